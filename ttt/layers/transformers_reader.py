"""`TransformersTTTReader`: end-to-end test-time training (TTT-E2E) of any transformers causal LM.

Reading one sequence, with fast weights W chosen among the model's own parameters by inner.params
(globs over transformers' names, e.g. model.layers.11.mlp.*):

    for each chunk c of ttt.chunk_len tokens:
        the whole model reads the chunk with W_c, fed its left context (the n_layers * (window - 1)
        tokens before the chunk, its receptive field, for a model whose every layer has a sliding
        window; all earlier tokens otherwise),
        and scores the chunk's next tokens: losses L_c;
        W_{c+1} = W_c after inner.steps steps on mean(L_c)                     (apply, then update)
    outer (meta) loss = mean over all positions of L_c, each chunk scored before its own update.

The outer gradient runs through every update, so through the model's attention: second order
through `attn_implementation="bob"` (flashbob.flash_attention). Unlike `TTTTransformer`, the left
context is re-read with the current fast weights (no key/value cache carried from chunk to chunk:
transformers' layers are called as they are, through `torch.func.functional_call`; what the engine
carries from chunk to chunk is the left context's token ids), which costs
(left context + chunk) / chunk forward passes per token, and the sequences of a batch are read one
after another, each with its own fast weights. The converted-model path (`TTTTransformer`, recipe
ttt_pretrained with model.checkpoint) reads each token once and is the faster one where it applies
(Llama-style checkpoints).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.func import functional_call

from ttt.inner import InnerLoop, InnerLoopConfig, select_by_glob
from ttt.models.hf_causal_lm import HFCausalLM
from ttt.models.transformer import next_token_losses

from .config import TTTConfig
from .fast_weights import FastCarry, adapt_chunk, detached_carry, initial_carry, read_options
from .reader import Chunk, ChunkedReader, ReadOptions, check_tokens, fed_tokens


class TransformersTTTReader(ChunkedReader):
    """An `HFCausalLM` read chunk by chunk by the `ChunkedReader` engine while its fast weights adapt
    (module docstring). The cache a chunk hands the next is its left context: the token ids (1, L) the
    next chunk is fed before its own.

    read: tokens (B, N) int64 -> (logits (B, N, V) or None, next-token losses (B, N - 1));
    token_losses: tokens (B, N) -> losses (B, N - 1), the training objective. Parameter names are
    lm.<transformers name> plus inner.lrs.{j} (inner.learnable_lr).
    """

    def __init__(self, lm: HFCausalLM, ttt: TTTConfig, inner: InnerLoopConfig):
        super().__init__()
        if not isinstance(lm, HFCausalLM):
            raise TypeError(f"TransformersTTTReader reads an HFCausalLM, got {type(lm).__name__}")
        if ttt.extra_mlp:
            raise ValueError(
                "ttt.extra_mlp=true needs the converted model (model.checkpoint); a transformers model "
                "adapts its own parameters: set ttt.extra_mlp=false and inner.params to its names, "
                "e.g. [model.layers.11.mlp.*]"
            )
        self.lm, self.ttt_cfg, self.inner_cfg = lm, ttt, inner
        self.cfg = lm.cfg
        what = "parameter of the transformers model"
        fast = select_by_glob(dict(lm.named_parameters()), inner.params, what=what)
        self.fast_names = list(fast)
        self.inner = InnerLoop(fast, inner)

    def initial_fast_weights(self) -> dict[str, nn.Parameter]:
        """The fast weights' meta-learned initial values (live parameters), by transformers name."""
        return {name: self.lm.get_parameter(name) for name in self.fast_names}

    def left_context(self, start: int) -> int:
        """Tokens fed before a chunk starting at `start`: the receptive field n_layers * (window - 1) of
        a model whose every layer has a sliding window (so a chunk's logits are the whole sequence's),
        all earlier tokens otherwise."""
        if self.cfg.window is None:
            return start
        return min(start, self.cfg.n_layers * (self.cfg.window - 1))

    def _positions(self, tokens: torch.Tensor, options: ReadOptions) -> Chunk:
        """The ids of the positions `fed_tokens` feeds as the chunks' inputs (the model reads ids; it makes
        its own positions)."""
        return Chunk(fed_tokens(tokens, options), tokens[:, 1:], None, None, mask=None, last=True)

    def _initial_caches(self, positions: int) -> list:
        """No left context before the first chunk."""
        return [None]

    def _initial_state(self, batch: int, options: ReadOptions) -> FastCarry:
        """The fast weights as they are (one sequence: batch is 1), optimizer state and lrs."""
        return initial_carry(self.inner, self.initial_fast_weights(), options, batch=None)

    def _detached(self, carry: FastCarry) -> FastCarry:
        return detached_carry(carry)

    def _read_chunk(self, carry: FastCarry, chunk: Chunk, caches: list, options: ReadOptions):
        """The model on the chunk's ids (1, C) after its left context caches[0] (1, L), with the fast
        weights of carry; its logits (1, C, V) scored against chunk.targets, then the inner steps
        (`adapt_chunk`). Returns (logits or None unless options.keep_logits, losses (1, T), [the next
        chunk's left context], carry after the steps). Without an outer gradient or inner steps no
        graph is built."""
        left = caches[0]
        fed = chunk.inputs if left is None else torch.cat([left, chunk.inputs], dim=1)
        skip = fed.shape[1] - len(chunk)

        def score(fast, first):
            logits = functional_call(self.lm, fast, (fed,), strict=False)[:, skip:]
            return logits, next_token_losses(logits, chunk.targets)

        with torch.set_grad_enabled(torch.is_grad_enabled() and (options.outer_grad or options.steps > 0)):
            logits, scored, carry = adapt_chunk(
                score, self.inner, carry, options, per_row=False, mask=chunk.mask, ends_sequence=chunk.last
            )
        context = fed[:, fed.shape[1] - self.left_context(fed.shape[1]) :]  # the next chunk's left context
        return (logits if options.keep_logits else None), scored, [context], carry

    def read_options(self, **arguments) -> ReadOptions:
        """`read`'s arguments against ttt and inner (`fast_weights.read_options`); chunks are not recomputed
        (inner.checkpoint is ignored)."""
        return replace(read_options(self.ttt_cfg, self.inner_cfg, **arguments), checkpoint=False)

    def _read(
        self, tokens: torch.Tensor, options: ReadOptions, loss_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The sequences of tokens (B, N) read one after another (the model adapts its own parameters:
        unbatched fast weights), each by the engine's chunk loop."""
        check_tokens(tokens)
        read_row = super()._read
        rows = [
            read_row(row[None], options, None if loss_mask is None else loss_mask[i : i + 1])
            for i, row in enumerate(tokens)
        ]
        logits = torch.cat([r[0] for r in rows]) if options.keep_logits else None
        return logits, torch.cat([r[1] for r in rows])
