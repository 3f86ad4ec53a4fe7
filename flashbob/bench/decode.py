"""Attention at decoding shapes (a few query rows over a long key cache) on one GPU: the forward that
splits the keys over more programs against the plain kernel and torch SDPA, in one process, on the
same inputs.

    python -m flashbob.bench decode --out decode_out

Cases: q (B, Hq, N, D), k and v (B, Hkv, M, D) for every head config Hq:Hkv (--heads), head dim (--d),
mask (--mask: causal, windowW or full), M (--m) and N (--n); B (--batch) and the dtype (--dtype) are
one each. flash_attention's causal mask is bottom-right aligned: query i sees keys j <= i + M - N, so
the last row sees every key (under windowW only the last W). Candidates, without grad:
  split       flashbob.flash_attention as it runs: the keys split as `tiling.key_splits` decides
              (column "splits": its count; 1 where the rule keeps the plain kernel, N > 16 among them);
  plain       the same under `tiling.force_splits(1)`: the plain kernel, one program per row block and head;
  sdpa_flash  torch's scaled_dot_product_attention held to SDPBackend.FLASH_ATTENTION,
  sdpa_cudnn  ... to SDPBackend.CUDNN_ATTENTION; both with enable_gqa where Hq > Hkv. SDPA's is_causal
              is top-left aligned, so SDPA gets no mask where every row sees every key (N = 1 without a
              window narrower than M, or full) and otherwise an explicit boolean (N, M) mask built once
              outside the timed calls (`sdpa_mask`); the flash backend takes no mask and raises there.
An SDPA candidate that raises is recorded with status "failed: ERROR" (unsupported in the table) and
the run goes on; split or plain raising stops it. --sdpa names the SDPA backends timed (default
flash,cudnn): a fault that ends the process (an illegal memory access) cannot be recorded, so a backend
that causes one is left out by naming only the others.

Check, per case, before timing: each candidate's output against the float64 torch backend
(flash_attention(..., backend="torch") on float64 copies) as a relative error; the run stops if split's
error exceeds twice plain's or a floor (2e-5 in float32, an eighth of the dtype's epsilon otherwise).

Timing, per case. Device time: --calls calls captured in one CUDA graph, replayed --replays times per
round between CUDA events, the candidates in rotating order (`ab.time_rounds`), for --rounds rounds: us
per call, median [min, max] over the rounds. The graph leaves out the host's cost of a call, which
would otherwise hide a 10 us kernel. Wall time: one call at a time between synchronisations, host and
device (`time_ms`, median of --calls calls). plain's wall time runs its launcher as written
(force_splits turns launch plans off), split's replays its launch plan. Off CUDA (tests) both times
are the host clock's and the SDPA candidates run on the math backend.

Writes results.csv, results.json and table.md to --out: per case each candidate's device us, plain /
split and the best SDPA / split (ratios of medians: above 1 where split is faster), then each
candidate's wall us and error.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import re
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F

import flashbob
from flashbob import tiling
from flashbob.bench import (
    DTYPES,
    YARDSTICKS,
    Results,
    device,
    dtype_of,
    failure,
    int_list,
    meta,
    parse_mask,
    rel,
    str_list,
    sync,
    time_ms,
)
from flashbob.bench.ab import spread, time_rounds

OURS = ("split", "plain")
CANDIDATES = (*OURS, *(f"sdpa_{kind}" for kind in YARDSTICKS))
"""split, plain, sdpa_flash, sdpa_cudnn: the table's column order."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One decoding shape: q (batch, heads_q, n, d); k, v (batch, heads_kv, m, d)."""

    batch: int
    heads_q: int
    heads_kv: int
    n: int
    m: int
    d: int
    mask: str
    dtype: str


def label(row: dict) -> str:
    """A case's name in the table, from its fields: '32:8 N4 M8192 d64 causal'."""
    return f"{row['heads_q']}:{row['heads_kv']} N{row['n']} M{row['m']} d{row['d']} {row['mask']}"


def parse_heads(text: str) -> list[tuple[int, int]]:
    """'12:12,32:8' -> [(12, 12), (32, 8)]; ValueError unless each Hq is a positive multiple of Hkv."""
    pairs = []
    for item in str_list(text):
        match = re.fullmatch(r"(\d+):(\d+)", item)
        pair = (int(match.group(1)), int(match.group(2))) if match else (0, 0)
        if min(pair) < 1 or pair[0] % pair[1]:
            raise ValueError(f"--heads entries must be Hq:Hkv, Hq a positive multiple of Hkv, got {item!r}")
        pairs.append(pair)
    return pairs


def make_inputs(case: Case, dev: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, Hq, N, D), k and v (B, Hkv, M, D), standard normal in the case's dtype."""
    gen = torch.Generator(device=dev).manual_seed(seed)
    dtype = dtype_of(case.dtype)

    def draw(heads: int, rows: int) -> torch.Tensor:
        return torch.randn(case.batch, heads, rows, case.d, device=dev, dtype=dtype, generator=gen)

    return draw(case.heads_q, case.n), draw(case.heads_kv, case.m), draw(case.heads_kv, case.m)


def sdpa_mask(n: int, m: int, causal: bool, window: int | None, dev) -> torch.Tensor | None:
    """SDPA's attn_mask for flash_attention's mask of n query rows over m keys (causal: bottom-right
    aligned, within `window` keys if given): None where every row sees every key, else a boolean
    (n, m) tensor, True where the key is visible."""
    if not causal:
        return None
    last = torch.arange(n, device=dev)[:, None] + (m - n)
    keys = torch.arange(m, device=dev)[None, :]
    visible = keys <= last
    if window is not None:
        visible &= keys > last - window
    return None if bool(visible.all()) else visible


def sdpa_backends(kinds: list[str]) -> dict:
    """SDPA candidate -> the SDPBackend it is held to, for kinds of bench.YARDSTICKS (flash, cudnn); the
    math backend off CUDA."""
    from torch.nn.attention import SDPBackend

    return {f"sdpa_{kind}": getattr(SDPBackend, YARDSTICKS[kind]) if torch.cuda.is_available()
            else SDPBackend.MATH for kind in kinds}


def candidates(case: Case, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               sdpa: list[str]) -> dict[str, Callable]:
    """Each candidate's call on q, k, v as a closure returning out (B, Hq, N, D): split, plain and the
    SDPA backends named in `sdpa` (of flash, cudnn), in CANDIDATES order."""
    from torch.nn.attention import sdpa_kernel

    causal, window = parse_mask(case.mask)
    mask = sdpa_mask(case.n, case.m, causal, window, q.device)

    def split():
        return flashbob.flash_attention(q, k, v, causal=causal, window=window, backend="triton")

    def plain():
        with tiling.force_splits(1):
            return split()

    def sdpa_call(backend):
        def call():
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                      enable_gqa=case.heads_q != case.heads_kv)
        return call

    return {"split": split, "plain": plain, **{name: sdpa_call(b) for name, b in sdpa_backends(sdpa).items()}}


def attempt_all(fns: dict[str, Callable], status: dict[str, str]) -> dict:
    """{name: fn()} for the fns that return; an SDPA candidate that raises is left out, its status
    the error (`failure`); split and plain raise."""
    values = {}
    for name, fn in fns.items():
        try:
            values[name] = fn()
        except Exception as exc:
            if name in OURS:
                raise
            status[name] = failure(exc)
    return values


def check(outputs: dict[str, torch.Tensor], reference: torch.Tensor, dtype: torch.dtype, where: str) -> dict:
    """Relative errors of the outputs (B, Hq, N, D) against the float64 reference. Raises SystemExit
    when split's exceeds twice plain's or a floor (2e-5 in float32, an eighth of the dtype's epsilon
    otherwise)."""
    errors = {name: rel(out, reference) for name, out in outputs.items()}
    floor = 2e-5 if dtype == torch.float32 else torch.finfo(dtype).eps / 8
    limit = max(2 * errors["plain"], floor)
    if not errors["split"] <= limit:
        raise SystemExit(f"decode check failed at {where}: split's error {errors['split']:.3e} > limit "
                         f"{limit:.3e} (twice plain's {errors['plain']:.3e}, floor {floor:.1e}); "
                         f"errors {errors}")
    return errors


def replayable(fn: Callable, calls: int) -> Callable:
    """A callable that makes `calls` calls of fn: on CUDA one replay of a CUDA graph that captured
    them (the device's work without the host's), elsewhere the calls themselves."""
    if not torch.cuda.is_available():
        return lambda: [fn() for _ in range(calls)]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    sync()
    return graph.replay


@torch.no_grad()
def run_case(results: Results, case: Case, args: argparse.Namespace) -> None:
    """Check every candidate at `case`, then time those that ran: one row per candidate."""
    q, k, v = make_inputs(case, device())
    causal, window = parse_mask(case.mask)
    reference = flashbob.flash_attention(q.double(), k.double(), v.double(), causal=causal, window=window,
                                         backend="torch")
    fns = candidates(case, q, k, v, args.sdpa)
    status = dict.fromkeys(fns, "ok")
    errors = check(attempt_all(fns, status), reference, q.dtype, label(dataclasses.asdict(case)))
    del reference
    captures = {name: functools.partial(replayable, fns[name], args.calls) for name in errors}
    graphs = attempt_all(captures, status)
    times = time_rounds(graphs, args.rounds, args.replays)
    splits = tiling.key_splits(q, k, window)
    for name in fns:
        timed = dict.fromkeys(("us", "us_min", "us_max", "wall_us"))
        if name in times:
            us, us_min, us_max = spread([1e3 * ms / args.calls for ms in times[name]])
            timed = dict(us=us, us_min=us_min, us_max=us_max,
                         wall_us=1e3 * time_ms(fns[name], budget_s=1.0, max_reps=args.calls))
        results.record(**dataclasses.asdict(case), candidate=name, splits=splits, status=status[name],
                       rel_err=errors.get(name), **timed)
    del graphs
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_cell(row: dict) -> str:
    """'median [min, max]' device us of a row, or 'unsupported' where it was not timed."""
    if row["us"] is None:
        return "unsupported"
    return f"{row['us']:.1f} [{row['us_min']:.1f}, {row['us_max']:.1f}]"


def wall_cell(row: dict) -> str:
    """'wall us (relative error)' of a row, or 'unsupported' where it was not timed."""
    if row["us"] is None:
        return "unsupported"
    return f"{row['wall_us']:.1f} ({row['rel_err']:.1e})"


def best_sdpa(by: dict[str, dict]) -> str:
    """'ratio (candidate)' of the fastest SDPA candidate's median to split's, or '-' if none ran."""
    timed = [row for name, row in by.items() if name not in OURS and row["us"] is not None]
    if not timed:
        return "-"
    best = min(timed, key=lambda row: row["us"])
    return f"{best['us'] / by['split']['us']:.2f} ({best['candidate']})"


def markdown_table(rows: list[dict], info: dict) -> str:
    """The run's header, then per case each candidate's device us, plain / split and best SDPA / split;
    then per case each candidate's wall us and error."""
    cases: dict[str, dict[str, dict]] = {}
    for row in rows:
        cases.setdefault(label(row), {})[row["candidate"]] = row
    names = [name for name in CANDIDATES if any(row["candidate"] == name for row in rows)]
    timing = (f"{info['calls']} calls in one CUDA graph, {info['replays']} replays a round"
              if info["device_type"] == "cuda" else f"host clock of {info['calls']} calls (no GPU)")
    header = [
        f"GPU: {info['device']}; torch {info['torch']}, triton {info['triton']}, cuDNN {info['cudnn']}; "
        f"commit {info['commit']}; "
        f"B={info['batch']}, {info['dtype']}; device us per call: {timing}, median [min, max] over "
        f"{info['rounds']} rounds; ratios of medians, above 1 where split is faster",
        "",
        f"Command: `{info['command']}`",
    ]
    return "\n".join([*header, "", *device_lines(cases, names), "", *wall_lines(cases, names)]) + "\n"


def device_lines(cases: dict[str, dict[str, dict]], names: list[str]) -> list[str]:
    """Device time table: {case label: {candidate: row}} -> markdown lines, a column per candidate in
    names."""
    lines = ["| case | splits | " + " | ".join(f"{name} us" for name in names)
             + " | plain / split | best SDPA / split |", "|" + "---|" * (len(names) + 4)]
    for name, by in cases.items():
        cells = " | ".join(device_cell(by[c]) for c in names)
        lines.append(f"| {name} | {by['split']['splits']} | {cells} | "
                     f"{by['plain']['us'] / by['split']['us']:.2f} | {best_sdpa(by)} |")
    return lines


def wall_lines(cases: dict[str, dict[str, dict]], names: list[str]) -> list[str]:
    """Wall time and error table: {case label: {candidate: row}} -> markdown lines, a column per
    candidate in names."""
    lines = ["Wall us per call, one call at a time (host + device), and the relative error against float64:",
             "", "| case | " + " | ".join(names) + " |", "|" + "---|" * (len(names) + 1)]
    for name, by in cases.items():
        lines.append(f"| {name} | " + " | ".join(wall_cell(by[c]) for c in names) + " |")
    return lines


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flashbob.bench decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", default="1,4,16", help="comma-separated query rows N")
    p.add_argument("--m", default="8192,32768,131072", help="comma-separated keys M")
    p.add_argument("--heads", default="12:12,32:8", help="comma-separated head configs Hq:Hkv")
    p.add_argument("--d", default="64", help="comma-separated head dims")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    p.add_argument("--mask", default="causal", help="comma-separated: causal, windowW, full")
    p.add_argument("--sdpa", default="flash,cudnn",
                   help="comma-separated SDPA backends to time (of flash, cudnn); '' for none")
    p.add_argument("--calls", type=int, default=50, help="calls per CUDA graph; timed calls of the wall time")
    p.add_argument("--replays", type=int, default=20, help="graph replays per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="decode_out", help="directory for results.csv, results.json, table.md")
    args = p.parse_args(argv)
    try:
        args.heads = parse_heads(args.heads)
        for mask in str_list(args.mask):
            parse_mask(mask)
    except ValueError as exc:
        p.error(str(exc))
    args.sdpa = str_list(args.sdpa)
    if set(args.sdpa) - set(YARDSTICKS):
        p.error(f"--sdpa entries must be of {', '.join(YARDSTICKS)}, got {args.sdpa}")
    if min(args.batch, args.calls, args.replays, args.rounds) < 1:
        p.error("--batch, --calls, --replays and --rounds must be at least 1")
    return args


def cases(args: argparse.Namespace) -> list[Case]:
    return [Case(args.batch, hq, hkv, n, m, d, mask, args.dtype) for hq, hkv in args.heads
            for d in int_list(args.d) for mask in str_list(args.mask) for m in int_list(args.m)
            for n in int_list(args.n)]


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    info = meta("flashbob.bench", ["decode", *(sys.argv[1:] if argv is None else argv)], batch=args.batch,
                dtype=args.dtype, calls=args.calls, replays=args.replays, rounds=args.rounds,
                cudnn=torch.backends.cudnn.version() if torch.cuda.is_available() else None)
    results = Results(args.out, info)
    for case in cases(args):
        run_case(results, case, args)
    results.finish(markdown_table(results.rows, info))
    return results.rows


if __name__ == "__main__":
    main()
