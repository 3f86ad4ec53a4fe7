"""Long-context key-value recall: the answers lie further back than any attention window reaches.

One task is one sequence (token ids, all in one vocabulary):

    BOS  k1 v1  k2 v2 ... kP vP   f f f ... f    |   k7 v7  k2 v2 ... (Q query pairs)
    `------------------- context -------------'      `------ queries ------'

The P key-value pairs are drawn fresh for each task (distinct keys; values with repetition); the
filler is a fixed repeating cycle of filler tokens, starting at a random phase; the queries repeat Q
of the pairs in a random order. A model with sliding-window attention whose receptive field
(n_layers * (window - 1)) is shorter than the filler cannot see the pairs from the queries: it can
only answer if reading the context (inner-loop training on it) stored the pairs in its weights.
The loss and accuracy of a task count the value positions of the queries only.

Curriculum (task.curriculum_start_pairs, task.curriculum_steps): training tasks of outer step s hold
only p(s) pairs, growing linearly from the start count to P over the curriculum's steps; the unused
pair slots become filler (shapes never change) and the Q queries ask the p(s) pairs, cycling through
them when p(s) < Q. Held-out tasks always hold P pairs.

Vocabulary: 0 padding (unused), 1 BOS, then filler, key and value tokens in that order.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

BOS = 1
FIRST_FREE_TOKEN = 2


@dataclass
class KVRecallConfig:
    """Sizes of the key-value recall task."""

    n_pairs: int = 16
    """Key-value pairs written at the start of the context (P)."""
    n_queries: int = 16
    """Pairs asked for after the context (Q <= P)."""
    n_keys: int = 64
    """Size of the key vocabulary."""
    n_values: int = 64
    """Size of the value vocabulary."""
    filler_len: int = 64
    """Filler tokens between the pairs and the queries; must exceed the model's receptive field."""
    n_filler_tokens: int = 8
    """Length of the repeating filler cycle (distinct filler tokens)."""
    curriculum_start_pairs: int | None = None
    """Pairs per training task at outer step 0, growing linearly to n_pairs (null: no curriculum)."""
    curriculum_steps: int = 0
    """Outer steps over which the pairs of a training task grow to n_pairs (with curriculum_start_pairs)."""

    def __post_init__(self):
        for name in ("n_pairs", "n_queries", "n_keys", "n_values", "n_filler_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"task.{name} must be a positive int, got {getattr(self, name)}")
        if self.filler_len < 0:
            raise ValueError(f"task.filler_len must be >= 0, got {self.filler_len}")
        if self.n_queries > self.n_pairs:
            raise ValueError(f"task.n_queries must be <= task.n_pairs ({self.n_pairs}), got {self.n_queries}")
        if self.n_pairs > self.n_keys:
            raise ValueError(f"task.n_pairs must be <= task.n_keys ({self.n_keys}), got {self.n_pairs}")
        if self.curriculum_start_pairs is not None:
            if not 1 <= self.curriculum_start_pairs <= self.n_pairs:
                raise ValueError(
                    f"task.curriculum_start_pairs must be in [1, task.n_pairs={self.n_pairs}] or null, "
                    f"got {self.curriculum_start_pairs}"
                )
            if self.curriculum_steps < 1:
                raise ValueError(
                    "task.curriculum_steps must be a positive int with task.curriculum_start_pairs, "
                    f"got {self.curriculum_steps}"
                )
        elif self.curriculum_steps:
            raise ValueError(
                f"task.curriculum_steps ({self.curriculum_steps}) needs task.curriculum_start_pairs"
            )

    @property
    def has_curriculum(self) -> bool:
        """Whether training tasks grow from curriculum_start_pairs pairs to n_pairs."""
        return self.curriculum_start_pairs is not None

    def pairs_at_step(self, step: int) -> int:
        """Pairs of a training task at outer `step` (n_pairs without a curriculum or after it)."""
        if not self.has_curriculum or step >= self.curriculum_steps:
            return self.n_pairs
        start = self.curriculum_start_pairs
        return start + round((self.n_pairs - start) * step / self.curriculum_steps)

    @property
    def vocab_size(self) -> int:
        """Token ids used: padding, BOS, filler, keys, values."""
        return FIRST_FREE_TOKEN + self.n_filler_tokens + self.n_keys + self.n_values

    @property
    def context_len(self) -> int:
        """Tokens before the queries: BOS, the pairs and the filler."""
        return 1 + 2 * self.n_pairs + self.filler_len

    @property
    def seq_len(self) -> int:
        """Tokens of one whole task: context and queries."""
        return self.context_len + 2 * self.n_queries


def sample_kv_recall(
    cfg: KVRecallConfig, rng: np.random.Generator, n_pairs: int | None = None
) -> dict[str, np.ndarray]:
    """One task. Returns {"tokens": (seq_len,) int64, "query_mask": (seq_len,) bool}; query_mask is True
    at the positions whose next token is a queried value (where the loss and accuracy are taken).
    n_pairs: pairs actually written (1..cfg.n_pairs, default all); the other pair slots are filler and
    the queries cycle through the written pairs."""
    written = cfg.n_pairs if n_pairs is None else n_pairs
    if not 1 <= written <= cfg.n_pairs:
        raise ValueError(f"n_pairs must be in [1, task.n_pairs={cfg.n_pairs}], got {written}")
    filler_base = FIRST_FREE_TOKEN
    key_base = filler_base + cfg.n_filler_tokens
    value_base = key_base + cfg.n_keys
    keys = key_base + rng.choice(cfg.n_keys, size=written, replace=False)
    values = value_base + rng.integers(0, cfg.n_values, size=written)
    phase = rng.integers(0, cfg.n_filler_tokens)
    filler_len = cfg.filler_len + 2 * (cfg.n_pairs - written)
    filler = filler_base + (phase + np.arange(filler_len)) % cfg.n_filler_tokens
    rounds = -(-cfg.n_queries // written)
    asked = np.concatenate([rng.permutation(written) for _ in range(rounds)])[: cfg.n_queries]
    pairs = np.stack([keys, values], axis=1).reshape(-1)
    queries = np.stack([keys[asked], values[asked]], axis=1).reshape(-1)
    tokens = np.concatenate([[BOS], pairs, filler, queries]).astype(np.int64)
    query_mask = np.zeros(cfg.seq_len, dtype=bool)
    query_mask[cfg.context_len : cfg.seq_len : 2] = True
    return {"tokens": tokens, "query_mask": query_mask}


def sample_kv_recall_at_step(
    cfg: KVRecallConfig, rng: np.random.Generator, step: int
) -> dict[str, np.ndarray]:
    """A training task of outer `step` under cfg's curriculum (`ttt.meta.data.StepTaskSampler`):
    sample_kv_recall with cfg.pairs_at_step(step) pairs."""
    return sample_kv_recall(cfg, rng, cfg.pairs_at_step(step))
