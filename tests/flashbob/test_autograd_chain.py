"""flash_attention through autograd and torch.func: twice differentiable on the Triton path, with
gradients equal to float64 autograd through plain attention, and a clear error on a third."""

import pytest
import torch
from kernel_cases import CASES, DEVICE, autograd_reference, make_inputs, rel_err

import flashbob
from flashbob import triton_ops

TOL = 2e-5


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)


@pytest.mark.parametrize(
    "case", [CASES[2], pytest.param(CASES[3], marks=pytest.mark.many_compiles), CASES[6]], ids=lambda c: c.id
)
def test_double_backward_through_autograd(case):
    q, k, v, dout, u_q, u_k, u_v = make_inputs(case, seed=3)
    ref = autograd_reference(case, q, k, v, dout, u_q, u_k, u_v)
    q, k, v, dout = (t.clone().requires_grad_() for t in (q, k, v, dout))
    out = flashbob.flash_attention(q, k, v, causal=case.causal, window=case.window, backend="triton")
    assert rel_err(out, ref["out"]) <= TOL
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    for name, g in zip(("dq", "dk", "dv"), (dq, dk, dv)):
        assert g.requires_grad and rel_err(g, ref[name]) <= TOL, name
    inner = (dq * u_q).sum() + (dk * u_k).sum() + (dv * u_v).sum()
    bob = torch.autograd.grad(inner, (q, k, v, dout))
    for i, (got, want) in enumerate(zip(bob, ref["bob"])):
        assert rel_err(got, want) <= TOL, f"bob output {i}"


def test_outside_torch_func_transforms_apply_skips_torch_s_per_call_signature_binding(monkeypatch):
    """The Functions' apply (`flashbob.function_apply.FastApplyFunction`) bypasses torch's
    `Function.apply`, which binds the arguments to forward's signature on every call, outside a
    transform, with the same second-order results as torch's own apply; under torch.func.grad it
    takes torch's."""
    from flashbob import autograd

    ours = (autograd.AttentionFunction, autograd.AttentionBackwardFunction, autograd.BobFunction)
    torch_apply = torch.autograd.Function.apply.__func__
    seen = []

    def counted(cls, *args, **kwargs):
        seen.append(cls)
        return torch_apply(cls, *args, **kwargs)

    case = CASES[2]
    q, k, v, dout, u_q, u_k, u_v = make_inputs(case, seed=5)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))

    def attention(q_, k_, v_):
        return flashbob.flash_attention(q_, k_, v_, causal=case.causal, window=case.window, backend="triton")

    def second_order():
        grads = torch.autograd.grad(attention(q, k, v), (q, k, v), dout, create_graph=True)
        return torch.autograd.grad(grads, (q, k, v), (u_q, u_k, u_v))

    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(counted))
    fast = second_order()
    assert not any(cls in ours for cls in seen)
    for function in ours:
        monkeypatch.setattr(function, "apply", classmethod(torch_apply))
    reference = second_order()
    for got, want in zip(fast, reference):
        assert torch.equal(got, want)
    monkeypatch.undo()
    seen.clear()
    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(counted))

    def inner(q_):
        return (attention(q_, k.detach(), v.detach()) * dout).sum()

    torch.func.grad(lambda q_: torch.func.grad(inner)(q_).square().sum())(q.detach())
    assert autograd.AttentionFunction in seen   # under the transforms, torch's own apply


def test_outer_loss_on_dq_only():
    """A MAML-style outer loss that depends on dq alone: u_k and u_v are absent in the BoB."""
    case = CASES[1]
    q, k, v, dout, u_q, _, _ = make_inputs(case, seed=4)
    ref = autograd_reference(case, q, k, v, dout, u_q, None, None)
    q, k, v, dout = (t.clone().requires_grad_() for t in (q, k, v, dout))
    out = flashbob.flash_attention(q, k, v, causal=True, backend="triton")
    (dq,) = torch.autograd.grad(out, (q,), dout, create_graph=True)
    bob = torch.autograd.grad((dq * u_q).sum(), (q, k, v, dout))
    for i, (got, want) in enumerate(zip(bob, ref["bob"])):
        assert rel_err(got, want) <= TOL, f"bob output {i}"


def test_torch_func_grad_of_grad():
    case = CASES[2]
    q, k, v, _, u_q, _, _ = make_inputs(case, seed=5)

    def loss(q_, backend):
        k_, v_ = k.to(q_.dtype), v.to(q_.dtype)
        return flashbob.flash_attention(q_, k_, v_, causal=True, backend=backend).square().sum()

    def inner(q_, backend):
        return (torch.func.grad(loss)(q_, backend) * u_q.to(q_.dtype)).sum()

    got = torch.func.grad(inner)(q, "triton")
    want = torch.func.grad(inner)(q.double(), "torch")
    assert rel_err(got, want) <= TOL


def test_functional_call_second_order():
    case = CASES[6]

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = torch.nn.Linear(case.d, case.d, bias=False)

        def forward(self, x, kv, backend):
            q = self.q_proj(x)
            return flashbob.flash_attention(q, kv, kv, causal=True, window=case.window, backend=backend)

    torch.manual_seed(0)
    model = Attn().to(DEVICE)
    x, kv = make_inputs(case, seed=6)[:2]
    kv = kv.repeat_interleave(case.heads_q // case.heads_kv, dim=1)[:, :1]

    def meta_grad(backend, dtype):
        params = {n: p.detach().to(dtype).requires_grad_() for n, p in model.named_parameters()}
        def inner_loss(p):
            return torch.func.functional_call(model, p, (x.to(dtype), kv.to(dtype), backend)).pow(2).mean()
        (g,) = torch.autograd.grad(inner_loss(params), list(params.values()), create_graph=True)
        adapted = {"q_proj.weight": params["q_proj.weight"] - 0.5 * g}
        return torch.autograd.grad(inner_loss(adapted), list(params.values()))[0]

    assert rel_err(meta_grad("triton", torch.float32), meta_grad("torch", torch.float64)) <= TOL


def test_third_derivative_raises():
    case = CASES[0]
    q, k, v, dout, u_q, _, _ = make_inputs(case)
    q = q.requires_grad_()
    out = flashbob.flash_attention(q, k, v, backend="triton")
    (dq,) = torch.autograd.grad(out, q, dout, create_graph=True)
    (ddq,) = torch.autograd.grad((dq * u_q).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="third derivative"):
        torch.autograd.grad(ddq.sum(), q)


def test_bob_is_deterministic():
    case = CASES[2]
    q, k, v, dout, u_q, u_k, u_v = make_inputs(case, seed=7)
    opts = dict(causal=True, backend="triton")
    out, lse = flashbob.attention_forward(q, k, v, **opts)
    dq, _, _ = flashbob.attention_backward(q, k, v, out, lse, dout, **opts)
    first = flashbob.attention_bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **opts)
    second = flashbob.attention_bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **opts)
    assert all(torch.equal(a, b) for a, b in zip(first, second))
