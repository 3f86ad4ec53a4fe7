"""FlashBoB against the baselines, on one GPU.

    python -m flashbob.bench speed --n 1024,4096,16384 --d 64,128 --mask causal,full --out bench_out

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
  That is the one-launch count; where the rows pass needs two launches (head dim above 64) the
  portable kernels issue 21 and the Hopper path 19, and TFLOP/s still counts 18: useful work, not
  the tensor cores' throughput.
For the baselines' BoB we report time and memory only.
"""

from __future__ import annotations

import os
import sys
import time

import torch

import flashbob
from flashbob.bench import (
    DTYPES,
    Results,
    meta,
    parse_mask,
    peak_gib,
    random_inputs,
    sdpa_attention,
    second_order_call,
    sweep_parser,
    sync_time,
    tflops,
    time_ms,
    visible_pairs,
)
from flashbob.reference import attention_naive

PRODUCTS = {"ours_forward": 2, "ours_backward": 7, "ours_bob": 18, "flash_forward": 2,
            "flash_backward": 5, "flash_fwd_bwd": 7}


def run_case(results: Results, args, n, d, mask, dtype_name, skip: set) -> None:
    from torch.nn.attention import SDPBackend

    causal, window = parse_mask(mask)
    dtype = DTYPES[dtype_name]
    b, h = args.batch, args.heads
    pairs = visible_pairs(n, n, causal, window)
    q, k, v, dout, u_q, u_k, u_v = random_inputs(b, h, h, n, d, dtype)
    base = {"n": n, "d": d, "mask": mask, "dtype": dtype_name, "batch": b, "heads": h}

    def record(method, ms=None, first_s=None, peak=None, io=None, status="ok", products=None):
        results.record(**base, method=method, ms=ms, first_call_s=first_s, peak_gib=peak,
                       inputs_outputs_gib=io, status=status,
                       tflops=tflops(products, pairs, d, b * h, ms) if (ms and products) else None)

    opts = dict(causal=causal, window=window, backend="triton")
    # Ours: forward, first backward, BoB.
    first = sync_time(lambda: flashbob.attention_forward(q, k, v, **opts))
    record("ours_forward", time_ms(lambda: flashbob.attention_forward(q, k, v, **opts), args.budget),
           first, products=PRODUCTS["ours_forward"])
    out, lse = flashbob.attention_forward(q, k, v, **opts)

    def backward(out=out, lse=lse):
        return flashbob.attention_backward(q, k, v, out, lse, dout, **opts)

    first = sync_time(backward)
    record("ours_backward", time_ms(backward, args.budget), first, products=PRODUCTS["ours_backward"])
    del out, lse, backward
    bob = second_order_call(lambda q_, k_, v_: flashbob.flash_attention(q_, k_, v_, **opts),
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
    p = sweep_parser("speed", __doc__, n="1024,4096,16384", budget=1.0, out="bench_out")
    p.add_argument("--mask", default="causal,full", help="comma-separated: full, causal, windowW")
    p.add_argument("--dtype", default="bf16", help="comma-separated: bf16, fp16, fp32")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--baselines", default="flash,naive,sdpa_math",
                   help="comma-separated subset of flash, naive, sdpa_math ('' for none)")
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
        raise SystemExit("python -m flashbob.bench speed needs a CUDA GPU")
    info = meta("flashbob.bench", ["speed", *(sys.argv[1:] if argv is None else argv)], batch=args.batch,
                heads=args.heads)
    info["gpu"] = info["device"]
    results, skip = Results(args.out, info), set()
    for dtype in args.dtype.split(","):
        for mask in args.mask.split(","):
            for d in (int(x) for x in args.d.split(",")):
                for n in sorted(int(x) for x in args.n.split(",")):
                    run_case(results, args, n, d, mask, dtype, skip)
                    plot(results.rows, os.path.join(args.out, "time_vs_n.png"))
    results.finish(markdown_table(results.rows, info))


if __name__ == "__main__":
    main()
