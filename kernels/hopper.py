"""The Hopper (sm_90) launch path of the BoB columns pass: when it applies, its tiles, its TMA
descriptors and its launch (the kernel: kernels/_bob_sm90.py).

It can run on a device of compute capability 9.0 on 16-bit inputs of head dim 64 or 128 whose
strides TMA can address (unit stride in the head dim, the others and the base address 16-byte
aligned). By default it runs only where it measured faster (`FASTER`); the environment variable
FLASHBOB_SM90=1 runs it wherever it can, =0 never. Everything else (other GPUs, float32, other head
dims, the CPU interpreter) takes the portable kernel, with the same results up to rounding. The rows
pass stays portable everywhere.
"""

from __future__ import annotations

import os

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._bob_sm90 import attention_bob_cols_sm90_kernel
from .validation import triton_interpreter_enabled

ENV = "FLASHBOB_SM90"
TILES = {
    64: dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=2, PREFETCH=False),
    128: dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, STAGES=2, PREFETCH=False),
}
"""Head dim -> the columns kernel's tiles: BLOCK_M queries per step, BLOCK_N keys per program (64 per
warpgroup), num_warps, STAGES query tiles in flight, PREFETCH (each tile's row vectors loaded one step
early: slower, kept off). The fastest of an H200 sweep (docs/kernel_notes.md, 2026-12-03); at head dim
64 the kernel spills 10 registers (the portable kernel 19), at 128 none."""
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


FASTER = {(64, True)}
"""(head dim, causal) where the Hopper path measured faster than the portable kernels on an H200 (BoB
call at 16K, bf16, same run; docs/kernel_notes.md): the default takes it there only."""


def mode() -> str:
    """FLASHBOB_SM90: "auto" (unset: where `FASTER` says), "1" (wherever it can run) or "0" (never)."""
    value = os.environ.get(ENV, "auto")
    if value not in ("auto", "0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected auto, 0 or 1")
    return value


def _tma_addressable(t: torch.Tensor) -> bool:
    step = 16 // t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(size == 1 or stride % step == 0 for size, stride in zip(t.shape[:-1], t.stride()[:-1])))


def on_hopper(q: torch.Tensor) -> bool:
    """Whether q lives on a device of compute capability 9.0 that runs compiled kernels (not the
    interpreter). `python -m kernels.bench sm90` replaces it to compile the path on the CPU."""
    return (q.is_cuda and not triton_interpreter_enabled()
            and torch.cuda.get_device_capability(q.device) == (9, 0))


def bob_cols_applies(q: torch.Tensor, *tensors: torch.Tensor, causal: bool) -> bool:
    """Whether the BoB columns pass of inputs like q (B, Hq, N, D) and `tensors` (every tensor the
    pass reads or writes, (B, H, L, D)) runs on the Hopper path."""
    chosen = mode()
    if chosen == "0" or (chosen == "auto" and (q.shape[-1], causal) not in FASTER):
        return False
    return (q.dtype in GL_DTYPES and q.shape[-1] in TILES and on_hopper(q)
            and all(_tma_addressable(t) for t in (q, *tensors)))


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor of t (B, H, L, D) with boxes (1, 1, rows, D); rows past L read as zeros. The
    stride of a dimension of size 1 is never followed, so an aligned one stands in for it."""
    block = [1, 1, rows, t.shape[-1]]
    strides = [stride if size > 1 else t.shape[-1] for size, stride in zip(t.shape, t.stride())]
    layout = gl.NVMMASharedLayout.get_default_for(block, GL_DTYPES[t.dtype])
    return TensorDescriptor(t, list(t.shape), strides, block, layout)


def bob_cols(start, q, k, v, dout, u_q, u_k, u_v, lse, delta, row_c, row_e, grad_k, grad_v, *,
             svec: int, heads_q: int, group: int, common: dict):
    """Launch the columns pass: writes grad_k and grad_v (B, Hkv, M, D) from q, dout, u_q (B, Hq, N, D),
    k, v, u_k, u_v (B, Hkv, M, D; absent cotangents: stand-ins with their flag off in `common`) and
    the float32 row vectors (B, Hq, N) lse, delta, c, e, rows `svec` apart. start(kernel, grid): the
    launch (or, under `triton_ops.compiling_only`, the compile); common: the mask arguments, flags,
    scales and HEAD_DIM the portable launch takes (its PRECISION is dropped: 16-bit products)."""
    batch, heads_kv, m, d = k.shape
    tiles = TILES[d]
    queries = [_descriptor(t, tiles["BLOCK_M"]) for t in (q, dout, u_q)]
    keys = [_descriptor(t, tiles["BLOCK_N"]) for t in (k, v, u_k, u_v)]
    args = {name: value for name, value in common.items() if name != "PRECISION"}
    grid = (-(-m // tiles["BLOCK_N"]), batch * heads_kv)
    return start(attention_bob_cols_sm90_kernel, grid)(
        queries[0], keys[0], keys[1], queries[1], queries[2], keys[2], keys[3],
        lse, delta, row_c, row_e, grad_k, grad_v, *grad_k.stride()[:3], svec,
        q.shape[2], m, heads_q, heads_kv, group, **args, **tiles,
    )
