"""`NeuralMemory`: a memory MLP whose weights are written by gradient steps while a block reads.

For one chunk of hidden states u (B, C, d_model) of every sequence, with the memory weights W (each
(B, ...), one memory per sequence) as of the end of the previous chunk:

    read      q = unit(u W_Q)                      y = M_W(q) W_R                    (B, C, d_model)
    write     k = unit(u W_K), v = u W_V           loss = mean_t 1/2 ||M_W(k_t) - v_t||^2  (per sequence)
              theta, eta, alpha = sigmoid(mean_t(u_t) W_G + b_G)  (per sequence: data-dependent gates)
              S <- eta S - max_lr theta grad_W(loss)          W <- (1 - alpha) W + S

unit() scales each vector to unit L2 norm. M_W is linear (k -> k W_0) at memory.depth 1, and
k + silu(...silu(k W_0)...) W_{L-1} at depth L >= 2. The write is one `ttt.inner.inner_step` with the
`InnerGatedMomentum` optimizer: theta is its per-row learning rate, eta and alpha its per-row gates.
Options of the write (all off by default; docs/neural_memory.md has what each measured):

    memory.center_keys        k_t = unit(u_t W_K - mean_s u_s W_K)
    memory.next_token_values  pairs (k_t, v_{t+1}), t < C - 1: a key stores what came next
    memory.normalize_step     layer j's lr theta / rho_j, rho_j = ||X_j^T X_j||_F / C (X_j its inputs)
    memory.tie_init           W_K = W_Q and W_R = W_V^T at initialisation
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from ttt.inner import InnerGatedMomentum, inner_step

from .config import MemoryConfig

Weights = dict[str, torch.Tensor]
"""The memory MLP's weights by name (w0, w1, ...): each (in, out), or (B, in, out) one per sequence."""


def memory_layer_inputs(weights: Mapping[str, torch.Tensor], keys: torch.Tensor) -> list[torch.Tensor]:
    """The input of each layer of M_W for keys (B, C, dim): [keys, silu(keys @ w0), ...], one per weight
    w0..w{L-1} (each (B, C, in) of that weight)."""
    inputs = [keys]
    for j in range(len(weights) - 1):
        inputs.append(F.silu(inputs[-1] @ weights[f"w{j}"]))
    return inputs


def memory_mlp(weights: Mapping[str, torch.Tensor], keys: torch.Tensor) -> torch.Tensor:
    """M_W(keys): keys (B, C, dim) with weights w0..w{L-1}, each (B, in, out) -> (B, C, dim). One weight:
    the linear map keys @ w0; more: keys + silu(...silu(keys @ w0)...) @ w{L-1} (a residual MLP)."""
    last = memory_layer_inputs(weights, keys)[-1] @ weights[f"w{len(weights) - 1}"]
    return last if len(weights) == 1 else keys + last


def curvature_scale(inputs: torch.Tensor) -> torch.Tensor:
    """rho = ||X^T X||_F / C of one layer's inputs X (B, C, in) over a chunk, per sequence: (B,) in at
    least float32 (the Gram matrix of the smaller side: ||X^T X||_F = ||X X^T||_F)."""
    x = inputs.to(torch.promote_types(inputs.dtype, torch.float32))
    with torch.autocast(x.device.type, enabled=False):  # keep the Gram in float32 under bf16 autocast
        gram = x @ x.transpose(1, 2) if x.shape[1] <= x.shape[2] else x.transpose(1, 2) @ x
    return gram.flatten(1).norm(dim=-1).clamp_min(1e-6) / x.shape[1]


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


class NeuralMemory(nn.Module):
    """The projections (wq, wk, wv: d_model -> dim; wr: dim -> d_model), the gates (gates: d_model -> 3,
    theta, eta, alpha) and the memory's meta-learned initial weights (init.w{j}) of one block."""

    def __init__(self, d_model: int, cfg: MemoryConfig):
        super().__init__()
        self.cfg = cfg
        dim, hidden = cfg.width(d_model), cfg.hidden_width(d_model)
        self.wq, self.wk, self.wv = (nn.Linear(d_model, dim, bias=False) for _ in range(3))
        self.wr = nn.Linear(dim, d_model, bias=False)
        self.gates = nn.Linear(d_model, 3)
        sizes = [dim, dim] if cfg.depth == 1 else [dim] + [hidden] * (cfg.depth - 1) + [dim]
        self.init = nn.ParameterDict(
            {f"w{j}": nn.Parameter(torch.empty(a, b)) for j, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))}
        )
        self.optimizer = InnerGatedMomentum()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Projections N(0, 1/fan_in) (unit-scale values of normalised inputs; before any write, the read
        of a unit query is of size 1/sqrt(dim) per component); gates at lr_init, momentum_init and
        decay_init (zero weights); memory: linear at zero, an MLP at the identity map (hidden layers
        N(0, 1/in), last layer zero). memory.tie_init: W_K = W_Q and W_R = W_V^T."""
        for layer in (self.wq, self.wk, self.wv, self.wr):
            nn.init.normal_(layer.weight, std=layer.weight.shape[1] ** -0.5)
        if self.cfg.tie_init:
            with torch.no_grad():
                self.wk.weight.copy_(self.wq.weight)
                self.wr.weight.copy_(self.wv.weight.t())
        nn.init.zeros_(self.gates.weight)
        with torch.no_grad():
            self.gates.bias.copy_(
                torch.tensor(
                    [_logit(self.cfg.lr_init), _logit(self.cfg.momentum_init), _logit(self.cfg.decay_init)]
                )
            )
        names = list(self.init)
        for name in names[:-1]:
            nn.init.normal_(self.init[name], std=self.init[name].shape[0] ** -0.5)
        nn.init.zeros_(self.init[names[-1]])

    def initial_weights(self) -> dict[str, nn.Parameter]:
        """The memory's initial weights by name (w0, ...): the fast weights' meta-learned start."""
        return dict(self.init.items())

    def read(self, weights: Mapping[str, torch.Tensor], u: torch.Tensor) -> torch.Tensor:
        """The memory's answer to the queries of u (B, C, d_model): M_W(unit(u W_Q)) W_R, (B, C, d_model)."""
        return self.wr(memory_mlp(weights, F.normalize(self.wq(u), dim=-1)))

    def write_pairs(self, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values a write of u (B, C, d_model) stores, each (B, T, dim): k_t = unit(u_t W_K)
        (with memory.center_keys unit(u_t W_K - mean_s u_s W_K), the mean over the T keys of each
        sequence) and v_t = u_t W_V, T = C; with memory.next_token_values v_t = u_{t+1} W_V, T = C - 1."""
        keys, values = self.wk(u), self.wv(u)
        if self.cfg.next_token_values:
            keys, values = keys[:, :-1], values[:, 1:]
        if self.cfg.center_keys:
            keys = keys - keys.mean(1, keepdim=True)
        return F.normalize(keys, dim=-1), values

    def associative_loss(self, weights: Mapping[str, torch.Tensor], u: torch.Tensor) -> torch.Tensor:
        """Per-sequence write loss of u (B, C, d_model): mean_t 1/2 ||M_W(k_t) - v_t||^2 over the pairs of
        `write_pairs`, (B,) float32 (at least). The mean over the chunk keeps the loss's curvature at most
        1 for a linear memory (unit keys), whatever the chunk length, so a learning rate up to 1 is
        stable; memory.normalize_step divides it by an upper bound of the actual curvature."""
        keys, values = self.write_pairs(u)
        error = memory_mlp(weights, keys) - values
        return 0.5 * error.to(torch.promote_types(error.dtype, torch.float32)).square().sum(-1).mean(-1)

    def gate_values(self, u: torch.Tensor, lr_scale: float = 1.0) -> tuple[torch.Tensor, ...]:
        """Data-dependent gates of a chunk u (B, C, d_model), each (B,): learning rate theta
        (max_lr * lr_scale * sigmoid), momentum eta and decay alpha (sigmoids of linear maps of the
        chunk's mean hidden state)."""
        theta, eta, alpha = torch.sigmoid(self.gates(u.mean(1))).unbind(-1)
        return theta * (self.cfg.max_lr * lr_scale), eta, alpha

    def write(
        self,
        weights: Mapping[str, torch.Tensor],
        state: dict,
        u: torch.Tensor,
        *,
        lr_scale: float,
        create_graph: bool,
        retain_graph: bool,
    ) -> tuple[Weights, dict]:
        """One gradient step of the memory on the chunk u (B, C, d_model), each sequence its own
        (weights (B, ...), state from `init_state`). memory.write_grad=total: the gradient of the
        associative loss along every path to `weights` (also through a read of them earlier in the chunk
        that u depends on); partial: keys and values taken as given (`weights` enter the loss through
        fresh views, so only that use is differentiated). create_graph: keep the gradient differentiable
        (second order); retain_graph: keep the chunk's graph (the outer loss needs it). Returns (new
        weights, new state)."""
        if self.cfg.write_grad == "partial":
            at = {name: w.view_as(w) for name, w in weights.items()}
        else:
            at = dict(weights)
        theta, eta, alpha = self.gate_values(u, lr_scale)

        def rows(gate: torch.Tensor | list[torch.Tensor]) -> dict[str, torch.Tensor]:
            gates = gate if isinstance(gate, list) else [gate] * len(at)
            return {
                name: g.view(-1, *(1,) * (w.dim() - 1)).to(w.dtype) for g, (name, w) in zip(gates, at.items())
            }

        if self.cfg.normalize_step:
            inputs = memory_layer_inputs(at, self.write_pairs(u)[0])
            theta = [theta / curvature_scale(x) for x in inputs]
        state = self.optimizer.with_gates(state, momentum=rows(eta), decay=rows(alpha))
        return inner_step(
            self.associative_loss(at, u).sum(),  # rows are independent: each row's grad is its own loss's
            at,
            state,
            optimizer=self.optimizer,
            lrs=rows(theta),
            create_graph=create_graph,
            grad_clip=self.cfg.grad_clip,
            per_row=True,
            retain_graph=retain_graph,
        )

    def init_state(self, weights: Mapping[str, torch.Tensor]) -> dict:
        """The write optimizer's state before the first chunk (zero surprise), for weights (B, ...)."""
        return self.optimizer.init(weights)
