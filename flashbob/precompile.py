"""Compile the kernels of a second-order call side by side, before its first launch.

Without it, a family's first second-order call (forward, first backward, BoB) compiles its kernels
one after another, each at its first launch: the forward; delta, dK/dV and dQ; the BoB's rows
launches and its columns kernel (tens of seconds in float32). Triton's MLIR and LLVM passes release
the GIL and ptxas runs as a subprocess, so these compiles overlap on threads, and the first call
costs about its slowest kernel (docs/notes/kernel_notes.md, "Compiling a family side by side").

`second_order`, called by the forward of `flashbob.autograd.AttentionFunction` when q, k or v
requires grad, runs the three launchers once under `triton_ops.compiling_only` inside Triton's
`AsyncCompileMode`: each launch they would make is submitted to a thread pool as a compile, with the
settings `flashbob.tiling` gives the real launch and arguments of the same Triton specialization (so
the same cache key; `_stand_in_spec`), and the call returns once all are compiled and in each kernel's
cache. The workers also build each kernel's C launcher, which Triton otherwise builds with the
system C compiler at the first launch. Nothing runs on the GPU and no result changes: the real
launches that follow find their kernels compiled.

Stand-ins, not the real tensors, go through the launchers: batch 1 and a few rows, so they take a
few KiB whatever the call's size. The forward's stand in for q, k and v (the same strides up to
what Triton specializes on), and the stand-in forward splits its keys where the real one would
(`tiling.key_splits`: the split and combine kernels compile instead of the plain one); the first
backward's are the stand-in forward's outputs, with its out as dout; the BoB's the stand-in
backward's outputs, with its dq, dk and dv as the three cotangents: contiguous (B, H, N, D), as
autograd's usually are. A guess that does not hold (another layout of dout at head dims that are
not multiples of 16, or some cotangents absent) only means that kernel compiles at its first
launch, as without this module. Each family (what the stand-ins and options are made of, whether
the keys are split, and the `tiling.override` settings in force) compiles once per process.

Off on the CPU, under TRITON_INTERPRET=1, during CUDA graph capture, inside another
AsyncCompileMode, and when the environment variable FLASHBOB_PRECOMPILE is 0.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import math
import os
import threading
import warnings

import torch
from triton import knobs
from triton.runtime import _async_compile, driver

from . import tiling, triton_ops

ENV = "FLASHBOB_PRECOMPILE"
THREAD_PREFIX = "flashbob-compile"
MAX_WORKERS = 8
"""Compile threads at most: a second-order family has at most 8 kernels (forward, or its split and
combine kernels; delta, dK/dV, dQ, two BoB rows launches, BoB columns)."""

_done: set[tuple] = set()
_lock = threading.Lock()


def switched_on() -> bool:
    """Whether FLASHBOB_PRECOMPILE allows precompiling ("1" or unset: yes, "0": no)."""
    value = os.environ.get(ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV} must be 0 (compile each kernel at its first launch) or 1 (default: "
                         f"compile a family's kernels side by side first), got {value!r}")
    return value == "1"


def _compiles_here(q: torch.Tensor) -> bool:
    """Whether launches on q's device compile kernels now: CUDA, no interpreter, no graph capture,
    and no AsyncCompileMode already active in this thread (Triton allows one)."""
    return (q.is_cuda and not knobs.runtime.interpret and not torch.cuda.is_current_stream_capturing()
            and _async_compile.active_mode.get() is None)


def _rows(length: int, head_dim: int) -> int:
    """A small row count r with r * head_dim = length * head_dim mod 16: the strides of contiguous
    (B, H, r, D) buffers then have the divisibility by 16 of the real (B, H, length, D) buffers."""
    return 16 + length % (16 // math.gcd(head_dim, 16))


def _stride_like(stride: int, wide: bool) -> int:
    """A stride no larger than needed with what Triton specializes on kept: divisibility by 16 and
    equality to 1, and with wide (a stride over one batch row, which costs no memory) 64 bits."""
    if stride <= 16:
        return stride
    return (2**31 if wide and stride >= 2**31 else 16) + stride % 16


def _stand_in_spec(t: torch.Tensor, rows: int) -> tuple:
    """(shape, strides, storage offset) of t's stand-in: t (B, H, L, D) with batch 1 and `rows` rows,
    and what Triton specializes on kept: the data pointer's alignment to 16 bytes, and each stride's
    class (`_stride_like`; head and row strides of 2**31 or more lose their 64 bits). Strides None:
    contiguous (a tensor whose last stride is not 1 is copied to a contiguous one by the launchers,
    like the stand-in's)."""
    shape = (1, t.shape[1], rows, t.shape[3])
    if t.stride(3) != 1:
        return shape, None, 0
    strides = (_stride_like(t.stride(0), True), *(_stride_like(s, False) for s in t.stride()[1:3]), 1)
    return shape, strides, 0 if t.data_ptr() % 16 == 0 else 1


def _stand_in(spec: tuple, like: torch.Tensor) -> torch.Tensor:
    """A tensor of like's dtype and device laid out as `spec` (`_stand_in_spec`), never written."""
    shape, strides, offset = spec
    if strides is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    extent = offset + 1 + sum((n - 1) * s for n, s in zip(shape, strides))
    return torch.empty(extent, dtype=like.dtype, device=like.device).as_strided(shape, strides, offset)


def _stand_in_specs(q, k, v, key_range) -> tuple:
    """The `_stand_in_spec`s of q, k, v and key_range (None without ranges)."""
    rows_q, rows_k = _rows(q.shape[2], q.shape[3]), _rows(k.shape[2], k.shape[3])
    ranges = None
    if key_range is not None:  # (B, 2) int32, passed as key_range.contiguous(): a pointer only
        ranges = ((1, 2), (2, 1), 0 if key_range.contiguous().data_ptr() % 16 == 0 else 1)
    return _stand_in_spec(q, rows_q), _stand_in_spec(k, rows_k), _stand_in_spec(v, rows_k), ranges


def second_order(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_range: torch.Tensor | None,
                 options: dict) -> None:
    """`compile_ahead` once per family, where it applies (on CUDA, ...: see the module docstring);
    the call `flashbob.autograd` makes before a forward whose inputs require grad. A failure to
    precompile is a warning: the kernels then compile at their first launch."""
    if not (switched_on() and _compiles_here(q)):
        return
    try:
        specs = _stand_in_specs(q, k, v, key_range)
    except RuntimeError:  # a tensor without a data pointer (a torch.func wrapper): launches compile
        return
    # tiling's overrides (benchmarks compare launch settings) change what the launchers compile
    overrides = repr(sorted((kernel, sorted(s.items())) for kernel, s in tiling._overrides.items()))
    splits = tiling.key_splits(q, k, options["window"]) > 1
    family = (str(q.device), tuple(t.dtype for t in (q, k, v)), specs, tuple(sorted(options.items())),
              overrides, splits)
    with _lock:
        if family in _done:
            return
        _done.add(family)
        try:
            compile_ahead(q, k, v, key_range, options)
        except Exception as exc:  # the real launches compile and report their own errors
            warnings.warn(f"flashbob: compiling the kernels ahead failed ({type(exc).__name__}: {exc}); "
                          f"they compile at their first launch (set {ENV}=0 to skip this)",
                          RuntimeWarning, stacklevel=3)


def compile_ahead(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_range: torch.Tensor | None,
                  options: dict) -> None:
    """Compile, side by side on a thread pool, every kernel that forward, first backward and BoB
    launch for inputs like q (B, Hq, N, D), k, v (B, Hkv, M, D), key_range ((B, 2) int32 or None)
    and options (causal, window, scale, fp32_precision: the launchers' keyword arguments), through
    stand-ins of them (`_stand_in_spec`); returns when all are compiled and in their kernels'
    caches. Unconditional (`second_order` decides whether it applies)."""
    splits = tiling.key_splits(q, k, options["window"])
    specs = _stand_in_specs(q, k, v, key_range)
    q, k, v, key_range = (None if spec is None else _stand_in(spec, t)
                          for spec, t in zip(specs, (q, k, v, key_range)))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    workers = max(1, min(MAX_WORKERS, cores))
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=THREAD_PREFIX) as pool, \
            CompileAhead(pool, ignore_errors=True), triton_ops.compiling_only():
        with tiling.force_splits(splits):
            out, lse = triton_ops.forward(q, k, v, key_range=key_range, **options)
        dq, dk, dv = triton_ops.backward(q, k, v, out, lse, out, key_range=key_range, **options)
        triton_ops.bob(q, k, v, out, lse, out, dq, dq, dk, dv, key_range=key_range, **options)


class CompileAhead(_async_compile.AsyncCompileMode):
    """Triton's AsyncCompileMode (while active, `JITFunction.warmup` submits each compile to the
    executor; on exit it waits for them and puts each compiled kernel in its JITFunction's cache),
    whose compiles also build the kernel's C launcher, so that its first launch finds it in
    Triton's on-disk cache. Whatever else Triton hands submit (finalize_fn; since 3.9 also cleanup_fn,
    which drops a failed compile's placeholder) goes through unchanged."""

    def submit(self, key, compile_fn, *finish):
        return super().submit(key, lambda: _with_launcher(compile_fn()), *finish)


def _with_launcher(kernel):
    with contextlib.suppress(Exception):  # the first launch builds it again and reports its own error
        driver.active.launcher_cls(kernel.src, kernel.metadata)
    return kernel
