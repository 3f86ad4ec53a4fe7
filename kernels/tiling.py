"""Tile shapes and launch settings for each kernel, by head dim, dtype and device.

Under Triton's CPU interpreter, small tiles (16) keep tests fast and exercise the multi-tile paths
on small sequences. On CUDA the shapes are chosen per kernel from the register budget: the rows
kernel of the BoB holds three (BLOCK_M, D) float32 accumulators, the others one or two.
"""

from __future__ import annotations

import torch
import triton


def block_d(head_dim: int) -> int:
    """Head dim padded to a power of two (at least 16, the smallest tensor-core operand)."""
    return max(16, triton.next_power_of_2(head_dim))


def choose(kernel: str, q: torch.Tensor, **flags) -> dict:
    """Launch settings for `kernel` ("forward", "backward_kv", "backward_q", "bob_rows", "bob_cols")
    with inputs like q (B, H, N, D): BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages."""
    bd = block_d(q.shape[-1])
    if not q.is_cuda:
        return {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_D": bd, "num_warps": 1, "num_stages": 1}
    if kernel == "forward":
        bm, bn, warps, stages = (128, 64, 8, 3) if bd <= 128 else (64, 32, 4, 2)
    elif kernel in ("backward_kv", "backward_q"):
        bm, bn, warps, stages = (64, 64, 4, 2) if bd <= 64 else (64, 64, 8, 2) if bd <= 128 else (32, 32, 4, 1)
    else:
        bm, bn, warps, stages = (64, 64, 4, 2) if bd <= 64 else (64, 32, 8, 2) if bd <= 128 else (32, 16, 4, 1)
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": bd, "num_warps": warps, "num_stages": stages}
