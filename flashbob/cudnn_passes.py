"""torch's cuDNN attention kernels as the forward and the first backward of `flash_attention` on CUDA;
the backward-over-backward stays FlashBoB's, fed the out, lse and dq these passes make.

    FLASHBOB_FIRST_PASSES=cudnn python ...      # opt in (default "triton": FlashBoB's own kernels)

cuDNN's fused attention (`torch.ops.aten._scaled_dot_product_cudnn_attention` and its backward) is the
fastest first-order attention torch has on Hopper. Its causal mask is that of a square (query i sees
keys j <= i), so bottom-right causal attention of N queries over M > N keys (a chunk reading the keys
of every position before it) runs as two calls: the first M - N keys, which every query sees (no
mask), and the last N, a square causal block. Their outputs merge by their log-sum-exps,
lse = logaddexp(lse_a, lse_b) and out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse); the backward
runs each part with the merged out and lse (each part's probabilities are then the whole row's
softmax restricted to its keys, and delta = rowsum(dout * out) is the row's), dq is the sum of the
parts' and dk, dv are the parts' side by side. The values are those of one softmax over all M keys.

`serves` says which calls these passes take: CUDA, bf16 or fp16, as many key heads as query heads,
head dim a multiple of 8 up to 128, more than one query, no key ranges, a window that masks
nothing (None, or causal with window >= M), N <= M when causal. Every other call runs FlashBoB's kernels.
"""

from __future__ import annotations

import os

import torch

ENV = "FLASHBOB_FIRST_PASSES"
"""Environment variable: "cudnn" sends the calls `serves` accepts to cuDNN; "triton" (the default) or
unset keeps FlashBoB's own forward and first backward."""

CHOICES = ("triton", "cudnn")


def chosen() -> str:
    """The first passes $FLASHBOB_FIRST_PASSES names ("triton" when unset); a clear error otherwise."""
    value = os.environ.get(ENV, "triton").strip().lower() or "triton"
    if value not in CHOICES:
        raise ValueError(f"{ENV} must be one of {CHOICES}, got {os.environ[ENV]!r}")
    return value


def serves(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, window: int | None,
           key_range: torch.Tensor | None) -> bool:
    """Whether the cuDNN passes run this call: chosen, and the shapes and options of the module
    docstring. q: (B, Hq, N, D); k, v: (B, Hkv, M, D)."""
    if chosen() != "cudnn" or not q.is_cuda or key_range is not None:
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or not q.dtype == k.dtype == v.dtype:
        return False
    n, m, dim = q.shape[2], k.shape[2], q.shape[3]
    if q.shape[1] != k.shape[1] or dim % 8 or dim > 128 or m == 0:
        return False
    if n == 1:  # cuDNN refuses one query over one key (a causal call of one query has such a block)
        return False
    if causal and n > m:
        return False
    return window is None or (causal and window >= m)


def _forward_call(q, k, v, square: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One cuDNN forward, causal within a square block when square: (out (B, H, N, D), lse (B, H, N)
    float32, natural log)."""
    result = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, square, False, scale=scale
    )
    return result[0], result[1].reshape(q.shape[:3])


def _backward_call(dout, q, k, v, out, lse, square: bool, scale: float):
    """One cuDNN backward of the keys k, v (B, H, M_part, D) with the whole rows' out (B, H, N, D) and
    lse (B, H, N): (dq, dk, dv) of this part."""
    unused = torch.empty((), dtype=torch.int64, device=q.device)  # dropout's seed and offset: no dropout
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse.unsqueeze(-1).contiguous(), unused, unused, None, None, None,
        q.shape[2], k.shape[2], 0.0, square, scale=scale,
    )


def _parts(n: int, m: int, causal: bool) -> list[tuple[int, int, bool]]:
    """The key ranges [start, end) of the cuDNN calls and whether each is a square causal block."""
    if not causal:
        return [(0, m, False)]
    return ([(0, m - n, False)] if m > n else []) + [(m - n, m, True)]


def forward(q, k, v, *, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """out (B, H, N, D) in q's dtype and lse (B, H, N) float32 (natural log), as `triton_ops.forward`
    returns them; a call `serves` accepts."""
    parts = [
        _forward_call(q, k[:, :, a:b], v[:, :, a:b], square, scale)
        for a, b, square in _parts(q.shape[2], k.shape[2], causal)
    ]
    if len(parts) == 1:
        out, lse = parts[0]
        return out, lse.contiguous()
    (out_a, lse_a), (out_b, lse_b) = parts
    lse = torch.logaddexp(lse_a, lse_b)
    wide = torch.promote_types(q.dtype, torch.float32)
    weight_a, weight_b = (lse_a - lse).exp().unsqueeze(-1), (lse_b - lse).exp().unsqueeze(-1)
    return (out_a.to(wide) * weight_a + out_b.to(wide) * weight_b).to(q.dtype), lse


def backward(q, k, v, out, lse, dout, *, causal: bool, scale: float):
    """(dq, dk, dv) shaped like (q, k, v), from `forward`'s out and lse (B, H, N); a call `serves`
    accepts."""
    grads = [
        _backward_call(dout, q, k[:, :, a:b], v[:, :, a:b], out, lse, square, scale)
        for a, b, square in _parts(q.shape[2], k.shape[2], causal)
    ]
    if len(grads) == 1:
        return grads[0]
    (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = grads
    wide = torch.promote_types(q.dtype, torch.float32)
    dq = (dq_a.to(wide) + dq_b.to(wide)).to(q.dtype)
    return dq, torch.cat([dk_a, dk_b], dim=2), torch.cat([dv_a, dv_b], dim=2)
