"""The TTT-E2E options of the transformer: QK-norm, post-norms, the init schemes, RoPE tables in float64,
and the interleaved-pair to rotate-half weight mapping; each exact through the second derivative."""

import math

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

from ttt.models import Transformer, TransformerConfig
from ttt.models.rope import interleaved_to_rotate_half, rope_cos_sin
from ttt.models.transformer import Block

SMALL = dict(vocab_size=40, d_model=12, n_layers=2, n_heads=2, head_dim=8, d_ff=10, attention="eager")


def test_qk_norm_and_post_norm_add_their_gains_and_start_as_ones():
    names = dict(Transformer(TransformerConfig(**SMALL, qk_norm=True, post_norm=True)).named_parameters())
    for i in range(2):
        assert names[f"layers.{i}.attn.q_norm.weight"].shape == (8,)
        assert names[f"layers.{i}.attn.k_norm.weight"].shape == (8,)
        for post in ("attn_post_norm", "mlp_post_norm"):
            assert torch.equal(names[f"layers.{i}.{post}.weight"], torch.ones(12))
    plain = dict(Transformer(TransformerConfig(**SMALL)).named_parameters())
    assert not any("q_norm" in n or "post_norm" in n for n in plain)


def test_qk_norm_normalises_each_head_before_rope():
    torch.manual_seed(0)
    cfg = TransformerConfig(**SMALL, qk_norm=True, fused_ops=False)
    attn = Block(cfg).attn.double()
    with torch.no_grad():
        attn.q_norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    x = torch.randn(1, 7, 12, dtype=torch.float64)
    cos, sin = rope_cos_sin(7, 8, 10000.0, x.device, dtype=torch.float64)
    q, k, _ = attn.project_qkv(x, cos, sin)
    raw = (x @ attn.wq.weight.t()).view(1, 7, 2, 8).transpose(1, 2)
    normed = raw / torch.sqrt(raw.square().mean(-1, keepdim=True) + cfg.norm_eps) * attn.q_norm.weight
    half = torch.cat([-normed[..., 4:], normed[..., :4]], -1)
    torch.testing.assert_close(q, normed * cos + half * sin, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_qk_norm_under_bf16_autocast_gives_q_k_v_of_one_dtype(fused):
    """bf16-mixed training (the 125M recipe on a GPU): the norm's float32 gain must not leave q and k in
    float32 beside a bf16 v, which the attention kernels refuse."""
    attn = Block(TransformerConfig(**SMALL, qk_norm=True, fused_ops=fused)).attn
    cos, sin = rope_cos_sin(7, 8, 10000.0, torch.device("cpu"), dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = attn.project_qkv(torch.randn(1, 7, 12), cos, sin)
    assert q.dtype == k.dtype == v.dtype == torch.bfloat16


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "plain"])
def test_block_with_qk_norm_and_post_norms_is_exact_to_the_second_derivative(fused):
    torch.manual_seed(1)
    cfg = TransformerConfig(**SMALL, qk_norm=True, post_norm=True, fused_ops=fused)
    block = Block(cfg).double()
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    cos, sin = rope_cos_sin(5, 8, 10000.0, torch.device("cpu"), dtype=torch.float64)
    x = torch.randn(1, 5, 12, dtype=torch.float64, requires_grad=True)
    gains = [block.attn.q_norm.weight, block.attn.k_norm.weight, block.attn_post_norm.weight]

    def run(x, *weights):
        params = dict(zip(["attn.q_norm.weight", "attn.k_norm.weight", "attn_post_norm.weight"], weights))
        return torch.func.functional_call(block, params, (x, cos, sin)).sum(-1)

    inputs = (x, *(g.detach().clone().requires_grad_() for g in gains))
    assert gradcheck(run, inputs)
    assert gradgradcheck(run, inputs)


def test_init_schemes():
    torch.manual_seed(0)
    big = dict(SMALL, d_model=96, head_dim=48, d_ff=256, vocab_size=400)
    normal = dict(Transformer(TransformerConfig(**big, init="normal", init_std=0.05)).named_parameters())
    scaled = dict(Transformer(TransformerConfig(**big)).named_parameters())
    for name in (
        "layers.0.attn.wo.weight",
        "layers.1.mlp.w_down.weight",
        "embed.weight",
        "layers.0.attn.wq.weight",
    ):
        assert normal[name].std().item() == pytest.approx(0.05, rel=0.1), name
    assert scaled["layers.0.attn.wo.weight"].std().item() == pytest.approx(0.02 / math.sqrt(4), rel=0.1)
    assert scaled["embed.weight"].std().item() == pytest.approx(0.02, rel=0.1)
    with pytest.raises(ValueError, match="model.init"):
        TransformerConfig(**SMALL, init="xavier")
    with pytest.raises(ValueError, match="model.init_std"):
        TransformerConfig(**SMALL, init_std=0.0)


def test_rope_tables_follow_a_float64_model():
    model = Transformer(TransformerConfig(**SMALL)).double()
    cos, sin = model.rope_tables(9, torch.device("cpu"))
    assert cos.dtype == sin.dtype == torch.float64
    angles = torch.arange(9, dtype=torch.float64)[:, None] / 10000.0 ** (torch.arange(0, 8, 2) / 8)
    torch.testing.assert_close(cos[:, :4], angles.cos(), rtol=1e-15, atol=1e-15)


def test_interleaved_weights_map_onto_rotate_half_with_the_same_scores():
    torch.manual_seed(2)
    heads, dim, n = 3, 8, 11
    wq, wk = (
        torch.randn(heads * dim, 16, dtype=torch.float64),
        torch.randn(heads * dim, 16, dtype=torch.float64),
    )
    x = torch.randn(n, 16, dtype=torch.float64)
    positions = torch.arange(n, dtype=torch.float64)
    omega = 10000.0 ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    angle = positions[:, None, None] * omega

    def interleaved(u):  # dims (2k, 2k + 1) rotate together
        a, b = u[..., 0::2], u[..., 1::2]
        return torch.stack(
            [a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1
        ).flatten(-2)

    cos, sin = rope_cos_sin(n, dim, 10000.0, x.device, dtype=torch.float64)

    def rotate_half(u):
        return u * cos[:, None] + torch.cat([-u[..., dim // 2 :], u[..., : dim // 2]], -1) * sin[:, None]

    theirs = torch.einsum(
        "thd,shd->hts",
        interleaved((x @ wq.t()).view(n, heads, dim)),
        interleaved((x @ wk.t()).view(n, heads, dim)),
    )
    q = rotate_half((x @ interleaved_to_rotate_half(wq, dim).t()).view(n, heads, dim))
    k = rotate_half((x @ interleaved_to_rotate_half(wk, dim).t()).view(n, heads, dim))
    torch.testing.assert_close(torch.einsum("thd,shd->hts", q, k), theirs, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="head_dim"):
        interleaved_to_rotate_half(wq, 5)
