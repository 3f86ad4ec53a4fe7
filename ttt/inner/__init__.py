"""The inner-loop engine: adapt named parameters of a module by differentiable optimizer steps.

    params = select_parameters(model, ["layers.1.mlp.*"])             # the meta-learned initial weights
    inner = InnerLoop(params, InnerLoopConfig(steps=2, lr=0.1))     # optimizer, lrs, clipping, order
    result = inner.adapt(lambda p, step: loss(functional_forward(model, p, x), y), params)
    outer = loss(functional_forward(model, result.params, xq), yq); outer.backward()

`meta_step` runs that for a list of tasks (inner adaptation, outer loss, backward), without Lightning.
"""

from .config import InnerLoopConfig
from .functional import functional_forward, select_parameters
from .loop import Adaptation, InnerLoop
from .meta_step import MetaStepResult, TaskObjective, meta_step
from .optimizers import InnerAdam, InnerMomentum, InnerSGD, make_inner_optimizer

__all__ = [
    "Adaptation",
    "InnerAdam",
    "InnerLoop",
    "InnerLoopConfig",
    "InnerMomentum",
    "InnerSGD",
    "MetaStepResult",
    "TaskObjective",
    "functional_forward",
    "make_inner_optimizer",
    "meta_step",
    "select_parameters",
]
