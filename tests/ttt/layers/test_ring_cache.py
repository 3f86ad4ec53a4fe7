"""`RingCache`: the window of a decoding, written in place; its pair is the concatenated cache's window,
and one query's attention over the ring is the pair's attention over the window."""

import pytest
import torch

import flashbob
from ttt.layers.ring_cache import RingCache

WINDOW = 5


def positions(n, seed=0):
    """Keys and values (2, 3, n, 8) of n positions, float64."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(2, 3, n, 8, generator=gen, dtype=torch.float64) for _ in range(2)]


@pytest.mark.parametrize("written", [0, 1, WINDOW - 1, WINDOW, 3 * WINDOW + 2])
def test_the_ring_holds_the_window_of_the_last_position(written):
    keys, values = positions(WINDOW - 1 + written)
    ring = RingCache.from_pair(keys[:, :, : WINDOW - 1], values[:, :, : WINDOW - 1])
    for i in range(WINDOW - 1, keys.shape[2]):
        ring.extend(keys[:, :, i : i + 1], values[:, :, i : i + 1])
    kept_keys, kept_values = ring.pair()
    assert torch.equal(kept_keys, keys[:, :, -(WINDOW - 1) :])
    assert torch.equal(kept_values, values[:, :, -(WINDOW - 1) :])
    if written:  # the last position's query sees the ring: the window's attention
        query = torch.randn(2, 3, 1, 8, dtype=torch.float64)
        want = flashbob.flash_attention(query, keys, values, causal=True, window=WINDOW, backend="torch")
        got = flashbob.flash_attention(query, ring.keys, ring.values, backend="torch")
        torch.testing.assert_close(got, want, rtol=0, atol=1e-14)


def test_more_than_one_position_at_a_time_is_refused():
    keys, values = positions(WINDOW + 1)
    ring = RingCache.from_pair(keys[:, :, : WINDOW - 1], values[:, :, : WINDOW - 1])
    with pytest.raises(ValueError, match="one position at a time"):
        ring.extend(keys[:, :, WINDOW - 1 :], values[:, :, WINDOW - 1 :])
