"""Local text corpora read through Hugging Face `datasets`, and fixed-length token windows cut from them.

The default corpus, "stdlib", is the Python standard library's own source files (*.py under
`sysconfig.get_paths()["stdlib"]`, third-party site-packages excluded): real text that every Python
install has, so nothing is downloaded. Its content depends on the Python version of the machine.
Other corpora: a file, a directory or a glob of .txt / .md / .py (one document per file),
.json / .jsonl (one document per record, field data.text_field) or .parquet files.
"""

from __future__ import annotations

import glob
import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import datasets
import numpy as np

from ttt.config.choice import Choice

from .tokenizer import Tokenizer


class Packing(Choice):
    """data.packing."""

    windows = "windows"
    stream = "stream"

TEXT_SUFFIXES = (".txt", ".md", ".py", ".rst")
BUILDERS_BY_SUFFIX = {
    **dict.fromkeys(TEXT_SUFFIXES, "text"),
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}


@dataclass
class TextDataConfig:
    """Which text, how it is tokenized and cut into training sequences."""

    corpus: str = "stdlib"
    """stdlib (the Python standard library source), or a file, directory or glob of text, JSON or Parquet."""
    text_field: str = "text"
    """Field holding the text in JSON and Parquet records."""
    tokenizer: str = "bytes"
    """bytes (UTF-8 bytes, vocab 256), or a local tokenizer.json (or its directory; needs `tokenizers`)."""
    seq_len: int = 512
    """Tokens per training and evaluation sequence (data.packing=windows); targets per sequence
    (data.packing=stream: slices of seq_len + 1 tokens)."""
    packing: Packing = Packing.windows
    """How documents become sequences: windows (seq_len consecutive tokens inside one document, drawn
    anywhere; documents shorter than seq_len unused) or stream (TTT-E2E's: each split's documents joined
    into one token stream with data.bos_id before each, cut into slices of seq_len + 1 tokens every
    seq_len tokens, read in a shuffled order, every slice once per pass; targets equal to BOS are masked
    out of the inner steps and the loss; held-out slices in order: `ttt.text.packing`)."""
    bos_id: int | None = None
    """The BOS token of data.packing=stream; null: the one the tokenizer puts before a text (a
    tokenizer.json's, e.g. Llama 3's 128000), or for a tokenizer without one the first id past its
    vocabulary (bytes: 256; the model's vocabulary must hold it)."""
    max_documents: int | None = None
    """Use at most this many documents (every k-th, evenly spread); null: all."""
    held_out_every: int = 10
    """Documents i with i % held_out_every == 0 are validation, == 1 are test; the rest train."""
    passkey_fraction: float = 0.0
    """This fraction of the training windows (train split only, drawn per row) are passkey sequences of
    seq_len tokens instead (`ttt.text.passkey.PasskeyMix`, eval.passkey_digits digits): it rewards
    retrieval beyond the attention window. 0: plain text windows; validation and test are always text."""
    passkey_answer_weight: float = 1.0
    """Weight of a passkey row's answer positions (the key's tokens) in its next-token loss, against 1
    for every other position; the row's loss is then the weighted mean. Above 1 it concentrates the
    passkey rows' gradient on retrieval; 1: the plain mean. Needs data.passkey_fraction > 0."""
    short_seq_len: int | None = None
    """The short-then-long context schedule: the first data.short_steps outer steps read training windows
    of this many tokens, seq_len / short_seq_len times as many per step (the same tokens per step), from
    every training document at least that long; then windows of seq_len. Validation and test always read
    seq_len. It must divide seq_len (`ttt.text.context_schedule`)."""
    short_steps: int = 0
    """Outer steps of the short phase (data.short_seq_len); 0: no short phase (short_seq_len unused)."""

    def __post_init__(self):
        if self.seq_len < 2:
            raise ValueError(f"data.seq_len must be >= 2, got {self.seq_len}")
        if self.max_documents is not None and self.max_documents < 3:
            raise ValueError(f"data.max_documents must be >= 3 or null, got {self.max_documents}")
        if self.held_out_every < 3:
            raise ValueError(f"data.held_out_every must be >= 3, got {self.held_out_every}")
        if not 0 <= self.passkey_fraction <= 1:
            raise ValueError(f"data.passkey_fraction must be in [0, 1], got {self.passkey_fraction}")
        if not 0 < self.passkey_answer_weight < math.inf:
            raise ValueError(
                f"data.passkey_answer_weight must be a finite number > 0, got {self.passkey_answer_weight}"
            )
        if self.short_steps < 0:
            raise ValueError(f"data.short_steps must be >= 0, got {self.short_steps}")
        if self.short_steps and self.short_seq_len is None:
            raise ValueError(
                f"data.short_steps={self.short_steps} needs data.short_seq_len, the length its windows have "
                "(e.g. 2048 for data.seq_len 16384); or set data.short_steps=0 for no short phase"
            )
        if self.short_steps and not (
            2 <= self.short_seq_len < self.seq_len and self.seq_len % self.short_seq_len == 0
        ):
            raise ValueError(
                f"data.short_seq_len must be >= 2, below data.seq_len ({self.seq_len}) and divide it (so "
                f"that a short step reads the same tokens as a long one), got {self.short_seq_len}"
            )
        self.packing = Packing.parse(self.packing, "data.packing")
        if self.packing == Packing.stream and (self.short_steps or self.passkey_fraction):
            raise ValueError(
                "data.packing=stream reads whole slices of one packed stream: it does not combine with "
                "data.short_steps or data.passkey_fraction (set them to 0, or use data.packing=windows)"
            )
        if self.bos_id is not None and self.bos_id < 0:
            raise ValueError(f"data.bos_id must be a token id >= 0 or null, got {self.bos_id}")
        if self.passkey_answer_weight != 1 and not self.passkey_fraction:
            raise ValueError(
                f"data.passkey_answer_weight={self.passkey_answer_weight} weights passkey rows, but "
                "data.passkey_fraction is 0 (no passkey rows): set data.passkey_fraction > 0 or leave the "
                "weight at 1"
            )


def corpus_files(corpus: str) -> list[str]:
    """The sorted files of data.corpus (see the module docstring)."""
    if corpus == "stdlib":
        root = Path(sysconfig.get_paths()["stdlib"])
        skip = {"site-packages", "dist-packages"}
        return sorted(str(p) for p in root.rglob("*.py") if not skip & set(p.parts))
    path = Path(corpus)
    if path.is_dir():
        files = sorted(str(p) for p in path.rglob("*") if p.suffix in BUILDERS_BY_SUFFIX)
    else:
        files = sorted(glob.glob(corpus, recursive=True))
    if not files:
        raise FileNotFoundError(
            f"data.corpus={corpus!r}: no files found; expected 'stdlib', or a file, directory or glob of "
            f"{', '.join(sorted(BUILDERS_BY_SUFFIX))} files"
        )
    return files


def load_documents(cfg: TextDataConfig) -> list[str]:
    """The corpus's documents as strings, in a fixed order (every k-th when data.max_documents is set)."""
    files = corpus_files(cfg.corpus)
    builders = {BUILDERS_BY_SUFFIX.get(Path(f).suffix) for f in files}
    if len(builders) != 1 or None in builders:
        raise ValueError(
            f"data.corpus={cfg.corpus!r}: files must all be text ({', '.join(TEXT_SUFFIXES)}), all JSON "
            f"(.json, .jsonl) or all Parquet; got suffixes {sorted({Path(f).suffix for f in files})}"
        )
    builder = builders.pop()
    options = {"sample_by": "document", "encoding_errors": "replace"} if builder == "text" else {}
    table = datasets.load_dataset(builder, data_files=files, split="train", **options)
    field = "text" if builder == "text" else cfg.text_field
    if field not in table.column_names:
        raise ValueError(
            f"data.text_field={field!r} is not a field of {cfg.corpus!r}; fields: {table.column_names}"
        )
    documents = [text for text in table[field] if text]
    if cfg.max_documents is not None and len(documents) > cfg.max_documents:
        documents = [documents[i] for i in np.linspace(0, len(documents) - 1, cfg.max_documents).astype(int)]
    return documents


class TokenWindows:
    """Windows of seq_len consecutive tokens, each inside one document of a split.

    sample(rng) draws a window uniformly among all windows that fit in a document (longer documents
    give more); documents shorter than seq_len are not used.
    """

    def __init__(self, documents: list[np.ndarray], seq_len: int, split: str):
        long_enough = [doc for doc in documents if len(doc) >= seq_len]
        if not long_enough:
            longest = max((len(doc) for doc in documents), default=0)
            raise ValueError(
                f"no {split} document has data.seq_len={seq_len} tokens (the longest has {longest}); "
                "lower data.seq_len or use a corpus with longer documents"
            )
        self.documents, self.seq_len = long_enough, seq_len
        starts = np.array([len(doc) - seq_len + 1 for doc in long_enough])
        self.cumulative = np.cumsum(starts)

    def sample(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """{"tokens": (seq_len,) int64} from a random document and offset."""
        index = int(rng.integers(self.cumulative[-1]))
        doc = int(np.searchsorted(self.cumulative, index, side="right"))
        offset = index - (self.cumulative[doc - 1] if doc else 0)
        return {"tokens": self.documents[doc][offset : offset + self.seq_len].astype(np.int64)}


def split_documents(cfg: TextDataConfig, tokenizer: Tokenizer) -> dict[str, list[np.ndarray]]:
    """The train, val and test documents as token arrays (documents are split by index)."""
    documents = load_documents(cfg)
    if len(documents) < 3:
        raise ValueError(f"data.corpus={cfg.corpus!r} has {len(documents)} documents; need at least 3")
    splits = {"train": [], "val": [], "test": []}
    for i, tokens in enumerate(tokenizer.encode_batch(documents)):
        split = {0: "val", 1: "test"}.get(i % cfg.held_out_every, "train")
        splits[split].append(tokens)
    return splits


def split_windows(cfg: TextDataConfig, tokenizer: Tokenizer) -> dict[str, TokenWindows]:
    """Token windows of data.seq_len tokens of the train, val and test documents."""
    return {
        split: TokenWindows(docs, cfg.seq_len, split)
        for split, docs in split_documents(cfg, tokenizer).items()
    }
