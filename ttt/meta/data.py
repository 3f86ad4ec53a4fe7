"""Task streams for meta-learning: an endless seeded training stream and fixed held-out sets.

A task sampler is any function `sample(rng: numpy.random.Generator) -> dict[str, np.ndarray]` whose
arrays have the same shapes for every task (so that tasks stack into a meta-batch). Task i of
stream s under seed k is `sample(default_rng([k, s, i]))`: the same on every machine and run, and
the training, validation and test streams never share a task.

Outer step s reads training tasks [s * G, (s + 1) * G), G = meta_batch_size * world size, so a run
resumed from a checkpoint reads exactly the tasks the uninterrupted run would have read, and P processes
with meta_batch_size b read the tasks of one process with P * b (process r takes the r-th block of b).
The held-out sets are Hugging Face `datasets.Dataset`s; each process evaluates its own contiguous share.
Text is a task stream too: a sampler per split draws token windows from that split's documents
(`ttt.text.corpus.TokenWindows.sample`), and `TaskDataModule` serves synthetic tasks and text alike.

An indexed sampler (`IndexedSampler`: a `task(seed, index)` method) gives task `index` itself instead of
drawing it from a generator: a finite data set read in a seeded order (text packed into a token stream,
`ttt.text.packing.PackedSlices`: every slice once per pass, in a shuffled order).

A curriculum is a training sampler that also takes the outer step, `sample_at_step(rng, step)` (the
step of task i is i // G): it changes the tasks as training goes on, and stays exact under resume and
DDP because the step comes from the task's index. The held-out sets keep the plain sampler (the final
task), so validation measures the goal all along.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Protocol, runtime_checkable

import datasets
import lightning.pytorch as pl
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

TaskSampler = Callable[[np.random.Generator], dict[str, np.ndarray]]
StepTaskSampler = Callable[[np.random.Generator, int], dict[str, np.ndarray]]
"""A curriculum: sample(rng, outer_step) -> task."""
TRAIN_STREAM, VAL_STREAM, TEST_STREAM = 0, 1, 2


@runtime_checkable
class IndexedSampler(Protocol):
    """A sampler that gives each task by its index (module docstring)."""

    def task(self, seed: int, index: int) -> dict[str, np.ndarray]:
        """Task `index` (from 0) of the stream under `seed`."""


def sample_task(sample, seed: int, stream: int, index: int) -> dict[str, np.ndarray]:
    """Task `index` of `stream` under `seed` from a TaskSampler (its own generator) or an IndexedSampler."""
    if isinstance(sample, IndexedSampler):
        return sample.task(seed, index)
    return sample(task_rng(seed, stream, index))
SPLITS = ("train", "val", "test")


def task_rng(seed: int, stream: int, index: int) -> np.random.Generator:
    """The generator of task `index` of `stream` under `seed`."""
    return np.random.default_rng([seed, stream, index])


class SyntheticTasks(Dataset):
    """Map-style view of an endless task stream: item i is task i (as torch tensors). With
    `sample_at_step` (a curriculum) task i is sample_at_step(rng, i // tasks_per_step) instead."""

    def __init__(
        self,
        sample: TaskSampler,
        *,
        seed: int,
        stream: int = TRAIN_STREAM,
        sample_at_step: StepTaskSampler | None = None,
        tasks_per_step: int = 1,
    ):
        if tasks_per_step < 1:
            raise ValueError(f"tasks_per_step must be a positive int, got {tasks_per_step}")
        self.sample, self.seed, self.stream = sample, seed, stream
        self.sample_at_step, self.tasks_per_step = sample_at_step, tasks_per_step

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if self.sample_at_step is None:
            task = sample_task(self.sample, self.seed, self.stream, index)
        else:
            task = self.sample_at_step(task_rng(self.seed, self.stream, index), index // self.tasks_per_step)
        return {name: torch.from_numpy(np.asarray(value)) for name, value in task.items()}


class StepAlignedSampler(Sampler[int]):
    """Task indices of consecutive outer steps for process `rank` of `world_size`: outer step s reads
    [s * G + rank * batch_size, s * G + (rank + 1) * batch_size) with G = world_size * batch_size, and an
    epoch starts after `done_steps()` outer steps. Tying the stream to the outer step (not to Lightning's
    epoch counter) keeps it identical when a run is resumed."""

    def __init__(
        self,
        steps_per_epoch: int,
        batch_size: int,
        done_steps: Callable[[], int],
        *,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        self.steps_per_epoch, self.batch_size, self.done_steps = steps_per_epoch, batch_size, done_steps
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[int]:
        global_batch = self.world_size * self.batch_size
        first_step = self.done_steps()
        for step in range(first_step, first_step + self.steps_per_epoch):
            start = step * global_batch + self.rank * self.batch_size
            yield from range(start, start + self.batch_size)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.batch_size


def process_share(tasks: datasets.Dataset, *, rank: int, world_size: int) -> datasets.Dataset:
    """The contiguous share of `tasks` evaluated by process `rank` of `world_size` (equal shares: the
    count must be a multiple of world_size, so that averaging the processes' means is exact)."""
    if len(tasks) % world_size:
        raise ValueError(f"{len(tasks)} held-out items do not split evenly over {world_size} processes")
    return tasks.shard(num_shards=world_size, index=rank, contiguous=True)


def process_rank(module: pl.LightningDataModule) -> dict[str, int]:
    """{"rank": global rank, "world_size": processes} of the trainer running `module` (rank 0 of 1
    without a trainer): the keyword arguments of StepAlignedSampler and process_share."""
    if module.trainer is None:
        return {"rank": 0, "world_size": 1}
    return {"rank": module.trainer.global_rank, "world_size": module.trainer.world_size}


def held_out_tasks(sample: TaskSampler, *, seed: int, stream: int, count: int) -> datasets.Dataset:
    """`count` tasks of a held-out stream as an in-memory Hugging Face Dataset in torch format."""
    rows = [sample_task(sample, seed, stream, i) for i in range(count)]
    return datasets.Dataset.from_list(rows).with_format("torch")


class TaskDataModule(pl.LightningDataModule):
    """Batches of tasks (or token windows): training from the endless stream, validation and test from
    held-out sets.

    sample: one sampler for all three streams (synthetic tasks), or one per split, {"train": ..., "val":
    ..., "test": ...} (text: windows of each split's own documents). Every batch is a dict of tensors with
    a leading task dim (meta_batch_size, or eval_batch_size for the held-out sets).
    train_curriculum: a StepTaskSampler that replaces the training sampler (the held-out sets keep
    `sample`); its tasks must have the shapes of `sample`'s, or train_collate must turn them into
    batches of those shapes.
    train_collate: how the training loader collates a step's tasks (default: stacked).
    """

    def __init__(
        self,
        sample: TaskSampler | Mapping[str, TaskSampler],
        *,
        seed: int,
        meta_batch_size: int,
        steps_per_epoch: int,
        val_tasks: int,
        test_tasks: int,
        eval_batch_size: int,
        num_workers: int = 0,
        train_curriculum: StepTaskSampler | None = None,
        train_collate: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]] | None = None,
    ):
        super().__init__()
        samples = dict(sample) if isinstance(sample, Mapping) else dict.fromkeys(SPLITS, sample)
        if sorted(samples) != sorted(SPLITS):
            raise ValueError(
                f"sample must be one sampler or one per split {SPLITS}, got splits {list(samples)}"
            )
        self.samples, self.seed = samples, seed
        self.meta_batch_size, self.steps_per_epoch = meta_batch_size, steps_per_epoch
        self.val_tasks, self.test_tasks, self.eval_batch_size = val_tasks, test_tasks, eval_batch_size
        self.num_workers, self.train_curriculum = num_workers, train_curriculum
        self.train_collate = train_collate

    @classmethod
    def from_trainer(
        cls,
        sample: TaskSampler | Mapping[str, TaskSampler],
        *,
        seed: int,
        trainer,
        train_curriculum: StepTaskSampler | None = None,
        train_collate: Callable[[list[dict[str, torch.Tensor]]], dict[str, torch.Tensor]] | None = None,
    ) -> TaskDataModule:
        """The data module whose batch sizes and held-out set sizes are those of a `TrainerConfig`."""
        return cls(
            sample,
            seed=seed,
            train_curriculum=train_curriculum,
            train_collate=train_collate,
            meta_batch_size=trainer.meta_batch_size,
            steps_per_epoch=trainer.steps_per_epoch,
            val_tasks=trainer.val_tasks,
            test_tasks=trainer.test_tasks,
            eval_batch_size=trainer.eval_batch_size,
            num_workers=trainer.num_workers,
        )

    def train_dataloader(self) -> DataLoader:
        processes = process_rank(self)
        tasks = SyntheticTasks(
            self.samples["train"],
            seed=self.seed,
            stream=TRAIN_STREAM,
            sample_at_step=self.train_curriculum,
            tasks_per_step=self.meta_batch_size * processes["world_size"],
        )
        return DataLoader(
            tasks,
            batch_size=self.meta_batch_size,
            sampler=StepAlignedSampler(
                self.steps_per_epoch, self.meta_batch_size, self._done_steps, **processes
            ),
            num_workers=self.num_workers,
            collate_fn=self.train_collate,
            drop_last=True,
        )

    def _done_steps(self) -> int:
        return 0 if self.trainer is None else self.trainer.global_step

    def _held_out_loader(self, split: str, stream: int, count: int) -> DataLoader:
        tasks = held_out_tasks(self.samples[split], seed=self.seed, stream=stream, count=count)
        tasks = process_share(tasks, **process_rank(self))
        return DataLoader(tasks, batch_size=self.eval_batch_size, num_workers=self.num_workers)

    def val_dataloader(self) -> DataLoader:
        return self._held_out_loader("val", VAL_STREAM, self.val_tasks)

    def test_dataloader(self) -> DataLoader:
        return self._held_out_loader("test", TEST_STREAM, self.test_tasks)
