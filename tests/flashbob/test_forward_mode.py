"""Forward mode through flash_attention on the Triton path (the fused forward-with-tangent kernel),
and gradients of a loss on the tangent, against float64 autograd through plain attention, outputs
poisoned."""

import itertools

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from kernel_cases import CASES, DEVICE, Case, make_inputs, rel_err

import flashbob
from flashbob import tiling, triton_ops
from flashbob.reference import attention_naive

TOL = 2e-5
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
JVP_CASES = [CASES[1], CASES[3], CASES[4], CASES[5], CASES[6], CASES[8], CASES[9]]
SUBSETS = [s for r in (1, 2) for s in itertools.combinations(range(3), r)]


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)


def attention(case, backend):
    def f(q, k, v):
        return flashbob.flash_attention(q, k, v, causal=case.causal, window=case.window, backend=backend)
    return f


def naive(case):
    def f(q, k, v):
        return attention_naive(q, k, v, causal=case.causal, window=case.window, scale=case.d**-0.5)
    return f


def jvp_inputs(case, seed):
    """Primals q, k, v, tangents t_q, t_k, t_v (shaped like them), and loss weights w_out, w_t like q."""
    q, k, v, w_out, t_q, t_k, t_v = make_inputs(case, seed=seed)
    w_t = make_inputs(case, seed=seed + 100)[3]
    return (q, k, v), (t_q, t_k, t_v), w_out, w_t


def tangent_loss(f, w_out, w_t):
    """(q, k, v, t_q, t_k, t_v) -> <out, w_out> + <t_out, w_t>, with t_out the JVP of f along t."""
    def loss(q, k, v, t_q, t_k, t_v):
        out, t_out = torch.func.jvp(f, (q, k, v), (t_q, t_k, t_v))
        return (out * w_out.to(out.dtype)).sum() + (t_out * w_t.to(out.dtype)).sum()
    return loss


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", JVP_CASES, ids=lambda c: c.id)
def test_jvp_matches_float64(case, dtype):
    primals, tangents, _, _ = jvp_inputs(case, seed=1)
    doubles = (tuple(x.double() for x in xs) for xs in (primals, tangents))
    want_out, want_t = torch.func.jvp(naive(case), *doubles)
    cast = tuple(tuple(x.to(dtype) for x in xs) for xs in (primals, tangents))
    out, t_out = torch.func.jvp(attention(case, "triton"), *cast)
    assert out.dtype == t_out.dtype == dtype
    if dtype == torch.float32:
        limit_out, limit_t = TOL, TOL
    else:  # within 2x plain PyTorch's error in the same dtype
        base_out, base_t = torch.func.jvp(naive(case), *cast)
        floor = torch.finfo(dtype).eps / 8
        limit_out = max(2 * rel_err(base_out, want_out), floor)
        limit_t = max(2 * rel_err(base_t, want_t), floor)
    assert rel_err(out, want_out) <= limit_out
    assert rel_err(t_out, want_t) <= limit_t


@pytest.mark.parametrize(("block_m", "block_n"), [(64, 32), (32, 64)])
def test_jvp_with_gpu_tile_shapes(block_m, block_n):
    """The tile shapes CUDA launches use, here on any device: the mask-skipping logic depends on them."""
    with tiling.override("jvp", BLOCK_M=block_m, BLOCK_N=block_n):
        test_jvp_matches_float64(Case(1, 2, 1, 100, 90, 64, causal=True, window=40), torch.float32)


@pytest.mark.parametrize("subset", SUBSETS, ids=lambda s: "+".join("qkv"[i] for i in s))
def test_forward_ad_with_a_subset_of_tangents(subset):
    """Duals on some inputs only: the absent tangents are None in the kernel (their work skipped)."""
    case = CASES[6]
    primals, tangents, _, _ = jvp_inputs(case, seed=2)
    zeros = [t if i in subset else torch.zeros_like(t) for i, t in enumerate(tangents)]
    _, want = torch.func.jvp(naive(case), *(tuple(x.double() for x in xs) for xs in (primals, zeros)))
    with fwAD.dual_level():
        duals = [fwAD.make_dual(x, t) if i in subset else x for i, (x, t) in enumerate(zip(primals, zeros))]
        got = fwAD.unpack_dual(attention(case, "triton")(*duals)).tangent
    assert rel_err(got, want) <= TOL


@pytest.mark.parametrize("case", [CASES[3], CASES[5], CASES[7]], ids=lambda c: c.id)
def test_grad_through_jvp(case):
    """torch.func.grad of a loss on the primal output and on its tangent, w.r.t. q, k, v and the tangents."""
    primals, tangents, w_out, w_t = jvp_inputs(case, seed=3)
    argnums = tuple(range(6))
    want_loss = tangent_loss(naive(case), w_out, w_t)
    want = torch.func.grad(want_loss, argnums)(*(x.double() for x in primals + tangents))
    got = torch.func.grad(tangent_loss(attention(case, "triton"), w_out, w_t), argnums)(*primals, *tangents)
    for name, g, w in zip(("q", "k", "v", "t_q", "t_k", "t_v"), got, want):
        assert rel_err(g, w) <= TOL, name


def test_autograd_grad_through_a_dual_on_q_only():
    """torch.autograd.grad through forward_ad duals, the tangent on q alone: the BoB runs with u_q only."""
    case = CASES[1]
    primals, tangents, _, w_t = jvp_inputs(case, seed=4)

    q, k, v, t_q = (x.detach().requires_grad_() for x in (*primals, tangents[0]))
    with fwAD.dual_level():
        t_out = fwAD.unpack_dual(attention(case, "triton")(fwAD.make_dual(q, t_q), k, v)).tangent
        loss = (t_out * w_t).sum()
    got = torch.autograd.grad(loss, (q, k, v, t_q))

    def ref_loss(q, k, v, t_q):
        _, t_out = torch.func.jvp(naive(case), (q, k, v), (t_q, torch.zeros_like(k), torch.zeros_like(v)))
        return (t_out * w_t.double()).sum()

    want = torch.func.grad(ref_loss, (0, 1, 2, 3))(*(x.detach().double() for x in (q, k, v, t_q)))
    for name, g, w in zip(("q", "k", "v", "t_q"), got, want):
        assert rel_err(g, w) <= TOL, name


def test_jvp_launcher_without_tangents_gives_the_forward():
    case = CASES[2]
    (q, k, v), _, _, _ = jvp_inputs(case, seed=5)
    out, lse, t_out = triton_ops.jvp(q, k, v, None, None, None, causal=True, window=None, scale=case.d**-0.5)
    want_out, want_lse = flashbob.attention_forward(q, k, v, causal=True, backend="torch")
    assert rel_err(out, want_out) <= TOL and rel_err(lse, want_lse) <= TOL
    assert torch.equal(t_out, torch.zeros_like(t_out))


@pytest.mark.parametrize("order", ["jvp_of_grad", "jvp_of_jvp"])
def test_forward_mode_through_a_derivative_raises(order):
    case = CASES[0]
    (q, k, v), (t_q, _, _), _, _ = jvp_inputs(case, seed=6)

    def f(q_):
        return attention(case, "triton")(q_, k, v)

    inner = torch.func.grad(lambda q_: f(q_).sum()) if order == "jvp_of_grad" else (
        lambda q_: torch.func.jvp(f, (q_,), (t_q,))[1])
    with pytest.raises(NotImplementedError, match="forward mode through its gradient"):
        torch.func.jvp(inner, (q,), (t_q,))


def test_third_derivative_through_a_jvp_raises():
    case = CASES[0]
    (q, k, v), (t_q, _, _), _, _ = jvp_inputs(case, seed=7)

    def tangent_sum(q_):
        return torch.func.jvp(lambda x: attention(case, "triton")(x, k, v), (q_,), (t_q,))[1].sin().sum()

    with pytest.raises(RuntimeError, match="third derivative"):
        torch.func.grad(lambda q_: torch.func.grad(tangent_sum)(q_).sin().sum())(q)
