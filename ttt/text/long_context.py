"""What long-context users look at, with and without test-time training: next-token loss by token
position, and passkey retrieval accuracy by context length. Written to the run directory as CSV,
JSON and PNG plots.

Every function takes `read(tokens, adapt) -> (logits or None, losses)`, the reading of sequences
(B, N) by the model under test, each on its own (adapt=False: the same model without test-time
training)."""

from __future__ import annotations

import csv
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ttt.tracking.report import new_figure, save_figure
from ttt.tracking.summary import strict_json

from .passkey import sample_passkey
from .tokenizer import Tokenizer

MODES = {"adapted": True, "unadapted": False}
"""Figure suffix -> whether the model adapts (test-time training on) while reading."""

ReadFn = Callable[[torch.Tensor, bool], tuple[torch.Tensor | None, torch.Tensor]]


@dataclass
class LongContextEvalConfig:
    """Evaluation after training (test split and passkey)."""

    position_bins: int = 16
    """Loss by position is averaged over this many equal bins of token positions."""
    late_fraction: float = 0.25
    """The summary's late_loss is the mean loss over this last fraction of the positions."""
    passkey_lengths: list[int] = field(default_factory=lambda: [256, 512])
    """Context lengths (tokens) of the passkey test; empty: no passkey test."""
    passkey_trials: int = 8
    """Passkey sequences per length."""
    passkey_digits: int = 5
    """Digits of the key."""

    def __post_init__(self):
        if self.position_bins < 1:
            raise ValueError(f"eval.position_bins must be a positive int, got {self.position_bins}")
        if not 0 < self.late_fraction <= 1:
            raise ValueError(f"eval.late_fraction must be in (0, 1], got {self.late_fraction}")
        if any(length < 2 for length in self.passkey_lengths):
            raise ValueError(f"eval.passkey_lengths must be ints >= 2, got {self.passkey_lengths}")
        if self.passkey_trials < 1 or self.passkey_digits < 1:
            raise ValueError("eval.passkey_trials and eval.passkey_digits must be positive ints")


def late_start(positions: int, late_fraction: float) -> int:
    """The first of the last `late_fraction` of `positions` scored positions: where late_loss begins."""
    return int(positions * (1 - late_fraction))


def window_ids(tokens: torch.Tensor) -> torch.Tensor:
    """A 63-bit fingerprint (B,) int64 of each window of `tokens` (B, N) (on their device): the same
    window has the same id in every run, so that runs can be compared window by window."""
    rows = tokens.to(torch.int64).cpu().numpy()
    ids = [
        int.from_bytes(hashlib.blake2b(row.tobytes(), digest_size=8).digest(), "little") >> 1 for row in rows
    ]
    return torch.tensor(ids, dtype=torch.int64, device=tokens.device)


def bin_positions(mean_loss: np.ndarray, bins: int) -> list[dict[str, float]]:
    """Mean of per-position losses (P,) over `bins` equal ranges: rows {start, end, loss} (end exclusive)."""
    edges = np.linspace(0, len(mean_loss), min(bins, len(mean_loss)) + 1).astype(int)
    return [
        {"start": int(a), "end": int(b), "loss": float(mean_loss[a:b].mean())}
        for a, b in zip(edges[:-1], edges[1:])
    ]


def passkey_accuracy(
    read: ReadFn, tokenizer: Tokenizer, cfg: LongContextEvalConfig, *, seed: int, device: torch.device
) -> list[dict[str, float]]:
    """Rows {length, exact_*, token_*, first_*} (* = adapted, unadapted): the fraction of passkeys
    retrieved exactly, of answer tokens right, and of first answer tokens right (the one that no earlier
    answer token hints at), per context length (same keys in both modes)."""
    rows = []
    for length in cfg.passkey_lengths:
        row = {"length": length}
        samples = [
            sample_passkey(tokenizer, length, cfg.passkey_digits, np.random.default_rng([seed, length, t]))
            for t in range(cfg.passkey_trials)
        ]
        tokens = torch.from_numpy(np.stack([sample["tokens"] for sample in samples])).to(device)
        masks = np.stack([sample["answer_mask"] for sample in samples])  # keys may differ in token count
        first = int(np.flatnonzero(masks.any(0))[0])  # answers sit at the end: score from here on
        scored = torch.from_numpy(masks[:, first:-1]).to(device)  # (trials, L - 1 - first)
        opening = torch.from_numpy(masks[:, first:-1].argmax(1)).to(device)  # each key's first position
        for mode, adapt in MODES.items():
            logits, _ = read(tokens, adapt)
            hits = logits[:, first:-1].argmax(-1) == tokens[:, first + 1 :]
            row[f"exact_{mode}"] = (hits | ~scored).all(1).float().mean().item()
            row[f"token_{mode}"] = ((hits & scored).sum(1) / scored.sum(1)).mean().item()
            row[f"first_{mode}"] = hits.gather(1, opening[:, None]).float().mean().item()
        rows.append(row)
    return rows


def write_csv(path: Path, rows: list[dict]) -> None:
    """Rows (dicts with the same keys) as a CSV file with a header."""
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def add_legend(ax, curves: int) -> None:
    """The legend of an axes with `curves` lines: inside it for up to 4, beside it for more (it would
    hide the lines)."""
    if curves <= 4:
        ax.legend()
    else:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1))


def plot_loss_by_position(path: Path, curves: dict[str, list[dict[str, float]]], title: str) -> None:
    """One line per curve name: loss against the middle position of each bin."""
    fig, (ax,) = new_figure()
    for name, rows in curves.items():
        ax.plot(
            [(r["start"] + r["end"]) / 2 for r in rows], [r["loss"] for r in rows], marker="o", label=name
        )
    ax.set(xlabel="token position", ylabel="next-token loss (nats)", title=title)
    add_legend(ax, len(curves))
    save_figure(fig, path)


def plot_validation_curves(path: Path, curves: dict[str, list[tuple[int, float, float]]]) -> None:
    """Two panels, one line per curve name, points (outer step, training time in s, validation late
    loss): the loss against the outer step (equal steps) and against the training time (equal
    wall-clock, as the runs ran)."""
    fig, axes = new_figure(2)
    for ax, column, xlabel in ((axes[0], 0, "outer step"), (axes[1], 1, "training time (s)")):
        for name, points in curves.items():
            ax.plot([p[column] for p in points], [p[2] for p in points], marker="o", label=name)
        ax.set(xlabel=xlabel, ylabel="validation late loss (nats)")
    add_legend(axes[1], len(curves))
    save_figure(fig, path)


def plot_passkey_curves(
    path: Path, exact: dict[str, list[tuple[int, float]]], digits: dict[str, list[tuple[int, float]]]
) -> None:
    """Two panels, one line per curve name, points (context length, accuracy): the passkeys retrieved
    exactly (`exact`), and the fraction of the key's digits right, teacher-forced (`digits`)."""
    fig, axes = new_figure(2)
    for ax, curves, label in (
        (axes[0], exact, "passkey exact accuracy"),
        (axes[1], digits, "key digits right"),
    ):
        for name, points in curves.items():
            ax.plot([length for length, _ in points], [acc for _, acc in points], marker="o", label=name)
        ax.set(xlabel="context length (tokens)", ylabel=label, ylim=(-0.05, 1.05), xscale="log")
    add_legend(axes[1], len(digits))
    save_figure(fig, path)


def plot_passkey(path: Path, rows: list[dict[str, float]]) -> None:
    """Exact passkey accuracy and key digits right against context length, with and without
    test-time training."""
    exact, digits = (
        {f"TTT {mode}": [(r["length"], r[f"{measure}_{mode}"]) for r in rows] for mode in MODES}
        for measure in ("exact", "token")
    )
    plot_passkey_curves(path, exact, digits)


def write_long_context_report(
    run_dir: Path,
    position_rows: dict[str, list[dict[str, float]]],
    passkey_rows: list[dict[str, float]],
    window_rows: list[dict[str, float | str]],
    position_means: dict[str, np.ndarray],
) -> dict[str, str]:
    """Write loss_by_position.{csv,json,png} (binned), nll_by_position.csv (every position, unbinned:
    rows {position, nll_adapted, nll_unadapted} from position_means, mode -> (P,) mean next-token loss
    of each position over the test windows, masked targets included), late_loss_by_window.csv (rows
    {window: id in hex, late_loss_adapted, late_loss_unadapted}, one per test window) and
    passkey.{csv,png} into run_dir; returns name -> path."""
    run_dir.mkdir(parents=True, exist_ok=True)
    names = list(position_rows)
    table = [
        {
            "start": row["start"],
            "end": row["end"],
            **{f"loss_{n}": position_rows[n][i]["loss"] for n in names},
        }
        for i, row in enumerate(position_rows[names[0]])
    ]
    files = {
        "loss_by_position_csv": run_dir / "loss_by_position.csv",
        "loss_by_position_png": run_dir / "loss_by_position.png",
    }
    write_csv(files["loss_by_position_csv"], table)
    files["nll_by_position_csv"] = run_dir / "nll_by_position.csv"
    modes = list(position_means)
    write_csv(
        files["nll_by_position_csv"],
        [
            {"position": i, **{f"nll_{mode}": float(position_means[mode][i]) for mode in modes}}
            for i in range(len(position_means[modes[0]]))
        ],
    )
    files["late_loss_by_window_csv"] = run_dir / "late_loss_by_window.csv"
    write_csv(files["late_loss_by_window_csv"], window_rows)
    (run_dir / "loss_by_position.json").write_text(strict_json(position_rows, indent=2) + "\n")
    plot_loss_by_position(
        files["loss_by_position_png"],
        {f"TTT {n}": rows for n, rows in position_rows.items()},
        "loss by token position (test split)",
    )
    if passkey_rows:
        files["passkey_csv"], files["passkey_png"] = run_dir / "passkey.csv", run_dir / "passkey.png"
        write_csv(files["passkey_csv"], passkey_rows)
        plot_passkey(files["passkey_png"], passkey_rows)
    return {name: str(path) for name, path in files.items()}
