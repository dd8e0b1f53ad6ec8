// Backward of sparse attention on tensor cores over BSB (f16 / bf16), in the FlashAttention-2
// pattern: three passes over 16-row windows of 16x8 bitmap blocks, no nnz x heads buffer, no
// floating-point atomics. With s = <q_i, k_j>, x = scale * log2(e) * s (the forward's log2
// domain), dP = <dOut_i, v_j>:
//   stats (A's BSB):   S = Q K^T and dP = dOut V^T by mma for each step of two blocks, an online
//                      max m, sum l = sum 2^(x - m) and w = sum 2^(x - m) dP; writes each row's
//                      lse2 = m + log2 l and D = w / l (= sum_j P dP). D from the recomputed P,
//                      not FlashAttention-2's <dOut_i, out_i>: an f16 / bf16 out's rounding
//                      would reach dS = P (dP - D) where dP ~ D and the scale's gradient, a
//                      cancelling sum (bf16: 24% off on a test graph).
//   dq (A's BSB):      S and dP = dOut V^T by mma; P = 2^(x - lse2), dS = P (dP - D);
//                      dQ = scale * dS K by mma, dS taking the place of the forward's P (the A
//                      operand, straight from the score registers) and K that of V; each row's
//                      share of the scale's gradient, sum dS * s.
//   dkv (A^T's BSB):   windows of 16 key rows j, block columns the query rows i: S^T = K Q^T,
//                      dP^T = V dOut^T; P and dS from column i's (lse2, D);
//                      dV = P^T dOut, dK = scale * dS^T Q.
// Two passes over A rather than one: a one-pass dQ (the CUDA-core row pass's sum x dP k - D sum
// x k) would round x dP and x to 16 bits before a cancelling difference; here dS is rounded
// once, as FlashAttention-2 rounds it.
//
// Register layouts are fused_bsb.cu's (g = lane / 4, t = lane % 4): the window side (Q and dOut,
// or K and V) in A fragments loaded once per unit; a step's 16 gathered rows in the
// B layout of S (lane (g, t) loads slot g) and, for the operand multiplied by dS or P, in the
// forward's V layout (slots 2t, 2t+1, features g * D8 ..). One warp per (unit, head), features
// of the head padded to DS (32 or 64: at 128 the dkv pass spills and lost to the CUDA-core
// backward, docs/kernels/backward.md).
//
// Units are fused-tc's (host schedule, largest first; a window without blocks has one unit,
// which writes zeros). A window split into several units leaves a partial per unit (stats: m,
// l, w; dq: the accumulator and the dscale share; dkv: both accumulators) and the last unit to
// finish (an integer counter per split window and head) merges them in part order and resets
// the counter, so the result does not depend on which unit merges.

#include "attention_tiles.cuh"

#define BWD_TC_STATS 0
#define BWD_TC_DQ 1
#define BWD_TC_DKV 2

// The A fragments of window rows wrow[0] (g) and wrow[1] (g + 8) of x, features [0, DS) of the
// head at head_off (f16 / bf16: NKS = DS / 16 k-steps).
template <class T, int NKC>
__device__ __forceinline__ void bwd_tc_afrag(u32 (&f)[2 * NKC][4], const T* __restrict__ x,
                                             const u32 (&wrow)[2], u64 hd, u64 head_off, u32 d,
                                             u32 t) {
#pragma unroll
    for (int c = 0; c < NKC; ++c) {
        u32 r0[4], r1[4];
        const u32 feat = c * 32u + t * 8u;
        bsb_load<T, 8, true>(r0, x + (wrow[0] != SPATTN_NONE ? wrow[0] : 0u) * hd + head_off,
                             feat, d, wrow[0] != SPATTN_NONE);
        bsb_load<T, 8, true>(r1, x + (wrow[1] != SPATTN_NONE ? wrow[1] : 0u) * hd + head_off,
                             feat, d, wrow[1] != SPATTN_NONE);
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
            f[2 * c + ks][0] = r0[2 * ks];
            f[2 * c + ks][1] = r1[2 * ks];
            f[2 * c + ks][2] = r0[2 * ks + 1];
            f[2 * c + ks][3] = r1[2 * ks + 1];
        }
    }
}

// The K-layout gather of one step: rows of y at the two blocks' slots, lane (g, t) loading slot
// g's features c * 32 + 8t .. + 8 (the B operand of S = A B^T).
template <class T, int NKC>
__device__ __forceinline__ void bwd_tc_gather_k(u32 (&kw)[2][NKC][4], const T* __restrict__ y,
                                                const BsbStep& st, u64 hd, u64 head_off, u32 d,
                                                u32 t) {
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) {
        const bool ok = st.ck[bb] != SPATTN_NONE;
#pragma unroll
        for (int c = 0; c < NKC; ++c)
            bsb_load<T, 8, true>(kw[bb][c], y + (ok ? st.ck[bb] : 0u) * hd + head_off,
                                 c * 32u + t * 8u, d, ok);
    }
}

// The V-layout gather of one step (fused_bsb.cu): lane (g, t) loads features g * D8 .. + D8 of
// the rows at slots 2t, 2t + 1 of both blocks.
template <class T, int D8>
__device__ __forceinline__ void bwd_tc_gather_v(u32 (&vw)[2][2][D8 / 2], const T* __restrict__ y,
                                                const BsbStep& st, u64 hd, u64 head_off, u32 d,
                                                u32 g) {
#pragma unroll
    for (int bb = 0; bb < 2; ++bb)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const bool ok = st.cv[bb][e] != SPATTN_NONE;
            bsb_load<T, D8, true>(vw[bb][e], y + (ok ? st.cv[bb][e] : 0u) * hd + head_off,
                                  g * D8, d, ok);
        }
}

// s[bb] = A B^T for the step's two blocks: A the window side's fragments, B a K-layout gather.
template <class T, int NKC>
__device__ __forceinline__ void bwd_tc_scores(float (&s)[2][4], const u32 (&f)[2 * NKC][4],
                                              const u32 (&kw)[2][NKC][4]) {
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) {
        float a0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, a1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int ks = 0; ks < 2 * NKC; ++ks) {
            const u32 b[2] = {kw[bb][ks / 2][2 * (ks % 2)], kw[bb][ks / 2][2 * (ks % 2) + 1]};
            mma_m16n8k16((ks & 1) ? a1 : a0, f[ks], b, T());
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) s[bb][i] = a0[i] + a1[i];
    }
}

// One (unit, head) of a pass. Window side: rows of x1 (Q or K) and x2 (dOut or V); gathered:
// y1 (K or Q, multiplied with x1), y2 (V or dOut, with x2). Outputs: stats (lse2, D) per (row of
// A, head); g1 (dQ or dK), g2 (dV); ds_rows the dscale share per (row of A, head).
//
// A step issues the column ids and bitmap words of the step after next, then all its gathers
// (and the column statistics the dkv pass needs) before its first mma, so that a warp has its
// whole step's loads in flight at once; the two step records alternate (ping-pong), each
// read two steps after its loads were issued.
template <class T, int DS, int MODE>
__device__ __forceinline__ void bwd_tc(
    const uint4* __restrict__ units, const u32* __restrict__ unit_split,
    const u32* __restrict__ split_part_first, u32 n_items, u32 heads, u32 d, u32 n_rows,
    const u32* __restrict__ row_ids, const u32* __restrict__ block_columns,
    const u32* __restrict__ bitmaps, const T* __restrict__ x1, const T* __restrict__ x2,
    const T* __restrict__ y1, const T* __restrict__ y2, float scale_log2, float scale, float2* __restrict__ stats, T* __restrict__ g1,
    T* __restrict__ g2, float* __restrict__ ds_rows, float* __restrict__ part,
    u32* __restrict__ counters) {
    constexpr int NKC = DS / 32;
    constexpr int D8 = DS / 8;
    constexpr int VW = D8 / 2;
    constexpr int NACC = MODE == BWD_TC_DKV ? 2 : 1;
    static_assert(DS == 32 || DS == 64, "registers: wider heads run the CUDA-core backward");
    // Floats of a partial row: (m, l, w); the accumulator and the dscale share; both
    // accumulators.
    constexpr u32 W = MODE == BWD_TC_STATS ? 3u : MODE == BWD_TC_DQ ? DS + 1u : 2u * DS;

    const u32 lane = lane_id();
    const u32 item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (item >= n_items) return;  // uniform across the warp
    const u32 u = item / heads, h = item - u * heads;
    const uint4 un = units[u];
    const u32 window = un.x, b_begin = un.y, b_end = un.z, part_id = un.w;
    const u32 g = lane >> 2, t = lane & 3u;
    const u64 hd = (u64)heads * d, head_off = (u64)h * d;
    u32 wrow[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32 row = window * BSB_WINDOW_ROWS + g + 8u * r;
        wrow[r] = row < n_rows ? caller_row(row_ids, row) : SPATTN_NONE;
    }
    const u32 shift = 8u * (g & 3u) + 2u * t;
    const u32 upper = g >= 4u ? 1u : 0u;

    BsbStep ma, mb;
    bsb_load_step(ma, block_columns, bitmaps, b_begin, b_end, g, t, upper);
    bsb_load_step(mb, block_columns, bitmaps, b_begin + 2u, b_end, g, t, upper);
    u32 f1[2 * NKC][4], f2[2 * NKC][4];
    bwd_tc_afrag<T, NKC>(f1, x1, wrow, hd, head_off, d, t);
    bwd_tc_afrag<T, NKC>(f2, x2, wrow, hd, head_off, d, t);
    // The row statistics of the dq pass's rows (g, g + 8).
    float2 rs[2] = {make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f)};
    if constexpr (MODE == BWD_TC_DQ) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
            if (wrow[r] != SPATTN_NONE) rs[r] = stats[(u64)wrow[r] * heads + h];
    }
    float m[2] = {SPATTN_NEG_INF, SPATTN_NEG_INF}, l[2] = {0.0f, 0.0f}, w[2] = {0.0f, 0.0f};
    float o[NACC][D8][4];
#pragma unroll
    for (int a = 0; a < NACC; ++a)
#pragma unroll
        for (int nt = 0; nt < D8; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[a][nt][i] = 0.0f;

    auto step = [&](u32 b, BsbStep& mc) {
        // This step's record, then the step after next into `mc`.
        const BsbStep cur = mc;
        bsb_load_step(mc, block_columns, bitmaps, b + 4u, b_end, g, t, upper);
        // The step's gathers first.
        constexpr bool VA = MODE != BWD_TC_STATS;
        u32 ka[2][NKC][4], kb[2][NKC][4];
        u32 va[VA ? 2 : 1][2][VA ? VW : 1], vb[MODE == BWD_TC_DKV ? 2 : 1][2][VW];
        float2 cs[2][2];
        bwd_tc_gather_k<T, NKC>(ka, y1, cur, hd, head_off, d, t);
        bwd_tc_gather_k<T, NKC>(kb, y2, cur, hd, head_off, d, t);
        if constexpr (VA) bwd_tc_gather_v<T, D8>(va, y1, cur, hd, head_off, d, g);
        if constexpr (MODE == BWD_TC_DKV) bwd_tc_gather_v<T, D8>(vb, y2, cur, hd, head_off, d, g);
        if constexpr (MODE == BWD_TC_DKV) {
            // Column i of entry (bb, c) is the slot 2t + c of block bb: its (lse2, D).
#pragma unroll
            for (int bb = 0; bb < 2; ++bb)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    const u32 col = cur.cv[bb][c];
                    cs[bb][c] = col != SPATTN_NONE ? __ldg(stats + (u64)col * heads + h)
                                                   : make_float2(0.0f, 0.0f);
                }
        }
        const u32 bits[2][2] = {{cur.bm[0][0], cur.bm[0][1]}, {cur.bm[1][0], cur.bm[1][1]}};

        float s[2][4], dp[2][4];
        bwd_tc_scores<T, NKC>(s, f1, ka);
        bwd_tc_scores<T, NKC>(dp, f2, kb);
        // Entry i of block bb: row g + 8 (i / 2), slot 2t + (i % 2); masked to -inf.
        float x[2][4];
#pragma unroll
        for (int bb = 0; bb < 2; ++bb)
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                const u32 bit = (bits[bb][i >> 1] >> (shift + (i & 1))) & 1u;
                x[bb][i] = bit ? s[bb][i] * scale_log2 : SPATTN_NEG_INF;
            }
        if constexpr (MODE == BWD_TC_STATS) {
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                float alpha;
                const float mu = bsb_row_max(x, r, m[r], alpha);
                float ls = 0.0f, ws = 0.0f;
#pragma unroll
                for (int bb = 0; bb < 2; ++bb)
#pragma unroll
                    for (int c = 0; c < 2; ++c) {
                        const float p = bsb_exp2(x[bb][2 * r + c] - mu);
                        ls += p;
                        ws = fmaf(p, dp[bb][2 * r + c], ws);
                    }
                l[r] = fmaf(l[r], alpha, ls);
                w[r] = fmaf(w[r], alpha, ws);
            }
        } else if constexpr (MODE == BWD_TC_DQ) {
            float ds[2][4];
#pragma unroll
            for (int bb = 0; bb < 2; ++bb)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 q = rs[i >> 1];
                    const float p = bsb_exp2(x[bb][i] - q.x);
                    ds[bb][i] = p * (dp[bb][i] - q.y);
                    // dscale's share, kept per lane in l (no statistics in this pass).
                    l[i >> 1] = fmaf(ds[bb][i], s[bb][i], l[i >> 1]);
                }
            bsb_pv_mma<T, D8>(o[0], ds, va[0], va[1]);
        } else {
            float p[2][4], ds[2][4];
#pragma unroll
            for (int bb = 0; bb < 2; ++bb)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float2 q = cs[bb][i & 1];
                    p[bb][i] = bsb_exp2(x[bb][i] - q.x);
                    ds[bb][i] = p[bb][i] * (dp[bb][i] - q.y);
                }
            bsb_pv_mma<T, D8>(o[0], ds, va[0], va[1]);
            bsb_pv_mma<T, D8>(o[1], p, vb[0], vb[1]);
        }
    };
    for (u32 b = b_begin;;) {
        if (b >= b_end) break;
        step(b, ma);
        b += 2u;
        if (b >= b_end) break;
        step(b, mb);
        b += 2u;
    }
    // Per-row sums over the 4 lanes of each row (stats: l, w; dq: the dscale share in l).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        w[r] += __shfl_xor_sync(0xffffffffu, w[r], 1);
        w[r] += __shfl_xor_sync(0xffffffffu, w[r], 2);
    }
    // Output factor of each accumulator (dK and dQ carry the scale).
    const float fac[2] = {scale, 1.0f};
    // The statistics of a row from its max, sum (log2 domain) and w.
    auto row_stats = [](float mm, float ll, float ww) {
        return ll > 0.0f ? make_float2(mm + log2f(ll), ww / ll) : make_float2(0.0f, 0.0f);
    };

    if (part_id == SPATTN_NONE) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (wrow[r] == SPATTN_NONE) continue;
            const u64 rh = (u64)wrow[r] * heads + h;
            if constexpr (MODE == BWD_TC_STATS) {
                if (t == 0u) stats[rh] = row_stats(m[r], l[r], w[r]);
                continue;
            }
            if (MODE == BWD_TC_DQ && t == 0u) ds_rows[rh] = l[r];
#pragma unroll
            for (int a = 0; a < NACC; ++a) {
                T* orow = (a == 0 ? g1 : g2) + (u64)wrow[r] * hd + head_off;
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float y[D8];
#pragma unroll
                    for (int nt = 0; nt < D8; ++nt) y[nt] = o[a][nt][2 * r + half] * fac[a];
                    bsb_store<T, D8, true>(orow, (2u * t + half) * D8, d, y);
                }
            }
        }
        return;
    }

    // A part of a split window: its partial rows, then the last part to arrive merges.
    const u32 split = unit_split[u];
    const u64 slot = (u64)part_id * heads + h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float* prow = part + (slot * BSB_WINDOW_ROWS + g + 8u * r) * W;
        if constexpr (MODE == BWD_TC_STATS) {
            if (t == 0u) {
                prow[0] = m[r];
                prow[1] = l[r];
                prow[2] = w[r];
            }
        } else {
            if (MODE == BWD_TC_DQ && t == 0u) prow[DS] = l[r];
#pragma unroll
            for (int a = 0; a < NACC; ++a)
#pragma unroll
                for (int half = 0; half < 2; ++half)
#pragma unroll
                    for (int nt = 0; nt < D8; ++nt)
                        prow[a * DS + (2u * t + half) * D8 + nt] = o[a][nt][2 * r + half];
        }
    }
    const u32 p0 = split_part_first[split], p1 = split_part_first[split + 1u];
    u32* counter = counters + (u64)split * heads + h;
    if (!last_to_finish(counter, p1 - p0, 0xffffffffu, lane, 32u)) return;
    for (u32 wr = 0; wr < BSB_WINDOW_ROWS; ++wr) {
        const u32 row = window * BSB_WINDOW_ROWS + wr;
        if (row >= n_rows) break;
        const u32 crow = caller_row(row_ids, row);
        const u64 rh = (u64)crow * heads + h;
        auto at = [&](u32 p, u32 i) {
            return __ldcg(part + (((u64)p * heads + h) * BSB_WINDOW_ROWS + wr) * W + i);
        };
        if constexpr (MODE == BWD_TC_STATS) {
            if (lane == 0u) {
                float mm = SPATTN_NEG_INF;
                for (u32 p = p0; p < p1; ++p) mm = fmaxf(mm, at(p, 0u));
                const float mu = mm == SPATTN_NEG_INF ? 0.0f : mm;
                float ll = 0.0f, ww = 0.0f;
                for (u32 p = p0; p < p1; ++p) {
                    const float c = bsb_exp2(at(p, 0u) - mu);
                    ll = fmaf(at(p, 1u), c, ll);
                    ww = fmaf(at(p, 2u), c, ww);
                }
                stats[rh] = row_stats(mm, ll, ww);
            }
        } else {
            for (u32 i = lane; i < W; i += 32u) {
                float sum = 0.0f;
                for (u32 p = p0; p < p1; ++p) sum += at(p, i);
                if (MODE == BWD_TC_DQ && i == DS) {
                    ds_rows[rh] = sum;
                } else {
                    const u32 a = i / DS, f = i - a * DS;
                    if (f < d) (a == 0u ? g1 : g2)[crow * hd + head_off + f] = from_f32<T>(sum * fac[a]);
                }
            }
        }
    }
    if (lane == 0u) *counter = 0u;
}

// Entry points backward_tc_{stats,dq,dkv}_{f16,bf16}_s{32,64}: one warp per (unit, head),
// n_items = units x heads, CTAs of BWD_TC_CTA_WARPS warps (the host's grid). head_dim a multiple
// of 8 and at most DS (the host picks the narrowest DS that holds it). The stats and dq passes
// run on A's BSB (x1 = Q, x2 = dOut, y1 = K, y2 = V), dkv on A^T's (x1 = K, x2 = V, y1 = Q,
// y2 = dOut); every pointer a pass does not use may be null.
#define SPATTN_BWD_TC_PARAMS(T)                                                                \
    const uint4 *units, const u32 *unit_split, const u32 *split_part_first, u32 n_items,       \
        u32 heads, u32 head_dim, u32 n_rows, const u32 *row_ids, const u32 *block_columns,     \
        const u32 *bitmaps, const T *x1, const T *x2, const T *y1, const T *y2,                \
        float scale_log2, float scale, float2 *stats, T *g1, T *g2, float *ds_rows,            \
        float *part, u32 *counters
#define SPATTN_BWD_TC(NAME, MODE, SUFFIX, T, DS)                                               \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        backward_tc_##NAME##_##SUFFIX##_s##DS(SPATTN_BWD_TC_PARAMS(T)) {                       \
        bwd_tc<T, DS, MODE>(units, unit_split, split_part_first, n_items, heads, head_dim,     \
                            n_rows, row_ids, block_columns, bitmaps, x1, x2, y1, y2,           \
                            scale_log2, scale, stats, g1, g2, ds_rows, part, counters);        \
    }
#define SPATTN_BWD_TC_ALL(SUFFIX, T, DS)                                                       \
    SPATTN_BWD_TC(stats, BWD_TC_STATS, SUFFIX, T, DS)                                          \
    SPATTN_BWD_TC(dq, BWD_TC_DQ, SUFFIX, T, DS)                                                \
    SPATTN_BWD_TC(dkv, BWD_TC_DKV, SUFFIX, T, DS)
SPATTN_BWD_TC_ALL(f16, __half, 32)
SPATTN_BWD_TC_ALL(f16, __half, 64)
SPATTN_BWD_TC_ALL(bf16, __nv_bfloat16, 32)
SPATTN_BWD_TC_ALL(bf16, __nv_bfloat16, 64)

// backward_tc_dscale: the scale's gradient, sum over n f32 shares x (one per row and head) in a
// fixed order: block b of the grid sums its contiguous chunk (per thread in f64, then a fixed
// tree), writes block_sums[b], and the last block to finish adds the block sums in block order
// into *out and resets *counter.
extern "C" __global__ void __launch_bounds__(256)
    backward_tc_dscale(const float* __restrict__ x, u64 n, double* __restrict__ block_sums,
                       u32* __restrict__ counter, double* __restrict__ out) {
    __shared__ double scratch[32];
    __shared__ bool last_block;
    const u64 chunk = (n + gridDim.x - 1u) / gridDim.x;
    const u64 begin = (u64)blockIdx.x * chunk, end = min(n, begin + chunk);
    double s = 0.0;
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) s += (double)x[i];
    s = block_sum_f64(s, scratch);
    if (threadIdx.x == 0) {
        block_sums[blockIdx.x] = s;
        __threadfence();
        last_block = atomicAdd(counter, 1u) + 1u == gridDim.x;
    }
    __syncthreads();
    if (last_block && threadIdx.x == 0) {
        __threadfence();
        double total = 0.0;
        for (u32 b = 0; b < gridDim.x; ++b) total += __ldcg(block_sums + b);
        *out = total;
        *counter = 0u;
    }
}
