"""`ChunkedReader`: the one engine that reads sequences chunk by chunk while the last blocks adapt.

Reading the sequences tokens (B, N) side by side:

    prefix blocks (plain) run once over the whole sequence (sliding-window attention);
    carry = each sequence's initial state (`_initial_state`: fast weights, optimizer / write state, ...);
    for each chunk c of ttt.chunk_len tokens:
        logits, per-token losses, caches, carry = `_read_chunk`(carry, the chunk, caches, ...):
        the suffix blocks read the chunk with carry and each layer's key/value cache (the window - 1
        most recent positions, carried across chunks; from `SuffixBlock.initial_cache`, which gives a
        block with shares_prefix under full causal attention one `PrefixCache` for the whole read),
        the head scores its next tokens (`_score`),
        and carry adapts (TTT-E2E: `score_then_step`, inner steps after scoring; neural memory: writes
        inside the blocks);
    returns the chunks' logits (kept on request) and losses, concatenated along the sequence.

With outer_grad=False every chunk's outputs and carry are detached (`_detached`: the fast weights made
fresh leaves) so that evaluation memory stays flat. Subclasses: `ttt.ttt_layers.TTTTransformer`,
`ttt.memory.NeuralMemoryTransformer`; each has its own `read` (its options) on top of `_read`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ttt.inner import maybe_checkpoint
from ttt.inner.recompute import recomputed
from ttt.models.linear_cross_entropy import linear_cross_entropy
from ttt.models.transformer import Block, Transformer, next_token_losses, rope_cos_sin

from .block import detach_cache
from .config import TTTConfig

Carry = Any
"""A subclass's per-sequence state between chunks (tensors each with a leading batch dim B)."""


class ChunkedReader(nn.Module):
    """A `Transformer` (its modules taken over) whose last ttt.suffix_len blocks, built from the base's
    by suffix_block, read chunk by chunk. forward: tokens (B, N) int64 -> logits (B, N, vocab);
    token_losses: tokens (B, N) -> next-token losses (B, N - 1). A subclass gives `read` (calling
    `_read`), `_initial_state`, `_read_chunk` and `_detached`. needs: the start of the error message for
    a base that is not a `Transformer`."""

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

    @property
    def suffix(self) -> list[nn.Module]:
        """The blocks read chunk by chunk."""
        return list(self.layers[self.first_suffix :])

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: (..., d_model) -> logits (..., vocab_size)."""
        h = self.norm(hidden)
        return h @ self.embed.weight.t() if self.lm_head is None else self.lm_head(h)

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
        return None, linear_cross_entropy(self.norm(x[:, : targets.shape[1]]), weight, targets)

    def _initial_state(self, batch: int, *, lr_scale: float) -> Carry:
        """Hook: each of the batch sequences' state before the first chunk."""
        raise NotImplementedError

    def _read_chunk(
        self, carry: Carry, hidden, targets, cos, sin, caches, last: bool, keep_logits: bool, *options
    ) -> tuple[torch.Tensor | None, torch.Tensor, list, Carry]:
        """Hook: the suffix on one chunk hidden (B, C, d_model) of every sequence, its RoPE tables cos, sin
        (C, head_dim), next tokens targets (B, T) (T = C, or C - 1 on the last chunk), the layers' caches;
        last: it is the last chunk; keep_logits: return the logits; options: those `read` passed to
        `_read`. Returns (logits (B, C, V) or None unless keep_logits, per-token losses (B, T)
        (`_score`), caches for the next chunk, carry after the chunk)."""
        raise NotImplementedError

    def _detached(self, carry: Carry) -> Carry:
        """Hook: carry cut from the graph, its fast weights fresh leaves that require grad."""
        raise NotImplementedError

    def _read(
        self,
        tokens: torch.Tensor,
        options: tuple,
        *,
        lr_scale: float,
        outer_grad: bool,
        keep_logits: bool,
        checkpoint: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The chunked reading of tokens (B, N) (module docstring). Returns (logits (B, N, V) or None
        unless keep_logits, next-token losses (B, N - 1)). options go to every `_read_chunk`; lr_scale to
        `_initial_state`; checkpoint: recompute each chunk in the outer backward (with outer_grad only:
        `recomputed`, which hands the fused loss's recorded outputs back instead of running it again),
        and with ttt.checkpoint_segment = k also each run of k chunks (only every k-th carry kept);
        outer_grad=False detaches every chunk (evaluation: memory stays flat). ttt.checkpoint_prefix
        recomputes each prefix block in the outer backward (only its input is saved)."""
        batch, n = tokens.shape
        cos, sin = rope_cos_sin(
            n, self.cfg.head_dim, self.cfg.rope_theta, tokens.device, self.cfg.rope_scaling
        )
        grad = outer_grad and torch.is_grad_enabled()
        with torch.set_grad_enabled(grad):
            hidden = self.embed(tokens)
            for block in self.layers[: self.first_suffix]:
                hidden = maybe_checkpoint(
                    block, hidden, cos, sin, enabled=grad and self.ttt_cfg.checkpoint_prefix
                )
        carry = self._initial_state(batch, lr_scale=lr_scale)
        if not outer_grad:
            carry = self._detached(carry)
        caches = [block.initial_cache(n) for block in self.suffix]
        recompute = checkpoint and outer_grad and torch.is_grad_enabled()
        span = (self.ttt_cfg.chunk_len * (self.ttt_cfg.checkpoint_segment or 0) if recompute else 0) or n
        all_logits, all_losses = [], []
        for start in range(0, n, span):
            end = min(start + span, n)
            args = (carry, caches, hidden[:, start:end], tokens[:, start + 1 : end + 1], cos[start:end],
                    sin[start:end], end == n, keep_logits, options, outer_grad, recompute)  # fmt: skip
            if span < n:
                logits, losses, caches, carry = recomputed(self._read_span, *args, params=self._trainable())
            else:
                logits, losses, caches, carry = self._read_span(*args)
            all_logits.append(logits)
            all_losses.append(losses)
        return (torch.cat(all_logits, dim=1) if keep_logits else None), torch.cat(all_losses, dim=1)

    def _trainable(self) -> list[torch.Tensor]:
        """The parameters that need gradients (those a recomputed chunk hands gradients back to)."""
        return [p for p in self.parameters() if p.requires_grad]

    def _read_span(
        self, carry, caches, hidden, targets, cos, sin, ends_sequence: bool, keep_logits: bool,
        options: tuple, outer_grad: bool, recompute: bool,
    ) -> tuple[torch.Tensor | None, torch.Tensor, list, Carry]:  # fmt: skip
        """The chunks of a span of positions: hidden (B, S, d_model) its prefix output, targets (B, S) the
        next tokens (B, S - 1 when the span ends the sequence: ends_sequence), cos, sin (S, head_dim),
        the caches and carry at its start. Each chunk is `recomputed` in the outer backward with
        recompute, and cut from the graph without outer_grad. Returns (logits (B, S, V) or None unless
        keep_logits, losses (B, S or S - 1), caches, carry)."""
        length, chunk = hidden.shape[1], self.ttt_cfg.chunk_len
        params = self._trainable() if recompute else []
        all_logits, all_losses = [], []
        for start in range(0, length, chunk):
            end = min(start + chunk, length)
            args = (carry, hidden[:, start:end], targets[:, start:end], cos[start:end], sin[start:end],
                    caches, ends_sequence and end == length, keep_logits, *options)  # fmt: skip
            if params:
                logits, losses, caches, carry = recomputed(self._read_chunk, *args, params=params)
            else:
                logits, losses, caches, carry = self._read_chunk(*args)
            if not outer_grad:
                logits, losses = (None if logits is None else logits.detach()), losses.detach()
                caches = [detach_cache(cache) for cache in caches]
                carry = self._detached(carry)
            all_logits.append(logits)
            all_losses.append(losses)
        logits = torch.cat(all_logits, dim=1) if keep_logits else None
        return logits, torch.cat(all_losses, dim=1), caches, carry

    def token_losses(self, tokens: torch.Tensor, **options) -> torch.Tensor:
        """Next-token losses of every position, tokens (B, N) int64 -> (B, N - 1) float32; options as
        in `read`. Its mean is the meta-training objective."""
        check_tokens(tokens)
        return self.read(tokens, **options)[1]

    def forward(self, tokens: torch.Tensor, **options) -> torch.Tensor:
        """tokens (B, N) int64 -> logits (B, N, vocab_size), reading while adapting (options as in
        `read`)."""
        check_tokens(tokens)
        return self.read(tokens, keep_logits=True, **options)[0]


def check_tokens(tokens: torch.Tensor) -> None:
    """ValueError unless tokens is a (batch, seq) int64 tensor with seq >= 1."""
    if tokens.dim() != 2 or tokens.dtype != torch.long or tokens.shape[1] < 1:
        raise ValueError(
            f"tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}"
        )
