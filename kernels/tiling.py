"""Tile shapes and launch settings for each kernel, by head dim and device.

Under Triton's CPU interpreter, small tiles (16) keep tests fast and exercise the multi-tile paths
on small sequences. On CUDA the shapes are chosen per kernel from the register budget: the rows
kernel of the BoB holds three (BLOCK_M, D) float32 accumulators, the others one or two.
`override` replaces a kernel's settings for a while (the benchmark uses it to compare tilings).
"""

from __future__ import annotations

import contextlib

import torch
import triton

KERNELS = ("forward", "backward_kv", "backward_q", "bob_rows", "bob_cols", "jvp")
_overrides: dict[str, dict] = {}


def block_d(head_dim: int) -> int:
    """Head dim padded to a power of two (at least 16, the smallest tensor-core operand)."""
    return max(16, triton.next_power_of_2(head_dim))


def _cuda_default(kernel: str, bd: int, itemsize: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a CUDA launch, from the H200 sweep recorded in
    docs/kernel_notes.md (bf16, N=16384, causal, head dims 64 and 128). Four warps (one warpgroup)
    win everywhere: eight split the row sums of a tile across warpgroups. Head dim 256 takes the
    smallest tiles, for the registers; in float32 its BoB columns kernel also halves the query tile:
    at BLOCK_M 32 it asked for 228 KiB of shared memory and Triton refused it (the H200 has 227)."""
    if bd > 128:
        if kernel == "forward":
            return (64, 32, 4, 2)
        return (16, 32, 4, 1) if kernel == "bob_cols" and itemsize > 2 else (32, 32, 4, 1)
    if kernel == "forward":
        return (64, 64, 4, 3)
    if kernel == "jvp":  # not yet swept: two (BLOCK_M, D) accumulators, one more than the dQ kernel
        return (64, 64, 4, 2) if bd <= 64 else (64, 32, 4, 2)
    if kernel in ("backward_kv", "backward_q"):
        return (64, 64, 4, 2)
    if kernel == "bob_rows":
        return (64, 32, 4, 3) if bd <= 64 else (64, 32, 4, 2)
    return (64, 64, 4, 2) if bd <= 64 else (32, 64, 4, 2)


def split_bob_rows(head_dim: int) -> bool:
    """Whether the BoB rows kernel runs as two launches (Q̄, then dŌ) by default: above head dim 64 its
    three (64, D) float32 accumulators would spill registers. The interpreter follows the same rule."""
    return block_d(head_dim) > 64


def choose(kernel: str, q: torch.Tensor, **flags) -> dict:
    """Launch settings for `kernel` (one of KERNELS) with inputs like q (B, H, N, D):
    BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages, and for bob_rows SPLIT (two launches or one)."""
    bd = block_d(q.shape[-1])
    bm, bn, warps, stages = _cuda_default(kernel, bd, q.element_size()) if q.is_cuda else (16, 16, 1, 1)
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": bd, "num_warps": warps, "num_stages": stages}
    if kernel == "bob_rows":
        cfg["SPLIT"] = split_bob_rows(q.shape[-1])
    cfg.update(_overrides.get(kernel, {}))
    return cfg


@contextlib.contextmanager
def override(kernel: str, **settings):
    """Within the block, launch `kernel` with `settings` (e.g. BLOCK_M=128, num_warps=8; for bob_rows
    also SPLIT=False, one launch)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    known = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages") + (("SPLIT",) if kernel == "bob_rows" else ())
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(f"override({kernel!r}) takes settings {known}, got {unknown}")
    previous = _overrides.get(kernel)
    _overrides[kernel] = settings
    try:
        yield
    finally:
        if previous is None:
            _overrides.pop(kernel)
        else:
            _overrides[kernel] = previous
