"""`NeuralMemoryTransformer`: a sliding-window `Transformer` whose last blocks carry a neural memory
written by gradient steps while they read (Titans-style), meta-trained end to end.

Reading one sequence:

    prefix blocks (no memory) run once over the whole sequence (sliding-window attention);
    for each chunk c of ttt.chunk_len tokens, through each memory block (`MemoryBlock`):
        read the memory M_{c-1} for the chunk's tokens, attend (window cache carried across chunks),
        then write: M_c = one gated-momentum step of M_{c-1} on the chunk's associative loss;
    head: next-token losses of every position; the outer (meta) loss is their mean.

The outer gradient differentiates through every write (second order unless memory.first_order): the
projections, gates, the memory's initial weights and the rest of the model are meta-learned. Each
sequence of a batch has its own memory: the weights carry a leading batch dim (B, ...). The last chunk
is not written (nothing reads it after).

Parameter names are those of `Transformer`, plus layers.{i}.memory.{wq,wk,wv,wr}.weight,
layers.{i}.memory.gates.{weight,bias} and the memory's initial weights layers.{i}.memory.init.w{j}
in the memory blocks.
"""

from __future__ import annotations

import torch

from ttt.inner import detach_state, expand_rows, fresh_leaves
from ttt.models.transformer import Transformer

from ..config import TTTConfig
from ..reader import Chunk, ReadOptions
from ..suffix_reader import SuffixReader
from .block import MemoryBlock
from .config import MemoryConfig


class NeuralMemoryTransformer(SuffixReader):
    """A `Transformer` (its modules taken over) with a neural memory in each of its last ttt.suffix_len
    blocks. forward: tokens (B, N) int64 -> logits (B, N, vocab). token_losses: tokens (B, N) -> next-token
    losses (B, N - 1). Reads like `TTTTransformer` (same `read` / `token_losses` / `initial_fast_weights`
    interface, one engine: `ChunkedReader`, through `SuffixReader`), so `TTTLanguageLearner` trains and
    evaluates it."""

    def __init__(self, base: Transformer, ttt: TTTConfig, memory: MemoryConfig):
        def suffix_block(block):
            return MemoryBlock(block, self.cfg, memory)

        super().__init__(base, ttt, suffix_block, needs="the neural memory needs a ttt.models.Transformer")
        if ttt.extra_mlp:
            raise ValueError(
                "ttt.extra_mlp must be false with a neural memory: the memory blocks' fast weights are "
                "the memory's own (memory.*)"
            )
        pairs = memory.keys_per_write(ttt.chunk_len)
        if pairs < 1 or (memory.center_keys and pairs < 2):
            raise ValueError(
                f"ttt.chunk_len {ttt.chunk_len} leaves {pairs} key(s) per write: memory.next_token_values "
                "needs ttt.chunk_len >= 2, and memory.center_keys two keys (one key minus the mean is none)"
            )
        self.memory_cfg = memory

    def initial_fast_weights(self) -> dict[str, torch.Tensor]:
        """The memories' meta-learned initial weights (live parameters), by full name
        layers.{i}.memory.init.w{j}."""
        return {
            f"layers.{i}.memory.init.{name}": weight
            for i, block in enumerate(self.suffix, start=self.first_suffix)
            for name, weight in block.memory.initial_weights().items()
        }

    def _initial_state(self, batch: int, options: ReadOptions) -> tuple[list[dict], list[dict]]:
        """(each memory block's weights (B, ...) from their initial values, its write state); options.lr_scale
        applies to the writes (`_read_chunk`)."""
        weights = [expand_rows(block.memory.initial_weights(), batch) for block in self.suffix]
        return weights, [block.memory.init_state(w) for block, w in zip(self.suffix, weights)]

    def _detached(self, carry: tuple[list[dict], list[dict]]) -> tuple[list[dict], list[dict]]:
        """carry with the memory weights fresh leaves (still expanded), the write states detached."""
        weights, states = carry
        return [fresh_leaves(w) for w in weights], [detach_state(s) for s in states]

    def _read_chunk(self, carry, chunk: Chunk, caches: list, options: ReadOptions):
        """Memory blocks and head on one chunk of every sequence (inputs (B, C, d_model)), with each
        block's memory weights and write state (carry). Each block writes unless options.adapt is false or
        this is the last chunk (the write would have no reader). Returns (logits (B, C, V) or None unless
        options.keep_logits, per-token losses (B, T) against chunk.targets, caches, carry after the
        chunk's writes)."""
        x, out = chunk.inputs, ([], [], [])
        retain = torch.is_grad_enabled() and options.outer_grad
        for block, block_weights, state, cache in zip(self.suffix, *carry, caches):
            x, cache, block_weights, state = block(
                x,
                chunk.cos,
                chunk.sin,
                cache,
                block_weights,
                state,
                write=options.adapt and not chunk.last,
                lr_scale=options.lr_scale,
                create_graph=options.create_graph,
                retain_graph=retain,
            )
            for bucket, item in zip(out, (cache, block_weights, state)):
                bucket.append(item)
        new_caches, weights, states = out
        return *self._score(x, chunk.targets, options.keep_logits), new_caches, (weights, states)

    def read_options(
        self, *, adapt: bool | None, steps: int | None, first_order: bool | None, lr_scale: float,
        outer_grad: bool, keep_logits: bool,
    ) -> ReadOptions:  # fmt: skip
        """`read`'s arguments against ttt and memory: adapt writes the memories (one write per chunk, so
        no steps); first_order defaults to memory.first_order; lr_scale scales the writes' learning
        rates. loss_mask is accepted for the learners' one interface: the writes' associative loss does
        not read targets."""
        if steps is not None:
            raise ValueError(f"the neural memory writes once per chunk: steps must be None, got {steps}")
        adapt = self.ttt_cfg.enabled if adapt is None else adapt
        first_order = self.memory_cfg.first_order if first_order is None else first_order
        if adapt and not torch.is_grad_enabled():
            raise RuntimeError(
                "the neural memory's writes need grad mode: wrap evaluation in torch.enable_grad()"
            )
        return ReadOptions(adapt=adapt, steps=int(adapt), create_graph=outer_grad and not first_order,
                           lr_scale=lr_scale, outer_grad=outer_grad, keep_logits=keep_logits,
                           checkpoint=self.memory_cfg.checkpoint and adapt)  # fmt: skip
