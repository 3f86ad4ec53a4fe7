"""cuDNN's attention as the forward and first backward of `flash_attention` (flashbob/cudnn_passes.py).

On the CPU: the split of bottom-right causal attention into an unmasked part and a square causal block,
and the merge of their outputs, give one softmax over all keys (the cuDNN calls stood in for by float64
plain attention); the setting's values and errors. On a GPU with cuDNN's kernel: the outputs, gradients
and second derivatives against float64 autograd with outputs poisoned, within 2x the error of plain
PyTorch in the same dtype, with the cuDNN passes taking every call they serve and none they do not.
"""

import pytest
import torch
from kernel_cases import DEVICE, Case, autograd_reference, make_inputs
from test_triton_stages import check, plain_torch_errors

import flashbob
from flashbob import cudnn_passes, triton_ops
from flashbob.reference import attention_naive

DOUBLE = torch.float64


def plain_part(q, k, v, square, scale):
    """A stand-in for one cuDNN forward: (out, lse) of plain attention, causal within a square block."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if square:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


def plain_part_backward(dout, q, k, v, out, lse, square, scale):
    """A stand-in for one cuDNN backward: the part's probabilities from the whole row's lse."""
    scores = (q @ k.transpose(-1, -2)) * scale
    if square:
        scores = scores.masked_fill(torch.ones(scores.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    probs = (scores - lse.unsqueeze(-1)).exp()
    delta = (dout * out).sum(-1, keepdim=True)
    dscores = probs * (dout @ v.transpose(-1, -2) - delta) * scale
    return dscores @ k, dscores.transpose(-1, -2) @ q, probs.transpose(-1, -2) @ dout


@pytest.mark.parametrize(
    "n, m, causal", [(37, 37, True), (29, 45, True), (5, 63, True), (1, 1, True), (45, 29, False)]
)
def test_the_split_passes_give_one_softmax_over_all_keys(monkeypatch, n, m, causal):
    monkeypatch.setattr(cudnn_passes, "_forward_call", plain_part)
    monkeypatch.setattr(cudnn_passes, "_backward_call", plain_part_backward)
    gen = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(2, 3, n, 48, generator=gen, dtype=DOUBLE) for _ in range(2))
    k, v = (torch.randn(2, 3, m, 48, generator=gen, dtype=DOUBLE) for _ in range(2))
    scale = 48**-0.5
    out, lse = cudnn_passes.forward(q, k, v, causal=causal, scale=scale)
    grads = cudnn_passes.backward(q, k, v, out, lse, dout, causal=causal, scale=scale)

    ref_in = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = attention_naive(*ref_in, causal=causal, scale=scale)
    scores = (q @ k.transpose(-1, -2)) * scale
    if causal:
        seen = torch.arange(m)[None] <= torch.arange(n)[:, None] + (m - n)
        scores = scores.masked_fill(~seen, float("-inf"))
    torch.testing.assert_close(out, ref_out.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, torch.autograd.grad(ref_out, ref_in, dout)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_the_setting_names_its_choices(monkeypatch):
    monkeypatch.delenv(cudnn_passes.ENV, raising=False)
    assert cudnn_passes.chosen() == "triton"
    monkeypatch.setenv(cudnn_passes.ENV, "cuDNN")
    assert cudnn_passes.chosen() == "cudnn"
    monkeypatch.setenv(cudnn_passes.ENV, "flash")
    with pytest.raises(ValueError, match="FLASHBOB_FIRST_PASSES must be one of .*'flash'"):
        cudnn_passes.chosen()


def test_off_cuda_or_unchosen_every_call_runs_flashbobs_kernels(monkeypatch):
    q = torch.randn(1, 2, 8, 64, dtype=torch.bfloat16)
    monkeypatch.setenv(cudnn_passes.ENV, "cudnn")
    assert not cudnn_passes.serves(q, q, q, causal=True, window=None, key_range=None)  # the CPU
    if DEVICE == "cuda":
        monkeypatch.delenv(cudnn_passes.ENV)
        q = q.cuda()
        assert not cudnn_passes.serves(q, q, q, causal=True, window=None, key_range=None)


def has_cudnn_attention() -> bool:
    if DEVICE != "cuda":
        return False
    q = torch.randn(1, 1, 16, 64, device="cuda", dtype=torch.bfloat16)
    try:
        cudnn_passes._forward_call(q, q, q, True, 0.125)
    except (RuntimeError, NotImplementedError, TypeError):  # no cuDNN kernel for this GPU or build
        return False
    return True


needs_cudnn = pytest.mark.skipif(not has_cudnn_attention(), reason="needs CUDA with cuDNN's attention")

SERVED = [
    Case(2, 4, 4, 37, 37, 48, causal=True),
    Case(1, 2, 2, 63, 63, 64, causal=True),
    Case(1, 2, 2, 29, 45, 80, causal=True),
    Case(1, 2, 2, 64, 1088, 64, causal=True, window=2048),
    Case(1, 2, 2, 45, 29, 128),
    Case(1, 1, 1, 2, 9, 64, causal=True),
]


@pytest.fixture
def cudnn_calls(monkeypatch):
    """Chooses the cuDNN passes and records the parts they run ("forward" / "backward")."""
    monkeypatch.setenv(cudnn_passes.ENV, "cudnn")
    monkeypatch.setattr(triton_ops, "POISON_OUTPUTS", True)
    calls = []
    for name in ("forward", "backward"):
        real = getattr(cudnn_passes, f"_{name}_call")

        def counted(*args, _real=real, _name=name):
            calls.append(_name)
            return _real(*args)

        monkeypatch.setattr(cudnn_passes, f"_{name}_call", counted)
    return calls


@needs_cudnn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", SERVED, ids=lambda c: c.id)
def test_second_order_through_the_cudnn_passes_matches_float64(case, dtype, cudnn_calls):
    inputs = make_inputs(case)
    ref = autograd_reference(case, *inputs)
    baseline = plain_torch_errors(case, inputs, ref, dtype)
    q, k, v, dout, u_q, u_k, u_v = (t.to(dtype).requires_grad_() for t in inputs)
    out = flashbob.flash_attention(q, k, v, causal=case.causal, window=case.window)
    check("out", out, ref["out"], dtype, baseline)
    firsts = torch.autograd.grad(out, (q, k, v), dout, create_graph=True)
    for name, got in zip(("dq", "dk", "dv"), firsts):
        check(name, got, ref[name], dtype, baseline)
    bob = torch.autograd.grad(firsts, (q, k, v, dout), (u_q, u_k, u_v))
    for i, (got, want) in enumerate(zip(bob, ref["bob"])):
        check(f"bob{i}", got, want, dtype, baseline)
    parts = 2 if case.causal and case.m > case.n else 1
    assert cudnn_calls == ["forward"] * parts + ["backward"] * parts


@needs_cudnn
@pytest.mark.parametrize(
    "case, dtype, ranged",
    [
        (Case(1, 4, 2, 37, 37, 64, causal=True), torch.bfloat16, False),  # GQA
        (Case(1, 2, 2, 30, 50, 64, causal=True, window=17), torch.bfloat16, False),  # a window that masks
        (Case(1, 2, 2, 50, 30, 64, causal=True), torch.bfloat16, False),  # more queries than keys
        (Case(1, 2, 2, 37, 37, 64, causal=True), torch.float32, False),
        (Case(1, 2, 2, 37, 37, 256, causal=True), torch.bfloat16, False),
        (Case(2, 2, 2, 37, 37, 64, causal=True), torch.bfloat16, True),
        (Case(1, 1, 1, 1, 9, 64, causal=True), torch.bfloat16, False),  # cuDNN refuses one query
    ],
    ids=["gqa", "window", "n>m", "float32", "d256", "key-ranges", "one-query"],
)
def test_calls_it_does_not_serve_run_flashbobs_kernels(case, dtype, ranged, cudnn_calls):
    q, k, v, dout = (t.to(dtype).requires_grad_() for t in make_inputs(case)[:4])
    ranges = {"key_start": torch.tensor([0, 3], device=DEVICE), "key_end": torch.tensor([37, 30])}
    ranges["key_end"] = ranges["key_end"].to(DEVICE)
    options = {"causal": case.causal, "window": case.window, **(ranges if ranged else {})}
    out = flashbob.flash_attention(q, k, v, **options)
    torch.autograd.grad(out, (q, k, v), dout)
    assert cudnn_calls == []
