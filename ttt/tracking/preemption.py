"""Runs that survive preemption: a signal (SIGTERM, SIGUSR1, or SIGINT: Ctrl-C) or a clock
(trainer.checkpoint_every_minutes) makes the run write its checkpoint at the next outer-step boundary;
after a signal it then stops. A second Ctrl-C stops it at once, without saving (`StoppedAtOnce`).

    signal arrives (any process)       -> `PreemptionSignals` notes it (a first Ctrl-C also says on stderr
                                          what follows); nothing else happens in the handler
    end of every outer step            -> every process says whether it got a signal and whether its clock
                                          is due; one all-reduce (a sum) makes them agree
    a signal, mid-epoch                -> last.ckpt written (atomically, through the Trainer's checkpoint
                                          IO); as the next step starts (the step's metrics are logged by
                                          then) <run>/preempted.json written and `Preempted` raised
    a signal, on an epoch's last step  -> the epoch ends as usual (validation, `EpochEndCheckpoint`), then
                                          `Preempted`: a checkpoint taken before the epoch's end would
                                          shift every later epoch of the resumed run
    a signal during the final test     -> `Preempted` at the next test batch (training had finished and
                                          saved; resuming runs the test again)
    the clock is due, mid-epoch        -> last.ckpt written, training goes on
    Ctrl-C after a signal was noted    -> the handler raises `StoppedAtOnce` wherever the run is: it stops
                                          without saving, its last checkpoint kept as it was

The state saved at an outer-step boundary is the whole training state (parameters, optimizer, schedule,
loop counters, callback states); the training data of outer step s are tasks [s * G, (s + 1) * G) of the
seeded stream (`ttt.meta.data.StepAlignedSampler`), so a resumed run continues exactly where the
interrupted one stopped. `ttt.train` turns `Preempted` into the exit status `PREEMPTED` (75), or
`INTERRUPTED` (130) after Ctrl-C.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Sequence
from types import FrameType

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_only

from .atomic import atomic_write_text
from .directory import RunPaths
from .divergence import DivergenceGuard

PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
"""Signals that make a run checkpoint and stop: SIGTERM (what Kubernetes, torchrun and SLURM send before
killing a job), SIGUSR1 (what SLURM's --signal=USR1@SECONDS is usually set to send ahead of the time
limit) and SIGINT (Ctrl-C in the terminal; a second one stops the run at once)."""
STDERR = 2
"""File descriptor of the process's standard error."""
FIRST_CTRL_C = (
    "\nCtrl-C: the run writes its checkpoint at the next outer step and stops "
    "(Ctrl-C again stops it at once, without saving)\n"
)


class Preempted(Exception):
    """The run stopped on a signal after its checkpoint was written; the message says which signal, at
    which outer step, where the checkpoint is and how to continue. `signal`: that signal (None: one that
    another process of the run received)."""

    def __init__(self, message: str, received: signal.Signals | None = None):
        super().__init__(message)
        self.signal = received


class StoppedAtOnce(BaseException):
    """A second Ctrl-C: raised by the signal handler wherever the run is, which stops without saving. A
    BaseException like KeyboardInterrupt, so that no `except Exception` on the way catches it, but not a
    KeyboardInterrupt, which Lightning answers with a message of its own and exit status 1."""


def stopped_at_once(paths: RunPaths) -> str:
    """What a run stopped by a second Ctrl-C leaves behind: its last checkpoint and how to continue from it,
    or that it has none yet."""
    if paths.last_checkpoint.is_file():
        return (
            f"stopped at once by a second Ctrl-C: nothing was saved after the checkpoint "
            f"{paths.last_checkpoint}; continue from it with: python -m ttt.train resume={paths.root}"
        )
    return (
        f"stopped at once by a second Ctrl-C, before the run wrote its first checkpoint (at its first epoch "
        f"end): {paths.root} holds nothing to resume"
    )


class PreemptionSignals:
    """Notes the first preemption signal that arrives (a first Ctrl-C also says on stderr what happens
    next); a Ctrl-C after it raises `StoppedAtOnce`. `install()` makes it the handler of `signals` (main
    thread only: Python runs handlers there) and remembers the handlers it replaced; `restore()` puts them
    back. As a context manager: installed inside the `with` block."""

    def __init__(self, signals: Sequence[signal.Signals] = PREEMPTION_SIGNALS):
        self.signals = tuple(signals)
        self.received: signal.Signals | None = None
        self._replaced: dict[signal.Signals, object] = {}
        self._pid = os.getpid()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:  # a data loader worker forked with this handler: the run decides
            return
        if self.received is not None:
            if signum == signal.SIGINT:
                raise StoppedAtOnce
            return
        self.received = signal.Signals(signum)
        if signum == signal.SIGINT and rank_zero_only.rank == 0:
            with contextlib.suppress(OSError):  # os.write, not print: the handler may interrupt a print
                os.write(STDERR, FIRST_CTRL_C.encode())

    def install(self) -> None:
        """Handle `signals` here (again: Lightning registers handlers of its own when a stage starts)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum in self.signals:
            previous = signal.signal(signum, self._handle)
            if previous != self._handle:  # bound methods compare equal, never identical
                self._replaced.setdefault(signum, previous)

    def __enter__(self) -> PreemptionSignals:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()

    def restore(self) -> None:
        """Put back the handlers that the first `install()` replaced."""
        if threading.current_thread() is not threading.main_thread():
            return
        for signum, previous in self._replaced.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._replaced = {}


def any_process(trainer: pl.Trainer, flags: Sequence[bool]) -> list[bool]:
    """For each flag, whether it is set in any process (one all-reduce for all of them; every process must
    call this at the same point)."""
    local = torch.tensor([float(flag) for flag in flags], device=trainer.strategy.root_device)
    if trainer.world_size > 1:
        local = trainer.strategy.reduce(local, reduce_op="sum")
    return [bool(value > 0) for value in local.tolist()]


class StepBoundaryCheckpoint(pl.Callback):
    """Writes `paths.last_checkpoint` at outer-step boundaries on a preemption signal (then raises
    `Preempted`) and every `every_minutes` minutes (None: only on signals). Place it after
    `EpochEndCheckpoint`, whose epoch-end checkpoint it relies on at an epoch's last step.

    guard: the run's `DivergenceGuard`, whose parameter check runs before a mid-epoch save (a
    non-finite state is never saved)."""

    def __init__(
        self,
        paths: RunPaths,
        signals: PreemptionSignals,
        every_minutes: float | None = None,
        guard: DivergenceGuard | None = None,
    ):
        if every_minutes is not None and not every_minutes > 0:
            raise ValueError(f"every_minutes must be > 0 or None, got {every_minutes}")
        self.paths, self.signals, self.every_minutes, self.guard = paths, signals, every_minutes, guard
        self._last_save = time.monotonic()
        self._stop_at_epoch_end = False
        self._stop_now = False
        self.saves_by_time = 0
        """Checkpoints written because the clock was due (this session)."""

    def _clock_due(self) -> bool:
        return (
            self.every_minutes is not None and time.monotonic() - self._last_save >= 60 * self.every_minutes
        )

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.signals.install()
        self._last_save = time.monotonic()

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.signals.install()

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx
    ):
        stop, due = any_process(trainer, [self.signals.received is not None, self._clock_due()])
        epoch_ends = (
            trainer.fit_loop.epoch_loop.batch_progress.is_last_batch
            or trainer.global_step >= trainer.max_steps
            or trainer.should_stop
        )
        if epoch_ends:  # the epoch-end checkpoint follows in a moment
            self._stop_at_epoch_end |= stop
            return
        if stop or due:
            if self.guard is not None:
                self.guard.check_parameters(trainer, pl_module)
            trainer.save_checkpoint(self.paths.last_checkpoint, weights_only=False)
            self._last_save = time.monotonic()
            self.saves_by_time += int(due and not stop)
        self._stop_now = stop

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx):
        # Raised here, not at the end of the step that saved: Lightning logs a step's metrics after its
        # on_train_batch_end hooks.
        if self._stop_now:
            self._preempted(trainer, "")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_save = time.monotonic()  # EpochEndCheckpoint has just saved
        (stop,) = any_process(trainer, [self.signals.received is not None])
        if stop or self._stop_at_epoch_end:
            self._preempted(trainer, " (the epoch-end checkpoint)")

    def on_test_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        (stop,) = any_process(trainer, [self.signals.received is not None])
        if stop:
            self._preempted(trainer, " (training had finished; the test runs again on resume)")

    def _preempted(self, trainer: pl.Trainer, which: str) -> None:
        received = self.signals.received
        name = received.name if received is not None else "another process's signal"
        step = trainer.global_step
        if trainer.is_global_zero:
            checkpoint = self.paths.last_checkpoint.relative_to(self.paths.root)
            record = {"signal": name, "outer_step": step, "checkpoint": str(checkpoint)}
            atomic_write_text(self.paths.preempted, json.dumps(record, indent=2) + "\n")
        how = "interrupted by SIGINT (Ctrl-C)" if received == signal.SIGINT else f"preempted by {name}"
        raise Preempted(
            f"{how} at outer step {step}: checkpoint {self.paths.last_checkpoint}{which}; "
            f"continue with: python -m ttt.train resume={self.paths.root}",
            received,
        )
