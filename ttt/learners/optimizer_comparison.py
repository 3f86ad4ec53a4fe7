"""`OptimizerComparisonLearner`: one language model trained by two outer optimizers side by side, a
first-order baseline (AdamW) and a Hessian optimizer (Sophia-H or AdaHessian), at equal steps and
compared at equal wall-clock time.

The learner holds two copies of the same initial `Transformer`, one per optimizer, under
`self.models[name]` (name: the optimizer's name, e.g. "adamw" and "sophia_h"). Every outer step
trains both on the same batch through `OuterLearner.outer_step`, the baseline first; the Hessian
optimizer's step also takes a Hutchinson estimate of the Hessian diagonal (`ttt.second_order.HessianFeed`)
on the steps it consumes one. Each optimizer's share of the step is timed on its own (CUDA
synchronised before and after), and inside the Hessian one the estimate's share; on CUDA each share's
peak memory is read too. Both models are evaluated on the same held-out windows after every epoch.

Logged: train/loss_<name>, train/lr_<name>, train/step_s_<name>, train/hvp_s (the estimate's seconds,
0 on steps without one), val/loss_<name>, test/loss_<name>. `summary_figures` (summary.json) and
optimizer_comparison.png are described in docs/second_order.md, "recipe=sophia_lm".
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ttt.config.choice import Choice
from ttt.config.schema import OuterOptimConfig
from ttt.meta.learner import OuterLearner
from ttt.meta.outer import outer_optimizers
from ttt.models.transformer import Transformer, next_token_loss
from ttt.second_order import HESSIAN_OPTIMIZERS, HessianFeed, module_loss_fn
from ttt.tracking.report import new_figure, save_figure

GIB = 2**30
CHECKPOINT_KEY = "optimizer_comparison"
"""Where the learner's clocks, held-out curve and probe generator live in a Lightning checkpoint."""


class BaselineOptimizer(Choice):
    """compare.baseline: the first-order optimizer the Hessian optimizer is compared with."""

    adamw = "adamw"
    adam = "adam"
    sgd = "sgd"


@dataclass
class CompareConfig:
    """The baseline optimizer and the Hessian estimate of an optimizer comparison."""

    baseline: BaselineOptimizer = BaselineOptimizer.adamw
    """First-order optimizer trained side by side with optim.name (which must be sophia_h or adahessian);
    every other optim setting (schedule, warm-up, clipping, betas, weight decay) is shared."""
    baseline_lr: float = 1e-3
    """Peak learning rate of the baseline (optim.lr is the Hessian optimizer's)."""
    hessian_samples: int = 1
    """Rademacher probes per Hutchinson estimate."""
    hessian_sequences: int | None = None
    """Sequences of the batch (its first ones) the Hessian estimate reads; null: all of them."""

    def __post_init__(self):
        self.baseline = BaselineOptimizer.parse(self.baseline, "compare.baseline")
        if self.baseline_lr <= 0:
            raise ValueError(f"compare.baseline_lr must be > 0, got {self.baseline_lr}")
        if self.hessian_samples < 1:
            raise ValueError(f"compare.hessian_samples must be >= 1, got {self.hessian_samples}")
        if self.hessian_sequences is not None and self.hessian_sequences < 1:
            raise ValueError(f"compare.hessian_sequences must be >= 1 or null, got {self.hessian_sequences}")


def loss_at_time(points: list[tuple[float, float]], budget: float) -> float | None:
    """The held-out loss of one optimizer at `budget` seconds of its training time: linear interpolation
    between the two (cumulative training seconds, loss) points around it. points: ascending in seconds.
    None when the budget lies outside the points (before the first evaluation or after the last): no
    extrapolation."""
    for (t0, loss0), (t1, loss1) in zip(points, points[1:]):
        if t0 <= budget <= t1:
            return loss0 if t1 == t0 else loss0 + (loss1 - loss0) * (budget - t0) / (t1 - t0)
    if points and points[-1][0] == budget:
        return points[-1][1]
    return None


def equal_time_comparison(curves: dict[str, list[tuple[float, float]]]) -> dict[str, Any]:
    """Each optimizer's held-out loss at the training time the faster one needed for all its steps.

    curves: name -> [(cumulative training seconds, held-out loss)] at each evaluation, ascending.
    Returns {"budget_s": the smallest final training time, "faster": its optimizer, "loss": name ->
    `loss_at_time(curve, budget_s)`}: the faster one's final loss, the others interpolated on their
    curves (None where the budget comes before their first evaluation)."""
    finished = {name: points[-1][0] for name, points in curves.items() if points}
    if len(finished) != len(curves):
        return {"budget_s": None, "faster": None, "loss": dict.fromkeys(curves)}
    faster = min(finished, key=finished.get)
    budget = finished[faster]
    return {
        "budget_s": budget,
        "faster": faster,
        "loss": {name: loss_at_time(points, budget) for name, points in curves.items()},
    }


def plot_comparison(
    path: Path, curve: list[dict[str, Any]], names: list[str], budget_s: float | None
) -> None:
    """optimizer_comparison.png: held-out loss against the outer step and against each optimizer's own
    cumulative training seconds (a dashed line at the equal-time budget). curve: the learner's rows."""
    fig, (by_step, by_time) = new_figure(2)
    for name in names:
        steps = [row["step"] for row in curve]
        losses = [row[name]["loss"] for row in curve]
        by_step.plot(steps, losses, marker="o", label=name)
        by_time.plot([row[name]["train_s"] for row in curve], losses, marker="o", label=name)
    if budget_s is not None:
        by_time.axvline(budget_s, color="gray", linestyle="--", linewidth=1, label="equal-time budget")
    by_step.set(xlabel="outer step", ylabel="held-out next-token loss (nats)", title="equal steps")
    by_time.set(xlabel="training seconds (own optimizer's share)", title="equal wall-clock time")
    for ax in (by_step, by_time):
        ax.legend()
    save_figure(fig, path)


class OptimizerComparisonLearner(OuterLearner):
    """Batches are {"tokens": (B, N) int64}; both models read the whole batch in one pass.

    model: the initial model (copied once per optimizer). optim: the Hessian optimizer (sophia_h or
    adahessian); compare: the baseline and the Hessian estimate. total_steps: the run's length. seed:
    seeds the Rademacher probes. One process (no ddp: recipes/sophia_lm.py refuses it)."""

    progress_metric = "loss"

    def __init__(
        self,
        model: Transformer,
        optim: OuterOptimConfig,
        compare: CompareConfig,
        total_steps: int,
        *,
        seed: int,
    ):
        super().__init__(optim, total_steps)
        if optim.name not in HESSIAN_OPTIMIZERS:
            raise ValueError(
                f"optim.name must be a Hessian optimizer ({', '.join(HESSIAN_OPTIMIZERS)}) to compare with "
                f"compare.baseline={compare.baseline}, got {optim.name!r}"
            )
        baseline = dataclasses.replace(optim, name=compare.baseline.value, lr=compare.baseline_lr)
        self.baseline_name, self.hessian_name = str(compare.baseline), str(optim.name)
        self.optim_cfgs = {self.baseline_name: baseline, self.hessian_name: optim}
        """Optimizer name -> its config, in stepping order (baseline first)."""
        self.models = nn.ModuleDict({name: copy.deepcopy(model) for name in self.optim_cfgs})
        self.compare_cfg, self.seed = compare, seed
        self.clock: dict[str, dict[str, list[float]]] = {
            name: {"step_s": [], "hvp_s": [], "peak_gib": []} for name in self.optim_cfgs
        }
        """Per optimizer, per outer step: seconds of its share, seconds of its Hessian estimate (0 on
        steps without one; always 0 for the baseline), peak CUDA GiB of its share (CUDA only)."""
        self.curve: list[dict[str, Any]] = []
        """After each validation: {"step", name: {"loss", "train_s"}} (train_s: cumulative step seconds)."""
        self._feed: HessianFeed | None = None
        self._probe_state: torch.Tensor | None = None
        self._estimates = 0
        self._val_sums: dict[str, torch.Tensor] = {}
        self._val_count = 0
        self._peak_outside_gib = 0.0
        self._baseline_state: dict[str, Any] | None = None
        self.baseline_optimizer: torch.optim.Optimizer | None = None
        self.baseline_schedule: torch.optim.lr_scheduler.LRScheduler | None = None

    # ---- training ---------------------------------------------------------------------------------

    def split_passes(self, batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
        """One pass: the whole batch."""
        return [batch]

    def arm_loss(self, name: str) -> Callable[[dict[str, torch.Tensor], int], tuple[torch.Tensor, dict]]:
        """pass_loss of optimizer `name`'s model: its mean next-token loss over the pass's sequences,
        as the pass's share of the batch mean (logged as train/loss_<name>)."""

        def pass_loss(rows: dict[str, torch.Tensor], batch_size: int) -> tuple[torch.Tensor, dict]:
            tokens = rows["tokens"]
            loss = next_token_loss(self.models[name](tokens), tokens) * len(tokens) / batch_size
            return loss, {"loss": loss.detach()}

        return pass_loss

    def feed(self, optimizer: torch.optim.Optimizer) -> HessianFeed:
        """The Hessian optimizer's `HessianFeed` (built at first use, with the probe generator restored
        from a checkpoint when resuming)."""
        if self._feed is None:
            model = self.models[self.hessian_name]
            generator = torch.Generator(device=self.device).manual_seed(self.seed)
            if self._probe_state is not None:
                generator.set_state(self._probe_state)
            self._feed = HessianFeed(
                optimizer,
                dict(model.named_parameters()),
                n_samples=self.compare_cfg.hessian_samples,
                generator=generator,
            )
            self._feed.estimates = self._estimates
        return self._feed

    def _hessian_kwargs(self, optimizer, tokens: torch.Tensor, seconds: list[float]) -> Callable[[], dict]:
        """The step_kwargs of `outer_step` for the Hessian optimizer: the estimate on due steps (on the
        first compare.hessian_sequences sequences), timed into `seconds` (0 on steps without one)."""

        def step_kwargs() -> dict[str, Any]:
            start = self._now()
            rows = tokens[: self.compare_cfg.hessian_sequences]
            model = self.models[self.hessian_name]
            loss_fn, _ = module_loss_fn(model, dict(model.named_parameters()), rows, next_token_loss)
            kwargs = self.feed(optimizer).step_kwargs(loss_fn)
            seconds.append(self._now() - start if kwargs else 0.0)
            return kwargs

        return step_kwargs

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            self._peak_outside_gib = max(
                self._peak_outside_gib, torch.cuda.max_memory_allocated(self.device) / GIB
            )
            torch.cuda.reset_peak_memory_stats(self.device)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        passes, batch_size = self.split_passes(batch), self.batch_size(batch)
        logged: dict[str, Any] = {}
        hessian_optimizer, hessian_schedule = self.optimizers(), self.lr_schedulers()
        arms = {
            self.baseline_name: (self.baseline_optimizer, self.baseline_schedule, None),
            self.hessian_name: (hessian_optimizer, hessian_schedule, []),
        }
        for name, (optimizer, scheduler, hvp_seconds) in arms.items():
            step_kwargs = None
            if hvp_seconds is not None:
                step_kwargs = self._hessian_kwargs(optimizer.optimizer, batch["tokens"], hvp_seconds)
            self._reset_peak()
            start = self._now()
            totals, lr, _ = self.outer_step(
                optimizer,
                scheduler,
                passes,
                batch_size,
                pass_loss=self.arm_loss(name),
                cfg=self.optim_cfgs[name],
                step_kwargs=step_kwargs,
            )
            clock = self.clock[name]
            clock["step_s"].append(self._now() - start)
            clock["hvp_s"].append(sum(hvp_seconds or []))
            if self.device.type == "cuda":
                clock["peak_gib"].append(torch.cuda.max_memory_allocated(self.device) / GIB)
            logged[f"train/loss_{name}"] = totals["loss"]
            logged[f"train/lr_{name}"] = lr
            logged[f"train/step_s_{name}"] = clock["step_s"][-1]
        logged["train/hvp_s"] = self.clock[self.hessian_name]["hvp_s"][-1]
        self.log_dict(logged, batch_size=batch_size, sync_dist=True)
        progress = logged[f"train/loss_{self.hessian_name}"]
        self.log(self.progress_metric, progress, prog_bar=True, logger=False, batch_size=batch_size)
        return progress

    def configure_optimizers(self) -> dict[str, Any]:
        """The Hessian optimizer and its schedule, for Lightning (`outer_optimizers`); the baseline's are
        built the same way but kept by the learner (`baseline_optimizer`, `baseline_schedule`) and saved in
        its checkpoint entry, so that Lightning counts one step per outer step (its global step counts
        the steps of every optimizer it knows)."""
        baseline = outer_optimizers(
            list(self.models[self.baseline_name].parameters()),
            self.optim_cfgs[self.baseline_name],
            self.schedule_steps(self.optim_cfgs[self.baseline_name]),
        )
        self.baseline_optimizer = baseline["optimizer"]
        self.baseline_schedule = baseline["lr_scheduler"]["scheduler"]
        if self._baseline_state is not None:  # resuming: on_load_checkpoint came first
            self.baseline_optimizer.load_state_dict(self._baseline_state["optimizer"])
            self.baseline_schedule.load_state_dict(self._baseline_state["schedule"])
            self._baseline_state = None
        hessian = self.models[self.hessian_name]
        return outer_optimizers(list(hessian.parameters()), self.optim_cfg, self.schedule_steps())

    # ---- evaluation -------------------------------------------------------------------------------

    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Mean next-token loss of each model on a held-out batch: loss_<name>."""
        tokens = batch["tokens"]
        return {f"loss_{name}": next_token_loss(model(tokens), tokens) for name, model in self.models.items()}

    def on_validation_epoch_start(self) -> None:
        self._val_sums, self._val_count = {}, 0

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        metrics = self.evaluate(batch)
        size = self.batch_size(batch)
        for key, value in metrics.items():
            self._val_sums[key] = self._val_sums.get(key, 0) + value.detach().double() * size
        self._val_count += size
        self.log_evaluation("val", metrics, size)

    def on_validation_epoch_end(self) -> None:
        if not self._val_count or self.trainer.sanity_checking:
            return
        reduce = self.trainer.strategy.reduce  # sums over processes when the held-out set is shared out
        count = reduce(torch.tensor(float(self._val_count), device=self.device), reduce_op="sum")
        row: dict[str, Any] = {"step": self.global_step}
        for name in self.optim_cfgs:
            mean = reduce(self._val_sums[f"loss_{name}"], reduce_op="sum") / count
            row[name] = {"loss": float(mean), "train_s": sum(self.clock[name]["step_s"])}
        self.curve.append(row)

    # ---- checkpoints --------------------------------------------------------------------------------

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        probe_state = None if self._feed is None else self._feed.generator.get_state()
        checkpoint[CHECKPOINT_KEY] = {
            "clock": copy.deepcopy(self.clock),
            "curve": copy.deepcopy(self.curve),
            "probe_state": probe_state if probe_state is not None else self._probe_state,
            "estimates": self._estimates if self._feed is None else self._feed.estimates,
            "peak_outside_gib": self._peak_outside_gib,
            "baseline": {
                "optimizer": self.baseline_optimizer.state_dict(),
                "schedule": self.baseline_schedule.state_dict(),
            },
        }

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint[CHECKPOINT_KEY]
        self.clock, self.curve = saved["clock"], saved["curve"]
        self._probe_state, self._estimates = saved["probe_state"], saved["estimates"]
        self._peak_outside_gib = saved["peak_outside_gib"]
        self._baseline_state = saved["baseline"]  # loaded by configure_optimizers, which Lightning calls next
        self._feed = None

    # ---- results -----------------------------------------------------------------------------------

    def held_out_curves(self) -> dict[str, list[tuple[float, float]]]:
        """name -> [(cumulative training seconds, held-out loss)] at each validation."""
        return {
            name: [(row[name]["train_s"], row[name]["loss"]) for row in self.curve]
            for name in self.optim_cfgs
        }

    def optimizer_figures(self, name: str) -> dict[str, Any]:
        """One optimizer's figures (docs/second_order.md, "recipe=sophia_lm")."""
        clock = self.clock[name]
        steps, hvps = clock["step_s"], clock["hvp_s"]
        timed, timed_hvp = (steps[1:], hvps[1:]) if len(steps) > 1 else (steps, hvps)
        estimates = [s for s in timed_hvp if s > 0]
        losses = [row[name]["loss"] for row in self.curve]
        return {
            "lr": self.optim_cfgs[name].lr,
            "final_val_loss": losses[-1] if losses else None,
            "best_val_loss": min(losses) if losses else None,
            "time_per_step_s": sum(timed) / len(timed) if timed else None,
            "first_step_s": steps[0] if steps else None,
            "train_s": sum(steps),
            "hvp_share_of_step_time": sum(timed_hvp) / sum(timed) if timed and sum(timed) > 0 else None,
            "hvp_s_per_estimate": sum(estimates) / len(estimates) if estimates else None,
            "hessian_estimates": sum(s > 0 for s in hvps),
            "peak_memory_gib": max(clock["peak_gib"]) if clock["peak_gib"] else None,
        }

    def summary_figures(self) -> dict[str, Any]:
        """{"optimizers": name -> `optimizer_figures`, "equal_time": `equal_time_comparison` of the
        held-out curves, "held_out_curve": the rows of `curve`, "peak_memory_gib": the peak over the
        whole training (CUDA; None elsewhere)}."""
        peaks = [p for clock in self.clock.values() for p in clock["peak_gib"]]
        return {
            "optimizers": {name: self.optimizer_figures(name) for name in self.optim_cfgs},
            "equal_time": equal_time_comparison(self.held_out_curves()),
            "held_out_curve": self.curve,
            "peak_memory_gib": max([self._peak_outside_gib, *peaks]) if peaks else None,
        }

    def on_fit_end(self) -> None:
        if self.trainer.is_global_zero and self.curve:
            budget = equal_time_comparison(self.held_out_curves())["budget_s"]
            path = Path(self.trainer.default_root_dir) / "optimizer_comparison.png"
            plot_comparison(path, self.curve, list(self.optim_cfgs), budget)
