"""Seconds to compile the kernels of one second-order family for a GPU, on a machine without one:
one after another, as the first launches compile them ("first-launch"), or side by side on
threads, as `flashbob.precompile` does before the first forward ("ahead").

    python -m flashbob.bench compile --d 128 --dtype fp32 --fp32-precision tf32x3
    python -m flashbob.bench compile --d 64 --dtype fp32 --modes ahead

Each mode runs in a fresh process with an empty Triton cache (TRITON_CACHE_DIR a new directory),
with the launch settings flashbob/tiling.py picks on the GPU (`flashbob.bench.sm90.device_settings`) and a
stand-in for Triton's CUDA driver that names the target and launches nothing, so the compiles are
those of the GPU (same specialization and options; lengths do not specialize). Prints one JSON line
per mode: wall seconds, the kernels compiled and the threads that compiled them, the kernels the
forward, first backward and BoB on the given inputs would still compile afterwards (none wanted),
and the C launchers the compiling threads asked for (Triton builds one per kernel with the system
C compiler; here they are not built, as there is no CUDA library: the GPU's first call has that
cost on top). A GPU's first call also loads each kernel. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import torch
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from flashbob import precompile, tiling, triton_ops, validation
from flashbob.bench import DTYPES, parse_mask, str_list
from flashbob.bench.sm90 import device_settings

MODES = ("first-launch", "ahead")


class CompileOnlyDriver:
    """Stands in for Triton's active driver: device 0, stream 0, the given target; records the
    launchers asked for (kernel name, thread name) and builds none."""

    def __init__(self, target: GPUTarget):
        self.target, self.launchers = target, []

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def launcher_cls(self, src, metadata):
        self.launchers.append((metadata.name, threading.current_thread().name))


def inputs(args) -> tuple:
    """q (B, 4, N, D), k, v (B, --kv-heads, N, D), dout, dq, u_q like q, dk, dv, u_k, u_v like k;
    out, lse: what the forward returns. q, k, v in --layout."""
    dtype, heads_q = DTYPES[args.dtype], 4

    def make(heads):
        if args.layout == "bnhd":
            return torch.randn(args.batch, args.n, heads, args.d).to(dtype).transpose(1, 2)
        return torch.randn(args.batch, heads, args.n, args.d).to(dtype)

    q, k, v = make(heads_q), make(args.kv_heads), make(args.kv_heads)
    like_q = [torch.randn(args.batch, heads_q, args.n, args.d).to(dtype) for _ in range(4)]
    like_k = [torch.randn(args.batch, args.kv_heads, args.n, args.d).to(dtype) for _ in range(4)]
    return q, k, v, torch.zeros(args.batch, heads_q, args.n), like_q, like_k


def launch_all(q, k, v, lse, like_q, like_k, options: dict) -> None:
    """The launchers of forward, first backward and BoB, under `triton_ops.compiling_only`."""
    out, dout, dq, u_q = like_q
    dk, dv, u_k, u_v = like_k
    with triton_ops.compiling_only():
        triton_ops.forward(q, k, v, **options)
        triton_ops.backward(q, k, v, out, lse, dout, **options)
        triton_ops.bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **options)


def child(args) -> dict:
    """One mode, in this (fresh) process."""
    dtype = DTYPES[args.dtype]
    causal, window = parse_mask(args.mask)
    options = dict(causal=causal, window=window, scale=args.d**-0.5, fp32_precision=args.fp32_precision)
    precision = validation.check_fp32_precision(args.fp32_precision) if dtype == torch.float32 else "tf32"
    limits = tiling.DeviceLimits(tiling.parse_shared_mem(args.shared_mem), divmod(args.arch, 10))
    fake = CompileOnlyDriver(GPUTarget("cuda", args.arch, 32))
    driver.set_active(fake)
    compiled = []
    knobs.compilation.listener = lambda src, metadata, **_: compiled.append(
        (metadata["name"], threading.current_thread().name))
    q, k, v, lse, like_q, like_k = inputs(args)
    with contextlib.ExitStack() as stack:
        for stage in ("forward", "backward", "bob"):
            stack.enter_context(device_settings(stage, args.d, dtype, limits, {}, precision))
        start = time.perf_counter()
        if args.child == "ahead":
            precompile.compile_ahead(q, k, v, None, options)
        else:
            launch_all(q, k, v, lse, like_q, like_k, options)
        wall = time.perf_counter() - start
        missed = []
        knobs.runtime.jit_cache_hook = lambda fn, **_: missed.append(fn.name) or True  # skip the compile
        launch_all(q, k, v, lse, like_q, like_k, options)
    return {"mode": args.child, "d": args.d, "dtype": args.dtype, "mask": args.mask,
            "gqa": f"4:{args.kv_heads}", "fp32_precision": args.fp32_precision, "layout": args.layout,
            "cpu_count": os.cpu_count(), "wall_s": round(wall, 2),
            "compiled": sorted(name for name, _ in compiled),
            "compile_threads": sorted({thread for _, thread in compiled}),
            "still_to_compile": missed, "launchers_asked": sorted(fake.launchers)}


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m flashbob.bench compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d", type=int, default=128, help="head dim")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--mask", default="causal", help="full, causal or windowW")
    p.add_argument("--kv-heads", type=int, default=2, help="kv heads of the 4 query heads")
    p.add_argument("--fp32-precision", choices=validation.FP32_PRECISIONS, default=None)
    p.add_argument("--layout", choices=("bhnd", "bnhd"), default="bhnd", help="of q, k, v")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--n", type=int, default=1000, help="sequence length")
    p.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 (H100/H200), 80")
    p.add_argument("--shared-mem", default="227K", help="the device's shared memory per block")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("python -m flashbob.bench compile compiles kernels: unset TRITON_INTERPRET")
    if args.child:
        row = child(args)
        print(json.dumps(row), flush=True)
        return [row]
    modes = str_list(args.modes)
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        p.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    rows = []
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    for mode in modes:
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="flashbob_compile_"))
        done = subprocess.run([sys.executable, "-m", "flashbob.bench", "compile", *passed, "--child", mode],
                              env=env, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise SystemExit(f"mode {mode} failed (rc {done.returncode}):\n{done.stderr[-2000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
