"""A run never trains on through NaN: divergence stops it, names the step, the loss and the likely keys,
keeps the last good checkpoint; summaries are strict JSON; bad learning rates are refused by name."""

import json
import re
from types import SimpleNamespace

import pytest
import torch

from recipes import load_config
from ttt.config import ConfigError
from ttt.tracking import DivergenceError, DivergenceGuard, write_summary
from ttt.train import DIVERGED, main


def test_divergence_stops_the_run_with_the_step_loss_and_keys(tiny_overrides, tmp_path, capsys):
    assert main(tiny_overrides("maml_sinusoid", "run.name=nan", "inner.lr=1e20")) == DIVERGED
    err = capsys.readouterr().err
    assert "diverged at outer step 1" in err
    assert "train/outer_loss = " in err and "outer (query) loss" in err
    assert "outer_loss non-finite in all 2 passes" in err
    assert "inner.lr" in err and "trainer.precision" in err
    assert not (tmp_path / "nan" / "checkpoints" / "last.ckpt").exists()
    assert not (tmp_path / "nan" / "summary.json").exists()


def test_divergence_after_resume_keeps_the_last_good_checkpoint(tiny_overrides, tmp_path, capsys):
    assert main(tiny_overrides("maml_sinusoid", "run.name=good")) == 0
    checkpoint = tmp_path / "good" / "checkpoints" / "last.ckpt"
    before = checkpoint.read_bytes()
    resumed = [f"resume={tmp_path / 'good'}", "trainer.max_steps=4", "inner.lr=1e20"]
    assert main(resumed) == DIVERGED
    err = capsys.readouterr().err
    assert "diverged at outer step 3" in err and str(checkpoint) in err
    assert checkpoint.read_bytes() == before


def _trainer(**metrics):
    return SimpleNamespace(callback_metrics=metrics, global_step=7, current_epoch=0)


def test_guard_names_the_ttt_learners_loss():
    with pytest.raises(DivergenceError, match=r"outer step 7.*\n.*train/loss = inf"):
        DivergenceGuard().on_train_batch_end(
            _trainer(**{"train/loss": torch.tensor(float("inf"))}), None, {"loss": torch.tensor(1.0)}, None, 0
        )
    DivergenceGuard().on_train_batch_end(_trainer(**{"train/loss": torch.tensor(2.0)}), None, None, None, 0)


def test_guard_refuses_an_epoch_end_with_non_finite_parameters():
    module = torch.nn.Linear(2, 2)
    DivergenceGuard().on_train_epoch_end(_trainer(), module)
    with torch.no_grad():
        module.weight[0, 0] = float("nan")
    with pytest.raises(DivergenceError, match="weight"):
        DivergenceGuard().on_train_epoch_end(_trainer(), module)


def test_summary_is_strict_json(tmp_path):
    write_summary(tmp_path / "summary.json", {"a": float("nan"), "b": float("inf"), "c": 1.5, "d": None})

    def refuse(name):
        raise ValueError(f"bare {name} in summary.json")

    loaded = json.loads((tmp_path / "summary.json").read_text(), parse_constant=refuse)
    assert loaded == {"a": "nan", "b": "inf", "c": 1.5, "d": None}


@pytest.mark.parametrize(
    "override", ["inner.lr=0", "inner.lr=-0.1", "inner.lr=inf", "optim.lr=0", "optim.lr=nan"]
)
def test_bad_learning_rates_are_refused_by_name(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.") + " must be a positive finite float"):
        load_config(["recipe=maml_sinusoid", override])


def test_detect_anomaly_reaches_the_trainer(tiny_overrides, tmp_path):
    from ttt.tracking import OuterStepTimer, RunPaths
    from ttt.train import make_trainer

    cfg = load_config(tiny_overrides("maml_sinusoid", "trainer.detect_anomaly=true"))
    trainer = make_trainer(cfg, RunPaths(tmp_path), OuterStepTimer())
    assert trainer._detect_anomaly


def test_guard_names_the_passes():
    outputs = {
        "loss": torch.tensor(float("nan")),
        "pass_metrics": {
            "inner_loss_last": torch.tensor([1.0, float("inf"), 1.0]),
            "outer_loss": torch.tensor([1.0, float("nan"), float("nan")]),
            "query_acc": torch.tensor([0.5, 0.5, 0.5]),
        },
    }
    with pytest.raises(DivergenceError) as info:
        DivergenceGuard().on_train_batch_end(_trainer(), None, outputs, None, 0)
    message = str(info.value)
    assert "inner_loss_last non-finite in 1 of 3 passes (index 1)" in message
    assert "outer_loss non-finite in 2 of 3 passes (index 1, 2)" in message
    assert "query_acc" not in message


@pytest.mark.parametrize("recipe", ["maml_sinusoid", "ttt_e2e", "neural_memory", "sophia_lm"])
def test_the_keys_named_for_a_diverged_run_exist_in_its_recipe(recipe):
    """The inner-step keys a divergence names are keys of that recipe (the neural memory's write step
    has its own; sophia_lm has no inner steps), and the guard's message carries them."""
    cfg = load_config([f"recipe={recipe}"])
    keys = cfg.inner_step_keys
    named = re.findall(r"[a-z_]+\.[a-z_]+", keys or "")
    assert (not named) == (recipe == "sophia_lm"), keys
    for key in named:
        section, field = key.split(".")
        assert hasattr(getattr(cfg, section), field), key
    with pytest.raises(DivergenceError) as error:
        DivergenceGuard(inner_keys=keys).on_train_batch_end(
            _trainer(**{"train/loss": torch.tensor(float("nan"))}), None, None, None, 0
        )
    message = str(error.value)
    assert all(key in message for key in named) and "optim.lr" in message
    assert ("inner.lr" in message) == (recipe in ("maml_sinusoid", "ttt_e2e"))
