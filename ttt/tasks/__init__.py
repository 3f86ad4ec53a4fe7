"""Tasks: synthetic generators (no download) and local-file corpora, with a no-download tokenizer."""

from .kv_recall import KVRecallConfig, sample_kv_recall, sample_kv_recall_at_step
from .sinusoid import SinusoidConfig, sample_sinusoid

__all__ = [
    "KVRecallConfig",
    "SinusoidConfig",
    "sample_kv_recall",
    "sample_kv_recall_at_step",
    "sample_sinusoid",
]
