"""Inner-loop gradient memory: what one full meta step costs, per attention backend, as N and k grow.

    python -m ttt.experiments.grad_memory [key=value ...]       # keys: ttt.experiments.grad_memory_config

For each point (backend, N, k, first/second order, inner-step checkpointing) it runs one full meta
step of a workload (`workloads`: the maml_longctx transformer with adapted MLPs, or TTT-E2E) through
`meta_step_probe` and records peak memory, bytes saved for backward, the back-of-envelope predictions
of both (`memory_model`), wall time, and whether it ran out of memory. The first point of each
(backend, order) pair also runs a warm-up step (compilation), timed apart. Unattended runs are safe:
a failed point is recorded (oom / timeout / error) and the larger points of its series (same backend,
order and checkpointing, N and k at least as large) are skipped; results.csv is rewritten after every
point; points that would start after `max_minutes`, or whose expected time (`expected_seconds`)
exceeds what is left of it, are skipped. At the end: table.md, results.json,
environment.json (written first) and the plots.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from ttt.inner import select_parameters
from ttt.models import Transformer, TransformerConfig
from ttt.ttt_layers import TTTConfig

from . import grad_memory_report as report
from .environment import describe
from .grad_memory_config import SWEEPS, GradMemoryConfig, load
from .memory_model import ModelDims, predicted_bytes, predicted_peak_bytes
from .meta_step_probe import GIB, measure
from .workloads import DEFAULT_ADAPTED, Point, ProbeSetup

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sweep_points(cfg: GradMemoryConfig) -> list[Point]:
    """The points of the sweeps in SWEEPS order, without repeats; within a sweep, per backend, order and
    checkpointing, N then k ascending (so that a failure can skip what follows)."""
    points: dict[Point, None] = {}
    for sweep in (getattr(cfg, name) for name in SWEEPS):
        for backend in cfg.backends:
            for order in sweep.orders:
                for ckpt in sweep.checkpoint:
                    for n in sorted(sweep.ns):
                        for k in sorted(sweep.ks):
                            points.setdefault(Point(backend, n, k, order, ckpt))
    return list(points)


def blocked_by(point: Point, failed: list[Point]) -> Point | None:
    """A failed point of the same series with N and k no larger than `point`'s, if any."""
    for bad in failed:
        same = (bad.backend, bad.order, bad.checkpoint) == (point.backend, point.order, point.checkpoint)
        if same and bad.n <= point.n and bad.k <= point.k:
            return bad
    return None


def expected_seconds(point: Point, rows: list[dict]) -> float:
    """A pessimistic guess of the point's step time from the largest measured point of its series below
    it: time grows as N^2 (attention) and as k + 1 (graphs); 0 when nothing is known."""
    below = [
        r
        for r in rows
        if r["status"] == "ok"
        and r["seconds"]
        and (r["backend"], r["order"], r["checkpoint"]) == (point.backend, point.order, point.checkpoint)
        and r["n"] <= point.n
        and r["k"] <= point.k
    ]
    if not below:
        return 0.0
    ref = max(below, key=lambda r: (r["n"], r["k"]))
    return ref["seconds"] * (point.n / ref["n"]) ** 2 * (point.k + 1) / (ref["k"] + 1)


def resolve(cfg: GradMemoryConfig) -> ProbeSetup:
    """The fixed part of every point: model config, adapted parameters, device and dtype (auto resolved)."""
    if cfg.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(cfg.device)
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bf16" if device.type == "cuda" else "fp32")
    model = TransformerConfig(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        window=cfg.window,
    )
    adapted = list(cfg.adapted or DEFAULT_ADAPTED[cfg.workload])
    ttt = TTTConfig(suffix_len=cfg.suffix_len, chunk_len=cfg.chunk_len)
    return ProbeSetup(model, adapted, cfg.inner_lr, device, DTYPES[dtype], cfg.seed, cfg.workload, ttt)


def predictor(setup: ProbeSetup):
    """point -> {"predicted_gib": saved graphs, "predicted_peak_gib": plus the transients} from
    `memory_model` for the sweep's model (built on the meta device: no memory); None values where the
    model does not apply (ttt_e2e, a sliding window)."""
    if setup.workload != "maml" or setup.model.window is not None:
        return lambda point: {"predicted_gib": None, "predicted_peak_gib": None}
    with torch.device("meta"):
        model = Transformer(setup.model).to(setup.dtype)
    dims = ModelDims.of(model, list(select_parameters(model, setup.adapted)))
    elem = torch.empty((), dtype=setup.dtype).element_size()

    def predict(point: Point) -> dict:
        backend = executed_backend(point.backend, setup.device)
        options = dict(n=point.n, k=point.k, order=point.order, checkpoint=point.checkpoint)
        return {
            "predicted_gib": predicted_bytes(dims, backend, elem, **options) / GIB,
            "predicted_peak_gib": predicted_peak_bytes(dims, backend, elem, **options) / GIB,
        }

    return predict


def summary(setup: ProbeSetup) -> str:
    """One line naming the workload, the model and the adapted parameters."""
    m = setup.model
    text = (
        f"{setup.workload}: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads of {m.head_dim}, "
        f"{'full causal' if m.window is None else f'window {m.window}'}, vocab {m.vocab_size}, "
        f"{str(setup.dtype).removeprefix('torch.')}, batch 1, adapted {setup.adapted}, "
        f"inner SGD lr {setup.inner_lr}"
    )
    if setup.workload == "ttt_e2e":
        text += f", chunks of {setup.ttt.chunk_len}, suffix of {setup.ttt.suffix_len} block(s)"
    return text


def executed_backend(backend: str, device: torch.device) -> str:
    """The attention code that actually runs: flashbob is the plain-PyTorch (eager) path off CUDA."""
    return "eager" if backend == "flashbob" and device.type != "cuda" else backend


def run(cfg: GradMemoryConfig) -> list[dict]:
    """Measure every point of `cfg`, writing the outputs under cfg.out as it goes; returns the rows."""
    setup = resolve(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    env = {
        **describe(setup.device),
        "dtype": str(setup.dtype).removeprefix("torch."),
        "setup": summary(setup),
    }
    report.write_atomic(out / "environment.json", json.dumps(env, indent=1) + "\n")
    predict = predictor(setup)
    points = sweep_points(cfg)
    print(
        f"grad_memory: {len(points)} points on {env['device']} ({env['dtype']}); writing {out}/", flush=True
    )
    rows, failed, warmed = [], {}, set()
    start = time.perf_counter()
    for point in points:
        row = {**vars(point), "error": "", **dict.fromkeys(report.MEASURED), **predict(point)}
        left_s = cfg.max_minutes * 60 - (time.perf_counter() - start)
        bad = blocked_by(point, list(failed))
        if bad is not None:
            row["status"] = f"skipped ({failed[bad]} at N={bad.n}, k={bad.k})"
        elif left_s <= 0 or expected_seconds(point, rows) > left_s:
            row["status"] = "skipped (budget)"
        else:
            limit = left_s if cfg.point_time_limit_s is None else min(left_s, cfg.point_time_limit_s)
            warmup = (point.backend, point.order) not in warmed
            row.update(measure(setup, point, time_limit_s=limit, warmup=warmup, warmup_limit_s=left_s))
            if row["status"] == "ok":
                warmed.add((point.backend, point.order))
            else:
                failed[point] = row["status"]
        rows.append(row)
        print(report.progress_line(row), flush=True)
        report.write_atomic(out / "results.csv", report.csv_text(rows))
    report.write_atomic(out / "results.json", json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    report.render(rows, env, out)
    print("\n".join(report.headline(rows)))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse key=value overrides, run the sweep; 2 on a bad override."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        print("Keys (key=value; each is documented in ttt/experiments/grad_memory_config.py):")
        for field in dataclasses.fields(GradMemoryConfig):
            default = "" if field.default is dataclasses.MISSING else f" = {field.default!r}"
            print(f"  {field.name}{default}")
        return 0
    try:
        cfg = load(argv, cuda_available=torch.cuda.is_available())
    except ValueError as err:
        print(f"grad_memory: {err}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    try:
        run(cfg)
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
