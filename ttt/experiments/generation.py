"""Prefill and decode speed and memory of a text TTT recipe's model (`ttt.layers.generation`), against the
same model with full attention: TTT-E2E's inference comparison.

    python -m ttt.experiments.generation recipe=ttt_e2e_125m [key=value ...] [--lengths 8192,32768,131072]
        [--decode-after 8192,131072] [--decode-tokens N] [--modes ttt,full] [--dtype bfloat16]
        [--repeats 3] [--out rows.jsonl] [--graphs] [--tiny]

Random weights and tokens: time and memory do not depend on their values. Modes:
    ttt    the recipe's model as configured: its sliding window, the inner steps of each chunk
    swa    the same without test-time training (ttt.enabled=false): what the inner steps cost
    full   window off and no test-time training: full causal attention over a growing key/value cache,
           run by each candidate of FULL_ATTENTION (our forward kernel, torch SDPA held to its flash
           kernel, to its cuDNN kernel); the fastest candidate of each measurement is marked best
Measurements, one JSON line each (and appended to --out):
    prefill   `prefill` of a random prompt of `tokens` tokens, after one warm-up prefill and decode
              (`warm_up_length`: compilation, graphs): ms_per_1k_tokens (the median of --repeats, CUDA
              synchronised), peak_gib
              (max_memory_allocated during the prefill, the weights included)
    decode    --decode-tokens greedy `decode_step`s (default 2 x ttt.chunk_len: two chunks' inner steps)
              after a prefill of `tokens` tokens: tokens_per_s, peak_gib during the decoding, state_gib
              (memory allocated after the prefill beyond the weights: the caches, the open chunk)
A measurement that runs out of memory gives status "oom", a candidate that cannot run "unsupported"
(with the error), and the next one runs. Each row is printed (and appended to --out) as soon as it is
measured, so a run stopped early keeps what it measured; stderr names each measurement as it starts. A
last line {"summary": ..., "best": ...} holds the goals' ratios (`goals`) and the fastest candidate of
each (mode, measure, tokens).
--graphs: the sliding-window modes (ttt, swa) prefill with `prefill(graphs=True)` (each chunk's step
one CUDA graph) and decode with a `GraphedDecoder` (each token's pass one CUDA graph); full attention,
whose caches grow, runs as without it; each row says which (graphs).
--tiny: a toy-size model of the recipe on the CPU in float32, lengths 48 and 96: it checks the logic,
its times mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from recipes import load_builder, load_config
from ttt.layers import TTTTransformer
from ttt.layers.generation import decode_step, prefill
from ttt.layers.graphed import GraphedDecoder

from .json_lines import emit
from .meta_step_probe import is_out_of_memory

MODES = {"ttt": [], "swa": ["ttt.enabled=false"], "full": ["ttt.enabled=false", "{model}.window=null"]}
"""Each mode's overrides on top of the command line's ({model}: the section holding the architecture)."""

FULL_ATTENTION = {
    "flashbob": ("flashbob", None),
    "sdpa_flash": ("sdpa", SDPBackend.FLASH_ATTENTION),
    "sdpa_cudnn": ("sdpa", SDPBackend.CUDNN_ATTENTION),
}
"""Candidates of the full mode: name -> (model attention backend, the SDPA kernel it is held to)."""

TINY = ["{model}.vocab_size=260", "{model}.d_model=32", "{model}.n_layers=4", "{model}.n_heads=4",
        "{model}.n_kv_heads=2", "{model}.d_ff=64", "{model}.window=32", "ttt.suffix_len=2",
        "ttt.chunk_len=16"]  # fmt: skip
"""--tiny's overrides: 4 blocks of width 32 (GQA), window 32, 2 of them adapting per 16-token chunk."""


def model_section(overrides: list[str]) -> str:
    """The config section that holds the architecture: model.architecture for the pretrained recipes,
    model otherwise."""
    cfg = load_config(overrides)
    return "model.architecture" if hasattr(cfg.model, "architecture") else "model"


def build_model(overrides: list[str], dtype: torch.dtype, device: torch.device) -> TTTTransformer:
    """The recipe's TTT model with random weights (seeded by its seed), in eval mode on device."""
    cfg = load_config(overrides)
    builder = load_builder(cfg.builder)
    model = builder.build_module(cfg).model if hasattr(builder, "build_module") else None
    if not isinstance(model, TTTTransformer):
        raise SystemExit(
            f"error: recipe {cfg.recipe} does not build a TTTTransformer (a text TTT-E2E recipe)"
        )
    return model.to(device=device, dtype=dtype).eval()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA); nothing elsewhere."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def allocated_gib(device: torch.device, *, peak: bool) -> float | None:
    """CUDA memory allocated now (or its peak since the last reset), in GiB; None off CUDA."""
    if device.type != "cuda":
        return None
    return (torch.cuda.max_memory_allocated(device) if peak else torch.cuda.memory_allocated(device)) / 2**30


def reset_peak(device: torch.device) -> None:
    """Free cached blocks and restart the peak count (CUDA)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    """Seconds fn takes, the device synchronised before and after."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def prompt(length: int, vocab: int, device: torch.device) -> torch.Tensor:
    """A random prompt (1, length) of ids below vocab (seeded by its length)."""
    generator = torch.Generator().manual_seed(length)
    return torch.randint(0, vocab, (1, length), generator=generator).to(device)


def measure_prefill(
    model: TTTTransformer, length: int, repeats: int, device: torch.device, graphs: bool = False
) -> dict:
    """ms_per_1k_tokens (median of repeats) and peak_gib of prefilling a random prompt of length tokens
    (graphs: `prefill(graphs=True)`, replaying the chunk shapes' graphs that the model keeps from the
    warm-up)."""
    tokens = prompt(length, model.cfg.vocab_size, device)
    seconds = []
    reset_peak(device)
    for _ in range(repeats):
        seconds.append(timed(lambda: prefill(model, tokens, graphs=graphs), device))
    return {"ms_per_1k_tokens": statistics.median(seconds) * 1e6 / length,
            "peak_gib": allocated_gib(device, peak=True)}  # fmt: skip


def measure_decode(
    model: TTTTransformer, context: int, steps: int, device: torch.device, graphs: bool = False
) -> dict:
    """tokens_per_s of `steps` greedy decode steps after a prefill of context tokens (graphs: by a
    `GraphedDecoder`, its graph built before the timing), peak_gib during them and state_gib, the memory
    the decode state holds beyond the weights."""
    weights = allocated_gib(device, peak=False)
    state, logits = prefill(model, prompt(context, model.cfg.vocab_size, device), graphs=graphs)
    state_gib = None if weights is None else allocated_gib(device, peak=False) - weights
    step = GraphedDecoder(state) if graphs else functools.partial(decode_step, state)
    token = logits[:, -1].argmax(-1)
    if graphs:
        token = step(token).argmax(-1)  # builds the graph once the caches are full
    reset_peak(device)

    def decode() -> None:
        nonlocal token
        for _ in range(steps):
            token = step(token).argmax(-1)

    seconds = timed(decode, device)
    peak = allocated_gib(device, peak=True)
    return {"tokens_per_s": steps / seconds, "decode_tokens": steps, "peak_gib": peak, "state_gib": state_gib}


def warm_up_length(model: TTTTransformer, length: int) -> int:
    """The warm-up prompt's length: length, and at least the window and two chunks (so that it closes a
    chunk whose caches hold the whole window: every chunk shape of a longer prompt occurs, and the
    graphed chunk step captures them all), rounded up to whole chunks (its first decode step takes a
    chunk's inner steps)."""
    chunk_len = model.ttt_cfg.chunk_len
    length = max(length, (model.cfg.window or 0) + 2 * chunk_len)
    return -(-length // chunk_len) * chunk_len


def candidates(mode: str) -> dict[str, tuple[str | None, SDPBackend | None]]:
    """The attention candidates of a mode: FULL_ATTENTION for full, the recipe's own otherwise."""
    return FULL_ATTENTION if mode == "full" else {"recipe": (None, None)}


def run_mode(
    mode: str, overrides: list[str], args: argparse.Namespace, device: torch.device
) -> Iterator[dict]:
    """The rows of one mode, each yielded once measured: every candidate's prefill at each length and
    decode after each context."""
    section = model_section(overrides)
    for name, (backend, kernel) in candidates(mode).items():
        mode_overrides = [*overrides, *(item.format(model=section) for item in MODES[mode])]
        if backend is not None:
            mode_overrides.append(f"{section}.attention={backend}")
        graphs = args.graphs and mode != "full"  # full attention's caches grow: no graphs
        base = {
            "mode": mode,
            "attention": name,
            "overrides": [o for o in mode_overrides if "recipe=" not in o],
            "graphs": graphs,
        }
        held = sdpa_kernel([kernel]) if kernel is not None else contextlib.nullcontext()
        model = build_model(mode_overrides, args.dtype, device)
        steps = args.decode_tokens or 2 * model.ttt_cfg.chunk_len
        plan = [("prefill", n) for n in args.lengths] + [("decode", n) for n in args.decode_after]
        with held:
            for index, (measure, tokens) in enumerate(plan):
                row = {**base, "measure": measure, "tokens": tokens}
                print(f"{mode}/{name}: {measure} {tokens} tokens", file=sys.stderr, flush=True)
                try:
                    if index == 0:  # warm-up: compilation, autotuning, the chunk step's graphs
                        measure_decode(model, warm_up_length(model, args.lengths[0]), 2, device, graphs)
                    if measure == "prefill":
                        measured = measure_prefill(model, tokens, args.repeats, device, graphs)
                        row.update(status="ok", **measured)
                    else:
                        row.update(status="ok", **measure_decode(model, tokens, steps, device, graphs))
                except Exception as err:  # noqa: BLE001 - each failure is a row; the next one runs
                    status = "oom" if is_out_of_memory(err) else "unsupported"
                    row.update(
                        status=status, error=str(err).splitlines()[0] if str(err) else type(err).__name__
                    )
                yield row
                reset_peak(device)
        del model
        reset_peak(device)


def same_measurement(a: dict, b: dict) -> bool:
    """Whether two rows measure the same thing (mode, measure, tokens), by rival candidates or alike."""
    return all(a[key] == b[key] for key in ("mode", "measure", "tokens"))


def mark_best(rows: list[dict]) -> list[dict]:
    """rows with best=True on the fastest ok candidate of each (mode, measure, tokens), False on the
    others."""
    speed = {"prefill": lambda row: -row["ms_per_1k_tokens"], "decode": lambda row: row["tokens_per_s"]}
    for row in rows:
        rivals = [r for r in rows if same_measurement(r, row)]
        ok = [r for r in rivals if r["status"] == "ok"]
        row["best"] = bool(ok) and row is max(ok, key=speed[row["measure"]])
    return rows


def goals(rows: list[dict]) -> dict:
    """The issue's goals from the best rows: prefill_speedup_vs_full (tokens -> full attention's ms per
    1K tokens of prefill / ttt's: >= 3 at 128K), ttt_prefill_cost_ratio (ttt's ms per 1K tokens at the
    longest length / at the shortest: flat within 15%), ttt_decode_rate_ratio (tokens/s after the
    longest context / after the shortest: flat within 10%), ttt_decode_peak_ratio (the decoding's peak
    memory, the same two: flat); None where a row is missing."""
    best = {(r["mode"], r["measure"], r["tokens"]): r for r in rows if r.get("best")}

    def ratio(top: tuple, bottom: tuple, key: str) -> float | None:
        a, b = best.get(top), best.get(bottom)
        return None if a is None or b is None or a.get(key) is None or not b.get(key) else a[key] / b[key]

    lengths = sorted({tokens for mode, measure, tokens in best if measure == "prefill" and mode == "ttt"})
    contexts = sorted({tokens for mode, measure, tokens in best if measure == "decode" and mode == "ttt"})
    prefill, decode = ("ttt", "prefill"), ("ttt", "decode")
    return {
        "prefill_speedup_vs_full": {
            n: ratio(("full", "prefill", n), (*prefill, n), "ms_per_1k_tokens") for n in lengths
        },
        "ttt_prefill_cost_ratio": ratio((*prefill, lengths[-1]), (*prefill, lengths[0]), "ms_per_1k_tokens")
        if lengths
        else None,
        "ttt_decode_rate_ratio": ratio((*decode, contexts[-1]), (*decode, contexts[0]), "tokens_per_s")
        if contexts
        else None,
        "ttt_decode_peak_ratio": ratio((*decode, contexts[-1]), (*decode, contexts[0]), "peak_gib")
        if contexts
        else None,
    }


def commit() -> str | None:
    """The repository's commit (with -dirty when the tree has changes), or None outside git."""
    try:
        command = ["git", "describe", "--always", "--dirty", "--abbrev=7"]
        described = subprocess.run(command, capture_output=True, text=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return described.stdout.strip() or None


def integers(text: str) -> list[int]:
    """A comma-separated list of positive ints (argparse type)."""
    values = [int(item) for item in text.split(",") if item]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive ints separated by commas, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m ttt.experiments.generation`; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m ttt.experiments.generation", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )  # fmt: skip
    parser.add_argument("overrides", nargs="+", help="recipe=NAME and key=value overrides")
    parser.add_argument("--lengths", type=integers, default=[8192, 32768, 131072], help="prefill lengths")
    parser.add_argument("--decode-after", type=integers, default=[8192, 131072], help="contexts of decoding")
    parser.add_argument("--decode-tokens", type=int, default=None, help="decode steps (2 x ttt.chunk_len)")
    parser.add_argument("--modes", default="ttt,full", help=f"comma-separated, of {list(MODES)}")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--repeats", type=int, default=3, help="timed prefills per length (median)")
    parser.add_argument("--out", help="append the JSON lines to this file")
    parser.add_argument("--tiny", action="store_true", help="a toy-size model on the CPU (tests the logic)")
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs (ttt.layers.graphed)")
    args = parser.parse_intermixed_args(argv)
    modes = args.modes.split(",")
    if [m for m in modes if m not in MODES] or args.repeats < 1 or (args.decode_tokens or 1) < 1:
        parser.error(
            f"--modes must be of {list(MODES)} (got {args.modes}), --repeats and --decode-tokens >= 1"
        )
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    args.dtype = torch.float32 if args.tiny else getattr(torch, args.dtype)
    overrides = list(args.overrides)
    if args.tiny:
        section = model_section(overrides)
        overrides += [item.format(model=section) for item in TINY]
        args.lengths, args.decode_after = [48, 96], [48, 96]
    context = {
        "recipe": load_config(overrides).recipe,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(args.dtype).removeprefix("torch."),
        "commit": commit(),
    }
    rows = []
    for mode in modes:
        for row in run_mode(mode, overrides, args, device):
            rows.append({**context, **row})
            emit(rows[-1], args.out)
    best = [{key: row[key] for key in ("mode", "attention", "measure", "tokens")}
            for row in mark_best(rows) if row["best"]]  # fmt: skip
    emit({**context, "summary": goals(rows), "best": best}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
