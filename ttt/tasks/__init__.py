"""Tasks: synthetic generators (no download) and local-file corpora, with a no-download tokenizer."""

from .kv_recall import KVRecallConfig, sample_kv_recall
from .sinusoid import SinusoidConfig, sample_sinusoid

__all__ = ["KVRecallConfig", "SinusoidConfig", "sample_kv_recall", "sample_sinusoid"]
