"""`InnerLoop`: k differentiable optimizer steps on named parameters, first or second order."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .config import InnerLoopConfig
from .optimizers import make_inner_optimizer

InnerLossFn = Callable[[dict[str, torch.Tensor], int], torch.Tensor]
"""loss_fn(params, step) -> scalar loss: the inner loss at `step` (0-based) with the given params."""


@dataclass
class Adaptation:
    """Result of `InnerLoop.adapt`."""

    params: dict[str, torch.Tensor]
    """Adapted parameters by name, differentiable with respect to the initial ones (and the lrs)."""
    losses: list[torch.Tensor]
    """The inner loss before each step, detached scalars (one per step)."""


def clip_by_global_norm(
    grads: Mapping[str, torch.Tensor], max_norm: float, *, per_row: bool = False
) -> dict[str, torch.Tensor]:
    """Scale all grads by min(1, max_norm / ||grads||) (global L2 norm); differentiable, no in-place ops.
    per_row: the grads are (B, ...), one problem per row (a sequence's own fast weights), and each row
    gets its own norm and factor."""
    start = 1 if per_row else 0
    total = torch.sqrt(sum(g.float().square().flatten(start).sum(-1) for g in grads.values()))
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    return {n: g * factor.view(factor.shape + (1,) * (g.dim() - start)).to(g.dtype) for n, g in grads.items()}


class InnerLoop(nn.Module):
    """Adapts a fixed set of named parameters with a differentiable optimizer.

    Owns the inner learning rates; with cfg.learnable_lr != "none" they are parameters of this module
    (Meta-SGD) and the outer optimizer must include `self.parameters()`.
    """

    def __init__(self, params: Mapping[str, torch.Tensor], cfg: InnerLoopConfig):
        super().__init__()
        if not params:
            raise ValueError("InnerLoop needs at least one parameter to adapt")
        self.cfg = cfg
        self.names = list(params)
        self.optimizer = make_inner_optimizer(cfg)
        if cfg.learnable_lr == "none":
            self.lrs = None
        else:
            self.lrs = nn.ParameterList(
                nn.Parameter(
                    torch.full(() if cfg.learnable_lr == "tensor" else p.shape, cfg.lr, dtype=torch.float32)
                )
                for p in params.values()
            )

    def learning_rates(self) -> dict[str, torch.Tensor | float]:
        """Inner learning rate of each adapted parameter: floats, or scalar / per-element tensors."""
        if self.lrs is None:
            return dict.fromkeys(self.names, self.cfg.lr)
        return dict(zip(self.names, self.lrs))

    def _step(self, loss_fn: InnerLossFn, step: int, params: dict, state: dict, create_graph: bool):
        loss = loss_fn(params, step)
        if loss.dim() != 0:
            raise ValueError(f"the inner loss must be a scalar, got shape {tuple(loss.shape)}")
        grads = torch.autograd.grad(
            loss, list(params.values()), create_graph=create_graph, materialize_grads=True
        )
        grads = dict(zip(params, grads))
        if self.cfg.grad_clip is not None:
            grads = clip_by_global_norm(grads, self.cfg.grad_clip)
        lrs = {
            n: lr.to(params[n].dtype) if torch.is_tensor(lr) else lr
            for n, lr in self.learning_rates().items()
        }
        new_params, new_state = self.optimizer.step(params, grads, state, lrs)
        return new_params, new_state, loss.detach()

    def adapt(
        self,
        loss_fn: InnerLossFn,
        params: Mapping[str, torch.Tensor],
        *,
        steps: int | None = None,
        first_order: bool | None = None,
    ) -> Adaptation:
        """Run `steps` inner steps (default cfg.steps) from `params` (keyed like at construction).

        Second order (the default unless cfg.first_order): the returned params carry the graph of
        every inner gradient, so an outer loss differentiates through the steps exactly.
        First order: inner gradients are constants; the outer gradient still reaches the initial
        params (and the learning rates) through the updates. Needs grad mode (inside torch.no_grad,
        wrap the call in torch.enable_grad()) and cannot run under torch.inference_mode.
        """
        if list(params) != self.names:
            raise ValueError(f"params must be keyed {self.names}, got {list(params)}")
        if torch.is_inference_mode_enabled():
            raise RuntimeError(
                "InnerLoop.adapt cannot run under torch.inference_mode (inner steps need gradients); "
                "with Lightning, build the Trainer with inference_mode=False"
            )
        if not torch.is_grad_enabled():
            raise RuntimeError("InnerLoop.adapt needs grad mode: wrap evaluation in torch.enable_grad()")
        steps = self.cfg.steps if steps is None else steps
        first_order = self.cfg.first_order if first_order is None else first_order
        current = {n: p if p.requires_grad else p.detach().requires_grad_() for n, p in params.items()}
        state = self.optimizer.init(current)
        losses = []
        for step in range(steps):
            if self.cfg.checkpoint:
                current, state, loss = checkpoint(
                    self._step, loss_fn, step, current, state, not first_order, use_reentrant=False
                )
            else:
                current, state, loss = self._step(loss_fn, step, current, state, not first_order)
            losses.append(loss)
        return Adaptation(params=current, losses=losses)
