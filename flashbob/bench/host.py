"""The host's time per launcher call, on a machine without a GPU: Triton's launch path runs for real
down to the driver, which is replaced by one that compiles for sm_90 and launches nothing.

    python -m flashbob.bench host                               # this tree, plans on and off
    python -m flashbob.bench host --base HEAD~1 --d 64,128 --n 2048 --stages bob

Per (stage, head dim, mask, side, launch plans on / off), rounds of --iters calls on CPU tensors of
shape (1, --heads, --n, d) in bf16, in an order that rotates from round to round; the table gives the
median microseconds per call over the rounds and [min, max]. Stage second_order is a whole call of
this tree's API through autograd (forward, gradient with create_graph, gradient of the gradients:
float16 inputs, as the API takes no bfloat16 CPU tensors), the launchers' part of it and autograd's
together. The stand-in driver (`stand_in_gpu`)
keeps everything Python does per launch: the launchers' own work, Triton's binding and cache
lookup, the launcher object's argument handling (TMA descriptors expanded into their fields);
what it leaves out is the driver's C side (cuLaunchKernelEx, cuTensorMapEncodeTiled for each TMA
descriptor) and CUDA's allocator (CPU tensors are allocated instead). So these figures are a
model: lower than a GPU machine's `host_ms` (`python -m flashbob.bench ab`), which is the figure of
record, but they move with the Python work that a change removes. --base adds another version's
launchers (a directory or commit, as `ab` takes them). Tiles are the interpreter's (CPU tensors),
which changes no launch's argument count. Must run without TRITON_INTERPRET.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import types
from unittest import mock

import torch
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia import driver as nvidia_driver
from triton.runtime import driver

from flashbob import triton_ops, validation
from flashbob.bench import host_ms, int_list, parse_mask, str_list

STAGES = ("forward", "backward", "bob", "second_order")
"""Launchers, and second_order: a whole second-order call through autograd (`flash_attention`,
`torch.autograd.grad` with create_graph, then the gradient of those gradients), this tree's only."""


_launch_to = None
"""Where the stand-in C launch sends each launch's arguments (None: nowhere)."""


def _c_launch(*args):
    """The driver's C launch, standing in: launches nothing."""
    if _launch_to is not None:
        _launch_to(args)


class _Utils:
    """The driver's utilities: a kernel "loads" as a stand-in module (Triton loads again while the
    module is None) and no function; a TMA descriptor is its fields; the C launch (`launch`, where
    Triton's launcher takes it from the utilities) launches nothing."""

    module = object()
    launch = staticmethod(_c_launch)

    def load_binary(self, name, kernel, shared, device):
        return self.module, None, 0, 0, 1024

    def get_device_properties(self, device):
        return {"max_shared_mem": 232448, "multiprocessor_count": 132, "max_num_regs": 65536, "warpSize": 32}

    def fill_tma_descriptor(self, *fields):
        return ("tma", *fields)

    fill_tma_descriptor_tiled = fill_tma_descriptor   # the names of newer Tritons

    def build_signature_metadata(self, signature):
        return tuple(signature)

    def is_stream_capturing(self, stream):
        return False


def _launcher(src, metadata):
    """Triton's own CUDA launcher, made without building its C module (where this Triton builds one per
    kernel, the build returns a module whose launch is `_c_launch`)."""
    patches = contextlib.ExitStack()
    with patches:
        if hasattr(nvidia_driver, "compile_module_from_src"):
            module = types.SimpleNamespace(launch=_c_launch)
            patches.enter_context(mock.patch.object(nvidia_driver, "compile_module_from_src",
                                                    lambda *args, **kwargs: module))
        if hasattr(nvidia_driver, "library_dirs"):
            patches.enter_context(mock.patch.object(nvidia_driver, "library_dirs", lambda: []))
        # Names a newer Triton takes from its driver's C module, which needs a GPU to build.
        for name in ("PyKernelArg", "ARG_CONSTEXPR", "ARG_KERNEL", "ARG_TUPLE"):
            if getattr(nvidia_driver, name, 0) is None:
                stand_in = (lambda **fields: tuple(sorted(fields.items()))) if name == "PyKernelArg" else name
                patches.enter_context(mock.patch.object(nvidia_driver, name, stand_in))
        return nvidia_driver.CudaLauncher(src, metadata)


class _StandInDriver:
    def __init__(self, arch: int):
        self.utils, self.launcher_cls, self.arch = _Utils(), _launcher, arch

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", self.arch, 32)

    def get_device_capability(self, device=0):
        return divmod(self.arch, 10)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def _package_module(ops, name: str):
    """The module `name` of the package that holds `ops` (None in a version without it)."""
    return sys.modules.get(ops.__name__.rpartition(".")[0] + "." + name)


@contextlib.contextmanager
def stand_in_gpu(*sides, arch: int = 90, launch_to=None):
    """Within the block Triton compiles for compute capability `arch` and launches nothing; the
    launchers of each of `sides` (triton_ops modules: flashbob.triton_ops by default, or another
    tree's copies) take CPU tensors for that GPU's. Launch plans made with either driver are
    forgotten on the way in and out. launch_to(args): called with each launch's arguments as the
    driver's C launch gets them (grid, stream, function, ..., then the kernel's), or None."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("the stand-in GPU compiles kernels: unset TRITON_INTERPRET")
    sides = sides or (triton_ops,)
    real_interpreter_check = validation.triton_interpreter_enabled
    validation.triton_interpreter_enabled = lambda: True   # the API's device check: take CPU tensors
    hoppers = [(h, h.on_hopper) for h in (_package_module(ops, "hopper") for ops in sides) if h is not None]
    plans_modules = [m for m in (_package_module(ops, "launch_plans") for ops in sides) if m is not None]
    global _launch_to
    previous = driver._active   # None until a driver is first asked for (none exists without a GPU)
    driver.set_active(_StandInDriver(arch))
    _launch_to = launch_to
    for hopper, _ in hoppers:
        hopper.on_hopper = lambda q: arch == 90
    for module in plans_modules:
        module.clear()
    try:
        yield
    finally:
        driver.set_active(previous)
        validation.triton_interpreter_enabled = real_interpreter_check
        _launch_to = None
        for hopper, on_hopper in hoppers:
            hopper.on_hopper = on_hopper
        for module in plans_modules:
            module.clear()


def stage_call(ops, stage: str, d: int, n: int, heads: int, causal: bool, window: int | None):
    """A no-argument call of `ops`' launcher of `stage` on fixed random bf16 CPU inputs (1, heads, n, d);
    second_order on float16 ones (the API refuses bfloat16 CPU tensors), None for another tree."""
    if stage == "second_order":
        return _second_order_call(ops, d, n, heads, causal, window)
    gen = torch.Generator().manual_seed(0)
    q, k, v, out, dout, dq, u_q, u_k, u_v = (torch.randn(1, heads, n, d, generator=gen).bfloat16()
                                             for _ in range(9))
    lse = torch.zeros(1, heads, n)
    opts = dict(causal=causal, window=window, scale=d**-0.5)
    if stage == "forward":
        return lambda: ops.forward(q, k, v, **opts)
    if stage == "backward":
        return lambda: ops.backward(q, k, v, out, lse, dout, **opts)
    if stage == "bob":
        return lambda: ops.bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, **opts)
    raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")


def _second_order_call(ops, d: int, n: int, heads: int, causal: bool, window: int | None):
    if ops is not triton_ops:
        return None
    import flashbob

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, heads, n, d, generator=gen).half().requires_grad_() for _ in range(3))
    dout, u_q, u_k, u_v = (torch.randn(1, heads, n, d, generator=gen).half() for _ in range(4))

    def call():
        out = flashbob.flash_attention(q, k, v, causal=causal, window=window, backend="triton")
        grads = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
        torch.autograd.grad(grads, (q, k, v), (u_q, u_k, u_v))

    return call




@contextlib.contextmanager
def plans(on: bool | None):
    """Launch plans on or off (FLASHBOB_LAUNCH_PLANS) within the block; None: as they are (a version
    without them)."""
    previous = os.environ.get("FLASHBOB_LAUNCH_PLANS")
    if on is not None:
        os.environ["FLASHBOB_LAUNCH_PLANS"] = "1" if on else "0"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("FLASHBOB_LAUNCH_PLANS", None)
        else:
            os.environ["FLASHBOB_LAUNCH_PLANS"] = previous


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(prog="python -m flashbob.bench host", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", type=str_list, default=list(STAGES))
    p.add_argument("--d", type=int_list, default=[64, 128], help="head dims")
    p.add_argument("--mask", type=str_list, default=["causal", "full"])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--base", default=None, help="another version's launchers (a directory or commit)")
    args = p.parse_args(argv)
    sides = [("this", triton_ops)]
    if args.base:
        from flashbob.bench import ab

        sides.insert(0, ("base", ab.import_side(ab.resolve(args.base), "flashbob_host_base")))
    with stand_in_gpu(*(ops for _, ops in sides)):
        return _measure(args, sides)


def _measure(args, sides) -> list[dict]:
    rows = []
    print("| stage | head dim, mask | side | plans | us / call [min, max] |")
    print("|---|---|---|---|---|")
    for stage in args.stages:
        for d in args.d:
            for mask in args.mask:
                causal, window = parse_mask(mask)
                variants = [(name, ops, on) for name, ops in sides
                            for on in ((True, False) if _package_module(ops, "launch_plans") else (None,))]
                calls = {}
                for name, ops, on in variants:
                    with plans(on):
                        call = stage_call(ops, stage, d, args.n, args.heads, causal, window)
                        if call is None:
                            continue
                        calls[name, on] = call
                        for _ in range(3):
                            call()
                variants = [variant for variant in variants if (variant[0], variant[2]) in calls]
                times = {key: [] for key in calls}
                for r in range(args.rounds):
                    order = variants[r % len(variants):] + variants[:r % len(variants)]
                    for name, _, on in order:
                        with plans(on):
                            times[name, on].append(1e3 * host_ms(calls[name, on], args.iters))
                for (name, on), values in times.items():
                    row = dict(stage=stage, d=d, mask=mask, side=name, plans=on,
                               us=statistics.median(values), us_min=min(values), us_max=max(values))
                    rows.append(row)
                    plans_text = "-" if on is None else "on" if on else "off"
                    print(f"| {stage} | {d}, {mask} | {name} | {plans_text} | "
                          f"{row['us']:.1f} [{row['us_min']:.1f}, {row['us_max']:.1f}] |", flush=True)
    return rows


if __name__ == "__main__":
    main()
