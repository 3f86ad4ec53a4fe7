"""What a measurement ran on: device, library versions, commit, command; for the experiment's records."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys

import torch


def _git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def commit() -> str:
    """HEAD's hash (with "+dirty" when tracked files differ), else $TTT_COMMIT, else "unknown"."""
    head = _git("rev-parse", "--short=12", "HEAD")
    if head is None:
        return os.environ.get("TTT_COMMIT", "unknown")
    return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no") else "")


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def describe(device: torch.device) -> dict:
    """Device name (and memory), python/torch/triton/CUDA versions, commit, command line and UTC time."""
    info = {
        "device": platform.processor() or platform.machine(),
        "device_memory_gib": None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "commit": commit(),
        "command": " ".join(["python -m ttt.experiments.grad_memory", *sys.argv[1:]]),
        "utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1))
    return info
