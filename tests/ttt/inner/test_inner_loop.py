"""The inner-loop engine against closed forms, float64 finite differences and torch.optim."""

import pytest
import torch
from torch import nn

from ttt.inner import (
    InnerLoop,
    InnerLoopConfig,
    InnerMomentum,
    InnerSGD,
    clip_by_global_norm,
    functional_forward,
    inner_step,
    meta_step,
    select_parameters,
)
from ttt.inner.functional import shared_parameters, substituted


def _quadratic(dim=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    root = torch.randn(dim, dim, dtype=torch.float64, generator=gen)
    curvature = root @ root.t() / dim + torch.eye(dim, dtype=torch.float64)
    return (
        curvature,
        torch.randn(dim, dtype=torch.float64, generator=gen),
        torch.randn(dim, dtype=torch.float64, generator=gen),
    )


def test_sgd_on_a_quadratic_matches_the_closed_form_second_order_gradient():
    curvature, minimum, target = _quadratic()
    w0 = torch.randn(4, dtype=torch.float64, requires_grad=True)
    lr, steps = 0.3, 3
    loop = InnerLoop({"w": w0}, InnerLoopConfig(steps=steps, lr=lr))
    inner = lambda p, step: 0.5 * (p["w"] - minimum) @ curvature @ (p["w"] - minimum)  # noqa: E731
    adapted = loop.adapt(inner, {"w": w0}).params["w"]
    transition = torch.linalg.matrix_power(torch.eye(4, dtype=torch.float64) - lr * curvature, steps)
    torch.testing.assert_close(adapted, minimum + transition @ (w0 - minimum), rtol=0, atol=1e-14)
    (grad,) = torch.autograd.grad(0.5 * (adapted - target).square().sum(), w0)
    torch.testing.assert_close(grad, transition.t() @ (adapted - target), rtol=0, atol=1e-14)

    first_order = InnerLoop({"w": w0}, InnerLoopConfig(steps=steps, lr=lr, first_order=True))
    fo_adapted = first_order.adapt(inner, {"w": w0}).params["w"]
    (fo_grad,) = torch.autograd.grad(0.5 * (fo_adapted - target).square().sum(), w0)
    torch.testing.assert_close(fo_grad, adapted.detach() - target, rtol=0, atol=1e-14)
    assert (fo_grad - grad).abs().max() > 1e-2


def _tiny_problem():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    xq, yq = torch.randn(4, 3, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)
    return model, (x, y), (xq, yq)


def _outer_loss(problem, cfg, flat_override=None):
    """Outer loss after adapting, optionally starting from the flat vector `flat_override`."""
    model, (x, y), (xq, yq) = problem
    params = select_parameters(model, cfg.params)
    if flat_override is not None:
        sizes = [p.numel() for p in params.values()]
        params = {n: t.view_as(p) for (n, p), t in zip(params.items(), flat_override.split(sizes))}
    loop = InnerLoop(params, cfg)
    inner = lambda p, step: (functional_forward(model, p, x) - y).square().mean()  # noqa: E731
    adapted = loop.adapt(inner, params).params
    return (functional_forward(model, adapted, xq) - yq).square().mean(), params


@pytest.mark.parametrize("optimizer", ["sgd", "momentum", "adam"])
@pytest.mark.parametrize("checkpoint", [False, True], ids=["stored", "checkpointed"])
def test_second_order_gradient_matches_float64_finite_differences(optimizer, checkpoint):
    problem = _tiny_problem()
    cfg = InnerLoopConfig(
        params=["0.*", "2.weight"], steps=3, lr=0.05, optimizer=optimizer, checkpoint=checkpoint
    )
    loss, params = _outer_loss(problem, cfg)
    analytic = torch.cat([g.flatten() for g in torch.autograd.grad(loss, list(params.values()))])
    flat = torch.cat([p.detach().flatten() for p in params.values()])
    numeric = torch.empty_like(flat)
    h = 1e-6
    for i in range(flat.numel()):
        step = torch.zeros_like(flat)
        step[i] = h
        plus, _ = _outer_loss(problem, cfg, flat + step)
        minus, _ = _outer_loss(problem, cfg, flat - step)
        numeric[i] = (plus - minus).detach() / (2 * h)
    torch.testing.assert_close(analytic, numeric, rtol=1e-6, atol=1e-8)

    fo_cfg = InnerLoopConfig(**{**cfg.__dict__, "first_order": True})
    fo_loss, fo_params = _outer_loss(problem, fo_cfg)
    fo = torch.cat([g.flatten() for g in torch.autograd.grad(fo_loss, list(fo_params.values()))])
    assert (fo - analytic).abs().max() > 1e-4 * analytic.abs().max()


def test_checkpointed_inner_steps_give_identical_second_order_gradients():
    problem = _tiny_problem()
    grads = []
    for checkpoint in (False, True):
        cfg = InnerLoopConfig(steps=4, lr=0.1, optimizer="adam", checkpoint=checkpoint, grad_clip=0.5)
        loss, params = _outer_loss(problem, cfg)
        grads.append(torch.autograd.grad(loss, list(params.values())))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_updates_match_torch_optim(optimizer):
    problem = _tiny_problem()
    model, (x, y), _ = problem
    cfg = InnerLoopConfig(steps=4, lr=0.05, optimizer=optimizer, momentum=0.8, beta1=0.7, beta2=0.9, eps=1e-8)
    params = select_parameters(model, ["*"])
    adapted = (
        InnerLoop(params, cfg)
        .adapt(lambda p, step: (functional_forward(model, p, x) - y).square().mean(), params)
        .params
    )
    clone = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 2)).double()
    clone.load_state_dict(model.state_dict())
    if optimizer == "momentum":
        reference = torch.optim.SGD(clone.parameters(), lr=0.05, momentum=0.8)
    else:
        reference = torch.optim.Adam(clone.parameters(), lr=0.05, betas=(0.7, 0.9), eps=1e-8)
    for _ in range(4):
        reference.zero_grad()
        (clone(x) - y).square().mean().backward()
        reference.step()
    for name, param in clone.named_parameters():
        torch.testing.assert_close(adapted[name], param, rtol=1e-6, atol=1e-7)


def test_adam_second_order_is_finite_where_the_gradient_is_zero():
    w = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    unused = torch.ones(2, dtype=torch.float64, requires_grad=True)
    loop = InnerLoop({"w": w, "unused": unused}, InnerLoopConfig(steps=2, optimizer="adam", lr=0.1))
    adapted = loop.adapt(lambda p, step: (p["w"] ** 2).sum(), {"w": w, "unused": unused}).params
    grads = torch.autograd.grad((adapted["w"] - 1).square().sum() + adapted["unused"].sum(), (w, unused))
    assert all(torch.isfinite(g).all() for g in grads)


def test_meta_sgd_learning_rate_gradient_matches_closed_form():
    curvature, minimum, target = _quadratic(seed=1)
    w0 = torch.randn(4, dtype=torch.float64)
    loop = InnerLoop({"w": w0}, InnerLoopConfig(steps=1, lr=0.2, learnable_lr="element")).double()
    adapted = loop.adapt(lambda p, s: 0.5 * (p["w"] - minimum) @ curvature @ (p["w"] - minimum), {"w": w0})
    loss = 0.5 * (adapted.params["w"] - target).square().sum()
    (lr_grad,) = torch.autograd.grad(loss, list(loop.parameters()))
    inner_grad = curvature @ (w0 - minimum)
    torch.testing.assert_close(
        lr_grad, -(adapted.params["w"].detach() - target) * inner_grad, rtol=0, atol=1e-14
    )


def test_log_space_lrs_start_at_lr_and_their_gradient_is_lr_times_the_linear_one():
    curvature, minimum, target = _quadratic(seed=2)
    w0 = torch.randn(4, dtype=torch.float64)

    def quadratic(params, step):
        return 0.5 * (params["w"] - minimum) @ curvature @ (params["w"] - minimum)

    def lr_grad(space):
        cfg = InnerLoopConfig(steps=2, lr=0.2, learnable_lr="element", lr_space=space)
        loop = InnerLoop({"w": w0}, cfg).double()
        adapted = loop.adapt(quadratic, {"w": w0})
        loss = 0.5 * (adapted.params["w"] - target).square().sum()
        return loop, adapted, torch.autograd.grad(loss, list(loop.parameters()))[0]

    linear, linear_adapted, linear_grad = lr_grad("linear")
    log, log_adapted, log_grad = lr_grad("log")
    assert [name for name, _ in log.named_parameters()] == ["log_lrs.0"]
    assert [name for name, _ in linear.named_parameters()] == ["lrs.0"]  # checkpoints keep their names
    # both start from float32 parameters (ln 0.2 and 0.2 round differently): equal to float32 rounding
    torch.testing.assert_close(log.learning_rates()["w"], torch.full((4,), 0.2, dtype=torch.float64))
    torch.testing.assert_close(log_adapted.params["w"], linear_adapted.params["w"], rtol=1e-6, atol=0)
    torch.testing.assert_close(log_grad, 0.2 * linear_grad, rtol=1e-6, atol=0)  # d/d ln lr = lr d/d lr


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"lr_space": "log"}, "inner.learnable_lr"),
        ({"lr_outer_lr": 0.1}, "inner.learnable_lr"),
        ({"learnable_lr": "tensor", "lr_space": "exp"}, "inner.lr_space"),
        ({"learnable_lr": "tensor", "lr_outer_lr": 0.0}, "inner.lr_outer_lr"),
    ],
)
def test_bad_lr_space_or_lr_outer_lr_is_refused_by_name(overrides, named):
    with pytest.raises(ValueError, match=named):
        InnerLoopConfig(**overrides)


def test_clip_by_global_norm():
    grads = {"a": torch.tensor([3.0, 0.0], requires_grad=True), "b": torch.tensor([4.0], requires_grad=True)}
    clipped = clip_by_global_norm(grads, 1.0)
    total = torch.sqrt(sum(g.square().sum() for g in clipped.values()))
    torch.testing.assert_close(total, torch.tensor(1.0), rtol=1e-5, atol=0)
    torch.testing.assert_close(clip_by_global_norm(grads, 10.0)["a"], grads["a"])
    (g,) = torch.autograd.grad(clipped["b"].sum(), grads["b"])
    assert g.abs().item() > 0


def test_clip_by_global_norm_is_optax_rule_in_float64_and_safe_at_zero():
    """Below max_norm the grads are returned as they are, at or above it they are g * max_norm / n (no
    epsilon), the norm in float64 for float64 grads; all-zero grads give no NaN in the second derivative."""
    w = torch.tensor([1e-9, 2e-9], dtype=torch.float64, requires_grad=True)
    below = clip_by_global_norm({"w": w * 1e8}, 1.0)["w"]
    assert torch.equal(below, w * 1e8)
    big = torch.tensor([3.0, 4.0], dtype=torch.float64, requires_grad=True)
    clipped = clip_by_global_norm({"w": big}, 1.0)["w"]
    want = torch.tensor([0.6, 0.8], dtype=torch.float64)
    torch.testing.assert_close(clipped.detach(), want, rtol=1e-15, atol=0)  # an epsilon would be off by 1e-6
    (grad,) = torch.autograd.grad(clipped[0], big)  # d(g0 / |g|): (|g|^2 - g0^2, -g0 g1) / |g|^3
    torch.testing.assert_close(
        grad, torch.tensor([16.0, -12.0], dtype=torch.float64) / 125, rtol=1e-15, atol=0
    )
    zero = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    out = clip_by_global_norm({"w": zero * zero}, 1.0)["w"]
    (first,) = torch.autograd.grad(out.sum(), zero, create_graph=True)
    (second,) = torch.autograd.grad(first.sum(), zero)
    assert torch.isfinite(first).all() and torch.isfinite(second).all()


def test_clip_by_global_norm_per_row_clips_each_row_as_on_its_own():
    torch.manual_seed(0)
    scale = torch.tensor([0.01, 1.0, 10.0])
    grads = {"a": torch.randn(3, 4, 5) * scale[:, None, None], "b": torch.randn(3, 7) * scale[:, None]}
    rows = clip_by_global_norm(grads, 1.0, per_row=True)
    for i in range(3):
        alone = clip_by_global_norm({n: g[i] for n, g in grads.items()}, 1.0)
        for name in grads:
            torch.testing.assert_close(rows[name][i], alone[name], rtol=1e-6, atol=0)
    torch.testing.assert_close(rows["a"][0], grads["a"][0])  # the small row is left alone


@pytest.mark.parametrize("lr_kind", ["float", "per_row", "per_element"])
def test_clipped_sgd_folds_the_clip_factor_into_the_lr_with_the_same_first_and_second_derivatives(
    lr_kind, monkeypatch
):
    """SGD takes the clip factor in its learning rates (p - (lr f) g, one kernel) where the product is
    no larger than the factor, else the clipped grads (per-element lrs): either way the step, its
    gradient and its second derivative equal p - lr clip(g) written out, in float64, with a row above
    max_norm, one below and an all-zero one."""
    gen = torch.Generator().manual_seed(1)
    w0 = torch.randn(3, 4, 5, dtype=torch.float64, generator=gen).requires_grad_()
    rows = torch.tensor([1.0, 0.01, 0.0], dtype=torch.float64)[:, None, None]  # the last row: zero grads
    lr = {"float": 0.7, "per_row": torch.tensor([0.5, 0.7, 0.9], dtype=torch.float64)[:, None, None],
          "per_element": torch.rand(4, 5, dtype=torch.float64, generator=gen)}[lr_kind]

    def inner_loss(w):
        return ((w * rows).pow(3) / 3 + (w * rows).square()).sum()

    handed = []
    sgd_step = InnerSGD.step
    monkeypatch.setattr(InnerSGD, "step", lambda self, p, grads, state, lrs: handed.append(grads["w"])
                        or sgd_step(self, p, grads, state, lrs))
    params = {"w": w0 * 1.0}
    folded, _ = inner_step(inner_loss(params["w"]), params, {}, optimizer=InnerSGD(), lrs={"w": lr},
                           create_graph=True, grad_clip=1.0, per_row=True)
    (g,) = torch.autograd.grad(inner_loss(w0 * 1.0), w0, create_graph=True)
    norms = g.flatten(1).norm(dim=1)
    assert norms[0] > 1 > norms[1] > 0 == norms[2]   # both branches of the clip, and zero
    clipped = clip_by_global_norm({"w": g}, 1.0, per_row=True)["w"]
    # SGD got the gradients themselves where the factor went into the lrs, the clipped ones otherwise.
    torch.testing.assert_close(handed[0], clipped if lr_kind == "per_element" else g, rtol=0, atol=0)
    written = w0 - lr * clipped
    torch.testing.assert_close(folded["w"], written, rtol=1e-14, atol=1e-14)
    probe = torch.randn(3, 4, 5, dtype=torch.float64, generator=gen)
    (first_folded,) = torch.autograd.grad((folded["w"] * probe).sum(), w0, create_graph=True)
    (first_written,) = torch.autograd.grad((written * probe).sum(), w0, create_graph=True)
    torch.testing.assert_close(first_folded, first_written, rtol=1e-13, atol=1e-13)
    (second_folded,) = torch.autograd.grad(first_folded.square().sum(), w0)
    (second_written,) = torch.autograd.grad(first_written.square().sum(), w0)
    torch.testing.assert_close(second_folded, second_written, rtol=1e-12, atol=1e-12)
    assert torch.isfinite(second_folded).all()


def test_select_parameters_and_its_error():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert list(select_parameters(model, ["1.*"])) == ["1.weight", "1.bias"]
    with pytest.raises(ValueError, match="0.weight"):
        select_parameters(model, ["mlp.*"])


def test_substituted_parameters_compute_what_functional_forward_does_and_come_back():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2))
    own = dict(model.named_parameters())
    fast = {"0.weight": torch.randn(4, 3, requires_grad=True), "2.bias": torch.randn(2, requires_grad=True)}
    x = torch.randn(5, 3)
    with substituted(model, fast):
        got = model(x)
    torch.testing.assert_close(got, functional_forward(model, fast, x), rtol=0, atol=0)
    assert all(model.get_parameter(name) is param for name, param in own.items())
    assert torch.autograd.grad(got.sum(), fast["0.weight"])[0].shape == (4, 3)
    wrong = {**fast, "1.weight": x}  # nn.Tanh has no parameters
    with pytest.raises(KeyError, match="'1.weight' is not a parameter"), substituted(model, wrong):
        pass
    assert all(model.get_parameter(name) is param for name, param in own.items())  # restored after the error


def test_shared_parameters_names_the_tied_weights():
    first, second = nn.Linear(2, 2), nn.Linear(2, 2)
    second.weight = first.weight
    model = nn.Sequential(first, second)
    assert shared_parameters(model, ["0.weight", "0.bias", "1.bias"]) == ["0.weight"]


def test_adapt_refuses_to_run_without_grad_mode():
    w = torch.zeros(2, requires_grad=True)
    loop = InnerLoop({"w": w}, InnerLoopConfig())
    with torch.no_grad(), pytest.raises(RuntimeError, match="enable_grad"):
        loop.adapt(lambda p, s: p["w"].sum(), {"w": w})


class _Regression:
    def __init__(self, model):
        self.model = model

    def inner_loss(self, params, task, step):
        (x, y), _ = task
        return (functional_forward(self.model, params, x) - y).square().mean()

    def outer_loss(self, params, task):
        _, (x, y) = task
        loss = (functional_forward(self.model, params, x) - y).square().mean()
        return loss, {"loss_copy": loss.detach()}


def test_meta_step_accumulates_the_mean_outer_gradient_over_tasks():
    model, support, query = _tiny_problem()
    tasks = [(support, query), ((support[0] + 1, support[1]), (query[0] - 1, query[1]))]
    params = select_parameters(model, ["2.*"])
    loop = InnerLoop(params, InnerLoopConfig(steps=2, lr=0.1))
    objective = _Regression(model)
    result = meta_step(objective, loop, params, tasks)
    got = [p.grad.clone() for p in params.values()]

    expected_loss = 0.0
    for task in tasks:
        adapted = loop.adapt(lambda p, s, task=task: objective.inner_loss(p, task, s), params).params
        expected_loss = expected_loss + objective.outer_loss(adapted, task)[0] / 2
    want = torch.autograd.grad(expected_loss, list(params.values()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(result.outer_loss, expected_loss.detach())
    torch.testing.assert_close(result.metrics["loss_copy"], expected_loss.detach())
    assert result.inner_losses.shape == (2,)


def test_adapt_explains_that_inference_mode_blocks_it():
    w = torch.zeros(2, requires_grad=True)
    loop = InnerLoop({"w": w}, InnerLoopConfig())
    with (
        torch.inference_mode(),
        torch.enable_grad(),
        pytest.raises(RuntimeError, match="inference_mode=False"),
    ):
        loop.adapt(lambda p, s: p["w"].sum(), {"w": w})


def test_inner_step_per_row_with_data_dependent_lrs_steps_each_row_as_on_its_own():
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3, 4, dtype=torch.float64, generator=gen, requires_grad=True)  # (B, 4): 3 problems
    targets = 5 * torch.randn(3, 4, dtype=torch.float64, generator=gen)
    lrs = torch.rand(3, 1, dtype=torch.float64, generator=gen)  # one (data-dependent) lr per row
    optimizer = InnerMomentum(0.5)

    def loss(p, rows):
        return (p - targets[rows]).square().sum()

    state = optimizer.init({"w": w})
    new, state = inner_step(
        loss(w, slice(None)), {"w": w}, state, optimizer=optimizer, lrs={"w": lrs},
        create_graph=True, grad_clip=1.0, per_row=True,
    )  # fmt: skip
    for row in range(3):
        w_row = w[row]
        alone, alone_state = inner_step(
            loss(w_row, row), {"w": w_row}, optimizer.init({"w": w_row}), optimizer=optimizer,
            lrs={"w": lrs[row, 0]}, create_graph=True, grad_clip=1.0,
        )  # fmt: skip
        torch.testing.assert_close(new["w"][row], alone["w"], rtol=1e-12, atol=0)
        torch.testing.assert_close(state["velocity"]["w"][row], alone_state["velocity"]["w"])


def test_inner_loop_step_scales_and_casts_the_learnable_lrs_in_one_place():
    w = torch.tensor([1.0, -2.0], dtype=torch.float64, requires_grad=True)
    loop = InnerLoop({"w": w}, InnerLoopConfig(lr=0.3, learnable_lr="element"))
    assert loop.lrs[0].dtype == torch.float32
    state = loop.init_state({"w": w})
    new, _ = loop.step((w.square() / 2).sum(), {"w": w}, state, create_graph=True, lr_scale=0.5)
    assert new["w"].dtype == torch.float64
    torch.testing.assert_close(new["w"], w * (1 - 0.5 * 0.3), rtol=1e-7, atol=0)
    (lr_grad,) = torch.autograd.grad(new["w"].sum(), list(loop.parameters()))
    torch.testing.assert_close(lr_grad, -0.5 * w.detach().float())  # d(w - s * lr * w)/d lr


def test_inner_step_refuses_a_non_scalar_loss():
    w = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="scalar"):
        inner_step(w * 2, {"w": w}, {}, optimizer=InnerSGD(), lrs={"w": 0.1}, create_graph=False)


def test_detach_state_detaches_tensors_inside_dicts_lists_and_tuples():
    from ttt.inner.step import detach_state

    x = torch.ones(2, requires_grad=True) * 2
    state = {"m": x, "blocks": [{"v": x}, (x, 3)], "t": 1}
    out = detach_state(state)
    assert not out["m"].requires_grad and out["t"] == 1
    assert not out["blocks"][0]["v"].requires_grad
    assert isinstance(out["blocks"][1], tuple) and not out["blocks"][1][0].requires_grad
    assert out["blocks"][1][1] == 3
