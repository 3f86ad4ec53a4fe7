"""Command line: meta-train a recipe, evaluate it on held-out tasks, write the run directory.

    python -m ttt.train recipe=NAME [key=value ...]
    python -m ttt.train --help

See `usage()` for the full text (it lists the recipes found under configs/).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import sys
import textwrap
import time
import warnings
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import yaml
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.plugins import DoublePrecision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from recipes import available_recipes, load_config
from ttt.config import ConfigError, RecipeConfig, to_dict, to_yaml
from ttt.config.keys import format_config_keys
from ttt.config.loading import recipe_description, recipe_header
from ttt.meta.outer import lr_schedule_notes
from ttt.meta.sharding import SecondOrderFSDPStrategy
from ttt.tracking import (
    AtomicCheckpointIO,
    CheckpointError,
    DivergenceError,
    DivergenceGuard,
    EpochEndCheckpoint,
    LastEpochEndsAtMaxSteps,
    LogStepAlignment,
    LossSpikeWatch,
    OuterStepTimer,
    Preempted,
    PreemptionSignals,
    RunDirectoryError,
    RunPaths,
    StepBoundaryCheckpoint,
    StoppedAtOnce,
    atomic_write_text,
    check_resumable,
    check_writable,
    finished_at,
    format_summary_table,
    load_checkpoint,
    new_run_dir,
    out_of_memory_advice,
    resolve_resume,
    stopped_at_once,
    trained_minutes,
    write_run_report,
    write_summary,
)

USAGE = """\
usage: python -m ttt.train recipe=NAME [key=value ...]     (or: ttt-train recipe=NAME ...)
       python -m ttt.train recipe=NAME --help     every key of recipe NAME: type, value, doc

Meta-trains recipe NAME (configs/NAME.yaml), evaluates it on held-out tasks, prints a summary
table and writes the run directory <run.root>/<run.name>/ (config.yaml, logs/, checkpoints/,
summary.json, training_curves.png, test_adapted_vs_unadapted.png). A NaN or infinite loss stops
the run (exit status 3) with the step, the loss and the keys to look at; the last good checkpoint
is kept. SIGTERM or SIGUSR1 (preemption) makes it write its checkpoint at the next outer step, mark
the run directory (preempted.json) and exit with status 75; Ctrl-C (SIGINT) does the same and exits
with status 130 (a second Ctrl-C stops it at once, without saving); resume= continues it. Several
devices, nodes, fsdp and preemption: docs/distributed.md.

Overrides are OmegaConf dotlist items, applied on top of the recipe's YAML, e.g.
    trainer.max_steps=50  model.attention=eager  inner.params=[layers.1.mlp.*]  run.name=try1
(a list key also takes a single value: inner.params=layers.1.mlp.*). Unknown keys, invalid values and
a run directory that cannot be written are errors that say what is valid, before any work (status 2).

Step counts
    trainer.max_steps=N    outer steps of the run, any N: epochs of trainer.steps_per_epoch steps,
                           each ending in validation and a checkpoint; the last one ends at N,
                           shorter if N is not a multiple
    optim.schedule_steps=N the lr schedule's length (warm-up and decay), a key of its own; default:
                           the first session's trainer.max_steps. The run prints its schedule as it
                           starts

Special keys
    print_config=true      print the resolved config and exit
    resume=PATH            continue a run (its directory or a checkpoint file); its saved config
                           is used, with any other overrides applied (e.g. a larger max_steps).
                           Nothing in the run directory changes unless the checkpoint fits the
                           model built from that config. A resume with fewer trainer.max_steps
                           than the run has trained is refused; with as many, a finished run has
                           nothing to do (exit 0). Extending a run (a larger trainer.max_steps)
                           keeps its lr schedule (optim.schedule_steps): past the schedule's end
                           the lr stays at its final value, with no jump; a resume that changes
                           the schedule says at its start how the lr moves. The optimizer comes
                           from the checkpoint: optim.name, lr, weight_decay, beta1, beta2 cannot
                           change
    seed=N                 seed of model init and task streams

Recipes
{recipes}
"""


def usage(width: int = 100) -> str:
    """The --help text, listing each recipe with its description (the first paragraph of its YAML
    header), wrapped to `width` columns beside a column of the recipe names."""
    recipes = sorted(available_recipes().items())
    names = max(len(name) for name, _ in recipes)
    lines = []
    for name, path in recipes:
        first = f"    {name.ljust(names)}  "
        wrapper = textwrap.TextWrapper(width, initial_indent=first, subsequent_indent=" " * len(first))
        lines += wrapper.wrap(recipe_description(path)) or [first.rstrip()]
    return USAGE.format(recipes="\n".join(lines))


def recipe_usage(argv: list[str]) -> str:
    """The --help text of `recipe=NAME [key=value ...]`: the recipe's header, then every config key with
    its type, its value in this recipe (after the overrides) and its doc."""
    cfg = load_config([item for item in argv if item not in HELP_FLAGS])
    header = recipe_header(available_recipes()[cfg.recipe])
    return (
        f"recipe {cfg.recipe}\n\n{textwrap.indent(header, '    ')}\n\n"
        f"Keys (key: type = value in this recipe, then its doc); override any with key=value\n"
        f"{format_config_keys(cfg)}"
    )


HELP_FLAGS = ("-h", "--help", "help")


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
    try:
        saved = OmegaConf.load(paths.config)
    except (OSError, ValueError, OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(
            f"resume={resume}: the run's {paths.config} is not readable YAML ({err}); it is written "
            "atomically, so it was edited outside the run: restore it"
        ) from err
    if OmegaConf.select(saved, "optim.schedule_steps") is None:  # a run from before the key existed
        OmegaConf.update(saved, "optim.schedule_steps", OmegaConf.select(saved, "trainer.max_steps"))
    cfg = load_config(overrides, base=saved)
    cfg.resume = resume
    check_kept_on_resume(load_config([], base=saved), cfg)
    return cfg, paths, checkpoint


KEPT_ON_RESUME = (
    "optim.name", "optim.lr", "optim.weight_decay", "optim.beta1", "optim.beta2",
    "inner.lr_outer_lr", "compare.baseline_lr",
)  # fmt: skip
"""Keys that a resume cannot change: the optimizers come back from the checkpoint as they were saved
(torch's load_state_dict keeps the saved settings of each parameter group: the learnable inner lrs'
group at inner.lr_outer_lr, an optimizer comparison's baseline at compare.baseline_lr; and the lr schedule
keeps the saved peak lr), so a new value would be silently ignored."""


def check_kept_on_resume(saved: RecipeConfig, cfg: RecipeConfig) -> None:
    """Raise ConfigError when the resumed config `cfg` changes one of `KEPT_ON_RESUME` of the run's saved
    config `saved`."""
    saved_values, new_values = (OmegaConf.create(to_dict(c)) for c in (saved, cfg))
    changed = [
        f"{key}={OmegaConf.select(new_values, key)} (the run's: {OmegaConf.select(saved_values, key)})"
        for key in KEPT_ON_RESUME
        if OmegaConf.select(new_values, key) != OmegaConf.select(saved_values, key)
    ]
    if changed:
        raise ConfigError(
            f"resume={cfg.resume}: {', '.join(changed)} cannot change on resume: the run continues with the "
            "optimizers saved in its checkpoint, which keep their name, lr, betas and weight decay (the "
            "learnable inner lrs' lr and a comparison's baseline lr too). Drop the override (the schedule's "
            "keys optim.scheduler, warmup_steps, min_lr_ratio, schedule_steps and optim.grad_clip can "
            "change), or start a new run with it"
        )


RUN_DIR_ENV = "TTT_RUN_DIR"
"""Environment variable through which the launching process tells the processes that Lightning's ddp
strategy starts for the other devices (they re-run the same command) which run directory it created."""


def run_paths(cfg: RecipeConfig) -> RunPaths:
    """The run directory of a new run: created by the launching process (global rank 0), found through
    RUN_DIR_ENV by the other processes that Lightning started, or by its name (run.name) in processes that
    torchrun or SLURM started (every one of them runs the command itself)."""
    if rank_zero_only.rank == 0:
        paths = new_run_dir(cfg.run.root, cfg.run.name, cfg.recipe)
        os.environ[RUN_DIR_ENV] = str(paths.root)
        return paths
    if RUN_DIR_ENV in os.environ:
        return RunPaths(Path(os.environ[RUN_DIR_ENV]))
    if cfg.run.name is None:
        raise ConfigError(
            f"process of global rank {rank_zero_only.rank} cannot tell which run directory rank 0 created: "
            "processes started by torchrun or SLURM (one command per process) need run.name=NAME; on one "
            "machine, trainer.devices=N alone starts the other processes"
        )
    return RunPaths(Path(cfg.run.root) / cfg.run.name)


UNUSED_PARAMETERS_ERROR = "parameters that were not used in producing the loss"
"""Part of the message of Lightning's DDP strategy when a trainable parameter got no gradient in a step."""
UNUSED_PARAMETERS_HINT = (
    "some trainable parameters got no outer gradient in an outer step (for example the inner learning "
    "rates with inner.steps=0 or ttt.enabled=false), which DDP must be told: set "
    "trainer.find_unused_parameters=true"
)


def check_run_place(cfg: RecipeConfig, paths: RunPaths | None) -> None:
    """Raise RunDirectoryError, before any work, where the run could not write its files (global rank 0
    writes them all): for a new run, where <run.root>/<run.name> is to be created; for a resumed one
    (`paths`), its run directory and the folders in it (checkpoints/, logs/, ...)."""
    if rank_zero_only.rank != 0:
        return
    if paths is None:
        check_writable(
            Path(cfg.run.root) / (cfg.run.name or ""),
            f"run.root={cfg.run.root}",
            "the run directory is created there: choose a writable place with run.root=DIR",
        )
        return
    for folder in (paths.root, *sorted(path for path in paths.root.iterdir() if path.is_dir())):
        check_writable(
            folder,
            f"resume={cfg.resume}",
            "a resumed run writes its checkpoint, logs and summary in its run directory: copy the directory "
            "to a writable place and resume the copy",
        )


class NothingToDo(Exception):
    """A resumed run that has done everything its config asks; the message says so and how to go on."""


def check_steps_left(cfg: RecipeConfig, checkpoint: Mapping[str, Any], paths: RunPaths) -> None:
    """Raise ConfigError when the run resumed from `checkpoint` has trained more outer steps than
    trainer.max_steps (a run cannot be shortened), and NothingToDo when it has trained exactly as many and
    finished there (its summary.json says so; a run stopped in its final test is tested again)."""
    done, wanted = int(checkpoint["global_step"]), cfg.trainer.max_steps
    if done > wanted:
        raise ConfigError(
            f"resume={cfg.resume}: the run has trained {done} outer steps, more than trainer.max_steps="
            f"{wanted}: a run cannot be shortened. Resume with trainer.max_steps={done} or more, or start a "
            f"new run with trainer.max_steps={wanted}; the run directory was left unchanged"
        )
    if done == wanted and finished_at(paths, done):
        raise NothingToDo(
            f"resume={cfg.resume}: the run has trained all its {done} outer steps (trainer.max_steps="
            f"{wanted}) and written its summary, {paths.summary}: nothing to do, the run directory was left "
            f"unchanged. To train on: resume={cfg.resume} trainer.max_steps=N with N > {done}"
        )


def check_accelerator(cfg: RecipeConfig) -> None:
    """Raise ConfigError when trainer.accelerator asks for GPUs this machine does not have (before the
    run directory exists, rather than Lightning's error after it)."""
    tc = cfg.trainer
    if tc.accelerator not in ("gpu", "cuda"):
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            f"trainer.accelerator={tc.accelerator} but this machine has no CUDA GPU that PyTorch can use "
            "(torch.cuda.is_available() is False): use trainer.accelerator=cpu, or auto"
        )
    if tc.devices > torch.cuda.device_count():
        raise ConfigError(
            f"trainer.devices={tc.devices} but this machine has {torch.cuda.device_count()} CUDA GPUs"
        )


HESSIAN_OPTIMIZERS_UNDER_FSDP = (
    "optim.name={name} is not supported with trainer.strategy=fsdp: the Hessian optimizers estimate the "
    "Hessian diagonal through the whole model after the outer backward and update whole parameters, while "
    "fsdp keeps the parameters and their optimizer state as shards outside each outer step; use "
    "trainer.strategy=ddp"
)
FP16_UNDER_FSDP = (
    "trainer.precision=16-mixed is not supported with trainer.strategy=fsdp: Lightning's "
    "ModelParallelStrategy has no loss scaling over sharded gradients; use trainer.precision=bf16-mixed"
)


def check_strategy(cfg: RecipeConfig) -> None:
    """Raise ConfigError for what trainer.strategy=fsdp cannot run (before the run directory exists)."""
    if cfg.trainer.strategy != "fsdp":
        return
    if cfg.optim.name in ("sophia_h", "adahessian"):
        raise ConfigError(HESSIAN_OPTIMIZERS_UNDER_FSDP.format(name=cfg.optim.name))
    if cfg.trainer.precision == "16-mixed":
        raise ConfigError(FP16_UNDER_FSDP)


def check_time_left(cfg: RecipeConfig, trained: float | None) -> None:
    """Raise ConfigError when a resumed run (`trained` minutes counted by its time limit, None if it had
    none) would stop at once: trainer.max_minutes counts the whole run, not this session."""
    limit = cfg.trainer.max_minutes
    if limit is not None and trained is not None and trained >= limit:
        raise ConfigError(
            f"trainer.max_minutes={limit:g} counts the whole run, which has trained {trained:.1f} minutes "
            f"already: resumed, it would stop at once. Set trainer.max_minutes above {trained:.1f} (the "
            "total this run may train), or null; the run directory was left unchanged"
        )


def make_trainer(
    cfg: RecipeConfig,
    paths: RunPaths,
    timer: OuterStepTimer,
    spikes: LossSpikeWatch | None = None,
    signals: PreemptionSignals | None = None,
) -> pl.Trainer:
    """The Lightning Trainer of a run: epochs of trainer.steps_per_epoch outer steps (the last one ends at
    trainer.max_steps, shorter if need be), validation and an atomic last.ckpt after each epoch (and at
    outer-step boundaries on a preemption signal or every trainer.checkpoint_every_minutes), CSV (and
    TensorBoard) logs in the run directory. With several devices, Lightning's DDP strategy (gloo on CPU,
    NCCL on GPUs). spikes: the run's loss-spike watch (a new one if None); signals: the run's preemption
    signals (new ones if None)."""
    tc = cfg.trainer
    strategy, precision, plugins = "auto", tc.precision, [AtomicCheckpointIO()]
    if tc.strategy == "fsdp":
        strategy = SecondOrderFSDPStrategy(tc.world_size, cpu_offload=tc.fsdp_cpu_offload)
        if precision in ("64-true", "64"):
            # Lightning refuses the flag with ModelParallelStrategy (fully_shard has no float64 path); ours
            # shards float64 tensors like any other, so the plugin is given instead of the flag.
            precision, plugins = None, [*plugins, DoublePrecision()]
    elif tc.strategy == "ddp" or tc.world_size > 1:
        strategy = DDPStrategy(find_unused_parameters=tc.find_unused_parameters)
    # One log version per session (logs/version_0, version_1 after a resume, ...): a logger reusing a
    # directory would delete the earlier metrics.
    loggers = [CSVLogger(save_dir=paths.root, name="logs")]
    guard = DivergenceGuard(paths.last_checkpoint, cfg.inner_step_keys)
    if cfg.run.tensorboard and importlib.util.find_spec("tensorboard") is not None:
        loggers.append(TensorBoardLogger(save_dir=paths.root, name="tensorboard"))
    return pl.Trainer(
        max_steps=tc.max_steps,
        max_time=None if tc.max_minutes is None else timedelta(minutes=tc.max_minutes),
        max_epochs=-1,
        accelerator=tc.accelerator,
        devices=tc.devices,
        num_nodes=tc.num_nodes,
        strategy=strategy,
        # The data modules give each process its own tasks (StepAlignedSampler, process_share).
        use_distributed_sampler=False,
        precision=precision,
        inference_mode=False,
        logger=loggers,
        # The guard runs before the checkpoint callbacks: a diverged epoch end raises before it is saved.
        # StepBoundaryCheckpoint comes last: it saves the state every other callback has updated.
        callbacks=[
            guard,
            spikes if spikes is not None else LossSpikeWatch(inner_keys=cfg.inner_step_keys),
            LastEpochEndsAtMaxSteps(),
            EpochEndCheckpoint(paths.last_checkpoint),
            LogStepAlignment(),
            timer,
            StepBoundaryCheckpoint(
                paths,
                signals if signals is not None else PreemptionSignals(),
                tc.checkpoint_every_minutes,
                guard,
            ),
        ],
        detect_anomaly=tc.detect_anomaly,
        enable_checkpointing=False,
        plugins=plugins,
        log_every_n_steps=tc.log_every_n_steps,
        enable_progress_bar=tc.progress_bar and sys.stdout.isatty(),
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
    query_loss_adapted, query_acc_* where the task has an accuracy, ...), outer_steps, and figures of the
    whole run, over every session (`OuterStepTimer`): time_per_outer_step_s (mean, each session's first
    step left out), first_outer_step_s (the run's first), training_time_s, peak_memory_gib (CUDA only,
    else None), loss_spike_steps (where `LossSpikeWatch` warned), wall_time_s (this session, plus the
    earlier ones up to the checkpoint it resumed from); run_dir, and the learner's own
    `summary_figures()`. Raises NothingToDo for a resumed run that has finished, and ConfigError for one
    asked to train fewer steps than it has (neither touches the run directory); StoppedAtOnce (its message
    saying what the run kept) after a second Ctrl-C.
    """
    from recipes import build

    start = time.perf_counter()
    check_accelerator(cfg)
    check_strategy(cfg)
    pl.seed_everything(cfg.seed, workers=True, verbose=False)
    try:
        module, data = build(cfg)  # the learner keeps cfg: its checkpoints load with no arguments
    except (ValueError, FileNotFoundError) as err:  # builders name the bad key in these
        raise ConfigError(f"recipe {cfg.recipe}: {err}") from err
    saved = None
    if checkpoint is not None:
        # Everything that can fail about the checkpoint fails here, before the run directory is touched.
        saved = load_checkpoint(checkpoint, mmap=True)
        check_resumable(saved, checkpoint, module.state_dict())
        check_steps_left(cfg, saved, paths)
        check_time_left(cfg, trained_minutes(saved))
    if paths is None:
        paths = run_paths(cfg)
    if rank_zero_only.rank == 0:
        atomic_write_text(paths.config, to_yaml(cfg))
        paths.preempted.unlink(missing_ok=True)  # this session continues the preempted one
        print("\n".join(lr_schedule_notes(cfg.optim, cfg.trainer.max_steps, saved)), file=sys.stderr)
    timer = OuterStepTimer(started=start)
    spikes = LossSpikeWatch(inner_keys=cfg.inner_step_keys)
    trainer = None
    try:
        # Ours from here on: Lightning installs its own at each stage's start, StepBoundaryCheckpoint
        # re-installs.
        with PreemptionSignals() as signals:
            trainer = make_trainer(cfg, paths, timer, spikes, signals)
            # config.yaml holds the latest session's config; each session's own goes beside its metrics
            # (logs/version_N/hparams.yaml), so a run resumed with other keys (a short-then-long context
            # schedule) keeps its history.
            trainer.loggers[0].log_hyperparams(to_dict(cfg))
            # Lightning restores a checkpoint before it casts the module to the precision's dtype: cast
            # first, or a float64 run would resume from float32-rounded parameters.
            module = trainer.strategy.precision_plugin.convert_module(module)
            trainer.fit(module, datamodule=data, ckpt_path=checkpoint)
            if cfg.trainer.test_tasks:
                trainer.test(module, datamodule=data, verbose=False)
    except StoppedAtOnce:
        if trainer is not None and trainer.strategy.launcher is not None:
            trainer.strategy.launcher.kill(signal.SIGKILL)  # processes Lightning started would wait for us
        raise StoppedAtOnce(stopped_at_once(paths)) from None
    summary: dict[str, Any] = {
        key.removeprefix("test/"): float(value)
        for key, value in trainer.callback_metrics.items()
        if key.startswith("test/")
    }
    summary.update(
        recipe=cfg.recipe,
        outer_steps=trainer.global_step,
        time_per_outer_step_s=timer.time_per_outer_step(),
        training_time_s=timer.training_seconds(),
        first_outer_step_s=timer.first_outer_step(),
        peak_memory_gib=timer.peak_memory_gib,
        loss_spike_steps=spikes.spike_steps(),
        wall_time_s=timer.wall_seconds(),
        run_dir=str(paths.root),
    )
    summary.update(module.summary_figures())  # last: a learner may refine a figure (peak_memory_gib)
    if trainer.is_global_zero:
        write_summary(paths.summary, summary)
        write_run_report(paths.root, summary)
    release_process_group()
    return summary


def release_process_group() -> None:
    """Destroy the process group of a run of several processes (Lightning created it) once the run has
    ended normally in this process. Left to the interpreter's exit, gloo's worker threads can abort a
    process during finalization ("terminate called without an active exception": pytorch/pytorch issue
    190489). Not after a failure: another process may still be in a collective. A later run in the same
    process creates the group again."""
    global _released_a_group
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
        _released_a_group = True


_released_a_group = False
"""Whether `release_process_group` destroyed a process group in this process (`cli` then ends it with
os._exit)."""


DIVERGED = 3
"""Exit status of a run stopped by a non-finite loss (2: bad command line or config)."""
OUT_OF_MEMORY = 4
"""Exit status of a run that ran out of accelerator memory (the message names the keys that lower it)."""
PREEMPTED = 75
"""Exit status of a run stopped by SIGTERM or SIGUSR1 after writing its checkpoint (75 is EX_TEMPFAIL of
sysexits.h: a temporary failure, to be retried); resume=RUN continues it."""
INTERRUPTED = 130
"""Exit status of a run stopped by Ctrl-C (SIGINT): 128 + 2, what shells report for a command that Ctrl-C
ended. After one Ctrl-C the run has written its checkpoint (resume=RUN continues it); after a second one
it stopped at once, keeping its last checkpoint."""


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ttt.train` and `ttt-train`; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or any(item in HELP_FLAGS for item in argv):
        if not any(item.startswith("recipe=") for item in argv):
            print(usage())
            return 0 if argv else 2
        try:
            print(recipe_usage(argv))
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        return 0
    try:
        cfg, paths, checkpoint = prepare(argv)
    except (ConfigError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if cfg.print_config:
        print(to_yaml(cfg), end="")
        return 0
    try:
        check_run_place(cfg, paths)
    except RunDirectoryError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    # Synthetic tasks are generated in microseconds: extra loader workers would not help.
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    # The training stream is indexed by the outer step (StepAlignedSampler): a run resumed from a checkpoint
    # written within an epoch reads what the uninterrupted run would have, which Lightning cannot know.
    warnings.filterwarnings(
        "ignore", message=".*resuming from a checkpoint that ended before the epoch ended.*"
    )
    try:
        summary = run(cfg, paths=paths, checkpoint=checkpoint)
    except NothingToDo as err:
        print(str(err))
        return 0
    except (ConfigError, FileExistsError, CheckpointError, RunDirectoryError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except DivergenceError as err:
        print(f"error: {err}", file=sys.stderr)
        return DIVERGED
    except torch.OutOfMemoryError as err:
        print(f"error: {out_of_memory_advice(cfg, err)}", file=sys.stderr)
        return OUT_OF_MEMORY
    except Preempted as err:
        if rank_zero_only.rank == 0:
            print(str(err), file=sys.stderr)
        return INTERRUPTED if err.signal == signal.SIGINT else PREEMPTED
    except StoppedAtOnce as err:
        if rank_zero_only.rank == 0:
            print(str(err), file=sys.stderr)
        return INTERRUPTED
    except KeyboardInterrupt:  # Ctrl-C before training started or after it ended: no run state at risk
        if rank_zero_only.rank == 0:
            print(
                "interrupted by Ctrl-C outside training; the run's checkpoint, if any, is as it was",
                file=sys.stderr,
            )
        return INTERRUPTED
    except SIGTERMException:  # Lightning's own handler, in the moment before a stage installs ours
        if rank_zero_only.rank == 0:
            print(
                "preempted by SIGTERM before training started; the run's checkpoint (if any) is as it was",
                file=sys.stderr,
            )
        return PREEMPTED
    except RuntimeError as err:
        if UNUSED_PARAMETERS_ERROR not in str(err):
            raise
        print(f"error: {UNUSED_PARAMETERS_HINT}", file=sys.stderr)
        return 2
    if rank_zero_only.rank == 0:
        print(format_summary_table(summary))
        print(f"\nsummary written to {Path(summary['run_dir']) / 'summary.json'}")
    return 0


def cli() -> None:
    """`python -m ttt.train` and `ttt-train`: main's exit status as the process's. A process that took part
    in a run of several processes ends without the interpreter's finalization (`os._exit`, its output
    flushed first): there gloo's worker threads can abort it ("terminate called without an active
    exception", pytorch/pytorch issue 190489), after the run has ended, written and closed everything,
    replacing its exit status with SIGABRT's. Other processes exit as usual."""
    status = main()
    if took_part_in_a_process_group():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def took_part_in_a_process_group() -> bool:
    """Whether this process has a process group (a failed run keeps it) or released one
    (`release_process_group`)."""
    initialized = torch.distributed.is_available() and torch.distributed.is_initialized()
    return initialized or _released_a_group


if __name__ == "__main__":
    cli()
