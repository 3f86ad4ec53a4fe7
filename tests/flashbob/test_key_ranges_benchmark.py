"""The logic of `python -m flashbob.bench ranges`: its correctness check (float32; the Triton interpreter on
the CPU) passes on the real kernels and stops on kernels that ignore the ranges, its settings give
the ranges and visible pairs they say, and its table reads the recorded rows."""

import pytest
import torch

from flashbob import triton_ops
from flashbob.bench import ranges as bench

SIZE = dict(b=3, h=1, n=40, d=16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the interpreter (tests/conftest.py)


def test_correctness_check_passes_on_the_kernels():
    errors = bench.check(DEVICE, torch.float32, **SIZE)
    assert set(errors) == {"out", "dq", "dk", "dv", "bob_q", "bob_k", "bob_v", "bob_dout"}
    assert max(errors.values()) < 2e-5


def test_correctness_check_stops_when_the_ranges_are_ignored(monkeypatch):
    real = triton_ops.forward

    def without_ranges(*args, key_range=None, **kwargs):
        return real(*args, **kwargs)

    monkeypatch.setattr(triton_ops, "forward", without_ranges)
    with pytest.raises(SystemExit, match="key-range check failed"):
        bench.check(DEVICE, torch.float32, **SIZE)


def test_settings_give_their_ranges_and_pairs():
    assert bench.key_ranges("none", 4, 64, "cpu") == {}
    full = bench.key_ranges("full", 4, 64, "cpu")
    assert full["key_start"].tolist() == [0] * 4 and full["key_end"].tolist() == [64] * 4
    left = bench.key_ranges("left", 4, 64, "cpu")
    assert left["key_start"].tolist() == [0, 8, 16, 32] and left["key_end"].tolist() == [64] * 4
    mask = torch.ones(64, 64, dtype=torch.bool).tril()
    starts = torch.tensor([0, 8, 16, 32])
    padded = mask[None] & (torch.arange(64)[None, None, :] >= starts[:, None, None])
    assert bench.visible_pairs("left", 4, 64) == int(padded.sum())
    assert bench.visible_pairs("full", 4, 64) == bench.visible_pairs("none", 4, 64) == 4 * int(mask.sum())


def test_table_reads_the_rows():
    rows = [{"d": 64, "n": 4096, "setting": s, "stage": "bob", "ms": ms, "pairs": pairs}
            for s, ms, pairs in (("none", 4.0, 100), ("full", 4.2, 100), ("left", 3.0, 70))]
    meta = {"gpu": "test", "torch": "x", "triton": "y", "commit": "z", "heads": 8, "check": "out 1e-3"}
    line = bench.markdown_table(rows, meta).splitlines()[-1]
    assert line == "| 64 | 4096 | bob | 4.00 | 4.20 | 1.05 | 3.00 | 0.75 | 0.70 |"
