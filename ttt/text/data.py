"""`TextDataModule`: batches of token windows; training from an endless seeded stream over the train
documents, validation and test from fixed held-out sets of the val and test documents."""

from __future__ import annotations

import lightning.pytorch as pl
from torch.utils.data import DataLoader

from ttt.meta.data import (
    TEST_STREAM,
    TRAIN_STREAM,
    VAL_STREAM,
    StepAlignedSampler,
    SyntheticTasks,
    held_out_tasks,
    process_rank,
    process_share,
)

from .corpus import TokenWindows


class TextDataModule(pl.LightningDataModule):
    """Batches {"tokens": (batch, seq_len) int64}. Window i of a stream is drawn with the generator of
    (seed, stream, i), and outer step s reads training windows [s * batch, (s + 1) * batch), so a
    resumed run reads exactly the windows of an uninterrupted one."""

    def __init__(
        self,
        windows: dict[str, TokenWindows],
        *,
        seed: int,
        batch_size: int,
        steps_per_epoch: int,
        val_sequences: int,
        test_sequences: int,
        eval_batch_size: int,
    ):
        super().__init__()
        self.windows, self.seed = windows, seed
        self.batch_size, self.steps_per_epoch, self.eval_batch_size = (
            batch_size,
            steps_per_epoch,
            eval_batch_size,
        )
        self.val_sequences, self.test_sequences = val_sequences, test_sequences

    def train_dataloader(self) -> DataLoader:
        return DataLoader(
            SyntheticTasks(self.windows["train"].sample, seed=self.seed, stream=TRAIN_STREAM),
            batch_size=self.batch_size,
            sampler=StepAlignedSampler(
                self.steps_per_epoch, self.batch_size, self._done_steps, **process_rank(self)
            ),
            drop_last=True,
        )

    def _done_steps(self) -> int:
        return 0 if self.trainer is None else self.trainer.global_step

    def _held_out(self, split: str, stream: int, count: int) -> DataLoader:
        sequences = held_out_tasks(self.windows[split].sample, seed=self.seed, stream=stream, count=count)
        sequences = process_share(sequences, **process_rank(self))
        return DataLoader(sequences, batch_size=self.eval_batch_size)

    def val_dataloader(self) -> DataLoader:
        return self._held_out("val", VAL_STREAM, self.val_sequences)

    def test_dataloader(self) -> DataLoader:
        return self._held_out("test", TEST_STREAM, self.test_sequences)
