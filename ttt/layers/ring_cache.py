"""`RingCache`: a sliding window's keys and values for decoding one position at a time, each new position
written in place over the one that left the window.

A window cache kept as a pair of tensors (the window - 1 most recent positions, in order) is extended by
concatenation and cut each token: a copy of the whole window per block per token, which at batch 1 is
most of a decoded token's GPU work (docs/generation.md, "What a decoded token costs"). A ring of
`window` slots holds the window of the position being read (the window - 1 before it and itself): the
position's key and value go to the slot of the one that just left the window, and its query attends to
every slot. The order of the slots does not matter to the attention of one query that sees all of them
(the keys carry their positions through RoPE, applied before caching); the values are those of the
pair's attention up to the order of a sum. The slot to write is a device tensor, advanced on the device,
so that a CUDA graph of a decoded token replays it (`ttt.layers.graphed.GraphedDecoder`).
"""

from __future__ import annotations

import torch


class RingCache:
    """keys, values (B, Hkv, window, D): the window of the positions read, in ring order; slot (1,) int64
    on their device: where the next position goes (the slot of the oldest)."""

    __slots__ = ("keys", "values", "slot")

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor):
        self.keys, self.values, self.slot = keys, values, slot

    @staticmethod
    def from_pair(keys: torch.Tensor, values: torch.Tensor) -> RingCache:
        """A ring of n + 1 slots from a pair cache's keys and values (B, Hkv, n, D) of a window of n + 1
        (its n most recent positions, in order): they fill the first n slots, the next position the last."""
        batch, heads, n, dim = keys.shape
        ring = [t.new_empty(batch, heads, n + 1, dim) for t in (keys, values)]
        for buffer, part in zip(ring, (keys, values)):
            buffer[:, :, :n] = part
            buffer[:, :, n:] = 0  # read by no attention before the next position overwrites it
        return RingCache(*ring, torch.full((1,), n, dtype=torch.long, device=keys.device))

    @property
    def window(self) -> int:
        """Slots: the window of the position read last."""
        return self.keys.shape[2]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write one position's keys and values (B, Hkv, 1, D) over the oldest, in place."""
        if keys.shape[2] != 1:
            raise ValueError(f"a RingCache takes one position at a time (decoding), got {keys.shape[2]}")
        self.keys.index_copy_(2, self.slot, keys)
        self.values.index_copy_(2, self.slot, values)
        self.slot.add_(1).remainder_(self.window)

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The window - 1 most recent positions' keys and values (B, Hkv, window - 1, D), in order: the
        pair cache a chunk read continues from (new tensors)."""
        order = (self.slot + torch.arange(1, self.window, device=self.slot.device)) % self.window
        return self.keys.index_select(2, order), self.values.index_select(2, order)

    def buffers(self) -> list[torch.Tensor]:
        """The tensors written in place (what a capture's warm-up run must restore)."""
        return [self.keys, self.values, self.slot]
