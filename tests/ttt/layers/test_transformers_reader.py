"""TTT-E2E on transformers models themselves (`TransformersTTTReader`): chunked reading equals the plain
model without adaptation, apply-then-update, rows independent, the outer gradient exact (float64
finite differences) and second order, and recipe=ttt_pretrained with transformers.checkpoint=DIR."""

import json

import pytest
import torch
from tiny_configs import TINY_TEXT_DATA, TINY_TRAINER, write_tiny_corpus
from tiny_models import VOCAB, tiny_model

from ttt.inner import InnerLoopConfig
from ttt.layers import TransformersTTTReader, TTTConfig
from ttt.models.hf_causal_lm import HFCausalLM
from ttt.train import main

FAST = ["model.layers.1.mlp.*"]
FAST_BY_ARCH = {"gpt2": ["transformer.h.1.mlp.*"]}


def _reader(arch, chunk_len=6, steps=1, first_order=False, dtype=torch.float64):
    torch.manual_seed(0)
    lm = HFCausalLM(tiny_model(arch, "bob").to(dtype))
    ttt = TTTConfig(extra_mlp=False, chunk_len=chunk_len)
    fast = FAST_BY_ARCH.get(arch, FAST)
    inner_cfg = InnerLoopConfig(params=fast, lr=0.5, steps=steps, first_order=first_order)
    return TransformersTTTReader(lm, ttt, inner_cfg)


def _tokens(batch=2, n=20, seed=1):
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["mistral", "llama", "gpt2"])
def test_reading_without_adaptation_equals_the_plain_model(arch):
    reader, tokens = _reader(arch), _tokens()
    logits, losses = reader.read(tokens, adapt=False, keep_logits=True)
    plain = reader.lm(tokens)
    # RoPE tables are float32 at absolute positions: a chunk read from a later offset rounds differently
    tol = dict(rtol=1e-6, atol=1e-7) if arch == "mistral" else dict(rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(logits, plain, **tol)
    expected = torch.nn.functional.cross_entropy(
        plain[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="none"
    )
    torch.testing.assert_close(losses, expected.view(2, -1), **tol)
    assert reader.left_context(12) == (8 if arch == "mistral" else 12)  # 2 layers of window 5: 8 tokens


def test_each_chunk_is_scored_before_its_update_and_rows_are_independent():
    reader, tokens = _reader("mistral"), _tokens()
    plain = reader.read(tokens, adapt=False)[1]
    adapted = reader.read(tokens)[1]
    torch.testing.assert_close(adapted[:, :6], plain[:, :6])  # the first chunk: initial weights
    assert not torch.allclose(adapted[:, 6:], plain[:, 6:])
    alone = torch.cat([reader.read(tokens[i : i + 1])[1] for i in range(2)])
    torch.testing.assert_close(adapted, alone, rtol=1e-12, atol=1e-12)


def test_outer_gradient_matches_finite_differences_and_differs_from_first_order():
    # GPT-2: its layer norms compute in the input's dtype (Llama-style RMSNorms round to float32)
    reader, tokens = _reader("gpt2", steps=2), _tokens(batch=1)
    weight = reader.lm.get_parameter("transformer.h.0.mlp.c_fc.weight")
    fast = reader.lm.get_parameter("transformer.h.1.mlp.c_proj.weight")
    (g_weight, g_fast) = torch.autograd.grad(reader.token_losses(tokens).mean(), (weight, fast))
    direction = torch.randn_like(weight, generator=torch.Generator().manual_seed(2))

    def loss_at(eps):
        with torch.no_grad():
            weight.add_(eps * direction)
        value = reader.token_losses(tokens).mean().detach()
        with torch.no_grad():
            weight.sub_(eps * direction)
        return value

    eps = 1e-5
    numeric = (loss_at(eps) - loss_at(-eps)) / (2 * eps)
    torch.testing.assert_close((g_weight * direction).sum(), numeric, rtol=1e-6, atol=1e-9)
    first = _reader("gpt2", steps=2, first_order=True)
    fo_fast = first.lm.get_parameter("transformer.h.1.mlp.c_proj.weight")
    (g_first,) = torch.autograd.grad(first.token_losses(tokens).mean(), (fo_fast,))
    assert not torch.allclose(g_first, g_fast, rtol=1e-4, atol=1e-8), "second order must change the gradient"


def test_settings_the_reader_cannot_honour_are_refused():
    lm = HFCausalLM(tiny_model("mistral", "bob"))
    with pytest.raises(ValueError, match="ttt.extra_mlp=true needs the converted model"):
        TransformersTTTReader(lm, TTTConfig(), InnerLoopConfig(params=FAST))
    with pytest.raises(ValueError, match="parameter of the transformers model"):
        TransformersTTTReader(lm, TTTConfig(extra_mlp=False), InnerLoopConfig(params=["layers.*.ttt_mlp.*"]))


def _recipe(tmp_path, *extra):
    checkpoint = tmp_path / "mistral"
    tiny_model("mistral", "eager", vocab_size=256).save_pretrained(checkpoint)
    corpus = write_tiny_corpus(tmp_path / "corpus")
    return [
        "recipe=ttt_pretrained_toy",
        f"transformers.checkpoint={checkpoint}",
        "model.random_weights=false",
        "ttt.extra_mlp=false",
        "ttt.chunk_len=16",
        f"inner.params={FAST}".replace("'", ""),
        f"data.corpus={corpus}",
        "data.tokenizer=bytes",
        *TINY_TEXT_DATA,
        *TINY_TRAINER,
        f"run.root={tmp_path / 'runs'}",
        *extra,
    ]


@pytest.mark.slow
def test_ttt_pretrained_trains_a_transformers_checkpoint_itself(tmp_path):
    assert main(_recipe(tmp_path, "run.name=hf")) == 0
    summary = json.loads((tmp_path / "runs" / "hf" / "summary.json").read_text())
    assert summary["outer_steps"] == 2
    assert summary["late_loss_adapted"] != summary["late_loss_unadapted"]
    assert (tmp_path / "runs" / "hf" / "loss_by_position.png").is_file()


def test_both_checkpoints_at_once_are_refused(tmp_path, capsys):
    assert main(_recipe(tmp_path, f"model.checkpoint={tmp_path}")) == 2
    assert "not both" in capsys.readouterr().err
