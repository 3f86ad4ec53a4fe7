"""`MemoryBlock`: a sliding-window attention block with a neural memory, read and written per chunk.

One chunk x (B, C, d_model) with memory weights W (as of the end of the previous chunk), h = attn_norm(x):

    mac (memory as context)   a = SWA(h + read_W(h))       x' = x + a           write W on rms(a)
                              (memory.mac_write_from=input: write W on h)
    mag (memory as gate)      a = SWA(h)                   x' = x + a * sigmoid(read_W(h))   write W on h
    then x'' = x' + mlp(mlp_norm(x')), as in every block.

rms(a) = a / sqrt(mean(a^2) + eps), per token: the attention's output is small at initialisation, and
the write's values should have the scale of the normalised block input that mag writes from.
SWA carries the sliding-window key/value cache across chunks (`SuffixBlock.attend`). The memory is read
before it is written (apply, then update): no token of a chunk reaches its own chunk's read. mac adds the
memory's retrieval of each token to that token's attention input, so every query sees, for each key
position of its window, the memory's answer for that position: the published MAC prepends the retrieved
tokens to the segment instead, which a causal sliding-window kernel cannot mask without letting a query
see the retrieval of a later token of its chunk. mag is the published gated form, with the sigmoid of the
projected read as the gate.
"""

from __future__ import annotations

import torch

from ttt.models.transformer import Block, TransformerConfig

from ..suffix_block import KVCache, SuffixBlock
from .config import MemoryConfig
from .layer import NeuralMemory, Weights


def unit_rms(a: torch.Tensor) -> torch.Tensor:
    """a (..., d) scaled to root-mean-square 1 along its last dim (computed in at least float32: float64
    stays float64; a's dtype kept)."""
    wide = a.to(torch.promote_types(a.dtype, torch.float32))
    return a * torch.rsqrt(wide.square().mean(-1, keepdim=True) + 1e-6).to(a.dtype)


class MemoryBlock(SuffixBlock):
    """`SuffixBlock` without an extra MLP (parameter names of `Block`: layers.{i}.attn.wq.weight, ...) plus
    a `NeuralMemory` (layers.{i}.memory.*). Each chunk continues its cache once: under full causal
    attention the keys and values share one buffer (`SuffixBlock.shares_prefix`)."""

    def __init__(self, block: Block, cfg: TransformerConfig, memory: MemoryConfig):
        if cfg.post_norm:
            raise ValueError("model.post_norm is not supported in neural-memory blocks: set it false")
        super().__init__(block, cfg, None)
        self.variant, self.mac_write_from = memory.variant, memory.mac_write_from
        self.memory = NeuralMemory(cfg.d_model, memory).to(block.attn_norm.weight.device)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache,
        weights: Weights,
        state: dict,
        *,
        write: bool,
        lr_scale: float,
        create_graph: bool,
        retain_graph: bool,
    ) -> tuple[torch.Tensor, KVCache, Weights, dict]:
        """One chunk x (B, C, d_model), RoPE tables cos, sin (C, head_dim) of its positions, the attention
        cache and the memory weights (each (B, ...)) and write state as of the previous chunk. Returns
        (x out (B, C, d_model), the cache, and the memory weights and state after writing this chunk, or
        unchanged without write)."""
        h = self.attn_norm(x)
        read = self.memory.read(weights, h)
        if self.variant == "mac":
            attended, cache = self.attend(h + read, cos, sin, cache)
            x, source = x + attended, (h if self.mac_write_from == "input" else unit_rms(attended))
        else:
            attended, cache = self.attend(h, cos, sin, cache)
            x, source = x + attended * torch.sigmoid(read), h
        if write:
            weights, state = self.memory.write(
                weights,
                state,
                source,
                lr_scale=lr_scale,
                create_graph=create_graph,
                retain_graph=retain_graph,
            )
        return x + self.mlp(self.mlp_norm(x)), cache, weights, state
