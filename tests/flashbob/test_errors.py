"""Every unsupported input fails with an error that names the argument."""

import pytest
import torch

import flashbob


def qkv(b=1, hq=2, hkv=2, n=8, m=8, d=16, dtype=torch.float32):
    """Random q (b, hq, n, d), k and v (b, hkv, m, d) in `dtype`."""
    shapes = ((b, hq, n, d), (b, hkv, m, d), (b, hkv, m, d))
    return tuple(torch.randn(s).to(dtype) for s in shapes)


@pytest.mark.parametrize(
    "make, kwargs, error, match",
    [
        (lambda: (torch.randn(2, 8, 16),) + qkv()[1:], {}, ValueError, "q must be 4-D"),
        (lambda: (qkv()[0], qkv()[1], qkv(m=9)[2]), {}, ValueError, "k and v must have the same shape"),
        (lambda: (qkv()[0],) + qkv(b=2)[1:], {}, ValueError, "batch"),
        (lambda: (qkv()[0],) + qkv(d=32)[1:], {}, ValueError, "head_dim 16"),
        (lambda: qkv(hq=3, hkv=2), {}, ValueError, "multiple of k/v heads"),
        (lambda: qkv(d=4), {}, ValueError, "head_dim must be in"),
        (lambda: qkv(d=264), {}, ValueError, "head_dim must be in"),
        (lambda: (qkv()[0].half(),) + qkv()[1:], {}, TypeError, "share one dtype"),
        (lambda: qkv(), {"window": 4}, ValueError, "window requires causal"),
        (lambda: qkv(), {"causal": True, "window": 0}, ValueError, "window must be a positive int"),
        (lambda: qkv(), {"causal": 1}, TypeError, "causal must be a bool"),
        (lambda: qkv(), {"scale": -1.0}, ValueError, "scale must be"),
        (lambda: qkv(), {"backend": "cuda"}, ValueError, "backend must be one of"),
        (lambda: qkv(dtype=torch.float64), {"backend": "triton"}, TypeError, "backend='triton' supports"),
        (lambda: qkv(dtype=torch.int32), {}, TypeError, "backend='torch' supports"),
        (lambda: (qkv()[0].numpy(),) + qkv()[1:], {}, TypeError, "q must be a torch.Tensor"),
    ],
)
def test_bad_input_names_the_argument(make, kwargs, error, match):
    with pytest.raises(error, match=match):
        flashbob.flash_attention(*make(), **kwargs)


def test_mixed_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="one device"):
        flashbob.flash_attention(q, k.to("meta"), v.to("meta"))


def test_triton_on_cpu_without_interpreter(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        flashbob.flash_attention(*qkv(), backend="triton")


def test_stage_inputs_are_checked():
    q, k, v = qkv()
    out, lse = flashbob.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="dout must have shape"):
        flashbob.attention_backward(q, k, v, out, lse, torch.randn(1, 2, 7, 16))
    with pytest.raises(ValueError, match="lse must be"):
        flashbob.attention_backward(q, k, v, out, lse[..., :3], torch.randn_like(q))
    with pytest.raises(ValueError, match="u_k must have shape"):
        flashbob.attention_bob(q, k, v, out, lse, q, q, u_k=torch.randn(1, 2, 3, 16))
    with pytest.raises(TypeError, match="u_v must have dtype"):
        flashbob.attention_bob(q, k, v, out, lse, q, q, u_v=v.double())


@pytest.mark.skipif(
    not flashbob.validation.triton_interpreter_enabled(), reason="CPU tensors reach Triton only interpreted"
)
def test_bf16_in_the_triton_interpreter_is_refused():
    """Triton's CPU interpreter gets bf16 wrong (values near 8e8 for answers near 3.5): refused, by dtype."""
    q, k, v = qkv(dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"torch\.bfloat16.*interpreter.*float16 or float32.*backend='torch'"):
        flashbob.flash_attention(q, k, v, backend="triton")
    torch.testing.assert_close(
        flashbob.flash_attention(q, k, v, backend="torch").float(),
        flashbob.flash_attention(q.float(), k.float(), v.float(), backend="torch"),
        atol=3e-2,
        rtol=3e-2,
    )
