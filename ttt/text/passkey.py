"""Passkey retrieval (needs no data): a key hidden at a random depth in repetitive filler, asked for at
the end. Scored on the answer tokens only, teacher-forced: exact when every answer token is the argmax."""

from __future__ import annotations

import numpy as np

from .tokenizer import Tokenizer

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
QUESTION = "What is the pass key? The pass key is "


def needle(key: str) -> str:
    """The sentence that hides `key`."""
    return f"The pass key is {key}. Remember it. {key} is the pass key. "


def sample_passkey(
    tokenizer: Tokenizer, length: int, digits: int, rng: np.random.Generator
) -> dict[str, np.ndarray]:
    """One passkey sequence of exactly `length` tokens: filler, the needle at a uniformly random depth,
    more filler, the question and the answer (the key).

    Returns {"tokens": (length,) int64, "answer_mask": (length,) bool}: answer_mask[i] is True when
    position i predicts an answer token (the positions to score).
    """
    key = "".join(str(d) for d in rng.integers(0, 10, size=digits))
    hidden, question, answer = (tokenizer.encode(text) for text in (needle(key), QUESTION, key))
    budget = length - len(hidden) - len(question) - len(answer)
    if budget < 0:
        raise ValueError(
            f"passkey length {length} is too short: the needle, question and answer alone take "
            f"{length - budget} tokens"
        )
    filler = tokenizer.encode(FILLER)
    filler = np.tile(filler, budget // len(filler) + 1)[:budget]
    depth = int(rng.integers(0, budget + 1))
    tokens = np.concatenate([filler[:depth], hidden, filler[depth:], question, answer]).astype(np.int64)
    answer_mask = np.zeros(length, dtype=bool)
    answer_mask[length - len(answer) - 1 : length - 1] = True
    return {"tokens": tokens, "answer_mask": answer_mask}
