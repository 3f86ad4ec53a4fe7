"""The pretrained recipe's first-contact errors: a missing checkpoint directory is reported as that,
and a null checkpoint builds random weights only when asked to (model.random_weights=true)."""

import pytest

from recipes import load_config
from ttt.config import ConfigError
from ttt.train import main


def test_missing_checkpoint_directory_is_reported_as_that(tmp_path, capsys):
    missing = tmp_path / "no_such_checkpoint"
    with pytest.raises(ConfigError, match=r"model\.checkpoint=.*no_such_checkpoint.*no such directory"):
        load_config(["recipe=pretrained/smollm2_135m", f"model.checkpoint={missing}"])
    args = ["recipe=pretrained/smollm2_135m", f"model.checkpoint={missing}", f"run.root={tmp_path}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "model.checkpoint" in err and "tokenizer" not in err


def test_null_checkpoint_without_opt_in_is_refused_before_the_run_directory(tmp_path, capsys):
    runs = tmp_path / "runs"
    args = ["recipe=pretrained/smollm2_135m", "trainer.accelerator=cpu", f"run.root={runs}"]
    assert main(args) == 2
    assert "model.random_weights=true" in capsys.readouterr().err
    assert not runs.exists()


def test_toy_recipe_opts_in_to_random_weights():
    assert load_config(["recipe=ttt_pretrained_toy"]).model.random_weights
