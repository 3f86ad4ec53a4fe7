"""Where a run lives: <run.root>/<run.name>/{config.yaml, logs/, checkpoints/last.ckpt, summary.json}."""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

CONFIG_FILE = "config.yaml"
LAST_CHECKPOINT = "last.ckpt"
PREEMPTED_FILE = "preempted.json"


@dataclass
class RunPaths:
    """The files of one run."""

    root: Path
    """The run directory."""

    @property
    def config(self) -> Path:
        """Resolved config of the run."""
        return self.root / CONFIG_FILE

    @property
    def checkpoints(self) -> Path:
        """Directory of checkpoints."""
        return self.root / "checkpoints"

    @property
    def last_checkpoint(self) -> Path:
        """Checkpoint written at the end of the latest epoch."""
        return self.checkpoints / LAST_CHECKPOINT

    @property
    def preempted(self) -> Path:
        """Written when a session stopped on a preemption signal (signal, outer step, checkpoint); removed
        when a resumed session starts training."""
        return self.root / PREEMPTED_FILE

    @property
    def summary(self) -> Path:
        """Final figures (JSON)."""
        return self.root / "summary.json"


class RunDirectoryError(ValueError):
    """A run directory, or the place for a new one, where the run cannot write; the message names the path
    and the key that chose it."""


def check_writable(path: str | os.PathLike, what: str, hint: str = "") -> None:
    """Raise RunDirectoryError (its message starts with `what`, e.g. "run.root=runs", and ends with `hint`)
    unless this process may create files in the directory `path` or, where it does not exist yet, in the
    nearest directory above it (in which it would be created). Asks the system (os.access, which also
    reports a read-only file system to root) rather than trying, so that nothing, not even a directory's
    modification time, changes."""
    hint = f"; {hint}" if hint else ""
    place = Path(path).absolute()
    while not place.exists() and place != place.parent:
        place = place.parent
    if not place.is_dir():
        raise RunDirectoryError(f"{what}: {place} is a file, not a directory{hint}")
    if not os.access(place, os.W_OK | os.X_OK):
        read_only = os.statvfs(place).f_flag & os.ST_RDONLY
        reason = "a read-only file system" if read_only else "no write permission"
        raise RunDirectoryError(f"{what}: cannot write in {place} ({reason}){hint}")


def new_run_dir(root: str, name: str | None, recipe: str) -> RunPaths:
    """Create a fresh run directory root/name (default name: <recipe>-<UTC time>); refuse to reuse one
    (FileExistsError). RunDirectoryError, naming run.root, when the file system refuses to create it."""
    if name is None:
        name = f"{recipe}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d-%H%M%S-%f')}"
    path = Path(root) / name
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"run directory {path} already exists; pick another run.name or resume={path}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:  # what `check_writable` could not foresee (a file system refusing directories)
        raise RunDirectoryError(
            f"run.root={root}: cannot create the run directory {path} ({err.strerror or err})"
        ) from err
    return RunPaths(path)


def resolve_resume(target: str) -> tuple[RunPaths, Path]:
    """resume=... -> (the run's paths, the checkpoint to load). target: a run directory (its last
    checkpoint is used) or a checkpoint file inside <run>/checkpoints/."""
    path = Path(target)
    if path.is_dir():
        paths, checkpoint = RunPaths(path), RunPaths(path).last_checkpoint
    elif path.is_file():
        paths, checkpoint = RunPaths(path.parent.parent), path
    else:
        raise FileNotFoundError(
            f"resume={target!r}: expected a run directory or a checkpoint file, found nothing"
        )
    if not checkpoint.is_file():
        raise FileNotFoundError(
            f"resume={target!r}: no checkpoint at {checkpoint} (a run writes it at its first epoch end: "
            "one stopped before that has nothing to resume; start a new run)"
        )
    if not paths.config.is_file():
        raise FileNotFoundError(
            f"resume={target!r}: no {CONFIG_FILE} in the run directory {paths.root} (a checkpoint file must "
            f"sit in <run>/checkpoints/, next to which the run's {CONFIG_FILE} is)"
        )
    return paths, checkpoint
