"""A decoder-only transformer in the common modern form: RoPE, RMSNorm, SwiGLU, GQA, optional
sliding-window attention, all attention through `ttt.models.attention.attention`.

With model.fused_ops (the default) RMSNorm, SwiGLU's product and RoPE run as the fused ops of
`ttt.models.fused_ops` (exact first and second derivatives, one compiled kernel per derivative order on
CUDA); without, as the plain PyTorch ops below.

Parameter names (what glob patterns for inner-loop adaptation and checkpoint loaders refer to):
    embed.weight                                  (vocab_size, d_model)
    layers.{i}.attn_norm.weight                   (d_model,)
    layers.{i}.attn.wq.weight / .bias             (n_heads * head_dim, d_model) / (n_heads * head_dim,)
    layers.{i}.attn.wk.weight / .bias             (n_kv_heads * head_dim, d_model)
    layers.{i}.attn.wv.weight / .bias             (n_kv_heads * head_dim, d_model)
    layers.{i}.attn.wo.weight                     (d_model, n_heads * head_dim)
    layers.{i}.mlp_norm.weight                    (d_model,)
    layers.{i}.mlp.w_gate.weight, .w_up.weight    (d_ff, d_model)
    layers.{i}.mlp.w_down.weight                  (d_model, d_ff)
    norm.weight                                   (d_model,)
    lm_head.weight                                (vocab_size, d_model); absent when tie_embeddings
The q/k/v biases exist only with qkv_bias=True (as in Qwen2). RoPE uses the "rotate half" layout of
Llama-family checkpoints.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionBackend, attention
from .fused_ops import rms_norm, rope, swiglu
from .rope import RopeScaling, rope_cos_sin


@dataclass
class TransformerConfig:
    """Shape and options of `Transformer`."""

    vocab_size: int = 256
    """Number of token ids the embedding and the output head cover."""
    d_model: int = 128
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Number of query heads."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); null: n_heads."""
    head_dim: int | None = None
    """Width of one attention head; null: d_model // n_heads."""
    d_ff: int | None = None
    """Hidden width of the SwiGLU MLP; null: 8/3 * d_model rounded up to a multiple of 32."""
    window: int | None = None
    """Sliding attention window (each token sees at most this many most recent tokens); None: full causal."""
    rope_theta: float = 10000.0
    """Base of the rotary position embedding frequencies."""
    rope_scaling: RopeScaling | None = None
    """Llama 3.1-style frequency scaling of RoPE (checkpoints with rope_type "llama3"); null: none."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    tie_embeddings: bool = False
    """Use the embedding matrix as the output head."""
    qkv_bias: bool = False
    """Give the q, k and v projections a bias (Qwen2 style)."""
    attention: AttentionBackend = AttentionBackend.flashbob
    """Attention backend: flashbob (FlashBoB kernels on CUDA), eager (plain PyTorch) or sdpa_math."""
    fused_ops: bool = True
    """Run RMSNorm, SwiGLU's product and RoPE as fused twice-differentiable ops (ttt.models.fused_ops)."""

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be a positive int, got {getattr(self, name)}")
        if self.head_dim is None and self.d_model % self.n_heads != 0:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be a multiple of model.n_heads ({self.n_heads}) "
                "unless model.head_dim is set"
            )
        n_kv_heads, head_dim, d_ff = self._sizes()
        if n_kv_heads < 1 or self.n_heads % n_kv_heads != 0:
            raise ValueError(f"model.n_kv_heads must divide model.n_heads ({self.n_heads}), got {n_kv_heads}")
        if head_dim < 2 or head_dim % 2 != 0:
            raise ValueError(f"model.head_dim must be an even int >= 2 (RoPE), got {head_dim}")
        if d_ff < 1:
            raise ValueError(f"model.d_ff must be a positive int, got {d_ff}")
        if self.window is not None and self.window < 1:
            raise ValueError(f"model.window must be a positive int or null, got {self.window}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("model.rope_theta and model.norm_eps must be positive")
        self.attention = AttentionBackend.parse(self.attention, "model.attention")

    def _sizes(self) -> tuple[int, int, int]:
        """(n_kv_heads, head_dim, d_ff), each its field or, when null, its default."""
        return (
            self.n_heads if self.n_kv_heads is None else self.n_kv_heads,
            self.d_model // self.n_heads if self.head_dim is None else self.head_dim,
            32 * math.ceil(8 * self.d_model / 3 / 32) if self.d_ff is None else self.d_ff,
        )

    def resolved(self) -> TransformerConfig:
        """A copy with n_kv_heads, head_dim and d_ff filled in where null: the sizes `Transformer`
        builds (its `cfg`). The config itself keeps null, so that a null d_ff follows a new d_model."""
        n_kv_heads, head_dim, d_ff = self._sizes()
        return dataclasses.replace(self, n_kv_heads=n_kv_heads, head_dim=head_dim, d_ff=d_ff)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 (float64 for float64 x). x: (..., dim) -> same shape, in
    promote_types(weight.dtype, x.dtype). Through functional_call the weight may also be (B, dim), one
    per sequence of x (B, N, dim). fused: as `fused_ops.rms_norm` (same values); False: plain ops."""

    def __init__(self, dim: int, eps: float, *, fused: bool = True):
        super().__init__()
        self.eps, self.fused = eps, fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return rms_norm(x, self.weight, self.eps)
        xf = x.to(torch.promote_types(x.dtype, torch.float32))
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight if self.weight.dim() == 1 else self.weight[:, None]  # (B, dim): one per sequence
        return weight * normed.to(x.dtype)


def project(layer: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """layer(x) for x (B, N, in) -> (B, N, out), also when functional_call has given the layer one weight
    per sequence: weight (B, out, in) and bias (B, out) instead of (out, in) and (out,). Test-time
    training uses that to read several sequences at once, each with its own fast weights."""
    weight, bias = layer.weight, layer.bias
    if weight.dim() == 2:
        return F.linear(x, weight, bias)
    out = torch.bmm(x, weight.transpose(1, 2))
    return out if bias is None else out + bias[:, None]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, N, D) by the tables cos, sin (N, D) in the rotate-half layout, in float32 (float64
    for float64 x), with plain ops; keeps x's dtype. `fused_ops.rope` computes the same."""
    half = x.shape[-1] // 2
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal (optionally sliding-window) grouped-query self-attention with RoPE. (B, N, d) -> (B, N, d)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg = cfg.resolved()
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        out = attention(q, k, v, backend=self.cfg.attention, causal=True, window=self.cfg.window)
        return self.project_out(out)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, N, d) -> q (B, n_heads, N, head_dim) and k, v (B, n_kv_heads, N, head_dim), RoPE applied
        to q and k with the tables cos, sin (N, head_dim)."""
        batch, seq, _ = x.shape
        cfg = self.cfg
        q = project(self.wq, x).view(batch, seq, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = project(self.wk, x).view(batch, seq, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = project(self.wv, x).view(batch, seq, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        rotate = rope if cfg.fused_ops else apply_rope
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def project_out(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output (B, n_heads, N, head_dim) -> (B, N, d_model) through wo."""
        batch, heads, seq, head_dim = out.shape
        return project(self.wo, out.transpose(1, 2).reshape(batch, seq, heads * head_dim))


class SwiGLU(nn.Module):
    """w_down(silu(w_gate x) * w_up x). (..., d_model) -> (..., d_model). fused: the product silu(.) * (.)
    as `fused_ops.swiglu` (rounded once); False: plain ops (under autocast silu rounds before the product)."""

    def __init__(self, d_model: int, d_ff: int, *, fused: bool = True):
        super().__init__()
        self.fused = fused
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = project(self.w_gate, x), project(self.w_up, x)
        return project(self.w_down, swiglu(gate, up) if self.fused else F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm residual block: x + attn(attn_norm(x)), then + mlp(mlp_norm(x)). (B, N, d) -> (B, N, d)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        cfg = cfg.resolved()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, fused=cfg.fused_ops)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, fused=cfg.fused_ops)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, fused=cfg.fused_ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """Decoder-only language model. forward: token ids (B, N) int64 -> logits (B, N, vocab_size)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg = cfg.resolved()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, fused=cfg.fused_ops)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """GPT-2 style init: N(0, 0.02) weights, residual output projections scaled by 1/sqrt(2 n_layers)."""
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(".bias"):
                nn.init.zeros_(param)
            elif name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(param, std=0.02)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states. tokens (B, N) int64 -> (B, N, d_model)."""
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(
                f"tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}"
            )
        cos, sin = rope_cos_sin(
            tokens.shape[1], self.cfg.head_dim, self.cfg.rope_theta, tokens.device, self.cfg.rope_scaling
        )
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, N) int64 -> logits (B, N, vocab_size)."""
        h = self.hidden_states(tokens)
        if self.lm_head is None:
            return h @ self.embed.weight.t()
        return self.lm_head(h)


def next_token_losses(
    logits: torch.Tensor, targets: torch.Tensor, *, reduction: str = "none"
) -> torch.Tensor:
    """Cross-entropy of the first T positions of logits (B, C, V) against targets (B, T), T <= C, per
    token: (B, T), in at least float32 (float64 logits give float64 losses); reduction="mean": their
    mean, a scalar (F.cross_entropy's own reduction)."""
    scored = logits[:, : targets.shape[1]].flatten(0, 1)
    losses = F.cross_entropy(
        scored.to(torch.promote_types(scored.dtype, torch.float32)), targets.flatten(), reduction=reduction
    )
    return losses.view(targets.shape) if reduction == "none" else losses


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean of `next_token_losses` of logits (B, N, V) at positions 0..N-2 against tokens (B, N) at
    1..N-1: the language-modelling loss of a `Transformer`'s output on its own input. Returns a scalar."""
    return next_token_losses(logits, tokens[:, 1:], reduction="mean")
