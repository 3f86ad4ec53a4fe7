"""ttt/experiments/transformers_meta_step.py's logic on the CPU (its figures come from an H200)."""

from ttt.experiments import transformers_meta_step as bench


def test_tiny_run_measures_every_attention(tmp_path):
    out = tmp_path / "rows.json"
    rows = bench.main(["--tiny", "--device", "cpu", "--dtype", "fp32", "--ns", "16", "--out", str(out)])
    assert [r["attn_implementation"] for r in rows] == ["bob", "eager", "sdpa"]
    assert all(r["status"] == "ok" and r["seconds"] > 0 and r["peak_gib"] > 0 for r in rows)
    assert out.is_file()
