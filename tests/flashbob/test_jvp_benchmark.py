"""The logic of `python -m flashbob.bench jvp`: its correctness check (float32; the Triton interpreter
on the CPU) passes on the real kernels and stops on a wrong one, and its table reads the recorded rows."""

import pytest
import torch

from flashbob import triton_ops
from flashbob.bench import jvp as bench

SIZE = (1, 1, 23, 16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the interpreter (tests/conftest.py)


def test_correctness_check_passes_on_the_kernels():
    errors = bench.check_correctness(DEVICE, torch.float32, size=SIZE)
    assert set(errors) == {"out", "t_out", "g_q", "g_k", "g_v", "g_tq", "g_tk", "g_tv"}
    assert max(errors.values()) < 1e-5


def test_correctness_check_stops_on_a_wrong_tangent(monkeypatch):
    real = triton_ops.jvp

    def off_by_a_bit(*args, **kwargs):
        out, lse, t_out = real(*args, **kwargs)
        return out, lse, t_out * 1.01

    monkeypatch.setattr(triton_ops, "jvp", off_by_a_bit)
    with pytest.raises(SystemExit, match="t_out"):
        bench.check_correctness(DEVICE, torch.float32, size=SIZE)


def test_table_reads_the_rows():
    base = {"n": 4096, "d": 64, "mask": "causal", "dtype": "bf16", "batch": 1, "heads": 8,
            "first_call_s": 1.0, "tflops": 100.0}
    rows = [{**base, "method": m, "ms": ms, "peak_gib": 1.0, "status": "ok"}
            for m, ms in (("ours_forward", 2.0), ("ours_jvp_kernel", 3.0), ("ours_jvp", 5.0),
                          ("ours_backward", 4.0), ("ours_grad_jvp", 12.0))]
    rows.append({**base, "method": "torch_jvp", "ms": None, "peak_gib": None, "status": "oom"})
    meta = {"gpu": "test", "torch": "x", "triton": "y", "commit": "z", "batch": 1, "heads": 8,
            "check": "bf16 1e-3"}
    line = bench.markdown_table(rows, meta).splitlines()[-1]
    assert line.startswith("| 64 | 4096 | 2.00 | 3.00 (100) | 5.00 | 2.50 |")
    assert "| 12.00 (100) | 3.00 | OOM | - |" in line
