"""Config sections every recipe has: outer optimizer, trainer, run directory, seed, resume.

A recipe's config subclasses `RecipeConfig` and adds its own sections (model, task, inner, ...).
Every field has a one-line docstring (shown by `python -m ttt.train --help`-style tools and kept in
the YAML comments); every section validates itself in __post_init__ and names the bad key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .choice import Choice


class OuterOptimizer(Choice):
    """optim.name."""

    adamw = "adamw"
    adam = "adam"
    sgd = "sgd"
    sophia_h = "sophia_h"
    adahessian = "adahessian"


class Scheduler(Choice):
    """optim.scheduler."""

    constant = "constant"
    cosine = "cosine"
    linear = "linear"


class Precision(Choice):
    """trainer.precision (Lightning's names)."""

    true32 = "32-true"
    plain32 = "32"
    bf16_mixed = "bf16-mixed"
    mixed16 = "16-mixed"
    bf16_true = "bf16-true"
    true16 = "16-true"
    true64 = "64-true"
    plain64 = "64"


class Accelerator(Choice):
    """trainer.accelerator (Lightning's names)."""

    auto = "auto"
    cpu = "cpu"
    gpu = "gpu"
    cuda = "cuda"
    mps = "mps"


class Strategy(Choice):
    """trainer.strategy."""

    auto = "auto"
    ddp = "ddp"
    fsdp = "fsdp"


UNSUPPORTED_STRATEGIES = {
    "deepspeed": (
        " is not supported: DeepSpeed gathers a layer's parameters only inside the wrapped module's own "
        "forward, while the inner loop calls the model through torch.func.functional_call with whole "
        "adapted parameters and differentiates through the inner gradients (create_graph=True); use "
        "trainer.strategy=fsdp (sharded parameters, gradients and optimizer state) or ddp"
    ),
    "ddp_spawn": " is not supported: it pickles the data module, whose task samplers are closures; use ddp",
}
"""Why these Lightning strategies are refused (the config error's text)."""
Strategy.__refused__ = UNSUPPORTED_STRATEGIES


@dataclass
class OuterOptimConfig:
    """The outer (meta) optimizer and its learning-rate schedule."""

    name: OuterOptimizer = OuterOptimizer.adamw
    """Optimizer: adamw, adam, sgd, or a Hessian optimizer (ttt.second_order): sophia_h, adahessian."""
    lr: float = 1e-3
    """Peak learning rate."""
    weight_decay: float = 0.0
    """Decoupled weight decay (adamw) or L2 penalty (adam, sgd)."""
    beta1: float = 0.9
    """Adam's first-moment decay (sgd: momentum)."""
    beta2: float = 0.999
    """Adam's second-moment decay."""
    grad_clip: float | None = 1.0
    """Clip the outer gradient to this global L2 norm; null: no clipping."""
    scheduler: Scheduler = Scheduler.cosine
    """Learning-rate schedule after warm-up: constant, cosine or linear (decay to min_lr_ratio * lr)."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many outer steps."""
    warmup_from_zero: bool = False
    """The first outer step takes lr 0: lr * s / warmup_steps at outer step s (from 0), optax's linear
    warm-up (TTT-E2E); false: lr * (s + 1) / warmup_steps (the first step already moves)."""
    min_lr_ratio: float = 0.1
    """Final learning rate of cosine and linear schedules, as a fraction of lr."""
    schedule_steps: int | None = None
    """Outer steps the schedule spans (warm-up and decay), a length of its own: trainer.max_steps says how
    long the run trains. Default (null): the first session's trainer.max_steps, filled in when the config
    is loaded, so the run's config.yaml keeps it. Past its end the lr stays at its final value
    (min_lr_ratio * lr; constant, or a warm-up that fills the schedule: lr), so a resume with a larger
    trainer.max_steps continues without a jump. optim.schedule_steps=N on resume re-plans the schedule
    over N steps; the run says at its start how that moves the lr at the current step."""
    hessian_update_interval: int = 10
    """sophia_h, adahessian: steps between Hessian-diagonal estimates (the first step has one)."""

    def __post_init__(self):
        self.name = OuterOptimizer.parse(self.name, "optim.name")
        self.scheduler = Scheduler.parse(self.scheduler, "optim.scheduler")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"optim.lr must be a positive finite float, got {self.lr}")
        if self.weight_decay < 0:
            raise ValueError(f"optim.weight_decay must be >= 0, got {self.weight_decay}")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ValueError(f"optim.beta1 and optim.beta2 must be in [0, 1), got {self.beta1}, {self.beta2}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"optim.grad_clip must be > 0 or null, got {self.grad_clip}")
        if self.warmup_steps < 0:
            raise ValueError(f"optim.warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"optim.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.schedule_steps is not None and self.schedule_steps < 1:
            raise ValueError(f"optim.schedule_steps must be >= 1 or null, got {self.schedule_steps}")
        if self.hessian_update_interval < 1:
            raise ValueError(
                f"optim.hessian_update_interval must be >= 1, got {self.hessian_update_interval}"
            )


@dataclass
class TrainerConfig:
    """Outer loop length, task batches, evaluation and the Lightning Trainer options."""

    max_steps: int = 300
    """Outer (meta) optimizer steps. Any number; the lr schedule has a length of its own
    (optim.schedule_steps)."""
    max_minutes: float | None = None
    """Stop training after this many minutes even before max_steps (Lightning's max_time), then test;
    the summary's outer_steps says how far it got. Like max_steps it counts the whole run: a resume
    restores the minutes trained so far. null: no time limit."""
    steps_per_epoch: int = 100
    """Outer steps between validations and checkpoints (one epoch). Any trainer.max_steps works: the last
    epoch ends at max_steps, shorter when max_steps is not a multiple of this; a run extended after such
    an epoch completes it, so epochs end at multiples of steps_per_epoch as in an uninterrupted run."""
    checkpoint_every_minutes: float | None = None
    """Also write the run's checkpoint (last.ckpt) at the first outer-step boundary after this many minutes
    since the last one, within epochs; null: only at epoch ends (and on SIGTERM, SIGUSR1 or Ctrl-C,
    always)."""
    meta_batch_size: int = 8
    """Tasks per outer step and device (N devices: N x meta_batch_size tasks per outer step)."""
    val_tasks: int = 32
    """Held-out tasks evaluated at the end of each epoch."""
    test_tasks: int = 64
    """Held-out tasks evaluated after training (the summary's figures)."""
    eval_batch_size: int = 8
    """Tasks per validation / test batch."""
    precision: Precision = Precision.true32
    """Lightning precision: 32-true, bf16-mixed, 16-mixed, bf16-true, 64-true."""
    accelerator: Accelerator = Accelerator.auto
    """Lightning accelerator: auto, cpu, gpu / cuda, mps."""
    devices: int = 1
    """Number of devices (processes) on this machine; with several, meta_batch_size is per device."""
    num_nodes: int = 1
    """Machines, each running trainer.devices processes, started by torchrun or SLURM (docs/distributed.md);
    all processes together read devices x num_nodes x meta_batch_size tasks per outer step."""
    strategy: Strategy = Strategy.auto
    """Lightning strategy: ddp (data parallel, one process per device), fsdp (data parallel with parameters,
    gradients and optimizer state sharded over the processes; docs/distributed.md) or auto (ddp when
    devices > 1)."""
    find_unused_parameters: bool = False
    """ddp only: allow trainable parameters that get no outer gradient in a step (slower)."""
    fsdp_cpu_offload: bool = False
    """fsdp only: keep the parameter shards, their gradients and the optimizer state in CPU memory (the
    optimizer steps on the CPU); each pass copies the shards to the device."""
    log_every_n_steps: int = 10
    """Write training metrics every this many outer steps."""
    progress_bar: bool = True
    """Show Lightning's progress bar (only when stdout is a terminal: logs redirected to a file get none)."""
    detect_anomaly: bool = False
    """Run under torch.autograd's anomaly detection (Lightning's detect_anomaly): the error of a NaN
    names the operation that produced it. Slow; for finding where a run diverged."""
    num_workers: int = 0
    """Data loader worker processes (synthetic tasks are cheap: 0 is usually best)."""

    def __post_init__(self):
        for name in (
            "max_steps",
            "steps_per_epoch",
            "meta_batch_size",
            "eval_batch_size",
            "devices",
            "num_nodes",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"trainer.{name} must be a positive int, got {getattr(self, name)}")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"trainer.max_minutes must be > 0 or null, got {self.max_minutes}")
        if self.checkpoint_every_minutes is not None and not self.checkpoint_every_minutes > 0:
            raise ValueError(
                f"trainer.checkpoint_every_minutes must be > 0 or null, got {self.checkpoint_every_minutes}"
            )
        for name in ("val_tasks", "test_tasks", "num_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"trainer.{name} must be >= 0, got {getattr(self, name)}")
        self.strategy = Strategy.parse(self.strategy, "trainer.strategy")
        if self.fsdp_cpu_offload and self.strategy != Strategy.fsdp:
            raise ValueError(
                f"trainer.fsdp_cpu_offload=true needs trainer.strategy=fsdp, got {self.strategy}"
            )
        self.precision = Precision.parse(self.precision, "trainer.precision")
        self.accelerator = Accelerator.parse(self.accelerator, "trainer.accelerator")
        if self.world_size > 1:
            for name in ("val_tasks", "test_tasks"):
                if getattr(self, name) % self.world_size:
                    raise ValueError(
                        f"trainer.{name} ({getattr(self, name)}) must be a multiple of trainer.devices x "
                        f"trainer.num_nodes ({self.world_size}): each process evaluates an equal share, and "
                        "the shares' means are averaged"
                    )
        if self.log_every_n_steps < 1:
            raise ValueError(f"trainer.log_every_n_steps must be >= 1, got {self.log_every_n_steps}")

    @property
    def world_size(self) -> int:
        """Processes of the run: devices x num_nodes."""
        return self.devices * self.num_nodes


@dataclass
class RunConfig:
    """Where a run writes its config, logs, checkpoints and summary."""

    root: str = "runs"
    """Parent of run directories, relative to the current directory unless absolute."""
    name: str | None = None
    """Run directory name under root; null: <recipe>-<UTC timestamp>."""
    tensorboard: bool = True
    """Also log to TensorBoard when the tensorboard package is installed (CSV logs are always written)."""


@dataclass
class RecipeConfig:
    """Fields every recipe config has; a recipe subclasses this and adds its own sections."""

    recipe: str = ""
    """Name of the recipe (the YAML file under configs/ without .yaml)."""
    builder: str = ""
    """Name of the module under recipes/ that builds the model and data for this config."""
    seed: int = 0
    """Seed of model initialisation and of the task streams (train, val and test streams differ)."""
    resume: str | None = None
    """Continue a run: its run directory or a checkpoint file."""
    print_config: bool = False
    """Print the resolved config and exit."""
    optim: OuterOptimConfig = field(default_factory=OuterOptimConfig)
    """Outer optimizer."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """Outer loop and Lightning Trainer options."""
    run: RunConfig = field(default_factory=RunConfig)
    """Run directory and logging."""

    @property
    def inner_step_keys(self) -> str | None:
        """The config keys that size the inner (test-time) steps, named when training diverges; None for
        a recipe without inner steps. A recipe whose inner step has other keys overrides this."""
        if hasattr(self, "inner"):
            return "inner.lr (and inner.grad_clip, inner.steps)"
        return None
