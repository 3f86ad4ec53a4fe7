"""Each Triton kernel's time under several tile settings, on one GPU, to choose flashbob/tiling.py's table.

    python -m flashbob.bench tiles --n 16384 --d 64,128 --mask causal --kernels bob_rows,bob_cols
    python -m flashbob.bench tiles --kernels bob_cols --settings '[[32, 128, 8, 2]]'

Per (head dim, kernel): the default first, then each candidate (BLOCK_M, BLOCK_N, num_warps,
num_stages[, SPLIT for bob_rows]) of CANDIDATES or --settings, through `tiling.override`: the median
ms of the stage that launches the kernel (forward, backward, BoB or JVP) and the kernel's own GPU ms
from the profiler; a setting that does not fit is recorded as failed. Then the registers and
spills of every variant compiled (where Triton reports them). bf16, B=1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

import torch

import flashbob
from flashbob import tiling, triton_ops
from flashbob.bench import (
    Results,
    failure,
    int_list,
    kernel_times,
    meta,
    parse_mask,
    random_inputs,
    str_list,
    time_ms,
)

CANDIDATES = {
    "forward": [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3)],
    "backward_kv": [(64, 64, 4, 2), (64, 64, 8, 2), (32, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2)],
    "backward_q": [(64, 64, 4, 2), (128, 64, 8, 2), (64, 32, 4, 2), (128, 32, 8, 2)],
    "bob_rows": [(64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 2), (128, 64, 8, 2), (64, 32, 4, 3),
                 # a fifth entry sets SPLIT: one launch with smaller row tiles, against the default
                 (32, 32, 4, 2, False), (32, 64, 4, 2, False), (32, 32, 4, 3, False), (32, 64, 4, 3, False)],
    "bob_cols": [(64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 2), (128, 64, 8, 2), (64, 32, 4, 2)],
    "jvp": [(64, 64, 4, 2), (64, 32, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (32, 64, 4, 2)],
}


KERNEL_NAMES = {
    "forward": "attention_forward_kernel",
    "backward_kv": "attention_backward_dkdv_kernel",
    "backward_q": "attention_backward_dq_kernel",
    "bob_rows": "attention_bob_rows_kernel",
    "bob_cols": "attention_bob_cols_kernel",
    "jvp": "attention_jvp_kernel",
}


def compiled_resources(kernel_name: str) -> list[dict]:
    """Registers and spills of every compiled variant of a kernel (empty if Triton hides them)."""
    from flashbob import _backward, _bob, _forward, _jvp

    for module in (_forward, _backward, _bob, _jvp):
        fn = getattr(module, kernel_name, None)
        if fn is None:
            continue
        found = []
        for cache in getattr(fn, "device_caches", {}).values():
            for compiled in cache[0].values():
                found.append({"regs": getattr(compiled, "n_regs", None),
                              "spills": getattr(compiled, "n_spills", None)})
        return found
    return []


def sweep_head_dim(results: Results, args, d: int) -> None:
    causal, window = parse_mask(args.mask)
    opts = dict(causal=causal, window=window, backend="triton")
    q, k, v, dout, u_q, u_k, u_v = random_inputs(1, args.heads, args.heads, args.n, d, torch.bfloat16)
    out, lse = flashbob.attention_forward(q, k, v, **opts)
    dq, _, _ = flashbob.attention_backward(q, k, v, out, lse, dout, **opts)
    stages = {
        "forward": lambda: flashbob.attention_forward(q, k, v, **opts),
        "backward": lambda: flashbob.attention_backward(q, k, v, out, lse, dout, **opts),
        "bob": lambda: flashbob.attention_bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **opts),
        "jvp": lambda: triton_ops.jvp(q, k, v, u_q, u_k, u_v, causal=causal, window=window, scale=d**-0.5),
    }
    for kernel in args.kernels:
        stage = kernel if kernel in ("forward", "jvp") else "backward" if "backward" in kernel else "bob"
        for candidate in [None, *(args.settings or CANDIDATES[kernel])]:
            settings = {}
            if candidate is not None:
                bm, bn, warps, num_stages, *split = candidate
                settings = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, num_stages=num_stages)
                settings.update({"SPLIT": split[0]} if split else {})
            base = dict(n=args.n, d=d, mask=args.mask, kernel=kernel, setting=json.dumps(settings) if settings
                        else "default")
            try:
                with tiling.override(kernel, **settings) if settings else contextlib.nullcontext():
                    ms = time_ms(stages[stage], budget_s=args.budget)
                    own = kernel_times(stages[stage], [KERNEL_NAMES[kernel]])[KERNEL_NAMES[kernel]]
                results.record(**base, stage_ms=ms, kernel_ms=own, status="ok")
            except Exception as exc:  # a setting can exceed shared memory: record it and go on
                results.record(**base, status=failure(exc))
        results.record(n=args.n, d=d, mask=args.mask, kernel=kernel, setting="compiled",
                       status=json.dumps(compiled_resources(KERNEL_NAMES[kernel])))


def table(rows: list[dict], info: dict) -> str:
    lines = [f"{info['device']}; torch {info['torch']}, triton {info['triton']}; commit {info['commit']}",
             "",
             "| d | mask | kernel | setting | stage ms | kernel ms |", "|---|---|---|---|---|---|"]
    for r in rows:
        if r["setting"] == "compiled":
            continue
        ms = (f"{r['stage_ms']:.3f} | {r['kernel_ms']:.3f}" if r["status"] == "ok" else f"{r['status']} | -")
        lines.append(f"| {r['d']} | {r['mask']} | {r['kernel']} | {r['setting']} | {ms} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m flashbob.bench tiles", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=16384)
    p.add_argument("--d", default="64,128")
    p.add_argument("--mask", default="causal")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kernels", default=",".join(CANDIDATES), help="comma-separated subset of tiling.KERNELS")
    p.add_argument("--settings", default=None,
                   help="JSON list of [BLOCK_M, BLOCK_N, num_warps, num_stages(, SPLIT)] (not CANDIDATES)")
    p.add_argument("--budget", type=float, default=0.5, help="seconds of timed calls per setting")
    p.add_argument("--out", default=None, help="directory for results.csv, results.json, table.md")
    args = p.parse_args(argv)
    args.kernels = str_list(args.kernels)
    unknown = set(args.kernels) - set(CANDIDATES)
    if unknown:
        p.error(f"--kernels: unknown {sorted(unknown)}; choose from {', '.join(CANDIDATES)}")
    args.settings = json.loads(args.settings) if args.settings else None
    if not torch.cuda.is_available():
        raise SystemExit("python -m flashbob.bench tiles needs a CUDA GPU")
    info = meta("flashbob.bench", ["tiles", *(sys.argv[1:] if argv is None else argv)])
    results = Results(args.out, info)
    for d in int_list(args.d):
        sweep_head_dim(results, args, d)
    results.finish(table(results.rows, info))


if __name__ == "__main__":
    main()
