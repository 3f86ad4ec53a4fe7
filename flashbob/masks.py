"""Which keys each query may attend to, shared by every backend.

Causal masks are bottom-right aligned (as in FlashAttention 2): with N queries and M keys, query i
sees key j when j <= i + (M - N). A sliding window of w keys (causal only) also requires
j > i + (M - N) - w, so each query sees at most its w most recent keys. Per-batch-row key ranges
(padding masks) also require key_range[b, 0] <= j < key_range[b, 1] in batch row b.
"""

from __future__ import annotations

import torch


def visible_keys(
    n_queries: int,
    n_keys: int,
    *,
    causal: bool,
    window: int | None,
    device: torch.device | str | None = None,
    key_range: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Boolean mask, True where query i may attend to key j: (n_queries, n_keys), or (B, 1, n_queries,
    n_keys) with key_range, a (B, 2) integer tensor of [start, end) per batch row.

    Returns None when every key is visible to every query (no mask at all).
    """
    cols = torch.arange(n_keys, device=device)
    mask = None
    if causal:
        offset = n_keys - n_queries
        rows = torch.arange(n_queries, device=device)[:, None]
        mask = cols[None, :] <= rows + offset
        if window is not None:
            mask &= cols[None, :] > rows + offset - window
    if key_range is not None:
        in_range = (cols >= key_range[:, :1]) & (cols < key_range[:, 1:])
        in_range = in_range[:, None, None, :]
        mask = in_range.expand(-1, 1, n_queries, -1) if mask is None else in_range & mask
    return mask
