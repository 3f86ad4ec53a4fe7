"""Gradient-based memory layers (Titans-style neural memory) on the one inner-loop engine.

    model = NeuralMemoryTransformer(Transformer(cfg), TTTConfig(suffix_len=1, extra_mlp=False),
                                    MemoryConfig(variant="mac", depth=2))
    model.token_losses(tokens).mean().backward()   # differentiates through every memory write

Each memory block reads its memory (an MLP, per sequence), attends over a sliding window, then writes the
memory by one `ttt.inner.inner_step` with data-dependent learning-rate, momentum and decay gates
(`ttt.inner.InnerGatedMomentum`). `TTTLanguageLearner` trains and evaluates it like `TTTTransformer`.
"""

from .block import MemoryBlock
from .config import MemoryConfig
from .layer import NeuralMemory, memory_mlp
from .model import NeuralMemoryTransformer

__all__ = ["MemoryBlock", "MemoryConfig", "NeuralMemory", "NeuralMemoryTransformer", "memory_mlp"]
