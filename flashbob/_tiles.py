"""Triton helpers shared by the attention kernels: pointers to tiles, masks, and the ranges of
tiles a mask leaves visible (so that fully masked tiles are never visited).

Per-batch-row key ranges (HAS_RANGE, a compile-time flag): batch row b sees only keys
KS <= j < KE, read once per program by `load_key_range`, on top of the causal / window mask.
Without ranges every range term is left out of the compiled kernel."""

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
NO_SPECIALIZE = ["N", "M", "HEADS_Q", "HEADS_KV", "OFFSET", "WINDOW", "SPLITS"]
"""Integer arguments the attention kernels must not specialize on: Triton would otherwise compile
again whenever one of them changes its divisibility by 16 or becomes 1 (a new sequence length, a
different head count or number of key splits). GROUP keeps only its "is 1" specialization (MHA
against GQA); the strides keep theirs, as they are multiples of 16 whenever the head dim is,
whatever the lengths, and aligned rows let the loads vectorize. So does `svec`, the row stride of the
float32 row vectors (lse, delta, c, e: `triton_ops.row_stride`, a multiple of 16): the kernels
address and mask those through it, never through N, so their loads vectorize too (through N, every
one was a scalar load). Names a kernel does not take are ignored."""


@triton.jit
def heaviest_first_row_block():
    """The query block of a program that owns rows, grid (cdiv(N, BLOCK_M), ...): the last block first.
    Under a causal mask a block's keys grow with its index, so the longest programs start first and
    the last wave holds the shortest (a program's work and result do not depend on its order)."""
    return tl.num_programs(0) - 1 - tl.program_id(0)


@triton.jit
def tile_ptrs(base, offs_rows, offs_d, stride_row):
    """Pointers to a (rows, BLOCK_D) tile of a row-major (seq, head_dim) slice."""
    return base + offs_rows[:, None] * stride_row + offs_d[None, :]


@triton.jit
def load_tile(base, offs_rows, offs_d, stride_row, n_rows, HEAD_DIM: tl.constexpr):
    """Load a (rows, BLOCK_D) tile, zero-filled past n_rows and past HEAD_DIM."""
    if offs_d.shape[0] == HEAD_DIM:
        mask = offs_rows[:, None] < n_rows
    else:
        mask = (offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    return tl.load(tile_ptrs(base, offs_rows, offs_d, stride_row), mask=mask, other=0.0)


@triton.jit
def store_tile(base, value, offs_rows, offs_d, stride_row, n_rows, HEAD_DIM: tl.constexpr):
    """Store a (rows, BLOCK_D) tile, skipping rows past n_rows and columns past HEAD_DIM."""
    if offs_d.shape[0] == HEAD_DIM:
        mask = offs_rows[:, None] < n_rows
    else:
        mask = (offs_rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM)
    tl.store(tile_ptrs(base, offs_rows, offs_d, stride_row), value.to(base.dtype.element_ty), mask=mask)


@triton.jit
def load_key_range(KeyRange, b, M, HAS_RANGE: tl.constexpr):
    """[ks, ke): the keys batch row b may see, from KeyRange (B, 2) int32, clipped to [0, M) (ke >= ks);
    (0, M) without ranges."""
    if HAS_RANGE:
        ks = tl.maximum(tl.load(KeyRange + 2 * b), 0)
        ke = tl.maximum(tl.minimum(tl.load(KeyRange + 2 * b + 1), M), ks)
    else:
        ks = 0
        ke = M
    return ks, ke


@triton.jit
def visible(offs_m, offs_n, N, M, OFFSET, WINDOW, KS, KE, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
            HAS_RANGE: tl.constexpr):
    """(BLOCK_M, BLOCK_N) mask: True where query offs_m may attend to key offs_n (both in range, and the
    key in the batch row's [KS, KE) with ranges)."""
    mask = (offs_m[:, None] < N) & (offs_n[None, :] < M)
    if CAUSAL:
        mask = mask & (offs_n[None, :] <= offs_m[:, None] + OFFSET)
        if HAS_WINDOW:
            mask = mask & (offs_n[None, :] > offs_m[:, None] + OFFSET - WINDOW)
    if HAS_RANGE:
        mask = mask & (offs_n[None, :] >= KS) & (offs_n[None, :] < KE)
    return mask


@triton.jit
def row_tile_needs_mask(start_m, start_n, M, OFFSET, WINDOW, KS, KE, CAUSAL: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, HAS_RANGE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """In a kernel over query rows: whether key tile start_n has keys that some row of the block
    start_m may not see (past M, after the causal limit, before the window, or outside [KS, KE))."""
    needs = start_n + BLOCK_N > M
    if CAUSAL:
        needs = needs | (start_n + BLOCK_N > start_m + OFFSET + 1)
        if HAS_WINDOW:
            needs = needs | (start_n < start_m + BLOCK_M + OFFSET - WINDOW)
    if HAS_RANGE:
        needs = needs | (start_n < KS) | (start_n + BLOCK_N > KE)
    return needs


@triton.jit
def col_tile_needs_mask(start_m, start_n, OFFSET, WINDOW, KS, KE, CAUSAL: tl.constexpr,
                        HAS_WINDOW: tl.constexpr, HAS_RANGE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """In a kernel over key columns: whether query tile start_m has rows that may not see some key
    of the block start_n (with ranges, any block with keys outside [KS, KE)). Rows past N need no
    mask there: their lse is +inf, so P is 0."""
    needs = start_m < 0
    if CAUSAL:
        needs = needs | (start_m < start_n + BLOCK_N - 1 - OFFSET)
        if HAS_WINDOW:
            needs = needs | (start_m + BLOCK_M > start_n - OFFSET + WINDOW)
    if HAS_RANGE:
        needs = needs | (start_n < KS) | (start_n + BLOCK_N > KE)
    return needs


@triton.jit
def key_range(start_m, M, OFFSET, WINDOW, KS, KE, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_RANGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the keys that rows start_m .. start_m + BLOCK_M - 1 may see (within [KS, KE) with
    ranges; empty when that range is); lo is BLOCK_N-aligned."""
    lo = 0
    hi = M
    if CAUSAL:
        hi = tl.minimum(M, start_m + BLOCK_M + OFFSET)
        if HAS_WINDOW:
            lo = tl.maximum(0, start_m + OFFSET - WINDOW + 1)
            lo = (lo // BLOCK_N) * BLOCK_N
    if HAS_RANGE:
        lo = tl.maximum(lo, (KS // BLOCK_N) * BLOCK_N)
        hi = tl.minimum(hi, KE)
        hi = tl.where(KE > KS, hi, lo)
    return lo, hi


@triton.jit
def split_piece(lo, hi, split, SPLITS, BLOCK_N: tl.constexpr):
    """[first, last): the piece of key split `split` of [lo, hi) (lo BLOCK_N-aligned), cut into SPLITS
    contiguous pieces of equally many whole BLOCK_N tiles (the last piece shorter); empty (first >=
    last) for the splits past the last tile."""
    tiles = tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_N)
    per_split = tl.cdiv(tiles, SPLITS) * BLOCK_N
    first = lo + split * per_split
    return first, tl.minimum(hi, first + per_split)


@triton.jit
def query_range(start_n, N, OFFSET, WINDOW, KS, KE, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
                HAS_RANGE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi): the queries that may see keys start_n .. start_n + BLOCK_N - 1 (those of them in
    [KS, KE) with ranges; empty when there are none); lo is BLOCK_M-aligned."""
    first = start_n
    last = start_n + BLOCK_N - 1
    if HAS_RANGE:
        first = tl.maximum(first, KS)
        last = tl.minimum(last, KE - 1)
    lo = 0
    hi = N
    if CAUSAL:
        lo = tl.maximum(0, first - OFFSET)
        lo = (lo // BLOCK_M) * BLOCK_M
        if HAS_WINDOW:
            hi = tl.minimum(N, last - OFFSET + WINDOW)
    if HAS_RANGE:
        hi = tl.where(last >= first, hi, lo)
    return lo, hi


@triton.jit
def lse_log2(lse_ptr, offs_m, N):
    """Row log-sum-exp in base 2, +inf on rows that see no key (so exp2(s - lse) is 0 there)."""
    lse = tl.load(lse_ptr + offs_m, mask=offs_m < N, other=float("inf"))
    return tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)


@triton.jit
def visible_t(offs_n, offs_m, OFFSET, WINDOW, KS, KE, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
              HAS_RANGE: tl.constexpr):
    """(BLOCK_N, BLOCK_M) mask for kernels over key columns: True where query offs_m sees key offs_n."""
    if CAUSAL:
        mask = offs_n[:, None] <= offs_m[None, :] + OFFSET
        if HAS_WINDOW:
            mask = mask & (offs_n[:, None] > offs_m[None, :] + OFFSET - WINDOW)
        if HAS_RANGE:
            mask = mask & (offs_n[:, None] >= KS) & (offs_n[:, None] < KE)
    else:
        mask = (offs_n[:, None] >= KS) & (offs_n[:, None] < KE) & (offs_m[None, :] >= 0)
    return mask
