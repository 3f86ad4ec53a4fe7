"""Which keys each query may attend to, shared by every backend.

Causal masks are bottom-right aligned (as in FlashAttention 2): with N queries and M keys, query i
sees key j when j <= i + (M - N). A sliding window of w keys (causal only) also requires
j > i + (M - N) - w, so each query sees at most its w most recent keys.
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
) -> torch.Tensor | None:
    """Boolean mask of shape (n_queries, n_keys), True where query i may attend to key j.

    Returns None when every key is visible to every query (no mask at all).
    """
    if not causal:
        return None
    offset = n_keys - n_queries
    rows = torch.arange(n_queries, device=device)[:, None]
    cols = torch.arange(n_keys, device=device)[None, :]
    mask = cols <= rows + offset
    if window is not None:
        mask &= cols > rows + offset - window
    return mask
