"""The gradient-memory experiment on the CPU: a tiny sweep end to end, checked against the memory model
and the files' formats; the memory model against measured saved-for-backward bytes; failures that skip
their series. No timing is asserted."""

import csv
import json
from types import SimpleNamespace

import pytest
import torch

from ttt.config import ConfigError
from ttt.experiments import grad_memory, grad_memory_report
from ttt.experiments.gpu_memory_model import ModelDims, predicted_bytes
from ttt.experiments.grad_memory import load
from ttt.experiments.meta_step_probe import measure
from ttt.experiments.workloads import Point
from ttt.inner import select_parameters
from ttt.models import Transformer

TINY = [
    "preset=cpu",
    "n_sweep.ns=[16,32]",
    "n_sweep.ks=[1,2]",
    "k_sweep.ns=[16]",
    "k_sweep.ks=[1,2,3]",
    "k_sweep.checkpoint=[false,true]",
    "first_order.ns=[16]",
    "checkpointed.ns=[16,32]",
]
ONLY_N_SWEEP = ["k_sweep.ns=[]", "first_order.ns=[]", "checkpointed.ns=[]"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny steps run many times faster on one thread than on threads that wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _strict_json(path):
    """The parsed JSON file; NaN or Infinity (not JSON) fail."""

    def refuse(constant):
        raise ValueError(f"{path.name}: {constant} is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


def test_cpu_sweep_agrees_with_the_memory_model_and_writes_strict_files(tmp_path, capsys):
    assert grad_memory.main([*TINY, f"out={tmp_path}"]) == 0
    with open(tmp_path / "results.csv") as handle:
        reader = csv.DictReader(handle)
        assert tuple(reader.fieldnames) == grad_memory_report.COLUMNS
        csv_rows = list(reader)
    rows = _strict_json(tmp_path / "results.json")["rows"]
    # 3 backends x (n_sweep's 2 N x 2 k, k_sweep's k=3 and checkpointed k=1..3, first_order, checkpointed's
    # N=32: its N=16 repeats a k_sweep point).
    assert len(rows) == len(csv_rows) == 3 * 10
    assert {(r["backend"], r["n"], r["k"], r["order"], r["checkpoint"]) for r in rows} >= {
        ("sdpa_math", 32, 2, "second", False),
        ("eager", 16, 3, "second", True),
        ("flashbob", 16, 2, "first", False),
    }
    for row in rows:
        assert row["status"] == "ok", row
        if not row["checkpoint"]:  # the saved-tensor meter cannot see inside a recomputation
            assert row["saved_gib"] == pytest.approx(row["predicted_gib"], rel=0.01), row
            # First order holds one more N x N tensor than the model counts (docs/grad_memory.md). The
            # fused ops' graphs are smaller and the rest of the peak is not: 1.12 at N=16, second order.
            bound = 1.15 if row["order"] == "second" else 1.25
            assert 0.7 < row["peak_gib"] / row["predicted_peak_gib"] < bound, row
        assert row["params_gib"] < row["saved_gib"] < row["peak_gib"]
    second = {
        (r["backend"], r["k"]): r["saved_gib"]
        for r in rows
        if r["n"] == 16 and r["order"] == "second" and not r["checkpoint"]
    }
    assert second[("eager", 3)] > second[("eager", 2)] > second[("eager", 1)]  # a graph per inner step
    assert sum(r["first_call_s"] is not None for r in rows) == 6  # one warm-up per (backend, order)
    for name in ("memory_vs_n.png", "time_vs_n.png", "memory_vs_k.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    env = _strict_json(tmp_path / "environment.json")
    assert env["torch"] == torch.__version__ and env["device_type"] == "cpu" and env["dtype"] == "float32"
    assert env["command"].startswith("python -m ttt.experiments.grad_memory preset=cpu")
    table = (tmp_path / "table.md").read_text()
    assert f"commit {env['commit']}" in table and "no eager / flashbob ratio off CUDA" in table
    assert "eager / flashbob time" not in table
    assert "grad_memory: 30 points" in capsys.readouterr().out
    (tmp_path / "memory_vs_n.png").unlink()
    (tmp_path / "table.md").write_text("")
    assert grad_memory_report.main([str(tmp_path)]) == 0  # rendered again from the CSV alone
    assert (tmp_path / "table.md").read_text() == table and (tmp_path / "memory_vs_n.png").is_file()


def test_speed_ratio_is_reported_for_cuda_runs_only():
    rows = [
        {"backend": b, "n": 64, "k": 1, "order": "second", "checkpoint": False, "status": "ok", "seconds": s}
        for b, s in (("eager", 3.0), ("flashbob", 1.5))
    ]
    on_gpu = "\n".join(grad_memory_report._speed(rows, {"device_type": "cuda"}))
    assert "eager / flashbob time at N=64 (largest both ran) = 2.00" in on_gpu
    assert "no eager / flashbob ratio" in grad_memory_report._speed(rows, {"device_type": "cpu"})[0]


def test_ttt_e2e_workload_runs_and_is_not_predicted(tmp_path):
    overrides = ["preset=cpu", "workload=ttt_e2e", "window=8", "chunk_len=8", "n_sweep.ns=[16,32]"]
    overrides += ["k_sweep.ns=[]", "first_order.ns=[16]", "checkpointed.ns=[32]", "backends=[flashbob,eager]"]
    rows = grad_memory.run(load([*overrides, f"out={tmp_path}"], cuda_available=False))
    assert len(rows) == 2 * 6 and {r["status"] for r in rows} == {"ok"}
    assert all(r["predicted_gib"] is None and r["saved_gib"] > 0 for r in rows)
    assert "ttt_e2e: 2 layers" in (tmp_path / "table.md").read_text()


@pytest.mark.parametrize("fused_ops", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["eager", "sdpa_math"])
def test_memory_model_matches_the_saved_bytes_and_bounds_the_peak(dtype, backend, fused_ops):
    setup = grad_memory.resolve(load(["preset=cpu", f"fused_ops={fused_ops}"], cuda_available=False))
    setup.dtype = dtype
    predict = grad_memory.predictor(setup)
    for n, k, order in [(24, 2, "first"), (24, 1, "second"), (40, 3, "second"), (256, 2, "second")]:
        point = Point(backend, n, k, order, False)
        row = measure(setup, point)
        assert row["status"] == "ok", row["error"]
        model = predict(point)
        assert row["saved_gib"] == pytest.approx(model["predicted_gib"], rel=0.01), point
        # The peak model is about an upper estimate: at the peak some linear activations are freed.
        assert 0.7 < row["peak_gib"] / model["predicted_peak_gib"] < 1.1, point


def test_memory_model_matches_the_flashbob_kernels_saved_bytes(monkeypatch):
    """The FlashBoB autograd chain itself (Triton's CPU interpreter), not the CPU fallback."""
    import flashbob

    flash_attention = flashbob.flash_attention

    def triton_only(*args, backend, **kwargs):
        return flash_attention(*args, backend="triton", **kwargs)

    monkeypatch.setattr(flashbob, "flash_attention", triton_only)
    setup = grad_memory.resolve(load(["preset=cpu"], cuda_available=False))
    model = Transformer(setup.model)
    dims = ModelDims.of(model, list(select_parameters(model, setup.adapted)))
    row = measure(setup, Point("flashbob", 32, 2, "second", False))
    assert row["status"] == "ok", row["error"]
    predicted = predicted_bytes(dims, "flashbob", 4, n=32, k=2, order="second", checkpoint=False)
    assert row["saved_gib"] * 2**30 == pytest.approx(predicted, rel=0.01)
    eager = predicted_bytes(dims, "eager", 4, n=32, k=2, order="second", checkpoint=False)
    assert row["saved_gib"] * 2**30 < eager  # no N x N tensor is saved


def test_a_failed_point_skips_the_larger_points_of_its_series(tmp_path, monkeypatch):
    """Real measurements, with the step of eager at N >= 32 and k >= 2 running out of memory and the
    step of sdpa_math at N=64 raising another error."""
    from ttt.experiments import workloads

    real_meta_step = workloads.meta_step

    def failing(objective, inner, params, tasks):
        n, k, backend = tasks[0]["inner"].numel() - 1, inner.cfg.steps, objective.model.cfg.attention
        if backend == "eager" and n >= 32 and k >= 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")
        if backend == "sdpa_math" and n == 64:
            raise RuntimeError("a kernel failed")
        return real_meta_step(objective, inner, params, tasks)

    monkeypatch.setattr(workloads, "meta_step", failing)
    overrides = ["preset=cpu", "n_sweep.ns=[16,32,64]", "n_sweep.ks=[1,2,4]", *ONLY_N_SWEEP]
    cfg = load([*overrides, f"out={tmp_path}"], cuda_available=False)
    rows = {(r["backend"], r["n"], r["k"]): r for r in grad_memory.run(cfg)}
    assert rows[("eager", 32, 2)]["status"] == "oom" and rows[("eager", 32, 2)]["peak_gib"] is None
    for skipped in (("eager", 64, 4), ("eager", 32, 4), ("eager", 64, 2)):
        assert rows[skipped]["status"] == "skipped (oom at N=32, k=2)"
    assert rows[("sdpa_math", 64, 1)]["status"] == "error"
    assert "RuntimeError: a kernel failed" in rows[("sdpa_math", 64, 1)]["error"]
    assert rows[("sdpa_math", 64, 2)]["status"] == "skipped (error at N=64, k=1)"
    for still_measured in (("eager", 64, 1), ("eager", 16, 4), ("flashbob", 64, 4), ("sdpa_math", 32, 4)):
        assert rows[still_measured]["status"] == "ok" and rows[still_measured]["saved_gib"] > 0
    with open(tmp_path / "results.csv") as handle:
        assert [r["status"] for r in csv.DictReader(handle)] == [r["status"] for r in rows.values()]
    saved = [r["saved_gib"] for r in _strict_json(tmp_path / "results.json")["rows"]]
    assert saved == [r["saved_gib"] for r in rows.values()] and None in saved  # null, not NaN


def test_no_point_starts_after_the_budget(tmp_path, monkeypatch):
    clock = iter(range(0, 10**6, 40))  # every look at the clock is 40 s later
    monkeypatch.setattr(grad_memory, "time", SimpleNamespace(monotonic=lambda: next(clock)))
    monkeypatch.setattr(grad_memory, "measure", lambda setup, point, warmup: {"status": "ok"})
    overrides = ["preset=cpu", "n_sweep.ns=[16,32,64,128]", "n_sweep.ks=[1]", *ONLY_N_SWEEP]
    overrides.append("backends=[eager]")
    rows = grad_memory.run(load([*overrides, "max_minutes=1.5", f"out={tmp_path}"], cuda_available=False))
    assert [r["status"] for r in rows] == ["ok", "ok", "skipped (budget)", "skipped (budget)"]


@pytest.mark.parametrize(
    "override, message",
    [
        ("n_sweep.nss=[1]", "unknown config key 'n_sweep.nss'"),
        (
            "backends=[flash]",
            "backends must be one of flashbob, eager, sdpa_math, sdpa, sdpa_cudnn; got 'flash'",
        ),
        ("preset=tpu", "preset must be one of auto, cpu, gpu; got 'tpu'"),
        ("n_sweep.orders=[third]", "n_sweep.orders must be one of first, second; got 'third'"),
        ("dtype=fp8", "dtype must be one of auto, bf16, fp16, fp32; got 'fp8'"),
        ("n_sweep.ks=[0]", "n_sweep: ns must be >= 2 and ks >= 1"),
    ],
)
def test_bad_overrides_are_errors_naming_the_key(override, message, capsys):
    assert grad_memory.main([override]) == 2
    assert message in capsys.readouterr().err
    with pytest.raises((ConfigError, ValueError)):
        load([override], cuda_available=False)


def test_presets_and_help():
    gpu, cpu = load([], cuda_available=True), load([], cuda_available=False)
    assert gpu.preset == "gpu" and gpu.d_model == 512 and gpu.n_sweep.ns[-1] == 524288
    assert cpu.preset == "cpu" and cpu.d_model == 32 and cpu.cpu_threads == 1
    assert load(["preset=cpu", "d_model=64"], cuda_available=True).d_model == 64


def test_help_lists_the_keys(capsys):
    assert grad_memory.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "max_minutes = 5.0" in out and "backends" in out and "preset = auto" in out


HVP_SWEEP = ["preset=cpu", "workload=hvp", "n_kv_heads=1", "tie_embeddings=true"]


def test_hvp_workload_measures_gradient_and_hvp_per_backend(tmp_path):
    cfg = load([*HVP_SWEEP, "n_sweep.ns=[24,16]", f"out={tmp_path}"], cuda_available=False)
    rows = grad_memory.run(cfg)
    # backend x (gradient, HVP) x N, N ascending within each series; k and checkpointing do not apply
    assert [(r["backend"], r["order"], r["n"]) for r in rows] == [
        (b, o, n) for b in ("flashbob", "eager", "sdpa_math") for o in ("first", "second") for n in (16, 24)
    ]
    for row in rows:
        assert row["status"] == "ok", row
        assert row["k"] == 1 and row["checkpoint"] is False and row["predicted_gib"] is None
        assert row["seconds"] > 0 and row["params_gib"] < row["saved_gib"] < row["peak_gib"]
    assert sum(r["first_call_s"] is not None for r in rows) == 6  # one warm-up per (backend, order)
    by_point = {(r["backend"], r["order"], r["n"]): r for r in rows}
    for backend in ("flashbob", "eager", "sdpa_math"):
        for n in (16, 24):  # the HVP keeps the gradient's graph and differentiates it again
            gradient, product = by_point[(backend, "first", n)], by_point[(backend, "second", n)]
            assert product["saved_gib"] > 1.4 * gradient["saved_gib"], (backend, n)
            assert product["peak_gib"] > gradient["peak_gib"], (backend, n)
    table = (tmp_path / "table.md").read_text()
    assert "hvp: 2 layers, d_model 32, 2 heads (1 key/value) of 16" in table and "tied embeddings" in table
    assert "- flashbob, N=24: HVP / gradient time" in table and "- eager, HVP: largest N that ran 24" in table
    assert _strict_json(tmp_path / "environment.json")["workload"] == "hvp"
    assert {p.name for p in tmp_path.glob("*.png")} == {"memory_vs_n.png", "time_vs_n.png"}


def test_hvp_workload_is_the_second_order_product(monkeypatch):
    """The step of order second runs ttt.second_order.hvp over every parameter, along +-1 entries."""
    from ttt.experiments import workloads

    calls = []

    def recording(loss_fn, params, vector):
        calls.append((set(params), {float(v) for t in vector.values() for v in t.unique()}))
        return {}

    monkeypatch.setattr(workloads, "hvp", recording)
    setup = grad_memory.resolve(load(HVP_SWEEP, cuda_available=False))
    model, step = workloads.build(setup, Point("eager", 16, 1, "second", False))
    step()
    assert calls == [(set(dict(model.named_parameters())), {-1.0, 1.0})]


def test_an_hvp_oom_stops_the_hvp_series_only(tmp_path, monkeypatch):
    from ttt.experiments import workloads

    real_hvp, calls = workloads.hvp, []

    def out_of_memory_from_32(loss_fn, params, vector):
        calls.append(None)
        if len(calls) > 2:  # N=16: a warm-up and a measured HVP; then N=32
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real_hvp(loss_fn, params, vector)

    monkeypatch.setattr(workloads, "hvp", out_of_memory_from_32)
    cfg = load(
        [*HVP_SWEEP, "n_sweep.ns=[16,32,48]", "backends=[eager]", f"out={tmp_path}"], cuda_available=False
    )
    rows = {(r["order"], r["n"]): r["status"] for r in grad_memory.run(cfg)}
    assert rows == {
        ("first", 16): "ok",
        ("first", 32): "ok",
        ("first", 48): "ok",
        ("second", 16): "ok",
        ("second", 32): "oom",
        ("second", 48): "skipped (oom at N=32, k=1)",
    }
    assert "- eager, HVP: largest N that ran 16; first OOM at N=32" in (tmp_path / "table.md").read_text()


def test_neural_memory_workload_measures_second_order_above_first(tmp_path):
    """The neural-memory layer as a workload: k is its memory depth; the second-order step keeps the
    graph of every write (so it saves more than the first-order one) and every point runs."""
    cfg = load(
        ["preset=cpu", "workload=neural_memory", "backends=[flashbob,eager]", "n_sweep.ns=[32]",
         "n_sweep.ks=[1,2]", "k_sweep.ns=[]", "checkpointed.ns=[]", "first_order.ns=[32]",
         "first_order.ks=[2]", "chunk_len=16", f"out={tmp_path}"],
        cuda_available=False,
    )  # fmt: skip
    rows = grad_memory.run(cfg)
    assert rows and all(r["status"] == "ok" for r in rows), rows
    by_point = {(r["backend"], r["order"], r["k"]): r for r in rows}
    for backend in ("flashbob", "eager"):
        assert by_point[(backend, "second", 2)]["saved_gib"] > by_point[(backend, "first", 2)]["saved_gib"]
    assert _strict_json(tmp_path / "environment.json")["workload"] == "neural_memory"
