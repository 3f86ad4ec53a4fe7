"""Passkey retrieval (needs no data): a key hidden at a random depth in repetitive filler, asked for at
the end. Scored on the answer tokens only, teacher-forced: exact when every answer token is the argmax.
`PasskeyMix` puts passkey sequences into a training stream (data.passkey_fraction)."""

from __future__ import annotations

from collections.abc import Callable

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


class PasskeyMix:
    """A training sampler: `sample`'s windows, a `fraction` of them replaced by passkey sequences of the
    same length (data.passkey_fraction), trained on with the next-token loss over the whole sequence,
    so that retrieving the key from far back is rewarded.

    Each call draws the window first and then, with probability `fraction`, replaces it by
    sample_passkey(tokenizer, length, digits, rng), all from the one generator: a row depends on its
    generator alone, and the windows kept are exactly those `sample` gives alone. With answer_weight
    != 1 (data.passkey_answer_weight) every row also carries "loss_weight" (length - 1,) float32, the
    weight of each next-token loss: answer_weight where a passkey row's position predicts an answer
    token, 1 elsewhere (text rows: all 1). length_key: the config key of `length`, named in errors.
    """

    def __init__(
        self,
        sample: Callable[[np.random.Generator], dict[str, np.ndarray]],
        fraction: float,
        tokenizer: Tokenizer,
        length: int,
        digits: int,
        answer_weight: float = 1.0,
        length_key: str = "data.seq_len",
    ):
        if not 0 < fraction <= 1:
            raise ValueError(f"data.passkey_fraction must be in (0, 1] to mix in passkeys, got {fraction}")
        if not 0 < answer_weight < float("inf"):
            raise ValueError(f"data.passkey_answer_weight must be a finite number > 0, got {answer_weight}")
        try:
            sample_passkey(tokenizer, length, digits, np.random.default_rng(0))
        except ValueError as error:
            raise ValueError(
                f"data.passkey_fraction={fraction} needs a passkey sequence in {length_key}={length} tokens "
                f"({error}); raise {length_key} or set data.passkey_fraction=0"
            ) from None
        self.sample, self.fraction, self.tokenizer = sample, fraction, tokenizer
        self.length, self.digits, self.answer_weight = length, digits, answer_weight

    def __call__(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """{"tokens": (length,) int64}, and "loss_weight" (length - 1,) float32 with an answer weight:
        a window of `sample`, or a passkey sequence."""
        window = self.sample(rng)
        if rng.random() >= self.fraction:
            if self.answer_weight == 1:
                return window
            return {**window, "loss_weight": np.ones(self.length - 1, dtype=np.float32)}
        passkey = sample_passkey(self.tokenizer, self.length, self.digits, rng)
        if self.answer_weight == 1:
            return {"tokens": passkey["tokens"]}
        weight = np.where(passkey["answer_mask"][:-1], self.answer_weight, 1.0).astype(np.float32)
        return {"tokens": passkey["tokens"], "loss_weight": weight}
