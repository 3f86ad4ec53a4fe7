"""Train a byte-level BPE tokenizer on a local corpus's training documents, with a BOS token that it puts
before every text: the tokenizer.json that data.tokenizer and data.packing=stream read (no download).

    python -m ttt.text.train_tokenizer --out tokenizers/stdlib_32k                  # the standard library
    python -m ttt.text.train_tokenizer --corpus DIR --vocab-size 16384 --out OUT

Only the training split's documents are read (data.held_out_every's rule), so the held-out text stays
unseen. Writes OUT/tokenizer.json; its BOS is <|begin_of_text|> (id 0). Needs `tokenizers`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .corpus import TextDataConfig, load_documents

BOS = "<|begin_of_text|>"


def training_documents(cfg: TextDataConfig) -> list[str]:
    """The documents of the training split of cfg's corpus (`split_documents`' rule: i % held_out_every
    not 0 or 1)."""
    return [doc for i, doc in enumerate(load_documents(cfg)) if i % cfg.held_out_every > 1]


def train_tokenizer(documents: list[str], vocab_size: int):
    """A byte-level BPE `tokenizers.Tokenizer` of vocab_size tokens trained on documents, BOS first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(documents, trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    return tokenizer


def main(argv: list[str] | None = None) -> Path:
    """The command line (module docstring); returns the tokenizer.json written."""
    parser = argparse.ArgumentParser(prog="python -m ttt.text.train_tokenizer", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--corpus", default="stdlib", help="as data.corpus (default: stdlib)")
    parser.add_argument("--vocab-size", type=int, default=32000, help="tokens, BOS included (>= 300)")
    parser.add_argument("--max-documents", type=int, default=None, help="as data.max_documents")
    parser.add_argument("--out", required=True, help="directory to write tokenizer.json into")
    args = parser.parse_args(argv)
    if args.vocab_size < 300:
        parser.error(f"--vocab-size must be >= 300 (256 bytes, BOS and merges), got {args.vocab_size}")
    try:
        cfg = TextDataConfig(corpus=args.corpus, max_documents=args.max_documents)
        documents = training_documents(cfg)
    except (FileNotFoundError, ValueError) as err:
        message = str(err).replace("data.corpus", "--corpus")
        parser.error(message.replace("data.max_documents", "--max-documents"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    tokenizer = train_tokenizer(documents, args.vocab_size)
    tokenizer.save(str(path))
    made = tokenizer.get_vocab_size()
    print(f"{path}: {made} tokens (asked {args.vocab_size}) from {len(documents)} documents; BOS {BOS} = 0",
          file=sys.stderr)  # fmt: skip
    return path


if __name__ == "__main__":
    main()
