"""Triton forward kernel: out = softmax(scale * Q K^T + mask) V and the row log-sum-exp."""

import triton
import triton.language as tl

from ._tiles import (
    NO_SPECIALIZE,
    heaviest_first_row_block,
    key_range,
    load_key_range,
    load_tile,
    row_tile_needs_mask,
    store_tile,
    visible,
)


@triton.jit(do_not_specialize=NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_forward_kernel(
    Q, K, V, Out, Lse,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son,
    N, M, HEADS_Q, GROUP, OFFSET, WINDOW, qk_scale_log2, KeyRange,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_RANGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head). Grid (cdiv(N, BLOCK_M), B * Hq)."""
    pid_m = heaviest_first_row_block()
    pid_bh = tl.program_id(1)
    b = (pid_bh // HEADS_Q).to(tl.int64)
    h = (pid_bh % HEADS_Q).to(tl.int64)
    hk = h // GROUP
    KS, KE = load_key_range(KeyRange, b, M, HAS_RANGE)
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_base = Q + b * sqb + h * sqh
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh

    q = load_tile(q_base, offs_m, offs_d, sqn, N, HEAD_DIM)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = key_range(start_m, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE, BLOCK_M, BLOCK_N)
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

    empty = row_sum == 0.0
    out = acc / tl.where(empty, 1.0, row_sum)[:, None]
    store_tile(Out + b * sob + h * soh, out, offs_m, offs_d, son, N, HEAD_DIM)
    lse_2 = row_max + tl.log2(tl.where(empty, 1.0, row_sum))
    lse = tl.where(empty, float("-inf"), lse_2 * 0.6931471805599453)  # natural log
    tl.store(Lse + pid_bh.to(tl.int64) * N + offs_m, lse, mask=offs_m < N)
