"""Overlay logged metrics of several runs against the outer step or the training time.

    python -m ttt.tracking.curves RUN_DIR [RUN_DIR ...] [--out DIR] [--metric NAME ...] [--x step|time]

Reads every session's logs/version_*/metrics.csv of each run (`report.read_logged_metrics`) and
writes DIR/curves.png (one panel per metric, one line per run) and DIR/curves.md (per run and
metric: the last logged value and its step and training time); DIR defaults to the run directory when
there is one run, and must be given for several. `--x time` draws against the
training seconds the run logged (`train/time_s`, outer steps only: validation and checkpoints are
left out), so runs are compared at equal training time; each metric's step is placed on the time
axis by interpolating the run's (step, time) points. A run is named by its directory's name.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from .atomic import atomic_write_text
from .directory import RunDirectoryError, check_writable
from .report import new_figure, read_logged_metrics, save_figure
from .timing import OuterStepTimer

DEFAULT_METRICS = ("val/query_acc_adapted", "val/query_loss_adapted")
"""Drawn when no --metric is given (recall and query loss of the MAML recipes), those that a run logged."""
X_AXES = ("step", "time")


def step_to_time(
    series: dict[str, list[tuple[int, float]]], run_dir: Path
) -> tuple[np.ndarray, np.ndarray]:
    """(steps, seconds) of a run's logged training time, for np.interp; an error naming the run if it
    logged none (runs from before the metric existed)."""
    points = series.get(OuterStepTimer.TIME_METRIC, [])
    if not points:
        raise ValueError(
            f"{run_dir}: logged no {OuterStepTimer.TIME_METRIC} (a run from before it was logged); "
            "use --x step"
        )
    steps, seconds = zip(*points)
    return np.asarray(steps, dtype=float), np.asarray(seconds, dtype=float)


Curves = dict[str, dict[str, list[tuple[float, float]]]]
"""Run name -> metric -> [(x, value)]."""


def load_runs(run_dirs: list[Path], metrics: list[str], x: str, *, only_logged: bool = False) -> Curves:
    """Run name -> metric -> [(x, value)] finite points, x the step or the training seconds. A metric that
    no run logged is an error, or, with `only_logged`, left out (an error if that leaves none)."""
    runs = {}
    for run_dir in run_dirs:
        if not (run_dir / "logs").is_dir():
            raise FileNotFoundError(f"{run_dir}: no logs/ directory (is it a run directory of ttt.train?)")
        series = read_logged_metrics(run_dir)
        clock = step_to_time(series, run_dir) if x == "time" else None
        curves = {}
        for metric in metrics:
            points = [(step, value) for step, value in series.get(metric, []) if math.isfinite(value)]
            if clock is not None:
                points = [(float(np.interp(step, *clock)), value) for step, value in points]
            curves[metric] = points
        runs[run_dir.name] = curves
    missing = [metric for metric in metrics if not any(curves[metric] for curves in runs.values())]
    if missing and (not only_logged or len(missing) == len(metrics)):
        raise ValueError(
            f"no run logged {' or '.join(repr(metric) for metric in missing)}; names look like "
            "val/query_acc_adapted or train/outer_loss (--metric NAME)"
        )
    return {name: {m: curves[m] for m in metrics if m not in missing} for name, curves in runs.items()}


def plot_curves(path: Path, runs: Curves, x: str) -> None:
    """One panel per metric, one line per run, against `x` (step or time)."""
    metrics = list(next(iter(runs.values())))
    fig, axes = new_figure(len(metrics))
    for ax, metric in zip(axes, metrics):
        for name, curves in runs.items():
            if curves[metric]:
                ax.plot(*zip(*curves[metric]), marker="o" if len(curves[metric]) < 30 else None, label=name)
        ax.set(xlabel="outer step" if x == "step" else "training time (s)", ylabel=metric)
        ax.legend(fontsize=8)
    save_figure(fig, path)


def markdown_table(runs: Curves, x: str) -> str:
    """Per run, the last logged value of each metric and where (step or seconds) it was logged."""
    metrics = list(next(iter(runs.values())))
    where = "step" if x == "step" else "time (s)"
    lines = [
        "| run | " + " | ".join(f"{m} (last) | {where}" for m in metrics) + " |",
        "|---|" + "---|---|" * len(metrics),
    ]
    for name, curves in runs.items():
        cells = []
        for metric in metrics:
            last = curves[metric][-1] if curves[metric] else None
            cells += [f"{last[1]:.4g}", f"{last[0]:.0f}"] if last else ["", ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def output_directory(out: Path | None, run_dirs: list[Path]) -> Path:
    """Where curves.png and curves.md go: `out`, else the one run's directory. ValueError when several
    runs are given without `out`, RunDirectoryError when the directory cannot be written."""
    if out is None:
        if len(run_dirs) > 1:
            raise ValueError(
                f"--out DIR is needed to overlay {len(run_dirs)} runs (it defaults to the run directory "
                "only when there is one run)"
            )
        out = run_dirs[0]
    check_writable(out, f"--out {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ttt.tracking.curves`; returns the exit status (2: bad arguments or runs)."""
    parser = argparse.ArgumentParser(
        prog="python -m ttt.tracking.curves", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories written by ttt.train")
    parser.add_argument(
        "--out", type=Path, help="directory for curves.png and curves.md; default: the run's (one run)"
    )
    parser.add_argument(
        "--metric",
        action="append",
        help=f"logged metric (repeatable); default: those of {DEFAULT_METRICS} that a run logged",
    )
    parser.add_argument(
        "--x", choices=X_AXES, default="step", help="horizontal axis: outer step or training time"
    )
    args = parser.parse_args(argv)
    try:
        metrics = args.metric or list(DEFAULT_METRICS)
        runs = load_runs(args.run_dirs, metrics, args.x, only_logged=args.metric is None)
        out = output_directory(args.out, args.run_dirs)
    except (ValueError, FileNotFoundError, RunDirectoryError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    plot_curves(out / "curves.png", runs, args.x)
    atomic_write_text(out / "curves.md", markdown_table(runs, args.x))
    print(f"wrote {out / 'curves.png'} and {out / 'curves.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
