"""`GradMemoryConfig`: every key of `python -m ttt.experiments.grad_memory key=value ...`, validated.

The defaults are the GPU experiment (2 layers, d_model 512, 8 heads of 64, full causal, bf16, MLPs
adapted); `preset=cpu` (chosen by `preset=auto` without CUDA) shrinks the model and the grid to a
seconds-long run. Overrides apply on top of the preset. Unknown keys are errors that list the keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ttt.models import ATTENTION_BACKENDS

from .workloads import WORKLOADS

ORDERS = ("first", "second")
SWEEPS = ("n_sweep", "checkpointed", "first_order", "k_sweep")
"""The grids, in the order they run (the most important first, in case the budget runs out)."""
DTYPES = ("auto", "bf16", "fp16", "fp32")


@dataclass
class Sweep:
    """A grid: every backend x order x checkpoint x n x k."""

    ns: list[int] = field(default_factory=list)
    """Sequence lengths (tokens)."""
    ks: list[int] = field(default_factory=lambda: [1])
    """Inner steps."""
    orders: list[str] = field(default_factory=lambda: ["second"])
    """first and/or second (order of the meta-gradient)."""
    checkpoint: list[bool] = field(default_factory=lambda: [False])
    """Inner-step checkpointing off and/or on."""


@dataclass
class GradMemoryConfig:
    """The experiment: model, inner loop, the four grids, limits and where the results go."""

    preset: str = "auto"
    """gpu (the defaults below), cpu (a tiny run), or auto: gpu when CUDA is available, else cpu."""
    out: str = "grad_memory_out"
    """Output directory: results.csv, results.json, table.md, environment.json and the plots."""
    device: str = "auto"
    """cuda, cpu, or auto (cuda when available)."""
    dtype: str = "auto"
    """Parameter dtype: bf16, fp16, fp32, or auto (bf16 on CUDA, fp32 on the CPU)."""
    workload: str = "maml"
    """maml (the maml_longctx transformer, k inner steps on a whole sequence) or ttt_e2e (TTT-E2E:
    fast-weight MLPs in the last suffix_len blocks, k inner steps per chunk of chunk_len tokens)."""
    window: int | None = None
    """Sliding attention window; null: full causal attention (what the memory model assumes)."""
    chunk_len: int = 1024
    """ttt_e2e: tokens per chunk."""
    suffix_len: int = 1
    """ttt_e2e: blocks read chunk by chunk, with fast weights."""
    d_model: int = 512
    """Width of the residual stream."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 8
    """Attention heads."""
    head_dim: int = 64
    """Width of one head."""
    vocab_size: int = 256
    """Vocabulary (the tokens are random)."""
    adapted: list[str] | None = None
    """Glob patterns of the parameters the inner loop adapts; null: every MLP (maml; what the memory
    model assumes) or the suffix blocks' extra MLPs (ttt_e2e)."""
    inner_lr: float = 0.01
    """Inner SGD learning rate."""
    backends: list[str] = field(default_factory=lambda: list(ATTENTION_BACKENDS))
    """Attention backends to measure."""
    n_sweep: Sweep = field(
        default_factory=lambda: Sweep(ns=[1024, 4096, 16384, 32768, 65536, 131072, 262144, 524288], ks=[1, 2])
    )
    """Memory and time against N."""
    k_sweep: Sweep = field(
        default_factory=lambda: Sweep(ns=[16384, 131072], ks=[1, 2, 4, 8], checkpoint=[False, True])
    )
    """Memory and time against k."""
    first_order: Sweep = field(default_factory=lambda: Sweep(ns=[16384, 262144], ks=[2], orders=["first"]))
    """First-order MAML at a few N."""
    checkpointed: Sweep = field(
        default_factory=lambda: Sweep(ns=[16384, 65536, 262144, 524288], ks=[2], checkpoint=[True])
    )
    """Checkpointed inner steps at a few N (beyond where the stored graphs fit)."""
    point_time_limit_s: float | None = 120.0
    """Give up on a point after this many seconds (null: no limit); larger N are then skipped."""
    max_minutes: float = 5.0
    """Budget of the whole sweep: points that would start later are skipped."""
    seed: int = 0
    """Seed of the weights and tokens."""
    cpu_threads: int | None = None
    """torch's CPU threads for the run (null: torch's default); the cpu preset uses 1, which on a shared
    machine is many times faster than threads that wait for each other."""

    def __post_init__(self):
        if self.preset not in ("auto", "cpu", "gpu"):
            raise ValueError(f"preset must be auto, cpu or gpu, got {self.preset!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {self.workload!r}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, got {self.device!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        for backend in self.backends:
            if backend not in ATTENTION_BACKENDS:
                raise ValueError(f"backends: each must be one of {ATTENTION_BACKENDS}, got {backend!r}")
        for name in SWEEPS:
            sweep = getattr(self, name)
            if any(n < 2 for n in sweep.ns) or any(k < 1 for k in sweep.ks):
                raise ValueError(f"{name}: ns must be >= 2 and ks >= 1, got {sweep.ns} and {sweep.ks}")
            if any(order not in ORDERS for order in sweep.orders):
                raise ValueError(f"{name}.orders: each must be one of {ORDERS}, got {sweep.orders}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1 or null, got {self.cpu_threads}")
        if self.max_minutes <= 0 or (self.point_time_limit_s is not None and self.point_time_limit_s <= 0):
            raise ValueError("max_minutes and point_time_limit_s must be positive")


PRESETS = {
    "gpu": {},
    "cpu": {
        "d_model": 32,
        "n_heads": 2,
        "head_dim": 16,
        "n_sweep": {"ns": [32, 64, 128], "ks": [1, 2]},
        "k_sweep": {"ns": [64], "ks": [1, 2, 4], "checkpoint": [False, True]},
        "first_order": {"ns": [64, 128], "ks": [2], "orders": ["first"]},
        "checkpointed": {"ns": [64, 128], "ks": [2], "checkpoint": [True]},
        "point_time_limit_s": 60.0,
        "max_minutes": 3.0,
        "cpu_threads": 1,
    },
}


def load(overrides: list[str], *, cuda_available: bool) -> GradMemoryConfig:
    """The config of `overrides` ("key=value", OmegaConf dotlist syntax) on top of the chosen preset.

    Raises ValueError naming the bad key or value (unknown keys list the valid ones).
    """
    try:
        cli = OmegaConf.from_dotlist(overrides)
    except OmegaConfBaseException as err:
        raise ValueError(f"could not parse {overrides}: {err}") from err
    schema = OmegaConf.structured(GradMemoryConfig)
    unknown = [str(key) for key in cli if key not in schema]
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; valid keys: {', '.join(str(k) for k in schema)}")
    preset = cli.get("preset", "auto")
    if preset == "auto":
        preset = "gpu" if cuda_available else "cpu"
    if preset not in PRESETS:
        raise ValueError(f"preset must be auto, cpu or gpu, got {preset!r}")
    try:
        merged = OmegaConf.merge(schema, PRESETS[preset], cli, {"preset": preset})
        return OmegaConf.to_object(merged)
    except OmegaConfBaseException as err:
        raise ValueError(str(err).splitlines()[0] + f" (key {err.full_key})") from err
