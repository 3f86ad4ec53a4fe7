"""`TTTTransformer`: chunked reading equals the plain model, updates are causal, the outer gradient goes
through the inner steps exactly (float64 finite differences), and the options do what they say."""

from dataclasses import replace
from functools import partial

import pytest
import torch
from reader_checks import assert_rows_read_as_if_alone, meta_loss

from ttt.inner import InnerLoopConfig
from ttt.layers import TTTConfig, TTTTransformer
from ttt.layers.reader import ChunkedReader
from ttt.models import Transformer, TransformerConfig
from ttt.models.rope import RopeScaling

EXTRA = ["layers.*.ttt_mlp.*"]


def make(*, window=5, n_layers=3, suffix_len=2, chunk_len=4, dtype=torch.float32, attention="eager", **inner):
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=32,
        d_model=16,
        n_layers=n_layers,
        n_heads=2,
        n_kv_heads=1,
        d_ff=24,
        window=window,
        attention=attention,
    )
    base = Transformer(cfg)
    inner = {"params": EXTRA, "lr": 0.5, **inner}
    model = TTTTransformer(
        base, TTTConfig(suffix_len=suffix_len, chunk_len=chunk_len), InnerLoopConfig(**inner)
    )
    with torch.no_grad():  # a non-zero extra MLP, as after meta-training
        for block in model.suffix:
            block.ttt_mlp.w_down.weight.normal_(std=0.3)
    return base, model.to(dtype)


def tokens(n=19, batch=2, seed=1):
    return torch.randint(0, 32, (batch, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("window, chunk_len", [(5, 4), (3, 7), (None, 4), (1, 3)], ids=str)
@pytest.mark.parametrize("attention", ["eager", "sdpa_math"])
def test_reading_without_updates_equals_the_sliding_window_model(window, chunk_len, attention):
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=32, d_model=16, n_layers=3, n_heads=2, d_ff=24, window=window, attention=attention
    )
    base = Transformer(cfg)
    x = tokens()
    expected = base(x)
    model = TTTTransformer(base, TTTConfig(suffix_len=2, chunk_len=chunk_len), InnerLoopConfig(params=EXTRA))
    torch.testing.assert_close(model(x, adapt=False), expected, rtol=1e-5, atol=1e-5)
    # the extra MLP starts at zero: a fresh TTT model computes exactly the base model even when adapting
    # its first chunk (only the first chunk is scored before any update)
    torch.testing.assert_close(model(x)[:, :chunk_len], expected[:, :chunk_len], rtol=1e-5, atol=1e-5)


def test_chunked_reading_applies_the_rope_scaling_of_the_model():
    """Llama 3.1-style scaled RoPE (a short original context, so that it acts within 19 tokens)."""
    torch.manual_seed(0)
    scaling = RopeScaling(factor=4.0, original_max_position_embeddings=8)
    cfg = TransformerConfig(vocab_size=32, d_model=16, n_layers=3, n_heads=2, d_ff=24, rope_scaling=scaling)
    base = Transformer(cfg)
    with torch.no_grad():  # sharp attention, so that positions matter
        for layer in base.layers:
            layer.attn.wq.weight.mul_(30)
            layer.attn.wk.weight.mul_(30)
    x = tokens()
    expected = base(x)
    model = TTTTransformer(base, TTTConfig(suffix_len=2, chunk_len=4), InnerLoopConfig(params=EXTRA))
    torch.testing.assert_close(model(x, adapt=False), expected, rtol=1e-5, atol=1e-5)
    base.cfg.rope_scaling = None
    assert (base(x) - expected).abs().max() > 1e-3, "the scaling changes the model"


def test_updates_change_later_chunks_only_and_stay_causal():
    _, model = make()
    x = tokens(n=19, batch=1)
    with_ttt, without = model.token_losses(x), model.token_losses(x, adapt=False)
    torch.testing.assert_close(with_ttt[:, :4], without[:, :4])
    assert (with_ttt[:, 4:] - without[:, 4:]).abs().min() > 0
    changed = x.clone()
    changed[0, 10] = (changed[0, 10] + 1) % 32
    after = model.token_losses(changed)
    torch.testing.assert_close(after[:, :9], with_ttt[:, :9], rtol=0, atol=0)  # position 9 predicts token 10
    assert not torch.equal(after[:, 9:], with_ttt[:, 9:])


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_each_sequence_of_a_batch_gets_its_own_fast_weights(optimizer):
    """Rows read side by side give each row's losses and outer gradient as if read alone, with two
    inner steps and a clip that binds (each row has its own gradient norm). In float64: Adam divides by
    tiny second moments, which would magnify float32 rounding."""
    _, model = make(
        steps=2, optimizer=optimizer, lr=0.05, grad_clip=0.05, learnable_lr="tensor", dtype=torch.float64
    )
    losses_tol, grads_tol = dict(rtol=1e-6, atol=1e-7), dict(rtol=1e-5, atol=1e-7)
    assert_rows_read_as_if_alone(model, tokens(batch=3), losses_tol, grads_tol)


@pytest.mark.parametrize("optimizer, lr", [("sgd", 0.5), ("momentum", 0.1)])
def test_outer_gradient_matches_finite_differences(optimizer, lr):
    """Directional derivative along the gradient (all parameters: fast and slow weights, learnable lrs)
    against central differences. The model normalises in float32 internally, so h = 1e-3 in float64;
    the first-order gradient misses by far more than the tolerance."""
    _, model = make(
        dtype=torch.float64, steps=2, optimizer=optimizer, lr=lr, learnable_lr="tensor", grad_clip=5.0
    )
    x = tokens(n=13, batch=1)
    params = list(model.parameters())
    grads = torch.autograd.grad(meta_loss(model, x), params)
    first_order = torch.autograd.grad(meta_loss(model, x, first_order=True), params)
    norm = torch.sqrt(sum(g.square().sum() for g in grads))
    direction = [g / norm for g in grads]
    h, values = 1e-3, []
    for shift in (h, -2 * h, h):
        with torch.no_grad():
            for param, d in zip(params, direction):
                param.add_(shift * d)
        values.append(meta_loss(model, x, outer_grad=False))
    finite_difference = (values[0] - values[1]) / (2 * h)
    torch.testing.assert_close(norm, finite_difference, rtol=5e-3, atol=0)
    first_order_slope = sum((g * d).sum() for g, d in zip(first_order, direction))
    assert abs(first_order_slope - finite_difference) > 0.1 * abs(finite_difference)


def test_first_order_drops_second_order_terms():
    _, model = make(steps=1)
    x = tokens(n=13, batch=1)
    name = "layers.2.ttt_mlp.w_gate.weight"
    second = torch.autograd.grad(meta_loss(model, x), model.get_parameter(name))[0]
    first = torch.autograd.grad(meta_loss(model, x, first_order=True), model.get_parameter(name))[0]
    assert not torch.allclose(first, second, rtol=1e-3, atol=1e-7)


def test_checkpointed_inner_steps_give_the_same_gradients():
    x = tokens(n=13, batch=1)
    grads = []
    for use_checkpoint in (False, True):
        _, model = make(steps=2, optimizer="momentum", checkpoint=use_checkpoint, learnable_lr="element")
        loss = meta_loss(model, x)
        grads.append(torch.autograd.grad(loss, list(model.parameters()), allow_unused=True))
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["kept", "recomputed"])
def test_the_chunk_that_ends_the_sequence_takes_no_inner_step(checkpoint):
    """Its steps would make weights no chunk reads: skipping them leaves the losses and the second-order
    gradients as they are (against the same read with its last chunk stepped), and saves their work."""
    _, model = make(dtype=torch.float64, steps=2, optimizer="momentum", checkpoint=checkpoint)
    x = tokens(n=12)  # 3 chunks of 4: the last has 3 targets to step on
    steps, step = [], model.inner.step
    model.inner.step = lambda *args, **kwargs: steps.append(1) or step(*args, **kwargs)
    params = list(model.parameters())

    losses = model.token_losses(x)
    grads = torch.autograd.grad(losses.sum(), params)
    passes = 2 if checkpoint else 1  # a recomputed chunk steps again in the outer backward
    assert len(steps) == 2 * 2 * passes, "2 chunks of 2 steps"

    options = model.read_options(adapt=None, steps=None, first_order=None, lr_scale=1.0, outer_grad=True,
                                 keep_logits=False)  # fmt: skip
    stepped_last = replace(model._positions(x, options), last=False)
    _, stepped_losses, _, _ = model.read_chunks(
        model.start_carry(2, options), model._initial_caches(12), stepped_last, options
    )
    stepped_grads = torch.autograd.grad(stepped_losses.sum(), params)
    assert len(steps) == (2 * 2 + 3 * 2) * passes, "the reference steps on its 3 chunks"
    torch.testing.assert_close(losses, stepped_losses, rtol=0, atol=0)
    for a, b in zip(grads, stepped_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("checkpoint", [False, True], ids=["kept", "recomputed"])
def test_a_read_without_logits_does_not_feed_the_last_position(checkpoint):
    """13 tokens in chunks of 4: the loss read feeds 12 positions, 3 whole chunks, the last taking no
    steps; the read that returns logits feeds all 13 (a fourth chunk of one position, with no target,
    after the third stepped for nothing). Same losses and second-order gradients."""
    _, model = make(dtype=torch.float64, steps=2, optimizer="momentum", checkpoint=checkpoint)
    x = tokens(n=13)
    fed, read_chunk = [], model._read_chunk
    model._read_chunk = lambda carry, chunk, *rest: fed.append(len(chunk)) or read_chunk(carry, chunk, *rest)
    steps, step = [], model.inner.step
    model.inner.step = lambda *args, **kwargs: steps.append(1) or step(*args, **kwargs)
    params = list(model.parameters())
    passes = 2 if checkpoint else 1  # a recomputed chunk is read, and steps, again in the outer backward

    losses = model.token_losses(x)
    grads = torch.autograd.grad(losses.sum(), params)
    assert fed == [4, 4, 4] * passes and len(steps) == 2 * 2 * passes
    fed.clear(), steps.clear()
    logits, every_losses = model.read(x, keep_logits=True)
    every_grads = torch.autograd.grad(every_losses.sum(), params)
    assert sorted(fed) == sorted([4, 4, 4, 1] * passes) and len(steps) == 3 * 2 * passes
    assert logits.shape == (2, 13, 32)
    torch.testing.assert_close(losses, every_losses, rtol=1e-12, atol=1e-12)
    for a, b in zip(grads, every_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    "params",
    [["layers.*.mlp.*"], ["layers.2.attn.*"], ["layers.*.ttt_mlp.*", "layers.1.attn.wq.weight"]],
    ids=["block_mlp", "attention", "extra_mlp+wq"],
)
def test_which_weights_are_fast_is_configurable(params):
    _, model = make(params=params)
    x = tokens(n=13, batch=1)
    assert not torch.allclose(model.token_losses(x)[:, 4:], model.token_losses(x, adapt=False)[:, 4:])
    loss = meta_loss(model, x)
    loss.backward()
    assert all(p.grad is not None for p in model.initial_fast_weights().values())


def test_evaluation_reading_is_detached_and_equal():
    _, model = make(steps=2)
    x = tokens(n=13, batch=1)
    with torch.no_grad(), torch.enable_grad():
        detached = model.token_losses(x, outer_grad=False)
    assert not detached.requires_grad
    torch.testing.assert_close(detached, model.token_losses(x).detach())
    with torch.no_grad(), pytest.raises(RuntimeError, match="grad mode"):
        model.token_losses(x)


def test_inner_lr_warmup_schedule():
    cfg = TTTConfig(lr_warmup_steps=10, lr_warmup_start=0.1)
    assert cfg.lr_scale(0) == pytest.approx(0.1) and cfg.lr_scale(5) == pytest.approx(0.55)
    assert cfg.lr_scale(10) == cfg.lr_scale(99) == 1.0
    _, model = make()
    x = tokens(n=13, batch=1)
    torch.testing.assert_close(model.token_losses(x, lr_scale=0.0), model.token_losses(x, adapt=False))


def test_bad_settings_fail_clearly():
    base, _ = make()
    with pytest.raises(
        ValueError, match=r"'layers\.0\.mlp\.w_up\.weight' matches no parameter of the suffix.*layers 1\.\.2"
    ):
        TTTTransformer(base, TTTConfig(suffix_len=2), InnerLoopConfig(params=["layers.0.mlp.w_up.weight"]))
    with pytest.raises(ValueError, match="ttt.suffix_len"):
        TTTTransformer(base, TTTConfig(suffix_len=9), InnerLoopConfig(params=EXTRA))
    with pytest.raises(ValueError, match="ttt.chunk_len"):
        TTTConfig(chunk_len=0)
    with pytest.raises(ValueError, match="checkpoint_segment_keeps_chunks=true needs ttt.checkpoint_segment"):
        TTTConfig(checkpoint_segment_keeps_chunks=True)
    with pytest.raises(TypeError, match="Transformer"):
        TTTTransformer(torch.nn.Linear(2, 2), TTTConfig(), InnerLoopConfig(params=EXTRA))


def test_flashbob_kernels_through_the_chunked_layer_match_eager(monkeypatch):
    """The Triton kernels (CUDA, or Triton's CPU interpreter in tests) on the suffix's rectangular,
    windowed, grouped-query attention, second order through two inner steps per chunk."""
    import importlib
    import os

    import flashbob

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs CUDA or TRITON_INTERPRET=1 (tests/conftest.py sets it without a GPU)")

    def triton_attention(q, k, v, *, backend, causal=True, window=None, scale=None):
        return flashbob.flash_attention(q, k, v, causal=causal, window=window, scale=scale, backend="triton")

    results = []
    for attention in ("eager", "triton"):
        torch.manual_seed(0)
        cfg = TransformerConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16,
                                window=7, attention="eager")  # fmt: skip
        inner = InnerLoopConfig(
            params=[*EXTRA, "layers.1.attn.wq.weight"], lr=0.5, steps=2, learnable_lr="tensor"
        )
        model = TTTTransformer(Transformer(cfg), TTTConfig(suffix_len=1, chunk_len=10), inner).to(device)
        with torch.no_grad():
            model.layers[1].ttt_mlp.w_down.weight.normal_(std=0.3)
        if attention == "triton":
            for module in ("ttt.layers.suffix_block", "ttt.models.transformer"):
                monkeypatch.setattr(importlib.import_module(module), "attention", triton_attention)
        x = torch.randint(0, 64, (1, 37), generator=torch.Generator().manual_seed(1)).to(device)
        loss = meta_loss(model, x)
        results.append((loss, torch.autograd.grad(loss, list(model.parameters()))))
    (eager_loss, eager_grads), (triton_loss, triton_grads) = results
    torch.testing.assert_close(triton_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(triton_grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("window, chunk_len", [(5, 4), (None, 4), (8, 7), (3, 19)], ids=str)
@pytest.mark.parametrize("fused_loss", [True, False], ids=["fused-loss", "logits"])
@pytest.mark.parametrize("checkpoint_prefix", [False, True], ids=["kept", "recomputed"])
def test_reading_without_adapting_at_once_equals_the_chunked_reading(
    window, chunk_len, fused_loss, checkpoint_prefix, monkeypatch
):
    """Without adapting, the suffix blocks read whole sequences (`TTTTransformer._read`) instead of chunk
    by chunk (`ChunkedReader._read`): the same losses, logits and gradients in float64 (windows shorter
    and longer than a chunk, full attention, one chunk for all), and the same evaluation read."""
    _, model = make(window=window, chunk_len=chunk_len, dtype=torch.float64)
    model.ttt_cfg = replace(model.ttt_cfg, fused_loss=fused_loss, checkpoint_prefix=checkpoint_prefix)
    x, params = tokens(), [p for p in model.parameters() if p.requires_grad]
    chunks_read = []
    read_chunk = model._read_chunk
    monkeypatch.setattr(model, "_read_chunk", lambda *args: chunks_read.append(1) or read_chunk(*args))
    results = []
    for read in (model._read, partial(ChunkedReader._read, model)):
        options = model.read_options(
            adapt=False, steps=None, first_order=None, lr_scale=1.0, outer_grad=True, keep_logits=False
        )
        logits, _ = read(x, replace(options, keep_logits=True))
        _, losses = read(x, options)
        grads = torch.autograd.grad(losses.square().sum(), params)
        with torch.no_grad():
            _, evaluated = read(x, replace(options, outer_grad=False))
        results.append((logits, losses, *grads, evaluated))
        assert bool(chunks_read) == (read != model._read)  # at once: no chunk read
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
