"""Plain-PyTorch attention: the reference for every kernel, and the execution path on the CPU.

Two forms, same semantics as the Triton kernels (masks from `flashbob.masks`, per-batch-row key ranges
included; rows that see no key give zero output and zero gradients):

* `attention_naive`: softmax attention written with ordinary tensor ops; autograd differentiates it
  any number of times. Memory is O(N*M) per head.
* `forward_reference`, `backward_reference`, `bob_reference`: the three stages written out from the
  formulas in the design notes (forward with log-sum-exp, first backward, backward-over-backward).
  They compute in float32 (float64 for float64 inputs) and return the input dtype.
"""

from __future__ import annotations

import torch

from .masks import visible_keys


def _expand_kv(t: torch.Tensor, heads_q: int) -> torch.Tensor:
    """(B, Hkv, M, D) -> (B, Hq, M, D) by repeating each kv head for its group of query heads."""
    group = heads_q // t.shape[1]
    return t if group == 1 else t.repeat_interleave(group, dim=1)


def _reduce_kv(t: torch.Tensor, heads_kv: int) -> torch.Tensor:
    """(B, Hq, M, D) -> (B, Hkv, M, D) by summing the gradients of each group of query heads."""
    b, hq, m, d = t.shape
    return t if hq == heads_kv else t.view(b, heads_kv, hq // heads_kv, m, d).sum(2)


def _scores(q, k, *, causal, window, scale, key_range=None):
    """Masked scores s*Q K^T of shape (B, Hq, N, M), -inf where masked; also the rows that see a key,
    (N,) or (B, 1, N) with key_range, or None when every row does."""
    scores = (q @ _expand_kv(k, q.shape[1]).transpose(-1, -2)) * scale
    mask = visible_keys(q.shape[2], k.shape[2], causal=causal, window=window, device=q.device,
                        key_range=key_range)
    if mask is None:
        return scores, None
    scores = scores.masked_fill(~mask, float("-inf"))
    # Decided from the shapes and arguments, not from the mask's values (no data-dependent branch, so
    # torch.compile traces it in one graph): query i sees key i + M - N, so without key ranges only
    # M < N leaves rows without a key; a key range may be empty, or end before the causal limit.
    return scores, (mask.any(-1) if key_range is not None or k.shape[2] < q.shape[2] else None)


def attention_naive(
    q, k, v, *, causal: bool = False, window: int | None = None, scale: float,
    key_range: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(scale * q k^T + mask) v, differentiable any number of times by autograd.

    q: (B, Hq, N, D); k, v: (B, Hkv, M, D); returns (B, Hq, N, D) in q's dtype.
    key_range: (B, 2) integer [start, end) of the keys each batch row sees, or None (all).
    """
    scores, has_key = _scores(q, k, causal=causal, window=window, scale=scale, key_range=key_range)
    if has_key is not None:
        # Rows with no visible key: give them finite scores, then zero their weights, so that
        # neither the output nor any derivative of it sees a NaN.
        scores = scores.masked_fill(~has_key[..., None], 0.0)
    probs = torch.softmax(scores, dim=-1)
    if has_key is not None:
        probs = probs * has_key[..., None].to(probs.dtype)
    return probs @ _expand_kv(v, q.shape[1])


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _probs(q, k, lse, *, causal, window, scale, key_range):
    """P = exp(S - L) of shape (B, Hq, N, M), in the compute dtype; zero where masked or on empty rows."""
    ct = _compute_dtype(q)
    scores, _ = _scores(q.to(ct), k.to(ct), causal=causal, window=window, scale=scale, key_range=key_range)
    lse = lse.to(ct)
    lse = torch.where(torch.isneginf(lse), torch.full_like(lse, float("inf")), lse)
    return torch.exp(scores - lse[..., None])


def forward_reference(q, k, v, *, causal=False, window=None, scale: float, key_range=None):
    """Forward stage. Returns out (B, Hq, N, D) in q's dtype and lse (B, Hq, N) in float32
    (float64 for float64 inputs): the natural-log row log-sum-exp of the masked scores, -inf on rows
    that see no key. key_range: (B, 2) [start, end) per batch row or None, in every stage here."""
    ct = _compute_dtype(q)
    scores, _ = _scores(q.to(ct), k.to(ct), causal=causal, window=window, scale=scale, key_range=key_range)
    lse = torch.logsumexp(scores, dim=-1)
    probs = _probs(q, k, lse, causal=causal, window=window, scale=scale, key_range=key_range)
    out = probs @ _expand_kv(v.to(ct), q.shape[1])
    return out.to(q.dtype), lse


def backward_reference(q, k, v, out, lse, dout, *, causal=False, window=None, scale: float, key_range=None):
    """First backward stage. out, dout: (B, Hq, N, D); lse: (B, Hq, N).
    Returns dq (B, Hq, N, D), dk and dv (B, Hkv, M, D) in q's dtype."""
    ct = _compute_dtype(q)
    hq, hkv = q.shape[1], k.shape[1]
    qf, kf, vf, dof = (t.to(ct) for t in (q, _expand_kv(k, hq), _expand_kv(v, hq), dout))
    probs = _probs(q, k, lse, causal=causal, window=window, scale=scale, key_range=key_range)
    delta = (dof * out.to(ct)).sum(-1, keepdim=True)
    dprobs = dof @ vf.transpose(-1, -2)
    dscores = probs * (dprobs - delta)
    dq = scale * dscores @ kf
    dk = scale * dscores.transpose(-1, -2) @ qf
    dv = probs.transpose(-1, -2) @ dof
    return dq.to(q.dtype), _reduce_kv(dk, hkv).to(q.dtype), _reduce_kv(dv, hkv).to(q.dtype)


def bob_reference(
    q, k, v, out, lse, dout, u_q=None, u_k=None, u_v=None, *, causal=False, window=None, scale: float,
    key_range=None,
):
    """Backward-over-backward stage: the gradients of <u_q, dq> + <u_k, dk> + <u_v, dv> with respect
    to q, k, v and dout, where (dq, dk, dv) is the first backward. Any cotangent may be None (zero).

    q, out, dout, u_q: (B, Hq, N, D); k, v, u_k, u_v: (B, Hkv, M, D); lse: (B, Hq, N).
    Returns (grad_q, grad_k, grad_v, grad_dout) shaped like (q, k, v, dout), in q's dtype.
    """
    ct = _compute_dtype(q)
    hq, hkv = q.shape[1], k.shape[1]
    qf, kf, vf, dof = (t.to(ct) for t in (q, _expand_kv(k, hq), _expand_kv(v, hq), dout))
    zeros_q = torch.zeros_like(qf)
    zeros_kv = torch.zeros_like(kf)
    uq = zeros_q if u_q is None else u_q.to(ct)
    uk = zeros_kv if u_k is None else _expand_kv(u_k, hq).to(ct)
    uv = zeros_kv if u_v is None else _expand_kv(u_v, hq).to(ct)
    probs = _probs(q, k, lse, causal=causal, window=window, scale=scale, key_range=key_range)
    delta = (dof * out.to(ct)).sum(-1, keepdim=True)
    dprobs = dof @ vf.transpose(-1, -2)
    dscores = probs * (dprobs - delta)
    g = scale * (uq @ kf.transpose(-1, -2) + qf @ uk.transpose(-1, -2))
    c = (probs * g).sum(-1, keepdim=True)
    g_p = dof @ uv.transpose(-1, -2) + g * (dprobs - delta) - c * dprobs
    e = (probs * g_p).sum(-1, keepdim=True)
    g_s = probs * (g_p - e)
    g_dp = probs * (g - c)
    grad_q = scale * (g_s @ kf + dscores @ uk)
    grad_k = scale * (g_s.transpose(-1, -2) @ qf + dscores.transpose(-1, -2) @ uq)
    grad_v = g_dp.transpose(-1, -2) @ dof
    grad_dout = probs @ uv + g_dp @ vf
    return (
        grad_q.to(q.dtype),
        _reduce_kv(grad_k, hkv).to(q.dtype),
        _reduce_kv(grad_v, hkv).to(q.dtype),
        grad_dout.to(q.dtype),
    )
