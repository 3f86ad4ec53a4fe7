"""`InnerLoop`: k differentiable optimizer steps on named parameters, first or second order."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from .config import InnerLoopConfig
from .optimizers import make_inner_optimizer
from .step import LearningRates, Tensors, inner_step, maybe_checkpoint

InnerLossFn = Callable[[dict[str, torch.Tensor], int], torch.Tensor]
"""loss_fn(params, step) -> scalar loss: the inner loss at `step` (0-based) with the given params."""


@dataclass
class Adaptation:
    """Result of `InnerLoop.adapt`."""

    params: dict[str, torch.Tensor]
    """Adapted parameters by name, differentiable with respect to the initial ones (and the lrs)."""
    losses: list[torch.Tensor]
    """The inner loss before each step, detached scalars (one per step)."""
    loss_graphs: list[torch.Tensor] = field(default_factory=list)
    """The same losses still attached to their graphs (`adapt(keep_loss_graphs=True)`; else empty): an
    outer loss may include them, e.g. the prequential loss of TTT-E2E (each chunk scored before its step)."""


class InnerLoop(nn.Module):
    """Adapts a fixed set of named parameters with a differentiable optimizer.

    Owns the inner learning rates; with cfg.learnable_lr != "none" they are parameters of this module
    (Meta-SGD) and the outer optimizer must include `self.parameters()`: `lrs.{j}` holding the lrs
    themselves (cfg.lr_space=linear), or `log_lrs.{j}` holding their logarithms (lr_space=log).
    """

    def __init__(self, params: Mapping[str, torch.Tensor], cfg: InnerLoopConfig):
        super().__init__()
        if not params:
            raise ValueError("InnerLoop needs at least one parameter to adapt")
        self.cfg = cfg
        self.names = list(params)
        self.optimizer = make_inner_optimizer(cfg)
        self.lrs = self.log_lrs = None
        if cfg.learnable_lr != "none":
            start = cfg.lr if cfg.lr_space == "linear" else math.log(cfg.lr)
            learnable = nn.ParameterList(
                nn.Parameter(
                    torch.full(() if cfg.learnable_lr == "tensor" else p.shape, start, dtype=torch.float32)
                )
                for p in params.values()
            )
            if cfg.lr_space == "linear":
                self.lrs = learnable
            else:
                self.log_lrs = learnable

    def learning_rates(self) -> dict[str, torch.Tensor | float]:
        """Inner learning rate of each adapted parameter: floats, or scalar / per-element tensors."""
        if self.log_lrs is not None:
            return {name: log_lr.exp() for name, log_lr in zip(self.names, self.log_lrs)}
        if self.lrs is None:
            return dict.fromkeys(self.names, self.cfg.lr)
        return dict(zip(self.names, self.lrs))

    def step_lrs(self, params: Mapping[str, torch.Tensor], lr_scale: float = 1.0) -> LearningRates:
        """The learning rates of one step on `params`: `learning_rates()` times lr_scale (warm-up), tensors
        cast to their parameter's dtype (float32 lrs with float64 or half fast weights)."""
        return {
            n: (lr.to(params[n].dtype) if torch.is_tensor(lr) else lr) * lr_scale
            for n, lr in self.learning_rates().items()
        }

    def init_state(self, params: Mapping[str, torch.Tensor]) -> dict:
        """The inner optimizer's state before the first step on `params` (per-row fast weights too)."""
        return self.optimizer.init(params)

    def step(
        self,
        loss: torch.Tensor,
        params: Mapping[str, torch.Tensor],
        state: dict,
        *,
        create_graph: bool,
        lr_scale: float = 1.0,
        lrs: LearningRates | None = None,
        per_row: bool = False,
        retain_graph: bool | None = None,
    ) -> tuple[Tensors, dict]:
        """One `inner_step` on the scalar `loss` with this loop's optimizer, clipping (cfg.grad_clip) and
        learning rates `step_lrs(params, lr_scale)`; a caller that takes many steps with the same lrs may
        compute them once and pass them as lrs instead of lr_scale. params keyed like at construction,
        each the parameter's shape, or (B, ...) with per_row (one problem per row, each clipped by its own
        norm; `loss` the sum of the rows' losses). Returns (new params, new state)."""
        if lrs is None:
            lrs = self.step_lrs(params, lr_scale)
        elif lr_scale != 1.0:
            raise ValueError(
                "InnerLoop.step takes lr_scale or lrs (from step_lrs(params, lr_scale)), not both"
            )
        return inner_step(
            loss,
            params,
            state,
            optimizer=self.optimizer,
            lrs=lrs,
            create_graph=create_graph,
            grad_clip=self.cfg.grad_clip,
            per_row=per_row,
            retain_graph=retain_graph,
        )

    def _loss_and_step(
        self, loss_fn: InnerLossFn, step: int, params: dict, state: dict, create_graph: bool, keep_graph: bool
    ):
        loss = loss_fn(params, step)
        new_params, new_state = self.step(
            loss, params, state, create_graph=create_graph, retain_graph=create_graph or keep_graph
        )
        return new_params, new_state, loss if keep_graph else loss.detach()

    def adapt(
        self,
        loss_fn: InnerLossFn,
        params: Mapping[str, torch.Tensor],
        *,
        steps: int | None = None,
        first_order: bool | None = None,
        keep_loss_graphs: bool = False,
    ) -> Adaptation:
        """Run `steps` inner steps (default cfg.steps) from `params` (keyed like at construction).

        Second order (the default unless cfg.first_order): the returned params carry the graph of
        every inner gradient, so an outer loss differentiates through the steps exactly.
        First order: inner gradients are constants; the outer gradient still reaches the initial
        params (and the learning rates) through the updates. keep_loss_graphs: also return each step's
        loss attached to its graph (`Adaptation.loss_graphs`; first order then keeps every step's forward
        graph alive until the outer backward). Needs grad mode (inside torch.no_grad,
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
        state = self.init_state(current)
        losses = []
        for step in range(steps):
            current, state, loss = maybe_checkpoint(
                self._loss_and_step,
                loss_fn,
                step,
                current,
                state,
                not first_order,
                keep_loss_graphs,
                enabled=self.cfg.checkpoint,
            )
            losses.append(loss)
        if not keep_loss_graphs:
            return Adaptation(params=current, losses=losses)
        return Adaptation(params=current, losses=[loss.detach() for loss in losses], loss_graphs=losses)
