"""Benchmark of FlashBoB against the baselines, on one GPU.

    python -m kernels.bench --n 1024,4096,16384 --d 64,128 --mask causal,full --out bench_out

For every case (B=1, H=8 by default) it measures, in one process:
  ours      forward, first backward, and the BoB (the second `autograd.grad` call alone, through
            `flash_attention`), with the first-call seconds (compile included) and the BoB's peak memory;
  flash     torch SDPA's flash backend: forward, backward, forward+backward (the yardstick);
  naive     plain-PyTorch attention, double backward (until it runs out of memory);
  sdpa_math torch SDPA's math backend, double backward (until it runs out of memory).
It writes results.csv, results.json, a markdown table (table.md) and a plot (time_vs_n.png).

FLOPs: a "product" is one d-deep matrix product over the visible (query, key) pairs,
2 * pairs * D * B * H floating-point operations. Products issued per stage:
  forward 2 (S = Q K^T, P V); first backward 7 in ours (dK/dV kernel: S, dP, dV, dK; dQ kernel:
  S, dP, dQ) and 5 in flash (S, dP, dV, dK, dQ); BoB 18 in ours (rows kernel: S, dP, G (2), W,
  X K, dS U_K, P K, P U_V, (P*G) V; columns kernel: S, dP, G (2), W, G_S^T Q, dS^T U_Q, G_dP^T dO).
For the baselines' BoB we report time and memory only.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

import kernels
from kernels.environment import describe
from kernels.reference import attention_naive

PRODUCTS = {"ours_forward": 2, "ours_backward": 7, "ours_bob": 18, "flash_forward": 2,
            "flash_backward": 5, "flash_fwd_bwd": 7}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def visible_pairs(n: int, m: int, causal: bool, window: int | None) -> int:
    """Number of (query, key) pairs the mask leaves visible."""
    if not causal:
        return n * m
    i = np.arange(n, dtype=np.int64)
    hi = np.minimum(m - 1, i + m - n)
    lo = np.zeros_like(i) if window is None else np.maximum(0, i + m - n - window + 1)
    return int(np.clip(hi - lo + 1, 0, None).sum())


def parse_mask(text: str) -> tuple[bool, int | None]:
    """'full' -> (False, None); 'causal' -> (True, None); 'window1024' -> (True, 1024)."""
    if text == "full":
        return False, None
    if text == "causal":
        return True, None
    if text.startswith("window"):
        return True, int(text[len("window"):])
    raise ValueError(f"--mask entries must be full, causal or windowW, got {text!r}")


def sync_time(fn) -> float:
    """Seconds of one synchronised call (first calls: compilation included)."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def time_ms(fn, budget_s: float = 1.0, max_reps: int = 50, warm_s: float | None = None) -> float:
    """Median milliseconds of fn over as many timed calls as fit in budget_s (at least one). warm_s:
    the seconds of a warm call the caller already made; without it, one warm-up call comes first."""
    first = sync_time(fn) if warm_s is None else warm_s
    reps = int(max(1, min(max_reps, budget_s / max(first, 1e-6))))
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def kernel_times(fn, names, reps: int = 5) -> dict[str, float]:
    """Mean GPU milliseconds per call of fn spent in the kernels whose names start with each of
    `names` (all their launches summed), from the profiler, after one warm call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    events = prof.key_averages()
    return {name: sum(e.device_time_total for e in events if e.key.startswith(name)) / reps / 1e3
            for name in names}


def peak_gib(fn) -> tuple[float, float]:
    """(peak GiB allocated during fn, GiB allocated before it)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() / 2**30, before / 2**30


def make_inputs(b, h, n, d, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen) for _ in range(7)]


def second_order_call(attention, q, k, v, dout, u_q, u_k, u_v):
    """Build out and (dq, dk, dv) with create_graph, return the BoB call (the second grad) as a closure."""
    q, k, v, dout = (t.detach().requires_grad_() for t in (q, k, v, dout))
    out = attention(q, k, v)
    firsts = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)

    def bob():
        return torch.autograd.grad(firsts, (q, k, v, dout), (u_q, u_k, u_v), retain_graph=True)

    return bob


def sdpa_attention(backend, causal):
    from torch.nn.attention import sdpa_kernel

    def attention(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return attention


def tflops(products: int, pairs: int, d: int, bh: int, ms: float) -> float:
    return products * 2 * pairs * d * bh / (ms * 1e-3) / 1e12


def run_case(args, n, d, mask, dtype_name, skip: set) -> list[dict]:
    from torch.nn.attention import SDPBackend

    causal, window = parse_mask(mask)
    dtype = DTYPES[dtype_name]
    b, h = args.batch, args.heads
    pairs = visible_pairs(n, n, causal, window)
    q, k, v, dout, u_q, u_k, u_v = make_inputs(b, h, n, d, dtype)
    base = {"n": n, "d": d, "mask": mask, "dtype": dtype_name, "batch": b, "heads": h}
    rows = []

    def record(method, ms=None, first_s=None, peak=None, io=None, status="ok", products=None):
        row = {**base, "method": method, "ms": ms, "first_call_s": first_s, "peak_gib": peak,
               "inputs_outputs_gib": io, "status": status,
               "tflops": tflops(products, pairs, d, b * h, ms) if (ms and products) else None}
        rows.append(row)
        print(json.dumps(row), flush=True)

    opts = dict(causal=causal, window=window, backend="triton")
    # Ours: forward, first backward, BoB.
    first = sync_time(lambda: kernels.attention_forward(q, k, v, **opts))
    record("ours_forward", time_ms(lambda: kernels.attention_forward(q, k, v, **opts), args.budget),
           first, products=PRODUCTS["ours_forward"])
    out, lse = kernels.attention_forward(q, k, v, **opts)

    def backward(out=out, lse=lse):
        return kernels.attention_backward(q, k, v, out, lse, dout, **opts)

    first = sync_time(backward)
    record("ours_backward", time_ms(backward, args.budget), first, products=PRODUCTS["ours_backward"])
    del out, lse, backward
    bob = second_order_call(lambda q_, k_, v_: kernels.flash_attention(q_, k_, v_, **opts),
                            q, k, v, dout, u_q, u_k, u_v)
    first = sync_time(bob)
    out_bytes = 4 * q.numel() * q.element_size()
    start = time.perf_counter()
    peak, before = peak_gib(bob)  # the warm-up call (peak_gib synchronises before and after it)
    warm = time.perf_counter() - start
    record("ours_bob", time_ms(bob, args.budget, warm_s=warm), first, peak, before + out_bytes / 2**30,
           products=PRODUCTS["ours_bob"])
    del bob
    torch.cuda.empty_cache()

    # Yardstick: torch's flash backend, first order (no window support: windows use causal flash).
    if "flash" in args.baselines:
        flash = sdpa_attention(SDPBackend.FLASH_ATTENTION, causal)
        qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

        def fwd():
            return flash(qg, kg, vg)

        def fwd_bwd():
            return torch.autograd.grad(flash(qg, kg, vg), (qg, kg, vg), dout)

        record("flash_forward", time_ms(fwd, args.budget), products=PRODUCTS["flash_forward"])
        out_f = fwd()
        record("flash_backward", time_ms(lambda: torch.autograd.grad(out_f, (qg, kg, vg), dout,
                                                                     retain_graph=True), args.budget),
               products=PRODUCTS["flash_backward"])
        del out_f
        record("flash_fwd_bwd", time_ms(fwd_bwd, args.budget), products=PRODUCTS["flash_fwd_bwd"])

    # Second-order baselines, until each runs out of memory.
    baselines = {
        "naive_bob": lambda q_, k_, v_: attention_naive(q_, k_, v_, causal=causal, window=window,
                                                        scale=d**-0.5),
        "sdpa_math_bob": sdpa_attention(SDPBackend.MATH, causal) if window is None else None,
    }
    for method, attention in baselines.items():
        if attention is None or method.split("_bob")[0] not in args.baselines:
            continue
        if (method, d, mask) in skip:
            record(method, status="oom (smaller n)")
            continue
        try:
            bob = second_order_call(attention, q, k, v, dout, u_q, u_k, u_v)
            peak, before = peak_gib(bob)
            record(method, time_ms(bob, args.budget), None, peak, before + out_bytes / 2**30)
        except torch.OutOfMemoryError:
            skip.add((method, d, mask))
            record(method, status="oom")
        bob = None
        torch.cuda.empty_cache()
    return rows


def write_results(rows: list[dict], out_dir: str, meta: dict, table: str) -> None:
    """results.json ({"meta", "rows"}), results.csv (one row per measurement) and table.md (`table`) in
    out_dir: the files of every kernel benchmark (this one, benchmarks/jvp.py)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump({"meta": meta, "rows": rows}, f, indent=1)
    with open(os.path.join(out_dir, "results.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    with open(os.path.join(out_dir, "table.md"), "w") as f:
        f.write(table)


def write_outputs(rows: list[dict], out_dir: str, meta: dict) -> None:
    """`write_results` with this benchmark's table, and its plot time_vs_n.png."""
    write_results(rows, out_dir, meta, markdown_table(rows, meta))
    plot(rows, os.path.join(out_dir, "time_vs_n.png"))


def markdown_table(rows: list[dict], meta: dict) -> str:
    """One line per case: ours vs the yardstick and the second-order baselines."""
    cases = sorted({(r["mask"], r["d"], r["n"], r["dtype"]) for r in rows})
    by = {(r["mask"], r["d"], r["n"], r["dtype"], r["method"]): r for r in rows}
    lines = [
        f"GPU: {meta['gpu']}; torch {meta['torch']}, triton {meta['triton']}; commit {meta['commit']}; "
        f"B={meta['batch']}, H={meta['heads']}",
        "",
        "| mask | d | N | dtype | ours fwd ms | ours bwd ms | flash fwd ms | flash bwd ms | "
        "flash fwd+bwd ms | ours BoB ms | BoB / flash fwd+bwd | BoB TFLOP/s | BoB peak GiB | "
        "peak / (in+out) | BoB first call s | naive BoB ms (GiB) | sdpa-math BoB ms (GiB) |",
        "|" + "---|" * 17,
    ]

    def get(case, method, key):
        r = by.get((*case, method))
        return None if r is None else r.get(key)

    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    for case in cases:
        bob, yard = get(case, "ours_bob", "ms"), get(case, "flash_fwd_bwd", "ms")
        peak, io = get(case, "ours_bob", "peak_gib"), get(case, "ours_bob", "inputs_outputs_gib")

        def baseline(method, case=case):
            status = get(case, method, "status")
            if status is None:
                return "-"
            if status != "ok":
                return "OOM"
            return f"{get(case, method, 'ms'):.1f} ({get(case, method, 'peak_gib'):.1f})"

        lines.append(
            f"| {case[0]} | {case[1]} | {case[2]} | {case[3]} | {fmt(get(case, 'ours_forward', 'ms'))} | "
            f"{fmt(get(case, 'ours_backward', 'ms'))} | {fmt(get(case, 'flash_forward', 'ms'))} | "
            f"{fmt(get(case, 'flash_backward', 'ms'))} | {fmt(yard)} | {fmt(bob)} | "
            f"{fmt(bob / yard if bob and yard else None)} | {fmt(get(case, 'ours_bob', 'tflops'), '.0f')} | "
            f"{fmt(peak)} | {fmt(peak / io if peak and io else None, '.3f')} | "
            f"{fmt(get(case, 'ours_bob', 'first_call_s'), '.1f')} | {baseline('naive_bob')} | "
            f"{baseline('sdpa_math_bob')} |"
        )
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["mask"], r["d"], r["dtype"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5 * len(groups), 4), squeeze=False)
    for ax, (mask, d, dtype) in zip(axes[0], groups):
        for method in ("ours_bob", "naive_bob", "sdpa_math_bob", "flash_fwd_bwd", "ours_forward"):
            key = (mask, d, dtype, method)
            pts = sorted((r["n"], r["ms"]) for r in rows
                         if (r["mask"], r["d"], r["dtype"], r["method"]) == key and r["ms"])
            if pts:
                ax.plot(*zip(*pts), marker="o", label=method)
        ax.set(xscale="log", yscale="log", xlabel="N (tokens)", ylabel="ms", title=f"{mask}, d={d}, {dtype}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="1024,4096,16384", help="comma-separated sequence lengths")
    p.add_argument("--d", default="64,128", help="comma-separated head dims")
    p.add_argument("--mask", default="causal,full", help="comma-separated: full, causal, windowW")
    p.add_argument("--dtype", default="bf16", help="comma-separated: bf16, fp16, fp32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--baselines", default="flash,naive,sdpa_math",
                   help="comma-separated subset of flash, naive, sdpa_math ('' for none)")
    p.add_argument("--budget", type=float, default=1.0, help="seconds of timed calls per measurement")
    p.add_argument("--out", default="bench_out", help="output directory")
    args = p.parse_args(argv)
    args.baselines = {x for x in args.baselines.split(",") if x}
    unknown = args.baselines - {"flash", "naive", "sdpa_math"}
    if unknown:
        p.error(f"--baselines: unknown {sorted(unknown)}; choose from flash, naive, sdpa_math")
    for mask in args.mask.split(","):
        parse_mask(mask)
    for dt in args.dtype.split(","):
        if dt not in DTYPES:
            p.error(f"--dtype entries must be in {sorted(DTYPES)}, got {dt!r}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernels.bench needs a CUDA GPU")
    env = describe(torch.device("cuda"), "kernels.bench")
    meta = {**env, "gpu": env["device"], "batch": args.batch, "heads": args.heads}
    rows, skip = [], set()
    for dtype in args.dtype.split(","):
        for mask in args.mask.split(","):
            for d in (int(x) for x in args.d.split(",")):
                for n in sorted(int(x) for x in args.n.split(",")):
                    rows += run_case(args, n, d, mask, dtype, skip)
                    write_outputs(rows, args.out, meta)
    print(markdown_table(rows, meta))


if __name__ == "__main__":
    main()
