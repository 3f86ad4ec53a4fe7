"""The ttt framework on transformers models: HFCausalLM keeps transformers' parameter names for
functional_call, ContextLearner's second-order meta-gradients with "bob" equal "eager", and the
maml_longctx recipe trains a transformers checkpoint from a local directory."""

import json

import pytest
import torch
from tiny_configs import TINY_KV_TASK, TINY_TRAINER
from tiny_models import VOCAB, tiny_config, tiny_model

from recipes.maml_longctx import Config
from ttt.config.schema import OuterOptimConfig
from ttt.inner import InnerLoopConfig, functional_forward, meta_step, select_parameters
from ttt.learners import ContextChunksConfig, ContextLearner
from ttt.models.hf_causal_lm import HFCausalLM, TransformersModelConfig, build_causal_lm, load_causal_lm
from ttt.train import main


def test_parameter_names_are_transformers_names_and_functional_call_substitutes_them():
    hf = tiny_model("llama", "bob")
    model = HFCausalLM(hf)
    assert [n for n, _ in model.named_parameters()] == [n for n, _ in hf.named_parameters()]
    ids = torch.randint(0, VOCAB, (1, 11))
    torch.testing.assert_close(model(ids), hf(ids).logits)
    name = "model.layers.1.mlp.down_proj.weight"
    assert list(select_parameters(model, ["model.layers.1.mlp.*"])) == [
        f"model.layers.1.mlp.{p}_proj.weight" for p in ("gate", "up", "down")
    ]
    zeroed = functional_forward(model, {name: torch.zeros_like(dict(model.named_parameters())[name])}, ids)
    with torch.no_grad():
        hf.get_parameter(name).zero_()
    torch.testing.assert_close(zeroed, hf(ids).logits)


def test_gpt2_names_and_window_of_the_shape():
    model = build_causal_lm(tiny_config("gpt2"))
    assert "transformer.h.1.mlp.c_fc.weight" in dict(model.named_parameters())
    assert model.cfg.window is None and model.cfg.n_layers == 2
    assert build_causal_lm(tiny_config("mistral")).cfg.window == 5
    assert build_causal_lm(tiny_config("qwen2")).cfg.window is None  # layer 0 attends fully


def test_load_causal_lm_reads_a_local_checkpoint(tmp_path):
    hf = tiny_model("qwen2", "eager")
    hf.save_pretrained(tmp_path / "ckpt")
    model = load_causal_lm(TransformersModelConfig(checkpoint=str(tmp_path / "ckpt")))
    assert model.hf_model.config._attn_implementation == "bob"
    ids = torch.randint(0, VOCAB, (2, 13))
    torch.testing.assert_close(model(ids), hf(ids).logits, rtol=1e-5, atol=1e-5)


def test_load_causal_lm_refuses_a_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="transformers.checkpoint must be a local directory"):
        load_causal_lm(TransformersModelConfig(checkpoint=str(tmp_path)))


def test_sdpa_is_refused_for_second_order_training():
    with pytest.raises(ValueError, match="sdpa"):
        TransformersModelConfig(checkpoint="x", attn_implementation="sdpa")


def _learner(attn, arch="mistral"):
    hf = tiny_model(arch, attn, dtype=torch.float64, sliding_window=4)
    inner = InnerLoopConfig(params=["model.layers.1.mlp.*"], steps=2, lr=0.5)
    chunks = ContextChunksConfig(tokens_per_step=6)
    return ContextLearner(HFCausalLM(hf), inner, OuterOptimConfig(), 10, context_len=16, chunks=chunks)


@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_context_learner_meta_gradients_bob_equal_eager_float64(arch, monkeypatch):
    """Eager's softmax(dtype=float32) would round float64; keep it in float64 for the reference."""
    softmax = torch.nn.functional.softmax

    def softmax_keeping_float64(x, dim=None, *args, dtype=None, **kwargs):
        return softmax(x, dim, *args, dtype=None if x.dtype == torch.float64 else dtype, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "softmax", softmax_keeping_float64)
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (20,), generator=gen)
    query_mask = torch.zeros(20, dtype=torch.bool)
    query_mask[16:19] = True
    grads = []
    for attn in ("eager", "bob"):
        learner = _learner(attn, arch)
        meta_step(
            learner,
            learner.inner_loop,
            learner.initial_params(),
            [{"tokens": tokens, "query_mask": query_mask}],
        )
        grads.append({n: p.grad for n, p in learner.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys() and any("self_attn" in n for n in grads[0])
    for name, g in grads[0].items():
        torch.testing.assert_close(grads[1][name], g, rtol=1e-9, atol=1e-12, msg=name)


TINY_TASK = [*TINY_KV_TASK, "inner.params=[model.layers.1.mlp.*]"]


def _mistral_checkpoint(path, window=8, vocab=32):
    hf = tiny_model("mistral", "eager", sliding_window=window, vocab_size=vocab)
    hf.save_pretrained(path)
    return path


def test_maml_longctx_trains_a_transformers_checkpoint(tmp_path):
    ckpt = _mistral_checkpoint(tmp_path / "mistral")
    overrides = [
        "recipe=maml_longctx", f"transformers.checkpoint={ckpt}", *TINY_TASK, *TINY_TRAINER,
        f"run.root={tmp_path}", "run.name=hf",
    ]  # fmt: skip
    assert main(overrides) == 0
    summary = json.loads((tmp_path / "hf" / "summary.json").read_text())
    assert summary["outer_steps"] == 2
    assert summary["query_loss_adapted"] != summary["query_loss_unadapted"]


def test_maml_longctx_refuses_a_checkpoint_with_full_attention(tmp_path):
    tiny_model("llama", "eager", vocab_size=32).save_pretrained(tmp_path / "llama")
    from recipes.maml_longctx import build

    cfg = Config(transformers=TransformersModelConfig(checkpoint=str(tmp_path / "llama")))
    with pytest.raises(ValueError, match="sliding window"):
        build(cfg)
