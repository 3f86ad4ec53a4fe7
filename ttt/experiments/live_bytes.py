"""`LiveTensorMeter`: peak bytes of all tensors alive during a block, for devices without allocator
statistics (the CPU); on CUDA the experiment reads `torch.cuda.max_memory_allocated` instead.

A TorchDispatchMode sees every aten op the block runs (autograd's backward ops included) and counts
the storage of each output once, until that storage is freed. Tensors that existed before the block
are not counted (add them yourself); buffers an op allocates and frees internally are not seen.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


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
