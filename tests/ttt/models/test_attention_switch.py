"""The model attention switch: every backend matches the float64 reference, values and derivatives."""

import importlib

import pytest
import torch
import torch.nn.functional as F

import flashbob
from flashbob.masks import visible_keys
from flashbob.reference import attention_naive
from ttt.inner import InnerLoop, InnerLoopConfig, functional_forward, select_parameters
from ttt.models import Transformer, TransformerConfig
from ttt.models.attention import ATTENTION_BACKENDS, attention

CASES = [
    # (Hq, Hkv, N, M, causal, window)
    (4, 4, 13, 13, True, None),
    (4, 2, 13, 13, True, 5),
    (2, 1, 7, 11, True, None),
    (2, 2, 9, 9, False, None),
]


def _ids(case):
    hq, hkv, n, m, causal, window = case
    return f"Hq{hq}-Hkv{hkv}-N{n}-M{m}-{'causal' if causal else 'full'}-w{window}"


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_backend_matches_reference_to_second_order(backend, case):
    hq, hkv, n, m, causal, window = case
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, hq, n, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, hkv, m, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, hkv, m, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    probe = torch.randn(2, hq, n, 8, dtype=torch.float64, generator=gen)

    def grad_of_grad(fn):
        out = fn(q, k, v)
        dq, dk, dv = torch.autograd.grad((out * probe).sum(), (q, k, v), create_graph=True)
        second = torch.autograd.grad((dq.sin().sum() + dk.square().sum() + dv.sum()), (q, k, v))
        return (out, dq, dk, dv, *second)

    got = grad_of_grad(lambda a, b, c: attention(a, b, c, backend=backend, causal=causal, window=window))
    want = grad_of_grad(lambda a, b, c: attention_naive(a, b, c, causal=causal, window=window, scale=8**-0.5))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def _assert_first_order_matches_reference(shape, backend, *, causal, window, seed):
    """attention(backend) on float64 q (2, Hq, N, 8), k, v (2, Hkv, M, 8), shape = (Hq, Hkv, N, M): its
    output and the gradients of out.sin().sum() equal attention_naive's."""
    hq, hkv, n, m = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, n, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k = torch.randn(2, hkv, m, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    v = torch.randn(2, hkv, m, 8, dtype=torch.float64, generator=gen, requires_grad=True)

    def with_grads(fn):
        out = fn(q, k, v)
        return (out, *torch.autograd.grad(out.sin().sum(), (q, k, v)))

    got = with_grads(lambda a, b, c: attention(a, b, c, backend=backend, causal=causal, window=window))
    want = with_grads(lambda a, b, c: attention_naive(a, b, c, causal=causal, window=window, scale=8**-0.5))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


PRIORITY_BEFORE = torch._C._get_sdp_priority_order()


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_cudnn"])
@pytest.mark.parametrize("case", [*CASES, (4, 2, 1, 9, True, None), (4, 2, 1, 9, True, 4)], ids=_ids)
def test_sdpa_matches_reference_to_first_order(case, backend):
    """torch SDPA's fused kernels (first order only: not in ATTENTION_BACKENDS), in torch's order and
    cuDNN first: the masks it is spared (full causal, one query decoding) and the ones it is given (a
    window, fewer queries than keys)."""
    hq, hkv, n, m, causal, window = case
    _assert_first_order_matches_reference((hq, hkv, n, m), backend, causal=causal, window=window, seed=0)
    assert backend not in ATTENTION_BACKENDS
    assert torch._C._get_sdp_priority_order() == PRIORITY_BEFORE  # the context restored torch's order


def test_unknown_backend_names_the_choices():
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match="flashbob"):
        attention(q, q, q, backend="flash")


def test_flashbob_triton_kernels_give_the_inner_loop_the_same_second_order_gradient(monkeypatch):
    """Adapting layer 0's MLP puts layer 1's attention inside the inner gradient, so the outer
    gradient runs backward-over-backward through it: on the Triton kernels (CPU interpreter here)
    it must equal plain PyTorch."""
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=40, d_model=32, n_heads=2, n_kv_heads=1, window=6, attention="flashbob"
    )
    model = Transformer(cfg)
    tokens = torch.randint(0, 40, (1, 16))

    def inner(params, step):
        return F.cross_entropy(functional_forward(model, params, tokens[:, :10])[0, :-1], tokens[0, 1:10])

    def outer_gradient():
        params = select_parameters(model, ["layers.0.mlp.*"])
        loop = InnerLoop(params, InnerLoopConfig(params=["layers.0.mlp.*"], steps=2, lr=0.5))
        adapted = loop.adapt(inner, params).params
        outer = F.cross_entropy(functional_forward(model, adapted, tokens)[0, :-1], tokens[0, 1:])
        return torch.autograd.grad(outer, list(model.parameters()))

    reference = outer_gradient()
    flash_attention = flashbob.flash_attention
    calls = []

    def triton_only(*args, backend, **kwargs):
        calls.append(backend)
        return flash_attention(*args, backend="triton", **kwargs)

    monkeypatch.setattr(flashbob, "flash_attention", triton_only)
    got = outer_gradient()
    assert calls and set(calls) == {"auto"}
    for g, r in zip(got, reference):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_cudnn"])
@pytest.mark.parametrize("case", [(4, 2, 37, 63, 10), (2, 2, 63, 63, 17), (2, 1, 5, 80, 48)])
def test_sdpa_windowed_reads_run_in_blocks_without_a_whole_mask(case, backend, monkeypatch):
    """A window over more keys than it keeps: query blocks (here of 4 rows) over their own keys, values and
    first derivatives as the float64 reference's, and no mask larger than rows x (rows + window - 1)."""
    switch = importlib.import_module("ttt.models.attention")  # the package's `attention` is the function

    hq, hkv, n, m, window = case
    monkeypatch.setattr(switch, "WINDOW_BLOCK_ROWS_MIN", 4)
    shapes = []

    def recorded(*args, **kwargs):
        mask = visible_keys(*args, **kwargs)
        shapes.append(tuple(mask.shape))
        return mask

    monkeypatch.setattr(switch, "visible_keys", recorded)
    _assert_first_order_matches_reference((hq, hkv, n, m), backend, causal=True, window=window, seed=1)
    rows = max(window // 8, 4)
    assert len(shapes) == -(-n // rows)
    assert all(r <= rows and c <= r + window - 1 for r, c in shapes)


def test_window_blocks_cover_every_query_and_its_visible_keys():
    from ttt.models.attention import window_blocks

    for n, m, window in [(37, 63, 10), (63, 63, 17), (1000, 1000, 300), (5, 80, 48)]:
        blocks = list(window_blocks(n, m, window, rows_min=4))
        assert [b[0] for b in blocks] == list(range(0, n, max(window // 8, 4)))
        assert blocks[-1][1] == n
        mask = visible_keys(n, m, causal=True, window=window)
        for start, stop, first, end in blocks:
            assert not mask[start:stop, :first].any() and not mask[start:stop, end:].any()
