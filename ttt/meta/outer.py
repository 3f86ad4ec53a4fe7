"""The outer (meta) optimizer of every learner: its construction, schedule and one update."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

from ttt.config.schema import OuterOptimConfig
from ttt.inner import InnerLoop

from .sharding import clip_sharded_gradients


def lr_multiplier(step: int, *, cfg: OuterOptimConfig, total_steps: int) -> float:
    """Factor applied to optim.lr at outer step `step` (0 for the first) of a schedule of `total_steps`
    outer steps: linear warm-up over optim.warmup_steps (from 0 with optim.warmup_from_zero), then the
    configured decay, which reaches min_lr_ratio at total_steps. Continuous in `step`: past total_steps
    the factor stays at its final value, and a warm-up that fills the schedule (warmup_steps >=
    total_steps) leaves no decay (1 after the warm-up)."""
    if step < cfg.warmup_steps:
        return (step if cfg.warmup_from_zero else step + 1) / cfg.warmup_steps
    if cfg.scheduler == "constant" or total_steps <= cfg.warmup_steps:
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / (total_steps - cfg.warmup_steps))
    decay = 1.0 - progress if cfg.scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


def describe_lr_schedule(cfg: OuterOptimConfig, total_steps: int) -> str:
    """One line saying what the outer lr does over a schedule of `total_steps` outer steps (ttt.train
    prints it as a run starts), naming the keys; says so when the warm-up leaves no steps for the decay."""
    warmup = ""
    if cfg.warmup_steps:
        warmup = f"linear warm-up over {cfg.warmup_steps} outer steps to {cfg.lr:g}, then "
    if cfg.scheduler == "constant":
        return f"lr schedule: {warmup}constant {cfg.lr:g}"
    if total_steps <= cfg.warmup_steps:
        return (
            f"lr schedule: {warmup}constant: optim.warmup_steps={cfg.warmup_steps} fills the whole schedule "
            f"(optim.schedule_steps={total_steps}), which leaves no steps for its {cfg.scheduler} decay; "
            f"for a decay, set optim.schedule_steps above {cfg.warmup_steps} (the outer steps that warm-up "
            "and decay span together)"
        )
    final = cfg.lr * cfg.min_lr_ratio
    return (
        f"lr schedule: {warmup}{cfg.scheduler} decay to {final:g} at outer step {total_steps} "
        f"(optim.schedule_steps={total_steps}), {final:g} after it"
    )


def lr_schedule_notes(
    cfg: OuterOptimConfig, max_steps: int, checkpoint: Mapping[str, Any] | None = None
) -> list[str]:
    """What the outer lr does in a session that trains up to outer step `max_steps` under `cfg` (whose
    schedule_steps is set), for ttt.train to print as it starts: the schedule (`describe_lr_schedule`);
    for a resume from `checkpoint` (a Lightning checkpoint dict), how this schedule moves the lr at the step
    it resumes from, if it does; and the steps that run past the schedule's end."""
    notes, start = [describe_lr_schedule(cfg, cfg.schedule_steps)], 0
    if checkpoint is not None:
        start = int(checkpoint["global_step"])
        saved = (checkpoint.get("lr_schedulers") or [{}])[0]
        if "_last_lr" in saved and "base_lrs" in saved:
            was = float(saved["_last_lr"][0])
            now = float(saved["base_lrs"][0]) * lr_multiplier(start, cfg=cfg, total_steps=cfg.schedule_steps)
            if not math.isclose(was, now, rel_tol=1e-6):
                notes.append(
                    f"this resume changes the lr schedule: at outer step {start} the lr moves from {was:g} "
                    f"(the run's schedule) to {now:g}"
                )
    end = max(cfg.schedule_steps, start)
    decays = cfg.scheduler != "constant" and cfg.schedule_steps > cfg.warmup_steps
    if decays and max_steps > end:
        final = cfg.lr * lr_multiplier(end, cfg=cfg, total_steps=cfg.schedule_steps)
        notes.append(
            f"outer steps {end}-{max_steps - 1} run past the lr schedule's end at its final lr {final:g} "
            f"(optim.schedule_steps={cfg.schedule_steps}; a larger value re-plans the decay)"
        )
    return notes


def outer_param_groups(module: torch.nn.Module) -> list[torch.nn.Parameter] | list[dict[str, Any]]:
    """The trainable parameters of `module` for the outer optimizer: a plain list, or, when an
    `InnerLoop` inside it sets inner.lr_outer_lr, parameter groups: everything else first (at optim.lr),
    then that loop's learnable lrs at lr_outer_lr (the schedule multiplies both)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    own_lr = {
        id(p): loop.cfg.lr_outer_lr
        for loop in module.modules()
        if isinstance(loop, InnerLoop) and loop.cfg.lr_outer_lr is not None
        for p in loop.parameters()
    }
    if not own_lr:
        return trainable
    groups = [{"params": [p for p in trainable if id(p) not in own_lr]}]
    for lr in dict.fromkeys(own_lr.values()):
        groups.append({"params": [p for p in trainable if own_lr.get(id(p)) == lr], "lr": lr})
    return groups


def outer_optimizers(
    params: list[torch.nn.Parameter] | list[dict[str, Any]], cfg: OuterOptimConfig, total_steps: int
) -> dict[str, Any]:
    """What a learner's configure_optimizers returns: the optimizer named by optim.name over `params`
    (tensors, or parameter groups from `outer_param_groups`) and its per-step LambdaLR schedule
    (`lr_multiplier`, on every group's lr)."""
    betas = (cfg.beta1, cfg.beta2)
    if cfg.name == "adamw":
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)
    elif cfg.name == "adam":
        optimizer = torch.optim.Adam(params, lr=cfg.lr, betas=betas, weight_decay=cfg.weight_decay)
    elif cfg.name in ("sophia_h", "adahessian"):
        from ttt.second_order import hessian_optimizer  # imports pytorch-optimizer only when used

        optimizer = hessian_optimizer(
            cfg.name,
            params,
            lr=cfg.lr,
            betas=betas,
            weight_decay=cfg.weight_decay,
            hessian_update_interval=cfg.hessian_update_interval,
        )
    else:
        optimizer = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.beta1, weight_decay=cfg.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg=cfg, total_steps=total_steps)
    )
    return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def outer_update(
    module: pl.LightningModule, optimizer, scheduler, cfg: OuterOptimConfig, **step_kwargs
) -> float:
    """Clip the accumulated outer gradients (optim.grad_clip, global norm), step the optimizer and the
    schedule. Returns the learning rate now in effect, as a float (NCCL cannot reduce a CPU tensor).
    step_kwargs go to optimizer.step (sophia_h, adahessian: `ttt.second_order.HessianFeed.step_kwargs`)."""
    if cfg.grad_clip is not None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if params and isinstance(params[0], DTensor):  # trainer.strategy=fsdp
            clip_sharded_gradients(params, cfg.grad_clip, module.device)
        else:
            module.clip_gradients(optimizer, gradient_clip_val=cfg.grad_clip, gradient_clip_algorithm="norm")
    optimizer.step(**step_kwargs)
    scheduler.step()
    return scheduler.get_last_lr()[0]
