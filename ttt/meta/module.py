"""`MetaLearner`: a LightningModule that meta-trains a model through an inner loop.

An `OuterLearner` (ttt/meta/learner.py: the outer step, its logging and optimizers) whose passes are
tasks. Subclass it and define the two losses of one task; to load its checkpoints with no arguments,
build the model in __init__ from plain values and save them (a checkpoint holds no Python objects):

    class MyLearner(MetaLearner):
        def __init__(self, hidden: int = 32, total_steps: int = 1000):
            model = nn.Sequential(nn.Linear(1, hidden), nn.Tanh(), nn.Linear(hidden, 1))
            super().__init__(model, InnerLoopConfig(params=["2.*"]), OuterOptimConfig(), total_steps)
            self.save_hyperparameters()                # hidden, total_steps: what loading rebuilds from

        def inner_loss(self, params, task, step):      # adapt on the task's support / context
            return F.mse_loss(self.forward_with(params, task["x_support"]), task["y_support"])

        def outer_loss(self, params, task):            # judge the adapted params on the queries
            loss = F.mse_loss(self.forward_with(params, task["x_query"]), task["y_query"])
            return loss                                # or (loss, {"name": detached metric, ...})

    learner = MyLearner.load_from_checkpoint(path)     # no Trainer needed; in eval mode
    params = learner.adapt(task)                       # one task's dict of tensors, no task dim
    y = learner.predict(params, x)                     # the model's output with the adapted params

The learners of the recipes (ttt.learners) keep the run's config instead and load the same way, or with
their config through `ttt.load(RUN_DIR)` (ttt/meta/loading.py).

A batch is a dict of tensors with a leading task dimension; `split_passes` turns it into one dict
per task. Training uses manual optimization: for each task, inner adaptation, outer loss and
backward (`pass_loss`), then outer gradient clipping, optimizer and scheduler step. Under DDP
(trainer.strategy=ddp) each process takes its own tasks and the gradients are averaged once per outer
step (`task_backward`); logged metrics are averaged over the processes. Validation and test adapt too
(grad mode is switched on inside them; build the Trainer with inference_mode=False) and log the
query loss and metrics without adaptation ("_unadapted") and after the inner steps ("_adapted"), as
`adapt` does: inner.eval_steps first-order steps.
The query loss is the outer loss itself unless `outer_loss` reports a metric named "query_loss"
(for objectives that add auxiliary terms to it).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from ttt.config.schema import OuterOptimConfig
from ttt.inner import InnerLoop, InnerLoopConfig, functional_forward, meta_step, select_parameters
from ttt.inner.meta_step import adapt_and_score

from .learner import OuterLearner, refuse_inference_mode


def _is_array(value) -> bool:
    """Whether `value` is a tensor or a numpy array (what adapt and predict put on the device)."""
    return torch.is_tensor(value) or isinstance(value, np.ndarray)


class MetaLearner(OuterLearner):
    """Meta-learns `model`'s initial weights (and, with Meta-SGD, the inner lrs) through `InnerLoop`."""

    def __init__(self, model: nn.Module, inner: InnerLoopConfig, optim: OuterOptimConfig, total_steps: int):
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

    def adapt(
        self, task: Mapping[str, torch.Tensor | np.ndarray], *, steps: int | None = None
    ) -> dict[str, torch.Tensor]:
        """The parameters adapted to one task, as validation and test adapt: `steps` first-order inner
        steps on `inner_loss` (default inner.eval_steps, else inner.steps) from the meta-learned initial
        values.

        task: one task's tensors (or numpy arrays, as a task sampler returns them) by name, without the
        leading task dim (what inner_loss takes), put on the learner's device. Returns {name: tensor} keyed
        and shaped like `initial_params()`, detached: no graph into the learner's parameters is kept. Runs
        in grad mode inside torch.no_grad too; refused under torch.inference_mode."""
        if not isinstance(task, Mapping) or not task or not all(map(_is_array, task.values())):
            kinds = sorted({type(v).__name__ for v in task.values()}) if isinstance(task, Mapping) else []
            raise TypeError(
                "task must be a non-empty dict of tensors or numpy arrays (one task, without the leading "
                f"task dim), got a {type(task).__name__}" + (f" of {', '.join(kinds)}" if kinds else "")
            )
        steps = self.inner_cfg.steps_at_eval if steps is None else steps
        if type(steps) is not int or steps < 0:
            raise ValueError(f"steps must be an int >= 0 (or None: inner.eval_steps), got {steps!r}")
        refuse_inference_mode(f"{type(self).__name__}.adapt")
        task = {name: torch.as_tensor(value, device=self.device) for name, value in task.items()}
        initial = {name: param.detach() for name, param in self.initial_params().items()}
        with torch.enable_grad():
            adaptation = self.inner_loop.adapt(
                lambda params, step: self.inner_loss(params, task, step),
                initial,
                steps=steps,
                first_order=True,
            )
        return {name: param.detach() for name, param in adaptation.params.items()}

    def predict(self, params: Mapping[str, torch.Tensor], *args, **kwargs):
        """self.model(*args, **kwargs) with `params` in place of those parameters (from `adapt`, or
        `initial_params()` for the unadapted model), without gradients; arguments that are tensors or numpy
        arrays are put on the learner's device. Returns the model's output: for the README's LineLearner,
        x (Q, 1) -> (Q, 1); for a ContextLearner, tokens (B, N) -> logits (B, N, vocab)."""
        unknown = sorted(set(params) - {name for name, _ in self.model.named_parameters()})
        if unknown:
            raise ValueError(
                f"params must be keyed by names of the model's parameters (as adapt returns them); not "
                f"parameters of the model: {unknown}"
            )
        args = [torch.as_tensor(v, device=self.device) if _is_array(v) else v for v in args]
        kwargs = {k: torch.as_tensor(v, device=self.device) if _is_array(v) else v for k, v in kwargs.items()}
        with torch.no_grad():
            return self.forward_with(params, *args, **kwargs)

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
