"""Chunked reading: the engine under every model that reads a long sequence chunk by chunk while its
last blocks adapt (TTT-E2E's `ttt.ttt_layers`, the Titans-style `ttt.memory`).

    ChunkedReader     prefix blocks once, then the suffix blocks chunk by chunk with a carried state
                      and key/value caches; fused head and loss, chunk and prefix checkpointing
    SuffixBlock       a `Transformer` block read chunk by chunk (sliding-window cache or `PrefixCache`)
    score_then_step   score a chunk with the fast weights, then take the inner steps on its mean loss
    TTTConfig         the `ttt` section: suffix length, chunk length, extra MLP, loss and checkpointing
"""

from .block import KVCache, SuffixBlock
from .config import TTTConfig
from .prefix_cache import PrefixCache
from .reader import ChunkedReader, check_tokens
from .steps import score_then_step

__all__ = [
    "ChunkedReader",
    "KVCache",
    "PrefixCache",
    "SuffixBlock",
    "TTTConfig",
    "check_tokens",
    "score_then_step",
]
