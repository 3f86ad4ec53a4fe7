"""`TTTTransformer`: a `Transformer` whose last blocks learn while they read (end-to-end TTT).

Reading one sequence (TTT-E2E, arXiv 2512.23675):

    prefix blocks (no fast weights) run once over the whole sequence (sliding-window attention);
    for each chunk c of ttt.chunk_len tokens:
        suffix blocks read the chunk with the fast weights W_c and each layer's key/value cache
        (the window - 1 most recent positions, carried across chunks); next-token losses L_c;
        W_{c+1} = W_c after inner.steps optimizer steps on mean(L_c)            (apply, then update)
    outer (meta) loss = mean over all positions of L_c: each chunk is scored before its own update.

The outer gradient differentiates through every update (second order unless inner.first_order),
hence through the suffix attention: that is backward-over-backward of attention (FlashBoB).
Each sequence of a batch gets its own fast weights: the rows are read side by side, the fast weights
carrying a leading batch dim (B, ...), and each row's inner loss, gradient and clipping are its own.

Parameter names are those of `Transformer`, plus layers.{i}.ttt_norm.weight and
layers.{i}.ttt_mlp.{w_gate,w_up,w_down}.weight in the suffix blocks with ttt.extra_mlp, and the
learnable inner learning rates inner.lrs.{j} (inner.learnable_lr).
"""

from __future__ import annotations

import torch
from torch import nn

from ttt.inner import InnerLoop, InnerLoopConfig, select_by_glob
from ttt.inner.functional import shared_parameters, substituted
from ttt.models.transformer import Transformer

from .config import TTTConfig
from .fast_weights import FastCarry, adapt_chunk, detached_carry, initial_carry, read_options
from .reader import Chunk, ReadOptions, check_loss_mask, check_tokens
from .suffix_block import SuffixBlock
from .suffix_reader import SuffixReader


class TTTTransformer(SuffixReader):
    """A `Transformer` (its modules taken over) with fast weights in its last ttt.suffix_len blocks.

    forward: tokens (B, N) int64 -> logits (B, N, vocab). token_losses: tokens (B, N) -> next-token
    losses (B, N - 1), the training objective. The fast weights are the suffix blocks' parameters that
    inner.params (glob patterns over full names) select: layers.*.mlp.* means the suffix blocks' MLPs.
    The chunked reading is `SuffixReader`'s (`ttt.layers`): each chunk is scored, then takes the inner
    steps (`score_then_step`).
    """

    def __init__(self, base: Transformer, ttt: TTTConfig, inner: InnerLoopConfig):
        def suffix_block(block):
            hidden = (ttt.extra_mlp_hidden or self.cfg.d_ff) if ttt.extra_mlp else None
            return SuffixBlock(block, self.cfg, hidden, extra_init=ttt.extra_mlp_init)

        needs = "test-time training needs a ttt.models.Transformer (Llama-style)"
        super().__init__(base, ttt, suffix_block, needs=needs)
        self.inner_cfg = inner
        fast = self._select_fast_weights(inner.params)
        shared = shared_parameters(self, list(fast))
        if shared:
            raise ValueError(f"inner.params selects weights that other parameters share (tied): {shared}")
        self.block_params = [
            [(full, full.split(".", 2)[2]) for full in fast if int(full.split(".")[1]) == i]
            for i in range(self.first_suffix, self.cfg.n_layers)
        ]
        self.inner = InnerLoop(fast, inner)

    def _select_fast_weights(self, patterns: list[str]) -> dict[str, nn.Parameter]:
        """The suffix blocks' parameters whose full names match a glob pattern (fnmatch)."""
        candidates = {
            f"layers.{i}.{name}": param
            for i in range(self.first_suffix, self.cfg.n_layers)
            for name, param in self.layers[i].named_parameters()
        }
        what = (
            f"parameter of the suffix blocks (layers {self.first_suffix}..{self.cfg.n_layers - 1}, "
            f"ttt.suffix_len={self.ttt_cfg.suffix_len})"
        )
        return select_by_glob(candidates, patterns, what=what)

    def initial_fast_weights(self) -> dict[str, torch.Tensor]:
        """The fast weights' meta-learned initial values (live parameters), by full name."""
        return {full: self.get_parameter(full) for names in self.block_params for full, _ in names}

    def _initial_state(self, batch: int, options: ReadOptions) -> FastCarry:
        """Each sequence's fast weights (B, ...) from their initial values, the inner optimizer's state and
        the warm-up-scaled inner learning rates."""
        return initial_carry(self.inner, self.initial_fast_weights(), options, batch)

    def _detached(self, carry: FastCarry) -> FastCarry:
        return detached_carry(carry)

    def _read(
        self, tokens: torch.Tensor, options: ReadOptions, loss_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Adapting: the chunked reading (`ChunkedReader._read`). Without adapting every chunk would read
        the initial fast weights, the suffix blocks' own parameters: the suffix blocks then read the whole
        sequences at once as the prefix blocks do (`blocks_over_sequence`: no chunk loop or key/value
        cache; recomputed in the outer backward with inner.checkpoint or ttt.checkpoint_prefix), and the
        head scores them chunk by chunk (the logits of one chunk at a time without ttt.fused_loss). Same
        losses, logits and gradients. tokens (B, N) -> (logits (B, N, V) or None unless
        options.keep_logits, next-token losses (B, N - 1))."""
        if options.adapt:
            return super()._read(tokens, options, loss_mask)
        check_tokens(tokens)
        check_loss_mask(loss_mask, tokens)
        whole = self._positions(tokens, options)
        with torch.set_grad_enabled(options.outer_grad and torch.is_grad_enabled()):
            recompute = options.checkpoint or self.ttt_cfg.checkpoint_prefix
            x = self.blocks_over_sequence(
                self.suffix, whole.inputs, whole.cos, whole.sin, recompute=recompute
            )
            size, keep = self.ttt_cfg.chunk_len, options.keep_logits
            scored = [
                self._score(x[:, start : start + size], whole.targets[:, start : start + size], keep)
                for start in range(0, x.shape[1], size)
            ]
        if options.on_chunk is not None:
            options.on_chunk(x.shape[1])
        logits = torch.cat([logits for logits, _ in scored], dim=1) if options.keep_logits else None
        return logits, torch.cat([losses for _, losses in scored], dim=1)

    def read_suffix(
        self, fast: dict[str, torch.Tensor], chunk: Chunk, caches: list
    ) -> tuple[torch.Tensor, list]:
        """The suffix blocks on one chunk of every sequence (chunk.inputs (B, C, d_model), the prefix's
        output; chunk.cos, chunk.sin their RoPE tables) with the fast weights `fast` (by full name, each
        (B, ...)) and each block's cache. Returns (their output (B, C, d_model), before the final norm;
        the caches for the next chunk)."""
        x, new_caches = chunk.inputs, []
        for block, names, cache in zip(self.suffix, self.block_params, caches):
            with substituted(block, {inside: fast[full] for full, inside in names}):
                x, cache = block(x, chunk.cos, chunk.sin, cache)
            new_caches.append(cache)
        return x, new_caches

    def _suffix_chunk(self, fast, chunk: Chunk, caches, keep_logits):
        """Suffix blocks and head on one chunk (`read_suffix`): (logits (B, C, V) or None unless
        keep_logits, per-token losses (B, T) against chunk.targets, caches for the next chunk)."""
        x, new_caches = self.read_suffix(fast, chunk, caches)
        return *self._score(x, chunk.targets, keep_logits), new_caches

    def _read_chunk(self, carry: FastCarry, chunk: Chunk, caches: list, options: ReadOptions):
        """Score one chunk with the fast weights of carry, then take options.steps inner steps on each
        sequence's mean loss over it (`adapt_chunk`). Returns (logits or None unless
        options.keep_logits, per-token losses (B, T), caches, carry after the steps)."""

        def score(fast, first):
            keep = options.keep_logits and first
            logits, losses, new_caches = self._suffix_chunk(fast, chunk, caches, keep)
            return (logits, new_caches), losses

        (logits, new_caches), scored, carry = adapt_chunk(
            score, self.inner, carry, options, per_row=True, mask=chunk.mask, ends_sequence=chunk.last
        )
        return logits, scored, new_caches, carry

    def read_options(self, **arguments) -> ReadOptions:
        """`read`'s arguments against ttt and inner (`fast_weights.read_options`)."""
        return read_options(self.ttt_cfg, self.inner_cfg, **arguments)
