"""`meta_step`: one full meta-learning step (inner adaptation, outer loss, backward) without Lightning."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from .loop import InnerLoop


class TaskObjective(Protocol):
    """The two losses of a meta-learning problem, for one task.

    An objective whose `scores_inner_losses` attribute is True gets the inner losses too:
    `outer_loss(params, task, inner_losses=[...])`, each step's loss before that step, still attached to
    its graph (e.g. to add TTT-E2E's prequential loss to the outer loss)."""

    def inner_loss(self, params: dict[str, torch.Tensor], task: Any, step: int) -> torch.Tensor:
        """Scalar inner (adaptation) loss of `task` at inner step `step`, with adapted `params`."""

    def outer_loss(
        self, params: dict[str, torch.Tensor], task: Any
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Scalar outer (query) loss of `task` with adapted `params`, alone or with extra detached
        metrics by name."""


@dataclass
class TaskResult:
    """One task adapted and scored by `adapt_and_score`."""

    outer_loss: torch.Tensor
    """Scalar outer loss with the adapted params, differentiable into the initial params and lrs."""
    inner_losses: torch.Tensor
    """The detached inner loss before each inner step, shape (steps,)."""
    metrics: dict[str, torch.Tensor]
    """The detached metrics `outer_loss` returned (empty when it returned the loss alone)."""


def adapt_and_score(
    objective: TaskObjective,
    inner_loop: InnerLoop,
    initial_params: Mapping[str, torch.Tensor],
    task: Any,
    *,
    steps: int | None = None,
    first_order: bool | None = None,
) -> TaskResult:
    """Adapt `initial_params` to one task with `inner_loop` (steps / first_order override its config) and
    take the task's outer loss with the adapted params."""
    scores_inner = getattr(objective, "scores_inner_losses", False)
    adaptation = inner_loop.adapt(
        lambda params, step: objective.inner_loss(params, task, step),
        initial_params,
        steps=steps,
        first_order=first_order,
        keep_loss_graphs=scores_inner,
    )
    if scores_inner:
        scored = objective.outer_loss(adaptation.params, task, inner_losses=adaptation.loss_graphs)
    else:
        scored = objective.outer_loss(adaptation.params, task)
    loss, metrics = (scored, {}) if torch.is_tensor(scored) else scored
    if not torch.is_tensor(loss) or loss.dim() != 0:
        raise ValueError(
            "outer_loss must return a scalar tensor or (scalar tensor, dict of metrics), got "
            f"{type(loss).__name__}{'' if not torch.is_tensor(loss) else tuple(loss.shape)}"
        )
    inner = torch.stack(adaptation.losses) if adaptation.losses else loss.new_zeros(0)
    return TaskResult(outer_loss=loss, inner_losses=inner, metrics=metrics)


@dataclass
class MetaStepResult:
    """What `meta_step` returns: detached means over the tasks."""

    outer_loss: torch.Tensor
    """Mean outer loss over the tasks (detached scalar)."""
    inner_losses: torch.Tensor
    """Mean inner loss before each inner step, shape (steps,)."""
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """Mean of each metric returned by `outer_loss`."""


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
    for task in tasks:
        result = adapt_and_score(
            objective, inner_loop, initial_params, task, steps=steps, first_order=first_order
        )
        if backward is not None:
            backward(result.outer_loss / len(tasks))
        outer_total += result.outer_loss.detach()
        inner_total = result.inner_losses if inner_total is None else inner_total + result.inner_losses
        for name, value in result.metrics.items():
            metric_totals[name] = metric_totals.get(name, 0.0) + value.detach()
    n = len(tasks)
    return MetaStepResult(
        outer_loss=outer_total / n,
        inner_losses=inner_total / n,
        metrics={name: total / n for name, total in metric_totals.items()},
    )
