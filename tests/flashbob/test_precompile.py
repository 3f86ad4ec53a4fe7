"""flashbob.precompile compiles, before a family's first forward, exactly the kernels (Triton cache
keys) that its forward, first backward and BoB then launch; and the private Triton API it relies on
behaves as it assumes (these tests fail when a Triton upgrade changes it).

The CPU tests run the autograd chain with every kernel replaced by a recorder that computes Triton's
cache key for sm_90 (the real binder of a JITFunction made from the interpreted kernel) for each
compile-ahead call and each launch, and runs nothing. The subprocess test compiles for sm_90 on
the CPU (no interpreter) through Triton's AsyncCompileMode, with `python -m flashbob.bench compile`."""

import concurrent.futures
import inspect
import json
import os
import pathlib
import subprocess
import sys
import threading

import pytest
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import make_backend
from triton.compiler.compiler import CompiledKernel
from triton.runtime import _async_compile
from triton.runtime.jit import JITFunction, KernelInterface, compute_cache_key, create_function_from_signature

import flashbob
from flashbob import precompile, triton_ops, validation

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUOBJDUMP = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SM90 = make_backend(GPUTarget("cuda", 90, 32))


class KeyRecorder:
    """Stands in for an interpreted kernel in flashbob.triton_ops: records (how, kernel, Triton's
    cache key for sm_90) for each `warmup` (how = "ahead") and each launch (how = "launch")."""

    def __init__(self, interpreted, log: list):
        jit = JITFunction(interpreted.fn, **interpreted.kwargs)
        self.name, self.log = interpreted.fn.__name__, log
        self.binder = create_function_from_signature(jit.signature, jit.params, SM90)

    def _record(self, how, args, kwargs):
        _, specialization, options = self.binder(*args, **kwargs)
        self.log.append((how, self.name, compute_cache_key({}, specialization, options)))

    def warmup(self, *args, grid, **kwargs):
        self._record("ahead", args, kwargs)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._record("launch", args, kwargs)


@pytest.fixture
def log(monkeypatch):
    """Kernels recorded, compiles ahead allowed on the CPU, no family compiled yet."""
    if not validation.triton_interpreter_enabled():
        pytest.skip("records the interpreter's kernels (on a GPU the kernels are compiled ones)")
    entries = []
    for name in [n for n in vars(triton_ops) if n.endswith("_kernel")]:
        monkeypatch.setattr(triton_ops, name, KeyRecorder(getattr(triton_ops, name), entries))
    monkeypatch.setattr(precompile, "_compiles_here", lambda q: True)
    monkeypatch.setattr(precompile, "_done", set())
    monkeypatch.delenv(precompile.ENV, raising=False)
    return entries


def second_order_call(q, k, v, **opts):
    """Forward, first backward (create_graph) and BoB through autograd, as a user would call them."""
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = flashbob.flash_attention(q, k, v, backend="triton", **opts)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.randn_like(out), create_graph=True)
    torch.autograd.grad((dq, dk, dv), (q, k, v), (torch.randn_like(dq), torch.randn_like(dk),
                                                 torch.randn_like(dv)))


def layout(kind, b, h_q, h_kv, n, m, d, dtype):
    """q (b, h_q, n, d), k, v (b, h_kv, m, d): contiguous, (B, N, H, D) storage, or q, k, v slices of
    one packed (B, N, 3, H, D) tensor (MHA; k and v then start off 16-byte alignment when
    h * d * itemsize is not a multiple of 16)."""
    if kind == "packed":
        qkv = torch.randn(b, n, 3, h_q, d).to(dtype)
        return tuple(qkv[:, :, i].transpose(1, 2) for i in range(3))
    if kind == "bnhd":
        return (torch.randn(b, n, h_q, d).to(dtype).transpose(1, 2),
                *(torch.randn(b, m, h_kv, d).to(dtype).transpose(1, 2) for _ in range(2)))
    return torch.randn(b, h_q, n, d).to(dtype), *(torch.randn(b, h_kv, m, d).to(dtype) for _ in range(2))


FAMILIES = [  # (layout, h_q, h_kv, n, m, d, dtype, options)
    ("bhnd", 4, 2, 37, 37, 37, torch.float32, dict(causal=True)),
    ("bnhd", 2, 1, 21, 21, 37, torch.float32, dict(causal=True, fp32_precision="tf32")),
    ("bnhd", 2, 1, 63, 70, 80, torch.float16, dict(causal=True, window=8, fp32_precision="tf32")),
    ("packed", 2, 2, 19, 19, 37, torch.float16, dict()),
    ("bnhd", 2, 2, 33, 33, 48, torch.float32, dict(fp32_precision="ieee", key_ranges=True)),
]


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f"{f[0]}-d{f[5]}-{str(f[6])[6:]}")
def test_compiles_ahead_exactly_what_the_call_launches(log, family):
    kind, h_q, h_kv, n, m, d, dtype, opts = family
    opts = dict(opts)
    if opts.pop("key_ranges", False):
        opts.update(key_start=torch.tensor([0, 3]), key_end=torch.tensor([m, m - 5]))
    second_order_call(*layout(kind, 2, h_q, h_kv, n, m, d, dtype), **opts)
    launched = {(name, key) for how, name, key in log if how == "launch"}
    ahead = [(name, key) for how, name, key in log if how == "ahead"]
    assert launched == set(ahead)
    assert len(launched) == (6 if d <= 64 else 7)  # forward, delta, dK/dV, dQ, BoB rows (x2 above 64), cols
    first_launch = next(i for i, (how, _, _) in enumerate(log) if how == "launch")
    assert {how for how, _, _ in log[:first_launch]} == {"ahead"}  # all compiled before the first launch
    assert {how for how, _, _ in log[first_launch:]} == {"launch"}


def test_a_family_whose_forward_splits_its_keys_compiles_the_split_kernels_ahead(log):
    """One query row over 600 keys: the forward's split and combine kernels compile ahead, the plain
    forward kernel neither ahead nor at launch."""
    second_order_call(*layout("bhnd", 1, 2, 2, 1, 600, 48, torch.float32), fp32_precision="ieee")
    launched = {(name, key) for how, name, key in log if how == "launch"}
    assert launched == {(name, key) for how, name, key in log if how == "ahead"}
    names = {name for name, _ in launched}
    assert {"attention_forward_split_kernel", "attention_forward_combine_kernel"} <= names
    assert "attention_forward_kernel" not in names


def test_once_per_family_and_stand_ins_are_small(log):
    second_order_call(*layout("bhnd", 1, 2, 2, 40, 40, 64, torch.float16), causal=True)
    first = len(log)
    q, k, v = layout("bhnd", 3, 2, 2, 4096, 4096, 64, torch.float16)  # other batch and lengths
    second_order_call(q, k, v, causal=True)
    assert [how for how, _, _ in log[first:]] == ["launch"] * (len(log) - first)
    assert {entry[1:] for entry in log[first:]} <= {entry[1:] for entry in log[:first]}
    for spec in precompile._stand_in_specs(q, k, v, None)[:3]:
        assert precompile._stand_in(spec, q).untyped_storage().nbytes() < 64 * 1024  # q: 3 MiB


def test_switched_off_by_the_environment(log, monkeypatch):
    monkeypatch.setenv(precompile.ENV, "0")
    second_order_call(*layout("bhnd", 1, 2, 2, 20, 20, 16, torch.float16))
    assert log and {how for how, _, _ in log} == {"launch"}
    monkeypatch.setenv(precompile.ENV, "yes")
    with pytest.raises(ValueError, match="FLASHBOB_PRECOMPILE must be 0"):
        second_order_call(*layout("bhnd", 1, 2, 2, 20, 20, 16, torch.float16))


def test_nothing_compiles_ahead_on_the_cpu_or_in_the_interpreter(log, monkeypatch):
    monkeypatch.undo()  # the real kernels and the real precompile._compiles_here
    q = torch.randn(1, 2, 20, 16)
    assert not precompile._compiles_here(q)
    for name in [n for n in vars(triton_ops) if n.endswith("_kernel")]:
        monkeypatch.setattr(triton_ops, name, KeyRecorder(getattr(triton_ops, name), log))
    second_order_call(*layout("bhnd", 1, 2, 2, 20, 20, 16, torch.float16))
    assert log and {how for how, _, _ in log} == {"launch"}


def test_triton_async_compile_mode_behaves_as_relied_on():
    """AsyncCompileMode (triton/runtime/_async_compile.py, private in Triton 3.6): while active it is
    `active_mode`; submit(key, compile_fn, finalize_fn[, cleanup_fn: Triton 3.9]) runs compile_fn on
    the executor, once per key; on exit it waits for every compile and calls finalize_fn with its
    result (and cleanup_fn with the failed ones' futures)."""
    finalized, threads, cleaned = [], [], []
    takes_cleanup = "cleanup_fn" in inspect.signature(_async_compile.AsyncCompileMode.submit).parameters
    finish = (finalized.append, cleaned.append) if takes_cleanup else (finalized.append,)

    def compile_fn(value):
        threads.append(threading.current_thread().name)
        return value

    with concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="pin") as pool:
        with _async_compile.AsyncCompileMode(pool, ignore_errors=True) as mode:
            assert _async_compile.active_mode.get() is mode
            first = mode.submit("a", lambda: compile_fn(1), *finish)
            assert mode.submit("a", lambda: compile_fn(2), *finish) is first
            mode.submit("b", lambda: compile_fn(3), *finish)
            failed = mode.submit("c", lambda: 1 / 0, *finish)  # ignored: the launch compiles it again
            with pytest.raises(RuntimeError), _async_compile.AsyncCompileMode(pool):
                pass
        assert _async_compile.active_mode.get() is None
    assert sorted(finalized) == [1, 3] and all(t.startswith("pin") for t in threads)
    assert first.result() == 1
    assert cleaned == ([failed] if takes_cleanup else [])


def test_triton_launch_path_is_the_one_relied_on():
    """JITFunction._do_compile submits to the active AsyncCompileMode; warmup takes the launch path
    with grid as a keyword; a compiled kernel builds its launcher from (src, metadata) at first
    launch, with the active driver's launcher_cls (what precompile.CompileAhead builds ahead)."""
    do_compile = inspect.getsource(JITFunction._do_compile)
    assert "_async_compile.active_mode.get()" in do_compile and "async_mode.submit(" in do_compile
    assert "warmup=True" in inspect.getsource(KernelInterface.warmup)
    assert inspect.signature(KernelInterface.warmup).parameters["grid"].kind is inspect.Parameter.KEYWORD_ONLY
    init_handles = inspect.getsource(CompiledKernel._init_handles)
    assert "driver.active.launcher_cls(self.src, self.metadata)" in init_handles


@pytest.mark.skipif(not CUOBJDUMP.exists(), reason="Triton's NVIDIA backend tools are not installed")
def test_compiles_for_sm90_on_worker_threads_into_the_kernel_caches(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "flashbob.bench", "compile", "--modes", "ahead",
                           "--d", "16", "--dtype", "fp16", "--n", "37", "--mask", "window8"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=300, check=True)
    (row,) = [json.loads(line) for line in done.stdout.splitlines()]
    names = ["attention_backward_dkdv_kernel", "attention_backward_dq_kernel", "attention_bob_cols_kernel",
             "attention_bob_rows_kernel", "attention_forward_kernel", "row_dot_kernel"]
    assert row["compiled"] == names and row["still_to_compile"] == []
    assert all(t.startswith(precompile.THREAD_PREFIX) for t in row["compile_threads"])
    assert [name for name, _ in row["launchers_asked"]] == names
    assert all(t.startswith(precompile.THREAD_PREFIX) for _, t in row["launchers_asked"])
