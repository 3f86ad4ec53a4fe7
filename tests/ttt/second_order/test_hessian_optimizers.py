"""Sophia-H and AdaHessian (pytorch-optimizer) built by the outer factory and fed by HessianFeed:
the estimate comes on exactly the steps the optimizer consumes one, it is the Hessian diagonal,
the steps decrease a loss, and it works under Lightning's manual optimization with outer_update."""

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from ttt.config.schema import OuterOptimConfig
from ttt.meta.outer import outer_optimizers, outer_update
from ttt.second_order import HessianFeed, hessian_optimizer, module_loss_fn

CURVATURE = torch.tensor([4.0, 1.0, 0.25, 2.0])


def quadratic(params):
    """0.5 * sum(c_i x_i^2) + sum(x): Hessian diag(c), minimum at x = -1 / c."""
    x = params["x"]
    return 0.5 * (CURVATURE * x.square()).sum() + x.sum()


def build(name, interval, lr):
    x = nn.Parameter(torch.ones(4))
    cfg = OuterOptimConfig(name=name, lr=lr, hessian_update_interval=interval, scheduler="constant")
    built = outer_optimizers([x], cfg, total_steps=100)
    return x, built["optimizer"], built["lr_scheduler"]["scheduler"]


@pytest.mark.parametrize("name", ["sophia_h", "adahessian"])
def test_feed_estimates_on_the_configured_interval_and_the_loss_decreases(name):
    x, optimizer, scheduler = build(
        name, interval=3, lr=5.0 if name == "sophia_h" else 0.1
    )  # Sophia-H moves at most lr * p (p = 0.01) per step
    feed = HessianFeed(optimizer, {"x": x})
    losses, estimated_at = [], []
    for step in range(1, 31):
        optimizer.zero_grad()
        loss = quadratic({"x": x})
        loss.backward()
        losses.append(float(loss.detach()))
        before = feed.estimates
        feed.step(quadratic)
        scheduler.step()
        if feed.estimates > before:
            estimated_at.append(step)
            torch.testing.assert_close(optimizer.state[x]["hessian"], CURVATURE)
    assert estimated_at == list(range(1, 31, 3))
    assert losses[-1] < losses[0] - 0.5 * (losses[0] - float(quadratic({"x": -1 / CURVATURE})))


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_feed_gives_adahessian_the_same_steps_as_its_own_create_graph_estimate():
    """AdaHessian's own estimate (Rademacher, from .grad after backward(create_graph=True)) is exact
    for a diagonal Hessian, as ours is: both paths must move the parameters identically."""
    trajectories = []
    for external in (False, True):
        x, optimizer, _ = build("adahessian", interval=2, lr=0.1)
        feed = HessianFeed(optimizer, {"x": x})
        for _ in range(7):
            optimizer.zero_grad()
            quadratic({"x": x}).backward(create_graph=not external)
            feed.step(quadratic) if external else optimizer.step()
        trajectories.append(x.detach().clone())
    torch.testing.assert_close(trajectories[0], trajectories[1], rtol=0, atol=0)


def test_a_due_step_without_a_hessian_says_what_to_pass():
    x, optimizer, _ = build("sophia_h", interval=5, lr=0.01)
    quadratic({"x": x}).backward()
    with pytest.raises(RuntimeError, match=r"pass step\(hessian=\.\.\.\)"):
        optimizer.step()


def test_bad_optimizer_params_and_intervals_are_named():
    x, optimizer, _ = build("sophia_h", interval=2, lr=0.01)
    with pytest.raises(ValueError, match="params must be the optimizer's parameters"):
        HessianFeed(optimizer, {"y": nn.Parameter(torch.ones(4))})
    with pytest.raises(TypeError, match="optimizer must be a Hessian optimizer"):
        HessianFeed(torch.optim.SGD([x], lr=0.1), {"x": x})
    with pytest.raises(ValueError, match="n_samples must be a positive int"):
        HessianFeed(optimizer, {"x": x}, n_samples=0)
    with pytest.raises(ValueError, match="optim.hessian_update_interval must be >= 1"):
        OuterOptimConfig(name="adahessian", hessian_update_interval=0)
    with pytest.raises(ValueError, match="name must be one of"):
        hessian_optimizer(
            "lbfgs", [x], lr=0.1, betas=(0.9, 0.99), weight_decay=0.0, hessian_update_interval=1
        )


class TinyRegression(pl.LightningModule):
    """A learner in the framework's pattern: manual optimization, outer_update clips and steps."""

    def __init__(self, cfg: OuterOptimConfig):
        super().__init__()
        self.automatic_optimization = False
        self.cfg = cfg
        self.net = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
        gen = torch.Generator().manual_seed(0)
        self.inputs = torch.randn(64, 3, generator=gen)
        self.targets = self.inputs @ torch.tensor([[1.0], [-2.0], [0.5]])
        self.losses = []

    def configure_optimizers(self):
        return outer_optimizers(list(self.parameters()), self.cfg, total_steps=20)

    def on_fit_start(self):
        self.feed = HessianFeed(self.optimizers().optimizer, dict(self.named_parameters()))

    def training_step(self, batch, batch_idx):
        optimizer, scheduler = self.optimizers(), self.lr_schedulers()
        optimizer.zero_grad()
        loss_fn, _ = module_loss_fn(self, ["*"], self.inputs, self.mse)
        loss = self.mse(self(self.inputs), self.inputs)
        self.manual_backward(loss)
        outer_update(self, optimizer, scheduler, self.cfg, **self.feed.step_kwargs(loss_fn))
        self.losses.append(float(loss.detach()))

    def mse(self, prediction, inputs):
        return (prediction - self.targets).square().mean()

    def forward(self, inputs):
        return self.net(inputs)

    def train_dataloader(self):
        return [0] * 20


@pytest.mark.parametrize("name, lr", [("sophia_h", 2.0), ("adahessian", 0.05)])
def test_under_lightning_manual_optimization(name, lr):
    cfg = OuterOptimConfig(name=name, lr=lr, hessian_update_interval=4, grad_clip=1.0, scheduler="cosine")
    module = TinyRegression(cfg)
    trainer = pl.Trainer(
        max_steps=20,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module)
    assert len(module.losses) == 20 and module.feed.estimates == 5
    assert module.losses[-1] < 0.7 * module.losses[0]
