"""The Triton stages (forward, first backward, FlashBoB) against float64 autograd, outputs poisoned.

On the CPU they run in Triton's interpreter in float32; on CUDA also in bfloat16 and float16,
where the error must stay within 2x the error of plain PyTorch run in the same dtype.
"""

import contextlib
import itertools

import pytest
import torch
from kernel_cases import CASES, DEVICE, Case, autograd_reference, make_inputs, many_compiles, rel_err

import flashbob
from flashbob import tiling, triton_ops
from flashbob.reference import attention_naive

DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])
FP32_TOL = 2e-5


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)


def plain_torch_errors(case, inputs, ref, dtype):
    """Errors of plain PyTorch autograd attention run in `dtype`, against the float64 reference."""
    q, k, v, dout, u_q, u_k, u_v = (t.to(dtype) for t in inputs)
    q, k, v, dout = (t.requires_grad_() for t in (q, k, v, dout))
    out = attention_naive(q, k, v, causal=case.causal, window=case.window, scale=case.d**-0.5)
    firsts = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    bob = torch.autograd.grad(firsts, (q, k, v, dout), (u_q, u_k, u_v))
    errs = {"out": rel_err(out, ref["out"])}
    errs.update({n: rel_err(g, ref[n]) for n, g in zip(("dq", "dk", "dv"), firsts)})
    errs.update({f"bob{i}": rel_err(g, r) for i, (g, r) in enumerate(zip(bob, ref["bob"]))})
    return errs


def check(name, got, ref, dtype, baseline):
    err = rel_err(got, ref)
    # Floors: plain PyTorch float32 is ~1e-7 here, and the float32 floor leaves room for another
    # summation order; in low precision, outputs whose exact value is zero (e.g. dq with a single
    # key) come out as rounding noise, which an eighth of the dtype's epsilon bounds.
    floor = FP32_TOL if dtype == torch.float32 else torch.finfo(dtype).eps / 8
    limit = max(2 * baseline[name], floor)
    assert err <= limit, f"{name}: relative error {err:.3g} > {limit:.3g}"


# On CUDA, the cases each dtype runs in the 5-minute set: together they cover GQA / MQA, windows,
# rectangular and empty rows, N = 1, and head dims 8 to 256 (CASES indices).
CUDA_QUICK = {torch.float32: (1, 6), torch.bfloat16: (2, 3, 8, 9), torch.float16: (4, 5, 7)}
STAGE_PARAMS = [
    pytest.param(case, dtype, id=f"{case.id}-{dtype}",
                 marks=many_compiles(i not in CUDA_QUICK[dtype]))
    for dtype in DTYPES for i, case in enumerate(CASES)
]


@pytest.mark.parametrize("case, dtype", STAGE_PARAMS)
def test_stages_match_float64(case, dtype):
    inputs = make_inputs(case)
    ref = autograd_reference(case, *inputs)
    baseline = plain_torch_errors(case, inputs, ref, dtype)
    q, k, v, dout, u_q, u_k, u_v = (t.to(dtype) for t in inputs)
    opts = dict(causal=case.causal, window=case.window, backend="triton")

    out, lse = flashbob.attention_forward(q, k, v, **opts)
    check("out", out, ref["out"], dtype, baseline)
    dq, dk, dv = flashbob.attention_backward(q, k, v, out, lse, dout, **opts)
    for name, got in zip(("dq", "dk", "dv"), (dq, dk, dv)):
        check(name, got, ref[name], dtype, baseline)
    bob = flashbob.attention_bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **opts)
    for i, (got, want) in enumerate(zip(bob, ref["bob"])):
        check(f"bob{i}", got, want, dtype, baseline)


SUBSETS = [s for r in (1, 2) for s in itertools.combinations(("u_q", "u_k", "u_v"), r)]


@pytest.mark.parametrize("present", SUBSETS, ids="+".join)
@pytest.mark.parametrize(
    "case", [CASES[1], pytest.param(CASES[7], marks=pytest.mark.many_compiles)], ids=lambda c: c.id
)
def test_bob_with_partial_cotangents(case, present):
    q, k, v, dout, *us = make_inputs(case, seed=1)
    us = [u if name in present else None for name, u in zip(("u_q", "u_k", "u_v"), us)]
    ref = autograd_reference(case, q, k, v, dout, *us)
    opts = dict(causal=case.causal, window=case.window, backend="triton")
    out, lse = flashbob.attention_forward(q, k, v, **opts)
    dq, _, _ = flashbob.attention_backward(q, k, v, out, lse, dout, **opts)
    bob = flashbob.attention_bob(q, k, v, out, lse, dout, dq, *us, **opts)
    for i, (got, want) in enumerate(zip(bob, ref["bob"])):
        if want.norm() == 0:
            assert torch.equal(got.cpu(), torch.zeros_like(got.cpu())), f"output {i} should be exactly zero"
        else:
            assert rel_err(got, want) <= FP32_TOL, f"output {i}: {rel_err(got, want):.3g}"


def test_lse_is_minus_inf_on_rows_without_keys():
    case = CASES[5]  # causal with N > M: the first N - M rows see no key
    q, k, v, *_ = make_inputs(case)
    out, lse = flashbob.attention_forward(q, k, v, causal=True, backend="triton")
    empty = case.n - case.m
    assert torch.isneginf(lse[..., :empty]).all() and torch.isfinite(lse[..., empty:]).all()
    assert torch.equal(out[..., :empty, :].cpu(), torch.zeros_like(out[..., :empty, :].cpu()))


def test_non_contiguous_inputs_match_contiguous():
    case = CASES[1]
    q, k, v, dout, u_q, u_k, u_v = make_inputs(case, seed=2)
    # (B, N, H, D) storage viewed as (B, H, N, D), as attention layers produce it.
    q_t, k_t, v_t = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    assert not q_t.is_contiguous()
    opts = dict(causal=True, backend="triton")
    out_a, lse_a = flashbob.attention_forward(q, k, v, **opts)
    out_b, lse_b = flashbob.attention_forward(q_t, k_t, v_t, **opts)
    assert torch.equal(out_a, out_b) and torch.equal(lse_a, lse_b)


LONG_CASES = [
    Case(1, 2, 2, 1024, 1024, 128, causal=True),
    Case(1, 4, 1, 4096, 4096, 64, causal=True, window=512),
    Case(1, 2, 2, 8192, 8192, 64, causal=True),
    Case(1, 2, 2, 8192, 8192, 128),
]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="long sequences need a GPU")
@pytest.mark.parametrize(
    "case, dtype",
    [pytest.param(case, dtype, id=f"{case.id}-{dtype}", marks=many_compiles(dtype != torch.bfloat16))
     for dtype in DTYPES for case in LONG_CASES],
)
def test_long_sequences_on_gpu(case, dtype):
    test_stages_match_float64(case, dtype)


@pytest.mark.many_compiles
@pytest.mark.parametrize("block_m, block_n", [(64, 32), (32, 64)])
@pytest.mark.parametrize(
    "case", [Case(1, 2, 1, 150, 150, 64, causal=True, window=40), Case(1, 2, 2, 97, 130, 80, causal=True)],
    ids=lambda c: c.id,
)
def test_gpu_tile_shapes(case, block_m, block_n):
    """The tile shapes CUDA launches use, here on any device: the mask-skipping logic depends on them."""
    with contextlib.ExitStack() as stack:
        for kernel in tiling.KERNELS:
            stack.enter_context(tiling.override(kernel, BLOCK_M=block_m, BLOCK_N=block_n))
        test_stages_match_float64(case, torch.float32)


@pytest.mark.many_compiles
@pytest.mark.parametrize("split", [False, True], ids=["one_launch", "two_launches"])
@pytest.mark.parametrize(
    "case", [Case(1, 2, 1, 37, 63, 48, causal=True), Case(1, 2, 2, 45, 45, 80)], ids=lambda c: c.id
)
def test_bob_rows_in_one_or_two_launches(case, split):
    """The BoB rows kernel's two modes, each at a head dim whose default is the other one."""
    with tiling.override("bob_rows", SPLIT=split, BLOCK_M=32 if case.d > 64 else 16, BLOCK_N=16):
        test_stages_match_float64(case, torch.float32)


def test_override_names_an_unknown_setting():
    with pytest.raises(ValueError, match=r"'SPLIT'"), tiling.override("bob_cols", SPLIT=False):
        pass
    with pytest.raises(ValueError, match="kernel must be one of"), tiling.override("bob", BLOCK_M=16):
        pass
