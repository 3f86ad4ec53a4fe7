"""Overrides that shrink the recipes to seconds-long CPU runs, shared by every test folder that runs a
recipe through the command line (tests/conftest.py puts this folder on the import path):

    from tiny_configs import TINY_TRAINER, TINY_KV_TASK, TINY_KV_MODEL, TINY_TEXT, tiny_text_run
"""

from pathlib import Path

TINY_TRAINER = [
    "trainer.max_steps=2",
    "trainer.steps_per_epoch=2",
    "trainer.meta_batch_size=2",
    "trainer.val_tasks=2",
    "trainer.test_tasks=2",
    "trainer.eval_batch_size=2",
    "trainer.progress_bar=false",
    "trainer.accelerator=cpu",
    "run.tensorboard=false",
]
"""Two outer steps of two tasks, two held-out tasks, on the CPU, without TensorBoard."""

TINY_KV_TASK = [
    "task.n_pairs=4",
    "task.n_queries=3",
    "task.n_keys=8",
    "task.n_values=8",
    "task.n_filler_tokens=4",
    "task.filler_len=14",
    "context.tokens_per_step=8",
    "inner.steps=2",
]
"""maml_longctx's key-value task at toy size (a 27-token context read in 2 inner steps)."""

TINY_KV_MODEL = ["model.d_model=32", "model.n_heads=2", "model.window=8", "model.vocab_size=32"]
"""maml_longctx's own Transformer at toy size (its window of 8 does not reach the pairs)."""

TINY_TEXT_DATA = [
    "data.seq_len=48",
    "data.held_out_every=3",
    "eval.passkey_lengths=[120]",
    "eval.passkey_trials=2",
    "eval.position_bins=4",
]
"""The text recipes' data and long-context evaluation at toy size: 48-byte windows, 120-byte passkeys."""

TINY_TEXT_MODEL = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.window=8",
    "ttt.suffix_len=1",
    "ttt.chunk_len=16",
]
"""The text recipes' own Transformer at toy size: 2 layers, window 8, one TTT block, 16-token chunks."""

TINY_TEXT = [*TINY_TEXT_DATA, *TINY_TEXT_MODEL]
"""The text recipes (ttt_e2e, neural_memory) at toy size: 48-byte windows, 2 layers, one TTT block."""


def write_tiny_corpus(directory: Path) -> Path:
    """Nine small Python-like documents in `directory` (created if missing, rewritten if there): a corpus
    for data.corpus=DIR."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(9):
        (directory / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i}\n" * (3 + i))
    return directory


def tiny_text_run(recipe: str, corpus: Path, root: Path, *extra: str) -> list[str]:
    """The command-line arguments of a tiny run of text recipe `recipe` on `corpus` (a folder, e.g.
    `write_tiny_corpus`'s), writing under `root`; `extra` overrides come last."""
    return [
        f"recipe={recipe}",
        f"data.corpus={corpus}",
        *TINY_TEXT,
        *TINY_TRAINER,
        f"run.root={root}",
        *extra,
    ]


def text_data_overrides(corpus, *, seq_len: int, meta_batch_size: int, max_steps: int) -> list[str]:
    """Overrides for building a text recipe's data module on `corpus` (one epoch of max_steps steps,
    4 validation and 4 test windows): the tests that read its batches rather than run it."""
    return [
        f"data.corpus={corpus}", f"data.seq_len={seq_len}", "data.held_out_every=3",
        f"trainer.meta_batch_size={meta_batch_size}", f"trainer.max_steps={max_steps}",
        f"trainer.steps_per_epoch={max_steps}", "trainer.val_tasks=4", "trainer.test_tasks=4",
        "trainer.eval_batch_size=4",
    ]  # fmt: skip
