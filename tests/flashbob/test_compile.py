"""torch.compile(fullgraph=True) of a model that calls flash_attention, at first order: the torch
backend compiles in one graph; the Triton path is one custom-op node (flashbob.compiled). Gradients
against float64 eager plain attention; second order under compile raises a clear error."""

import pytest
import torch
from kernel_cases import DEVICE, rel_err

import flashbob
from flashbob import compiled, triton_ops

TOL = 2e-5
N, M, D = 21, 19, 16


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Attention(torch.nn.Module):
    """A query projection, then causal GQA attention (N > M: some rows see no key)."""

    def __init__(self, backend):
        super().__init__()
        self.backend = backend
        self.q_proj = torch.nn.Linear(D, D, bias=False)

    def forward(self, x, k, v):
        return flashbob.flash_attention(self.q_proj(x), k, v, causal=True, backend=self.backend).sin().sum()


def inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    shapes = ((1, 2, N, D), (1, 1, M, D), (1, 1, M, D))
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(DEVICE, dtype) for s in shapes]


def gradients(model, x, k, v):
    """d loss / d (q_proj.weight, k, v)."""
    k, v = k.clone().requires_grad_(), v.clone().requires_grad_()
    return torch.autograd.grad(model(x, k, v), (model.q_proj.weight, k, v))


def reference_gradients(model):
    ref = Attention("torch").to(DEVICE, torch.float64)
    ref.load_state_dict(model.state_dict())
    return gradients(ref, *inputs(torch.float64))


def graph_recorder(graphs):
    """A Dynamo backend that keeps each traced graph and runs it eagerly through AOTAutograd."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    def record(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=record, bw_compiler=record)


def test_torch_backend_compiles_in_one_graph():
    """With AOTAutograd's eager backend; inductor gives the same (54 s to build on 2 CPU cores)."""
    torch.manual_seed(0)
    model = Attention("torch").to(DEVICE)
    got = gradients(torch.compile(model, fullgraph=True, backend="aot_eager"), *inputs())
    for g, w in zip(got, reference_gradients(model)):
        assert rel_err(g, w) <= TOL


def test_triton_path_is_one_custom_op_node():
    torch.manual_seed(0)
    model = Attention("triton").to(DEVICE)
    graphs = []
    got = gradients(torch.compile(model, fullgraph=True, backend=graph_recorder(graphs)), *inputs())
    for g, w in zip(got, reference_gradients(model)):
        assert rel_err(g, w) <= TOL
    forward, backward = graphs
    ops = [[n.target for n in gm.graph.nodes if n.op == "call_function"] for gm in (forward, backward)]
    assert ops[0].count(torch.ops.flashbob.attention_forward.default) == 1
    assert ops[1].count(torch.ops.flashbob.attention_backward.default) == 1


@pytest.mark.parametrize("wrt", ["k", "weight"])
def test_second_order_under_compile_raises(wrt):
    """PyTorch's AOTAutograd does not differentiate a compiled backward: a second derivative raises
    (for a parameter with a misleading message, 'not used' on the CPU and 'does not require grad' on
    CUDA; allow_unused=True would give None)."""
    model = Attention("triton").to(DEVICE)
    compiled_model = torch.compile(model, fullgraph=True, backend="aot_eager")
    x, k, v = inputs()
    target = k.requires_grad_() if wrt == "k" else model.q_proj.weight
    (g,) = torch.autograd.grad(compiled_model(x, k, v), target, create_graph=True)
    message = (
        "does not currently support double backward"
        if wrt == "k"
        else "appears to not have been used|does not require grad and does not have a grad_fn"
    )
    with pytest.raises(RuntimeError, match=message):
        torch.autograd.grad(g.square().sum(), target)


def test_custom_op_refuses_a_second_derivative():
    q, k, v = (t.requires_grad_() for t in inputs())
    out, _ = compiled.attention_forward_op(q, k, v, True, None, D**-0.5)
    (dq,) = torch.autograd.grad(out.sin().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="under torch.compile is differentiable once"):
        torch.autograd.grad(dq.sum(), q)
