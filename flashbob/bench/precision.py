"""Error against float64 of every stage, next to plain PyTorch's in the same dtype, and the times.

    python -m flashbob.bench precision --dtype bf16 --n 2048 --d 64,128 --mask causal,full
    python -m flashbob.bench precision --dtype fp32 --fp32-precision tf32x3,tf32,ieee --n 4096 --mask causal

For each dtype (and, in float32, each --fp32-precision mode), head dim and mask: the relative error
||x - ref|| / ||ref|| of the eight outputs of `flash_attention` through autograd (out; dq, dk, dv;
the four BoB outputs grad_q, grad_k, grad_v, grad_dout) against float64 on the same rounded inputs
(B=1, --check-heads), and of plain PyTorch autograd attention run in the same dtype (float32 with
TF32 off); "worst" is the largest ratio of the two over the eight. Then, with --time (the default on
a GPU), the ms of forward + backward and of the BoB call at (1, --heads, --n) and the seconds of the
first call (compilation included). Off CUDA (tests), float16 stands in for bfloat16 in the Triton
interpreter.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import flashbob
from flashbob import validation
from flashbob.bench import (
    Results,
    all_orders,
    dtype_of,
    failure,
    fwd_bwd_call,
    int_list,
    median_ms,
    meta,
    parse_mask,
    random_inputs,
    rel,
    second_order_call,
    str_list,
    sync,
)
from flashbob.reference import attention_naive

OUTPUTS = ("out", "dq", "dk", "dv", "grad_q", "grad_k", "grad_v", "grad_dout")


def runs(dtypes: list[str], modes: list[str]) -> list[tuple[str, str | None]]:
    """(dtype, fp32_precision) in order: each float32 mode for fp32, None for the 16-bit dtypes."""
    return [(dt, mode) for dt in dtypes for mode in (modes if dt == "fp32" else [None])]


def reference_errors(d: int, mask: str, n: int, heads: int, dtype: torch.dtype) -> tuple:
    """(low-precision inputs, float64 reference outputs, plain PyTorch's errors in dtype)."""
    causal, window = parse_mask(mask)
    full = random_inputs(1, heads, heads, n, d, torch.float64, seed=1)
    low = [t.to(dtype) for t in full]

    def naive(q, k, v):
        return attention_naive(q, k, v, causal=causal, window=window, scale=d**-0.5)

    ref = all_orders(naive, *[t.double() for t in low])
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch_err = [rel(x, r) for x, r in zip(all_orders(naive, *low), ref)]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return low, ref, torch_err


def measure(args, dtype_name: str, mode: str | None, d: int, mask: str) -> dict:
    dtype = dtype_of(dtype_name)
    causal, window = parse_mask(mask)

    def ours(q, k, v):
        return flashbob.flash_attention(q, k, v, causal=causal, window=window, backend="triton",
                                       fp32_precision=mode)

    low, ref, torch_err = reference_errors(d, mask, args.n, args.check_heads, dtype)
    start = time.perf_counter()
    got = all_orders(ours, *low)
    sync()
    row = {"first_call_s": time.perf_counter() - start}
    for name, x, r, e in zip(OUTPUTS, got, ref, torch_err):
        row[f"err_{name}"], row[f"torch_err_{name}"] = rel(x, r), e
    row["worst_ratio_to_torch"] = max(row[f"err_{n}"] / max(row[f"torch_err_{n}"], 1e-30) for n in OUTPUTS)
    if args.time:
        inputs = random_inputs(1, args.heads, args.heads, args.n, d, dtype, seed=2)
        row["fwd_bwd_ms"] = median_ms(fwd_bwd_call(ours, *inputs[:4]), args.rep_ms)
        row["bob_ms"] = median_ms(second_order_call(ours, *inputs), args.rep_ms)
    return row


def table(rows: list[dict], info: dict) -> str:
    lines = [f"{info['device']}; torch {info['torch']}, triton {info['triton']}; commit {info['commit']}; "
             f"N={info['n']}; errors at H={info['check_heads']}, times at H={info['heads']}",
             "",
             "| dtype | mode | d | mask | worst err / torch | out | dq | dk | dv | grad_q | grad_k | "
             "grad_v | grad_dout | fwd+bwd ms | BoB ms |", "|" + "---|" * 15]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['dtype']} | {r['mode']} | {r['d']} | {r['mask']} | {r['status']} |")
            continue
        ratios = " | ".join(f"{r[f'err_{n}'] / max(r[f'torch_err_{n}'], 1e-30):.2f}" for n in OUTPUTS)
        times = " | ".join("-" if r.get(k) is None else f"{r[k]:.2f}" for k in ("fwd_bwd_ms", "bob_ms"))
        lines.append(f"| {r['dtype']} | {r['mode']} | {r['d']} | {r['mask']} | "
                     f"{r['worst_ratio_to_torch']:.2f} | {ratios} | {times} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m flashbob.bench precision", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bf16", help="comma-separated: bf16, fp16, fp32")
    p.add_argument("--fp32-precision", default=",".join(validation.FP32_PRECISIONS),
                   help="comma-separated float32 modes (fp32 only)")
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--d", default="64,128", help="comma-separated head dims")
    p.add_argument("--mask", default="causal,full", help="comma-separated: full, causal, windowW")
    p.add_argument("--check-heads", type=int, default=2, help="heads of the float64 error check")
    p.add_argument("--heads", type=int, default=8, help="heads of the timed calls")
    p.add_argument("--time", action=argparse.BooleanOptionalAction, default=torch.cuda.is_available())
    p.add_argument("--rep-ms", type=int, default=200, help="timed milliseconds per measurement")
    p.add_argument("--out", default=None, help="directory for results.csv, results.json, table.md")
    args = p.parse_args(argv)
    args.dtype, args.fp32_precision = str_list(args.dtype), str_list(args.fp32_precision)
    for name in args.dtype:
        try:
            dtype_of(name)
        except ValueError as exc:
            p.error(f"--dtype: {exc}")
    for mode in args.fp32_precision:
        try:
            validation.check_fp32_precision(mode)
        except ValueError as exc:
            p.error(f"--fp32-precision: {exc}")
    return args


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    info = meta("flashbob.bench", ["precision", *(sys.argv[1:] if argv is None else argv)], n=args.n,
                heads=args.heads, check_heads=args.check_heads)
    results = Results(args.out, info)
    for dtype_name, mode in runs(args.dtype, args.fp32_precision):
        for d in int_list(args.d):
            for mask in str_list(args.mask):
                base = dict(dtype=dtype_name, mode=mode or "-", d=d, mask=mask, n=args.n)
                try:
                    results.record(**base, **measure(args, dtype_name, mode, d, mask), status="ok")
                except Exception as exc:  # a mode may not compile or fit: record it and go on
                    results.record(**base, status=failure(exc))
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
    results.finish(table(results.rows, info))
    return results.rows


if __name__ == "__main__":
    main()
