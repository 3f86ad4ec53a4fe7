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
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ttt.inner import (
    InnerLoop,
    InnerLoopConfig,
    detach_state,
    expand_rows,
    fresh_leaves,
    maybe_checkpoint,
    select_by_glob,
)
from ttt.models.transformer import Transformer, rope_cos_sin

from .block import SuffixBlock
from .config import TTTConfig


class TTTTransformer(nn.Module):
    """A `Transformer` (its modules taken over) with fast weights in its last ttt.suffix_len blocks.

    forward: tokens (B, N) int64 -> logits (B, N, vocab). token_losses: tokens (B, N) -> next-token
    losses (B, N - 1), the training objective. The fast weights are the suffix blocks' parameters that
    inner.params (glob patterns over full names) select: layers.*.mlp.* means the suffix blocks' MLPs.
    """

    def __init__(self, base: Transformer, ttt: TTTConfig, inner: InnerLoopConfig):
        super().__init__()
        if not isinstance(base, Transformer):
            raise TypeError(
                f"test-time training needs a ttt.models.Transformer (Llama-style), got {type(base).__name__}"
            )
        cfg = base.cfg
        if ttt.suffix_len > cfg.n_layers:
            raise ValueError(f"ttt.suffix_len ({ttt.suffix_len}) must be <= model.n_layers ({cfg.n_layers})")
        self.cfg, self.ttt_cfg, self.inner_cfg = cfg, ttt, inner
        self.first_suffix = cfg.n_layers - ttt.suffix_len
        hidden = (ttt.extra_mlp_hidden or cfg.d_ff) if ttt.extra_mlp else None
        self.embed, self.norm, self.lm_head = base.embed, base.norm, base.lm_head
        self.layers = nn.ModuleList(
            [
                *base.layers[: self.first_suffix],
                *(SuffixBlock(b, cfg, hidden) for b in base.layers[self.first_suffix :]),
            ]
        )
        fast = self._select_fast_weights(inner.params)
        self.block_params = [
            [(full, full.split(".", 2)[2]) for full in fast if int(full.split(".")[1]) == i]
            for i in range(self.first_suffix, cfg.n_layers)
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

    @property
    def suffix(self) -> list[SuffixBlock]:
        """The blocks read chunk by chunk."""
        return list(self.layers[self.first_suffix :])

    def initial_fast_weights(self) -> dict[str, torch.Tensor]:
        """The fast weights' meta-learned initial values (live parameters), by full name."""
        return {full: self.get_parameter(full) for names in self.block_params for full, _ in names}

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm and output head: (..., d_model) -> logits (..., vocab_size)."""
        h = self.norm(hidden)
        return h @ self.embed.weight.t() if self.lm_head is None else self.lm_head(h)

    def _suffix_chunk(self, fast, hidden, targets, cos, sin, caches):
        """Suffix blocks and head on one chunk (B, C, d_model) of every sequence with their fast weights
        `fast` (each (B, ...)): (logits (B, C, V), per-token losses (B, T) of the first
        T = targets.shape[1] positions, caches for the next chunk)."""
        x, new_caches = hidden, []
        for block, names, cache in zip(self.suffix, self.block_params, caches):
            params = {inside: fast[full] for full, inside in names}
            x, cache = functional_call(block, params, (x, cos, sin, cache), strict=False)
            new_caches.append(cache)
        logits = self.head(x)
        scored = logits[:, : targets.shape[1]].flatten(0, 1)
        losses = F.cross_entropy(
            scored.to(torch.promote_types(scored.dtype, torch.float32)), targets.flatten(), reduction="none"
        )
        return logits, losses.view(targets.shape), new_caches

    def _read_chunk(
        self, fast, state, lrs, hidden, targets, cos, sin, caches, steps, create_graph, keep_logits
    ):
        """Score one chunk with `fast`, then take `steps` inner steps on each sequence's mean loss over it.
        Returns (logits or None, per-token losses (B, T), caches, updated fast weights, optimizer state)."""
        logits, scored, new_caches = self._suffix_chunk(fast, hidden, targets, cos, sin, caches)
        if targets.numel() == 0:
            steps = 0
        for step in range(steps):
            losses = scored if step == 0 else self._suffix_chunk(fast, hidden, targets, cos, sin, caches)[1]
            fast, state = self.inner.step(
                losses.mean(1).sum(),  # rows are independent: each row's grad is that of its own mean
                fast,
                state,
                create_graph=create_graph,
                lrs=lrs,
                per_row=True,
                retain_graph=create_graph or step == 0,  # step 0's loss is also part of the outer loss
            )
        return (logits if keep_logits else None), scored, new_caches, fast, state

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
        """Read the sequences tokens (B, N) chunk by chunk, side by side, each adapting its own fast
        weights. Returns (logits (B, N, V) or None unless keep_logits, next-token losses (B, N - 1)).

        adapt: update the fast weights (default ttt.enabled); steps: inner steps per chunk (default
        inner.steps); first_order: default inner.first_order; lr_scale multiplies the inner learning
        rates (warm-up); outer_grad=False detaches every chunk (evaluation: memory stays flat).
        """
        batch, n = tokens.shape
        adapt = self.ttt_cfg.enabled if adapt is None else adapt
        steps = (self.inner_cfg.steps if steps is None else steps) if adapt else 0
        create_graph = outer_grad and not (self.inner_cfg.first_order if first_order is None else first_order)
        if steps and not torch.is_grad_enabled():
            raise RuntimeError("test-time training needs grad mode: wrap evaluation in torch.enable_grad()")
        cos, sin = rope_cos_sin(n, self.cfg.head_dim, self.cfg.rope_theta, tokens.device)
        with torch.set_grad_enabled(outer_grad and torch.is_grad_enabled()):
            hidden = self.embed(tokens)
            for block in self.layers[: self.first_suffix]:
                hidden = block(hidden, cos, sin)
        fast = expand_rows(self.initial_fast_weights(), batch)
        lrs = self.inner.step_lrs(fast, lr_scale)  # once per read: every chunk's steps share them
        if not outer_grad:
            fast, lrs = fresh_leaves(fast), detach_state(lrs)  # fast: a leaf, still expanded
        state = self.inner.init_state(fast)
        caches, all_logits, all_losses = [None] * len(self.suffix), [], []
        use_checkpoint = self.inner_cfg.checkpoint and outer_grad and steps > 0
        for start in range(0, n, self.ttt_cfg.chunk_len):
            end = min(start + self.ttt_cfg.chunk_len, n)
            args = (
                fast,
                state,
                lrs,
                hidden[:, start:end],
                tokens[:, start + 1 : end + 1],
                cos[start:end],
                sin[start:end],
                caches,
                steps,
                create_graph,
                keep_logits,
            )
            logits, losses, caches, fast, state = maybe_checkpoint(
                self._read_chunk, *args, enabled=use_checkpoint
            )
            if not outer_grad:
                logits, losses = (None if logits is None else logits.detach()), losses.detach()
                caches = [(k.detach(), v.detach()) for k, v in caches]
                fast, state = fresh_leaves(fast), detach_state(state)
            all_logits.append(logits)
            all_losses.append(losses)
        return (torch.cat(all_logits, dim=1) if keep_logits else None), torch.cat(all_losses, dim=1)

    def token_losses(self, tokens: torch.Tensor, **options) -> torch.Tensor:
        """Next-token losses of every position, tokens (B, N) int64 -> (B, N - 1) float32; options as
        in `read`. Its mean is the meta-training objective."""
        _check_tokens(tokens)
        return self.read(tokens, **options)[1]

    def forward(self, tokens: torch.Tensor, **options) -> torch.Tensor:
        """tokens (B, N) int64 -> logits (B, N, vocab_size), reading with test-time training (options as in
        `read`)."""
        _check_tokens(tokens)
        return self.read(tokens, keep_logits=True, **options)[0]


def _check_tokens(tokens: torch.Tensor) -> None:
    if tokens.dim() != 2 or tokens.dtype != torch.long or tokens.shape[1] < 1:
        raise ValueError(
            f"tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}"
        )
