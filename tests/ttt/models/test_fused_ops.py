"""`ttt.models.fused_ops` (RMSNorm, SwiGLU's product, RoPE): float64 gradcheck and gradgradcheck (reverse
and forward mode), values and first and second derivatives equal to the plain implementations of
`ttt.models.transformer`, dtypes, the compiled path (inductor's CPU backend) without recompiling per
chunk length, and a TTT transformer's second-order meta-gradient unchanged by model.fused_ops."""

import functools

import pytest
import torch
import torch.nn.functional as F
from torch.autograd import gradcheck, gradgradcheck

from ttt.inner import InnerLoopConfig
from ttt.layers import TTTConfig, TTTTransformer
from ttt.models import Transformer, TransformerConfig, fused_ops
from ttt.models.compiled import CompiledOnCuda
from ttt.models.fused_ops import rms_norm, rope, swiglu
from ttt.models.transformer import RMSNorm, SwiGLU, apply_rope

DOUBLE = torch.float64
EPS = 1e-5


def plain_rms_norm(x, weight):
    """The plain module's forward, with weight (dim,) or (B, dim) given through functional_call."""
    return torch.func.functional_call(RMSNorm(x.shape[-1], EPS, fused=False), {"weight": weight}, (x,))


def plain_swiglu(gate, up):
    return F.silu(gate) * up


def _tables(seq, dim, dtype=torch.float32):
    """RoPE-like tables (seq, dim) with equal halves, as `rope_cos_sin` gives, but random angles."""
    angles = torch.rand(seq, dim // 2, generator=torch.Generator().manual_seed(seq), dtype=DOUBLE) * 6
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def make_case(name, dtype, *, batch=3, rows=37, dim=48, seed=0):
    """(fused op, plain op, input tensors requiring grad) for one of the cases below."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        values = torch.randn(*shape, generator=gen, dtype=DOUBLE) * scale + shift
        return values.to(dtype).requires_grad_()

    if name == "rms_norm":  # x (rows, dim), one weight
        inputs = (randn(rows, dim), randn(dim, scale=0.3, shift=1.0))
        return (lambda x, w: rms_norm(x, w, EPS)), plain_rms_norm, inputs
    if name == "rms_norm_per_row":  # x (B, rows, dim), one weight per sequence
        inputs = (randn(batch, rows, dim), randn(batch, dim, scale=0.3, shift=1.0))
        return (lambda x, w: rms_norm(x, w, EPS)), plain_rms_norm, inputs
    if name == "swiglu":
        return swiglu, plain_swiglu, (randn(batch, rows, dim, scale=2.0), randn(batch, rows, dim))
    cos, sin = _tables(rows, dim, torch.float32 if dtype != DOUBLE else DOUBLE)
    return (lambda x: rope(x, cos, sin)), (lambda x: apply_rope(x, cos, sin)), (randn(2, batch, rows, dim),)


CASES = ["rms_norm", "rms_norm_per_row", "swiglu", "rope"]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("size", ["B2-N5-D6", "B3-N37-D48"])
def test_gradcheck_and_gradgradcheck_in_float64(name, size):
    """Every Jacobian entry of the small case (fast_mode=False), random projections of the odd-sized one;
    forward mode (jvp) and forward-over-reverse too, and unused outputs' cotangents (None)."""
    small = size == "B2-N5-D6"
    dims = dict(batch=2, rows=5, dim=6) if small else dict(batch=3, rows=37, dim=48)
    op, _, inputs = make_case(name, DOUBLE, **dims)
    assert gradcheck(op, inputs, check_forward_ad=True, check_undefined_grad=True, fast_mode=not small)
    assert gradgradcheck(op, inputs, check_fwd_over_rev=True, check_undefined_grad=True, fast_mode=not small)


def _derivatives(op, inputs, seed, use):
    """y, the first derivatives g_i = d<y, c>/d inputs (create_graph) and the second derivatives
    d<sum_i used g_i, c_i>/d (inputs and c): the inner-step pattern, with `use` picking which first
    derivatives reach the outer loss (an unused one gives its VJP op a None cotangent)."""
    gen = torch.Generator().manual_seed(seed)
    y = op(*inputs)
    cot = torch.randn(y.shape, generator=gen, dtype=DOUBLE).to(y.device, y.dtype).requires_grad_()
    firsts = torch.autograd.grad(y, inputs, cot, create_graph=True)
    outer = sum(
        (f * torch.randn(f.shape, generator=gen, dtype=DOUBLE).to(f.device, f.dtype)).sum()
        for f, used in zip(firsts, use)
        if used
    )
    seconds = torch.autograd.grad(outer, (*inputs, cot), allow_unused=True, materialize_grads=True)
    return [y, *firsts, *seconds]


def _uses(name):
    """Which first derivatives reach the outer loss: all, and each alone."""
    if name == "rope":
        return [(True,)]
    return [(True, True), (True, False), (False, True)]


@pytest.mark.parametrize("name", CASES)
def test_values_and_derivatives_equal_the_plain_ops_in_float64(name):
    for use in _uses(name):
        fused_op, plain_op, inputs = make_case(name, DOUBLE)
        got = _derivatives(fused_op, inputs, 1, use)
        want = _derivatives(plain_op, inputs, 1, use)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)  # the same ops
        for g, w in zip(got, want):
            assert g.dtype == w.dtype
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-13)


def _relative_error(got, want):
    """||got - want|| / ||want|| (||got|| where want is zero: a derivative the outer loss does not reach)."""
    scale = want.norm().item()
    return (got.double() - want).norm().item() / (scale if scale > 0 else 1.0)


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_low_precision_is_as_close_to_float64_as_the_plain_ops(name, dtype):
    """Same dtypes as the plain ops, forward bit-identical to them in float32, and every value and
    derivative at most twice plain PyTorch's error (both against float64, for each use)."""
    for use in _uses(name):
        fused_op, plain_op, inputs = make_case(name, dtype)
        reference = _derivatives(plain_op, [t.detach().double().requires_grad_() for t in inputs], 1, use)
        got = _derivatives(fused_op, inputs, 1, use)
        base = _derivatives(plain_op, inputs, 1, use)
        if dtype == torch.float32:
            torch.testing.assert_close(got[0], base[0], rtol=0, atol=0)
        for g, b, ref in zip(got, base, reference):
            assert g.dtype == b.dtype
            assert _relative_error(g, ref) <= 2 * _relative_error(b, ref) + 1e-7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", CASES)
def test_compiled_on_cuda_is_as_close_to_float64_as_the_plain_ops(name):
    """The compiled CUDA path in bf16: every value and derivative finite and at most twice plain
    PyTorch's bf16 error on the GPU (both against float64)."""
    for use in _uses(name):
        fused_op, plain_op, inputs = make_case(name, torch.bfloat16, batch=4, rows=1031, dim=768)
        inputs = [t.detach().cuda().requires_grad_() for t in inputs]
        if name == "rope":
            cos, sin = (t.cuda() for t in _tables(1031, 768))
            fused_op = functools.partial(rope, cos=cos, sin=sin)
            plain_op = functools.partial(apply_rope, cos=cos, sin=sin)
        reference = _derivatives(plain_op, [t.detach().double().requires_grad_() for t in inputs], 1, use)
        got = _derivatives(fused_op, inputs, 1, use)
        base = _derivatives(plain_op, inputs, 1, use)
        for g, b, ref in zip(got, base, reference):
            assert torch.isfinite(g).all() and g.dtype == b.dtype
            assert _relative_error(g, ref) <= 2 * _relative_error(b, ref) + 1e-6


def test_rms_norm_keeps_the_plain_modules_dtypes():
    """weight * normed.to(x.dtype): float32 weights make a float32 output of bf16 x, bf16 ones a bf16."""
    x = torch.randn(2, 5, 8, dtype=torch.bfloat16, requires_grad=True)
    for weight_dtype in (torch.float32, torch.bfloat16):
        weight = torch.rand(8, dtype=weight_dtype, requires_grad=True)
        out, plain = rms_norm(x, weight, EPS), plain_rms_norm(x, weight)
        assert out.dtype == plain.dtype == torch.promote_types(weight_dtype, torch.bfloat16)
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
        grads = torch.autograd.grad(out.sum(), (x, weight))
        assert [g.dtype for g in grads] == [torch.bfloat16, weight_dtype]


def test_rope_is_differentiable_a_third_time():
    """Linear in x: its backward is the transposed rotation, an op of the same kind (any order)."""
    fused_op, plain_op, (x,) = make_case("rope", DOUBLE, rows=7, dim=8)

    def third(op):
        y = op(x)
        (g1,) = torch.autograd.grad(y.sin().sum(), x, create_graph=True)
        (g2,) = torch.autograd.grad(g1.square().sum(), x, create_graph=True)
        return torch.autograd.grad(g2.pow(3).sum(), x)[0]

    torch.testing.assert_close(third(fused_op), third(plain_op), rtol=1e-12, atol=1e-12)


def test_bad_inputs_are_refused():
    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(x, torch.ones(3, 8), EPS)
    with pytest.raises(ValueError, match="one shape"):
        swiglu(torch.randn(4, 6), torch.randn(4, 5))
    cos, sin = _tables(5, 8)
    with pytest.raises(ValueError, match="cos, sin"):
        rope(x[None], cos[:4], sin[:4])
    with pytest.raises(ValueError, match="constants"):
        rope(x[None], cos.requires_grad_(), sin)


@pytest.fixture
def compiled_on_cpu(monkeypatch):
    """Every math function of fused_ops compiled by torch.compile, on the CPU (inductor's C++ backend),
    instead of the eager CPU path."""
    for name, value in vars(fused_ops).items():
        if isinstance(value, CompiledOnCuda):
            monkeypatch.setattr(fused_ops, name, value.compiled)


@pytest.mark.parametrize("name", CASES)
def test_compiled_path_equals_the_eager_one_and_does_not_recompile_per_chunk_length(name, compiled_on_cpu):
    """Values and derivatives through the compiled math equal the plain ops in float64; a second chunk
    length (rows) and batch size reuse the compiled code (dynamic dims)."""
    for use in _uses(name):
        fused_op, plain_op, inputs = make_case(name, DOUBLE)
        for g, w in zip(_derivatives(fused_op, inputs, 2, use), _derivatives(plain_op, inputs, 2, use)):
            torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-13)
    fused_op, _, inputs = make_case(name, DOUBLE, batch=4, rows=45, seed=1)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for use in _uses(name):
            _derivatives(fused_op, inputs, 3, use)


def test_the_switch_selects_the_fused_ops():
    """model.fused_ops: the fused Functions in the graph, or none of them."""

    def node_names(fused):
        torch.manual_seed(0)
        cfg = TransformerConfig(vocab_size=11, d_model=16, n_heads=2, attention="eager", fused_ops=fused)
        out = Transformer(cfg)(torch.randint(0, 11, (1, 5))).sum()
        names, stack, seen = set(), [out.grad_fn], set()
        while stack:
            node = stack.pop()
            if node is not None and node not in seen:
                seen.add(node)
                names.add(type(node).__name__)
                stack.extend(next_node for next_node, _ in node.next_functions)
        return names

    fused_nodes = {"_RMSNormBackward", "_SwiGLUBackward", "_RopeBackward"}
    assert fused_nodes <= node_names(True)
    assert not fused_nodes & node_names(False)


def make_ttt(fused_ops):
    """A tiny TTT-E2E model in float64 whose fast weights include norms (per-sequence RMSNorm weights)."""
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=37, d_model=16, n_layers=3, n_heads=2, n_kv_heads=1, d_ff=24, window=6,
        attention="eager", fused_ops=fused_ops,
    )  # fmt: skip
    inner = InnerLoopConfig(
        params=["layers.*.ttt_mlp.*", "layers.*.ttt_norm.*", "layers.*.mlp_norm.*"], lr=0.5, steps=2
    )
    model = TTTTransformer(Transformer(cfg), TTTConfig(suffix_len=2, chunk_len=4), inner)
    with torch.no_grad():  # a non-zero extra MLP and norms away from one, as after meta-training
        for block in model.suffix:
            block.ttt_mlp.w_down.weight.normal_(std=0.3)
            block.ttt_norm.weight.uniform_(0.5, 1.5)
    assert all(m.fused == fused_ops for m in model.modules() if isinstance(m, (RMSNorm, SwiGLU)))
    return model.to(DOUBLE)


def test_ttt_second_order_meta_gradient_is_unchanged_by_fused_ops():
    tokens = torch.randint(0, 37, (2, 23), generator=torch.Generator().manual_seed(3))
    results = []
    for fused in (True, False):
        model = make_ttt(fused)
        losses = model.token_losses(tokens)
        results.append([losses.detach(), *torch.autograd.grad(losses.mean(), list(model.parameters()))])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", CASES)
def test_outside_torch_func_transforms_apply_skips_torch_s_per_call_binding(name, monkeypatch):
    """The fused Functions (`FastApplyFunction`) do not go through torch's `Function.apply` outside a
    transform, with the same values and first and second derivatives as torch's apply; under
    torch.func.grad they take torch's."""
    ours = (fused_ops._RMSNorm, fused_ops._RMSNormVJP, fused_ops._SwiGLU, fused_ops._SwiGLUVJP,
            fused_ops._Rope)  # fmt: skip
    torch_apply = torch.autograd.Function.apply.__func__
    seen = []

    def counted(cls, *args, **kwargs):
        seen.append(cls)
        return torch_apply(cls, *args, **kwargs)

    fused_op, _, inputs = make_case(name, DOUBLE)
    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(counted))
    fast = _derivatives(fused_op, inputs, 3, _uses(name)[0])
    assert not any(cls in ours for cls in seen)
    for function in ours:
        monkeypatch.setattr(function, "apply", classmethod(torch_apply))
    for got, want in zip(fast, _derivatives(fused_op, inputs, 3, _uses(name)[0])):
        assert torch.equal(got, want)
    monkeypatch.undo()
    seen.clear()
    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(counted))
    detached = [t.detach() for t in inputs]
    torch.func.grad(lambda first, *rest: fused_op(first, *rest).square().sum())(*detached)
    assert any(cls in ours for cls in seen)
