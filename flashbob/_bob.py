"""Triton backward-over-backward (FlashBoB) kernels.

Notation of the design notes: P, dP = dO V^T, dS = P*(dP - delta), G = s*(U_Q K^T + Q U_K^T),
W = dO U_V^T, and the two row scalars c = rowsum(P*G), e = rowsum(P*G_P).

Rows kernel, one sweep over keys per query block. Every output of a row is affine in c and e, so it
accumulates the pieces and combines them once the sweep has found c and e. With
X = P*W + P*G*(dP - delta) and x = sum rowsum(X):
    c   = sum rowsum(P*G),          e = x - c*delta
    Q̄   = s*sum[X K + dS U_K] - s*x*sum[P K] - c*dQ
    dŌ  = sum[P U_V + (P*G) V] - c*O
using sum[(P*dP) K] = dQ/s + delta*sum[P K] (dQ from the first backward), sum[P V] = O, and
c*delta + e = x. At large head dims the three (BLOCK_M, D) accumulators do not fit the registers:
the kernel is then launched twice, once for Q̄, c, e (WANT_GQ) and once for dŌ (WANT_GDO).
Columns kernel, one program per key block (no atomics, deterministic), with c and e known, computed
in the transposed (key, query) orientation so that every tile is already the left operand it feeds:
    K̄ = s*sum[G_S^T Q + dS^T U_Q],   V̄ = sum[G_dP^T dO],
    G_S = P*(W + G*(dP - delta) - c*dP - e),   G_dP = P*(G - c),
with G_S formed as P*(W - e - c*delta) + (G - c)*dS, which keeps fewer (key, query) tiles live, so
fewer registers spill (the sm_90 counts: docs/notes/kernel_notes.md, "Calibration counts").
Absent cotangents are compile-time flags (HAS_G = HAS_UQ or HAS_UK): their products are never issued.
The float32 row vectors Lse, Delta, C, E hold one value per (batch, head, query), (batch, head) rows
svec apart; rows N to svec hold values that add nothing (lse +inf, the others 0), and the rows
kernel writes C and E there too.
"""

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


@triton.jit(do_not_specialize=NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_bob_rows_kernel(
    Q, K, V, O, DO, DQ, UQ, UK, UV, Lse, Delta, GQ, GDO, C, E,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sob, soh, son, sdob, sdoh, sdon,
    sdqb, sdqh, sdqn, suqb, suqh, suqn, sukb, sukh, sukn, suvb, suvh, suvn, sgb, sgh, sgn, svec,
    N, M, HEADS_Q, GROUP, OFFSET, WINDOW, qk_scale_log2, scale, KeyRange,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_RANGE: tl.constexpr, HAS_UQ: tl.constexpr,
    HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr, WANT_GQ: tl.constexpr,
    WANT_GDO: tl.constexpr, HEAD_DIM: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_M query rows of one (batch, query head); writes Q̄, c, e (WANT_GQ) and
    dŌ (WANT_GDO). Grid (cdiv(N, BLOCK_M), B * Hq). GQ and GDO share strides (fresh buffers)."""
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
    uk_base = UK + b * sukb + hk * sukh
    uv_base = UV + b * suvb + hk * suvh

    q = load_tile(Q + b * sqb + h * sqh, offs_m, offs_d, sqn, N, HEAD_DIM)
    do = load_tile(DO + b * sdob + h * sdoh, offs_m, offs_d, sdon, N, HEAD_DIM)
    if HAS_UQ:
        uq = load_tile(UQ + b * suqb + h * suqh, offs_m, offs_d, suqn, N, HEAD_DIM)
    lse2 = lse_log2(Lse + row, offs_m, svec)
    delta = tl.load(Delta + row + offs_m, mask=offs_m < svec, other=0.0)

    acc_q = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)    # sum X K + dS U_K
    acc_pk = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)   # sum P K
    acc_do = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)   # sum P U_V + (P*G) V
    c = tl.zeros([BLOCK_M], tl.float32)
    x_sum = tl.zeros([BLOCK_M], tl.float32)
    lo, hi = key_range(start_m, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE, BLOCK_M, BLOCK_N)
    for start_n in tl.range(lo, hi, BLOCK_N):
        offs_n = start_n + offs_n0
        k = load_tile(k_base, offs_n, offs_d, skn, M, HEAD_DIM)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        p = tl.exp2(s * qk_scale_log2 - lse2[:, None])
        if row_tile_needs_mask(start_m, start_n, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW,
                                 HAS_RANGE, BLOCK_M, BLOCK_N):
            seen = visible(offs_m, offs_n, N, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE)
            p = tl.where(seen, p, 0.0)
        x = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        if HAS_UV:
            uv = load_tile(uv_base, offs_n, offs_d, suvn, M, HEAD_DIM)
            if WANT_GQ:
                x += p * tl.dot(do, tl.trans(uv), input_precision=PRECISION)
            if WANT_GDO:
                acc_do = tl.dot(p.to(uv.dtype), uv, acc_do, input_precision=PRECISION)
        if HAS_G:
            v = load_tile(v_base, offs_n, offs_d, svn, M, HEAD_DIM)
            g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            if HAS_UQ:
                g = tl.dot(uq, tl.trans(k), g, input_precision=PRECISION)
            if HAS_UK:
                uk = load_tile(uk_base, offs_n, offs_d, sukn, M, HEAD_DIM)
                g = tl.dot(q, tl.trans(uk), g, input_precision=PRECISION)
            pg = p * g * scale
            c += tl.sum(pg, 1)
            if WANT_GQ:
                dp_shift = tl.dot(do, tl.trans(v), input_precision=PRECISION) - delta[:, None]
                x += pg * dp_shift
                if HAS_UK:
                    acc_q = tl.dot((p * dp_shift).to(uk.dtype), uk, acc_q, input_precision=PRECISION)
            if WANT_GDO:
                acc_do = tl.dot(pg.to(v.dtype), v, acc_do, input_precision=PRECISION)
        if WANT_GQ:
            x_sum += tl.sum(x, 1)
            acc_q = tl.dot(x.to(k.dtype), k, acc_q, input_precision=PRECISION)
            acc_pk = tl.dot(p.to(k.dtype), k, acc_pk, input_precision=PRECISION)

    if WANT_GQ:
        gq = acc_q * scale - (scale * x_sum)[:, None] * acc_pk
        if HAS_G:
            dq = load_tile(DQ + b * sdqb + h * sdqh, offs_m, offs_d, sdqn, N, HEAD_DIM).to(tl.float32)
            gq -= c[:, None] * dq
        store_tile(GQ + b * sgb + h * sgh, gq, offs_m, offs_d, sgn, N, HEAD_DIM)
        tl.store(C + row + offs_m, c, mask=offs_m < svec)
        tl.store(E + row + offs_m, x_sum - c * delta, mask=offs_m < svec)
    if WANT_GDO:
        if HAS_G:
            o = load_tile(O + b * sob + h * soh, offs_m, offs_d, son, N, HEAD_DIM).to(tl.float32)
            acc_do -= c[:, None] * o
        store_tile(GDO + b * sgb + h * sgh, acc_do, offs_m, offs_d, sgn, N, HEAD_DIM)


@triton.jit(do_not_specialize=NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_bob_cols_kernel(
    Q, K, V, DO, UQ, UK, UV, Lse, Delta, C, E, GK, GV,
    sqb, sqh, sqn, skb, skh, skn, svb, svh, svn, sdob, sdoh, sdon,
    suqb, suqh, suqn, sukb, sukh, sukn, suvb, suvh, suvn, sgb, sgh, sgn, svec,
    N, M, HEADS_Q, HEADS_KV, GROUP, OFFSET, WINDOW, qk_scale_log2, scale, KeyRange,
    CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_RANGE: tl.constexpr, HAS_UQ: tl.constexpr,
    HAS_UK: tl.constexpr, HAS_UV: tl.constexpr, HAS_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, kv head), summing over its GROUP query heads;
    writes K̄ and V̄. Grid (cdiv(M, BLOCK_N), B * Hkv). GK and GV share strides. Tiles are
    (BLOCK_N, BLOCK_M): the transposes of the rows kernel's."""
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
    if HAS_G:
        v = load_tile(V + b * svb + hk * svh, offs_n, offs_d, svn, M, HEAD_DIM)
    if HAS_UK:
        uk = load_tile(UK + b * sukb + hk * sukh, offs_n, offs_d, sukn, M, HEAD_DIM)
    if HAS_UV:
        uv = load_tile(UV + b * suvb + hk * suvh, offs_n, offs_d, suvn, M, HEAD_DIM)
    acc_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    acc_v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo, hi = query_range(start_n, N, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE, BLOCK_M, BLOCK_N)
    for g_head in range(0, GROUP):
        h = hk * GROUP + g_head
        row = (b * HEADS_Q + h) * svec
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdob + h * sdoh
        uq_base = UQ + b * suqb + h * suqh
        for start_m in tl.range(lo, hi, BLOCK_M):
            offs_m = start_m + offs_m0
            q = load_tile(q_base, offs_m, offs_d, sqn, N, HEAD_DIM)
            lse2 = lse_log2(Lse + row, offs_m, svec)
            e = tl.load(E + row + offs_m, mask=offs_m < svec, other=0.0)
            st = tl.dot(k, tl.trans(q), input_precision=PRECISION)
            pt = tl.exp2(st * qk_scale_log2 - lse2[None, :])
            if col_tile_needs_mask(start_m, start_n, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE,
                                     BLOCK_M, BLOCK_N):
                seen = visible_t(offs_n, offs_m, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE)
                pt = tl.where(seen, pt, 0.0)
            # With gc = G - c and P_dP = P*(dP - delta) (transposed): V̄ += (P*gc)^T dO,
            # K̄ += P_dP^T U_Q + [P*(U_V dO^T - e - c*delta) + gc*P_dP]^T Q (= (P*(G_P - e))^T Q).
            base = -e
            if HAS_UV or HAS_G:
                do = load_tile(do_base, offs_m, offs_d, sdon, N, HEAD_DIM)
            if HAS_G:
                delta = tl.load(Delta + row + offs_m, mask=offs_m < svec, other=0.0)
                c = tl.load(C + row + offs_m, mask=offs_m < svec, other=0.0)
                base -= c * delta
            if HAS_UV:
                rt = pt * tl.dot(uv, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], tl.float32) + base[None, :],
                                 input_precision=PRECISION)
            else:
                rt = pt * base[None, :]
            if HAS_G:
                gt = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
                if HAS_UQ:
                    uq = load_tile(uq_base, offs_m, offs_d, suqn, N, HEAD_DIM)
                    gt = tl.dot(k, tl.trans(uq), gt, input_precision=PRECISION)
                if HAS_UK:
                    gt = tl.dot(uk, tl.trans(q), gt, input_precision=PRECISION)
                gct = gt * scale - c[None, :]
                acc_v = tl.dot((pt * gct).to(do.dtype), do, acc_v, input_precision=PRECISION)
                p_dpt = pt * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
                if HAS_UQ:
                    acc_k = tl.dot(p_dpt.to(uq.dtype), uq, acc_k, input_precision=PRECISION)
                rt += gct * p_dpt
            acc_k = tl.dot(rt.to(q.dtype), q, acc_k, input_precision=PRECISION)
    store_tile(GK + b * sgb + hk * sgh, acc_k * scale, offs_n, offs_d, sgn, M, HEAD_DIM)
    store_tile(GV + b * sgb + hk * sgh, acc_v, offs_n, offs_d, sgn, M, HEAD_DIM)
