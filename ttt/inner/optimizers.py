"""Differentiable inner optimizers: pure functions of (params, grads, state, lrs).

Each optimizer has `init(params) -> state` and `step(params, grads, state, lrs) -> (params, state)`
(the `InnerOptimizer` protocol), where params, grads and lrs are dicts keyed by parameter name. A
parameter is its own shape (...) or, for per-row fast weights, (B, ...); its lr is a float or a tensor
broadcastable to it: scalar, per-element (...), or per-row and data-dependent (B, 1, ...). Nothing is
done in place, so autograd can differentiate the updates with respect to the initial parameters, the
gradients and the learning rates. A new optimizer implements the protocol and joins
`make_inner_optimizer`; `inner_step` (ttt/inner/step.py) drives every one of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from .config import InnerLoopConfig

Tensors = dict[str, torch.Tensor]
LearningRates = Mapping[str, "float | torch.Tensor"]
"""Learning rate of each parameter by name: a float or a tensor broadcastable to the parameter."""


class InnerOptimizer(Protocol):
    """A differentiable optimizer: pure functions of dicts keyed by parameter name, nothing in place."""

    def init(self, params: Mapping[str, torch.Tensor]) -> dict:
        """The state before the first step (buffers shaped like params, per-row ones included)."""

    def step(
        self,
        params: Mapping[str, torch.Tensor],
        grads: Mapping[str, torch.Tensor],
        state: dict,
        lrs: LearningRates,
    ) -> tuple[Tensors, dict]:
        """(updated params, updated state); every tensor differentiable in params, grads, state and lrs."""


def descend(p: torch.Tensor, g: torch.Tensor, lr: float | torch.Tensor) -> torch.Tensor:
    """p - lr * g in one kernel (lr a float or a tensor broadcastable to p); differentiable in all three."""
    return torch.addcmul(p, g, lr, value=-1) if torch.is_tensor(lr) else torch.add(p, g, alpha=-lr)


class InnerSGD:
    """p <- p - lr * g."""

    linear_in_lr_grad = True
    """step(p, c g, lrs) == step(p, g, c lrs): `inner_step` folds a clip factor into the lrs."""

    def init(self, params: Mapping[str, torch.Tensor]) -> dict:
        """No state."""
        return {}

    def step(self, params: Mapping, grads: Mapping, state: dict, lrs: Mapping) -> tuple[Tensors, dict]:
        """One update; every dict keyed by parameter name."""
        return {n: descend(p, grads[n], lrs[n]) for n, p in params.items()}, state


class InnerMomentum:
    """Heavy-ball momentum: v <- mu * v + g; p <- p - lr * v (v starts at zero)."""

    def __init__(self, momentum: float):
        self.momentum = momentum

    def init(self, params: Mapping[str, torch.Tensor]) -> dict:
        """Velocity buffers at zero."""
        return {"velocity": {n: torch.zeros_like(p) for n, p in params.items()}}

    def step(self, params: Mapping, grads: Mapping, state: dict, lrs: Mapping) -> tuple[Tensors, dict]:
        """One update; every dict keyed by parameter name."""
        velocity = {n: self.momentum * state["velocity"][n] + grads[n] for n in params}
        return {n: p - lrs[n] * velocity[n] for n, p in params.items()}, {"velocity": velocity}


class InnerAdam:
    """Adam with bias correction; the denominator is sqrt(v_hat + eps^2), not sqrt(v_hat) + eps: the two
    agree to within eps, and the first keeps every derivative finite where v_hat = 0."""

    def __init__(self, beta1: float, beta2: float, eps: float):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def init(self, params: Mapping[str, torch.Tensor]) -> dict:
        """First and second moments at zero, step count 0."""
        zeros = {n: torch.zeros_like(p) for n, p in params.items()}
        return {"m": zeros, "v": dict(zeros), "t": 0}

    def step(self, params: Mapping, grads: Mapping, state: dict, lrs: Mapping) -> tuple[Tensors, dict]:
        """One update; every dict keyed by parameter name."""
        t = state["t"] + 1
        m = {n: self.beta1 * state["m"][n] + (1 - self.beta1) * grads[n] for n in params}
        v = {n: self.beta2 * state["v"][n] + (1 - self.beta2) * grads[n].square() for n in params}
        c1, c2 = 1 - self.beta1**t, 1 - self.beta2**t
        new = {n: p - lrs[n] * (m[n] / c1) / torch.sqrt(v[n] / c2 + self.eps**2) for n, p in params.items()}
        return new, {"m": m, "v": v, "t": t}


class InnerGatedMomentum:
    """Momentum with data-dependent gates and weight decay (the neural-memory update of Titans,
    arXiv 2501.00663): with surprise S (starts at zero), learning rate theta (the lrs), momentum gate
    eta and decay ("forgetting") gate alpha,

        S <- eta * S - theta * g          p <- (1 - alpha) * p + S

    theta comes through `lrs` like every optimizer's learning rate; eta and alpha are the gates of the
    coming step, carried in the state: `with_gates(state, momentum=..., decay=...)` returns the state
    with new gates (dicts keyed by parameter name, or one value for all, each a float or a tensor
    broadcastable to the parameter, e.g. per row and data-dependent (B, 1, ...)). This is the one
    extension of the protocol: `step` itself keeps its signature. Without with_gates, the constructor's
    momentum and decay apply."""

    def __init__(self, momentum: float = 0.9, decay: float = 0.0):
        self.momentum, self.decay = momentum, decay

    def init(self, params: Mapping[str, torch.Tensor]) -> dict:
        """Surprise buffers at zero; the constructor's momentum and decay as gates."""
        return {
            "surprise": {n: torch.zeros_like(p) for n, p in params.items()},
            "momentum": dict.fromkeys(params, self.momentum),
            "decay": dict.fromkeys(params, self.decay),
        }

    @staticmethod
    def with_gates(state: dict, *, momentum, decay) -> dict:
        """`state` with the gates of the next step: momentum (eta) and decay (alpha), each a dict keyed
        by parameter name or one float / tensor for every parameter."""

        def per_name(gate) -> dict:
            return dict(gate) if isinstance(gate, Mapping) else dict.fromkeys(state["surprise"], gate)

        return {**state, "momentum": per_name(momentum), "decay": per_name(decay)}

    def step(self, params: Mapping, grads: Mapping, state: dict, lrs: Mapping) -> tuple[Tensors, dict]:
        """One update; every dict keyed by parameter name."""
        eta, alpha = state["momentum"], state["decay"]
        surprise = {n: eta[n] * state["surprise"][n] - lrs[n] * grads[n] for n in params}
        new = {n: (1 - alpha[n]) * p + surprise[n] for n, p in params.items()}
        return new, {**state, "surprise": surprise}


def make_inner_optimizer(cfg: InnerLoopConfig) -> InnerSGD | InnerMomentum | InnerAdam:
    """The optimizer named by cfg.optimizer, with its hyperparameters from cfg."""
    if cfg.optimizer == "sgd":
        return InnerSGD()
    if cfg.optimizer == "momentum":
        return InnerMomentum(cfg.momentum)
    return InnerAdam(cfg.beta1, cfg.beta2, cfg.eps)
