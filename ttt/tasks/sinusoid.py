"""The MAML sinusoid regression benchmark (Finn et al. 2017): y = A sin(x - phase), fit from K points."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass
class SinusoidConfig:
    """Distribution of sinusoid tasks."""

    amplitude_min: float = 0.1
    """Smallest amplitude A."""
    amplitude_max: float = 5.0
    """Largest amplitude A."""
    phase_max: float = math.pi
    """Phases are uniform in [0, phase_max]."""
    x_range: float = 5.0
    """Inputs are uniform in [-x_range, x_range]."""
    support_size: int = 10
    """Points the inner loop fits (K)."""
    query_size: int = 10
    """Points the adapted model is judged on."""

    def __post_init__(self):
        if not 0 < self.amplitude_min <= self.amplitude_max:
            raise ValueError("task.amplitude_min must be > 0 and <= task.amplitude_max")
        if self.phase_max < 0 or self.x_range <= 0:
            raise ValueError("task.phase_max must be >= 0 and task.x_range > 0")
        if self.support_size < 1 or self.query_size < 1:
            raise ValueError("task.support_size and task.query_size must be positive ints")


def sample_sinusoid(cfg: SinusoidConfig, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """One task: x_support, y_support (support_size, 1) and x_query, y_query (query_size, 1), float32."""
    amplitude = rng.uniform(cfg.amplitude_min, cfg.amplitude_max)
    phase = rng.uniform(0.0, cfg.phase_max)
    task = {}
    for split, size in (("support", cfg.support_size), ("query", cfg.query_size)):
        x = rng.uniform(-cfg.x_range, cfg.x_range, size=(size, 1))
        task[f"x_{split}"] = x.astype(np.float32)
        task[f"y_{split}"] = (amplitude * np.sin(x - phase)).astype(np.float32)
    return task
