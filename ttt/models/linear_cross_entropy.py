"""`linear_cross_entropy`: the output head and the next-token loss in one op whose first and second
derivatives are exact, which never holds the logits of more than one block of rows, and which runs
as few products over the vocabulary as the second-order step allows.

Per row t (hidden h_t (d,), target y_t), with the head weight W (V, d):

    z_t = W h_t                 logits (V,)
    loss_t = lse_t - z_t[y_t]   lse_t = logsumexp(z_t); p_t = softmax(z_t) = exp(z_t - lse_t)
    G_t = W^T (p_t - e_{y_t})   (d,): the gradient of loss_t in h_t

The forward computes G beside the losses (one more product, in the same pass over the logits) and
keeps it: a gradient in the hidden states, which is what an inner step of test-time training takes,
is then g_t G_t, element-wise, with no product over the vocabulary. G is an output of the op, so a
second derivative reaches it like any other output.

Backward, given g_t = dOut/dloss_t and c_t = dOut/dG_t (c is None unless a gradient of the op was
itself differentiated):

    c = None:  grad_h_t = g_t G_t (element-wise, differentiable: it uses the output G)
               grad_W = sum_t g_t (p_t - e_{y_t}) h_t^T                       (`_WeightGrad`)
    c given:   u_t = W c_t (V,), s_t = p_t . u_t, r_t = g_t (p_t - e_{y_t}) + p_t * (u_t - s_t)
               grad_h_t = W^T r_t;  grad_W = sum_t r_t h_t^T + (p_t - e_{y_t}) c_t^T   (`_JointBackward`)

(dG_t/dz_t applied to c_t is the softmax Jacobian applied to u_t; W also enters G directly, whence
the (p - e) c^T term.) s_t needs no pass over the vocabulary: s_t = p_t . W c_t = (W^T p_t) . c_t =
(G_t + W[y_t]) . c_t, from the forward's G, so the block's element-wise work that forms r is one pass
over z and u (one read each), not a reduction before it.

`_WeightGrad` is differentiable once more: given the cotangent B of grad_W, with u'_t = B h_t and
s'_t = p_t . u'_t,

    d/dg_t = s'_t - u'_t[y_t];  d/dh_t = W^T [g_t p_t * (u'_t - s'_t)] + B^T g_t (p_t - e_{y_t})
    d/dW   = sum_t g_t p_t * (u'_t - s'_t) h_t^T.

Products over the vocabulary per call (each a (rows, V, d) product): forward 2; an inner step's
gradient in h 0; a first-order backward with the weight's gradient 2; the backward of a second-order
graph (losses and G both reached) 5. A third derivative is not provided.

Under activation checkpointing, `recompute_contexts` (the pair of contexts `ttt.inner.recompute` runs a
region's forward and its recomputation in; torch.utils.checkpoint's `context_fn` has the same form) keeps
each forward's outputs (lse, losses and G: O(rows * d)) and hands them back when the checkpointed
region is recomputed, so the recomputation runs no product over the vocabulary either.

Every pass walks the rows in blocks of at most `block_bytes` of float32 logits and recomputes z from
h and W (lse, one float per row, and G, one (d,) vector per row, are what the forward keeps), so
memory is O(rows * d + block) instead of the O(rows * V) float32 logits, softmax and their gradients
that autograd keeps for F.cross_entropy (twice over in a second-order graph). The matrix products run
in the autocast dtype when autocast is on (as F.linear would), the softmax arithmetic in float32
(float64 for float64 inputs), the weight's gradient summed over the blocks in float32 (on CUDA by
the products themselves: `accumulate_product`), and on CUDA the element-wise work of a block is one
compiled kernel or two that read the block's logits once (`torch.compile`), not a chain of float32
passes.

With keep_logits the forward also keeps z itself, in the compute dtype (rows * V of it: bf16 under
autocast), and every backward reads it instead of recomputing it: one product over the vocabulary fewer
in each (first order 1, second order 4), for that memory. The values are the same: the recomputed z is
the same product of the same operands.
"""

from __future__ import annotations

import contextlib

import torch

from ttt.inner.recompute import ReplayLog, register_replay

from .compiled import CompiledOnCuda

DEFAULT_BLOCK_BYTES = 2**30
"""Float32-equivalent logits of one block of rows (1 GiB: 2,093 rows of a 128,256 vocabulary)."""


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    block_bytes: int = DEFAULT_BLOCK_BYTES,
    keep_logits: bool = False,
) -> torch.Tensor:
    """Per-token cross-entropy of the logits hidden @ weight.T against targets, without materialising
    them. hidden (..., d) float, weight (V, d), targets (...) int64 in [0, V) -> losses (...) in float32
    (float64 for float64 inputs). Equal to F.cross_entropy(hidden @ weight.T, targets, reduction="none")
    with first and second derivatives exact in hidden and weight (module docstring). keep_logits: keep
    the (rows, V) logits in the compute dtype for the backward instead of recomputing them (only where a
    backward can run: grad mode, and hidden or weight requiring grad)."""
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
    backward = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    config = _Config(compute_dtype, loss_dtype, block_rows, keep_logits and backward)
    losses, _ = _LinearCrossEntropy.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), config
    )
    return losses.view(targets.shape)


class _Config:
    """The dtypes and block size of one call (not a tensor: autograd passes it through untouched)."""

    def __init__(
        self, compute_dtype: torch.dtype, loss_dtype: torch.dtype, block_rows: int, keep_logits: bool
    ):
        self.compute_dtype, self.loss_dtype, self.block_rows = compute_dtype, loss_dtype, block_rows
        self.keep_logits = keep_logits

    def cast(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """tensor in the compute dtype (None stays None)."""
        return None if tensor is None else tensor.to(self.compute_dtype)

    def blocks(self, rows: int):
        """Row slices of at most block_rows rows covering range(rows)."""
        return (slice(start, min(start + self.block_rows, rows)) for start in range(0, rows, self.block_rows))


def _logits(kept: torch.Tensor | None, h: torch.Tensor, w: torch.Tensor, rows: slice) -> torch.Tensor:
    """z = h[rows] W^T (R, V) in the compute dtype: the kept logits' rows, else the product."""
    return h[rows] @ w.t() if kept is None else kept[rows]


def _softmax_minus_target(logits, lse, targets):
    """(p, p - onehot(targets)) (R, V) in lse's dtype, p the softmax of logits (R, V) given lse (R,)."""
    p = torch.exp(logits.to(lse.dtype) - lse[:, None])
    hit = torch.arange(logits.shape[1], device=logits.device) == targets[:, None]
    return p, p - hit.to(p.dtype)


def _forward_terms(logits, targets, loss_dtype: torch.dtype):
    """logits z (R, V) -> (lse (R,), losses (R,)) in loss_dtype, and p - onehot(targets) (R, V) in
    logits' dtype (the operand of G's product)."""
    z = logits.to(loss_dtype)
    lse = torch.logsumexp(z, dim=1)
    losses = lse - z.gather(1, targets[:, None])[:, 0]
    return lse, losses, _softmax_minus_target(logits, lse, targets)[1].to(logits.dtype)


def _logit_grad(logits, lse, targets, grad):
    """dz = grad (p - onehot(targets)) (R, V), in logits' dtype (the backward's product operand)."""
    return (_softmax_minus_target(logits, lse, targets)[1] * grad[:, None].to(lse.dtype)).to(logits.dtype)


def _joint_terms(logits, u, lse, targets, grad, s):
    """`_JointBackward`'s per-block terms from logits z (R, V), u = W c (R, V) and s = p.u (R,) in lse's
    dtype: (r = grad (p - onehot) + p (u - s), p - onehot), both (R, V) in logits' dtype. Element-wise:
    one read of z and u."""
    p, p_minus = _softmax_minus_target(logits, lse, targets)
    r = p_minus * grad[:, None].to(lse.dtype) + p * (u.to(lse.dtype) - s[:, None])
    return r.to(logits.dtype), p_minus.to(logits.dtype)


def _softmax_dot(grad_dir, weight, targets, cot_dir, dtype: torch.dtype) -> torch.Tensor:
    """s_t = p_t . (W c_t) (R,) in dtype without a product over the vocabulary: (G_t + W[y_t]) . c_t, since
    W^T p_t = W^T (p_t - e_{y_t}) + W[y_t] = G_t + W[y_t]. grad_dir G (R, d), weight W (V, d), targets y
    (R,), cot_dir c (R, d)."""
    expected = grad_dir.to(dtype) + weight[targets].to(dtype)
    return (expected * cot_dir.to(dtype)).sum(1)


def _weight_grad_second(logits, u, lse, targets, grad):
    """`_WeightGrad`'s backward terms from logits z (R, V) and u' = B h (R, V): (g p (u' - p.u'),
    g (p - onehot)), both (R, V) in logits' dtype, and d/dg = p.u' - u'[y] (R,)."""
    p, p_minus = _softmax_minus_target(logits, lse, targets)
    u = u.to(lse.dtype)
    g = grad[:, None].to(lse.dtype)
    s = (p * u).sum(1, keepdim=True)
    d_grad = s[:, 0] - u.gather(1, targets[:, None])[:, 0]
    return (p * (u - s) * g).to(logits.dtype), (p_minus * g).to(logits.dtype), d_grad


forward_terms = CompiledOnCuda(_forward_terms, "linear_cross_entropy")
logit_grad = CompiledOnCuda(_logit_grad, "linear_cross_entropy")
joint_terms = CompiledOnCuda(_joint_terms, "linear_cross_entropy")
weight_grad_second = CompiledOnCuda(_weight_grad_second, "linear_cross_entropy")


ADDMM_OUT_DTYPE = "dtype_out" in torch.ops.aten.addmm.overloads()
"""Whether this torch's addmm takes out_dtype (torch >= 2.8): half-precision operands, a float32 result."""


def accumulate_product(total: torch.Tensor, left: torch.Tensor, right: torch.Tensor) -> None:
    """total += left @ right in place, for total (V, d) in the loss dtype and left (V, R), right (R, d) in
    the compute dtype. In one product: addmm_ where the dtypes agree; on CUDA with half-precision
    operands cuBLAS accumulates into float32 total itself (addmm's out_dtype), so neither a (V, d)
    half-precision product nor a separate addition over it is made (and the product is not rounded to
    half precision before it is added). Elsewhere (or before torch 2.8) the product is formed, then
    added."""
    if left.dtype == total.dtype:
        total.addmm_(left, right)
    elif ADDMM_OUT_DTYPE and total.is_cuda and total.dtype == torch.float32:
        torch.addmm(total, left, right, out_dtype=torch.float32, out=total)
    else:
        total += left @ right


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


_FORWARDS = ReplayLog("linear_cross_entropy")
"""The (lse, losses, G, kept logits or None) of each forward run in a recomputed region, handed back to
its recomputation."""


@register_replay
def recompute_contexts() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """(record, replay) contexts for a recomputed region (`ttt.inner.recompute`; also a valid `context_fn`
    of torch.utils.checkpoint, non-reentrant): the first context records the outputs
    of every `linear_cross_entropy` forward of the region, the second (the recomputation) hands them
    back in the same order instead of recomputing them. Same values; O(rows * d) kept per call (and the
    logits with keep_logits)."""
    return _FORWARDS.contexts()


def _recorded_forward(
    hidden: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The next recorded (lse, losses, G, kept logits or None) of the replaying region, for a call on
    hidden's rows."""
    lse, losses, grad_dir, kept = _FORWARDS.region().take()
    if lse.shape[0] != hidden.shape[0] or lse.device != hidden.device:
        raise RuntimeError(
            "linear_cross_entropy: the recomputation's forward differs from the recorded one "
            f"({hidden.shape[0]} rows on {hidden.device}, recorded {lse.shape[0]} on {lse.device})"
        )
    return lse.detach(), losses.detach(), grad_dir.detach(), kept  # fresh aliases: each becomes an output


class _LinearCrossEntropy(torch.autograd.Function):
    """hidden (M, d), weight (V, d), targets (M,) -> (losses (M,), G (M, d) in the compute dtype:
    G_t = W^T (p_t - e_{y_t})); backward: module docstring (z kept with config.keep_logits)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, config):
        region = _FORWARDS.region()
        if region is not None and region.replaying:
            lse, losses, grad_dir, kept = _recorded_forward(hidden)
        else:
            lse, losses, grad_dir, kept = _forward(hidden, weight, targets, config)
            if region is not None:  # aliases: the outputs themselves would keep this node's graph alive
                region.record((lse, losses.detach(), grad_dir.detach(), kept))
        ctx.save_for_backward(hidden, weight, targets, lse, grad_dir, kept)
        ctx.set_materialize_grads(False)
        ctx.config, ctx.weight_node = config, _gradient_node(weight)
        return losses, grad_dir

    @staticmethod
    def backward(ctx, grad_losses, grad_dir_cot):
        hidden, weight, targets, lse, grad_dir, kept = ctx.saved_tensors
        want_hidden = ctx.needs_input_grad[0]
        want_weight = ctx.needs_input_grad[1] and _will_run(ctx.weight_node)
        if grad_dir_cot is not None:
            if grad_losses is None:
                grad_losses = torch.zeros_like(lse)
            want = (want_hidden, want_weight)
            grad_hidden, grad_weight = _JointBackward.apply(
                hidden, weight, targets, lse, grad_dir, grad_losses, grad_dir_cot, kept, ctx.config, want
            )
            return grad_hidden, grad_weight, None, None
        if grad_losses is None:
            return None, None, None, None
        grad_hidden = grad_losses[:, None] * grad_dir if want_hidden else None
        grad_weight = (
            _WeightGrad.apply(hidden, weight, targets, lse, grad_losses, kept, ctx.config)
            if want_weight
            else None
        )
        return grad_hidden, grad_weight, None, None


def _forward(
    hidden, weight, targets, config
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(lse (M,), losses (M,), G (M, d), the logits (M, V) with config.keep_logits else None) of
    hidden (M, d), weight (V, d), targets (M,), block by block."""
    losses = hidden.new_empty(hidden.shape[0], dtype=config.loss_dtype)
    lse = torch.empty_like(losses)
    grad_dir = hidden.new_empty(hidden.shape, dtype=config.compute_dtype)
    kept = (
        hidden.new_empty(hidden.shape[0], weight.shape[0], dtype=config.compute_dtype)
        if config.keep_logits
        else None
    )
    with torch.autocast(hidden.device.type, enabled=False):
        h, w = config.cast(hidden), config.cast(weight)
        w_t = w.t()
        for rows in config.blocks(hidden.shape[0]):
            logits = h[rows] @ w_t if kept is None else torch.mm(h[rows], w_t, out=kept[rows])
            lse[rows], losses[rows], p_minus = forward_terms(logits, targets[rows], config.loss_dtype)
            grad_dir[rows] = p_minus @ w
    return lse, losses, grad_dir, kept


class _WeightGrad(torch.autograd.Function):
    """(hidden (M, d), weight (V, d), targets, lse (M,), grad_losses (M,), kept logits (M, V) or None) ->
    grad_W (V, d), in weight's dtype: sum_t g_t (p_t - e_{y_t}) h_t^T; differentiable once more (module
    docstring)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, lse, grad_losses, kept, config):
        grad_weight = torch.zeros_like(weight, dtype=config.loss_dtype)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w = config.cast(hidden), config.cast(weight)
            for rows in config.blocks(hidden.shape[0]):
                dz = logit_grad(_logits(kept, h, w, rows), lse[rows], targets[rows], grad_losses[rows])
                accumulate_product(grad_weight, dz.t(), h[rows])
        ctx.save_for_backward(hidden, weight, targets, lse, grad_losses, kept)
        ctx.config = config
        return grad_weight.to(weight.dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, cot_weight):
        hidden, weight, targets, lse, grad_losses, kept = ctx.saved_tensors
        config = ctx.config
        need_hidden, need_weight, _, _, need_grad = ctx.needs_input_grad[:5]
        d_hidden = torch.zeros_like(hidden) if need_hidden else None
        d_weight = torch.zeros_like(weight, dtype=config.loss_dtype) if need_weight else None
        d_grad = torch.zeros_like(grad_losses) if need_grad else None
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, b = config.cast(hidden), config.cast(weight), config.cast(cot_weight)
            for rows in config.blocks(hidden.shape[0]):
                r, dz, dg = weight_grad_second(
                    _logits(kept, h, w, rows), h[rows] @ b.t(), lse[rows], targets[rows], grad_losses[rows]
                )
                if need_grad:
                    d_grad[rows] = dg
                if need_hidden:
                    d_hidden[rows] = (r @ w).to(d_hidden.dtype) + dz @ b
                if need_weight:
                    accumulate_product(d_weight, r.t(), h[rows])
        d_weight = None if d_weight is None else d_weight.to(weight.dtype)
        return d_hidden, d_weight, None, None, d_grad, None, None


class _JointBackward(torch.autograd.Function):
    """The backward of a second-order graph, where both outputs of `_LinearCrossEntropy` were reached:
    (hidden (M, d), weight (V, d), targets, lse (M,), the forward's G (M, d), grad_losses g (M,), cot_dir
    c (M, d), kept logits (M, V) or None) ->
    (grad_h (M, d) or None, grad_W (V, d) or None) as `want` asks (module docstring). Not
    differentiable: a third derivative is not provided."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, lse, grad_dir, grad_losses, cot_dir, kept, config, want):
        want_hidden, want_weight = want
        grad_hidden = torch.empty_like(hidden) if want_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=config.loss_dtype) if want_weight else None
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, c = config.cast(hidden), config.cast(weight), config.cast(cot_dir)
            for rows in config.blocks(hidden.shape[0]):
                s = _softmax_dot(grad_dir[rows], w, targets[rows], c[rows], lse.dtype)
                r, p_minus = joint_terms(
                    _logits(kept, h, w, rows), c[rows] @ w.t(), lse[rows], targets[rows], grad_losses[rows], s
                )
                if want_hidden:
                    grad_hidden[rows] = r @ w
                if want_weight:
                    accumulate_product(grad_weight, r.t(), h[rows])
                    accumulate_product(grad_weight, p_minus.t(), c[rows])
        return grad_hidden, (None if grad_weight is None else grad_weight.to(weight.dtype))

    @staticmethod
    def backward(ctx, *cotangents):
        raise RuntimeError("linear_cross_entropy: a third derivative is not provided")
