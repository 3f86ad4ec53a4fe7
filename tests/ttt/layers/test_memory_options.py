"""The memory options of a TTT read (fused head + loss, prefix recomputation, chunk recomputation)
each lower its peak memory and leave losses and outer gradients unchanged, alone and combined, in
float64, second and first order; `linear_cross_entropy` against F.cross_entropy through its second
derivative."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ttt.experiments.gpu_memory_meters import LiveTensorMeter
from ttt.inner import InnerLoopConfig
from ttt.layers import TTTConfig, TTTTransformer
from ttt.models import Transformer, TransformerConfig
from ttt.models.linear_cross_entropy import linear_cross_entropy, recompute_contexts

pytestmark = pytest.mark.slow  # second-order reads under every option: tens of seconds each on two cores

DOUBLE = torch.float64


@pytest.mark.parametrize("rows, vocab, dim", [(37, 63, 48), (5, 80, 7)], ids=str)
@pytest.mark.parametrize("block_rows", [3, 1000])
@pytest.mark.parametrize("keep_logits", [False, True], ids=["recomputed", "kept"])
def test_linear_cross_entropy_matches_cross_entropy_to_the_second_derivative(
    rows, vocab, dim, block_rows, keep_logits
):
    gen = torch.Generator().manual_seed(rows)
    hidden = torch.randn(rows, dim, dtype=DOUBLE, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, dim, dtype=DOUBLE, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), generator=gen)

    def fused(h, w):
        blocks = 4 * vocab * block_rows
        return linear_cross_entropy(h, w, targets, block_bytes=blocks, keep_logits=keep_logits)

    def plain(h, w):
        return F.cross_entropy(h @ w.t(), targets, reduction="none")

    torch.testing.assert_close(fused(hidden, weight), plain(hidden, weight), rtol=1e-12, atol=1e-12)
    # the inner-step pattern: a gradient in hidden alone (the head's weight gradient is skipped),
    # differentiated again into both
    row_weight = torch.rand(rows, dtype=DOUBLE, generator=gen)
    results = []
    for loss_fn in (fused, plain):
        loss = (loss_fn(hidden, weight) * row_weight).sum()
        (grad_hidden,) = torch.autograd.grad(loss, hidden, create_graph=True)
        outer = (grad_hidden.sin() * hidden).sum() + loss
        results.append(torch.autograd.grad(outer, (hidden, weight)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("keep_logits", [False, True], ids=["recomputed", "kept"])
def test_linear_cross_entropy_passes_gradcheck_and_gradgradcheck(keep_logits):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(5, 4, dtype=DOUBLE, generator=gen, requires_grad=True)
    weight = torch.randn(7, 4, dtype=DOUBLE, generator=gen, requires_grad=True)
    targets = torch.randint(0, 7, (5,), generator=gen)

    def fused(h, w):
        return linear_cross_entropy(h, w, targets, block_bytes=4 * 7 * 2, keep_logits=keep_logits)  # 2 rows

    assert torch.autograd.gradcheck(fused, (hidden, weight))
    assert torch.autograd.gradgradcheck(fused, (hidden, weight))


class VocabProducts(TorchDispatchMode):
    """Counts the matrix products with a dimension of size `vocab` run inside it."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.count = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func._overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.addmm_):
            tensors = [tensor for tensor in (*args, out) if torch.is_tensor(tensor)]
            self.count += any(self.vocab in tensor.shape for tensor in tensors)
        return out


@pytest.mark.parametrize("keep_logits, after", [(False, 5), (True, 4)], ids=["recomputed", "kept"])
def test_linear_cross_entropy_runs_two_vocabulary_products_forward_none_for_an_inner_step_five_after(
    keep_logits, after
):
    """The work of one TTT chunk's head: forward (logits and G), the inner step's gradient in hidden
    (element-wise from G), the second-order graph's backward into hidden and weight (one block): one
    product fewer when the forward keeps the logits. A first-order backward into the weight: 2, or 1."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 5, dtype=DOUBLE, generator=gen, requires_grad=True)
    weight = torch.randn(11, 5, dtype=DOUBLE, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (6,), generator=gen)
    counted = []
    with VocabProducts(11) as products:
        losses = linear_cross_entropy(hidden, weight, targets, keep_logits=keep_logits)
        counted.append(products.count)
        (grad_hidden,) = torch.autograd.grad(losses.mean(), hidden, create_graph=True)
        counted.append(products.count - sum(counted))
        torch.autograd.grad(grad_hidden.square().sum() + losses.sum(), (hidden, weight))
        counted.append(products.count - sum(counted))
        again = linear_cross_entropy(hidden, weight, targets, keep_logits=keep_logits)
        torch.autograd.grad(again.sum(), weight)
        counted.append(products.count - sum(counted) - 2)
    assert counted == [2, 0, after, after - 3]


@pytest.mark.parametrize("keep_logits", [False, True], ids=["recomputed", "kept"])
def test_a_recomputed_linear_cross_entropy_hands_back_its_recorded_forward(keep_logits):
    """Inside a recomputed region's replay the forward runs no product over the vocabulary and gives
    the recorded values (with keep_logits, its backward into the weight none either: the recorded
    logits come back too); a replay that does not match the recording is refused."""
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(6, 5, dtype=DOUBLE, generator=gen, requires_grad=True)
    weight = torch.randn(11, 5, dtype=DOUBLE, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (6,), generator=gen)
    record, replay = recompute_contexts()
    with record:
        recorded = linear_cross_entropy(hidden, weight, targets, keep_logits=keep_logits)
    with replay, VocabProducts(11) as products:
        replayed = linear_cross_entropy(hidden, weight, targets, keep_logits=keep_logits)
        (grad,) = torch.autograd.grad(replayed.sum(), hidden, retain_graph=True)
    assert products.count == 0
    with VocabProducts(11) as products:
        (grad_weight,) = torch.autograd.grad(replayed.sum(), weight)
    assert products.count == (1 if keep_logits else 2)
    torch.testing.assert_close(replayed, recorded, rtol=0, atol=0)
    want_grad, want_grad_weight = torch.autograd.grad(recorded.sum(), (hidden, weight))
    torch.testing.assert_close(grad, want_grad, rtol=0, atol=0)
    torch.testing.assert_close(grad_weight, want_grad_weight, rtol=0, atol=0)
    with replay, pytest.raises(RuntimeError, match="differs from the recorded one"):
        linear_cross_entropy(hidden[:4], weight, targets[:4])


def test_linear_cross_entropy_keeps_no_logits_where_no_backward_can_run():
    """keep_logits allocates the (rows, V) logits only where grad mode could run a backward."""
    hidden, weight = torch.randn(6, 5, dtype=DOUBLE), torch.randn(11, 5, dtype=DOUBLE, requires_grad=True)
    targets = torch.randint(0, 11, (6,), generator=torch.Generator().manual_seed(4))
    sizes = []

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func._overloadpacket in (torch.ops.aten.empty, torch.ops.aten.new_empty):
                sizes.append(tuple(out.shape))
            return out

    with torch.no_grad(), Allocations():
        linear_cross_entropy(hidden, weight, targets, keep_logits=True)
    assert (6, 11) not in sizes
    with Allocations():
        linear_cross_entropy(hidden, weight, targets, keep_logits=True)
    assert (6, 11) in sizes


def test_linear_cross_entropy_refuses_mismatched_inputs():
    hidden, weight = torch.randn(2, 3, 4), torch.randn(9, 4)
    with pytest.raises(ValueError, match="targets must have the shape"):
        linear_cross_entropy(hidden, weight, torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="weight must be"):
        linear_cross_entropy(hidden, torch.randn(9, 5), torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="int64"):
        linear_cross_entropy(hidden, weight, torch.zeros(2, 3, dtype=torch.int32))


def make_ttt(
    *, fused_loss=False, checkpoint_prefix=False, checkpoint=False, tie=False, first_order=False,
    vocab=37, n_layers=3, chunk_len=4, segment=None, keep_logits=False, keeps_chunks=False,
):  # fmt: skip
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=vocab,
        d_model=16,
        n_layers=n_layers,
        n_heads=2,
        n_kv_heads=1,
        d_ff=24,
        window=6,
        attention="eager",
        tie_embeddings=tie,
    )
    ttt = TTTConfig(
        suffix_len=2,
        chunk_len=chunk_len,
        fused_loss=fused_loss,
        fused_loss_keeps_logits=keep_logits,
        checkpoint_prefix=checkpoint_prefix,
        checkpoint_segment=segment,
        checkpoint_segment_keeps_chunks=keeps_chunks,
    )
    inner = InnerLoopConfig(
        params=["layers.*.ttt_mlp.*"],
        lr=0.5,
        grad_clip=1.0,
        checkpoint=checkpoint,
        first_order=first_order,
        steps=2,
    )
    model = TTTTransformer(Transformer(cfg), ttt, inner)
    with torch.no_grad():  # a non-zero extra MLP, as after meta-training
        for block in model.suffix:
            block.ttt_mlp.w_down.weight.normal_(std=0.3)
    return model.to(DOUBLE)


def losses_and_grads(model, tokens):
    losses = model.token_losses(tokens)
    grads = torch.autograd.grad(losses.mean(), list(model.parameters()))
    return losses.detach(), grads


OPTIONS = {  # each option alone, then together: (fused loss, prefix, chunk checkpoint, tied head, segment,
    # the fused loss keeping its logits)
    "fused_loss": (True, False, False, False, None, False),
    "fused_loss_tied": (True, False, False, True, None, False),
    "fused_loss_kept": (True, False, False, False, None, True),
    "prefix": (False, True, False, False, None, False),
    "chunks": (False, False, True, False, None, False),
    "segments": (False, False, True, False, 2, False),
    "all": (True, True, True, False, None, False),
    "all_tied": (True, True, True, True, None, False),
    "all_kept": (True, True, True, False, None, True),
    "all_segments": (True, True, True, False, 4, False),
}


@pytest.mark.parametrize(
    "fused_loss, checkpoint_prefix, checkpoint, tie, segment, keep_logits",
    OPTIONS.values(),
    ids=OPTIONS.keys(),
)
def test_memory_options_leave_losses_and_second_order_gradients_unchanged(
    fused_loss, checkpoint_prefix, checkpoint, tie, segment, keep_logits
):
    """23 tokens in chunks of 4 (the last of 3), segments of 2 and 4 chunks (the last one shorter)."""
    tokens = torch.randint(0, 37, (2, 23), generator=torch.Generator().manual_seed(3))
    options = dict(fused_loss=fused_loss, checkpoint_prefix=checkpoint_prefix, checkpoint=checkpoint)
    options.update(tie=tie, segment=segment, keep_logits=keep_logits)
    want_losses, want_grads = losses_and_grads(make_ttt(tie=tie), tokens)
    got_losses, got_grads = losses_and_grads(make_ttt(**options), tokens)
    torch.testing.assert_close(got_losses, want_losses, rtol=1e-12, atol=1e-12)
    for got, want in zip(got_grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    # the second-order term is in the comparison: first order gives other gradients
    first = make_ttt(**options, first_order=True)
    assert any(not torch.allclose(g, w) for g, w in zip(losses_and_grads(first, tokens)[1], want_grads))


def test_kept_logits_spare_products_in_a_checkpointed_second_order_read():
    """The recipe's setting (chunks and prefix recomputed): the logits kept by each chunk's forward reach
    its recomputation's backward, which then runs fewer products over the vocabulary."""
    tokens = torch.randint(0, 37, (2, 23), generator=torch.Generator().manual_seed(3))
    counts = []
    for keep_logits in (False, True):
        model = make_ttt(fused_loss=True, checkpoint_prefix=True, checkpoint=True, keep_logits=keep_logits)
        with VocabProducts(37) as products:
            torch.autograd.grad(model.token_losses(tokens).mean(), list(model.parameters()))
        counts.append(products.count)
    assert counts[1] < counts[0]


def test_memory_options_keep_first_order_gradients():
    tokens = torch.randint(0, 37, (2, 23), generator=torch.Generator().manual_seed(4))
    plain = make_ttt(first_order=True)
    for segment in (None, 3):
        model = make_ttt(
            fused_loss=True, checkpoint_prefix=True, checkpoint=True, first_order=True, segment=segment
        )
        for got, want in zip(losses_and_grads(model, tokens)[1], losses_and_grads(plain, tokens)[1]):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("first_order", [False, True])
def test_chunk_recomputation_leaves_only_the_carries_after_the_forward(first_order):
    """What a read leaves for its backward: with chunk recomputation each chunk's inputs (fast weights,
    caches, its slice of the prefix output), none of its activations (a graph kept alive by anything,
    e.g. a cache of the fused loss's outputs, shows here)."""
    tokens = torch.randint(0, 4096, (2, 96), generator=torch.Generator().manual_seed(7))
    kept = []
    for checkpoint in (False, True):
        model = make_ttt(vocab=4096, chunk_len=8, fused_loss=True, checkpoint_prefix=True,
                         checkpoint=checkpoint, first_order=first_order)  # fmt: skip
        with LiveTensorMeter() as meter:
            loss = model.token_losses(tokens).mean()  # its graph holds what the backward will use
            kept.append(meter.live_bytes)
        del loss
    assert kept[1] < (0.6 if first_order else 0.25) * kept[0], kept  # measured about 0.5 and 0.2


def test_a_read_without_test_time_training_recomputes_its_suffix_blocks_too():
    """adapt=False (ttt.enabled=false, the baseline) reads the suffix blocks over whole sequences:
    inner.checkpoint recomputes them in the outer backward as ttt.checkpoint_prefix does the prefix,
    gradients unchanged, far fewer bytes left for the backward."""
    tokens = torch.randint(0, 37, (2, 96), generator=torch.Generator().manual_seed(8))
    kept, grads = [], []
    for checkpoint in (False, True):
        model = make_ttt(chunk_len=8, checkpoint=checkpoint)
        with LiveTensorMeter() as meter:
            loss = model.read(tokens, adapt=False)[1].mean()
            kept.append(meter.live_bytes)
        grads.append(torch.autograd.grad(loss, list(model.parameters()), allow_unused=True))
    for got, want in zip(*grads[::-1]):
        assert (got is None) == (want is None)
        if got is not None:
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    assert kept[1] < 0.5 * kept[0], kept  # measured 0.35 (the prefix kept in both)


def test_segments_keep_the_carry_of_every_kth_chunk_only():
    """12 chunks: with segments of 4, what the forward leaves for the backward (the carries and inputs of
    3 segments instead of 12 chunks) is smaller, and so is the peak of the read and its backward."""
    tokens = torch.randint(0, 37, (2, 96), generator=torch.Generator().manual_seed(7))
    kept, peaks = [], []
    for segment in (None, 4):
        model = make_ttt(n_layers=3, chunk_len=8, checkpoint=True, checkpoint_prefix=True, segment=segment)
        with LiveTensorMeter() as meter:
            loss = model.token_losses(tokens).mean()
            kept.append(meter.live_bytes)
            loss.backward()
        peaks.append(meter.peak_bytes)
    assert kept[1] < 0.6 * kept[0] and peaks[1] < peaks[0], (kept, peaks)


@pytest.mark.parametrize("segment, fused_loss", [(2, False), (4, True)])
def test_segments_that_keep_their_chunks_run_each_chunk_twice_with_the_same_gradients(segment, fused_loss):
    """ttt.checkpoint_segment_keeps_chunks: the second-order gradients of the plain read (23 tokens in
    chunks of 4, runs of 2 and 4 chunks, the last shorter), each chunk read twice an outer step (the
    run's forward and its recomputation) instead of three times, for a higher peak than recomputing the
    chunks too and a lower one than keeping every chunk's graph."""
    tokens = torch.randint(0, 37, (2, 23), generator=torch.Generator().manual_seed(3))
    want_losses, want_grads = losses_and_grads(make_ttt(), tokens)
    reads, peaks = {}, {}
    for keeps in (False, True):
        model = make_ttt(fused_loss=fused_loss, checkpoint=True, segment=segment, keeps_chunks=keeps)
        calls = []

        def counted(*args, calls=calls, read_chunk=model._read_chunk):
            calls.append(1)
            return read_chunk(*args)

        model._read_chunk = counted
        with LiveTensorMeter() as meter:
            got_losses, got_grads = losses_and_grads(model, tokens)
        reads[keeps], peaks[keeps] = len(calls), meter.peak_bytes
        torch.testing.assert_close(got_losses, want_losses, rtol=1e-12, atol=1e-12)
        for got, want in zip(got_grads, want_grads):
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    chunks = 6  # ceil(23 / 4)
    assert reads == {False: 3 * chunks, True: 2 * chunks}, reads
    with LiveTensorMeter() as meter:
        losses_and_grads(make_ttt(fused_loss=fused_loss), tokens)
    assert peaks[False] < peaks[True] < meter.peak_bytes, (peaks, meter.peak_bytes)


@pytest.mark.parametrize("option", ["fused_loss", "checkpoint_prefix", "checkpoint"])
def test_each_memory_option_lowers_the_peak_of_a_second_order_read(option):
    """Every tensor a read and its outer backward create, while it lives (`LiveTensorMeter`): a
    4,096-token vocabulary (the fused loss's term), 6 blocks (the prefix's) and 12 chunks (the chunks')."""
    tokens = torch.randint(0, 4096, (2, 96), generator=torch.Generator().manual_seed(6))

    def peak(**options):
        model = make_ttt(vocab=4096, n_layers=6, chunk_len=8, **options)
        with LiveTensorMeter() as meter:
            model.token_losses(tokens).mean().backward()
        return meter.peak_bytes

    assert peak(**{option: True}) < peak()  # byte counts: no noise, a no-op option ties


def test_logits_are_kept_by_the_plain_head_when_asked_for():
    tokens = torch.randint(0, 37, (2, 11), generator=torch.Generator().manual_seed(5))
    model = make_ttt(fused_loss=True)
    logits, losses = model.read(tokens, keep_logits=True)
    assert logits.shape == (2, 11, 37)
    torch.testing.assert_close(losses, model.token_losses(tokens), rtol=1e-12, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("rows, vocab, dim", [(4099, 128256, 768), (37, 1000, 48)], ids=str)
@pytest.mark.parametrize("keep_logits", [False, True], ids=["recomputed", "kept"])
def test_linear_cross_entropy_under_bf16_autocast_is_as_close_as_plain_pytorch(rows, vocab, dim, keep_logits):
    """Compiled on CUDA, bf16 products: losses, the inner gradient and the outer (second-order)
    gradients within twice plain PyTorch's bf16 error, both against float64; outputs written (no NaN)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, dim, device="cuda", generator=gen)
    weight = torch.randn(vocab, dim, device="cuda", generator=gen) / dim**0.5
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    cot = torch.randn(rows, dim, device="cuda", generator=gen)

    def run(loss_fn, h, w, autocast):
        h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            losses = loss_fn(h, w)
            (grad_h,) = torch.autograd.grad(losses.sum(), h, create_graph=True)
            outer = torch.autograd.grad((grad_h * cot).sum() + losses.mean(), (h, w))
        return [losses.double(), grad_h.double(), *(g.double() for g in outer)]

    def plain(h, w):
        return F.cross_entropy(h @ w.t(), targets, reduction="none")

    def fused(h, w):
        return linear_cross_entropy(h, w, targets, block_bytes=2**26, keep_logits=keep_logits)  # blocks

    want = run(plain, hidden.double(), weight.double(), autocast=False)
    for got, base, ref in zip(run(fused, hidden, weight, True), run(plain, hidden, weight, True), want):
        assert torch.isfinite(got).all()
        err, base_err = (got - ref).norm() / ref.norm(), (base - ref).norm() / ref.norm()
        assert err <= 2 * base_err + 1e-6, (err.item(), base_err.item())


@pytest.mark.parametrize(
    "device, dtype",
    [
        ("cpu", torch.float64),
        ("cpu", torch.bfloat16),
        pytest.param(
            "cuda",
            torch.bfloat16,
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_accumulate_product_adds_the_product_in_float32_in_place(device, dtype):
    """total += left @ right into float32 total (the head weight's gradient over blocks of rows), in place,
    against float64: same-dtype operands exact to float64's rounding, half-precision ones (on CUDA added
    by the product itself) within a product's half-precision rounding; odd sizes; total poisoned
    nowhere (its start is part of the sum)."""
    from ttt.models.linear_cross_entropy import accumulate_product

    gen = torch.Generator().manual_seed(3)
    left = torch.randn(63, 37, generator=gen, dtype=DOUBLE).to(device=device, dtype=dtype)
    right = torch.randn(37, 48, generator=gen, dtype=DOUBLE).to(device=device, dtype=dtype)
    start = torch.randn(63, 48, generator=gen, dtype=DOUBLE)
    total = start.to(device=device, dtype=DOUBLE if dtype == DOUBLE else torch.float32, copy=True)
    storage = total.data_ptr()
    accumulate_product(total, left.t().t(), right)
    want = start + left.cpu().double() @ right.cpu().double()
    assert total.data_ptr() == storage
    # On CUDA the float32 sum is the product's own (2.6e-6 of the largest entry measured at the head's
    # size); the CPU forms the product in bf16 first (up to 2^-8 of it).
    relative = {DOUBLE: 1e-14, torch.bfloat16: 1e-4 if device == "cuda" else 0.02}[dtype]
    tolerance = relative * want.abs().max().item()
    torch.testing.assert_close(total.cpu().double(), want, rtol=0, atol=tolerance)
