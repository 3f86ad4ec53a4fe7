"""Launch plans: a launcher's kernel launches, recorded once per input layout and replayed after.

A launcher call (forward, backward, BoB, forward with tangent) spends most of its host time on work
its inputs' layouts already decide: choosing tiles, the mask arguments, TMA descriptors and their
checks, and Triton's own per-launch binding (specializing some 60 arguments into a cache key). The
first call with a given layout runs the launcher as written while `recording`: each launch goes
through Triton as usual and returns its compiled kernel, whose arguments are then sorted into
constants, the call's tensors (`slots`: inputs and outputs, by name) and the scratch buffers the
launcher allocated (`scratch`). A later call with the same `key` only allocates its outputs and
`replay`s: it allocates the scratch and hands each compiled kernel its arguments: straight to the
driver's C launch with the TMA tensor maps encoded once per address where Triton's launcher has the
form of Triton 3.6 (`_DirectLaunch`), else to the launcher with the descriptors rebuilt around the new
tensors (`_TritonLaunch`), as Triton's `JITFunction.run` would. Each launch's form is checked when the
plan is made: run once more through Triton with both sides captured (nothing launched), it must hand
over exactly Triton's own arguments, or the next form is tried, and a launch with none makes no plan.

The key holds everything a launch depends on besides the slots' contents: each input's shape,
strides, dtype and 16-byte alignment (Triton's pointer specialization), the options, the current
device and the environment variables the launchers read. Plans are off (every call runs as written)
under Triton's interpreter, with launch hooks set (profilers such as proton read each launch's
metadata), while `flashbob.tiling.override` or `impose_limits` is in effect, when two inputs are one
tensor object, and with FLASHBOB_LAUNCH_PLANS=0. A call whose launches take a tensor that is neither
a slot nor registered scratch (nor a view of one) makes no plan, and its key then always runs as
written, without recording again.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
import os
import warnings

import torch
from triton import knobs
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime import driver

from . import hopper, tiling
from .validation import triton_interpreter_enabled

ENV = "FLASHBOB_LAUNCH_PLANS"
CAPACITY = 512
"""Plans kept (least recently used dropped first): one per (launcher, input layout, options)."""

_plans: collections.OrderedDict[tuple, Plan | None] = collections.OrderedDict()
"""Key -> its plan, or None for a key whose call made none."""
_recorder: contextvars.ContextVar[_Recorder | None] = contextvars.ContextVar("flashbob_launch_recorder",
                                                                             default=None)


def clear() -> None:
    """Forget every plan (the next call of each layout records again) and every tensor map."""
    _plans.clear()
    _tensor_maps.clear()


def count() -> int:
    """How many plans are kept."""
    return sum(plan is not None for plan in _plans.values())


def switched_on() -> bool:
    """FLASHBOB_LAUNCH_PLANS: "1" (or unset) records and replays plans, "0" runs every call as written."""
    value = os.environ.get(ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{ENV}={value!r}: expected 0 or 1")
    return value == "1"


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: a function, or a chain of hooks (Triton 3.6) holding one."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _layout(t: torch.Tensor | None):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0)


def key(launcher: str, inputs: dict[str, torch.Tensor | None], options: tuple) -> tuple | None:
    """The plan key of a launcher call: `launcher`'s name, each input's layout (None: absent) and
    `options` (the launcher's non-tensor arguments), or None where plans are off for this call
    (module doc). The launcher's outputs, allocated from the inputs' shapes, need no key of their own."""
    if (not switched_on() or triton_interpreter_enabled() or tiling.adjusted()
            or _hooked(knobs.runtime.launch_enter_hook) or _hooked(knobs.runtime.launch_exit_hook)):
        return None
    tensors = [t for t in inputs.values() if t is not None]
    if len({id(t) for t in tensors}) != len(tensors):
        return None
    env = (os.environ.get(hopper.ENV), os.environ.get(tiling.SHARED_MEM_ENV))
    return (launcher, driver.active.get_current_device(), *map(_layout, inputs.values()), options, env)


def replay(plan_key: tuple | None, slots: dict[str, torch.Tensor | None]) -> bool:
    """Issue the launches recorded under `plan_key` on these slots; False (nothing issued) where
    there is no such plan."""
    plan = None if plan_key is None else _plans.get(plan_key)
    if plan is None:   # no plan, or a key that makes none
        return False
    _plans.move_to_end(plan_key)
    plan.replay(slots)
    return True


@contextlib.contextmanager
def recording(plan_key: tuple | None, slots: dict[str, torch.Tensor | None], allocate):
    """Within the block the launcher runs as written, its launches going through `start` and its
    scratch buffers through `scratch`; at its end the plan, where one can be made, is kept under
    `plan_key` (None, or a key that made no plan before: nothing is recorded). allocate(shape,
    dtype, device): how a replay allocates the scratch (the launcher's own allocator)."""
    if plan_key is None or plan_key in _plans:
        yield
        return
    recorder = _Recorder()
    token = _recorder.set(recorder)
    try:
        yield
    finally:
        _recorder.reset(token)
    if recorder.dropped:
        return
    try:
        _plans[plan_key] = recorder.plan(slots, allocate)
    except Exception as err:  # noqa: BLE001 - the launches ran as written; only the plan is lost
        warnings.warn(f"flashbob: no launch plan for {plan_key[0]} ({type(err).__name__}: {err}); its "
                      f"launchers run as written", RuntimeWarning, stacklevel=4)
        _plans[plan_key] = None
    while len(_plans) > CAPACITY:
        _plans.popitem(last=False)


def start(kernel, grid):
    """kernel[grid], recorded where a recording is active."""
    recorder = _recorder.get()
    return kernel[grid] if recorder is None else recorder.launcher(kernel, grid)


def drop_recording() -> None:
    """The call being recorded makes no plan (its launches changed course midway); its key records
    again on its next call."""
    recorder = _recorder.get()
    if recorder is not None:
        recorder.dropped = True


def scratch(buffer: torch.Tensor) -> torch.Tensor:
    """Register `buffer` (just allocated, contents undefined until a kernel writes it) as scratch of
    the call being recorded: a replay allocates one like it. Returns buffer."""
    recorder = _recorder.get()
    if recorder is not None:
        recorder.scratch[id(buffer)] = (len(recorder.scratch), buffer)
    return buffer


class _Recorder:
    def __init__(self):
        self.dropped = False
        self.launches: list[tuple] = []
        self.repeats: list = []
        """Each launch as a call that repeats it through Triton (`_matches_triton` captures it)."""
        self.scratch: dict[int, tuple[int, torch.Tensor]] = {}

    def launcher(self, kernel, grid):
        def launch(*args, **kwargs):
            compiled = kernel[grid](*args, **kwargs)
            if hasattr(compiled, "result"):
                compiled = compiled.result()
            bound = kernel.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in kernel.arg_names})
            bound.apply_defaults()
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            self.launches.append((compiled, grid3, list(bound.arguments.values())))
            self.repeats.append(functools.partial(kernel[grid], *args, **kwargs))
            return compiled

        return launch

    def plan(self, slots: dict[str, torch.Tensor | None], allocate) -> Plan | None:
        """The plan of the recorded call, or None where one cannot be made or where some launch has no
        form that hands over the arguments Triton's own path does (`_matches_triton`)."""
        if not self.launches or not all(hasattr(c, "packed_metadata") for c, _, _ in self.launches):
            return None
        names = [name for name, t in slots.items() if t is not None]
        refs = {id(slots[name]): i for i, name in enumerate(names)}
        buffers = sorted(self.scratch.values(), key=lambda item: item[0])
        scratch = [(tuple(b.shape), b.dtype) for _, b in buffers]
        for index, buffer in buffers:
            refs[id(buffer)] = len(names) + index
        views: list[tuple] = []
        tensors = [slots[name] for name in names] + [buffer for _, buffer in buffers]

        def ref(t: torch.Tensor) -> int | None:
            if id(t) in refs:
                return refs[id(t)]
            base = t._base
            if base is None or id(base) not in refs:
                return None
            views.append((refs[id(base)], tuple(t.shape), t.stride(), t.storage_offset()))
            tensors.append(t)
            refs[id(t)] = len(names) + len(scratch) + len(views) - 1
            return refs[id(t)]

        launches = []
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        for (compiled, grid, recorded), repeat in zip(self.launches, self.repeats, strict=True):
            args = list(recorded)
            fills = []
            for position, value in enumerate(args):
                if isinstance(value, torch.Tensor):
                    index = ref(value)
                    if index is None:
                        return None
                    fills.append((position, index, None))
                    args[position] = None
                elif isinstance(value, TensorDescriptor):
                    index = ref(value.base)
                    if index is None:
                        return None
                    fields = {name: field for name, field in vars(value).items() if name != "base"}
                    fills.append((position, index, fields))
                    args[position] = None
            # The first form whose arguments, on this call's own tensors, are exactly Triton's own.
            forms = (_direct(compiled, grid, args, fills), _TritonLaunch(compiled, grid, args, fills))
            chosen = next((form for form in forms if form is not None
                           and _matches_triton(form, repeat, tensors, stream)), None)
            if chosen is None:
                return None
            launches.append(chosen)
        return Plan(names, scratch, views, launches, allocate)


def _matches_triton(launch, repeat, tensors: list[torch.Tensor], stream) -> bool:
    """Whether `launch`, issued on the recorded call's own tensors (slots, scratch, views, in the
    plan's order), hands over exactly what Triton's own path does when `repeat` runs it again: at the
    driver's C launch for a `_DirectLaunch`, at the compiled kernel's launcher for a `_TritonLaunch`.
    Both sides are captured, nothing is launched. False for any difference or any failure to capture,
    as with a Triton whose launch path has another form."""
    try:
        return launch.matches_triton(repeat, tensors, stream)
    except Exception:  # noqa: BLE001 - any failure to capture: not this form
        return False


class Plan:
    """One launcher call's launches for one key: the slots' names in order, the scratch buffers
    ((shape, dtype) each), the views of either ((tensor index, shape, strides, offset) each), the
    launches (`_DirectLaunch` where Triton's launcher has the form it knows, else `_TritonLaunch`),
    and allocate(shape, dtype, device), which makes the scratch."""

    def __init__(self, names, scratch, views, launches, allocate):
        self.names, self.scratch, self.views, self.launches = names, scratch, views, launches
        self.allocate = allocate

    def replay(self, slots: dict[str, torch.Tensor | None]) -> None:
        tensors = [slots[name] for name in self.names]
        device = tensors[0].device
        tensors += [self.allocate(shape, dtype, device) for shape, dtype in self.scratch]
        tensors += [tensors[i].as_strided(shape, stride, offset) for i, shape, stride, offset in self.views]
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        for launch in self.launches:
            launch.issue(tensors, stream)


class _TritonLaunch:
    """A launch through the compiled kernel's launcher, as JITFunction.run makes it (no launch
    metadata or hooks: plans are off while any is set). args: the arguments in signature order, the
    tensors left out; fills: where each goes, (position, tensor index, descriptor fields or None)."""

    def __init__(self, compiled, grid, args, fills):
        self.compiled, self.grid, self.args, self.fills = compiled, grid, tuple(args), tuple(fills)

    def arguments(self, tensors: list[torch.Tensor], stream) -> list:
        """The compiled kernel launcher's arguments for these tensors."""
        args = list(self.args)
        for position, index, fields in self.fills:
            if fields is None:
                args[position] = tensors[index]
            else:
                descriptor = object.__new__(TensorDescriptor)
                descriptor.__dict__.update(fields, base=tensors[index])
                args[position] = descriptor
        compiled = self.compiled
        return [*self.grid, stream, compiled.function, compiled.packed_metadata, None, None, None, *args]

    def issue(self, tensors: list[torch.Tensor], stream) -> None:
        self.compiled.run(*self.arguments(tensors, stream))

    def matches_triton(self, repeat, tensors: list[torch.Tensor], stream) -> bool:
        captured = []
        with _swapped(self.compiled, "_run", lambda *args: captured.append(args)):
            repeat()
        return len(captured) == 1 and _same(captured[0], self.arguments(tensors, stream), skip=(6, 7, 8))


@contextlib.contextmanager
def _swapped(owner, name: str, value):
    """owner.name is value within the block."""
    previous = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, previous)


@contextlib.contextmanager
def _swapped_cell(cell, value):
    """A closure cell holds value within the block."""
    previous = cell.cell_contents
    cell.cell_contents = value
    try:
        yield
    finally:
        cell.cell_contents = previous


def _same(theirs, ours, skip: tuple[int, ...]) -> bool:
    """Whether two argument lists agree, positions `skip` (launch metadata and hooks) left out: tensors
    by address, shape, strides and dtype, descriptors by their fields and base, the rest by value."""
    return len(theirs) == len(ours) and all(
        _same_value(a, b) for i, (a, b) in enumerate(zip(theirs, ours)) if i not in skip)


def _layout_at(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def _fields(descriptor: TensorDescriptor) -> dict:
    return {name: value for name, value in vars(descriptor).items() if name != "base"}


def _same_value(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and _layout_at(a) == _layout_at(b)
    if isinstance(a, TensorDescriptor) or isinstance(b, TensorDescriptor):
        return (isinstance(a, TensorDescriptor) and isinstance(b, TensorDescriptor)
                and _same_value(a.base, b.base) and _fields(a) == _fields(b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


_tensor_maps: dict[tuple[int, int], object] = {}
"""(base address, box id) -> the CUDA tensor map Triton's driver encoded for it: a tensor map holds
the address and the box's geometry only, so one made for an address serves every tensor there."""
TENSOR_MAPS = 4096
_box_ids = iter(range(1 << 62))


def _direct(compiled, grid, args, fills) -> _DirectLaunch | None:
    """The launch as Triton 3.6's CUDA launcher finally makes it (its C launch, with each TMA
    descriptor expanded into an encoded tensor map, its shape and strides), or None where the
    launcher has another form (another Triton, scratch memory, descriptors without metadata)."""
    launcher = compiled.run
    launch = getattr(launcher, "launch", None)
    scratch = getattr(launcher, "global_scratch_size", 1) or getattr(launcher, "profile_scratch_size", 1)
    if launch is None or scratch:
        return None
    code = getattr(launch, "__code__", None)
    cells = {} if code is None else {
        name: cell.cell_contents for name, cell in zip(code.co_freevars, launch.__closure__ or ())}
    descriptors = [fill for fill in fills if fill[2] is not None]
    if cells or descriptors:
        if not {"launcher", "tensordesc_indices", "tensordesc_meta"} <= cells.keys():
            return None
        metas = cells["tensordesc_meta"]
        positions = sorted(cells["tensordesc_indices"])
        if (not metas or any(meta is None for meta in metas)
                or positions != sorted(fill[0] for fill in descriptors)):
            return None
        launch = cells["launcher"]
        meta_at = dict(zip(positions, metas))
    try:
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST
    except ImportError:
        return None
    x, y, z = grid
    # Grid, stream, function, cooperative, PDL, the two scratch buffers (none), kernel metadata, launch
    # metadata and the two hooks (none: plans are off while a hook is set); then the kernel's arguments.
    final = [x, y, z, None, compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl,
             None, None, compiled.packed_metadata, None, None, None]
    tensor_at, maps_at = [], []
    fill_at = {fill[0]: fill for fill in fills}
    for position, value in enumerate(args):
        fill = fill_at.get(position)
        if fill is None:
            final.append(value)
        elif fill[2] is None:
            tensor_at.append((len(final), fill[1]))
            final.append(None)
        else:
            fields, meta = fill[2], meta_at[position]
            shape = list(fields["shape"])
            if meta["fp4_padded"]:
                shape[-1] *= 2
            box = (meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                   meta["block_size"], shape, list(fields["strides"]), 1 if fields["padding"] == "nan" else 0)
            maps_at.append((len(final), fill[1], next(_box_ids), box))
            final += [None, *shape, *fields["strides"]]
    return _DirectLaunch(launch, final, tensor_at, maps_at, launcher)


class _DirectLaunch:
    """A launch handed straight to the driver's C launch: `final`, its arguments with the stream, the
    tensors and the tensor maps left out; tensor_at, (position, tensor index) each; maps_at,
    (position, tensor index, box id, box: the encoder's arguments after the address) each;
    launcher: the compiled kernel's launcher that `launch` was taken from."""

    def __init__(self, launch, final, tensor_at, maps_at, launcher):
        self.launch, self.final, self.tensor_at, self.maps_at = launch, final, tensor_at, maps_at
        self.launcher = launcher

    def arguments(self, tensors: list[torch.Tensor], stream, encode, cached: bool = True) -> list:
        """The C launch's arguments for these tensors; encode(address, *box): the tensor map encoder,
        its results kept by (address, box) unless not `cached`."""
        final = list(self.final)
        final[3] = stream
        for position, index in self.tensor_at:
            final[position] = tensors[index]
        for position, index, box_id, box in self.maps_at:
            address = tensors[index].data_ptr()
            tensor_map = _tensor_maps.get((address, box_id)) if cached else None
            if tensor_map is None:
                tensor_map = encode(address, *box)
                if cached:
                    if len(_tensor_maps) >= TENSOR_MAPS:
                        _tensor_maps.clear()
                    _tensor_maps[address, box_id] = tensor_map
            final[position] = tensor_map
        return final

    def issue(self, tensors: list[torch.Tensor], stream) -> None:
        self.launch(*self.arguments(tensors, stream, driver.active.utils.fill_tma_descriptor))

    def matches_triton(self, repeat, tensors: list[torch.Tensor], stream) -> bool:
        """Triton's path captured at its C launch (the wrapper's `launcher` cell, or the launcher's own
        `launch` where there is no wrapper), tensor maps as their encoder's arguments, against ours."""
        captured = []
        utils = driver.active.utils

        def encode(*fields):
            return ("tensor map", *fields)

        def record(*args):
            captured.append(args)

        wrapper = self.launcher.launch
        code = getattr(wrapper, "__code__", None)
        cells = {} if code is None else dict(zip(code.co_freevars, wrapper.__closure__ or ()))
        capture = (_swapped_cell(cells["launcher"], record) if "launcher" in cells
                   else _swapped(self.launcher, "launch", record))
        with _swapped(utils, "fill_tma_descriptor", encode), capture:
            repeat()
        ours = self.arguments(tensors, stream, encode, cached=False)
        return len(captured) == 1 and _same(captured[0], ours, skip=(10, 11, 12))
