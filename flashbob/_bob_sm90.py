"""The BoB kernels for Hopper (sm_90), written in Gluon: the two passes of `flashbob/_bob.py` (notation and
formulas there) with their tiles moved by the tensor-memory accelerator (TMA) and their products issued
as warpgroup MMAs, the accumulating ones with their left operand in registers.

Columns pass (K̄ and V̄, c and e known). A consumer warpgroup owns BLOCK_N keys of one (batch, kv
head): their tiles (K, and V, U_K, U_V where their flags are on) are loaded once, and the query-side
tiles (Q, dO, U_Q) of the GROUP query heads with their float32 row vectors (lse, delta, c, e) stream
through a ring of STAGES shared-memory slots, each filled by TMA and completed on an mbarrier. Per
query tile (`_cols_tile`) the score-side products (S^T = K Q^T, U_V dO^T, V dO^T, K U_Q^T + U_K Q^T)
are issued asynchronously, then the products into K̄ and V̄. Two forms:
`attention_bob_cols_sm90_kernel`, one warpgroup a program that also issues its loads, and
`attention_bob_cols_ws_sm90_kernel`, warp-specialized: two consumer warpgroups with keys of their
own share each query tile, and a producer warp refills a slot once both have released it.

Rows pass (Q̄, dŌ, c and e), `attention_bob_rows_ws_sm90_kernel`, warp-specialized the same way:
two consumer warpgroups own BLOCK_M queries each (their Q, dO, U_Q loaded once) and share the key
tiles (K, V, U_K, U_V) that a producer warp streams through the ring; per key tile (`_rows_tile`)
the one-sweep affine split of the portable rows kernel. Where the three (BLOCK_M, D) float32
accumulators do not fit the registers (head dim 128), it leaves out sum[P K] (LATE_PK) and writes
Q̄ without its last term, in float32; a second, forward-like kernel (S and P K only) adds it.

Tiles are 4-D TMA boxes (1, 1, rows, D) of (B, H, L, D) tensors of any 16-byte-aligned strides, so
rows past a head's length read as zeros and never as the next head's. The masks and ranges are the
portable kernels' own helpers. Every output element is summed by one warpgroup in a fixed order, so
two calls give the same bits.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from ._tiles import (
    NO_SPECIALIZE,
    col_tile_needs_mask,
    key_range,
    load_key_range,
    lse_log2,
    query_range,
    row_tile_needs_mask,
    visible,
    visible_t,
)

tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
"""TMA's global-to-shared copy (tensor descriptor, coordinates, mbarrier, destination): `async_load` since
Triton 3.8, `async_copy_global_to_shared` before (3.9 removed that name)."""


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """STAGES mbarriers in shared memory, one per ring slot, each initialised to one arrival."""
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    return bars


@gluon.jit
def _issue_query_tiles(t, n_tiles, lo, b, hk, GROUP, q_desc, do_desc, uq_desc, lse_desc, e_desc,
                       delta_desc, c_desc, bars, q_ring, do_ring, uq_ring, lse_ring, e_ring, delta_ring,
                       c_ring, LOAD_DO: gl.constexpr, HAS_UQ: gl.constexpr, HAS_G: gl.constexpr,
                       BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    """Start the TMA loads of query tile t (head t // n_tiles of the group, rows lo + (t % n_tiles) *
    BLOCK_M) and of its row vectors (lse and e, with HAS_G delta and c) into ring slot t % STAGES,
    completing on that slot's barrier (the vectors' descriptors: (1, 1, R >= BLOCK_M) boxes of (B, Hq, N)
    float32 tensors)."""
    slot = t % STAGES
    h = hk * GROUP + t // n_tiles
    start_m = lo + (t % n_tiles) * BLOCK_M
    nbytes: gl.constexpr = (q_desc.block_type.nbytes * (1 + LOAD_DO + HAS_UQ)
                            + lse_desc.block_type.nbytes * (2 + 2 * HAS_G))
    bar = bars.index(slot)
    mbarrier.expect(bar, nbytes)
    tma_load(q_desc, [b, h, start_m, 0], bar, q_ring.index(slot))
    if LOAD_DO:
        tma_load(do_desc, [b, h, start_m, 0], bar, do_ring.index(slot))
    if HAS_UQ:
        tma_load(uq_desc, [b, h, start_m, 0], bar, uq_ring.index(slot))
    tma_load(lse_desc, [b, h, start_m], bar, lse_ring.index(slot))
    tma_load(e_desc, [b, h, start_m], bar, e_ring.index(slot))
    if HAS_G:
        tma_load(delta_desc, [b, h, start_m], bar, delta_ring.index(slot))
        tma_load(c_desc, [b, h, start_m], bar, c_ring.index(slot))


@gluon.jit
def _vector(slot, ring, BLOCK_M: gl.constexpr, layout: gl.constexpr):
    """The first BLOCK_M values of ring slot `slot` of a row vector's (STAGES, 1, 1, rows) ring, in `layout`
    (a box may be wider than the query tile: TMA writes shared memory only at 128-byte-aligned addresses)."""
    rows: gl.constexpr = ring.shape[3]
    return ring.index(slot).reshape([rows]).slice(0, BLOCK_M).load(layout)


@gluon.jit
def _query_vectors(slot, lse_ring, e_ring, delta_ring, c_ring, HAS_G: gl.constexpr, BLOCK_M: gl.constexpr,
                   layout: gl.constexpr):
    """The float32 row vectors of the query tile in ring slot `slot`: lse in base 2 (+inf on rows that see
    no key), e, and with HAS_G delta and c (zeros otherwise), each (BLOCK_M,) in `layout`."""
    lse = _vector(slot, lse_ring, BLOCK_M, layout)
    lse2 = gl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    e = _vector(slot, e_ring, BLOCK_M, layout)
    if HAS_G:
        delta = _vector(slot, delta_ring, BLOCK_M, layout)
        c = _vector(slot, c_ring, BLOCK_M, layout)
    else:
        delta = gl.zeros_like(e)
        c = gl.zeros_like(e)
    return lse2, e, delta, c


@gluon.jit
def _issue_key_tiles(t, lo, b, hk, k_desc, v_desc, uk_desc, uv_desc, bars, k_ring, v_ring, uk_ring, uv_ring,
                     HAS_G: gl.constexpr, HAS_UK: gl.constexpr, HAS_UV: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr):
    """Start the TMA loads of key tile t (keys lo + t * BLOCK_N of kv head hk) into ring slot
    t % STAGES, completing on that slot's barrier."""
    slot = t % STAGES
    start_n = lo + t * BLOCK_N
    nbytes: gl.constexpr = k_desc.block_type.nbytes * (1 + HAS_G + HAS_UK + HAS_UV)
    bar = bars.index(slot)
    mbarrier.expect(bar, nbytes)
    tma_load(k_desc, [b, hk, start_n, 0], bar, k_ring.index(slot))
    if HAS_G:
        tma_load(v_desc, [b, hk, start_n, 0], bar, v_ring.index(slot))
    if HAS_UK:
        tma_load(uk_desc, [b, hk, start_n, 0], bar, uk_ring.index(slot))
    if HAS_UV:
        tma_load(uv_desc, [b, hk, start_n, 0], bar, uv_ring.index(slot))


@gluon.jit
def _load_rows(base, sb, sh, sn, b, h, offs_m, offs_d, N):
    """The (BLOCK_M, D) float32 tile of rows offs_m of (b, h) of a (B, H, N, D) tensor, zeros past N;
    its layout is that of offs_m[:, None] + offs_d[None, :]."""
    offsets = offs_m[:, None].to(gl.int64) * sn + offs_d[None, :]
    return gl.load(base + b.to(gl.int64) * sb + h.to(gl.int64) * sh + offsets, mask=offs_m[:, None] < N,
                   other=0.0).to(gl.float32)


@gluon.jit
def _row_block(HEADS_Q, GROUP, KeyRange, M, svec, HAS_RANGE: gl.constexpr, BLOCK_M: gl.constexpr,
               layout: gl.constexpr):
    """The query block of a rows-pass program (grid (cdiv(N, BLOCK_M), B * Hq)): batch b, query head
    h, kv head hk, the batch row's key range [KS, KE), the offset `row` of its row vectors, its first
    query start_m (the last block first, as `_tiles.heaviest_first_row_block` orders them) and its
    queries offs_m (BLOCK_M,) in `layout`."""
    pid_bh = gl.program_id(1)
    b = pid_bh // HEADS_Q
    h = pid_bh % HEADS_Q
    KS, KE = load_key_range(KeyRange, b.to(gl.int64), M, HAS_RANGE)
    start_m = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=layout)
    return b, h, h // GROUP, KS, KE, pid_bh.to(gl.int64) * svec, start_m, offs_m


@gluon.jit
def _cols_tile(slot, start_m, start_n, offs_n, acc_k, acc_v, q_ring, do_ring, uq_ring, lse_ring, e_ring,
               delta_ring, c_ring, k_t, v_t, uk_t, uv_t, OFFSET, WINDOW, KS, KE, qk_scale_log2, scale,
               CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_RANGE: gl.constexpr, HAS_UQ: gl.constexpr,
               HAS_UK: gl.constexpr, HAS_UV: gl.constexpr, HAS_G: gl.constexpr, HEAD_DIM: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """One query tile of the columns pass (ring slot `slot`, queries start_m ..) against the keys offs_n
    (BLOCK_N,) starting at start_n whose tiles k_t, v_t, uk_t, uv_t ((BLOCK_N, D) shared memory; those
    whose flag is off are never read) a warpgroup holds: returns acc_k, acc_v (BLOCK_N, D) float32 with
    the tile's terms added. With gc = G - c and P_dP = P*(dP - delta) (transposed): V̄ += (P*gc)^T dO,
    K̄ += P_dP^T U_Q + [P*(U_V dO^T - e - c*delta) + gc*P_dP]^T Q (= (P*(G_P - e))^T Q)."""
    LOAD_DO: gl.constexpr = HAS_UV or HAS_G
    dtype: gl.constexpr = q_ring.dtype
    score_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    left_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    queries_of: gl.constexpr = gl.SliceLayout(0, score_layout)
    zero_scores = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, score_layout)

    offs_m = start_m + gl.arange(0, BLOCK_M, layout=queries_of)
    lse2, e, delta, c = _query_vectors(slot, lse_ring, e_ring, delta_ring, c_ring, HAS_G, BLOCK_M, queries_of)
    q_t = q_ring.index(slot).reshape([BLOCK_M, HEAD_DIM])
    if LOAD_DO:
        do_t = do_ring.index(slot).reshape([BLOCK_M, HEAD_DIM])
    st = warpgroup_mma(k_t, q_t.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
    if HAS_UV:
        uvdo = warpgroup_mma(uv_t, do_t.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
    st = warpgroup_mma_wait(num_outstanding=HAS_UV, deps=(st,))
    pt = gl.exp2(st * qk_scale_log2 - lse2[None, :])
    if col_tile_needs_mask(start_m, start_n, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE,
                           BLOCK_M, BLOCK_N):
        seen = visible_t(offs_n, offs_m, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE)
        pt = gl.where(seen, pt, 0.0)
    base = -e
    if HAS_G:
        base -= c * delta
    if HAS_UV:
        r = pt * (warpgroup_mma_wait(num_outstanding=0, deps=(uvdo,)) + base[None, :])
    else:
        r = pt * base[None, :]
    if HAS_G:
        if HAS_UQ:
            uq_t = uq_ring.index(slot).reshape([BLOCK_M, HEAD_DIM])
            gt = warpgroup_mma(k_t, uq_t.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
            if HAS_UK:
                gt = warpgroup_mma(uk_t, q_t.permute((1, 0)), gt, is_async=True)
        else:
            gt = warpgroup_mma(uk_t, q_t.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
        dpt = warpgroup_mma(v_t, do_t.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
        gt = warpgroup_mma_wait(num_outstanding=1, deps=(gt,))
        gc = gt * scale - c[None, :]
        acc_v = warpgroup_mma(gl.convert_layout((pt * gc).to(dtype), left_layout), do_t, acc_v)
        dpt = warpgroup_mma_wait(num_outstanding=0, deps=(dpt,))
        p_dpt = pt * (dpt - delta[None, :])
        if HAS_UQ:
            acc_k = warpgroup_mma(gl.convert_layout(p_dpt.to(dtype), left_layout), uq_t, acc_k)
        r += gc * p_dpt
    acc_k = warpgroup_mma(gl.convert_layout(r.to(dtype), left_layout), q_t, acc_k)
    return acc_k, acc_v


@gluon.jit
def _store_key_rows(GK, GV, sgb, sgh, sgn, b, hk, start_n, M, acc_k, acc_v, scale, HEAD_DIM: gl.constexpr,
                    BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """Write K̄ = scale * acc_k and V̄ = acc_v ((BLOCK_N, D) float32) to keys start_n .. of (b, hk) of GK,
    GV (B, Hkv, M, D), keys past M left out."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    out_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, acc_layout))
    out_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    offsets = b.to(gl.int64) * sgb + hk * sgh + out_n[:, None].to(gl.int64) * sgn + out_d[None, :]
    keep = out_n[:, None] < M
    gl.store(GK + offsets, (acc_k * scale).to(GK.dtype.element_ty), mask=keep)
    gl.store(GV + offsets, acc_v.to(GV.dtype.element_ty), mask=keep)


@gluon.jit(do_not_specialize=NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_bob_cols_sm90_kernel(
    q_desc, k_desc, v_desc, do_desc, uq_desc, uk_desc, uv_desc, lse_desc, delta_desc, c_desc, e_desc,
    GK, GV, sgb, sgh, sgn,
    N, M, HEADS_KV, GROUP, OFFSET, WINDOW, qk_scale_log2, scale, KeyRange,
    CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_RANGE: gl.constexpr, HAS_UQ: gl.constexpr,
    HAS_UK: gl.constexpr, HAS_UV: gl.constexpr, HAS_G: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """One program: BLOCK_N keys of one (batch, kv head), summing over its GROUP query heads; writes K̄
    and V̄ (GK, GV: (B, Hkv, M, D), shared strides). Grid (cdiv(M, BLOCK_N), B * Hkv). Descriptors: TMA
    boxes (1, 1, BLOCK_M, D) of q, dout, u_q, (1, 1, BLOCK_N, D) of k, v, u_k, u_v (an absent
    cotangent's flag is off and its descriptor, a stand-in, is never read) and (1, 1, R) of the float32
    row vectors lse, delta, c, e (B, Hq, N), R >= BLOCK_M rows of which the first BLOCK_M are read."""
    LOAD_DO: gl.constexpr = HAS_UV or HAS_G
    dtype: gl.constexpr = q_desc.dtype
    score_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    keys_of: gl.constexpr = gl.SliceLayout(1, score_layout)

    pid_n = gl.program_id(0)
    pid_bh = gl.program_id(1)
    b = pid_bh // HEADS_KV
    hk = pid_bh % HEADS_KV
    KS, KE = load_key_range(KeyRange, b.to(gl.int64), M, HAS_RANGE)
    start_n = pid_n * BLOCK_N
    offs_n = start_n + gl.arange(0, BLOCK_N, layout=keys_of)

    key_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(key_bar.index(0), count=1)
    k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
    key_bytes: gl.constexpr = k_desc.block_type.nbytes * (1 + HAS_G + HAS_UK + HAS_UV)
    v_smem = k_smem
    uk_smem = k_smem
    uv_smem = k_smem
    if HAS_G:
        v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
    if HAS_UK:
        uk_smem = gl.allocate_shared_memory(dtype, uk_desc.block_type.shape, uk_desc.layout)
    if HAS_UV:
        uv_smem = gl.allocate_shared_memory(dtype, uv_desc.block_type.shape, uv_desc.layout)
    mbarrier.expect(key_bar.index(0), key_bytes)
    tma_load(k_desc, [b, hk, start_n, 0], key_bar.index(0), k_smem)
    if HAS_G:
        tma_load(v_desc, [b, hk, start_n, 0], key_bar.index(0), v_smem)
    if HAS_UK:
        tma_load(uk_desc, [b, hk, start_n, 0], key_bar.index(0), uk_smem)
    if HAS_UV:
        tma_load(uv_desc, [b, hk, start_n, 0], key_bar.index(0), uv_smem)

    bars = _ring_barriers(STAGES)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
    do_ring = q_ring
    uq_ring = q_ring
    if LOAD_DO:
        do_ring = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
    if HAS_UQ:
        uq_ring = gl.allocate_shared_memory(dtype, [STAGES] + uq_desc.block_type.shape, uq_desc.layout)
    lse_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + lse_desc.block_type.shape, lse_desc.layout)
    e_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + e_desc.block_type.shape, e_desc.layout)
    delta_ring = lse_ring
    c_ring = lse_ring
    if HAS_G:
        delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + delta_desc.block_type.shape,
                                               delta_desc.layout)
        c_ring = gl.allocate_shared_memory(gl.float32, [STAGES] + c_desc.block_type.shape, c_desc.layout)

    lo, hi = query_range(start_n, N, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE, BLOCK_M, BLOCK_N)
    n_tiles = (gl.maximum(hi - lo, 0) + BLOCK_M - 1) // BLOCK_M
    total = GROUP * n_tiles
    for t in gl.static_range(STAGES - 1):
        if t < total:
            _issue_query_tiles(t, n_tiles, lo, b, hk, GROUP, q_desc, do_desc, uq_desc, lse_desc, e_desc,
                               delta_desc, c_desc, bars, q_ring, do_ring, uq_ring, lse_ring, e_ring,
                               delta_ring, c_ring, LOAD_DO, HAS_UQ, HAS_G, BLOCK_M, STAGES)

    mbarrier.wait(key_bar.index(0), phase=0)
    k_t = k_smem.reshape([BLOCK_N, HEAD_DIM])
    v_t = v_smem.reshape([BLOCK_N, HEAD_DIM])
    uk_t = uk_smem.reshape([BLOCK_N, HEAD_DIM])
    uv_t = uv_smem.reshape([BLOCK_N, HEAD_DIM])
    acc_k = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    acc_v = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    for t in range(total):
        ahead = t + STAGES - 1
        if ahead < total:
            _issue_query_tiles(ahead, n_tiles, lo, b, hk, GROUP, q_desc, do_desc, uq_desc, lse_desc,
                               e_desc, delta_desc, c_desc, bars, q_ring, do_ring, uq_ring, lse_ring, e_ring,
                               delta_ring, c_ring, LOAD_DO, HAS_UQ, HAS_G, BLOCK_M, STAGES)
        slot = t % STAGES
        mbarrier.wait(bars.index(slot), phase=(t // STAGES) & 1)
        acc_k, acc_v = _cols_tile(
            slot, lo + (t % n_tiles) * BLOCK_M, start_n, offs_n, acc_k, acc_v, q_ring, do_ring, uq_ring,
            lse_ring, e_ring, delta_ring, c_ring, k_t, v_t, uk_t, uv_t, OFFSET, WINDOW, KS, KE, qk_scale_log2,
            scale, CAUSAL, HAS_WINDOW, HAS_RANGE, HAS_UQ, HAS_UK, HAS_UV, HAS_G, HEAD_DIM, BLOCK_M, BLOCK_N,
            num_warps)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(key_bar.index(0))
    _store_key_rows(GK, GV, sgb, sgh, sgn, b, hk, start_n, M, acc_k, acc_v, scale, HEAD_DIM, BLOCK_N,
                    num_warps)


@gluon.jit
def _tile_buffers(prefix: gl.constexpr, first_desc, second_desc, third_desc, fourth_desc,
                  SECOND: gl.constexpr, THIRD: gl.constexpr, FOURTH: gl.constexpr):
    """Shared memory for prefix + (tile shape) tiles of each descriptor's tensor: the first always, the
    others where their flag is on (else the first's buffer stands in, never read)."""
    shape: gl.constexpr = prefix + first_desc.block_type.shape
    first = gl.allocate_shared_memory(first_desc.dtype, shape, first_desc.layout)
    second = first
    third = first
    fourth = first
    if SECOND:
        second = gl.allocate_shared_memory(second_desc.dtype, shape, second_desc.layout)
    if THIRD:
        third = gl.allocate_shared_memory(third_desc.dtype, shape, third_desc.layout)
    if FOURTH:
        fourth = gl.allocate_shared_memory(fourth_desc.dtype, shape, fourth_desc.layout)
    return first, second, third, fourth


@gluon.jit
def _consumer_barriers(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """The barriers of a warp-specialized kernel: one for the tiles loaded once, and per ring slot
    `ready` (the producer's TMA bytes) and `empty` (one arrival from each of the CONSUMERS)."""
    once = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(once.index(0), count=1)
    ready = _ring_barriers(STAGES)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(empty.index(i), count=CONSUMERS)
    return once, ready, empty


@gluon.jit
def _issue_blocks_once(bar, b, h, start, first_desc, second_desc, third_desc, fourth_desc, first_bufs,
                       second_bufs, third_bufs, fourth_bufs, SECOND: gl.constexpr, THIRD: gl.constexpr,
                       FOURTH: gl.constexpr, BLOCK: gl.constexpr, CONSUMERS: gl.constexpr):
    """Start the TMA loads of the CONSUMERS blocks of BLOCK rows (start + i * BLOCK ..) of head h of
    batch row b of each tensor (the first always, the others where their flag is on) into block i of its
    buffers, all completing on `bar`."""
    nbytes: gl.constexpr = first_desc.block_type.nbytes * (1 + SECOND + THIRD + FOURTH) * CONSUMERS
    mbarrier.expect(bar, nbytes)
    for i in gl.static_range(CONSUMERS):
        rows = start + i * BLOCK
        tma_load(first_desc, [b, h, rows, 0], bar, first_bufs.index(i))
        if SECOND:
            tma_load(second_desc, [b, h, rows, 0], bar, second_bufs.index(i))
        if THIRD:
            tma_load(third_desc, [b, h, rows, 0], bar, third_bufs.index(i))
        if FOURTH:
            tma_load(fourth_desc, [b, h, rows, 0], bar, fourth_bufs.index(i))


@gluon.jit
def _cols_loads(q_desc, do_desc, uq_desc, lse_desc, e_desc, delta_desc, c_desc, k_desc, v_desc, uk_desc,
                uv_desc, key_bar, ready, empty, q_ring, do_ring, uq_ring, lse_ring, e_ring, delta_ring,
                c_ring, k_keys, v_keys, uk_keys, uv_keys, b, hk, start_n, lo, n_tiles, total, GROUP,
                LOAD_DO: gl.constexpr, HAS_UQ: gl.constexpr, HAS_UK: gl.constexpr, HAS_UV: gl.constexpr,
                HAS_G: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                CONSUMERS: gl.constexpr, STAGES: gl.constexpr):
    """The producer partition of the warp-specialized columns pass (one warp): the CONSUMERS key blocks
    of BLOCK_N rows (K, with their flags V, U_K, U_V) once onto key_bar, then every query tile into
    the ring, slot t % STAGES once all consumers have released it (`empty`), onto `ready`."""
    _issue_blocks_once(key_bar.index(0), b, hk, start_n, k_desc, v_desc, uk_desc, uv_desc, k_keys, v_keys,
                       uk_keys, uv_keys, HAS_G, HAS_UK, HAS_UV, BLOCK_N, CONSUMERS)
    for t in range(total):
        mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
        _issue_query_tiles(t, n_tiles, lo, b, hk, GROUP, q_desc, do_desc, uq_desc, lse_desc, e_desc,
                           delta_desc, c_desc, ready, q_ring, do_ring, uq_ring, lse_ring, e_ring, delta_ring,
                           c_ring, LOAD_DO, HAS_UQ, HAS_G, BLOCK_M, STAGES)


@gluon.jit
def _cols_consumer(which: gl.constexpr, args, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                   HAS_RANGE: gl.constexpr, HAS_UQ: gl.constexpr, HAS_UK: gl.constexpr, HAS_UV: gl.constexpr,
                   HAS_G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                   STAGES: gl.constexpr, WARPS: gl.constexpr):
    """A consumer partition of the warp-specialized columns pass (one warpgroup): key block `which` of
    the program (keys start_n + which * BLOCK_N ..) against every query tile of the ring, releasing
    each slot to the producer (`empty`) once read; writes its K̄ and V̄ rows. args: the tuple of
    buffers, barriers and scalars that `attention_bob_cols_ws_sm90_kernel` hands every consumer."""
    (GK, GV, sgb, sgh, sgn, key_bar, ready, empty, q_ring, do_ring, uq_ring, lse_ring, e_ring, delta_ring,
     c_ring, k_keys, v_keys, uk_keys, uv_keys, b, hk, start_n, lo, n_tiles, total, M, OFFSET, WINDOW, KS, KE,
     qk_scale_log2, scale) = args
    score_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, HEAD_DIM, 16])
    first = start_n + which * BLOCK_N
    offs_n = first + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, score_layout))
    mbarrier.wait(key_bar.index(0), phase=0)
    k_t = k_keys.index(which).reshape([BLOCK_N, HEAD_DIM])
    v_t = v_keys.index(which).reshape([BLOCK_N, HEAD_DIM])
    uk_t = uk_keys.index(which).reshape([BLOCK_N, HEAD_DIM])
    uv_t = uv_keys.index(which).reshape([BLOCK_N, HEAD_DIM])
    acc_k = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    acc_v = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, acc_layout)
    for t in range(total):
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), phase=(t // STAGES) & 1)
        acc_k, acc_v = _cols_tile(
            slot, lo + (t % n_tiles) * BLOCK_M, first, offs_n, acc_k, acc_v, q_ring, do_ring, uq_ring,
            lse_ring, e_ring, delta_ring, c_ring, k_t, v_t, uk_t, uv_t, OFFSET, WINDOW, KS, KE, qk_scale_log2,
            scale, CAUSAL, HAS_WINDOW, HAS_RANGE, HAS_UQ, HAS_UK, HAS_UV, HAS_G, HEAD_DIM, BLOCK_M, BLOCK_N,
            WARPS)
        fence_async_shared()   # this warpgroup's reads of the slot come before the producer's next TMA writes
        mbarrier.arrive(empty.index(slot), count=1)
    _store_key_rows(GK, GV, sgb, sgh, sgn, b, hk, first, M, acc_k, acc_v, scale, HEAD_DIM, BLOCK_N, WARPS)


@gluon.jit(do_not_specialize=NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_bob_cols_ws_sm90_kernel(
    q_desc, k_desc, v_desc, do_desc, uq_desc, uk_desc, uv_desc, lse_desc, delta_desc, c_desc, e_desc,
    GK, GV, sgb, sgh, sgn,
    N, M, HEADS_KV, GROUP, OFFSET, WINDOW, qk_scale_log2, scale, KeyRange,
    CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_RANGE: gl.constexpr, HAS_UQ: gl.constexpr,
    HAS_UK: gl.constexpr, HAS_UV: gl.constexpr, HAS_G: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr, STAGES: gl.constexpr,
    CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """The columns pass, warp-specialized: one program owns CONSUMERS * BLOCK_N keys of one (batch, kv
    head), each block of BLOCK_N held by a consumer warpgroup of its own (the default partition,
    num_warps = 4, and a worker of CONSUMER_REGS registers); the consumers share the query tiles that
    one producer warp streams, a ring slot refilled once all have released it. Arguments, outputs and
    descriptors as `attention_bob_cols_sm90_kernel`'s; grid (cdiv(M, CONSUMERS * BLOCK_N), B * Hkv)."""
    gl.static_assert(num_warps == 4, "a consumer is one warpgroup")
    gl.static_assert(CONSUMERS == 2, "two consumer warpgroups")
    LOAD_DO: gl.constexpr = HAS_UV or HAS_G
    pid_bh = gl.program_id(1)
    b = pid_bh // HEADS_KV
    hk = pid_bh % HEADS_KV
    KS, KE = load_key_range(KeyRange, b.to(gl.int64), M, HAS_RANGE)
    start_n = gl.program_id(0) * (CONSUMERS * BLOCK_N)

    key_bar, ready, empty = _consumer_barriers(STAGES, CONSUMERS)
    k_keys, v_keys, uk_keys, uv_keys = _tile_buffers([CONSUMERS], k_desc, v_desc, uk_desc, uv_desc, HAS_G,
                                                     HAS_UK, HAS_UV)
    q_ring, do_ring, uq_ring, _ = _tile_buffers([STAGES], q_desc, do_desc, uq_desc, q_desc, LOAD_DO, HAS_UQ,
                                                False)
    lse_ring, e_ring, delta_ring, c_ring = _tile_buffers([STAGES], lse_desc, e_desc, delta_desc, c_desc, True,
                                                         HAS_G, HAS_G)

    lo, hi = query_range(start_n, N, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE, BLOCK_M,
                         CONSUMERS * BLOCK_N)
    n_tiles = (gl.maximum(hi - lo, 0) + BLOCK_M - 1) // BLOCK_M
    total = GROUP * n_tiles
    shared = (GK, GV, sgb, sgh, sgn, key_bar, ready, empty, q_ring, do_ring, uq_ring, lse_ring, e_ring,
              delta_ring, c_ring, k_keys, v_keys, uk_keys, uv_keys, b, hk, start_n, lo, n_tiles, total, M,
              OFFSET, WINDOW, KS, KE, qk_scale_log2, scale)
    gl.warp_specialize([
        (_cols_consumer, (0, shared, CAUSAL, HAS_WINDOW, HAS_RANGE, HAS_UQ, HAS_UK, HAS_UV, HAS_G, HEAD_DIM,
                          BLOCK_M, BLOCK_N, STAGES, num_warps)),
        (_cols_consumer, (1, shared, CAUSAL, HAS_WINDOW, HAS_RANGE, HAS_UQ, HAS_UK, HAS_UV, HAS_G, HEAD_DIM,
                          BLOCK_M, BLOCK_N, STAGES, num_warps)),
        (_cols_loads, (q_desc, do_desc, uq_desc, lse_desc, e_desc, delta_desc, c_desc, k_desc, v_desc,
                       uk_desc, uv_desc, key_bar, ready, empty, q_ring, do_ring, uq_ring, lse_ring, e_ring,
                       delta_ring, c_ring, k_keys, v_keys, uk_keys, uv_keys, b, hk, start_n, lo, n_tiles,
                       total, GROUP, LOAD_DO, HAS_UQ, HAS_UK, HAS_UV, HAS_G, BLOCK_M, BLOCK_N, CONSUMERS,
                       STAGES))],
                       [num_warps, 1], [CONSUMER_REGS, 24])


@gluon.jit
def _rows_tile(slot, start_m, offs_m, lse2, delta, c, x_sum, acc_q, acc_pk, acc_do, q_t, do_t, uq_t, k_ring,
               v_ring, uk_ring, uv_ring, start_n, N, M, OFFSET, WINDOW, KS, KE, qk_scale_log2, scale,
               CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_RANGE: gl.constexpr, HAS_UQ: gl.constexpr,
               HAS_UK: gl.constexpr, HAS_UV: gl.constexpr, HAS_G: gl.constexpr, LATE_PK: gl.constexpr,
               HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """One key tile of the rows pass (ring slot `slot`, keys start_n ..) against the queries offs_m
    (BLOCK_M,) starting at start_m whose tiles q_t, do_t, uq_t ((BLOCK_M, D) shared memory; those whose
    flag is off are never read) a warpgroup holds, with their lse2 (base 2) and delta: returns c and
    x_sum (BLOCK_M,) and acc_q (sum X K + dS U_K), acc_pk (sum P K, untouched with LATE_PK), acc_do
    (sum P U_V + (P*G) V), each (BLOCK_M, D) float32, with the tile's terms added."""
    dtype: gl.constexpr = q_t.dtype
    score_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    left_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    zero_scores = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, score_layout)
    k_t = k_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])
    if HAS_G:
        v_t = v_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])
    if HAS_UK:
        uk_t = uk_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])
    if HAS_UV:
        uv_t = uv_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])

    s = warpgroup_mma(q_t, k_t.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
    if HAS_UV:
        w = warpgroup_mma(do_t, uv_t.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=HAS_UV, deps=(s,))
    p = gl.exp2(s * qk_scale_log2 - lse2[:, None])
    if row_tile_needs_mask(start_m, start_n, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE,
                           BLOCK_M, BLOCK_N):
        offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, score_layout))
        seen = visible(offs_m, offs_n, N, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE)
        p = gl.where(seen, p, 0.0)
    x = p * warpgroup_mma_wait(num_outstanding=0, deps=(w,)) if HAS_UV else zero_scores
    if HAS_UV:
        acc_do = warpgroup_mma(gl.convert_layout(p.to(dtype), left_layout), uv_t, acc_do)
    if HAS_G:
        if HAS_UQ:
            g = warpgroup_mma(uq_t, k_t.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
            if HAS_UK:
                g = warpgroup_mma(q_t, uk_t.permute((1, 0)), g, is_async=True)
        else:
            g = warpgroup_mma(q_t, uk_t.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_t, v_t.permute((1, 0)), zero_scores, use_acc=False, is_async=True)
        g = warpgroup_mma_wait(num_outstanding=1, deps=(g,))
        pg = p * g * scale
        c += gl.sum(pg, 1)
        acc_do = warpgroup_mma(gl.convert_layout(pg.to(dtype), left_layout), v_t, acc_do)
        dp_shift = warpgroup_mma_wait(num_outstanding=0, deps=(dp,)) - delta[:, None]
        x += pg * dp_shift
        if HAS_UK:
            acc_q = warpgroup_mma(gl.convert_layout((p * dp_shift).to(dtype), left_layout), uk_t, acc_q)
    x_sum += gl.sum(x, 1)
    acc_q = warpgroup_mma(gl.convert_layout(x.to(dtype), left_layout), k_t, acc_q)
    if not LATE_PK:
        acc_pk = warpgroup_mma(gl.convert_layout(p.to(dtype), left_layout), k_t, acc_pk)
    return c, x_sum, acc_q, acc_pk, acc_do


@gluon.jit
def _store_query_rows(O, DQ, GQ, GDO, C, E, sob, soh, son, sdqb, sdqh, sdqn, sgb, sgh, sgn, svec, row, b, h,
                      start_m, N, c, x_sum, delta, acc_q, acc_pk, acc_do, scale, HAS_G: gl.constexpr,
                      LATE_PK: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                      num_warps: gl.constexpr):
    """The rows pass's outputs for queries start_m .. (BLOCK_M of (b, h), rows past N left out): Q̄
    (with LATE_PK without its last term, in float32), dŌ, and the row vectors c and e (at offset `row`,
    rows svec apart), from the sums `_rows_tile` gathered (c, x_sum, delta: (BLOCK_M,) in the score
    layout's row slice)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    acc_rows: gl.constexpr = gl.SliceLayout(1, acc_layout)
    offs_m = start_m + gl.arange(0, BLOCK_M, layout=c.type.layout)
    out_m = start_m + gl.arange(0, BLOCK_M, layout=acc_rows)
    out_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    offsets = out_m[:, None].to(gl.int64) * sgn + out_d[None, :]
    keep = out_m[:, None] < N
    g_base = b.to(gl.int64) * sgb + h.to(gl.int64) * sgh
    c_acc = gl.convert_layout(c, acc_rows)
    gq = acc_q * scale
    if not LATE_PK:
        gq -= gl.convert_layout(scale * x_sum, acc_rows)[:, None] * acc_pk
    if HAS_G:
        gq -= c_acc[:, None] * _load_rows(DQ, sdqb, sdqh, sdqn, b, h, out_m, out_d, N)
    gl.store(GQ + g_base + offsets, gq.to(GQ.dtype.element_ty), mask=keep)
    gl.store(C + row + offs_m, c, mask=offs_m < svec)
    gl.store(E + row + offs_m, x_sum - c * delta, mask=offs_m < svec)
    if HAS_G:
        acc_do -= c_acc[:, None] * _load_rows(O, sob, soh, son, b, h, out_m, out_d, N)
    gl.store(GDO + g_base + offsets, acc_do.to(GDO.dtype.element_ty), mask=keep)


@gluon.jit
def _rows_loads(q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc, query_bar, ready, empty, q_rows,
                do_rows, uq_rows, k_ring, v_ring, uk_ring, uv_ring, b, h, hk, start_m, lo, total,
                LOAD_DO: gl.constexpr, HAS_UQ: gl.constexpr, HAS_UK: gl.constexpr, HAS_UV: gl.constexpr,
                HAS_G: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr,
                STAGES: gl.constexpr):
    """The producer partition of the warp-specialized rows pass (one warp): the CONSUMERS query blocks
    of BLOCK_M rows (Q, with their flags dO, U_Q) once onto query_bar, then every key tile into the
    ring, slot t % STAGES once all consumers have released it (`empty`), onto `ready`."""
    _issue_blocks_once(query_bar.index(0), b, h, start_m, q_desc, do_desc, uq_desc, q_desc, q_rows, do_rows,
                       uq_rows, q_rows, LOAD_DO, HAS_UQ, False, BLOCK_M, CONSUMERS)
    for t in range(total):
        mbarrier.wait(empty.index(t % STAGES), ((t // STAGES) & 1) ^ 1)
        _issue_key_tiles(t, lo, b, hk, k_desc, v_desc, uk_desc, uv_desc, ready, k_ring, v_ring, uk_ring,
                         uv_ring, HAS_G, HAS_UK, HAS_UV, BLOCK_N, STAGES)


@gluon.jit
def _rows_consumer(which: gl.constexpr, args, CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr,
                   HAS_RANGE: gl.constexpr, HAS_UQ: gl.constexpr, HAS_UK: gl.constexpr, HAS_UV: gl.constexpr,
                   HAS_G: gl.constexpr, LATE_PK: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                   BLOCK_N: gl.constexpr, STAGES: gl.constexpr, WARPS: gl.constexpr):
    """A consumer partition of the warp-specialized rows pass (one warpgroup): query block `which` of the
    program (queries start_m + which * BLOCK_M ..) against every key tile of the ring, releasing each
    slot to the producer (`empty`) once read; writes its outputs. args: the tuple of pointers, strides,
    buffers, barriers and scalars that `attention_bob_rows_ws_sm90_kernel` hands every consumer."""
    (O, DQ, Lse, Delta, GQ, GDO, C, E, sob, soh, son, sdqb, sdqh, sdqn, sgb, sgh, sgn, svec, row, query_bar,
     ready, empty, q_rows, do_rows, uq_rows, k_ring, v_ring, uk_ring, uv_ring, b, h, start_m, lo, total, N, M,
     OFFSET, WINDOW, KS, KE, qk_scale_log2, scale) = args
    score_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[WARPS, 1], instr_shape=[16, HEAD_DIM, 16])
    rows_of: gl.constexpr = gl.SliceLayout(1, score_layout)
    first = start_m + which * BLOCK_M
    offs_m = first + gl.arange(0, BLOCK_M, layout=rows_of)
    lse2 = lse_log2(Lse + row, offs_m, svec)
    delta = gl.load(Delta + row + offs_m, mask=offs_m < svec, other=0.0)
    mbarrier.wait(query_bar.index(0), phase=0)
    q_t = q_rows.index(which).reshape([BLOCK_M, HEAD_DIM])
    do_t = do_rows.index(which).reshape([BLOCK_M, HEAD_DIM])
    uq_t = uq_rows.index(which).reshape([BLOCK_M, HEAD_DIM])
    acc_q = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    acc_pk = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    acc_do = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    c = gl.zeros([BLOCK_M], gl.float32, rows_of)
    x_sum = gl.zeros([BLOCK_M], gl.float32, rows_of)
    for t in range(total):
        slot = t % STAGES
        mbarrier.wait(ready.index(slot), phase=(t // STAGES) & 1)
        c, x_sum, acc_q, acc_pk, acc_do = _rows_tile(
            slot, first, offs_m, lse2, delta, c, x_sum, acc_q, acc_pk, acc_do, q_t, do_t, uq_t, k_ring,
            v_ring, uk_ring, uv_ring, lo + t * BLOCK_N, N, M, OFFSET, WINDOW, KS, KE, qk_scale_log2, scale,
            CAUSAL, HAS_WINDOW, HAS_RANGE, HAS_UQ, HAS_UK, HAS_UV, HAS_G, LATE_PK, HEAD_DIM, BLOCK_M, BLOCK_N,
            WARPS)
        mbarrier.arrive(empty.index(slot), count=1)
    _store_query_rows(O, DQ, GQ, GDO, C, E, sob, soh, son, sdqb, sdqh, sdqn, sgb, sgh, sgn, svec, row, b, h,
                      first, N, c, x_sum, delta, acc_q, acc_pk, acc_do, scale, HAS_G, LATE_PK, HEAD_DIM,
                      BLOCK_M, WARPS)


@gluon.jit(do_not_specialize=NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_bob_rows_ws_sm90_kernel(
    q_desc, k_desc, v_desc, do_desc, uq_desc, uk_desc, uv_desc,
    O, DQ, Lse, Delta, GQ, GDO, C, E, sob, soh, son, sdqb, sdqh, sdqn, sgb, sgh, sgn, svec,
    N, M, HEADS_Q, GROUP, OFFSET, WINDOW, qk_scale_log2, scale, KeyRange,
    CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_RANGE: gl.constexpr, HAS_UQ: gl.constexpr,
    HAS_UK: gl.constexpr, HAS_UV: gl.constexpr, HAS_G: gl.constexpr, LATE_PK: gl.constexpr,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, CONSUMERS: gl.constexpr,
    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr,
):
    """The rows pass, warp-specialized: one program owns CONSUMERS * BLOCK_M queries of one (batch,
    query head), each block of BLOCK_M held by a consumer warpgroup of its own (the default partition,
    num_warps = 4, and a worker of CONSUMER_REGS registers); the consumers share the key tiles that one
    producer warp streams, a ring slot refilled once all have released it. Writes Q̄ (with LATE_PK:
    s*sum[X K + dS U_K] - c*dQ, into a float32 GQ), dŌ, c and e (GQ, GDO: (B, Hq, N, D), shared element
    strides; C, E: the float32 row vectors, rows svec apart). Grid (cdiv(N, CONSUMERS * BLOCK_M),
    B * Hq), the last blocks first. Descriptors: TMA boxes (1, 1, BLOCK_M, D) of q, dout, u_q and
    (1, 1, BLOCK_N, D) of k, v, u_k, u_v (an absent cotangent's flag is off and its descriptor, a
    stand-in, is never read); O and DQ are read through their strides."""
    gl.static_assert(num_warps == 4, "a consumer is one warpgroup")
    gl.static_assert(CONSUMERS == 2, "two consumer warpgroups")
    LOAD_DO: gl.constexpr = HAS_UV or HAS_G
    b, h, hk, KS, KE, row, start_m, _ = _row_block(HEADS_Q, GROUP, KeyRange, M, svec, HAS_RANGE,
                                                   CONSUMERS * BLOCK_M, gl.BlockedLayout([1], [32], [4], [0]))

    query_bar, ready, empty = _consumer_barriers(STAGES, CONSUMERS)
    q_rows, do_rows, uq_rows, _ = _tile_buffers([CONSUMERS], q_desc, do_desc, uq_desc, q_desc, LOAD_DO,
                                                HAS_UQ, False)
    k_ring, v_ring, uk_ring, uv_ring = _tile_buffers([STAGES], k_desc, v_desc, uk_desc, uv_desc, HAS_G,
                                                     HAS_UK, HAS_UV)

    lo, hi = key_range(start_m, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE, CONSUMERS * BLOCK_M,
                       BLOCK_N)
    total = (gl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N
    shared = (O, DQ, Lse, Delta, GQ, GDO, C, E, sob, soh, son, sdqb, sdqh, sdqn, sgb, sgh, sgn, svec, row,
              query_bar, ready, empty, q_rows, do_rows, uq_rows, k_ring, v_ring, uk_ring, uv_ring, b, h,
              start_m, lo, total, N, M, OFFSET, WINDOW, KS, KE, qk_scale_log2, scale)
    gl.warp_specialize([
        (_rows_consumer, (0, shared, CAUSAL, HAS_WINDOW, HAS_RANGE, HAS_UQ, HAS_UK, HAS_UV, HAS_G, LATE_PK,
                          HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, num_warps)),
        (_rows_consumer, (1, shared, CAUSAL, HAS_WINDOW, HAS_RANGE, HAS_UQ, HAS_UK, HAS_UV, HAS_G, LATE_PK,
                          HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, num_warps)),
        (_rows_loads, (q_desc, do_desc, uq_desc, k_desc, v_desc, uk_desc, uv_desc, query_bar, ready, empty,
                       q_rows, do_rows, uq_rows, k_ring, v_ring, uk_ring, uv_ring, b, h, hk, start_m, lo,
                       total, LOAD_DO, HAS_UQ, HAS_UK, HAS_UV, HAS_G, BLOCK_M, BLOCK_N, CONSUMERS, STAGES))],
        [num_warps, 1], [CONSUMER_REGS, 24])


@gluon.jit(do_not_specialize=NO_SPECIALIZE, do_not_specialize_on_alignment=["GROUP"])
def attention_bob_rows_pk_sm90_kernel(
    q_desc, k_desc, Lse, Delta, C, E, GQ_PART, GQ, sgb, sgh, sgn, svec,
    N, M, HEADS_Q, GROUP, OFFSET, WINDOW, qk_scale_log2, scale, KeyRange,
    CAUSAL: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_RANGE: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """The rows pass's last term after a LATE_PK launch: Q̄ = GQ_PART - s*x*sum[P K] with x = e + c*delta
    (GQ_PART float32 and GQ, (B, Hq, N, D), shared element strides). Grid (cdiv(N, BLOCK_M), B * Hq);
    descriptors: TMA boxes (1, 1, BLOCK_M, D) of q and (1, 1, BLOCK_N, D) of k."""
    dtype: gl.constexpr = q_desc.dtype
    score_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
    left_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows_of: gl.constexpr = gl.SliceLayout(1, score_layout)
    acc_rows: gl.constexpr = gl.SliceLayout(1, acc_layout)

    b, h, hk, KS, KE, row, start_m, offs_m = _row_block(HEADS_Q, GROUP, KeyRange, M, svec, HAS_RANGE, BLOCK_M,
                                                        rows_of)

    query_bar = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    mbarrier.init(query_bar.index(0), count=1)
    q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
    mbarrier.expect(query_bar.index(0), q_desc.block_type.nbytes)
    tma_load(q_desc, [b, h, start_m, 0], query_bar.index(0), q_smem)
    bars = _ring_barriers(STAGES)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)

    lo, hi = key_range(start_m, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE, BLOCK_M, BLOCK_N)
    total = (gl.maximum(hi - lo, 0) + BLOCK_N - 1) // BLOCK_N
    for t in gl.static_range(STAGES - 1):
        if t < total:
            _issue_key_tiles(t, lo, b, hk, k_desc, k_desc, k_desc, k_desc, bars, k_ring, k_ring, k_ring,
                             k_ring, False, False, False, BLOCK_N, STAGES)
    lse2 = lse_log2(Lse + row, offs_m, svec)
    mbarrier.wait(query_bar.index(0), phase=0)
    q_t = q_smem.reshape([BLOCK_M, HEAD_DIM])
    acc_pk = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, acc_layout)
    zero_scores = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, score_layout)
    for t in range(total):
        ahead = t + STAGES - 1
        if ahead < total:
            _issue_key_tiles(ahead, lo, b, hk, k_desc, k_desc, k_desc, k_desc, bars, k_ring, k_ring, k_ring,
                             k_ring, False, False, False, BLOCK_N, STAGES)
        slot = t % STAGES
        start_n = lo + t * BLOCK_N
        mbarrier.wait(bars.index(slot), phase=(t // STAGES) & 1)
        k_t = k_ring.index(slot).reshape([BLOCK_N, HEAD_DIM])
        s = warpgroup_mma(q_t, k_t.permute((1, 0)), zero_scores, use_acc=False)
        p = gl.exp2(s * qk_scale_log2 - lse2[:, None])
        if row_tile_needs_mask(start_m, start_n, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE,
                               BLOCK_M, BLOCK_N):
            offs_n = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, score_layout))
            seen = visible(offs_m, offs_n, N, M, OFFSET, WINDOW, KS, KE, CAUSAL, HAS_WINDOW, HAS_RANGE)
            p = gl.where(seen, p, 0.0)
        acc_pk = warpgroup_mma(gl.convert_layout(p.to(dtype), left_layout), k_t, acc_pk)

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    mbarrier.invalidate(query_bar.index(0))
    out_m = start_m + gl.arange(0, BLOCK_M, layout=acc_rows)
    out_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, acc_layout))
    inside = out_m < svec
    x = (gl.load(E + row + out_m, mask=inside, other=0.0)
         + gl.load(C + row + out_m, mask=inside, other=0.0)
         * gl.load(Delta + row + out_m, mask=inside, other=0.0))
    offsets = b.to(gl.int64) * sgb + h.to(gl.int64) * sgh + out_m[:, None].to(gl.int64) * sgn + out_d[None, :]
    keep = out_m[:, None] < N
    gq = gl.load(GQ_PART + offsets, mask=keep, other=0.0) - (scale * x)[:, None] * acc_pk
    gl.store(GQ + offsets, gq.to(dtype), mask=keep)
