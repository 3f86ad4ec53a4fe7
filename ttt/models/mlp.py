"""A small ReLU multilayer perceptron: the model of the MAML sinusoid benchmark."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass
class MLPConfig:
    """Shape of `MLP`."""

    in_features: int = 1
    """Input width."""
    hidden_sizes: list[int] = field(default_factory=lambda: [40, 40])
    """Width of each hidden ReLU layer."""
    out_features: int = 1
    """Output width."""

    def __post_init__(self):
        sizes = [self.in_features, *self.hidden_sizes, self.out_features]
        if any(size < 1 for size in sizes):
            raise ValueError(f"model widths must be positive ints, got {sizes}")


class MLP(nn.Module):
    """Linear layers `layers.{i}` with ReLU between them. x (..., in_features) -> (..., out_features)."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        sizes = [cfg.in_features, *cfg.hidden_sizes, cfg.out_features]
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[:-1]:
            x = torch.relu(layer(x))
        return self.layers[-1](x)
