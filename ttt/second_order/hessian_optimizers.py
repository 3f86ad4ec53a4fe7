"""Sophia-H and AdaHessian (from pytorch-optimizer) fed Hutchinson estimates from a loss closure.

pytorch-optimizer's `SophiaH` and `AdaHessian` estimate the Hessian diagonal inside `step` from the
parameters' .grad, which needs `loss.backward(create_graph=True)` on every step: the whole
double-backward graph stays alive through clipping and the update even on the steps (all but one in
`update_period`) that never use it. Both also take an external estimate, `step(hessian=[...])`, one
tensor per parameter in param-group order; `HessianFeed` computes that estimate with
`ttt.second_order.hutchinson_diagonal` from a loss closure on exactly the steps the optimizer consumes
one (its steps 1, 1 + k, 1 + 2k, ... for update_period k), so the learner's own backward stays
first order and the differentiable graph lives only inside the estimate.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from pytorch_optimizer import AdaHessian, SophiaH
from pytorch_optimizer.base.optimizer import BaseOptimizer

from .hvp import LossFn, hutchinson_diagonal

HESSIAN_OPTIMIZERS = ("sophia_h", "adahessian")


class _ExternalHessianError:
    """Mixin over a pytorch-optimizer Hessian optimizer: a due step without `hessian=` and without a
    create_graph backward raises an error that says what to pass, instead of autograd's
    "element 0 of tensors does not require grad"."""

    @staticmethod
    def compute_hutchinson_hessian(param_groups, state, **kwargs) -> None:
        grads = [p.grad for group in param_groups for p in group["params"] if p.grad is not None]
        if all(g.grad_fn is None for g in grads):  # no create_graph backward before this step
            raise RuntimeError(
                "this step of the Hessian optimizer needs a Hessian estimate: pass step(hessian=...) "
                "(ttt.second_order.HessianFeed.step_kwargs), or call loss.backward(create_graph=True) "
                "before it"
            )
        BaseOptimizer.compute_hutchinson_hessian(param_groups, state, **kwargs)


class GuardedSophiaH(_ExternalHessianError, SophiaH):
    """pytorch-optimizer's SophiaH with the clear error of `_ExternalHessianError`."""


class GuardedAdaHessian(_ExternalHessianError, AdaHessian):
    """pytorch-optimizer's AdaHessian with the clear error of `_ExternalHessianError`."""


def hessian_optimizer(
    name: str,
    params,
    *,
    lr: float,
    betas: tuple[float, float],
    weight_decay: float,
    hessian_update_interval: int,
) -> torch.optim.Optimizer:
    """pytorch-optimizer's SophiaH (name "sophia_h") or AdaHessian ("adahessian") over `params`
    (tensors or param groups), consuming a Hessian estimate every `hessian_update_interval` steps
    (its update_period). Feed it with `HessianFeed`; everything else is the library's defaults."""
    if name not in HESSIAN_OPTIMIZERS:
        raise ValueError(f"name must be one of {HESSIAN_OPTIMIZERS}, got {name!r}")
    if not isinstance(hessian_update_interval, int) or hessian_update_interval < 1:
        raise ValueError(f"hessian_update_interval must be a positive int, got {hessian_update_interval!r}")
    optimizer_class = GuardedSophiaH if name == "sophia_h" else GuardedAdaHessian
    return optimizer_class(
        params, lr=lr, betas=betas, weight_decay=weight_decay, update_period=hessian_update_interval
    )


class HessianFeed:
    """Hands a pytorch-optimizer Hessian optimizer (SophiaH, AdaHessian) its Hessian-diagonal
    estimate on the steps that consume one, and nothing on the others.

    optimizer: built by `hessian_optimizer` (or any optimizer with `update_period` whose step takes
        `hessian=`).
    params: name -> parameter, the optimizer's parameters in its param-group order (e.g.
        dict(model.named_parameters()) for an optimizer over model.parameters()).
    n_samples: Rademacher probes per estimate. generator: draws them (None: the global RNG).

    A learner step with manual optimization reads:
        self.manual_backward(loss)
        outer_update(self, optimizer, scheduler, cfg, **feed.step_kwargs(loss_fn))
    where loss_fn(params) recomputes the loss from a dict of parameters (`module_loss_fn`).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        params: Mapping[str, torch.Tensor],
        *,
        n_samples: int = 1,
        generator: torch.Generator | None = None,
    ):
        interval = getattr(optimizer, "update_period", None)
        if not isinstance(interval, int) or interval < 1:
            raise TypeError(
                f"optimizer must be a Hessian optimizer with an update_period (SophiaH, AdaHessian), "
                f"got {type(optimizer).__name__}"
            )
        ordered = [p for group in optimizer.param_groups for p in group["params"]]
        given = list(params.values())
        if len(given) != len(ordered) or any(a is not b for a, b in zip(given, ordered)):
            raise ValueError(
                "params must be the optimizer's parameters, by name, in its param-group order "
                f"({len(ordered)} tensors); got {len(given)} that differ"
            )
        if not isinstance(n_samples, int) or n_samples < 1:
            raise ValueError(f"n_samples must be a positive int, got {n_samples!r}")
        self.optimizer = optimizer
        self.params = dict(params)
        self.n_samples = n_samples
        self.generator = generator
        self.estimates = 0
        """How many Hessian estimates this feed has computed."""

    @property
    def due(self) -> bool:
        """Whether the optimizer's next step consumes a Hessian estimate."""
        steps_taken = self.optimizer.param_groups[0].get("step", 0)
        return steps_taken % self.optimizer.update_period == 0

    def step_kwargs(self, loss_fn: LossFn) -> dict[str, list[torch.Tensor]]:
        """{"hessian": [estimate per parameter, in param-group order]} when the next step is due one
        (computed now by `hutchinson_diagonal(loss_fn, params)`), else {}. loss_fn: dict of tensors
        keyed like params -> scalar loss."""
        if not self.due:
            return {}
        estimate = hutchinson_diagonal(loss_fn, self.params, self.n_samples, self.generator)
        self.estimates += 1
        return {"hessian": list(estimate.values())}

    def step(self, loss_fn: LossFn) -> None:
        """optimizer.step(), with the Hessian estimate when due (no clipping or schedule: those are
        `ttt.meta.outer.outer_update`'s)."""
        self.optimizer.step(**self.step_kwargs(loss_fn))
