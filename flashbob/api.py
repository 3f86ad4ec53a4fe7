"""Public entry points: `flash_attention` and the three stages as plain functions."""

from __future__ import annotations

import torch

from . import reference
from .validation import check_attention_args, check_fp32_precision, check_key_range, check_like


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
    fp32_precision: str | None = None,
    key_start: torch.Tensor | None = None,
    key_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention that can be differentiated twice.

    q: (B, Hq, N, D); k, v: (B, Hkv, M, D) with Hq a multiple of Hkv (GQA / MQA).
    Returns out: (B, Hq, N, D) = softmax(scale * q k^T + mask) v.

    causal: query i sees keys j <= i + (M - N) (bottom-right aligned).
    window: with causal, query i also needs j > i + (M - N) - window.
    key_start, key_end: (B,) integer tensors on q's device, or None (0, and M): every query of batch
    row b sees only keys key_start[b] <= j < key_end[b], on top of the causal / window mask (a
    padding mask: left padding is key_start = number of pad tokens, right padding key_end = length).
    0 <= key_start <= key_end <= M. Not differentiable (integers). Rows that see no key (an empty
    range, or a range that begins after the row's causal limit) output zero, with zero gradients.
    scale: defaults to D ** -0.5.
    backend: "triton" (CUDA, or CPU under TRITON_INTERPRET=1), "torch" (plain PyTorch, any order
    of derivatives), or "auto" (triton on CUDA, torch elsewhere).
    fp32_precision: the Triton path's matrix products for float32 inputs, in all three stages:
    "ieee" (full float32, slowest), "tf32x3" (three TF32 tensor-core products, near float32; default),
    "tf32" (one, ~1e-3 relative error), or None for `validation.DEFAULT_FP32_PRECISION`; costs in
    `validation.check_fp32_precision`. The torch backend follows PyTorch's own matmul settings.
    """
    scale, backend = check_attention_args(q, k, v, causal=causal, window=window, scale=scale, backend=backend)
    fp32_precision = check_fp32_precision(fp32_precision)
    key_range = check_key_range(key_start, key_end, q, k)
    if backend == "torch":
        return reference.attention_naive(
            q, k, v, causal=causal, window=window, scale=scale, key_range=key_range
        )
    from .autograd import triton_attention

    return triton_attention(q, k, v, causal=causal, window=window, scale=scale, fp32_precision=fp32_precision,
                            key_range=key_range)


def attention_forward(q, k, v, *, causal=False, window=None, scale=None, backend="auto", fp32_precision=None,
                      key_start=None, key_end=None):
    """Forward stage. q: (B, Hq, N, D); k, v: (B, Hkv, M, D); key_start, key_end: (B,) or None.

    Returns (out, lse): out (B, Hq, N, D) in q's dtype; lse (B, Hq, N) float32 (float64 for
    float64 inputs), the natural-log row log-sum-exp of the scaled masked scores, -inf on rows that
    see no key. fp32_precision, key_start, key_end: as in `flash_attention` (the later stages need
    the same key ranges).
    """
    scale, backend = check_attention_args(q, k, v, causal=causal, window=window, scale=scale, backend=backend)
    fp32_precision = check_fp32_precision(fp32_precision)
    key_range = check_key_range(key_start, key_end, q, k)
    if backend == "torch":
        return reference.forward_reference(
            q, k, v, causal=causal, window=window, scale=scale, key_range=key_range
        )
    from . import triton_ops

    return triton_ops.forward(q, k, v, causal=causal, window=window, scale=scale,
                              fp32_precision=fp32_precision, key_range=key_range)


def _check_stage_inputs(q, k, out, lse, dout):
    check_like("out", out, q, tuple(q.shape))
    check_like("dout", dout, q, tuple(q.shape))
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(q.shape[:3]):
        raise ValueError(f"lse must be a tensor of shape {tuple(q.shape[:3])} from attention_forward")
    if lse.device != q.device:
        raise ValueError(f"lse must be on {q.device}, got {lse.device}")


def attention_backward(q, k, v, out, lse, dout, *, causal=False, window=None, scale=None, backend="auto",
                       fp32_precision=None, key_start=None, key_end=None):
    """First backward stage. q, out, dout: (B, Hq, N, D); k, v: (B, Hkv, M, D); lse: (B, Hq, N)
    as returned by `attention_forward` with the same options (key_start, key_end (B,) included).

    Returns (dq, dk, dv) shaped like (q, k, v). The result is not itself differentiable; use
    `flash_attention` with autograd for that. fp32_precision: as in `flash_attention`.
    """
    scale, backend = check_attention_args(q, k, v, causal=causal, window=window, scale=scale, backend=backend)
    fp32_precision = check_fp32_precision(fp32_precision)
    _check_stage_inputs(q, k, out, lse, dout)
    key_range = check_key_range(key_start, key_end, q, k)
    if backend == "torch":
        return reference.backward_reference(
            q, k, v, out, lse, dout, causal=causal, window=window, scale=scale, key_range=key_range
        )
    from . import triton_ops

    return triton_ops.backward(q, k, v, out, lse, dout, causal=causal, window=window, scale=scale,
                               fp32_precision=fp32_precision, key_range=key_range)


def attention_bob(
    q, k, v, out, lse, dout, dq, u_q=None, u_k=None, u_v=None, *, causal=False, window=None, scale=None,
    backend="auto", fp32_precision=None, key_start=None, key_end=None,
):
    """Backward-over-backward stage (FlashBoB): the gradients of <u_q, dq> + <u_k, dk> + <u_v, dv>
    with respect to (q, k, v, dout), where (dq, dk, dv) = attention_backward(q, k, v, out, lse, dout).

    q, out, dout, dq, u_q: (B, Hq, N, D); k, v, u_k, u_v: (B, Hkv, M, D); lse: (B, Hq, N).
    dq is the first backward's dq (the Triton path reuses it instead of recomputing it). Any of
    u_q, u_k, u_v may be None (zero): its work is skipped.
    Returns (grad_q, grad_k, grad_v, grad_dout) shaped like (q, k, v, dout).
    fp32_precision, key_start, key_end ((B,) or None): as in `flash_attention`.
    """
    scale, backend = check_attention_args(q, k, v, causal=causal, window=window, scale=scale, backend=backend)
    fp32_precision = check_fp32_precision(fp32_precision)
    _check_stage_inputs(q, k, out, lse, dout)
    check_like("dq", dq, q, tuple(q.shape))
    check_like("u_q", u_q, q, tuple(q.shape))
    check_like("u_k", u_k, q, tuple(k.shape))
    check_like("u_v", u_v, q, tuple(k.shape))
    key_range = check_key_range(key_start, key_end, q, k)
    if backend == "torch":
        return reference.bob_reference(
            q, k, v, out, lse, dout, u_q, u_k, u_v, causal=causal, window=window, scale=scale,
            key_range=key_range,
        )
    from . import triton_ops

    return triton_ops.bob(
        q, k, v, out, lse, dout, dq, u_q, u_k, u_v, causal=causal, window=window, scale=scale,
        fp32_precision=fp32_precision, key_range=key_range,
    )
