"""`MetaLearner`: a LightningModule that meta-trains a model through an inner loop.

Subclass it and define the two losses of one task:

    class MyLearner(MetaLearner):
        def inner_loss(self, params, task, step):      # adapt on the task's support / context
            return F.mse_loss(self.forward_with(params, task["x_support"]), task["y_support"])

        def outer_loss(self, params, task):            # judge the adapted params on the queries
            loss = F.mse_loss(self.forward_with(params, task["x_query"]), task["y_query"])
            return loss, {}

A batch is a dict of tensors with a leading task dimension; `split_tasks` turns it into one dict
per task. Training uses manual optimization: `meta_step` (inner adaptation, outer loss, backward
per task), outer gradient clipping, optimizer and scheduler step. Under DDP (trainer.strategy=ddp)
each process takes its own tasks and the gradients are averaged once per outer step (`task_backward`);
logged metrics are averaged over the processes. Validation and test adapt too
(grad mode is switched on inside them; build the Trainer with inference_mode=False) and log the
query loss and metrics without adaptation ("_unadapted") and after the inner steps ("_adapted").
The query loss is the outer loss itself unless `outer_loss` reports a metric named "query_loss"
(for objectives that add auxiliary terms to it).
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn

from ttt.config.schema import OuterOptimConfig
from ttt.inner import InnerLoop, InnerLoopConfig, functional_forward, meta_step, select_parameters

from .distributed import task_backward
from .outer import outer_optimizers, outer_update


class MetaLearner(pl.LightningModule):
    """Meta-learns `model`'s initial weights (and, with Meta-SGD, the inner lrs) through `InnerLoop`."""

    def __init__(self, model: nn.Module, inner: InnerLoopConfig, optim: OuterOptimConfig, total_steps: int):
        super().__init__()
        self.automatic_optimization = False
        self.model = model
        self.inner_cfg, self.optim_cfg, self.total_steps = inner, optim, total_steps
        self.inner_loop = InnerLoop(self.initial_params(), inner)

    def initial_params(self) -> dict[str, nn.Parameter]:
        """The adapted parameters' meta-learned initial values (live parameters of self.model)."""
        return select_parameters(self.model, self.inner_cfg.params)

    def forward_with(self, params: dict[str, torch.Tensor], *args, **kwargs):
        """self.model(*args, **kwargs) with `params` substituted by name."""
        return functional_forward(self.model, params, *args, **kwargs)

    def inner_loss(
        self, params: dict[str, torch.Tensor], task: dict[str, torch.Tensor], step: int
    ) -> torch.Tensor:
        """Scalar loss the inner loop minimises at inner step `step` for one task. Override this."""
        raise NotImplementedError("subclasses of MetaLearner define inner_loss(params, task, step)")

    def outer_loss(
        self, params: dict[str, torch.Tensor], task: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Scalar outer loss of one task with adapted params, and detached metrics by name
        (e.g. {"query_acc": ...}; "query_loss" when the outer loss is more than the query loss).
        Override this."""
        raise NotImplementedError("subclasses of MetaLearner define outer_loss(params, task)")

    def split_tasks(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """A meta-batch (dict of tensors with a leading task dim) -> one dict per task."""
        sizes = {value.shape[0] for value in batch.values()}
        if len(sizes) != 1:
            raise ValueError(f"every tensor of a meta-batch needs the same leading size, got {sizes}")
        return [{name: value[i] for name, value in batch.items()} for i in range(sizes.pop())]

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        tasks = self.split_tasks(batch)
        optimizer.zero_grad()
        backward = task_backward(self, optimizer, len(tasks))
        result = meta_step(self, self.inner_loop, self.initial_params(), tasks, backward=backward)
        lr = outer_update(self, optimizer, scheduler, self.optim_cfg)
        metrics = {"train/outer_loss": result.outer_loss, "train/lr": lr}
        if result.inner_losses.numel():
            metrics["train/inner_loss_first"] = result.inner_losses[0]
            metrics["train/inner_loss_last"] = result.inner_losses[-1]
        metrics.update({f"train/{name}": value for name, value in result.metrics.items()})
        self.log_dict(metrics, batch_size=len(tasks), sync_dist=True)
        self.log("outer_loss", result.outer_loss, prog_bar=True, logger=False, batch_size=len(tasks))
        # Per-task losses: the divergence guard (ttt.tracking) names the task that went non-finite.
        return {
            "loss": result.outer_loss,
            "task_outer_losses": result.task_outer_losses,
            "task_inner_losses": result.task_inner_losses,
        }

    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Query loss and metrics of a batch of held-out tasks, before and after inner adaptation
        (cfg.eval_steps steps, first order: evaluation needs no second derivatives)."""
        tasks = self.split_tasks(batch)
        params = self.initial_params()
        with torch.enable_grad():
            unadapted = meta_step(self, self.inner_loop, params, tasks, backward=None, steps=0)
            adapted = meta_step(
                self,
                self.inner_loop,
                params,
                tasks,
                backward=None,
                steps=self.inner_cfg.steps_at_eval,
                first_order=True,
            )
        out = {}
        for tag, result in (("unadapted", unadapted), ("adapted", adapted)):
            out[f"query_loss_{tag}"] = result.outer_loss
            out.update({f"{name}_{tag}": value for name, value in result.metrics.items()})
        return out

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        metrics = self.evaluate(batch)
        self.log_dict(
            {f"val/{k}": v for k, v in metrics.items()},
            batch_size=len(next(iter(batch.values()))),
            sync_dist=True,
        )

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        metrics = self.evaluate(batch)
        self.log_dict(
            {f"test/{k}": v for k, v in metrics.items()},
            batch_size=len(next(iter(batch.values()))),
            sync_dist=True,
        )

    def configure_optimizers(self) -> dict[str, Any]:
        trainable = [p for p in self.parameters() if p.requires_grad]
        return outer_optimizers(trainable, self.optim_cfg, self.total_steps)
