"""`ttt.experiments.scale`: one JSON row per mode from the recipe's own training step, the model FLOP
count by hand, and bad arguments named."""

import json
from pathlib import Path

import pytest

from recipes import load_config
from ttt.experiments import scale
from ttt.meta.sharding import SecondOrderFSDPStrategy
from ttt.models import TransformerConfig


def test_model_flops_count_the_matrices_the_head_and_the_visible_keys():
    cfg = TransformerConfig(vocab_size=10, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, d_ff=16, window=3)
    # per layer: q 8x8, k and v 8x4 each, o 8x8 = 192; MLP 3 x 8 x 16 = 384; head 10 x 8 = 80
    matrix = 2 * (192 + 384) + 80 + 5
    keys = 1 + 2 + 3 + 3 + 3  # 5 positions, window 3
    attention = 4 * 2 * 2 * 4 * keys
    assert scale.keys_seen(5, 3) == keys and scale.keys_seen(5, None) == 15
    assert scale.model_flops_per_sequence(cfg, 5, extra_params=5) == 3 * (2 * matrix * 5 + attention)


def test_one_row_per_mode_from_the_recipes_training_step(tmp_path, capsys):
    out = tmp_path / "rows.jsonl"
    args = ["recipe=ttt_e2e", "trainer.meta_batch_size=2", "data.seq_len=64", "model.attention=eager"]
    options = ["--steps", "1", "--modes", "second,off", "--profile", "--sources", "--out", str(out)]
    assert scale.main([*args, *options]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["mode"] for row in rows] == ["second", "off"]
    for row in rows:
        assert row["status"] == "ok" and row["sequences"] == 2 and row["seq_len"] == 64
        assert row["s_per_step"] > 0 and row["tokens_per_s"] > 0 and row["model_tflop"] > 0
        assert row["step_s"] == [row["s_per_step"]]  # one timed step
        assert row["environment"]["device_type"] == "cpu" and row["environment"]["commit"]
        assert row["environment"]["command"].startswith("python -m ttt.experiments.scale recipe=ttt_e2e")
        assert row["peak_gib"] is None and row["mfu"] is None and row["alloc_retries"] is None  # no CUDA here
        assert "cuda_alloc_conf" in row["environment"]  # the allocator's settings, None when unset
        assert row["profile"] is None and row["sources"] is None  # their steps ran; they profile CUDA only
    assert rows[1]["overrides"][-1] == "ttt.enabled=false"


def test_bad_modes_and_recipes_without_a_module_builder_are_named():
    with pytest.raises(SystemExit):
        scale.main(["recipe=ttt_e2e", "--modes", "second,sideways"])
    with pytest.raises(SystemExit, match="not a text TTT recipe"):
        scale.main(["recipe=maml_sinusoid", "--steps", "1"])


@pytest.mark.slow
def test_a_row_under_fsdp_with_cpu_offload_on_one_device(tmp_path):
    """trainer.strategy=fsdp runs the step through the strategy ttt.train builds (its own process: the
    strategy starts a process group)."""
    import subprocess
    import sys

    out = tmp_path / "rows.jsonl"
    args = ["recipe=ttt_e2e", "trainer.meta_batch_size=2", "data.seq_len=64", "model.attention=eager"]
    args += ["trainer.strategy=fsdp", "trainer.fsdp_cpu_offload=true"]
    command = [sys.executable, "-m", "ttt.experiments.scale", *args, "--steps", "1", "--modes", "second"]
    subprocess.run([*command, "--out", str(out)], check=True, capture_output=True, timeout=600)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["status"] == "ok" and row["s_per_step"] > 0
    assert "trainer.fsdp_cpu_offload=true" in row["overrides"]
    strategy = scale.one_device_strategy(load_config(args))
    assert isinstance(strategy, SecondOrderFSDPStrategy) and strategy.cpu_offload
    assert scale.one_device_strategy(load_config(args[:4])) == "auto"


@pytest.mark.slow
def test_an_ab_against_a_base_directory_alternates_the_trees_and_sums_up_the_ratio(tmp_path, capsys):
    """--base DIR --rounds 2: each round runs both trees, in alternating order, each in a process of its
    own running its own code (the base copy's scale.py marks its rows); the summary gives this / base."""
    import shutil

    from ttt.experiments import step_ab

    base = tmp_path / "base"
    for folder in step_ab.PROJECT_FOLDERS:
        shutil.copytree(step_ab.this_tree().root + "/" + folder, base / folder,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    marked = base / "ttt" / "experiments" / "scale.py"
    mark = ('emit({"mode": mode, ', 'emit({"mode": mode, "copy": 1, ')
    marked.write_text(marked.read_text().replace(*mark))
    out = tmp_path / "rows.jsonl"
    args = ["recipe=ttt_e2e", "trainer.meta_batch_size=2", "data.seq_len=32", "model.attention=eager"]
    options = ["--steps", "1", "--modes", "off", "--base", str(base), "--rounds", "2", "--out", str(out)]
    assert scale.main([*args, *options]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    order = [(row["round"], row["tree"]) for row in rows]
    assert order == [(0, "this"), (0, "base"), (1, "base"), (1, "this")]
    assert all(("copy" in row) == (row["tree"] == "base") for row in rows)
    assert all(row["status"] == "ok" and row["s_per_step"] > 0 for row in rows)
    assert {row["code"] for row in rows if row["tree"] == "base"} == {str(base)}  # no .git there
    table = capsys.readouterr().out
    assert "| mode | this s/step by round | base s/step by round | this / base" in table
    (line,) = [line for line in table.splitlines() if line.startswith("| off |")]
    ratios = [rows[3]["s_per_step"] / rows[2]["s_per_step"], rows[0]["s_per_step"] / rows[1]["s_per_step"]]
    assert f"{sorted(ratios)[0]:.3f}, {sorted(ratios)[1]:.3f}]" in line


def test_a_base_that_is_neither_a_tree_nor_a_commit_is_named(tmp_path, capsys):
    args = ["recipe=ttt_e2e", "--steps", "1", "--modes", "off", "--base", str(tmp_path / "nowhere")]
    assert scale.main(args) == 2
    err = capsys.readouterr().err
    assert "--base must be a directory holding ttt/experiments/scale.py or a commit" in err
    with pytest.raises(SystemExit):
        scale.main(["recipe=ttt_e2e", "--base", str(tmp_path), "--profile"])


def test_a_base_commit_is_extracted_with_the_project_folders():
    """--base COMMIT: `git archive` of ttt/, flashbob/, recipes/ and configs/ into a directory of its own,
    named by the short commit."""
    import shutil
    import subprocess

    from ttt.experiments import step_ab

    root = step_ab.this_tree().root
    try:
        head = step_ab.git(root, "rev-parse", "--short=12", "HEAD").strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("this tree is not a git checkout")
    tree = step_ab.base_tree("HEAD")
    assert tree.label == "base" and tree.code == head and tree.root != root and tree.extracted
    wanted = ("ttt/experiments/scale.py", "flashbob/api.py", "recipes/__init__.py", "configs/ttt_e2e.yaml")
    for path in wanted:
        assert (Path(tree.root) / path).is_file(), path
    shutil.rmtree(tree.root)


def test_a_tree_is_named_by_its_own_checkout_only():
    """The checkout's top names its commit (flashbob.environment's, "+dirty" when changed); a folder
    inside it, like a copy of another tree kept there, is not that commit: it is named by its path."""
    import subprocess

    from ttt.experiments import step_ab

    root = step_ab.this_tree().root
    try:
        head = step_ab.git(root, "rev-parse", "--short=12", "HEAD").strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("this tree is not a git checkout")
    assert step_ab.code_of(root).removesuffix("+dirty") == head
    assert step_ab.code_of(f"{root}/ttt") == f"{root}/ttt"



def test_an_ab_with_a_budget_stops_before_a_process_that_might_pass_it(monkeypatch, capsys):
    """Processes of 100 s (the fake clock's), a budget of 350 s: this, base, base run (300 s used, and
    300 + 100 > 350), round 2's `this` does not; the summary pairs round 1 alone and shows round 2's
    lone base time."""
    from ttt.experiments import step_ab

    clock = [0.0]
    monkeypatch.setattr(step_ab.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(step_ab, "base_tree", lambda where: step_ab.Tree("base", where, "basecode"))

    def measure(tree, overrides, modes, steps):
        clock[0] += 100.0
        return [{"mode": "second", "status": "ok", "s_per_step": 2.0 if tree.label == "this" else 4.0}]

    monkeypatch.setattr(step_ab, "measure_tree", measure)
    rows = step_ab.run(["recipe=ttt_e2e"], ["second"], 1, "/nowhere", 3, None, budget_s=350.0)
    assert [(row["round"], row["tree"]) for row in rows] == [(0, "this"), (0, "base"), (1, "base")]
    printed = capsys.readouterr().out
    assert "stopped before round 2's this tree: 300 s of the 350 s budget used" in printed
    assert "| second | 2.000 | 4.000, 4.000 | 0.500 [0.500, 0.500] |" in printed
    assert step_ab.summary(rows[2:], [step_ab.this_tree(), step_ab.Tree("base", "", "b")]).endswith(
        "no round ran both trees |"
    )
    with pytest.raises(SystemExit):
        scale.main(["recipe=ttt_e2e", "--base", "/nowhere", "--budget", "0"])


def test_base_overrides_go_to_the_base_side_alone(monkeypatch, capsys):
    """--base . --base-override KEY=VALUE: an A/B of options in one tree; the base's code names them."""
    from ttt.experiments import step_ab

    seen = {}

    def measure(tree, overrides, modes, steps):
        seen[tree.label] = overrides
        return [{"mode": "off", "status": "ok", "s_per_step": 1.0}]

    monkeypatch.setattr(step_ab, "measure_tree", measure)
    option = ("ttt.compile_prefix=false",)
    rows = step_ab.run(["recipe=ttt_e2e"], ["off"], 1, ".", 1, None, base_overrides=option)
    assert seen == {"this": ["recipe=ttt_e2e"], "base": ["recipe=ttt_e2e", "ttt.compile_prefix=false"]}
    assert rows[1]["code"].endswith(" ttt.compile_prefix=false")
    with pytest.raises(SystemExit):
        scale.main(["recipe=ttt_e2e", "--base-override", "ttt.compile_prefix=false"])
    assert "--base-override needs --base" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # refused before either tree runs
        scale.main(["recipe=ttt_e2e", "--base", ".", "--base-override", "oops"])
    assert "--base-override: override 'oops' must look like key=value" in capsys.readouterr().err
