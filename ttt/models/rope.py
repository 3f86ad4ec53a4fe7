"""Rotary position embedding tables, plain or with the frequency scaling of context-extended checkpoints.

    cos, sin = rope_cos_sin(seq_len, head_dim, theta, device, scaling)   # each (seq_len, head_dim)

Scalings (config.json rope_scaling / rope_parameters, `RopeScaling.rope_type`):
    llama3  Llama 3.1's: low frequencies divided by `factor`, high ones kept, a smooth blend between.
    yarn    YaRN (Peng et al., 2023): the same split made over the rotary pairs by how often they turn
            within the original context (beta_fast / beta_slow turns bound the blend), and cos and sin
            multiplied by an attention factor (0.1 ln(factor) + 1 unless given).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ttt.config.choice import Choice


class RopeType(Choice):
    """model.rope_scaling.rope_type: which frequency scaling."""

    llama3 = "llama3"
    yarn = "yarn"


@dataclass
class RopeScaling:
    """RoPE frequency scaling of a checkpoint whose context was extended after pretraining."""

    rope_type: RopeType = RopeType.llama3
    """llama3 (Llama 3.1-3.2) or yarn (YaRN, e.g. Qwen2.5 beyond 32K)."""
    factor: float = 8.0
    """How much the low frequencies are divided by (the context extension)."""
    original_max_position_embeddings: int = 8192
    """The context length the model was pretrained at before its context was extended."""
    low_freq_factor: float = 1.0
    """llama3: wavelengths above original_max_position_embeddings / low_freq_factor are scaled fully."""
    high_freq_factor: float = 4.0
    """llama3: wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    beta_fast: float = 32.0
    """yarn: rotary pairs turning more often than this within the original context are kept."""
    beta_slow: float = 1.0
    """yarn: rotary pairs turning less often than this within the original context are scaled fully."""
    attention_factor: float | None = None
    """yarn: cos and sin are multiplied by this; null: 0.1 ln(factor) + 1 (1 for factor <= 1)."""

    def __post_init__(self):
        self.rope_type = RopeType.parse(self.rope_type, "model.rope_scaling.rope_type")
        if self.factor <= 0 or self.original_max_position_embeddings < 1:
            raise ValueError(
                "model.rope_scaling.factor and .original_max_position_embeddings must be positive, got "
                f"{self.factor} and {self.original_max_position_embeddings}"
            )
        if self.rope_type == RopeType.llama3 and not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                "model.rope_scaling needs 0 < low_freq_factor < high_freq_factor, got "
                f"{self.low_freq_factor} and {self.high_freq_factor}"
            )
        if self.rope_type == RopeType.yarn and not 0 < self.beta_slow < self.beta_fast:
            raise ValueError(
                "model.rope_scaling needs 0 < beta_slow < beta_fast, got "
                f"{self.beta_slow} and {self.beta_fast}"
            )
        if self.attention_factor is not None and self.attention_factor <= 0:
            raise ValueError(
                f"model.rope_scaling.attention_factor must be positive or null, got {self.attention_factor}"
            )

    def apply(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        """Scaled rotary frequencies (head_dim / 2,) of the unscaled ones of base `theta`."""
        if self.rope_type == RopeType.yarn:
            return self._yarn(inv_freq, theta)
        wavelength = 2 * math.pi / inv_freq
        context = self.original_max_position_embeddings
        smooth = (context / wavelength - self.low_freq_factor) / (
            self.high_freq_factor - self.low_freq_factor
        )
        blended = (1 - smooth) * inv_freq / self.factor + smooth * inv_freq
        scaled = torch.where(wavelength > context / self.low_freq_factor, inv_freq / self.factor, blended)
        return torch.where(wavelength < context / self.high_freq_factor, inv_freq, scaled)

    def _yarn(self, inv_freq: torch.Tensor, theta: float) -> torch.Tensor:
        head_dim = 2 * len(inv_freq)

        def pair_turning(turns: float) -> float:
            """The (fractional) rotary pair index that turns `turns` times within the original context."""
            context = self.original_max_position_embeddings
            return head_dim * math.log(context / (turns * 2 * math.pi)) / (2 * math.log(theta))

        # whole pairs, as in the reference implementation: the blend starts and ends on a pair boundary
        first = max(math.floor(pair_turning(self.beta_fast)), 0)
        last = min(math.ceil(pair_turning(self.beta_slow)), head_dim - 1)
        span = max(last - first, 1e-3)
        pairs = torch.arange(len(inv_freq), device=inv_freq.device, dtype=inv_freq.dtype)
        scaled_share = ((pairs - first) / span).clamp(0, 1)  # 0: kept (fast pairs), 1: divided by factor
        return inv_freq * (1 - scaled_share) + inv_freq / self.factor * scaled_share

    def magnitude(self) -> float:
        """The factor cos and sin are multiplied by (YaRN's attention factor; 1 for llama3)."""
        if self.rope_type != RopeType.yarn:
            return 1.0
        if self.attention_factor is not None:
            return self.attention_factor
        return 0.1 * math.log(self.factor) + 1.0 if self.factor > 1 else 1.0


def rope_cos_sin(
    seq_len: int,
    head_dim: int,
    theta: float,
    device: torch.device,
    scaling: RopeScaling | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    start: int = 0,
) -> tuple[torch.Tensor, ...]:
    """Rotary tables for positions start..seq_len-1: cos and sin, each (seq_len - start, head_dim), in
    `dtype` (float32, or float64 for a float64 model: the tables are computed in it), row i the same
    numbers as row start + i of the tables from 0 (decoding one position at a time); the frequencies (and
    for YaRN the magnitude) scaled by `scaling` where given."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=dtype) / head_dim)
    if scaling is not None:
        inv_freq = scaling.apply(inv_freq, theta)
    angles = torch.outer(torch.arange(start, seq_len, device=device, dtype=dtype), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    magnitude = 1.0 if scaling is None else scaling.magnitude()
    return angles.cos() * magnitude, angles.sin() * magnitude


def interleaved_to_rotate_half(weight: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q or k projection (heads * head_dim, d_in), or a QK-norm gain (head_dim,), trained with
    interleaved-pair RoPE (dims 2k, 2k + 1 rotate together: TTT-E2E's official code, GPT-J), reordered
    for our rotate-half RoPE (dims k, k + head_dim / 2): row j of each head is its row P[j],
    P = [0, 2, ..., head_dim - 2, 1, 3, ..., head_dim - 1]. Every score q . k is unchanged, since q and
    k move alike; v, wo and the rest need no change. (A JAX kernel is (d_in, out): transpose it first.)"""
    if head_dim < 2 or head_dim % 2 or weight.shape[0] % head_dim:
        raise ValueError(
            f"weight's first dim ({weight.shape[0]}) must be a multiple of an even head_dim, got {head_dim}"
        )
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)]).to(weight.device)
    heads = torch.arange(weight.shape[0] // head_dim, device=weight.device)
    return weight[(heads[:, None] * head_dim + order).flatten()]
