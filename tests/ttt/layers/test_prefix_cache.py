"""`PrefixCache` against torch.cat of the chunks: the same values, first and second derivatives (float64,
odd sizes), one shared buffer when reserved, a second continuation that leaves the first intact, a
recomputed continuation replayed in place, the Triton chain (interpreter, float32) on its strided views,
and TTT-E2E's suffix reading with it (`SuffixBlock.shares_prefix`) against the concatenation."""

import pytest
import torch
from test_e2e_reference import TINY, sample_batch

import flashbob
from recipes import load_config
from recipes.ttt_e2e import build_module
from ttt.inner.recompute import recomputed
from ttt.layers import prefix_cache
from ttt.layers.prefix_cache import PrefixCache
from ttt.layers.suffix_block import SuffixBlock
from ttt.models.transformer import Block, TransformerConfig

CHUNKS = (5, 3, 7, 1, 6)  # B 2, Hkv 3, D 5


def chunk_inputs(dtype=torch.float64, chunks=CHUNKS, heads=3, dim=5):
    torch.manual_seed(0)
    return [torch.randn(2, heads, c, dim, dtype=dtype, requires_grad=True) for c in chunks]


def per_chunk_objective(leaves, read):
    """Sum over chunks of a nonlinear function of every key and value so far: read(cache, k, v) gives
    the (keys, values) of all positions after a chunk's k, v."""
    cache, total = None, 0
    for x in leaves:
        cache, (keys, values) = read(cache, x.sin(), 2 * x)
        total = total + (keys.square() * values).sum() + values.exp().sum()
    return total


def with_prefix_cache(reserved):
    def read(cache, k, v):
        cache = (PrefixCache.reserve(reserved) if cache is None else cache).extend(k, v)
        return cache, (cache.keys, cache.values)

    return read


def with_cat(cache, k, v):
    if cache is not None:
        k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
    return (k, v), (k, v)


def derivatives(read, leaves):
    """(objective, its gradient, and the gradient of |gradient|^2: a Hessian-vector product)."""
    value = per_chunk_objective(leaves, read)
    grads = torch.autograd.grad(value, leaves, create_graph=True)
    hvp = torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)
    return value, grads, hvp


@pytest.mark.parametrize("reserved", [sum(CHUNKS), 0, 4], ids=["reserved", "growing", "small-reserve"])
def test_values_and_two_orders_of_derivatives_equal_those_of_concatenation(reserved):
    leaves = chunk_inputs()
    value, grads, hvp = derivatives(with_prefix_cache(reserved), leaves)
    expected_value, expected_grads, expected_hvp = derivatives(with_cat, leaves)
    assert torch.equal(value, expected_value)
    for got, expected in zip((*grads, *hvp), (*expected_grads, *expected_hvp)):
        assert torch.equal(got, expected)


def test_a_reserved_cache_keeps_every_chunk_in_one_buffer():
    cache = PrefixCache.reserve(sum(CHUNKS))
    views = []
    for x in chunk_inputs():
        cache = cache.extend(x, x)
        views.append(cache.keys)
    storages = {v.untyped_storage().data_ptr() for v in views}
    assert len(storages) == 1 and cache.positions == sum(CHUNKS)
    assert views[-1].untyped_storage().nbytes() == views[-1].numel() * views[-1].element_size()


def test_a_second_continuation_copies_and_leaves_the_first_intact():
    a, b, c = chunk_inputs(chunks=(4, 3, 2))
    start = PrefixCache.reserve(9).extend(a, a)
    first = start.extend(b, b)
    second = start.extend(c, 3 * c)  # a second continuation of start: new buffers
    assert torch.equal(first.keys, torch.cat([a, b], 2)) and torch.equal(first.values, torch.cat([a, b], 2))
    assert torch.equal(second.values, torch.cat([a, 3 * c], 2))
    assert second.keys.untyped_storage().data_ptr() != first.keys.untyped_storage().data_ptr()
    assert second.keys.untyped_storage().nbytes() == second.keys.numel() * second.keys.element_size()
    third = first.extend(c, c)  # first is still its buffers' latest continuation: in place
    assert third.keys.untyped_storage().data_ptr() == first.keys.untyped_storage().data_ptr()
    (first.keys.sum() + 2 * second.values.sum() + third.keys.square().sum()).backward()
    torch.testing.assert_close(a.grad, 1 + 2 + 2 * a.detach())
    torch.testing.assert_close(c.grad, 6 + 2 * c.detach())


def test_a_second_first_chunk_copies_at_its_own_size():
    a, b = chunk_inputs(chunks=(4, 3))
    empty = PrefixCache.reserve(9)
    first, second = empty.extend(a, a), empty.extend(b, b)
    assert first.keys.untyped_storage().nbytes() == 2 * 3 * 9 * 5 * 8  # B, Hkv, the 9 rows, D; float64
    assert second.keys.untyped_storage().nbytes() == b.numel() * 8
    assert torch.equal(first.keys, a) and torch.equal(second.keys, b)


def test_detached_cache_extends_in_place_without_a_graph():
    a, b = chunk_inputs(chunks=(4, 3))
    cache = PrefixCache.reserve(7).extend(a, a).detach()
    assert not cache.keys.requires_grad
    extended = cache.extend(b.detach(), b.detach())
    assert extended.keys.untyped_storage().data_ptr() == cache.keys.untyped_storage().data_ptr()
    assert torch.equal(extended.keys, torch.cat([a, b], 2).detach())


def test_the_triton_chain_reads_the_views_like_the_concatenation(monkeypatch):
    """float32 in the interpreter: forward, gradient and Hessian-vector product of causal attention of
    each chunk's queries over the cache, the keys a view of a longer buffer."""
    from flashbob import triton_ops

    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)
    chunks, heads, dim = (7, 9), 2, 16
    keys = chunk_inputs(torch.float32, chunks, heads, dim)
    queries = chunk_inputs(torch.float32, chunks, heads, dim)

    def attention_objective(read):
        cache, total = None, 0
        for q, k in zip(queries, keys):
            cache, (all_keys, all_values) = read(cache, k, k.cos())
            out = flashbob.flash_attention(q, all_keys, all_values, causal=True, backend="triton")
            total = total + (out * out.detach().sin()).sum()
        return total

    results = []
    for read in (with_prefix_cache(30), with_cat):
        value = attention_objective(read)
        grads = torch.autograd.grad(value, [*queries, *keys], create_graph=True)
        hvp = torch.autograd.grad(sum(g.square().sum() for g in grads), [*queries, *keys])
        results.append((value, *grads, *hvp))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)


def count_new_buffers(monkeypatch):
    """A list that grows by one for each `_Rows` (a pair of key and value buffers) made from now on."""
    made, original = [], prefix_cache._Rows.__init__

    def counted(self, *args, **kwargs):
        made.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(prefix_cache._Rows, "__init__", counted)
    return made


def test_a_recomputed_continuation_writes_its_rows_of_the_same_buffer_again(monkeypatch):
    """Chunks read through `ttt.inner.recompute.recomputed`: the recomputation in the backward replays
    each in-place continuation in place (no buffer made, the attention-like objective sees views of the
    forward's buffer), with the value, gradient and Hessian-vector product of the concatenation."""
    leaves = chunk_inputs()
    made = count_new_buffers(monkeypatch)
    seen = []

    def chunk_read(read):
        def step(cache, x):
            cache, (keys, values) = read(cache, x.sin(), 2 * x)
            seen.append(keys.untyped_storage().data_ptr())
            return cache, (keys.square() * values).sum() + values.exp().sum()

        return step

    def objective(read, checkpointed):
        cache, total = (PrefixCache.reserve(sum(CHUNKS)) if checkpointed else None), 0
        for x in leaves:
            if checkpointed:
                cache, value = recomputed(chunk_read(read), cache, x, module=None)
            else:
                cache, value = chunk_read(read)(cache, x)
            total = total + value
        return total

    results = []
    for read, checkpointed in ((with_prefix_cache(0), True), (with_cat, False)):
        value = objective(read, checkpointed)
        grads = torch.autograd.grad(value, leaves, create_graph=True)
        if checkpointed:
            assert len(made) == 1 and len(set(seen)) == 1  # the forward's one buffer, in the backward too
            assert len(seen) == 2 * len(CHUNKS)
        hvp = torch.autograd.grad(sum(g.square().sum() for g in grads), leaves)
        results.append((value, *grads, *hvp))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=1e-13)


TTT_E2E = [*TINY, "model.window=12"]
"""TTT-E2E at a tiny size whose window (12) covers its 13-position reads but for their last query, as
8,192 covers the official 8,193-token slices: the suffix's keys and values go into a `PrefixCache`."""


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [[], ["inner.checkpoint=false"], ["inner.steps=2"], ["ttt.checkpoint_segment=2"], ["model.window=null"]],
    ids=["checkpointed", "stored", "two-steps", "segments", "full-attention"],
)
def test_ttt_e2e_with_a_shared_prefix_has_the_concatenations_losses_and_derivatives(options, monkeypatch):
    """The recipe's pass losses, their second-order gradients and an evaluation read (adapting, without
    an outer graph), float64, with `SuffixBlock.shares_prefix` on and off. Checkpointed chunks replay
    their continuations in place: the only buffers made are each block's one per pass (a second inner
    step's rescoring and a recomputed run of chunks copy, as the concatenation does)."""
    batch = sample_batch()
    results = []
    for shares_prefix in (True, False):
        torch.manual_seed(0)
        learner = build_module(load_config([*TTT_E2E, *options])).double()
        for block in learner.model.suffix:
            block.shares_prefix = shares_prefix
        params = [p for p in learner.parameters() if p.requires_grad]
        made = count_new_buffers(monkeypatch)
        passes = learner.split_passes(batch)
        loss = sum(learner.pass_loss(rows, len(batch["tokens"]))[0] for rows in passes)
        grads = torch.autograd.grad(loss, params)
        if shares_prefix and not options:
            assert len(made) == len(passes) * len(learner.model.suffix)
        assert (len(made) > 0) == shares_prefix
        evaluated = learner.model.token_losses(batch["tokens"], outer_grad=False)
        results.append((loss, *grads, evaluated))
    assert len(results[0]) == len(results[1])
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize(
    "window, positions, covered",
    [(None, 10**6, True), (8192, 8193, True), (8192, 9215, True), (8192, 9216, False), (8192, 16385, False)],
)
def test_a_window_covers_a_read_it_falls_short_of_by_less_than_a_chunk(window, positions, covered):
    cfg = TransformerConfig(vocab_size=8, d_model=8, n_layers=1, n_heads=2, window=window).resolved()
    block = SuffixBlock(Block(cfg), cfg, None)
    assert block.covers(positions, 1024) == covered
    assert isinstance(block.initial_cache(positions, 1024), PrefixCache) == covered
