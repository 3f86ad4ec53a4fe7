"""Tiny end-to-end runs of every recipe through the command line, and resume = uninterrupted."""

import json
import math

import lightning.pytorch as pl
import lightning.pytorch.callbacks.timer as lightning_timer
import pytest
import torch

import ttt.train
from ttt.train import main, make_trainer


@pytest.mark.parametrize("recipe", ["maml_longctx", "maml_sinusoid"])
def test_tiny_recipe_run_writes_the_run_directory(recipe, tiny_overrides, tmp_path, capsys):
    assert main(tiny_overrides(recipe, "run.name=tiny")) == 0
    run = tmp_path / "tiny"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outer_steps"] == 2 and summary["recipe"] == recipe
    assert summary["query_loss_adapted"] != summary["query_loss_unadapted"]
    if recipe == "maml_longctx":
        assert {"query_acc_adapted", "query_acc_unadapted"} <= set(summary)
    assert summary["time_per_outer_step_s"] > 0 and summary["first_outer_step_s"] > 0
    assert summary["peak_memory_gib"] is None
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    assert "val/query_loss_adapted" in (run / "logs" / "version_0" / "metrics.csv").read_text()
    assert "query_loss" in capsys.readouterr().out
    assert not list(run.rglob("*.tmp"))


class _MinutePerStep(pl.Callback):
    """A clock for Lightning's Timer on which every outer step takes one minute (it advances when a
    step starts, so the step ends at the next whole minute whatever the order of the callbacks)."""

    def __init__(self):
        self.seconds = 0.0

    def monotonic(self) -> float:
        return self.seconds

    def on_train_batch_start(self, *args, **kwargs):
        self.seconds += 60.0


def test_time_limit_stops_training_then_tests(tiny_overrides, tmp_path, monkeypatch):
    """trainer.max_minutes stops training at the first step that ends past the limit, then the run
    tests and writes its summary. The clock is simulated (a minute per step), so the test does not
    depend on how fast the machine is."""
    clock = _MinutePerStep()
    monkeypatch.setattr(lightning_timer, "time", clock)

    def timed_trainer(*args, **kwargs):
        trainer = make_trainer(*args, **kwargs)
        trainer.callbacks.append(clock)
        return trainer

    monkeypatch.setattr(ttt.train, "make_trainer", timed_trainer)
    limited = ["trainer.max_steps=50", "trainer.steps_per_epoch=50", "trainer.max_minutes=2.5"]
    assert main(tiny_overrides("maml_sinusoid", "run.name=timed", *limited)) == 0
    summary = json.loads((tmp_path / "timed" / "summary.json").read_text())
    assert summary["outer_steps"] == 3 and "query_loss_adapted" in summary  # step 3 ends at 3 minutes


def test_existing_run_directory_is_not_overwritten(tiny_overrides, tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("x")
    assert main(tiny_overrides("maml_sinusoid", "run.name=taken")) == 2


def _state(run):
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)


class _Crash(Exception):
    """Stands for the process dying."""


class _CrashAtEpoch(pl.Callback):
    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            raise _Crash


@pytest.mark.parametrize("precision", ["32-true", "64-true"])
def test_interrupted_and_resumed_run_reaches_the_uninterrupted_state(
    precision, tiny_overrides, tmp_path, monkeypatch
):
    four_steps = [
        "trainer.max_steps=4",
        "trainer.steps_per_epoch=2",
        "inner.learnable_lr=tensor",
        f"trainer.precision={precision}",
    ]
    assert main(tiny_overrides("maml_longctx", "run.name=straight", *four_steps)) == 0

    def crashing_trainer(*args, **kwargs):
        trainer = make_trainer(*args, **kwargs)
        trainer.callbacks.append(_CrashAtEpoch(1))
        return trainer

    monkeypatch.setattr(ttt.train, "make_trainer", crashing_trainer)
    with pytest.raises(_Crash):
        main(tiny_overrides("maml_longctx", "run.name=crashed", *four_steps))
    assert _state(tmp_path / "crashed")["global_step"] == 2
    monkeypatch.setattr(ttt.train, "make_trainer", make_trainer)
    assert main([f"resume={tmp_path / 'crashed'}"]) == 0

    straight, resumed = _state(tmp_path / "straight"), _state(tmp_path / "crashed")
    assert resumed["global_step"] == straight["global_step"] == 4
    assert straight["state_dict"].keys() == resumed["state_dict"].keys()
    for name, value in straight["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=0, atol=0, msg=name)
    moments = [s["exp_avg"] for s in straight["optimizer_states"][0]["state"].values()]
    resumed_moments = [s["exp_avg"] for s in resumed["optimizer_states"][0]["state"].values()]
    assert len(moments) == len(resumed_moments) > 0
    for a, b in zip(moments, resumed_moments):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    fresh = json.loads((tmp_path / "straight" / "summary.json").read_text())
    again = json.loads((tmp_path / "crashed" / "summary.json").read_text())
    assert fresh["query_loss_adapted"] == again["query_loss_adapted"]


def test_a_finished_run_can_be_extended(tiny_overrides, tmp_path):
    assert main(tiny_overrides("maml_sinusoid", "run.name=short")) == 0
    assert main([f"resume={tmp_path / 'short'}", "trainer.max_steps=4"]) == 0
    assert _state(tmp_path / "short")["global_step"] == 4
    assert sorted(p.parent.name for p in (tmp_path / "short" / "logs").rglob("metrics.csv")) == [
        "version_0",
        "version_1",
    ]


def test_resume_of_a_missing_run_fails_clearly(tmp_path, capsys):
    assert main([f"resume={tmp_path / 'nothing'}"]) == 2
    assert "expected a run directory or a checkpoint file" in capsys.readouterr().err


def test_bf16_mixed_precision_run_is_close_to_float32_but_computed_in_bf16(tiny_overrides, tmp_path):
    summaries = {}
    for precision in ("32-true", "bf16-mixed"):
        assert (
            main(tiny_overrides("maml_longctx", f"run.name={precision}", f"trainer.precision={precision}"))
            == 0
        )
        summaries[precision] = json.loads((tmp_path / precision / "summary.json").read_text())
    full, mixed = summaries["32-true"], summaries["bf16-mixed"]
    for key in ("query_loss_unadapted", "query_loss_adapted", "context_loss_adapted"):
        assert math.isfinite(mixed[key]), key
        assert mixed[key] != full[key], f"{key}: bf16-mixed gave the float32 value (no autocast?)"
        assert mixed[key] == pytest.approx(full[key], rel=2e-3), key  # measured: 3e-5


def test_maml_longctx_trains_under_a_pair_curriculum(tiny_overrides, tmp_path):
    curriculum = ["task.curriculum_start_pairs=1", "task.curriculum_steps=2", "run.name=curriculum"]
    assert main(tiny_overrides("maml_longctx", *curriculum)) == 0
    summary = json.loads((tmp_path / "curriculum" / "summary.json").read_text())
    assert summary["outer_steps"] == 2 and math.isfinite(summary["query_loss_adapted"])
