"""`ContextLearner`: test-time training on a long context, meta-learned end to end.

A task is a token sequence `tokens` (N,) whose first `context_len` tokens are the context and whose
`query_mask` (N,) marks the positions whose next token is an answer. The inner loop reads the
context chunk by chunk: inner step i takes the next-token loss on chunk i mod n_chunks (with
`left_context` earlier tokens fed for attention, not scored) and updates the adapted weights. The
outer loss is the next-token loss on the answers, reading the whole sequence with the adapted weights,
plus optionally (context_loss_weight > 0) a next-token loss on the context itself, as in TTT-E2E,
whose meta-loss is the language-modelling loss of every chunk. `context.context_loss` says which:

    adapted      the context read with the adapted weights after every inner step;
    prequential  TTT-E2E's: the mean of the inner losses, each chunk scored before its own step (the
                 first with the initial weights), differentiated through the earlier steps.

The adapted form rewards inner steps that memorise the context (filler too), so the initial weights
need not predict it; the prequential form scores every chunk before the weights trained on it, so
what the initial weights can predict (a repeating filler) is learned by them, and chunks without
new information leave the adapted weights alone.

Not a `ttt.layers.ChunkedReader`: the inner steps are a MAML task's (`meta_step`), cycling over the
context's chunks with no carried cache, and the outer loss reads the whole sequence with the final weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ttt.config.choice import Choice
from ttt.config.schema import OuterOptimConfig
from ttt.inner import InnerLoopConfig
from ttt.meta import MetaLearner
from ttt.models import Transformer


class ContextLoss(Choice):
    """context.context_loss."""

    adapted = "adapted"
    prequential = "prequential"


@dataclass
class ContextChunksConfig:
    """How the inner loop reads the context."""

    tokens_per_step: int = 64
    """Scored tokens per inner step: inner step i trains on the context's chunk i mod (number of chunks)
    of this many positions (was context.chunk_len)."""
    left_context: int | None = None
    """Earlier tokens fed before each chunk as attention context (not scored); null: the model's window."""
    context_loss_weight: float = 0.0
    """Weight of the context's next-token loss (context_loss) in the outer loss (0: query loss only)."""
    context_loss: ContextLoss = ContextLoss.adapted
    """Which context loss: adapted (read after every inner step) or prequential (the mean of the inner
    losses, each chunk scored before its own step, as TTT-E2E's meta-loss)."""

    def __post_init__(self):
        if self.tokens_per_step < 1:
            raise ValueError(f"context.tokens_per_step must be a positive int, got {self.tokens_per_step}")
        if self.left_context is not None and self.left_context < 0:
            raise ValueError(f"context.left_context must be >= 0 or null, got {self.left_context}")
        if self.context_loss_weight < 0:
            raise ValueError(f"context.context_loss_weight must be >= 0, got {self.context_loss_weight}")
        self.context_loss = ContextLoss.parse(self.context_loss, "context.context_loss")


class ContextLearner(MetaLearner):
    """Meta-learns a `Transformer` whose adapted weights are trained on the context at test time."""

    def __init__(
        self,
        model: Transformer,
        inner: InnerLoopConfig,
        optim: OuterOptimConfig,
        total_steps: int,
        *,
        context_len: int,
        chunks: ContextChunksConfig,
    ):
        super().__init__(model, inner, optim, total_steps)
        if context_len < 2:
            raise ValueError(f"context_len must be >= 2 (a token and its successor), got {context_len}")
        self.context_len = context_len
        self.chunk_len = chunks.tokens_per_step
        self.context_loss_weight = chunks.context_loss_weight
        self.scores_inner_losses = chunks.context_loss_weight > 0 and chunks.context_loss == "prequential"
        """Whether outer_loss takes the inner losses (`ttt.inner.meta_step.TaskObjective`)."""
        self.left_context = (model.cfg.window or 0) if chunks.left_context is None else chunks.left_context

    @property
    def n_chunks(self) -> int:
        """Chunks of the context's context_len - 1 scored positions (the last token has no successor)."""
        return -(-(self.context_len - 1) // self.chunk_len)

    def chunk_span(self, chunk: int) -> tuple[int, int, int]:
        """(first fed position, first scored position, end) of `chunk`: tokens[first_fed:end] are fed,
        positions [first_scored, end) predict tokens first_scored + 1 .. end."""
        start = chunk * self.chunk_len
        end = min(start + self.chunk_len, self.context_len - 1)
        return max(0, start - self.left_context), start, end

    def inner_loss(
        self, params: dict[str, torch.Tensor], task: dict[str, torch.Tensor], step: int
    ) -> torch.Tensor:
        tokens = task["tokens"]
        fed, start, end = self.chunk_span(step % self.n_chunks)
        logits = self.forward_with(params, tokens[None, fed:end])[0, start - fed :]
        return F.cross_entropy(_at_least_float32(logits), tokens[start + 1 : end + 1])

    def outer_loss(
        self,
        params: dict[str, torch.Tensor],
        task: dict[str, torch.Tensor],
        inner_losses: list[torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Query loss (+ context_loss_weight x the context loss) with adapted `params`, and metrics
        (query_loss, query_acc, context_loss: the adapted one). inner_losses: each inner step's loss
        before that step, attached to its graph (given when scores_inner_losses); their mean is the
        prequential context loss (with no inner step: the first chunk's loss with `params`)."""
        tokens, query_mask = task["tokens"], task["query_mask"]
        positions = query_mask[:-1].nonzero()[:, 0]
        logits = self.forward_with(params, tokens[None, :-1])[0]
        query_logits, targets = _at_least_float32(logits[positions]), tokens[positions + 1]
        query_loss = F.cross_entropy(query_logits, targets)
        context_len = self.context_len
        context_loss = F.cross_entropy(_at_least_float32(logits[: context_len - 1]), tokens[1:context_len])
        metrics = {
            "query_loss": query_loss.detach(),
            "query_acc": (query_logits.argmax(-1) == targets).float().mean().detach(),
            "context_loss": context_loss.detach(),
        }
        if self.context_loss_weight == 0:
            return query_loss, metrics
        if self.scores_inner_losses:
            context_loss = (
                torch.stack(inner_losses).mean() if inner_losses else self.inner_loss(params, task, 0)
            )
            metrics["prequential_loss"] = context_loss.detach()
        return query_loss + self.context_loss_weight * context_loss, metrics


def _at_least_float32(logits: torch.Tensor) -> torch.Tensor:
    """logits (..., V) for the loss: half precision widened to float32, float32 and float64 kept."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))
