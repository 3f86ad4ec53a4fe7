"""The outer backward under data parallelism: one gradient all-reduce per outer step.

Meta-learners backpropagate each task (or sequence) of a batch as soon as its loss is known, so that
only one task's graph is alive at a time. Under Lightning's DDP strategy every `manual_backward`
would all-reduce the gradients; `task_backward` lets only the last backward of the outer step do it
(DDP's `no_sync` pattern for gradient accumulation, through Lightning's `toggle_model`), and that
reduction averages the gradients accumulated over all the step's tasks. The inner loop's
`torch.autograd.grad` calls never reach DDP: they return gradients instead of accumulating `.grad`,
which is what DDP's reducer hooks on.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer


def task_backward(
    module: pl.LightningModule, optimizer: LightningOptimizer | torch.optim.Optimizer, n_tasks: int
) -> Callable[[torch.Tensor], None]:
    """A backward function for the `n_tasks` per-task losses of one outer step: `manual_backward`,
    with gradient synchronisation across processes blocked for all but the `n_tasks`-th call.

    optimizer: the Lightning optimizer of the step, or a plain torch optimizer that the learner keeps
    and steps itself (outside Lightning's step count, e.g. the baseline of
    `ttt.learners.optimizer_comparison`); for the latter the blocking goes through the module's
    (first) Lightning optimizer, whose toggle_model leaves parameters of no Lightning optimizer alone."""
    if not isinstance(optimizer, LightningOptimizer):
        registered = module.optimizers()
        optimizer = registered[0] if isinstance(registered, list) else registered
    calls = 0

    def backward(loss: torch.Tensor) -> None:
        nonlocal calls
        calls += 1
        with optimizer.toggle_model(sync_grad=calls == n_tasks):
            module.manual_backward(loss)

    return backward
