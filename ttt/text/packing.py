"""Documents packed into one token stream and cut into slices (TTT-E2E's training data).

    slices = PackedSlices(documents, length=8192, bos_id=128000, split="train", shuffle=True)
    slices.task(seed, index)    # {"tokens": (8193,) int64, "loss_mask": (8192,) bool}

The documents of a split, each with the BOS token before it, are joined into one stream; slice i is
stream[i * length : i * length + length + 1]: length inputs and length targets, its last token the
next slice's first (the official data loader's stride). Targets equal to BOS are masked out of the loss
(the model is not asked to predict where a document starts). With shuffle, pass p over the slices
reads them in the order of a permutation drawn from (seed, p): every slice once per pass; without, in
order (the held-out sets).
"""

from __future__ import annotations

import numpy as np


class PackedSlices:
    """The slices of a split's documents packed into one stream (module docstring); an
    `ttt.meta.IndexedSampler`."""

    def __init__(self, documents: list[np.ndarray], *, length: int, bos_id: int, split: str, shuffle: bool):
        if length < 1:
            raise ValueError(f"data.seq_len must be a positive int, got {length}")
        pieces = [piece for doc in documents for piece in (np.array([bos_id], dtype=np.int64), doc)]
        self.stream = np.concatenate(pieces).astype(np.int64) if pieces else np.zeros(0, dtype=np.int64)
        self.length, self.bos_id, self.shuffle = length, bos_id, shuffle
        self.count = max(0, (len(self.stream) - 1) // length)
        if self.count < 1:
            raise ValueError(
                f"the {split} documents make {len(self.stream)} tokens with their BOS tokens, fewer than one "
                f"slice of data.seq_len + 1 = {length + 1}: lower data.seq_len or give data.corpus more "
                "text (or raise data.max_documents)"
            )
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return self.count

    def slice_index(self, seed: int, index: int) -> int:
        """Which slice task `index` reads: pass index // count, in its seeded order (or in order)."""
        rounds, position = divmod(index, self.count)
        if not self.shuffle:
            return position
        key = (seed, rounds)
        if key not in self._orders:
            self._orders = {key: np.random.default_rng([seed, rounds]).permutation(self.count)}
        return int(self._orders[key][position])

    def task(self, seed: int, index: int) -> dict[str, np.ndarray]:
        """{"tokens": (length + 1,) int64, "loss_mask": (length,) bool (target != BOS)} of task `index`."""
        start = self.slice_index(seed, index) * self.length
        tokens = self.stream[start : start + self.length + 1]
        return {"tokens": tokens, "loss_mask": tokens[1:] != self.bos_id}
