"""One differentiable inner step: the single place where inner gradients are taken.

    new_params, new_state = inner_step(loss, params, state, optimizer=opt, lrs=lrs, create_graph=True)

params: dict name -> tensor, the fast weights the loss was computed with. With per_row=False each is a
parameter's own shape; with per_row=True each carries a leading batch dim (B, ...), one independent
problem per row (a sequence's own fast weights), and the loss is the sum of the rows' losses, so each
row's gradient is that of its own loss. state: the optimizer's state (`optimizer.init(params)`).
lrs: dict name -> float or tensor broadcastable to that name's fast weight: a scalar, a per-element
(...) tensor, or a data-dependent per-row (B, 1, ...) tensor. `InnerLoop.step` supplies the lrs of a
loop's config (learnable, warm-up scaled, cast) and its optimizer and clipping.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .optimizers import InnerOptimizer, LearningRates, Tensors


def clip_by_global_norm(
    grads: Mapping[str, torch.Tensor], max_norm: float, *, per_row: bool = False
) -> Tensors:
    """The grads unchanged where their global L2 norm n is below max_norm, else scaled by max_norm / n
    (optax's rule, as TTT-E2E's inner step clips); differentiable (also through n), no in-place ops, the
    norm in float32 (float64 for float64 grads). per_row: the grads are (B, ...), one problem per row (a
    sequence's own fast weights), and each row gets its own norm and factor."""
    start = 1 if per_row else 0
    squares = sum(g.to(torch.promote_types(g.dtype, torch.float32)).square().flatten(start).sum(-1)
                  for g in grads.values())  # fmt: skip
    # All-zero grads (a chunk whose targets are all masked) have n = 0, where sqrt's derivative is infinite:
    # take the root of 1 there (the factor multiplies zeros anyway), so that no NaN reaches the outer graph.
    total = torch.where(squares > 0, torch.sqrt(torch.where(squares > 0, squares, 1.0)), 0.0)
    factor = max_norm / torch.clamp(total, min=max_norm)
    return {n: g * factor.view(factor.shape + (1,) * (g.dim() - start)).to(g.dtype) for n, g in grads.items()}


def inner_step(
    loss: torch.Tensor,
    params: Mapping[str, torch.Tensor],
    state: dict,
    *,
    optimizer: InnerOptimizer,
    lrs: LearningRates,
    create_graph: bool,
    grad_clip: float | None = None,
    per_row: bool = False,
    retain_graph: bool | None = None,
) -> tuple[Tensors, dict]:
    """One optimizer step on `loss` (a scalar computed from `params`): gradients, optional clipping to
    global norm grad_clip (each row by its own norm with per_row), then optimizer.step with `lrs`.

    create_graph=True keeps the gradients differentiable (second order: an outer loss differentiates
    through the step exactly); False makes them constants (first order). retain_graph keeps the loss's
    graph for a later backward (default: as create_graph, torch's default). A parameter the loss does not
    use gets a zero gradient. Returns (new params keyed like `params`, new optimizer state).
    """
    if loss.dim() != 0:
        raise ValueError(f"the inner loss must be a scalar, got shape {tuple(loss.shape)}")
    grads = torch.autograd.grad(
        loss,
        list(params.values()),
        create_graph=create_graph,
        retain_graph=retain_graph,
        materialize_grads=True,
    )
    grads = dict(zip(params, grads))
    if grad_clip is not None:
        grads = clip_by_global_norm(grads, grad_clip, per_row=per_row)
    return optimizer.step(params, grads, state, lrs)


def maybe_checkpoint(fn: Callable[..., Any], *args: Any, enabled: bool) -> Any:
    """fn(*args), recomputed in the backward instead of storing its activations when `enabled`
    (non-reentrant activation checkpointing, so inner `autograd.grad` calls inside fn work). fn must
    depend only on its arguments (bind loop variables as arguments, not through a closure). An inner
    gradient taken inside fn makes torch recompute fn once more during the forward; the chunked readers
    use `ttt.inner.recompute.recomputed`, which does not."""
    if not enabled:
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False)


def expand_rows(params: Mapping[str, torch.Tensor], rows: int) -> Tensors:
    """Fast weights for `rows` independent problems: each (...) tensor viewed as (rows, ...) (an expand,
    no copy; the gradient reaching the initial weights is the sum over rows)."""
    return {name: p.expand(rows, *p.shape) for name, p in params.items()}


def fresh_leaves(params: Mapping[str, torch.Tensor]) -> Tensors:
    """params detached from their graph, as leaves that require grad (the next inner step needs their
    gradient): cuts the outer graph between evaluation chunks so that memory stays flat."""
    return {name: p.detach().requires_grad_() for name, p in params.items()}


def detach_state(state: Any) -> Any:
    """An optimizer state (nested dicts, lists and tuples of tensors and numbers) with every tensor
    detached."""
    if isinstance(state, dict):
        return {key: detach_state(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(detach_state(value) for value in state)
    return state.detach() if torch.is_tensor(state) else state
