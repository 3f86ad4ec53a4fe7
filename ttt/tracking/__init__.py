"""Run directories, atomic files, checkpoints and their loader, checkpoints on preemption signals and by
time, outer-step timing, the divergence guard, the loss-spike watch, the out-of-memory advice, and the
end-of-run summary and figures."""

from .atomic import AtomicCheckpointIO, atomic_write_text
from .checkpoint_file import CheckpointError, check_resumable, load_checkpoint, trained_minutes
from .checkpointing import EpochEndCheckpoint, LastEpochEndsAtMaxSteps, LogStepAlignment
from .directory import RunDirectoryError, RunPaths, check_writable, new_run_dir, resolve_resume
from .divergence import DivergenceError, DivergenceGuard
from .loss_spikes import LossSpikeWatch
from .out_of_memory import out_of_memory_advice
from .preemption import Preempted, PreemptionSignals, StepBoundaryCheckpoint, StoppedAtOnce, stopped_at_once
from .report import write_run_report
from .summary import finished_at, format_summary_table, write_summary
from .timing import OuterStepTimer

__all__ = [
    "AtomicCheckpointIO",
    "CheckpointError",
    "DivergenceError",
    "DivergenceGuard",
    "EpochEndCheckpoint",
    "LastEpochEndsAtMaxSteps",
    "LogStepAlignment",
    "LossSpikeWatch",
    "OuterStepTimer",
    "Preempted",
    "PreemptionSignals",
    "RunDirectoryError",
    "RunPaths",
    "StepBoundaryCheckpoint",
    "StoppedAtOnce",
    "atomic_write_text",
    "check_resumable",
    "check_writable",
    "finished_at",
    "format_summary_table",
    "load_checkpoint",
    "new_run_dir",
    "out_of_memory_advice",
    "resolve_resume",
    "stopped_at_once",
    "trained_minutes",
    "write_run_report",
    "write_summary",
]
