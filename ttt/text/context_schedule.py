"""The short-then-long context schedule (data.short_seq_len, data.short_steps): a training curriculum
whose first outer steps read many short windows and the rest few long ones, the same tokens per step.

Long-context models are usually trained this way (the TTT-E2E paper pretrains at 8K and extends to
128K). Here it also means more documents per step: at 16K bytes, 4 rows are 4 documents; at 2K, 32
rows are 32. Validation and test read the long windows throughout.

A task of the schedule is a block of rows: {"tokens": (rows, short_len)} in the short phase, (1,
seq_len) after it (every array of the samplers' tasks gains that leading dim); `flatten_rows` collates
meta_batch_size such tasks into batches of meta_batch_size * rows sequences.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import default_collate

from ttt.meta.data import TaskSampler


class ShortThenLong:
    """A `StepTaskSampler`: at outer step s < short_steps, `rows` draws of `short` stacked; after, one
    draw of `long`. All draws of a task come from its one generator, so a task depends on its index
    alone (resume and DDP read exactly the rows of an uninterrupted single-process run), and a long-phase
    task is exactly the window that `long` alone gives for that index."""

    def __init__(self, short: TaskSampler, long: TaskSampler, *, short_steps: int, rows: int):
        if short_steps < 1 or rows < 1:
            raise ValueError(f"short_steps and rows must be positive ints, got {short_steps} and {rows}")
        self.short, self.long, self.short_steps, self.rows = short, long, short_steps, rows

    def __call__(self, rng: np.random.Generator, step: int) -> dict[str, np.ndarray]:
        """The task of outer step `step`: arrays (rows, ...) in the short phase, (1, ...) after it."""
        if step >= self.short_steps:
            return {name: np.asarray(value)[None] for name, value in self.long(rng).items()}
        draws = [self.short(rng) for _ in range(self.rows)]
        return {name: np.stack([draw[name] for draw in draws]) for name in draws[0]}


def flatten_rows(tasks: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Collate tasks of (rows, ...) arrays into one batch of (len(tasks) * rows, ...) sequences."""
    return {name: value.flatten(0, 1) for name, value in default_collate(tasks).items()}
