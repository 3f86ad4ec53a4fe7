"""Load a recipe: its YAML, then command-line overrides, checked against the typed schema.

    cfg = load_config(["recipe=maml_longctx", "trainer.max_steps=50"], book=recipes.BOOK)

The recipes themselves (configs/*.yaml and the builders under recipes/) are the app's: `recipes.BOOK`
says where they are, and `recipes.load_config(overrides)` is this with that book. A recipe YAML states
what differs from its builder's defaults (the `Config` dataclass under recipes/), or, with a top-level
`base: OTHER_RECIPE`, what differs from that recipe's YAML (itself resolved the same way; the builder is
inherited): e.g. configs/maml_longctx_16k.yaml extends maml_longctx.

Every key is checked before merging: an unknown or mistyped key raises ConfigError listing the
valid keys at that level and the closest matches (difflib); a value of a `Choice` field (or of a list
of them) that is not one of its values raises ConfigError listing the valid values. Wrong value types
and invalid values raise ConfigError naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from omegaconf.nodes import EnumNode

from .choice import Choice
from .schema import RecipeConfig


class ConfigError(ValueError):
    """A bad recipe name, key or value; the message says what exists or what is expected."""


@dataclass(frozen=True)
class RecipeBook:
    """Where recipes come from (the app's: `recipes.BOOK`, over configs/ and recipes/): `yamls()`, recipe
    name -> its YAML file; `builder(name)`, the builder module of that name (ValueError naming the
    builders when there is none): its `Config` (the `RecipeConfig` subclass of its YAMLs), `build(cfg)` ->
    (learner, data) and, where it can build the learner without reading data, `build_module(cfg)`."""

    yamls: Callable[[], dict[str, Path]]
    builder: Callable[[str], ModuleType]


def recipe_header(path: Path) -> str:
    """The leading comment block of a recipe YAML (its description and launch command), without '# '."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line[2:] if line.startswith("# ") else line[1:])
    return "\n".join(lines)


def read_recipe(name: str, recipes: dict[str, Path], _children: tuple[str, ...] = ()) -> DictConfig:
    """The YAML of recipe `name` merged onto the YAML of its `base:` recipe, if it names one (recursively;
    a cycle or an unknown base is a ConfigError)."""
    raw = OmegaConf.load(recipes[name])
    parent = raw.pop("base", None)
    if parent is None:
        return raw
    if parent == name or parent in _children:
        chain = " -> ".join((*_children, name, parent))
        raise ConfigError(f"{recipes[name]}: base: {parent} makes a cycle ({chain})")
    if parent not in recipes:
        raise ConfigError(
            f"{recipes[name]}: unknown base {parent!r}{_close_matches(str(parent), list(recipes))}\n"
            f"recipes: {', '.join(sorted(recipes))}"
        )
    return OmegaConf.merge(read_recipe(parent, recipes, (*_children, name)), raw)


def _close_matches(word: str, choices: list[str]) -> str:
    matches = difflib.get_close_matches(word, choices, n=3, cutoff=0.6)
    return f"; did you mean {' or '.join(repr(m) for m in matches)}?" if matches else ""


def _choice_type(node: Any) -> type[Choice] | None:
    """The Choice class of a schema node: of the field itself, or of the elements of a list field."""
    if isinstance(node, EnumNode):
        kind = node.enum_type
    elif isinstance(node, ListConfig):
        kind = node._metadata.element_type
    else:
        return None
    return kind if isinstance(kind, type) and issubclass(kind, Choice) else None


def _check_choice(kind: type[Choice], value: Any, key: str, where: str) -> None:
    """Raise ConfigError listing kind's values when `value` (a scalar or a list of them) is none of them."""
    for item in value if isinstance(value, (list, ListConfig)) else [value]:
        if item is None or isinstance(item, Enum) or str(item) in kind.values() + tuple(kind.__members__):
            continue
        try:
            kind.parse(str(item), key)
        except ValueError as err:
            raise ConfigError(f"{err} ({where})") from None


def _check_keys(given: Any, schema: Any, where: str, prefix: str = "") -> None:
    """Raise ConfigError for the first key in `given` (a DictConfig) that `schema` does not have, or
    whose value is not one of its Choice's values. Numbers given for a choice (trainer.precision=32)
    are turned into the choice's string."""
    if not isinstance(given, DictConfig) or not isinstance(schema, DictConfig):
        return
    if schema._is_none() and dataclasses.is_dataclass(schema._metadata.ref_type):
        schema = OmegaConf.structured(schema._metadata.ref_type)  # an optional section, null by default
    valid = [str(k) for k in schema]
    for key in given:
        full = f"{prefix}{key}"
        if key not in schema:
            raise ConfigError(
                f"unknown config key {full!r} ({where}){_close_matches(str(key), valid)}\n"
                f"valid keys{' under ' + prefix.rstrip('.') if prefix else ''}: {', '.join(valid)}"
            )
        kind = _choice_type(schema._get_node(key))
        if kind is not None:
            value = given[key]
            _check_choice(kind, value, full, where)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                given[key] = str(value)
            continue
        _check_keys(given._get_node(key), schema._get_node(key), where, f"{full}.")


def _recipe_schema(book: RecipeBook, builder: str, yaml_path: Path) -> type[RecipeConfig]:
    try:
        return book.builder(builder).Config
    except ValueError as err:
        raise ConfigError(f"{yaml_path}: {err}") from err


def parse_overrides(overrides: list[str]) -> DictConfig:
    """"key=value" strings (OmegaConf dotlist syntax) as a DictConfig; ConfigError on a malformed one."""
    for item in overrides:
        if "=" not in item or item.startswith("="):
            raise ConfigError(f"override {item!r} must look like key=value (e.g. trainer.max_steps=100)")
    try:
        return OmegaConf.from_dotlist(overrides)
    except OmegaConfBaseException as err:
        raise ConfigError(f"could not parse the overrides {overrides}: {err}") from err


RENAMED_KEYS = {"context.chunk_len": "context.tokens_per_step"}
"""Old config key -> its new name: still read (saved run configs, YAML, the command line) with a warning,
for one release."""


def _rename_old_keys(given: DictConfig, where: str) -> None:
    """Move the value of each old key of RENAMED_KEYS in `given` to its new key, with a warning; a
    ConfigError when both are given."""
    for old, new in RENAMED_KEYS.items():
        section, leaf = old.rsplit(".", 1)
        node = OmegaConf.select(given, section) if isinstance(given, DictConfig) else None
        if not isinstance(node, DictConfig) or leaf not in node:
            continue
        if OmegaConf.select(given, new) is not None:
            raise ConfigError(f"{old} is the old name of {new}; give only {new} ({where})")
        warnings.warn(f"config key {old} is now {new} ({where}); the old name goes in the next release",
                      FutureWarning, stacklevel=3)  # fmt: skip
        value = node.pop(leaf)
        OmegaConf.update(given, new, value, force_add=True)


def load_structured(schema_class: type, layers: list[tuple[DictConfig, str]]) -> Any:
    """An instance of the dataclass `schema_class` from its defaults and `layers` merged in order, each
    a (DictConfig, where it came from) pair. Every layer's keys and choices are checked first; any bad
    key, type or value (including a ValueError of __post_init__) is a ConfigError naming it."""
    schema = OmegaConf.structured(schema_class)
    for given, where in layers:
        _rename_old_keys(given, where)
        _check_keys(given, schema, where)
    try:
        return OmegaConf.to_object(OmegaConf.merge(schema, *(given for given, _ in layers)))
    except OmegaConfBaseException as err:
        raise ConfigError(str(err).splitlines()[0] + f" (key {err.full_key})") from err
    except ValueError as err:
        raise ConfigError(str(err)) from err


def load_config(overrides: list[str], *, book: RecipeBook, base: DictConfig | None = None) -> RecipeConfig:
    """The validated config object of recipe=NAME (from `overrides`, a recipe of `book`) with the other
    overrides applied (the app's `recipes.load_config` passes its book).

    overrides: "key=value" strings (OmegaConf dotlist); one of them must be recipe=NAME unless
    `base` (e.g. the saved config of a run being resumed) is given.
    """
    cli = parse_overrides(overrides)
    recipes = book.yamls()
    if base is None:
        name = cli.get("recipe")
        if name is None:
            raise ConfigError(f"missing recipe=NAME; recipes: {', '.join(sorted(recipes))}")
        if name not in recipes:
            raise ConfigError(
                f"unknown recipe {name!r}{_close_matches(str(name), list(recipes))}\n"
                f"recipes: {', '.join(sorted(recipes))}"
            )
        base = read_recipe(name, recipes)
        base.recipe = name
        source = str(recipes[name])
    else:
        source = "saved run config"
    builder = base.get("builder")
    schema_class = _recipe_schema(book, builder, Path(source))
    if cli.get("builder", builder) != builder:
        raise ConfigError(f"builder cannot be overridden (the recipe uses {builder!r})")
    cfg = load_structured(schema_class, [(base, source), (cli, "command line")])
    cfg.optim.schedule_steps = cfg.schedule_steps  # the horizon stays with the run (see its doc)
    return cfg


def _plain(value: Any) -> Any:
    """`value` (nested dicts and lists from OmegaConf.to_container) with every Enum replaced by its value."""
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    return value.value if isinstance(value, Enum) else value


def to_dict(cfg: RecipeConfig) -> dict[str, Any]:
    """The resolved config as nested plain dicts (derived defaults filled in; choices as their values)."""
    return _plain(OmegaConf.to_container(OmegaConf.structured(cfg)))


def to_yaml(cfg: RecipeConfig) -> str:
    """The resolved config as YAML (`to_dict`, which loads back)."""
    return OmegaConf.to_yaml(to_dict(cfg))

