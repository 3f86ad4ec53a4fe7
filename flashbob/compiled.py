"""The Triton path as `torch.library` custom ops, for `torch.compile`: Dynamo sees the forward as one
node (with a fake implementation for shapes), and AOTAutograd its backward as another.

Under compile the op is differentiable once: the backward op itself has no derivative, and asking
for one (double backward, or grad of grad) raises `DOUBLE_BACKWARD_ERROR`. Outside compile,
`flashbob.autograd` runs the full chain (second order, forward mode, vmap). This module has no
`from __future__ import annotations`: custom_op reads the type hints to build the op's schema.
"""

import torch

from . import triton_ops

DOUBLE_BACKWARD_ERROR = (
    "flash_attention(backend='triton') under torch.compile is differentiable once; a second derivative "
    "(double backward, torch.func.grad of grad) is not supported inside a compiled region. Run the "
    "second-order step eagerly (outside torch.compile), where the FlashBoB kernels compute it."
)


@torch.library.custom_op("flashbob::attention_forward", mutates_args=())
def attention_forward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, window: int | None, scale: float,
    fp32_precision: str | None = None, key_range: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: (B, Hq, N, D); k, v: (B, Hkv, M, D); key_range (B, 2) int32 or None.
    Returns out (B, Hq, N, D) and lse (B, Hq, N) float32."""
    return triton_ops.forward(
        q, k, v, causal=causal, window=window, scale=scale, fp32_precision=fp32_precision,
        key_range=key_range,
    )


@attention_forward_op.register_fake
def _(q, k, v, causal, window, scale, fp32_precision=None, key_range=None):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashbob::attention_backward", mutates_args=())
def attention_backward_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    dout: torch.Tensor, causal: bool, window: int | None, scale: float, fp32_precision: str | None = None,
    key_range: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """First backward. Returns (dq, dk, dv) shaped like (q, k, v)."""
    return triton_ops.backward(
        q, k, v, out, lse, dout, causal=causal, window=window, scale=scale, fp32_precision=fp32_precision,
        key_range=key_range,
    )


@attention_backward_op.register_fake
def _(q, k, v, out, lse, dout, causal, window, scale, fp32_precision=None, key_range=None):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _forward_setup_context(ctx, inputs, output):
    q, k, v, causal, window, scale, fp32_precision, key_range = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, key_range)
    ctx.options = (causal, window, scale, fp32_precision)


def _forward_backward(ctx, dout, _dlse):
    q, k, v, out, lse, key_range = ctx.saved_tensors
    dq, dk, dv = attention_backward_op(q, k, v, out, lse, dout, *ctx.options, key_range)
    return dq, dk, dv, None, None, None, None, None


def _refuse_double_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def _backward_setup_context(ctx, inputs, output):
    pass


torch.library.register_autograd(
    "flashbob::attention_forward", _forward_backward, setup_context=_forward_setup_context
)
torch.library.register_autograd(
    "flashbob::attention_backward", _refuse_double_backward, setup_context=_backward_setup_context
)


def compiled_attention(
    q, k, v, *, causal: bool, window: int | None, scale: float, fp32_precision: str | None = None,
    key_range: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton attention as one custom op (first order only). Shapes as `flashbob.flash_attention`;
    key_range (B, 2) int32 or None."""
    out, _ = attention_forward_op(q, k, v, causal, window, scale, fp32_precision, key_range)
    return out
