"""Reading a run's checkpoint: the one loader of checkpoint files (resume validation and Lightning's
restore both use it), with errors that name the file and say what to do."""

from __future__ import annotations

import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

EXPECTED_KEYS = ("state_dict", "global_step", "optimizer_states", "lr_schedulers", "loops")
"""Entries of a Lightning training checkpoint that resuming needs."""

WHAT_TO_DO = (
    "runs write their checkpoints atomically, so this file was damaged or replaced outside the run (a "
    "partial copy, a full disk): copy it again from where it came from, resume from another checkpoint "
    "file (resume=RUN/checkpoints/FILE), or start a new run"
)


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read, or that does not fit the run; the message names the file."""


def load_checkpoint(path: str | Path, *, map_location: Any = "cpu", mmap: bool = False) -> dict[str, Any]:
    """The checkpoint dict saved at `path` (tensors and plain containers only: weights_only=True).

    mmap=True maps the tensors' storage instead of reading it (cheap checks of large checkpoints).
    Raises CheckpointError naming the file and saying what to do when it is missing, empty,
    truncated, not a checkpoint, or holds objects other than tensors and plain containers.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (or is not a file)")
    if path.stat().st_size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes); {WHAT_TO_DO}")
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as err:
        if "Unsupported global" in str(err):  # a real pickle of classes, not a damaged file
            raise CheckpointError(
                f"checkpoint {path} holds Python objects other than tensors and plain containers, which are "
                "not loaded (unpickling them could run arbitrary code); ttt.train's checkpoints hold none: "
                f"was it written by another program? {WHAT_TO_DO}"
            ) from err
        raise CheckpointError(
            f"checkpoint {path} is not a PyTorch checkpoint (its bytes do not unpickle); {WHAT_TO_DO}"
        ) from err
    except (RuntimeError, EOFError, zipfile.BadZipFile, ValueError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupt ({type(err).__name__}: {reason}); {WHAT_TO_DO}"
        ) from err
    if not isinstance(checkpoint, Mapping):
        raise CheckpointError(
            f"checkpoint {path} holds a {type(checkpoint).__name__}, not a training checkpoint (a dict)"
        )
    return dict(checkpoint)


def check_resumable(
    checkpoint: Mapping[str, Any], path: str | Path, state_dict: Mapping[str, torch.Tensor]
) -> None:
    """Raise CheckpointError unless `checkpoint` (from `path`) is a training checkpoint whose model
    state has exactly the names and shapes of `state_dict` (the model built from the run's config)."""
    missing = [key for key in EXPECTED_KEYS if key not in checkpoint]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} is not a training checkpoint of ttt.train: it lacks {', '.join(missing)} "
            "(a weights-only file cannot be resumed; start a new run)"
        )
    saved = checkpoint["state_dict"]
    problems = [f"missing from the checkpoint: {name}" for name in state_dict if name not in saved]
    problems += [f"not in the model: {name}" for name in saved if name not in state_dict]
    problems += [
        f"{name}: checkpoint {tuple(saved[name].shape)}, model {tuple(value.shape)}"
        for name, value in state_dict.items()
        if name in saved and tuple(saved[name].shape) != tuple(value.shape)
    ]
    if problems:
        shown = "\n  ".join(problems[:5]) + (
            f"\n  ... and {len(problems) - 5} more" if len(problems) > 5 else ""
        )
        raise CheckpointError(
            f"checkpoint {path} does not fit the model built from the run's config ({len(problems)} "
            f"differences):\n  {shown}\nan override that changes the model's shape (model.*, inner.params, "
            "inner.learnable_lr, ...) cannot be applied on resume: drop it, or start a new run with it; "
            "the run directory was left unchanged"
        )


def trained_minutes(checkpoint: Mapping[str, Any]) -> float | None:
    """Training minutes that Lightning's time limit (trainer.max_minutes) has counted in the run saved in
    `checkpoint` (its Timer state, which a resume restores), or None when that run had no time limit."""
    timer = checkpoint.get("callbacks", {}).get("Timer")
    if not isinstance(timer, Mapping):
        return None
    return float(timer.get("time_elapsed", {}).get("train", 0.0)) / 60.0
