"""Run directories, atomic files and checkpoints, outer-step timing, and the end-of-run summary."""

from .atomic import AtomicCheckpointIO, atomic_write_text
from .checkpointing import EpochEndCheckpoint, LogStepAlignment
from .directory import RunPaths, new_run_dir, resolve_resume
from .divergence import DivergenceError, DivergenceGuard
from .summary import format_summary_table, write_summary
from .timing import OuterStepTimer

__all__ = [
    "AtomicCheckpointIO",
    "DivergenceError",
    "DivergenceGuard",
    "EpochEndCheckpoint",
    "LogStepAlignment",
    "OuterStepTimer",
    "RunPaths",
    "atomic_write_text",
    "format_summary_table",
    "new_run_dir",
    "resolve_resume",
    "write_summary",
]
