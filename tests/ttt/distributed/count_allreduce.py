"""`python tests/ttt/distributed/count_allreduce.py OUT.json key=value ...`: `ttt.train.main(key=value ...)`
with a callback that counts DDP's gradient all-reduces (one call of its communication hook per
bucket) in every outer step; global rank 0 writes the counts, a list with one int per outer step, to
OUT.json. Lightning's ddp strategy re-runs this script for the other devices, so every process installs
the same callback."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning.pytorch as pl
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

import ttt.train


class AllReduceCounter(pl.Callback):
    """Registers a communication hook that counts its calls and then does DDP's default all-reduce."""

    def __init__(self, out: Path):
        self.out, self.calls, self.per_step = out, 0, []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        trainer.strategy.model.register_comm_hook(None, self.hook)

    def hook(self, process_group, bucket):
        self.calls += 1
        return allreduce_hook(process_group, bucket)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.per_step.append(self.calls)
        self.calls = 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.is_global_zero:
            self.out.write_text(json.dumps(self.per_step))


def main() -> int:
    out, argv = Path(sys.argv[1]), sys.argv[2:]
    make_trainer = ttt.train.make_trainer

    def counting_trainer(*args, **kwargs) -> pl.Trainer:
        trainer = make_trainer(*args, **kwargs)
        trainer.callbacks.append(AllReduceCounter(out))
        return trainer

    ttt.train.make_trainer = counting_trainer
    return ttt.train.main(argv)


if __name__ == "__main__":
    sys.exit(main())
