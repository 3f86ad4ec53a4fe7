"""Compare the loss by position and the passkey accuracy of several runs in plots and markdown tables.

    python -m ttt.text.compare RUN_DIR [RUN_DIR ...] --out DIR

Each run directory must hold loss_by_position.json (written by the ttt_e2e, ttt_pretrained and
neural_memory recipes). A run that trained with test-time training (or memory writes) contributes two
curves (with and without it); a run without it (ttt.enabled=false) contributes one. Writes
DIR/loss_by_position_compare.png and .md; when the runs have passkey.csv, also
DIR/passkey_compare.png (exact accuracy and key digits right by context length, the same curves)
and .md (exact accuracy, then the fraction of the key's tokens right); when they have
late_loss_by_window.csv, also
DIR/late_loss_paired.md: each curve's late loss against the first curve's, test window by test window
(mean difference, its standard error, and how many windows are lower), for the runs that read the
same test windows; when they have summary.json, also DIR/runs_compare.md: outer steps, training time,
peak memory, late loss and passkey accuracy at the longest length, one row per run; when they logged
validations, also DIR/validation_compare.png: the validation late loss against the outer step and
against the training time (as the runs ran: a GPU shared between runs slows each).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

import numpy as np

from ttt.tracking.report import read_logged_metrics

from .long_context import plot_loss_by_position, plot_passkey_curves, plot_validation_curves


def load_curves(run_dir: Path) -> dict[str, list[dict[str, float]]]:
    """Curve label -> binned rows of one run (labels are '<run name>' or '<run name> (no TTT)')."""
    path = run_dir / "loss_by_position.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{run_dir}: no loss_by_position.json (is it a finished ttt_e2e run directory?)"
        )
    rows = json.loads(path.read_text())
    if rows["adapted"] == rows["unadapted"]:
        return {run_dir.name: rows["adapted"]}
    return {run_dir.name: rows["adapted"], f"{run_dir.name} (no TTT)": rows["unadapted"]}


def curve_modes(run_dir: Path) -> dict[str, str]:
    """Curve label (as in `load_curves`) -> the mode it reads ("adapted" or "unadapted")."""
    return dict(zip(load_curves(run_dir), ("adapted", "unadapted")))


def load_passkey(run_dir: Path, measure: str = "exact") -> dict[str, list[tuple[int, float]]]:
    """Curve label (as in `load_curves`) -> (context length, passkey accuracy) points of one run, by
    `measure`: "exact" (every digit right) or "token" (the fraction of digits right); empty when the
    run has no passkey.csv."""
    path = run_dir / "passkey.csv"
    if not path.is_file():
        return {}
    rows = list(csv.DictReader(path.open()))
    return {
        label: [(int(r["length"]), float(r[f"{measure}_{mode}"])) for r in rows]
        for label, mode in curve_modes(run_dir).items()
    }


def load_window_losses(run_dir: Path) -> dict[str, dict[str, float]]:
    """Curve label (as in `load_curves`) -> {test window id: late loss} of one run; empty when the run
    has no late_loss_by_window.csv (a run directory may lack it: the pairing is then left out)."""
    path = run_dir / "late_loss_by_window.csv"
    if not path.is_file():
        return {}
    rows = list(csv.DictReader(path.open()))
    return {
        label: {r["window"]: float(r[f"late_loss_{mode}"]) for r in rows}
        for label, mode in curve_modes(run_dir).items()
    }


def load_validation(run_dir: Path) -> dict[str, list[tuple[int, float, float]]]:
    """Curve label (as in `load_curves`) -> (outer step, training time in s, validation late loss)
    points of one run: every logged validation, its time that of the last training step logged at or
    before it; empty when the run logged no validation or no training time."""
    series = read_logged_metrics(run_dir)
    times = series.get("train/time_s", [])
    curves = {}
    for label, mode in curve_modes(run_dir).items():
        points = []
        for step, loss in series.get(f"val/late_loss_{mode}", []):
            before = [time for logged, time in times if logged <= step]
            if before:
                points.append((step, before[-1], loss))
        if points:
            curves[label] = points
    return curves


def paired_table(windows: dict[str, dict[str, float]]) -> str:
    """Each curve's late loss against the first curve's, window by window: the mean over its windows,
    the mean difference (negative: lower than the first), the difference's standard error over the
    windows, and the windows where it is lower. A curve read on other test windows is not paired."""
    (reference, base), *others = windows.items()
    lines = [
        f"Late loss per test window, against {reference} ({len(base)} windows):",
        "",
        f"| curve | late loss | minus {reference} | standard error | windows lower |",
        "|---|---|---|---|---|",
        f"| {reference} | {np.mean(list(base.values())):.4f} | | | |",
    ]
    for name, losses in others:
        mean = np.mean(list(losses.values()))
        if losses.keys() != base.keys():
            lines.append(f"| {name} | {mean:.4f} | other test windows: not paired | | |")
            continue
        diffs = np.array([losses[window] - base[window] for window in base])
        error = f"{diffs.std(ddof=1) / np.sqrt(len(diffs)):.4f}" if len(diffs) > 1 else "-"
        lower = f"{int((diffs < 0).sum())} of {len(diffs)}"
        lines.append(f"| {name} | {mean:.4f} | {diffs.mean():+.4f} | {error} | {lower} |")
    return "\n".join(lines) + "\n"


def runs_table(summaries: dict[str, dict]) -> str:
    """One row per run (run name -> its summary.json): outer steps, training time as run (the GPU may
    have been shared), peak memory, the test late loss with and without TTT (one value for a run
    without TTT), and passkey exact / digit accuracy with TTT at the longest context length tested."""

    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    lines = [
        "| run | outer steps | training time (s) | peak memory (GiB) | late loss | without TTT "
        "| passkey length | passkey exact | key digits |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, summary in summaries.items():
        lengths = [int(key.split("_")[2]) for key in summary if key.startswith("passkey_exact_")]
        longest = max(lengths, default=None)
        late, without = summary.get("late_loss_adapted"), summary.get("late_loss_unadapted")
        cells = [
            cell(summary.get("outer_steps"), "d"),
            cell(summary.get("training_time_s"), ".0f"),
            cell(summary.get("peak_memory_gib"), ".1f"),
            cell(late, ".3f"),
            cell(without if without != late else None, ".3f"),
            cell(longest, "d"),
            cell(summary.get(f"passkey_exact_{longest}_adapted"), ".3f"),
            cell(summary.get(f"passkey_token_{longest}_adapted"), ".3f"),
        ]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def passkey_table(curves: dict[str, list[tuple[int, float]]]) -> str:
    """Passkey accuracy per context length (columns) of each curve (rows)."""
    lengths = sorted({length for points in curves.values() for length, _ in points})
    lines = [
        "| curve | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
        "|" + "---|" * (len(lengths) + 1),
    ]
    for name, points in curves.items():
        by_length = dict(points)
        cells = [f"{by_length[n]:.2f}" if n in by_length else "-" for n in lengths]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def markdown_table(curves: dict[str, list[dict[str, float]]]) -> str:
    """Loss per position bin (columns) of each curve (rows)."""
    bins = next(iter(curves.values()))
    header = "| curve | " + " | ".join(f"{r['start']}-{r['end']}" for r in bins) + " |"
    lines = [header, "|" + "---|" * (len(bins) + 1)]
    lines += [
        f"| {name} | " + " | ".join(f"{r['loss']:.4f}" for r in rows) + " |" for name, rows in curves.items()
    ]
    return "\n".join(lines) + "\n"


def emit(path: Path, table: str, first: bool = False) -> None:
    """Write a markdown table to `path` and print it (after a blank line unless it is the first)."""
    path.write_text(table)
    print(("" if first else "\n") + table, end="")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ttt.text.compare`; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m ttt.text.compare", description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run directories")
    parser.add_argument("--out", type=Path, required=True, help="directory for the plot and the table")
    args = parser.parse_args(argv)
    try:
        curves = {label: rows for run in args.runs for label, rows in load_curves(run).items()}
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    plot_loss_by_position(args.out / "loss_by_position_compare.png", curves, "loss by token position")
    emit(args.out / "loss_by_position_compare.md", markdown_table(curves), first=True)
    passkey = {label: points for run in args.runs for label, points in load_passkey(run).items()}
    if passkey:
        tokens = {label: points for run in args.runs for label, points in load_passkey(run, "token").items()}
        plot_passkey_curves(args.out / "passkey_compare.png", passkey, tokens)
        emit(
            args.out / "passkey_compare.md",
            f"Exact (every digit of the key right):\n\n{passkey_table(passkey)}\n"
            f"Fraction of the key's digits right (teacher-forced):\n\n{passkey_table(tokens)}",
        )
    summaries = {
        run.name: json.loads((run / "summary.json").read_text())
        for run in args.runs
        if (run / "summary.json").is_file()
    }
    if summaries:
        emit(args.out / "runs_compare.md", runs_table(summaries))
    validation = {label: points for run in args.runs for label, points in load_validation(run).items()}
    if validation:
        plot_validation_curves(args.out / "validation_compare.png", validation)
    windows = {label: losses for run in args.runs for label, losses in load_window_losses(run).items()}
    if windows:
        emit(args.out / "late_loss_paired.md", paired_table(windows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
