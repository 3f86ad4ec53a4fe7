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
inputs), and on CUDA the element-wise work of a block (softmax, its gradients) is one compiled
kernel or two that read the block's logits once (`torch.compile`), not a chain of float32 passes.
A third derivative is not provided (once_differentiable).
"""

from __future__ import annotations

import torch

from .compiled import CompiledOnCuda

DEFAULT_BLOCK_BYTES = 2**30
"""Float32-equivalent logits of one block of rows (1 GiB: 2,093 rows of a 128,256 vocabulary)."""


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

    def cast(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """tensor in the compute dtype (None stays None)."""
        return None if tensor is None else tensor.to(self.compute_dtype)

    def blocks(self, rows: int):
        """Row slices of at most block_rows rows covering range(rows)."""
        return (slice(start, min(start + self.block_rows, rows)) for start in range(0, rows, self.block_rows))


def _row_stats(logits: torch.Tensor, targets: torch.Tensor, loss_dtype: torch.dtype):
    """logits (R, V) -> (lse (R,), losses (R,)) in loss_dtype."""
    z = logits.to(loss_dtype)
    lse = torch.logsumexp(z, dim=1)
    return lse, lse - z.gather(1, targets[:, None])[:, 0]


def _softmax_minus_target(logits, lse, targets):
    """(p - onehot(targets)) (R, V) in lse's dtype, p the softmax of logits (R, V) given lse (R,)."""
    p = torch.exp(logits.to(lse.dtype) - lse[:, None])
    hit = torch.arange(logits.shape[1], device=logits.device) == targets[:, None]
    return p, p - hit.to(p.dtype)


def _logit_grad(logits, lse, targets, grad):
    """dz = grad (p - onehot(targets)) (R, V), in logits' dtype (the backward's product operand)."""
    return (_softmax_minus_target(logits, lse, targets)[1] * grad[:, None].to(lse.dtype)).to(logits.dtype)


def _logit_second(logits, u, u_more, lse, targets, grad):
    """The double backward's per-block terms from logits z (R, V), u = W a_t (+ u_more = B h_t) (R, V):
    (r = g p (u - p.u), dz = g (p - onehot), both in logits' dtype, d/dg = p.u - u[y] (R,))."""
    p, p_minus = _softmax_minus_target(logits, lse, targets)
    u = u.to(lse.dtype) if u_more is None else u.to(lse.dtype) + u_more.to(lse.dtype)
    g = grad[:, None].to(lse.dtype)
    s = (p * u).sum(1, keepdim=True)
    d_grad = s[:, 0] - u.gather(1, targets[:, None])[:, 0]
    return (p * (u - s) * g).to(logits.dtype), (p_minus * g).to(logits.dtype), d_grad


row_stats = CompiledOnCuda(_row_stats, "linear_cross_entropy")
logit_grad = CompiledOnCuda(_logit_grad, "linear_cross_entropy")
logit_second = CompiledOnCuda(_logit_second, "linear_cross_entropy")


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
            h, w_t = config.cast(hidden), config.cast(weight).t()
            for rows in config.blocks(hidden.shape[0]):
                lse[rows], losses[rows] = row_stats(h[rows] @ w_t, targets[rows], config.loss_dtype)
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
            h, w = config.cast(hidden), config.cast(weight)
            for rows in config.blocks(hidden.shape[0]):
                dz = logit_grad(h[rows] @ w.t(), lse[rows], targets[rows], grad_losses[rows])
                if want_hidden:
                    grad_hidden[rows] = dz @ w
                if want_weight:
                    grad_weight += dz.t() @ h[rows]
        ctx.save_for_backward(hidden, weight, targets, lse, grad_losses)
        ctx.config = config
        return grad_hidden, (None if grad_weight is None else grad_weight.to(weight.dtype))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, cot_hidden, cot_weight):
        hidden, weight, targets, lse, grad_losses = ctx.saved_tensors
        config = ctx.config
        need_hidden, need_weight, _, _, need_grad = ctx.needs_input_grad[:5]
        d_hidden = torch.zeros_like(hidden) if need_hidden else None
        d_weight = torch.zeros_like(weight, dtype=config.loss_dtype) if need_weight else None
        d_grad = torch.zeros_like(grad_losses) if need_grad else None
        if cot_hidden is None and cot_weight is None:
            return _gradients(d_hidden, d_weight, d_grad, weight.dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, a, b = (
                config.cast(hidden),
                config.cast(weight),
                config.cast(cot_hidden),
                config.cast(cot_weight),
            )
            for rows in config.blocks(hidden.shape[0]):
                terms = [a[rows] @ w.t()] if a is not None else []
                if b is not None:
                    terms.append(h[rows] @ b.t())
                r, dz, dg = logit_second(
                    h[rows] @ w.t(), terms[0], terms[1] if len(terms) > 1 else None,
                    lse[rows], targets[rows], grad_losses[rows],
                )  # fmt: skip
                if need_grad:
                    d_grad[rows] = dg
                if need_hidden:
                    d_hidden[rows] = r @ w if b is None else (r @ w).to(d_hidden.dtype) + dz @ b
                if need_weight:
                    d_weight += r.t() @ h[rows]
                    if a is not None:
                        d_weight += dz.t() @ a[rows]
        return _gradients(d_hidden, d_weight, d_grad, weight.dtype)


def _gradients(d_hidden, d_weight, d_grad, weight_dtype):
    """The double backward's return tuple, d_weight in weight_dtype."""
    d_weight = None if d_weight is None else d_weight.to(weight_dtype)
    return d_hidden, d_weight, None, None, d_grad, None, None
