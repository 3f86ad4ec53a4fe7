"""Where a run lives: <run.root>/<run.name>/{config.yaml, logs/, checkpoints/last.ckpt, summary.json}."""

from __future__ import annotations

import datetime as dt
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


def new_run_dir(root: str, name: str | None, recipe: str) -> RunPaths:
    """Create a fresh run directory root/name (default name: <recipe>-<UTC time>); refuse to reuse one."""
    if name is None:
        name = f"{recipe}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d-%H%M%S-%f')}"
    path = Path(root) / name
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"run directory {path} already exists; pick another run.name or resume={path}")
    path.mkdir(parents=True, exist_ok=True)
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
