"""Per-batch-row key ranges (padding masks) on one GPU: what the range code costs, and what the
tiles it skips save, in one process.

    python -m flashbob.bench ranges --out key_ranges_out

Before timing it checks once, at a small size (bf16, B=3, H=2, N=300, D=64, causal; left
padding, right padding and an empty row), the forward, the first backward and the BoB with key
ranges against the float64 torch backend given the same ranges (each within twice plain PyTorch's
bf16 error); it stops if one is off. Then, for every (d, N), causal, bf16, B=4, H=8, and three range settings:
  none   no key_start / key_end: the path every other benchmark measures (HAS_RANGE off);
  full   key_start = 0, key_end = N on every row: the range code compiled in, nothing masked
         (its overhead: a ratio near 1.00 to none expected);
  left   left padding of 0, N/8, N/4 and N/2 tokens on the four rows (a generation batch): the
         tiles before each row's range are skipped, so times should follow the visible pairs;
it times the forward, forward + first backward, and the BoB (the second autograd.grad alone), as
median ms (flashbob.bench.time_ms) and the ratio to none next to the ratio of visible pairs.
Writes results.csv, results.json and table.md to --out.
"""

from __future__ import annotations

import sys

import torch

import flashbob
from flashbob.bench import Results, int_list, meta, rel, second_order_call, sweep_parser, time_ms

SETTINGS = ("none", "full", "left")
LEFT_PAD_FRACTIONS = (0, 1 / 8, 1 / 4, 1 / 2)
"""Left padding per batch row of the "left" setting, as fractions of N (the batch is their count)."""


def key_ranges(setting: str, batch: int, n: int, device) -> dict:
    """flash_attention's key_start / key_end for `setting` (none: no arguments)."""
    if setting == "none":
        return {}
    if setting == "full":
        start = torch.zeros(batch, dtype=torch.int64)
    else:
        start = torch.tensor([int(f * n) for f in LEFT_PAD_FRACTIONS[:batch]])
    return {"key_start": start.to(device), "key_end": torch.full((batch,), n, device=device)}


def visible_pairs(setting: str, batch: int, n: int) -> int:
    """(query, key) pairs a causal N x N mask with `setting`'s ranges leaves visible, over the batch."""
    if setting != "left":
        return batch * n * (n + 1) // 2
    return sum((n - int(f * n)) * (n - int(f * n) + 1) // 2 for f in LEFT_PAD_FRACTIONS[:batch])


def check(device, dtype=torch.bfloat16, b=3, h=2, n=300, d=64) -> dict:
    """Relative errors of the Triton stages in `dtype` with key ranges (left padding n/3, right
    padding to 2n/3, an empty row) against the float64 torch backend given the same ranges. Raises
    SystemExit when one exceeds twice plain PyTorch's error in `dtype` (the torch backend run on the
    same rounded inputs), or a floor (2e-5 in float32, an eighth of the dtype's epsilon otherwise)."""
    gen = torch.Generator().manual_seed(0)
    inputs = [torch.randn(b, h, n, d, generator=gen, dtype=torch.float64) for _ in range(7)]
    ranges = {"key_start": torch.tensor([n // 3, 0, 5])[:b], "key_end": torch.tensor([n, 2 * n // 3, 5])[:b]}

    def stages(backend, dtype, dev):
        q, k, v, dout, u_q, u_k, u_v = (t.to(dev, dtype) for t in inputs)
        opts = dict(causal=True, backend=backend, **{key: t.to(dev) for key, t in ranges.items()})
        out, lse = flashbob.attention_forward(q, k, v, **opts)
        firsts = flashbob.attention_backward(q, k, v, out, lse, dout, **opts)
        bob = flashbob.attention_bob(q, k, v, out, lse, dout, firsts[0], u_q, u_k, u_v, **opts)
        return [t.double().cpu() for t in (out, *firsts, *bob)]

    want = stages("torch", torch.float64, "cpu")
    plain = stages("torch", dtype, "cpu")
    got = stages("triton", dtype, device)
    floor = 2e-5 if dtype == torch.float32 else torch.finfo(dtype).eps / 8
    names = ("out", "dq", "dk", "dv", "bob_q", "bob_k", "bob_v", "bob_dout")
    errors = {name: rel(g, w) for name, g, w in zip(names, got, want)}
    limits = {name: max(2 * rel(p_, w), floor) for name, p_, w in zip(names, plain, want)}
    if any(errors[name] > limits[name] for name in names):
        raise SystemExit(f"key-range check failed: errors {errors}, limits {limits}")
    return errors


def warm_time_ms(fn, budget: float) -> float:
    """time_ms after one untimed call: time_ms sizes its repetitions by its own first call, which
    would otherwise include the compilation (and leave one timed call, not a median)."""
    fn()
    return time_ms(fn, budget)


def run_case(results: Results, args, n: int, d: int) -> None:
    """Times of every setting at (n, d): forward, forward + backward, BoB."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, h = len(LEFT_PAD_FRACTIONS), args.heads
    q, k, v, dout, u_q, u_k, u_v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                                                generator=gen) for _ in range(7))
    for setting in SETTINGS:
        ranges = key_ranges(setting, b, n, "cuda")

        def attention(q, k, v, ranges=ranges):
            return flashbob.flash_attention(q, k, v, causal=True, **ranges)

        def fwd_bwd(attention=attention):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            torch.autograd.grad(attention(*leaves), leaves, dout)

        with torch.no_grad():
            forward_ms = warm_time_ms(lambda attention=attention: attention(q, k, v), args.budget)
        bob = second_order_call(attention, q, k, v, dout, u_q, u_k, u_v)
        times = {"forward": forward_ms, "fwd_bwd": warm_time_ms(fwd_bwd, args.budget),
                 "bob": warm_time_ms(bob, args.budget)}
        del bob
        for stage, ms in times.items():
            results.record(d=d, n=n, setting=setting, stage=stage, ms=ms, pairs=visible_pairs(setting, b, n))
        torch.cuda.empty_cache()


def markdown_table(rows: list[dict], meta: dict) -> str:
    """One line per (d, N, stage): ms of each setting and the ratios to none."""
    by = {(r["d"], r["n"], r["setting"], r["stage"]): r for r in rows}
    lines = [
        f"GPU: {meta['gpu']}; torch {meta['torch']}, triton {meta['triton']}; commit {meta['commit']}; "
        f"causal, bf16, B={len(LEFT_PAD_FRACTIONS)}, H={meta['heads']}; left padding "
        f"{', '.join(f'{f:g}' for f in LEFT_PAD_FRACTIONS)} of N; check errors: {meta['check']}",
        "",
        "| d | N | stage | none ms | full ms | full / none | left ms | left / none | left pairs / none |",
        "|" + "---|" * 9,
    ]
    for d, n, stage in sorted({(r["d"], r["n"], r["stage"]) for r in rows}):
        none, full, left = (by[(d, n, s, stage)] for s in SETTINGS)
        lines.append(
            f"| {d} | {n} | {stage} | {none['ms']:.2f} | {full['ms']:.2f} | {full['ms'] / none['ms']:.2f} | "
            f"{left['ms']:.2f} | {left['ms'] / none['ms']:.2f} | {left['pairs'] / none['pairs']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    p = sweep_parser("ranges", __doc__, n="4096,16384", budget=0.3, out="key_ranges_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("python -m flashbob.bench ranges needs a CUDA GPU")
    errors = check("cuda")
    info = meta("flashbob.bench", ["ranges", *(sys.argv[1:] if argv is None else argv)], heads=args.heads,
                check=", ".join(f"{k} {e:.1e}" for k, e in errors.items()))
    info["gpu"] = info["device"]
    results = Results(args.out, info)
    for d in int_list(args.d):
        for n in int_list(args.n):
            run_case(results, args, n, d)
    results.finish(markdown_table(results.rows, info))


if __name__ == "__main__":
    main()
