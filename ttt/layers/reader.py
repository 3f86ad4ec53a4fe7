"""`ChunkedReader`: the one engine that reads sequences chunk by chunk while a per-sequence state adapts.

Reading the sequences tokens (B, N) side by side:

    positions = `_positions`(tokens): what each fed position gives the chunks (our transformer: its
        prefix blocks' output, run once over the whole sequence; a transformers model: the token ids);
        a read that returns no logits feeds all but the last position, which has no target (`fed_tokens`);
    carry = each sequence's initial state (`start_carry`: fast weights, optimizer / write state, ...);
    caches = `_initial_caches`: what a chunk hands the next (key/value caches, left-context tokens);
    for each chunk c of ttt.chunk_len positions (`read_chunks`, which also hands back the end state):
        logits, per-token losses, caches, carry = `_read_chunk`(carry, chunk c of positions, caches):
        the chunk is scored and carry adapts (TTT-E2E: `score_then_step`, inner steps after scoring;
        neural memory: writes inside the blocks), except the chunk that ends the sequence (`Chunk.last`),
        whose adaptation no later chunk would read;
    returns the chunks' logits (kept on request) and losses, concatenated along the sequence.

With options.outer_grad=False every chunk's outputs and carry are detached (`_detached`: the fast
weights made fresh leaves), so that evaluation memory stays flat; with options.checkpoint each chunk is
recomputed in the outer backward, and with ttt.checkpoint_segment = k also each run of k chunks (with
ttt.checkpoint_segment_keeps_chunks, only the runs: their chunks read plainly inside them).

Subclasses: `SuffixReader` (our `Transformer`: prefix once, suffix blocks chunk by chunk) under
`TTTTransformer` and `NeuralMemoryTransformer`, and `TransformersTTTReader` (a transformers model).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import register_pytree_node

from ttt.inner.recompute import TrainableParameters, recomputed

from .config import TTTConfig

Carry = Any
"""A subclass's per-sequence state between chunks (tensors each with a leading batch dim B)."""


@dataclass(frozen=True)
class ReadOptions:
    """How one read runs, resolved by a subclass's `read` from its arguments and configs."""

    adapt: bool
    """The carry adapts while reading (inner steps, memory writes); False: every chunk reads the initial
    state (the same model without test-time training)."""
    steps: int
    """Inner steps per chunk (fast-weight readers; 0 without adapting)."""
    create_graph: bool
    """Keep the graph of the adaptation (a second-order outer gradient); False: first order."""
    lr_scale: float
    """Factor on the inner learning rates (the warm-up)."""
    outer_grad: bool
    """Keep the outer graph; False detaches every chunk (evaluation: memory stays flat)."""
    keep_logits: bool
    """Return the logits (B, N, V); False: only the losses (the training path: no logits kept)."""
    checkpoint: bool
    """Recompute each chunk in the outer backward (only with outer_grad and grad mode)."""
    on_chunk: Callable[[int], None] | None = None
    """Called with each chunk's length once it is read (a progress bar); None: nothing is called."""


@dataclass
class Chunk:
    """Positions [start, end) of a read: inputs (B, C, ...) what they feed the reader, targets (B, T) the
    next tokens (T = C, or C - 1 when the chunk ends a sequence whose last position is fed too: `last`
    and `fed_tokens`), cos, sin (C, head_dim) RoPE
    tables of their absolute positions (None for readers that need none), mask (B, T) the targets whose
    losses count (None: all of them)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None
    mask: torch.Tensor | None
    last: bool

    def __len__(self) -> int:
        return self.inputs.shape[1]

    def part(self, start: int, end: int) -> Chunk:
        """Positions [start, end) of this chunk (relative to its first)."""

        def rows(table):
            return None if table is None else table[start:end]

        def columns(table):
            return None if table is None else table[:, start:end]

        return Chunk(self.inputs[:, start:end], self.targets[:, start:end], rows(self.cos), rows(self.sin),
                     columns(self.mask), self.last and end == len(self))  # fmt: skip


register_pytree_node(
    Chunk,
    lambda chunk: ([chunk.inputs, chunk.targets, chunk.cos, chunk.sin, chunk.mask], chunk.last),
    lambda children, last: Chunk(*children, last),
)
"""A pytree node: its tensors are what `recomputed` passes through a recomputed chunk."""


class ChunkedReader(nn.Module):
    """The chunk loop (module docstring) over a subclass's hooks: `_positions`, `_initial_caches`,
    `_initial_state`, `_read_chunk`, `_detached`, and `read_options` (`read`'s arguments resolved).
    token_losses: tokens (B, N) -> next-token losses (B, N - 1); forward: tokens -> logits (B, N, V)."""

    ttt_cfg: TTTConfig

    def _positions(self, tokens: torch.Tensor, options: ReadOptions) -> Chunk:
        """Hook: the whole read as one chunk: inputs (B, n, ...) of the positions `fed_tokens` feeds,
        targets (B, N - 1), RoPE tables (n, head_dim) or None, mask None, last=True."""
        raise NotImplementedError

    def _initial_caches(self, positions: int) -> list:
        """Hook: what the first chunk is handed (one entry per layer that carries something)."""
        raise NotImplementedError

    def _initial_state(self, batch: int, options: ReadOptions) -> Carry:
        """Hook: each of the batch sequences' state before the first chunk."""
        raise NotImplementedError

    def _read_chunk(
        self, carry: Carry, chunk: Chunk, caches: list, options: ReadOptions
    ) -> tuple[torch.Tensor | None, torch.Tensor, list, Carry]:
        """Hook: one chunk of every sequence. Returns (logits (B, C, V), or None unless
        options.keep_logits, per-token losses (B, T) against chunk.targets, the caches for the next
        chunk, carry after the chunk)."""
        raise NotImplementedError

    def _detached(self, carry: Carry) -> Carry:
        """Hook: carry cut from the graph, its fast weights fresh leaves that require grad."""
        raise NotImplementedError

    def _detach_caches(self, caches: list) -> list:
        """Hook: the caches cut from the graph (default: they hold no graph)."""
        return caches

    def _read(
        self, tokens: torch.Tensor, options: ReadOptions, loss_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The chunked reading of tokens (B, N) (module docstring); loss_mask (B, N - 1): the targets whose
        losses the inner steps count (None: all). Returns (logits (B, N, V), or None unless
        options.keep_logits, next-token losses (B, N - 1), every target's)."""
        check_tokens(tokens)
        whole = replace(self._positions(tokens, options), mask=check_loss_mask(loss_mask, tokens))
        carry, caches = self.start_carry(tokens.shape[0], options), self._initial_caches(len(whole))
        logits, losses, _, _ = self.read_chunks(carry, caches, whole, options)
        return logits, losses

    def start_carry(self, batch: int, options: ReadOptions) -> Carry:
        """Each of the batch sequences' state before the first chunk (`_initial_state`), cut from the
        graph without options.outer_grad."""
        carry = self._initial_state(batch, options)
        return carry if options.outer_grad else self._detached(carry)

    def read_chunks(
        self, carry: Carry, caches: list, positions: Chunk, options: ReadOptions
    ) -> tuple[torch.Tensor | None, torch.Tensor, list, Carry]:
        """The chunk loop over positions (inputs (B, n, ...), n >= 1: `_positions`, or a part of it) from
        carry and caches, in chunks of ttt.chunk_len from its first position, recomputed in segments with
        options.checkpoint. Returns (logits (B, n, V) or None unless options.keep_logits, losses (B, T)
        against positions.targets, and the end state: the caches and carry after its last chunk, which a
        later read of the positions that follow continues from (`ttt.layers.generation`); when positions
        end the sequence (positions.last), that chunk does not adapt, so carry is the one it read)."""
        recompute = options.checkpoint and options.outer_grad and torch.is_grad_enabled()
        options = replace(options, checkpoint=recompute)
        n = len(positions)
        span = (self.ttt_cfg.chunk_len * (self.ttt_cfg.checkpoint_segment or 0) if recompute else 0) or n
        params = TrainableParameters(self) if recompute else None  # found once for every region of the read
        keeps_chunks = self.ttt_cfg.checkpoint_segment_keeps_chunks  # a run's chunks read plainly inside it
        in_span = replace(options, checkpoint=False) if keeps_chunks else options
        all_logits, all_losses = [], []
        for start in range(0, n, span):
            part = positions.part(start, min(start + span, n))
            if span < n:
                logits, losses, caches, carry = recomputed(
                    self._read_span, carry, caches, part, in_span, params, module=params
                )
            else:
                logits, losses, caches, carry = self._read_span(carry, caches, part, options, params)
            all_logits.append(logits)
            all_losses.append(losses)
        logits = torch.cat(all_logits, dim=1) if options.keep_logits else None
        return logits, torch.cat(all_losses, dim=1), caches, carry

    def _read_span(
        self, carry: Carry, caches: list, span: Chunk, options: ReadOptions,
        params: TrainableParameters | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor, list, Carry]:  # fmt: skip
        """The chunks of a span of positions, from its carry and caches. Each chunk is `recomputed` in the
        outer backward with options.checkpoint (params: this reader's `TrainableParameters` then), and
        cut from the graph without options.outer_grad.
        Returns (logits (B, S, V) or None, losses (B, S or S - 1), caches, carry)."""
        chunk_len = self.ttt_cfg.chunk_len
        all_logits, all_losses = [], []
        for start in range(0, len(span), chunk_len):
            chunk = span.part(start, min(start + chunk_len, len(span)))
            if options.checkpoint:
                logits, losses, caches, carry = recomputed(
                    self._read_chunk, carry, chunk, caches, options, module=params
                )
            else:
                logits, losses, caches, carry = self._read_chunk(carry, chunk, caches, options)
            if not options.outer_grad:
                logits, losses = (None if logits is None else logits.detach()), losses.detach()
                caches, carry = self._detach_caches(caches), self._detached(carry)
            if options.on_chunk is not None:
                options.on_chunk(len(chunk))
            all_logits.append(logits)
            all_losses.append(losses)
        logits = torch.cat(all_logits, dim=1) if options.keep_logits else None
        return logits, torch.cat(all_losses, dim=1), caches, carry

    def read_options(
        self, *, adapt: bool | None, steps: int | None, first_order: bool | None, lr_scale: float,
        outer_grad: bool, keep_logits: bool,
    ) -> ReadOptions:  # fmt: skip
        """Hook: `read`'s arguments resolved against the subclass's configs (the defaults of None)."""
        raise NotImplementedError

    def read(
        self,
        tokens: torch.Tensor,
        *,
        adapt: bool | None = None,
        steps: int | None = None,
        first_order: bool | None = None,
        lr_scale: float = 1.0,
        outer_grad: bool = True,
        keep_logits: bool = False,
        loss_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Read the sequences tokens (B, N) chunk by chunk, each adapting its own state (fast weights,
        memory). Returns (logits (B, N, V) or None unless keep_logits, next-token losses (B, N - 1)).

        adapt: adapt while reading (default ttt.enabled; false: the same model without test-time
        training); steps: inner steps per chunk (fast-weight readers; default inner.steps); first_order:
        no graph of the adaptation (default the config's); lr_scale multiplies the inner learning rates
        (warm-up); outer_grad=False detaches every chunk (evaluation: memory stays flat); loss_mask
        (B, N - 1): the targets each chunk's inner loss counts (None: all)."""
        options = self.read_options(adapt=adapt, steps=steps, first_order=first_order, lr_scale=lr_scale,
                                    outer_grad=outer_grad, keep_logits=keep_logits)  # fmt: skip
        return self._read(tokens, options, loss_mask)

    def token_losses(self, tokens: torch.Tensor, **options) -> torch.Tensor:
        """Next-token losses of every position, tokens (B, N) int64 -> (B, N - 1) float32; options as
        in `read` (loss_mask among them). `objective.sequence_losses` makes the meta-training objective."""
        check_tokens(tokens)
        return self.read(tokens, **options)[1]

    def forward(self, tokens: torch.Tensor, **options) -> torch.Tensor:
        """tokens (B, N) int64 -> logits (B, N, vocab_size), reading while adapting (options as in
        `read`)."""
        check_tokens(tokens)
        return self.read(tokens, keep_logits=True, **options)[0]


def fed_tokens(tokens: torch.Tensor, options: ReadOptions) -> torch.Tensor:
    """The positions of tokens (B, N) that a read feeds its model: all N when it returns their logits
    (options.keep_logits) or N is 1; else the first N - 1, the last having no target to score: a causal
    reader's outputs at the others do not depend on it, so the losses and their derivatives are the same,
    and a read of k * chunk_len + 1 tokens (TTT-E2E's 8,193-token slices) is k whole chunks, the last of
    which takes no inner steps, not a chunk more of one position with nothing to score (whose
    adaptation was then computed, and differentiated, for nothing)."""
    return tokens if options.keep_logits or tokens.shape[1] == 1 else tokens[:, :-1]


def check_loss_mask(loss_mask: torch.Tensor | None, tokens: torch.Tensor) -> torch.Tensor | None:
    """loss_mask (B, N - 1) as a bool tensor on tokens' device (None stays None); ValueError naming its
    expected shape otherwise."""
    if loss_mask is None:
        return None
    want = (tokens.shape[0], tokens.shape[1] - 1)
    if tuple(loss_mask.shape) != want:
        raise ValueError(f"loss_mask must be (batch, seq - 1) = {want} for tokens {tuple(tokens.shape)}, "
                         f"got {tuple(loss_mask.shape)}")  # fmt: skip
    return loss_mask.to(device=tokens.device, dtype=torch.bool)


def check_tokens(tokens: torch.Tensor) -> None:
    """ValueError unless tokens is a (batch, seq) int64 tensor with seq >= 1."""
    if tokens.dim() != 2 or tokens.dtype != torch.long or tokens.shape[1] < 1:
        raise ValueError(
            f"tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}"
        )
