"""Load a recipe: its YAML under configs/, then command-line overrides, checked against the typed schema.

    cfg = load_config(["recipe=maml_longctx", "trainer.max_steps=50"])

Every key is checked before merging: an unknown or mistyped key raises ConfigError listing the
valid keys at that level and the closest matches (difflib). Wrong value types and invalid values
raise ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .schema import RecipeConfig


class ConfigError(ValueError):
    """A bad recipe name, key or value; the message says what exists or what is expected."""


def available_recipes() -> dict[str, Path]:
    """Recipe name -> its YAML file, for every configs/**/*.yaml (configs/pretrained/x.yaml is named
    pretrained/x)."""
    import configs

    # __path__ rather than importlib.resources: it also works when configs resolves as a namespace package.
    folders = [Path(entry) for entry in configs.__path__ if Path(entry).is_dir()]
    return {
        path.relative_to(folder).with_suffix("").as_posix(): path
        for folder in folders
        for path in sorted(folder.rglob("*.yaml"))
    }


def recipe_header(path: Path) -> str:
    """The leading comment block of a recipe YAML (its description and launch command), without '# '."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[2:] if line.startswith("# ") else line[1:])
    return "\n".join(lines)


def _close_matches(word: str, choices: list[str]) -> str:
    matches = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(m) for m in matches)}?" if matches else ""


def _check_keys(given: Any, schema: Any, where: str, prefix: str = "") -> None:
    """Raise ConfigError for the first key in `given` (a DictConfig) that `schema` does not have."""
    if not isinstance(given, DictConfig) or not isinstance(schema, DictConfig):
        return
    valid = [str(k) for k in schema]
    for key in given:
        full = f"{prefix}{key}"
        if key not in schema:
            raise ConfigError(
                f"unknown config key {full!r} ({where}){_close_matches(str(key), valid)}\n"
                f"valid keys{' under ' + prefix.rstrip('.') if prefix else ''}: {', '.join(valid)}"
            )
        _check_keys(given._get_node(key), schema._get_node(key), where, f"{full}.")


def _recipe_schema(builder: str, yaml_path: Path) -> type[RecipeConfig]:
    from recipes import load_builder

    try:
        return load_builder(builder).Config
    except ValueError as err:
        raise ConfigError(f"{yaml_path}: {err}") from err


def _parse_overrides(overrides: list[str]) -> DictConfig:
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} must look like key=value (e.g. trainer.max_steps=100)")
    try:
        return OmegaConf.from_dotlist(overrides)
    except OmegaConfBaseException as err:
        raise ConfigError(f"could not parse the overrides {overrides}: {err}") from err


def load_config(overrides: list[str], *, base: DictConfig | None = None) -> RecipeConfig:
    """The validated config object of recipe=NAME (from `overrides`) with the other overrides applied.

    overrides: "key=value" strings (OmegaConf dotlist); one of them must be recipe=NAME unless
    `base` (e.g. the saved config of a run being resumed) is given.
    """
    cli = _parse_overrides(overrides)
    recipes = available_recipes()
    if base is None:
        name = cli.get("recipe")
        if name is None:
            raise ConfigError(f"missing recipe=NAME; recipes: {', '.join(sorted(recipes))}")
        if name not in recipes:
            raise ConfigError(
                f"unknown recipe {name!r}{_close_matches(str(name), list(recipes))}\n"
                f"recipes: {', '.join(sorted(recipes))}"
            )
        base = OmegaConf.load(recipes[name])
        base.recipe = name
        source = str(recipes[name])
    else:
        source = "saved run config"
    builder = base.get("builder")
    schema = OmegaConf.structured(_recipe_schema(builder, Path(source)))
    _check_keys(base, schema, source)
    _check_keys(cli, schema, "command line")
    try:
        merged = OmegaConf.merge(schema, base, cli)
        if merged.builder != builder:
            raise ConfigError(f"builder cannot be overridden (the recipe uses {builder!r})")
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ConfigError(str(err).splitlines()[0] + f" (key {err.full_key})") from err
    except ValueError as err:
        raise ConfigError(str(err)) from err
    cfg.optim.schedule_steps = cfg.schedule_steps  # the horizon stays with the run (see its doc)
    return cfg


def to_yaml(cfg: RecipeConfig) -> str:
    """The resolved config as YAML (derived defaults filled in)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_dict(cfg: RecipeConfig) -> dict:
    """The resolved config as plain nested dicts (for hyperparameter logging)."""
    return dataclasses.asdict(cfg)
