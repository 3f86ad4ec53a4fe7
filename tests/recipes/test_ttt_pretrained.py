"""The ttt_pretrained recipe: a checkpoint (tiny, written on the fly) becomes a TTT model that starts
as the checkpoint, meta-fine-tunes at toy size, and mismatched checkpoints fail clearly. The presets
describe the checkpoints they name."""

import json

import pytest
import torch
from hf_checkpoints import LLAMA_JSON, hf_llama_tensors, write_checkpoint
from tiny_configs import TINY_TEXT_DATA, TINY_TRAINER, write_tiny_corpus

from recipes import load_config
from recipes.ttt_pretrained import load_base_model
from ttt.layers import TTTTransformer
from ttt.models import Transformer, TransformerConfig, from_pretrained
from ttt.train import main

ARCH = {"vocab_size": 256, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 48,
        "rope_theta": 500.0, "norm_eps": 1e-5, "tie_embeddings": False, "qkv_bias": False}  # fmt: skip
PRESET_PARAMETERS = {"smollm2_135m": 134.5e6, "smollm2_360m": 361.8e6, "qwen2_5_0_5b": 494.0e6}
"""Published parameter counts of the checkpoints the presets name."""


@pytest.fixture
def checkpoint(tmp_path):
    torch.manual_seed(0)
    model = Transformer(TransformerConfig(**ARCH))
    return write_checkpoint(tmp_path / "ckpt", {**LLAMA_JSON, "vocab_size": 256}, hf_llama_tensors(model))


@pytest.fixture
def tiny_overrides(checkpoint, tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    arch = [f"model.architecture.{key}={value}" for key, value in ARCH.items()]
    return [
        "recipe=pretrained/smollm2_135m",
        f"model.checkpoint={checkpoint}",
        *arch,
        "model.architecture.window=8",
        "ttt.suffix_len=1",
        "ttt.chunk_len=16",
        f"data.corpus={corpus}",
        "data.tokenizer=bytes",
        *TINY_TEXT_DATA,
        *TINY_TRAINER,
        f"run.root={tmp_path / 'runs'}",
    ]


def test_converted_model_starts_as_the_checkpoint_with_a_window(tiny_overrides, checkpoint):
    cfg = load_config(tiny_overrides)
    model = TTTTransformer(load_base_model(cfg.model), cfg.ttt, cfg.inner)
    reference = from_pretrained(checkpoint, window=8)
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    expected = reference(tokens)
    torch.testing.assert_close(model(tokens, adapt=False), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(tokens)[:, :16], expected[:, :16], rtol=1e-5, atol=1e-5)


def test_tiny_meta_fine_tuning_run(tiny_overrides, tmp_path):
    assert main([*tiny_overrides, "run.name=ft"]) == 0
    run = tmp_path / "runs" / "ft"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outer_steps"] == 2 and {"late_loss_adapted", "late_loss_unadapted"} <= set(summary)
    assert (run / "loss_by_position.png").is_file() and (run / "passkey.csv").is_file()


def test_checkpoint_of_another_architecture_fails_naming_the_field(tiny_overrides):
    cfg = load_config([*tiny_overrides, "model.architecture.d_ff=64"])
    with pytest.raises(ValueError, match="d_ff: checkpoint 48, preset 64"):
        load_base_model(cfg.model)


@pytest.mark.parametrize("preset", sorted(PRESET_PARAMETERS))
def test_presets_have_the_size_of_their_checkpoints(preset):
    cfg = load_config([f"recipe=pretrained/{preset}"])
    with torch.device("meta"):
        model = Transformer(cfg.model.architecture)
    count = sum(p.numel() for p in model.parameters())
    assert count == pytest.approx(PRESET_PARAMETERS[preset], rel=0.01)
    assert cfg.model.architecture.window and cfg.data.seq_len >= 16384
    assert cfg.ttt.suffix_len == pytest.approx(cfg.model.architecture.n_layers / 4, abs=0.6)
