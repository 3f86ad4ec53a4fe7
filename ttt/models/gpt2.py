"""The GPT-2 decoder, for loading GPT-2 checkpoints: LayerNorm with bias, learned absolute positions,
a GELU MLP, biases on every projection and a head tied to the embedding. Attention goes through the
same switch as `Transformer` (`ttt.models.attention.attention`).

GPT-2 lives in its own small module rather than as options of `Transformer`: it differs in the
norm, the positions, the MLP and the biases at once, and a Llama-style `Transformer` with four
switches would read worse than two plain models.

Parameter names:
    embed.weight                                  (vocab_size, d_model)
    pos_embed.weight                              (max_positions, d_model)
    layers.{i}.attn_norm.weight / .bias           (d_model,)
    layers.{i}.attn.wq / wk / wv / wo .weight     (d_model, d_model), .bias (d_model,)
    layers.{i}.mlp_norm.weight / .bias            (d_model,)
    layers.{i}.mlp.w_in.weight / .bias            (d_ff, d_model) / (d_ff,)
    layers.{i}.mlp.w_out.weight / .bias           (d_model, d_ff) / (d_model,)
    norm.weight / .bias                           (d_model,)
The output head is embed.weight (tied).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention, check_attention_backend

GELU_APPROXIMATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}
"""Hugging Face activation names of GPT-2 -> the `approximate` argument of torch's GELU."""


@dataclass
class GPT2Config:
    """Shape and options of `GPT2`."""

    vocab_size: int = 50257
    """Number of token ids."""
    d_model: int = 768
    """Width of the residual stream."""
    n_layers: int = 12
    """Number of blocks."""
    n_heads: int = 12
    """Number of attention heads (head_dim = d_model // n_heads)."""
    d_ff: int = 3072
    """Hidden width of the MLP."""
    max_positions: int = 1024
    """Rows of the learned position embedding: the longest sequence the model reads."""
    norm_eps: float = 1e-5
    """Epsilon of LayerNorm."""
    activation: str = "gelu_new"
    """MLP activation, by its Hugging Face name: gelu_new, gelu_pytorch_tanh (tanh approximation) or gelu."""
    window: int | None = None
    """Sliding attention window; None: full causal attention (as GPT-2 was trained)."""
    attention: str = "flashbob"
    """Attention backend: flashbob, eager or sdpa_math."""

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "d_ff", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be a positive int, got {getattr(self, name)}")
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"model.d_model ({self.d_model}) must be a multiple of model.n_heads ({self.n_heads})"
            )
        if self.activation not in GELU_APPROXIMATIONS:
            raise ValueError(
                f"model.activation must be one of {sorted(GELU_APPROXIMATIONS)}, got {self.activation!r}"
            )
        if self.window is not None and self.window < 1:
            raise ValueError(f"model.window must be a positive int or null, got {self.window}")
        check_attention_backend(self.attention)

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.d_model // self.n_heads


class GPT2Attention(nn.Module):
    """Causal multi-head self-attention with biased projections. (B, N, d) -> (B, N, d)."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(cfg.d_model, cfg.d_model) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        heads = [
            w(x).view(batch, seq, self.cfg.n_heads, self.cfg.head_dim).transpose(1, 2)
            for w in (self.wq, self.wk, self.wv)
        ]
        out = attention(*heads, backend=self.cfg.attention, causal=True, window=self.cfg.window)
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.cfg.d_model))


class GPT2MLP(nn.Module):
    """w_out(gelu(w_in x)). (..., d_model) -> (..., d_model)."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.approximate = GELU_APPROXIMATIONS[cfg.activation]
        self.w_in = nn.Linear(cfg.d_model, cfg.d_ff)
        self.w_out = nn.Linear(cfg.d_ff, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_out(F.gelu(self.w_in(x), approximate=self.approximate))


class GPT2Block(nn.Module):
    """Pre-LayerNorm residual block. (B, N, d) -> (B, N, d)."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = GPT2Attention(cfg)
        self.mlp_norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class GPT2(nn.Module):
    """GPT-2 language model. forward: token ids (B, N) int64, N <= max_positions -> logits (B, N, vocab)."""

    def __init__(self, cfg: GPT2Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_positions, cfg.d_model)
        self.layers = nn.ModuleList(GPT2Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, N) int64 -> logits (B, N, vocab_size)."""
        if tokens.dim() != 2 or tokens.dtype != torch.long:
            raise ValueError(
                f"tokens must be a (batch, seq) int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}"
            )
        if tokens.shape[1] > self.cfg.max_positions:
            raise ValueError(
                f"GPT-2 reads at most max_positions={self.cfg.max_positions} tokens (learned positions), "
                f"got a sequence of {tokens.shape[1]}"
            )
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos_embed(positions)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x) @ self.embed.weight.t()
