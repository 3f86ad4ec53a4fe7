"""benchmarks/sm90_resources.py compiles the kernels for sm_90 on a machine without a GPU (in a
subprocess: the test process runs Triton's interpreter, whose kernels cannot be compiled)."""

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import triton

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "sm90_resources.py"
CUOBJDUMP = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's NVIDIA backend tools are not installed")
def test_forward_with_key_ranges_compiles_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, str(SCRIPT), "--stage", "forward", "--d", "64", "--key-range"],
                          env=env, capture_output=True, text=True, timeout=300, check=True)
    (row,) = [json.loads(line) for line in done.stdout.splitlines()]
    assert row["kernel"] == "attention_forward_kernel" and row["HAS_RANGE"] and row["CAUSAL"]
    assert (row["BLOCK_M"], row["BLOCK_N"], row["num_warps"], row["num_stages"]) == (64, 64, 4, 3)
    assert row["regs"] > 0 and row["shared_bytes"] > 0 and row["spill_stores"] == 0
    assert sum(row["hgmma"].values()) > 0  # wgmma: the Hopper code path, not the interpreter's


def test_refuses_to_run_under_the_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = importlib.util.spec_from_file_location("sm90_resources", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit, match="unset TRITON_INTERPRET"):
        module.main(["--stage", "forward", "--d", "16"])
