"""The gradient-memory experiment on the CPU: a tiny sweep end to end, the memory model against the
measured saved-for-backward bytes, and the sweep's failure handling. No timing is asserted."""

import csv
import json

import pytest
import torch

from ttt.experiments import grad_memory, grad_memory_report
from ttt.experiments.grad_memory_config import load
from ttt.experiments.memory_model import ModelDims, predicted_bytes
from ttt.experiments.meta_step_probe import measure, time_limit
from ttt.experiments.workloads import Point, ProbeSetup
from ttt.inner import select_parameters
from ttt.models import Transformer, TransformerConfig

TINY = [
    "preset=cpu",
    "d_model=32",
    "n_heads=2",
    "head_dim=16",
    "n_sweep.ns=[16,32]",
    "n_sweep.ks=[1,2]",
    "k_sweep.ns=[16]",
    "k_sweep.ks=[1,2,3]",
    "k_sweep.checkpoint=[false,true]",
    "first_order.ns=[16]",
    "checkpointed.ns=[16,32]",
]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny steps run many times faster on one thread than on threads that wait for each other."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_cpu_sweep_writes_csv_table_plots_and_environment(tmp_path, capsys):
    assert grad_memory.main([*TINY, f"out={tmp_path}"]) == 0
    with open(tmp_path / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    # 3 backends x (n_sweep's 2 N x 2 k, k_sweep's k=3 and checkpointed k=1..3, first_order,
    # checkpointed's N=32: the other points repeat earlier ones).
    assert len(rows) == 3 * (4 + 1 + 3 + 1 + 1)
    assert {row["status"] for row in rows} == {"ok"}
    for row in rows:
        assert float(row["saved_gib"]) > 0 and float(row["predicted_gib"]) > 0 and float(row["seconds"]) > 0
        assert float(row["peak_gib"]) > float(row["saved_gib"])  # on the CPU: LiveTensorMeter
    assert sum(row["first_call_s"] != "" for row in rows) == 6  # one warm-up per (backend, order)
    for name in ("memory_vs_n.png", "time_vs_n.png", "memory_vs_k.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    env = json.loads((tmp_path / "environment.json").read_text())
    assert env["torch"] == torch.__version__ and env["commit"] and env["dtype"] == "float32"
    table = (tmp_path / "table.md").read_text()
    assert f"commit {env['commit']}" in table and table.count("\n| flashbob |") == 10
    assert "memory slope in k" in table and "eager / flashbob" in table
    assert json.loads((tmp_path / "results.json").read_text())["rows"][0]["backend"] == "flashbob"
    assert "grad_memory: 30 points" in capsys.readouterr().out
    (tmp_path / "memory_vs_n.png").unlink()
    (tmp_path / "table.md").write_text("")
    assert grad_memory_report.main([str(tmp_path)]) == 0  # rendered again from the CSV alone
    assert (tmp_path / "table.md").read_text() == table and (tmp_path / "memory_vs_n.png").is_file()


def test_ttt_e2e_workload_runs_and_is_not_predicted(tmp_path):
    overrides = [*TINY[:4], "workload=ttt_e2e", "window=8", "chunk_len=8", "n_sweep.ns=[16,32]"]
    overrides += ["k_sweep.ns=[]", "first_order.ns=[16]", "checkpointed.ns=[32]", "backends=[flashbob,eager]"]
    rows = grad_memory.run(load([*overrides, f"out={tmp_path}"], cuda_available=False))
    assert len(rows) == 2 * 6 and {r["status"] for r in rows} == {"ok"}
    assert all(r["predicted_gib"] is None and r["saved_gib"] > 0 for r in rows)
    assert "ttt_e2e: 2 layers" in (tmp_path / "table.md").read_text()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", ["eager", "sdpa_math"])
def test_memory_model_matches_the_saved_bytes_and_bounds_the_peak(dtype, backend):
    setup = grad_memory.resolve(load(["preset=cpu"], cuda_available=False))
    setup.dtype = dtype
    predict = grad_memory.predictor(setup)
    for n, k, order in [(24, 2, "first"), (24, 1, "second"), (40, 3, "second"), (256, 2, "second")]:
        point = Point(backend, n, k, order, False)
        row = measure(setup, point, warmup=False, time_limit_s=None)
        assert row["status"] == "ok", row["error"]
        model = predict(point)
        assert row["saved_gib"] == pytest.approx(model["predicted_gib"], rel=0.01), point
        # The peak model is about an upper estimate: at the peak some linear activations are freed.
        assert 0.7 < row["peak_gib"] / model["predicted_peak_gib"] < 1.1, point


def test_memory_model_matches_the_flashbob_kernels_saved_bytes(monkeypatch):
    """The FlashBoB autograd chain itself (Triton's CPU interpreter), not the CPU fallback."""
    import kernels

    flash_attention = kernels.flash_attention

    def triton_only(*args, backend, **kwargs):
        return flash_attention(*args, backend="triton", **kwargs)

    monkeypatch.setattr(kernels, "flash_attention", triton_only)
    setup = grad_memory.resolve(load(["preset=cpu"], cuda_available=False))
    model = Transformer(setup.model)
    dims = ModelDims.of(model, list(select_parameters(model, setup.adapted)))
    point = Point("flashbob", 32, 2, "second", False)
    row = measure(setup, point, time_limit_s=None)
    assert row["status"] == "ok", row["error"]
    predicted = predicted_bytes(dims, "flashbob", 4, n=32, k=2, order="second", checkpoint=False)
    assert row["saved_gib"] * 2**30 == pytest.approx(predicted, rel=0.01)
    eager = predicted_bytes(dims, "eager", 4, n=32, k=2, order="second", checkpoint=False)
    assert row["saved_gib"] * 2**30 < eager  # no N x N tensor is saved


def test_failed_point_skips_the_larger_points_of_its_series(tmp_path, monkeypatch):
    def fake_measure(setup, point, **limits):
        status = "oom" if point.backend == "eager" and point.n >= 32 and point.k >= 2 else "ok"
        return {"status": status, "seconds": 0.1 if status == "ok" else None}

    monkeypatch.setattr(grad_memory, "measure", fake_measure)
    cfg = load(
        [
            *TINY[:5],
            "n_sweep.ns=[16,32,64]",
            "n_sweep.ks=[1,2,4]",
            "k_sweep.ns=[]",
            "first_order.ns=[]",
            "checkpointed.ns=[]",
            f"out={tmp_path}",
        ],
        cuda_available=False,
    )
    rows = {(r["backend"], r["n"], r["k"]): r["status"] for r in grad_memory.run(cfg)}
    assert rows[("eager", 32, 2)] == "oom"
    assert rows[("eager", 64, 4)] == rows[("eager", 32, 4)] == "skipped (oom at N=32, k=2)"
    assert rows[("eager", 64, 1)] == rows[("eager", 16, 4)] == rows[("flashbob", 64, 4)] == "ok"


def test_points_expected_to_overrun_the_budget_are_skipped(tmp_path, monkeypatch):
    def fake_measure(setup, point, **limits):
        return {"status": "ok", "seconds": (point.n / 16) ** 2}  # reported, not spent

    monkeypatch.setattr(grad_memory, "measure", fake_measure)
    sweeps = ["n_sweep.ns=[16,32,64,128]", "n_sweep.ks=[1]", "k_sweep.ns=[]", "first_order.ns=[]"]
    overrides = [*TINY[:5], *sweeps, "checkpointed.ns=[]", "backends=[flashbob]", "max_minutes=0.2"]
    statuses = [
        r["status"] for r in grad_memory.run(load([*overrides, f"out={tmp_path}"], cuda_available=False))
    ]
    # N=64 is expected to take 4 x 4 s and N=128 16 x 4 s, with about 12 s of the budget left.
    assert statuses == ["ok", "ok", "skipped (budget)", "skipped (budget)"]


def test_out_of_memory_and_time_limit_are_recorded_not_raised(monkeypatch):
    setup = ProbeSetup(
        TransformerConfig(d_model=16, n_heads=2),
        ["layers.*.mlp.*"],
        0.01,
        torch.device("cpu"),
        torch.float32,
        0,
    )

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 64 GiB")

    monkeypatch.setattr("ttt.experiments.workloads.meta_step", out_of_memory)
    row = measure(setup, Point("eager", 8, 1, "second", False), warmup=False, time_limit_s=None)
    assert row["status"] == "oom" and row["seconds"] is None
    with pytest.raises(Exception, match="over the time limit"), time_limit(0.05):
        while True:
            pass


@pytest.mark.parametrize(
    "override, message",
    [
        ("n_sweep.nss=[1]", "nss"),
        ("backends=[flash]", "backends"),
        ("preset=tpu", "preset"),
        ("n_sweep.orders=[third]", "orders"),
    ],
)
def test_bad_overrides_are_errors_naming_the_key(override, message, capsys):
    assert grad_memory.main([override]) == 2
    assert message in capsys.readouterr().err


def test_help_lists_the_keys(capsys):
    from ttt.experiments.grad_memory import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "max_minutes" in out and "backends" in out
