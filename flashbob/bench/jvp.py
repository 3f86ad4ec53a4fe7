"""Forward mode (JVP) and the gradient through it, on one GPU, against the forward, the first
backward and plain PyTorch's JVP, in one process.

    python -m flashbob.bench jvp --n 4096,8192,16384,32768,65536 --d 64,128 --out jvp_out

Before timing it checks once, at a small size, the JVP's output and tangent and the gradients of
a loss on the tangent against float64 autograd through plain attention (bf16 within 2x plain
PyTorch's bf16 error; with --check bf16,fp32 also fp32 within 1e-4); it stops if they are off.
Then, for every (d, N), causal, bf16, B=1, H=8 (all inputs (B, H, N, D)):
  ours_forward   flash_attention forward alone (no grad);
  ours_jvp_kernel the fused forward-with-tangent kernel alone (triton_ops.jvp: out, lse, tangent);
  ours_jvp       torch.func.jvp(flash_attention) with tangents of q, k, v (autograd runs the
                 Function's forward, then its jvp: the forward kernel plus the fused kernel);
  ours_backward  the first backward (autograd.grad of out);
  ours_grad_jvp  autograd.grad of the tangent w.r.t. q, k, v and the three tangents (first
                 backward + FlashBoB, built once, timed with retain_graph);
  torch_jvp      torch.func.jvp through plain PyTorch attention (kernels' torch backend);
  sdpa_math_jvp  torch.func.jvp through SDPA's math backend.
Plain PyTorch runs until it runs out of memory (recorded as OOM, larger N skipped).
FLOPs: a "product" is one d-deep matrix product over the visible pairs, 2 * pairs * D * B * H.
Products: forward 2 (S, P V); jvp kernel 6 (S, P V, dQ K^T, Q dK^T, (P*dS) V, P dV); ours_jvp 8
(forward + jvp kernel); backward 7; grad_jvp 25 (backward 7 + BoB 18). Plain PyTorch's JVP is
reported in time and memory only. Writes results.csv, results.json and table.md to --out.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.nn.functional as F

import flashbob
from flashbob import triton_ops
from flashbob.bench import (
    Results,
    dtype_of,
    int_list,
    meta,
    peak_gib,
    rel,
    str_list,
    sweep_parser,
    sync_time,
    tflops,
    time_ms,
    visible_pairs,
)

PRODUCTS = {"ours_forward": 2, "ours_jvp_kernel": 6, "ours_jvp": 8, "ours_backward": 7, "ours_grad_jvp": 25}
CHECK_SIZE = (1, 2, 200, 64)  # (B, H, N, D) of the correctness check


def attention(backend):
    """(q, k, v) -> causal attention on `backend`: "triton", "torch" or "sdpa_math"."""
    if backend == "sdpa_math":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return sdpa
    return lambda q, k, v: flashbob.flash_attention(q, k, v, causal=True, backend=backend)


def jvp_and_grads(f, primals, tangents, weight):
    """(out, t_out, grads of <t_out, weight> w.r.t. the primals and the tangents)."""
    xs = [x.detach().requires_grad_() for x in (*primals, *tangents)]
    out, t_out = torch.func.jvp(f, tuple(xs[:3]), tuple(xs[3:]))
    grads = torch.autograd.grad((t_out * weight.to(t_out.dtype)).sum(), xs)
    return [out, t_out, *grads]


def check_correctness(device: str, dtype: torch.dtype, size=CHECK_SIZE) -> dict:
    """Relative errors of the Triton JVP and of the gradients through it against float64 plain
    attention (and, in low precision, of plain PyTorch in the same dtype). Raises if they are off."""
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(size, generator=gen, dtype=torch.float64).to(device) for _ in range(7)]
    primals, tangents, weight = inputs[:3], inputs[3:6], inputs[6]
    names = ["out", "t_out", "g_q", "g_k", "g_v", "g_tq", "g_tk", "g_tv"]
    want = jvp_and_grads(attention("torch"), primals, tangents, weight)
    low = [[x.to(dtype) for x in xs] for xs in (primals, tangents)]
    got = jvp_and_grads(attention("triton"), *low, weight)
    errors = {n: rel(g, w) for n, g, w in zip(names, got, want)}
    if dtype == torch.float32:
        limits = dict.fromkeys(names, 1e-4)
    else:
        plain = jvp_and_grads(attention("torch"), *low, weight)
        floor = torch.finfo(dtype).eps / 8
        limits = {n: max(2 * rel(p, w), floor) for n, p, w in zip(names, plain, want)}
    bad = {n: (errors[n], limits[n]) for n in names if not errors[n] <= limits[n]}
    if bad:
        raise SystemExit(f"correctness check failed in {dtype} (error, limit): {bad}")
    return errors


def run_case(results: Results, args, n, d, skip: set) -> None:
    b, h, dtype = args.batch, args.heads, torch.bfloat16
    pairs = visible_pairs(n, n, True, None)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, t_q, t_k, t_v, g = (torch.randn(b, h, n, d, device="cuda", dtype=dtype, generator=gen)
                                 for _ in range(7))
    base = {"n": n, "d": d, "mask": "causal", "dtype": "bf16", "batch": b, "heads": h}

    def record(method, ms=None, first_s=None, peak=None, status="ok"):
        products = PRODUCTS.get(method)
        results.record(**base, method=method, ms=ms, first_call_s=first_s, peak_gib=peak, status=status,
                       tflops=tflops(products, pairs, d, b * h, ms) if (ms and products) else None)

    def measure(method, fn):
        first = sync_time(fn)
        peak, _ = peak_gib(fn)
        record(method, time_ms(fn, args.budget), first, peak)

    ours = attention("triton")
    scale = d**-0.5
    with torch.no_grad():
        measure("ours_forward", lambda: ours(q, k, v))
        measure("ours_jvp_kernel", lambda: triton_ops.jvp(q, k, v, t_q, t_k, t_v, causal=True, window=None,
                                                           scale=scale))
        measure("ours_jvp", lambda: torch.func.jvp(ours, (q, k, v), (t_q, t_k, t_v)))
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    out = ours(qg, kg, vg)
    measure("ours_backward", lambda out=out: torch.autograd.grad(out, (qg, kg, vg), g, retain_graph=True))
    xs = [x.detach().requires_grad_() for x in (q, k, v, t_q, t_k, t_v)]
    _, t_out = torch.func.jvp(ours, tuple(xs[:3]), tuple(xs[3:]))
    measure("ours_grad_jvp", lambda t_out=t_out: torch.autograd.grad(t_out, xs, g, retain_graph=True))
    out = t_out = xs = None
    torch.cuda.empty_cache()
    for method, backend in (("torch_jvp", "torch"), ("sdpa_math_jvp", "sdpa_math")):
        if (method, d) in skip:
            record(method, status="oom (smaller n)")
            continue
        plain = attention(backend)
        try:
            with torch.no_grad():
                measure(method, lambda plain=plain: torch.func.jvp(plain, (q, k, v), (t_q, t_k, t_v)))
        except torch.OutOfMemoryError:
            skip.add((method, d))
            record(method, status="oom")
        except RuntimeError as err:  # e.g. an op without a forward-mode formula in this torch version
            skip.add((method, d))
            record(method, status=f"error: {str(err).splitlines()[0][:80]}")
        torch.cuda.empty_cache()


def markdown_table(rows: list[dict], meta: dict) -> str:
    """One line per (d, N): our times and ratios, plain PyTorch's JVP time and memory."""
    by = {(r["d"], r["n"], r["method"]): r for r in rows}

    def get(d, n, method, key="ms"):
        r = by.get((d, n, method))
        return None if r is None else r.get(key)

    def fmt(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    def plain(d, n, method):
        status = get(d, n, method, "status")
        if status is None or status.startswith("error"):
            return "-" if status is None else "error"
        return "OOM" if status != "ok" else f"{get(d, n, method):.1f} ({get(d, n, method, 'peak_gib'):.1f})"

    lines = [
        f"GPU: {meta['gpu']}; torch {meta['torch']}, triton {meta['triton']}; commit {meta['commit']}; "
        f"causal, bf16, B={meta['batch']}, H={meta['heads']}; check errors: {meta['check']}",
        "",
        "| d | N | fwd ms | jvp kernel ms (TFLOP/s) | jvp ms | jvp / fwd | jvp peak GiB | bwd ms | "
        "grad-through-jvp ms (TFLOP/s) | grad-jvp / bwd | torch jvp ms (GiB) | sdpa-math jvp ms (GiB) |",
        "|" + "---|" * 12,
    ]
    for d, n in sorted({(r["d"], r["n"]) for r in rows}):
        fwd, jvp, bwd, gj = (get(d, n, m)
                             for m in ("ours_forward", "ours_jvp", "ours_backward", "ours_grad_jvp"))
        lines.append(
            f"| {d} | {n} | {fmt(fwd)} | {fmt(get(d, n, 'ours_jvp_kernel'))} "
            f"({fmt(get(d, n, 'ours_jvp_kernel', 'tflops'), '.0f')}) | {fmt(jvp)} | "
            f"{fmt(jvp / fwd if jvp and fwd else None)} | {fmt(get(d, n, 'ours_jvp', 'peak_gib'))} | "
            f"{fmt(bwd)} | {fmt(gj)} ({fmt(get(d, n, 'ours_grad_jvp', 'tflops'), '.0f')}) | "
            f"{fmt(gj / bwd if gj and bwd else None)} | {plain(d, n, 'torch_jvp')} | "
            f"{plain(d, n, 'sdpa_math_jvp')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = sweep_parser("jvp", __doc__, n="4096,8192,16384,32768,65536", budget=0.3, out="jvp_out")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--check", default="bf16", help="dtypes of the correctness check: bf16, fp32 or both "
                   "(fp32 compiles its own kernels: about a minute more)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m flashbob.bench jvp needs a CUDA GPU")
    check = {name: max(check_correctness("cuda", dtype_of(name)).values()) for name in str_list(args.check)}
    print(json.dumps({"check_max_rel_err": check}), flush=True)
    info = meta("flashbob.bench", ["jvp", *(sys.argv[1:] if argv is None else argv)], batch=args.batch,
                heads=args.heads, check=", ".join(f"{k} {v:.1e}" for k, v in check.items()))
    info["gpu"] = info["device"]
    results, skip = Results(args.out, info), set()
    for d in int_list(args.d):
        for n in sorted(int_list(args.n)):
            run_case(results, args, n, d, skip)
            results.save()
    results.finish(markdown_table(results.rows, info))


if __name__ == "__main__":
    main()
