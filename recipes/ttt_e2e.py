"""ttt_e2e: meta-train a small TTT-E2E transformer on real text (by default the Python standard
library's source, read as bytes), then measure loss by position and passkey retrieval with and
without test-time training."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

from ttt.config import RecipeConfig
from ttt.inner import InnerLoopConfig
from ttt.layers import TTTConfig, TTTTransformer
from ttt.learners.ttt_language_model import TTTLanguageLearner
from ttt.meta import TaskDataModule
from ttt.models import Transformer, TransformerConfig
from ttt.text.context_schedule import ShortThenLong, flatten_rows
from ttt.text.corpus import Packing, TextDataConfig, TokenWindows, split_documents
from ttt.text.long_context import LongContextEvalConfig
from ttt.text.packing import PackedSlices
from ttt.text.passkey import PasskeyMix
from ttt.text.tokenizer import load_tokenizer


@dataclass
class Config(RecipeConfig):
    """ttt_e2e: model, test-time training, inner loop, text and evaluation, plus the common sections."""

    model: TransformerConfig = field(default_factory=lambda: TransformerConfig(window=64))
    """The transformer (TTT-E2E uses sliding-window attention; null window: full attention)."""
    ttt: TTTConfig = field(default_factory=TTTConfig)
    """Where the fast weights sit and how the context is chunked."""
    inner: InnerLoopConfig = field(
        default_factory=lambda: InnerLoopConfig(params=["layers.*.ttt_mlp.*"], lr=1.0, grad_clip=1.0)
    )
    """The inner optimizer; inner.params (globs) pick the fast weights among the suffix blocks' parameters."""
    data: TextDataConfig = field(default_factory=TextDataConfig)
    """The text corpus and its tokenizer."""
    eval: LongContextEvalConfig = field(default_factory=LongContextEvalConfig)
    """Loss by position and passkey retrieval after training."""


def build_data(cfg: Config, tokenizer) -> TaskDataModule:
    """Token windows of the corpus's train / val / test documents, batched as the trainer section says:
    batches {"tokens": (meta_batch_size, seq_len)}. With data.short_steps > 0 the first short_steps
    training batches are (meta_batch_size * seq_len / short_seq_len, short_seq_len) instead
    (`ShortThenLong`). With data.passkey_fraction > 0 that fraction of the training rows are passkey
    sequences with eval.passkey_digits digits (the evaluation's; its default in recipes without an eval
    section); with data.passkey_answer_weight != 1 the training batches also carry "loss_weight" (rows,
    length - 1), the weight of each next-token loss."""
    data = cfg.data
    documents = split_documents(data, tokenizer)
    if data.packing == Packing.stream:
        slices = packed_slices(cfg, documents, tokenizer)
        return TaskDataModule.from_trainer(slices, seed=cfg.seed, trainer=cfg.trainer)
    windows = {split: TokenWindows(docs, data.seq_len, split) for split, docs in documents.items()}
    samples = {split: windows_of_split.sample for split, windows_of_split in windows.items()}
    samples["train"] = with_passkeys(cfg, samples["train"], tokenizer, data.seq_len, "data.seq_len")
    if not data.short_steps:
        return TaskDataModule.from_trainer(samples, seed=cfg.seed, trainer=cfg.trainer)
    ttt = getattr(cfg, "ttt", None)
    if ttt is not None and ttt.enabled and data.short_seq_len <= ttt.chunk_len:
        raise ValueError(
            f"data.short_seq_len={data.short_seq_len} is at most one ttt.chunk_len={ttt.chunk_len} chunk: "
            "the inner steps, taken after each chunk, would help nothing in the short phase; use at least "
            f"two chunks (data.short_seq_len >= {2 * ttt.chunk_len})"
        )
    if data.short_steps >= cfg.trainer.max_steps:
        warnings.warn(
            f"data.short_steps={data.short_steps} >= trainer.max_steps={cfg.trainer.max_steps}: no training "
            f"step reads data.seq_len={data.seq_len} windows (validation and test still do); lower "
            "data.short_steps unless a resume with a larger trainer.max_steps follows",
            stacklevel=2,
        )
    short = TokenWindows(documents["train"], data.short_seq_len, "train").sample
    schedule = ShortThenLong(
        with_passkeys(cfg, short, tokenizer, data.short_seq_len, "data.short_seq_len"),
        samples["train"],
        short_steps=data.short_steps,
        rows=data.seq_len // data.short_seq_len,
    )
    return TaskDataModule.from_trainer(
        samples, seed=cfg.seed, trainer=cfg.trainer, train_curriculum=schedule, train_collate=flatten_rows
    )


def packed_slices(cfg: Config, documents: dict, tokenizer) -> dict[str, PackedSlices]:
    """Each split's documents packed into one stream and cut into data.seq_len + 1-token slices
    (`ttt.text.packing`): training in a shuffled order, the held-out sets in order; ValueError naming
    trainer.val_tasks / trainer.test_tasks when a held-out split has fewer slices than asked for."""
    bos = stream_bos(cfg.data, tokenizer)
    slices = {
        split: PackedSlices(docs, length=cfg.data.seq_len, bos_id=bos, split=split, shuffle=split == "train")
        for split, docs in documents.items()
    }
    for split, key in (("val", "val_tasks"), ("test", "test_tasks")):
        asked, made = getattr(cfg.trainer, key), len(slices[split])
        if asked > made:
            raise ValueError(
                f"trainer.{key}={asked} but the {split} documents make {made} slices of data.seq_len + 1 = "
                f"{cfg.data.seq_len + 1} tokens: lower trainer.{key} or data.seq_len"
            )
    return slices


def with_passkeys(cfg: Config, sample, tokenizer, length: int, length_key: str):
    """`sample` (windows of `length` tokens, config key `length_key`) with data.passkey_fraction of its
    rows passkey sequences (`PasskeyMix`); `sample` itself when the fraction is 0."""
    if not cfg.data.passkey_fraction:
        return sample
    digits = getattr(cfg, "eval", LongContextEvalConfig()).passkey_digits
    return PasskeyMix(
        sample,
        cfg.data.passkey_fraction,
        tokenizer,
        length,
        digits,
        answer_weight=cfg.data.passkey_answer_weight,
        length_key=length_key,
    )


def build_learner(cfg: Config, model: TTTTransformer, tokenizer) -> TTTLanguageLearner:
    """The Lightning module that meta-trains `model` with cfg's outer optimizer and evaluation."""
    return TTTLanguageLearner(
        model, cfg.optim, cfg.trainer.max_steps, evaluation=cfg.eval, tokenizer=tokenizer, seed=cfg.seed
    )


def text_tokenizer(data: TextDataConfig, model: TransformerConfig):
    """The tokenizer of data.tokenizer, refused (naming model.vocab_size) when its vocabulary does not fit
    the model's, and with data.packing=stream when the BOS token (`stream_bos`) is not a token id of the
    model: the tokenizer of every text recipe built on our `Transformer`."""
    tokenizer = load_tokenizer(data.tokenizer)
    if model.vocab_size < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size ({model.vocab_size}) must be >= the tokenizer's vocabulary "
            f"({tokenizer.vocab_size}) of data.tokenizer={data.tokenizer!r}"
        )
    if data.packing == Packing.stream:
        bos = stream_bos(data, tokenizer)
        if not 0 <= bos < model.vocab_size:
            raise ValueError(
                f"data.bos_id ({bos}) must be a token id below model.vocab_size ({model.vocab_size})"
            )
    return tokenizer


def stream_bos(data: TextDataConfig, tokenizer) -> int:
    """The BOS token of data.packing=stream: data.bos_id, else the tokenizer's, else the first id past the
    tokenizer's vocabulary."""
    if data.bos_id is not None:
        return data.bos_id
    return tokenizer.vocab_size if tokenizer.bos_id is None else tokenizer.bos_id


def build_module(cfg: Config) -> TTTLanguageLearner:
    """The learner of `cfg` around a fresh TTT transformer, without its data (`ttt.experiments.scale`
    feeds it random tokens)."""
    model = TTTTransformer(Transformer(cfg.model), cfg.ttt, cfg.inner)
    return build_learner(cfg, model, text_tokenizer(cfg.data, cfg.model))


def build(cfg: Config) -> tuple[TTTLanguageLearner, TaskDataModule]:
    """A fresh TTT transformer and the text stream of `cfg`."""
    learner = build_module(cfg)
    return learner, build_data(cfg, learner.tokenizer)
