"""Files that are either completely written or not there: write a temporary file, then os.replace;
and the Lightning checkpoint IO that saves that way and loads through `load_checkpoint`."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from .checkpoint_file import load_checkpoint

FILE_MODE = 0o644
"""Mode of the files written here (mkstemp would leave them readable by their owner only)."""


def _atomic_write(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_bytes(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Call `write(handle)` on a temporary file beside `path`, then put it at `path` atomically."""
    _atomic_write(Path(path), write)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write `text` (UTF-8) to `path` atomically."""
    _atomic_write(Path(path), lambda handle: handle.write(text.encode()))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning checkpoint IO whose saves are atomic: a crash mid-save leaves the old checkpoint intact."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any = None) -> None:
        _atomic_write(Path(path), lambda handle: torch.save(checkpoint, handle))

    def load_checkpoint(
        self, path: _PATH, map_location: Any = "cpu", weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's restore (ckpt_path) through `load_checkpoint`: tensors only, errors naming the file."""
        return load_checkpoint(path, map_location=map_location)
