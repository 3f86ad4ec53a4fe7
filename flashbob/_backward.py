"""Triton first-backward kernels: delta = rowsum(dO * O), then dK, dV (one program per key block,
no atomics) and dQ (one program per query block)."""

import triton
import triton.language as tl

from ._tiles import (
    NO_SPECIALIZE,
    col_tile_needs_mask,
    heaviest_first_row_block,
    key_range,
    load_key_range,
    load_tile,
    lse_log2,
    query_range,
    row_tile_needs_mask,
    store_tile,
    visible,
    visible_t,
)


@triton.jit(do_not_specialize=["N", "HEADS"])
def row_dot_kernel(
    A, Bt, Out, sab, sah, san, sbb, sbh, sbn, svec, N, HEADS,
    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Out[b, h, i] = sum_d A[b, h, i, d] * Bt[b, h, i, d] in float32. Grid (cdiv(N, BLOCK_M), B * H)."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HEADS).to(tl.int64)
    h = (pid_bh % HEADS).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    a = load_tile(A + b * sab + h * sah, offs_m, offs_d, san, N, HEAD_DIM).to(tl.float32)
    bt = load_tile(Bt + b * sbb + h * sbh, offs_m, offs_d, sbn, N, HEAD_DIM).to(tl.float32)
    tl.store(Out + pid_bh.to(tl.int64) * svec + offs_m, tl.sum(a * bt, 1), mask=offs_m < svec)


@triton.jit(do_not_specialize=NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_backward_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, sdkb, sdkh, sdkn, svec,
    N, M, HEADS_Q, HEADS_KV, GROUP, OFFSET, WINDOW, qk_scale_log2, scale, KeyRange,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_RANGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, kv head), summing over its GROUP query heads.
    Grid (cdiv(M, BLOCK_N), B * Hkv). dK, dV share strides (both are fresh contiguous buffers)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // HEADS_KV).to(tl.int64)
    hk = (pid_bh % HEADS_KV).to(tl.int64)
    KS, KE = load_key_range(KeyRange, b, M, HAS_RANGE)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m0 = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k = load_tile(K + b * skb + hk * skh, offs_n, offs_d, skn, M, HEAD_DIM)
    v = load_tile(V + b * svb + hk * svh, offs_n, offs_d, svn, M, HEAD_DIM)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo, hi = query_range(start_n, N, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE, BLOCK_M, BLOCK_N)
    for g in range(0, GROUP):
        h = hk * GROUP + g
        row = (b * HEADS_Q + h) * svec
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        for start_m in range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            q = load_tile(q_base, offs_m, offs_d, sqn, N, HEAD_DIM)
            do = load_tile(do_base, offs_m, offs_d, sdon, N, HEAD_DIM)
            lse2 = lse_log2(Lse + row, offs_m, svec)
            delta = tl.load(Delta + row + offs_m, mask=offs_m < svec, other=0.0)
            # Transposed (key, query) tiles: P^T and dS^T are the left operands of dV and dK.
            pt = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale_log2 - lse2[None, :])
            if col_tile_needs_mask(start_m, start_n, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE,
                                   BLOCK_M, BLOCK_N):
                seen = visible_t(offs_n, offs_m, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE)
                pt = tl.where(seen, pt, 0.0)
            dpt = tl.dot(v, tl.trans(do), input_precision=PRECISION)
            dst = pt * (dpt - delta[None, :])
            dv = tl.dot(pt.to(do.dtype), do, dv, input_precision=PRECISION)
            dk = tl.dot(dst.to(q.dtype), q, dk, input_precision=PRECISION)
    store_tile(DK + b * sdkb + hk * sdkh, dk * scale, offs_n, offs_d, sdkn, M, HEAD_DIM)
    store_tile(DV + b * sdkb + hk * sdkh, dv, offs_n, offs_d, sdkn, M, HEAD_DIM)


@triton.jit(do_not_specialize=NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_backward_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon, sdqb, sdqh, sdqn, svec,
    N, M, HEADS_Q, GROUP, OFFSET, WINDOW, qk_scale_log2, scale, KeyRange,
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
    row = pid_bh.to(tl.int64) * svec
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n0 = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    q = load_tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, N, HEAD_DIM)
    do = load_tile(DO + b * sdob + h * sdoh, offs_m, offs_d, sdon, N, HEAD_DIM)
    lse2 = lse_log2(Lse + row, offs_m, svec)
    delta = tl.load(Delta + row + offs_m, mask=offs_m < svec, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    lo, hi = key_range(start_m, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE, BLOCK_M, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k = load_tile(k_base, offs_n, offs_d, skn, M, HEAD_DIM)
        v = load_tile(v_base, offs_n, offs_d, svn, M, HEAD_DIM)
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale_log2 - lse2[:, None])
        if row_tile_needs_mask(start_m, start_n, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW,
                               HAS_RANGE, BLOCK_M, BLOCK_N):
            seen = visible(offs_m, offs_n, N, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE)
            p = tl.where(seen, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=PRECISION)
    store_tile(DQ + b * sdqb + h * sdqh, dq * scale, offs_m, offs_d, sdqn, N, HEAD_DIM)
