"""`OuterStepTimer`: wall time per outer step, wall time of the run, peak accelerator memory and the CUDA
caching allocator's retries per outer step, for the run summary, and the training time so far as the
logged metric `train/time_s` (outer steps only: no validation, testing or checkpoint writes), so that runs
can be compared at equal training time (`python -m ttt.tracking.curves --x time`). Every figure covers the
whole run: the timer's state goes into the checkpoint, and a resumed session starts from the figures of
the sessions before it (the retries are this session's)."""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import torch

EARLIER_SESSIONS = {
    "training_seconds": 0.0,
    "training_steps": 0,
    "averaged_seconds": 0.0,
    "averaged_steps": 0,
    "first_outer_step_s": None,
    "wall_seconds": 0.0,
    "peak_memory_gib": None,
}
"""The timer's state (`OuterStepTimer.state_dict`) of a run without earlier sessions: training seconds and
outer steps, those of the steps averaged (each session's first `warmup` left out), the run's first outer
step, wall seconds up to the checkpoint, and the peak memory (GiB, None off CUDA)."""


def _allocator_retries(device: torch.device) -> int:
    """The CUDA caching allocator's retries on device so far (0 off CUDA)."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def _peak(*values: float | None) -> float | None:
    known = [value for value in values if value is not None]
    return max(known) if known else None


class OuterStepTimer(pl.Callback):
    """Times every training batch (synchronising CUDA); the first `warmup` steps of each session are not
    averaged (they include one-off costs such as kernel compilation). started: the time.perf_counter() at
    which this session began (None: now), from which its wall time counts."""

    TIME_METRIC = "train/time_s"

    def __init__(self, warmup: int = 1, started: float | None = None):
        self.warmup = warmup
        self.started = time.perf_counter() if started is None else started
        self.durations: list[float] = []
        self.earlier: dict[str, Any] = dict(EARLIER_SESSIONS)
        """The figures of the sessions before a resume, up to the checkpoint it started from."""
        self.peak_memory_gib: float | None = None
        """Peak allocated CUDA memory of training in GiB over the run, read at train end (None off CUDA)."""
        self.alloc_retries: list[int] = []
        """This session's outer steps' CUDA allocator retries, one count a step (empty off CUDA): each retry
        is an allocation that found no free cached block, so the allocator freed its cache (a device-wide
        synchronisation and cudaFree) and tried again; a step with many is slowed by fragmentation."""
        self._retries_before = 0
        self._device: torch.device | None = None
        self._start = 0.0

    def _sync(self, pl_module: pl.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._device = pl_module.device
        if pl_module.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(pl_module.device)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._sync(pl_module)
        self._retries_before = _allocator_retries(pl_module.device)
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self._sync(pl_module)
        self.durations.append(time.perf_counter() - self._start)
        if pl_module.device.type == "cuda":
            self.alloc_retries.append(_allocator_retries(pl_module.device) - self._retries_before)
        pl_module.log(self.TIME_METRIC, self.training_seconds(), on_step=True, on_epoch=False, batch_size=1)

    def training_seconds(self) -> float:
        """Seconds spent in outer steps since the run began, over every session."""
        return self.earlier["training_seconds"] + sum(self.durations)

    def time_per_outer_step(self) -> float | None:
        """Mean seconds per outer step over the run, each session's first `warmup` steps left out (all steps
        if that leaves none); None before the first step."""
        averaged = self.durations[self.warmup :]
        steps = self.earlier["averaged_steps"] + len(averaged)
        if steps:
            return (self.earlier["averaged_seconds"] + sum(averaged)) / steps
        steps = self.earlier["training_steps"] + len(self.durations)
        return self.training_seconds() / steps if steps else None

    def first_outer_step(self) -> float | None:
        """Seconds of the run's first outer step (includes one-off costs such as kernel compilation)."""
        if self.earlier["first_outer_step_s"] is not None:
            return self.earlier["first_outer_step_s"]
        return self.durations[0] if self.durations else None

    def wall_seconds(self) -> float:
        """Wall seconds of this session so far, plus those of the earlier sessions up to the checkpoint this
        one resumed from."""
        return self.earlier["wall_seconds"] + time.perf_counter() - self.started

    def state_dict(self) -> dict[str, Any]:
        averaged = self.durations[self.warmup :]
        session_peak = None
        if self._device is not None and self._device.type == "cuda":
            session_peak = torch.cuda.max_memory_allocated(self._device) / 2**30
        return {
            "training_seconds": self.training_seconds(),
            "training_steps": self.earlier["training_steps"] + len(self.durations),
            "averaged_seconds": self.earlier["averaged_seconds"] + sum(averaged),
            "averaged_steps": self.earlier["averaged_steps"] + len(averaged),
            "first_outer_step_s": self.first_outer_step(),
            "wall_seconds": self.wall_seconds(),
            "peak_memory_gib": _peak(self.earlier["peak_memory_gib"], session_peak),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.earlier = {key: state_dict.get(key, default) for key, default in EARLIER_SESSIONS.items()}

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Read here: once fit returns, Lightning has moved the module back to the CPU.
        session_peak = None
        if pl_module.device.type == "cuda":
            session_peak = torch.cuda.max_memory_allocated(pl_module.device) / 2**30
        self.peak_memory_gib = _peak(self.earlier["peak_memory_gib"], session_peak)
