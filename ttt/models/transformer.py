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
    layers.{i}.attn.q_norm.weight, .k_norm.weight (head_dim,); only with qk_norm
    layers.{i}.attn.wo.weight                     (d_model, n_heads * head_dim)
    layers.{i}.attn_post_norm.weight              (d_model,); only with post_norm
    layers.{i}.mlp_norm.weight                    (d_model,)
    layers.{i}.mlp.w_gate.weight, .w_up.weight    (d_ff, d_model)
    layers.{i}.mlp.w_down.weight                  (d_model, d_ff)
    layers.{i}.mlp_post_norm.weight               (d_model,); only with post_norm
    norm.weight                                   (d_model,)
    lm_head.weight                                (vocab_size, d_model); absent when tie_embeddings
The q/k/v biases exist only with qkv_bias=True (as in Qwen2). RoPE uses the "rotate half" layout of
Llama-family checkpoints: head dims k and k + head_dim/2 form a rotated pair. An interleaved-pair
checkpoint (pairs 2k, 2k + 1, as TTT-E2E's official JAX code) maps onto it by permuting each head's
rows of wq and wk (and the QK-norm gains) by P = [0, 2, 4, ..., head_dim - 2, 1, 3, ..., head_dim - 1]:
our row j of a head is its row P[j] (`interleaved_to_rotate_half`); the scores are unchanged.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ttt.config.choice import Choice

from .attention import AttentionBackend, attention
from .fused_ops import rms_norm, rope, swiglu
from .rope import RopeScaling, rope_cos_sin


class InitScheme(Choice):
    """model.init."""

    scaled_residual = "scaled_residual"
    normal = "normal"


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
    qk_norm: bool = False
    """RMSNorm each head's query and key (learned gains q_norm, k_norm of size head_dim per layer, shared
    by the heads) before RoPE (TTT-E2E, OLMo 2, Qwen3)."""
    post_norm: bool = False
    """Also RMSNorm each sub-layer's output before the residual add: x + post_norm(f(pre_norm(x))), for
    attention and MLP (and a suffix block's extra MLP) (TTT-E2E, Gemma 2)."""
    init: InitScheme = InitScheme.scaled_residual
    """Initial weights: scaled_residual (GPT-2: N(0, init_std), the residual output projections attn.wo
    and mlp.w_down N(0, init_std / sqrt(2 n_layers))) or normal (every linear and the embedding
    N(0, init_std): TTT-E2E). Norm gains start at 1, biases at 0."""
    init_std: float = 0.02
    """Standard deviation of the initial weights (model.init)."""

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
        if not self.init_std > 0:
            raise ValueError(f"model.init_std must be > 0, got {self.init_std}")
        self.attention = AttentionBackend.parse(self.attention, "model.attention")
        self.init = InitScheme.parse(self.init, "model.init")

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
    return linear(x, layer.weight, layer.bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (B, N, in) @ weight^T + bias, for weight (out, in) and bias (out,) or None, or one per
    sequence: weight (B, out, in) and bias (B, out). Returns (B, N, out)."""
    if weight.dim() == 2:
        return F.linear(x, weight, bias)
    out = torch.bmm(x, weight.transpose(1, 2))
    return out if bias is None else out + bias[:, None]


def project_many(layers: list[nn.Linear], x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(project(layer, x) for layer in layers) as one product: the layers' weights (out_i, in), or
    (B, out_i, in) per sequence, and biases concatenated along the output dim. x (B, N, in) is read,
    and cast under autocast, once, and its gradient is one product rather than a sum of len(layers)
    products rounded to autocast's dtype. Returns views (B, N, out_i) of one (B, N, sum out_i) product;
    separate products where the layers differ in kind (some weights per sequence, some biases None)."""
    if not layers:
        raise ValueError("project_many needs at least one layer, got none")
    weights = [layer.weight for layer in layers]
    biases = [layer.bias for layer in layers]
    if len({(weight.dim(), bias is None) for weight, bias in zip(weights, biases, strict=True)}) > 1:
        return tuple(linear(x, weight, bias) for weight, bias in zip(weights, biases, strict=True))
    bias = None if biases[0] is None else torch.cat(biases, dim=-1)
    out = linear(x, torch.cat(weights, dim=-2), bias)
    return out.split([weight.shape[-2] for weight in weights], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (B, H, N, D) by the tables cos, sin (N, D) in the rotate-half layout, in float32 (float64
    for float64 x), with plain ops; keeps x's dtype. `fused_ops.rope` computes the same."""
    half = x.shape[-1] // 2
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    """Causal (optionally sliding-window) grouped-query self-attention with RoPE. (B, N, d) -> (B, N, d).
    `backend` (model.attention unless set otherwise, as `SuffixReader` does for ttt.prefix_attention) is
    the `attention` backend it runs."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg = cfg.resolved()
        self.backend = cfg.attention
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wk = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wv = nn.Linear(cfg.d_model, cfg.n_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, fused=cfg.fused_ops)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps, fused=cfg.fused_ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.project_qkv(x, cos, sin)
        out = attention(q, k, v, backend=self.backend, causal=True, window=self.cfg.window)
        return self.project_out(out)

    def project_qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x (B, N, d) -> q (B, n_heads, N, head_dim) and k, v (B, n_kv_heads, N, head_dim), with qk_norm
        each head's q and k RMSNormed, then RoPE applied to q and k with the tables cos, sin
        (N, head_dim)."""
        batch, seq, _ = x.shape
        cfg = self.cfg
        if self.q_norm is not None:  # the norms save q and k (views of the product): v's view keeps no more
            q, k, v = project_many([self.wq, self.wk, self.wv], x)
        else:  # rope does not save q and k: a view v of their product would keep it alive
            (q, k), v = project_many([self.wq, self.wk], x), project(self.wv, x)
        q = q.view(batch, seq, cfg.n_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(batch, seq, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        v = v.view(batch, seq, cfg.n_kv_heads, cfg.head_dim).transpose(1, 2)
        if self.q_norm is not None:
            # Back to the projections' dtype: under autocast the norm's float32 gain promotes its output.
            q, k = per_head(self.q_norm, q).to(v.dtype), per_head(self.k_norm, k).to(v.dtype)
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
        gate, up = project_many([self.w_gate, self.w_up], x)
        return project(self.w_down, swiglu(gate, up) if self.fused else F.silu(gate) * up)


def per_head(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """norm over each head's vector of x (B, H, N, head_dim), its gain (head_dim,) shared by the heads, or
    (B, head_dim) through functional_call (one per sequence: broadcast over heads and positions)."""
    if norm.weight.dim() == 1:
        return norm(x)
    batch, heads, seq, dim = x.shape
    normed = norm(x.transpose(1, 2).reshape(batch, seq * heads, dim))
    return normed.view(batch, seq, heads, dim).transpose(1, 2)


def residual(x: torch.Tensor, sublayer_out: torch.Tensor, post_norm: RMSNorm | None) -> torch.Tensor:
    """x + sublayer_out, the output normed first by post_norm where the block has one."""
    return x + (sublayer_out if post_norm is None else post_norm(sublayer_out))


class Block(nn.Module):
    """Pre-norm residual block: x + attn(attn_norm(x)), then + mlp(mlp_norm(x)); with cfg.post_norm each
    sub-layer's output is normed before the add (attn_post_norm, mlp_post_norm). (B, N, d) -> (B, N, d)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        cfg = cfg.resolved()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, fused=cfg.fused_ops)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, fused=cfg.fused_ops)
        self.mlp = SwiGLU(cfg.d_model, cfg.d_ff, fused=cfg.fused_ops)
        self.attn_post_norm = self.mlp_post_norm = None
        if cfg.post_norm:
            self.attn_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, fused=cfg.fused_ops)
            self.mlp_post_norm = RMSNorm(cfg.d_model, cfg.norm_eps, fused=cfg.fused_ops)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = residual(x, self.attn(self.attn_norm(x), cos, sin), self.attn_post_norm)
        return residual(x, self.mlp(self.mlp_norm(x)), self.mlp_post_norm)


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
        """model.init: norm gains 1, biases 0, every other weight N(0, init_std); with scaled_residual
        (GPT-2) the residual output projections N(0, init_std / sqrt(2 n_layers))."""
        std, scaled = self.cfg.init_std, self.cfg.init == InitScheme.scaled_residual
        for name, param in self.named_parameters():
            if name.endswith("norm.weight"):
                nn.init.ones_(param)
            elif name.endswith(".bias"):
                nn.init.zeros_(param)
            elif scaled and name.endswith(("attn.wo.weight", "mlp.w_down.weight")):
                nn.init.normal_(param, std=std / math.sqrt(2 * self.cfg.n_layers))
            else:
                nn.init.normal_(param, std=std)

    def rope_tables(self, positions: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin (positions, head_dim) of positions 0.. in float32 (float64 for a float64 model)."""
        cfg, dtype = self.cfg, torch.promote_types(self.embed.weight.dtype, torch.float32)
        return rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, device, cfg.rope_scaling, dtype=dtype)

    def hidden_states(self, tokens: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states. tokens (B, N) int64 -> (B, N, d_model)."""
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(
                f"tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}"
            )
        cos, sin = self.rope_tables(tokens.shape[1], tokens.device)
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
