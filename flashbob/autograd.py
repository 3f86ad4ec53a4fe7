"""The autograd chain of the Triton path: forward -> first backward -> backward-over-backward.

Each stage is a `torch.autograd.Function` whose backward calls the next stage's launcher, so
`torch.autograd.grad(out, ..., create_graph=True)` returns dq, dk, dv that are differentiable once
more, and `torch.func.grad(torch.func.grad(f))` works (the Functions use `setup_context`). The
saved out and lse enter later stages detached: the BoB formulas already hold the total derivative
through them, so giving them a gradient would count it twice.

Forward mode: `AttentionFunction.jvp` runs the fused forward-with-tangent kernel through
`AttentionJvpFunction`, whose backward (a loss on the tangent) runs the first backward and the BoB.
Every Function has a `vmap` rule that folds the vmapped dim into the batch. Derivations and what
each transform supports: docs/forward_mode.md.

The forward, when q, k or v requires grad, first has the kernels of all three stages compiled side
by side (`flashbob.precompile.second_order`: once per family, on CUDA only).

Per-batch-row key ranges travel as a tensor argument `key_range` ((B, 2) int32, or None) of every
Function, just before the options: an integer input, never differentiated (its gradient and
tangent are None), and folded with the batch by the vmap rule like any other tensor.
"""

from __future__ import annotations

import torch

from . import cudnn_passes, precompile, triton_ops
from .function_apply import FastApplyFunction


class _Options:
    """Mask, scale and float32 precision, carried through the chain as one non-tensor argument."""

    __slots__ = ("causal", "window", "scale", "fp32_precision")

    def __init__(self, causal: bool, window: int | None, scale: float, fp32_precision: str | None = None):
        self.causal, self.window, self.scale = causal, window, scale
        self.fp32_precision = fp32_precision

    def kwargs(self) -> dict:
        return {"causal": self.causal, "window": self.window, "scale": self.scale,
                "fp32_precision": self.fp32_precision}


def _fold_vmap(function, info, in_dims, *args):
    """The `vmap` rule of every Function here: the vmapped dim of each tensor argument (broadcast
    where its in_dim is None) is folded into the batch dim, the Function runs once on (V * B, ...)
    tensors, and every tensor output is unfolded to (V, B, ...) with out_dim 0."""
    size = info.batch_size
    folded = []
    for arg, dim in zip(args, in_dims):
        if isinstance(arg, torch.Tensor):
            arg = arg.expand(size, *arg.shape) if dim is None else arg.movedim(dim, 0)
            arg = arg.reshape(size * arg.shape[1], *arg.shape[2:])
        folded.append(arg)
    outputs = function.apply(*folded)
    unfolded = tuple(None if o is None else o.unflatten(0, (size, o.shape[0] // size)) for o in outputs)
    return unfolded, tuple(None if o is None else 0 for o in outputs)


FORWARD_MODE_ERROR = (
    "flash_attention(backend='triton') supports forward mode on its output (torch.func.jvp, "
    "torch.autograd.forward_ad) and gradients through that; forward mode through its gradient "
    "(jvp of grad, forward-over-reverse) or through a tangent (jvp of jvp) is not supported. Use "
    "grad of grad (the FlashBoB kernels) or backend='torch'."
)


def _refuse_forward_mode(ctx, *tangents):
    raise NotImplementedError(FORWARD_MODE_ERROR)


class AttentionFunction(FastApplyFunction):
    """(q, k, v) -> (out, lse); its backward is `AttentionBackwardFunction`, its jvp (forward mode)
    `AttentionJvpFunction`."""

    @staticmethod
    def forward(q, k, v, key_range, opts: _Options):
        if q.requires_grad or k.requires_grad or v.requires_grad:
            precompile.second_order(q, k, v, key_range, opts.kwargs())
        if cudnn_passes.serves(q, k, v, causal=opts.causal, window=opts.window, key_range=key_range):
            return cudnn_passes.forward(q, k, v, causal=opts.causal, scale=opts.scale)
        return triton_ops.forward(q, k, v, key_range=key_range, **opts.kwargs())

    @staticmethod
    def vmap(info, in_dims, *args):
        return _fold_vmap(AttentionFunction, info, in_dims, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, key_range, opts = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.save_for_forward(q, k, v)
        ctx.key_range, ctx.opts = key_range, opts
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)

    @staticmethod
    def jvp(ctx, t_q, t_k, t_v, _t_key_range, _t_opts):
        q, k, v = ctx.saved_tensors
        _, _, t_out = AttentionJvpFunction.apply(q, k, v, t_q, t_k, t_v, ctx.key_range, ctx.opts)
        return t_out, None

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return None, None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = AttentionBackwardFunction.apply(
            q, k, v, out.detach(), lse.detach(), dout, ctx.key_range, ctx.opts
        )
        return dq, dk, dv, None, None


class AttentionBackwardFunction(FastApplyFunction):
    """(q, k, v, out, lse, dout) -> (dq, dk, dv); its backward is the FlashBoB stage."""

    @staticmethod
    def forward(q, k, v, out, lse, dout, key_range, opts: _Options):
        if cudnn_passes.serves(q, k, v, causal=opts.causal, window=opts.window, key_range=key_range):
            return cudnn_passes.backward(q, k, v, out, lse, dout, causal=opts.causal, scale=opts.scale)
        return triton_ops.backward(q, k, v, out, lse, dout, key_range=key_range, **opts.kwargs())

    jvp = staticmethod(_refuse_forward_mode)

    @staticmethod
    def vmap(info, in_dims, *args):
        return _fold_vmap(AttentionBackwardFunction, info, in_dims, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, out, lse, dout, key_range, opts = inputs
        dq, _, _ = output
        ctx.save_for_backward(q, k, v, out, lse, dout, dq)
        ctx.key_range, ctx.opts = key_range, opts
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, u_q, u_k, u_v):
        if u_q is None and u_k is None and u_v is None:
            return (None,) * 8
        q, k, v, out, lse, dout, dq = ctx.saved_tensors
        grad_q, grad_k, grad_v, grad_dout = BobFunction.apply(
            q, k, v, out, lse, dout, dq.detach(), u_q, u_k, u_v, ctx.key_range, ctx.opts
        )
        return grad_q, grad_k, grad_v, None, None, grad_dout, None, None


class BobFunction(FastApplyFunction):
    """The FlashBoB stage as a Function, so that a third derivative fails loudly, not silently."""

    @staticmethod
    def forward(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, key_range, opts: _Options):
        return triton_ops.bob(
            q, k, v, out, lse, dout, dq, u_q, u_k, u_v, key_range=key_range, **opts.kwargs()
        )

    jvp = staticmethod(_refuse_forward_mode)

    @staticmethod
    def vmap(info, in_dims, *args):
        return _fold_vmap(BobFunction, info, in_dims, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(
            "flash_attention(backend='triton') is differentiable twice (forward, backward, "
            "backward-over-backward); a third derivative is not supported. Use backend='torch' "
            "for higher-order derivatives."
        )


class AttentionJvpFunction(FastApplyFunction):
    """(q, k, v, t_q, t_k, t_v) -> (out, lse, t_out) by the fused forward-with-tangent kernel; any
    tangent may be None. Its backward differentiates t_out = J(q, k, v) t: with g the cotangent of
    t_out, <g, J t> = <J^T g, t>, so the gradient with respect to t is the first backward with
    dout = g, and the gradient with respect to (q, k, v) is the FlashBoB stage with dout = g and
    cotangents u = t. out and lse are outputs for the launcher's sake only (not differentiable)."""

    @staticmethod
    def forward(q, k, v, t_q, t_k, t_v, key_range, opts: _Options):
        return triton_ops.jvp(q, k, v, t_q, t_k, t_v, key_range=key_range, **opts.kwargs())

    jvp = staticmethod(_refuse_forward_mode)

    @staticmethod
    def vmap(info, in_dims, *args):
        return _fold_vmap(AttentionJvpFunction, info, in_dims, *args)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, t_q, t_k, t_v, key_range, opts = inputs
        out, lse, _ = output
        ctx.save_for_backward(q, k, v, t_q, t_k, t_v, out, lse)
        ctx.key_range, ctx.opts = key_range, opts
        ctx.mark_non_differentiable(out, lse)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, _dout, _dlse, g):
        if g is None:
            return (None,) * 8
        q, k, v, t_q, t_k, t_v, out, lse = ctx.saved_tensors
        out, lse = out.detach(), lse.detach()
        grads_t = AttentionBackwardFunction.apply(q, k, v, out, lse, g, ctx.key_range, ctx.opts)
        grads_x = (None, None, None)
        if any(ctx.needs_input_grad[:3]) and not (t_q is None and t_k is None and t_v is None):
            dq = grads_t[0].detach()
            grads_x = BobFunction.apply(
                q, k, v, out, lse, g, dq, t_q, t_k, t_v, ctx.key_range, ctx.opts
            )[:3]
        grads_t = tuple(None if t is None else d for t, d in zip((t_q, t_k, t_v), grads_t))
        return (*grads_x, *grads_t, None, None)


def triton_attention(q, k, v, *, causal: bool, window: int | None, scale: float,
                     fp32_precision: str | None = None,
                     key_range: torch.Tensor | None = None) -> torch.Tensor:
    """Triton attention with a twice-differentiable backward. Shapes as `flashbob.flash_attention`;
    key_range (B, 2) int32 or None; fp32_precision applies to every stage. Under torch.compile it is
    the custom op of `flashbob.compiled` instead (first order only)."""
    if torch.compiler.is_compiling():
        from .compiled import compiled_attention

        return compiled_attention(
            q, k, v, causal=causal, window=window, scale=scale, fp32_precision=fp32_precision,
            key_range=key_range,
        )
    out, _ = AttentionFunction.apply(q, k, v, key_range, _Options(causal, window, scale, fp32_precision))
    return out
