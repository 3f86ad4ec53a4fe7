"""`FastApplyFunction`: a `torch.autograd.Function` base whose apply skips torch's per-call argument
binding where no torch.func transform is active.

torch's `Function.apply`, for a Function with `setup_context`, binds the call's arguments to forward's
signature (`inspect.signature`) on every call: tens of microseconds of host time an apply (for
FlashBoB's chain: `python -m flashbob.bench host --stages second_order`), which a short call at batch
1 cannot hide behind the GPU's work. A Function applied with all of its arguments,
positionally, whose forward has no defaults, gains nothing from that binding; subclassing this one
drops it. Under a transform (vmap, grad, jvp) torch's own apply runs; dead functorch wrappers are
unwrapped as torch's apply does.
"""

from __future__ import annotations

import torch

try:  # torch's own Function.apply uses both; without them, every apply is torch's
    from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead_wrappers

    _transforms_active = torch._C._are_functorch_transforms_active
except (ImportError, AttributeError):
    _unwrap_dead_wrappers = _transforms_active = None


class FastApplyFunction(torch.autograd.Function):
    """Subclass it instead of `torch.autograd.Function` (module docstring); apply(*args) takes every
    argument of forward, positionally."""

    @classmethod
    def apply(cls, *args):
        if _transforms_active is None or _transforms_active():
            return super().apply(*args)
        return super(torch.autograd.Function, cls).apply(*_unwrap_dead_wrappers(args))
