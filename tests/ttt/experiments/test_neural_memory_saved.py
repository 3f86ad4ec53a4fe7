"""The logic of ttt/experiments/neural_memory_saved.py: with the CUDA path's autograd chain on the CPU, a full
causal meta step saves O(N) keys and values with the shared prefix buffer, O(N^2 / chunk_len) with the
per-chunk concatenation; the patched functions are restored afterwards."""

import pytest

import flashbob
from flashbob import triton_ops
from ttt.experiments import neural_memory_saved as bench


def attention_bytes_per_token(n, **options):
    peak, sources = bench.measure(n, chunk_len=16, **options)
    assert peak >= sum(sources.values()) > 0
    return sum(b for source, b in sources.items() if source.startswith("flashbob/")) / n


@pytest.mark.slow
def test_the_shared_prefix_saves_linear_keys_and_values_and_concatenation_quadratic():
    originals = (flashbob.flash_attention, triton_ops.forward, triton_ops.backward, triton_ops.bob)
    shared = [attention_bytes_per_token(n, variant="mac", window=None, concat=False) for n in (32, 128)]
    concat = [attention_bytes_per_token(n, variant="mac", window=None, concat=True) for n in (32, 128)]
    assert abs(shared[1] / shared[0] - 1) < 0.02
    assert concat[1] > 1.5 * concat[0] and concat[1] > 1.5 * shared[1]
    assert (flashbob.flash_attention, triton_ops.forward, triton_ops.backward, triton_ops.bob) == originals
