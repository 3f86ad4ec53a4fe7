"""How a read's next-token losses make the losses of its sequences: the inner step's loss of a chunk
and the outer objective, with a mask of the targets that count (TTT-E2E masks targets equal to BOS)."""

from __future__ import annotations

import torch

from .config import LossAverage

EMPTY_FLOOR = 1e-10
"""A masked mean divides by max(count, EMPTY_FLOOR): a chunk whose targets are all masked has loss 0."""


def row_means(losses: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Each row's mean of losses (B, T) over the targets mask (B, T) (bool or 0/1) keeps; all of them
    without a mask. Returns (B,) in losses' dtype."""
    if mask is None:
        return losses.mean(1)
    weight = mask.to(losses.dtype)
    return (losses * weight).sum(1) / weight.sum(1).clamp_min(EMPTY_FLOOR)


def sequence_losses(
    losses: torch.Tensor, mask: torch.Tensor | None, *, average: LossAverage | str, chunk_len: int
) -> torch.Tensor:
    """The loss of each sequence from its next-token losses (B, T) and mask (B, T) or None: their masked
    mean (average "tokens"), or the mean over chunks of chunk_len targets of each chunk's masked mean
    ("chunks": TTT-E2E's meta-loss; the last chunk may be shorter). Returns (B,)."""
    if average == LossAverage.tokens:
        return row_means(losses, mask)
    means = []
    for start in range(0, losses.shape[1], chunk_len):
        part = slice(start, start + chunk_len)
        means.append(row_means(losses[:, part], None if mask is None else mask[:, part]))
    return torch.stack(means, dim=1).mean(1)
