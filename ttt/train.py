"""Command line: meta-train a recipe, evaluate it on held-out tasks, write the run directory.

    python -m ttt.train recipe=NAME [key=value ...]
    python -m ttt.train --help

See `usage()` for the full text (it lists the recipes found under configs/).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import OmegaConf

from ttt.config import ConfigError, RecipeConfig, available_recipes, load_config, to_yaml
from ttt.config.loading import recipe_header
from ttt.tracking import (
    AtomicCheckpointIO,
    EpochEndCheckpoint,
    OuterStepTimer,
    RunPaths,
    atomic_write_text,
    format_summary_table,
    new_run_dir,
    resolve_resume,
    write_summary,
)

USAGE = """\
usage: python -m ttt.train recipe=NAME [key=value ...]

Meta-trains recipe NAME (configs/NAME.yaml), evaluates it on held-out tasks, prints a summary
table and writes the run directory <run.root>/<run.name>/ (config.yaml, logs/, checkpoints/,
summary.json).

Overrides are OmegaConf dotlist items, applied on top of the recipe's YAML, e.g.
    trainer.max_steps=50  model.attention=eager  inner.params=[layers.1.mlp.*]  run.name=try1
Unknown keys and invalid values are errors that say what is valid.

Special keys
    print_config=true      print the resolved config and exit
    resume=PATH            continue a run (its directory or a checkpoint file); its saved config
                           is used, with any other overrides applied (e.g. a larger max_steps)
    seed=N                 seed of model init and task streams

Recipes
{recipes}
"""


def usage() -> str:
    """The --help text, listing each recipe with the first line of its YAML header."""
    lines = []
    for name, path in sorted(available_recipes().items()):
        header = recipe_header(path).splitlines()
        lines.append(f"    {name:<20} {header[0] if header else ''}")
    return USAGE.format(recipes="\n".join(lines))


def _split_resume(argv: list[str]) -> tuple[str | None, list[str]]:
    resume = [item.split("=", 1)[1] for item in argv if item.startswith("resume=")]
    rest = [item for item in argv if not item.startswith("resume=")]
    if len(resume) > 1:
        raise ConfigError("resume= given more than once")
    return (resume[0] if resume and resume[0] not in ("", "null") else None), rest


def prepare(argv: list[str]) -> tuple[RecipeConfig, RunPaths | None, Path | None]:
    """Config from the command line; for resume=..., also the run's paths and the checkpoint."""
    resume, overrides = _split_resume(argv)
    if resume is None:
        return load_config(overrides), None, None
    paths, checkpoint = resolve_resume(resume)
    cfg = load_config(overrides, base=OmegaConf.load(paths.config))
    cfg.resume = resume
    return cfg, paths, checkpoint


RUN_DIR_ENV = "TTT_RUN_DIR"
"""Environment variable through which the launching process tells the processes that Lightning's ddp
strategy starts for the other devices (they re-run the same command) which run directory it created."""


def run_paths(cfg: RecipeConfig) -> RunPaths:
    """The run directory of a new run: created by the launching process (global rank 0), found through
    RUN_DIR_ENV by the other processes of a ddp run."""
    if rank_zero_only.rank == 0:
        paths = new_run_dir(cfg.run.root, cfg.run.name, cfg.recipe)
        os.environ[RUN_DIR_ENV] = str(paths.root)
        return paths
    if RUN_DIR_ENV not in os.environ:
        raise RuntimeError(
            f"process of global rank {rank_zero_only.rank} has no {RUN_DIR_ENV}: start several devices "
            "with trainer.devices=N (Lightning launches the other processes), not one command per process"
        )
    return RunPaths(Path(os.environ[RUN_DIR_ENV]))


UNUSED_PARAMETERS_ERROR = "parameters that were not used in producing the loss"
"""Part of the message of Lightning's DDP strategy when a trainable parameter got no gradient in a step."""
UNUSED_PARAMETERS_HINT = (
    "some trainable parameters got no outer gradient in an outer step (for example the inner learning "
    "rates with inner.steps=0 or ttt.enabled=false), which DDP must be told: set "
    "trainer.find_unused_parameters=true"
)


def make_trainer(cfg: RecipeConfig, paths: RunPaths, timer: OuterStepTimer) -> pl.Trainer:
    """The Lightning Trainer of a run: epochs of trainer.steps_per_epoch outer steps, validation and
    an atomic last.ckpt after each epoch, CSV (and TensorBoard) logs in the run directory. With
    several devices, Lightning's DDP strategy (gloo on CPU, NCCL on GPUs)."""
    tc = cfg.trainer
    strategy = "auto"
    if tc.strategy == "ddp" or tc.devices > 1:
        strategy = DDPStrategy(find_unused_parameters=tc.find_unused_parameters)
    # One log version per session (logs/version_0, version_1 after a resume, ...): a logger reusing a
    # directory would delete the earlier metrics.
    loggers = [CSVLogger(save_dir=paths.root, name="logs")]
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is not None:
        loggers.append(TensorBoardLogger(save_dir=paths.root, name="tensorboard"))
    return pl.Trainer(
        max_steps=tc.max_steps,
        max_time=None if tc.max_minutes is None else timedelta(minutes=tc.max_minutes),
        max_epochs=-1,
        accelerator=tc.accelerator,
        devices=tc.devices,
        strategy=strategy,
        # The data modules give each process its own tasks (StepAlignedSampler, process_share).
        use_distributed_sampler=False,
        precision=tc.precision,
        inference_mode=False,
        logger=loggers,
        callbacks=[EpochEndCheckpoint(paths.last_checkpoint), timer],
        enable_checkpointing=False,
        plugins=[AtomicCheckpointIO()],
        log_every_n_steps=tc.log_every_n_steps,
        enable_progress_bar=tc.progress_bar,
        num_sanity_val_steps=0,
        limit_val_batches=1.0 if tc.val_tasks else 0,
        default_root_dir=paths.root,
    )


def run(
    cfg: RecipeConfig, *, paths: RunPaths | None = None, checkpoint: Path | None = None
) -> dict[str, Any]:
    """Build the recipe, fit (or continue from `checkpoint`), test, and write summary.json (every
    process of a ddp run calls this; only global rank 0 writes files).

    Returns the summary: test figures without their "test/" prefix (query_loss_unadapted,
    query_loss_adapted, query_acc_* where the task has an accuracy, ...), time_per_outer_step_s
    (mean after the first step of this session), first_outer_step_s, peak_memory_gib (CUDA only,
    else None), outer_steps, wall_time_s, run_dir; and the learner's own `summary_figures()`.
    """
    from recipes import load_builder

    start = time.perf_counter()
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    module, data = load_builder(cfg.builder).build(cfg)
    if paths is None:
        paths = run_paths(cfg)
    if rank_zero_only.rank == 0:
        atomic_write_text(paths.config, to_yaml(cfg))
    timer = OuterStepTimer()
    trainer = make_trainer(cfg, paths, timer)
    # Lightning restores a checkpoint before it casts the module to the precision's dtype: cast first,
    # or a float64 run would resume from float32-rounded parameters.
    module = trainer.strategy.precision_plugin.convert_module(module)
    trainer.fit(module, datamodule=data, ckpt_path=checkpoint)
    if cfg.trainer.test_tasks:
        trainer.test(module, datamodule=data, verbose=False)
    summary: dict[str, Any] = {
        key.removeprefix("test/"): float(value)
        for key, value in trainer.callback_metrics.items()
        if key.startswith("test/")
    }
    summary.update(
        recipe=cfg.recipe,
        outer_steps=trainer.global_step,
        time_per_outer_step_s=timer.time_per_outer_step(),
        first_outer_step_s=timer.first_outer_step(),
        peak_memory_gib=timer.peak_memory_gib,
        wall_time_s=time.perf_counter() - start,
        run_dir=str(paths.root),
    )
    summary.update(module.summary_figures())  # last: a learner may refine a figure (peak_memory_gib)
    if trainer.is_global_zero:
        write_summary(paths.summary, summary)
    return summary


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ttt.train` and `ttt-train`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or any(item in ("-h", "--help", "help") for item in argv):
        print(usage())
        return 0 if argv else 2
    try:
        cfg, paths, checkpoint = prepare(argv)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if cfg.print_config:
        print(to_yaml(cfg), end="")
        return 0
    # Synthetic tasks are generated in microseconds: extra loader workers would not help.
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    try:
        summary = run(cfg, paths=paths, checkpoint=checkpoint)
    except FileExistsError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        if UNUSED_PARAMETERS_ERROR not in str(err):
            raise
        print(f"error: {UNUSED_PARAMETERS_HINT}", file=sys.stderr)
        return 2
    if rank_zero_only.rank == 0:
        print(format_summary_table(summary))
        print(f"\nsummary written to {Path(summary['run_dir']) / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
