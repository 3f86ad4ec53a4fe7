"""One sweep point of the gradient-memory experiment: build the workload, run one full meta step, measure it.

A full meta step (`workloads`) is what training repeats: the inner steps (second order: with
create_graph), the outer loss with the adapted weights, and the outer backward into every parameter.
Measured per point:
    seconds       wall time of the step, CUDA synchronised before and after
    first_call_s  the same for the very first step of a (backend, order) pair: compilation included
    peak_gib      torch.cuda.max_memory_allocated during the step (reset just before), nothing
                  subtracted; parameters, gradients and tokens are in it (params_gib says how much).
                  Off CUDA: the parameters plus the peak of `LiveTensorMeter` (every tensor the step
                  creates, while it lives)
    saved_gib     peak bytes saved for backward (`SavedTensorMeter`), on any device
A failure never propagates: out-of-memory gives status "oom", anything else "error" (with the
exception's message); memory is released either way, so the sweep can go on.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import nn

from .gpu_memory_meters import LiveTensorMeter, SavedTensorMeter
from .workloads import Point, ProbeSetup, build

GIB = 2**30


def is_out_of_memory(err: BaseException) -> bool:
    """True for torch's OutOfMemoryError and for the RuntimeErrors some libraries raise instead."""
    return isinstance(err, torch.OutOfMemoryError) or (
        isinstance(err, RuntimeError) and "out of memory" in str(err).lower()
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _release(device: torch.device, *, collect: bool) -> None:
    """Free what a step left: cached CUDA blocks, and (collect=True, after a failure) whatever the
    exception's frames kept alive. A finished step's graph is freed by reference counting alone."""
    if collect:
        gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _timed_step(model: nn.Module, step: Callable[[], None], device: torch.device) -> float:
    model.zero_grad(set_to_none=True)
    _sync(device)
    start = time.perf_counter()
    step()
    _sync(device)
    return time.perf_counter() - start


def _measure(setup: ProbeSetup, point: Point, warmup: bool, builder) -> dict:
    model, step = builder(setup, point)
    params_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    row = {"params_gib": params_bytes / GIB}
    if warmup:
        row["first_call_s"] = _timed_step(model, step, setup.device)
    model.zero_grad(set_to_none=True)
    _release(setup.device, collect=False)
    if setup.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(setup.device)
    live = nullcontext() if setup.device.type == "cuda" else LiveTensorMeter()
    with SavedTensorMeter() as meter, live:
        row["seconds"] = _timed_step(model, step, setup.device)
    row["saved_gib"] = meter.peak_bytes / GIB
    if setup.device.type == "cuda":
        row["peak_gib"] = torch.cuda.max_memory_allocated(setup.device) / GIB
    else:
        row["peak_gib"] = (params_bytes + live.peak_bytes) / GIB
    return row


def measure(
    setup: ProbeSetup,
    point: Point,
    *,
    warmup: bool = False,
    builder: Callable[[ProbeSetup, Point], tuple[nn.Module, Callable[[], None]]] = build,
) -> dict:
    """Run and measure one meta step at `point`; with `warmup`, a first step (compilation included) is
    timed alone before it. builder(setup, point) -> (model, step) makes the workload (default:
    `workloads.build`; any setup with a `device` works with another builder, e.g.
    ttt/experiments/transformers_meta_step.py).

    Returns {"status": ok | oom | error, "error": message or "", "seconds", "first_call_s",
    "peak_gib", "saved_gib", "params_gib"}; after a failure the measured values are None.
    """
    row = dict.fromkeys(("seconds", "first_call_s", "peak_gib", "saved_gib", "params_gib"))
    status, error = "ok", ""
    try:
        row.update(_measure(setup, point, warmup, builder))
    except Exception as err:
        status, error = ("oom", "") if is_out_of_memory(err) else ("error", f"{type(err).__name__}: {err}")
    _release(setup.device, collect=status != "ok")
    return {**row, "status": status, "error": error}
