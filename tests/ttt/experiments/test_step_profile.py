"""`ttt.experiments.step_profile`: kernel names sorted into categories, the step summary, and kernel time
attributed to the op, autograd node and project line that launched it."""

import pytest
import torch

from ttt.experiments.step_profile import (
    PROJECT_ROOT,
    StepProfiler,
    attribute_device_time,
    kernel_category,
    project_frame,
    summarize_kernels,
)
from ttt.models.transformer import residual


@pytest.mark.parametrize(
    "name, category",
    [
        ("attention_bob_cols_kernel", "attention"),
        ("attention_forward_kernel", "attention"),
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", "matmul"),
        ("triton_poi_fused__to_copy_arange_eq_exp_mul_sub_unsqueeze_0", "compiled"),
        ("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", "elementwise"),
        ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda>", "copy"),
        ("Memset (Device)", "copy"),
        ("some_library_kernel", "other"),
    ],
)
def test_kernel_category(name, category):
    assert kernel_category(name) == category


def test_summary_sums_categories_and_ranks_kernels():
    rows = [("nvjet_a", 5.0, 2), ("attention_forward_kernel", 3.0, 1), ("nvjet_b", 1.0, 4), ("x", 0.5, 1)]
    summary = summarize_kernels(rows, wall_ms=10.0, top=2)
    assert summary["categories"] == {"matmul": 6.0, "attention": 3.0, "other": 0.5}
    assert list(summary["categories"]) == ["matmul", "attention", "other"]
    assert summary["kernel_ms"] == 9.5 and summary["busy_fraction"] == pytest.approx(0.95)
    assert [row["name"] for row in summary["top"]] == ["nvjet_a", "attention_forward_kernel"]
    assert summary["top"][0] == {"name": "nvjet_a", "ms": 5.0, "calls": 2, "category": "matmul"}


def test_profiler_refuses_a_negative_step():
    with pytest.raises(ValueError, match="step must be >= 0"):
        StepProfiler(step=-1)


def test_sources_name_the_op_its_autograd_node_and_the_project_line_that_ran_it():
    """On the CPU, with host time for device time: the forward's addition is attributed to the project's
    line that ran it (`residual`), the backward's to its autograd node (the engine runs it: no frame)."""
    x = torch.randn(64, 64, requires_grad=True)
    y = torch.randn(64, 64, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=True) as prof:
        torch.autograd.grad((residual(x, y, None) * y).sum(), (x, y))
    rows = attribute_device_time(prof.events(), time_of=lambda event: event.self_cpu_time_total, top=100)
    add = [r for r in rows if r["op"] == "aten::add" and r["node"] == "forward"]
    assert len(add) == 1 and add[0]["calls"] == 1
    assert add[0]["frame"].startswith("ttt/models/transformer.py(") and add[0]["frame"].endswith(": residual")
    outside = [r for r in rows if r["op"] == "aten::mul" and r["node"] == "forward"]
    assert len(outside) == 1 and outside[0]["frame"] is None  # this test's own line is not the project's
    backward = [r for r in rows if r["op"] == "aten::mul" and r["node"] == "MulBackward0"]
    assert backward and sum(r["calls"] for r in backward) == 2 and all(r["frame"] is None for r in backward)
    assert all(r["ms"] > 0 for r in rows) and rows == sorted(rows, key=lambda r: -r["ms"])


def test_project_frame_is_the_innermost_frame_in_the_project_packages():
    stack = ["torch/nn/functional.py(10): linear", "ttt/models/mlp.py(20): forward", "ttt/train.py(5): main"]
    assert project_frame(stack) == "ttt/models/mlp.py(20): forward"
    assert project_frame([f"{PROJECT_ROOT}/flashbob/api.py(3): f"]) == "flashbob/api.py(3): f"
    assert project_frame(stack[:1]) is None and project_frame(None) is None


def test_a_frame_under_the_repository_as_imported_or_resolved_is_the_projects(monkeypatch):
    """A checkout reached through a symlink: the profiler names files by the path they were imported
    from, which differs from the resolved one; both are the project's."""
    from ttt.experiments import step_profile

    monkeypatch.setattr(step_profile, "PROJECT_ROOTS", ("/link/repo", "/disk/repo"))
    assert step_profile.project_frame(["/link/repo/ttt/a.py(1): f"]) == "ttt/a.py(1): f"
    assert step_profile.project_frame(["/disk/repo/flashbob/b.py(2): g"]) == "flashbob/b.py(2): g"
    assert step_profile.project_frame(["/elsewhere/ttt/a.py(1): f"]) is None
