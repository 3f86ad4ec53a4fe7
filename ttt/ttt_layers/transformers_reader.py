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
transformers' layers are called as they are, through `torch.func.functional_call`), which costs
(left context + chunk) / chunk forward passes per token, and the sequences of a batch are read one
after another, each with its own fast weights. The converted-model path (`TTTTransformer`, recipe
ttt_pretrained with model.checkpoint) reads each token once and is the faster one where it applies
(Llama-style checkpoints).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.func import functional_call

from ttt.inner import InnerLoop, InnerLoopConfig, detach_state, fresh_leaves, select_by_glob
from ttt.models.hf_causal_lm import HFCausalLM
from ttt.models.transformer import next_token_losses
from ttt.reading import TTTConfig, check_tokens, score_then_step

from .model import resolve_read_options


class TransformersTTTReader(nn.Module):
    """An `HFCausalLM` read chunk by chunk while its fast weights adapt (module docstring).

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

    def _score(self, fast, tokens: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Logits (1, end - start, V) of positions [start, end) of one sequence tokens (1, N) read with
        `fast` and its left context, and their next-token losses (1, T), T = targets in the sequence."""
        fed = start - self.left_context(start)
        logits = functional_call(self.lm, fast, (tokens[:, fed:end],), strict=False)[:, start - fed :]
        return logits, next_token_losses(logits, tokens[:, start + 1 : end + 1])

    def _read_row(self, tokens, steps, create_graph, lr_scale, outer_grad, keep_logits):
        """One sequence tokens (1, N) read chunk by chunk from the initial fast weights: (logits (1, N, V)
        or None, losses (1, N - 1)); each chunk scored, then stepped, by `score_then_step` as in
        `TTTTransformer`; the options as `read` resolved them."""
        fast = self.initial_fast_weights()
        lrs, state = self.inner.step_lrs(fast, lr_scale), self.inner.init_state(fast)
        if not outer_grad:
            fast, state, lrs = fresh_leaves(fast), detach_state(state), detach_state(lrs)
        n, all_logits, all_losses = tokens.shape[1], [], []
        for start in range(0, n, self.ttt_cfg.chunk_len):
            end = min(start + self.ttt_cfg.chunk_len, n)
            with torch.set_grad_enabled(torch.is_grad_enabled() and (outer_grad or steps > 0)):
                logits, scored, fast, state = score_then_step(
                    lambda fast, _, start=start, end=end: self._score(fast, tokens, start, end),
                    self.inner,
                    fast,
                    state,
                    lrs,
                    steps=steps,
                    create_graph=create_graph,
                    per_row=False,
                    scored_in_outer=outer_grad,
                )
            if not outer_grad:
                logits, scored = logits.detach(), scored.detach()
                fast, state = fresh_leaves(fast), detach_state(state)
            all_logits.append(logits if keep_logits else None)
            all_losses.append(scored)
        return (torch.cat(all_logits, dim=1) if keep_logits else None), torch.cat(all_losses, dim=1)

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
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Read the sequences tokens (B, N) chunk by chunk, one after another, each adapting its own fast
        weights. Returns (logits (B, N, V) or None unless keep_logits, next-token losses (B, N - 1)).
        Options as in `TTTTransformer.read`."""
        check_tokens(tokens)
        options = dict(adapt=adapt, steps=steps, first_order=first_order, outer_grad=outer_grad)
        steps, create_graph = resolve_read_options(self.ttt_cfg, self.inner_cfg, **options)
        row_options = (steps, create_graph, lr_scale, outer_grad, keep_logits)
        rows = [self._read_row(row[None], *row_options) for row in tokens]
        logits = torch.cat([r[0] for r in rows]) if keep_logits else None
        return logits, torch.cat([r[1] for r in rows])

    def token_losses(self, tokens: torch.Tensor, **options) -> torch.Tensor:
        """Next-token losses of every position, tokens (B, N) int64 -> (B, N - 1) float32 (its mean is
        the meta-training objective); options as in `read`."""
        return self.read(tokens, **options)[1]

    def forward(self, tokens: torch.Tensor, **options) -> torch.Tensor:
        """tokens (B, N) int64 -> logits (B, N, vocab_size), reading while adapting."""
        return self.read(tokens, keep_logits=True, **options)[0]
