"""Overlay logged metrics of several runs against the outer step or the training time.

    python -m ttt.tracking.curves RUN_DIR [RUN_DIR ...] --out DIR [--metric NAME ...] [--x step|time]

Reads every session's logs/version_*/metrics.csv of each run (`report.read_logged_metrics`) and
writes DIR/curves.png (one panel per metric, one line per run) and DIR/curves.md (per run and
metric: the last logged value and its step and training time). `--x time` draws against the
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

from .report import new_figure, read_logged_metrics, save_figure
from .timing import OuterStepTimer

DEFAULT_METRICS = ("val/query_acc_adapted", "val/query_loss_adapted")
"""Drawn when no --metric is given (recall and query loss of the MAML recipes)."""
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


def load_runs(run_dirs: list[Path], metrics: list[str], x: str) -> Curves:
    """Run name -> metric -> [(x, value)] finite points, x the step or the training seconds."""
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
    for metric in metrics:
        if not any(curves[metric] for curves in runs.values()):
            raise ValueError(
                f"no run logged {metric!r}; names look like val/query_acc_adapted or train/outer_loss"
            )
    return runs


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ttt.tracking.curves", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories written by ttt.train")
    parser.add_argument("--out", type=Path, required=True, help="directory for curves.png and curves.md")
    parser.add_argument(
        "--metric", action="append", help=f"logged metric (repeatable); default {DEFAULT_METRICS}"
    )
    parser.add_argument(
        "--x", choices=X_AXES, default="step", help="horizontal axis: outer step or training time"
    )
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.run_dirs, args.metric or list(DEFAULT_METRICS), args.x)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    plot_curves(args.out / "curves.png", runs, args.x)
    (args.out / "curves.md").write_text(markdown_table(runs, args.x))
    print(f"wrote {args.out / 'curves.png'} and {args.out / 'curves.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
