"""Tokenizers that need no download: UTF-8 bytes (the default), or a local Hugging Face tokenizer.json;
and `TextStream`, the text of ids decoded one at a time (streaming generation)."""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

REPLACEMENT = "\ufffd"
"""What decoding puts for bytes that are not UTF-8 (and ids that are no token)."""


class Tokenizer(Protocol):
    """What the text recipes need from a tokenizer."""

    vocab_size: int
    """Token ids are in [0, vocab_size)."""
    bos_id: int | None
    """The token the tokenizer puts before a text (None: it puts none)."""

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, (n,) int32."""

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text, [(n_i,) int32], possibly in parallel."""

    def decode(self, ids: Sequence[int]) -> str:
        """The text of token ids (n,), special tokens included; bytes that are not UTF-8 (a character
        the ids end inside of, too) as U+FFFD."""


class ByteTokenizer:
    """One token per UTF-8 byte: vocab_size 256, no special tokens."""

    vocab_size = 256
    bos_id = None

    def encode(self, text: str) -> np.ndarray:
        """The UTF-8 bytes of `text`, (n,) int32."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32)

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text, [(n_i,) int32]."""
        return [self.encode(text) for text in texts]

    def decode(self, ids: Sequence[int]) -> str:
        """The bytes ids (n,) as UTF-8 text, what is not UTF-8 as U+FFFD (ids outside 0..255, such as
        a stream's BOS 256, each as one U+FFFD)."""
        stand_in = REPLACEMENT.encode()
        data = b"".join(bytes((i,)) if 0 <= i < 256 else stand_in for i in map(int, ids))
        return data.decode("utf-8", errors="replace")


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

    def encode_batch(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` of each text, [(n_i,) int32], on all cores (the `tokenizers` thread pool)."""
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.int32) for encoding in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ids (n,), special tokens kept; partial UTF-8 bytes (byte-level BPE) as U+FFFD."""
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)


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


class TextStream:
    """The text of token ids given one at a time, each piece once it is final: `push(id)` returns the text
    it completes ("" while the ids end inside a character, for up to PENDING ids), `finish()` the rest
    (an unfinished character as U+FFFD). Each push decodes only the ids since the previous piece and
    those before it that a tokenizer may join to them (e.g. a leading space), whatever the length.

        stream = TextStream(tokenizer)
        for token in tokens: print(stream.push(token), end="")
        print(stream.finish())
    """

    PENDING = 8
    """Ids held back at most while they end inside a character (a UTF-8 character is at most 4 bytes)."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        """The ids of the previous piece, then those not yet given out as text."""
        self.given = 0
        """How many of `ids` are the previous piece's."""

    def _new_text(self, final: bool) -> str:
        before = self.tokenizer.decode(self.ids[: self.given])
        text = self.tokenizer.decode(self.ids)
        unfinished = text.endswith(REPLACEMENT) and len(self.ids) - self.given < self.PENDING
        if len(text) <= len(before) or (unfinished and not final):
            return ""
        self.ids, self.given = self.ids[self.given :], len(self.ids) - self.given
        return text[len(before) :]

    def push(self, token: int) -> str:
        """The text that token completes ("" while none is final)."""
        self.ids.append(int(token))
        return self._new_text(final=False)

    def finish(self) -> str:
        """The text of the ids not given out yet; the stream is then empty."""
        rest = self._new_text(final=True)
        self.ids, self.given = [], 0
        return rest
