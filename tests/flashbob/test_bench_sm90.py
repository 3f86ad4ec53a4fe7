"""`python -m flashbob.bench sm90` compiles the kernels for sm_90 on a machine without a GPU (in a
subprocess: the test process runs Triton's interpreter, whose kernels cannot be compiled)."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import triton

from flashbob.bench import sm90

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUOBJDUMP = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
needs_tools = pytest.mark.skipif(not CUOBJDUMP.exists(),
                                 reason="Triton's NVIDIA backend tools are not installed")


def compile_rows(tmp_path, *args) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "flashbob.bench", "sm90", *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=True)
    return [json.loads(line) for line in done.stdout.splitlines()]


@needs_tools
def test_forward_with_key_ranges_compiles_for_sm90(tmp_path):
    (row,) = compile_rows(tmp_path, "--stage", "forward", "--d", "64", "--key-range")
    assert row["kernel"] == "attention_forward_kernel" and row["HAS_RANGE"] and row["CAUSAL"]
    assert (row["BLOCK_M"], row["BLOCK_N"], row["num_warps"], row["num_stages"]) == (64, 64, 4, 3)
    assert row["regs"] > 0 and row["shared_bytes"] > 0 and row["spill_stores"] == 0
    assert sum(row["hgmma"].values()) > 0  # wgmma: the Hopper code path, not the interpreter's
    assert row["estimate_bytes"] >= row["shared_bytes"]  # the estimate meets what Triton compiled


@needs_tools
def test_another_tree_with_the_same_kernels_compiles_the_same_code(tmp_path):
    """--tree imports a version's kernels under another name: this tree's own compile to the same
    SASS, so equal hashes mean the same code."""
    (own,) = compile_rows(tmp_path, "--stage", "forward", "--d", "32")
    (tree,) = compile_rows(tmp_path, "--stage", "forward", "--d", "32", "--tree", str(ROOT))
    assert own["sass_hash"] == tree["sass_hash"] and own["instructions"] == tree["instructions"] > 0


def test_refuses_to_run_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(SystemExit, match="unset TRITON_INTERPRET"):
        sm90.main(["--stage", "forward", "--d", "16"])


def test_instructions_leave_out_addresses_and_parameter_offsets():
    listing = ("        /*0010*/      LDC R1, c[0x0][0x28] ;      /* 0x00000a00ff017b82 */\n"
               "                                                  /* 0x000fe40000000800 */\n"
               "        /*0020*/      S2R R0, SR_TID.X ;          /* 0x0000000000007919 */\n")
    assert sm90.sass_instructions(listing) == ["LDC R1, c[0x0][.]", "S2R R0, SR_TID.X"]
