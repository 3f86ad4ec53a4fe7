"""`MetaLearner`: a LightningModule that meta-trains a model through an inner loop.

An `OuterLearner` (ttt/meta/learner.py: the outer step, its logging and optimizers) whose passes are
tasks. Subclass it and define the two losses of one task:

    class MyLearner(MetaLearner):
        def inner_loss(self, params, task, step):      # adapt on the task's support / context
            return F.mse_loss(self.forward_with(params, task["x_support"]), task["y_support"])

        def outer_loss(self, params, task):            # judge the adapted params on the queries
            loss = F.mse_loss(self.forward_with(params, task["x_query"]), task["y_query"])
            return loss                                # or (loss, {"name": detached metric, ...})

A batch is a dict of tensors with a leading task dimension; `split_passes` turns it into one dict
per task. Training uses manual optimization: for each task, inner adaptation, outer loss and
backward (`pass_loss`), then outer gradient clipping, optimizer and scheduler step. Under DDP
(trainer.strategy=ddp) each process takes its own tasks and the gradients are averaged once per outer
step (`task_backward`); logged metrics are averaged over the processes. Validation and test adapt too
(grad mode is switched on inside them; build the Trainer with inference_mode=False) and log the
query loss and metrics without adaptation ("_unadapted") and after the inner steps ("_adapted").
The query loss is the outer loss itself unless `outer_loss` reports a metric named "query_loss"
(for objectives that add auxiliary terms to it).
"""

from __future__ import annotations

import torch
from torch import nn

from ttt.config.schema import OuterOptimConfig
from ttt.inner import InnerLoop, InnerLoopConfig, functional_forward, meta_step, select_parameters
from ttt.inner.meta_step import adapt_and_score

from .learner import OuterLearner


class MetaLearner(OuterLearner):
    """Meta-learns `model`'s initial weights (and, with Meta-SGD, the inner lrs) through `InnerLoop`."""

    def __init__(
        self,
        model: nn.Module,
        inner: InnerLoopConfig,
        optim: OuterOptimConfig,
        total_steps: int | None = None,
    ):
        """model: the network whose initial weights are meta-learned; inner: the inner loop; optim and
        total_steps: the outer optimizer and the run's length (`OuterLearner`)."""
        super().__init__(optim, total_steps)
        self.model = model
        self.inner_cfg = inner
        self.inner_loop = InnerLoop(self.initial_params(), inner)

    def initial_params(self) -> dict[str, nn.Parameter]:
        """The adapted parameters' meta-learned initial values (live parameters of self.model)."""
        return select_parameters(self.model, self.inner_cfg.params)

    def step_metrics(self) -> dict[str, float]:
        """inner_lr: the mean of the inner learning rates, when they are learnable (train/inner_lr)."""
        if self.inner_cfg.learnable_lr == "none":
            return {}
        with torch.no_grad():
            lrs = [torch.as_tensor(lr).float().mean() for lr in self.inner_loop.learning_rates().values()]
            return {"inner_lr": torch.stack(lrs).mean().item()}

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
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Scalar outer loss of one task with adapted params, alone or with detached metrics by name
        (e.g. {"query_acc": ...}; "query_loss" when the outer loss is more than the query loss).
        Override this."""
        raise NotImplementedError("subclasses of MetaLearner define outer_loss(params, task)")

    def split_passes(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """A meta-batch (dict of tensors with a leading task dim) -> one dict per task (a pass each)."""
        sizes = {value.shape[0] for value in batch.values()}
        if len(sizes) != 1:
            raise ValueError(f"every tensor of a meta-batch needs the same leading size, got {sizes}")
        return [{name: value[i] for name, value in batch.items()} for i in range(sizes.pop())]

    def pass_loss(
        self, task: dict[str, torch.Tensor], batch_size: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Adapt to one task and score it: (outer_loss / batch_size, the outer loss, first and last inner
        losses and outer_loss's metrics, each / batch_size)."""
        result = adapt_and_score(self, self.inner_loop, self.initial_params(), task)
        share = result.outer_loss / batch_size
        metrics = {"outer_loss": share.detach()}
        if result.inner_losses.numel():
            metrics["inner_loss_first"] = result.inner_losses[0] / batch_size
            metrics["inner_loss_last"] = result.inner_losses[-1] / batch_size
        metrics.update({name: value.detach() / batch_size for name, value in result.metrics.items()})
        return share, metrics

    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Query loss and metrics of a batch of held-out tasks, before and after inner adaptation
        (cfg.eval_steps steps, first order: evaluation needs no second derivatives)."""
        tasks = self.split_passes(batch)
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
