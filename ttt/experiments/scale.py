"""Time and memory of a text TTT recipe's outer step at its full size: the recipe's own learner and
Lightning training step on random tokens (time and memory do not depend on the values), with and
without the second-order term.

    python -m ttt.experiments.scale recipe=ttt_e2e_125m [key=value ...] [--steps 3]
        [--modes second,first,off] [--out results.jsonl] [--profile] [--sources]
    python -m ttt.experiments.scale recipe=ttt_e2e_125m --modes second --base COMMIT_OR_DIR [--rounds 2]
        [--budget SECONDS] [--base-override KEY=VALUE ...]

With --base, an A/B: this tree against the base, each measured by its own code in a process of its
own, alternating round by round, then this / base per mode with its spread (`ttt.experiments.step_ab`);
--budget stops it, with its summary, before a process that might not finish in that many seconds;
--base-override KEY=VALUE (repeated) sets an option of the base side alone (with --base ., an A/B of
options in this tree).

Modes: second (the recipe as configured: exact second order), first (inner.first_order=true), off
(ttt.enabled=false: the same model without test-time training). Each mode builds the learner afresh,
runs one warm-up outer step (compilation) and --steps timed ones. One JSON line per mode:
    s_per_step        mean wall time of the timed outer steps (CUDA synchronised)
    step_s            each timed outer step's wall time (their spread: a one-step figure has none)
    tokens_per_s      tokens of a batch (trainer.meta_batch_size x data.seq_len) / s_per_step
    peak_gib          torch.cuda.max_memory_allocated over the run (warm-up included)
    alloc_retries     each timed outer step's CUDA allocator retries (`OuterStepTimer.alloc_retries`:
                      a cache flush and device synchronisation each; None off CUDA)
    tokens_in_flight  sequences read side by side in one pass (ttt.sequences_per_pass) x data.seq_len
    mib_per_token     peak_gib / tokens_in_flight, in MiB
    model_tflop       model FLOPs of one outer step (`model_flops_per_sequence`), in TFLOP
    mfu               model_tflop / s_per_step / the accelerator's dense bf16 peak (`PEAK_TFLOPS`)
    profile           with --profile: one more step's CUDA kernel time by category and its largest
                      kernels (`ttt.experiments.step_profile`), after the timed steps
    sources           with --sources: one more step's kernel time by the op, autograd node and
                      line of this project that launched it (`attribute_device_time`; the host's
                      ops recorded too, so that step runs slower)
    environment       where it ran: GPU, library versions, commit, command, time, the allocator's
                      settings (`flashbob.environment.describe`)
A mode that runs out of memory gives status "oom" and the next mode runs.
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Iterator

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, IterableDataset

from flashbob.environment import describe
from recipes import load_config
from ttt.config.loading import ConfigError, parse_overrides
from ttt.meta.sharding import SecondOrderFSDPStrategy
from ttt.models import TransformerConfig
from ttt.tracking import OuterStepTimer

from . import step_ab
from .json_lines import emit
from .meta_step_probe import is_out_of_memory
from .step_profile import StepProfiler

MODES = {"second": [], "first": ["inner.first_order=true"], "off": ["ttt.enabled=false"]}
"""Each mode's overrides on top of the command line's."""

PEAK_TFLOPS = {"H200": 989.4, "H100": 989.4, "A100": 312.0}
"""Dense bf16 matrix peak by accelerator name (vendor datasheets, SXM parts), for the MFU."""


class RandomTokens(IterableDataset):
    """Endless batches {"tokens": (rows, seq_len) int64} of uniform random ids below vocab; with masked,
    also {"loss_mask": (rows, seq_len - 1)} all true (the batches of data.packing=stream, whose masking
    costs the same whatever it masks)."""

    def __init__(self, vocab: int, rows: int, seq_len: int, seed: int = 0, *, masked: bool = False):
        self.vocab, self.rows, self.seq_len, self.seed, self.masked = vocab, rows, seq_len, seed, masked

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(self.seed)
        while True:
            tokens = torch.randint(0, self.vocab, (self.rows, self.seq_len), generator=gen)
            if not self.masked:
                yield {"tokens": tokens}
            else:
                yield {"tokens": tokens, "loss_mask": torch.ones_like(tokens[:, 1:], dtype=torch.bool)}


def keys_seen(seq_len: int, window: int | None) -> int:
    """Sum over the positions of a causal (sliding-window) sequence of the keys each query sees."""
    w = seq_len if window is None else min(window, seq_len)
    return w * (w + 1) // 2 + (seq_len - w) * w


def model_flops_per_sequence(model: TransformerConfig, seq_len: int, extra_params: int = 0) -> float:
    """Training FLOPs of one sequence through the transformer without test-time training: 3 x (2 x the
    matrix parameters, output head included, extra_params too (TTT's extra MLPs), per token, plus
    4 x layers x heads x head_dim x the keys each query sees, for QK^T and PV). The inner steps and
    the second-order term are not counted: this is the work of the plain model, so MFU is comparable
    across modes and with other systems."""
    cfg = model.resolved()
    attn = cfg.d_model * cfg.head_dim * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    matrix = cfg.n_layers * (attn + 3 * cfg.d_model * cfg.d_ff) + cfg.vocab_size * cfg.d_model + extra_params
    attention = 4 * cfg.n_layers * cfg.n_heads * cfg.head_dim * keys_seen(seq_len, cfg.window)
    return 3.0 * (2.0 * matrix * seq_len + attention)


def peak_tflops() -> float | None:
    """The dense bf16 peak of the current CUDA device by its name, or None (unknown or no CUDA)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_TFLOPS.items() if key in name), None)


def measure(overrides: list[str], steps: int, profile: bool = False, sources: bool = False) -> dict:
    """One mode: build the recipe's learner, train warm-up + `steps` outer steps on random tokens;
    profile: also profile one more step after the timed ones (`StepProfiler`; not in s_per_step);
    sources: one more after that, with the host's ops and stacks (`StepProfiler(sources=True)`)."""
    from recipes import load_builder

    cfg = load_config(overrides)
    # The learner trains these steps (its run's length), on the recipe's lr schedule (optim.schedule_steps).
    cfg.trainer.max_steps = 1 + steps + profile + sources
    builder = load_builder(cfg.builder)
    if not hasattr(builder, "build_module"):
        raise SystemExit(f"error: recipe {cfg.recipe} (builder {cfg.builder}) is not a text TTT recipe")
    pl.seed_everything(cfg.seed, verbose=False)
    module = builder.build_module(cfg)
    model_cfg = module.model.cfg
    rows, seq_len = cfg.trainer.meta_batch_size, cfg.data.seq_len
    per_pass = min(cfg.ttt.sequences_per_pass or rows, rows)
    extra = sum(p.numel() for name, p in module.model.named_parameters() if ".ttt_mlp." in name)
    row = {
        "recipe": cfg.recipe,
        "overrides": [item for item in overrides if not item.startswith("recipe=")],
        "sequences": rows,
        "seq_len": seq_len,
        "tokens_in_flight": per_pass * seq_len,
        "params_m": sum(p.numel() for p in module.parameters()) / 1e6,
        "model_tflop": rows * model_flops_per_sequence(model_cfg, seq_len, extra) / 1e12,
    }
    timer = OuterStepTimer(warmup=1)
    profiler = StepProfiler(step=1 + steps) if profile else None
    attributor = StepProfiler(step=1 + steps + profile, sources=True) if sources else None
    trainer = pl.Trainer(
        max_steps=cfg.trainer.max_steps,
        accelerator=cfg.trainer.accelerator,
        devices=1,
        strategy=one_device_strategy(cfg),
        precision=cfg.trainer.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        inference_mode=False,
        callbacks=[callback for callback in (timer, profiler, attributor) if callback is not None],
    )
    stream = cfg.data.packing == "stream"  # slices of seq_len + 1 tokens: seq_len targets
    tokens = RandomTokens(model_cfg.vocab_size, rows, seq_len + stream, cfg.seed, masked=stream)
    data = DataLoader(tokens, batch_size=None)
    try:
        trainer.fit(module, train_dataloaders=data)
    except Exception as err:  # noqa: BLE001 - any failure is a row, so that the next mode runs
        if not is_out_of_memory(err):
            raise
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None
        return {**row, "status": "oom", "peak_gib": peak, "error": str(err).splitlines()[0]}
    timed = timer.durations[1 : 1 + steps]
    seconds = sum(timed) / len(timed)
    peak, top = timer.peak_memory_gib, peak_tflops()
    row.update(
        status="ok",
        s_per_step=seconds,
        step_s=timed,
        alloc_retries=timer.alloc_retries[1 : 1 + steps] if timer.alloc_retries else None,
        first_step_s=timer.first_outer_step(),
        tokens_per_s=rows * seq_len / seconds,
        peak_gib=peak,
        mib_per_token=None if peak is None else peak * 1024 / row["tokens_in_flight"],
        mfu=None if top is None else row["model_tflop"] / seconds / top,
    )
    if profiler is not None:
        row["profile"] = profiler.summary
    if attributor is not None:
        row["sources"] = None if attributor.summary is None else attributor.summary["sources"]
    return row


def one_device_strategy(cfg) -> SecondOrderFSDPStrategy | str:
    """trainer.strategy on one device: fsdp (with trainer.fsdp_cpu_offload: parameters, gradients and
    optimizer state in CPU memory between steps) or Lightning's default."""
    if cfg.trainer.strategy == "fsdp":
        return SecondOrderFSDPStrategy(1, cpu_offload=cfg.trainer.fsdp_cpu_offload)
    return "auto"


def release() -> None:
    """Free what a mode left behind before the next one is measured."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("overrides", nargs="+", help="recipe=NAME and key=value overrides")
    parser.add_argument("--steps", type=int, default=3, help="timed outer steps after one warm-up step")
    parser.add_argument("--modes", default="second,first,off", help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--out", help="append one JSON line per mode to this file")
    parser.add_argument("--profile", action="store_true", help="profile one more step's kernels")
    parser.add_argument("--sources", action="store_true", help="attribute one more step's kernel time")
    parser.add_argument("--base", help="A/B against this commit or directory (ttt.experiments.step_ab)")
    parser.add_argument("--rounds", type=int, default=2, help="with --base: rounds, each tree once a round")
    parser.add_argument(
        "--budget", type=float, help="with --base: seconds of wall time; no process starts that might pass it"
    )
    parser.add_argument(
        "--base-override", action="append", default=[], metavar="KEY=VALUE",
        help="with --base: an override of the base side alone (repeatable)",
    )  # fmt: skip
    args = parser.parse_intermixed_args(argv)
    modes = args.modes.split(",")
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown or args.steps < 1:
        parser.error(f"--modes must be of {list(MODES)} (got {unknown}), --steps >= 1 (got {args.steps})")
    if args.base_override and args.base is None:
        parser.error(f"--base-override needs --base (got {args.base_override})")
    try:  # before any tree runs: a malformed one would fail only after this tree's measurement
        parse_overrides(args.base_override)
    except ConfigError as err:
        parser.error(f"--base-override: {err}")
    if args.base is not None:
        if args.profile or args.sources or args.rounds < 1 or (args.budget is not None and args.budget <= 0):
            parser.error(
                f"--base takes --rounds >= 1 (got {args.rounds}), --budget > 0 seconds (got {args.budget}), "
                "and no --profile or --sources"
            )
        try:
            step_ab.run(
                args.overrides, modes, args.steps, args.base, args.rounds, args.out, args.budget,
                tuple(args.base_override),
            )  # fmt: skip
        except (ValueError, RuntimeError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2 if isinstance(err, ValueError) else 1
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    environment = describe(device, "ttt.experiments.scale", argv)
    for mode in modes:
        row = measure(args.overrides + MODES[mode], args.steps, args.profile, args.sources)
        emit({"mode": mode, **row, "environment": environment}, args.out)
        release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
