"""`DivergenceGuard`: stop a run at the first non-finite loss, before anything is saved from it.

It reads what every learner reports after each outer step (the value `training_step` returns and
the logged `train/*` losses), so it does not depend on how a learner computes them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import lightning.pytorch as pl
import torch

WATCHED_LOSSES = {
    "train/inner_loss_first": "inner loss before the first inner step (the unadapted initial weights)",
    "train/inner_loss_last": "inner loss before the last inner step (after inner adaptation)",
    "train/outer_loss": "outer (query) loss after inner adaptation",
    "train/loss": "outer loss (mean next-token loss through the inner updates)",
}
"""Logged training losses that are checked after every outer step, and what each one measures."""


class DivergenceError(RuntimeError):
    """Training produced a non-finite loss or parameter; the message names the step, the losses and the
    config keys most likely at fault."""


DEFAULT_INNER_KEYS = "inner.lr (and inner.grad_clip, inner.steps)"


def _likely_causes(bad: set[str], inner_keys: str | None = DEFAULT_INNER_KEYS) -> str:
    """The config keys to look at first, given which losses are non-finite; inner_keys: the keys that
    size the recipe's inner steps (`RecipeConfig.inner_step_keys`; None: it has none)."""
    outer = "optim.lr (and optim.grad_clip), trainer.precision"
    if "train/inner_loss_first" in bad:
        return "the initial weights are already non-finite or overflow: optim.lr, trainer.precision"
    if inner_keys and bad & {"train/inner_loss_last", "train/outer_loss"}:
        return f"the inner updates diverged: {inner_keys}, trainer.precision"
    return f"{inner_keys}, {outer}" if inner_keys else outer


def _which_passes(outputs: Mapping) -> list[str]:
    """Lines naming the passes whose metrics are non-finite, from the "pass_metrics" a learner returns
    next to "loss" (name -> (passes,)); a pass is one task of a MetaLearner, ttt.sequences_per_pass
    sequences of the TTT learner."""
    lines = []
    for name, values in sorted(dict(outputs.get("pass_metrics") or {}).items()):
        if not isinstance(values, torch.Tensor) or values.numel() == 0:
            continue
        bad = ~torch.isfinite(values.detach().float().cpu().reshape(len(values), -1)).all(1)
        if not bad.any():
            continue
        rows = [int(i) for i in bad.nonzero()[:, 0]]
        if len(rows) == len(values):
            which = f"all {len(rows)} passes"
        else:
            shown = ", ".join(map(str, rows[:10])) + (", ..." if len(rows) > 10 else "")
            which = f"{len(rows)} of {len(values)} passes (index {shown})"
        lines.append(f"  {name} non-finite in {which}")
    if lines:
        lines.append(
            "  (a pass: one task of a MetaLearner; ttt.sequences_per_pass sequences of the TTT learner)"
        )
    return lines


def _finite(value: torch.Tensor | float) -> bool:
    if isinstance(value, torch.Tensor):
        return bool(torch.isfinite(value).all())
    return math.isfinite(float(value))


class DivergenceGuard(pl.Callback):
    """Raises `DivergenceError` after an outer step whose loss is NaN or infinite, and at an epoch end
    whose parameters are not all finite (so the end-of-epoch checkpoint, saved by a callback after
    this one, keeps the last good state). `checkpoint`: that checkpoint's path, named in the error;
    `inner_keys`: the keys that size the recipe's inner steps (`RecipeConfig.inner_step_keys`), named
    among the likely causes."""

    def __init__(self, checkpoint: Path | None = None, inner_keys: str | None = DEFAULT_INNER_KEYS):
        self.checkpoint, self.inner_keys = checkpoint, inner_keys

    def _kept(self) -> str:
        if self.checkpoint is not None and Path(self.checkpoint).is_file():
            return f"the last good checkpoint is kept: {self.checkpoint} (resume=PATH continues from it)"
        return "no checkpoint had been written yet"

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx
    ):
        metrics: dict[str, torch.Tensor | float] = {
            name: value for name, value in trainer.callback_metrics.items() if name in WATCHED_LOSSES
        }
        loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            metrics["training_step output"] = loss.detach()
        bad = {name for name, value in metrics.items() if not _finite(value)}
        if not bad:
            return
        step = trainer.global_step  # outer steps completed, this one included
        lines = [f"training diverged at outer step {step} (epoch {trainer.current_epoch}): non-finite loss"]
        for name in sorted(bad):
            value = float(metrics[name]) if metrics[name].numel() == 1 else "non-finite entries"
            lines.append(f"  {name} = {value}  ({WATCHED_LOSSES.get(name, 'returned by training_step')})")
        if isinstance(outputs, Mapping):
            lines += _which_passes(outputs)
        finite = sorted(set(metrics) - bad)
        if finite:
            lines.append("  finite: " + ", ".join(f"{n} = {float(metrics[n]):.4g}" for n in finite))
        lines.append(f"  likely at fault: {_likely_causes(bad, self.inner_keys)}")
        lines.append(f"  nothing was saved from this state; {self._kept()}")
        lines.append("  trainer.detect_anomaly=true names the operation that produced the first NaN")
        raise DivergenceError("\n".join(lines))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check_parameters(trainer, pl_module)

    def check_parameters(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Raise `DivergenceError` unless every parameter is finite: before a checkpoint is written (at an
        epoch end, and before `StepBoundaryCheckpoint`'s saves within an epoch)."""
        bad = [name for name, p in pl_module.named_parameters() if not bool(torch.isfinite(p).all())]
        if bad:
            raise DivergenceError(
                f"training diverged by outer step {trainer.global_step} (epoch {trainer.current_epoch}): "
                f"{len(bad)} parameter tensors are non-finite (first: {bad[0]}) although the losses were "
                "finite; likely at fault: optim.lr, optim.grad_clip, trainer.precision. This step's "
                f"checkpoint was not written; {self._kept()}"
            )
