"""Fused element-wise ops of the transformer with exact first and second derivatives: `rms_norm`,
`swiglu` (the product silu(gate) * up) and `rope`.

Each is a `torch.autograd.Function` whose backward is a second Function (its VJP op), whose own backward
is the VJP of the VJP, so the outer gradient of test-time training, which differentiates an inner
gradient taken with create_graph=True, runs through them. On CUDA each level's arithmetic is one
compiled kernel (`CompiledOnCuda`: torch.compile of the pure math function, batch and sequence dims
dynamic), where autograd would run and save a chain of eager element-wise kernels; on the CPU the same
math runs eagerly. The VJP of the VJP of `rms_norm` and `swiglu` is `once_differentiable`: a third
derivative is not provided (nothing here needs one). `rope` is linear in x, so its backward is the
transposed rotation, an op of the same class, and it is differentiable any number of times. Each op
also has forward-mode derivatives (`jvp`) at both levels, so `torch.func.jvp` and forward-over-reverse
Hessian-vector products work (under `torch.func.grad` too); `torch.func.vmap` is not supported.
Inside a region that torch.compile traces (`ttt.compile_prefix`) each op is its plain math instead: the
compiler fuses it with its neighbours and derives its first derivative (a compiled graph is
differentiable once).

Per row (the last dim, size n; means are over it), with cotangents g of an op's outputs, u and v of the
VJP op's outputs, and tangents x', w', g', ... in forward mode:

RMSNorm, y = w * xh, xh = r x, r = (mean(x^2) + eps)^(-1/2), the weight w (n,) shared by all rows or,
through functional_call, one per sequence (B, n) for x (B, N, n). From dr/dx = -r^3 x / n, the Jacobian
of xh is J = r (I - xh xh^T / n), symmetric. With h = g w and c = mean(h xh):

    VJP:          dx = J h = r (h - c xh)                  dw = sum over the weight's rows of g xh
    VJP of VJP:   a = mean(u xh), m = mean(u h), p = v g (v: the row's weight's cotangent),
                  d/dg = w J u + v xh,   J u = r (u - a xh)
                  d/dw = sum over the weight's rows of g J u
                  d/dx = r^2 ((3 a c - m) xh - a h - c u) + J p
    The first term of d/dx is the gradient in x of <u, J h> = r <u, h> - (r^3 / n) <u, x> <h, x> at
    fixed h; J p is that of <v, sum g xh>.
    forward mode: b = mean(xh x'), h' = g' w + g w'
                  y'  = w J x' + w' xh
                  dx' = J h' + r^2 ((3 b c - mean(h x')) xh - b h - c x')   (the same Hessian as d/dx)
                  dw' = sum over the weight's rows of g' xh + g J x'

SwiGLU product, y = silu(a) b, with s = sigmoid(a), s0 = silu(a) = a s, s1 = silu'(a) = s (1 + a (1 - s)),
s2 = silu''(a) = s (1 - s) (2 + a (1 - 2 s)):

    VJP:          da = g b s1                              db = g s0
    VJP of VJP:   d/dg = u b s1 + v s0,   d/da = g (u b s2 + v s1),   d/db = u g s1
    forward mode: y' = a' s1 b + s0 b',   da' = (g' b + g b') s1 + g b s2 a',   db' = g' s0 + g s1 a'

RoPE, y = A x = x cos + R(x) sin in the rotate-half layout, R(x) = (-x2, x1) for the halves x1, x2 of
the last dim. R^T = -R, so the VJP is A^T g = g cos - R(g sin) (for tables whose halves are equal, as
`rope_cos_sin`'s are, that is the rotation with -sin), and (A^T)^T = A: `_Rope(transposed)` has the
backward `_Rope(not transposed)`; forward mode applies the op itself to the tangent.

Numerics. The arithmetic runs in float32, or float64 if an input is float64 (the compute dtype: the
inputs' dtypes promoted with float32), and each result is rounded once to its dtype:
    rms_norm(x, w)   -> promote(w.dtype, x.dtype), as the plain module's `w * normed.to(x.dtype)`: xh is
                        rounded to x's dtype before the weight multiplies it (bf16 x, float32 w: a float32
                        output of bf16-rounded xh), and dw uses that rounded xh; grads in x's and w's dtypes
    swiglu(a, b)     -> promote(a.dtype, b.dtype); silu(a) b is rounded once (plain PyTorch under bf16
                        autocast rounds silu(a) to bf16 before the multiply, so bf16 results differ from
                        it by that rounding)
    rope(x, cos, sin) -> x's dtype.
In float32 and float64 the forwards run the ops of the plain implementations (`RMSNorm(fused=False)`,
`F.silu(gate) * up`, `apply_rope` in ttt.models.transformer): the same values eagerly, equal to
rounding compiled; the derivatives equal autograd's through those ops to rounding (for a bf16 x,
autograd rounds g w to bf16 inside the norm's backward; these do not).

Saved for backward (every level recomputes xh, r and sigmoid(a) from its inputs inside its kernel),
per row, against the plain ops (`ttt.experiments.gpu_memory_model` counts both):
    rms_norm     x, w             plain: x in float32 (x itself if float32), rsqrt, xh in x's dtype
    its VJP op   x, w, g          plain: g, three float32 dim-wide terms and two float32 scalars
    swiglu       gate, up         plain: gate, silu(gate), up
    its VJP op   gate, up, g      the MLP's share of an inner-gradient graph: 3 d_ff-wide tensors
                                  (g and the grads of gate and up, which the projections save); plain: 8
    rope         cos, sin         the tables, shared by every call (as plain)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from flashbob.function_apply import FastApplyFunction

from .compiled import CompiledOnCuda


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * x / sqrt(mean(x^2, last dim) + eps), the normalisation in float32 (float64 for float64
    x). x (..., dim); weight (dim,), or (B, dim) with x (B, N, dim): one weight per sequence (what
    functional_call gives a norm whose weight is a per-sequence fast weight). Returns (..., dim) in
    promote_types(weight.dtype, x.dtype). First and second derivatives exact (module docstring)."""
    norm = _rms_norm if torch.compiler.is_compiling() else _RMSNorm.apply
    if weight.dim() == 1 and weight.shape[0] == x.shape[-1]:
        return norm(x, weight, eps)
    if weight.dim() == 2 and x.dim() == 3 and weight.shape == (x.shape[0], x.shape[-1]):
        return norm(x, weight[:, None], eps)
    raise ValueError(
        f"rms_norm's weight must be ({x.shape[-1]},) or, for x (B, N, dim), (B, dim); got weight "
        f"{tuple(weight.shape)} for x {tuple(x.shape)}"
    )


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, computed in float32 (float64 for float64 inputs) and rounded once. gate, up
    (..., d_ff) of one shape -> (..., d_ff) in promote_types(gate.dtype, up.dtype). First and second
    derivatives exact (module docstring)."""
    if gate.shape != up.shape:
        raise ValueError(
            f"swiglu needs gate and up of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}"
        )
    return (_swiglu if torch.compiler.is_compiling() else _SwiGLU.apply)(gate, up)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin (the rotate-half layout), computed in float32 (float64 for float64
    x). x (B, H, N, D), D even; cos, sin (N, D), constant tables (`rope_cos_sin`). Returns (B, H, N, D)
    in x's dtype. Differentiable in x any number of times (module docstring)."""
    if x.shape[-1] % 2 or cos.shape != sin.shape or cos.shape != x.shape[-2:]:
        raise ValueError(
            f"rope needs x (..., N, D) with D even and cos, sin (N, D); got x {tuple(x.shape)}, "
            f"cos {tuple(cos.shape)}, sin {tuple(sin.shape)}"
        )
    if cos.requires_grad or sin.requires_grad:
        raise ValueError("rope's cos and sin tables must be constants (no gradient flows into them)")
    return (_rope if torch.compiler.is_compiling() else _Rope.apply)(x, cos, sin, False)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """The tensors' dtypes promoted with float32: float32, or float64 if one of them is."""
    dtype = torch.float32
    for tensor in tensors:
        dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _plus(total: torch.Tensor | None, term: torch.Tensor) -> torch.Tensor:
    """total + term, total None standing for zero."""
    return term if total is None else total + term


def _mean(t: torch.Tensor) -> torch.Tensor:
    """Mean over the last dim, kept: (..., n) -> (..., 1)."""
    return t.mean(-1, keepdim=True)


# RMSNorm. x (..., n), w (n,) or (B, 1, n) for x (B, N, n), g of y's shape and dtype, u of x's, v of w's.


def _rms_stats(x, eps, dtype):
    """(xh = x r (..., n), r = rsqrt(mean(x^2) + eps) (..., 1)), in dtype."""
    xc = x.to(dtype)
    r = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
    return xc * r, r


def _rms_norm(x, w, eps):
    """y = w * xh, xh rounded to x's dtype first (as the plain module)."""
    normed, _ = _rms_stats(x, eps, _compute_dtype(x, w))
    return w * normed.to(x.dtype)


def _rms_norm_vjp(x, w, g, eps):
    """(dx in x's dtype, dw in w's dtype and shape)."""
    dtype = _compute_dtype(x, w)
    normed, r = _rms_stats(x, eps, dtype)
    g_c = g.to(dtype)
    h = g_c * w.to(dtype)
    dx = r * (h - _mean(h * normed) * normed)
    dw = (g_c * normed.to(x.dtype)).sum_to_size(w.shape)
    return dx.to(x.dtype), dw.to(w.dtype)


def _rms_norm_vjp_vjp(x, w, g, u, v, eps):
    """(d/dx, d/dw or None, d/dg) of <u, dx> + <v, dw>; u or v None stands for zero (not both)."""
    dtype = _compute_dtype(x, w)
    normed, r = _rms_stats(x, eps, dtype)
    g_c, w_c = g.to(dtype), w.to(dtype)
    d_x = d_w = d_g = None
    if u is not None:
        u_c = u.to(dtype)
        h = g_c * w_c
        a, c, m = _mean(u_c * normed), _mean(h * normed), _mean(u_c * h)
        j_u = r * (u_c - a * normed)
        d_x = r * r * ((3 * a * c - m) * normed - a * h - c * u_c)
        d_w = (g_c * j_u).sum_to_size(w.shape).to(w.dtype)
        d_g = w_c * j_u
    if v is not None:
        p = v.to(dtype) * g_c
        d_x = _plus(d_x, r * (p - _mean(p * normed) * normed))
        d_g = _plus(d_g, v.to(dtype) * normed.to(x.dtype))
    return d_x.to(x.dtype), d_w, d_g.to(g.dtype)


def _rms_norm_jvp(x, w, x_t, w_t, eps):
    """y' of the tangents x', w' (either None: zero, not both), in y's dtype."""
    normed, r = _rms_stats(x, eps, _compute_dtype(x, w))
    y_t = None
    if x_t is not None:
        x_t = x_t.to(normed.dtype)
        y_t = w.to(normed.dtype) * (r * (x_t - _mean(normed * x_t) * normed))
    if w_t is not None:
        y_t = _plus(y_t, w_t.to(normed.dtype) * normed.to(x.dtype))
    return y_t.to(torch.promote_types(x.dtype, w.dtype))


def _rms_norm_vjp_jvp(x, w, g, x_t, w_t, g_t, eps):
    """(dx', dw' or None) of the tangents x', w', g' (each None: zero, not all)."""
    dtype = _compute_dtype(x, w)
    normed, r = _rms_stats(x, eps, dtype)
    g_c, w_c = g.to(dtype), w.to(dtype)
    h_t = dx_t = dw_t = None
    if g_t is not None:
        h_t = g_t.to(dtype) * w_c
        dw_t = g_t.to(dtype) * normed.to(x.dtype)
    if w_t is not None:
        h_t = _plus(h_t, g_c * w_t.to(dtype))
    if h_t is not None:
        dx_t = r * (h_t - _mean(h_t * normed) * normed)
    if x_t is not None:
        x_t = x_t.to(dtype)
        h = g_c * w_c
        b, c, e = _mean(normed * x_t), _mean(h * normed), _mean(h * x_t)
        dx_t = _plus(dx_t, r * r * ((3 * b * c - e) * normed - b * h - c * x_t))
        dw_t = _plus(dw_t, g_c * (r * (x_t - b * normed)))
    return dx_t.to(x.dtype), None if dw_t is None else dw_t.sum_to_size(w.shape).to(w.dtype)


# SwiGLU product. a = gate, b = up (..., d_ff), g of y's shape, u of a's, v of b's.


def _silu_slopes(a):
    """(silu(a) = a s, silu'(a) = s (1 + a (1 - s))), s = sigmoid(a)."""
    s = torch.sigmoid(a)
    return a * s, s * (1 + a * (1 - s))


def _silu_slopes_and_curvature(a):
    """(silu(a), silu'(a), silu''(a) = s (1 - s) (2 + a (1 - 2 s))), s = sigmoid(a)."""
    s = torch.sigmoid(a)
    return a * s, s * (1 + a * (1 - s)), s * (1 - s) * (2 + a * (1 - 2 * s))


def _swiglu(a, b):
    """y = silu(a) b, rounded once."""
    dtype = _compute_dtype(a, b)
    return (F.silu(a.to(dtype)) * b.to(dtype)).to(torch.promote_types(a.dtype, b.dtype))


def _swiglu_vjp(a, b, g):
    """(da in a's dtype, db in b's dtype)."""
    dtype = _compute_dtype(a, b)
    a_c, b_c, g_c = a.to(dtype), b.to(dtype), g.to(dtype)
    s0, s1 = _silu_slopes(a_c)
    return (g_c * b_c * s1).to(a.dtype), (g_c * s0).to(b.dtype)


def _swiglu_vjp_vjp(a, b, g, u, v):
    """(d/da, d/db or None, d/dg) of <u, da> + <v, db>; u or v None stands for zero (not both)."""
    dtype = _compute_dtype(a, b)
    a_c, b_c, g_c = a.to(dtype), b.to(dtype), g.to(dtype)
    s0, s1, s2 = _silu_slopes_and_curvature(a_c)
    d_a = d_b = d_g = None
    if u is not None:
        u_c = u.to(dtype)
        d_a = g_c * u_c * b_c * s2
        d_b = (u_c * g_c * s1).to(b.dtype)
        d_g = u_c * b_c * s1
    if v is not None:
        v_c = v.to(dtype)
        d_a = _plus(d_a, g_c * v_c * s1)
        d_g = _plus(d_g, v_c * s0)
    return d_a.to(a.dtype), d_b, d_g.to(g.dtype)


def _swiglu_jvp(a, b, a_t, b_t):
    """y' of the tangents a', b' (either None: zero, not both), in y's dtype."""
    dtype = _compute_dtype(a, b)
    a_c, b_c = a.to(dtype), b.to(dtype)
    s0, s1 = _silu_slopes(a_c)
    y_t = None
    if a_t is not None:
        y_t = a_t.to(dtype) * s1 * b_c
    if b_t is not None:
        y_t = _plus(y_t, s0 * b_t.to(dtype))
    return y_t.to(torch.promote_types(a.dtype, b.dtype))


def _swiglu_vjp_jvp(a, b, g, a_t, b_t, g_t):
    """(da', db' or None) of the tangents a', b', g' (each None: zero, not all)."""
    dtype = _compute_dtype(a, b)
    a_c, b_c, g_c = a.to(dtype), b.to(dtype), g.to(dtype)
    s0, s1, s2 = _silu_slopes_and_curvature(a_c)
    gb_t = da_t = db_t = None
    if g_t is not None:
        gb_t = g_t.to(dtype) * b_c
        db_t = g_t.to(dtype) * s0
    if b_t is not None:
        gb_t = _plus(gb_t, g_c * b_t.to(dtype))
    if gb_t is not None:
        da_t = gb_t * s1
    if a_t is not None:
        a_t = a_t.to(dtype)
        da_t = _plus(da_t, g_c * b_c * s2 * a_t)
        db_t = _plus(db_t, g_c * s1 * a_t)
    return da_t.to(a.dtype), None if db_t is None else db_t.to(b.dtype)


# RoPE. x (..., N, D), cos, sin (N, D).


def _rotate_half(x):
    """R(x) = (-x2, x1) for the halves x1, x2 of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _rope(x, cos, sin, transposed):
    """A x = x cos + R(x) sin, or with transposed A^T x = x cos - R(x sin); in x's dtype."""
    xc = x.to(_compute_dtype(x, cos, sin))
    out = xc * cos - _rotate_half(xc * sin) if transposed else xc * cos + _rotate_half(xc) * sin
    return out.to(x.dtype)


_OWNER = "ttt.models.fused_ops"
rms_norm_math = CompiledOnCuda(_rms_norm, _OWNER, dynamic_rows=True)
rms_norm_vjp_math = CompiledOnCuda(_rms_norm_vjp, _OWNER, dynamic_rows=True)
rms_norm_vjp_vjp_math = CompiledOnCuda(_rms_norm_vjp_vjp, _OWNER, dynamic_rows=True)
rms_norm_jvp_math = CompiledOnCuda(_rms_norm_jvp, _OWNER, dynamic_rows=True)
rms_norm_vjp_jvp_math = CompiledOnCuda(_rms_norm_vjp_jvp, _OWNER, dynamic_rows=True)
swiglu_math = CompiledOnCuda(_swiglu, _OWNER, dynamic_rows=True)
swiglu_vjp_math = CompiledOnCuda(_swiglu_vjp, _OWNER, dynamic_rows=True)
swiglu_vjp_vjp_math = CompiledOnCuda(_swiglu_vjp_vjp, _OWNER, dynamic_rows=True)
swiglu_jvp_math = CompiledOnCuda(_swiglu_jvp, _OWNER, dynamic_rows=True)
swiglu_vjp_jvp_math = CompiledOnCuda(_swiglu_vjp_jvp, _OWNER, dynamic_rows=True)
rope_math = CompiledOnCuda(_rope, _OWNER, dynamic_rows=True)


class _RMSNorm(FastApplyFunction):
    """(x (..., n), w (n,) or (B, 1, n), eps) -> y; backward: `_RMSNormVJP`."""

    @staticmethod
    def forward(x, w, eps):
        return rms_norm_math(x, w, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, ctx.eps = inputs
        ctx.save_for_backward(x, w)
        ctx.save_for_forward(x, w)

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx, dw = _RMSNormVJP.apply(x, w, g, ctx.eps)
        return dx, dw, None

    @staticmethod
    def jvp(ctx, x_t, w_t, _):
        x, w = ctx.saved_tensors
        return rms_norm_jvp_math(x, w, x_t, w_t, ctx.eps)


class _RMSNormVJP(FastApplyFunction):
    """(x, w, g, eps) -> (dx, dw); its backward is the VJP of the VJP, once differentiable."""

    @staticmethod
    def forward(x, w, g, eps):
        return rms_norm_vjp_math(x, w, g, eps)

    @staticmethod
    def setup_context(ctx, inputs, output):
        x, w, g, ctx.eps = inputs
        ctx.save_for_backward(x, w, g)
        ctx.save_for_forward(x, w, g)
        ctx.set_materialize_grads(False)

    @staticmethod
    @once_differentiable
    def backward(ctx, u, v):
        if u is None and v is None:
            return None, None, None, None
        x, w, g = ctx.saved_tensors
        return (*rms_norm_vjp_vjp_math(x, w, g, u, v, ctx.eps), None)

    @staticmethod
    def jvp(ctx, x_t, w_t, g_t, _):
        x, w, g = ctx.saved_tensors
        return rms_norm_vjp_jvp_math(x, w, g, x_t, w_t, g_t, ctx.eps)


class _SwiGLU(FastApplyFunction):
    """(a, b) -> silu(a) b; backward: `_SwiGLUVJP`."""

    @staticmethod
    def forward(a, b):
        return swiglu_math(a, b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return _SwiGLUVJP.apply(a, b, g)

    @staticmethod
    def jvp(ctx, a_t, b_t):
        a, b = ctx.saved_tensors
        return swiglu_jvp_math(a, b, a_t, b_t)


class _SwiGLUVJP(FastApplyFunction):
    """(a, b, g) -> (da, db); its backward is the VJP of the VJP, once differentiable."""

    @staticmethod
    def forward(a, b, g):
        return swiglu_vjp_math(a, b, g)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)
        ctx.set_materialize_grads(False)

    @staticmethod
    @once_differentiable
    def backward(ctx, u, v):
        if u is None and v is None:
            return None, None, None
        a, b, g = ctx.saved_tensors
        return swiglu_vjp_vjp_math(a, b, g, u, v)

    @staticmethod
    def jvp(ctx, a_t, b_t, g_t):
        a, b, g = ctx.saved_tensors
        return swiglu_vjp_jvp_math(a, b, g, a_t, b_t, g_t)


class _Rope(FastApplyFunction):
    """(x, cos, sin, transposed) -> A x or A^T x; backward: the other one, differentiable again."""

    @staticmethod
    def forward(x, cos, sin, transposed):
        return rope_math(x, cos, sin, transposed)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, cos, sin, ctx.transposed = inputs
        ctx.save_for_backward(cos, sin)
        ctx.save_for_forward(cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        return _Rope.apply(g, cos, sin, not ctx.transposed), None, None, None

    @staticmethod
    def jvp(ctx, x_t, *_):
        cos, sin = ctx.saved_tensors
        return rope_math(x_t, cos, sin, ctx.transposed)
