"""`EpochEndCheckpoint`: the one checkpoint a run keeps, rewritten at the end of every epoch."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl


class EpochEndCheckpoint(pl.Callback):
    """Saves the full training state to `path` at the end of each training epoch (after its
    validation). Atomic when the Trainer uses `AtomicCheckpointIO`."""

    def __init__(self, path: Path):
        self.path = Path(path)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.save_checkpoint(self.path, weights_only=False)
