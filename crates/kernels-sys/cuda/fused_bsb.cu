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

template <class T, int DS, bool VEC, bool PIPE>
__device__ __forceinline__ void fused_bsb(
    const uint4* __restrict__ units, const u32* __restrict__ unit_split,
    const u32* __restrict__ split_part_first, u32 n_items, u32 heads, u32 head_dim, u32 fs,
    u32 n_rows, const u32* __restrict__ row_ids, const u32* __restrict__ block_columns,
    const u32* __restrict__ bitmaps, const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, float scale_log2,
    T* __restrict__ out, float* __restrict__ part_ml, float* __restrict__ part_acc,
    u32* __restrict__ counters) {
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
    bsb_tiles<T, DS, VEC, PIPE, false>(qrow[0], qrow[1], q, block_columns,
                                       bitmaps, nullptr, 0u, b_begin, b_end, 2u, k, v, hd,
                                       head_off, d, base, scale_log2, fs, wig, bar, gsize, xs, m,
                                       l, o);

    if (part == SPATTN_NONE) {
        // The whole window: normalise and write (a row without edges has l = 0: zeros).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (qrow[r] != SPATTN_NONE) {
                const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
                T* orow = out + (u64)qrow[r] * hd + head_off;
                float y[D8];
#pragma unroll
                for (int nt = 0; nt < D8; ++nt) y[nt] = o[nt][2 * r] * inv;
                bsb_store<T, D8, VEC>(orow, base + 2u * t * D8, d, y);
#pragma unroll
                for (int nt = 0; nt < D8; ++nt) y[nt] = o[nt][2 * r + 1] * inv;
                bsb_store<T, D8, VEC>(orow, base + (2u * t + 1u) * D8, d, y);
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
    bsb_finish_split<T, D8, VEC>(unit_split[u], split_part_first, counters, heads, h, dp, gt,
                                 gsize, bar, mrg, part_ml, part_acc, n_rows, window, row_ids, out,
                                 hd, head_off, d);
}

#define SPATTN_FUSED_BSB(SUFFIX, T, DS, NAME, VEC, PIPE)                                       \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        fused_bsb_##SUFFIX##_s##DS##NAME(                                                      \
            const uint4* units, const u32* unit_split, const u32* split_part_first,            \
            u32 n_items, u32 heads, u32 head_dim, u32 fs, u32 n_rows, const u32* row_ids,      \
            const u32* block_columns, const u32* bitmaps, const T* q, const T* k, const T* v,  \
            float scale_log2, T* out, float* part_ml, float* part_acc, u32* counters) {        \
        fused_bsb<T, DS, VEC, PIPE>(units, unit_split, split_part_first, n_items, heads,       \
                                    head_dim, fs, n_rows, row_ids, block_columns, bitmaps, q,  \
                                    k, v, scale_log2, out, part_ml, part_acc, counters);       \
    }

// The 128-feature slice is software-pipelined (measured a little faster on H100); the narrower
// slices are not (the pipeline's registers cost them warps per SM: slower), nor are
// element-wise rows (head_dim * sizeof(T) not a multiple of 16: their scalar loads would spill).
#define SPATTN_FUSED_BSB_BOTH(SUFFIX, T, DS)                                                   \
    SPATTN_FUSED_BSB(SUFFIX, T, DS, , true, DS == 128)                                         \
    SPATTN_FUSED_BSB(SUFFIX, T, DS, _scalar, false, false)

SPATTN_FUSED_BSB_BOTH(f16, __half, 32)
SPATTN_FUSED_BSB_BOTH(f16, __half, 64)
SPATTN_FUSED_BSB_BOTH(f16, __half, 128)
SPATTN_FUSED_BSB_BOTH(bf16, __nv_bfloat16, 32)
SPATTN_FUSED_BSB_BOTH(bf16, __nv_bfloat16, 64)
SPATTN_FUSED_BSB_BOTH(bf16, __nv_bfloat16, 128)
SPATTN_FUSED_BSB_BOTH(f32, float, 32)
SPATTN_FUSED_BSB_BOTH(f32, float, 64)

// ---- the pipelined kernel: K and V tiles through shared memory --------------------------------
// f16/bf16 heads of exactly D features (64 or 128), one warp per (unit, head). The registers of
// fused_bsb's 128-feature slice hold the K rows of the next step and the V rows of this one in
// flight (255 registers under the CUDA 13 JIT: one or two warps per scheduler). Here cp.async
// copies each step's 16 K rows, 16 V rows and two bitmaps into shared memory, STAGES steps
// ahead, and the warp reads them with ldmatrix: registers hold only the Q fragments, the f32
// accumulator and one step's scores.
//
// Per warp and stage (bsb_pipe_stage_bytes, mirrored by the host): the K tile (16 slots x D
// features: slot r's 16-byte chunk c stored at chunk c ^ (r & 7) of its row, so that the 8 rows
// one ldmatrix reads fall in 8 different bank groups), the V tile (same layout), and the 32
// bytes of the two blocks' bitmaps. After the stages: the warp's BSB_MERGE_FLOATS of merge
// scratch.
//
// Fragments, natural feature order (g = lane / 4, t = lane % 4):
// - Q (A of S = Q K^T, k-step ks): a[0] = Q[g][16ks + 2t, +1], a[1] = the same of row g + 8,
//   a[2], a[3] the same at feature + 8. Loaded once, 4 bytes at a time.
// - K (B, col): ldmatrix of the block's 8 slot rows, chunks 2ks and 2ks + 1.
// - V (B of P V, k = 16 slots, n-tile nt = features 8nt .. 8nt + 7): ldmatrix.trans.
// - O: o[nt][0], o[nt][1] = O[g][8nt + 2t, +1]; o[nt][2], o[nt][3] the same of row g + 8.
__host__ __device__ constexpr u32 bsb_pipe_stage_bytes(u32 d) { return 2u * 16u * d * 2u + 32u; }

template <class T, int D, int STAGES>
__device__ __forceinline__ void fused_bsb_pipe(
    const uint4* __restrict__ units, const u32* __restrict__ unit_split,
    const u32* __restrict__ split_part_first, u32 n_items, u32 heads, u32 n_rows,
    const u32* __restrict__ row_ids, const u32* __restrict__ block_columns,
    const u32* __restrict__ bitmaps, const T* __restrict__ q, const T* __restrict__ k,
    const T* __restrict__ v, float scale_log2, T* __restrict__ out, float* __restrict__ part_ml,
    float* __restrict__ part_acc, u32* __restrict__ counters) {
    static_assert(sizeof(T) == 2 && (D == 64 || D == 128), "f16 / bf16, 64 or 128 features");
    constexpr u32 CH = D / 8;               // 16-byte chunks of a row
    constexpr u32 ROW = CH * 16u;           // bytes of a row
    constexpr u32 TILE = 16u * ROW;         // bytes of the K (or V) tile of one step
    constexpr u32 STAGE = bsb_pipe_stage_bytes(D);
    constexpr u32 RPO = 32u / CH;           // rows one warp-wide copy covers
    constexpr int NKS = D / 16;             // k-steps of S
    constexpr int NT = D / 8;               // n-tiles of O
    constexpr u32 WARP_BYTES = STAGES * STAGE + BSB_MERGE_FLOATS * 4u;
    static_assert(STAGE == 2u * TILE + 32u, "stage layout");
    extern __shared__ uint4 bsb_pipe_smem[];

    const u32 lane = lane_id(), warp = threadIdx.x >> 5;
    const u32 item = blockIdx.x * (blockDim.x >> 5) + warp;
    if (item >= n_items) return;  // uniform across the warp
    unsigned char* base = reinterpret_cast<unsigned char*>(bsb_pipe_smem) + warp * WARP_BYTES;
    const u32 base_s = smem_addr(base);
    float* mrg = reinterpret_cast<float*>(base + STAGES * STAGE);

    const u32 u = item / heads, h = item - u * heads;
    const uint4 un = units[u];
    const u32 window = un.x, b_begin = un.y, b_end = un.z, part = un.w;
    const u32 steps = (b_end - b_begin + 1u) / 2u;
    const u32 g = lane >> 2, t = lane & 3u;
    const u64 hd = (u64)heads * D, head_off = (u64)h * D;
    const u32 row0 = window * BSB_WINDOW_ROWS + g;
    const u32 qrow[2] = {row0 < n_rows ? caller_row(row_ids, row0) : SPATTN_NONE,
                         row0 + 8u < n_rows ? caller_row(row_ids, row0 + 8u) : SPATTN_NONE};

    // Column of slot lane % 16 of step s (block b_begin + 2s + slot / 8); none past the unit.
    auto cols_of = [&](u32 s) -> u32 {
        const u32 blk = b_begin + 2u * s + ((lane >> 3) & 1u);
        return (s < steps && blk < b_end) ? __ldg(block_columns + (u64)blk * 8u + (lane & 7u))
                                          : SPATTN_NONE;
    };
    // The copies of step s (its columns in col, lane l < 16 holding slot l) into stage
    // s % STAGES, then a commit (an empty group past the last step keeps the count uniform).
    const u32 cc = lane % CH, rr = lane / CH;  // this lane's chunk, and first slot, of the copies
    auto issue = [&](u32 s, u32 col) {
        if (s < steps) {
            const u32 sk = base_s + (s % STAGES) * STAGE;
#pragma unroll
            for (u32 i = 0; i < 16u / RPO; ++i) {
                const u32 r = rr + RPO * i;
                const u32 cr = __shfl_sync(0xffffffffu, col, r);
                const bool ok = cr != SPATTN_NONE;
                const u64 off = ok ? (u64)cr * hd + head_off + cc * 8u : 0u;
                const u32 dst = r * ROW + ((cc ^ (r & 7u)) * 16u);
                cp_async_16(sk + dst, k + off, ok);
                cp_async_16(sk + TILE + dst, v + off, ok);
            }
            if (lane < 2u) {
                const u32 blk = b_begin + 2u * s + lane;
                const bool ok = blk < b_end;
                cp_async_16(sk + 2u * TILE + 16u * lane, bitmaps + (ok ? (u64)blk * 4u : 0u), ok);
            }
        }
        cp_async_commit();
    };

    // Q fragments (4-byte loads; zeros for rows past the matrix). Q is read once and out written
    // once: both streaming (evict first), so that L2 keeps the K and V rows that windows share.
    u32 qf[NKS][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32* qr = reinterpret_cast<const u32*>(
            q + (qrow[r] != SPATTN_NONE ? (u64)qrow[r] * hd + head_off : 0u));
#pragma unroll
        for (int ks = 0; ks < NKS; ++ks)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                qf[ks][r + 2 * half] =
                    qrow[r] != SPATTN_NONE ? __ldcs(qr + 8 * ks + 4 * half + t) : 0u;
    }

    // Prologue: steps 0 .. STAGES - 2 in flight, the columns of step STAGES - 1 loaded.
    u32 col_next = cols_of(0u);
#pragma unroll
    for (u32 s = 0; s + 1u < (u32)STAGES; ++s) {
        const u32 c = col_next;
        col_next = cols_of(s + 1u);
        issue(s, c);
    }

    float m[2] = {SPATTN_NEG_INF, SPATTN_NEG_INF}, l[2] = {0.0f, 0.0f}, o[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    const u32 shift = 8u * (g & 3u) + 2u * t, upper = g >= 4u ? 1u : 0u;
    // ldmatrix roles: matrix mq = lane / 8, its row lane % 8.
    const u32 mq = lane >> 3, mr = lane & 7u;

    for (u32 i = 0; i < steps; ++i) {
        cp_async_wait<STAGES - 2>();
        __syncwarp();  // step i's copies by every lane are visible; step i - 1 is read
        {
            const u32 c = col_next;
            col_next = cols_of(i + STAGES);
            issue(i + STAGES - 1u, c);
        }
        const u32 st = i % STAGES;
        const u32 sk = base_s + st * STAGE, sv = sk + TILE;
        const u32* bw = reinterpret_cast<const u32*>(base + st * STAGE + 2u * TILE);

        // S = Q K^T of the two blocks, two accumulators per block.
        float s[2][4];
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
            float sa[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
            const u32 row = sk + (bb * 8u + mr) * ROW;
#pragma unroll
            for (int kk = 0; kk < NKS / 2; ++kk) {
                u32 r[4];
                ldmatrix_x4(r, row + (((4u * kk + mq) ^ mr) * 16u));
                const u32 b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
                mma_m16n8k16(sa[0], qf[2 * kk], b0, T());
                mma_m16n8k16(sa[1], qf[2 * kk + 1], b1, T());
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) s[bb][j] = sa[0][j] + sa[1][j];
        }
        const u32 bits[2][2] = {{bw[upper], bw[2u + upper]}, {bw[4u + upper], bw[6u + upper]}};
        float p[2][4];
        bsb_online_step<NT>(s, bits, shift, scale_log2, m, l, p, o);

        // O += P V: A = P of the 16 slots, B = V from the tile, transposed by ldmatrix.
        const u32 a[4] = {pack2<T>(p[0][0], p[0][1]), pack2<T>(p[0][2], p[0][3]),
                          pack2<T>(p[1][0], p[1][1]), pack2<T>(p[1][2], p[1][3])};
        const u32 vrow = sv + (((mq & 1u) << 3) + mr) * ROW;
#pragma unroll
        for (int j = 0; j < NT / 2; ++j) {
            u32 r[4];
            ldmatrix_x4_trans(r, vrow + (((2u * j + (mq >> 1)) ^ mr) * 16u));
            const u32 b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
            mma_m16n8k16(o[2 * j], a, b0, T());
            mma_m16n8k16(o[2 * j + 1], a, b1, T());
        }
    }
    cp_async_wait<0>();  // no copy may land in shared memory after the warp leaves

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }

    if (part == SPATTN_NONE) {
        // The whole window: normalise and write (a row without edges has l = 0: zeros).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (qrow[r] == SPATTN_NONE) continue;
            const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
            u32* orow = reinterpret_cast<u32*>(out + (u64)qrow[r] * hd + head_off);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                __stcs(orow + 4 * nt + t, pack2<T>(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv));
        }
        return;
    }

    // A part of a split window: (m, l) and the accumulator of rows g, g + 8, then the merge.
    const u64 slot = (u64)part * heads + h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u64 wr = slot * BSB_WINDOW_ROWS + g + 8u * r;
        if (t == 0u) {
            part_ml[wr * 2u] = m[r];
            part_ml[wr * 2u + 1u] = l[r];
        }
        float2* arow = reinterpret_cast<float2*>(part_acc + wr * D);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) arow[4 * nt + t] = make_float2(o[nt][2 * r], o[nt][2 * r + 1]);
    }
    bsb_finish_split<T, NT, true>(unit_split[u], split_part_first, counters, heads, h, D, lane,
                                  32u, 0u, mrg, part_ml, part_acc, n_rows, window, row_ids, out,
                                  hd, head_off, D);
}

// Entry points fused_bsb_{f16,bf16}_d{64,128}_pipe: fused_bsb's parameters (head_dim must be D,
// fs 1).
#define SPATTN_FUSED_BSB_PIPE(SUFFIX, T, D)                                                    \
    extern "C" __global__ void __launch_bounds__(128) fused_bsb_##SUFFIX##_d##D##_pipe(        \
        const uint4* units, const u32* unit_split, const u32* split_part_first, u32 n_items,   \
        u32 heads, u32 head_dim, u32 fs, u32 n_rows, const u32* row_ids,                       \
        const u32* block_columns, const u32* bitmaps, const T* q, const T* k, const T* v,      \
        float scale_log2, T* out, float* part_ml, float* part_acc, u32* counters) {            \
        (void)head_dim;                                                                        \
        (void)fs;                                                                              \
        fused_bsb_pipe<T, D, BSB_PIPE_STAGES>(units, unit_split, split_part_first, n_items,    \
                                              heads, n_rows, row_ids, block_columns, bitmaps,  \
                                              q, k, v, scale_log2, out, part_ml, part_acc,     \
                                              counters);                                       \
    }

// Steps in flight per warp (the host mirrors it).
#define BSB_PIPE_STAGES 3
SPATTN_FUSED_BSB_PIPE(f16, __half, 64)
SPATTN_FUSED_BSB_PIPE(f16, __half, 128)
SPATTN_FUSED_BSB_PIPE(bf16, __nv_bfloat16, 64)
SPATTN_FUSED_BSB_PIPE(bf16, __nv_bfloat16, 128)
