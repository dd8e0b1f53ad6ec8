// RT-GNN-style hybrid kernels: tensor-core and CUDA-core warps of one CTA splitting the work of
// each window, for fused attention (fused_hybrid_*) and for SpMM (spmm_hybrid_*).
//
// Format (spattn_formats::HybridBlocks / HybridSplit): rows renumbered by degree into 16-row
// windows; each window's columns (original node ids) ordered by how many of its rows they hit
// and packed into 16x8 bitmap blocks; the blocks at or above a fill threshold (a prefix of the
// window) are tensor-core tiles, the edges of the others CUDA-core edges listed per renumbered
// row. Q and the output go through row_ids (renumbered row -> the caller's row); K and V are
// gathered by original id, so the caller's arrays are used as they are.
//
// Work: persistent CTAs pull items (unit, head) from a queue (atomic counter; units are
// sorted largest first on the host). A CTA has `tc_warps` tensor-core warps and the rest
// CUDA-core warps. For one item:
// - tensor-core warp i takes the unit's block pairs i, i + T, ... (the fused_bsb tile loop of
//   attention_tiles.cuh: mma SDDMM, bitmap mask, online softmax, mma P V; SpMM: mma P V with
//   the bitmap or the slot weights as P);
// - CUDA-core warp c takes the c-th of C equal slices of the unit's CUDA-core edges and walks
//   them row by row (the fused_csr edge loop, in the log2 domain; SpMM: weighted sums);
// - every warp leaves one exact partial (max, sum, f32 accumulator) per window row in its own
//   shared-memory slot, and after a barrier the CTA merges the slots of each row (online_merge
//   in the log2 domain) and writes the output rows, or, for a unit of a split window, the
//   window's partial to global memory; the last unit of a split window to finish merges them
//   (bsb_merge_parts, as fused_bsb). SpMM partials are plain sums (max 0, and a sum of 1 on
//   the window's first part only, so that the shared merge adds them unscaled).
// Barriers are named (`bar.sync id, threads`): 1 after the queue pull, 2 after the partials,
// 3 after the per-row maxima, 4 and 5 around a split window's hand-off.
//
// Shared memory (floats): 4 control words, 32 row stats, 32 merge scratch, then per warp
// 16 x 2 (max, sum) and 16 x DS accumulators.
//
// Attention kernels have `_x` twins taking a score bias and dropout in the caller's CSR order
// (no edge features): the tensor-core warps through BsbExtras (bias and keep bits gathered by
// fused_bsb's bsb_bias_gather_* and bsb_keep_gather before the launch), the CUDA-core
// warps through EdgeExtras in the log2 domain (cd_edge_ids naming each CUDA-core edge's caller
// edge).

#include "attention_tiles.cuh"

// The `_x` kernels' extras: the CUDA-core warps' (bias in the caller's CSR order, cd_edge_ids
// naming each CUDA-core edge's caller edge, dropout) and the tensor-core warps' (BsbExtrasArgs,
// gathered into block-and-bit order before the launch).
template <class T> struct HybridExtrasArgs {
    const T* bias;
    u32 bias_heads;
    const u32* cd_edge_ids;
    Dropout drop;
    BsbExtrasArgs tc;
};

// The CUDA-core warps' EdgeExtras of head h in a `_x` kernel (ON; no edge features), none
// otherwise (`xa` is not read).
template <bool ON, class T>
__device__ __forceinline__ auto hyb_cd_extras(const HybridExtrasArgs<T>* xa, u32 h, u32 heads) {
    if constexpr (ON) {
        const EdgeExtras<T, false> xt = {xa->bias,  nullptr, xa->cd_edge_ids, xa->bias_heads,
                                         h,         heads,   0u,  1.4426950408889634f,
                                         xa->drop};
        return xt;
    } else {
        return NoEdgeExtras();
    }
}

// The tensor-core warps' extras of head h (see bsb_extras_or_none).
template <bool ON, class T>
__device__ __forceinline__ auto hyb_tc_extras(const HybridExtrasArgs<T>* xa, u32 h) {
    return bsb_extras_or_none<ON>(ON ? &xa->tc : nullptr, h);
}

#define HYB_HEAD_FLOATS 68u

// Barrier of all the CTA's threads at named barrier `id` (1..15).
__device__ __forceinline__ void hyb_sync(u32 id) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(blockDim.x) : "memory");
}

template <class T, int DS, bool SPMM, bool EXTRAS = false>
__device__ __forceinline__ void hybrid(
    const uint4* __restrict__ units, const u32* __restrict__ split_part_first, u32 n_items,
    u32 heads, u32 head_dim, u32 n_rows, u32 tc_warps, const u32* __restrict__ row_ids,
    const u32* __restrict__ block_columns, const u32* __restrict__ bitmaps,
    const float* __restrict__ tc_weights, const u32* __restrict__ cd_row_offsets,
    const u32* __restrict__ cd_columns, const float* __restrict__ cd_weights,
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, float scale_log2,
    T* __restrict__ out, float* __restrict__ part_ml, float* __restrict__ part_acc,
    u32* __restrict__ counters, u32* __restrict__ queue,
    const HybridExtrasArgs<T>* xa = nullptr) {
    constexpr int D8 = DS / 8;
    // CUDA-core lanes: a whole warp per row segment, CV features per access, NV accesses.
    constexpr int MAXV = 16 / (int)sizeof(T);
    constexpr int CV = DS / 32 < MAXV ? DS / 32 : MAXV;
    constexpr int NV = DS / (32 * CV);
    constexpr bool PIPE = DS == 128 && !SPMM;

    extern __shared__ float hyb_smem[];
    u32* ctl = reinterpret_cast<u32*>(hyb_smem);
    float* stat = hyb_smem + 4;
    float* mrg = hyb_smem + 36;
    const u32 nwarps = blockDim.x >> 5;
    float* slot_ml = hyb_smem + HYB_HEAD_FLOATS;
    float* slot_acc = slot_ml + nwarps * BSB_WINDOW_ROWS * 2u;

    const u32 tid = threadIdx.x, lane = lane_id(), warp = tid >> 5;
    const u32 g = lane >> 2, t = lane & 3u;
    const u64 hd = (u64)heads * head_dim;
    const u32 cd_warps = nwarps - tc_warps;

    for (;;) {
        if (tid == 0u) ctl[0] = atomicAdd(queue, 1u);
        hyb_sync(1);
        const u32 item = ctl[0];
        if (item >= n_items) break;
        const u32 u = item / heads, h = item - u * heads;
        const uint4 ua = __ldg(units + 2u * u), ub = __ldg(units + 2u * u + 1u);
        const u32 window = ua.x, tc0 = ua.y, tc1 = ua.z, part = ua.w;
        const u32 cd0 = ub.x, cd1 = ub.y, split = ub.z, wbase = ub.w;
        const u64 head_off = (u64)h * head_dim;
        const u32 wr0 = window * BSB_WINDOW_ROWS;
        float* my_ml = slot_ml + warp * BSB_WINDOW_ROWS * 2u;
        float* my_acc = slot_acc + warp * BSB_WINDOW_ROWS * DS;

        if (warp < tc_warps) {
            // Tensor-core warp: block pairs warp, warp + T, ... of the unit.
            float m[2], l[2], o[D8][4];
            u32 qr0 = SPATTN_NONE, qr1 = SPATTN_NONE;
            if (!SPMM) {
                if (wr0 + g < n_rows) qr0 = __ldg(row_ids + wr0 + g);
                if (wr0 + g + 8u < n_rows) qr1 = __ldg(row_ids + wr0 + g + 8u);
            }
            bsb_tiles<T, DS, PIPE, SPMM>(
                qr0, qr1, q, block_columns, bitmaps, tc_weights, wbase, tc0 + 2u * warp, tc1,
                2u * tc_warps, k, v, hd, head_off, head_dim, 0u, scale_log2, 1u, 0u, 0u, 32u,
                nullptr, m, l, o, hyb_tc_extras<EXTRAS>(xa, h));
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const u32 wr = g + 8u * r;
                if (t == 0u) {
                    my_ml[wr * 2u] = SPMM ? 0.0f : m[r];
                    my_ml[wr * 2u + 1u] = l[r];
                }
#pragma unroll
                for (int half = 0; half < 2; ++half) {
                    float4* dst = reinterpret_cast<float4*>(my_acc + wr * DS + (2u * t + half) * D8);
#pragma unroll
                    for (int c = 0; c < D8 / 4; ++c)
                        dst[c] = make_float4(o[4 * c][2 * r + half], o[4 * c + 1][2 * r + half],
                                             o[4 * c + 2][2 * r + half], o[4 * c + 3][2 * r + half]);
                }
            }
        } else {
            // CUDA-core warp: slice c of the unit's edges, row by row.
            const u32 c = warp - tc_warps;
            const u64 ne = cd1 - cd0;
            const u32 lo = cd0 + (u32)(ne * c / cd_warps), hi = cd0 + (u32)(ne * (c + 1u) / cd_warps);
            bool on[NV];
            u32 feat[NV];
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                feat[j] = (lane + j * 32u) * CV;
                on[j] = feat[j] < head_dim;
            }
            for (u32 r = 0; r < BSB_WINDOW_ROWS; ++r) {
                const u32 row = wr0 + r;
                u32 s = lo, e = lo;
                if (row < n_rows) {
                    s = max(lo, __ldg(cd_row_offsets + row));
                    e = min(hi, __ldg(cd_row_offsets + row + 1u));
                }
                float m = SPATTN_NEG_INF, l = 0.0f, acc[NV][CV];
#pragma unroll
                for (int j = 0; j < NV; ++j)
#pragma unroll
                    for (int i = 0; i < CV; ++i) acc[j][i] = 0.0f;
                if (s < e) {
                    if constexpr (SPMM) {
                        m = 0.0f;
                        csr_edges_sum<T, CV, NV>(cd_columns, cd_weights, s, e, v, hd, head_off, on,
                                                 feat, acc);
                    } else {
                        const u32 qrow = __ldg(row_ids + row);
                        float qv[NV][CV];
#pragma unroll
                        for (int j = 0; j < NV; ++j) {
#pragma unroll
                            for (int i = 0; i < CV; ++i) qv[j][i] = 0.0f;
                            if (on[j]) {
                                load_vec<T, CV>(q + (u64)qrow * hd + head_off + feat[j], qv[j]);
#pragma unroll
                                for (int i = 0; i < CV; ++i) qv[j][i] *= scale_log2;
                            }
                        }
                        csr_edges_online<T, CV, NV, true>(cd_columns, s, e, k, v, hd, head_off, on,
                                                          feat, qv, 0xffffffffu, 32u, m, l, acc,
                                                          hyb_cd_extras<EXTRAS>(xa, h, heads));
                    }
#pragma unroll
                    for (int j = 0; j < NV; ++j)
                        if (on[j])
#pragma unroll
                            for (int i = 0; i < CV; ++i) my_acc[r * DS + feat[j] + i] = acc[j][i];
                }
                if (lane == 0u) {
                    my_ml[r * 2u] = m;
                    my_ml[r * 2u + 1u] = l;
                }
            }
        }
        hyb_sync(2);

        // Per row: the max over the slots and the total sum (log2 domain).
        if (tid < BSB_WINDOW_ROWS) {
            float mm = SPATTN_NEG_INF, ll = 0.0f;
            for (u32 s = 0; s < nwarps; ++s) {
                const float m2 = slot_ml[(s * BSB_WINDOW_ROWS + tid) * 2u];
                const float l2 = slot_ml[(s * BSB_WINDOW_ROWS + tid) * 2u + 1u];
                float c1, c2;
                // A slot with no live edge of the row (m2 -inf, l2 0) adds nothing, and may
                // hold no accumulator; one whose max is -inf but saw a NaN (l2 NaN) merges.
                if (m2 != SPATTN_NEG_INF || l2 != 0.0f) online_merge_log2(mm, ll, m2, l2, c1, c2);
            }
            stat[tid * 2u] = mm;
            stat[tid * 2u + 1u] = ll;
            if (part != SPATTN_NONE) {
                const u64 i = (((u64)part * heads + h) * BSB_WINDOW_ROWS + tid) * 2u;
                part_ml[i] = SPMM ? 0.0f : mm;
                part_ml[i + 1u] = SPMM ? (part == split_part_first[split] ? 1.0f : 0.0f) : ll;
            }
        }
        hyb_sync(3);

        // Per (row, feature): the merged accumulator, normalised (attention) and written.
        for (u32 i = tid; i < BSB_WINDOW_ROWS * DS; i += blockDim.x) {
            const u32 r = i / DS, f = i - r * DS;
            if (f >= head_dim) continue;
            const float mm = stat[r * 2u];
            float a = 0.0f;
            for (u32 s = 0; s < nwarps; ++s) {
                const float m2 = slot_ml[(s * BSB_WINDOW_ROWS + r) * 2u];
                const float l2 = slot_ml[(s * BSB_WINDOW_ROWS + r) * 2u + 1u];
                if (m2 != SPATTN_NEG_INF || l2 != 0.0f)
                    a += slot_acc[(s * BSB_WINDOW_ROWS + r) * DS + f] * (SPMM ? 1.0f : bsb_exp2(m2 - mm));
            }
            if (part == SPATTN_NONE) {
                const u32 row = wr0 + r;
                if (row < n_rows) {
                    const float ll = stat[r * 2u + 1u];
                    // ll is 0 for a row without edges (or all masked), NaN for a NaN score.
                    const float y = SPMM ? a : (ll != 0.0f ? a / ll : 0.0f);
                    out[(u64)__ldg(row_ids + row) * hd + head_off + f] = from_f32<T>(y);
                }
            } else {
                part_acc[(((u64)part * heads + h) * BSB_WINDOW_ROWS + r) * DS + f] = a;
            }
        }
        if (part == SPATTN_NONE) continue;

        // A unit of a split window: the last of its parts to arrive merges them.
        __threadfence();
        hyb_sync(4);
        const u32 p_first = split_part_first[split], p_end = split_part_first[split + 1u];
        u32* counter = counters + (u64)split * heads + h;
        if (tid == 0u) ctl[1] = atomicAdd(counter, 1u) == p_end - p_first - 1u ? 1u : 0u;
        hyb_sync(4);
        if (ctl[1] != 0u) {
            __threadfence();
            const u32 rows_here = min(BSB_WINDOW_ROWS, n_rows - wr0);
            bsb_merge_parts<T, DS / 16>(part_ml, part_acc, p_first, p_end, heads, h, DS, tid,
                                             blockDim.x, 5u, mrg, rows_here, row_ids, wr0, out,
                                             nullptr, hd, head_off, head_dim);
            if (tid == 0u) *counter = 0u;  // ready for the next launch
        }
    }
    // The last CTA out resets the queue for the next launch (every CTA has pulled past the end).
    if (tid == 0u && atomicAdd(queue + 1, 1u) == gridDim.x - 1u) {
        queue[0] = 0u;
        queue[1] = 0u;
    }
}

#define SPATTN_HYBRID_PARAMS(T)                                                                 \
    const uint4 *units, const u32 *split_part_first, u32 n_items, u32 heads, u32 head_dim,      \
        u32 n_rows, u32 tc_warps, const u32 *row_ids, const u32 *block_columns,                 \
        const u32 *bitmaps, const float *tc_weights, const u32 *cd_row_offsets,                 \
        const u32 *cd_columns, const float *cd_weights, const T *q, const T *k, const T *v,     \
        float scale_log2, T *out, float *part_ml, float *part_acc, u32 *counters, u32 *queue
#define SPATTN_HYBRID_ARGS                                                                      \
    units, split_part_first, n_items, heads, head_dim, n_rows, tc_warps, row_ids,               \
        block_columns, bitmaps, tc_weights, cd_row_offsets, cd_columns, cd_weights, q, k, v,    \
        scale_log2, out, part_ml, part_acc, counters, queue

// The `_x` kernels' parameters after the others, and their HybridExtrasArgs.
#define SPATTN_HYBRID_X_PARAMS(T)                                                               \
    const T *bias, u32 bias_heads, const u32 *cd_edge_ids, u32 key0, u32 key1, u32 off0,        \
        u32 off1, u32 threshold, float drop_scale, SPATTN_BSB_X_PARAMS
#define SPATTN_HYBRID_X_ARGS(T)                                                                 \
    const HybridExtrasArgs<T> xa = {bias,        bias_heads,                                    \
                                    cd_edge_ids, {key0, key1, off0, off1, threshold, drop_scale}, \
                                    SPATTN_BSB_X_ARGS}

#define SPATTN_HYBRID(SUFFIX, T, DS)                                                            \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        fused_hybrid_##SUFFIX##_s##DS(SPATTN_HYBRID_PARAMS(T)) {                              \
        hybrid<T, DS, false>(SPATTN_HYBRID_ARGS);                                               \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(256) fused_hybrid_##SUFFIX##_s##DS##_x(        \
        SPATTN_HYBRID_PARAMS(T), SPATTN_HYBRID_X_PARAMS(T)) {                                   \
        SPATTN_HYBRID_X_ARGS(T);                                                                \
        hybrid<T, DS, false, true>(SPATTN_HYBRID_ARGS, &xa);                                    \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        spmm_hybrid_##SUFFIX##_s##DS(SPATTN_HYBRID_PARAMS(T)) {                               \
        hybrid<T, DS, true>(SPATTN_HYBRID_ARGS);                                                \
    }

// Rows of whole 16-byte vectors only: the host pads heads of other lengths with zeros
// (resize_rows, rows.cu).
SPATTN_HYBRID(f16, __half, 32)
SPATTN_HYBRID(f16, __half, 64)
SPATTN_HYBRID(f16, __half, 128)
SPATTN_HYBRID(bf16, __nv_bfloat16, 32)
SPATTN_HYBRID(bf16, __nv_bfloat16, 64)
SPATTN_HYBRID(bf16, __nv_bfloat16, 128)
SPATTN_HYBRID(f32, float, 32)
SPATTN_HYBRID(f32, float, 64)

// ---- the pipelined hybrid kernel: one window per tensor-core warp ------------------------------
// fused_hybrid_{f16,bf16}_d{64,128}_pipe: f16/bf16 heads of exactly 64 or 128 features. The
// kernel above gives a whole CTA one window at a time, so on graphs whose windows hold a few
// block pairs most of its tensor-core warps idle, and every item pays CTA-wide barriers. Here
// a CTA has `tc_warps` (1..4) tensor-core warps, each owning its own item (unit, head) as in
// fused_bsb_pipe, and at most one CUDA-core warp that serves the CTA's items in turn:
// - tensor-core warp i runs its unit's blocks through the pipelined tile loop
//   (bsb_pipe_tiles: cp.async K/V tiles in shared memory, mma SDDMM, bitmap mask, online
//   softmax, mma P V), keeping the partial (max, sum, f32 accumulator) of rows g, g + 8;
// - the CUDA-core warp takes the CUDA-core edges of item 0, 1, ... in order: four groups of 8
//   lanes, group j walking window rows j, j + 4, j + 8, j + 12 with the fused-csr edge loop in
//   the log2 domain (csr_edges_online), each lane holding 8-feature vectors of the head;
// - hand-off, only for an item with CUDA-core edges, between just the two warps, on two
//   shared-memory mbarriers of warp i (hyb_free[i], hyb_full[i], 32 arrivals each, one phase
//   per launch): warp i's lanes arrive on hyb_free[i] once its copies have landed (its stages
//   are free); the CUDA-core warp waits for that, writes its 16 rows' (max, sum) and
//   accumulators into warp i's stage memory and its lanes arrive on hyb_full[i]; warp i waits
//   for that, merges the two partials of its rows exactly (both in the log2 domain) and ends
//   the unit as fused_bsb_pipe does (output rows, or a split window's partial and the last
//   part's merge).
//   Why not named barriers (bar.sync / barrier.sync 1 + i, 64), as the first version had:
//   the CUDA-core warp reaches the hand-off with its lane groups diverged (rows of different
//   lengths), and a hardware barrier counts a warp's arrival per warp, not per thread, so the
//   first group to arrive could complete the pair's barrier on its own. racecheck showed it
//   (the partial written into stages the tensor-core warp was still reading through
//   ldmatrix), with bar.sync, with barrier.sync, and with __syncwarp() before them; the
//   "unexplained" hazards at 4 tensor-core warps were the same race. An mbarrier counts each
//   arriving thread.
// Without a CUDA-core warp (launched with tc_warps warps only) every edge must be on tensor
// cores; the host checks it.
// spmm_hybrid_{f16,bf16}_d{64,128}_pipe is the same kernel for SpMM (SPMM true): the stages
// hold only V tiles and bitmaps, P is the bitmap (or the slot weights), the CUDA-core lane
// groups run weighted sums (csr_edges_sum), and every partial is a plain sum (max 0), so the
// hand-off's merge and a split window's merge add them unscaled.
//
// CUDA-core partial in warp i's stage memory (floats): (max, sum) of row r at 2r, its
// accumulator at 32 + r * (D + 8) (rows padded by 8 floats: the float2 reads of a half-warp,
// rows g = 0..3 and t = 0..3, fall in 32 different banks).
// At most 4 tensor-core warps (the launch bound follows; the plan tries 1..3). After the
// tensor-core warps' shared memory: the hand-off's mbarriers, hyb_free[HYB_PIPE_MAX_TC] then
// hyb_full[HYB_PIPE_MAX_TC] (8 bytes each; the host adds them: PIPE_MBAR_BYTES in
// hybrid_spmm.rs).
#define HYB_PIPE_MAX_TC 4u

__host__ __device__ constexpr u32 hyb_pipe_row_floats(u32 d) { return d + 8u; }
static_assert(bsb_pipe_warp_bytes(64, true) % 8u == 0u && bsb_pipe_warp_bytes(128, true) % 8u == 0u &&
                  bsb_pipe_warp_bytes(64) % 8u == 0u && bsb_pipe_warp_bytes(128) % 8u == 0u,
              "the mbarriers after the warps' memory are 8-byte aligned");
// (Checked for SpMM's stages, which are smaller: no K tile.)
static_assert(4u * (32u + 16u * hyb_pipe_row_floats(64)) <=
                  BSB_PIPE_STAGES * bsb_pipe_stage_bytes(64, true),
              "CUDA-core partial fits the stages (64)");
static_assert(4u * (32u + 16u * hyb_pipe_row_floats(128)) <=
                  BSB_PIPE_STAGES * bsb_pipe_stage_bytes(128, true),
              "CUDA-core partial fits the stages (128)");

// The hand-off's mbarriers (sm_80+): hyb_free[i] and hyb_full[i] of tensor-core warp i, each
// completing its phase 0 when 32 threads have arrived. Initialised at the start of every launch.
__device__ __forceinline__ void hyb_mbar_init(u64* bar, u32 count) {
    asm volatile("mbarrier.init.shared.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}
// One arrival of the calling thread (release: its earlier shared-memory accesses are visible to
// a thread whose wait sees the phase complete).
__device__ __forceinline__ void hyb_mbar_arrive(u64* bar) {
    asm volatile("{\n\t.reg .b64 st;\n\tmbarrier.arrive.shared.b64 st, [%0];\n\t}" ::"r"(
                     smem_addr(bar))
                 : "memory");
}
// Spins until phase 0 of `bar` has completed (acquire).
__device__ __forceinline__ void hyb_mbar_wait(u64* bar) {
    u32 done = 0u;
    while (done == 0u) {
        asm volatile(
            "{\n\t.reg .pred p;\n\tmbarrier.test_wait.parity.shared.b64 p, [%1], 0;\n\t"
            "selp.u32 %0, 1, 0, p;\n\t}"
            : "=r"(done)
            : "r"(smem_addr(bar))
            : "memory");
    }
}

// The CUDA-core warp of hybrid_pipe: lane group j = lane / 8 (4 groups), lane gl = lane % 8
// holds the 8-feature vectors gl, gl + 8, ... of the head; its partial of item i goes into
// tensor-core warp i's stages (smem0 + i * bsb_pipe_warp_bytes(D, SPMM)).
template <class T, int D, bool SPMM, bool EXTRAS = false>
__device__ __forceinline__ void hybrid_pipe_cd(
    const uint4* __restrict__ units, u32 n_items, u32 heads, u32 n_rows, u32 tc_warps,
    const u32* __restrict__ row_ids, const u32* __restrict__ cd_row_offsets,
    const u32* __restrict__ cd_columns, const float* __restrict__ cd_weights,
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, float scale_log2,
    unsigned char* smem0, u64* hyb_free, u64* hyb_full,
    const HybridExtrasArgs<T>* xa = nullptr) {
    constexpr u32 RF = hyb_pipe_row_floats(D);
    const u32 lane = lane_id();
    const u64 hd = (u64)heads * D;
    constexpr int NV = D / 64;
    const u32 j = lane >> 3, gl = lane & 7u;
    const u32 mask = 0xffu << (8u * j);
    bool on[NV];
    u32 feat[NV];
#pragma unroll
    for (int x = 0; x < NV; ++x) {
        feat[x] = (gl + 8u * x) * 8u;
        on[x] = true;
    }
    for (u32 i = 0; i < tc_warps; ++i) {
        const u32 item = blockIdx.x * tc_warps + i;
        if (item >= n_items) break;
        const u32 u = item / heads, h = item - u * heads;
        const uint4 ua = __ldg(units + 2u * u), ub = __ldg(units + 2u * u + 1u);
        const u32 cd0 = ub.x, cd1 = ub.y;
        if (cd0 >= cd1) continue;  // warp i does not wait for this item
        const u64 head_off = (u64)h * D;
        const u32 wr0 = ua.x * BSB_WINDOW_ROWS;
        float m[4], l[4], acc[4][NV][8];
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
            const u32 row = wr0 + j + 4u * rr;
            m[rr] = SPATTN_NEG_INF;
            l[rr] = 0.0f;
#pragma unroll
            for (int x = 0; x < NV; ++x)
#pragma unroll
                for (int e = 0; e < 8; ++e) acc[rr][x][e] = 0.0f;
            if (row >= n_rows) continue;
            const u32 s = max(cd0, __ldg(cd_row_offsets + row));
            const u32 e = min(cd1, __ldg(cd_row_offsets + row + 1u));
            if (s >= e) continue;
            if constexpr (SPMM) {
                m[rr] = 0.0f;  // a plain sum: merged unscaled
                csr_edges_sum<T, 8, NV>(cd_columns, cd_weights, s, e, v, hd, head_off, on, feat,
                                        acc[rr]);
                continue;
            }
            const T* qr = q + (u64)__ldg(row_ids + row) * hd + head_off;
            float qv[NV][8];
#pragma unroll
            for (int x = 0; x < NV; ++x) {
                load_vec<T, 8>(qr + feat[x], qv[x]);
#pragma unroll
                for (int c = 0; c < 8; ++c) qv[x][c] *= scale_log2;
            }
            csr_edges_online<T, 8, NV, true>(cd_columns, s, e, k, v, hd, head_off, on, feat, qv,
                                             mask, 8u, m[rr], l[rr], acc[rr],
                                             hyb_cd_extras<EXTRAS>(xa, h, heads));
        }
        // Warp i's stages are free once its lanes have arrived; write the partial, hand it over.
        hyb_mbar_wait(hyb_free + i);
        float* cp = reinterpret_cast<float*>(smem0 + i * bsb_pipe_warp_bytes(D, SPMM));
#pragma unroll
        for (int rr = 0; rr < 4; ++rr) {
            const u32 wr = j + 4u * rr;
            if (gl == 0u) {
                cp[2u * wr] = m[rr];
                cp[2u * wr + 1u] = l[rr];
            }
#pragma unroll
            for (int x = 0; x < NV; ++x) {
                float4* dst = reinterpret_cast<float4*>(cp + 32u + wr * RF + feat[x]);
                dst[0] = make_float4(acc[rr][x][0], acc[rr][x][1], acc[rr][x][2], acc[rr][x][3]);
                dst[1] = make_float4(acc[rr][x][4], acc[rr][x][5], acc[rr][x][6], acc[rr][x][7]);
            }
        }
        hyb_mbar_arrive(hyb_full + i);
    }
}

// HAS_CD = false compiles the CUDA-core warp, the hand-off and its mbarriers out: the
// all-tensor-core split gets its own kernel (`*_pipe_tc`), because behind a runtime flag the
// merge after the tile loop made the compiler recompute the swizzled ldmatrix addresses every
// step (docs/kernels/hybrid.md).
template <class T, int D, bool SPMM, bool HAS_CD, bool EXTRAS = false>
__device__ __forceinline__ void hybrid_pipe(
    const uint4* __restrict__ units, const u32* __restrict__ split_part_first, u32 n_items,
    u32 heads, u32 n_rows, u32 tc_warps, const u32* __restrict__ row_ids,
    const u32* __restrict__ block_columns, const u32* __restrict__ bitmaps,
    const float* __restrict__ tc_weights, const u32* __restrict__ cd_row_offsets,
    const u32* __restrict__ cd_columns, const float* __restrict__ cd_weights,
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, float scale_log2,
    T* __restrict__ out, float* __restrict__ part_ml, float* __restrict__ part_acc,
    u32* __restrict__ counters, const HybridExtrasArgs<T>* xa = nullptr) {
    constexpr int NT = D / 8;
    constexpr u32 RF = hyb_pipe_row_floats(D);
    extern __shared__ uint4 hyb_pipe_smem[];
    unsigned char* smem0 = reinterpret_cast<unsigned char*>(hyb_pipe_smem);
    const u32 lane = lane_id(), warp = threadIdx.x >> 5;
    // A compile-time false without CUDA-core warps: the hand-off code below folds away.
    const bool has_cd = HAS_CD && (blockDim.x >> 5) > tc_warps;
    const u64 hd = (u64)heads * D;
    // The mbarriers sit after the tensor-core warps' memory (counted by the host), not in
    // static shared memory ahead of it, which slowed even the all-tensor-core kernel
    // (docs/kernels/hybrid.md).
    u64* hyb_free = reinterpret_cast<u64*>(smem0 + tc_warps * bsb_pipe_warp_bytes(D, SPMM));
    u64* hyb_full = hyb_free + HYB_PIPE_MAX_TC;
    if (has_cd) {
        if (threadIdx.x < HYB_PIPE_MAX_TC) {
            hyb_mbar_init(hyb_free + threadIdx.x, 32u);
            hyb_mbar_init(hyb_full + threadIdx.x, 32u);
        }
        __syncthreads();  // the mbarriers are initialised before any warp uses them
    }

    // A warp may leave once its own hand-off (if any) is done: each mbarrier phase needs only
    // the two warps of its pair, and the CTA's shared memory lives until its last warp exits.
    if (warp < tc_warps) [&] {
        const u32 item = blockIdx.x * tc_warps + warp;
        if (item >= n_items) return;  // uniform across the warp; the CUDA-core warp skips it too
        unsigned char* smem = smem0 + warp * bsb_pipe_warp_bytes(D, SPMM);
        const u32 u = item / heads, h = item - u * heads;
        const uint4 ua = __ldg(units + 2u * u), ub = __ldg(units + 2u * u + 1u);
        const u32 window = ua.x, part = ua.w;
        const u64 head_off = (u64)h * D;
        const u32 g = lane >> 2, t = lane & 3u;
        u32 qrow[2];
        bsb_pipe_qrows(row_ids, window, n_rows, qrow);
        float m[2], l[2], o[NT][4];
        bsb_pipe_tiles<T, D, SPMM>(smem, ua.y, ua.z, qrow, q, block_columns, bitmaps, k, v, hd,
                                   head_off, scale_log2, tc_weights, ub.w, m, l, o, 0u,
                                   hyb_tc_extras<EXTRAS>(xa, h));
        if (has_cd && ub.x < ub.y) {
            hyb_mbar_arrive(hyb_free + warp);  // stages free for the CUDA-core partial
            hyb_mbar_wait(hyb_full + warp);     // the partial is there
            const float* cp = reinterpret_cast<const float*>(smem);
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const u32 wr = g + 8u * r;
                const float m2 = cp[2u * wr], l2 = cp[2u * wr + 1u];
                // Neither side has a live edge and the partial no NaN (its l2 would be NaN).
                if (fmaxf(m[r], m2) == SPATTN_NEG_INF && l2 == 0.0f) continue;
                float c1, c2;
                online_merge_log2(m[r], l[r], m2, l2, c1, c2);
                const float2* acc = reinterpret_cast<const float2*>(cp + 32u + wr * RF);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    const float2 a = acc[4 * nt + t];
                    o[nt][2 * r] = o[nt][2 * r] * c1 + a.x * c2;
                    o[nt][2 * r + 1] = o[nt][2 * r + 1] * c1 + a.y * c2;
                }
            }
        }
        bsb_pipe_finish<T, D, SPMM>(part, ub.z, split_part_first, counters, heads, h, smem,
                                    part_ml, part_acc, n_rows, window, row_ids, out, nullptr,
                                    hd, head_off, qrow, m, l, o);
    }();
    else if constexpr (HAS_CD)
        hybrid_pipe_cd<T, D, SPMM, EXTRAS>(units, n_items, heads, n_rows, tc_warps, row_ids,
                                           cd_row_offsets, cd_columns, cd_weights, q, k, v,
                                           scale_log2, smem0, hyb_free, hyb_full, xa);
}

// Each op and type twice: `_pipe` (tensor-core and CUDA-core warps) and `_pipe_tc` (tensor-core
// warps only, the host's choice for a split without CUDA-core warps).
#define SPATTN_HYBRID_PIPE_OP(OP, SPMM, SUFFIX, T, D, HAS_CD, TAIL, WARPS)                      \
    extern "C" __global__ void __launch_bounds__(32 * (WARPS))                                  \
        OP##_hybrid_##SUFFIX##_d##D##_pipe##TAIL(SPATTN_HYBRID_PARAMS(T)) {                     \
        (void)head_dim;                                                                         \
        (void)queue;                                                                            \
        hybrid_pipe<T, D, SPMM, HAS_CD>(units, split_part_first, n_items, heads, n_rows,        \
                                        tc_warps, row_ids, block_columns, bitmaps, tc_weights,  \
                                        cd_row_offsets, cd_columns, cd_weights, q, k, v,        \
                                        scale_log2, out, part_ml, part_acc, counters);          \
    }
// The attention twins with extras: `_pipe_x` and `_pipe_tc_x`.
#define SPATTN_HYBRID_PIPE_X(SUFFIX, T, D, HAS_CD, TAIL, WARPS)                                 \
    extern "C" __global__ void __launch_bounds__(32 * (WARPS))                                  \
        fused_hybrid_##SUFFIX##_d##D##_pipe##TAIL##_x(SPATTN_HYBRID_PARAMS(T),                  \
                                                      SPATTN_HYBRID_X_PARAMS(T)) {              \
        (void)head_dim;                                                                         \
        (void)queue;                                                                            \
        SPATTN_HYBRID_X_ARGS(T);                                                                \
        hybrid_pipe<T, D, false, HAS_CD, true>(units, split_part_first, n_items, heads, n_rows, \
                                               tc_warps, row_ids, block_columns, bitmaps,       \
                                               tc_weights, cd_row_offsets, cd_columns,          \
                                               cd_weights, q, k, v, scale_log2, out, part_ml,   \
                                               part_acc, counters, &xa);                        \
    }
#define SPATTN_HYBRID_PIPE(SUFFIX, T, D)                                                        \
    SPATTN_HYBRID_PIPE_X(SUFFIX, T, D, true, , HYB_PIPE_MAX_TC + 1)                             \
    SPATTN_HYBRID_PIPE_X(SUFFIX, T, D, false, _tc, HYB_PIPE_MAX_TC)                             \
    SPATTN_HYBRID_PIPE_OP(fused, false, SUFFIX, T, D, true, , HYB_PIPE_MAX_TC + 1)              \
    SPATTN_HYBRID_PIPE_OP(spmm, true, SUFFIX, T, D, true, , HYB_PIPE_MAX_TC + 1)                \
    SPATTN_HYBRID_PIPE_OP(fused, false, SUFFIX, T, D, false, _tc, HYB_PIPE_MAX_TC)              \
    SPATTN_HYBRID_PIPE_OP(spmm, true, SUFFIX, T, D, false, _tc, HYB_PIPE_MAX_TC)

SPATTN_HYBRID_PIPE(f16, __half, 64)
SPATTN_HYBRID_PIPE(f16, __half, 128)
SPATTN_HYBRID_PIPE(bf16, __nv_bfloat16, 64)
SPATTN_HYBRID_PIPE(bf16, __nv_bfloat16, 128)
