"""TTT-E2E's options of the test-time-training layers: the inner learning rate's warm-up, the prime MLP's
init, the masked inner loss and the objective averaged over chunks."""

import pytest
import torch

from ttt.inner import InnerLoopConfig
from ttt.layers import TTTConfig, TTTTransformer
from ttt.layers.objective import row_means, sequence_losses
from ttt.models import Transformer, TransformerConfig

MODEL = dict(vocab_size=30, d_model=16, n_layers=2, n_heads=2, d_ff=12, attention="eager")


@pytest.mark.parametrize(
    "counts_current, expected",
    [(True, [0.101875, 0.10375, 0.998125, 1.0, 1.0]), (False, [0.1, 0.101875, 0.9963, 0.998125, 1.0])],
)
def test_inner_lr_warm_up(counts_current, expected):
    cfg = TTTConfig(lr_warmup_steps=480, lr_warmup_counts_current_step=counts_current)
    got = [cfg.lr_scale(s) for s in (0, 1, 478, 479, 480)]
    assert got == pytest.approx(expected, abs=1e-4)
    assert TTTConfig(lr_warmup_steps=0).lr_scale(0) == 1.0


def test_objective_takes_masked_chunk_means_or_the_masked_token_mean():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0, 10.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False, True, True, False]])
    tokens = sequence_losses(losses, mask, average="tokens", chunk_len=2)
    chunks = sequence_losses(losses, mask, average="chunks", chunk_len=2)
    torch.testing.assert_close(tokens, torch.tensor([8.0 / 3], dtype=torch.float64))
    torch.testing.assert_close(
        chunks, torch.tensor([(1.0 + 3.5 + 0.0) / 3], dtype=torch.float64)
    )  # empty chunk: 0
    plain = sequence_losses(losses, None, average="tokens", chunk_len=2)
    assert torch.equal(plain, losses.mean(1))  # no mask: the mean itself, as before
    assert row_means(losses[:, 4:], mask[:, 4:]).item() == 0.0


@pytest.mark.parametrize("init", ["normal", "zero_out"])
def test_prime_mlp_init(init):
    torch.manual_seed(0)
    ttt = TTTConfig(extra_mlp_init=init, extra_mlp_hidden=64)
    cfg = TransformerConfig(**MODEL, init_std=0.05)
    model = TTTTransformer(Transformer(cfg), ttt, InnerLoopConfig(params=["layers.*.ttt_mlp.*"]))
    down = model.layers[1].ttt_mlp.w_down.weight
    gate = model.layers[1].ttt_mlp.w_gate.weight
    assert gate.std().item() == pytest.approx(0.05, rel=0.15)
    if init == "zero_out":
        assert torch.equal(down, torch.zeros_like(down))
    else:
        assert down.std().item() == pytest.approx(0.05, rel=0.15)
    with pytest.raises(ValueError, match="ttt.extra_mlp_init"):
        TTTConfig(extra_mlp_init="xavier")


def test_masked_targets_change_only_what_the_inner_steps_count():
    """A masked target's loss is still reported; the inner step ignores it (so later chunks differ), and
    masking nothing equals no mask at all."""
    torch.manual_seed(0)
    cfg = TransformerConfig(**MODEL, post_norm=True, qk_norm=True)
    ttt = TTTConfig(chunk_len=4, extra_mlp_init="normal")
    model = TTTTransformer(
        Transformer(cfg), ttt, InnerLoopConfig(params=["layers.*.ttt_mlp.*"], lr=1.0)
    ).double()
    tokens = torch.randint(0, 30, (2, 13))
    every = torch.ones(2, 12, dtype=torch.bool)
    some = every.clone()
    some[:, 1:3] = False
    plain = model.token_losses(tokens)
    torch.testing.assert_close(model.token_losses(tokens, loss_mask=every), plain, rtol=0, atol=0)
    masked = model.token_losses(tokens, loss_mask=some)
    torch.testing.assert_close(masked[:, :4], plain[:, :4], rtol=0, atol=0)  # the first chunk: scored first
    assert not torch.allclose(masked[:, 4:], plain[:, 4:])
    with pytest.raises(ValueError, match="loss_mask must be"):
        model.token_losses(tokens, loss_mask=every[:, :5])
