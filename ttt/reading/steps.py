"""`score_then_step`: one chunk of test-time training, scored with the current fast weights, then
adapted on its own mean loss (apply, then update): the loop every TTT-E2E reader runs per chunk."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ttt.inner import InnerLoop

Weights = dict[str, torch.Tensor]


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
) -> tuple[Any, torch.Tensor, Weights, dict]:
    """Score a chunk with the fast weights `fast`, then take `steps` inner steps (`inner.step`, learning
    rates lrs) on its mean loss; none when the chunk has nothing to predict (an empty last chunk).

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
            losses.mean(1).sum() if per_row else losses.mean(),  # rows independent: each its own mean
            fast,
            state,
            create_graph=create_graph,
            lrs=lrs,
            per_row=per_row,
            retain_graph=create_graph or (step == 0 and scored_in_outer),
        )
    return outputs, scored, fast, state
