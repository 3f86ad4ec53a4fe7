"""The decoder-only transformer: shapes, parameter names, masks, options, config validation."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ttt.models import Transformer, TransformerConfig


def _model(**overrides):
    torch.manual_seed(0)
    cfg = dict(vocab_size=37, d_model=32, n_layers=2, n_heads=4, attention="eager")
    cfg.update(overrides)
    return Transformer(TransformerConfig(**cfg))


def test_logits_shape_and_parameter_names():
    model = _model(n_kv_heads=2)
    logits = model(torch.randint(0, 37, (3, 11)))
    assert logits.shape == (3, 11, 37)
    names = dict(model.named_parameters())
    for name in [
        "embed.weight",
        "layers.1.attn.wq.weight",
        "layers.1.attn.wk.weight",
        "layers.1.attn.wv.weight",
        "layers.1.attn.wo.weight",
        "layers.1.mlp.w_gate.weight",
        "layers.1.mlp.w_up.weight",
        "layers.1.mlp.w_down.weight",
        "layers.1.attn_norm.weight",
        "layers.1.mlp_norm.weight",
        "norm.weight",
        "lm_head.weight",
    ]:
        assert name in names, name
    assert names["layers.0.attn.wk.weight"].shape == (2 * 8, 32)
    assert not any(name.endswith("bias") for name in names)


def test_qkv_bias_and_tied_embeddings():
    model = _model(qkv_bias=True, tie_embeddings=True)
    names = dict(model.named_parameters())
    assert {"layers.0.attn.wq.bias", "layers.0.attn.wk.bias", "layers.0.attn.wv.bias"} <= set(names)
    assert "lm_head.weight" not in names
    tokens = torch.randint(0, 37, (1, 5))
    torch.testing.assert_close(model(tokens), model.hidden_states(tokens) @ model.embed.weight.t())


def test_causal_and_windowed_receptive_field():
    model = _model(window=3)
    tokens = torch.randint(0, 37, (1, 20))
    changed = tokens.clone()
    changed[0, 4] = (changed[0, 4] + 1) % 37
    diff = (model(tokens) - model(changed)).abs().amax(-1)[0]
    # Two layers of window 3 see 2 * (3 - 1) = 4 tokens back: positions 4..8 change, the rest do not.
    assert torch.all(diff[:4] == 0)
    assert torch.all(diff[4:9] > 0)
    assert torch.all(diff[9:] == 0)


@pytest.mark.parametrize("backend", ["flashbob", "sdpa_math"])
def test_backends_give_the_same_logits(backend):
    tokens = torch.randint(0, 37, (2, 9))
    torch.testing.assert_close(_model(window=4, attention=backend)(tokens), _model(window=4)(tokens))


@pytest.mark.parametrize(
    "overrides, key",
    [
        (dict(n_kv_heads=3), "n_kv_heads"),
        (dict(d_model=30), "head_dim"),
        (dict(window=0), "window"),
        (dict(attention="flash"), "flashbob"),
    ],
)
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ValueError, match=key):
        TransformerConfig(**{"vocab_size": 37, "d_model": 32, "n_heads": 4, **overrides})


def test_bad_tokens_are_rejected():
    with pytest.raises(ValueError, match="int64"):
        _model()(torch.zeros(2, 3))


def test_explicit_head_dim_and_ffn_width():
    model = _model(head_dim=12, d_ff=40, n_kv_heads=1)
    assert model.layers[0].attn.wq.weight.shape == (4 * 12, 32)
    assert model.layers[0].attn.wk.weight.shape == (12, 32)
    assert model.layers[0].mlp.w_up.weight.shape == (40, 32)
    assert model(torch.randint(0, 37, (1, 6))).shape == (1, 6, 37)


def test_null_sizes_resolve_in_the_model_and_follow_d_model_in_the_config():
    from recipes import load_config

    cfg = TransformerConfig(d_model=96, n_heads=4)
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.d_ff) == (None, None, None)
    model = Transformer(cfg)
    assert (model.cfg.n_kv_heads, model.cfg.head_dim, model.cfg.d_ff) == (4, 24, 256)
    assert model.layers[0].mlp.w_up.weight.shape == (256, 96)
    wider = load_config(["recipe=maml_longctx", "model.d_model=256"]).model
    assert wider.d_ff is None and wider.resolved().d_ff == 704  # 8/3 * 256 rounded up to 32


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_project_many_equals_the_separate_projections_in_value_and_gradient(bias, per_sequence):
    """One product over the joined weights: the same outputs, and the same gradients in x and in every
    weight and bias, as one product per layer (float64); per_sequence: weights (B, out, in) as
    functional_call gives fast weights."""
    from torch import nn

    from ttt.models.transformer import project, project_many

    gen = torch.Generator().manual_seed(0)
    layers = [nn.Linear(5, out, bias=bias).double() for out in (4, 3, 3)]
    x = torch.randn(2, 7, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    if per_sequence:
        for layer in layers:
            del layer.weight
            layer.weight = torch.randn(
                2, layer.out_features, 5, dtype=torch.float64, generator=gen
            ).requires_grad_()
            if bias:
                del layer.bias
                layer.bias = torch.randn(
                    2, layer.out_features, dtype=torch.float64, generator=gen
                ).requires_grad_()
    leaves = [x, *(t for layer in layers for t in (layer.weight, layer.bias) if t is not None)]
    cotangents = [
        torch.randn(2, 7, layer.out_features, dtype=torch.float64, generator=gen) for layer in layers
    ]

    def value_and_grads(outs):
        total = sum((out * cot).sum() for out, cot in zip(outs, cotangents, strict=True))
        return [out.detach() for out in outs], torch.autograd.grad(total, leaves)

    with ProductCount() as products:
        joined_out = project_many(layers, x)
    assert products.count == 1  # one product over the joined weights, not one per layer
    joined, joined_grads = value_and_grads(joined_out)
    separate, separate_grads = value_and_grads([project(layer, x) for layer in layers])
    assert [out.shape for out in joined] == [(2, 7, 4), (2, 7, 3), (2, 7, 3)]
    for got, want in zip([*joined, *joined_grads], [*separate, *separate_grads], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


class ProductCount(TorchDispatchMode):
    """Counts the matrix products (mm, addmm, bmm, baddbmm) run inside it."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        products = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)
        self.count += func._overloadpacket in products
        return func(*args, **(kwargs or {}))


def test_project_many_runs_separate_products_for_layers_of_different_kinds():
    """A per-sequence weight beside a shared one (say only wq adapted) cannot be concatenated: each
    layer gets its own product, with the same values."""
    from torch import nn

    from ttt.models.transformer import project, project_many

    gen = torch.Generator().manual_seed(1)
    shared, fast = nn.Linear(5, 4, bias=False).double(), nn.Linear(5, 4, bias=False).double()
    del fast.weight
    fast.weight = torch.randn(2, 4, 5, dtype=torch.float64, generator=gen)
    x = torch.randn(2, 3, 5, dtype=torch.float64, generator=gen)
    for got, layer in zip(project_many([shared, fast], x), (shared, fast), strict=True):
        torch.testing.assert_close(got, project(layer, x), rtol=0, atol=0)
    with pytest.raises(ValueError, match="at least one layer"):
        project_many([], x)
