"""`meta_step`: one full meta-learning step (inner adaptation, outer loss, backward) without Lightning."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .loop import InnerLoop


class TaskObjective(Protocol):
    """The two losses of a meta-learning problem, for one task."""

    def inner_loss(self, params: dict[str, torch.Tensor], task: Any, step: int) -> torch.Tensor:
        """Scalar inner (adaptation) loss of `task` at inner step `step`, with adapted `params`."""

    def outer_loss(
        self, params: dict[str, torch.Tensor], task: Any
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Scalar outer (query) loss of `task` with adapted `params`, and extra detached metrics."""


@dataclass
class MetaStepResult:
    """What `meta_step` returns: detached means over the tasks."""

    outer_loss: torch.Tensor
    """Mean outer loss over the tasks (detached scalar)."""
    inner_losses: torch.Tensor
    """Mean inner loss before each inner step, shape (steps,)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Mean of each metric returned by `outer_loss`."""
    task_outer_losses: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    """Outer loss of each task, shape (tasks,) (which task diverged, for the divergence guard)."""
    task_inner_losses: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 0))
    """Inner loss of each task before each inner step, shape (tasks, steps)."""


def meta_step(
    objective: TaskObjective,
    inner_loop: InnerLoop,
    initial_params: Mapping[str, torch.Tensor],
    tasks: Sequence[Any],
    *,
    backward: Callable[[torch.Tensor], None] | None = torch.Tensor.backward,
    steps: int | None = None,
    first_order: bool | None = None,
) -> MetaStepResult:
    """Adapt to each task, take its outer loss, and backpropagate mean_t(outer_loss_t) into the
    initial parameters and the inner learning rates (gradients accumulate in .grad; no optimizer step).

    Each task is backpropagated as soon as its loss is known, so only one task's graph is alive
    at a time. backward: called on outer_loss_t / len(tasks) (e.g. Lightning's manual_backward);
    None skips the backward (evaluation). steps / first_order override the inner loop's config.
    """
    if not tasks:
        raise ValueError("meta_step needs at least one task")
    outer_total, inner_total, metric_totals = 0.0, None, {}
    task_outer, task_inner = [], []
    for task in tasks:
        adaptation = inner_loop.adapt(
            lambda params, step, task=task: objective.inner_loss(params, task, step),
            initial_params,
            steps=steps,
            first_order=first_order,
        )
        loss, metrics = objective.outer_loss(adaptation.params, task)
        if backward is not None:
            backward(loss / len(tasks))
        outer_total += loss.detach()
        inner = torch.stack(adaptation.losses) if adaptation.losses else loss.new_zeros(0)
        inner_total = inner if inner_total is None else inner_total + inner
        task_outer.append(loss.detach())
        task_inner.append(inner.detach())
        for name, value in metrics.items():
            metric_totals[name] = metric_totals.get(name, 0.0) + value.detach()
    n = len(tasks)
    return MetaStepResult(
        outer_loss=outer_total / n,
        inner_losses=inner_total / n,
        metrics={name: total / n for name, total in metric_totals.items()},
        task_outer_losses=torch.stack(task_outer),
        task_inner_losses=torch.stack(task_inner),
    )
