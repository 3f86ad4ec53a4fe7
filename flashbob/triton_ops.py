"""Launchers of the Triton kernels: check layouts, allocate outputs, pick tiles, launch.

Each stage (forward, first backward, backward-over-backward, forward with tangent) is one function
taking and returning plain tensors; `flashbob.autograd` chains them. Inputs need unit stride in the
head dimension (other strides are passed through, so transposed (B, N, H, D) views need no copy).
Each stage's launches are recorded on its first call with a given input layout and replayed on later
ones (`flashbob.launch_plans`): a stage first normalizes its inputs and allocates its outputs, and
every buffer it allocates after that is scratch.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import triton

from . import hopper, launch_plans, tiling
from ._backward import attention_backward_dkdv_kernel, attention_backward_dq_kernel, row_dot_kernel
from ._bob import attention_bob_cols_kernel, attention_bob_rows_kernel
from ._forward import (
    attention_forward_combine_kernel,
    attention_forward_kernel,
    attention_forward_split_kernel,
)
from ._jvp import attention_jvp_kernel
from ._tiles import LOG2E
from .validation import check_fp32_precision

POISON_OUTPUTS = False
"""Tests set this to fill every buffer a launcher allocates with NaN, so an unwritten element shows."""
_COMPILING_ONLY = contextvars.ContextVar("flashbob_compiling_only", default=False)


@contextlib.contextmanager
def compiling_only():
    """Within the block (this thread only), the launchers compile the kernels they would launch
    instead of launching them: `JITFunction.warmup` takes Triton's launch path up to its cache key
    (the same specialization and options as the launch), with the settings `tiling.choose` gives,
    which `tiling.launch` tries first. Outputs are allocated but never written, and no setting is
    remembered. Under Triton's AsyncCompileMode the compiles go to its executor
    (`flashbob.precompile`)."""
    token = _COMPILING_ONLY.set(True)
    try:
        yield
    finally:
        _COMPILING_ONLY.reset(token)


def _start(kernel, grid):
    """kernel[grid], the launch (recorded while a launch plan records); under `compiling_only` its
    compile."""
    if _COMPILING_ONLY.get():
        return functools.partial(kernel.warmup, grid=grid)
    return launch_plans.start(kernel, grid)


def _launch(kernel: str, q: torch.Tensor, run, **flags) -> None:
    """tiling.launch(kernel, q, run, **flags); under `compiling_only` run(tiling.choose(...))."""
    if _COMPILING_ONLY.get():
        run(tiling.choose(kernel, q, **flags))
    else:
        tiling.launch(kernel, q, run, **flags)


def _empty(shape, dtype, device) -> torch.Tensor:
    buf = torch.empty(shape, dtype=dtype, device=device)
    if POISON_OUTPUTS and not _COMPILING_ONLY.get():
        buf.fill_(float("nan"))
    return launch_plans.scratch(buf)


def _planned(stage: str, inputs: dict, outputs: dict, options: tuple, launch_all) -> None:
    """Replay the stage's launch plan for these inputs and options onto these outputs (tensors by
    name; outputs are allocated from the inputs' shapes), or call launch_all() (the stage's launches
    as written), recording it where plans apply."""
    plan_key = None if _COMPILING_ONLY.get() else launch_plans.key(stage, inputs, options)
    slots = {**inputs, **outputs}
    if not launch_plans.replay(plan_key, slots):
        with launch_plans.recording(plan_key, slots, _empty):
            launch_all()


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _strides(t: torch.Tensor) -> tuple[int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2)


def _precision(dtype: torch.dtype, fp32_precision: str | None = None) -> str:
    """Triton's input_precision for products of `dtype` inputs (see check_fp32_precision)."""
    return check_fp32_precision(fp32_precision) if dtype == torch.float32 else "tf32"


def _mask_args(causal: bool, window: int | None, n: int, m: int, key_range: torch.Tensor | None,
               stand_in: torch.Tensor) -> dict:
    """The kernels' mask arguments. key_range: (B, 2) int32 [start, end) per batch row, or None (no
    ranges: HAS_RANGE is off and `stand_in`, never read, fills the pointer)."""
    return {"OFFSET": m - n, "WINDOW": window or 0, "CAUSAL": causal, "HAS_WINDOW": window is not None,
            "KeyRange": stand_in if key_range is None else key_range, "HAS_RANGE": key_range is not None}


def _contiguous(key_range: torch.Tensor | None) -> torch.Tensor | None:
    return None if key_range is None else key_range.contiguous()


ROW_ALIGN = 16
"""The float32 row vectors that the backward and BoB kernels read (lse, delta, c, e: one value per
(batch, head, query)) start every `row_stride(N)` elements: a multiple of ROW_ALIGN."""


def row_stride(n: int) -> int:
    """Elements between the (batch, head) rows of the row vectors: n rounded up to ROW_ALIGN.

    The kernels take it as the argument `svec` and read rows [0, svec) of each (the rows past n
    hold values that add nothing: lse +inf, delta, c and e 0). Triton specializes `svec` on its
    divisibility by 16, which always holds, so the row vectors load as aligned vectors while the
    lengths themselves stay unspecialized (no compilation per length)."""
    return -(-n // ROW_ALIGN) * ROW_ALIGN


def _row_vectors(batch: int, heads: int, n: int, device) -> torch.Tensor:
    """A (batch, heads, n) float32 view of a buffer whose rows are `row_stride(n)` apart; the
    kernel that fills it writes the padding too."""
    return _empty((batch, heads, row_stride(n)), torch.float32, device)[..., :n]


def _aligned_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse (B, H, N) as the kernels read it: itself when its rows are already `row_stride(N)` apart
    (contiguous with N a multiple of ROW_ALIGN), else a copy whose padding is +inf."""
    batch, heads, n = lse.shape
    stride = row_stride(n)
    if n == stride and all(size == 1 or got == want for size, got, want in
                           zip(lse.shape, lse.stride(), (heads * stride, stride, 1))):
        return lse
    padded = torch.full((batch, heads, stride), float("inf"), dtype=torch.float32, device=lse.device)
    padded[..., :n] = lse
    return padded[..., :n]


def row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """rowsum(a * b) in float32. a, b: (B, H, N, D) -> (B, H, N), rows `row_stride(N)` apart
    (zero in the padding)."""
    batch, heads, n, d = a.shape
    out = _row_vectors(batch, heads, n, a.device)
    block_m = 64 if a.is_cuda else 16
    grid = (triton.cdiv(row_stride(n), block_m), batch * heads)
    _start(row_dot_kernel, grid)(
        a, b, out, *_strides(a), *_strides(b), row_stride(n), n, heads,
        HEAD_DIM=d, BLOCK_M=block_m, BLOCK_D=tiling.block_d(d),
    )
    return out


def forward(q, k, v, *, causal: bool, window: int | None, scale: float, fp32_precision: str | None = None,
            key_range: torch.Tensor | None = None):
    """q: (B, Hq, N, D); k, v: (B, Hkv, M, D). Returns out (B, Hq, N, D) and lse (B, Hq, N) float32.
    fp32_precision: the products of float32 inputs (`validation.check_fp32_precision`).
    key_range: (B, 2) int32, batch row b sees keys key_range[b, 0] <= j < key_range[b, 1] (on top of
    the causal / window mask), or None (every key); the same in every launcher.
    For few query rows and many keys the keys are split over more programs (`tiling.key_splits`), the
    same results in two launches (`_split_forward`)."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    key_range = _contiguous(key_range)
    batch, heads_q, n, d = q.shape
    heads_kv, m = k.shape[1], k.shape[2]
    out = _empty(q.shape, q.dtype, q.device)
    lse = _empty((batch, heads_q, n), torch.float32, q.device)

    def launch_all():
        precision = _precision(q.dtype, fp32_precision)
        args = dict(qk_scale_log2=scale * LOG2E, **_mask_args(causal, window, n, m, key_range, q), HEAD_DIM=d,
                    PRECISION=precision)
        splits = tiling.key_splits(q, k, window)
        if splits > 1:
            _split_forward(q, k, v, out, lse, splits, args)
            return

        def run(cfg):
            return _start(attention_forward_kernel, (triton.cdiv(n, cfg["BLOCK_M"]), batch * heads_q))(
                q, k, v, out, lse, *_strides(q), *_strides(k), *_strides(v), *_strides(out),
                n, m, heads_q, heads_q // heads_kv, **args, **cfg,
            )

        _launch("forward", q, run, PRECISION=precision)

    _planned("forward", dict(q=q, k=k, v=v, key_range=key_range), dict(out=out, lse=lse),
             (causal, window, scale, fp32_precision), launch_all)
    return out, lse


COMBINE_SPLITS = 16
"""Splits the combine kernel merges per step (BLOCK_S)."""


def _split_forward(q, k, v, out, lse, splits: int, args: dict) -> None:
    """The forward's launches with the keys split into `splits` pieces: each piece's normalized output
    and log-sum-exp into float32 scratch (`attention_forward_split_kernel`), then their merge into out
    (B, Hq, N, D) and lse (B, Hq, N) (`attention_forward_combine_kernel`). args: the kernels' mask,
    scale, HEAD_DIM and PRECISION arguments."""
    batch, heads_q, n, d = q.shape
    heads_kv, m = k.shape[1], k.shape[2]
    part = _empty((batch * heads_q, n, splits, d), torch.float32, q.device)
    part_lse = _empty((batch * heads_q, n, splits), torch.float32, q.device)

    def run(cfg):
        grid = (triton.cdiv(n, cfg["BLOCK_M"]), splits, batch * heads_q)
        compiled = _start(attention_forward_split_kernel, grid)(
            q, k, v, part, part_lse, *_strides(q), *_strides(k), *_strides(v),
            n, m, heads_q, heads_q // heads_kv, SPLITS=splits, **args, **cfg,
        )
        _start(attention_forward_combine_kernel, (n, batch * heads_q))(
            part, part_lse, out, lse, *_strides(out), n, heads_q, splits,
            HEAD_DIM=d, BLOCK_S=COMBINE_SPLITS, BLOCK_D=cfg["BLOCK_D"],
        )
        return compiled

    _launch("forward_split", q, run, PRECISION=args["PRECISION"])


def backward(q, k, v, out, lse, dout, *, causal: bool, window: int | None, scale: float,
             fp32_precision: str | None = None, key_range: torch.Tensor | None = None):
    """First backward. Returns (dq, dk, dv) shaped like (q, k, v)."""
    q, k, v, out, dout = (_unit_last(t) for t in (q, k, v, out, dout))
    lse = _aligned_lse(lse)
    key_range = _contiguous(key_range)
    batch, heads_q, n, d = q.shape
    heads_kv, m = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    dq = _empty(q.shape, q.dtype, q.device)
    dk = _empty(k.shape, k.dtype, k.device)
    dv = _empty(k.shape, k.dtype, k.device)

    def launch_all():
        delta = row_dot(dout, out)
        precision = _precision(q.dtype, fp32_precision)
        common = dict(
            qk_scale_log2=scale * LOG2E, scale=scale, **_mask_args(causal, window, n, m, key_range, q),
            HEAD_DIM=d, PRECISION=precision,
        )

        def run_kv(cfg):
            return _start(attention_backward_dkdv_kernel, (triton.cdiv(m, cfg["BLOCK_N"]), batch * heads_kv))(
                q, k, v, dout, lse, delta, dk, dv,
                *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dk), row_stride(n),
                n, m, heads_q, heads_kv, group, **common, **cfg,
            )

        def run_q(cfg):
            return _start(attention_backward_dq_kernel, (triton.cdiv(n, cfg["BLOCK_M"]), batch * heads_q))(
                q, k, v, dout, lse, delta, dq,
                *_strides(q), *_strides(k), *_strides(v), *_strides(dout), *_strides(dq), row_stride(n),
                n, m, heads_q, group, **common, **cfg,
            )

        _launch("backward_kv", q, run_kv, PRECISION=precision)
        _launch("backward_q", q, run_q, PRECISION=precision)

    _planned("backward", dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, key_range=key_range),
             dict(dq=dq, dk=dk, dv=dv), (causal, window, scale, fp32_precision), launch_all)
    return dq, dk, dv


def bob(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, *, causal: bool, window: int | None, scale: float,
        fp32_precision: str | None = None, key_range: torch.Tensor | None = None):
    """Backward-over-backward. Cotangents u_q (like q), u_k, u_v (like k) may be None.
    Returns (grad_q, grad_k, grad_v, grad_dout) shaped like (q, k, v, dout)."""
    q, k, v, out, dout, dq = (_unit_last(t) for t in (q, k, v, out, dout, dq))
    u_q, u_k, u_v = (None if t is None else _unit_last(t.to(q.dtype)) for t in (u_q, u_k, u_v))
    if u_q is None and u_k is None and u_v is None:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), torch.zeros_like(dout)
    lse = _aligned_lse(lse)
    key_range = _contiguous(key_range)
    grad_q = _empty(q.shape, q.dtype, q.device)
    grad_dout = _empty(q.shape, q.dtype, q.device)
    grad_k = _empty(k.shape, k.dtype, k.device)
    grad_v = _empty(k.shape, k.dtype, k.device)
    inputs = dict(q=q, k=k, v=v, out=out, lse=lse, dout=dout, dq=dq, u_q=u_q, u_k=u_k, u_v=u_v,
                  key_range=key_range)
    outputs = dict(grad_q=grad_q, grad_k=grad_k, grad_v=grad_v, grad_dout=grad_dout)
    _planned("bob", inputs, outputs, (causal, window, scale, fp32_precision), lambda: _bob_launches(
        **inputs, **outputs, causal=causal, window=window, scale=scale, fp32_precision=fp32_precision))
    return grad_q, grad_k, grad_v, grad_dout


def _bob_launches(q, k, v, out, lse, dout, dq, u_q, u_k, u_v, key_range, grad_q, grad_k, grad_v, grad_dout, *,
                  causal, window, scale, fp32_precision):
    """The BoB's launches as written (`bob` takes its arguments to the layouts they need)."""
    batch, heads_q, n, d = q.shape
    heads_kv, m = k.shape[1], k.shape[2]
    group = heads_q // heads_kv
    flags = dict(HAS_UQ=u_q is not None, HAS_UK=u_k is not None, HAS_UV=u_v is not None,
                 HAS_G=u_q is not None or u_k is not None)
    # Absent cotangents are never read (their flag is off): any tensor stands in for the pointer.
    u_q_ = q if u_q is None else u_q
    u_k_ = k if u_k is None else u_k
    u_v_ = k if u_v is None else u_v
    delta = row_dot(dout, out)
    row_c = _row_vectors(batch, heads_q, n, q.device)
    row_e = _row_vectors(batch, heads_q, n, q.device)
    precision = _precision(q.dtype, fp32_precision)
    common = dict(
        qk_scale_log2=scale * LOG2E, scale=scale, **_mask_args(causal, window, n, m, key_range, q), **flags,
        HEAD_DIM=d, PRECISION=precision,
    )

    def run_rows(cfg):
        cfg = dict(cfg)
        split = cfg.pop("SPLIT")
        rows_args = (
            q, k, v, out, dout, dq, u_q_, u_k_, u_v_, lse, delta, grad_q, grad_dout, row_c, row_e,
            *_strides(q), *_strides(k), *_strides(v), *_strides(out), *_strides(dout), *_strides(dq),
            *_strides(u_q_), *_strides(u_k_), *_strides(u_v_), *_strides(grad_q), row_stride(n),
            n, m, heads_q, group,
        )
        # Q̄ with c and e first, then dŌ (in one launch where the accumulators fit the registers).
        passes = ((True, False), (False, True)) if split else ((True, True),)
        grid = (triton.cdiv(n, cfg["BLOCK_M"]), batch * heads_q)
        compiled = [_start(attention_bob_rows_kernel, grid)(
            *rows_args, **common, WANT_GQ=gq, WANT_GDO=gdo, **cfg) for gq, gdo in passes]
        return max(compiled, key=lambda c: getattr(getattr(c, "metadata", None), "shared", 0))

    def run_cols(cfg):
        return _start(attention_bob_cols_kernel, (triton.cdiv(m, cfg["BLOCK_N"]), batch * heads_kv))(
            q, k, v, dout, u_q_, u_k_, u_v_, lse, delta, row_c, row_e, grad_k, grad_v,
            *_strides(q), *_strides(k), *_strides(v), *_strides(dout),
            *_strides(u_q_), *_strides(u_k_), *_strides(u_v_), *_strides(grad_k), row_stride(n),
            n, m, heads_q, heads_kv, group, **common, **cfg,
        )

    # Each pass writes all of its outputs, so a Hopper pass that does not compile (hopper.compiled_or_off:
    # a Triton whose Gluon differs) leaves the portable pass a clean slate.
    if not (hopper.applies("rows", q, k, v, dout, u_q_, u_k_, u_v_, causal=causal) and hopper.compiled_or_off(
            hopper.bob_rows, _start, q, k, v, out, dout, dq, u_q_, u_k_, u_v_, lse, delta, grad_q, grad_dout,
            row_c, row_e, svec=row_stride(n), heads_q=heads_q, group=group, common=common, allocate=_empty)):
        _launch("bob_rows", q, run_rows, PRECISION=precision, **flags)
    if not (hopper.applies("cols", q, k, v, dout, u_q_, u_k_, u_v_, lse, delta, row_c, row_e, causal=causal)
            and hopper.compiled_or_off(hopper.bob_cols, _start, q, k, v, dout, u_q_, u_k_, u_v_, lse, delta,
                                       row_c, row_e, grad_k, grad_v, group=group, common=common)):
        _launch("bob_cols", q, run_cols, PRECISION=precision, **flags)


def jvp(q, k, v, t_q, t_k, t_v, *, causal: bool, window: int | None, scale: float,
        fp32_precision: str | None = None, key_range: torch.Tensor | None = None):
    """Forward with tangent. q, t_q: (B, Hq, N, D); k, v, t_k, t_v: (B, Hkv, M, D); any tangent may
    be None (zero). Returns out (B, Hq, N, D), lse (B, Hq, N) float32 and t_out (B, Hq, N, D), the
    directional derivative of out along (t_q, t_k, t_v). fp32_precision: as in `forward`."""
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    t_q, t_k, t_v = (None if t is None else _unit_last(t.to(q.dtype)) for t in (t_q, t_k, t_v))
    key_range = _contiguous(key_range)
    batch, heads_q, n, d = q.shape
    heads_kv, m = k.shape[1], k.shape[2]
    out = _empty(q.shape, q.dtype, q.device)
    t_out = _empty(q.shape, q.dtype, q.device)
    lse = _empty((batch, heads_q, n), torch.float32, q.device)

    def launch_all():
        flags = dict(HAS_TQ=t_q is not None, HAS_TK=t_k is not None, HAS_TV=t_v is not None)
        # Absent tangents are never read (their flag is off): any tensor stands in for the pointer.
        t_q_ = q if t_q is None else t_q
        t_k_ = k if t_k is None else t_k
        t_v_ = v if t_v is None else t_v
        precision = _precision(q.dtype, fp32_precision)

        def run(cfg):
            return _start(attention_jvp_kernel, (triton.cdiv(n, cfg["BLOCK_M"]), batch * heads_q))(
                q, k, v, t_q_, t_k_, t_v_, out, t_out, lse,
                *_strides(q), *_strides(k), *_strides(v), *_strides(t_q_), *_strides(t_k_), *_strides(t_v_),
                *_strides(out), n, m, heads_q, heads_q // heads_kv, qk_scale_log2=scale * LOG2E, scale=scale,
                **_mask_args(causal, window, n, m, key_range, q), **flags, HEAD_DIM=d, PRECISION=precision,
                **cfg,
            )

        _launch("jvp", q, run, PRECISION=precision, **flags)

    _planned("jvp", dict(q=q, k=k, v=v, t_q=t_q, t_k=t_k, t_v=t_v, key_range=key_range),
             dict(out=out, t_out=t_out, lse=lse), (causal, window, scale, fp32_precision), launch_all)
    return out, lse, t_out
