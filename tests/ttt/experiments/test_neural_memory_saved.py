"""The logic of ttt/experiments/neural_memory_saved.py: with the CUDA path's autograd chain on the CPU, a full
causal meta step saves O(N) keys and values with the shared prefix buffer, O(N^2 / chunk_len) with the
per-chunk concatenation; the patched functions are restored afterwards."""

import pytest

import flashbob
from flashbob import triton_ops
from ttt.experiments import neural_memory_saved as bench


def attention_bytes(n, **options):
    peak, sources = bench.measure(n, chunk_len=16, **options)
    assert peak >= sum(sources.values()) > 0
    return sum(b for source, b in sources.items() if source.startswith("flashbob/"))


@pytest.mark.slow
def test_the_shared_prefix_saves_linear_keys_and_values_and_concatenation_quadratic():
    """Each 32 tokens more (2 chunks) save as many bytes more with the shared buffer (the chunk that ends
    the read, which does not write, is a constant offset), more each time with the concatenation."""
    originals = (flashbob.flash_attention, triton_ops.forward, triton_ops.backward, triton_ops.bob)
    shared = [attention_bytes(n, variant="mac", window=None, concat=False) for n in (32, 64, 96)]
    concat = [attention_bytes(n, variant="mac", window=None, concat=True) for n in (32, 64, 96)]
    shared_steps = [shared[1] - shared[0], shared[2] - shared[1]]
    concat_steps = [concat[1] - concat[0], concat[2] - concat[1]]
    assert abs(shared_steps[1] / shared_steps[0] - 1) < 0.02
    assert concat_steps[1] > 1.2 * concat_steps[0] and concat[2] > 1.5 * shared[2]
    assert (flashbob.flash_attention, triton_ops.forward, triton_ops.backward, triton_ops.bob) == originals
