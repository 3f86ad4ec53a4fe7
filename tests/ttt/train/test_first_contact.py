"""What a new user meets first: a missing GPU is named before anything is written, --help lists a
recipe's keys with their docs, redirected logs carry no progress bar, and every run writes plots."""

import pytest
import torch

from ttt.train import main


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a CUDA GPU")
def test_gpu_accelerator_without_a_gpu_fails_before_the_run_directory(tiny_overrides, tmp_path, capsys):
    assert main(tiny_overrides("maml_sinusoid", "run.name=gpu", "trainer.accelerator=gpu")) == 2
    assert "trainer.accelerator=gpu" in capsys.readouterr().err
    assert not (tmp_path / "gpu").exists()


def test_recipe_help_lists_every_key_with_type_value_and_doc(capsys):
    assert main(["recipe=maml_sinusoid", "inner.lr=0.05", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("recipe maml_sinusoid\n")
    assert "  inner.lr: float = 0.05\n      Inner learning rate" in out
    assert "  trainer.max_steps: int = " in out and "Outer (meta) optimizer steps." in out
    assert "  optim.schedule_steps: int | None = " in out
    assert "  trainer.detect_anomaly: bool = false" in out


def test_help_gives_every_recipe_its_whole_description_in_one_column(capsys):
    """Names as long as pretrained/qwen2_5_0_5b keep the column; descriptions are not cut mid-sentence."""
    from recipes import available_recipes
    from ttt.config.loading import recipe_header

    assert main(["--help"]) == 0
    listing = capsys.readouterr().out.split("\nRecipes\n", 1)[1].rstrip("\n").splitlines()
    recipes = available_recipes()
    column = 4 + max(len(name) for name in recipes) + 2
    described: dict[str, list[str]] = {}
    for line in listing:
        assert len(line) <= 100 and line[column] != " ", line
        name = line[:column].strip()
        if name:
            described[name] = []
        described[list(described)[-1]].append(line[column:])
    first_paragraphs = {name: recipe_header(path).split("\n\n")[0].split() for name, path in recipes.items()}
    assert {name: " ".join(lines).split() for name, lines in described.items()} == first_paragraphs


def test_recipe_help_lists_the_keys_of_a_section_that_is_null_by_default(capsys):
    assert main(["recipe=ttt_pretrained_toy", "--help"]) == 0
    out = capsys.readouterr().out
    assert "  model.architecture.rope_scaling: RopeScaling | None = null\n" in out
    assert "  model.architecture.rope_scaling.factor: float = 8.0\n" in out
    assert "(default once model.architecture.rope_scaling is given)" in out
    assert main(["--help"]) == 0
    assert "recipe=NAME --help" in capsys.readouterr().out


def test_recipe_help_with_a_bad_key_names_it(capsys):
    assert main(["recipe=maml_sinusoid", "inner.lrr=1", "--help"]) == 2
    assert "inner.lrr" in capsys.readouterr().err


def test_no_progress_bar_when_stdout_is_not_a_terminal(tiny_overrides, tmp_path):
    from recipes import load_config
    from ttt.tracking import OuterStepTimer, RunPaths
    from ttt.train import make_trainer

    cfg = load_config(tiny_overrides("maml_sinusoid", "trainer.progress_bar=true"))
    trainer = make_trainer(cfg, RunPaths(tmp_path), OuterStepTimer())  # pytest captures stdout
    assert trainer.progress_bar_callback is None


def test_a_maml_run_writes_training_curves_and_adapted_vs_unadapted_figures(tiny_overrides, tmp_path):
    from ttt.tracking.report import read_logged_metrics

    assert main(tiny_overrides("maml_sinusoid", "run.name=plots", "trainer.log_every_n_steps=1")) == 0
    run = tmp_path / "plots"
    for name in ("training_curves.png", "test_adapted_vs_unadapted.png"):
        assert (run / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    logged = read_logged_metrics(run)
    assert [step for step, _ in logged["train/outer_loss"]] == [0, 1]
    assert [step for step, _ in logged["val/query_loss_adapted"]] == [1]


def test_adapted_vs_unadapted_figure_skips_what_it_cannot_draw(tmp_path):
    from ttt.tracking.report import adapted_pairs, write_run_report

    summary = {"query_loss_unadapted": 2.0, "query_loss_adapted": 1.0, "query_acc_unadapted": "nan"}
    summary["query_acc_adapted"] = 0.5
    assert adapted_pairs(summary) == ["query_loss"]
    assert write_run_report(tmp_path, {"outer_steps": 3}) == {}  # no logs, no pairs: no figure
