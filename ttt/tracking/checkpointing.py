"""`EpochEndCheckpoint`: the one checkpoint a run keeps, rewritten at the end of every epoch;
`LastEpochEndsAtMaxSteps`, which gives a run's shorter last epoch its validation and checkpoint; and
`LogStepAlignment`, which keeps a resumed run's logged steps equal to its outer steps."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl


class EpochEndCheckpoint(pl.Callback):
    """Saves the full training state to `path` at the end of each training epoch (after its
    validation). Atomic when the Trainer uses `AtomicCheckpointIO`.

    A run resumed from an epoch-end checkpoint replays that epoch's end before its first new step
    (Lightning's loops); that replay trained nothing, so the file is left as it is."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._saved_at: int | None = None
        """Outer step of the state in `path` when this session started from it (None: a new run)."""

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._saved_at = trainer.global_step if trainer.ckpt_path is not None else None

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step == self._saved_at:
            return
        trainer.save_checkpoint(self.path, weights_only=False)


class LastEpochEndsAtMaxSteps(pl.Callback):
    """Ends the epoch in progress when the run reaches trainer.max_steps, so that a last epoch shorter than
    the others (max_steps not a multiple of the epoch's length) validates and saves like every other
    epoch: Lightning would stop it mid-epoch, without validation, on reaching max_steps."""

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx
    ) -> None:
        if trainer.global_step >= trainer.max_steps > 0:
            trainer.should_stop = True  # Lightning then validates, and ends the epoch (EpochEndCheckpoint)


class LogStepAlignment(pl.Callback):
    """Logs every outer step's metrics under that step's index (`trainer.global_step` before it).

    Lightning's loggers count steps with a counter of their own (batches that stepped an optimizer),
    which a restart from an epoch-end checkpoint increments once more than it should: a resumed run's
    rows would be shifted by one step and collide with the first session's last row. Every learner
    takes exactly one outer optimizer step per training batch, so the counter is set to the optimizer
    step count before each batch."""

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx
    ) -> None:
        trainer.fit_loop.epoch_loop._batches_that_stepped = trainer.global_step
