"""Every recipe YAML loads against its schema; bad names, keys and values fail with helpful messages."""

import numpy as np
import pytest
import torch

from recipes import load_builder
from ttt.config import ConfigError, available_recipes, load_config, to_yaml
from ttt.config.loading import recipe_header
from ttt.meta import MetaLearner, SyntheticTasks, TaskDataModule
from ttt.meta.data import TRAIN_STREAM, VAL_STREAM, task_rng
from ttt.train import main

RECIPES = sorted(available_recipes())


def test_the_documented_recipes_exist():
    assert {"maml_longctx", "maml_sinusoid"} <= set(RECIPES)


@pytest.mark.parametrize("name", RECIPES)
def test_every_yaml_loads_and_documents_its_launch_command(name):
    cfg = load_config([f"recipe={name}"])
    assert cfg.recipe == name
    assert isinstance(cfg, load_builder(cfg.builder).Config)
    assert f"python -m ttt.train recipe={name}" in recipe_header(available_recipes()[name])
    assert f"recipe: {name}" in to_yaml(cfg)


@pytest.mark.parametrize("name", [name for name in RECIPES if name.startswith("maml_")])
def test_maml_recipes_build_their_learner_and_data(name):
    cfg = load_config([f"recipe={name}"])
    learner, data = load_builder(cfg.builder).build(cfg)
    assert isinstance(learner, MetaLearner) and isinstance(data, TaskDataModule)
    assert learner.total_steps == cfg.trainer.max_steps and learner.inner_cfg == cfg.inner
    # The first validation batch holds the validation stream's first tasks, stacked; training reads
    # the training stream from task 0.
    batch = next(iter(data.val_dataloader()))
    rows = min(cfg.trainer.eval_batch_size, cfg.trainer.val_tasks)
    first = data.samples["val"](task_rng(cfg.seed, VAL_STREAM, 0))
    assert set(batch) == set(first)
    for key, value in first.items():
        assert batch[key].shape == (rows, *value.shape), key
        np.testing.assert_array_equal(batch[key][0].numpy(), value, err_msg=key)
    train_first = SyntheticTasks(data.samples["train"], seed=cfg.seed, stream=TRAIN_STREAM)[0]
    assert not all(torch.equal(train_first[key], torch.from_numpy(first[key])) for key in first)


def test_unknown_recipe_lists_the_recipes():
    with pytest.raises(ConfigError, match="maml_longctx.*maml_sinusoid"):
        load_config(["recipe=nope"])
    with pytest.raises(ConfigError, match="did you mean 'maml_sinusoid'"):
        load_config(["recipe=maml_sinusiod"])


def test_mistyped_keys_suggest_the_close_match_and_list_the_valid_keys():
    expected = r"'model\.windw'.*did you mean 'window'\?\nvalid keys under model:"
    with pytest.raises(ConfigError, match=expected):
        load_config(["recipe=maml_longctx", "model.windw=4"])
    with pytest.raises(ConfigError, match="'trainr'.*did you mean 'trainer'"):
        load_config(["recipe=maml_longctx", "trainr.max_steps=4"])


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.max_steps=abc", "trainer.max_steps"),
        ("model.attention=flash", "flashbob"),
        ("inner.optimizer=rmsprop", "inner.optimizer"),
        ("model.window=64", "task.filler_len"),
        ("trainer.max_steps=250", "multiple of trainer.steps_per_epoch"),
        ("trainer.max_minutes=0", "trainer.max_minutes"),
        ("builder=maml_sinusoid", "builder"),
        ("inner.params=[nothing.*]", "nothing"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        cfg = load_config(["recipe=maml_longctx", override])
        load_builder(cfg.builder).build(cfg)


def test_overrides_must_be_key_value():
    with pytest.raises(ConfigError, match="key=value"):
        load_config(["recipe=maml_longctx", "trainer.max_steps"])


def test_cli_help_print_config_and_errors(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "maml_longctx" in out and "maml_sinusoid" in out and "key=value" in out
    assert main(["recipe=maml_sinusoid", "inner.lr=0.5", "print_config=true"]) == 0
    assert "lr: 0.5" in capsys.readouterr().out
    assert main(["recipe=nope"]) == 2
    assert "maml_longctx" in capsys.readouterr().err
