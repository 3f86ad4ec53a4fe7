"""A resumed run's logs continue the first session's: every outer step logged once, under its index."""

import csv

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
