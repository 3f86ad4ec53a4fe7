"""fp32_precision: the float32 product modes reach every kernel of every stage, through the stage
functions and through the autograd chain, and bad values fail by name.

Triton's interpreter computes every product in full float32 whatever input_precision says, so on
the CPU the modes are checked for plumbing and for float64 agreement of the code around them; their
errors on a GPU are measured by `python -m flashbob.bench precision`.
"""

import contextlib

import pytest
import torch
from kernel_cases import DEVICE, Case, autograd_reference, make_inputs, rel_err

import flashbob
from flashbob import tiling, triton_ops, validation

KERNEL_NAMES = ("attention_forward_kernel", "attention_backward_dkdv_kernel", "attention_backward_dq_kernel",
                "attention_bob_rows_kernel", "attention_bob_cols_kernel")
CASE = Case(1, 4, 2, 37, 29, 48, causal=True)
# On a GPU the TF32 modes round: bounds well above their expected error (measured, against plain
# PyTorch float32, by `python -m flashbob.bench precision`), to catch a broken mode, not to grade it.
TOL = {"ieee": 2e-5, "tf32x3": 1e-4 if DEVICE == "cuda" else 2e-5, "tf32": 2e-2 if DEVICE == "cuda" else 2e-5}


class Recorder:
    """A kernel stand-in that records the PRECISION of each launch, then launches the real kernel."""

    def __init__(self, kernel, seen):
        self.kernel, self.seen = kernel, seen

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.seen.append(kwargs["PRECISION"])
            return self.kernel[grid](*args, **kwargs)

        return launch


@pytest.fixture
def seen(monkeypatch):
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)
    launched = []
    for name in KERNEL_NAMES:
        monkeypatch.setattr(triton_ops, name, Recorder(getattr(triton_ops, name), launched))
    return launched


@pytest.mark.parametrize("mode", validation.FP32_PRECISIONS)
def test_each_mode_reaches_every_stage_and_matches_float64(mode, seen):
    q, k, v, dout, u_q, u_k, u_v = make_inputs(CASE, seed=8)
    ref = autograd_reference(CASE, q, k, v, dout, u_q, u_k, u_v)
    opts = dict(causal=True, backend="triton", fp32_precision=mode)
    out, lse = flashbob.attention_forward(q, k, v, **opts)
    dq, dk, dv = flashbob.attention_backward(q, k, v, out, lse, dout, **opts)
    bob = flashbob.attention_bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **opts)
    assert seen and set(seen) == {mode} and len(seen) >= 5
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert rel_err(got, ref[name]) <= TOL[mode], name
    for i, (got, want) in enumerate(zip(bob, ref["bob"])):
        assert rel_err(got, want) <= TOL[mode], f"bob{i}"


@pytest.mark.parametrize("mode", ["tf32x3", "tf32"])
def test_autograd_chain_carries_the_mode_to_the_bob(mode, seen):
    q, k, v, dout, u_q, u_k, u_v = make_inputs(CASE, seed=9)
    ref = autograd_reference(CASE, q, k, v, dout, u_q, u_k, u_v)
    q, k, v, dout = (t.clone().requires_grad_() for t in (q, k, v, dout))
    out = flashbob.flash_attention(q, k, v, causal=True, backend="triton", fp32_precision=mode)
    firsts = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    bob = torch.autograd.grad(firsts, (q, k, v, dout), (u_q, u_k, u_v))
    # forward, 2 backward, rows (one pass), columns; on a GPU whose shared memory a setting exceeds, a
    # launch is retried with a smaller one (tiling.launch), so a kernel may appear twice
    assert set(seen) == {mode} and len(seen) >= 5, seen
    for i, (got, want) in enumerate(zip(bob, ref["bob"])):
        assert rel_err(got, want) <= TOL[mode], f"bob{i}"


def test_tf32x3_head_dim_128_settings_match_float64(monkeypatch, seen):
    """The float32 tf32x3 launch settings at head dim 128 (registers capped at 255, the tiles of
    tiling.TF32X3_HEAD_DIM_128) launch every stage and match float64 at odd sizes (head dim 80 pads
    to 128); on the CPU the register cap is a launch option the interpreter ignores."""
    case = Case(1, 2, 1, 45, 37, 80, causal=True)
    q, k, v, dout, u_q, u_k, u_v = make_inputs(case, seed=10)
    ref = autograd_reference(case, q, k, v, dout, u_q, u_k, u_v)
    opts = dict(causal=True, backend="triton", fp32_precision="tf32x3")
    with contextlib.ExitStack() as stack:
        stack.enter_context(tiling.override("bob_rows", maxnreg=tiling.REGISTER_CAP_FP32))
        for kernel, (bm, bn, warps, stages) in tiling.TF32X3_HEAD_DIM_128.items():
            tiles = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=stages)
            stack.enter_context(tiling.override(kernel, **tiles, maxnreg=tiling.REGISTER_CAP_FP32))
        out, lse = flashbob.attention_forward(q, k, v, **opts)
        dq, dk, dv = flashbob.attention_backward(q, k, v, out, lse, dout, **opts)
        bob = flashbob.attention_bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **opts)
    assert set(seen) == {"tf32x3"} and len(seen) >= 5
    for name, got in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert rel_err(got, ref[name]) <= TOL["tf32x3"], name
    for i, (got, want) in enumerate(zip(bob, ref["bob"])):
        assert rel_err(got, want) <= TOL["tf32x3"], f"bob{i}"


def test_default_and_half_precision_inputs(seen):
    q, k, v = make_inputs(CASE)[:3]
    flashbob.attention_forward(q, k, v, backend="triton")
    flashbob.attention_forward(q.half(), k.half(), v.half(), backend="triton", fp32_precision="ieee")
    assert seen == [validation.DEFAULT_FP32_PRECISION, "tf32"], "16-bit inputs take native products"


@pytest.mark.parametrize("call", ["flash_attention", "attention_forward", "attention_backward",
                                  "attention_bob"])
def test_bad_precision_names_the_argument(call):
    q, k, v = make_inputs(CASE)[:3]
    lse = q[..., 0]
    args = {"flash_attention": (q, k, v), "attention_forward": (q, k, v),
            "attention_backward": (q, k, v, q, lse, q), "attention_bob": (q, k, v, q, lse, q, q)}[call]
    expected = r"fp32_precision must be one of \('ieee', 'tf32x3', 'tf32'\).*'TF32'"
    with pytest.raises(ValueError, match=expected):
        getattr(flashbob, call)(*args, fp32_precision="TF32")
