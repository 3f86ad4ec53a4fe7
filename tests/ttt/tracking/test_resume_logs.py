"""A resumed run's logs continue the first session's: every outer step logged once, under its index;
any max_steps works, its shorter last epoch completed by an extension; extending a run keeps its lr
schedule, which never jumps, and its summary's history."""

import csv
import json

import pytest
import torch
from omegaconf import OmegaConf

from recipes import load_config
from ttt.train import main


def _train_steps(run, version):
    with (run / "logs" / f"version_{version}" / "metrics.csv").open() as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("train/outer_loss")]


def test_resumed_logs_have_no_duplicate_or_shifted_steps(tiny_overrides, tmp_path):
    every_step = "trainer.log_every_n_steps=1"
    assert main(tiny_overrides("maml_sinusoid", "run.name=logs", every_step)) == 0
    checkpoint = tmp_path / "logs" / "checkpoints" / "last.ckpt"
    assert main([f"resume={tmp_path / 'logs'}", "trainer.max_steps=4"]) == 0
    assert _train_steps(tmp_path / "logs", 0) == [0, 1]
    assert _train_steps(tmp_path / "logs", 1) == [2, 3]
    assert checkpoint.is_file()


def _logged(run, version, metric="train/lr"):
    with (run / "logs" / f"version_{version}" / "metrics.csv").open() as handle:
        return [float(row[metric]) for row in csv.DictReader(handle) if row.get(metric)]


def test_extending_a_run_keeps_its_schedule_without_a_jump(tiny_overrides, tmp_path):
    cosine = [
        "optim.scheduler=cosine",
        "optim.lr=1e-3",
        "optim.min_lr_ratio=0.2",
        "trainer.log_every_n_steps=1",
    ]
    assert main(tiny_overrides("maml_sinusoid", "run.name=ext", *cosine)) == 0
    first = _logged(tmp_path / "ext", 0)
    assert first[-1] == pytest.approx(2e-4)  # the 2-step schedule has reached its end
    assert main([f"resume={tmp_path / 'ext'}", "trainer.max_steps=6"]) == 0
    assert _logged(tmp_path / "ext", 1) == pytest.approx([2e-4] * 4)  # stays at the final lr
    saved = load_config([], base=OmegaConf.load(tmp_path / "ext" / "config.yaml"))
    assert (saved.trainer.max_steps, saved.optim.schedule_steps) == (6, 2)


def test_a_new_run_schedules_over_its_max_steps():
    cfg = load_config(["recipe=maml_sinusoid", "trainer.max_steps=40", "trainer.steps_per_epoch=20"])
    assert cfg.optim.schedule_steps == 40


def test_a_resumed_run_keeps_its_log_space_inner_lrs_and_their_outer_group(tiny_overrides, tmp_path):
    log_lr = [
        "inner.learnable_lr=tensor",
        "inner.lr=0.1",
        "inner.lr_space=log",
        "inner.lr_outer_lr=0.2",
        "trainer.log_every_n_steps=1",
    ]
    assert main(tiny_overrides("maml_sinusoid", "run.name=loglr", *log_lr)) == 0
    checkpoint = torch.load(tmp_path / "loglr" / "checkpoints" / "last.ckpt", weights_only=False)
    assert "inner_loop.log_lrs.0" in checkpoint["state_dict"]
    assert len(checkpoint["optimizer_states"][0]["param_groups"]) == 2
    first = _logged(tmp_path / "loglr", 0, "train/inner_lr")
    assert abs(first[-1] - 0.1) > 0.01  # the outer group's lr 0.2 moved ln lr visibly
    assert main([f"resume={tmp_path / 'loglr'}", "trainer.max_steps=4"]) == 0
    resumed = _logged(tmp_path / "loglr", 1, "train/inner_lr")
    # continues from the saved ln lr (a restart at 0.1 would repeat the first step: 0.1 -> 0.095)
    assert abs(resumed[0] - first[-1]) < 0.5 * abs(first[-1] - first[0])


def _validated_steps(run, version):
    with (run / "logs" / f"version_{version}" / "metrics.csv").open() as handle:
        return [int(row["step"]) for row in csv.DictReader(handle) if row.get("val/query_loss_adapted")]


def test_any_max_steps_works_and_an_extension_completes_the_shorter_last_epoch(tiny_overrides, tmp_path):
    """Epochs of 3 steps: a 2-step run validates and saves at its end, keeps steps_per_epoch=3, and extended
    to 7 steps validates where the uninterrupted 7-step run does, reaching its state exactly."""
    epochs = ["trainer.steps_per_epoch=3", "trainer.log_every_n_steps=1"]
    assert main(tiny_overrides("maml_sinusoid", "run.name=short", *epochs)) == 0  # max_steps=2
    run = tmp_path / "short"
    assert _validated_steps(run, 0) == [1]
    assert load_config([], base=OmegaConf.load(run / "config.yaml")).trainer.steps_per_epoch == 3
    assert main([f"resume={run}", "trainer.max_steps=7"]) == 0
    assert _validated_steps(run, 1) == [2, 5, 6]  # the first epoch completed at step 3, then 6, then 7
    assert main(tiny_overrides("maml_sinusoid", "run.name=straight", *epochs, "trainer.max_steps=7")) == 0
    straight = tmp_path / "straight"
    assert _validated_steps(straight, 0) == [2, 5, 6]
    got, want = (torch.load(r / "checkpoints" / "last.ckpt", weights_only=False) for r in (run, straight))
    assert got["global_step"] == want["global_step"] == 7
    for name, value in want["state_dict"].items():
        assert torch.equal(got["state_dict"][name], value), name


def test_a_warm_up_that_fills_the_schedule_is_said_and_an_extension_keeps_its_lr(
    tiny_overrides, tmp_path, capsys
):
    """A 2-step run whose warm-up is 2 steps has no room for its decay: the lr stays at its peak, the run
    says so as it starts, and an extension continues at that lr (it dropped to min_lr_ratio * lr)."""
    warm = ["optim.scheduler=cosine", "optim.warmup_steps=2", "optim.lr=1e-3", "trainer.log_every_n_steps=1"]
    assert main(tiny_overrides("maml_sinusoid", "run.name=warm", *warm)) == 0
    assert "optim.warmup_steps=2 fills the whole schedule (optim.schedule_steps=2)" in capsys.readouterr().err
    assert _logged(tmp_path / "warm", 0) == pytest.approx([1e-3, 1e-3])  # the lr of the step after each
    assert main([f"resume={tmp_path / 'warm'}", "trainer.max_steps=5"]) == 0
    assert _logged(tmp_path / "warm", 1) == pytest.approx([1e-3] * 3)


def test_a_resume_that_re_plans_the_schedule_says_how_the_lr_moves(tiny_overrides, tmp_path, capsys):
    cosine = ["optim.scheduler=cosine", "optim.lr=1e-3", "optim.min_lr_ratio=0.2"]
    assert main(tiny_overrides("maml_sinusoid", "run.name=replan", *cosine)) == 0
    capsys.readouterr()
    assert main([f"resume={tmp_path / 'replan'}", "trainer.max_steps=4", "optim.schedule_steps=4"]) == 0
    err = capsys.readouterr().err
    assert "at outer step 2 the lr moves from 0.0002 (the run's schedule) to 0.0006" in err
    assert main([f"resume={tmp_path / 'replan'}", "trainer.max_steps=6"]) == 0
    assert "outer steps 4-5 run past the lr schedule's end at its final lr 0.0002" in capsys.readouterr().err


def test_an_extended_run_keeps_its_summary_history(tiny_overrides, tmp_path):
    """The summary's timings cover every session: the first step is the run's first, the mean step time
    and the wall time count the earlier sessions (up to the checkpoint resumed from)."""
    assert main(tiny_overrides("maml_sinusoid", "run.name=hist")) == 0
    run = tmp_path / "hist"
    first = json.loads((run / "summary.json").read_text())
    saved = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)["callbacks"]["OuterStepTimer"]
    assert main([f"resume={run}", "trainer.max_steps=4"]) == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["outer_steps"] == 4
    assert summary["first_outer_step_s"] == first["first_outer_step_s"] > 0
    assert summary["time_per_outer_step_s"] > 0 and summary["training_time_s"] > first["training_time_s"]
    assert summary["wall_time_s"] > saved["wall_seconds"] > first["training_time_s"]
