"""The Hopper (sm_90) launch path of the BoB's two passes: when each applies, its tiles, its TMA
descriptors and its launch (the kernels: flashbob/_bob_sm90.py).

A pass can run on a device of compute capability 9.0 on 16-bit inputs of head dim 64 or 128 whose
strides TMA can address (unit stride in the head dim, the others and the base address 16-byte
aligned). By default each runs only where it measured faster (`FASTER`); the environment variable
FLASHBOB_SM90=1 runs both wherever they can, =0 never. Everything else (other GPUs, float32, other
head dims, the CPU interpreter) takes the portable kernels, with the same results up to rounding.
The rows pass, and the columns pass at head dim 64 under a full mask, run warp-specialized kernels
(`WARP_SPECIALIZED`): two consumer warpgroups share the tiles a producer warp streams.
"""

from __future__ import annotations

import functools
import os
import warnings

import torch
import triton
from triton.compiler.errors import CompilationError
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from ._bob_sm90 import (
    attention_bob_cols_sm90_kernel,
    attention_bob_cols_ws_sm90_kernel,
    attention_bob_rows_pk_sm90_kernel,
    attention_bob_rows_ws_sm90_kernel,
)
from .validation import triton_interpreter_enabled

ENV = "FLASHBOB_SM90"
WARP_SPECIALIZED = dict(num_warps=4, CONSUMERS=2, CONSUMER_REGS=240, maxnreg=168)
"""The launch settings of a warp-specialized kernel: CONSUMERS warpgroups (num_warps = 4 each: the
default partition and a worker given CONSUMER_REGS registers) and a producer warp (24 registers, in a
warpgroup of its own), 12 warps in all; maxnreg 168 is the most one program of 12 warps is given
(65,536 registers / 384 threads, a multiple of 8), which setmaxnreg moves from the producer's
warpgroup to the consumers'."""
COLS_TILES = {
    (64, True): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=2),
    (64, False): dict(BLOCK_M=64, BLOCK_N=64, STAGES=2, **WARP_SPECIALIZED),
    (128, True): dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, STAGES=2),
    (128, False): dict(BLOCK_M=16, BLOCK_N=64, num_warps=4, STAGES=2),
}
"""(head dim, causal) -> the columns pass's tiles: BLOCK_M queries per step, BLOCK_N keys per
warpgroup, STAGES query tiles (with their row vectors) in flight; with the `WARP_SPECIALIZED`
settings the warp-specialized kernel (CONSUMERS * BLOCK_N keys a program), else one warpgroup a
program. The fastest of H200 sweeps (docs/notes/kernel_notes.md, 2026-12-04): the warp-specialized kernel
is faster at head dim 64 under a full mask only, and neither Gluon form beats the portable pass at
head dim 128 (`FASTER`). Their register and spill counts on sm_90: docs/notes/kernel_notes.md,
"Calibration counts"."""
ROWS_LAUNCHES = {
    64: (dict(BLOCK_M=64, BLOCK_N=32, STAGES=3, **WARP_SPECIALIZED),),
    128: (dict(BLOCK_M=64, BLOCK_N=32, STAGES=2, **WARP_SPECIALIZED),
          dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, STAGES=2)),
}
"""Head dim -> the rows pass's launches, each with its tiles: BLOCK_M queries per warpgroup, BLOCK_N
keys per step, STAGES key tiles in flight. The first launch is the warp-specialized rows kernel (two
consumer warpgroups of BLOCK_M queries share each key tile). It writes every output where its
three (BLOCK_M, D) float32 accumulators fit the registers (head dim 64); at head dim 128 it leaves
sum[P K] to a second, forward-like kernel, Q̄ passing between them in a float32 (B, Hq, N, D) buffer
(11 products per tile, against 10 in one launch). The fastest of H200 sweeps (docs/notes/kernel_notes.md,
2026-12-04; their register and spill counts on sm_90 there, "Calibration counts")."""
VECTOR_ROWS = 32
"""The fewest rows of a float32 row vector that one TMA box moves: 128 bytes, as a box's shared-memory
destination must start 128-byte aligned (the ring slots of the columns pass lie back to back)."""
GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
TMA_DTYPES = {**GL_DTYPES, torch.float32: gl.float32}


FASTER = {"cols": {(64, True), (64, False)}, "rows": {(64, True), (64, False), (128, True), (128, False)}}
"""Pass -> the (head dim, causal) where its Hopper kernel measured faster than the portable one on an
H200 (BoB call at 16K, bf16, same run; docs/notes/kernel_notes.md): the default takes it there only."""


_off_because: str | None = None
"""Why the Hopper path is off for this process (a pass that did not compile), or None."""


def compiled_or_off(launch_pass, *args, **kwargs) -> bool:
    """launch_pass(*args, **kwargs) (`bob_rows` or `bob_cols`); True where it ran. Where its kernel does
    not compile (these kernels are written for Triton 3.6's Gluon; another Triton's may differ), the
    Hopper path goes off for the process with one warning, the launch plan being recorded is dropped,
    and False lets the caller run the portable pass (which writes every output the Hopper one would)."""
    global _off_because
    try:
        launch_pass(*args, **kwargs)
    except CompilationError as err:
        _off_because = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        warnings.warn(f"flashbob: the Hopper BoB kernels do not compile with triton {triton.__version__} "
                      f"({_off_because}); the portable kernels run instead (same results, slower on Hopper)",
                      RuntimeWarning, stacklevel=3)
        from . import launch_plans  # here: launch_plans imports this module

        launch_plans.drop_recording()
        return False
    return True


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
    interpreter). `python -m flashbob.bench sm90` replaces it to compile the path on the CPU."""
    return (q.is_cuda and not triton_interpreter_enabled()
            and torch.cuda.get_device_capability(q.device) == (9, 0))


def applies(pass_name: str, q: torch.Tensor, *tensors: torch.Tensor, causal: bool) -> bool:
    """Whether the BoB pass `pass_name` ("rows" or "cols") of inputs like q (B, Hq, N, D) and
    `tensors` (every tensor the pass reads through TMA, (B, H, L, D)) runs on the Hopper path."""
    if pass_name not in FASTER:
        raise ValueError(f"pass_name={pass_name!r}: expected 'rows' or 'cols'")
    chosen = mode()
    if chosen == "0" or _off_because is not None:
        return False
    if chosen == "auto" and (q.shape[-1], causal) not in FASTER[pass_name]:
        return False
    known = q.shape[-1] in ROWS_LAUNCHES if pass_name == "rows" else (q.shape[-1], causal) in COLS_TILES
    return (q.dtype in GL_DTYPES and known and on_hopper(q)
            and all(_tma_addressable(t) for t in (q, *tensors)))


def _descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:
    """A TMA descriptor of t (B, H, L, D) with boxes (1, 1, rows, D), or of a row vector t (B, H, L)
    with boxes (1, 1, rows); rows past L read as zeros. The stride of a dimension of size 1 is never
    followed, so an aligned one stands in for it."""
    block = [1, 1, rows, *t.shape[3:]]
    aligned = 16 // t.element_size()
    strides = [1]
    for size, stride, inner in zip(t.shape[-2::-1], t.stride()[-2::-1], t.shape[:0:-1]):
        strides.insert(0, stride if size > 1 else -(-strides[0] * inner // aligned) * aligned)
    return TensorDescriptor(t, list(t.shape), strides, block, _shared_layout(tuple(block), t.dtype))


@functools.cache
def _shared_layout(block: tuple[int, ...], dtype: torch.dtype) -> gl.NVMMASharedLayout:
    """The shared-memory layout of a TMA box `block` of `dtype`, made once: a BoB call builds up to 15
    descriptors, and making the layout took 16 of a descriptor's 20 microseconds on the host."""
    return gl.NVMMASharedLayout.get_default_for(list(block), TMA_DTYPES[dtype])


def bob_cols(start, q, k, v, dout, u_q, u_k, u_v, lse, delta, row_c, row_e, grad_k, grad_v, *,
             group: int, common: dict):
    """Launch the columns pass: writes grad_k and grad_v (B, Hkv, M, D) from q, dout, u_q (B, Hq, N, D),
    k, v, u_k, u_v (B, Hkv, M, D; absent cotangents: stand-ins with their flag off in `common`) and
    the float32 row vectors (B, Hq, N) lse, delta, c, e, moved by TMA with the query tiles.
    start(kernel, grid): the launch (or, under `triton_ops.compiling_only`, the compile); common: the
    mask arguments, flags, scales and HEAD_DIM the portable launch takes (its PRECISION is dropped:
    16-bit products)."""
    batch, heads_kv, m, d = k.shape
    tiles = COLS_TILES[d, common["CAUSAL"]]
    queries = [_descriptor(t, tiles["BLOCK_M"]) for t in (q, dout, u_q)]
    queries += [_descriptor(t, max(tiles["BLOCK_M"], VECTOR_ROWS)) for t in (lse, delta, row_c, row_e)]
    keys = [_descriptor(t, tiles["BLOCK_N"]) for t in (k, v, u_k, u_v)]
    args = {name: value for name, value in common.items() if name != "PRECISION"}
    kernel = attention_bob_cols_ws_sm90_kernel if "CONSUMERS" in tiles else attention_bob_cols_sm90_kernel
    grid = (-(-m // (tiles["BLOCK_N"] * tiles.get("CONSUMERS", 1))), batch * heads_kv)
    return start(kernel, grid)(
        queries[0], keys[0], keys[1], queries[1], queries[2], keys[2], keys[3], *queries[3:],
        grad_k, grad_v, *grad_k.stride()[:3],
        q.shape[2], m, heads_kv, group, **args, **tiles,
    )


def bob_rows(start, q, k, v, out, dout, dq, u_q, u_k, u_v, lse, delta, grad_q, grad_dout, row_c, row_e, *,
             svec: int, heads_q: int, group: int, common: dict, allocate):
    """Launch the rows pass: writes grad_q, grad_dout (B, Hq, N, D, contiguous) and the float32 row
    vectors row_c, row_e (B, Hq, N; rows `svec` apart) from q, out, dout, dq, u_q (B, Hq, N, D), k,
    v, u_k, u_v (B, Hkv, M, D; absent cotangents: stand-ins with their flag off in `common`), lse and
    delta, in the launches `ROWS_LAUNCHES` gives. start and common: as `bob_cols` takes them;
    allocate(shape, dtype, device): the launcher's allocator, for the float32 buffer between launches."""
    batch, _, n, d = q.shape
    main, *late = ROWS_LAUNCHES[d]
    args = {name: value for name, value in common.items() if name != "PRECISION"}
    masks = {name: args[name] for name in ("OFFSET", "WINDOW", "qk_scale_log2", "scale", "KeyRange", "CAUSAL",
                                           "HAS_WINDOW", "HAS_RANGE", "HEAD_DIM")}
    m = k.shape[2]
    partial = allocate(grad_q.shape, torch.float32, grad_q.device) if late else grad_q
    queries = [_descriptor(t, main["BLOCK_M"]) for t in (q, dout, u_q)]
    keys = [_descriptor(t, main["BLOCK_N"]) for t in (k, v, u_k, u_v)]
    grid = (-(-n // (main["BLOCK_M"] * main["CONSUMERS"])), batch * heads_q)
    compiled = [start(attention_bob_rows_ws_sm90_kernel, grid)(
        queries[0], keys[0], keys[1], queries[1], queries[2], keys[2], keys[3],
        out, dq, lse, delta, partial, grad_dout, row_c, row_e, *out.stride()[:3], *dq.stride()[:3],
        *grad_q.stride()[:3], svec, n, m, heads_q, group, **args, LATE_PK=bool(late), **main,
    )]
    for tiles in late:
        grid = (-(-n // tiles["BLOCK_M"]), batch * heads_q)
        compiled.append(start(attention_bob_rows_pk_sm90_kernel, grid)(
            _descriptor(q, tiles["BLOCK_M"]), _descriptor(k, tiles["BLOCK_N"]), lse, delta, row_c, row_e,
            partial, grad_q, *grad_q.stride()[:3], svec, n, m, heads_q, group, **masks, **tiles,
        ))
    return compiled
