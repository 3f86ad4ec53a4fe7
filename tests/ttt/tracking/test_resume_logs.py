"""A resumed run's logs continue the first session's: every outer step logged once, under its index;
extending a run keeps its lr schedule."""

import csv

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
