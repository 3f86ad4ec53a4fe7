"""`CompiledOnCuda`: a pure tensor function that runs eagerly on the CPU and, on CUDA tensors, compiled by
torch.compile, so that its chain of element-wise ops (and the reductions between them) is one kernel or a
few instead of one PyTorch kernel, and one read and write of every operand, per op.

The ops that use it (`ttt.models.linear_cross_entropy`, `ttt.models.fused_ops`) call it inside the forward
and backward of their `torch.autograd.Function`s: what is compiled is plain arithmetic with no autograd
graph, so it needs no derivative of its own (compiled graphs are not twice differentiable).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable

import torch


class CompiledOnCuda:
    """fn(*args) on CPU tensors; on CUDA tensors (args[0] decides) fn compiled by torch.compile, falling
    back to fn with a warning that names `owner` if compilation fails (fn is exact too, only slower).

    dynamic_rows: every dim but the last of each tensor argument is compiled as dynamic at a variant's
    first call (`torch._dynamo.maybe_mark_dynamic` on the arguments of the call that compiles; marking
    every call would cost the host a sixth of one), so a new batch size or chunk length never recompiles
    and the last (feature) dim stays a constant the kernel is specialised for. Without it torch.compile's
    default applies: a dim is compiled for its first size and made dynamic when it first changes (one
    recompile).

    Each variant of the arguments (`variant`: the tensors' dtypes, ranks, dims of size 1 and contiguity,
    the other arguments' values) is compiled from its own copy of fn's code: torch.compile's recompile
    limit (8 compiled versions of one code object, past which it runs fn uncompiled) then counts the
    recompiles of one variant, not every dtype, rank and flag a model passes."""

    def __init__(self, fn: Callable[..., object], owner: str, *, dynamic_rows: bool = False):
        self.fn, self.owner, self.dynamic_rows = fn, owner, dynamic_rows
        self._compiled: dict[tuple, Callable[..., object]] = {}
        self._failed = False

    def __call__(self, *args):
        if not args[0].is_cuda or self._failed:
            return self.fn(*args)
        try:
            return self.compiled(*args)
        except Exception as err:  # noqa: BLE001 - any compiler failure: the eager function is exact too
            warnings.warn(f"{self.owner} runs uncompiled ({type(err).__name__}: {err})", stacklevel=2)
            self._failed = True
            return self.fn(*args)

    def compiled(self, *args):
        """fn compiled by torch.compile, on tensors of any device, with no fallback (the tests run it on
        CPU tensors, where inductor's C++ backend compiles it)."""
        key = variant(args)
        compiled = self._compiled.get(key)
        # Detached: the arithmetic is compiled once, not once more for every combination of its inputs'
        # requires_grad flags (guarded by torch.compile).
        args = tuple(arg.detach() if isinstance(arg, torch.Tensor) else arg for arg in args)
        if compiled is None:
            compiled = self._compiled[key] = torch.compile(_own_code(self.fn), dynamic=None)
            if self.dynamic_rows:  # the call that compiles: its graph keeps these dims symbolic for the rest
                for arg in args:
                    if isinstance(arg, torch.Tensor):
                        for dim in range(arg.dim() - 1):
                            torch._dynamo.maybe_mark_dynamic(arg, dim)
        return compiled(*args)


def variant(args: tuple) -> tuple:
    """What torch.compile specialises a call on besides sizes: each tensor's dtype, device type, which of
    its dims have size 1 (those are never dynamic; their count is its rank) and whether it is contiguous
    (a layout of its own, compiled from its first call with its rows dynamic), each other argument's
    value."""
    return tuple(
        (arg.dtype, arg.device.type, tuple(size == 1 for size in arg.shape), arg.is_contiguous())
        if isinstance(arg, torch.Tensor) else arg
        for arg in args
    )  # fmt: skip


def _own_code(fn: Callable[..., object]) -> Callable[..., object]:
    """fn with a copy of its code object: torch.compile keeps its compiled versions, and counts them
    against its recompile limit, per code object."""
    code = fn.__code__.replace()
    copy = types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__qualname__, copy.__doc__ = fn.__qualname__, fn.__doc__
    return copy
