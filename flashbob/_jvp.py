"""Triton forward-with-tangent kernel: out, lse and the tangent tO of out in one sweep over keys.

With S = s Q K^T, P = softmax(S), O = P V and tangents dQ, dK, dV of q, k, v:
    dS = s (dQ K^T + Q dK^T),   mu = rowsum(P * dS),   tO = (P * (dS - mu)) V + P dV.
The sweep keeps, per row and rescaled by the running max like the softmax sum l:
    l = sum exp(S - m),  acc = sum exp(S - m) V,  mu_acc = sum exp(S - m) dS,
    t_acc = sum exp(S - m) (dS V + dV),
and ends with O = acc / l, mu = mu_acc / l, tO = t_acc / l - mu O (derivation in
docs/forward_mode.md). Absent tangents are compile-time flags: their products are never issued.
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
    store_tile,
    visible,
)

JVP_NO_SPECIALIZE = [name for name in NO_SPECIALIZE if name != "HEADS_KV"]
"""The lengths and counts a new value of which must not compile the kernel again (it takes no HEADS_KV)."""


@triton.jit(do_not_specialize=JVP_NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_jvp_kernel(
    Q, K, V, TQ, TK, TV, Out, TOut, Lse,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, stqb, stqh, stqn, stkb, stkh, stkn,
    stvb, stvh, stvn, sob, soh, son,
    N, M, HEADS_Q, GROUP, OFFSET, WINDOW, qk_scale_log2, scale, KeyRange,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_RANGE: tl.constexpr, HAS_TQ: tl.constexpr,
    HAS_TK: tl.constexpr, HAS_TV: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head). Grid (cdiv(N, BLOCK_M), B * Hq).
    Out and TOut share strides (fresh buffers)."""
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
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    tk_base = TK + b * stkb + hk * stkh
    tv_base = TV + b * stvb + hk * stvh

    q = load_tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, N, HEAD_DIM)
    if HAS_TQ:
        tq = load_tile(TQ + b * stqb + h * stqh, offs_m, offs_d, stqn, N, HEAD_DIM)
    row_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    row_sum = tl.zeros([BLOCK_M], tl.float32)
    mu_acc = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    t_acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
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
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
        t_acc = t_acc * alpha[:, None]
        if HAS_TQ or HAS_TK:
            # dS in natural units; masked entries are finite and meet p = 0.
            if HAS_TQ:
                ds = tl.dot(tq, tl.trans(k), input_precision=PRECISION)
                if HAS_TK:
                    tk = load_tile(tk_base, offs_n, offs_d, stkn, M, HEAD_DIM)
                    ds = tl.dot(q, tl.trans(tk), ds, input_precision=PRECISION)
            else:
                tk = load_tile(tk_base, offs_n, offs_d, stkn, M, HEAD_DIM)
                ds = tl.dot(q, tl.trans(tk), input_precision=PRECISION)
            pds = p * (ds * scale)
            mu_acc = mu_acc * alpha + tl.sum(pds, 1)
            t_acc = tl.dot(pds.to(v.dtype), v, t_acc, input_precision=PRECISION)
        if HAS_TV:
            tv = load_tile(tv_base, offs_n, offs_d, stvn, M, HEAD_DIM)
            t_acc = tl.dot(p.to(tv.dtype), tv, t_acc, input_precision=PRECISION)
        row_max = new_max

    empty = row_sum == 0.0
    inv = 1.0 / tl.where(empty, 1.0, row_sum)
    out = acc * inv[:, None]
    t_out = t_acc * inv[:, None] - (mu_acc * inv)[:, None] * out
    store_tile(Out + b * sob + h * soh, out, offs_m, offs_d, son, N, HEAD_DIM)
    store_tile(TOut + b * sob + h * soh, t_out, offs_m, offs_d, son, N, HEAD_DIM)
    lse_2 = row_max + tl.log2(tl.where(empty, 1.0, row_sum))
    lse = tl.where(empty, float("-inf"), lse_2 * 0.6931471805599453)  # natural log
    tl.store(Lse + pid_bh.to(tl.int64) * N + offs_m, lse, mask=offs_m < N)
