"""`recomputed`: run a function, keep only its inputs, and run it again in the backward.

    out = recomputed(fn, *args, module=reader)      # fn(*args), its intermediate tensors dropped

Activation checkpointing for regions that take gradients themselves, such as a chunk of test-time
training (score, then an inner step through `torch.autograd.grad(create_graph=True)`). PyTorch's
non-reentrant checkpoint drops the region's saved tensors as the forward runs, so an inner gradient
taken inside the region recomputes the region once more during the forward: three runs of it per
outer step. Here the region's forward runs as plain autograd on detached copies of its inputs (the
inner gradient uses that graph), only the outputs leave it, and the backward runs it once more: two
runs, and nesting works (a region that runs recomputed regions, e.g. a run of chunks of which only
the first carry is kept).

fn(*args): args and the outputs are nested tuples, lists and dicts (pytrees) of tensors and other
values; tensors among the args become inputs of one autograd node, tensors among the outputs its
outputs. fn may also use the parameters of `module` (reached through the module's attributes, as its
methods do): those that need a gradient become inputs of the node too, and the backward returns their
gradients into the graph. fn must compute the same values when run again (no randomness). The
backward reruns fn under the autocast state of the forward, with the recorded forwards of every op
registered by `register_replay` handed back (`linear_cross_entropy` registers itself: its forward is
the costly part of a chunk), and differentiates it with `torch.autograd.grad` (so `torch.autograd.grad`
and `.backward()` both work on the result; under create_graph the gradients are differentiable once
more).

Under create_graph the rerun must take the node's inputs and parameters with their history (the
gradients it returns are functions of them), yet its `torch.autograd.grad` must stop at them: a tensor
it differentiates against that leads further back (a parameter the earlier chunks used too, an input
computed from another input) would pull the earlier regions' gradients into this node's, counted once
here and once more when the backward reaches them, and rerun every earlier region (2^k - 1 reruns for
k chunks). So the rerun gets a view of each input tensor and of each of the module's parameters
(`_parameters_as_views`): a view's history is one node deep, and only the rerun uses it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

ReplayContexts = Callable[[], tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]]
"""factory() -> (record, replay) context managers for one recomputed region: inside `record` (the
forward) an op records its outputs, inside `replay` (the recomputation) it hands them back in the same
order instead of computing them again."""

_REPLAYS: list[ReplayContexts] = []


def register_replay(factory: ReplayContexts) -> ReplayContexts:
    """Register an op whose forwards a recomputed region replays instead of recomputing (the same values:
    the op must return, in replay, what it recorded). Returns factory (usable as a decorator)."""
    if factory not in _REPLAYS:
        _REPLAYS.append(factory)
    return factory


def _replay_contexts() -> tuple[_Together, _Together]:
    """One (record, replay) pair over every registered op's contexts."""
    pairs = [factory() for factory in _REPLAYS]
    return _Together([pair[0] for pair in pairs]), _Together([pair[1] for pair in pairs])


class ReplayLog:
    """One op's records in the recomputed regions running now, for `register_replay`: each region gets
    a list of entries (`contexts`), which the op's calls append to in order while the region's forward
    records and take back in the same order while its recomputation replays (from the first again at
    each replay: a region may be recomputed more than once). A call belongs to the innermost region
    running (`region`). Module-wide, not per thread: the backward that recomputes a region may run on
    another thread than its forward.

        LOG = ReplayLog("my_op")
        register_replay(LOG.contexts)
        region = LOG.region()                 # in the op: None outside a recomputed region
        if region is not None and region.replaying: out = region.take()
        else: out = compute(); region is None or region.record(out)
    """

    def __init__(self, op: str):
        self.op = op
        self._active: list[_Entries] = []

    def contexts(self) -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """(record, replay) for one region: a `ReplayContexts` factory (also a valid `context_fn` of
        torch.utils.checkpoint, non-reentrant)."""
        entries = _Entries(self.op)
        return _EntriesContext(self._active, entries, False), _EntriesContext(self._active, entries, True)

    def region(self) -> _Entries | None:
        """The innermost running region's entries, or None outside every region."""
        return self._active[-1] if self._active else None


class _Entries:
    """What one op's calls recorded in one region, and whether the region is replaying them now."""

    def __init__(self, op: str):
        self.op, self.entries, self.replaying, self.cursor = op, [], False, 0

    def record(self, entry: Any) -> None:
        """Append the entry of a call of the region's forward."""
        self.entries.append(entry)

    def take(self) -> Any:
        """The next entry, for a call of the recomputation."""
        if self.cursor >= len(self.entries):
            raise RuntimeError(f"{self.op}: the recomputation runs a call that its forward did not")
        self.cursor += 1
        return self.entries[self.cursor - 1]


class _EntriesContext(contextlib.AbstractContextManager):
    """Makes `entries` the innermost of `active`, recording (from empty) or replaying (from its first
    entry); re-entrant, as the recomputation context of a checkpoint must be."""

    def __init__(self, active: list[_Entries], entries: _Entries, replaying: bool):
        self.active, self.entries, self.replaying = active, entries, replaying

    def __enter__(self):
        self.entries.replaying, self.entries.cursor = self.replaying, 0
        if not self.replaying:
            self.entries.entries.clear()
        self.active.append(self.entries)
        return self

    def __exit__(self, *exc):
        self.active.remove(self.entries)
        return False


class _Together(contextlib.AbstractContextManager):
    """Context managers entered in order and left in reverse order, as one (re-entrant when each is)."""

    def __init__(self, contexts: list[contextlib.AbstractContextManager]):
        self.contexts = contexts

    def __enter__(self):
        for context in self.contexts:
            context.__enter__()
        return self

    def __exit__(self, *exc):
        for context in reversed(self.contexts):
            context.__exit__(*exc)
        return False


def recomputed(fn: Callable[..., Any], *args: Any, module: nn.Module | TrainableParameters | None) -> Any:
    """fn(*args), recomputed in the backward instead of keeping its intermediate tensors (module
    docstring); module: the module whose parameters fn uses (those that need gradients get them), or
    its `TrainableParameters` (a caller that runs many regions over one module finds them once), None
    when fn uses no tensor outside args that needs a gradient. Returns fn's outputs (same structure;
    tensors detached from fn's own graph and attached to one recompute node)."""
    leaves, spec = tree_flatten(args)
    tensor_slots = [i for i, leaf in enumerate(leaves) if torch.is_tensor(leaf)]
    params = module if isinstance(module, TrainableParameters) else TrainableParameters(module)
    region = _Region(fn, leaves, spec, tensor_slots, params)
    outputs = _Recomputed.apply(region, *(leaves[i] for i in tensor_slots), *params.current())
    return region.rebuild_outputs(outputs if isinstance(outputs, tuple) else (outputs,))


class TrainableParameters:
    """A module's parameters that need gradients, in `parameters()` order, and the slots (submodule,
    name) that hold them, found by one walk of the module's tree. Valid while the module keeps its
    structure and its parameters' requires_grad flags (a read's chunks); what the slots hold may change
    (the views a rerun swaps in), and `current` reads it."""

    def __init__(self, module: nn.Module | None):
        first = [] if module is None else [p for p in module.parameters() if p.requires_grad]
        index = {id(p): i for i, p in enumerate(first)}
        self.slots = [
            (sub, name, index[id(param)])
            for sub in ([] if module is None else module.modules())
            for name, param in sub._parameters.items()
            if param is not None and id(param) in index
        ]
        """(submodule, name, position in `current`) of every slot holding one of the parameters (a weight
        two submodules share has two slots)."""
        self.count = len(first)

    def current(self) -> list[torch.Tensor]:
        """What the slots hold now, one tensor per parameter in `parameters()` order: the parameters, or
        the views of a rerun (`_parameters_as_views`)."""
        now: list[torch.Tensor | None] = [None] * self.count
        for sub, name, i in self.slots:
            if now[i] is None:
                now[i] = sub._parameters[name]
        return now


@contextlib.contextmanager
def _parameters_as_views(params: TrainableParameters):
    """Within the block, each of the slots' tensors is replaced by a view of itself (one view per tensor:
    a weight two submodules share stays shared); yields the views in `current` order. The slots get
    their tensors back on leaving."""
    views = [p.view_as(p) for p in params.current()]
    swapped = [(sub, name, sub._parameters[name]) for sub, name, _ in params.slots]
    for sub, name, i in params.slots:
        sub._parameters[name] = views[i]
    try:
        yield views
    finally:
        for sub, name, param in swapped:
            sub._parameters[name] = param


class _Region:
    """fn and its flattened arguments (the tensor slots filled per run), and the structure of its
    outputs once it has run."""

    def __init__(self, fn, leaves: list, spec, tensor_slots: list[int], params: TrainableParameters):
        self.fn, self.leaves, self.spec, self.tensor_slots = fn, leaves, spec, tensor_slots
        self.params = params
        self.out_constants: list | None = None
        """The output leaves of the forward run, tensors replaced by `_TENSOR` (no graph kept here)."""
        self.out_spec = None

    @property
    def inputs(self) -> int:
        """How many of the node's inputs are fn's argument tensors (the rest are params)."""
        return len(self.tensor_slots)

    def run(self, tensors: Sequence[torch.Tensor]) -> list:
        """fn on the arguments with their tensors replaced by `tensors`; its output leaves (flattened)."""
        leaves = list(self.leaves)
        for slot, tensor in zip(self.tensor_slots, tensors):
            leaves[slot] = tensor
        out_leaves, self.out_spec = tree_flatten(self.fn(*tree_unflatten(leaves, self.spec)))
        return out_leaves

    def keep_constants(self, out_leaves: list) -> None:
        """Remember the non-tensor output leaves of the forward run."""
        self.out_constants = [_TENSOR if torch.is_tensor(leaf) else leaf for leaf in out_leaves]

    def rebuild_outputs(self, tensors: tuple) -> Any:
        """The outputs of the forward run with their tensors replaced by the node's outputs."""
        tensors = iter(tensors)
        leaves = [next(tensors) if leaf is _TENSOR else leaf for leaf in self.out_constants]
        return tree_unflatten(leaves, self.out_spec)


_TENSOR = object()
"""Placeholder of a tensor among a region's output leaves."""


def _detached(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Fresh leaves sharing storage with tensors, requiring grad where they did."""
    return [t.detach().requires_grad_(t.requires_grad) for t in tensors]


def _autocast_state() -> list[tuple[str, bool, torch.dtype]]:
    """(device type, autocast on, its dtype) for the CPU and, where there is one, CUDA."""
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    return [
        (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in devices
    ]


class _Recomputed(torch.autograd.Function):
    """(region, fn's argument tensors..., params...) -> fn's output tensors; backward: module docstring."""

    @staticmethod
    def forward(ctx, region: _Region, *tensors):
        inputs = tensors[: region.inputs]
        ctx.region, ctx.autocast = region, _autocast_state()
        ctx.record, ctx.replay = _replay_contexts()
        ctx.save_for_backward(*inputs)
        ctx.set_materialize_grads(False)  # an output nothing used (the last chunk's carry) costs nothing
        with torch.enable_grad(), ctx.record:
            out_leaves = region.run(_detached(inputs))
        region.keep_constants(out_leaves)
        outputs = [leaf for leaf in out_leaves if torch.is_tensor(leaf)]
        ctx.differentiable = [out.requires_grad for out in outputs]
        detached = tuple(out.detach() for out in outputs)
        ctx.mark_non_differentiable(*(d for d, diff in zip(detached, ctx.differentiable) if not diff))
        return detached

    @staticmethod
    def backward(ctx, *grads):
        region = ctx.region
        # Under create_graph the gradients must reach the inputs' own graph, and stop at them: rerun on
        # views of the inputs and parameters (module docstring). Else on fresh leaves and the module's
        # parameters as they are now (a region's forward run inside a rerun saw the views of that rerun).
        saved, create_graph = ctx.saved_tensors, torch.is_grad_enabled()
        with contextlib.ExitStack() as stack:
            for device, enabled, dtype in ctx.autocast:
                stack.enter_context(torch.autocast(device, enabled=enabled, dtype=dtype))
            stack.enter_context(torch.enable_grad())
            if create_graph:
                inputs = [t.view_as(t) if t.requires_grad else t for t in saved]
                params = stack.enter_context(_parameters_as_views(region.params))
            else:
                inputs, params = _detached(saved), region.params.current()
            stack.enter_context(ctx.replay)
            outputs = [leaf for leaf in region.run(inputs) if torch.is_tensor(leaf)]
        pairs = [
            (out, grad)
            for out, grad, diff in zip(outputs, grads, ctx.differentiable)
            if diff and grad is not None and out.requires_grad
        ]
        candidates = inputs + params
        needs = ctx.needs_input_grad[1:]
        wanted = [i for i, need in enumerate(needs) if need and candidates[i].requires_grad]
        result: list[torch.Tensor | None] = [None] * len(candidates)
        if pairs and wanted:
            found = torch.autograd.grad(
                [out for out, _ in pairs],
                [candidates[i] for i in wanted],
                [grad for _, grad in pairs],
                allow_unused=True,
                create_graph=torch.is_grad_enabled(),
            )
            for i, grad in zip(wanted, found):
                result[i] = grad
        return (None, *result)
