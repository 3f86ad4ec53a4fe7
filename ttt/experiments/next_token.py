"""The meta-learning problem the gradient-memory experiment measures: next-token prediction.

A task is two random token sequences, `inner` and `outer`, each (N + 1,) int64. The inner loss is the
next-token cross-entropy on `inner` (every inner step sees the whole sequence); the outer loss is
the same on `outer`, read with the adapted weights. Random tokens are enough: memory and time do not
depend on the values.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttt.inner import functional_forward
from ttt.models import Transformer


def random_task(n: int, vocab_size: int, device: torch.device, seed: int) -> dict[str, torch.Tensor]:
    """{"inner": (n + 1,), "outer": (n + 1,)} int64 tokens in [0, vocab_size), reproducible from seed."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab_size, (2, n + 1), generator=gen)
    return {"inner": tokens[0].to(device), "outer": tokens[1].to(device)}


def next_token_loss(
    model: Transformer, params: dict[str, torch.Tensor], tokens: torch.Tensor
) -> torch.Tensor:
    """Mean cross-entropy (float32 scalar) of predicting tokens[1:] from tokens[:-1] (tokens: (N + 1,))."""
    logits = functional_forward(model, params, tokens[None, :-1])[0]
    return F.cross_entropy(logits.float(), tokens[1:])


class NextTokenObjective:
    """`ttt.inner.TaskObjective` of `random_task` tasks for a `Transformer`."""

    def __init__(self, model: Transformer):
        self.model = model

    def inner_loss(self, params: dict[str, torch.Tensor], task: dict, step: int) -> torch.Tensor:
        """Next-token loss on task["inner"] (the same sequence at every step)."""
        return next_token_loss(self.model, params, task["inner"])

    def outer_loss(self, params: dict[str, torch.Tensor], task: dict) -> tuple[torch.Tensor, dict]:
        """Next-token loss on task["outer"] with the adapted params; no extra metrics."""
        return next_token_loss(self.model, params, task["outer"]), {}
