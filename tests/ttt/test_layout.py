"""The package's homes: the library never imports its app (recipes, configs, ttt.train) outside the
command-line entry points, the inner-loop engine imports no model code, and the names that moved still
import for one release, as the same modules, with a warning naming the new home."""

import ast
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from recipes import load_config
from ttt._moved import MOVED

ROOT = Path(__file__).resolve().parents[2]
APP = ("recipes", "configs", "ttt.train")


def imported_modules(path: Path) -> set[str]:
    """Every module an import statement of the file names (absolute; relative ones resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return names


def is_entry_point(path: Path) -> bool:
    """A module run as `python -m ...` (it has an `if __name__ == "__main__":` block)."""
    return '__name__ == "__main__"' in path.read_text()


def test_the_library_imports_its_app_only_in_entry_points():
    offenders = {
        str(path.relative_to(ROOT)): sorted(n for n in imported_modules(path) if n.startswith(APP))
        for path in sorted((ROOT / "ttt").rglob("*.py"))
        if not is_entry_point(path)
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_ttt_load_is_light_to_reach_and_finds_the_recipes_through_their_entry_point():
    code = (
        "import sys\n"
        "import ttt\n"
        "assert 'torch' not in sys.modules, 'import ttt imports no torch'\n"
        "from ttt import load\n"
        "assert 'recipes' not in sys.modules, 'reaching ttt.load imports no app'\n"
        "from ttt.meta.loading import installed_book\n"
        "import recipes\n"
        "assert installed_book() is recipes.BOOK\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_the_inner_loop_engine_imports_no_model_code():
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            n for n in imported_modules(path) if n.startswith(("ttt.models", "ttt.layers"))
        )
        for path in sorted((ROOT / "ttt" / "inner").rglob("*.py"))
    }
    assert {path: names for path, names in offenders.items() if names} == {}


def test_a_recomputed_region_replays_the_fused_loss_registered_from_the_models_side():
    from ttt.inner import recompute
    from ttt.models import linear_cross_entropy

    assert linear_cross_entropy.recompute_contexts in recompute._REPLAYS


@pytest.mark.parametrize(
    "old", ["ttt.reading", "ttt.ttt_layers", "ttt.memory.model", "ttt.second_order.optimizers"]
)
def test_a_moved_module_imports_under_its_old_name_as_the_same_module(old):
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"new = importlib.import_module({MOVED[old]!r})\n"
        "assert old is new, (old, new)\n"
        f"assert new.__spec__.name == {MOVED[old]!r}, new.__spec__.name\n"
        f"assert any({MOVED[old]!r} in str(w.message) and w.category is FutureWarning for w in caught)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_an_old_command_runs_the_moved_module_with_a_warning():
    done = subprocess.run([sys.executable, "-m", "ttt.memory.diagnose", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "neural_memory_diagnose" in done.stdout
    assert "ttt.memory.diagnose moved to ttt.experiments.neural_memory_diagnose" in done.stderr


def test_a_renamed_config_key_is_read_with_a_warning_and_refused_beside_its_new_name():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cfg = load_config(["recipe=maml_longctx", "context.chunk_len=16"])
    assert cfg.context.tokens_per_step == 16
    assert any("context.tokens_per_step" in str(w.message) for w in caught)
    with pytest.raises(ValueError, match="give only context.tokens_per_step"):
        load_config(["recipe=maml_longctx", "context.chunk_len=16", "context.tokens_per_step=8"])
