"""`SuffixBlock`: a `Transformer` block that reads a sequence chunk by chunk, carrying its sliding-window
key/value cache across chunks, optionally with an extra fast-weight MLP (TTT-E2E)."""

from __future__ import annotations

import torch
from torch import nn

from ttt.models.attention import attention
from ttt.models.transformer import Block, RMSNorm, SwiGLU, TransformerConfig, residual

from .prefix_cache import PrefixCache
from .ring_cache import RingCache

KVCache = tuple[torch.Tensor, torch.Tensor] | PrefixCache | RingCache | None
"""Keys (RoPE applied) and values of the most recent positions, each (B, n_kv_heads, M, head_dim): a
pair, a `PrefixCache` (all positions, for a read the window covers: `SuffixBlock.shares_prefix`), or a
`RingCache` (a sliding window decoded one position at a time, written in place)."""


def detach_cache(cache: KVCache) -> KVCache:
    """cache with its keys and values cut from the graph."""
    if cache is None:
        return None
    if isinstance(cache, PrefixCache):
        return cache.detach()
    return cache[0].detach(), cache[1].detach()


class SuffixBlock(nn.Module):
    """Same parameters and computation as `Block` (it takes over the block's modules, so parameter
    names stay layers.{i}.attn.wq.weight etc.), plus, with an extra MLP,
    x + ttt_mlp(ttt_norm(x)) between attention and the block's MLP (with model.post_norm,
    x + ttt_post_norm(ttt_mlp(ttt_norm(x)))). extra_init "zero_out" starts the extra MLP's output
    projection at zero, so a fresh SuffixBlock computes exactly what the block did; "normal" draws its
    three matrices from N(0, model.init_std) (TTT-E2E). Through functional_call any of its weights may
    carry a leading batch dim, one per sequence (see `project`)."""

    shares_prefix = True
    """Carry the keys and values of a read that the window covers (`covers`) as a `PrefixCache`: each
    chunk writes its rows into one buffer, and its attention saves a view of it, instead of a copy of
    the prefix per chunk (O(N^2 / chunk_len) saved and copied). A chunk read again from the same cache
    (a rescoring, a recomputation outside `ttt.inner.recompute`'s replay) copies, as the concatenation
    does. False: always the concatenation (the comparison of `ttt.experiments.neural_memory_saved`)."""

    def __init__(
        self, block: Block, cfg: TransformerConfig, extra_hidden: int | None, extra_init: str = "zero_out"
    ):
        super().__init__()
        self.cfg = cfg
        self.attn_norm, self.attn = block.attn_norm, block.attn
        self.mlp_norm, self.mlp = block.mlp_norm, block.mlp
        self.attn_post_norm, self.mlp_post_norm = block.attn_post_norm, block.mlp_post_norm
        self.ttt_norm = self.ttt_mlp = self.ttt_post_norm = None
        if extra_hidden is not None:
            device = block.attn_norm.weight.device
            self.ttt_norm = RMSNorm(cfg.d_model, cfg.norm_eps, fused=cfg.fused_ops).to(device)
            self.ttt_mlp = SwiGLU(cfg.d_model, extra_hidden, fused=cfg.fused_ops).to(device)
            if cfg.post_norm:
                self.ttt_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, fused=cfg.fused_ops).to(device)
            nn.init.normal_(self.ttt_mlp.w_gate.weight, std=cfg.init_std)
            nn.init.normal_(self.ttt_mlp.w_up.weight, std=cfg.init_std)
            if extra_init == "zero_out":
                nn.init.zeros_(self.ttt_mlp.w_down.weight)
            else:
                nn.init.normal_(self.ttt_mlp.w_down.weight, std=cfg.init_std)

    def kept_keys(self) -> int | None:
        """How many past positions a later query can still see: window - 1 (None: all, full attention)."""
        return None if self.cfg.window is None else self.cfg.window - 1

    def covers(self, positions: int, chunk_len: int) -> bool:
        """Whether a read of `positions` positions in chunks of chunk_len is one for a `PrefixCache`: full
        attention, or a window that falls short of the read by less than a chunk (a chunk's attention is
        then handed fewer keys beyond its window, which the kernels skip, than it has rows; the logits
        of TTT-E2E's 8,193-token slices under a window of 8,192)."""
        return self.cfg.window is None or positions - self.cfg.window < chunk_len

    def initial_cache(self, positions: int, chunk_len: int) -> KVCache:
        """The cache before the first chunk of a read of `positions` positions in chunks of chunk_len:
        with shares_prefix, for a read the window `covers`, an empty `PrefixCache` with room for all of
        them; else None (the pair of the window - 1 most recent keys and values follows)."""
        shared = self.shares_prefix and self.covers(positions, chunk_len)
        return PrefixCache.reserve(positions) if shared else None

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache):
        """Attention of the chunk x (B, C, d) over the cache and itself; cos, sin (C, head_dim) are the
        RoPE tables of the chunk's absolute positions. Returns ((B, C, d), the cache for the next chunk).
        A `RingCache` (one position) takes its keys and values in place; a `PrefixCache` (given, as
        `initial_cache` makes it, or made for a block with shares_prefix under full attention) grows in
        its buffer, its keys past the window masked (and skipped by the kernels); a pair of tensors is
        extended by concatenation and cut to the `kept_keys` most recent (a view, copied when more was
        cut than kept, so that the cache of a long read does not hold all of it)."""
        q, k, v = self.attn.project_qkv(x, cos, sin)
        if isinstance(cache, RingCache):  # one position, whose window is the whole ring once written
            cache.extend(k, v)
            out = attention(q, cache.keys, cache.values, backend=self.cfg.attention, causal=False)
            return self.attn.project_out(out), cache
        if isinstance(cache, PrefixCache) or (self.shares_prefix and self.kept_keys() is None):
            cache = (PrefixCache.reserve(0) if cache is None else cache).extend(k, v)
            out = attention(
                q, cache.keys, cache.values, backend=self.cfg.attention, causal=True, window=self.cfg.window
            )
            return self.attn.project_out(out), cache
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        out = attention(q, k, v, backend=self.cfg.attention, causal=True, window=self.cfg.window)
        keep = self.kept_keys()
        first = 0 if keep is None else max(0, k.shape[2] - keep)
        k, v = k[:, :, first:], v[:, :, first:]
        if keep is not None and first > keep:  # a long read: a view would hold all of it
            k, v = k.clone(), v.clone()
        return self.attn.project_out(out), (k, v)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache = None):
        """One chunk: x (B, C, d_model) -> ((B, C, d_model), the key/value cache for the next chunk)."""
        attended, cache = self.attend(self.attn_norm(x), cos, sin, cache)
        return self._after_attention(residual(x, attended, self.attn_post_norm)), cache

    def read_whole(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Whole sequences at once, with this block's own weights and no cache: x (B, N, d_model), cos, sin
        (N, head_dim) of positions 0..N-1 -> (B, N, d_model); what `forward` computes chunk by chunk from
        an empty cache."""
        attended = self.attn(self.attn_norm(x), cos, sin)
        return self._after_attention(residual(x, attended, self.attn_post_norm))

    def _after_attention(self, x: torch.Tensor) -> torch.Tensor:
        """The extra MLP (when there is one) and the MLP, each a residual: (B, C, d_model) -> same."""
        if self.ttt_mlp is not None:
            x = residual(x, self.ttt_mlp(self.ttt_norm(x)), self.ttt_post_norm)
        return residual(x, self.mlp(self.mlp_norm(x)), self.mlp_post_norm)
