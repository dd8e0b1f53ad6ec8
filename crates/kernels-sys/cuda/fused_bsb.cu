// Fused attention on BSB, tensor cores (Fused3S style):
//   out = softmax_row(scale * Q K^T masked by A) V
// in one pass over each 16-row window's 16x8 blocks, FlashAttention-2 style: S = Q K^T of two
// blocks (16 rows x 16 columns) by mma.sync, masked by the blocks' u128 bitmaps to -inf, an
// online softmax (running max from -inf, running sum, f32 accumulator), and P V by mma.sync with
// P taken straight from S's accumulator registers. No score reaches device memory.
//
// Work: an item is (unit, head); a unit is a range of blocks of one window (host schedule,
// largest first). An item is taken by a group of `fs` warps; warp w of the group owns features
// [w*DS, (w+1)*DS) of the head. Each warp computes the partial S over its features, the group
// sums the partials through shared memory (same order in every warp, so all warps hold the
// same S, bit for bit, and the same softmax state), and each warp multiplies P by its slice of
// V. A CTA holds `groups` groups, synchronised by named barriers (id 1 + group).
//
// Rows may be renumbered by the plan (a locality or degree order, so that a window's rows share
// columns): window row r is then the caller's row row_ids[16 * window + r], through which Q is
// loaded and out stored; column ids (K, V) are always the caller's. row_ids null: no renumbering.
//
// Windows with more blocks than the host's chunk are split into several units; each leaves an
// exact partial (max, sum, f32 accumulator) per row and head, and the last unit of a window to
// finish (an atomic counter per split window and head) merges them and writes the rows.
//
// Register layouts (g = lane / 4, t = lane % 4; see mma.cuh):
// - SDDMM, f16/bf16: lane t of a group loads 16 bytes = 8 features (8t .. 8t+8 of a 32-feature
//   chunk) of a Q or K row; words 0, 1 feed k-step 0 (a[0]/a[2] or b[0]/b[1]), words 2, 3 k-step
//   1. The contraction over features is a sum, so any feature order shared by Q and K is right.
//   f32 (tf32 m16n8k8, run as 3xTF32 so scores keep f32 accuracy): 4 features per lane, 16 per
//   chunk, the same word roles.
// - S accumulator: c[0], c[1] = S[g][2t, 2t+1], c[2], c[3] = S[g+8][2t, 2t+1]; column n of a
//   block is slot n, whose K row lanes of group g = n loaded.
// - P V, f16/bf16 (m16n8k16): A = the S registers of the two blocks (k = slot of block 0, then of
//   block 1). B[k][n] = V[slot k][feature phi(nt, n)] with phi(nt, n) = base + n*D8 + nt: lane
//   (g, t) loads features base + g*D8 .. + D8 of the V rows of slots 2t, 2t+1 of both blocks,
//   and byte-permutes pairs into b registers. f32 (tf32 m16n8k8, one mma per block): k = t is
//   slot 2t and k = t+4 slot 2t+1, matching the S registers as they are.
// - O accumulator: o[nt][0], o[nt][1] = O[g][phi(nt, 2t)], O[g][phi(nt, 2t+1)]; over nt these
//   are D8 consecutive features (base + 2t*D8 + nt, base + (2t+1)*D8 + nt): vector stores.

#include "attention_tiles.cuh"

// Every kernel has an `_x` twin that also takes a score bias and dropout (BsbExtras,
// attention_tiles.cuh; the pipelined kernels three, `_xb` bias, `_xd` dropout and `_x` both,
// BsbStagedExtras), gathered before the launch from the caller's CSR order by
// bsb_bias_gather_* and bsb_keep_gather (below): the bias joins each score in the log2 domain
// before the running max, and the dropout factor weighs P V but not the running sum, so the
// split windows' partials merge as they are.

template <class T, int DS, bool PIPE, bool EXTRAS>
__device__ __forceinline__ void fused_bsb(
    const uint4* __restrict__ units, const u32* __restrict__ unit_split,
    const u32* __restrict__ split_part_first, u32 n_items, u32 heads, u32 head_dim, u32 fs,
    u32 n_rows, const u32* __restrict__ row_ids, const u32* __restrict__ block_columns,
    const u32* __restrict__ bitmaps, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, float scale_log2,
    T* __restrict__ out, float* __restrict__ lse, float* __restrict__ part_ml,
    float* __restrict__ part_acc, u32* __restrict__ counters, const BsbExtrasArgs* xa) {
    constexpr int D8 = DS / 8;  // n-tiles of P V = features per lane per V row

    extern __shared__ float bsb_smem[];
    const u32 lane = lane_id(), warp = threadIdx.x >> 5;
    const u32 grp = warp / fs, wig = warp - grp * fs;
    const u32 groups = (blockDim.x >> 5) / fs;
    const u32 item = blockIdx.x * groups + grp;
    if (item >= n_items) return;  // the whole group leaves together
    const u32 gsize = fs * 32u, gt = wig * 32u + lane, bar = grp + 1u;
    const u32 xs_floats = fs > 1u ? 2u * fs * 256u : 0u;
    float* xs = bsb_smem + grp * (xs_floats + BSB_MERGE_FLOATS);
    float* mrg = xs + xs_floats;

    const u32 u = item / heads, h = item - u * heads;
    const uint4 un = units[u];
    const u32 window = un.x, b_begin = un.y, b_end = un.z, part = un.w;
    const u32 g = lane >> 2, t = lane & 3u;
    const u32 d = head_dim, base = wig * DS;
    const u64 hd = (u64)heads * head_dim, head_off = (u64)h * head_dim;
    const u32 row0 = window * BSB_WINDOW_ROWS + g, row1 = row0 + 8u;
    // The caller's row (Q, out) of window rows g and g + 8: through row_ids when the plan
    // renumbered the rows, else the row itself; SPATTN_NONE past the matrix.
    auto q_row = [&](u32 row) { return row >= n_rows ? SPATTN_NONE : caller_row(row_ids, row); };
    const u32 qrow[2] = {q_row(row0), q_row(row1)};

    float m[2], l[2], o[D8][4];
    bsb_tiles<T, DS, PIPE, false>(qrow[0], qrow[1], q, block_columns, bitmaps, nullptr, 0u,
                                  b_begin, b_end, 2u, k, v, hd, head_off, d, base, scale_log2,
                                  fs, wig, bar, gsize, xs, m, l, o,
                                  bsb_extras_or_none<EXTRAS>(xa, h));

    if (part == SPATTN_NONE) {
        // The whole window: normalise and write (a row without edges has l = 0: zeros; a NaN
        // score's row stays NaN).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (qrow[r] != SPATTN_NONE) {
                const float inv = softmax_inv(l[r]);
                if (lse != nullptr && wig == 0u && t == 0u)
                    lse[(u64)qrow[r] * heads + h] = softmax_lse2(m[r], l[r]);
                T* orow = out + (u64)qrow[r] * hd + head_off;
                float y[D8];
#pragma unroll
                for (int nt = 0; nt < D8; ++nt) y[nt] = o[nt][2 * r] * inv;
                bsb_store<T, D8>(orow, base + 2u * t * D8, d, y);
#pragma unroll
                for (int nt = 0; nt < D8; ++nt) y[nt] = o[nt][2 * r + 1] * inv;
                bsb_store<T, D8>(orow, base + (2u * t + 1u) * D8, d, y);
            }
        }
        return;
    }

    // A part of a split window: leave (m, l, acc) for rows g, g+8 (all 16 rows, features
    // [base, base + DS) of this warp), then the last part to arrive merges.
    const u32 dp = fs * DS;
    const u64 slot = (u64)part * heads + h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32 wr = g + 8u * r;
        if (wig == 0u && t == 0u) {
            part_ml[(slot * BSB_WINDOW_ROWS + wr) * 2u] = m[r];
            part_ml[(slot * BSB_WINDOW_ROWS + wr) * 2u + 1u] = l[r];
        }
        float* arow = part_acc + (slot * BSB_WINDOW_ROWS + wr) * dp + base;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float4* dst = reinterpret_cast<float4*>(arow + (2u * t + half) * D8);
#pragma unroll
            for (int c = 0; c < D8 / 4; ++c)
                dst[c] = make_float4(o[4 * c][2 * r + half], o[4 * c + 1][2 * r + half],
                                     o[4 * c + 2][2 * r + half], o[4 * c + 3][2 * r + half]);
        }
    }
    bsb_finish_split<T, D8>(unit_split[u], split_part_first, counters, heads, h, dp, gt,
                                 gsize, bar, mrg, part_ml, part_acc, n_rows, window, row_ids, out,
                                 lse, hd, head_off, d);
}

// The parameters every fused_bsb kernel takes (its `_x` twin: SPATTN_BSB_X_PARAMS after them).
#define SPATTN_BSB_PARAMS(T)                                                                   \
    const uint4 *units, const u32 *unit_split, const u32 *split_part_first, u32 n_items,       \
        u32 heads, u32 head_dim, u32 fs, u32 n_rows, const u32 *row_ids, const u32 *unit_pre,  \
        const u32 *block_columns, const u32 *bitmaps, const T *q, const T *k, const T *v,      \
        float scale_log2, T *out, float *lse, float *part_ml, float *part_acc, u32 *counters

// Rows of whole 16-byte vectors only: the host pads heads of other lengths with zeros
// (resize_rows, rows.cu). Only the 128-feature slice prefetches the next step's K rows (PIPE):
// narrower slices would pay for its registers in warps per SM.
#define SPATTN_FUSED_BSB(SUFFIX, T, DS)                                                        \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        fused_bsb_##SUFFIX##_s##DS(SPATTN_BSB_PARAMS(T)) {                                     \
        (void)unit_pre;                                                                        \
        fused_bsb<T, DS, DS == 128, false>(units, unit_split, split_part_first, n_items,       \
                                           heads, head_dim, fs, n_rows, row_ids,               \
                                           block_columns, bitmaps, q, k, v, scale_log2, out,   \
                                           lse, part_ml, part_acc, counters, nullptr);         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) fused_bsb_##SUFFIX##_s##DS##_x(          \
        SPATTN_BSB_PARAMS(T), SPATTN_BSB_X_PARAMS) {                                           \
        (void)unit_pre;                                                                        \
        const BsbExtrasArgs xa = SPATTN_BSB_X_ARGS;                                            \
        fused_bsb<T, DS, DS == 128, true>(units, unit_split, split_part_first, n_items, heads, \
                                          head_dim, fs, n_rows, row_ids, block_columns,        \
                                          bitmaps, q, k, v, scale_log2, out, nullptr,          \
                                          part_ml, part_acc, counters, &xa);                   \
    }

SPATTN_FUSED_BSB(f16, __half, 32)
SPATTN_FUSED_BSB(f16, __half, 64)
SPATTN_FUSED_BSB(f16, __half, 128)
SPATTN_FUSED_BSB(bf16, __nv_bfloat16, 32)
SPATTN_FUSED_BSB(bf16, __nv_bfloat16, 64)
SPATTN_FUSED_BSB(bf16, __nv_bfloat16, 128)
SPATTN_FUSED_BSB(f32, float, 32)
SPATTN_FUSED_BSB(f32, float, 64)

// ---- the pipelined kernel: K and V tiles through shared memory --------------------------------
// One warp per (unit, head), f16/bf16 heads of exactly 64 or 128 features: the tile loop is
// bsb_pipe_tiles (attention_tiles.cuh, with the shared-memory layout and fragments), the end of
// the unit bsb_pipe_finish.
template <class T, int D, int XMODE, bool FEATS = false>
__device__ __forceinline__ void fused_bsb_pipe(
    const uint4* __restrict__ units, const u32* __restrict__ unit_split,
    const u32* __restrict__ split_part_first, u32 n_items, u32 heads, u32 n_rows,
    const u32* __restrict__ row_ids, const u32* __restrict__ unit_pre,
    const u32* __restrict__ block_columns,
    const u32* __restrict__ bitmaps, const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, float scale_log2, T* __restrict__ out, float* __restrict__ lse,
    float* __restrict__ part_ml, float* __restrict__ part_acc, u32* __restrict__ counters,
    const BsbExtrasArgs* xa, const T* __restrict__ feats = nullptr,
    const u32* __restrict__ edge_ids = nullptr) {
    // The extras: none or staged (XMODE), or with edge features BsbFeatExtras (a bias and
    // dropout read as the register kernels read them, the features' rows staged).
    using X = typename BsbPick<FEATS, BsbFeatExtras<T>,
                               decltype(bsb_staged_extras_or_none<XMODE>(xa, 0u))>::type;
    constexpr u32 XB = bsb_pipe_extra_bytes<X>(D);
    extern __shared__ uint4 bsb_pipe_smem[];
    const u32 warp = threadIdx.x >> 5;
    const u32 item = blockIdx.x * (blockDim.x >> 5) + warp;
    if (item >= n_items) return;  // uniform across the warp
    unsigned char* smem = reinterpret_cast<unsigned char*>(bsb_pipe_smem) +
                          warp * bsb_pipe_feat_warp_bytes(D, XB, FEATS);

    const u32 u = item / heads, h = item - u * heads;
    // D 128: the unit's descriptor and its prologue record, loaded together, so that the first
    // copies and the Q loads depend on the record only. (D 64, where the record measured
    // slower, loads the column and row ids after the descriptor; docs/kernels/fused-tc.md.)
    constexpr bool PRE = D == 128;
    u32 col01 = 0u, qrow[2];
    if constexpr (PRE) {
        const u32* pre = unit_pre + (u64)u * BSB_PIPE_PRE_WORDS;
        const u32 lane = lane_id();
        col01 = __ldg(pre + lane);
        qrow[0] = __ldg(pre + 32u + (lane >> 2));
        qrow[1] = __ldg(pre + 40u + (lane >> 2));
    }
    const uint4 un = units[u];
    const u32 window = un.x, part = un.w;
    const u64 hd = (u64)heads * D, head_off = (u64)h * D;
    if constexpr (!PRE) bsb_pipe_qrows(row_ids, window, n_rows, qrow);
    float m[2], l[2], o[D / 8][4];
    X xt;
    if constexpr (FEATS) {
        // The features' scratch (val, tab, then the tile of chunks past a step's first) after
        // the warp's stages and merge scratch.
        xt = make_bsb_feat_extras<T>(*xa, h, feats, edge_ids,
                                     smem + bsb_pipe_warp_bytes(D, false, XB));
    } else {
        xt = bsb_staged_extras_or_none<XMODE>(xa, h);
    }
    bsb_pipe_tiles<T, D, false, PRE>(smem, un.y, un.z, qrow, q, block_columns, bitmaps, k, v, hd,
                                     head_off, scale_log2, nullptr, 0u, m, l, o, col01, xt);
    bsb_pipe_finish<T, D, false, XB>(part, part == SPATTN_NONE ? 0u : unit_split[u],
                                         split_part_first, counters, heads, h, smem, part_ml,
                                         part_acc, n_rows, window, row_ids, out, lse, hd,
                                         head_off, qrow, m, l, o);
}

// Entry points fused_bsb_{f16,bf16}_d{64,128}_pipe: fused_bsb's parameters (head_dim must be D,
// fs 1), unit_pre the units' prologue records for D 128 (BSB_PIPE_PRE_WORDS words each, built by
// the host from the schedule, the block columns and the row order; null for D 64 and the
// register kernels, which do not read it). Only the `_lse` twins write lse (a null lse in
// the plain kernel measured 5% slower on R-MAT 16 at 8 x 64), at D 64 alone: the row
// statistics feed the tensor-core backward, which holds heads up to 64. Their extras twins:
// `_xb` (a bias), `_xd` (dropout), `_x` (both); each reads only the extras it takes, none
// writes lse.
#define SPATTN_FUSED_BSB_PIPE_X(SUFFIX, T, D, XNAME, XMODE)                                   \
    extern "C" __global__ void __launch_bounds__(128) fused_bsb_##SUFFIX##_d##D##_pipe##XNAME( \
        SPATTN_BSB_PARAMS(T), SPATTN_BSB_X_PARAMS) {                                           \
        (void)head_dim;                                                                        \
        (void)fs;                                                                              \
        const BsbExtrasArgs xa = SPATTN_BSB_X_ARGS;                                            \
        fused_bsb_pipe<T, D, XMODE>(units, unit_split, split_part_first, n_items, heads,       \
                                    n_rows, row_ids, unit_pre, block_columns, bitmaps, q, k,   \
                                    v, scale_log2, out, nullptr, part_ml, part_acc, counters,  \
                                    &xa);                                                      \
    }
#define SPATTN_FUSED_BSB_PIPE_L(SUFFIX, T, D, LNAME, LSE)                                     \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        fused_bsb_##SUFFIX##_d##D##_pipe##LNAME(SPATTN_BSB_PARAMS(T)) {                        \
        (void)head_dim;                                                                        \
        (void)lse;                                                                             \
        (void)fs;                                                                              \
        fused_bsb_pipe<T, D, 0>(units, unit_split, split_part_first, n_items, heads, n_rows,   \
                                row_ids, unit_pre, block_columns, bitmaps, q, k, v,            \
                                scale_log2, out, LSE, part_ml, part_acc, counters, nullptr);   \
    }
#define SPATTN_FUSED_BSB_PIPE(SUFFIX, T, D)                                                    \
    SPATTN_FUSED_BSB_PIPE_L(SUFFIX, T, D, , nullptr)                                           \
    SPATTN_FUSED_BSB_PIPE_X(SUFFIX, T, D, _xb, 1)                                              \
    SPATTN_FUSED_BSB_PIPE_X(SUFFIX, T, D, _xd, 2)                                              \
    SPATTN_FUSED_BSB_PIPE_X(SUFFIX, T, D, _x, 3)

// Entry points fused_bsb_{f16,bf16}_d{64,128}_pipe_xf: the pipelined kernels with edge
// features (and a bias and / or dropout, each may be absent): SPATTN_BSB_X_PARAMS, then feats
// the caller's nnz x heads x D features and edge_ids per kernel edge its caller edge
// (OrderedBsb::edge_map); shared memory bsb_pipe_feat_warp_bytes(D, bsb_pipe_extra_bytes, true)
// a warp.
#define SPATTN_FUSED_BSB_PIPE_XF(SUFFIX, T, D)                                                 \
    extern "C" __global__ void __launch_bounds__(128) fused_bsb_##SUFFIX##_d##D##_pipe_xf(     \
        SPATTN_BSB_PARAMS(T), SPATTN_BSB_X_PARAMS, const T *feats, const u32 *edge_ids) {      \
        (void)head_dim;                                                                        \
        (void)lse;                                                                             \
        (void)fs;                                                                              \
        const BsbExtrasArgs xa = SPATTN_BSB_X_ARGS;                                            \
        fused_bsb_pipe<T, D, 0, true>(units, unit_split, split_part_first, n_items, heads,     \
                                      n_rows, row_ids, unit_pre, block_columns, bitmaps, q, k, \
                                      v, scale_log2, out, nullptr, part_ml, part_acc,          \
                                      counters, &xa, feats, edge_ids);                         \
    }

SPATTN_FUSED_BSB_PIPE(f16, __half, 64)
SPATTN_FUSED_BSB_PIPE_XF(f16, __half, 64)
SPATTN_FUSED_BSB_PIPE_XF(f16, __half, 128)
SPATTN_FUSED_BSB_PIPE_XF(bf16, __nv_bfloat16, 64)
SPATTN_FUSED_BSB_PIPE_XF(bf16, __nv_bfloat16, 128)
SPATTN_FUSED_BSB_PIPE_L(f16, __half, 64, _lse, lse)
SPATTN_FUSED_BSB_PIPE(f16, __half, 128)
SPATTN_FUSED_BSB_PIPE(bf16, __nv_bfloat16, 64)
SPATTN_FUSED_BSB_PIPE_L(bf16, __nv_bfloat16, 64, _lse, lse)
SPATTN_FUSED_BSB_PIPE(bf16, __nv_bfloat16, 128)

// Entry points bsb_bias_gather_{f32,f16,bf16} (grid ceil(n / 256) blocks of 256) and
// bsb_keep_gather (ceil(n_blocks / BSB_KEEP_GROUP) CTAs of 256): the gathers
// (attention_tiles.cuh) before the `_x` kernels of this module and of hybrid's tensor-core warps.
#define SPATTN_BSB_BIAS_GATHER(SUFFIX, T)                                                      \
    extern "C" __global__ void __launch_bounds__(256) bsb_bias_gather_##SUFFIX(                \
        const u32* ids, u32 n, const T* bias, u32 bias_heads, float* bias_out) {               \
        bsb_bias_gather<T>(ids, n, bias, bias_heads, bias_out);                                \
    }
SPATTN_BSB_BIAS_GATHER(f32, float)
SPATTN_BSB_BIAS_GATHER(f16, __half)
SPATTN_BSB_BIAS_GATHER(bf16, __nv_bfloat16)

extern "C" __global__ void __launch_bounds__(256)
    bsb_keep_gather(const u32* ids, u32 n, const u32* bitmaps, const u32* block_edge_start,
                    u32 n_blocks, u32 heads, u32 key0, u32 key1, u32 off0, u32 off1,
                    u32 threshold, float drop_scale, u32* keep_out) {
    bsb_keep_gather(ids, n, bitmaps, block_edge_start, n_blocks, heads,
                    {key0, key1, off0, off1, threshold, drop_scale}, keep_out);
}
