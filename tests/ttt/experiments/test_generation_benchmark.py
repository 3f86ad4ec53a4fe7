"""`ttt.experiments.generation` at --tiny size on the CPU: its rows, candidates, best marks and goal
ratios (the logic the GPU session relies on; no time is asserted), and bad arguments named."""

import json

import pytest

from ttt.experiments import generation


@pytest.mark.parametrize("recipe", ["ttt_e2e_125m", "pretrained/llama3_2_1b"])
def test_tiny_rows_for_every_mode_candidate_and_length(recipe, tmp_path, capsys):
    """Every row is printed and written as measured, with its measurement named on stderr first."""
    out = tmp_path / "rows.jsonl"
    args = [f"recipe={recipe}", "--tiny", "--modes", "ttt,full", "--repeats", "1", "--decode-tokens", "20"]
    assert generation.main([*args, "--out", str(out)]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    printed = capsys.readouterr()
    assert printed.out.splitlines() == out.read_text().splitlines()
    assert len(printed.err.splitlines()) == len(lines) - 1 and "ttt/recipe: prefill 48 tokens" in printed.err
    rows, summary = lines[:-1], lines[-1]
    plan = [("prefill", 48), ("prefill", 96), ("decode", 48), ("decode", 96)]
    by_attention = {}
    for row in rows:
        assert row["recipe"] == recipe and row["device"] == "cpu" and row["dtype"] == "float32"
        by_attention.setdefault((row["mode"], row["attention"]), []).append((row["measure"], row["tokens"]))
    assert by_attention == {
        ("ttt", "recipe"): plan,
        ("full", "flashbob"): plan,
        ("full", "sdpa_flash"): plan,
        ("full", "sdpa_cudnn"): plan,
    }
    best = summary["best"]
    for row in rows:
        assert "best" not in row  # printed when measured, before its rivals
        if row["attention"] == "sdpa_cudnn":  # no cuDNN on the CPU
            assert row["status"] == "unsupported" and row["error"]
            assert all(b["attention"] != "sdpa_cudnn" for b in best)
            continue
        assert row["status"] == "ok" and row["peak_gib"] is None  # no CUDA memory to count
        if row["measure"] == "prefill":
            assert row["ms_per_1k_tokens"] > 0
        else:
            assert row["tokens_per_s"] > 0 and row["decode_tokens"] == 20
    full = next(row for row in rows if row["mode"] == "full")["overrides"]
    assert "ttt.enabled=false" in full and full[-2].endswith("window=null") and full[-1].endswith("=flashbob")
    for measure, tokens in plan:
        for mode in ("ttt", "full"):
            assert sum((b["mode"], b["measure"], b["tokens"]) == (mode, measure, tokens) for b in best) == 1
    goals = summary["summary"]
    assert set(goals["prefill_speedup_vs_full"]) == {"48", "96"}
    assert all(value > 0 for value in goals["prefill_speedup_vs_full"].values())
    assert goals["ttt_prefill_cost_ratio"] > 0 and goals["ttt_decode_rate_ratio"] > 0
    assert goals["ttt_decode_peak_ratio"] is None  # no CUDA


def test_mark_best_and_goals_read_the_fastest_ok_rows():
    rows = [
        {"mode": "ttt", "measure": "prefill", "tokens": 8, "status": "ok", "ms_per_1k_tokens": 2.0},
        {"mode": "ttt", "measure": "prefill", "tokens": 32, "status": "ok", "ms_per_1k_tokens": 2.2},
        {"mode": "full", "measure": "prefill", "tokens": 32, "status": "ok", "ms_per_1k_tokens": 9.0},
        {"mode": "full", "measure": "prefill", "tokens": 32, "status": "ok", "ms_per_1k_tokens": 6.6},
        {"mode": "full", "measure": "prefill", "tokens": 32, "status": "oom"},
    ]
    marked = generation.mark_best(rows[:2]) + generation.mark_best(rows[2:])
    assert [row["best"] for row in marked] == [True, True, False, True, False]
    goals = generation.goals(marked)
    assert goals["prefill_speedup_vs_full"] == {8: None, 32: pytest.approx(3.0)}
    assert goals["ttt_prefill_cost_ratio"] == pytest.approx(1.1) and goals["ttt_decode_rate_ratio"] is None


def test_bad_arguments_are_named():
    with pytest.raises(SystemExit):
        generation.main(["recipe=ttt_e2e", "--modes", "ttt,sideways"])
    with pytest.raises(SystemExit):
        generation.main(["recipe=ttt_e2e", "--lengths", "8,-1"])
    with pytest.raises(SystemExit, match="does not build a TTTTransformer"):
        generation.main(["recipe=neural_memory", "--modes", "ttt"])


def test_graphs_apply_to_the_window_modes_and_full_attention_runs_as_without(tmp_path, capsys):
    """--graphs: the ttt mode's rows measured with graphs (graphs=true), the full mode's as without it
    (graphs=false: its caches grow), every row ok but cuDNN's (none on the CPU)."""
    out = tmp_path / "rows.jsonl"
    args = ["recipe=ttt_e2e_125m", "--tiny", "--modes", "ttt,full", "--repeats", "1", "--decode-tokens", "20"]
    assert generation.main([*args, "--graphs", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()][:-1]
    assert all(row["graphs"] == (row["mode"] == "ttt") for row in rows)
    assert all(row["status"] == "ok" for row in rows if row["attention"] != "sdpa_cudnn")
