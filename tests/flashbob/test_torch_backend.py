"""The plain-PyTorch backend: its stage formulas against float64 autograd, gradgradcheck, and masks."""

import pytest
import torch
from kernel_cases import CASES, Case, autograd_reference, make_inputs, rel_err

import flashbob
from flashbob.masks import visible_keys


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_stage_formulas_match_autograd(case):
    q, k, v, dout, u_q, u_k, u_v = (t.double().cpu() for t in make_inputs(case, device="cpu"))
    ref = autograd_reference(case, q, k, v, dout, u_q, u_k, u_v)
    opts = dict(causal=case.causal, window=case.window, backend="torch")
    out, lse = flashbob.attention_forward(q, k, v, **opts)
    assert rel_err(out, ref["out"]) < 1e-12
    dq, dk, dv = flashbob.attention_backward(q, k, v, out, lse, dout, **opts)
    for name, g in zip(("dq", "dk", "dv"), (dq, dk, dv)):
        assert rel_err(g, ref[name]) < 1e-12, name
    bob = flashbob.attention_bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **opts)
    for i, (got, want) in enumerate(zip(bob, ref["bob"])):
        assert rel_err(got, want) < 1e-12, f"bob output {i}"


GRADGRAD_CASES = [
    Case(1, 2, 1, 5, 7, 8, causal=True),  # GQA, rectangular
    Case(1, 1, 1, 7, 4, 8, causal=True),  # N > M: the first rows see no key
    Case(1, 1, 1, 6, 6, 8, causal=True, window=3),
]


@pytest.mark.parametrize("case", GRADGRAD_CASES, ids=lambda c: c.id)
def test_gradgradcheck(case):
    q, k, v = (t.double().cpu().requires_grad_() for t in make_inputs(case, device="cpu")[:3])

    def fn(q_, k_, v_):
        return flashbob.flash_attention(q_, k_, v_, causal=case.causal, window=case.window, backend="torch")

    assert torch.autograd.gradgradcheck(fn, (q, k, v))


def test_auto_backend_is_torch_on_cpu():
    case = CASES[0]
    q, k, v = make_inputs(case, device="cpu")[:3]
    got = flashbob.flash_attention(q, k, v, backend="auto")
    want = flashbob.flash_attention(q, k, v, backend="torch")
    assert torch.equal(got, want)


def test_mask_semantics():
    n, m, window = 5, 8, 3
    mask = visible_keys(n, m, causal=True, window=window)
    for i in range(n):
        for j in range(m):
            assert bool(mask[i, j]) == (i + m - n - window < j <= i + m - n)
    assert visible_keys(n, m, causal=False, window=None) is None
