"""`ttt.models.from_pretrained`: Hugging Face-format checkpoints built on the fly (no download).

Without transformers: hand-written config.json + safetensors load, names and shapes are checked and
bad inputs fail clearly. With transformers (the GPU machine): our logits equal transformers' own on
the same random weights, for every supported architecture.
"""

import importlib.util
import json

import pytest
import torch
from hf_checkpoints import LLAMA_JSON, hf_llama_tensors, write_checkpoint
from safetensors.torch import save_file

from ttt.models import Transformer, TransformerConfig, from_pretrained

HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
TOKENS = torch.tensor([[1, 5, 9, 3, 60, 7, 2, 11, 40, 13, 0, 63], [4, 4, 8, 15, 16, 23, 42, 1, 2, 3, 5, 8]])


@pytest.fixture
def llama_reference(tmp_path):
    """A random tiny Transformer and its checkpoint directory in Hugging Face Llama format."""
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=48,
        rope_theta=500.0,
        attention="eager",
    )
    model = Transformer(cfg)
    return model, write_checkpoint(tmp_path / "llama", LLAMA_JSON, hf_llama_tensors(model))


def test_hand_built_llama_checkpoint_loads_with_the_same_logits(llama_reference):
    reference, path = llama_reference
    model = from_pretrained(path, attention="eager")
    assert isinstance(model, Transformer) and model.cfg.n_kv_heads == 2 and model.cfg.rope_theta == 500.0
    assert model.cfg.norm_eps == 1e-5 and model.cfg.d_ff == 48
    torch.testing.assert_close(model(TOKENS), reference(TOKENS), rtol=0, atol=0)


def test_default_attention_is_flashbob_and_overrides_apply(llama_reference):
    _, path = llama_reference
    assert from_pretrained(path).cfg.attention == "flashbob"
    model = from_pretrained(path, window=4, dtype=torch.float64)
    assert model.cfg.window == 4 and model.embed.weight.dtype == torch.float64
    with pytest.raises(ValueError, match="unknown model overrides.*'windw'.*window"):
        from_pretrained(path, windw=4)


def test_sharded_checkpoint_loads(llama_reference, tmp_path):
    reference, path = llama_reference
    tensors = hf_llama_tensors(reference)
    names = sorted(tensors)
    shards = {"a.safetensors": names[: len(names) // 2], "b.safetensors": names[len(names) // 2 :]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text(json.dumps(LLAMA_JSON))
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(sharded / shard))
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    torch.testing.assert_close(from_pretrained(sharded, attention="eager")(TOKENS), reference(TOKENS))


def test_bad_checkpoints_fail_with_clear_messages(llama_reference, tmp_path):
    reference, path = llama_reference
    with pytest.raises(FileNotFoundError, match="expected a checkpoint directory"):
        from_pretrained(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        from_pretrained(tmp_path / "empty")
    bert = write_checkpoint(tmp_path / "bert", {"architectures": ["BertModel"]}, {"x": torch.zeros(1)})
    with pytest.raises(
        ValueError, match="unsupported architectures.*BertModel.*LlamaForCausalLM.*Qwen2ForCausalLM"
    ):
        from_pretrained(bert)

    tensors = hf_llama_tensors(reference)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(47, 32)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.w_up\.weight.*\(47, 32\).*\(48, 32\)"):
        from_pretrained(write_checkpoint(tmp_path / "shape", LLAMA_JSON, tensors))
    tensors = hf_llama_tensors(reference)
    del tensors["model.norm.weight"]
    with pytest.raises(ValueError, match=r"missing \['norm.weight'\]"):
        from_pretrained(write_checkpoint(tmp_path / "missing", LLAMA_JSON, tensors))
    tensors = hf_llama_tensors(reference)
    tensors["model.layers.0.mystery.weight"] = torch.zeros(2)
    with pytest.raises(ValueError, match="mystery"):
        from_pretrained(write_checkpoint(tmp_path / "unknown", LLAMA_JSON, tensors))
    scaled = {**LLAMA_JSON, "rope_scaling": {"rope_type": "dynamic", "factor": 8.0}}
    with pytest.raises(ValueError, match="rope scaling 'dynamic' is not supported"):
        from_pretrained(write_checkpoint(tmp_path / "scaled", scaled, hf_llama_tensors(reference)))
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 0.7}
    with pytest.raises(ValueError, match="'yarn' with mscale=0.7 is not supported"):
        from_pretrained(
            write_checkpoint(
                tmp_path / "mscale", {**LLAMA_JSON, "rope_scaling": yarn}, hf_llama_tensors(reference)
            )
        )
    scaled = {**LLAMA_JSON, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(ValueError, match=r"'llama3' is missing \['low_freq_factor'"):
        from_pretrained(write_checkpoint(tmp_path / "scaled3", scaled, hf_llama_tensors(reference)))
    for bad, match in (("eight", "factor='eight' is not a number"), (-4.0, "factor and .original_max")):
        scaled = {**LLAMA_JSON, "rope_scaling": {**yarn, "mscale": None, "factor": bad}}
        with pytest.raises(ValueError, match=match):
            from_pretrained(write_checkpoint(tmp_path / "badyarn", scaled, hf_llama_tensors(reference)))
    incomplete = {key: value for key, value in LLAMA_JSON.items() if key != "intermediate_size"}
    with pytest.raises(ValueError, match="LlamaForCausalLM: missing key 'intermediate_size'"):
        from_pretrained(write_checkpoint(tmp_path / "incomplete", incomplete, hf_llama_tensors(reference)))
    (tmp_path / "noweights").mkdir()
    (tmp_path / "noweights" / "config.json").write_text(json.dumps(LLAMA_JSON))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        from_pretrained(tmp_path / "noweights")


def _save_hf_model(hf_model, path):
    hf_model.save_pretrained(path, safe_serialization=True)
    return path


LLAMA3_ROPE = {
    "rope_theta": 100.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 16},
}  # fmt: skip
YARN_ROPE = {
    "rope_theta": 100.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                     "beta_fast": 4.0, "beta_slow": 1.0},
}  # fmt: skip


def _hf_models():
    import transformers as tf

    shape = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads")  # fmt: skip
    common = {**{key: LLAMA_JSON[key] for key in shape}, "max_position_embeddings": 64}
    return {
        "llama": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common, rope_theta=1000.0, rms_norm_eps=1e-5)),
        "smollm2-tied": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common, tie_word_embeddings=True)),
        # Llama 3.2's rope scaling, its context shrunk so that every frequency band occurs at head_dim 8:
        # wavelengths 6.3 (blended), 20 (divided by the factor: above 16 / 1), 63 and 200 (divided)
        "llama3.2-rope": lambda: tf.LlamaForCausalLM(tf.LlamaConfig(**common, **LLAMA3_ROPE)),
        "qwen2": lambda: tf.Qwen2ForCausalLM(
            tf.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=True)
        ),
        # Qwen2.5's YaRN for long context, its context shrunk so that all of it acts at head_dim 8: in
        # 32 positions at theta 100 the 4 rotary pairs turn 5.1, 1.6, 0.5 and 0.16 times, so pair 0 is
        # kept, pair 1 half scaled and pairs 2-3 fully; cos and sin are multiplied by 0.1 ln 4 + 1
        "qwen2.5-yarn": lambda: tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, **YARN_ROPE)),
    }


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
@pytest.mark.parametrize("family", ["llama", "smollm2-tied", "llama3.2-rope", "qwen2", "qwen2.5-yarn"])
def test_logits_match_transformers(family, tmp_path):
    torch.manual_seed(0)
    hf_model = _hf_models()[family]().float().eval()
    with torch.no_grad():
        for param in hf_model.parameters():  # random biases and norm weights too, not just their init
            param.add_(torch.randn_like(param) * 0.05)
    path = _save_hf_model(hf_model, tmp_path / family)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours = from_pretrained(path).to(device)
    with torch.no_grad():
        expected = hf_model.to(device)(TOKENS.to(device)).logits
        got = ours(TOKENS.to(device))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    if family in ("llama3.2-rope", "qwen2.5-yarn"):  # the scaling is what makes them match
        with torch.no_grad():
            unscaled = from_pretrained(path, rope_scaling=None).to(device)(TOKENS.to(device))
        assert (unscaled - expected).abs().max() > 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(
    not (HAS_TRANSFORMERS and torch.cuda.is_available()), reason="needs transformers and CUDA"
)
def test_logits_match_transformers_at_smollm2_135m_size(tmp_path):
    """A random model of SmolLM2-135M's shape (30 layers, GQA 9/3, tied), 1024 tokens, FlashBoB on CUDA."""
    import transformers as tf

    torch.manual_seed(0)
    shape = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
             "num_attention_heads": 9, "num_key_value_heads": 3, "tie_word_embeddings": True}  # fmt: skip
    config = tf.LlamaConfig(**shape, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192)
    hf_model = tf.LlamaForCausalLM(config).float().eval()
    path = _save_hf_model(hf_model, tmp_path / "smollm2")
    tokens = torch.randint(0, 49152, (2, 1024), device="cuda")
    ours = from_pretrained(path).cuda()
    with torch.no_grad():
        expected = hf_model.cuda()(tokens).logits
        got = ours(tokens)
    print(f"max |logits - transformers| = {(got - expected).abs().max().item():.3e}")
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
