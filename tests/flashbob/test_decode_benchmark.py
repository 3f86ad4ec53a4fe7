"""The logic of `python -m flashbob.bench decode` without a GPU: SDPA's masks match flash_attention's
bottom-right causal and window masks, the correctness check stops where split is off, the table reads
the recorded rows, the options parse, and a tiny run (float32, the Triton interpreter, the host clock
standing in for CUDA graphs) records every candidate, one that raises as unsupported."""

import pytest
import torch

import flashbob
from flashbob.bench import decode as bench

LOW = "fp32" if not torch.cuda.is_available() else "bf16"  # the interpreter's bfloat16 is wrong


@pytest.mark.parametrize("n, m, causal, window", [(1, 9, True, None), (3, 9, True, None), (3, 9, True, 4),
                                                  (1, 9, True, 4), (3, 9, False, None)])
def test_sdpa_masks_give_flash_attention_outputs(n, m, causal, window):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, rows, 8, generator=gen, dtype=torch.float64) for rows in (n, m, m))
    k, v = k[:, :2], v[:, :2]
    mask = bench.sdpa_mask(n, m, causal, window, "cpu")
    assert (mask is None) == (n == 1 and window is None or not causal)
    with sdpa_kernel(SDPBackend.MATH):
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    want = flashbob.flash_attention(q, k, v, causal=causal, window=window, backend="torch")
    assert torch.allclose(got, want, atol=1e-12)


def test_sdpa_mask_is_bottom_right():
    assert bench.sdpa_mask(2, 5, True, None, "cpu").int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert bench.sdpa_mask(2, 5, True, 2, "cpu").int().tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


def test_check_stops_when_split_is_off():
    gen = torch.Generator().manual_seed(0)
    reference = torch.randn(1, 2, 4, 8, generator=gen, dtype=torch.float64)
    plain = reference + 1e-3 * torch.randn(reference.shape, generator=gen, dtype=torch.float64)
    errors = bench.check({"split": plain, "plain": plain}, reference, torch.bfloat16, "here")
    assert errors["split"] == errors["plain"] == pytest.approx(1e-3, rel=0.5)
    with pytest.raises(SystemExit, match="decode check failed at here: split's error"):
        bench.check({"split": reference * 1.01, "plain": plain}, reference, torch.bfloat16, "here")
    floor_only = {"split": reference * (1 + 1e-5), "plain": reference}  # within the float32 floor 2e-5
    assert bench.check(floor_only, reference, torch.float32, "here")["split"] == pytest.approx(1e-5)


def test_options_parse():
    args = bench.parse_args(["--out", "x"])
    assert args.heads == [(12, 12), (32, 8)] and args.sdpa == ["flash", "cudnn"]
    assert (args.n, args.m, args.d) == ("1,4,16", "8192,32768,131072", "64")
    assert len(bench.cases(args)) == 2 * 3 * 3
    assert bench.cases(args)[1] == bench.Case(1, 12, 12, 4, 8192, 64, "causal", "bf16")
    assert bench.parse_args(["--sdpa", "flash"]).sdpa == ["flash"]
    for bad in (["--heads", "12:5"], ["--heads", "12"], ["--mask", "sliding"], ["--rounds", "0"],
                ["--sdpa", "math"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)


def test_table_reads_the_rows():
    case = {"batch": 1, "heads_q": 32, "heads_kv": 8, "n": 4, "m": 8192, "d": 64, "mask": "causal",
            "dtype": "bf16", "splits": 9}
    timed = {"split": (20.0, 4e-3), "plain": (70.0, 4e-3), "sdpa_flash": (None, None),
             "sdpa_cudnn": (25.0, 5e-3)}
    rows = [{**case, "candidate": name, "status": "ok" if us else "failed: RuntimeError: no kernel",
             "rel_err": err, "us": us, "us_min": us and us - 1, "us_max": us and us + 2,
             "wall_us": us and us + 30} for name, (us, err) in timed.items()]
    info = {"device": "test", "device_type": "cuda", "torch": "x", "triton": "y", "cudnn": 91002,
            "commit": "z", "batch": 1, "dtype": "bf16", "calls": 50, "replays": 20, "rounds": 5,
            "command": "python -m flashbob.bench decode"}
    lines = bench.markdown_table(rows, info).splitlines()
    assert ("| 32:8 N4 M8192 d64 causal | 9 | 20.0 [19.0, 22.0] | 70.0 [69.0, 72.0] | unsupported | "
            "25.0 [24.0, 27.0] | 3.50 | 1.25 (sdpa_cudnn) |") in lines
    assert lines[-1] == ("| 32:8 N4 M8192 d64 causal | 50.0 (4.0e-03) | 100.0 (4.0e-03) | unsupported | "
                         "55.0 (5.0e-03) |")
    without_sdpa = bench.markdown_table(rows[:2], info).splitlines()
    assert "| case | splits | split us | plain us | plain / split | best SDPA / split |" in without_sdpa
    assert without_sdpa[-1] == "| 32:8 N4 M8192 d64 causal | 50.0 (4.0e-03) | 100.0 (4.0e-03) |"


def test_a_tiny_run_records_every_candidate(tmp_path, monkeypatch):
    """Hq=2, M=512: the interpreter's rule splits the keys in two; cuDNN, which the CPU lacks, raises."""
    from torch.nn.attention import SDPBackend

    monkeypatch.setattr(bench, "sdpa_backends", lambda kinds: {"sdpa_flash": SDPBackend.MATH,
                                                               "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION})
    rows = bench.main(["--n", "1,4", "--m", "512", "--heads", "2:1", "--d", "16", "--dtype", LOW,
                       "--calls", "1", "--replays", "1", "--rounds", "2", "--out", str(tmp_path)])
    assert [(r["n"], r["candidate"]) for r in rows] == [(n, c) for n in (1, 4) for c in bench.CANDIDATES]
    assert all(r["splits"] == 2 for r in rows)
    ran = [r for r in rows if r["candidate"] != "sdpa_cudnn"]
    assert all(r["status"] == "ok" and r["rel_err"] < 1e-5 and r["us"] > 0 and r["wall_us"] > 0 for r in ran)
    failed = [r for r in rows if r["candidate"] == "sdpa_cudnn"]
    assert all(r["status"].startswith("failed: RuntimeError") and r["us"] is None for r in failed)
    table = (tmp_path / "table.md").read_text()
    assert "| 2:1 N4 M512 d16 causal | 2 |" in table and "unsupported" in table
