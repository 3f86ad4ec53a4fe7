"""Fast weights that learn while a model reads (TTT-E2E): what `TTTTransformer` and
`TransformersTTTReader` share.

    carry = initial_carry(inner, initial_weights, options, batch)      # fast weights, optimizer state, lrs
    outputs, losses, carry = adapt_chunk(score, inner, carry, options, per_row=True)
    carry = detached_carry(carry)                                        # evaluation: cut from the graph

`score_then_step` is one chunk of test-time training: scored with the current fast weights, then
adapted on its own mean loss (apply, then update).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ttt.inner import InnerLoop, InnerLoopConfig, detach_state, expand_rows, fresh_leaves

from .config import TTTConfig
from .objective import row_means
from .reader import ReadOptions

Weights = dict[str, torch.Tensor]
FastCarry = tuple[Weights, dict, dict]
"""(fast weights by full name, the inner optimizer's state, the inner learning rates)."""


def read_options(
    ttt: TTTConfig,
    inner: InnerLoopConfig,
    *,
    adapt: bool | None,
    steps: int | None,
    first_order: bool | None,
    lr_scale: float,
    outer_grad: bool,
    keep_logits: bool,
) -> ReadOptions:
    """The `ReadOptions` of a fast-weight read: adapt defaults to ttt.enabled, steps to inner.steps (0
    without adapting), first_order to inner.first_order; the graph of the inner steps is built only for
    an outer gradient of second order; chunks are recomputed with inner.checkpoint. RuntimeError when
    steps are asked for outside grad mode."""
    adapt = ttt.enabled if adapt is None else adapt
    steps = (inner.steps if steps is None else steps) if adapt else 0
    create_graph = outer_grad and not (inner.first_order if first_order is None else first_order)
    if steps and not torch.is_grad_enabled():
        raise RuntimeError("test-time training needs grad mode: wrap evaluation in torch.enable_grad()")
    return ReadOptions(
        adapt=adapt, steps=steps, create_graph=create_graph, lr_scale=lr_scale, outer_grad=outer_grad,
        keep_logits=keep_logits, checkpoint=inner.checkpoint,
    )  # fmt: skip


def initial_carry(
    inner: InnerLoop, initial: Mapping[str, torch.Tensor], options: ReadOptions, batch: int | None
) -> FastCarry:
    """The carry before the first chunk: the fast weights from their initial values (expanded to
    (batch, ...), one per sequence; batch None: as they are), the optimizer's fresh state, and the inner
    learning rates scaled by options.lr_scale (once per read: every chunk's steps share them)."""
    fast = dict(initial) if batch is None else expand_rows(initial, batch)
    return fast, inner.init_state(fast), inner.step_lrs(fast, options.lr_scale)


def detached_carry(carry: FastCarry) -> FastCarry:
    """carry with the fast weights fresh leaves (same shape), optimizer state and lrs detached."""
    fast, state, lrs = carry
    return fresh_leaves(fast), detach_state(state), detach_state(lrs)


def adapt_chunk(
    score: Callable[[Weights, bool], tuple[Any, torch.Tensor]],
    inner: InnerLoop,
    carry: FastCarry,
    options: ReadOptions,
    *,
    per_row: bool,
    mask: torch.Tensor | None,
    ends_sequence: bool,
) -> tuple[Any, torch.Tensor, FastCarry]:
    """One chunk of a fast-weight read: `score_then_step` with options.steps steps on the chunk's masked
    mean loss (mask (B, T) or None), none on the chunk that ends the sequence (`Chunk.last`: no later
    chunk reads the weights they would make, and scoring comes before them, so its losses are the same).
    Returns (the first scoring's outputs, its losses (B, T), carry after the steps)."""
    fast, state, lrs = carry
    steps = 0 if ends_sequence else options.steps
    outputs, scored, fast, state = score_then_step(
        score, inner, fast, state, lrs, steps=steps, create_graph=options.create_graph,
        per_row=per_row, scored_in_outer=options.outer_grad, mask=mask,
    )  # fmt: skip
    return outputs, scored, (fast, state, lrs)


def score_then_step(
    score: Callable[[Weights, bool], tuple[Any, torch.Tensor]],
    inner: InnerLoop,
    fast: Weights,
    state: dict,
    lrs: dict,
    *,
    steps: int,
    create_graph: bool,
    per_row: bool,
    scored_in_outer: bool = True,
    mask: torch.Tensor | None = None,
) -> tuple[Any, torch.Tensor, Weights, dict]:
    """Score a chunk with the fast weights `fast`, then take `steps` inner steps (`inner.step`, learning
    rates lrs) on its mean loss over the targets mask (B, T) keeps (all without a mask; a row whose
    targets are all masked has loss 0); none when the chunk has nothing to predict (an empty last chunk).

    score(fast, first) -> (outputs, next-token losses (B, T)): the chunk read with fast; first is True
    for the scoring whose outputs are returned, False for the rescoring of steps 1.. (whose outputs are
    dropped). Step 0 reuses the first scoring's losses, so its graph is retained through that step when
    scored_in_outer (they are part of the outer loss). per_row: fast (B, ...), one problem per sequence,
    each stepped on its own mean loss; else unbatched fast weights and B = 1.
    Returns (outputs, losses (B, T) before the steps, fast and state after them)."""
    outputs, scored = score(fast, True)
    for step in range(steps if scored.numel() else 0):
        losses = scored if step == 0 else score(fast, False)[1]
        fast, state = inner.step(
            row_means(losses, mask).sum() if per_row else row_means(losses, mask)[0],  # each row its own mean
            fast,
            state,
            create_graph=create_graph,
            lrs=lrs,
            per_row=per_row,
            retain_graph=create_graph or (step == 0 and scored_in_outer),
        )
    return outputs, scored, fast, state
