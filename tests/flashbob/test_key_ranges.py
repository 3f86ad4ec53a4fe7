"""Per-batch-row key ranges (key_start, key_end: padding masks) on every path: the Triton stages
(forward, first backward, BoB), grad of grad, forward mode, vmap and torch.compile, and the torch
backend, against float64 autograd through attention with an explicit (B, 1, N, M) boolean mask built
here (not through the op's range code), outputs poisoned; and the argument checks."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_cases import DEVICE, Case, make_inputs, rel_err

import flashbob
from flashbob import triton_ops

TOL = 2e-5


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)


@dataclasses.dataclass(frozen=True)
class RangeCase:
    case: Case
    key_start: tuple[int, ...]
    key_end: tuple[int, ...]
    name: str

    @property
    def id(self) -> str:
        return f"{self.case.id}-{self.name}"

    def ranges(self, device=DEVICE) -> dict:
        return {"key_start": torch.tensor(self.key_start, device=device),
                "key_end": torch.tensor(self.key_end, device=device)}


RANGE_CASES = [
    # Left padding (generation batches), GQA; batch row 2's range is empty (all padding).
    RangeCase(Case(3, 4, 2, 37, 37, 48, causal=True), (0, 9, 20), (37, 37, 20), "left-pad-empty-row"),
    # Right padding (training batches), no causal mask, rectangular, head dim 80.
    RangeCase(Case(2, 2, 2, 29, 45, 80), (0, 0), (45, 13), "right-pad"),
    # Left padding under a sliding window: rows before the padding's end see no key.
    RangeCase(Case(2, 2, 1, 37, 37, 16, causal=True, window=9), (3, 30), (37, 37), "left-pad-window"),
    # A range in the middle, N > M: the causal limit and the range's end both cut rows.
    RangeCase(Case(2, 2, 2, 40, 29, 32, causal=True), (5, 0), (20, 29), "both-ends"),
]
PARAMS = [pytest.param(rc, id=rc.id) for rc in RANGE_CASES]


def explicit_mask(rc: RangeCase) -> torch.Tensor:
    """(B, 1, N, M) bool: causal / window mask (bottom-right aligned) and each batch row's keys."""
    c = rc.case
    rows = torch.arange(c.n)[:, None] + (c.m - c.n)
    cols = torch.arange(c.m)[None, :]
    allowed = torch.ones(c.n, c.m, dtype=torch.bool)
    if c.causal:
        allowed &= cols <= rows
    if c.window is not None:
        allowed &= cols > rows - c.window
    keys = torch.zeros(c.batch, c.m, dtype=torch.bool)
    for b, (start, end) in enumerate(zip(rc.key_start, rc.key_end)):
        keys[b, start:end] = True
    return (allowed[None, None] & keys[:, None, None, :]).to(DEVICE)


def masked_attention(q, k, v, mask, scale):
    """softmax(scale q k^T, -inf where ~mask) v; rows with no visible key give 0 (and no NaN)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    seen = mask.any(-1, keepdim=True)
    probs = torch.softmax(torch.where(seen, scores, 0.0), -1) * seen
    return probs @ v


def reference(rc: RangeCase, q, k, v, dout, u_q, u_k, u_v):
    """out, (dq, dk, dv) and the BoB gradients by float64 autograd through `masked_attention`."""
    mask = explicit_mask(rc)
    q, k, v, dout = (t.detach().double().requires_grad_() for t in (q, k, v, dout))
    out = masked_attention(q, k, v, mask, rc.case.d**-0.5)
    firsts = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    bob = torch.autograd.grad(firsts, (q, k, v, dout), (u_q.double(), u_k.double(), u_v.double()))
    return out.detach(), [g.detach() for g in firsts], bob


def options(rc: RangeCase, backend: str) -> dict:
    return dict(causal=rc.case.causal, window=rc.case.window, backend=backend, **rc.ranges())


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("rc", PARAMS)
def test_stages_with_key_ranges_match_float64(rc, backend):
    inputs = make_inputs(rc.case)
    want_out, want_firsts, want_bob = reference(rc, *inputs)
    q, k, v, dout, u_q, u_k, u_v = inputs
    opts = options(rc, backend)
    out, lse = flashbob.attention_forward(q, k, v, **opts)
    assert rel_err(out, want_out) <= TOL
    empty = ~explicit_mask(rc).any(-1).expand_as(lse)
    assert empty.any() == (rc.name != "right-pad")
    assert bool(torch.isneginf(lse[empty]).all()) and bool((out[empty] == 0).all())
    assert bool(torch.isfinite(lse[~empty]).all())
    firsts = flashbob.attention_backward(q, k, v, out, lse, dout, **opts)
    for name, got, want in zip(("dq", "dk", "dv"), firsts, want_firsts):
        assert rel_err(got, want) <= TOL, name
    unseen_keys = ~explicit_mask(rc).any(-2).any(1)   # (B, M): keys no query of the row sees
    for got in firsts[1:]:
        assert bool((got.permute(0, 2, 1, 3)[unseen_keys] == 0).all())
    bob = flashbob.attention_bob(q, k, v, out, lse, dout, firsts[0], u_q, u_k, u_v, **opts)
    for i, (got, want) in enumerate(zip(bob, want_bob)):
        assert rel_err(got, want) <= TOL, f"bob{i}"


def meta_loss(f, w):
    """(q, k, v) -> <grad of sum(sin(f(q, k, v))), w>: a function of the first gradients."""
    def loss(q, k, v):
        firsts = torch.autograd.grad(f(q, k, v).sin().sum(), (q, k, v), create_graph=True)
        return sum((g * x).sum() for g, x in zip(firsts, w))
    return loss


@pytest.mark.parametrize("rc", [PARAMS[0], PARAMS[2]])
def test_grad_of_grad_with_key_ranges_matches_float64(rc):
    q, k, v, _, u_q, u_k, u_v = make_inputs(rc.case)
    mask, scale = explicit_mask(rc), rc.case.d**-0.5

    def ours(q, k, v):
        return flashbob.flash_attention(q, k, v, **options(rc, "triton"))

    def theirs(q, k, v):
        return masked_attention(q, k, v, mask, scale)

    results = []
    for f, dtype in ((ours, torch.float32), (theirs, torch.float64)):
        args = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        w = [t.to(dtype) for t in (u_q, u_k, u_v)]
        results.append(torch.autograd.grad(meta_loss(f, w)(*args), args))
    for name, got, want in zip("qkv", *results):
        assert got.dtype == torch.float32 and rel_err(got, want) <= TOL, name


@pytest.mark.parametrize("rc", [PARAMS[0], PARAMS[1]])
def test_jvp_and_its_gradient_with_key_ranges_match_float64(rc):
    """torch.func.jvp (the fused forward-with-tangent kernel), then the gradient of a loss on the
    tangent (the first backward and the BoB on the JVP's backward)."""
    q, k, v, w, t_q, t_k, t_v = make_inputs(rc.case)
    mask, scale = explicit_mask(rc), rc.case.d**-0.5

    def ours(q, k, v):
        return flashbob.flash_attention(q, k, v, **options(rc, "triton"))

    def theirs(q, k, v):
        return masked_attention(q, k, v, mask, scale)

    results = []
    for f, dtype in ((ours, torch.float32), (theirs, torch.float64)):
        primals = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        tangents = [t.to(dtype).requires_grad_() for t in (t_q, t_k, t_v)]
        _, t_out = torch.func.jvp(f, tuple(primals), tuple(tangents))
        grads = torch.autograd.grad((t_out * w.to(dtype)).sum(), (*primals, *tangents))
        results.append((t_out.detach(), *grads))
    for i, (got, want) in enumerate(zip(*results)):
        assert rel_err(got, want) <= TOL, i


@pytest.mark.parametrize("ranges_dim", [None, 0])
def test_vmap_with_key_ranges_matches_float64(ranges_dim):
    """vmap over q, with one set of ranges for every vmapped entry (None) or one each (0)."""
    rc = RANGE_CASES[0]
    q, k, v = make_inputs(rc.case)[:3]
    gen = torch.Generator().manual_seed(3)
    qs = torch.randn((2, *q.shape), generator=gen, dtype=torch.float64).to(DEVICE)
    starts = torch.tensor([rc.key_start, (4, 0, 37)], device=DEVICE)
    ends = torch.tensor([rc.key_end, (30, 37, 37)], device=DEVICE)
    if ranges_dim is None:
        starts, ends = starts[0], ends[0]

    def ours(q, start, end):
        return flashbob.flash_attention(q, k, v, causal=True, backend="triton", key_start=start, key_end=end)

    got = torch.func.vmap(ours, in_dims=(0, ranges_dim, ranges_dim))(qs.float(), starts, ends)
    for i in range(2):
        entry = rc if ranges_dim is None else RangeCase(
            rc.case, tuple(starts[i].tolist()), tuple(ends[i].tolist()), "vmapped")
        want = masked_attention(qs[i], k.double(), v.double(), explicit_mask(entry), rc.case.d**-0.5)
        assert rel_err(got[i], want) <= TOL


@pytest.mark.slow
def test_func_transforms_with_key_ranges_as_arguments():
    """torch.func.grad of grad, and vmap of grad with vmapped ranges, where the ranges are arguments
    of the transformed function (so every transform level wraps them)."""
    rc = RANGE_CASES[3]
    q, k, v = make_inputs(rc.case)[:3]
    starts = torch.tensor([rc.key_start, (0, 7)], device=DEVICE)
    ends = torch.tensor([rc.key_end, (29, 8)], device=DEVICE)

    def loss(q, start, end):
        out = flashbob.flash_attention(q, k, v, causal=True, backend="triton", key_start=start, key_end=end)
        return out.sin().sum()

    def reference_loss(q, entry):
        return masked_attention(q, k.double(), v.double(), explicit_mask(entry), rc.case.d**-0.5).sin().sum()

    def second(f):
        return lambda q, *rest: torch.func.grad(lambda q_: torch.func.grad(f)(q_, *rest).square().sum())(q)

    got = second(loss)(q, starts[0], ends[0])
    assert rel_err(got, second(reference_loss)(q.double(), rc)) <= TOL
    got = torch.func.vmap(torch.func.grad(loss))(torch.stack([q, q + 1]), starts, ends)
    for i in range(2):
        entry = RangeCase(rc.case, tuple(starts[i].tolist()), tuple(ends[i].tolist()), "vmapped")
        want = torch.func.grad(reference_loss)((q + i).double(), entry)
        assert rel_err(got[i], want) <= TOL


def test_compiled_first_order_with_key_ranges_matches_float64():
    """Under torch.compile the ranges reach the custom ops (forward and backward) as a tensor input."""
    torch._dynamo.reset()
    rc = RANGE_CASES[0]
    q, k, v, dout = make_inputs(rc.case)[:4]
    ranges = rc.ranges()

    def f(q, k, v, start, end):
        out = flashbob.flash_attention(q, k, v, causal=True, backend="triton", key_start=start, key_end=end)
        return (out * dout).sum()

    args = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(
        torch.compile(f, fullgraph=True, backend="aot_eager")(*args, ranges["key_start"], ranges["key_end"]),
        args,
    )
    torch._dynamo.reset()
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    out = masked_attention(*ref, explicit_mask(rc), rc.case.d**-0.5)
    for got_g, want_g in zip(got, torch.autograd.grad(out, ref, dout.double())):
        assert rel_err(got_g, want_g) <= TOL


def bad_ranges():
    """(key_start, key_end, error type, message) for q (2, 2, 5, 16) and k (2, 1, 7, 16)."""
    ok = torch.tensor([0, 2])
    return [
        ([0, 2], None, TypeError, "key_start must be a torch.Tensor"),
        (ok.float(), None, TypeError, "key_start must have an integer dtype"),
        (None, torch.tensor([True, False]), TypeError, "key_end must have an integer dtype"),
        (torch.tensor([0, 1, 2]), None, ValueError, r"key_start must have shape \(2,\)"),
        (None, torch.tensor([[7, 7]]), ValueError, r"key_end must have shape \(2,\)"),
        (ok.to("meta"), None, ValueError, "key_start must be on"),
        (torch.tensor([-1, 0]), None, ValueError, r"key_start must be in \[0, M=7\]"),
        (torch.tensor([0, 8]), torch.tensor([7, 8]), ValueError, r"key_start must be in \[0, M=7\]"),
        (torch.tensor([2**32, 0]), None, ValueError, r"key_start must be in \[0, M=7\]"),  # not wrapped
        (ok, torch.tensor([7, 8]), ValueError, r"key_end must be in \[key_start, M=7\]"),
        (torch.tensor([3, 3]), torch.tensor([7, 2]), ValueError, r"key_end must be in \[key_start"),
    ]


STAGES = ["flash_attention", "attention_forward", "attention_backward", "attention_bob"]


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("start, end, error, message", bad_ranges())
def test_bad_key_ranges_are_refused_by_name(stage, backend, start, end, error, message):
    def on_device(x):  # the ranges' own faults, not a device mismatch (except the meta-device case)
        return x.to(DEVICE) if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x

    start, end = on_device(start), on_device(end)
    q = torch.randn(2, 2, 5, 16, device=DEVICE)
    k = v = torch.randn(2, 1, 7, 16, device=DEVICE)
    lse = torch.zeros(2, 2, 5, device=DEVICE)
    args = {"flash_attention": (q, k, v), "attention_forward": (q, k, v),
            "attention_backward": (q, k, v, q, lse, q), "attention_bob": (q, k, v, q, lse, q, q, q)}[stage]
    with pytest.raises(error, match=message):
        getattr(flashbob, stage)(*args, backend=backend, key_start=start, key_end=end)
