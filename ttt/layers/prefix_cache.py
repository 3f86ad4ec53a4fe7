"""`PrefixCache`: the keys and values of every position read so far, for full causal attention read
chunk by chunk, without a copy of the prefix per chunk.

Appending a chunk's keys to the cache with torch.cat makes a new (B, H, L + C, D) tensor per chunk, and
the attention saves it for its backward: over the N / C chunks of a sequence the saved copies add up
to about N^2 / (2C) positions per layer (docs/neural_memory.md, "Gradient-memory figures"). Here each
chunk writes its keys and values into the free rows of one buffer, and the attention gets a view of
the buffer's first L + C rows: every chunk's saved view shares the buffer, so the saved keys and values
are O(N). A read that reserves its length (`PrefixCache.reserve`, as `ChunkedReader` does through
`SuffixBlock.initial_cache`) fills one buffer of N rows. Without it, a full buffer is replaced by one
of twice the rows needed (the old one stays alive while views saved before hold it): at most about 4N
rows in all.

Only the first continuation of a cache writes in place. Another continuation of the same cache (a chunk
read again from the same cache, as an inner step's rescoring does) copies the prefix into a new
buffer, so the values of a view never change after it is made. One exception: the recomputation of a
region of `ttt.inner.recompute` (a checkpointed chunk, in the outer backward) replays the continuations
its forward made in place (`recompute_contexts`) in place again: it writes the same rows of the same
buffer with the same values, which only views made after them (later chunks, whose backward has run)
can see. Values, and derivatives of any order, are those of the concatenation: the view holds the same
numbers, and its backward hands each part its rows of the gradient.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import register_pytree_node

from ttt.inner.recompute import ReplayLog, register_replay


class _Rows:
    """Key and value buffers (B, Hkv, capacity, D) shared by the caches that view them (None until the
    first chunk gives their shape and dtype), and how many of their rows are written (filled)."""

    __slots__ = ("keys", "values", "filled", "capacity")

    def __init__(self, capacity: int, like: torch.Tensor | None = None):
        self.keys = self.values = None
        self.filled, self.capacity = 0, capacity
        if like is not None:
            self.allocate(like)

    def allocate(self, like: torch.Tensor) -> None:
        """The buffers, in the dtype and device of like (B, Hkv, C, D)."""
        batch, heads, _, dim = like.shape
        self.keys = like.new_empty(batch, heads, self.capacity, dim)
        self.values = like.new_empty(batch, heads, self.capacity, dim)


class _Append(torch.autograd.Function):
    """(prefix (B, H, L, D) or None, new (B, H, C, D), buffer (B, H, >= L + C, D)) -> the buffer's first
    L + C rows, holding prefix then new; in_place: the prefix is already the buffer's first L rows."""

    @staticmethod
    def forward(ctx, prefix, new, buffer: torch.Tensor, in_place: bool):
        start = 0 if prefix is None else prefix.shape[2]
        end = start + new.shape[2]
        # Written through .data: these rows lie past every view made so far, so no saved tensor's
        # values change, and autograd must not count the write against the views (one version counter).
        if not in_place and prefix is not None:
            buffer.data[:, :, :start].copy_(prefix)
        buffer.data[:, :, start:end].copy_(new)
        ctx.start, ctx.has_prefix = start, prefix is not None
        return buffer[:, :, :end]

    @staticmethod
    def backward(ctx, grad):
        prefix_grad = grad[:, :, : ctx.start] if ctx.has_prefix else None
        return prefix_grad, grad[:, :, ctx.start :], None, None


class PrefixCache:
    """Keys and values (B, Hkv, L, D) of the L positions read so far (`keys`, `values`: views of shared
    buffers, differentiable into every chunk's keys and values; None before the first chunk)."""

    __slots__ = ("keys", "values", "_rows")

    def __init__(self, keys: torch.Tensor | None, values: torch.Tensor | None, rows: _Rows):
        self.keys, self.values, self._rows = keys, values, rows

    @staticmethod
    def reserve(positions: int) -> PrefixCache:
        """An empty cache whose buffers (made by its first `extend`, in the keys' dtype) hold `positions`
        rows: a read of that many positions then never copies."""
        return PrefixCache(None, None, _Rows(positions))

    @property
    def positions(self) -> int:
        """L, the positions held."""
        return 0 if self.keys is None else self.keys.shape[2]

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> PrefixCache:
        """This cache followed by a chunk's keys and values (B, Hkv, C, D): a cache of L + C positions,
        written into the free rows of this cache's buffers when this is their first continuation and they
        have room (and the same dtype and device), or when a recomputation replays such a continuation
        (module docstring), else into new buffers: of L + C rows for a second continuation (a copy, as
        torch.cat makes), of 2 (L + C) for a first one that does not fit."""
        start, rows = self.positions, self._rows
        end = start + keys.shape[2]
        region = _CONTINUATIONS.region()
        if region is not None and region.replaying and region.take() == (rows, start, end):
            return self._written(keys, values, rows, in_place=True)
        first_continuation = rows.filled == start
        if first_continuation and rows.keys is None:
            rows.capacity = max(rows.capacity, end)
            rows.allocate(keys)
        in_place = (
            first_continuation
            and rows.capacity >= end
            and (rows.keys.dtype, rows.keys.device) == (keys.dtype, keys.device)
        )
        if region is not None and not region.replaying:
            region.record((rows, start, end) if in_place else None)
        if not in_place:
            rows = _Rows(2 * end if first_continuation else end, like=keys)
        rows.filled = end
        return self._written(keys, values, rows, in_place=in_place)

    def _written(self, keys: torch.Tensor, values: torch.Tensor, rows: _Rows, *, in_place: bool):
        """A `PrefixCache`: this cache's positions and keys, values (B, Hkv, C, D) after them, in rows'
        buffers (in_place: this cache's positions are already their first rows)."""
        keys = _Append.apply(self.keys, keys, rows.keys, in_place)
        values = _Append.apply(self.values, values, rows.values, in_place)
        return PrefixCache(keys, values, rows)

    def detach(self) -> PrefixCache:
        """The same positions cut from the graph (still extended in place)."""
        if self.keys is None:
            return self
        return PrefixCache(self.keys.detach(), self.values.detach(), self._rows)


_CONTINUATIONS = ReplayLog("PrefixCache.extend")
"""Per recomputed region, each continuation of its forward: (rows, start, end) when it wrote in place,
else None."""


@register_replay
def recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(record, replay) contexts for a recomputed region (`ttt.inner.recompute`): the continuations that
    the forward writes in place, the recomputation writes in place again (module docstring)."""
    return _CONTINUATIONS.contexts()


register_pytree_node(
    PrefixCache,
    lambda cache: ([cache.keys, cache.values], cache._rows),
    lambda children, rows: PrefixCache(children[0], children[1], rows),
)
"""A pytree node: its keys and values are what `ttt.inner.recompute.recomputed` passes through a
recomputed chunk (the shared buffers travel as the node's context)."""
