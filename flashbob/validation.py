"""Argument checks shared by the public entry points: every bad input fails here, by name."""

from __future__ import annotations

import math
import os

import torch

BACKENDS = ("auto", "triton", "torch")
TRITON_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TORCH_DTYPES = (*TRITON_DTYPES, torch.float64)
MIN_HEAD_DIM, MAX_HEAD_DIM = 8, 256
INTERPRETER_WRONG_DTYPES = (torch.bfloat16,)
"""Dtypes that Triton's CPU interpreter computes wrongly (triton 3.6: bf16 gives values near 8e8 where
the answer is near 3.5); refused there, fine on CUDA."""
FP32_PRECISIONS = ("ieee", "tf32x3", "tf32")
DEFAULT_FP32_PRECISION = "tf32x3"
"""The products of float32 inputs on the Triton path (fp32_precision=None): three TF32 products of hi
and lo parts. On an H200 their error is at or below plain PyTorch float32's, and they run many times
faster than IEEE products, which lose to them in error too (docs/notes/kernel_notes.md, "Calibration of the
launch settings")."""


def triton_interpreter_enabled() -> bool:
    """True when Triton's CPU interpreter is switched on (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on")


def check_attention_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    window: int | None,
    scale: float | None,
    backend: str,
) -> tuple[float, str]:
    """Validate q (B, Hq, N, D), k and v (B, Hkv, M, D) and the options.

    Returns (scale, backend) with the defaults resolved: scale = D ** -0.5 and "auto" mapped to
    "triton" for CUDA tensors and "torch" otherwise. Raises TypeError or ValueError naming the
    offending argument and the expected value.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seq, head_dim), got shape {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    batch, heads_q, n_queries, head_dim = q.shape
    if k.shape[0] != batch:
        raise ValueError(f"k and v must have batch {batch} like q, got {k.shape[0]}")
    if k.shape[3] != head_dim:
        raise ValueError(f"k and v must have head_dim {head_dim} like q, got {k.shape[3]}")
    heads_kv = k.shape[1]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(
            f"q heads ({heads_q}) must be a multiple of k/v heads ({heads_kv}) for grouped-query attention"
        )
    if n_queries == 0 or k.shape[2] == 0:
        raise ValueError(f"q and k need at least one position, got N={n_queries}, M={k.shape[2]}")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}], got {head_dim}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {causal!r}")
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if not causal:
            raise ValueError("window requires causal=True (a sliding window looks back from each query)")
    if scale is None:
        scale = head_dim**-0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < scale < math.inf):
        raise ValueError(f"scale must be a positive finite float or None, got {scale!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "torch"
    if backend == "torch" and q.dtype not in TORCH_DTYPES:
        raise TypeError(f"backend='torch' supports dtypes {TORCH_DTYPES}, got {q.dtype}")
    if backend == "triton":
        if q.dtype not in TRITON_DTYPES:
            raise TypeError(f"backend='triton' supports dtypes {TRITON_DTYPES}, got {q.dtype}")
        if not q.is_cuda and not (q.device.type == "cpu" and triton_interpreter_enabled()):
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1 set before "
                f"flashbob is imported), got device {q.device}; use backend='torch' on the CPU"
            )
        if q.device.type == "cpu" and q.dtype in INTERPRETER_WRONG_DTYPES:
            raise TypeError(
                f"backend='triton' with {q.dtype} inputs on the CPU runs in Triton's interpreter "
                "(TRITON_INTERPRET=1), whose bfloat16 arithmetic is wrong (results off by orders of "
                "magnitude, silently); use float16 or float32 inputs there, or backend='torch'"
            )
    return float(scale), backend


def check_like(name: str, t: torch.Tensor | None, like: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Check that an extra stage input (dout, out, cotangent, ...) has the expected shape, dtype, device."""
    if t is None:
        return
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(t.shape)}")
    if t.device != like.device:
        raise ValueError(f"{name} must be on {like.device}, got {t.device}")
    if t.dtype != like.dtype:
        raise TypeError(f"{name} must have dtype {like.dtype}, got {t.dtype}")


def check_fp32_precision(fp32_precision: str | None) -> str:
    """The matrix products of float32 inputs on the Triton path; None means DEFAULT_FP32_PRECISION.

    "ieee": full float32 products on the CUDA cores (no tensor cores): about 1.4x plain PyTorch
      float32's error, 4-7x slower than "tf32x3" and the slowest to compile (42-75 s on the H200).
    "tf32x3" (the default): each product as three tensor-core TF32 products (high*high + high*low +
      low*high parts of the operands): 1.0-1.3x PyTorch float32's error at N=4096 (2.3x at N=17,
      where PyTorch's sums are short), about 3x the tensor-core work of "tf32"; at head dim 128 its
      BoB runs on small tiles (its split operands need more shared memory), 24 ms at N=4096 on the
      H200 (8.5 ms at head dim 64).
    "tf32": one TF32 product (10-bit mantissas): fastest, about 1e-3 relative error.
    Ignored for float16 and bfloat16 inputs, whose products are always native tensor-core ones.
    """
    if fp32_precision is None:
        return DEFAULT_FP32_PRECISION
    if fp32_precision not in FP32_PRECISIONS:
        raise ValueError(f"fp32_precision must be one of {FP32_PRECISIONS} or None, got {fp32_precision!r}")
    return fp32_precision


def check_key_range(
    key_start: torch.Tensor | None, key_end: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor
) -> torch.Tensor | None:
    """Per-batch-row key ranges: batch row b sees keys key_start[b] <= j < key_end[b] only.

    key_start, key_end: (B,) integer tensors on q's device, or None (0 and M). Both None means no
    ranges: returns None. Otherwise returns key_range (B, 2) int32 [start, end). Raises TypeError or
    ValueError naming the argument; the values (0 <= key_start <= key_end <= M) are checked wherever
    they can be read (not inside torch.compile or on a vmapped range tensor, where the kernels clip
    them to [0, M) instead).
    """
    if key_start is None and key_end is None:
        return None
    batch, n_keys = q.shape[0], k.shape[2]
    bounds = []
    for name, t, default in (("key_start", key_start, 0), ("key_end", key_end, n_keys)):
        if t is None:
            t = torch.full((batch,), default, dtype=torch.int32, device=q.device)
        elif not isinstance(t, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor of shape ({batch},) or None, got {type(t).__name__}"
            )
        elif t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TypeError(f"{name} must have an integer dtype (torch.int32 or torch.int64), got {t.dtype}")
        elif tuple(t.shape) != (batch,):
            raise ValueError(
                f"{name} must have shape ({batch},) (one entry per batch row), got {tuple(t.shape)}"
            )
        elif t.device != q.device:
            raise ValueError(f"{name} must be on {q.device} like q, got {t.device}")
        bounds.append(t)
    key_range = torch.stack((bounds[0].to(torch.int64), bounds[1].to(torch.int64)), dim=-1)
    if _values_readable(key_range):
        start, end = key_range.unbind(-1)
        bad_start, bad_end = torch.stack(
            ((start < 0) | (start > n_keys), (end < start) | (end > n_keys))
        ).any(-1).tolist()  # one device sync for all four checks
        if bad_start:
            raise ValueError(f"key_start must be in [0, M={n_keys}], got {start.tolist()}")
        if bad_end:
            raise ValueError(f"key_end must be in [key_start, M={n_keys}], got key_end {end.tolist()} "
                             f"for key_start {start.tolist()}")
    return key_range.to(torch.int32)


def _values_readable(t: torch.Tensor) -> bool:
    """Whether reading t's values is allowed here: not while torch.compile traces, not when t is
    vmapped by torch.func at any level (under grad transforms it is wrapped once per level)."""
    if torch.compiler.is_compiling():
        return False
    functorch = torch._C._functorch
    while functorch.is_functorch_wrapped_tensor(t):
        if functorch.is_batchedtensor(t):
            return False
        t = functorch.get_unwrapped(t)
    return True
