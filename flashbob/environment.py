"""What a measurement ran on: device, library versions, commit, command and time, for benchmark records.

One helper for every benchmark and experiment (`flashbob.bench`, `ttt.experiments.grad_memory`); it
lives in `flashbob` because `ttt` may import `flashbob` but not the other way round.
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
import sys

import torch


def _git(*args: str, root: str | None = None) -> str | None:
    where = [] if root is None else ["-C", root]
    try:
        done = subprocess.run(["git", *where, *args], capture_output=True, text=True, check=True, timeout=10)
        return done.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def commit(root: str | None = None) -> str:
    """The commit of the working directory's checkout, or of the checkout at `root`: $FLASHBOB_COMMIT
    when set and root is None (a copy of the tree whose .git, if any, is not the tree's own: the GPU
    machine's copy carried a stale .git and reported another commit), else HEAD's short hash (with
    "+dirty" when tracked files differ), else "unknown" (also for a root that is not the top of a
    checkout, such as a copy inside another one)."""
    if root is None and os.environ.get("FLASHBOB_COMMIT"):
        return os.environ["FLASHBOB_COMMIT"]
    if root is not None:
        top = _git("rev-parse", "--show-toplevel", root=root)
        if top is None or os.path.realpath(top) != os.path.realpath(root):
            return "unknown"
    head = _git("rev-parse", "--short=12", "HEAD", root=root)
    if head is None:
        return "unknown"
    return head + ("+dirty" if _git("status", "--porcelain", "--untracked-files=no", root=root) else "")


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except ImportError:
        return None


def describe(device: torch.device, module: str, args: list[str] | None = None) -> dict:
    """Where and how `python -m module ARGS` (or `python script.py ARGS` when module ends in .py) runs
    (args: the command-line arguments; None: sys.argv's):
    device type, name and memory (GiB; None off CUDA), CPU count, python / torch / triton / CUDA
    versions, the CUDA allocator's settings ($PYTORCH_CUDA_ALLOC_CONF, None when unset), commit, the
    command line and the UTC time."""
    launcher = "python" if module.endswith(".py") else "python -m"
    info = {
        "device_type": device.type,
        "device": platform.processor() or platform.machine(),
        "device_memory_gib": None,
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "cuda": torch.version.cuda,
        "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "commit": commit(),
        "command": " ".join([launcher, module, *(sys.argv[1:] if args is None else args)]),
        "utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=props.name, device_memory_gib=round(props.total_memory / 2**30, 1))
    return info
