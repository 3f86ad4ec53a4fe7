"""`linear_cross_entropy`: the output head and the next-token loss in one op whose first and second
derivatives are exact and which never holds the logits of more than one block of rows.

Per row t (hidden h_t (d,), target y_t), with the head weight W (V, d):

    z_t = W h_t                 logits (V,)
    loss_t = lse_t - z_t[y_t]   lse_t = logsumexp(z_t); p_t = softmax(z_t) = exp(z_t - lse_t)

Backward, given g_t = dOut/dloss_t:

    dz_t = g_t (p_t - e_{y_t});  grad_h_t = W^T dz_t;  grad_W = sum_t dz_t h_t^T.

The backward is itself an op (`_LinearCrossEntropyBackward`) with inputs (h, W, g), so test-time
training can differentiate an inner gradient (create_graph=True). Its own backward, given the
cotangents a_t of grad_h_t and B of grad_W, uses u_t = W a_t + B h_t (V,) and s_t = p_t . u_t:

    d/dg_t = s_t - u_t[y_t]
    r_t    = g_t p_t * (u_t - s_t)                   (the softmax Jacobian applied to g_t u_t)
    d/dh_t = W^T r_t + B^T dz_t
    d/dW   = sum_t r_t h_t^T + dz_t a_t^T

Every pass walks the rows in blocks of at most `block_bytes` of float32 logits and recomputes z from
h and W (lse, one float per row, is the only thing kept from the forward), so memory is O(rows * d +
block) instead of the O(rows * V) float32 logits, softmax and their gradients that autograd keeps
for F.cross_entropy (twice over in a second-order graph). The matrix products run in the autocast
dtype when autocast is on (as F.linear would), the softmax arithmetic in float32 (float64 for float64
inputs). A third derivative is not provided (once_differentiable).
"""

from __future__ import annotations

import torch

DEFAULT_BLOCK_BYTES = 256 * 2**20
"""Float32 logits held at once by one block of rows (256 MiB: 512 rows of a 128K vocabulary)."""


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
) -> torch.Tensor:
    """Per-token cross-entropy of the logits hidden @ weight.T against targets, without materialising
    them. hidden (..., d) float, weight (V, d), targets (...) int64 in [0, V) -> losses (...) in float32
    (float64 for float64 inputs). Equal to F.cross_entropy(hidden @ weight.T, targets, reduction="none")
    with first and second derivatives exact in hidden and weight (module docstring)."""
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"targets must have the shape of hidden without its last dim, {tuple(hidden.shape[:-1])}, "
            f"got {tuple(targets.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be (vocab, {hidden.shape[-1]}) to match hidden's last dim, "
            f"got {tuple(weight.shape)}"
        )
    if targets.dtype != torch.long:
        raise ValueError(f"targets must be int64, got {targets.dtype}")
    if block_bytes < 1:
        raise ValueError(f"block_bytes must be a positive int, got {block_bytes}")
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    loss_dtype = torch.promote_types(compute_dtype, torch.float32)
    block_rows = max(1, block_bytes // (4 * weight.shape[0]))
    config = _Config(compute_dtype, loss_dtype, block_rows)
    flat = _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), config
    )
    return flat.view(targets.shape)


class _Config:
    """The dtypes and block size of one call (not a tensor: autograd passes it through untouched)."""

    def __init__(self, compute_dtype: torch.dtype, loss_dtype: torch.dtype, block_rows: int):
        self.compute_dtype, self.loss_dtype, self.block_rows = compute_dtype, loss_dtype, block_rows


def _blocks(rows: int, config: _Config):
    """Row slices of at most config.block_rows rows covering range(rows)."""
    return (slice(start, min(start + config.block_rows, rows)) for start in range(0, rows, config.block_rows))


def _mm(a: torch.Tensor, b: torch.Tensor, config: _Config) -> torch.Tensor:
    """a @ b in the compute dtype, returned in the loss dtype."""
    return (a.to(config.compute_dtype) @ b.to(config.compute_dtype)).to(config.loss_dtype)


def _softmax_block(hidden, weight, lse, rows, config):
    """Softmax p (R, V) of the rows' logits, from lse (R,) kept by the forward."""
    return torch.exp(_mm(hidden[rows], weight.t(), config) - lse[rows, None])


def _minus_target(p: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """p - onehot(targets), in place on p (R, V)."""
    return p.scatter_add_(1, targets[:, None], torch.full_like(p[:, :1], -1.0))


def _will_run(node) -> bool:
    """Whether the running backward will reach the autograd node `node` (a weight that no one asked a
    gradient of, e.g. the head during an inner step on fast weights, is skipped)."""
    if node is None:
        return True
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError):
        return True


def _gradient_node(tensor: torch.Tensor):
    """The autograd node that receives tensor's gradient, or None."""
    if not tensor.requires_grad:
        return None
    try:
        return torch.autograd.graph.get_gradient_edge(tensor).node
    except (AttributeError, RuntimeError):
        return None


class _LinearCrossEntropy(torch.autograd.Function):
    """hidden (M, d), weight (V, d), targets (M,) -> losses (M,); backward: `_LinearCrossEntropyBackward`."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, config):
        losses = hidden.new_empty(hidden.shape[0], dtype=config.loss_dtype)
        lse = torch.empty_like(losses)
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _blocks(hidden.shape[0], config):
                logits = _mm(hidden[rows], weight.t(), config)
                lse[rows] = torch.logsumexp(logits, dim=1)
                losses[rows] = lse[rows] - logits.gather(1, targets[rows, None])[:, 0]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.config, ctx.weight_node = config, _gradient_node(weight)
        return losses

    @staticmethod
    def backward(ctx, grad_losses):
        hidden, weight, targets, lse = ctx.saved_tensors
        want = (ctx.needs_input_grad[0], ctx.needs_input_grad[1] and _will_run(ctx.weight_node))
        grad_hidden, grad_weight = _LinearCrossEntropyBackward.apply(
            hidden, weight, targets, lse, grad_losses, ctx.config, want
        )
        return grad_hidden, grad_weight, None, None


class _LinearCrossEntropyBackward(torch.autograd.Function):
    """(hidden (M, d), weight (V, d), targets, lse (M,), grad_losses (M,)) -> (grad_hidden (M, d) or None,
    grad_weight (V, d) or None), as `want` asks; differentiable once more (module docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, lse, grad_losses, config, want):
        want_hidden, want_weight = want
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=config.loss_dtype) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _blocks(hidden.shape[0], config):
                dz = _minus_target(_softmax_block(hidden, weight, lse, rows, config), targets[rows])
                dz.mul_(grad_losses[rows, None].to(config.loss_dtype))
                if want_hidden:
                    grad_hidden[rows] = _mm(dz, weight, config)
                if want_weight:
                    grad_weight += _mm(dz.t(), hidden[rows], config)
        ctx.save_for_backward(hidden, weight, targets, lse, grad_losses)
        ctx.config = config
        return grad_hidden, (None if grad_weight is None else grad_weight.to(weight.dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, cot_hidden, cot_weight):
        hidden, weight, targets, lse, grad_losses = ctx.saved_tensors
        config = ctx.config
        need_hidden, need_weight, _, _, need_grad = ctx.needs_input_grad[:5]
        d_hidden = torch.empty_like(hidden) if need_hidden else None
        d_weight = torch.zeros_like(weight, dtype=config.loss_dtype) if need_weight else None
        d_grad = torch.empty_like(grad_losses) if need_grad else None
        if cot_hidden is None and cot_weight is None:
            return _zeros_or_none(d_hidden, d_weight, d_grad, weight.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            for rows in _blocks(hidden.shape[0], config):
                p = _softmax_block(hidden, weight, lse, rows, config)
                g = grad_losses[rows, None].to(config.loss_dtype)
                u = 0
                if cot_hidden is not None:
                    u = _mm(cot_hidden[rows], weight.t(), config)
                if cot_weight is not None:
                    u = u + _mm(hidden[rows], cot_weight.t(), config)
                s = (p * u).sum(1, keepdim=True)
                if need_grad:
                    d_grad[rows] = (s - u.gather(1, targets[rows, None]))[:, 0].to(d_grad.dtype)
                r = p * (u - s) * g
                dz = _minus_target(p, targets[rows]).mul_(g)  # p is spent: dz = g (p - e_y) in its place
                if need_hidden:
                    d_hidden[rows] = _mm(r, weight, config)
                    if cot_weight is not None:
                        d_hidden[rows] += _mm(dz, cot_weight, config).to(d_hidden.dtype)
                if need_weight:
                    d_weight += _mm(r.t(), hidden[rows], config)
                    if cot_hidden is not None:
                        d_weight += _mm(dz.t(), cot_hidden[rows], config)
        d_weight = None if d_weight is None else d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, d_grad, None, None


def _zeros_or_none(d_hidden, d_weight, d_grad, weight_dtype):
    """Zero gradients for the inputs that need one (no cotangent reached the backward's outputs)."""
    zero = [None if t is None else t.zero_() for t in (d_hidden, d_weight, d_grad)]
    if zero[1] is not None:
        zero[1] = zero[1].to(weight_dtype)
    return zero[0], zero[1], None, None, zero[2], None, None
