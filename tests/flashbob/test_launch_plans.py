"""Launch plans (flashbob.launch_plans): a replayed call hands the driver exactly the arguments the
launcher written out would, for every stage and path; the recorder's rules, on stand-in kernels."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch
import triton

from flashbob import launch_plans, tiling

ROOT = pathlib.Path(__file__).resolve().parents[2]
NVIDIA_TOOLS = (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()
LAUNCH_KINDS = {"_DirectLaunch"} if triton.__version__.startswith("3.6.") else {"_TritonLaunch"}
"""The form every launch's replay takes: Triton 3.6's C launch unwrapped, the launcher elsewhere."""

CASES = [
    # The Hopper path at head dim 64 (warp-specialized rows, TMA columns: 18 descriptors), GQA,
    # a length that is no multiple of 16 (lse copied to aligned rows), one cotangent absent.
    dict(stage="bob", b=2, hq=4, hkv=2, n=100, d=64, causal=True, absent=["u_v"]),
    # Head dim 128 under a full mask: the rows pass's second launch and its float32 scratch.
    dict(stage="bob", b=1, hq=2, hkv=2, n=64, d=128, causal=False),
    # The portable path, a window and key ranges; head dim 80.
    dict(stage="bob", b=2, hq=2, hkv=1, n=37, d=80, causal=True, window=16, key_range=True, sm90="0"),
    dict(stage="forward", b=1, hq=3, hkv=1, n=63, d=48, causal=True, key_range=True),
    dict(stage="backward", b=2, hq=2, hkv=2, n=37, d=64, causal=False),
    dict(stage="jvp", b=1, hq=2, hkv=1, n=50, d=64, causal=True, absent=["u_k"]),
    # Decoding: one query row over 1000 keys, which the forward splits (split and combine launches).
    dict(stage="forward", b=1, hq=2, hkv=1, n=1, m=1000, d=80, causal=True, key_range=True),
]


def replays(cases: list[dict], tmp_path) -> list[dict]:
    rows = []
    for sm90 in sorted({case.get("sm90", "auto") for case in cases}):
        env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "FLASHBOB_SM90")}
        env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path), FLASHBOB_SM90=sm90)
        chosen = [case for case in cases if case.get("sm90", "auto") == sm90]
        done = subprocess.run([sys.executable, str(ROOT / "tests" / "flashbob" / "launch_plan_replays.py"),
                               json.dumps(chosen)], env=env, cwd=ROOT, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        rows += [json.loads(line) for line in done.stdout.splitlines()]
    return rows


def _flat(args: list) -> list:
    """A launch's canonical arguments (lists headed by their kind), with the argument tuples that newer
    Tritons nest opened."""
    return [leaf for a in args if isinstance(a, list)
            for leaf in (_flat(a) if a and isinstance(a[0], list) else [a])]


@pytest.mark.skipif(not NVIDIA_TOOLS, reason="Triton's NVIDIA backend tools are not installed")
def test_a_replay_hands_the_driver_what_the_written_launcher_does(tmp_path):
    rows = replays(CASES, tmp_path)
    assert len(rows) == len(CASES)
    for row in rows:
        case = row["case"]
        assert row["plans"] == 1, case
        assert row["replay_jit_runs"] == 0, case          # no launch went through JITFunction.run
        assert set(row["launch_kinds"]) == LAUNCH_KINDS, case
        assert row["written"] and row["replayed"] == row["written"], case
    written = {json.dumps(row["case"], sort_keys=True): row["written"] for row in rows}
    hopper_64, hopper_128 = (written[json.dumps(case, sort_keys=True)] for case in CASES[:2])
    assert sum(a[0] == "tma" for launch in hopper_64 for a in _flat(launch)) == 18
    assert len(hopper_128) == 4 and any("float32" in str(a) and "scratch" in str(a) for a in hopper_128[2])
    decoding = written[json.dumps(CASES[-1], sort_keys=True)]
    assert len(decoding) == 2 and all("scratch" in str(launch) for launch in decoding)


class _Driver:
    """Stands in for Triton's active driver: device 0, stream 7."""

    @staticmethod
    def get_current_device():
        return 0

    @staticmethod
    def get_current_stream(device):
        return 7


@pytest.fixture(autouse=True)
def stand_in_driver(monkeypatch):
    monkeypatch.setattr(launch_plans, "driver", type("Drivers", (), {"active": _Driver}))
    yield
    launch_plans.clear()


class _Compiled:
    """Stands in for a compiled kernel: its launcher (`run`, Triton's property over `_run`) records."""

    packed_metadata = None
    function = None

    def __init__(self, calls):
        self._run = calls.append_args

    @property
    def run(self):
        return self._run


class _Calls(list):
    def append_args(self, *args):
        self.append(args)


class _Kernel:
    """Stands in for a @triton.jit kernel of signature (a, b, c, n, BLOCK): one compiled kernel, launched
    as JITFunction.run does (grid, stream 7, function, metadata, launch metadata, hooks, then the
    arguments in signature order); `skew` hands it one argument more, as a Triton whose launch path
    the plans do not know might."""

    def __init__(self, skew: bool = False):
        import inspect

        self.calls, self.skew = _Calls(), skew
        self.compiled = _Compiled(self.calls)
        self.signature = inspect.signature(lambda a, b, c, n, BLOCK=16: None)
        self.arg_names = list(self.signature.parameters)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            bound = self.signature.bind(*args, **{k: v for k, v in kwargs.items() if k in self.arg_names})
            bound.apply_defaults()
            extra = ("skew",) if self.skew else ()
            grid3 = tuple(grid) + (1,) * (3 - len(grid))
            arguments = (*bound.arguments.values(), *extra)
            self.compiled.run(*grid3, 7, None, None, "metadata", None, None, *arguments)
            return self.compiled

        return launch


def _record(kernel, slots, make_args, key=("stand-in",)):
    launch_plans.clear()
    def allocate(shape, dtype, device):
        return torch.full(shape, -1.0, dtype=dtype)

    with launch_plans.recording(key, slots, allocate):
        launch_plans.start(kernel, (3, 2))(*make_args(), n=5, num_warps=4)
    return key


def test_replay_puts_the_new_slots_and_fresh_scratch_where_the_recorded_ones_were():
    kernel = _Kernel()
    a, out = torch.randn(4, 8), torch.empty(4, 8)
    scratch = {}

    def make_args():
        scratch["buf"] = launch_plans.scratch(torch.empty(2, 16))
        return a, out, scratch["buf"][:, :8]

    key = _record(kernel, dict(a=a, out=out), make_args)
    assert launch_plans.count() == 1 and len(kernel.calls) == 1   # checked against Triton: captured, not run
    a2, out2 = torch.randn(4, 8), torch.empty(4, 8)
    assert launch_plans.replay(key, dict(a=a2, out=out2))
    x, y, z, stream, function, metadata, launch_metadata, enter, leave, *args = kernel.calls[-1]
    assert (x, y, z, stream) == (3, 2, 1, 7) and (launch_metadata, enter, leave) == (None, None, None)
    assert args[0] is a2 and args[1] is out2 and args[3:] == [5, 16]
    view = args[2]
    assert view.shape == (2, 8) and view.stride() == (16, 1) and view._base.shape == (2, 16)
    assert view._base is not scratch["buf"] and bool((view == -1).all())   # a new buffer, from allocate


def test_a_tensor_that_is_neither_slot_nor_scratch_makes_no_plan_and_is_not_recorded_again():
    kernel = _Kernel()
    a, out = torch.randn(4), torch.empty(4)
    key = _record(kernel, dict(a=a, out=out), lambda: (a, out, torch.zeros(3)))
    assert launch_plans.count() == 0 and not launch_plans.replay(key, dict(a=a, out=out))
    with launch_plans.recording(key, dict(a=a, out=out), None):   # all slots now, but not recorded again
        launch_plans.start(kernel, (1,))(a, out, a, n=1)
    assert launch_plans.count() == 0


def test_a_plan_that_would_hand_over_other_arguments_than_triton_is_not_kept():
    kernel = _Kernel(skew=True)
    a, out = torch.randn(4), torch.empty(4)
    key = _record(kernel, dict(a=a, out=out), lambda: (a, out, a))
    assert launch_plans.count() == 0 and not launch_plans.replay(key, dict(a=a, out=out))
    assert len(kernel.calls) == 1   # the recorded call's own launch, as written


def test_plans_are_kept_up_to_capacity_least_recently_used_first(monkeypatch):
    monkeypatch.setattr(launch_plans, "CAPACITY", 2)
    kernel = _Kernel()
    a, out = torch.randn(4), torch.empty(4)
    launch_plans.clear()
    for name in ("k1", "k2", "k3"):
        with launch_plans.recording((name,), dict(a=a, out=out), None):
            launch_plans.start(kernel, (1,))(a, out, a, n=1)
    assert launch_plans.count() == 2
    assert not launch_plans.replay(("k1",), dict(a=a, out=out))
    assert launch_plans.replay(("k2",), dict(a=a, out=out))


def test_keys_hold_layouts_and_are_off_where_plans_do_not_apply(monkeypatch):
    monkeypatch.setattr(launch_plans, "triton_interpreter_enabled", lambda: False)
    q, k = torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)
    options = (True, None, 0.5, None)
    key = launch_plans.key("forward", dict(q=q, k=k, r=None), options)
    assert key == launch_plans.key("forward", dict(q=torch.randn(1, 2, 8, 4), k=k, r=None), options)
    other_strides = q.transpose(2, 3).contiguous().transpose(2, 3)
    assert key != launch_plans.key("forward", dict(q=other_strides, k=k, r=None), options)
    assert key != launch_plans.key("forward", dict(q=q, k=k, r=None), (False, None, 0.5, None))
    assert launch_plans.key("forward", dict(q=q, k=q), ()) is None          # one tensor in two slots
    with tiling.override("forward", BLOCK_M=16):
        assert launch_plans.key("forward", dict(q=q), ()) is None
    monkeypatch.setenv(launch_plans.ENV, "0")
    assert launch_plans.key("forward", dict(q=q), ()) is None
    monkeypatch.setenv(launch_plans.ENV, "off")
    with pytest.raises(ValueError, match="FLASHBOB_LAUNCH_PLANS='off': expected 0 or 1"):
        launch_plans.key("forward", dict(q=q), ())


def test_the_interpreter_never_plans():
    q = torch.randn(1, 1, 4, 4)
    assert launch_plans.key("forward", dict(q=q), ()) is None


def test_a_failure_to_make_a_plan_warns_and_leaves_the_launcher_as_written(monkeypatch):
    def broken(self, slots, allocate):
        raise KeyError("a bug")

    monkeypatch.setattr(launch_plans._Recorder, "plan", broken)
    kernel, a, out = _Kernel(), torch.randn(4), torch.empty(4)
    with pytest.warns(RuntimeWarning, match="no launch plan for stand-in .*KeyError"):
        key = _record(kernel, dict(a=a, out=out), lambda: (a, out, a))
    assert len(kernel.calls) == 1 and launch_plans.count() == 0
    assert not launch_plans.replay(key, dict(a=a, out=out))
