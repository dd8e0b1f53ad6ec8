// Tensor-core ops on ME-BCRS (FlashSparse's swap-and-transpose): SDDMM, edge softmax and SpMM,
// plus the conversions of per-edge values between CSR edge order and the slot layout.
//
// Layouts
// - Dense operands: rows x heads x head_dim, row-major (hd = heads * head_dim elements a row).
// - Per-slot values (scores, probabilities): f32, head-major: (head h, slot) is element
//   h * n_slots + slot, slot = vector * 8 + row_in_window, n_slots = n_vectors * 8. Head-major
//   puts the 16 x 8 tile a warp computes for one head in 512 contiguous bytes.
// - Padding slots (mask bit clear, e.g. every slot of a row past n_rows): SDDMM writes -inf,
//   edge softmax writes 0, SpMM and softmax never read them (they use the mask, so a padding
//   slot can hold anything).
//
// Work items (host schedule, DeviceMeBcrs): item i covers vectors item_start[i] .. item_end[i]
// of window item_window[i]. Every window has at least one item (an empty window one empty item,
// so SpMM writes its zero rows); a window of more vectors than the host's chunk is cut into
// several items, each taken by its own warp. For SpMM such an item has a partial index
// (item_partial[i] != NONE): it writes f32 partial output rows to scratch, and
// spmm_mebcrs_finalize sums the partials of each split window in a fixed order (deterministic,
// no atomics, no memset).
//
// Row ids. The rows may be renumbered on the host (a locality or degree order, so a window's rows
// share more columns): window row 8w + r is then the caller's row row_ids[8w + r], through which
// SDDMM loads Q and SpMM stores out; column ids (K, V) are always the caller's, and the edge ->
// slot map is kept in the caller's CSR edge order. row_ids null: no renumbering.
//
// Swap-and-transpose. SpMM computes O^T (features x 8 rows) = V^T (features x vectors) .
// P^T (vectors x 8 rows): the window's 8 rows are the mma's n = 8, a tile of 16 features its
// m = 16, and the k dimension walks the window's vectors (16 per m16n8k16, 8 per tf32 m16n8k8).
// SDDMM computes S^T (vectors x 8 rows) = K_tile (16 vectors x d) . Q_window^T (d x 8 rows),
// with k walking the features. Inside one mma the order of m (features) and of k (features in
// SDDMM) is free, so both are permuted to give every lane contiguous features: a lane's gathers
// are 4..16-byte loads, 8 lanes (SpMM) or 4 lanes (SDDMM) cover a contiguous run of a row, and
// SpMM's stores come out the same way. Every sum is accumulated in f32.

#include "mma.cuh"

#define SPATTN_FULL_MASK 0xffffffffu

// ---- raw loads and stores -----------------------------------------------------------------------

// NW 32-bit words at p through the read-only path; p is 16-byte aligned when NW is a multiple
// of 4, 8-byte aligned when NW == 2, 4-byte aligned when NW == 1.
template <int NW>
__device__ __forceinline__ void load_words(const void* p, u32 (&w)[NW]) {
    if constexpr (NW % 4 == 0) {
        const uint4* q = reinterpret_cast<const uint4*>(p);
#pragma unroll
        for (int i = 0; i < NW / 4; ++i) {
            const uint4 x = __ldg(q + i);
            w[4 * i] = x.x;
            w[4 * i + 1] = x.y;
            w[4 * i + 2] = x.z;
            w[4 * i + 3] = x.w;
        }
    } else if constexpr (NW == 2) {
        const uint2 x = __ldg(reinterpret_cast<const uint2*>(p));
        w[0] = x.x;
        w[1] = x.y;
    } else {
        static_assert(NW == 1, "1, 2 or a multiple of 4 words");
        w[0] = __ldg(reinterpret_cast<const unsigned int*>(p));
    }
}

template <int NW>
__device__ __forceinline__ void store_words(void* p, const u32 (&w)[NW]) {
    if constexpr (NW % 4 == 0) {
        uint4* q = reinterpret_cast<uint4*>(p);
#pragma unroll
        for (int i = 0; i < NW / 4; ++i) q[i] = make_uint4(w[4 * i], w[4 * i + 1], w[4 * i + 2], w[4 * i + 3]);
    } else if constexpr (NW == 2) {
        *reinterpret_cast<uint2*>(p) = make_uint2(w[0], w[1]);
    } else {
        static_assert(NW == 1, "1, 2 or a multiple of 4 words");
        *reinterpret_cast<unsigned int*>(p) = w[0];
    }
}

template <int NW>
__device__ __forceinline__ void zero_words(u32 (&w)[NW]) {
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = 0u;
}

// Elements f .. f + N of a row (p points at element f; N = NW * 4 / sizeof(T)) as raw words,
// elements at or past `limit` as zero. One element at a time: no alignment needed (odd
// head_dim), and nothing at or past `limit` is read.
template <class T, int NW>
__device__ __forceinline__ void load_words_guarded(const T* p, u32 f, u32 limit, u32 (&w)[NW]) {
    constexpr int PER = 4 / (int)sizeof(T);  // elements per word: 2 (f16/bf16) or 1 (f32)
#pragma unroll
    for (int i = 0; i < NW; ++i) {
        u32 word = 0u;
#pragma unroll
        for (int j = 0; j < PER; ++j) {
            const u32 e = (u32)(i * PER + j);
            if (f + e < limit) {
                u32 bits;
                if constexpr (PER == 2) {
                    bits = __ldg(reinterpret_cast<const unsigned short*>(p) + e);
                } else {
                    bits = __ldg(reinterpret_cast<const unsigned int*>(p) + e);
                }
                word |= bits << (16 * j);
            }
        }
        w[i] = word;
    }
}

// N floats rounded to T and packed into N * sizeof(T) / 4 words.
template <class T, int N>
__device__ __forceinline__ void pack_row(const float (&x)[N], u32 (&w)[N * sizeof(T) / 4]) {
    if constexpr (sizeof(T) == 4) {
#pragma unroll
        for (int i = 0; i < N; ++i) w[i] = __float_as_uint(x[i]);
    } else {
#pragma unroll
        for (int i = 0; i < N / 2; ++i) w[i] = pack2<T>(x[2 * i], x[2 * i + 1]);
    }
}

// ---- SDDMM ------------------------------------------------------------------------------------
// scores[h, slot(v, r)] = scale * <Q[8w + r, h, :], K[col(v), h, :]> for every vector v of the
// item, -inf where row r has no edge to col(v). One warp per (item, head = blockIdx.y); the warp
// walks the item's vectors 16 at a time (the mma's m) and, for each tile, the head's features
// STEP at a time: two mmas, every lane loading E contiguous features (16 bytes) of two K rows
// (vectors g and g + 8 of the tile) and one Q row (row g of the window).
//
// ALIGNED: head_dim % E == 0, so a lane's E features are all in range or all out, and 16-byte
// aligned; otherwise element-wise loads with a bound check (any head_dim).

template <class T, bool ALIGNED>
__device__ __forceinline__ void sddmm_mebcrs(const u32* __restrict__ item_window,
                                             const u32* __restrict__ item_start,
                                             const u32* __restrict__ item_end, u32 n_items,
                                             const u32* __restrict__ col_indices,
                                             const unsigned char* __restrict__ row_masks,
                                             u32 n_rows, const u32* __restrict__ row_ids,
                                             u64 n_slots, const T* __restrict__ q,
                                             const T* __restrict__ k, u32 heads, u32 head_dim,
                                             float scale, float* __restrict__ scores) {
    constexpr bool TF32 = sizeof(T) == 4;
    constexpr int E = 16 / (int)sizeof(T);  // features per lane per step: 8 (f16) or 4 (tf32)
    constexpr u32 STEP = 4 * E;              // features per step (two mmas)
    const u32 lane = lane_id(), g = lane >> 2, t = lane & 3u;
    const u32 item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (item >= n_items) return;  // uniform across the warp
    const u32 h = blockIdx.y;
    const u64 hd = (u64)heads * head_dim;
    const u32 w = item_window[item], vb = item_start[item], ve = item_end[item];
    const u64 q_row = (u64)w * 8u + g;
    const bool q_on = q_row < n_rows;
    const T* qp = q + (q_on ? (u64)caller_row(row_ids, (u32)q_row) : 0) * hd + (u64)h * head_dim;
    float* sh = scores + (u64)h * n_slots;

    for (u32 v0 = vb; v0 < ve; v0 += 16u) {
        const u32 mine = v0 + (lane & 15u);
        u32 col = 0u, mask = 0u;
        if (mine < ve) {
            col = __ldg(col_indices + mine);
            mask = __ldg(row_masks + mine);
        }
        // Rows g and g + 8 of the mma's A: vectors v0 + g and v0 + g + 8 (mask 0: past the end).
        const u32 c0 = __shfl_sync(SPATTN_FULL_MASK, col, g);
        const u32 m0 = __shfl_sync(SPATTN_FULL_MASK, mask, g);
        const u32 c1 = __shfl_sync(SPATTN_FULL_MASK, col, g + 8u);
        const u32 m1 = __shfl_sync(SPATTN_FULL_MASK, mask, g + 8u);
        const T* k0 = k + (u64)c0 * hd + (u64)h * head_dim;
        const T* k1 = k + (u64)c1 * hd + (u64)h * head_dim;

        float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll 2
        for (u32 f0 = 0; f0 < head_dim; f0 += STEP) {
            const u32 f = f0 + E * t;  // this lane's first feature
            u32 a0[4], a1[4], b[4];
            if constexpr (ALIGNED) {
                const bool on = f < head_dim;
                if (on && m0 != 0u) load_words<4>(k0 + f, a0); else zero_words(a0);
                if (on && m1 != 0u) load_words<4>(k1 + f, a1); else zero_words(a1);
                if (on && q_on) load_words<4>(qp + f, b); else zero_words(b);
            } else {
                if (m0 != 0u) load_words_guarded<T, 4>(k0 + f, f, head_dim, a0); else zero_words(a0);
                if (m1 != 0u) load_words_guarded<T, 4>(k1 + f, f, head_dim, a1); else zero_words(a1);
                if (q_on) load_words_guarded<T, 4>(qp + f, f, head_dim, b); else zero_words(b);
            }
#pragma unroll
            for (int s = 0; s < 2; ++s) {
                // The lane's k indices of this mma are its features f + 2s*(E/4) ..: the same
                // words in A and B, so the permutation of k cancels in the dot product.
                if constexpr (TF32) {
                    const u32 a[4] = {to_tf32(__uint_as_float(a0[2 * s])),
                                      to_tf32(__uint_as_float(a1[2 * s])),
                                      to_tf32(__uint_as_float(a0[2 * s + 1])),
                                      to_tf32(__uint_as_float(a1[2 * s + 1]))};
                    const u32 bb[2] = {to_tf32(__uint_as_float(b[2 * s])),
                                       to_tf32(__uint_as_float(b[2 * s + 1]))};
                    mma_m16n8k8_tf32(acc, a, bb);
                } else {
                    const u32 a[4] = {a0[2 * s], a1[2 * s], a0[2 * s + 1], a1[2 * s + 1]};
                    const u32 bb[2] = {b[2 * s], b[2 * s + 1]};
                    mma_m16n8k16(acc, a, bb, T());
                }
            }
        }
        // acc[0..1]: vector v0 + g, rows 2t, 2t+1; acc[2..3]: vector v0 + g + 8.
        const u32 r = 2u * t;
        if (v0 + g < ve) {
            const float x0 = (m0 >> r) & 1u ? acc[0] * scale : SPATTN_NEG_INF;
            const float x1 = (m0 >> (r + 1u)) & 1u ? acc[1] * scale : SPATTN_NEG_INF;
            *reinterpret_cast<float2*>(sh + (u64)(v0 + g) * 8u + r) = make_float2(x0, x1);
        }
        if (v0 + g + 8u < ve) {
            const float x0 = (m1 >> r) & 1u ? acc[2] * scale : SPATTN_NEG_INF;
            const float x1 = (m1 >> (r + 1u)) & 1u ? acc[3] * scale : SPATTN_NEG_INF;
            *reinterpret_cast<float2*>(sh + (u64)(v0 + g + 8u) * 8u + r) = make_float2(x0, x1);
        }
    }
}

// ---- SpMM -------------------------------------------------------------------------------------
// out[row_ids[8w + r], h, :] = sum over vectors v of the window with bit r of mask(v) of
// p[h, slot(v, r)] * V[col(v), h, :]. One warp per (item, slab = blockIdx.y): a slab is FT
// tiles of 16 features of one head (h = blockIdx.y / slabs). Lane (g, t) owns NE = 2 FT
// contiguous features, f = slab * 16 FT + NE g: mma row g of tile j is feature f + 2j, row g + 8
// is f + 2j + 1. Per k-step it gathers those features of NV vector rows (f16: vectors 2t, 2t+1,
// 2t+8, 2t+9 of the step; tf32: t, t+4), so 8 lanes read NE * 8 contiguous features of a row,
// and transposes 2 x 2 blocks into A registers (pair_lo / pair_hi). Lane (g, t) ends with
// rows 2t and 2t+1 of its NE features: stores of NE contiguous elements.
//
// ALIGNED: head_dim % NE == 0 (a lane's features all in range or all out, aligned to NE
// elements); otherwise element-wise with a bound check.

// The parameters of every SpMM kernel (spmm_mebcrs, spmm_mebcrs_pipe and their entry points),
// and the same names as an argument list.
#define SPATTN_SPMM_PARAMS(T)                                                                    \
    const u32 *__restrict__ item_window, const u32 *__restrict__ item_start,                    \
        const u32 *__restrict__ item_end, const u32 *__restrict__ item_partial, u32 n_items,    \
        const u32 *__restrict__ col_indices, const unsigned char *__restrict__ row_masks,       \
        u32 n_rows, const u32 *__restrict__ row_ids, u64 n_slots, const float *__restrict__ p,  \
        const T *__restrict__ v, u32 heads, u32 head_dim, u32 slabs, T *__restrict__ out,       \
        float *__restrict__ scratch
#define SPATTN_SPMM_ARGS                                                                         \
    item_window, item_start, item_end, item_partial, n_items, col_indices, row_masks, n_rows,   \
        row_ids, n_slots, p, v, heads, head_dim, slabs, out, scratch

template <class T, int FT, bool ALIGNED>
__device__ __forceinline__ void spmm_mebcrs(SPATTN_SPMM_PARAMS(T)) {
    constexpr bool TF32 = sizeof(T) == 4;
    constexpr u32 KV = TF32 ? 8u : 16u;          // vectors per mma (its k)
    constexpr int NV = TF32 ? 2 : 4;             // vector rows a lane gathers per k-step
    constexpr int NE = 2 * FT;                   // features a lane owns
    constexpr int NW = NE * (int)sizeof(T) / 4;  // raw words per gathered row
    const u32 lane = lane_id(), g = lane >> 2, t = lane & 3u;
    const u32 item = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (item >= n_items) return;  // uniform across the warp
    const u32 h = blockIdx.y / slabs, slab = blockIdx.y - h * slabs;
    const u32 f = slab * 16u * FT + NE * g;
    const bool lane_on = f < head_dim;
    const u64 hd = (u64)heads * head_dim;
    const u64 head_off = (u64)h * head_dim + f;
    const u32 w = item_window[item], vb = item_start[item], ve = item_end[item];
    const float* ph = p + (u64)h * n_slots;
    u32 vx[NV];
    if constexpr (TF32) {
        vx[0] = t;
        vx[1] = t + 4u;
    } else {
        vx[0] = 2u * t;
        vx[1] = 2u * t + 1u;
        vx[2] = 2u * t + 8u;
        vx[3] = 2u * t + 9u;
    }

    float acc[FT][4];
#pragma unroll
    for (int j = 0; j < FT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;

    // Column and mask of vector v0 + lane % KV (0 past the item's end).
    auto indices = [&](u32 v0, u32& col, u32& mask) {
        col = 0u;
        mask = 0u;
        if (v0 + (lane % KV) < ve) {
            col = __ldg(col_indices + v0 + (lane % KV));
            mask = __ldg(row_masks + v0 + (lane % KV));
        }
    };
    // The k-step at v0: this lane's features of its NV vector rows (raw words) and its
    // probabilities (B: row g of P^T's column = probability of (row g, vector v0 + vx); 0 at
    // padding slots and past the item's end (mask 0), whatever p holds there).
    auto gather = [&](u32 v0, u32 col, u32 mask, u32 (&rows)[NV][NW], float (&pv)[NV]) {
#pragma unroll
        for (int x = 0; x < NV; ++x) {
            const u32 cx = __shfl_sync(SPATTN_FULL_MASK, col, vx[x]);
            const u32 mx = __shfl_sync(SPATTN_FULL_MASK, mask, vx[x]);
            pv[x] = (mx >> g) & 1u ? __ldg(ph + (u64)(v0 + vx[x]) * 8u + g) : 0.0f;
            const T* src = v + (u64)cx * hd + head_off;
            if constexpr (ALIGNED) {
                if (mx != 0u && lane_on) load_words<NW>(src, rows[x]); else zero_words(rows[x]);
            } else {
                if (mx != 0u) load_words_guarded<T, NW>(src, f, head_dim, rows[x]);
                else zero_words(rows[x]);
            }
        }
    };
    // acc += the k-step's V^T tile . P^T tile.
    auto multiply = [&](const u32 (&rows)[NV][NW], const float (&pv)[NV]) {
        u32 b[2];
        if constexpr (TF32) {
            b[0] = to_tf32(pv[0]);
            b[1] = to_tf32(pv[1]);
        } else {
            b[0] = pack2<T>(pv[0], pv[1]);
            b[1] = pack2<T>(pv[2], pv[3]);
        }
#pragma unroll
        for (int j = 0; j < FT; ++j) {
            if constexpr (TF32) {
                const u32 a[4] = {to_tf32(__uint_as_float(rows[0][2 * j])),
                                  to_tf32(__uint_as_float(rows[0][2 * j + 1])),
                                  to_tf32(__uint_as_float(rows[1][2 * j])),
                                  to_tf32(__uint_as_float(rows[1][2 * j + 1]))};
                mma_m16n8k8_tf32(acc[j], a, b);
            } else {
                const u32 a[4] = {pair_lo(rows[0][j], rows[1][j]), pair_hi(rows[0][j], rows[1][j]),
                                  pair_lo(rows[2][j], rows[3][j]), pair_hi(rows[2][j], rows[3][j])};
                mma_m16n8k16(acc[j], a, b, T());
            }
        }
    };

    // Column indices one k-step ahead, so that a step's gathers do not wait for them.
    u32 next_col, next_mask;
    indices(vb, next_col, next_mask);
    for (u32 v0 = vb; v0 < ve; v0 += KV) {
        const u32 col = next_col, mask = next_mask;
        indices(v0 + KV, next_col, next_mask);
        u32 rows[NV][NW];
        float pv[NV];
        gather(v0, col, mask, rows, pv);
        multiply(rows, pv);
    }

    // acc[j][0], acc[j][2]: row 2t, features f + 2j, f + 2j + 1; acc[j][1], acc[j][3]: row 2t+1.
    const u32 partial = item_partial[item];
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        const u32 r = 2u * t + (u32)half;
        const u64 row = (u64)w * 8u + r;
        if (row >= n_rows) continue;
        float x[NE];
#pragma unroll
        for (int j = 0; j < FT; ++j) {
            x[2 * j] = acc[j][half];
            x[2 * j + 1] = acc[j][2 + half];
        }
        if (partial == SPATTN_NONE) {
            T* dst = out + (u64)caller_row(row_ids, (u32)row) * hd + head_off;
            if constexpr (ALIGNED) {
                if (lane_on) {
                    u32 words[NW];
                    pack_row<T, NE>(x, words);
                    store_words<NW>(dst, words);
                }
            } else {
#pragma unroll
                for (int e = 0; e < NE; ++e)
                    if (f + (u32)e < head_dim) dst[e] = from_f32<T>(x[e]);
            }
        } else {
            float* dst = scratch + ((u64)partial * 8u + r) * hd + head_off;
#pragma unroll
            for (int e = 0; e < NE; ++e)
                if (f + (u32)e < head_dim) dst[e] = x[e];
        }
    }
}

// ---- SpMM pipelined through shared memory (f16 / bf16, head_dim a multiple of 16) ------------
// The sums of spmm_mebcrs, with the k-step's V rows and probabilities copied into shared memory
// by cp.async, STAGES k-steps in flight per warp: registers hold the accumulators, not the
// gathered rows, so a warp keeps up to (STAGES - 1) * 4 KiB of gathers in flight without
// losing occupancy. Per warp and stage (spmm_pipe_stage_bytes, which the host mirrors):
// - V tile: 16 vector rows x CH = 2 FT chunks of 16 bytes (the slab's 16 FT features of the
//   vector's column), chunk c of row r stored at position c ^ (r & SW), so the 8 rows one
//   ldmatrix reads fall in 8 different bank groups;
// - the 16 vectors' 8 probabilities each (f32, as in p: 512 contiguous bytes);
// - the 16 vectors' masks.
// A operand: ldmatrix.trans of the V tile (rows = vectors = k, columns = features = m), B: the
// probabilities of the lane's (vector, row) pairs, 0 where the mask bit is clear (so padding
// slots, whatever they hold, never reach the mma). Vectors past the item's end are zero-filled
// (cp.async src-size 0) and masked. Output rows are staged through shared memory for 16-byte
// stores; items of split windows write f32 partials for spmm_mebcrs_finalize, as spmm_mebcrs.

__host__ __device__ constexpr u32 spmm_pipe_stage_bytes(u32 ft) { return 512u * ft + 512u + 16u; }

template <class T, int FT, int STAGES>
__device__ __forceinline__ void spmm_mebcrs_pipe(SPATTN_SPMM_PARAMS(T)) {
    static_assert(sizeof(T) == 2, "f16 / bf16 operands");
    constexpr u32 CH = 2u * FT;                    // 16-byte chunks of a V row's slab
    constexpr u32 SW = (CH < 8u ? CH : 8u) - 1u;   // swizzle mask
    constexpr u32 ROWS_PER_OP = 32u / CH;          // V rows one warp-wide cp.async covers
    constexpr u32 V_BYTES = 16u * CH * 16u, P_BYTES = 512u;
    constexpr u32 STAGE = spmm_pipe_stage_bytes(FT);
    static_assert(STAGE == V_BYTES + P_BYTES + 16u, "stage layout");
    extern __shared__ uint4 spmm_pipe_smem[];

    const u32 lane = lane_id(), g = lane >> 2, t = lane & 3u;
    const u32 warp = threadIdx.x >> 5;
    const u32 item = blockIdx.x * (blockDim.x >> 5) + warp;
    if (item >= n_items) return;  // uniform across the warp
    unsigned char* base = reinterpret_cast<unsigned char*>(spmm_pipe_smem) + warp * STAGES * STAGE;
    const u32 base_s = smem_addr(base);
    const u32 h = blockIdx.y / slabs, slab = blockIdx.y - h * slabs;
    const u64 hd = (u64)heads * head_dim;
    const u64 slab_off = (u64)h * head_dim + (u64)slab * 16u * FT;
    const u32 w = item_window[item], vb = item_start[item], ve = item_end[item];
    const u32 steps = (ve - vb + 15u) / 16u;
    const float* ph = p + (u64)h * n_slots;
    const u32 cc = lane % CH, rr = lane / CH;  // this lane's chunk, and first row, of the copies

    // Column and mask of vector v0 + lane % 16 (0 past the item's end).
    auto indices = [&](u32 v0, u32& col, u32& mask) {
        col = 0u;
        mask = 0u;
        const u32 vv = v0 + (lane & 15u);
        if (vv < ve) {
            col = __ldg(col_indices + vv);
            mask = __ldg(row_masks + vv);
        }
    };
    // Copies of k-step s (its vectors' columns and masks in col / mask) into stage s % STAGES.
    auto issue = [&](u32 s, u32 col, u32 mask) {
        const u32 st = s % STAGES, v0 = vb + 16u * s;
        const u32 sv = base_s + st * STAGE;
#pragma unroll
        for (u32 i = 0; i < (u32)FT; ++i) {
            const u32 r = rr + ROWS_PER_OP * i;
            const u32 cr = __shfl_sync(SPATTN_FULL_MASK, col, r);
            const u32 mr = __shfl_sync(SPATTN_FULL_MASK, mask, r);
            cp_async_16(sv + r * (CH * 16u) + ((cc ^ (r & SW)) * 16u),
                        v + (u64)cr * hd + slab_off + cc * 8u, mr != 0u);
        }
        const bool p_on = v0 + (lane >> 1) < ve;  // lane copies p of vector v0 + lane / 2
        cp_async_16(sv + V_BYTES + 16u * lane, p_on ? ph + (u64)v0 * 8u + 4u * lane : ph, p_on);
        if (lane < 16u) base[st * STAGE + V_BYTES + P_BYTES + lane] = (unsigned char)mask;
    };

    float acc[FT][4];
#pragma unroll
    for (int j = 0; j < FT; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.0f;
    // ldmatrix role: matrix q = lane / 8 (features half q & 1, vectors half q >> 1), row lane % 8.
    const u32 q = lane >> 3, vr = ((q >> 1) << 3) + (lane & 7u);
    auto compute = [&](u32 s) {
        const u32 st = s % STAGES;
        const unsigned char* sb = base + st * STAGE;
        const float* ps = reinterpret_cast<const float*>(sb + V_BYTES);
        const unsigned char* ms = sb + V_BYTES + P_BYTES;
        const u32 k[4] = {2u * t, 2u * t + 1u, 2u * t + 8u, 2u * t + 9u};
        float pv[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) pv[x] = (ms[k[x]] >> g) & 1u ? ps[k[x] * 8u + g] : 0.0f;
        const u32 b[2] = {pack2<T>(pv[0], pv[1]), pack2<T>(pv[2], pv[3])};
        const u32 row_s = base_s + st * STAGE + vr * (CH * 16u);
#pragma unroll
        for (int j = 0; j < FT; ++j) {
            const u32 c = 2u * (u32)j + (q & 1u);
            u32 a[4];
            ldmatrix_x4_trans(a, row_s + ((c ^ (vr & SW)) * 16u));
            mma_m16n8k16(acc[j], a, b, T());
        }
    };

    u32 next_col, next_mask;
    indices(vb, next_col, next_mask);
#pragma unroll
    for (u32 s = 0; s < (u32)STAGES - 1u; ++s) {
        if (s < steps) {
            const u32 col = next_col, mask = next_mask;
            indices(vb + 16u * (s + 1u), next_col, next_mask);
            issue(s, col, mask);
        }
        cp_async_commit();
    }
    for (u32 s = 0; s < steps; ++s) {
        const u32 sn = s + (u32)STAGES - 1u;
        if (sn < steps) {
            const u32 col = next_col, mask = next_mask;
            indices(vb + 16u * (sn + 1u), next_col, next_mask);
            issue(sn, col, mask);
        }
        cp_async_commit();
        cp_async_wait<STAGES - 1>();  // step s has landed
        __syncwarp();
        compute(s);
        __syncwarp();  // stage s % STAGES is free for a later issue
    }
    cp_async_wait<0>();
    __syncwarp();

    // acc[j][half], acc[j][2 + half]: features 16j + g and 16j + g + 8 of window row 2t + half.
    const u32 partial = item_partial[item];
    if (partial != SPATTN_NONE) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float* dst = scratch + ((u64)partial * 8u + 2u * t + (u32)half) * hd + slab_off;
#pragma unroll
            for (int j = 0; j < FT; ++j) {
                dst[16 * j + g] = acc[j][half];
                dst[16 * j + g + 8] = acc[j][2 + half];
            }
        }
        return;
    }
    T* os = reinterpret_cast<T*>(base);  // 8 rows x 16 FT features, in stage 0's V tile
#pragma unroll
    for (int half = 0; half < 2; ++half) {
        T* orow = os + (2u * t + (u32)half) * (16u * FT);
#pragma unroll
        for (int j = 0; j < FT; ++j) {
            orow[16 * j + g] = from_f32<T>(acc[j][half]);
            orow[16 * j + g + 8] = from_f32<T>(acc[j][2 + half]);
        }
    }
    __syncwarp();
    for (u32 i = lane; i < 8u * CH; i += 32u) {
        const u32 r = i / CH, c = i - r * CH;
        const u32 row = w * 8u + r;
        if (row < n_rows)
            *reinterpret_cast<uint4*>(out + (u64)caller_row(row_ids, row) * hd + slab_off + c * 8u) =
                reinterpret_cast<const uint4*>(base)[i];
    }
}

// out rows of split windows: the sum of their items' partials, in item order. Thread per
// (split window s, row r < 8, feature of hd).
template <class T>
__device__ __forceinline__ void spmm_mebcrs_finalize(const u32* __restrict__ split_windows,
                                                     const u32* __restrict__ partial_first,
                                                     u32 n_split, u32 n_rows,
                                                     const u32* __restrict__ row_ids, u32 hd,
                                                     const float* __restrict__ scratch,
                                                     T* __restrict__ out) {
    const u64 per_window = 8ull * hd;
    const u64 total = (u64)n_split * per_window;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 s = i / per_window;
        const u64 rem = i - s * per_window;
        const u64 r = rem / hd;
        const u64 f = rem - r * hd;
        const u64 row = (u64)split_windows[s] * 8u + r;
        if (row >= n_rows) continue;
        float sum = 0.0f;
        for (u32 pi = partial_first[s]; pi < partial_first[s + 1]; ++pi)
            sum += scratch[((u64)pi * 8u + r) * hd + f];
        out[(u64)caller_row(row_ids, (u32)row) * hd + f] = from_f32<T>(sum);
    }
}

// ---- edge softmax over the slot layout ------------------------------------------------------
// p[h, slot(v, r)] = exp(x - max_r) / sum_r over the slots of row r with bit r of mask(v) set,
// x = score or LeakyReLU(score); 0 at every padding slot. Each thread takes whole vectors: one
// mask byte and the vector's 8 slots as two 16-byte loads (a warp reads 1 KiB contiguous), and
// keeps a running (max, sum) per row of the window (online softmax); the (max, sum) of the 8
// rows are merged across lanes, then a second pass writes the 8 probabilities of each vector
// with two 16-byte stores. Padding slots are loaded with their vector but never used (a select,
// so whatever they hold cannot leak). `out` may alias `scores` (in place): every element is
// read and then written by the same thread.

__device__ __forceinline__ float softmax_input(float x, int leaky, float slope) {
    return leaky ? leaky_relu(x, slope) : x;
}

// Adds score x to the running (m, s); a -inf score (masked) adds nothing, a NaN makes s NaN.
__device__ __forceinline__ void online_add(float& m, float& s, float x) {
    if (x > m) {
        s = s * online_rescale(m, x) + 1.0f;
        m = x;
    } else if (x != SPATTN_NEG_INF) {
        s += __expf(x - m);
    }
}

__device__ __forceinline__ void load_slots(const float* p, float (&x)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
}

// Accumulates vectors v0, v0 + stride, ... < ve into the per-row (m, s) of the calling thread.
__device__ __forceinline__ void softmax_accumulate(const unsigned char* __restrict__ row_masks,
                                                   const float* sh, u32 v0, u32 ve, u32 stride,
                                                   int leaky, float slope, float (&m)[8],
                                                   float (&s)[8]) {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        m[r] = SPATTN_NEG_INF;
        s[r] = 0.0f;
    }
    for (u32 v = v0; v < ve; v += stride) {
        const u32 mask = __ldg(row_masks + v);
        float x[8];
        load_slots(sh + (u64)v * 8u, x);
#pragma unroll
        for (int r = 0; r < 8; ++r)
            if ((mask >> r) & 1u) online_add(m[r], s[r], softmax_input(x[r], leaky, slope));
    }
}

// Writes the probabilities of vectors v0, v0 + stride, ... < ve, given each row's max and
// 1 / sum (a row whose scores are all -inf: max 0 and 1 / sum 0, so its slots get zeros).
__device__ __forceinline__ void softmax_write(const unsigned char* __restrict__ row_masks,
                                              const float* sh, float* oh, u32 v0, u32 ve,
                                              u32 stride, int leaky, float slope,
                                              const float (&m)[8], const float (&inv)[8]) {
    for (u32 v = v0; v < ve; v += stride) {
        const u32 mask = __ldg(row_masks + v);
        float x[8];
        load_slots(sh + (u64)v * 8u, x);
#pragma unroll
        for (int r = 0; r < 8; ++r)
            x[r] = (mask >> r) & 1u ? __expf(softmax_input(x[r], leaky, slope) - m[r]) * inv[r]
                                    : 0.0f;
        float4* o = reinterpret_cast<float4*>(oh + (u64)v * 8u);
        o[0] = make_float4(x[0], x[1], x[2], x[3]);
        o[1] = make_float4(x[4], x[5], x[6], x[7]);
    }
}

// Merges the per-row (m, s) of all 32 lanes; every lane gets the result.
__device__ __forceinline__ void softmax_warp_merge(float (&m)[8], float (&s)[8]) {
#pragma unroll
    for (int r = 0; r < 8; ++r) {
#pragma unroll
        for (u32 o = 16; o > 0; o >>= 1) {
            float c1, c2;
            online_merge(m[r], s[r], __shfl_xor_sync(SPATTN_FULL_MASK, m[r], o),
                         __shfl_xor_sync(SPATTN_FULL_MASK, s[r], o), c1, c2);
        }
    }
}

// A warp per (window, head = blockIdx.y), windows of at most long_threshold vectors: lane l
// takes vectors l, l + 32, ... of the window.
extern "C" __global__ void edge_softmax_mebcrs_windows(const u32* __restrict__ row_pointers,
                                                       u32 n_windows,
                                                       const unsigned char* __restrict__ row_masks,
                                                       u64 n_slots, u32 long_threshold,
                                                       const float* scores, int leaky,
                                                       float slope, float* out) {
    const u32 lane = lane_id();
    const u32 w = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (w >= n_windows) return;  // uniform across the warp
    const u32 vb = row_pointers[w], ve = row_pointers[w + 1];
    if (ve - vb > long_threshold) return;  // the block kernel's
    const float* sh = scores + (u64)blockIdx.y * n_slots;
    float* oh = out + (u64)blockIdx.y * n_slots;
    float m[8], s[8], inv[8];
    softmax_accumulate(row_masks, sh, vb + lane, ve, 32u, leaky, slope, m, s);
    softmax_warp_merge(m, s);
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        inv[r] = softmax_inv(s[r]);
        m[r] = softmax_base(m[r]);  // all masked, or no slot
    }
    softmax_write(row_masks, sh, oh, vb + lane, ve, 32u, leaky, slope, m, inv);
}

// A block per (long window = long_windows[blockIdx.x], head = blockIdx.y); blockDim.x a multiple
// of 32, at most 1024: thread i takes vectors i, i + blockDim.x, ... of the window.
extern "C" __global__ void edge_softmax_mebcrs_long_windows(
    const u32* __restrict__ row_pointers, const u32* __restrict__ long_windows,
    const unsigned char* __restrict__ row_masks, u64 n_slots, const float* scores, int leaky,
    float slope, float* out) {
    __shared__ float part_m[32][8], part_s[32][8], row_m[8], row_inv[8];
    const u32 lane = lane_id(), warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const u32 w = long_windows[blockIdx.x];
    const u32 vb = row_pointers[w], ve = row_pointers[w + 1];
    const float* sh = scores + (u64)blockIdx.y * n_slots;
    float* oh = out + (u64)blockIdx.y * n_slots;
    float m[8], s[8];
    softmax_accumulate(row_masks, sh, vb + threadIdx.x, ve, blockDim.x, leaky, slope, m, s);
    softmax_warp_merge(m, s);
    if (lane == 0) {
#pragma unroll
        for (int r = 0; r < 8; ++r) {
            part_m[warp][r] = m[r];
            part_s[warp][r] = s[r];
        }
    }
    __syncthreads();
    if (threadIdx.x < 8u) {
        const u32 r = threadIdx.x;
        float mm = SPATTN_NEG_INF, ss = 0.0f, c1, c2;
        for (u32 x = 0; x < warps; ++x) online_merge(mm, ss, part_m[x][r], part_s[x][r], c1, c2);
        row_m[r] = softmax_base(mm);  // all masked, or no slot
        row_inv[r] = softmax_inv(ss);
    }
    __syncthreads();
    float inv[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) {
        m[r] = row_m[r];
        inv[r] = row_inv[r];
    }
    softmax_write(row_masks, sh, oh, vb + threadIdx.x, ve, blockDim.x, leaky, slope, m, inv);
}

// ---- layout conversions -------------------------------------------------------------------------
// CSR edge order (e * heads + h) <-> slots (h * n_slots + edge_to_slot[e]). Thread per
// (edge, head). Scattering leaves padding slots as they were (the host fills them first).

extern "C" __global__ void csr_to_slots_mebcrs(const u32* __restrict__ edge_to_slot, u32 nnz,
                                               u32 heads, u64 n_slots,
                                               const float* __restrict__ in,
                                               float* __restrict__ out) {
    const u64 total = (u64)nnz * heads;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u32 h;
        const u64 e = split_index(i, heads, total, h);
        out[h * n_slots + edge_to_slot[e]] = in[i];
    }
}

extern "C" __global__ void slots_to_csr_mebcrs(const u32* __restrict__ edge_to_slot, u32 nnz,
                                               u32 heads, u64 n_slots,
                                               const float* __restrict__ in,
                                               float* __restrict__ out) {
    const u64 total = (u64)nnz * heads;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u32 h;
        const u64 e = split_index(i, heads, total, h);
        out[i] = in[h * n_slots + edge_to_slot[e]];
    }
}

// ---- extern "C" instantiations ------------------------------------------------------------------
// sddmm_mebcrs_{dtype}[_unaligned], spmm_mebcrs_{dtype}_t{FT}[_unaligned],
// spmm_mebcrs_finalize_{dtype}; dtype f16, bf16, or tf32 (f32 operands through tf32 mma);
// spmm_mebcrs_{f16,bf16}_t8_pipe (the shared-memory pipelined SpMM).

#define SPATTN_SDDMM_ME(NAME, T, ALIGNED)                                                        \
    extern "C" __global__ void NAME(const u32* item_window, const u32* item_start,              \
                                    const u32* item_end, u32 n_items, const u32* col_indices,   \
                                    const unsigned char* row_masks, u32 n_rows,                 \
                                    const u32* row_ids, u64 n_slots, const T* q, const T* k,    \
                                    u32 heads, u32 head_dim, float scale, float* scores) {      \
        sddmm_mebcrs<T, ALIGNED>(item_window, item_start, item_end, n_items, col_indices,       \
                                 row_masks, n_rows, row_ids, n_slots, q, k, heads, head_dim,    \
                                 scale, scores);                                                \
    }

// One SpMM entry point: the kernel signature, calling the device function given after T (a
// template instantiation, hence variadic: its argument list has commas).
#define SPATTN_SPMM_ENTRY(NAME, T, ...)                                                          \
    extern "C" __global__ void NAME(SPATTN_SPMM_PARAMS(T)) { __VA_ARGS__(SPATTN_SPMM_ARGS); }

#define SPATTN_ME_PER_FT(SUFFIX, T, FT)                                                          \
    SPATTN_SPMM_ENTRY(spmm_mebcrs_##SUFFIX##_t##FT, T, spmm_mebcrs<T, FT, true>)                 \
    SPATTN_SPMM_ENTRY(spmm_mebcrs_##SUFFIX##_t##FT##_unaligned, T, spmm_mebcrs<T, FT, false>)

// The pipelined SpMM is instantiated where it measured faster: 128-feature slabs (FT = 8), three
// stages (docs/kernels/tc-ops.md).
#define SPATTN_PIPE_PER_DTYPE(SUFFIX, T)                                                         \
    SPATTN_SPMM_ENTRY(spmm_mebcrs_##SUFFIX##_t8_pipe, T, spmm_mebcrs_pipe<T, 8, 3>)

#define SPATTN_ME_PER_DTYPE(SUFFIX, T)                                                           \
    SPATTN_SDDMM_ME(sddmm_mebcrs_##SUFFIX, T, true)                                              \
    SPATTN_SDDMM_ME(sddmm_mebcrs_##SUFFIX##_unaligned, T, false)                                 \
    SPATTN_ME_PER_FT(SUFFIX, T, 1)                                                               \
    SPATTN_ME_PER_FT(SUFFIX, T, 2)                                                               \
    SPATTN_ME_PER_FT(SUFFIX, T, 4)                                                               \
    SPATTN_ME_PER_FT(SUFFIX, T, 8)                                                               \
    extern "C" __global__ void spmm_mebcrs_finalize_##SUFFIX(                                    \
        const u32* split_windows, const u32* partial_first, u32 n_split, u32 n_rows,            \
        const u32* row_ids, u32 hd, const float* scratch, T* out) {                              \
        spmm_mebcrs_finalize<T>(split_windows, partial_first, n_split, n_rows, row_ids, hd,     \
                                scratch, out);                                                  \
    }

SPATTN_ME_PER_DTYPE(f16, __half)
SPATTN_ME_PER_DTYPE(bf16, __nv_bfloat16)
SPATTN_ME_PER_DTYPE(tf32, float)
SPATTN_PIPE_PER_DTYPE(f16, __half)
SPATTN_PIPE_PER_DTYPE(bf16, __nv_bfloat16)
