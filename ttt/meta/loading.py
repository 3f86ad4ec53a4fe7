"""A trained learner back from its checkpoint, without a Trainer: `load` (as `ttt.load`: a run directory
of ttt.train, or one of its checkpoints) and `OuterLearner.load_from_checkpoint` (any learner's
checkpoint), and `build`, which gives a recipe's learner the config it is rebuilt from.

A checkpoint holds tensors and plain containers only (it is read by `ttt.tracking.load_checkpoint`,
which unpickles no classes), so a learner is rebuilt from plain hyperparameters, then its state loaded:

    built by a recipe   the hyperparameters hold the run's config (RECIPE_CONFIG, stored by `build`, which
                        ttt.train builds with); the recipe's builder builds the learner from it again. A
                        checkpoint written before configs were stored is read with the config.yaml of its
                        run directory. The builder comes from the recipe book that the app registers under
                        the entry-point group "ttt.recipe_books" (this repository's `recipes.BOOK`, in
                        pyproject.toml), or the `book` given: the library never imports its app.
    any other learner   cls(**hyperparameters): a subclass builds its model from the plain values its
                        __init__ saves with self.save_hyperparameters() (`ttt.meta.MetaLearner` shows it).

The state dict is loaded strictly, `on_load_checkpoint` sees the checkpoint, `global_step` reads the
checkpoint's step while no Trainer is attached, and the learner is returned in eval mode.
"""

from __future__ import annotations

import inspect
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ttt.config import ConfigError, RecipeBook, RecipeConfig, load_config, to_dict
from ttt.tracking import CheckpointError, RunPaths, load_checkpoint

from .learner import OuterLearner

RECIPE_CONFIG = "recipe_config"
"""The hyperparameter that holds the config a recipe's learner was built from (plain dicts)."""

BOOK_ENTRY_POINTS = "ttt.recipe_books"
"""Entry-point group under which an app registers its `RecipeBook` (pyproject.toml: recipes:BOOK)."""

TRUE_PRECISION_DTYPES = {
    "64-true": torch.float64,
    "64": torch.float64,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}
"""trainer.precision values under which Lightning casts the whole learner (as ttt.train does before
training): the dtype its checkpoint's tensors have. Mixed precisions keep float32 parameters."""


def installed_book() -> RecipeBook:
    """The recipe book registered under BOOK_ENTRY_POINTS; LookupError when none or several are."""
    found = {point.value: point for point in entry_points(group=BOOK_ENTRY_POINTS)}
    if len(found) != 1:
        problem = "no recipe book is" if not found else f"several recipe books ({', '.join(found)}) are"
        raise LookupError(
            f"{problem} registered under the entry-point group {BOOK_ENTRY_POINTS!r}; this repository "
            "registers recipes:BOOK in pyproject.toml, which an install writes into the package metadata "
            "(pip install -e . again after it changed), or pass book="
        )
    return next(iter(found.values())).load()


def _keeping_config(learner: OuterLearner, cfg: RecipeConfig) -> OuterLearner:
    """`learner` with `cfg` in its hyperparameters (RECIPE_CONFIG: saved in its checkpoints, not logged)."""
    learner.save_hyperparameters({RECIPE_CONFIG: to_dict(cfg)}, logger=False)
    return learner


def build(cfg: RecipeConfig, *, book: RecipeBook) -> tuple[OuterLearner, pl.LightningDataModule]:
    """The learner and data of `cfg` by its builder in `book`; the learner keeps `cfg` in its
    hyperparameters, so that its checkpoints load with no arguments."""
    learner, data = book.builder(cfg.builder).build(cfg)
    return _keeping_config(learner, cfg), data


def _build_learner(cfg: RecipeConfig, book: RecipeBook) -> OuterLearner:
    """The learner of `cfg` alone, keeping `cfg`: `build_module(cfg)` where the builder has one (the text
    recipes: no corpus is read), else the learner of `build`."""
    builder = book.builder(cfg.builder)
    if not hasattr(builder, "build_module"):
        return build(cfg, book=book)[0]
    return _keeping_config(builder.build_module(cfg), cfg)


def _run_config_file(checkpoint_path: Path) -> Path | None:
    """The config.yaml of the run directory a checkpoint file sits in (<run>/checkpoints/FILE), if any."""
    config = RunPaths(checkpoint_path.parent.parent).config
    return config if checkpoint_path.parent.name == "checkpoints" and config.is_file() else None


def _saved_recipe_config(checkpoint: dict[str, Any], path: Path) -> dict[str, Any] | None:
    """The config a recipe's learner was built from: its RECIPE_CONFIG hyperparameter, or, for a
    checkpoint without hyperparameters (written before they were stored), its run's config.yaml; None
    for a checkpoint of another learner."""
    hparams = checkpoint.get(pl.LightningModule.CHECKPOINT_HYPER_PARAMS_KEY) or {}
    if RECIPE_CONFIG in hparams:
        return hparams[RECIPE_CONFIG]
    config_file = _run_config_file(path)
    if hparams or config_file is None:
        return None
    try:
        return OmegaConf.to_container(OmegaConf.load(config_file))
    except (OSError, ValueError, OmegaConfBaseException) as err:
        raise ConfigError(f"checkpoint {path}: the run's {config_file} is not readable YAML ({err})") from err


def _recipe_learner(
    saved: dict[str, Any], checkpoint: dict[str, Any], path: Path, book: RecipeBook | None
) -> tuple[OuterLearner, RecipeConfig]:
    """The learner (its state loaded) and the config of a recipe's checkpoint."""
    book = installed_book() if book is None else book
    try:
        cfg = load_config([], book=book, base=OmegaConf.create(saved))
    except ConfigError as err:
        raise ConfigError(f"checkpoint {path}: its recipe config does not load: {err}") from err
    with torch.random.fork_rng(devices=[]):  # the initial weights are overwritten: leave the caller's RNG
        learner = _build_learner(cfg, book)
    dtype = TRUE_PRECISION_DTYPES.get(str(cfg.trainer.precision))
    if dtype is not None:
        learner.to(dtype)
    _restore(learner, checkpoint, path, strict=True)
    return learner, cfg


def _restore(learner: OuterLearner, checkpoint: dict[str, Any], path: Path, *, strict: bool) -> None:
    """Load the checkpoint's state into `learner` (CheckpointError naming the file when it does not fit),
    give it the checkpoint (`on_load_checkpoint`) and its outer step, and switch it to eval mode."""
    if "state_dict" not in checkpoint:
        raise CheckpointError(f"checkpoint {path} holds no state_dict: it is not a Lightning checkpoint")
    learner.configure_model()  # as Lightning's loader: a learner may build layers there
    learner.on_load_checkpoint(checkpoint)
    try:
        learner.load_state_dict(checkpoint["state_dict"], strict=strict)
    except RuntimeError as err:
        reason = str(err).strip().splitlines()
        raise CheckpointError(
            f"checkpoint {path} does not fit the {type(learner).__name__} built from its hyperparameters:\n  "
            + "\n  ".join(reason[:6])
        ) from err
    learner.checkpoint_step = int(checkpoint.get("global_step", 0))
    learner.eval()


def _locate(path: str | Path) -> Path:
    """The checkpoint file of `path`: a run directory's last checkpoint, or the file itself."""
    path = Path(path)
    if path.is_dir():
        checkpoint = RunPaths(path).last_checkpoint
        if not checkpoint.is_file():
            raise FileNotFoundError(
                f"run directory {path} has no checkpoint ({checkpoint} is missing): a run writes it at its "
                "first epoch end, so one stopped before that has nothing to load"
            )
        return checkpoint
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: expected a run directory or a checkpoint file")
    return path


def load(
    path: str | Path, *, device: str | torch.device = "cpu", book: RecipeBook | None = None
) -> tuple[OuterLearner, RecipeConfig]:
    """The learner of a run of ttt.train, in eval mode on `device`, and the config it was built from.

    path: a run directory (its checkpoints/last.ckpt is loaded) or a checkpoint file of a run. book: the
    recipes to rebuild it with (None: the installed one, `installed_book`). Raises FileNotFoundError for a
    missing path or checkpoint, CheckpointError for an unreadable checkpoint or one that does not fit the
    learner its config builds (or is not a recipe's), ConfigError for a config its recipes cannot load
    (a builder they do not have); each message names the path.

        learner, cfg = ttt.load("runs/maml_longctx-20260101-120000-000000")
        params = learner.adapt(task)                 # a MetaLearner's task dict, without the task dim
        logits = learner.predict(params, task["tokens"][None])
    """
    checkpoint_path = _locate(path)
    checkpoint = load_checkpoint(checkpoint_path)
    saved = _saved_recipe_config(checkpoint, checkpoint_path)
    if saved is None:
        raise CheckpointError(
            f"checkpoint {checkpoint_path} was not written by a recipe run (it holds no recipe config, and "
            "no run config.yaml is beside it): load it with its class, YourLearner.load_from_checkpoint(path)"
        )
    learner, cfg = _recipe_learner(saved, checkpoint, checkpoint_path, book)
    return learner.to(device), cfg


def load_learner(
    cls: type[OuterLearner], path: str | Path, *, map_location: Any = "cpu", strict: bool = True, **kwargs
) -> OuterLearner:
    """`cls.load_from_checkpoint(path)`: the learner saved at `path`, its state loaded (strict: every
    tensor, as saved), on the device its tensors are mapped to (map_location, as torch.load's), in eval
    mode. A recipe's learner is rebuilt by its builder; any other is cls(**its hyperparameters, **kwargs),
    or cls(hparams=its hyperparameters, **kwargs) for an __init__ that saved its one argument `hparams`
    (Lightning's save_hyperparameters(hparams))."""
    path = Path(path)
    checkpoint = load_checkpoint(path, map_location=map_location)
    saved = _saved_recipe_config(checkpoint, path)
    if saved is not None:
        if kwargs:
            raise TypeError(
                f"checkpoint {path} is a recipe's: its learner is rebuilt from the run's config, which takes "
                f"no keyword arguments (got {', '.join(kwargs)})"
            )
        learner, cfg = _recipe_learner(saved, checkpoint, path, None)
        if not isinstance(learner, cls):
            raise CheckpointError(
                f"checkpoint {path} holds a {type(learner).__name__} (recipe {cfg.recipe}), not a "
                f"{cls.__name__}: load it with {type(learner).__name__}.load_from_checkpoint or ttt.load"
            )
    else:
        hparams = dict(checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_KEY) or {})
        parameters = {
            name: parameter
            for name, parameter in list(inspect.signature(cls.__init__).parameters.items())[1:]
            if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY)
        }
        single = checkpoint.get(cls.CHECKPOINT_HYPER_PARAMS_NAME)
        if single in parameters:  # Lightning's other pattern: __init__(self, hparams) saving hparams itself
            hparams = {single: hparams}
        hparams.update(kwargs)
        required = [name for name, parameter in parameters.items() if parameter.default is parameter.empty]
        missing = [name for name in required if name not in hparams]
        if missing:
            raise TypeError(
                f"checkpoint {path} has no hyperparameters {missing} that {cls.__name__}.__init__ needs: a "
                "learner that loads with no arguments builds its model from plain values its __init__ "
                "saves with self.save_hyperparameters() (see ttt.meta.MetaLearner); or pass them: "
                f"{cls.__name__}.load_from_checkpoint(path, {missing[0]}=...)"
            )
        learner = cls(**hparams)
        _restore(learner, checkpoint, path, strict=strict)
    state = checkpoint["state_dict"]
    return learner.to(next(iter(state.values())).device) if state else learner
