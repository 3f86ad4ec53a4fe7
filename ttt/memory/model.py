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
import torch.nn.functional as F
from torch import nn

from ttt.inner import detach_state, expand_rows, fresh_leaves, maybe_checkpoint
from ttt.models.transformer import Transformer, rope_cos_sin
from ttt.ttt_layers.config import TTTConfig

from .block import MemoryBlock
from .config import MemoryConfig


class NeuralMemoryTransformer(nn.Module):
    """A `Transformer` (its modules taken over) with a neural memory in each of its last ttt.suffix_len
    blocks. forward: tokens (B, N) int64 -> logits (B, N, vocab). token_losses: tokens (B, N) -> next-token
    losses (B, N - 1). Reads like `TTTTransformer` (same `read` / `token_losses` / `initial_fast_weights`
    interface), so `TTTLanguageLearner` trains and evaluates it."""

    def __init__(self, base: Transformer, ttt: TTTConfig, memory: MemoryConfig):
        super().__init__()
        if not isinstance(base, Transformer):
            raise TypeError(f"the neural memory needs a ttt.models.Transformer, got {type(base).__name__}")
        cfg = base.cfg
        if ttt.suffix_len > cfg.n_layers:
            raise ValueError(f"ttt.suffix_len ({ttt.suffix_len}) must be <= model.n_layers ({cfg.n_layers})")
        if ttt.extra_mlp:
            raise ValueError(
                "ttt.extra_mlp must be false with a neural memory: the memory blocks' fast weights are "
                "the memory's own (memory.*)"
            )
        self.cfg, self.ttt_cfg, self.memory_cfg = cfg, ttt, memory
        self.first_suffix = cfg.n_layers - ttt.suffix_len
        self.embed, self.norm, self.lm_head = base.embed, base.norm, base.lm_head
        self.layers = nn.ModuleList(
            [
                *base.layers[: self.first_suffix],
                *(MemoryBlock(b, cfg, memory) for b in base.layers[self.first_suffix :]),
            ]
        )

    @property
    def suffix(self) -> list[MemoryBlock]:
        """The memory blocks, read chunk by chunk."""
        return list(self.layers[self.first_suffix :])

    def initial_fast_weights(self) -> dict[str, torch.Tensor]:
        """The memories' meta-learned initial weights (live parameters), by full name
        layers.{i}.memory.init.w{j}."""
        return {
            f"layers.{i}.memory.init.{name}": weight
            for i, block in enumerate(self.suffix, start=self.first_suffix)
            for name, weight in block.memory.initial_weights().items()
        }

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: (..., d_model) -> logits (..., vocab_size)."""
        h = self.norm(hidden)
        return h @ self.embed.weight.t() if self.lm_head is None else self.lm_head(h)

    def _read_chunk(
        self, weights, states, hidden, targets, cos, sin, caches, write, lr_scale, create_graph, keep
    ):
        """Memory blocks and head on one chunk (B, C, d_model) of every sequence, with each block's memory
        weights and write state. Returns (logits (B, C, V) or None unless keep, per-token losses (B, T) of
        the first T = targets.shape[1] positions, caches, weights and states after the chunk's writes)."""
        x, out = hidden, ([], [], [])
        retain = torch.is_grad_enabled() and create_graph is not None
        for block, block_weights, state, cache in zip(self.suffix, weights, states, caches):
            x, cache, block_weights, state = block(
                x,
                cos,
                sin,
                cache,
                block_weights,
                state,
                write=write,
                lr_scale=lr_scale,
                create_graph=bool(create_graph),
                retain_graph=retain,
            )
            for bucket, item in zip(out, (cache, block_weights, state)):
                bucket.append(item)
        logits = self.head(x)
        scored = logits[:, : targets.shape[1]].flatten(0, 1)
        losses = F.cross_entropy(
            scored.to(torch.promote_types(scored.dtype, torch.float32)), targets.flatten(), reduction="none"
        )
        return (logits if keep else None), losses.view(targets.shape), *out

    def read(
        self,
        tokens: torch.Tensor,
        *,
        adapt: bool | None = None,
        first_order: bool | None = None,
        lr_scale: float = 1.0,
        outer_grad: bool = True,
        keep_logits: bool = False,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Read the sequences tokens (B, N) chunk by chunk, side by side, each writing its own memory.
        Returns (logits (B, N, V) or None unless keep_logits, next-token losses (B, N - 1)).

        adapt: write the memories (default ttt.enabled; false: every chunk reads the initial memory);
        first_order: default memory.first_order; lr_scale multiplies the memory learning rates (warm-up);
        outer_grad=False detaches every chunk (evaluation: memory stays flat).
        """
        batch, n = tokens.shape
        adapt = self.ttt_cfg.enabled if adapt is None else adapt
        first_order = self.memory_cfg.first_order if first_order is None else first_order
        if adapt and not torch.is_grad_enabled():
            raise RuntimeError(
                "the neural memory's writes need grad mode: wrap evaluation in torch.enable_grad()"
            )
        # create_graph: True (second order), False (first order), None (no outer graph at all)
        create_graph = (not first_order) if outer_grad else None
        cos, sin = rope_cos_sin(n, self.cfg.head_dim, self.cfg.rope_theta, tokens.device)
        with torch.set_grad_enabled(outer_grad and torch.is_grad_enabled()):
            hidden = self.embed(tokens)
            for block in self.layers[: self.first_suffix]:
                hidden = block(hidden, cos, sin)
        weights = [expand_rows(block.memory.initial_weights(), batch) for block in self.suffix]
        if not outer_grad:
            weights = [fresh_leaves(w) for w in weights]
        states = [block.memory.init_state(w) for block, w in zip(self.suffix, weights)]
        caches, all_logits, all_losses = [None] * len(self.suffix), [], []
        chunk = self.ttt_cfg.chunk_len
        use_checkpoint = self.memory_cfg.checkpoint and outer_grad and adapt
        for start in range(0, n, chunk):
            end = min(start + chunk, n)
            args = (
                weights,
                states,
                hidden[:, start:end],
                tokens[:, start + 1 : end + 1],
                cos[start:end],
                sin[start:end],
                caches,
                adapt and end < n,  # the last chunk's write would have no reader
                lr_scale,
                create_graph,
                keep_logits,
            )
            logits, losses, caches, weights, states = maybe_checkpoint(
                self._read_chunk, *args, enabled=use_checkpoint
            )
            if not outer_grad:
                logits, losses = (None if logits is None else logits.detach()), losses.detach()
                caches = [(k.detach(), v.detach()) for k, v in caches]
                weights, states = [fresh_leaves(w) for w in weights], detach_state(states)
            all_logits.append(logits)
            all_losses.append(losses)
        return (torch.cat(all_logits, dim=1) if keep_logits else None), torch.cat(all_losses, dim=1)

    def token_losses(self, tokens: torch.Tensor, **options) -> torch.Tensor:
        """Next-token losses of every position, tokens (B, N) int64 -> (B, N - 1) float32; options as in
        `read`. Its mean is the meta-training objective."""
        _check_tokens(tokens)
        return self.read(tokens, **options)[1]

    def forward(self, tokens: torch.Tensor, **options) -> torch.Tensor:
        """tokens (B, N) int64 -> logits (B, N, vocab_size), reading with memory writes (options as in
        `read`)."""
        _check_tokens(tokens)
        return self.read(tokens, keep_logits=True, **options)[0]


def _check_tokens(tokens: torch.Tensor) -> None:
    if tokens.dim() != 2 or tokens.dtype != torch.long or tokens.shape[1] < 1:
        raise ValueError(
            f"tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}"
        )
