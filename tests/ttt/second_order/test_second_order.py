"""ttt.second_order: Hessian-vector products against forward-over-reverse, through the torch path in
float64 and the FlashBoB Triton kernels (CPU interpreter) in float32; Hutchinson's estimate against
the exact diagonal; the errors. (The cost of one HVP as context grows: the hvp workload of
tests/ttt/experiments/test_grad_memory.py.)"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jvp

import flashbob
import flashbob.triton_ops
from ttt.models import ATTENTION_BACKENDS, Transformer, TransformerConfig
from ttt.second_order import hutchinson_diagonal, hvp, module_loss_fn


def next_token_ce(logits, tokens):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())


def tiny_model(dtype, **overrides):
    torch.manual_seed(0)
    cfg = dict(vocab_size=23, d_model=16, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=8)
    return Transformer(TransformerConfig(**{**cfg, **overrides})).to(dtype)


def random_vector(params, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return {
        k: torch.randn(p.shape, dtype=torch.float64, generator=gen).to(p.dtype) for k, p in params.items()
    }


def forward_over_reverse(loss_fn, params, vector):
    """H v by torch.func: the forward-mode derivative of the gradient along v."""
    return jvp(grad(loss_fn), ({k: p.detach() for k, p in params.items()},), (vector,))[1]


def max_relative_error(got, want):
    return max(float((got[k].double() - want[k].double()).abs().max() / want[k].abs().max()) for k in want)


@pytest.mark.parametrize("backend", ATTENTION_BACKENDS)
@pytest.mark.parametrize("window", [None, 5], ids=["causal", "window5"])
def test_hvp_equals_forward_over_reverse_in_float64(backend, window):
    model = tiny_model(torch.float64, attention=backend, window=window)
    tokens = torch.randint(0, 23, (2, 13), generator=torch.Generator().manual_seed(2))
    loss_fn, params = module_loss_fn(model, ["*"], tokens, next_token_ce)
    vector = random_vector(params)
    got = hvp(loss_fn, params, vector)
    want = forward_over_reverse(loss_fn, params, vector)
    assert set(got) == set(want) == set(dict(model.named_parameters()))
    for key in want:
        assert got[key].dtype == torch.float64 and got[key].shape == params[key].shape
    # float64 throughout (RMSNorm and RoPE upcast only below float32): the fused ops' double backward
    # against their forward-mode derivatives of the backward, two derivations, to rounding
    assert max_relative_error(got, want) < 1e-12
    assert all(p.grad is None for p in model.parameters())


def test_hvp_runs_the_flashbob_kernels_and_matches_float64(monkeypatch):
    """The model's attention on the Triton path (CPU interpreter), float32: the HVP calls the BoB
    kernels and is as close to the float64 HVP as plain PyTorch in float32 is."""
    tokens = torch.randint(0, 23, (1, 13), generator=torch.Generator().manual_seed(2))
    model = tiny_model(torch.float32)

    def model_hvp(m):
        loss_fn, params = module_loss_fn(m, ["*"], tokens, next_token_ce)
        return hvp(loss_fn, params, random_vector(params))

    want = model_hvp(tiny_model(torch.float64))
    torch32 = model_hvp(model)
    flash_attention, bob = flashbob.flash_attention, flashbob.triton_ops.bob
    calls = []

    def triton_only(*args, backend, **kwargs):
        calls.append("attention")
        return flash_attention(*args, backend="triton", **kwargs)

    def counted_bob(*args, **kwargs):
        calls.append("bob")
        return bob(*args, **kwargs)

    monkeypatch.setattr(flashbob, "flash_attention", triton_only)
    monkeypatch.setattr(flashbob.triton_ops, "bob", counted_bob)
    got = model_hvp(model)
    assert calls.count("attention") == 2 and calls.count("bob") == 2
    assert max_relative_error(got, want) <= 2 * max_relative_error(torch32, want) + 1e-6


@pytest.mark.slow
def test_hutchinson_mean_converges_to_the_exact_diagonal():
    """Over n Rademacher probes the estimate of entry i has standard deviation
    sqrt(sum_{j != i} H_ij^2 / n): the errors in those units must look like standard normals."""
    model = tiny_model(torch.float64, n_layers=1, d_model=8, n_heads=1, n_kv_heads=1, vocab_size=11)
    tokens = torch.randint(0, 11, (1, 9), generator=torch.Generator().manual_seed(3))
    loss_fn, params = module_loss_fn(model, ["layers.0.attn.*"], tokens, next_token_ce)
    sizes = [p.numel() for p in params.values()]
    columns = []
    for i in range(sum(sizes)):
        unit = torch.zeros(sum(sizes), dtype=torch.float64)
        unit[i] = 1
        vector = {k: u.view_as(p) for (k, p), u in zip(params.items(), unit.split(sizes))}
        columns.append(torch.cat([c.flatten() for c in hvp(loss_fn, params, vector).values()]))
    hessian = torch.stack(columns, dim=1)
    torch.testing.assert_close(hessian, hessian.T, rtol=0, atol=1e-6 * float(hessian.abs().max()))
    exact = hessian.diagonal()
    n = 400
    estimate = hutchinson_diagonal(loss_fn, params, n_samples=n, generator=torch.Generator().manual_seed(4))
    estimate = torch.cat([e.flatten() for e in estimate.values()])
    sd = ((hessian.square().sum(1) - exact.square()) / n).sqrt()
    z = (estimate - exact) / sd
    assert exact.abs().max() > 10 * sd.max() / math.sqrt(n)  # the diagonal is not trivially zero
    assert z.abs().max() < 5.0
    assert 0.8 < z.square().mean().sqrt() < 1.2
    assert abs(z.mean()) < 4 / math.sqrt(len(z))


def test_hutchinson_is_exact_for_a_diagonal_hessian_and_reproducible():
    scale = torch.tensor([[1.0, -2.0, 3.0], [0.5, 4.0, 0.0]], dtype=torch.float64)
    params = {"w": torch.randn(2, 3, dtype=torch.float64), "b": torch.tensor([0.3], dtype=torch.float64)}

    def loss_fn(p):
        return (scale * p["w"] ** 2).sum() + p["b"].exp().sum()

    first = hutchinson_diagonal(loss_fn, params, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(first["w"], 2 * scale)
    torch.testing.assert_close(first["b"], params["b"].exp())
    again = hutchinson_diagonal(loss_fn, params, n_samples=3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(again["w"], first["w"])


def test_parameters_the_loss_ignores_get_zeros():
    params = {"used": torch.tensor([2.0]), "unused": torch.ones(3), "linear": torch.ones(2)}

    def loss_fn(p):
        return p["used"].pow(3).sum() + p["linear"].sum()

    out = hvp(loss_fn, params, {k: torch.ones_like(p) for k, p in params.items()})
    torch.testing.assert_close(out["used"], torch.tensor([12.0]))
    assert not out["unused"].any() and not out["linear"].any()


def _quadratic():
    return lambda p: p["x"].square().sum(), {"x": torch.ones(3)}


@pytest.mark.parametrize(
    "vector, error, match",
    [
        ({}, ValueError, r"missing \['x'\]"),
        ({"x": torch.ones(3), "y": torch.ones(1)}, ValueError, r"unexpected \['y'\]"),
        ({"x": torch.ones(4)}, ValueError, r"vector\['x'\] must have shape \(3,\)"),
        (
            {"x": torch.ones(3, dtype=torch.float64)},
            TypeError,
            r"vector\['x'\] must have dtype torch.float32",
        ),
        ({"x": torch.ones(3, device="meta")}, ValueError, r"vector\['x'\] must be on cpu"),
        ([torch.ones(3)], TypeError, "vector must be a dict"),
    ],
    ids=["missing", "extra", "shape", "dtype", "device", "not-a-dict"],
)
def test_bad_vectors_name_the_key_and_the_expected_value(vector, error, match):
    loss_fn, params = _quadratic()
    with pytest.raises(error, match=match):
        hvp(loss_fn, params, vector)


def test_bad_params_losses_and_probe_counts_are_named():
    loss_fn, params = _quadratic()
    with pytest.raises(ValueError, match="params must be a non-empty dict"):
        hutchinson_diagonal(loss_fn, {})
    with pytest.raises(TypeError, match=r"params\['i'\] must be a floating-point tensor"):
        hvp(loss_fn, {"i": torch.ones(3, dtype=torch.long)}, {"i": torch.ones(3, dtype=torch.long)})
    with pytest.raises(ValueError, match="loss_fn must return a scalar tensor, got \\(3,\\)"):
        hvp(lambda p: p["x"] ** 2, params, {"x": torch.ones(3)})
    with pytest.raises(ValueError, match="does not depend on the params it is given"):
        hvp(lambda p: torch.ones(()), params, {"x": torch.ones(3)})
    with pytest.raises(ValueError, match="n_samples must be a positive int, got 0"):
        hutchinson_diagonal(loss_fn, params, n_samples=0)
    with pytest.raises(ValueError, match="generator must be on meta like params"):
        hutchinson_diagonal(loss_fn, {"x": torch.ones(3, device="meta")}, generator=torch.Generator())
    model = tiny_model(torch.float32)
    with pytest.raises(ValueError, match="matches no parameter"):
        module_loss_fn(model, ["layers.9.*"], None, next_token_ce)
    with pytest.raises(TypeError, match="names must be a list of glob patterns"):
        module_loss_fn(model, "layers.*", None, next_token_ce)
    with pytest.raises(ValueError, match="'w' is not a parameter"):
        module_loss_fn(model, {"w": torch.ones(1)}, None, next_token_ce)
