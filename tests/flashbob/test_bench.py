"""`python -m flashbob.bench`: the dispatcher, the one writer of results, and the plumbing of the `ab`,
`precision` and `first-call` subcommands at toy sizes (on the CPU in Triton's interpreter, timed by
the host clock or a stand-in timer: no timing is asserted)."""

import csv
import json
import os
import pathlib
import subprocess

import pytest
import torch

from flashbob import bench
from flashbob.bench import __main__ as entry
from flashbob.bench import ab, first_call, precision

ROOT = pathlib.Path(__file__).resolve().parents[2]
LOW = "fp32" if not torch.cuda.is_available() else "bf16"  # the interpreter's bfloat16 is wrong


def test_dispatcher_names_the_subcommands(capsys):
    entry.main(["--help"])
    printed = capsys.readouterr().out
    assert all(name in printed for name in entry.SUBCOMMANDS)
    with pytest.raises(SystemExit, match="unknown subcommand 'sweep'"):
        entry.main(["sweep"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_options_without_a_subcommand_run_speed():
    with pytest.raises(SystemExit, match="speed needs a CUDA GPU"):
        entry.main(["--n", "16"])


def test_results_writes_every_row_and_the_table(tmp_path, capsys):
    results = bench.Results(str(tmp_path), {"commit": "x"})
    results.record(case="a", ms=1.0)
    results.record(case="b", status="failed: X")
    results.finish("| table |\n")
    with open(tmp_path / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["case"], r["ms"], r["status"]) for r in rows] == [("a", "1.0", ""), ("b", "", "failed: X")]
    assert json.loads((tmp_path / "results.json").read_text())["meta"] == {"commit": "x"}
    assert (tmp_path / "table.md").read_text() == "| table |\n" and "| table |" in capsys.readouterr().out


def test_dtype_and_mask_names():
    assert bench.dtype_of("bf16") is torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        bench.dtype_of("fp8")
    assert bench.parse_mask("window64") == (True, 64)


def test_ab_rounds_rotate_the_order():
    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in ("A", "B", "yardstick")}
    times = ab.time_rounds(fns, rounds=3, iters=2)
    assert calls == ["A", "A", "B", "B", "yardstick", "yardstick", "B", "B", "yardstick", "yardstick",
                     "A", "A", "yardstick", "yardstick", "A", "A", "B", "B"]
    assert {name: len(t) for name, t in times.items()} == {"A": 3, "B": 3, "yardstick": 3}


def test_idle_time_is_what_no_kernel_covers_between_the_first_start_and_the_last_end():
    assert bench.idle_us([(10.0, 20.0), (25.0, 30.0), (0.0, 8.0)]) == 2.0 + 5.0
    assert bench.idle_us([(0.0, 10.0), (2.0, 5.0), (9.0, 12.0)]) == 0.0  # overlaps and nesting
    assert bench.idle_us([(3.0, 4.0)]) == 0.0
    assert bench.idle_us([]) == 0.0
    with pytest.raises(ValueError, match="reps=1"):
        bench.kernel_times(lambda: None, ["any"], reps=1)


@pytest.mark.slow
def test_ab_times_two_sides_and_the_yardstick(tmp_path, monkeypatch):
    """This tree as side A and again as side B (imported twice under their own names): every
    (case, mode, side) has a row, the ratios come from the per-round times, the outputs agree."""
    monkeypatch.setattr(ab, "block_ms", lambda fn, iters: 1.0)
    rows = ab.main(["--base", str(ROOT), "--side", f"again={ROOT}", "--n", "20", "--d", "16", "--mask",
                    "causal,window8", "--dtype", LOW, "--heads", "2", "--rounds", "2", "--iters", "1",
                    "--warm-jobs", "0", "--out", str(tmp_path)])
    assert [(r["mask"], r["mode"], r["side"]) for r in rows] == [
        (mask, mode, side) for mask in ("causal", "window8") for mode in ab.MODES for side in ("A", "again")]
    assert all(r["ratio"] == r["ratio_min"] == r["ratio_max"] == 1.0 and r["diff"] == 0.0 for r in rows)
    assert all(r["vs_yardstick"] == 1.0 and r["rounds"] == 2 and r["host_ms"] > 0 for r in rows)
    assert all(r["vs_cudnn"] == 1.0 and r["cudnn_ms"] == 1.0 for r in rows)  # the second yardstick
    table = (tmp_path / "table.md").read_text()
    assert "| window8 d16 N20" in table and "A = " in table and "again = " in table


def test_ab_sides_are_named_once_and_resolved(tmp_path):
    with pytest.raises(ValueError, match="NAME=WHERE"):
        ab.make_sides(str(ROOT), ["nowhere"])
    with pytest.raises(ValueError, match="side names must differ"):
        ab.make_sides(str(ROOT), [f"A={ROOT}"])
    sides = ab.make_sides(str(ROOT), [])
    package = str(ROOT / "flashbob")
    assert [(s.name, s.root) for s in sides] == [("A", package), ("this", package)]
    assert ab.resolve(package) == package
    assert len({s.module for s in sides}) == 2
    with pytest.raises(ValueError, match="neither a directory"):
        ab.resolve(str(tmp_path / "no-such-commit"))


IN_GIT = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode == 0


@pytest.mark.skipif(not IN_GIT, reason="not a git checkout")
def test_ab_extracts_a_commit_with_git_archive():
    package = ab.extract("HEAD", str(ROOT))
    assert os.path.basename(package) == "flashbob" and os.path.isfile(os.path.join(package, "triton_ops.py"))
    ops = ab.import_side(package, "flashbob_ab_test_head")
    assert ops.__name__ == "flashbob_ab_test_head.triton_ops" and callable(ops.bob)


def test_ab_takes_a_tree_from_before_the_rename(tmp_path):
    """Commits before the rename hold the package as kernels/: a directory or a commit of such a tree
    resolves to its kernels/ folder."""
    old = tmp_path / "old"
    (old / "kernels").mkdir(parents=True)
    (old / "kernels" / "triton_ops.py").write_text("def bob():\n    return 'old'\n")
    assert ab.resolve(str(old)) == str(old / "kernels")
    git = ["git", "-C", str(old), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "kernels"], ["commit", "-q", "-m", "old tree"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    package = ab.extract("HEAD", str(old))
    assert os.path.basename(package) == "kernels"
    assert ab.import_side(package, "flashbob_ab_test_old").bob() == "old"


def test_precision_records_every_mode_against_float64(tmp_path):
    rows = precision.main(["--dtype", "fp32,fp16", "--fp32-precision", "tf32x3,ieee", "--n", "17",
                           "--d", "16", "--mask", "causal", "--check-heads", "1", "--no-time",
                           "--out", str(tmp_path)])
    assert [(r["dtype"], r["mode"], r["status"]) for r in rows] == [
        ("fp32", "tf32x3", "ok"), ("fp32", "ieee", "ok"), ("fp16", "-", "ok")]
    # Float32's error, not tf32's (about 1e-3): the 2x bar of flashbob.validation holds at N=4096; at
    # N=17 (short sums, small reference errors) the H200 measured tf32x3 at 2.3x PyTorch float32's.
    assert all(r["worst_ratio_to_torch"] < 4 for r in rows if r["dtype"] == "fp32")
    assert "| fp16 | - | 16 | causal |" in (tmp_path / "table.md").read_text()


def test_precision_refuses_unknown_modes():
    with pytest.raises(SystemExit):
        precision.parse_args(["--fp32-precision", "bf16x3"])


def test_first_call_runs_a_family_in_a_fresh_process(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    monkeypatch.chdir(ROOT)
    rows = first_call.main(["--families", "2", "--n", "17", "--jobs", "1", "--out", str(tmp_path)])
    (row,) = rows
    assert row["status"] == "ok" and row["dtype"] == "fp32" and row["first_total_s"] > 0
    assert row["precompile"] is True  # on by default
    with pytest.raises(SystemExit):
        first_call.main(["--families", "99"])
