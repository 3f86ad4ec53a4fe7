"""The kernel benchmarks: one entry point, `python -m flashbob.bench SUBCOMMAND [options]`.

    speed      FlashBoB's forward, backward and BoB against torch's flash attention (the yardstick)
               and the second-order baselines, over lengths, head dims and masks (`speed.py`)
    ab         this tree's kernels against another commit's (or several), interleaved in one
               process on one GPU: each case's time ratio with its spread over rounds (`ab.py`)
    jvp        forward mode (the fused JVP kernel) and the gradient through it (`jvp.py`)
    ranges     per-batch-row key ranges: what the range code costs, what skipped tiles save (`ranges.py`)
    decode     few query rows over many keys: the split-keys forward against the plain kernel and torch
               SDPA, device time per call from CUDA graphs (`decode.py`)
    precision  error against float64 of the BoB in 16-bit dtypes and of every stage in the float32
               modes, with their times (`precision.py`)
    first-call seconds of a family's first second-order call in fresh processes, and the
               compilations a new length causes (`first_call.py`)
    tiles      a kernel's time under other tile settings (`tiles.py`)
    sm90       what Triton compiles for a GPU, on a machine without one: registers, spills, shared
               memory against `tiling.shared_mem_estimate`, wgmma instructions (`sm90.py`)
    host       the host's time per launcher call on a machine without a GPU (a stand-in driver
               that launches nothing), with launch plans on and off, against another version (`host.py`)
    compile    seconds to compile a family's kernels for a GPU without one, one after another or
               side by side as `flashbob.precompile` does (`compile.py`)

`python -m flashbob.bench SUBCOMMAND --help` lists each one's options. This module holds what they
share: the dtype names, masks, timers, inputs, the yardstick and the one writer of results
(`Results`: results.csv, results.json and table.md in the output directory).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
"""Dtype names of every benchmark's command line."""


def dtype_of(name: str) -> torch.dtype:
    """DTYPES[name], or ValueError naming the choices."""
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


def parse_mask(text: str) -> tuple[bool, int | None]:
    """'full' -> (False, None); 'causal' -> (True, None); 'window1024' -> (True, 1024)."""
    if text == "full":
        return False, None
    if text == "causal":
        return True, None
    if text.startswith("window"):
        return True, int(text[len("window"):])
    raise ValueError(f"mask entries must be full, causal or windowW, got {text!r}")


def sweep_parser(
    subcommand: str, doc: str | None, *, n: str, budget: float, out: str
) -> argparse.ArgumentParser:
    """The parser of a subcommand that sweeps lengths and head dims: --n and --d (comma-separated),
    --heads, --budget (seconds of timed calls per measurement) and --out, with these defaults."""
    p = argparse.ArgumentParser(prog=f"python -m flashbob.bench {subcommand}", description=doc,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default=n, help="comma-separated sequence lengths")
    p.add_argument("--d", default="64,128", help="comma-separated head dims")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--budget", type=float, default=budget, help="seconds of timed calls per measurement")
    p.add_argument("--out", default=out, help="output directory")
    return p


def int_list(text: str) -> list[int]:
    """'64,128' -> [64, 128]."""
    return [int(x) for x in text.split(",") if x]


def str_list(text: str) -> list[str]:
    """'causal,full' -> ['causal', 'full']."""
    return [x for x in text.split(",") if x]


def visible_pairs(n: int, m: int, causal: bool, window: int | None) -> int:
    """Number of (query, key) pairs the mask leaves visible."""
    if not causal:
        return n * m
    i = np.arange(n, dtype=np.int64)
    hi = np.minimum(m - 1, i + m - n)
    lo = np.zeros_like(i) if window is None else np.maximum(0, i + m - n - window + 1)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def tflops(products: int, pairs: int, d: int, bh: int, ms: float) -> float:
    """TFLOP/s of `products` d-deep matrix products over `pairs` visible pairs in each of bh heads."""
    return products * 2 * pairs * d * bh / (ms * 1e-3) / 1e12


def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def sync_time(fn) -> float:
    """Seconds of one synchronised call (first calls: compilation included)."""
    sync()
    start = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - start


def time_ms(fn, budget_s: float = 1.0, max_reps: int = 50, warm_s: float | None = None) -> float:
    """Median milliseconds of fn over as many timed calls as fit in budget_s (at least one; CUDA
    events on a GPU, the host clock elsewhere). warm_s: the seconds of a warm call the caller
    already made; without it, one warm-up call comes first."""
    first = sync_time(fn) if warm_s is None else warm_s
    reps = int(max(1, min(max_reps, budget_s / max(first, 1e-6))))
    return float(np.median([call_ms(fn) for _ in range(reps)]))


def call_ms(fn) -> float:
    """Milliseconds of one call of fn: CUDA events on a GPU, the host clock elsewhere."""
    if not torch.cuda.is_available():
        return 1e3 * sync_time(fn)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def block_ms(fn, iters: int) -> float:
    """Mean milliseconds per call of `iters` calls of fn run back to back: CUDA events around the
    block, so the host's launch work overlaps the GPU's as in a training loop (the host clock off
    CUDA)."""
    if not torch.cuda.is_available():
        return 1e3 * sync_time(lambda: [fn() for _ in range(iters)]) / iters
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sync()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / iters


def host_ms(fn, iters: int) -> float:
    """Mean host milliseconds per call to issue `iters` calls of fn back to back, the GPU's work not
    waited for (it is afterwards): what the launcher costs the CPU, the floor of a call's time
    wherever the GPU's work is shorter."""
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    seconds = time.perf_counter() - start
    sync()
    return 1e3 * seconds / iters


def median_ms(fn, rep_ms: int) -> float:
    """Median ms of fn: triton.testing.do_bench on CUDA (rep_ms of timed calls), one timed call elsewhere."""
    if not torch.cuda.is_available():
        return 1e3 * sync_time(fn)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=min(50, rep_ms // 4), rep=rep_ms, return_mode="median"))


def kernel_times(fn, names, reps: int = 5) -> dict[str, float]:
    """Mean GPU milliseconds per call of fn spent in the kernels whose names start with each of
    `names` (all their launches summed), from the profiler, after one warm call; and under IDLE_KEY
    the GPU's idle milliseconds per call between kernels, from the second call's first kernel to the
    last call's last one (the first call's launches start on an idle GPU, which waits for the host
    between them: the host time of a call, not a gap of calls issued back to back)."""
    from torch.profiler import ProfilerActivity, profile

    if reps < 2:
        raise ValueError(f"reps={reps}: expected at least 2 (the idle time is counted from the second call)")
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    times = {name: sum(e.device_time_total for e in events if e.key.startswith(name)) / reps / 1e3
             for name in names}
    kernels = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                     if e.device_type == torch.autograd.DeviceType.CUDA)
    times[IDLE_KEY] = idle_us(kernels[len(kernels) // reps:]) / (reps - 1) / 1e3
    return times


IDLE_KEY = "idle"
"""kernel_times' key of the GPU's idle time between kernels."""


def idle_us(intervals: list[tuple[float, float]]) -> float:
    """Time inside [first start, last end] of (start, end) intervals that no interval covers."""
    idle, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is not None and start > reach:
            idle += start - reach
        reach = end if reach is None else max(reach, end)
    return idle


def peak_gib(fn) -> tuple[float, float]:
    """(peak GiB allocated during fn, GiB allocated before it)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30, before / 2**30


def random_inputs(b: int, h_q: int, h_kv: int, n: int, d: int, dtype: torch.dtype, seed: int = 0,
                  layout: str = "bhnd", dev: str | None = None) -> list[torch.Tensor]:
    """q, k, v, dout, u_q, u_k, u_v: q, dout, u_q (b, h_q, n, d), the others (b, h_kv, n, d), drawn in
    float64 and rounded to dtype; with layout "bnhd" (B, N, H, D) storage seen as (B, H, N, D)."""
    dev = dev or device()
    gen = torch.Generator(device=dev).manual_seed(seed)

    def make(h):
        shape = (b, n, h, d) if layout == "bnhd" else (b, h, n, d)
        t = torch.randn(shape, device=dev, dtype=torch.float64, generator=gen).to(dtype)
        return t.transpose(1, 2) if layout == "bnhd" else t

    return [make(h) for h in (h_q, h_kv, h_kv, h_q, h_q, h_kv, h_kv)]


def second_order_call(attention, q, k, v, dout, u_q, u_k, u_v):
    """Build out and (dq, dk, dv) with create_graph, return the BoB call (the second grad) as a closure."""
    q, k, v, dout = (t.detach().requires_grad_() for t in (q, k, v, dout))
    firsts = torch.autograd.grad(attention(q, k, v), (q, k, v), dout, create_graph=True)
    return lambda: torch.autograd.grad(firsts, (q, k, v, dout), (u_q, u_k, u_v), retain_graph=True)


def all_orders(attention, q, k, v, dout, u_q, u_k, u_v) -> list[torch.Tensor]:
    """out, (dq, dk, dv) and the four BoB outputs through autograd, for an attention callable."""
    q, k, v, dout = (t.detach().clone().requires_grad_() for t in (q, k, v, dout))
    out = attention(q, k, v)
    firsts = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    bob = torch.autograd.grad(firsts, (q, k, v, dout), (u_q, u_k, u_v))
    return [out.detach(), *(f.detach() for f in firsts), *bob]


def fwd_bwd_call(attention, q, k, v, dout):
    """forward + first backward through autograd, as a closure."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return lambda: torch.autograd.grad(attention(q, k, v), (q, k, v), dout)


def sdpa_attention(backend, causal: bool):
    """(q, k, v) -> torch's scaled_dot_product_attention on one SDPBackend."""
    from torch.nn.attention import sdpa_kernel

    def attention(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attention


YARDSTICKS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION"}
"""The yardsticks, torch SDPA backends by name: flash (FlashAttention-2 class, the first) and cuDNN's
fused attention (FlashAttention-3 class on Hopper)."""


def yardstick(causal: bool, kind: str = "flash"):
    """A yardstick's attention: torch SDPA on the backend YARDSTICKS names (the math backend off CUDA, for
    tests)."""
    from torch.nn.attention import SDPBackend

    if kind not in YARDSTICKS:
        raise ValueError(f"yardstick kind must be one of {sorted(YARDSTICKS)}, got {kind!r}")
    backend = getattr(SDPBackend, YARDSTICKS[kind]) if torch.cuda.is_available() else SDPBackend.MATH
    return sdpa_attention(backend, causal)


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64."""
    ref = ref.detach().double()
    return float((x.detach().double() - ref).norm() / ref.norm().clamp_min(1e-300))


@contextlib.contextmanager
def overrides(settings: dict):
    """Within the block, {kernel: settings} through `flashbob.tiling.override`."""
    from flashbob import tiling

    with contextlib.ExitStack() as stack:
        for kernel, values in settings.items():
            stack.enter_context(tiling.override(kernel, **values))
        yield


def failure(exc: BaseException) -> str:
    """A row's status for a case that raised: the exception's type and first line."""
    return f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


class Results:
    """The rows of one benchmark run and its files in `out` (None: print only): each `record`ed row
    is printed as a JSON line and results.csv / results.json are rewritten at once (a run cut off by
    a time limit keeps every row so far); `finish(table)` writes table.md and prints the table."""

    def __init__(self, out: str | None, meta: dict):
        self.out, self.meta, self.rows = out, meta, []
        if out:
            os.makedirs(out, exist_ok=True)

    def record(self, **row) -> dict:
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        self.save()
        return row

    def save(self) -> None:
        if not self.out or not self.rows:
            return
        with open(os.path.join(self.out, "results.json"), "w") as f:
            json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1)
        names = list(dict.fromkeys(k for row in self.rows for k in row))
        with open(os.path.join(self.out, "results.csv"), "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=names, restval="")
            writer.writeheader()
            writer.writerows(self.rows)

    def finish(self, table: str) -> None:
        self.save()
        if self.out:
            with open(os.path.join(self.out, "table.md"), "w") as f:
                f.write(table)
        print(table, flush=True)


def meta(module: str, argv: list[str] | None = None, **fields) -> dict:
    """The run's record (`flashbob.environment.describe`) plus fields."""
    from flashbob.environment import describe

    return {**describe(torch.device(device()), module, argv), **fields}
