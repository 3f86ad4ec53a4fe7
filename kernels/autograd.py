"""The autograd chain of the Triton path: forward -> first backward -> backward-over-backward.

Each stage is a `torch.autograd.Function` whose backward calls the next stage's launcher, so
`torch.autograd.grad(out, ..., create_graph=True)` returns dq, dk, dv that are differentiable once
more, and `torch.func.grad(torch.func.grad(f))` works (the Functions use `setup_context`). The
saved out and lse enter later stages detached: the BoB formulas already hold the total derivative
through them, so giving them a gradient would count it twice.
"""

from __future__ import annotations

import torch

from . import triton_ops


class _Options:
    """Mask, scale and float32 precision, carried through the chain as one non-tensor argument."""

    __slots__ = ("causal", "window", "scale", "fp32_precision")

    def __init__(self, causal: bool, window: int | None, scale: float, fp32_precision: str | None = None):
        self.causal, self.window, self.scale = causal, window, scale
        self.fp32_precision = fp32_precision

    def kwargs(self) -> dict:
        return {"causal": self.causal, "window": self.window, "scale": self.scale,
                "fp32_precision": self.fp32_precision}


class AttentionFunction(torch.autograd.Function):
    """(q, k, v) -> (out, lse); its backward is `AttentionBackwardFunction`."""

    @staticmethod
    def forward(q, k, v, opts: _Options):
        return triton_ops.forward(q, k, v, **opts.kwargs())

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, opts = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.opts = opts
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, _dlse):
        if dout is None:
            return None, None, None, None
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = AttentionBackwardFunction.apply(q, k, v, out.detach(), lse.detach(), dout, ctx.opts)
        return dq, dk, dv, None


class AttentionBackwardFunction(torch.autograd.Function):
    """(q, k, v, out, lse, dout) -> (dq, dk, dv); its backward is the FlashBoB stage."""

    @staticmethod
    def forward(q, k, v, out, lse, dout, opts: _Options):
        return triton_ops.backward(q, k, v, out, lse, dout, **opts.kwargs())

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, out, lse, dout, opts = inputs
        dq, _, _ = output
        ctx.save_for_backward(q, k, v, out, lse, dout, dq)
        ctx.opts = opts
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, u_q, u_k, u_v):
        if u_q is None and u_k is None and u_v is None:
            return (None,) * 7
        q, k, v, out, lse, dout, dq = ctx.saved_tensors
        grad_q, grad_k, grad_v, grad_dout = BobFunction.apply(
            q, k, v, out, lse, dout, dq.detach(), u_q, u_k, u_v, ctx.opts
        )
        return grad_q, grad_k, grad_v, None, None, grad_dout, None


class BobFunction(torch.autograd.Function):
    """The FlashBoB stage as a Function, so that a third derivative fails loudly, not silently."""

    @staticmethod
    def forward(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, opts: _Options):
        return triton_ops.bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **opts.kwargs())

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


def triton_attention(q, k, v, *, causal: bool, window: int | None, scale: float,
                     fp32_precision: str | None = None) -> torch.Tensor:
    """Triton attention with a twice-differentiable backward. Shapes as `kernels.flash_attention`;
    fp32_precision applies to all three stages."""
    out, _ = AttentionFunction.apply(q, k, v, _Options(causal, window, scale, fp32_precision))
    return out
