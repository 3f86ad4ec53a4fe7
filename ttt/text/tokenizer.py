"""Tokenizers that need no download: UTF-8 bytes (the default), or a local Hugging Face tokenizer.json."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Protocol

import numpy as np


class Tokenizer(Protocol):
    """What the text recipes need from a tokenizer."""

    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    bos_id: int | None
    """The token the tokenizer puts before a text (None: it puts none)."""

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, (n,) int32."""


class ByteTokenizer:
    """One token per UTF-8 byte: vocab_size 256, no special tokens."""

    vocab_size = 256
    bos_id = None

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text`, (n,) int32."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)


class JsonTokenizer:
    """A Hugging Face tokenizer.json read by the `tokenizers` package (installed with transformers)."""

    def __init__(self, path: Path):
        if importlib.util.find_spec("tokenizers") is None:
            raise ImportError(
                f"data.tokenizer={str(path)!r} needs the `tokenizers` package (pip install tokenizers)"
            )
        from tokenizers import Tokenizer as HFTokenizer

        self.tokenizer = HFTokenizer.from_file(str(path))
        self.vocab_size = self.tokenizer.get_vocab_size()
        self.bos_id = _leading_special_token(self.tokenizer)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, (n,) int32, without added special tokens."""
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.int32)


def _leading_special_token(tokenizer) -> int | None:
    """The token a `tokenizers.Tokenizer`'s template puts before a text (its BOS), or None."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    framed = tokenizer.encode("a", add_special_tokens=True).ids
    before = next((i for i in range(len(framed)) if framed[i : i + len(plain)] == plain), 0)
    return framed[0] if before else None


def load_tokenizer(spec: str) -> ByteTokenizer | JsonTokenizer:
    """spec "bytes" -> ByteTokenizer; a tokenizer.json file, or a directory holding one -> JsonTokenizer."""
    if spec == "bytes":
        return ByteTokenizer()
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"data.tokenizer={spec!r}: expected 'bytes' or a tokenizer.json file (or its directory)"
        )
    return JsonTokenizer(path)
