"""Tile shapes and launch settings for each kernel, by head dim, dtype and device.

Under Triton's CPU interpreter, small tiles (16) keep tests fast and exercise the multi-tile paths
on small sequences. On CUDA the starting point is the table tuned on the H200 (`_cuda_default`);
where the device has less shared memory per block than a setting needs (`shared_mem_estimate`),
the setting steps down (fewer pipeline stages, then smaller tiles) until the estimate fits.
If Triton still reports `OutOfResources` at launch, `launch` steps down further and remembers the
setting that worked, per (kernel, dtype, head dim, float32 precision, device), so the fallback's
extra compilation happens once per process.

Limits can be imposed below the real device's, to run on one GPU what a smaller one would get:
`impose_limits(DeviceLimits(...))` in code, or the environment variable FLASHBOB_MAX_SHARED_MEM
(bytes, or KiB with a K suffix: `163K` for an A100, `99K` for an L4 / RTX 4090). Under an imposed
limit, a compiled kernel that needs more shared memory than the limit counts as out of resources.

Registers do not vary across the GPUs Triton supports (compute capability 8.0 and newer: 64K
32-bit registers per SM, at most 255 per thread), so the register rule (`split_bob_rows`) is the
same on all of them. `override` replaces a kernel's settings for a while (benchmarks use it to
compare tilings); overridden settings are launched as given, without stepping down.

For few query rows and many keys (decoding) the forward splits the keys over more programs
(`split_keys`, by the device's SM count); `force_splits` imposes a count (tests, compiles ahead).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import os
import re
from collections.abc import Callable

import torch
import triton
from triton.runtime.errors import OutOfResources

KERNELS = ("forward", "forward_split", "backward_kv", "backward_q", "bob_rows", "bob_cols", "jvp")
INTERPRETER_TILES = (16, 16, 1, 1)
"""(BLOCK_M, BLOCK_N, num_warps, num_stages) under the CPU interpreter."""
MIN_TILE = 16
SHARED_MEM_ENV = "FLASHBOB_MAX_SHARED_MEM"

_overrides: dict[str, dict] = {}
_imposed: list[DeviceLimits] = []
_working: dict[tuple, dict] = {}
_device_cache: dict[int, DeviceLimits] = {}
_forced_splits: contextvars.ContextVar[int | None] = contextvars.ContextVar("flashbob_forced_splits",
                                                                           default=None)


@dataclasses.dataclass(frozen=True)
class DeviceLimits:
    """What one launch may use on a GPU: shared memory per block in bytes (the opt-in maximum
    that Triton checks at launch) and the compute capability (major, minor)."""

    max_shared_mem: int
    capability: tuple[int, int]


PRESETS = {
    "h100": DeviceLimits(232448, (9, 0)),  # H100 / H200: 227 KiB per block
    "a100": DeviceLimits(166912, (8, 0)),  # 163 KiB
    "ada": DeviceLimits(101376, (8, 9)),   # L4, RTX 4090: 99 KiB
}
"""Limits of the GPU families the kernels are meant for (NVIDIA's per-block opt-in maxima)."""


def block_d(head_dim: int) -> int:
    """Head dim padded to a power of two (at least 16, the smallest tensor-core operand)."""
    return max(16, triton.next_power_of_2(head_dim))


def parse_shared_mem(text: str) -> int:
    """'232448' -> 232448 bytes; '163K' or '163KiB' -> 163 * 1024. Raises ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*(K|KiB)?\s*", text, flags=re.IGNORECASE)
    if not match or int(match.group(1)) <= 0:
        raise ValueError(f"{SHARED_MEM_ENV} must be a positive number of bytes or of KiB with a K suffix "
                         f"(e.g. 163K), got {text!r}")
    return int(match.group(1)) * (1024 if match.group(2) else 1)


def _real_limits(device: torch.device) -> DeviceLimits:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _device_cache:
        props = triton.runtime.driver.active.utils.get_device_properties(index)
        _device_cache[index] = DeviceLimits(props["max_shared_mem"], torch.cuda.get_device_capability(index))
    return _device_cache[index]


def device_limits(device: torch.device) -> DeviceLimits:
    """Limits a launch on `device` must respect: the device's own, lowered by FLASHBOB_MAX_SHARED_MEM
    and by an active `impose_limits` (whose capability then stands in for the device's). On a
    non-CUDA device (the interpreter) the H100 preset stands in for the device."""
    limits = _real_limits(device) if device.type == "cuda" else PRESETS["h100"]
    env = os.environ.get(SHARED_MEM_ENV)
    if env:
        limits = dataclasses.replace(limits, max_shared_mem=min(limits.max_shared_mem, parse_shared_mem(env)))
    if _imposed:
        imposed = _imposed[-1]
        limits = DeviceLimits(min(limits.max_shared_mem, imposed.max_shared_mem), imposed.capability)
    return limits


def adjusted() -> bool:
    """Whether `override`, `impose_limits` or `force_splits` is in effect (launch plans are off while
    any is)."""
    return bool(_overrides or _imposed) or _forced_splits.get() is not None


@contextlib.contextmanager
def impose_limits(limits: DeviceLimits):
    """Within the block, choose and check launch settings as if the device had `limits` (shared
    memory is only ever lowered, never raised above the real device's). Settings remembered by the
    fallback are keyed by the limits, so they do not leak out of the block."""
    _imposed.append(limits)
    try:
        yield limits
    finally:
        _imposed.pop()


TF32X3_HEAD_DIM_128 = {
    "forward": (64, 32, 4, 3),
    "backward_kv": (32, 64, 4, 2),
    "backward_q": (64, 32, 4, 2),
    "bob_cols": (16, 16, 4, 2),
}
"""Float32 tf32x3 at head dim 128, where each loop-invariant operand keeps hi and lo parts in shared
memory, so the 64-wide tiles of the table need more than an H200 has (64 keys of the BoB columns
kernel: 320 KiB). The forward and first backward take 32-wide loop tiles with one stage more, the
BoB columns kernel 16 x 16 tiles: on an H200 the fastest of the settings that fit, at the same error
(docs/notes/kernel_notes.md, "Calibration of the launch settings"). The rows kernel and the JVP follow the
table, stepped down by the estimate."""


def _cuda_default(kernel: str, bd: int, itemsize: int, precision: str = "ieee") -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for a CUDA launch: the fastest of an H200 sweep (bf16,
    N=16384, causal, head dims 64 and 128; docs/notes/kernel_notes.md). Four warps (one warpgroup) where a
    program owns query rows: eight would split the row sums of a tile across warpgroups. Head dim 256
    takes the smallest tiles, for the registers (`cuda_config` then fits them to the device's shared
    memory). itemsize: bytes per input element; precision: the products of float32 inputs."""
    if kernel == "forward_split":  # not measured: 16 rows, the fewest tl.dot takes (decoding has 1)
        return (16, 64, 4, 3) if bd <= 128 else (16, 32, 4, 2)
    if bd > 128:
        return (64, 32, 4, 2) if kernel == "forward" else (32, 32, 4, 1)
    if itemsize == 4 and precision == "tf32x3" and bd == 128 and kernel in TF32X3_HEAD_DIM_128:
        return TF32X3_HEAD_DIM_128[kernel]
    if kernel == "forward":
        return (64, 64, 4, 3)
    if kernel == "jvp":  # two (BLOCK_M, D) accumulators, one more than the dQ kernel (not swept)
        return (64, 64, 4, 2) if bd <= 64 else (64, 32, 4, 2)
    if kernel in ("backward_kv", "backward_q"):
        return (64, 64, 4, 2)
    if kernel == "bob_rows":
        return (64, 32, 4, 3) if bd <= 64 else (64, 32, 4, 2)
    if bd <= 64:
        return (64, 64, 4, 2)
    # bob_cols at head dim 128, 16-bit inputs: 128 keys per program over two warpgroups (their warps
    # split keys, which need no cross-warp row sums), faster on an H200 than 64 keys over one, with
    # three query tiles in flight (docs/notes/kernel_notes.md, "the columns pass regrouped"; its shared
    # memory under "Calibration counts").
    # Float32 operands would not fit it: they keep the one-warpgroup tile.
    return (32, 128, 8, 3) if itemsize == 2 else (32, 64, 4, 2)


REGISTER_CAP_FP32 = 255
"""`maxnreg` of every float32 launch on CUDA with float32-accurate products (tf32x3, ieee): the most
registers ptxas may give a thread. Without it, ptxas (Triton 3.6, sm_90) gives the launches whose
products are not wgmma (mma.sync tiles, FMA) few registers and spills the rest to the stack; with it,
they take up to 255 and spill far less (the counts: docs/notes/kernel_notes.md, "Calibration counts").
Plain tf32 compiles alike with and without it, so it is left to ptxas there."""


def split_bob_rows(head_dim: int) -> bool:
    """Whether the BoB rows kernel runs as two launches (Q̄, then dŌ) by default: above head dim 64 its
    three (64, D) float32 accumulators (192 registers per thread of four warps at D=128) would spill.
    The interpreter follows the same rule."""
    return block_d(head_dim) > 64


SPLIT_ROWS = 16
"""Query rows (per batch and head) at most for which the forward splits keys: one row block of the
split kernel, whose 16 rows are the fewest tl.dot takes (decoding has 1, speculative decoding a few)."""
MIN_SPLIT_KEYS = 256
"""Keys per split at least: four of the split kernel's 64-key tiles on CUDA, so that a program's key
loop outweighs its prologue, its scratch writes and its share of the combine."""
MAX_SPLITS = 128
"""Splits at most: the combine merges all of a row's splits in one program."""
INTERPRETER_SMS = 16
"""The SM count that stands in for a device without one (the interpreter): small, so that tests of a
few heads take the split path."""


def split_keys(n: int, keys: int, batch_heads: int, device_sms: int) -> int:
    """Into how many pieces the forward splits the keys of n query rows per (batch, head) that see at
    most `keys` keys, for batch_heads = B * Hq on a device of device_sms SMs.

    1 (the plain kernel, one program per row block and head) unless n <= SPLIT_ROWS and that grid
    leaves more than half of the SMs idle (2 * batch_heads <= device_sms); then about two programs per
    SM (ceil(2 * device_sms / batch_heads) pieces), each of at least MIN_SPLIT_KEYS keys, and at
    most MAX_SPLITS: a decoded token of 12 heads on 132 SMs over 8192 keys takes 22 pieces."""
    if n > SPLIT_ROWS or 2 * batch_heads > device_sms:
        return 1
    return max(1, min(-(-2 * device_sms // batch_heads), keys // MIN_SPLIT_KEYS, MAX_SPLITS))


@functools.cache
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """The SM count of a CUDA device; INTERPRETER_SMS for any other."""
    if device.type != "cuda":
        return INTERPRETER_SMS
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def key_splits(q: torch.Tensor, k: torch.Tensor, window: int | None) -> int:
    """The forward's key splits for q (B, Hq, N, D) and k (B, Hkv, M, D) under a sliding window (None:
    none): the count `force_splits` imposes, else `split_keys` on q's device, a row then seeing at
    most M keys (N + window - 1 under a window)."""
    forced = _forced_splits.get()
    if forced is not None:
        return forced
    n, m = q.shape[2], k.shape[2]
    keys = m if window is None else min(m, n + window - 1)
    return split_keys(n, keys, q.shape[0] * q.shape[1], device_sms(q.device))


@contextlib.contextmanager
def force_splits(count: int):
    """Within the block (this thread only), the forward splits the keys into `count` pieces whatever
    the sizes (1: the plain kernel); launch plans are off meanwhile."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"force_splits takes a positive int, got {count!r}")
    token = _forced_splits.set(count)
    try:
        yield
    finally:
        _forced_splits.reset(token)


COLUMN_KERNELS = ("backward_kv", "bob_cols")
"""Kernels whose programs own BLOCK_N keys and loop over query tiles (the others own BLOCK_M rows)."""
LAUNCH_ONLY = ("SPLIT",)
"""Settings that are not tiles: `launch` remembers a fallback's tiles without them."""


def _operand_tiles(kernel: str, flags: dict) -> tuple[int, int, int]:
    """(tiles loaded once per program, tiles loaded per loop step, of those the most alive at once)
    for `kernel`: the (rows, BLOCK_D) operands it keeps. A kernel not listed counts as 2 and 3."""
    uq, uk, uv = (bool(flags.get(f, True)) for f in ("HAS_UQ", "HAS_UK", "HAS_UV"))
    g = bool(flags.get("HAS_G", uq or uk))
    if kernel in ("forward", "forward_split"):
        return 1, 2, 2                                      # q; k, v
    if kernel in ("backward_kv", "backward_q"):
        return 2, 2, 2                                      # q, do / k, v
    if kernel == "bob_rows":
        inner = 1 + uv + g + uk                             # k, u_v, v, u_k
        return 2 + uq, inner, min(inner, 3)                 # q, do, u_q: u_v and v die young
    if kernel == "bob_cols":
        return 1 + g + uk + uv, 1 + (uv or g) + uq, 1 + (uv or g) + uq   # k, v, u_k, u_v; q, do, u_q
    if kernel == "jvp":
        tq, tk, tv = (bool(flags.get(f, True)) for f in ("HAS_TQ", "HAS_TK", "HAS_TV"))
        return 1 + tq, 2 + tk + tv, 2 + tk + tv                  # q, t_q; k, v, t_k, t_v
    return 2, 3, 3


def _row_vectors(kernel: str, flags: dict) -> int:
    """Float32 (BLOCK_M,) vectors per query tile that a columns kernel's loop loads (lse, delta;
    for the BoB also e and c): pipelined like the tiles. Row kernels load theirs once (registers)."""
    if kernel == "backward_kv":
        return 2
    if kernel == "bob_cols":
        uq, uk = (bool(flags.get(f, True)) for f in ("HAS_UQ", "HAS_UK"))
        return 2 + 2 * bool(flags.get("HAS_G", uq or uk))
    return 0


def shared_mem_estimate(kernel: str, cfg: dict, itemsize: int, precision: str = "ieee", **flags) -> int:
    """Bytes of shared memory a launch of `kernel` with cfg (BLOCK_M, BLOCK_N, BLOCK_D, num_warps,
    num_stages) is expected to need, for inputs of `itemsize` bytes: an upper bound of what Triton
    3.6 compiles, checked against every launch compiled on an H200 (tests/flashbob/test_tiling.py reads
    them; `python -m flashbob.bench sm90` prints the estimate next to a compile). Three regimes:
      tensor-core products (16-bit inputs, or float32 with tf32): the loop-invariant operand tiles
      once, plus num_stages buffers of every tile the loop loads (the software pipeline), plus, in
      the columns kernels, num_stages - 1 buffers of the float32 per-query vectors their loop loads;
      where a program's own rows are split over warpgroups of fewer than 64 rows each (eight warps
      on 64 rows), one float32 (BLOCK_M, BLOCK_N) tile through which the warpgroups exchange;
      float32 tf32x3 (each product three tf32 products of hi and lo parts): as tf32, but every
      loop-invariant tile counted twice, because Triton (pass F32DotTC) splits an operand that does
      not change in the loop into hi and lo once and keeps both parts in shared memory for the whole
      loop, while the loop's tiles keep their pipeline buffers and are split in registers; the BoB
      columns kernel one float32 (BLOCK_N, BLOCK_M) tile more;
      float32 IEEE products (FMA): the larger of the tf32 regime's count (Triton pipelines these
      loads too) and the loop-invariant tiles, the loop's tiles alive at once and one float32
      (BLOCK_M, BLOCK_N) tile of scratch.
    How each regime was fitted and where it over-estimates: docs/notes/kernel_notes.md, "Calibration of
    the launch settings".
    """
    outer, inner, alive = _operand_tiles(kernel, flags)
    rows_outer, rows_inner = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if kernel in COLUMN_KERNELS:
        rows_outer, rows_inner = rows_inner, rows_outer
    tile = itemsize * cfg["BLOCK_D"]
    score_tile = 4 * cfg["BLOCK_M"] * cfg["BLOCK_N"]
    if itemsize == 4 and precision == "ieee":
        unpipelined = tile * (outer * rows_outer + alive * rows_inner) + score_tile
        return max(unpipelined, shared_mem_estimate(kernel, cfg, itemsize, "tf32", **flags))
    stages = max(1, cfg["num_stages"])
    three_pass = itemsize == 4 and precision == "tf32x3"
    need = tile * ((1 + three_pass) * outer * rows_outer + stages * inner * rows_inner)
    need += (stages - 1) * _row_vectors(kernel, flags) * 4 * cfg["BLOCK_M"]
    warpgroups = max(1, cfg.get("num_warps", 4) // 4)
    if warpgroups > 1 and rows_outer // warpgroups < 64:
        need += score_tile
    if three_pass and kernel == "bob_cols":
        need += score_tile
    return need


def step_down(kernel: str, cfg: dict) -> dict | None:
    """The next smaller setting after cfg: one pipeline stage fewer, else half the loop's tile, else
    half the program's tile (down to 16 rows); None when cfg is the smallest."""
    loop, own = ("BLOCK_M", "BLOCK_N") if kernel in COLUMN_KERNELS else ("BLOCK_N", "BLOCK_M")
    if cfg["num_stages"] > 1:
        return {**cfg, "num_stages": cfg["num_stages"] - 1}
    for name in (loop, own):
        if cfg[name] > MIN_TILE:
            return {**cfg, name: cfg[name] // 2}
    return None


def cuda_config(kernel: str, head_dim: int, itemsize: int, limits: DeviceLimits, precision: str = "ieee",
                **flags) -> dict:
    """Launch settings for `kernel` on a GPU with `limits`: the tuned table's, stepped down until
    `shared_mem_estimate` fits the device's shared memory (the smallest setting if none does;
    `launch` then has the last word). BLOCK_M, BLOCK_N, BLOCK_D, num_warps, num_stages, and for
    float32 tf32x3 and ieee maxnreg (`REGISTER_CAP_FP32`)."""
    if limits.capability < (8, 0):
        raise RuntimeError(
            f"the Triton kernels need a GPU of compute capability 8.0 or newer (Ampere, Ada, Hopper), got "
            f"{limits.capability[0]}.{limits.capability[1]}; use backend='torch'"
        )
    bd = block_d(head_dim)
    bm, bn, warps, stages = _cuda_default(kernel, bd, itemsize, precision)
    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": bd, "num_warps": warps, "num_stages": stages}
    if itemsize == 4 and precision in ("tf32x3", "ieee"):
        cfg["maxnreg"] = REGISTER_CAP_FP32
    while shared_mem_estimate(kernel, cfg, itemsize, precision, **flags) > limits.max_shared_mem:
        smaller = step_down(kernel, cfg)
        if smaller is None:
            break
        cfg = smaller
    return cfg


def _memory_key(kernel: str, q: torch.Tensor, precision: str) -> tuple:
    return (kernel, q.dtype, block_d(q.shape[-1]), precision, str(q.device), device_limits(q.device))


def choose(kernel: str, q: torch.Tensor, **flags) -> dict:
    """Launch settings for `kernel` with inputs like q (B, H, N, D): BLOCK_M, BLOCK_N, BLOCK_D,
    num_warps, num_stages, and for bob_rows SPLIT (two launches or one). flags: the kernel's
    compile-time flags (HAS_UQ, ..., PRECISION), which the shared-memory estimate reads."""
    precision = flags.get("PRECISION", "ieee")
    remembered = _working.get(_memory_key(kernel, q, precision))
    if remembered is not None:
        cfg = dict(remembered)
    elif q.is_cuda:
        cfg = cuda_config(kernel, q.shape[-1], q.element_size(), device_limits(q.device), precision,
                          **{k: v for k, v in flags.items() if k != "PRECISION"})
    else:
        bm, bn, warps, stages = INTERPRETER_TILES
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_D": block_d(q.shape[-1]), "num_warps": warps,
               "num_stages": stages}
    if kernel == "bob_rows":
        cfg.setdefault("SPLIT", split_bob_rows(q.shape[-1]))
    cfg.update(_overrides.get(kernel, {}))
    return cfg


def _check_imposed(compiled, limit: int) -> None:
    """Raise OutOfResources where a compiled kernel needs more shared memory than an imposed limit
    (the real device would have accepted it)."""
    shared = getattr(getattr(compiled, "metadata", None), "shared", None)
    if shared is not None and shared > limit:
        raise OutOfResources(shared, limit, "shared memory")


def launch(kernel: str, q: torch.Tensor, run: Callable[[dict], object], **flags) -> dict:
    """Launch `kernel` by calling run(cfg) (which must launch it with the settings cfg and may
    return the compiled kernel; launches must be repeatable: they overwrite their outputs) with
    `choose`'s settings. On OutOfResources, step down to the first smaller setting whose estimate,
    scaled by the error's required / estimated ratio, fits, and try again; the setting that works
    is remembered. Returns the settings used. Overridden settings are launched as given."""
    cfg = choose(kernel, q, **flags)
    precision = flags.get("PRECISION", "ieee")
    limit = device_limits(q.device).max_shared_mem
    itemsize = q.element_size()
    while True:
        try:
            compiled = run(cfg)
            _check_imposed(compiled, limit)
        except OutOfResources as err:
            if kernel in _overrides:
                raise
            cfg = _fallback(kernel, cfg, err, itemsize, limit, precision, flags)
            continue
        if kernel not in _overrides:
            _working[_memory_key(kernel, q, precision)] = {
                k: v for k, v in cfg.items() if k not in LAUNCH_ONLY}
        return cfg


def _fallback(kernel, cfg, err, itemsize, limit, precision, flags) -> dict:
    estimate = shared_mem_estimate(kernel, cfg, itemsize, precision, **flags)
    ratio = err.required / estimate if err.name == "shared memory" and estimate else 1.0
    smaller = step_down(kernel, cfg)
    if smaller is None:
        raise OutOfResources(err.required, err.limit,
                             f"{err.name} for kernel {kernel} even at its smallest tiles "
                             f"(head dim block {cfg['BLOCK_D']}, {itemsize}-byte inputs, precision "
                             f"{precision}); use bfloat16 inputs or backend='torch'") from err
    while True:
        fits = shared_mem_estimate(kernel, smaller, itemsize, precision, **flags) * ratio <= limit
        after = step_down(kernel, smaller)
        if fits or after is None:
            return smaller
        smaller = after


@contextlib.contextmanager
def override(kernel: str, **settings):
    """Within the block, launch `kernel` with `settings` (e.g. BLOCK_M=128, num_warps=8, maxnreg=255
    (None: ptxas's own choice); for bob_rows also SPLIT=False, one launch)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    known = (("BLOCK_M", "BLOCK_N", "num_warps", "num_stages", "maxnreg")
             + (("SPLIT",) if kernel == "bob_rows" else ()))
    unknown = sorted(set(settings) - set(known))
    if unknown:
        raise ValueError(f"override({kernel!r}) takes settings {known}, got {unknown}")
    previous = _overrides.get(kernel)
    _overrides[kernel] = settings
    try:
        yield
    finally:
        if previous is None:
            _overrides.pop(kernel)
        else:
            _overrides[kernel] = previous
