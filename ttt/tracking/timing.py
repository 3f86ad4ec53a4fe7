"""`OuterStepTimer`: wall time per outer step and peak accelerator memory, for the run summary, and the
training time so far as the logged metric `train/time_s` (outer steps only: no validation, testing or
checkpoint writes; carried across resumes), so that runs can be compared at equal training time
(`python -m ttt.tracking.curves --x time`)."""

from __future__ import annotations

import time

import lightning.pytorch as pl
import torch


class OuterStepTimer(pl.Callback):
    """Times every training batch (synchronising CUDA); the first `warmup` steps are not averaged."""

    TIME_METRIC = "train/time_s"

    def __init__(self, warmup: int = 1):
        self.warmup = warmup
        self.durations: list[float] = []
        self.earlier_sessions_s = 0.0
        """Training seconds of the sessions before a resume (from the checkpoint)."""
        self.peak_memory_gib: float | None = None
        """Peak allocated CUDA memory of training in GiB, read at train end (None off CUDA)."""
        self._start = 0.0

    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(pl_module)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(pl_module)
        self.durations.append(time.perf_counter() - self._start)
        pl_module.log(self.TIME_METRIC, self.training_seconds(), on_step=True, on_epoch=False, batch_size=1)

    def training_seconds(self) -> float:
        """Seconds spent in outer steps since the run began, over every session."""
        return self.earlier_sessions_s + sum(self.durations)

    def state_dict(self) -> dict[str, float]:
        return {"training_seconds": self.training_seconds()}

    def load_state_dict(self, state_dict: dict[str, float]) -> None:
        self.earlier_sessions_s = float(state_dict.get("training_seconds", 0.0))

    def time_per_outer_step(self) -> float | None:
        """Mean seconds per outer step after the warm-up steps (all steps if there are no others)."""
        timed = self.durations[self.warmup :] or self.durations
        return sum(timed) / len(timed) if timed else None

    def first_outer_step(self) -> float | None:
        """Seconds of the first timed outer step (includes one-off costs such as kernel compilation)."""
        return self.durations[0] if self.durations else None

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Read here: once fit returns, Lightning has moved the module back to the CPU.
        if pl_module.device.type == "cuda":
            self.peak_memory_gib = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
