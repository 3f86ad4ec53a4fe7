"""Test-time-training layers: models whose last blocks adapt while they read a long sequence, chunk by
chunk, meta-trained end to end through the adaptation.

    inner = InnerLoopConfig(params=["layers.*.ttt_mlp.*"], lr=1.0)
    model = TTTTransformer(Transformer(cfg), TTTConfig(suffix_len=1), inner)
    model.token_losses(tokens).mean().backward()   # differentiates through the inner steps

    TTTTransformer          TTT-E2E: fast-weight MLPs in the last blocks, an SGD step per chunk (e2e.py)
    NeuralMemoryTransformer Titans-style neural memory written by gated-momentum steps (neural_memory/)
    TransformersTTTReader   TTT-E2E of any transformers causal LM, its own parameters adapting
    TTTConfig, ReadOptions  where the adapting blocks sit and how the context is chunked; one read's options

The engine under all three is `ChunkedReader` (reader.py): one chunk loop with carried state and
caches, chunk and segment recomputation, detached evaluation, and the end state handed back
(`read_chunks`). `SuffixReader` runs our `Transformer`'s prefix blocks once and its suffix blocks
(`SuffixBlock`, `PrefixCache`) chunk by chunk; fast-weight readers share `fast_weights`
(`score_then_step`: score a chunk, then take the inner steps on its loss). `generation` continues a
`TTTTransformer`'s read token by token (`prefill`, `decode_step`, `generate`), exactly as the chunked
read would read the tokens it draws.
"""

from .config import TTTConfig
from .e2e import TTTTransformer
from .fast_weights import score_then_step
from .generation import DecodeState, decode_step, generate, prefill
from .neural_memory import MemoryConfig, NeuralMemoryTransformer
from .prefix_cache import PrefixCache
from .reader import Chunk, ChunkedReader, ReadOptions, check_tokens
from .suffix_block import KVCache, SuffixBlock
from .suffix_reader import SuffixReader
from .transformers_reader import TransformersTTTReader

__all__ = [
    "Chunk",
    "ChunkedReader",
    "DecodeState",
    "KVCache",
    "MemoryConfig",
    "NeuralMemoryTransformer",
    "PrefixCache",
    "ReadOptions",
    "SuffixBlock",
    "SuffixReader",
    "TTTConfig",
    "TTTTransformer",
    "TransformersTTTReader",
    "check_tokens",
    "decode_step",
    "generate",
    "prefill",
    "score_then_step",
]
