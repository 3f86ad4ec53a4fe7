"""Seconds of a family's first second-order call in a fresh process, and what a new length compiles.

    python -m flashbob.bench first-call --families 0,2 --out first_call_out
    FLASHBOB_PRECOMPILE=0 python -m flashbob.bench first-call ...     # without flashbob.precompile

One fresh process per family of FAMILIES (dtype, head dim, mask, kv heads of 4 query heads, float32
mode), --jobs of them side by side, each with an empty Triton cache (TRITON_CACHE_DIR a new
directory): seconds to the first forward, first backward and BoB at N=--n; then one call at N+1 in
the (B, N, H, D) layout (lengths and strides of other divisibility) and the kernels it compiled (0
wanted: lengths do not specialize). Each row says whether `flashbob.precompile` compiled the family
side by side first. A process still running after --budget seconds is killed and recorded so. Off
CUDA (tests) the processes run the Triton interpreter, which compiles nothing (counts: None), with
float16 for bfloat16.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import flashbob
from flashbob import precompile
from flashbob.bench import DTYPES, Results, device, failure, int_list, meta, parse_mask, random_inputs, sync

FAMILIES = [  # [dtype, head dim, mask, kv heads of 4 query heads, fp32_precision]
    ["bf16", 64, "causal", 4, None],
    ["bf16", 128, "full", 1, None],
    ["fp32", 64, "causal", 4, None],
    ["fp16", 256, "causal", 4, None],
    ["fp32", 128, "causal", 2, "tf32x3"],
    ["bf16", 80, "window64", 2, None],
    ["fp32", 64, "causal", 4, "tf32"],
]
KERNEL_FNS = ("attention_forward_kernel", "attention_backward_dkdv_kernel", "attention_backward_dq_kernel",
              "attention_bob_rows_kernel", "attention_bob_cols_kernel", "row_dot_kernel")


def compiled_count() -> int | None:
    """Kernels compiled so far in this process (None under the interpreter, which compiles none)."""
    from flashbob import _backward, _bob, _forward

    total = 0
    for name in KERNEL_FNS:
        fn = next(getattr(m, name) for m in (_forward, _backward, _bob) if hasattr(m, name))
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            return None
        total += sum(len(cache[0]) for cache in caches.values())
    return total


def child(family: list, n: int) -> dict:
    """In a fresh process: first-call seconds of one family, then a call at n + 1 in the (B, N, H, D)
    layout and the kernels it compiled."""
    dtype, d, mask, h_kv, precision = family
    if device() == "cpu" and dtype == "bf16":
        dtype = "fp16"  # the interpreter's bfloat16 is wrong
    causal, window = parse_mask(mask)
    times = {}
    for label, size, layout in (("first", n, "bhnd"), ("second", n + 1, "bnhd")):
        q, k, v, dout, u_q, u_k, u_v = random_inputs(1, 4, h_kv, size, d, DTYPES[dtype], layout=layout)
        q, k, v, dout = (t.requires_grad_() for t in (q, k, v, dout))
        before = compiled_count()
        t0 = time.perf_counter()
        out = flashbob.flash_attention(q, k, v, causal=causal, window=window, backend="triton",
                                      fp32_precision=precision)
        sync()
        t1 = time.perf_counter()
        firsts = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
        sync()
        t2 = time.perf_counter()
        torch.autograd.grad(firsts, (q, k, v, dout), (u_q, u_k, u_v))
        sync()
        t3 = time.perf_counter()
        after = compiled_count()
        times.update({f"{label}_forward_s": t1 - t0, f"{label}_backward_s": t2 - t1,
                      f"{label}_bob_s": t3 - t2, f"{label}_total_s": t3 - t0,
                      f"{label}_compiled": None if before is None else after - before})
    return {**times, "precompile": precompile.switched_on()}


def family_fields(family: list) -> dict:
    dtype, d, mask, h_kv, precision = family
    return dict(dtype=dtype, d=d, mask=mask, gqa=f"4:{h_kv}", mode=precision or "default")


def run_families(results: Results, families: list[list], n: int, jobs: int, budget: float) -> None:
    deadline = time.monotonic() + budget
    pending, running = list(families), []
    while pending or running:
        while pending and len(running) < jobs and deadline - time.monotonic() > 5:
            family = pending.pop(0)
            cache = tempfile.mkdtemp(prefix="flashbob_cache_")
            env = dict(os.environ, TRITON_CACHE_DIR=cache)
            cmd = [sys.executable, "-m", "flashbob.bench", "first-call", "--child", json.dumps(family),
                   "--n", str(n)]
            logs = tuple(os.path.join(cache, name) for name in ("stdout", "stderr"))
            with open(logs[0], "w") as out, open(logs[1], "w") as err:
                running.append((family, subprocess.Popen(cmd, env=env, stdout=out, stderr=err), logs))
        if not running:
            for family in pending:
                results.record(**family_fields(family), status="skipped: budget")
            return
        time.sleep(0.2)
        for item in list(running):
            family, proc, logs = item
            if proc.poll() is None and time.monotonic() < deadline:
                continue
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                status = {"status": "failed: still running at the end of the budget"}
            elif proc.returncode != 0:
                tail = read(logs[1]).strip().splitlines()[-1:] or [""]
                status = {"status": f"failed: rc {proc.returncode}: {tail[0][:200]}"}
            else:
                status = {**json.loads(read(logs[0]).strip().splitlines()[-1]), "status": "ok"}
            results.record(**family_fields(family), **status)
            running.remove(item)


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def table(rows: list[dict], info: dict) -> str:
    lines = [f"{info['device']}; torch {info['torch']}, triton {info['triton']}; commit {info['commit']}; "
             f"N={info['n']}", "",
             "| family | precompile | first forward s | backward s | BoB s | total s | at N+1 s | "
             "compiled at N+1 |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        family = f"{r['dtype']} d{r['d']} {r['mask']} {r['gqa']} {r['mode']}"
        if r["status"] != "ok":
            lines.append(f"| {family} | {r['status']} |")
            continue
        lines.append(f"| {family} | {r['precompile']} | {r['first_forward_s']:.1f} | "
                     f"{r['first_backward_s']:.1f} | {r['first_bob_s']:.1f} | {r['first_total_s']:.1f} | "
                     f"{r['second_total_s']:.2f} | "
                     f"{r['second_compiled']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m flashbob.bench first-call", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(str(i) for i in range(len(FAMILIES))),
                   help="comma-separated indices into FAMILIES")
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--jobs", type=int, default=4, help="processes side by side")
    p.add_argument("--budget", type=float, default=120.0, help="seconds for all families")
    p.add_argument("--out", default=None, help="directory for results.csv, results.json, table.md")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.n)), flush=True)
        return []
    indices = int_list(args.families)
    if not all(0 <= i < len(FAMILIES) for i in indices):
        p.error(f"--families: indices into FAMILIES must be in [0, {len(FAMILIES)}), got {indices}")
    info = meta("flashbob.bench", ["first-call", *(sys.argv[1:] if argv is None else argv)], n=args.n)
    results = Results(args.out, info)
    try:
        run_families(results, [FAMILIES[i] for i in indices], args.n, args.jobs, args.budget)
    except Exception as exc:  # record what stopped the part
        results.record(status=failure(exc))
    results.finish(table([r for r in results.rows if "dtype" in r], info))
    return results.rows


if __name__ == "__main__":
    main()
