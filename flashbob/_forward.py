"""Triton forward kernels: out = softmax(scale * Q K^T + mask) V and the row log-sum-exp.

`attention_forward_kernel` gives each program BLOCK_M query rows and all the keys they see. For few
query rows and many keys (decoding) that grid is too small to fill the GPU, so the keys are split
("flash-decoding"): `attention_forward_split_kernel` gives each program one of SPLITS contiguous
pieces of the keys of its rows, and writes the piece's normalized output and log-sum-exp lse_s to
float32 scratch; `attention_forward_combine_kernel` then merges the pieces of each row,

    L = max_s lse_s,   w_s = 2^(lse_s - L),   out = sum_s w_s out_s / sum_s w_s,   lse = L + log2 sum_s w_s,

with the same results (rows that see no key: out 0, lse -inf) as the single kernel.
"""

import triton
import triton.language as tl

from ._tiles import (
    NO_SPECIALIZE,
    heaviest_first_row_block,
    key_range,
    load_key_range,
    load_tile,
    row_tile_needs_mask,
    split_piece,
    store_tile,
    visible,
)


@triton.jit
def attend(q, k_base, v_base, skn, svn, start_m, offs_m, offs_d, lo, hi, N, M, OFFSET, WINDOW, KS, KE,
           qk_scale_log2, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_RANGE: tl.constexpr,
           HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
           BLOCK_D: tl.constexpr):
    """The online softmax of the rows offs_m (block start_m; q their (BLOCK_M, BLOCK_D) tile) over the
    keys [lo, hi) (lo BLOCK_N-aligned). Returns the unnormalized output acc (BLOCK_M, BLOCK_D), the
    row max (base 2; -inf on rows that saw no visible key) and the row sum (0 there), float32."""
    offs_n0 = tl.arange(0, BLOCK_N)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k = load_tile(k_base, offs_n, offs_d, skn, M, HEAD_DIM)
        v = load_tile(v_base, offs_n, offs_d, svn, M, HEAD_DIM)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2
        if row_tile_needs_mask(start_m, start_n, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW,
                               HAS_RANGE, BLOCK_M, BLOCK_N):
            seen = visible(offs_m, offs_n, N, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE)
            s = tl.where(seen, s, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(s, 1))
        # Rows that have seen no visible key yet keep a -inf max; shift them by 0 instead.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        p = tl.exp2(s - shift[:, None])
        alpha = tl.exp2(row_max - shift)
        row_sum = row_sum * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=PRECISION)
        row_max = new_max
    return acc, row_max, row_sum


@triton.jit(do_not_specialize=NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_forward_kernel(
    Q, K, V, Out, Lse,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    N, M, HEADS_Q, GROUP, OFFSET, WINDOW, qk_scale_log2, KeyRange,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_RANGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head). Grid (cdiv(N, BLOCK_M), B * Hq).
    Its loop is `attend`; the statements around it keep their order from before that helper existed,
    so it compiles to the same sm_90 code as then (SASS hash, `python -m flashbob.bench sm90`)."""
    pid_m = heaviest_first_row_block()
    pid_bh = tl.program_id(1)
    b = (pid_bh // HEADS_Q).to(tl.int64)
    h = (pid_bh % HEADS_Q).to(tl.int64)
    hk = h // GROUP
    KS, KE = load_key_range(KeyRange, b, M, HAS_RANGE)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh

    q = load_tile(q_base, offs_m, offs_d, sqn, N, HEAD_DIM)
    lo, hi = key_range(start_m, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE, BLOCK_M, BLOCK_N)
    acc, row_max, row_sum = attend(
        q, k_base, v_base, skn, svn, start_m, offs_m, offs_d, lo, hi,
        N, M, OFFSET, WINDOW, KS, KE, qk_scale_log2, CAUSAL, HAS_WINDOW, HAS_RANGE, HEAD_DIM, PRECISION,
        BLOCK_M, BLOCK_N, BLOCK_D)
    empty = row_sum == 0.0
    out = acc / tl.where(empty, 1.0, row_sum)[:, None]
    store_tile(Out + b * sob + h * soh, out, offs_m, offs_d, son, N, HEAD_DIM)
    lse_2 = row_max + tl.log2(tl.where(empty, 1.0, row_sum))
    lse = tl.where(empty, float("-inf"), lse_2 * 0.6931471805599453)  # natural log
    tl.store(Lse + pid_bh.to(tl.int64) * N + offs_m, lse, mask=offs_m < N)


@triton.jit(do_not_specialize=NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_forward_split_kernel(
    Q, K, V, Part, PartLse,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn,
    N, M, HEADS_Q, GROUP, OFFSET, WINDOW, SPLITS, qk_scale_log2, KeyRange,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_RANGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head) against piece `split` of the keys
    they see (`split_piece`). Grid (cdiv(N, BLOCK_M), SPLITS, B * Hq). Writes the piece's normalized
    output to Part (B * Hq, N, SPLITS, HEAD_DIM) and its log-sum-exp in base 2 to PartLse
    (B * Hq, N, SPLITS), both float32; where a row sees no key of the piece, 0 and -inf."""
    pid_m = heaviest_first_row_block()
    split = tl.program_id(1)
    pid_bh = tl.program_id(2)
    b = (pid_bh // HEADS_Q).to(tl.int64)
    h = (pid_bh % HEADS_Q).to(tl.int64)
    hk = h // GROUP
    KS, KE = load_key_range(KeyRange, b, M, HAS_RANGE)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)

    q = load_tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, N, HEAD_DIM)
    lo, hi = key_range(start_m, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE, BLOCK_M, BLOCK_N)
    lo, hi = split_piece(lo, hi, split, SPLITS, BLOCK_N)
    acc, row_max, row_sum = attend(
        q, K + b * skb + hk * skh, V + b * svb + hk * svh, skn, svn, start_m, offs_m, offs_d, lo, hi,
        N, M, OFFSET, WINDOW, KS, KE, qk_scale_log2, CAUSAL, HAS_WINDOW, HAS_RANGE, HEAD_DIM, PRECISION,
        BLOCK_M, BLOCK_N, BLOCK_D)
    empty = row_sum == 0.0
    out = acc / tl.where(empty, 1.0, row_sum)[:, None]
    lse_2 = tl.where(empty, float("-inf"), row_max + tl.log2(tl.where(empty, 1.0, row_sum)))
    first = pid_bh.to(tl.int64) * N * SPLITS + split   # (batch and head, row 0, split)
    store_tile(Part + first * HEAD_DIM, out, offs_m, offs_d, SPLITS * HEAD_DIM, N, HEAD_DIM)
    tl.store(PartLse + first + offs_m * SPLITS, lse_2, mask=offs_m < N)


@triton.jit(do_not_specialize=NO_SPECIALIZE)
def attention_forward_combine_kernel(
    Part, PartLse, Out, Lse,
    sob, soh, son,
    N, HEADS_Q, SPLITS,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: one query row of one (batch, query head), grid (N, B * Hq). Merges the row's SPLITS
    pieces from `attention_forward_split_kernel`, BLOCK_S at a time (module docstring), into Out and
    Lse (natural log): out 0 and lse -inf where no piece saw a key."""
    row = tl.program_id(0)
    pid_bh = tl.program_id(1)
    first = (pid_bh.to(tl.int64) * N + row) * SPLITS
    offs_s0 = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    lse_max = float("-inf")
    total = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start_s in range(0, SPLITS, BLOCK_S):
        offs_s = start_s + offs_s0
        lse_2 = tl.load(PartLse + first + offs_s, mask=offs_s < SPLITS, other=float("-inf"))
        part = load_tile(Part + first * HEAD_DIM, offs_s, offs_d, HEAD_DIM, SPLITS, HEAD_DIM)
        new_max = tl.maximum(lse_max, tl.max(lse_2, 0))
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        weight = tl.exp2(lse_2 - shift)
        alpha = tl.exp2(lse_max - shift)
        total = total * alpha + tl.sum(weight, 0)
        acc = acc * alpha + tl.sum(weight[:, None] * part, 0)
        lse_max = new_max

    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)
    lse_2 = lse_max + tl.log2(tl.where(empty, 1.0, total))
    lse = tl.where(empty, float("-inf"), lse_2 * 0.6931471805599453)  # natural log
    b = (pid_bh // HEADS_Q).to(tl.int64)
    h = (pid_bh % HEADS_Q).to(tl.int64)
    out_row = Out + b * sob + h * soh + row.to(tl.int64) * son
    tl.store(out_row + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)
    tl.store(Lse + pid_bh.to(tl.int64) * N + row, lse)
