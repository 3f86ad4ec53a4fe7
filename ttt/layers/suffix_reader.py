"""`SuffixReader`: a `Transformer` whose last ttt.suffix_len blocks (the suffix) are read chunk by chunk
by the `ChunkedReader` engine, the blocks before them (the prefix) once over the whole sequence.

    prefix blocks (plain) run once over the whole sequence (sliding-window attention, absolute positions);
    for each chunk: the suffix blocks read it with the carry and each layer's key/value cache (the
        window - 1 most recent positions, carried across chunks; from `SuffixBlock.initial_cache`, which
        gives a block one `PrefixCache` for the whole read when its window covers the read), and the
        head scores its next tokens (`_score`).

ttt.checkpoint_prefix recomputes each prefix block in the outer backward (only its input is saved);
ttt.compile_prefix runs the prefix blocks through torch.compile on CUDA (`run_block_over_sequence`).
Subclasses: `TTTTransformer` (fast-weight MLPs), `NeuralMemoryTransformer` (memory blocks).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from ttt.inner import maybe_checkpoint
from ttt.models.linear_cross_entropy import linear_cross_entropy
from ttt.models.transformer import Block, Transformer, next_token_losses, rope_cos_sin

from .config import TTTConfig
from .reader import Chunk, ChunkedReader, ReadOptions, fed_tokens
from .suffix_block import SuffixBlock, detach_cache


def _run_block(block: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    if isinstance(block, SuffixBlock):
        return block.read_whole(hidden, cos, sin)
    return block(hidden, cos, sin)


_compiled_run_block = torch.compile(_run_block)


def run_block_over_sequence(
    block: nn.Module, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, compiled: bool
) -> torch.Tensor:
    """A block (a prefix `Block`, or a `SuffixBlock` read without a cache: `SuffixBlock.read_whole`) over
    whole sequences: hidden (B, N, d_model), cos, sin (N, head_dim) -> (B, N, d_model); compiled: through
    torch.compile, one graph for every block of one structure (the parameters are the graph's inputs,
    not constants), differentiable once: a second derivative through it raises torch's error."""
    return (_compiled_run_block if compiled else _run_block)(block, hidden, cos, sin)


class SuffixReader(ChunkedReader):
    """A `Transformer` (its modules taken over) whose last ttt.suffix_len blocks, built from the base's by
    suffix_block, read chunk by chunk (module docstring). needs: the start of the error message for a base
    that is not a `Transformer`. Subclasses give `read`, `_initial_state`, `_read_chunk`, `_detached`."""

    def __init__(
        self, base: Transformer, ttt: TTTConfig, suffix_block: Callable[[Block], nn.Module], *, needs: str
    ):
        super().__init__()
        if not isinstance(base, Transformer):
            raise TypeError(f"{needs}, got {type(base).__name__}")
        cfg = base.cfg
        if ttt.suffix_len > cfg.n_layers:
            raise ValueError(f"ttt.suffix_len ({ttt.suffix_len}) must be <= model.n_layers ({cfg.n_layers})")
        self.cfg, self.ttt_cfg = cfg, ttt
        self.first_suffix = cfg.n_layers - ttt.suffix_len
        self.embed, self.norm, self.lm_head = base.embed, base.norm, base.lm_head
        self.layers = nn.ModuleList(
            [*base.layers[: self.first_suffix], *map(suffix_block, base.layers[self.first_suffix :])]
        )
        if ttt.prefix_attention is not None:
            for block in self.layers[: self.first_suffix]:
                block.attn.backend = ttt.prefix_attention

    @property
    def suffix(self) -> list[nn.Module]:
        """The blocks read chunk by chunk."""
        return list(self.layers[self.first_suffix :])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: (..., d_model) -> logits (..., vocab_size)."""
        h = self.norm(hidden)
        return h @ self.embed.weight.t() if self.lm_head is None else self.lm_head(h)

    def rope_tables(
        self, end: int, device: torch.device, *, start: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (end - start, head_dim) of the absolute positions start..end-1, in float32 (float64
        for a float64 model)."""
        cfg, dtype = self.cfg, torch.promote_types(self.embed.weight.dtype, torch.float32)
        return rope_cos_sin(
            end, cfg.head_dim, cfg.rope_theta, device, cfg.rope_scaling, dtype=dtype, start=start
        )

    def _score(
        self, x: torch.Tensor, targets: torch.Tensor, keep_logits: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The suffix's output on a chunk x (B, C, d_model) -> (logits (B, C, V), or None unless
        keep_logits, next-token losses (B, T) of its first T = targets.shape[1] positions against
        targets (B, T), in at least float32). Without keep_logits and with ttt.fused_loss the head and
        the loss are one `linear_cross_entropy` (no (B, C, V) logits kept, same values and derivatives)."""
        if keep_logits or not self.ttt_cfg.fused_loss:
            logits = self.head(x)
            return (logits if keep_logits else None), next_token_losses(logits, targets)
        weight = self.embed.weight if self.lm_head is None else self.lm_head.weight
        hidden, keep = self.norm(x[:, : targets.shape[1]]), self.ttt_cfg.fused_loss_keeps_logits
        return None, linear_cross_entropy(hidden, weight, targets, keep_logits=keep)

    def _positions(self, tokens: torch.Tensor, options: ReadOptions) -> Chunk:
        """The prefix blocks' output (B, n, d_model) of the positions `fed_tokens` feeds and their RoPE
        tables (n, head_dim), as one chunk (targets: tokens[:, 1:]); the prefix keeps its graph only for
        an outer gradient."""
        fed = fed_tokens(tokens, options)
        cos, sin = self.rope_tables(fed.shape[1], tokens.device)
        grad = options.outer_grad and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):
            hidden = self.embed(fed)
            hidden = self.blocks_over_sequence(
                self.layers[: self.first_suffix], hidden, cos, sin, recompute=self.ttt_cfg.checkpoint_prefix
            )
        return Chunk(hidden, tokens[:, 1:], cos, sin, mask=None, last=True)

    def blocks_over_sequence(
        self, blocks: list[nn.Module], hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
        recompute: bool,
    ) -> torch.Tensor:  # fmt: skip
        """blocks one after another over whole sequences hidden (B, N, d_model) (`run_block_over_sequence`;
        cos, sin (N, head_dim)): compiled with ttt.compile_prefix on CUDA, and with recompute, under grad
        mode, each recomputed in the outer backward (only its input saved). Returns (B, N, d_model)."""
        run = partial(run_block_over_sequence, compiled=self.ttt_cfg.compile_prefix and hidden.is_cuda)
        recompute = recompute and torch.is_grad_enabled()
        for block in blocks:
            hidden = maybe_checkpoint(run, block, hidden, cos, sin, enabled=recompute)
        return hidden

    def _initial_caches(self, positions: int) -> list:
        """Each suffix block's cache before the first chunk of a read of `positions` positions."""
        return [block.initial_cache(positions, self.ttt_cfg.chunk_len) for block in self.suffix]

    def _detach_caches(self, caches: list) -> list:
        """The key/value caches cut from the graph."""
        return [detach_cache(cache) for cache in caches]
