"""Recipes: named, complete configs (configs/NAME.yaml) and the builders that make a learner and its data
from them. A builder is a module recipes/NAME.py with a `Config` dataclass (the typed schema of the YAML
files under configs/ that say `builder: NAME`) and `build(cfg) -> (MetaLearner, LightningDataModule)`;
a builder that can build its learner without reading data also has `build_module(cfg)` (`ttt.load` uses
it). Builders are found by module name and imported only when used.

    cfg = load_config(["recipe=maml_longctx", "trainer.max_steps=50"])   # validated, overrides applied
    learner, data = build(cfg)                  # load_builder(cfg.builder).build(cfg), config remembered

This package is the app on top of the `ttt` library: the command-line entry points import it; the library
never does (`ttt.config.load_config` takes a `RecipeBook`, and `BOOK` is this package's; `ttt.load` finds
`BOOK` through the entry point pyproject.toml registers).
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path
from types import ModuleType

from lightning.pytorch import LightningDataModule
from omegaconf import DictConfig

from ttt.config import RecipeBook, RecipeConfig
from ttt.config import load_config as load_with_book
from ttt.meta.learner import OuterLearner
from ttt.meta.loading import build as build_with_book


def builder_names() -> list[str]:
    """Names of the modules in this package (candidate builders)."""
    return sorted(info.name for info in pkgutil.iter_modules(__path__) if not info.name.startswith("_"))


def load_builder(name: str) -> ModuleType:
    """The builder module `name`; ValueError listing the builders when there is none of that name."""
    if name not in builder_names():
        raise ValueError(f"builder must be one of {builder_names()}, got {name!r}")
    module = importlib.import_module(f"{__name__}.{name}")
    if not (hasattr(module, "Config") and hasattr(module, "build")):
        raise ValueError(f"recipes/{name}.py must define Config and build(cfg)")
    return module


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


BOOK = RecipeBook(yamls=available_recipes, builder=load_builder)
"""The recipes of this repository, for `ttt.config.load_config` and `ttt.load` (registered in
pyproject.toml under the entry-point group "ttt.recipe_books")."""


def load_config(overrides: list[str], *, base: DictConfig | None = None) -> RecipeConfig:
    """The validated config of recipe=NAME (one of `overrides`, "key=value" strings) with the other
    overrides applied; with `base` (the saved config of a run being resumed) no recipe= is needed.
    ConfigError (naming the key and what is valid) for a bad recipe, key or value."""
    return load_with_book(overrides, book=BOOK, base=base)


def build(cfg: RecipeConfig) -> tuple[OuterLearner, LightningDataModule]:
    """The learner and data of `cfg` by its builder; the learner keeps `cfg` in its hyperparameters, so
    that its checkpoints load with no arguments (`ttt.load`, `load_from_checkpoint`)."""
    return build_with_book(cfg, book=BOOK)
