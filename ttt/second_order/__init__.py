"""Second-order derivatives through attention: Hessian-vector products, Hutchinson's diagonal
estimate, the Hessian optimizers they feed, and their cost as context grows (docs/second_order.md)."""

from .hessian_optimizers import HESSIAN_OPTIMIZERS, HessianFeed, hessian_optimizer
from .hvp import check_params, check_vector, hutchinson_diagonal, hvp, module_loss_fn, rademacher_like

__all__ = [
    "HESSIAN_OPTIMIZERS",
    "HessianFeed",
    "check_params",
    "check_vector",
    "hessian_optimizer",
    "hutchinson_diagonal",
    "hvp",
    "module_loss_fn",
    "rademacher_like",
]
