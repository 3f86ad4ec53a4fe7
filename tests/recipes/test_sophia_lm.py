"""recipe=sophia_lm at toy size through the command line: the summary's figures, both models trained
and different, resume = uninterrupted (both models, both optimizers, the probe generator), the
equal-time comparison on synthetic curves, and the config errors."""

import json

import lightning.pytorch as pl
import pytest
import torch
from tiny_configs import TINY_TRAINER, write_tiny_corpus

import ttt.train
from recipes import load_builder, load_config
from ttt.config import ConfigError
from ttt.learners.optimizer_comparison import equal_time_comparison, loss_at_time
from ttt.train import main, make_trainer

OPTIMIZER_FIGURES = {
    "lr",
    "final_val_loss",
    "best_val_loss",
    "time_per_step_s",
    "first_step_s",
    "train_s",
    "hvp_share_of_step_time",
    "hvp_s_per_estimate",
    "hessian_estimates",
    "peak_memory_gib",
}


@pytest.fixture
def tiny_sophia_lm(tmp_path):
    corpus = write_tiny_corpus(tmp_path / "corpus")
    return [
        "recipe=sophia_lm",
        f"data.corpus={corpus}",
        "data.seq_len=32",
        "data.held_out_every=3",
        "model.d_model=16",
        "model.n_heads=2",
        "optim.hessian_update_interval=3",
        *TINY_TRAINER,
        "trainer.max_steps=4",
        "trainer.log_every_n_steps=1",
        f"run.root={tmp_path / 'runs'}",
    ]


def _state(run):
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)


def _strict_json(path):
    def refuse(constant):
        raise ValueError(f"{path.name}: {constant} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_tiny_run_trains_both_models_and_writes_every_figure(tiny_sophia_lm, tmp_path):
    assert main([*tiny_sophia_lm, "run.name=tiny"]) == 0
    run = tmp_path / "runs" / "tiny"
    summary = _strict_json(run / "summary.json")
    assert summary["outer_steps"] == 4 and summary["recipe"] == "sophia_lm"
    assert {"loss_adamw", "loss_sophia_h"} <= set(summary)  # test-set losses
    figures = summary["optimizers"]
    assert set(figures) == {"adamw", "sophia_h"}
    for name, row in figures.items():
        assert set(row) == OPTIMIZER_FIGURES, name
        assert row["time_per_step_s"] > 0 and row["peak_memory_gib"] is None  # no CUDA here
        assert 0 < row["best_val_loss"] <= row["final_val_loss"] < 6
    assert figures["adamw"]["lr"] == 2.0e-3 and figures["sophia_h"]["lr"] == 0.05
    assert figures["adamw"]["hessian_estimates"] == 0 and figures["adamw"]["hvp_share_of_step_time"] == 0
    assert figures["sophia_h"]["hessian_estimates"] == 2  # steps 1 and 4 with an interval of 3
    assert 0 < figures["sophia_h"]["hvp_share_of_step_time"] < 1
    curve = summary["held_out_curve"]
    assert [row["step"] for row in curve] == [2, 4]
    assert curve[1]["sophia_h"]["train_s"] == pytest.approx(figures["sophia_h"]["train_s"])
    equal = summary["equal_time"]
    assert equal["faster"] in figures and equal["budget_s"] == figures[equal["faster"]]["train_s"]
    assert equal["loss"][equal["faster"]] == figures[equal["faster"]]["final_val_loss"]
    assert (run / "optimizer_comparison.png").read_bytes()[:4] == b"\x89PNG"
    metrics = (run / "logs" / "version_0" / "metrics.csv").read_text().splitlines()[0].split(",")
    assert {"val/loss_adamw", "val/loss_sophia_h", "train/loss_adamw", "train/hvp_s"} <= set(metrics)

    # Both copies started from the same weights, both moved, and they moved differently.
    cfg = load_config(tiny_sophia_lm)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    initial = load_builder(cfg.builder).build(cfg)[0].state_dict()
    trained = _state(run)["state_dict"]
    for key in [k for k in initial if k.startswith("models.adamw.")]:
        twin = key.replace("models.adamw.", "models.sophia_h.")
        torch.testing.assert_close(initial[key], initial[twin], rtol=0, atol=0)
        if "norm" not in key:
            assert not torch.equal(trained[key], initial[key]), key
            assert not torch.equal(trained[twin], initial[twin]), twin
            assert not torch.equal(trained[key], trained[twin]), key


class _Crash(Exception):
    """Stands for the process dying."""


class _CrashAtEpoch(pl.Callback):
    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == 1:
            raise _Crash


def test_interrupted_and_resumed_run_reaches_the_uninterrupted_state(tiny_sophia_lm, tmp_path, monkeypatch):
    assert main([*tiny_sophia_lm, "run.name=straight"]) == 0

    def crashing_trainer(*args, **kwargs):
        trainer = make_trainer(*args, **kwargs)
        trainer.callbacks.append(_CrashAtEpoch())
        return trainer

    monkeypatch.setattr(ttt.train, "make_trainer", crashing_trainer)
    with pytest.raises(_Crash):
        main([*tiny_sophia_lm, "run.name=crashed"])
    assert _state(tmp_path / "runs" / "crashed")["global_step"] == 2
    monkeypatch.setattr(ttt.train, "make_trainer", make_trainer)
    assert main([f"resume={tmp_path / 'runs' / 'crashed'}"]) == 0

    straight, resumed = _state(tmp_path / "runs" / "straight"), _state(tmp_path / "runs" / "crashed")
    assert resumed["global_step"] == straight["global_step"] == 4
    assert straight["state_dict"].keys() == resumed["state_dict"].keys()
    assert any(k.startswith("models.sophia_h.") for k in straight["state_dict"])
    for name, value in straight["state_dict"].items():
        torch.testing.assert_close(resumed["state_dict"][name], value, rtol=0, atol=0, msg=name)
    # AdamW's moments (the learner keeps its baseline optimizer and schedule in its checkpoint entry),
    # and Sophia-H's momentum and Hessian moment (its estimate at step 4 drew its probes from the
    # restored generator).
    assert len(straight["optimizer_states"]) == len(resumed["optimizer_states"]) == 1
    optimizer_states = {
        ("exp_avg", "exp_avg_sq"): [
            s["optimizer_comparison"]["baseline"]["optimizer"] for s in (straight, resumed)
        ],
        ("momentum", "hessian_moment"): [s["optimizer_states"][0] for s in (straight, resumed)],
    }
    for keys, (one, other) in optimizer_states.items():
        assert one["state"].keys() == other["state"].keys() and len(one["state"]) > 0
        for param in one["state"]:
            for key in keys:
                torch.testing.assert_close(
                    other["state"][param][key], one["state"][param][key], rtol=0, atol=0
                )
    schedules = [s["optimizer_comparison"]["baseline"]["schedule"] for s in (straight, resumed)]
    assert schedules[0]["last_epoch"] == schedules[1]["last_epoch"] == 4
    for saved in (straight, resumed):
        comparison = saved["optimizer_comparison"]
        assert comparison["estimates"] == 2 and len(comparison["curve"]) == 2
        assert [len(clock["step_s"]) for clock in comparison["clock"].values()] == [4, 4]
    torch.testing.assert_close(
        resumed["optimizer_comparison"]["probe_state"], straight["optimizer_comparison"]["probe_state"]
    )
    fresh = _strict_json(tmp_path / "runs" / "straight" / "summary.json")
    again = _strict_json(tmp_path / "runs" / "crashed" / "summary.json")
    assert fresh["loss_sophia_h"] == again["loss_sophia_h"] and fresh["loss_adamw"] == again["loss_adamw"]
    losses = [[row[name]["loss"] for name in ("adamw", "sophia_h")] for row in fresh["held_out_curve"]]
    assert losses == [
        [row[name]["loss"] for name in ("adamw", "sophia_h")] for row in again["held_out_curve"]
    ]


def test_equal_time_comparison_interpolates_the_slower_curve():
    curves = {
        "fast": [(1.0, 4.0), (2.0, 3.0), (3.0, 2.5)],
        "slow": [(2.0, 4.2), (4.0, 3.0), (6.0, 2.0)],
    }
    result = equal_time_comparison(curves)
    assert result["budget_s"] == 3.0 and result["faster"] == "fast"
    assert result["loss"]["fast"] == 2.5
    assert result["loss"]["slow"] == pytest.approx(4.2 + (3.0 - 4.2) * (3.0 - 2.0) / (4.0 - 2.0))  # 3.6
    late = equal_time_comparison({"fast": [(1.0, 3.0)], "slow": [(1.5, 4.0), (3.0, 2.0)]})
    assert late["budget_s"] == 1.0 and late["loss"] == {"fast": 3.0, "slow": None}  # no extrapolation
    assert loss_at_time([(1.0, 3.0), (2.0, 1.0)], 2.0) == 1.0 and loss_at_time([(1.0, 3.0)], 0.5) is None
    assert equal_time_comparison({"a": [], "b": [(1.0, 2.0)]})["budget_s"] is None


@pytest.mark.parametrize(
    "override, message",
    [
        ("optim.name=adamw", "optim.name must be a Hessian optimizer"),
        ("compare.baseline=sophia_h", "compare.baseline must be one of adamw, adam, sgd"),
        ("compare.baseline_lr=0", "compare.baseline_lr must be > 0"),
        ("compare.hessian_sequences=0", "compare.hessian_sequences must be >= 1"),
        ("trainer.devices=2", "trainer.devices > 1 / trainer.strategy=ddp is not supported by sophia_lm"),
        ("trainer.precision=16-mixed", "trainer.precision=16-mixed is not supported by sophia_lm"),
    ],
)
def test_bad_comparison_settings_name_the_key(override, message, tiny_sophia_lm):
    with pytest.raises((ConfigError, ValueError), match=message):
        cfg = load_config([*tiny_sophia_lm, override])
        load_builder(cfg.builder).build(cfg)
