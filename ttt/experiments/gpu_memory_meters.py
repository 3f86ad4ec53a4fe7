"""Two meters of the memory a meta step uses, for `meta_step_probe`.

`SavedTensorMeter`: live and peak bytes of the tensors autograd keeps for backward, on any device.

Every tensor an autograd node saves (`ctx.save_for_backward`, the inputs of a matmul, ...) passes
through a pack hook; the meter counts each storage once while any node still holds it, so the peak
is the activation memory of a meta step as the back-of-envelope model counts it: no allocator
slack, no transient buffers, no gradients. Inside `torch.utils.checkpoint` regions the checkpoint's
own hooks take over, so recomputed activations are (correctly) not counted there. With by_source,
each storage is also charged to the line of `ttt` or `flashbob` code that first saved it (the
innermost such frame of the Python stack: a custom Function's setup_context, or the line that called a
built-in op), for finding which operation's saved tensors grow.

`LiveTensorMeter`: peak bytes of all tensors alive during a block, for devices without allocator
statistics (the CPU); on CUDA the experiment reads `torch.cuda.max_memory_allocated` instead.

A TorchDispatchMode sees every aten op the block runs (autograd's backward ops included) and counts
the storage of each output once, until that storage is freed. Tensors that existed before the block
are not counted (add them yourself); buffers an op allocates and frees internally are not seen.
"""

from __future__ import annotations

import traceback
import weakref
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flashbob import function_apply


class _Held:
    """What the graph stores instead of a saved tensor; its death tells the meter the node let go."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class SavedTensorMeter:
    """Context manager: `with SavedTensorMeter() as meter: ...; meter.peak_bytes`.

    live_bytes: bytes of distinct storages currently saved for backward.
    peak_bytes: maximum of live_bytes since entering.
    by_source: also charge each storage to the code that first saved it (`live_by_source`; slow: reads
    the stack at every save).
    """

    def __init__(self, *, by_source: bool = False):
        self.live_bytes = 0
        self.peak_bytes = 0
        self._holders: dict[tuple, int] = {}
        self._sources: dict[tuple, tuple[str, int]] | None = {} if by_source else None
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def live_by_source(self) -> Counter:
        """Bytes of the storages saved now, by "path:line function" of the code that first saved each
        (paths from the package root; "?" outside ttt and kernels). Needs by_source=True."""
        if self._sources is None:
            raise RuntimeError("live_by_source needs SavedTensorMeter(by_source=True)")
        charged = Counter()
        for source, nbytes in self._sources.values():
            charged[source] += nbytes
        return charged

    def _pack(self, tensor: torch.Tensor) -> _Held:
        storage = tensor.untyped_storage()
        key = (tensor.device, storage.data_ptr())
        if self._holders.get(key, 0) == 0:
            self.live_bytes += storage.nbytes()
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            if self._sources is not None:
                self._sources[key] = (_saving_code(), storage.nbytes())
        self._holders[key] = self._holders.get(key, 0) + 1
        # A detached alias: holding the tensor itself would make a node that saves its own output
        # reference itself through its grad_fn, a cycle that keeps the graph alive.
        held = _Held(tensor.detach())
        weakref.finalize(held, self._release, key, storage.nbytes())
        return held

    @staticmethod
    def _unpack(held: _Held) -> torch.Tensor:
        return held.tensor

    def _release(self, key: tuple, nbytes: int) -> None:
        self._holders[key] -= 1
        if self._holders[key] == 0:
            del self._holders[key]
            self.live_bytes -= nbytes
            if self._sources is not None:
                del self._sources[key]

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


_PASS_THROUGH = (__file__, function_apply.__file__)
"""Frames never charged: this module's, and `FastApplyFunction.apply` (as torch's own apply is not)."""


def _saving_code() -> str:
    """"path:line function" of the innermost frame in ttt/ or flashbob/ outside `_PASS_THROUGH`."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename in _PASS_THROUGH:
            continue
        for package in ("/ttt/", "/flashbob/"):
            if package in frame.filename:
                path = package[1:] + frame.filename.rsplit(package, 1)[1]
                return f"{path}:{frame.lineno} {frame.name}"
    return "?"


class LiveTensorMeter(TorchDispatchMode):
    """Context manager: `with LiveTensorMeter() as meter: ...; meter.peak_bytes`.

    live_bytes: bytes of the storages created in the block and not yet freed.
    peak_bytes: maximum of live_bytes since entering.
    """

    def __init__(self):
        super().__init__()
        self.live_bytes = 0
        self.peak_bytes = 0
        self._sizes: dict[int, int] = {}

    def _track(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if nbytes == 0 or key in self._sizes:
            return
        self._sizes[key] = nbytes
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.live_bytes -= self._sizes.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor):
                self._track(leaf)
        return out
