"""Old module names that still import, for one release, with a FutureWarning naming the new one.

The test-time-training layers moved into one package (`ttt.layers`) and a few modules were renamed;
`import ttt.reading`, `from ttt.ttt_layers import TTTTransformer` or `python -m ttt.memory.diagnose`
still work: the old name is an alias of the new module (the same module object, so its classes are the
same classes). Installed by `ttt/__init__.py`; to be removed in the release after the move.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType

MOVED = {
    "ttt.reading": "ttt.layers",
    "ttt.reading.block": "ttt.layers.suffix_block",
    "ttt.reading.config": "ttt.layers.config",
    "ttt.reading.prefix_cache": "ttt.layers.prefix_cache",
    "ttt.reading.reader": "ttt.layers.reader",
    "ttt.reading.steps": "ttt.layers.fast_weights",
    "ttt.ttt_layers": "ttt.layers",
    "ttt.ttt_layers.model": "ttt.layers.e2e",
    "ttt.ttt_layers.transformers_reader": "ttt.layers.transformers_reader",
    "ttt.memory": "ttt.layers.neural_memory",
    "ttt.memory.block": "ttt.layers.neural_memory.block",
    "ttt.memory.config": "ttt.layers.neural_memory.config",
    "ttt.memory.layer": "ttt.layers.neural_memory.layer",
    "ttt.memory.model": "ttt.layers.neural_memory.model",
    "ttt.memory.diagnose": "ttt.experiments.neural_memory_diagnose",
    "ttt.memory.workload": "ttt.experiments.neural_memory_workload",
    "ttt.experiments.memory_meters": "ttt.experiments.gpu_memory_meters",
    "ttt.experiments.memory_model": "ttt.experiments.gpu_memory_model",
    "ttt.second_order.optimizers": "ttt.second_order.hessian_optimizers",
}
"""Old module name -> new module name."""


class _AliasLoader(importlib.abc.Loader):
    """Loads an old name as the new module itself; gives `python -m OLD` the new module's code."""

    def __init__(self, new: str):
        self.new, self.spec = new, None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.new)
        self.spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set the alias's own spec on it: put the real one back

    def get_code(self, fullname: str):
        return importlib.util.find_spec(self.new).loader.get_code(self.new)


class _MovedFinder(importlib.abc.MetaPathFinder):
    """Finds the names of `MOVED` (and only those), warning once per name."""

    def find_spec(self, fullname: str, path=None, target=None):
        new = MOVED.get(fullname)
        if new is None:
            return None
        warnings.warn(
            f"{fullname} moved to {new}; the old name is an alias for one release (docs/notes/history.md, "
            "'Moves')",
            FutureWarning,
            stacklevel=2,
        )
        is_package = importlib.util.find_spec(new).submodule_search_locations is not None
        return importlib.machinery.ModuleSpec(fullname, _AliasLoader(new), is_package=is_package)


def install() -> None:
    """Put the finder first on sys.meta_path (once)."""
    if not any(isinstance(finder, _MovedFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())  # before PathFinder, which would find an old name by path
