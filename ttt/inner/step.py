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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from .optimizers import InnerOptimizer, LearningRates, Tensors


def clip_factor(grads: Mapping[str, torch.Tensor], max_norm: float, *, per_row: bool = False) -> torch.Tensor:
    """The factor of optax's global-norm clip (as TTT-E2E's inner step clips): 1 where the grads' global
    L2 norm n is below max_norm, else max_norm / n; differentiable (also through n), in float32 (float64
    for float64 grads). Each tensor's squares are summed over its own dims (a transposed gradient is not
    copied first); not torch.linalg.vector_norm, whose second derivative at zero is NaN. per_row: the
    grads are (B, ...), one problem per row (a sequence's own fast weights): a factor per row (B,); else
    one, shape ()."""
    start = 1 if per_row else 0

    def squares_of(g: torch.Tensor) -> torch.Tensor:
        g = g.to(torch.promote_types(g.dtype, torch.float32))
        return g.square().sum(dim=tuple(range(start, g.dim()))) if g.dim() > start else g.square()

    squares = sum(squares_of(g) for g in grads.values())
    # All-zero grads (a chunk whose targets are all masked) have n = 0, where sqrt's derivative is infinite:
    # take the root of 1 there (the factor multiplies zeros anyway), so that no NaN reaches the outer graph.
    total = torch.where(squares > 0, torch.sqrt(torch.where(squares > 0, squares, 1.0)), 0.0)
    return max_norm / torch.clamp(total, min=max_norm)


def _per_row(factor: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """factor (B,) or () viewed to broadcast against `like` (B, ...) or (...)."""
    return factor.view(factor.shape + (1,) * (like.dim() - factor.dim()))


def clip_by_global_norm(
    grads: Mapping[str, torch.Tensor], max_norm: float, *, per_row: bool = False
) -> Tensors:
    """The grads times `clip_factor` (unchanged where their global norm is below max_norm, else scaled
    to it); no in-place ops. per_row: grads (B, ...), each row clipped by its own norm."""
    return _scaled(grads, clip_factor(grads, max_norm, per_row=per_row))


def _scaled(grads: Mapping[str, torch.Tensor], factor: torch.Tensor) -> Tensors:
    return {n: g * _per_row(factor, g).to(g.dtype) for n, g in grads.items()}


def _clipped_lrs(
    lrs: LearningRates, grads: Mapping[str, torch.Tensor], factor: torch.Tensor
) -> LearningRates | None:
    """Each lr times the clip factor, for an optimizer whose step is linear in lr * grad; None where a
    product would be larger than the factor (per-element lrs): then the grads are scaled instead."""
    scaled = {}
    for n, g in grads.items():
        row_factor = _per_row(factor, g)
        lr = lrs[n]
        if torch.is_tensor(lr) and _broadcast_numel(lr.shape, row_factor.shape) > factor.numel():
            return None
        scaled[n] = lr * row_factor.to(g.dtype)
    return scaled


def _broadcast_numel(a: Sequence[int], b: Sequence[int]) -> int:
    """The number of elements of shapes a and b broadcast together (both broadcastable), by hand: this
    runs for every fast weight at every inner step, where torch.broadcast_shapes costs the host more."""
    total = 1
    for i in range(1, max(len(a), len(b)) + 1):
        total *= max(a[-i] if i <= len(a) else 1, b[-i] if i <= len(b) else 1)
    return total


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
        # An optimizer linear in lr * grad (SGD) takes the clip factor in its learning rates: p - (lr f) g
        # in one kernel, never the clipped grads f g as a tensor of their own (nor their outer backward's).
        factor = clip_factor(grads, grad_clip, per_row=per_row)
        linear = getattr(optimizer, "linear_in_lr_grad", False)
        clipped = _clipped_lrs(lrs, grads, factor) if linear else None
        if clipped is None:
            grads = _scaled(grads, factor)
        else:
            lrs = clipped
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
