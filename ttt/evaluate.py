"""Loss by token position over long held-out text, with and without test-time training, of trained runs,
overlaid in one plot (TTT-E2E's loss against context length).

    python -m ttt.evaluate RUN_DIR [RUN_DIR ...] [--out DIR] [key=value ...]
    python -m ttt.evaluate runs/ttt_e2e_125m-... runs/full-attention-... data.corpus=DIR data.seq_len=131072

Each run (a run directory of ttt.train, or a checkpoint file of one, of a text recipe: ttt_e2e*,
pretrained/*, neural_memory*) is loaded with `ttt.load` and tested as its training run was tested, by
the learner's own test (`TTTLanguageLearner`: every test sequence read with and without its test-time
training, inner learning rates at the run's step), on the test split of the run's data pipeline with
the overrides applied to its config. Overrides may change what is read, not the model: data.* (corpus,
seq_len, ...), eval.* (position bins, passkey lengths; eval.passkey_lengths=[] for none),
trainer.test_tasks, trainer.eval_batch_size, trainer.precision and trainer.accelerator.

Writes, per run, DIR/<run name>/ as its training run wrote its run directory (`ttt.text.long_context`):
loss_by_position.{csv,json,png} (binned), nll_by_position.csv (every position), late_loss_by_window.csv,
passkey.{csv,png}; then the runs overlaid (`ttt.text.compare`): DIR/loss_by_position_compare.{png,md},
passkey_compare.{png,md}, late_loss_paired.md (the runs read the same test windows). DIR defaults to
eval-<UTC time>. Exit status 2, with a message, for a run without a checkpoint or not a text run, an
override of another key or with a bad value, or data that cannot make the test split.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import lightning.pytorch as pl
from omegaconf import OmegaConf

from recipes import build, load_builder, load_config
from ttt.config import ConfigError, RecipeConfig, to_dict
from ttt.learners.ttt_language_model import TTTLanguageLearner
from ttt.meta.loading import load
from ttt.text import compare
from ttt.tracking import CheckpointError

CHANGEABLE = ("data.", "eval.", "trainer.test_tasks=", "trainer.eval_batch_size=", "trainer.precision=",
              "trainer.accelerator=")  # fmt: skip
"""The overrides an evaluation takes (key prefixes): what is read and how, never the model."""


def check_overrides(overrides: list[str]) -> None:
    """ValueError naming the first override that is not key=value or changes something other than
    CHANGEABLE."""
    for item in overrides:
        if "=" not in item or not item.startswith(CHANGEABLE):
            raise ValueError(
                f"{item!r}: an evaluation takes key=value overrides of data.*, eval.* and "
                f"{', '.join(key.rstrip('=') for key in CHANGEABLE[2:])}; the model is the run's"
            )


TEST_ONLY = ["trainer.val_tasks=0", "trainer.devices=1", "trainer.num_nodes=1"]
"""What an evaluation sets itself: no validation split to cut, one process."""


def evaluation_config(cfg: RecipeConfig, overrides: list[str]) -> RecipeConfig:
    """The run's config with TEST_ONLY and the overrides applied (ConfigError naming a bad key or value)."""
    return load_config([*TEST_ONLY, *overrides], base=OmegaConf.create(to_dict(cfg)))


def evaluate_run(run: Path, overrides: list[str], out: Path) -> None:
    """Test run's learner on its data's test split under `overrides`, writing its report into out."""
    learner, cfg = load(run)
    if not isinstance(learner, TTTLanguageLearner):
        raise ValueError(f"{run}: loss by position is measured on text runs (a TTTLanguageLearner: recipes "
                         f"ttt_e2e*, pretrained/*, neural_memory*); recipe {cfg.recipe} has a "
                         f"{type(learner).__name__}")  # fmt: skip
    cfg = evaluation_config(cfg, overrides)
    builder = load_builder(cfg.builder)
    data = builder.build_data(cfg, learner.tokenizer) if hasattr(builder, "build_data") else build(cfg)[1]
    learner.eval_cfg = cfg.eval
    trainer = pl.Trainer(
        accelerator=cfg.trainer.accelerator, devices=1, precision=cfg.trainer.precision, logger=False,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=sys.stderr.isatty(),
        inference_mode=False, default_root_dir=out,
    )  # fmt: skip
    trainer.test(learner, datamodule=data, verbose=False)


def report_names(runs: list[Path]) -> list[str]:
    """Each run's folder name under DIR: its run directory's name (a checkpoint's: <run>/checkpoints/x),
    with -2, -3, ... after a name already taken."""
    names, seen = [], Counter()
    for run in runs:
        name = run.resolve().parent.parent.name if run.is_file() else run.resolve().name
        seen[name] += 1
        names.append(name if seen[name] == 1 else f"{name}-{seen[name]}")
    return names


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ttt.evaluate`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m ttt.evaluate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("items", nargs="+", metavar="RUN_DIR | key=value",
                        help="run directories (or checkpoint files), then config overrides")  # fmt: skip
    parser.add_argument("--out", type=Path, help="directory for the reports (default eval-<UTC time>)")
    args = parser.parse_intermixed_args(argv)
    runs = [Path(item) for item in args.items if "=" not in item]
    overrides = [item for item in args.items if "=" in item]
    if not runs:
        parser.error("give at least one RUN_DIR")
    out = args.out or Path(time.strftime("eval-%Y%m%d-%H%M%S", time.gmtime()))
    try:
        check_overrides(overrides)
        for run, name in zip(runs, report_names(runs)):
            evaluate_run(run, overrides, out / name)
    except (FileNotFoundError, CheckpointError, ConfigError, LookupError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return compare.main([*(str(out / name) for name in report_names(runs)), "--out", str(out)])


if __name__ == "__main__":
    sys.exit(main())
