// Backward of sparse attention on tensor cores over BSB (f16 / bf16), in the FlashAttention-2
// pattern: three passes over 16-row windows of 16x8 bitmap blocks, no nnz x heads buffer (but
// dBias's, with a bias), no floating-point atomics. With s = <q_i, k_j>, x = scale * log2(e) *
// s (the forward's log2 domain), dP = <dOut_i, v_j>:
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
//   (forward's statistics: where the caller kept the forward's lse2 (fused-tc writes it) and
//   passes it with the forward's output, the stats pass is not run: the dq pass takes lse2 and
//   D = <dOut_i, out_i> (FlashAttention-2's), writes both for the dkv pass, and corrects each
//   row's dscale share by (D - c) b with c = sum P dP, b = sum P s: exact, where the share's
//   cancelling sum would carry out's rounding (bf16: 24% off); dQ, dK and dV take that rounding
//   at its size, as FlashAttention-2's do. Where the two grids together span a few waves of
//   the GPU, a row kernel writes (lse2, D) first and the dq and dkv passes run at once on two
//   streams.)
//   dkv (A^T's BSB):   windows of 16 key rows j, block columns the query rows i: S^T = K Q^T,
//                      dP^T = V dOut^T; P and dS from column i's (lse2, D);
//                      dV = P^T dOut, dK = scale * dS^T Q.
// Two passes over A rather than one: a one-pass dQ (the CUDA-core row pass's sum x dP k - D sum
// x k) would round x dP and x to 16 bits before a cancelling difference; here dS is rounded
// once, as FlashAttention-2 rounds it.
//
// Layouts are the forward's pipelined tile loop's (bsb_pipe_tiles; g = lane / 4, t = lane % 4):
// the window side (Q and dOut, or K and V) in A fragments loaded once per unit; each step's 16
// gathered rows of y1 and y2 copied once into shared memory by cp.async, two steps ahead, and
// read by ldmatrix in both the layouts a pass needs (the B operand of the scores, and transposed
// for the product with dS or P). One warp per (unit, head), features of the head padded to DS
// (32 or 64: at 128 the accumulators alone take 128 registers a lane; those heads run the
// CUDA-core backward, docs/kernels/backward.md).
//
// Extras (the `_xb`, `_xd`, `_x` kernels: a bias, dropout, both; XMODE bits 0 and 1): as in the
// pipelined forward (BsbStagedExtras), each step's gathered bias (log2 domain, block-and-bit
// order) and keep words travel into its stage with its tiles. With s' = x + bias and the keep
// factor f (0 or 1 / (1 - rate)): stats w = sum 2^(s' - m) f dP; dS = P (f dP - D); dV = (P f)^T
// dOut. The dq pass writes each edge's dS to d_bias in A's BSB's block-and-bit order, head by
// head (consecutive stores, no edge-map read in the tile loop), once per edge and head;
// backward_tc_bias_grad then moves it to the caller's edge order. Over A^T the stage
// holds A^T's gathers (the same keep draws: an edge's bits come from its caller edge).
//
// Units are fused-tc's (host schedule, largest first; a window without blocks has one unit,
// which writes zeros). A window split into several units leaves a partial per unit (stats: m,
// l, w; dq: the accumulator, the dscale share and its correction's c and b; dkv: both
// accumulators) and the last unit to finish (an integer counter per split window and head)
// merges them in part order and resets the counter, so the result does not depend on which
// unit merges.

#include "attention_tiles.cuh"

#define BWD_TC_STATS 0
#define BWD_TC_DQ 1
#define BWD_TC_DKV 2

// <x[0..n), y[0..n)> over a quad of lanes (t = lane % 4; n a multiple of 8), 0 where !on: each
// lane's 16-byte chunks t, t + 4, ..., then the lanes 1 apart, then 2 apart. Every lane of
// `mask` calls it. The dq pass's D and backward_tc_row_stats's both come from here, so that
// the passes one after the other and at once give the same bits.
template <class T>
__device__ __forceinline__ float bwd_tc_quad_dot(const T* __restrict__ x, const T* __restrict__ y,
                                                 u32 n, u32 t, u32 mask, bool on) {
    float dot = on ? lane_dot<T, 8>(x, y, n, t, 4u) : 0.0f;
    dot += __shfl_xor_sync(mask, dot, 1);
    dot += __shfl_xor_sync(mask, dot, 2);
    return dot;
}

// Shared memory of one warp (the host mirrors it): BSB_PIPE_STAGES stages, each the step's y1
// and y2 tiles (16 slots, rows of BWD_TC_ROW bytes: 64 features, a 32-feature slice using the
// first half of each row, so that one swizzle serves both), the two blocks' bitmaps and, in the
// dkv pass, the (lse2, D) of the 16 slots' columns.
#define BWD_TC_ROW 128u
// With extras (xmode), the stage's staged extras follow (bsb_pipe_x_bytes).
__host__ __device__ constexpr u32 bwd_tc_stage_bytes(int mode, int xmode) {
    return 2u * 16u * BWD_TC_ROW + 32u + (mode == BWD_TC_DKV ? 16u * 8u : 0u) +
           bsb_pipe_x_bytes((xmode & 1) != 0, (xmode & 2) != 0);
}
__host__ __device__ constexpr u32 bwd_tc_warp_bytes(int mode, int xmode) {
    return BSB_PIPE_STAGES * bwd_tc_stage_bytes(mode, xmode);
}

// One (unit, head) of a pass. Window side: rows of x1 (Q or K) and x2 (dOut or V) in A
// fragments; gathered: y1 (K or Q, multiplied with x1), y2 (V or dOut, with x2), each step's
// rows copied into shared memory by cp.async BSB_PIPE_STAGES - 1 steps ahead (the forward's
// pipeline, bsb_pipe_tiles) and read by ldmatrix: as the B operand of the scores, and
// transposed as the B operand of dQ += dS K (y1), dK += dS^T Q (y1) and dV += P^T dOut (y2).
// With lse non-null (dq pass only): the forward's lse2 per (row of A, head) and out, the
// forward's output (rows of x2's shape), replace the stats pass (see the top); with out null
// too, the row kernel's stats are read instead.
// Outputs: stats (lse2, D) per (row of A, head); g1 (dQ or dK), g2 (dV); ds_rows the dscale
// share per (row of A, head). `smem`: the warp's bwd_tc_warp_bytes(MODE, XMODE). Extras
// (XMODE != 0): xa, and in the dq pass with a bias d_bias (xa.n_edges per head, A's BSB's
// edge order).
template <class T, int DS, int MODE, int XMODE>
__device__ __forceinline__ void bwd_tc(
    unsigned char* smem, const uint4* __restrict__ units, const u32* __restrict__ unit_split,
    const u32* __restrict__ split_part_first, u32 n_items, u32 heads, u32 d, u32 n_rows,
    const u32* __restrict__ row_ids, const u32* __restrict__ block_columns,
    const u32* __restrict__ bitmaps, const T* __restrict__ x1, const T* __restrict__ x2,
    const T* __restrict__ y1, const T* __restrict__ y2, const T* __restrict__ out,
    const float* __restrict__ lse, float scale_log2, float scale, float2* __restrict__ stats,
    T* __restrict__ g1, T* __restrict__ g2,
    float* __restrict__ ds_rows, float* __restrict__ part, u32* __restrict__ counters,
    const BsbExtrasArgs& xa, T* __restrict__ d_bias) {
    constexpr int STAGES = BSB_PIPE_STAGES;
    constexpr int NKS = DS / 16;  // k-steps of the scores
    constexpr int NT = DS / 8;    // n-tiles of an accumulator
    constexpr int NACC = MODE == BWD_TC_DKV ? 2 : 1;
    constexpr u32 ROW = BWD_TC_ROW;
    constexpr u32 TILE = 16u * ROW;
    constexpr u32 Y2OFF = TILE, BOFF = 2u * TILE, SOFF = BOFF + 32u;
    constexpr u32 XOFF = SOFF + (MODE == BWD_TC_DKV ? 16u * 8u : 0u);  // the staged extras
    constexpr u32 STAGE = bwd_tc_stage_bytes(MODE, XMODE);
    constexpr bool XON = XMODE != 0, BIAS_GRAD = (XMODE & 1) != 0 && MODE == BWD_TC_DQ;
    static_assert(DS == 32 || DS == 64, "registers: wider heads run the CUDA-core backward");
    static_assert(DS * 2u <= ROW, "a tile row holds the slice");
    // Floats of a partial row: (m, l, w); the accumulator, the dscale share, c and b; both
    // accumulators.
    constexpr u32 W = MODE == BWD_TC_STATS ? 3u : MODE == BWD_TC_DQ ? DS + 3u : 2u * DS;
    // The dq pass from the forward's statistics (uniform across the grid).
    const bool from_fwd = MODE == BWD_TC_DQ && lse != nullptr;

    const u32 lane = lane_id();
    const u32 item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (item >= n_items) return;  // uniform across the warp
    const u32 u = item / heads, h = item - u * heads;
    const uint4 un = units[u];
    const u32 window = un.x, b_begin = un.y, b_end = un.z, part_id = un.w;
    const u32 g = lane >> 2, t = lane & 3u;
    const u64 hd = (u64)heads * d, head_off = (u64)h * d;
    const u32 steps = (b_end - b_begin + 1u) / 2u;
    const u32 base_s = smem_addr(smem);
    u32 wrow[2];
    bsb_pipe_qrows(row_ids, window, n_rows, wrow);
    auto xt = bsb_staged_extras_or_none<XMODE>(&xa, h);

    // Step s's columns (lanes 0-15) and staged extras' span (lanes 16, 17): bsb_pipe_step_ids.
    auto ids_of = [&](u32 s) {
        return bsb_pipe_step_ids(block_columns, xt, b_begin, b_end, steps, s, lane);
    };
    // The copies of step s (its columns and extras' span bounds in col) into stage s % STAGES,
    // then a commit (an empty group past the last step keeps the count uniform).
    auto issue = [&](u32 s, u32 col) {
        if (s < steps) {
            const u32 sk = base_s + (s % STAGES) * STAGE;
            bsb_pipe_copy_rows<T, DS / 8, ROW, true>(sk, 0u, Y2OFF, y1, y2, col, 0u, hd,
                                                     head_off, d / 8u);
            bsb_pipe_copy_bitmaps(sk + BOFF, bitmaps, b_begin, b_end, s, lane);
            if constexpr (MODE == BWD_TC_DKV) {
                // The columns' (lse2, D), slot l's by lane l.
                const u32 c = __shfl_sync(0xffffffffu, col, lane & 15u);
                const bool ok = c != SPATTN_NONE;
                if (lane < 16u)
                    cp_async_8(sk + SOFF + 8u * lane, stats + (ok ? (u64)c * heads + h : 0u), ok);
            }
            if constexpr (XON) xt.issue(sk + XOFF, col, b_begin + 2u * s, b_end);
        }
        cp_async_commit();
    };

    // Prologue: steps 0 .. STAGES - 2 in flight, the columns of step STAGES - 1 loaded.
    u32 col_next = ids_of(0u);
#pragma unroll
    for (u32 s = 0; s + 1u < (u32)STAGES; ++s) {
        const u32 c = col_next;
        col_next = ids_of(s + 1u);
        issue(s, c);
    }

    u32 f1[NKS][4], f2[NKS][4];
    bsb_window_afrag<T, NKS>(f1, x1, wrow, hd, head_off, d);
    bsb_window_afrag<T, NKS>(f2, x2, wrow, hd, head_off, d);
    // The row statistics of the dq pass's rows (g, g + 8): the stats pass's, or the forward's
    // lse2 and <dOut, out>, which the unit (the first part of a split window) writes for dkv.
    float2 rs[2] = {make_float2(0.0f, 0.0f), make_float2(0.0f, 0.0f)};
    if constexpr (MODE == BWD_TC_DQ) {
        if (from_fwd && out == nullptr) {
            // backward_tc_row_stats wrote them (the passes then run at once; uniform).
#pragma unroll
            for (int r = 0; r < 2; ++r)
                if (wrow[r] != SPATTN_NONE) rs[r] = stats[(u64)wrow[r] * heads + h];
        } else if (from_fwd) {
            const bool writes =
                part_id == SPATTN_NONE || part_id == split_part_first[unit_split[u]];
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                // The quad's 4 lanes split the row's 16-byte chunks (d a multiple of 8; every
                // lane shuffles).
                const u64 o = (u64)wrow[r] * hd + head_off;
                const float dot = bwd_tc_quad_dot<T>(x2 + o, out + o, d, t, 0xffffffffu,
                                                     wrow[r] != SPATTN_NONE);
                if (wrow[r] != SPATTN_NONE) {
                    const u64 rh = (u64)wrow[r] * heads + h;
                    rs[r] = make_float2(__ldg(lse + rh), dot);
                    if (writes && t == 0u) stats[rh] = rs[r];
                }
            }
        } else {
#pragma unroll
            for (int r = 0; r < 2; ++r)
                if (wrow[r] != SPATTN_NONE) rs[r] = stats[(u64)wrow[r] * heads + h];
        }
    }
    // stats: m, l, w; dq: l the dscale share, and from the forward's statistics its
    // correction's c = sum P dP (in w) and b = sum P s (per lane).
    float m[2] = {SPATTN_NEG_INF, SPATTN_NEG_INF}, l[2] = {0.0f, 0.0f}, w[2] = {0.0f, 0.0f};
    float b[2] = {0.0f, 0.0f};
    float o[NACC][NT][4];
#pragma unroll
    for (int a = 0; a < NACC; ++a)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int i = 0; i < 4; ++i) o[a][nt][i] = 0.0f;
    const u32 shift = 8u * (g & 3u) + 2u * t, upper = g >= 4u ? 1u : 0u;

    for (u32 i = 0; i < steps; ++i) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();  // step i's copies by every lane are visible; step i - 1 is read
        {
            const u32 c = col_next;
            col_next = ids_of(i + STAGES);
            issue(i + STAGES - 1u, c);
        }
        const u32 st = i % STAGES;
        const u32 sk = base_s + st * STAGE;
        // The step's first edge (dBias), loaded before the step's products that hide it.
        u32 step_first = 0u;
        if constexpr (BIAS_GRAD) step_first = __ldg(xa.block_edge_start + b_begin + 2u * i);
        const u32* bw = reinterpret_cast<const u32*>(smem + st * STAGE + BOFF);
        const u32 bits[2][2] = {{bw[upper], bw[2u + upper]}, {bw[4u + upper], bw[6u + upper]}};
        // The step's extras, landed in the stage with its tiles.
        if constexpr (XON) xt.load(smem + st * STAGE + XOFF, bw, upper, shift);

        float s[2][4], dp[2][4];
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
            bsb_tile_scores<T, NKS, ROW>(s[bb], f1, sk, bb);
            bsb_tile_scores<T, NKS, ROW>(dp[bb], f2, sk + Y2OFF, bb);
        }
        // Entry i of block bb: row g + 8 (i / 2), slot 2t + (i % 2); masked to -inf. kf: its
        // dropout factor (1 without), which multiplies dP (and P, for dV).
        float x[2][4], kf[2][4];
#pragma unroll
        for (int bb = 0; bb < 2; ++bb)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const u32 bit = (bits[bb][e >> 1] >> (shift + (e & 1))) & 1u;
                if constexpr (XON) {
                    x[bb][e] = bit ? fmaf(s[bb][e], scale_log2, xt.bias_log2(bb, e))
                                   : SPATTN_NEG_INF;
                    kf[bb][e] = xt.keep_factor(bb, e);
                } else {
                    x[bb][e] = bit ? s[bb][e] * scale_log2 : SPATTN_NEG_INF;
                    kf[bb][e] = 1.0f;
                }
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
                        ws = fmaf(XON ? p * kf[bb][2 * r + c] : p, dp[bb][2 * r + c], ws);
                    }
                l[r] = fmaf(l[r], alpha, ls);
                w[r] = fmaf(w[r], alpha, ws);
            }
        } else if constexpr (MODE == BWD_TC_DQ) {
            float ds[2][4];
#pragma unroll
            for (int bb = 0; bb < 2; ++bb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 q = rs[e >> 1];
                    const float p = bsb_exp2(x[bb][e] - q.x);
                    const float fdp = XON ? kf[bb][e] * dp[bb][e] : dp[bb][e];
                    ds[bb][e] = p * (fdp - q.y);
                    // dscale's share, kept per lane in l (no statistics in this pass).
                    l[e >> 1] = fmaf(ds[bb][e], s[bb][e], l[e >> 1]);
                    if (from_fwd) {
                        w[e >> 1] = fmaf(p, fdp, w[e >> 1]);
                        b[e >> 1] = fmaf(p, s[bb][e], b[e >> 1]);
                    }
                }
            if constexpr (BIAS_GRAD) {
                // dBias = dS at each set bit's edge in block-and-bit order: block 0's from the
                // step's first edge, block 1's after block 0's bits (zero words past the unit
                // set none).
                T* db = d_bias + (u64)h * xa.n_edges + step_first;
#pragma unroll
                for (int bb = 0; bb < 2; ++bb) {
                    const u32 wb[4] = {bw[4 * bb], bw[4 * bb + 1], bw[4 * bb + 2], bw[4 * bb + 3]};
                    u32 rank[4];
                    bool on[4];
                    bsb_lane_ranks(wb, upper, shift, rank, on);
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        if (on[e]) db[rank[e]] = from_f32<T>(ds[bb][e]);
                    db += bsb_block_edges(wb);
                }
            }
            bsb_tile_pv<T, NT, ROW>(o[0], ds, sk);
        } else {
            // Column i of entry (bb, e) is slot 8 bb + 2t + e % 2: its (lse2, D).
            const float2* cs = reinterpret_cast<const float2*>(smem + st * STAGE + SOFF);
            float p[2][4], ds[2][4];
#pragma unroll
            for (int bb = 0; bb < 2; ++bb)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float2 q = cs[8u * bb + 2u * t + (e & 1)];
                    const float pe = bsb_exp2(x[bb][e] - q.x);
                    ds[bb][e] = pe * (XON ? fmaf(kf[bb][e], dp[bb][e], -q.y) : dp[bb][e] - q.y);
                    p[bb][e] = XON ? pe * kf[bb][e] : pe;  // the weight of dOut in dV
                }
            bsb_tile_pv<T, NT, ROW>(o[0], ds, sk);
            bsb_tile_pv<T, NT, ROW>(o[1], p, sk + Y2OFF);
        }
    }
    cp_async_wait<0>();  // no copy may land in shared memory after this

    // Per-row sums over the 4 lanes of each row (stats: l, w; dq: the dscale share in l).
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
        w[r] += __shfl_xor_sync(0xffffffffu, w[r], 1);
        w[r] += __shfl_xor_sync(0xffffffffu, w[r], 2);
        if constexpr (MODE == BWD_TC_DQ) {
            b[r] += __shfl_xor_sync(0xffffffffu, b[r], 1);
            b[r] += __shfl_xor_sync(0xffffffffu, b[r], 2);
        }
    }
    // Output factor of each accumulator (dK and dQ carry the scale).
    const float fac[2] = {scale, 1.0f};
    // The statistics of a row from its max, sum (log2 domain) and w (a NaN sum's are NaN).
    auto row_stats = [](float mm, float ll, float ww) {
        return ll == 0.0f ? make_float2(0.0f, 0.0f) : make_float2(mm + log2f(ll), ww / ll);
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
            // The exact share: sum dS s + (D - sum P dP) sum P s (w, b zero without from_fwd).
            if (MODE == BWD_TC_DQ && t == 0u) ds_rows[rh] = fmaf(rs[r].y - w[r], b[r], l[r]);
#pragma unroll
            for (int a = 0; a < NACC; ++a) {
                u32* orow = reinterpret_cast<u32*>((a == 0 ? g1 : g2) + (u64)wrow[r] * hd +
                                                   head_off);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
                    if (8u * nt < d)
                        orow[4 * nt + t] = pack2<T>(o[a][nt][2 * r] * fac[a],
                                                    o[a][nt][2 * r + 1] * fac[a]);
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
            if (MODE == BWD_TC_DQ && t == 0u) {
                prow[DS] = l[r];
                prow[DS + 1] = w[r];
                prow[DS + 2] = b[r];
            }
#pragma unroll
            for (int a = 0; a < NACC; ++a)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    prow[a * DS + 8 * nt + 2 * t] = o[a][nt][2 * r];
                    prow[a * DS + 8 * nt + 2 * t + 1] = o[a][nt][2 * r + 1];
                }
        }
    }
    const u32 p0 = split_part_first[split], p1 = split_part_first[split + 1u];
    u32* counter = counters + (u64)split * heads + h;
    if (!last_to_finish(counter, p1 - p0, 0xffffffffu, lane, 32u)) return;
    const u32 rows_here = min(BSB_WINDOW_ROWS, n_rows - window * BSB_WINDOW_ROWS);
    if constexpr (MODE == BWD_TC_STATS) {
        // A row per lane: the parts' max, then their sums rescaled to it, in part order.
        if (lane < rows_here) {
            const u64 rh = (u64)caller_row(row_ids, window * BSB_WINDOW_ROWS + lane) * heads + h;
            auto at = [&](u32 p, u32 i) {
                return __ldcg(part + (((u64)p * heads + h) * BSB_WINDOW_ROWS + lane) * W + i);
            };
            float mm = SPATTN_NEG_INF;
            for (u32 p = p0; p < p1; ++p) mm = fmaxf(mm, at(p, 0u));
            const float mu = softmax_base(mm);
            float ll = 0.0f, ww = 0.0f;
            for (u32 p = p0; p < p1; ++p) {
                const float c = bsb_exp2(at(p, 0u) - mu);
                ll = fmaf(at(p, 1u), c, ll);
                ww = fmaf(at(p, 2u), c, ww);
            }
            stats[rh] = row_stats(mm, ll, ww);
        }
    } else {
        // RG rows at a time, lane i's float i of each: a part's RG loads in flight at once (one
        // round trip a part, where a row at a time took 16), each float summed in part order
        // from 0. The dq pass's share takes the sums of floats DS + 1 and DS + 2 (c and b) from
        // the next two lanes (DS is a multiple of 32). RG 16, the whole window, in this loop
        // form: ptxas gave the other forms tried more registers (docs/kernels/backward.md).
        constexpr u32 RG = 16u;
        static_assert(BSB_WINDOW_ROWS % RG == 0u && DS % 32 == 0, "row groups, share lanes");
        for (u32 wr0 = 0; wr0 < rows_here; wr0 += RG) {
#pragma unroll
            for (u32 i0 = 0; i0 < W; i0 += 32u) {
                const u32 i = i0 + lane;
                const bool in = i < W;
                float sum[RG];
#pragma unroll
                for (u32 r = 0; r < RG; ++r) sum[r] = 0.0f;
                for (u32 p = p0; p < p1; ++p) {
                    const float* src = part + (((u64)p * heads + h) * BSB_WINDOW_ROWS + wr0) * W + i;
#pragma unroll
                    for (u32 r = 0; r < RG; ++r)
                        if (in) sum[r] += __ldcg(src + r * W);
                }
#pragma unroll
                for (u32 r = 0; r < RG; ++r) {
                    const u32 wr = wr0 + r;
                    float cc = 0.0f, bs = 0.0f;
                    if (MODE == BWD_TC_DQ && i0 + 32u > DS) {
                        cc = __shfl_down_sync(0xffffffffu, sum[r], 1);
                        bs = __shfl_down_sync(0xffffffffu, sum[r], 2);
                    }
                    if (!in || wr >= rows_here) continue;
                    const u64 crow = caller_row(row_ids, window * BSB_WINDOW_ROWS + wr);
                    if (MODE == BWD_TC_DQ && i >= DS) {
                        // The share and its correction (D as the stats pass or the first part
                        // wrote it, before the counter's fence).
                        const u64 rh = crow * heads + h;
                        if (i == DS) ds_rows[rh] = fmaf(__ldcg(&stats[rh].y) - cc, bs, sum[r]);
                        continue;
                    }
                    const u32 a = i / DS, f = i - a * DS;
                    if (f < d)
                        (a == 0u ? g1 : g2)[crow * hd + head_off + f] =
                            from_f32<T>(sum[r] * fac[a]);
                }
            }
        }
    }
    if (lane == 0u) *counter = 0u;
}

// stats[(i, h)] = (lse2, <dOut_i, out_i>) for every (row, head) of A, a group of 4 lanes each
// (bwd_tc_quad_dot, as the dq pass): the forward's statistics for the dq and dkv passes at
// once, neither of which then writes them.
template <class T>
__device__ __forceinline__ void bwd_tc_row_stats(u32 rows, u32 heads, u32 head_dim,
                                                 const T* __restrict__ d_out,
                                                 const T* __restrict__ out,
                                                 const float* __restrict__ lse,
                                                 float2* __restrict__ stats) {
    const u32 mask = group_mask(4u), t = lane_id() & 3u;
    const u64 total = (u64)rows * heads, groups = grid_groups(4u);
    for (u64 rh = grid_group(4u); rh < total; rh += groups) {
        const u64 o = rh * head_dim;
        const float dot = bwd_tc_quad_dot<T>(d_out + o, out + o, head_dim, t, mask, true);
        if (t == 0u) stats[rh] = make_float2(__ldg(lse + rh), dot);
    }
}

// Entry points backward_tc_row_stats_{f16,bf16}: (rows, heads, head_dim a multiple of 8) as
// bwd_tc_row_stats, any 1-D grid of a multiple of 4 threads a block.
#define SPATTN_BWD_TC_ROW_STATS(SUFFIX, T)                                                     \
    extern "C" __global__ void backward_tc_row_stats_##SUFFIX(                                 \
        u32 rows, u32 heads, u32 head_dim, const T* d_out, const T* out, const float* lse,    \
        float2* stats) {                                                                       \
        bwd_tc_row_stats<T>(rows, heads, head_dim, d_out, out, lse, stats);                    \
    }
SPATTN_BWD_TC_ROW_STATS(f16, __half)
SPATTN_BWD_TC_ROW_STATS(bf16, __nv_bfloat16)

// dBias from the dq pass's d_bsb (n entries of A's BSB per head, block-and-bit order) into the
// caller's edge order through ids (A's BSB edge to caller edge): out[ids[k] * heads + h] with a
// thread per (edge, head), heads adjacent, so that an edge's heads are one contiguous store and
// a head's edges are read in runs of consecutive addresses (32 / heads a warp, the next warps
// continuing them); or, for a bias shared by the heads, a thread an edge writing out[ids[k]] =
// its heads' values summed in head order in f32.
template <class T>
__device__ __forceinline__ void bwd_tc_bias_grad(const u32* __restrict__ ids, u32 n, u32 heads,
                                                 bool shared, const T* __restrict__ d_bsb,
                                                 T* __restrict__ out) {
    if (shared) {
        SPATTN_GRID_STRIDE(k, n) {
            float s = 0.0f;
            for (u32 h = 0; h < heads; ++h) s += to_f32(d_bsb[(u64)h * n + k]);
            out[__ldg(ids + k)] = from_f32<T>(s);
        }
        return;
    }
    const u64 items = (u64)n * heads;
    auto move = [&](u64 k, u64 h) { out[(u64)__ldg(ids + k) * heads + h] = d_bsb[h * n + k]; };
    if (items <= 0xffffffffu) {  // 32-bit division, the common case
        SPATTN_GRID_STRIDE(i, items) {
            const u32 k = (u32)i / heads;
            move(k, (u32)i - k * heads);
        }
    } else {
        SPATTN_GRID_STRIDE(i, items) {
            const u64 k = i / heads;
            move(k, i - k * heads);
        }
    }
}

// Entry points backward_tc_bias_grad_{f16,bf16} (any 1-D grid): bwd_tc_bias_grad, shared != 0
// for a bias shared by the heads.
#define SPATTN_BWD_TC_BIAS_GRAD(SUFFIX, T)                                                     \
    extern "C" __global__ void backward_tc_bias_grad_##SUFFIX(                                 \
        const u32* ids, u32 n, u32 heads, u32 shared, const T* d_bsb, T* out) {                \
        bwd_tc_bias_grad<T>(ids, n, heads, shared != 0u, d_bsb, out);                          \
    }
SPATTN_BWD_TC_BIAS_GRAD(f16, __half)
SPATTN_BWD_TC_BIAS_GRAD(bf16, __nv_bfloat16)

// Entry points backward_tc_{stats,dq,dkv}_{f16,bf16}_s{32,64}{,_xb,_xd,_x}: one warp per
// (unit, head), n_items = units x heads, CTAs of the host's warps, each warp
// bwd_tc_warp_bytes(MODE, XMODE) of the dynamic shared memory. The extras' parameters
// (SPATTN_BSB_X_PARAMS, d_bias) are read by the `_x*` kernels only (d_bias by the dq pass with
// a bias: x_edges x heads), null for the others. head_dim a multiple
// of 8 and at most DS (the host picks the narrowest DS that holds it). The stats and dq passes
// run on A's BSB (x1 = Q, x2 = dOut, y1 = K, y2 = V), dkv on A^T's (x1 = K, x2 = V, y1 = Q,
// y2 = dOut); out and lse (the forward's output and lse2) are read by the dq pass where lse is
// non-null, which replaces the stats pass (with out null, backward_tc_row_stats has written
// stats from them); every pointer a pass does not use may be null.
#define SPATTN_BWD_TC_PARAMS(T)                                                                \
    const uint4 *units, const u32 *unit_split, const u32 *split_part_first, u32 n_items,       \
        u32 heads, u32 head_dim, u32 n_rows, const u32 *row_ids, const u32 *block_columns,     \
        const u32 *bitmaps, const T *x1, const T *x2, const T *y1, const T *y2, const T *out,  \
        const float *lse, float scale_log2, float scale, float2 *stats, T *g1, T *g2,          \
        float *ds_rows, float *part, u32 *counters, SPATTN_BSB_X_PARAMS, T *d_bias
#define SPATTN_BWD_TC(NAME, MODE, SUFFIX, T, DS, XMODE, XS)                                    \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        backward_tc_##NAME##_##SUFFIX##_s##DS##XS(SPATTN_BWD_TC_PARAMS(T)) {                   \
        extern __shared__ uint4 bwd_tc_smem[];                                                 \
        unsigned char* smem = reinterpret_cast<unsigned char*>(bwd_tc_smem) +                  \
                              (threadIdx.x >> 5) * bwd_tc_warp_bytes(MODE, XMODE);             \
        const BsbExtrasArgs xa = SPATTN_BSB_X_ARGS;                                            \
        bwd_tc<T, DS, MODE, XMODE>(smem, units, unit_split, split_part_first, n_items, heads,  \
                                   head_dim, n_rows, row_ids, block_columns, bitmaps, x1, x2,  \
                                   y1, y2, out, lse, scale_log2, scale, stats, g1, g2,         \
                                   ds_rows, part, counters, xa, d_bias);                       \
    }
#define SPATTN_BWD_TC_X(SUFFIX, T, DS, XMODE, XS)                                              \
    SPATTN_BWD_TC(stats, BWD_TC_STATS, SUFFIX, T, DS, XMODE, XS)                               \
    SPATTN_BWD_TC(dq, BWD_TC_DQ, SUFFIX, T, DS, XMODE, XS)                                     \
    SPATTN_BWD_TC(dkv, BWD_TC_DKV, SUFFIX, T, DS, XMODE, XS)
#define SPATTN_BWD_TC_ALL(SUFFIX, T, DS)                                                       \
    SPATTN_BWD_TC_X(SUFFIX, T, DS, 0, )                                                        \
    SPATTN_BWD_TC_X(SUFFIX, T, DS, 1, _xb)                                                     \
    SPATTN_BWD_TC_X(SUFFIX, T, DS, 2, _xd)                                                     \
    SPATTN_BWD_TC_X(SUFFIX, T, DS, 3, _x)
SPATTN_BWD_TC_ALL(f16, __half, 32)
SPATTN_BWD_TC_ALL(f16, __half, 64)
SPATTN_BWD_TC_ALL(bf16, __nv_bfloat16, 32)
SPATTN_BWD_TC_ALL(bf16, __nv_bfloat16, 64)
