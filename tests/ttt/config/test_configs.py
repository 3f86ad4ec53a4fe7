"""Every recipe YAML loads against its schema; bad names, keys and values fail with helpful messages."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from omegaconf import OmegaConf

from recipes import available_recipes, load_builder, load_config
from ttt.config import ConfigError, to_yaml
from ttt.config.loading import read_recipe, recipe_header
from ttt.inner import InnerLoopConfig
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
    header = recipe_header(available_recipes()[name])
    assert f"python -m ttt.train recipe={name}" in header
    # figures live in the docs' tables, with their commit; a header would let them go stale
    assert "Figure (" not in header and not re.search(r"\bcommit [0-9a-f]{7}\b", header), header
    assert len(header.splitlines()) <= 8, "a header says what the recipe is and its command"
    assert header.splitlines()[0].endswith("."), "its first line (shown by --help) is a sentence"
    assert f"recipe: {name}" in to_yaml(cfg)


def _leaves(tree: dict, prefix: str = ""):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def _resolved(cfg) -> dict:
    """Dotted key -> value of a loaded config, as it is saved to a run's config.yaml."""
    return dict(_leaves(yaml.safe_load(to_yaml(cfg))))


@pytest.mark.parametrize("name", RECIPES)
def test_every_value_a_yaml_states_is_the_value_its_recipe_runs_with(name):
    """What a recipe's YAML says (merged onto its bases) is what the command runs: no key is dropped,
    renamed or overridden on the way to the typed config."""
    stated = dict(_leaves(OmegaConf.to_container(read_recipe(name, available_recipes()))))
    resolved = _resolved(load_config([f"recipe={name}"]))
    differ = {key: (value, resolved.get(key, "<missing>")) for key, value in stated.items()
              if key != "base" and resolved.get(key, "<missing>") != value}  # fmt: skip
    assert not differ, f"{name}: (stated, resolved) per key: {differ}"


@pytest.mark.parametrize("name", RECIPES)
def test_a_yaml_states_only_what_differs_from_its_base_or_the_defaults(name):
    own = OmegaConf.to_container(OmegaConf.load(available_recipes()[name]))
    base = own.pop("base", None)
    if base is None:
        without = _resolved(load_builder(own["builder"]).Config())
    else:
        without = _resolved(load_config([f"recipe={base}"]))
    restated = [key for key, value in _leaves(own) if key != "builder" and without.get(key) == value]
    assert not restated, f"{name} restates the values it would have anyway: {restated}"


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / f"{name}.yaml"
    path.write_text(text)
    return path


def test_a_recipe_extends_its_base_and_bad_bases_are_errors(tmp_path):
    recipes = {
        "small": _write(tmp_path, "small", "builder: maml_sinusoid\ninner:\n  steps: 2\n  lr: 0.5\n"),
        "big": _write(tmp_path, "big", "base: small\ninner:\n  steps: 7\n"),
        "bigger": _write(tmp_path, "bigger", "base: big\ntrainer:\n  max_steps: 9\n"),
        "loop": _write(tmp_path, "loop", "base: loop2\n"),
        "loop2": _write(tmp_path, "loop2", "base: loop\n"),
        "typo": _write(tmp_path, "typo", "base: smal\n"),
    }
    merged = read_recipe("bigger", recipes)
    assert OmegaConf.to_container(merged) == {
        "builder": "maml_sinusoid", "inner": {"steps": 7, "lr": 0.5}, "trainer": {"max_steps": 9}
    }  # fmt: skip
    with pytest.raises(ConfigError, match="makes a cycle \\(loop -> loop2 -> loop\\)"):
        read_recipe("loop", recipes)
    with pytest.raises(ConfigError, match="unknown base 'smal'; did you mean 'small'"):
        read_recipe("typo", recipes)


def test_the_16k_configs_extend_their_cpu_recipes():
    pairs = (("maml_longctx_16k", "maml_longctx"), ("ttt_e2e_16k", "ttt_e2e"), ("sophia_lm_16k", "sophia_lm"))
    for name, base in pairs:
        assert OmegaConf.load(available_recipes()[name]).base == base
        big, small = load_config([f"recipe={name}"]), load_config([f"recipe={base}"])
        assert big.builder == small.builder and big.optim.weight_decay == small.optim.weight_decay


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
        ("trainer.max_minutes=0", "trainer.max_minutes"),
        ("builder=maml_sinusoid", "builder"),
        ("inner.params=[nothing.*]", "nothing"),
    ],
)
def test_bad_values_name_the_key(override, message):
    with pytest.raises((ConfigError, ValueError), match=message):
        cfg = load_config(["recipe=maml_longctx", override])
        load_builder(cfg.builder).build(cfg)


@pytest.mark.parametrize(
    "key, values",
    [
        ("inner.optimizer", "sgd, momentum, adam"),
        ("inner.learnable_lr", "none, tensor, element"),
        ("optim.name", "adamw, adam, sgd, sophia_h, adahessian"),
        ("optim.scheduler", "constant, cosine, linear"),
        ("trainer.strategy", "auto, ddp, fsdp"),
        ("trainer.precision", "32-true, 32, bf16-mixed, 16-mixed, bf16-true, 16-true, 64-true, 64"),
        ("trainer.accelerator", "auto, cpu, gpu, cuda, mps"),
        ("model.attention", "flashbob, eager, sdpa_math, sdpa, sdpa_cudnn"),
    ],
)
def test_a_bad_choice_is_a_config_error_listing_the_valid_values(key, values):
    expected = f"^{re.escape(key)} must be one of {re.escape(values)}; got 'bogus'"
    with pytest.raises(ConfigError, match=expected):
        load_config(["recipe=maml_longctx", f"{key}=bogus"])


def test_choices_compare_format_and_save_as_their_strings(tmp_path):
    cfg = load_config(["recipe=maml_longctx", "trainer.precision=64", "inner.optimizer=adam"])
    assert cfg.inner.optimizer == "adam" and f"{cfg.trainer.precision}" == "64"
    assert {"adam": 1}[cfg.inner.optimizer] == 1 and json.dumps(cfg.optim.name) == '"adamw"'
    assert "optimizer='adam'" in repr(cfg.inner)
    saved = to_yaml(cfg)
    assert "precision: '64'" in saved and "optimizer: adam" in saved
    (tmp_path / "config.yaml").write_text(saved)
    assert load_config([], base=OmegaConf.load(tmp_path / "config.yaml")) == cfg
    with pytest.raises(ValueError, match="inner.optimizer must be one of sgd, momentum, adam; got 'rmsprop'"):
        InnerLoopConfig(optimizer="rmsprop")


@pytest.mark.parametrize("max_steps", [250, 20])
def test_any_max_steps_is_accepted_and_leaves_the_epoch_length_as_given(max_steps):
    """maml_longctx's trainer.steps_per_epoch=100 stays 100 (the last epoch is shorter), and the lr
    schedule's length is its own key."""
    trainer = load_config(["recipe=maml_longctx", f"trainer.max_steps={max_steps}"]).trainer
    assert (trainer.max_steps, trainer.steps_per_epoch) == (max_steps, 100)
    explicit = ["recipe=maml_longctx", f"trainer.max_steps={max_steps}", "optim.schedule_steps=300"]
    assert load_config(explicit).optim.schedule_steps == 300


def test_a_list_key_takes_a_single_value():
    cfg = load_config(["recipe=maml_longctx", "inner.params=layers.1.mlp.*"])
    assert cfg.inner.params == ["layers.1.mlp.*"]
    assert load_config(["recipe=maml_sinusoid", "model.hidden_sizes=16"]).model.hidden_sizes == [16]


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


def test_an_optional_section_null_by_default_takes_its_keys_by_name():
    """model.architecture.rope_scaling is null unless given; its keys are checked against its type."""
    assert load_config(["recipe=ttt_pretrained_toy"]).model.architecture.rope_scaling is None
    scaling = load_config(["recipe=ttt_pretrained_toy", "model.architecture.rope_scaling.factor=4"])
    assert scaling.model.architecture.rope_scaling.factor == 4.0
    assert scaling.model.architecture.rope_scaling.original_max_position_embeddings == 8192
    with pytest.raises(ConfigError, match="rope_scaling.fctor.*did you mean 'factor'"):
        load_config(["recipe=ttt_pretrained_toy", "model.architecture.rope_scaling.fctor=4"])
    with pytest.raises(ConfigError, match="low_freq_factor < high_freq_factor, got 4.0 and 4.0"):
        load_config(["recipe=ttt_pretrained_toy", "model.architecture.rope_scaling.low_freq_factor=4"])
    with pytest.raises(ConfigError, match="attention_factor must be positive or null, got 0.0"):
        load_config(["recipe=ttt_pretrained_toy", "model.architecture.rope_scaling.attention_factor=0"])
