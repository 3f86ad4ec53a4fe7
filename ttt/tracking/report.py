"""The figures every run writes at its end, from what it logged: training curves from the
metrics.csv files of all its sessions, and the held-out figures with and without adaptation from its
summary. One plotting style for the project (`new_figure`, `save_figure`; ttt.text.long_context draws
its loss-by-position and passkey figures with them too).

    write_run_report(run_dir, summary) -> {"training_curves_png": path, "test_adapted_vs_unadapted_png": path}
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib import pyplot as plt  # noqa: E402  (after choosing the file-only backend)

from .atomic import atomic_write_bytes  # noqa: E402

TRAIN_CURVES = ("train/outer_loss", "train/inner_loss_first", "train/inner_loss_last", "train/loss")
"""Logged training losses drawn against the outer step (those a run logged)."""
VAL_CURVES = ("val/query_loss_unadapted", "val/query_loss_adapted")
"""Logged validation losses drawn against the outer step."""


def new_figure(panels: int = 1) -> tuple[Any, list[Any]]:
    """A figure of `panels` side-by-side axes (6 x 4 inches each) with a light grid: (figure, axes)."""
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    for ax in axes[0]:
        ax.grid(alpha=0.3)
        ax.set_axisbelow(True)
    return fig, list(axes[0])


def save_figure(fig: Any, path: Path) -> None:
    """Lay out, write `fig` to `path` (PNG, 120 dpi) atomically (an interrupted write leaves the old file)
    and close it."""
    fig.tight_layout()
    atomic_write_bytes(Path(path), lambda handle: fig.savefig(handle, format="png", dpi=120))
    plt.close(fig)


def read_logged_metrics(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Metric name -> [(step, value)] over every session's logs/version_*/metrics.csv, in step order;
    empty and non-numeric cells are left out."""
    series: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((run_dir / "logs").glob("version_*/metrics.csv")):
        with path.open(newline="") as handle:
            for row in csv.DictReader(handle):
                for name, cell in row.items():
                    if name in ("epoch", "step") or not cell:
                        continue
                    try:
                        series.setdefault(name, []).append((int(row["step"]), float(cell)))
                    except ValueError:
                        continue
    return {name: sorted(points) for name, points in series.items()}


def plot_training_curves(path: Path, series: dict[str, list[tuple[int, float]]]) -> bool:
    """Training losses (left) and validation query losses with and without adaptation (right) against
    the outer step; False (and no file) when the run logged none of them."""
    panels = [
        (names, ylabel)
        for names, ylabel in ((TRAIN_CURVES, "training loss"), (VAL_CURVES, "validation query loss"))
        if any(series.get(name) for name in names)
    ]
    if not panels:
        return False
    fig, axes = new_figure(len(panels))
    for ax, (names, ylabel) in zip(axes, panels):
        for name in names:
            points = [(step, value) for step, value in series.get(name, []) if math.isfinite(value)]
            if points:
                ax.plot(*zip(*points), marker="o" if len(points) < 30 else None, label=name.split("/", 1)[1])
        ax.set(xlabel="outer step", ylabel=ylabel)
        ax.legend()
    save_figure(fig, path)
    return True


def adapted_pairs(summary: dict[str, Any]) -> list[str]:
    """Metric names m with both m_unadapted and m_adapted (finite numbers) in `summary`."""

    def number(key: str) -> bool:
        value = summary.get(key)
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    names = {key.removesuffix("_unadapted") for key in summary if key.endswith("_unadapted")}
    return sorted(name for name in names if number(f"{name}_unadapted") and number(f"{name}_adapted"))


def plot_adapted_vs_unadapted(path: Path, summary: dict[str, Any]) -> bool:
    """One panel per held-out metric of the summary: its value without and with adaptation (bars);
    False (and no file) when the summary has no such pair."""
    names = adapted_pairs(summary)
    if not names:
        return False
    fig, axes = new_figure(len(names))
    for ax, name in zip(axes, names):
        values = [summary[f"{name}_unadapted"], summary[f"{name}_adapted"]]
        bars = ax.bar(["unadapted", "adapted"], values, color=["tab:gray", "tab:blue"])
        ax.bar_label(bars, fmt="%.4g")
        ax.set(ylabel=name, title=f"test: {name}")
    save_figure(fig, path)
    return True


def write_run_report(run_dir: Path, summary: dict[str, Any]) -> dict[str, str]:
    """Write training_curves.png and test_adapted_vs_unadapted.png into run_dir (each when there is
    something to draw); returns figure name -> path."""
    run_dir = Path(run_dir)
    figures = {
        "training_curves_png": (
            run_dir / "training_curves.png",
            lambda path: plot_training_curves(path, read_logged_metrics(run_dir)),
        ),
        "test_adapted_vs_unadapted_png": (
            run_dir / "test_adapted_vs_unadapted.png",
            lambda path: plot_adapted_vs_unadapted(path, summary),
        ),
    }
    return {name: str(path) for name, (path, draw) in figures.items() if draw(path)}
