"""The one attention function every ttt model calls; `backend` picks the implementation.

* "flashbob": `flashbob.flash_attention(backend="auto")`: the FlashBoB Triton kernels on CUDA (exact
  backward-over-backward, no N x N tensor), the plain-PyTorch path elsewhere.
* "eager": `flashbob.flash_attention(backend="torch")`: plain PyTorch on any device.
* "sdpa_math": `torch.nn.functional.scaled_dot_product_attention` restricted to its math backend
  (the only SDPA backend that supports double backward), with an explicit boolean mask.
* "sdpa": `scaled_dot_product_attention` with whichever fused kernel torch picks (flash, cuDNN,
  memory-efficient; `torch.nn.attention.sdpa_kernel` restricts the choice). First order only (no
  double backward): for inference and first-order training. The fused kernels run where no mask is
  needed (full causal attention over as many keys as queries, or one query: decoding); any other mask
  is passed explicitly, which leaves torch fewer kernels to pick from; a sliding window over more keys
  than it keeps runs in query blocks, each over its own keys with its own mask (`window_blocks`), so no
  (N, M) mask is built for a long read.
* "sdpa_cudnn": "sdpa" with cuDNN's fused kernel first in torch's order (torch's own order puts it
  last), where the device offers it (CUDA; elsewhere the next in that order). On Hopper its forward+backward
  is 1.7-2.0x torch's flash kernel's (docs/benchmarks.md, the cuDNN yardstick). First order only.

All five share the semantics of `flashbob`: causal masks are bottom-right aligned and a window of
w keeps the w most recent keys (causal only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import flashbob
from flashbob.masks import visible_keys
from ttt.config.choice import Choice


class AttentionBackend(Choice):
    """model.attention: which implementation `attention` runs."""

    flashbob = "flashbob"
    eager = "eager"
    sdpa_math = "sdpa_math"
    sdpa = "sdpa"
    sdpa_cudnn = "sdpa_cudnn"


FIRST_ORDER_BACKENDS = (AttentionBackend.sdpa, AttentionBackend.sdpa_cudnn)
"""The backends without a second derivative (torch's fused SDPA kernels)."""

ATTENTION_BACKENDS = tuple(name for name in AttentionBackend.values() if name not in FIRST_ORDER_BACKENDS)
"""The backends with exact derivatives of every order (all but "sdpa" and "sdpa_cudnn")."""

CUDNN_FIRST = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.MATH]
"""torch SDPA's backends in the order "sdpa_cudnn" tries them."""


def _sdpa_math(q, k, v, *, causal, window, scale):
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    mask = visible_keys(q.shape[2], k.shape[2], causal=causal, window=window, device=q.device)
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


WINDOW_BLOCK_ROWS_MIN = 128
"""The fewest query rows of a block of `_windowed_sdpa` (see `window_blocks`)."""


def window_blocks(n: int, m: int, window: int, rows_min: int = WINDOW_BLOCK_ROWS_MIN):
    """Query blocks of causal sliding-window attention of n queries over m >= n keys (bottom-right
    aligned): (start, stop, first_key, end_key) per block of max(window // 8, rows_min) rows (the last
    shorter), where queries start..stop-1 see only keys first_key..end_key-1 (window - 1 keys before the
    block's first query's position through its last's). A block's mask is then rows x (rows + window - 1),
    at most 12.5% more scores than the window's (a mask keeps the kernels from skipping any)."""
    rows = max(window // 8, rows_min)
    for start in range(0, n, rows):
        stop = min(start + rows, n)
        yield start, stop, max(0, m - n + start - window + 1), m - n + stop


def _windowed_sdpa(q, k, v, *, window, scale):
    """Causal sliding-window SDPA in the query blocks of `window_blocks`, each over its keys alone with
    its own mask: O(N * window) mask memory instead of an (N, M) mask. (B, Hq, N, D) -> same."""
    outs = []
    blocks = window_blocks(q.shape[2], k.shape[2], window, WINDOW_BLOCK_ROWS_MIN)
    for start, stop, first_key, end_key in blocks:
        mask = visible_keys(stop - start, end_key - first_key, causal=True, window=window, device=q.device)
        outs.append(F.scaled_dot_product_attention(
            q[:, :, start:stop], k[:, :, first_key:end_key], v[:, :, first_key:end_key], attn_mask=mask,
            scale=scale, enable_gqa=True,
        ))  # fmt: skip
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)


def _sdpa(q, k, v, *, causal, window, scale):
    n, m = q.shape[2], k.shape[2]
    every_key = not causal or n == 1  # bottom-right causal: a single query sees every key
    if (window is None or window >= m) and (every_key or n == m):
        return F.scaled_dot_product_attention(q, k, v, is_causal=not every_key, scale=scale, enable_gqa=True)
    if causal and window is not None and window < m and n <= m:
        return _windowed_sdpa(q, k, v, window=window, scale=scale)
    mask = visible_keys(n, m, causal=causal, window=window, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    backend: str,
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Softmax attention through the chosen backend.

    q: (B, Hq, N, D); k, v: (B, Hkv, M, D) with Hq a multiple of Hkv. Returns (B, Hq, N, D).
    causal / window / scale as in `flashbob.flash_attention` (scale defaults to D ** -0.5).
    With "sdpa_math", "sdpa" and "sdpa_cudnn", every query must see at least one key (true whenever
    N <= M and causal).
    """
    backend = AttentionBackend.parse(backend, "attention backend")
    if backend == "sdpa_math":
        return _sdpa_math(q, k, v, causal=causal, window=window, scale=scale)
    if backend == "sdpa":
        return _sdpa(q, k, v, causal=causal, window=window, scale=scale)
    if backend == "sdpa_cudnn":
        with sdpa_kernel(CUDNN_FIRST, set_priority=True):
            return _sdpa(q, k, v, causal=causal, window=window, scale=scale)
    kernel_backend = "auto" if backend == "flashbob" else "torch"
    return flashbob.flash_attention(q, k, v, causal=causal, window=window, scale=scale,
                                    backend=kernel_backend)
