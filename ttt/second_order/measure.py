"""The cost of one Hessian-vector product through a whole `Transformer`, as a multiple of one gradient.

`measure_hvp(model, tokens, backend)` times and measures, on the model's next-token loss over all of
its parameters:
    grad   one forward and one first-order backward (torch.autograd.grad), what training pays anyway;
    hvp    `ttt.second_order.hvp` along a Rademacher vector: forward, differentiable backward and the
           backward-over-backward (FlashBoB kernels with backend "flashbob" on CUDA).
Each is called once to warm up (Triton compilation), then timed `repeats` times (median seconds, CUDA
synchronised). Peak memory: torch.cuda.max_memory_allocated over one call (reset just before; the
parameters and tokens are in it); off CUDA, the parameters plus the peak of
`ttt.experiments.memory_meters.LiveTensorMeter` over one untimed call. Out of memory is a status, not an
exception, so a sweep over growing contexts can record where each backend stops.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from ttt.experiments.memory_meters import LiveTensorMeter
from ttt.experiments.meta_step_probe import is_out_of_memory
from ttt.models.attention import AttentionBackend
from ttt.models.transformer import Attention, Transformer

from .hvp import hvp, module_loss_fn, rademacher_like

GIB = 2**30


@contextmanager
def attention_backend(model: Transformer, backend: str) -> Iterator[None]:
    """Run every attention layer of `model` through `backend` inside the block; restored after."""
    backend = AttentionBackend.parse(backend, "backend")
    configs = {id(m.cfg): m.cfg for m in model.modules() if isinstance(m, Attention)}
    previous = {key: cfg.attention for key, cfg in configs.items()}
    try:
        for cfg in configs.values():
            cfg.attention = backend
        yield
    finally:
        for key, cfg in configs.items():
            cfg.attention = previous[key]


def executed_attention(backend: str, device: torch.device) -> str:
    """What `backend` runs on `device`: "triton" (the FlashBoB kernels), "torch" or "sdpa_math"."""
    if backend == "sdpa_math":
        return "sdpa_math"
    return "triton" if backend == "flashbob" and device.type == "cuda" else "torch"


def next_token_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean float32 cross-entropy of logits (B, N, V) at positions 0..N-2 against tokens (B, N) at 1..N-1."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), tokens[:, 1:].flatten())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _seconds(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _peak_gib(fn: Callable[[], object], device: torch.device, resident_bytes: int) -> float:
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        _sync(device)
        return torch.cuda.max_memory_allocated(device) / GIB
    with LiveTensorMeter() as meter:
        fn()
    return (resident_bytes + meter.peak_bytes) / GIB


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def measure_hvp(
    model: Transformer, tokens: torch.Tensor, backend: str, *, repeats: int = 3, seed: int = 0
) -> dict:
    """Time and peak memory of one gradient and one HVP of `model`'s next-token loss on `tokens`.

    model: a `ttt.models.Transformer` (its parameters' device and dtype are used as they are).
    tokens: (B, N) int64 token ids on the model's device.
    backend: attention backend for this measurement ("flashbob", "eager", "sdpa_math").
    repeats: timed calls of each (after one warm-up call). seed: the Rademacher direction.
    Returns {"backend", "batch", "n_tokens", "status": "ok" | "oom" | "error", "error",
    "oom_in": None | "grad" | "hvp", "executes" (`executed_attention`), "grad_s", "hvp_s",
    "hvp_over_grad_s", "grad_peak_gib", "hvp_peak_gib", "hvp_over_grad_peak", "params_gib"};
    values that were not measured are None.
    """
    if not isinstance(model, Transformer):
        raise TypeError(f"model must be a ttt.models.Transformer, got {type(model).__name__}")
    backend = AttentionBackend.parse(backend, "backend")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be a positive int, got {repeats!r}")
    device = next(model.parameters()).device
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype != torch.long:
        raise ValueError(
            f"tokens must be a (batch, seq) int64 tensor, got {getattr(tokens, 'shape', tokens)}"
        )
    if tokens.device != device:
        raise ValueError(f"tokens must be on the model's device {device}, got {tokens.device}")
    loss_fn, params = module_loss_fn(model, ["*"], tokens, next_token_loss)
    params = {key: p for key, p in params.items() if p.requires_grad}
    generator = torch.Generator(device=device).manual_seed(seed)
    vector = {key: rademacher_like(p, generator) for key, p in params.items()}
    resident = (
        sum(p.numel() * p.element_size() for p in model.parameters()) + tokens.numel() * tokens.element_size()
    )

    def gradient() -> None:
        leaves = {key: p.detach().requires_grad_(True) for key, p in params.items()}
        torch.autograd.grad(loss_fn(leaves), tuple(leaves.values()))

    def product() -> None:
        hvp(loss_fn, params, vector)

    row = {
        "backend": backend,
        "batch": tokens.shape[0],
        "n_tokens": tokens.shape[1],
        "status": "ok",
        "error": "",
        "oom_in": None,
        "executes": executed_attention(backend, device),
        "params_gib": resident / GIB,
        **dict.fromkeys(
            ("grad_s", "hvp_s", "hvp_over_grad_s", "grad_peak_gib", "hvp_peak_gib", "hvp_over_grad_peak")
        ),
    }
    stage = "grad"
    try:
        with attention_backend(model, backend):
            for stage, fn in (("grad", gradient), ("hvp", product)):
                fn()
                row[f"{stage}_peak_gib"] = _peak_gib(fn, device, resident)
                row[f"{stage}_s"] = _seconds(fn, device, repeats)
                _release(device)
    except Exception as err:
        if not is_out_of_memory(err):
            row.update(status="error", error=f"{type(err).__name__}: {err}")
        else:
            row.update(status="oom", oom_in=stage)
    _release(device)
    if row["hvp_s"] is not None:
        row["hvp_over_grad_s"] = row["hvp_s"] / row["grad_s"]
        row["hvp_over_grad_peak"] = row["hvp_peak_gib"] / row["grad_peak_gib"]
    return row


def sweep_contexts(
    model: Transformer,
    contexts: list[int],
    backends: list[str],
    *,
    batch: int = 1,
    repeats: int = 3,
    seed: int = 0,
    on_row: Callable[[dict], None] | None = None,
) -> list[dict]:
    """`measure_hvp` for every backend at every context length (ascending), on random tokens.

    contexts: sequence lengths N; each point reads tokens (batch, N) drawn with `seed`.
    After a backend runs out of memory at some N, its longer contexts are not run: their rows have
    status "skipped" and error "oom at N=...". on_row: called with each row as it is measured.
    Returns the rows in (N, backend) order.
    """
    device = next(model.parameters()).device
    vocab = model.cfg.vocab_size
    stopped: dict[str, int] = {}
    rows = []
    for n in sorted(contexts):
        tokens = torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed)).to(device)
        for backend in backends:
            if backend in stopped:
                row = {"backend": backend, "batch": batch, "n_tokens": n, "status": "skipped"}
                row["error"] = f"oom at N={stopped[backend]}"
            else:
                row = measure_hvp(model, tokens, backend, repeats=repeats, seed=seed)
                if row["status"] == "oom":
                    stopped[backend] = n
            rows.append(row)
            if on_row is not None:
                on_row(row)
    return rows
