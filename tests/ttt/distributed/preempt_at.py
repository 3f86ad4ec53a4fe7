"""`python tests/ttt/distributed/preempt_at.py WHERE STEP RANK PIDFILE key=value ...`:
`ttt.train.main(key=value ...)` in which the process of global rank RANK, on reaching WHERE ("step": the
start of the outer step after STEP completed steps; "validation": the first validation after STEP steps;
"test": the final test), writes its pid to PIDFILE and waits there until it has received a preemption
signal, which the test sends from outside. So the signal arrives at a chosen point of the run, without
timing. The other processes of a ddp run go on, and wait in the step's collectives."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import lightning.pytorch as pl

import ttt.train
from ttt.tracking import StepBoundaryCheckpoint

WAIT_S = 120
"""How long the process waits for the signal before failing (the test sends it within a second)."""


class WaitForSignal(pl.Callback):
    def __init__(self, where: str, step: int, rank: int, pidfile: Path):
        self.where, self.step, self.rank, self.pidfile = where, step, rank, pidfile
        self.done = False

    def _wait(self, trainer: pl.Trainer, where: str) -> None:
        if self.done or where != self.where or trainer.global_rank != self.rank:
            return
        if where != "test" and trainer.global_step != self.step:
            return
        self.done = True
        (checkpoints,) = [cb for cb in trainer.callbacks if isinstance(cb, StepBoundaryCheckpoint)]
        self.pidfile.write_text(str(os.getpid()))
        deadline = time.monotonic() + WAIT_S
        while checkpoints.signals.received is None:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no signal within {WAIT_S} s")
            time.sleep(0.01)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._wait(trainer, "step")

    def on_validation_start(self, trainer, pl_module) -> None:
        self._wait(trainer, "validation")

    def on_test_start(self, trainer, pl_module) -> None:
        self._wait(trainer, "test")


def main() -> int:
    where, step, rank, pidfile = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    make_trainer = ttt.train.make_trainer

    def waiting_trainer(*args, **kwargs) -> pl.Trainer:
        trainer = make_trainer(*args, **kwargs)
        trainer.callbacks.append(WaitForSignal(where, step, rank, pidfile))
        return trainer

    ttt.train.make_trainer = waiting_trainer
    return ttt.train.main(sys.argv[5:])


if __name__ == "__main__":
    sys.exit(main())
