"""`RegressionLearner`: MAML for few-shot regression (mean squared error on support and query sets)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ttt.meta import MetaLearner


class RegressionLearner(MetaLearner):
    """Tasks are dicts with x_support (K, d_in), y_support (K, d_out), x_query (Q, d_in), y_query (Q, d_out).
    Every inner step fits the whole support set; the outer loss is the query MSE."""

    def inner_loss(
        self, params: dict[str, torch.Tensor], task: dict[str, torch.Tensor], step: int
    ) -> torch.Tensor:
        return F.mse_loss(self.forward_with(params, task["x_support"]), task["y_support"])

    def outer_loss(
        self, params: dict[str, torch.Tensor], task: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return F.mse_loss(self.forward_with(params, task["x_query"]), task["y_query"]), {}
