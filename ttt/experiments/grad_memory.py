"""Inner-loop gradient memory: what one full meta step costs, per attention backend, as N and k grow.

    python -m ttt.experiments.grad_memory [key=value ...]      # --help lists the keys; docs/grad_memory.md

For each point (backend, N, k, first/second order, inner-step checkpointing) it runs one full meta step
of a workload (`workloads`: the maml_longctx transformer with adapted MLPs, or TTT-E2E; or, with
workload=hvp, one Hessian-vector product of a transformer's loss and the gradient it is compared with)
through `meta_step_probe` and records peak memory, bytes saved for backward, the back-of-envelope
predictions of both (`gpu_memory_model`), wall time, and whether it ran out of memory. The first point of
each (backend, order) pair also runs a warm-up step (compilation), timed apart. A failed point is
recorded (oom / error) and the larger points of its series (same backend, order and checkpointing, N and
k at least as large) are skipped; no point starts after `max_minutes`; results.csv is rewritten after
every point. environment.json is written first; results.json, table.md and the plots at the end.

The defaults are the GPU experiment; preset=cpu (chosen by preset=auto without CUDA) applies
grad_memory_cpu.yaml, a seconds-long run; key=value overrides apply on top of the preset.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from omegaconf import OmegaConf

from flashbob.environment import describe
from ttt.config.choice import Choice
from ttt.config.loading import ConfigError, load_structured, parse_overrides
from ttt.inner import select_parameters
from ttt.layers import TTTConfig
from ttt.models import Transformer, TransformerConfig
from ttt.models.attention import ATTENTION_BACKENDS, AttentionBackend
from ttt.tracking.atomic import atomic_write_text

from . import grad_memory_report as report
from .gpu_memory_model import ModelDims, predicted_bytes, predicted_peak_bytes
from .meta_step_probe import GIB, measure
from .workloads import DEFAULT_ADAPTED, Order, Point, ProbeSetup, Workload

CPU_PRESET = Path(__file__).with_name("grad_memory_cpu.yaml")
"""The overrides of preset=cpu."""
SWEEPS = ("n_sweep", "checkpointed", "first_order", "k_sweep")
"""The grids, in the order they run (the most important first, in case max_minutes runs out)."""


class Preset(Choice):
    """preset."""

    auto = "auto"
    cpu = "cpu"
    gpu = "gpu"


class Device(Choice):
    """device."""

    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Dtype(Choice):
    """dtype."""

    auto = "auto"
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Sweep:
    """A grid: every backend x order x checkpoint x n x k."""

    ns: list[int] = field(default_factory=list)
    """Sequence lengths (tokens)."""
    ks: list[int] = field(default_factory=lambda: [1])
    """Inner steps."""
    orders: list[Order] = field(default_factory=lambda: [Order.second])
    """first and/or second (order of the meta-gradient)."""
    checkpoint: list[bool] = field(default_factory=lambda: [False])
    """Inner-step checkpointing off and/or on."""


@dataclass
class GradMemoryConfig:
    """The experiment: model, inner loop, the four grids, the time budget and where the results go."""

    preset: Preset = Preset.auto
    """gpu (the defaults below), cpu (grad_memory_cpu.yaml: a tiny run), or auto: gpu when CUDA is
    available, else cpu."""
    out: str = "grad_memory_out"
    """Output directory: results.csv, results.json, table.md, environment.json and the plots."""
    device: Device = Device.auto
    """cuda, cpu, or auto (cuda when available)."""
    dtype: Dtype = Dtype.auto
    """Parameter dtype: bf16, fp16, fp32, or auto (bf16 on CUDA, fp32 on the CPU)."""
    workload: Workload = Workload.maml
    """maml (the maml_longctx transformer, k inner steps on a whole sequence), ttt_e2e (TTT-E2E:
    fast-weight MLPs in the last suffix_len blocks, k inner steps per chunk of chunk_len tokens) or hvp
    (one Hessian-vector product of the next-token loss over every parameter, and the gradient it is
    compared with: only n_sweep.ns is used, each N as order first = gradient and second = HVP) or
    neural_memory (ttt.layers.neural_memory, memory as context, in the last suffix_len blocks, written once
    per chunk
    of chunk_len tokens; k is the memory MLP's depth)."""
    window: int | None = None
    """Sliding attention window; null: full causal attention (what the memory model assumes)."""
    chunk_len: int = 1024
    """ttt_e2e, neural_memory: tokens per chunk."""
    suffix_len: int = 1
    """ttt_e2e, neural_memory: blocks read chunk by chunk, with fast weights (or a memory)."""
    d_model: int = 512
    """Width of the residual stream."""
    n_layers: int = 2
    """Transformer blocks."""
    n_heads: int = 8
    """Attention heads."""
    head_dim: int = 64
    """Width of one head."""
    n_kv_heads: int | None = None
    """Key/value heads (grouped-query attention); null: n_heads."""
    d_ff: int | None = None
    """SwiGLU hidden width; null: 8/3 d_model rounded up to a multiple of 32."""
    tie_embeddings: bool = False
    """Use the embedding matrix as the output head."""
    fused_ops: bool = True
    """The model's fused RMSNorm, SwiGLU and RoPE ops (model.fused_ops); false: the plain PyTorch ops."""
    vocab_size: int = 256
    """Vocabulary (the tokens are random)."""
    adapted: list[str] | None = None
    """Glob patterns of the parameters the inner loop adapts; null: every MLP (maml; what the memory
    model assumes) or the suffix blocks' extra MLPs (ttt_e2e)."""
    inner_lr: float = 0.01
    """Inner SGD learning rate."""
    backends: list[AttentionBackend] = field(
        default_factory=lambda: [AttentionBackend(name) for name in ATTENTION_BACKENDS]
    )
    """Attention backends to measure (default: those with second derivatives, all but sdpa and sdpa_cudnn)."""
    n_sweep: Sweep = field(
        default_factory=lambda: Sweep(ns=[1024, 4096, 16384, 32768, 65536, 131072, 262144, 524288], ks=[1, 2])
    )
    """Memory and time against N."""
    k_sweep: Sweep = field(
        default_factory=lambda: Sweep(ns=[16384, 131072], ks=[1, 2, 4, 8], checkpoint=[False, True])
    )
    """Memory and time against k."""
    first_order: Sweep = field(
        default_factory=lambda: Sweep(ns=[16384, 262144], ks=[2], orders=[Order.first])
    )
    """First-order MAML at a few N."""
    checkpointed: Sweep = field(
        default_factory=lambda: Sweep(ns=[16384, 65536, 262144, 524288], ks=[2], checkpoint=[True])
    )
    """Checkpointed inner steps at a few N (beyond where the stored graphs fit)."""
    max_minutes: float = 5.0
    """Budget of the sweep: points that would start later are skipped (a running point is not stopped)."""
    seed: int = 0
    """Seed of the weights and tokens."""
    cpu_threads: int | None = None
    """torch's CPU threads for the run (null: torch's default); the cpu preset uses 1, which on a shared
    machine is many times faster than threads that wait for each other."""

    def __post_init__(self):
        for name in SWEEPS:
            sweep = getattr(self, name)
            if any(n < 2 for n in sweep.ns) or any(k < 1 for k in sweep.ks):
                raise ValueError(f"{name}: ns must be >= 2 and ks >= 1, got {sweep.ns} and {sweep.ks}")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads must be >= 1 or null, got {self.cpu_threads}")
        if self.max_minutes <= 0:
            raise ValueError(f"max_minutes must be > 0, got {self.max_minutes}")


def load(overrides: list[str], *, cuda_available: bool) -> GradMemoryConfig:
    """The config of `overrides` ("key=value") on top of the preset they choose (ConfigError naming a bad
    key or value, with the valid keys or values)."""
    cli = parse_overrides(overrides)
    preset = Preset.parse(cli.pop("preset", "auto"), "preset")
    if preset == Preset.auto:
        preset = Preset.gpu if cuda_available else Preset.cpu
    layers = [(OmegaConf.create({"preset": preset.value}), "preset")]
    if preset == Preset.cpu:
        layers.append((OmegaConf.load(CPU_PRESET), str(CPU_PRESET)))
    return load_structured(GradMemoryConfig, [*layers, (cli, "command line")])


def sweep_points(cfg: GradMemoryConfig) -> list[Point]:
    """The points of the sweeps in SWEEPS order, without repeats; within a sweep, per backend, order and
    checkpointing, N then k ascending (so that a failure can skip what follows). workload=hvp: per
    backend, the gradient (order first) then the HVP (second) at every N of n_sweep, k=1, no
    checkpointing."""
    if cfg.workload == Workload.hvp:
        orders = (Order.first, Order.second)
        return [
            Point(b, n, 1, o, False) for b in cfg.backends for o in orders for n in sorted(cfg.n_sweep.ns)
        ]
    points: dict[Point, None] = {}
    for sweep in (getattr(cfg, name) for name in SWEEPS):
        for backend in cfg.backends:
            for order in sweep.orders:
                for ckpt in sweep.checkpoint:
                    for n in sorted(sweep.ns):
                        for k in sorted(sweep.ks):
                            points.setdefault(Point(backend, n, k, order, ckpt))
    return list(points)


def blocked_by(point: Point, failed: dict[Point, str]) -> str | None:
    """Why `point` is skipped: a failed point of its series with N and k no larger than its own, if any."""
    for bad, status in failed.items():
        same = (bad.backend, bad.order, bad.checkpoint) == (point.backend, point.order, point.checkpoint)
        if same and bad.n <= point.n and bad.k <= point.k:
            return f"skipped ({status} at N={bad.n}, k={bad.k})"
    return None


def resolve(cfg: GradMemoryConfig) -> ProbeSetup:
    """The fixed part of every point: model config, adapted parameters, device and dtype (auto resolved)."""
    cuda = torch.cuda.is_available() if cfg.device == Device.auto else cfg.device == Device.cuda
    device = torch.device("cuda" if cuda else "cpu")
    dtype = cfg.dtype.value if cfg.dtype != Dtype.auto else ("bf16" if cuda else "fp32")
    model = TransformerConfig(
        vocab_size=cfg.vocab_size,
        d_model=cfg.d_model,
        n_layers=cfg.n_layers,
        n_heads=cfg.n_heads,
        head_dim=cfg.head_dim,
        n_kv_heads=cfg.n_kv_heads,
        d_ff=cfg.d_ff,
        tie_embeddings=cfg.tie_embeddings,
        window=cfg.window,
        fused_ops=cfg.fused_ops,
    )
    adapted = list(cfg.adapted or DEFAULT_ADAPTED[cfg.workload])
    ttt = TTTConfig(suffix_len=cfg.suffix_len, chunk_len=cfg.chunk_len)
    return ProbeSetup(model, adapted, cfg.inner_lr, device, TORCH_DTYPES[dtype], cfg.seed, cfg.workload, ttt)


def executed_backend(backend: str, device: torch.device) -> str:
    """The attention code that actually runs: flashbob is the plain-PyTorch (eager) path off CUDA."""
    return "eager" if backend == "flashbob" and device.type != "cuda" else backend


def predictor(setup: ProbeSetup):
    """point -> {"predicted_gib": saved graphs, "predicted_peak_gib": plus the transients} from
    `gpu_memory_model` for the sweep's model (built on the meta device: no memory); None values where the
    model does not apply (ttt_e2e, a sliding window)."""
    if setup.workload != Workload.maml or setup.model.window is not None:
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
    m = setup.model.resolved()
    text = (
        f"{setup.workload}: {m.n_layers} layers, d_model {m.d_model}, {m.n_heads} heads "
        f"({m.n_kv_heads} key/value) of {m.head_dim}, d_ff {m.d_ff}"
        f"{', tied embeddings' if m.tie_embeddings else ''}{'' if m.fused_ops else ', plain (unfused) ops'}, "
        f"{'full causal' if m.window is None else f'window {m.window}'}, vocab {m.vocab_size}, "
        f"{str(setup.dtype).removeprefix('torch.')}, batch 1, "
    )
    if setup.workload == Workload.hvp:
        return text + "next-token loss over every parameter: gradient (order first) and HVP (second)"
    text += f"adapted {setup.adapted}, inner SGD lr {setup.inner_lr}"
    if setup.workload == Workload.ttt_e2e:
        text += f", chunks of {setup.ttt.chunk_len}, suffix of {setup.ttt.suffix_len} block(s)"
    return text


def run(cfg: GradMemoryConfig, args: list[str] | None = None) -> list[dict]:
    """Measure every point of `cfg`, writing the outputs under cfg.out as it goes; returns the rows.
    args: the command line's overrides, for the record (None: sys.argv's)."""
    setup = resolve(cfg)
    out = Path(cfg.out)
    env = {
        **describe(setup.device, "ttt.experiments.grad_memory", args),
        "dtype": str(setup.dtype).removeprefix("torch."),
        "workload": str(setup.workload),
        "setup": summary(setup),
    }
    atomic_write_text(out / "environment.json", json.dumps(env, indent=1) + "\n")
    predict = predictor(setup)
    points = sweep_points(cfg)
    where = f"{env['device']} ({env['dtype']})"
    print(f"grad_memory: {len(points)} points on {where}; writing {out}/", flush=True)
    rows, failed, warmed = [], {}, set()
    deadline = time.monotonic() + cfg.max_minutes * 60
    for point in points:
        row = {**dataclasses.asdict(point), "error": "", **dict.fromkeys(report.MEASURED), **predict(point)}
        skipped = blocked_by(point, failed)
        if skipped is None and time.monotonic() > deadline:
            skipped = "skipped (budget)"
        if skipped is not None:
            row["status"] = skipped
        else:
            row.update(measure(setup, point, warmup=(point.backend, point.order) not in warmed))
            if row["status"] == "ok":
                warmed.add((point.backend, point.order))
            else:
                failed[point] = row["status"]
        rows.append(row)
        print(report.progress_line(row), flush=True)
        atomic_write_text(out / "results.csv", report.csv_text(rows))
    atomic_write_text(out / "results.json", json.dumps({"environment": env, "rows": rows}, indent=1) + "\n")
    report.render(rows, env, out)
    print("\n".join(report.headline(rows, env)))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Entry point: parse key=value overrides, run the sweep; 2 on a bad override."""
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        print(__doc__)
        print("Keys (key=value; each is documented in ttt/experiments/grad_memory.py, GradMemoryConfig):")
        for item in dataclasses.fields(GradMemoryConfig):
            default = "" if item.default is dataclasses.MISSING else f" = {item.default}"
            print(f"  {item.name}{default}")
        return 0
    try:
        cfg = load(argv, cuda_available=torch.cuda.is_available())
    except (ConfigError, ValueError) as err:
        print(f"grad_memory: {err}", file=sys.stderr)
        return 2
    threads = torch.get_num_threads()
    if cfg.cpu_threads is not None:
        torch.set_num_threads(cfg.cpu_threads)
    try:
        run(cfg, argv)
    finally:
        torch.set_num_threads(threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
