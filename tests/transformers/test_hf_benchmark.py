"""benchmarks/transformers_meta_step.py's logic on the CPU (its figures come from an H200)."""

import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).parents[2] / "benchmarks" / "transformers_meta_step.py"


def test_tiny_run_measures_every_attention(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location("transformers_meta_step", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # dataclasses look their module up there
    spec.loader.exec_module(bench)
    out = tmp_path / "rows.json"
    rows = bench.main(["--tiny", "--device", "cpu", "--dtype", "fp32", "--ns", "16", "--out", str(out)])
    assert [r["attn_implementation"] for r in rows] == ["bob", "eager", "sdpa"]
    assert all(r["status"] == "ok" and r["seconds"] > 0 and r["peak_gib"] > 0 for r in rows)
    assert out.is_file()
