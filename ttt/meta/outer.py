"""The outer (meta) optimizer of every learner: its construction, schedule and one update."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from torch.distributed.tensor import DTensor

from ttt.config.schema import OuterOptimConfig
from ttt.inner import InnerLoop

from .sharding import clip_sharded_gradients


def lr_multiplier(step: int, *, cfg: OuterOptimConfig, total_steps: int) -> float:
    """Factor applied to optim.lr at outer step `step` (0 for the first): linear warm-up (from 0 with
    optim.warmup_from_zero), then the configured decay."""
    if step < cfg.warmup_steps:
        return (step if cfg.warmup_from_zero else step + 1) / cfg.warmup_steps
    if cfg.scheduler == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, total_steps - cfg.warmup_steps))
    decay = 1.0 - progress if cfg.scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


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
