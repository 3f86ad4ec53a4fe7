"""`InnerLoopConfig`: every option of the inner loop, validated."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ttt.config.choice import Choice


class InnerOptimizer(Choice):
    """inner.optimizer."""

    sgd = "sgd"
    momentum = "momentum"
    adam = "adam"


class LearnableLR(Choice):
    """inner.learnable_lr."""

    none = "none"
    tensor = "tensor"
    element = "element"


class LRSpace(Choice):
    """inner.lr_space."""

    linear = "linear"
    log = "log"


@dataclass
class InnerLoopConfig:
    """How the inner loop adapts parameters."""

    params: list[str] = field(default_factory=lambda: ["*"])
    """Glob patterns (fnmatch) over parameter names; the matching parameters are adapted."""
    steps: int = 1
    """Inner optimizer steps during meta-training."""
    eval_steps: int | None = None
    """Inner optimizer steps at validation and test; None means the same as steps."""
    optimizer: InnerOptimizer = InnerOptimizer.sgd
    """Differentiable inner optimizer: sgd, momentum or adam."""
    lr: float = 0.01
    """Inner learning rate (the initial value when learnable)."""
    learnable_lr: LearnableLR = LearnableLR.none
    """Meta-learn the inner learning rates (Meta-SGD): none, tensor (one per parameter tensor) or element."""
    lr_space: LRSpace = LRSpace.linear
    """How the learnable lrs are parameterised: linear (the parameter is the lr) or log (the parameter is
    ln lr, so an outer step changes the lr by a factor whatever its size, and it stays positive)."""
    lr_outer_lr: float | None = None
    """Outer learning rate of the learnable lrs (their own group of the outer optimizer, on optim.lr's
    schedule); null: optim.lr. With lr_space=log and Adam it bounds the change of ln lr per outer step."""
    momentum: float = 0.9
    """Momentum coefficient of the momentum optimizer."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.999
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's epsilon; it sits inside the square root, sqrt(v + eps^2), so every derivative stays finite."""
    grad_clip: float | None = None
    """Clip the inner gradient to this global L2 norm (differentiably); None: no clipping."""
    first_order: bool = False
    """Drop second-order terms (first-order MAML): inner gradients are not differentiated."""
    checkpoint: bool = False
    """Recompute each inner step in the outer backward instead of storing it (activation checkpointing).
    A TTT reader recomputes each chunk, with or without inner steps: without test-time training
    (ttt.enabled=false) that is plain activation checkpointing of the suffix blocks, so the baseline
    holds the memory of the TTT run and not that of every chunk."""

    def __post_init__(self):
        if not self.params or any(not isinstance(p, str) or not p for p in self.params):
            raise ValueError(f"inner.params must be a non-empty list of glob patterns, got {self.params!r}")
        if self.steps < 0:
            raise ValueError(f"inner.steps must be >= 0, got {self.steps}")
        if self.eval_steps is not None and self.eval_steps < 0:
            raise ValueError(f"inner.eval_steps must be >= 0 or null, got {self.eval_steps}")
        if not 0 < self.lr < math.inf:
            raise ValueError(
                f"inner.lr must be a positive finite float, got {self.lr} (zero does not adapt, a "
                "negative lr ascends the inner loss)"
            )
        self.optimizer = InnerOptimizer.parse(self.optimizer, "inner.optimizer")
        self.learnable_lr = LearnableLR.parse(self.learnable_lr, "inner.learnable_lr")
        self.lr_space = LRSpace.parse(self.lr_space, "inner.lr_space")
        if self.lr_outer_lr is not None and not 0 < self.lr_outer_lr < math.inf:
            raise ValueError(
                f"inner.lr_outer_lr must be a positive finite float or null, got {self.lr_outer_lr}"
            )
        if self.learnable_lr == "none" and (self.lr_space != "linear" or self.lr_outer_lr is not None):
            raise ValueError(
                "inner.lr_space and inner.lr_outer_lr apply to learnable lrs: set inner.learnable_lr to "
                f"tensor or element (got inner.learnable_lr=none, lr_space={self.lr_space}, "
                f"lr_outer_lr={self.lr_outer_lr})"
            )
        if not 0 <= self.momentum < 1:
            raise ValueError(f"inner.momentum must be in [0, 1), got {self.momentum}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"inner.beta1 and inner.beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.eps <= 0:
            raise ValueError(f"inner.eps must be > 0, got {self.eps}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"inner.grad_clip must be > 0 or null, got {self.grad_clip}")

    @property
    def steps_at_eval(self) -> int:
        """Inner steps used at validation and test."""
        return self.steps if self.eval_steps is None else self.eval_steps
