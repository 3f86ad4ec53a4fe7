"""`OuterLearner`: the outer (meta) step that every learner shares, as a LightningModule.

One training step, with manual optimization:

    passes = self.split_passes(batch)             # parts of the batch, one graph alive at a time
    for each pass:
        loss, metrics = self.pass_loss(pass, batch_size)   # this pass's share of the batch's mean loss
        backward(loss)                            # task_backward: under DDP one all-reduce per step
    outer_update(...)                             # outer clipping, optimizer step, schedule step
    log train/<metric> (the passes' shares summed), train/lr and step_metrics()

(zero_grad, the passes and outer_update are `outer_step`, which a learner with several optimizers calls
once per optimizer).

A learner defines `split_passes`, `pass_loss` and `evaluate` (held-out metrics by name, logged as
val/<name> and test/<name>). `MetaLearner` (a pass is one task, adapted by the inner loop) and
`TTTLanguageLearner` (a pass is ttt.sequences_per_pass sequences read side by side) extend it; a learner
without an inner loop (a plain language model under a second-order outer optimizer) needs only the
three hooks; `summary_figures` adds figures of its own to summary.json.
"""

from __future__ import annotations

import contextlib
import inspect
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import _restricted_classmethod

from ttt.config.schema import OuterOptimConfig

from .distributed import task_backward
from .outer import outer_optimizers, outer_param_groups, outer_update
from .sharding import SecondOrderFSDPStrategy, gathered_parameters


def refuse_inference_mode(what: str) -> None:
    """RuntimeError naming `what` (a call that takes inner gradient steps) under torch.inference_mode."""
    if torch.is_inference_mode_enabled():
        raise RuntimeError(
            f"{what} takes inner gradient steps, which torch.inference_mode forbids: call it outside "
            "torch.inference_mode (torch.no_grad is fine: it switches grad mode on for its inner steps)"
        )


def _plain(value: Any) -> bool:
    """Whether `value` is None, a bool, int, float or str, or a list, tuple or str-keyed dict of such."""
    if value is None or type(value) in (bool, int, float, str):
        return True
    if type(value) in (list, tuple):
        return all(_plain(item) for item in value)
    return type(value) is dict and all(type(key) is str and _plain(item) for key, item in value.items())


class OuterLearner(pl.LightningModule):
    """Manual outer optimization over the passes of a batch, its logging, and `configure_optimizers`.

    Batches are dicts of tensors with a leading batch dim (tasks or sequences)."""

    progress_metric = "outer_loss"
    """The pass metric shown in the progress bar (not logged to files under this bare name)."""

    def __init__(self, optim: OuterOptimConfig, total_steps: int | None = None):
        """optim: the outer optimizer and its lr schedule. total_steps: the outer steps the run trains, which
        must be the Trainer's max_steps (None: taken from the Trainer); the schedule spans them unless
        optim.schedule_steps gives it a length of its own (`schedule_steps`)."""
        super().__init__()
        self.automatic_optimization = False
        self.optim_cfg, self.total_steps = optim, total_steps
        self.checkpoint_step = 0
        """The outer step of the checkpoint this learner was loaded from (`load_from_checkpoint`,
        `ttt.load`); 0 for a new learner. `global_step` without a Trainer."""

    @property
    def global_step(self) -> int:
        """Outer steps trained: the Trainer's global_step while one is attached (at least
        `checkpoint_step`: a Trainer that only tests a loaded learner counts from 0), else
        `checkpoint_step` (Lightning's is 0 without a Trainer, which would restart step-dependent settings
        such as the inner learning rates' warm-up of a loaded learner)."""
        if self._trainer is None:
            return self.checkpoint_step
        return max(self.trainer.global_step, self.checkpoint_step)

    def save_hyperparameters(
        self,
        *args: Any,
        ignore: str | list[str] | None = None,
        frame: types.FrameType | None = None,
        logger: bool = True,
    ) -> None:
        """Lightning's `save_hyperparameters` (by default every argument of the calling __init__: what
        `load_from_checkpoint` builds the learner from), refusing values a checkpoint cannot hold: it is
        read without unpickling classes (`ttt.tracking.load_checkpoint`), so each hyperparameter must be
        None, a bool, int, float or str, or a list, tuple or str-keyed dict of such values. TypeError
        naming the others: build configs and models from plain values in __init__, or leave them out
        (ignore=[name])."""
        frame = frame if frame is not None else inspect.currentframe().f_back
        super().save_hyperparameters(*args, ignore=ignore, frame=frame, logger=logger)
        refused = [f"{name} ({type(v).__name__})" for name, v in self.hparams.items() if not _plain(v)]
        if refused:
            raise TypeError(
                f"{type(self).__name__}: hyperparameters {', '.join(refused)} are not plain values; a "
                "checkpoint holds tensors and plain containers only (None, bool, int, float, str, and lists, "
                "tuples and str-keyed dicts of them): pass plain values and build configs and models from "
                "them in __init__, or leave these out with save_hyperparameters(ignore=[...])"
            )

    @_restricted_classmethod  # as Lightning's: on an instance, a TypeError (the result is a new learner)
    def load_from_checkpoint(
        cls, checkpoint_path: str | Path, map_location: Any = "cpu", strict: bool = True, **kwargs: Any
    ) -> OuterLearner:
        """The learner saved at `checkpoint_path` (a file a Trainer wrote, e.g. a run's
        checkpoints/last.ckpt), with no Trainer and no arguments: a recipe's learner is rebuilt by its
        builder from the run's config that its checkpoint holds, any other as cls(**its saved
        hyperparameters, **kwargs). Its state is loaded (strict: every tensor, as saved) onto the device
        map_location gives (torch.load's argument; default the CPU), in eval mode, `global_step` at the
        checkpoint's step. Clear errors (CheckpointError, TypeError) name the file. `ttt.meta.loading`
        says how; `ttt.load(RUN_DIR)` also returns the run's config."""
        from .loading import load_learner  # it builds on this module

        return load_learner(cls, checkpoint_path, map_location=map_location, strict=strict, **kwargs)

    def schedule_steps(self, optim: OuterOptimConfig | None = None) -> int:
        """Outer steps the lr schedule of `optim` (None: the learner's) spans: its schedule_steps, else the
        run's length (`total_steps`, or the attached Trainer's max_steps). Raises ValueError when
        total_steps and the Trainer's max_steps disagree (the schedule would end early or never), or when
        neither is known."""
        optim = self.optim_cfg if optim is None else optim
        try:
            trainer_steps = self.trainer.max_steps
        except RuntimeError:  # not attached to a Trainer
            trainer_steps = -1
        if self.total_steps is not None and trainer_steps not in (-1, self.total_steps):
            raise ValueError(
                f"{type(self).__name__}(total_steps={self.total_steps}) but the Trainer's max_steps is "
                f"{trainer_steps}: total_steps is the run's length, over which the lr schedule runs; pass "
                f"total_steps={trainer_steps} (or None: the Trainer's), and give the schedule a length of "
                "its own with OuterOptimConfig(schedule_steps=N) (optim.schedule_steps)"
            )
        if optim.schedule_steps is not None:
            return optim.schedule_steps
        steps = self.total_steps if self.total_steps is not None else trainer_steps
        if steps == -1:
            raise ValueError(
                f"{type(self).__name__} needs the lr schedule's length: pass total_steps, build the Trainer "
                "with max_steps, or set OuterOptimConfig(schedule_steps=N)"
            )
        return steps

    def split_passes(self, batch: dict[str, torch.Tensor]) -> list[Any]:
        """The passes of a batch, each backpropagated before the next is computed. Override this."""
        raise NotImplementedError(f"{type(self).__name__} defines split_passes(batch)")

    def pass_loss(self, batch_pass: Any, batch_size: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(scalar loss, detached metrics) of one pass, each its share of the batch's mean: the sum over
        the pass's items divided by batch_size, so that the passes' shares add up to the batch mean.
        The loss is backpropagated; the metrics are summed over the passes and logged as train/<name>.
        Override this."""
        raise NotImplementedError(f"{type(self).__name__} defines pass_loss(batch_pass, batch_size)")

    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Held-out metrics of a batch by name (logged as val/<name> and test/<name>). Override this."""
        raise NotImplementedError(f"{type(self).__name__} defines evaluate(batch)")

    def step_metrics(self) -> dict[str, float]:
        """Extra training metrics of the current outer step (logged as train/<name>); none by default."""
        return {}

    def batch_size(self, batch: dict[str, torch.Tensor]) -> int:
        """Items (tasks or sequences) in a batch: the leading size of its tensors."""
        return len(next(iter(batch.values())))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> dict[str, Any]:
        passes, batch_size = self.split_passes(batch), self.batch_size(batch)
        totals, lr, per_pass = self.outer_step(self.optimizers(), self.lr_schedulers(), passes, batch_size)
        logged = {f"train/{name}": value for name, value in totals.items()}
        logged.update({"train/lr": lr, **{f"train/{k}": v for k, v in self.step_metrics().items()}})
        self.log_dict(logged, batch_size=batch_size, sync_dist=True)
        progress = totals[self.progress_metric]
        self.log(self.progress_metric, progress, prog_bar=True, logger=False, batch_size=batch_size)
        # Each pass's metrics (P,): the divergence guard (ttt.tracking) names the pass that went non-finite.
        return {"loss": progress, "pass_metrics": per_pass}

    def outer_step(
        self,
        optimizer,
        scheduler,
        passes: list[Any],
        batch_size: int,
        *,
        pass_loss: Callable[[Any, int], tuple[torch.Tensor, dict[str, torch.Tensor]]] | None = None,
        cfg: OuterOptimConfig | None = None,
        step_kwargs: Callable[[], dict[str, Any]] | None = None,
    ) -> tuple[dict[str, torch.Tensor], float, dict[str, torch.Tensor]]:
        """One outer update of `optimizer`: zero its gradients, backpropagate every pass's loss (one
        pass's graph alive at a time; under DDP one all-reduce), then `outer_update`.

        pass_loss: (pass, batch_size) -> (loss, metrics); None: self.pass_loss. cfg: the optimizer's
        config; None: the learner's optim section. step_kwargs: called after the backward passes, its
        dict goes to optimizer.step (a Hessian estimate, `ttt.second_order.HessianFeed.step_kwargs`).
        A learner with several optimizers (`ttt.learners.optimizer_comparison`) calls this once per
        optimizer. Returns (the passes' metrics summed, the learning rate now in effect, each metric per
        pass as a (P,) tensor: the divergence guard of ttt.tracking names the pass that went non-finite)."""
        pass_loss = self.pass_loss if pass_loss is None else pass_loss
        optimizer.zero_grad()
        backward = task_backward(self, optimizer, len(passes))  # DDP: one all-reduce per outer step
        totals: dict[str, torch.Tensor] = {}
        per_pass: dict[str, list[torch.Tensor]] = {}
        # trainer.strategy=fsdp: the parameters whole through the step's passes and their backward passes (a
        # checkpointed inner loop recomputes its forward there), the gradients reduced into the shards after
        with gathered_parameters(self, self.device):
            for batch_pass in passes:  # one pass's graph alive at a time
                loss, metrics = pass_loss(batch_pass, batch_size)
                backward(loss)
                for name, value in metrics.items():
                    totals[name] = totals[name] + value if name in totals else value
                    per_pass.setdefault(name, []).append(torch.as_tensor(value).detach())
        extra = {} if step_kwargs is None else step_kwargs()
        lr = outer_update(self, optimizer, scheduler, self.optim_cfg if cfg is None else cfg, **extra)
        return totals, lr, {name: torch.stack(values) for name, values in per_pass.items()}

    def summary_figures(self) -> dict[str, Any]:
        """Figures of the run beyond the logged test metrics, added to summary.json by ttt.train
        (JSON values: numbers, strings, None, lists, dicts); none by default."""
        return {}

    def configure_model(self) -> None:
        """Under trainer.strategy=fsdp, shard the parameters over the processes (`ttt.meta.sharding`);
        nothing under other strategies, or without a Trainer (loading a checkpoint)."""
        if self._trainer is not None and isinstance(self.trainer.strategy, SecondOrderFSDPStrategy):
            self.trainer.strategy.shard(self)

    def _gather_for_evaluation(self) -> None:
        # trainer.strategy=fsdp: the parameters stay whole (detached) from the start of a validation or test
        # to its end, for every hook of the learner in between.
        self._evaluation_parameters = contextlib.ExitStack()
        self._evaluation_parameters.enter_context(
            gathered_parameters(self, self.device, reduce_gradients=False)
        )

    def _release_after_evaluation(self) -> None:
        self._evaluation_parameters.close()

    on_validation_start = on_test_start = _gather_for_evaluation
    on_validation_end = on_test_end = _release_after_evaluation

    def log_evaluation(self, stage: str, metrics: dict[str, torch.Tensor], batch_size: int) -> None:
        """Log held-out metrics as <stage>/<name>, averaged over batches and processes."""
        self.log_dict({f"{stage}/{k}": v for k, v in metrics.items()}, batch_size=batch_size, sync_dist=True)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log_evaluation("val", self.evaluate(batch), self.batch_size(batch))

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log_evaluation("test", self.evaluate(batch), self.batch_size(batch))

    def configure_callbacks(self) -> list[pl.Callback]:
        """No callbacks. Refuses the Trainer options that manual optimization cannot honour, naming what to
        use instead, before Lightning refuses them with advice no learner here can follow (switch to
        automatic optimization): this is the first hook Lightning calls with the Trainer attached."""
        trainer = self.trainer
        if trainer.state.fn != "fit":
            return []
        if trainer.gradient_clip_val:
            raise ValueError(
                f"pl.Trainer(gradient_clip_val={trainer.gradient_clip_val}) does not apply to "
                f"{type(self).__name__}, which clips its outer gradient itself: set "
                f"OuterOptimConfig(grad_clip={trainer.gradient_clip_val}) (optim.grad_clip, the global L2 "
                "norm; null: no clipping) and leave gradient_clip_val unset"
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"pl.Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) does not apply to "
                f"{type(self).__name__}, which takes one outer step per batch and backpropagates its passes "
                "one at a time: a larger batch (trainer.meta_batch_size) averages over more tasks"
            )
        return []

    def configure_optimizers(self) -> dict[str, Any]:
        return outer_optimizers(outer_param_groups(self), self.optim_cfg, self.schedule_steps())
