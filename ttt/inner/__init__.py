"""The inner-loop engine: adapt named parameters of a module by differentiable optimizer steps.

    params = select_parameters(model, ["layers.1.mlp.*"])             # the meta-learned initial weights
    inner = InnerLoop(params, InnerLoopConfig(steps=2, lr=0.1))     # optimizer, lrs, clipping, order
    result = inner.adapt(lambda p, step: loss(functional_forward(model, p, x), y), params)
    outer = loss(functional_forward(model, result.params, xq), yq); outer.backward()

Every inner gradient of the framework is taken by `inner_step` (step.py): MAML's `InnerLoop.adapt`
and the TTT layers' chunk reading both go through `InnerLoop.step`, which adds the loop's optimizer,
clipping and (learnable, warm-up scaled) learning rates. A layer that drives its own steps:

    fast = expand_rows(initial, batch)                      # (B, ...): one problem per row
    state = inner.init_state(fast)
    fast, state = inner.step(rows_loss.sum(), fast, state, create_graph=True, per_row=True)

`meta_step` runs adaptation, outer loss and backward for a list of tasks, without Lightning.
"""

from .config import InnerLoopConfig
from .functional import functional_forward, select_by_glob, select_parameters
from .loop import Adaptation, InnerLoop
from .meta_step import MetaStepResult, TaskObjective, meta_step
from .optimizers import (
    InnerAdam,
    InnerGatedMomentum,
    InnerMomentum,
    InnerOptimizer,
    InnerSGD,
    make_inner_optimizer,
)
from .step import clip_by_global_norm, detach_state, expand_rows, fresh_leaves, inner_step, maybe_checkpoint

__all__ = [
    "Adaptation",
    "InnerAdam",
    "InnerGatedMomentum",
    "InnerLoop",
    "InnerLoopConfig",
    "InnerMomentum",
    "InnerOptimizer",
    "InnerSGD",
    "MetaStepResult",
    "TaskObjective",
    "clip_by_global_norm",
    "detach_state",
    "expand_rows",
    "fresh_leaves",
    "functional_forward",
    "inner_step",
    "make_inner_optimizer",
    "maybe_checkpoint",
    "meta_step",
    "select_by_glob",
    "select_parameters",
]
