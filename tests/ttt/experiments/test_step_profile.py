"""`ttt.experiments.step_profile`: kernel names sorted into categories, and the step summary."""

import pytest

from ttt.experiments.step_profile import StepProfiler, kernel_category, summarize_kernels


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
