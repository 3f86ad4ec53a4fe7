"""Outputs of the gradient-memory sweep: the CSV (rewritten after every point), a markdown table with
the headline figures, and three plots. A row is a dict with the keys of COLUMNS.

    python -m ttt.experiments.grad_memory_report DIR     # table.md and plots again from DIR's results

(e.g. for a run that was killed before its end, or whose machine had no matplotlib).
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path

from ttt.tracking.atomic import atomic_write_text

COLUMNS = (
    "backend",
    "order",
    "checkpoint",
    "k",
    "n",
    "status",
    "peak_gib",
    "saved_gib",
    "predicted_gib",
    "predicted_peak_gib",
    "params_gib",
    "seconds",
    "first_call_s",
    "error",
)
MEASURED = ("status", "peak_gib", "saved_gib", "params_gib", "seconds", "first_call_s")
GIB = ".3g"
"""Format of GiB cells: three significant digits (76.4, 0.00123)."""
BACKEND_STYLE = {"flashbob": "tab:blue", "eager": "tab:red", "sdpa_math": "tab:orange"}
K_MARKERS = {1: "o", 2: "s", 4: "^", 8: "D"}


def _csv_value(value):
    """A CSV cell: floats in full (repr: read back exactly, so a table rendered from the CSV alone is
    the table rendered from the rows; 6 digits would round a value like 0.001055 a second time)."""
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else value


def read_csv_rows(path: Path) -> list[dict]:
    """The rows of a results.csv, with numbers, booleans and None (empty cells) restored."""
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    for row in rows:
        for key, value in row.items():
            if key in ("k", "n"):
                row[key] = int(value)
            elif key == "checkpoint":
                row[key] = value == "True"
            elif key.endswith(("_gib", "_s")) or key == "seconds":
                row[key] = float(value) if value else None
    return rows


def csv_text(rows: list[dict]) -> str:
    """The rows as CSV with a header (COLUMNS); None becomes an empty cell."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    writer.writerows({key: _csv_value(row.get(key)) for key in COLUMNS} for row in rows)
    return buffer.getvalue()


def _ok(rows, **match) -> list[dict]:
    return [r for r in rows if r["status"] == "ok" and all(r[key] == value for key, value in match.items())]


def _memory(row: dict) -> float | None:
    """The measured memory of a row: its peak, else (in rows from older files) its saved bytes."""
    return row["peak_gib"] if row["peak_gib"] is not None else row["saved_gib"]


def _series_name(k: int, order: str, ckpt: bool, hvp: bool = False) -> str:
    if hvp:  # workload=hvp: order second is the HVP, first the gradient
        return "HVP" if order == "second" else "gradient"
    return f"k={k}, {order} order{', checkpointed' if ckpt else ''}"


def _reach(rows: list[dict], hvp: bool = False) -> list[str]:
    """Per series: the largest N that ran, the first N out of memory, FlashBoB's memory per token."""
    lines = []
    for backend, k, order, ckpt in sorted(
        {(r["backend"], r["k"], r["order"], r["checkpoint"]) for r in rows}
    ):
        same = [
            r
            for r in rows
            if (r["backend"], r["k"], r["order"], r["checkpoint"]) == (backend, k, order, ckpt)
        ]
        ok = [r["n"] for r in same if r["status"] == "ok"]
        oom = [r["n"] for r in same if r["status"] == "oom"]
        if len(ok) + len(oom) < 2:
            continue
        line = (
            f"- {backend}, {_series_name(k, order, ckpt, hvp)}: largest N that ran {max(ok, default='-')}; "
            f"first OOM at N={min(oom, default='-')}"
        )
        fit = sorted((r["n"], _memory(r)) for r in _ok(same) if _memory(r) is not None)
        if len(fit) >= 2 and backend == "flashbob":
            (n0, m0), (n1, m1) = fit[-2], fit[-1]
            line += f"; memory slope {(m1 - m0) * 2**20 / (n1 - n0):.1f} KiB/token (N={n0}..{n1})"
        lines.append(line)
    return lines


def _k_slopes(rows: list[dict]) -> list[str]:
    """Memory per inner step (second order, stored steps) at each N with at least three k."""
    lines = []
    for backend, n in sorted({(r["backend"], r["n"]) for r in rows}):
        same = _ok(rows, backend=backend, n=n, order="second", checkpoint=False)
        fit = sorted((r["k"], _memory(r)) for r in same if _memory(r) is not None)
        if len(fit) >= 3:
            (k0, m0), (k1, m1) = fit[0], fit[-1]
            lines.append(
                f"- {backend}, N={n}: memory slope in k {(m1 - m0) / (k1 - k0):.3f} GiB per inner step "
                f"({(m1 - m0) * 2**20 / (k1 - k0) / n:.1f} KiB/token; k={k0}..{k1})"
            )
    return lines


def _on_cuda(env: dict) -> bool:
    """Whether the run was on CUDA (older environment.json files have no device_type: a device memory
    was recorded only on CUDA)."""
    return env.get("device_type", "cuda" if env.get("device_memory_gib") else "cpu") == "cuda"


def _speed(rows: list[dict], env: dict) -> list[str]:
    """Eager / FlashBoB time at the largest N both ran, per series; on CUDA only: elsewhere flashbob
    runs the same plain-PyTorch attention as eager, and the ratio would mean nothing."""
    if not _on_cuda(env):
        return [
            "- speed: no eager / flashbob ratio off CUDA (both ran the same plain-PyTorch attention there)"
        ]
    lines, hvp = [], env.get("workload") == "hvp"
    for k, order, ckpt in sorted({(r["k"], r["order"], r["checkpoint"]) for r in rows}):
        eager = {r["n"]: r for r in _ok(rows, backend="eager", k=k, order=order, checkpoint=ckpt)}
        flash = {r["n"]: r for r in _ok(rows, backend="flashbob", k=k, order=order, checkpoint=ckpt)}
        both = [n for n in eager if n in flash and eager[n]["seconds"] and flash[n]["seconds"]]
        if both:
            n = max(both)
            lines.append(
                f"- speed, {_series_name(k, order, ckpt, hvp)}: eager / flashbob time at N={n} "
                f"(largest both ran) = {eager[n]['seconds'] / flash[n]['seconds']:.2f}"
            )
    return lines


def _model_check(rows: list[dict]) -> list[str]:
    """Per backend: measured / predicted peak and saved memory over the points that ran (no checkpointing)."""
    lines = []
    for backend in sorted({r["backend"] for r in rows}):
        ratios = {}
        for measured, predicted in (("peak_gib", "predicted_peak_gib"), ("saved_gib", "predicted_gib")):
            ratios[measured] = sorted(
                r[measured] / r[predicted]
                for r in _ok(rows, backend=backend, checkpoint=False)
                if r.get(measured) is not None and r.get(predicted)
            )
        if ratios["peak_gib"] and ratios["saved_gib"]:
            peak, saved = ratios["peak_gib"], ratios["saved_gib"]
            lines.append(
                f"- model check, {backend}: measured / predicted peak {peak[len(peak) // 2]:.2f} "
                f"(median; {peak[0]:.2f}-{peak[-1]:.2f}), saved {saved[len(saved) // 2]:.3f} "
                f"({saved[0]:.3f}-{saved[-1]:.3f})"
            )
    return lines


def _hvp_ratios(rows: list[dict]) -> list[str]:
    """workload=hvp: per backend and N where both ran, the HVP (order second) against the gradient
    (order first): time and peak memory, and their ratios."""
    lines = []
    for backend, n in sorted({(r["backend"], r["n"]) for r in rows}):
        gradient, product = (
            _ok(rows, backend=backend, n=n, order="first"),
            _ok(rows, backend=backend, n=n, order="second"),
        )
        if gradient and product and gradient[0]["seconds"] and gradient[0]["peak_gib"]:
            g, h = gradient[0], product[0]
            lines.append(
                f"- {backend}, N={n}: HVP / gradient time {h['seconds'] / g['seconds']:.2f} "
                f"({h['seconds']:.3g} s / {g['seconds']:.3g} s), peak {h['peak_gib'] / g['peak_gib']:.2f} "
                f"({cell(h['peak_gib'], GIB)} / {cell(g['peak_gib'], GIB)} GiB)"
            )
    return lines


def headline(rows: list[dict], env: dict) -> list[str]:
    """Findings as markdown bullets: reach and first OOM per series, memory slopes, speed ratios (CUDA
    only), how measured memory compares with the model; workload=hvp: HVP / gradient time and peak."""
    hvp = env.get("workload") == "hvp"
    ratios = _hvp_ratios(rows) if hvp else []
    return _reach(rows, hvp) + ratios + _k_slopes(rows) + _speed(rows, env) + _model_check(rows)


def progress_line(row: dict) -> str:
    """One line per finished point, for the console."""
    return (
        f"  {row['backend']:9s} {row['order']:6s} ckpt={int(row['checkpoint'])} k={row['k']} "
        f"N={row['n']:7d}  {row['status']:8s} peak={cell(row['peak_gib'], GIB)} "
        f"(model {cell(row['predicted_peak_gib'], GIB)}) saved={cell(row['saved_gib'], GIB)} "
        f"(model {cell(row['predicted_gib'], GIB)}) GiB  t={cell(row['seconds'], '.3f')} s  {row['error']}"
    )


def cell(value, spec: str = ".2f") -> str:
    """A table cell: "-" for None, floats formatted with `spec`."""
    if value is None or value == "":
        return "-"
    return format(value, spec) if isinstance(value, float) else str(value)


def markdown(rows: list[dict], env: dict) -> str:
    """Environment line, headline bullets, then one table row per point."""
    out = [
        f"Device: {env['device']} ({env['device_memory_gib'] or '-'} GiB); torch {env['torch']}, triton "
        f"{env['triton']}, CUDA {env['cuda']}; commit {env['commit']}; {env['utc']} UTC",
        f"Command: `{env['command']}`",
        f"Setup: {env['setup']}",
        "",
        *headline(rows, env),
        "",
        "| backend | order | ckpt | k | N | status | peak GiB | model peak GiB | saved GiB | "
        "model saved GiB | saved KiB/token | time s | first call s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        per_token = None if r["saved_gib"] is None else r["saved_gib"] * 2**20 / r["n"]
        out.append(
            f"| {r['backend']} | {r['order']} | {'on' if r['checkpoint'] else 'off'} | {r['k']} | {r['n']} | "
            f"{r['status']} | {cell(r['peak_gib'], GIB)} | {cell(r.get('predicted_peak_gib'), GIB)} | "
            f"{cell(r['saved_gib'], GIB)} | {cell(r['predicted_gib'], GIB)} | {cell(per_token, '.1f')} | "
            f"{cell(r['seconds'], '.3f')} | {cell(r['first_call_s'], '.2f')} |"
        )
    return "\n".join(out) + "\n"


def plot(rows: list[dict], out_dir: Path, workload: str | None = None) -> list[Path]:
    """memory_vs_n.png, time_vs_n.png (second order, no checkpointing, one line per backend and k; an x
    marks the first OOM) and memory_vs_k.png (at each N of the rows that vary k). workload "hvp": the
    first two only, HVP (order second) solid and gradient (order first) dashed. Returns the paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ttt.tracking.report import save_figure

    hvp = workload == "hvp"
    base = [r for r in rows if (hvp or r["order"] == "second") and not r["checkpoint"]]
    label = "peak GiB"
    title = "HVP (solid) and gradient (dashed)" if hvp else "second order, no checkpointing"
    paths = []
    for name, value, ylabel in (
        ("memory_vs_n", _memory, label),
        ("time_vs_n", lambda r: r["seconds"], "seconds"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for backend, k, order in sorted({(r["backend"], r["k"], r["order"]) for r in base}):
            key = (backend, k, order)
            same = sorted(
                (r for r in base if (r["backend"], r["k"], r["order"]) == key), key=lambda r: r["n"]
            )
            pts = [(r["n"], value(r)) for r in same if r["status"] == "ok" and value(r) is not None]
            style = dict(color=BACKEND_STYLE.get(backend), marker=K_MARKERS.get(k, "*"))
            if hvp:
                style["linestyle"] = "-" if order == "second" else "--"
            series = (
                f"{backend}, {'HVP' if order == 'second' else 'gradient'}" if hvp else f"{backend}, k={k}"
            )
            if pts:
                ax.plot(*zip(*pts), label=series, **style)
            oom = [r["n"] for r in same if r["status"] == "oom"]
            if oom and pts:
                ax.plot(
                    [min(oom)], [pts[-1][1]], marker="x", markersize=10, color=style["color"], linestyle=""
                )
            if name == "memory_vs_n":
                pred = [
                    (r["n"], r["predicted_peak_gib"])
                    for r in same
                    if r.get("predicted_peak_gib") is not None
                    and (r["status"] == "ok" or r["n"] == min(oom, default=None))
                ]
                if pred:
                    ax.plot(*zip(*pred), color=style["color"], linestyle=":", linewidth=1, alpha=0.6)
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="N (tokens)",
            ylabel=ylabel,
            title=title + (" (x: first OOM; dotted: model)" if name == "memory_vs_n" else ""),
        )
        ax.grid(True, which="both", alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        paths.append(out_dir / f"{name}.png")
        save_figure(fig, paths[-1])
    if hvp:
        return paths
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for backend, n, order, ckpt in sorted(
        {(r["backend"], r["n"], r["order"], r["checkpoint"]) for r in rows}
    ):
        pts = sorted(
            (r["k"], _memory(r)) for r in _ok(rows, backend=backend, n=n, order=order, checkpoint=ckpt)
        )
        if len(pts) >= 3:
            ax.plot(
                *zip(*pts),
                marker="o",
                color=BACKEND_STYLE.get(backend),
                linestyle="--" if ckpt else "-",
                label=f"{backend}, N={n}, {order}{', ckpt' if ckpt else ''}",
            )
    ax.set(xlabel="inner steps k", ylabel=label, title="memory vs k (dashed: checkpointed inner steps)")
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)
    paths.append(out_dir / "memory_vs_k.png")
    save_figure(fig, paths[-1])
    return paths


def render(rows: list[dict], env: dict, out_dir: Path) -> None:
    """Write table.md and the plots under out_dir (the plots are skipped, with a note, without matplotlib)."""
    atomic_write_text(out_dir / "table.md", markdown(rows, env))
    try:
        plot(rows, out_dir, env.get("workload"))
    except ImportError as err:
        print(f"plots skipped ({err}); later: python -m ttt.experiments.grad_memory_report {out_dir}")


def main(argv: list[str] | None = None) -> int:
    """Render DIR's table.md and plots from DIR/results.csv and DIR/environment.json."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or not (Path(args[0]) / "results.csv").is_file():
        print("usage: python -m ttt.experiments.grad_memory_report DIR (with results.csv)", file=sys.stderr)
        return 2
    out_dir = Path(args[0])
    env = json.loads((out_dir / "environment.json").read_text())
    render(read_csv_rows(out_dir / "results.csv"), env, out_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
