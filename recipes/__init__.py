"""Recipe builders. A builder is a module recipes/NAME.py with a `Config` dataclass (the typed schema
of the YAML files under configs/ that say `builder: NAME`) and `build(cfg) -> (MetaLearner,
LightningDataModule)`. Builders are found by module name and imported only when used."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType


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
