// Device pieces shared by the fused attention kernels (fused_bsb.cu, fused_csr.cu, hybrid.cu):
// the BSB tensor-core tile loop (mma SDDMM, bitmap mask, online softmax in the log2 domain, mma
// P V), the exact merge of split-window partials, and the CUDA-core per-edge online-softmax loop.
// One copy here; each kernel file instantiates what it needs. See fused_bsb.cu for the register
// layouts of the tile loop and fused_csr.cu for the lane layout of the edge loop.
#pragma once

#include "common.cuh"
#include "mma.cuh"

#define BSB_WINDOW_ROWS 16u
#define BSB_BLOCK_COLS 8u
// Floats of one group's merge scratch (16 maxima, 16 inverse sums, a flag).
#define BSB_MERGE_FLOATS 64u

// 2^x (ex2.approx: relative error ~2^-22; 2^-inf = 0).
__device__ __forceinline__ float bsb_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// online_merge (common.cuh) in the log2 domain (scores times log2 e, exp2): merges partial
// (m2, l2) into (m, l) and returns the factors, acc = acc * c1 + acc2 * c2 (both 0 when
// neither side saw an edge).
__device__ __forceinline__ void online_merge_log2(float& m, float& l, float m2, float l2,
                                                  float& c1, float& c2) {
    const float mn = fmaxf(m, m2);
    c1 = m == SPATTN_NEG_INF ? 0.0f : bsb_exp2(m - mn);
    c2 = m2 == SPATTN_NEG_INF ? 0.0f : bsb_exp2(m2 - mn);
    m = mn;
    l = l * c1 + l2 * c2;
}

// SpMM's P entries of one lane for one 16x8 block: the lane's bits of rows g and g + 8 (the
// block's two words shifted to the lane's slots 2t, 2t + 1) times its slot weights w (1 for a
// binary matrix, see bsb_spmm_weights).
__device__ __forceinline__ void bsb_spmm_p(u32 word0, u32 word1, const float (&w)[4],
                                           float (&p)[4]) {
    p[0] = (word0 & 1u) ? w[0] : 0.0f;
    p[1] = (word0 & 2u) ? w[1] : 0.0f;
    p[2] = (word1 & 1u) ? w[2] : 0.0f;
    p[3] = (word1 & 2u) ? w[3] : 0.0f;
}

// The slot weights of lane (g, t) in block `blk` of a weighted matrix (128 floats per block,
// block b's at (b + wbase) * 128, slot r * 8 + c; wbase wraps): slots 2t, 2t + 1 of rows g and
// g + 8. All 1 when weights is null (binary) or the block is padding (!valid).
__device__ __forceinline__ void bsb_spmm_weights(const float* __restrict__ weights, u32 blk,
                                                 u32 wbase, bool valid, u32 g, u32 t,
                                                 float (&w)[4]) {
    w[0] = w[1] = w[2] = w[3] = 1.0f;
    if (weights == nullptr || !valid) return;
    const float* wb = weights + (u64)(blk + wbase) * 128u + 2u * t;
    const float2 w0 = __ldg(reinterpret_cast<const float2*>(wb + g * 8u));
    const float2 w1 = __ldg(reinterpret_cast<const float2*>(wb + (g + 8u) * 8u));
    w[0] = w0.x;
    w[1] = w0.y;
    w[2] = w1.x;
    w[3] = w1.y;
}

// Barrier of the `threads` threads of one group (named barrier `id`, or the warp alone).
__device__ __forceinline__ void bsb_group_sync(u32 id, u32 threads) {
    if (threads == 32u) {
        __syncwarp();
    } else {
        asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
    }
}

// N elements of T at row[f0 .. f0 + N) as raw 32-bit words; zero where !valid or feature >= d.
// 16-byte (or N*sizeof(T)-byte) loads: rows are whole 16-byte vectors (the host pads heads that
// are not) and f0 a multiple of the access. `row` is only dereferenced when valid.
template <class T, int N>
__device__ __forceinline__ void bsb_load(u32 (&w)[N * sizeof(T) / 4], const T* __restrict__ row,
                                         u32 f0, u32 d, bool valid) {
    constexpr int BYTES = N * (int)sizeof(T);
    constexpr int CB = BYTES < 16 ? BYTES : 16;
    constexpr int CE = CB / (int)sizeof(T), CW = CB / 4;
    typedef typename RawOf<CB>::type Raw;
#pragma unroll
    for (int c = 0; c < N / CE; ++c) {
        const u32 f = f0 + c * CE;
        if (valid && f < d) {
            Raw raw = __ldg(reinterpret_cast<const Raw*>(row + f));
            const u32* rw = reinterpret_cast<const u32*>(&raw);
#pragma unroll
            for (int i = 0; i < CW; ++i) w[c * CW + i] = rw[i];
        } else {
#pragma unroll
            for (int i = 0; i < CW; ++i) w[c * CW + i] = 0u;
        }
    }
}

// Packs floats x[0 .. 4/sizeof(T)) into one 32-bit word of T.
template <class T> __device__ __forceinline__ u32 bsb_word(const float* x) {
    if constexpr (sizeof(T) == 4) {
        return __float_as_uint(x[0]);
    } else {
        return pack2<T>(x[0], x[1]);
    }
}

// Stores x[0 .. N) as T to row[f0 .. f0 + N), features >= d skipped (accesses as in bsb_load).
template <class T, int N>
__device__ __forceinline__ void bsb_store(T* __restrict__ row, u32 f0, u32 d, const float (&x)[N]) {
    constexpr int BYTES = N * (int)sizeof(T);
    constexpr int CB = BYTES < 16 ? BYTES : 16;
    constexpr int CE = CB / (int)sizeof(T), CW = CB / 4;
    constexpr int EW = 4 / (int)sizeof(T);  // elements per word
    typedef typename RawOf<CB>::type Raw;
#pragma unroll
    for (int c = 0; c < N / CE; ++c) {
        const u32 f = f0 + c * CE;
        if (f < d) {
            Raw raw;
            u32* rw = reinterpret_cast<u32*>(&raw);
#pragma unroll
            for (int i = 0; i < CW; ++i) rw[i] = bsb_word<T>(&x[c * CE + i * EW]);
            *reinterpret_cast<Raw*>(row + f) = raw;
        }
    }
}

// S += A B for one k-step of the SDDMM. f16/bf16: one m16n8k16. f32: 3xTF32 m16n8k8
// (a_big b_big + a_big b_small + a_small b_big), so that scores keep f32 accuracy (scores of
// 1e4 would otherwise carry errors of several units); `as` holds the small parts of A.
template <class T>
__device__ __forceinline__ void bsb_qk(float (&s)[4], const u32 (&a)[4], const u32 (&as)[4],
                                       u32 k0, u32 k1) {
    if constexpr (sizeof(T) == 4) {
        const float f0 = __uint_as_float(k0), f1 = __uint_as_float(k1);
        const u32 bb[2] = {to_tf32(f0), to_tf32(f1)};
        const u32 bs[2] = {to_tf32(f0 - __uint_as_float(bb[0])),
                           to_tf32(f1 - __uint_as_float(bb[1]))};
        mma_m16n8k8_tf32(s, as, bb);
        mma_m16n8k8_tf32(s, a, bs);
        mma_m16n8k8_tf32(s, a, bb);
    } else {
        const u32 b[2] = {k0, k1};
        mma_m16n8k16(s, a, b, T());
    }
}

// Column slots and bitmap words of one step (two blocks; a missing second block is all
// padding). Kept raw, as loaded, so that a prefetch never waits on its own load.
struct BsbStep {
    u32 ck[2];     // K: the column of slot g
    u32 cv[2][2];  // V: the columns of slots 2t, 2t+1
    u32 bm[2][2];  // the bitmap words holding rows g and g+8
};

// `bitmap_words` is the bitmaps as u32, 4 per block: word k holds rows 4k .. 4k+3 (8 bits
// each). Row g is in word g / 4 (`upper` = g >= 4), row g+8 in word 2 + g / 4.
__device__ __forceinline__ void bsb_load_step(BsbStep& st, const u32* __restrict__ cols,
                                              const u32* __restrict__ bitmap_words, u32 b,
                                              u32 end, u32 g, u32 t, u32 upper) {
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) {
        const u32 blk = b + bb;
        if (blk < end) {
            const u32* c = cols + (u64)blk * BSB_BLOCK_COLS;
            st.ck[bb] = __ldg(c + g);
            const uint2 cv = __ldg(reinterpret_cast<const uint2*>(c + 2 * t));
            st.cv[bb][0] = cv.x;
            st.cv[bb][1] = cv.y;
            const u32* w = bitmap_words + (u64)blk * 4u + upper;
            st.bm[bb][0] = __ldg(w);
            st.bm[bb][1] = __ldg(w + 2);
        } else {
            st.ck[bb] = SPATTN_NONE;
            st.cv[bb][0] = SPATTN_NONE;
            st.cv[bb][1] = SPATTN_NONE;
            st.bm[bb][0] = 0u;
            st.bm[bb][1] = 0u;
        }
    }
}


// What bsb_online_step adds to the lane's entries beyond the masked scores: nothing
// (NoBsbExtras, the plain kernels), or a score bias and dropout (BsbExtras, the `_x` kernels of
// fused_bsb and of hybrid's tensor-core warps; BsbStagedExtras, fused_bsb's pipelined ones).
// A block's edges are numbered in bit order (row-major) from block_edge_start[blk]. The bias
// arrives in that order, gathered from the caller's CSR order before the launch
// (bsb_bias_gather, below) as floats times log2 e, so the tile loop makes one independent load
// per entry. The dropout's keep bits arrive in the blocks' own layout (bsb_keep_gather: per
// block and head 4 words laid out as its bitmap), so an entry tests its keep bit as it tests
// its bitmap bit: no rank and no Philox draw in the tile loop.
struct NoBsbExtras {
    enum : bool { ON = false, STAGED = false, FEATS = false };  // enumerators: no object to emit
    enum : u32 { X_BYTES = 0u };                  // bytes of a pipelined stage's extras
};

// What both tensor-core extras hold: head h's gathered bias and keep words (make_bsb_extras),
// and the step's entries' values the tile loop reads (bias_log2, keep_factor).
struct BsbExtrasHead {
    enum : bool { ON = true, FEATS = false };
    const float* __restrict__ bias;  // null, or this head's row: per edge, bias x log2 e
    const u32* __restrict__ keep;    // null (no dropout), or this head's keep words, 4 a block
    float drop_scale;                // 1 / (1 - rate)
    const u32* __restrict__ block_edge_start;
    float bv[2][4];  // the step's entries' bias (log2 domain), 0 where there is none
    float kf[2][4];  // the step's entries' dropout factors
    __device__ __forceinline__ float bias_log2(int bb, int j) const { return bv[bb][j]; }
    // A masked entry's factor does not matter (its probability is 0).
    __device__ __forceinline__ float keep_factor(int bb, int j) const { return kf[bb][j]; }
    // Block bb's factors from its keep words of rows g (k0) and g + 8 (k1), this lane's bits at
    // shift and shift + 1, as in the bitmap.
    __device__ __forceinline__ void keep_from_words(int bb, u32 k0, u32 k1, u32 shift) {
        k0 >>= shift;
        k1 >>= shift;
        kf[bb][0] = (k0 & 1u) ? drop_scale : 0.0f;
        kf[bb][1] = (k0 & 2u) ? drop_scale : 0.0f;
        kf[bb][2] = (k1 & 1u) ? drop_scale : 0.0f;
        kf[bb][3] = (k1 & 2u) ? drop_scale : 0.0f;
    }
    __device__ __forceinline__ void bias_none(int bb) {
#pragma unroll
        for (int j = 0; j < 4; ++j) bv[bb][j] = 0.0f;
    }
    __device__ __forceinline__ void keep_all(int bb) {
#pragma unroll
        for (int j = 0; j < 4; ++j) kf[bb][j] = 1.0f;
    }
};

// A block's edges are its bits in row-major order: with its bitmap words w (row g in word
// `upper`, row g + 8 in word 2 + upper, this lane's bits at shift and shift + 1), entry
// 2r + c of the lane gets its rank among the block's edges in rank[2r + c] and whether its bit
// is set in on[2r + c]. A row's second entry ranks after its first: one popc per row.
__device__ __forceinline__ void bsb_lane_ranks(const u32 (&w)[4], u32 upper, u32 shift,
                                               u32 (&rank)[4], bool (&on)[4]) {
    const u32 p0 = __popc(w[0]);
    const u32 before[2] = {upper ? p0 : 0u, p0 + __popc(w[1]) + (upper ? __popc(w[2]) : 0u)};
    const u32 word[2] = {upper ? w[1] : w[0], upper ? w[3] : w[2]};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32 x = word[r] >> shift;
        on[2 * r] = x & 1u;
        on[2 * r + 1] = (x >> 1) & 1u;
        rank[2 * r] = before[r] + __popc(word[r] & ((1u << shift) - 1u));
        rank[2 * r + 1] = rank[2 * r] + (x & 1u);
    }
}

// The edges of a block: the bits of its 4 words.
__device__ __forceinline__ u32 bsb_block_edges(const u32 (&w)[4]) {
    return __popc(w[0]) + __popc(w[1]) + __popc(w[2]) + __popc(w[3]);
}

struct BsbExtras : BsbExtrasHead {
    enum : bool { STAGED = false };
    enum : u32 { X_BYTES = 0u };
    u32 e[2][4];     // the step's entries: block bb, entry 2r + c
    u32 base[2];     // block bb's first edge
    u32 count[2];    // block bb's edges (0 past the unit)

    // Block bb of the step is blk, its bitmap words w (bsb_lane_ranks); its keep words loaded.
    __device__ __forceinline__ void find(int bb, u32 blk, const u32 (&w)[4], u32 upper,
                                         u32 shift) {
        base[bb] = __ldg(block_edge_start + blk);
        u32 rank[4];
        bool on[4];
        bsb_lane_ranks(w, upper, shift, rank, on);
        count[bb] = bsb_block_edges(w);
#pragma unroll
        for (int j = 0; j < 4; ++j) e[bb][j] = on[j] ? base[bb] + rank[j] : SPATTN_NONE;
        if (keep != nullptr) {
            const u32* kb = keep + (u64)blk * 4u;
            keep_from_words(bb, __ldg(kb + upper), __ldg(kb + 2u + upper), shift);
        } else {
            keep_all(bb);
        }
    }
    // Block bb of the step lies past the unit.
    __device__ __forceinline__ void none(int bb) {
        base[bb] = 0u;
        count[bb] = 0u;
#pragma unroll
        for (int j = 0; j < 4; ++j) e[bb][j] = SPATTN_NONE;
        keep_all(bb);
    }
    // The step's blocks blk0 and blk0 + 1 (at or past `end`: past the unit), their bitmap
    // words from words(bb, blk, w); then their bias fetched (fetch).
    template <class W>
    __device__ __forceinline__ void find_step(u32 blk0, u32 end, u32 upper, u32 shift, W words) {
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
            const u32 blk = blk0 + bb;
            if (blk < end) {
                u32 w[4];
                words(bb, blk, w);
                find(bb, blk, w, upper, shift);
            } else {
                none(bb);
            }
        }
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) fetch(bb);
    }
    // Block bb's bias, by the whole warp (every lane calls it for the same block): a block's
    // edges are consecutive, so lanes j < count load edge base + j's bias (32 at a time) and
    // each entry takes its value from the lane that loaded it. One coalesced load per block
    // instead of one scattered load per entry.
    __device__ __forceinline__ void fetch(int bb) {
        if (bias == nullptr) {
            bias_none(bb);
            return;
        }
        const u32 lane = lane_id(), b = base[bb], n = count[bb];
        float got[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        for (u32 c = 0; c < n; c += 32u) {  // warp-uniform: n is the block's
            const float mine = c + lane < n ? __ldg(bias + b + c + lane) : 0.0f;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 r = e[bb][j] - b;  // the entry's rank in its block (huge if none)
                const float v = __shfl_sync(0xffffffffu, mine, r & 31u);
                if (r - c < 32u) got[j] = v;
            }
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) bv[bb][j] = got[j];
    }

    // The register tile loop's path (bsb_tiles), which keeps the bias's loads off the step's
    // critical path: the span of the next step's edges is loaded a step ahead (span), the
    // step's first 64 bias values (two loads a lane) and its blocks' bitmap and keep words at
    // its top (begin), while its K and V rows are in flight, and the entries take their values
    // after S (finish).
    u32 sp[2];     // the edges of the step begin takes next: its first, and the first past it
    u32 first;     // this step's first edge
    u32 n;         // this step's edges (ranks past 32 and 64 take the slower paths)
    float mine;    // the bias of edge first + lane (0 past the step's edges)
    float mine2;   // with more than 32 edges, of edge first + 32 + lane
    u32 wd[2][4];  // this step's blocks' bitmap words (0 past the unit; unread without a bias)
    u32 kw[2][2];  // their keep words of rows g and g + 8
    // The step of blocks blk0, blk0 + 1 (at or past end: past the unit).
    __device__ __forceinline__ void span(u32 blk0, u32 end) {
        const bool ok = bias != nullptr && blk0 < end;
        sp[0] = ok ? __ldg(block_edge_start + blk0) : 0u;
        sp[1] = ok ? __ldg(block_edge_start + min(blk0 + 2u, end)) : 0u;
    }
    template <class W>
    __device__ __forceinline__ void begin(u32 blk0, u32 end, u32 upper, W words) {
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
            const u32 blk = blk0 + bb;
            if (bias != nullptr && blk < end) {
                words(bb, blk, wd[bb]);
            } else {
#pragma unroll
                for (int i = 0; i < 4; ++i) wd[bb][i] = 0u;
            }
            if (keep != nullptr && blk < end) {
                const u32* kb = keep + (u64)blk * 4u;
                kw[bb][0] = __ldg(kb + upper);
                kw[bb][1] = __ldg(kb + 2u + upper);
            }
        }
        first = sp[0];
        n = sp[1] - sp[0];
        const u32 lane = lane_id();
        mine = bias != nullptr && lane < n ? __ldg(bias + first + lane) : 0.0f;
        mine2 = bias != nullptr && lane + 32u < n ? __ldg(bias + first + 32u + lane) : 0.0f;
    }
    // An entry's bias is the value of its rank in the step (block 0's bits first): from the
    // lane that loaded it, or past the first 64 loaded by itself. Every lane shuffles all 8
    // entries, then selects: no lane-dependent branch around a shuffle; the second shuffles
    // and the loads past 64 only in a step that has such ranks (warp-uniform).
    __device__ __forceinline__ void finish(u32 blk0, u32 end, u32 upper, u32 shift) {
        if (bias != nullptr) {  // warp-uniform
            u32 rank[2][4];
            bool on[2][4];
            bsb_lane_ranks(wd[0], upper, shift, rank[0], on[0]);
            bsb_lane_ranks(wd[1], upper, shift, rank[1], on[1]);
            const u32 start1 = bsb_block_edges(wd[0]);  // block 1's first edge in the step
#pragma unroll
            for (int bb = 0; bb < 2; ++bb)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    rank[bb][j] += bb == 1 ? start1 : 0u;
                    const float v = __shfl_sync(0xffffffffu, mine, rank[bb][j] & 31u);
                    bv[bb][j] = on[bb][j] ? v : 0.0f;
                }
            if (n > 32u) {
#pragma unroll
                for (int bb = 0; bb < 2; ++bb)
#pragma unroll
                    for (int j = 0; j < 4; ++j) {
                        const float v = __shfl_sync(0xffffffffu, mine2, rank[bb][j] & 31u);
                        if (on[bb][j] && rank[bb][j] >= 32u) bv[bb][j] = v;
                    }
            }
            if (n > 64u) {
#pragma unroll
                for (int bb = 0; bb < 2; ++bb)
#pragma unroll
                    for (int j = 0; j < 4; ++j)
                        if (on[bb][j] && rank[bb][j] >= 64u)
                            bv[bb][j] = __ldg(bias + first + rank[bb][j]);
            }
        } else {
            bias_none(0);
            bias_none(1);
        }
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
            if (keep != nullptr && blk0 + bb < end)
                keep_from_words(bb, kw[bb][0], kw[bb][1], shift);
            else
                keep_all(bb);
        }
    }
};

// Bytes of a pipelined stage's staged extras (BsbStagedExtras): the step's bias span (two blocks
// of 128 bits at most, f32) with a bias, then the two blocks' keep words (4 each) with dropout.
#define BSB_PIPE_X_BIAS 256u
__host__ __device__ constexpr u32 bsb_pipe_x_bytes(bool bias, bool drop) {
    return (bias ? 4u * BSB_PIPE_X_BIAS : 0u) + (drop ? 32u : 0u);
}

// The extras of fused_bsb's pipelined `_x` kernels, which one of them takes fixed at compile
// time (BIAS, DROP: `_xb`, `_xd`, `_x` both), so that a kernel carries no test or load of an
// extra it does not take. A step's extras travel into its stage by cp.async with its K and V
// tiles (issue), and the step reads them from shared memory (load): the bias of the step's
// edges, which are consecutive (block-and-bit order) from block_edge_start[blk0] to
// block_edge_start[min(blk0 + 2, b_end)] (n_blocks + 1 entries), loaded a step before the
// copies are issued (prefetch), as the column ids are; the keep words of its two blocks.
template <bool BIAS, bool DROP>
struct BsbStagedExtras : BsbExtrasHead {
    enum : bool { STAGED = true, SPAN = BIAS };  // SPAN: a step's copies read its bias span
    enum : u32 { X_BYTES = bsb_pipe_x_bytes(BIAS, DROP), KEEP_OFF = bsb_pipe_x_bytes(BIAS, false) };

    // Lane 16: the first edge of the step of blocks blk0, blk0 + 1 (< b_end); lane 17: the
    // first edge past it (lanes 0-15 carry the step's columns in the same register:
    // bsb_pipe_step_ids). Other lanes, a step past the unit, and without a bias: 0.
    __device__ __forceinline__ u32 prefetch(u32 blk0, u32 b_end) const {
        if constexpr (!BIAS) {
            return 0u;
        } else {
            const u32 lane = lane_id();
            if (lane - 16u >= 2u || blk0 >= b_end) return 0u;
            return __ldg(block_edge_start + (lane == 16u ? blk0 : min(blk0 + 2u, b_end)));
        }
    }
    // The step's copies into its stage's extras (shared address x) from its bias span `be`
    // (prefetch's lanes 16 and 17) and of its blocks blk0, blk0 + 1 (< b_end), in the stage's
    // cp.async group. Every lane calls it.
    __device__ __forceinline__ void issue(u32 x, u32 be, u32 blk0, u32 b_end) const {
        const u32 lane = lane_id();
        if constexpr (BIAS) {
            const u32 first = __shfl_sync(0xffffffffu, be, 16);
            const u32 end = __shfl_sync(0xffffffffu, be, 17);
            const u32 n = end - first;  // at most 256: two blocks of 128 bits
#pragma unroll 1
            for (u32 c = 0; c < n; c += 32u)  // warp-uniform
                if (c + lane < n) cp_async_4(x + 4u * (c + lane), bias + first + c + lane);
        }
        if constexpr (DROP) {
            if (lane < 2u) {
                const u32 blk = blk0 + lane;
                const bool ok = blk < b_end;
                cp_async_16(x + KEEP_OFF + 16u * lane, keep + (ok ? (u64)blk * 4u : 0u), ok);
            }
        }
    }
    // The step's entries from its stage's extras xp, given the stage's bitmap words w (shared
    // memory, 4 per block; zeros for a block past the unit): an entry's rank in the bias span is
    // the bits before it, block 0's first.
    __device__ __forceinline__ void load(const unsigned char* xp, const u32* w, u32 upper,
                                         u32 shift) {
        if constexpr (BIAS) {
            const float* sb = reinterpret_cast<const float*>(xp);
            u32 start = 0u;  // block bb's first edge in the span
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                const u32 wb[4] = {w[4 * bb], w[4 * bb + 1], w[4 * bb + 2], w[4 * bb + 3]};
                u32 rank[4];
                bool on[4];
                bsb_lane_ranks(wb, upper, shift, rank, on);
#pragma unroll
                for (int j = 0; j < 4; ++j) bv[bb][j] = on[j] ? sb[start + rank[j]] : 0.0f;
                if (bb == 0) start = bsb_block_edges(wb);
            }
        } else {
            bias_none(0);
            bias_none(1);
        }
        if constexpr (DROP) {
            const u32* sk = reinterpret_cast<const u32*>(xp + KEEP_OFF);
#pragma unroll
            for (int bb = 0; bb < 2; ++bb)
                keep_from_words(bb, sk[4 * bb + upper], sk[4 * bb + 2 + upper], shift);
        } else {
            keep_all(0);
            keep_all(1);
        }
    }
};

// The `_x` kernels' tensor-core extras (their last parameters, SPATTN_BSB_X_PARAMS): the
// gathered bias (null, or bias_rows rows of n_edges floats: 1 shared by the heads, else one per
// head), each block's first edge, and the keep words (null, or 4 per block and head, laid out
// as the bitmaps: n_blocks × 4 a head) with the dropout's scale.
struct BsbExtrasArgs {
    const float* bias;
    u32 bias_rows;
    const u32* block_edge_start;
    const u32* keep;
    u32 n_edges;
    u32 n_blocks;
    float drop_scale;
};
#define SPATTN_BSB_X_PARAMS                                                                    \
    const float *x_bias, u32 x_bias_rows, const u32 *block_edge_start, const u32 *x_keep,      \
        u32 x_edges, u32 x_blocks, float x_drop_scale
#define SPATTN_BSB_X_ARGS                                                                      \
    { x_bias, x_bias_rows, block_edge_start, x_keep, x_edges, x_blocks, x_drop_scale }

// BsbExtras (or BsbStagedExtras) of head h.
template <class X = BsbExtras>
__device__ __forceinline__ X make_bsb_extras(const BsbExtrasArgs& a, u32 h) {
    X xt;
    xt.bias = a.bias == nullptr ? nullptr : a.bias + (u64)(a.bias_rows == 1u ? 0u : h) * a.n_edges;
    xt.keep = a.keep == nullptr ? nullptr : a.keep + (u64)h * a.n_blocks * 4u;
    xt.drop_scale = a.drop_scale;
    xt.block_edge_start = a.block_edge_start;
    return xt;
}

// The tile loops' extras argument: head h's BsbExtras from `a` in a `_x` kernel (ON), none
// otherwise (`a` is not read), so that one call serves both twins.
template <bool ON>
__device__ __forceinline__ auto bsb_extras_or_none(const BsbExtrasArgs* a, u32 h) {
    if constexpr (ON) {
        return make_bsb_extras(*a, h);
    } else {
        return NoBsbExtras();
    }
}

// The extras of fused_bsb's pipelined kernels: XMODE 0 none, else BsbStagedExtras taking the
// bias (bit 0) and dropout (bit 1).
template <int XMODE>
__device__ __forceinline__ auto bsb_staged_extras_or_none(const BsbExtrasArgs* a, u32 h) {
    if constexpr (XMODE != 0) {
        return make_bsb_extras<BsbStagedExtras<(XMODE & 1) != 0, (XMODE & 2) != 0>>(*a, h);
    } else {
        return NoBsbExtras();
    }
}

// Edge features in the pipelined tile loop (fused_bsb's `_xf` kernels): the extras of
// BsbExtras (a bias and dropout, either may be absent) and features f_e added to K and V,
// s_e += <q_i, f_e>, out_i += w_e f_e, each read from the caller's nnz x heads x head_dim matrix
// through the kernel-to-caller edge map. A step's edges are consecutive in the kernel's order
// (block 0's, then block 1's), so both products run on tensor cores over chunks of 16 of them
// (bsb_pipe_tiles). `tab` and `val` are the warp's scratch in shared memory (BSB_FEAT_FLOATS
// floats), indexed by an edge's rank in its step; `ovf` the tile of its chunks past the first.
#define BSB_FEAT_FLOATS 320u
template <class T>
struct BsbFeatExtras : BsbExtras {
    enum : bool { FEATS = true };
    const T* __restrict__ feats;     // caller edge x, head h: feats + x * hd + h * head_dim
    const u32* __restrict__ edge_ids;  // per kernel edge its caller edge
    unsigned char* tab;              // per edge of the step its window row (256 bytes)
    float* val;                      // per edge of the step a score term, then a probability
    unsigned char* ovf;              // the tile of a step's chunks past its first
};

// A if B, else C (NVRTC has no <type_traits>).
template <bool B, class A, class C> struct BsbPick { using type = A; };
template <class A, class C> struct BsbPick<false, A, C> { using type = C; };

// Head h's BsbFeatExtras, with this warp's scratch at `scratch`: val (256 floats), tab (256
// bytes: BSB_FEAT_FLOATS floats in all), then the overflow tile.
template <class T>
__device__ __forceinline__ BsbFeatExtras<T> make_bsb_feat_extras(const BsbExtrasArgs& a, u32 h,
                                                                 const T* feats,
                                                                 const u32* edge_ids,
                                                                 unsigned char* scratch) {
    BsbFeatExtras<T> xt;
    static_cast<BsbExtras&>(xt) = make_bsb_extras(a, h);
    xt.feats = feats;
    xt.edge_ids = edge_ids;
    xt.val = reinterpret_cast<float*>(scratch);
    xt.tab = scratch + 4u * 256u;
    xt.ovf = scratch + 4u * BSB_FEAT_FLOATS;
    return xt;
}

// The bias gather before a `_x` launch: per kernel edge p < n (block-and-bit order), for every
// bias row h < bias_heads, its caller edge ids[p]'s bias times log2 e into bias_out[h * n + p].
// One thread an edge: its id and its heads' bias (adjacent in the caller's layout) are read
// once, not once per head.
template <class T>
__device__ __forceinline__ void bsb_bias_gather(const u32* __restrict__ ids, u32 n,
                                                const T* __restrict__ bias, u32 bias_heads,
                                                float* __restrict__ bias_out) {
    const u32 p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= n) return;
    const u64 x = __ldg(ids + p);
    for (u32 h = 0; h < bias_heads; ++h)
        bias_out[(u64)h * n + p] = to_f32(bias[x * bias_heads + h]) * 1.4426950408889634f;
}

// The bit position (0..31) of the set bit of x with k set bits below it (k < popc(x)).
__device__ __forceinline__ u32 nth_set_bit(u32 x, u32 k) {
    u32 pos = 0u;
#pragma unroll
    for (u32 width = 16u; width > 0u; width >>= 1u) {
        const u32 c = __popc(x & ((1u << width) - 1u));
        if (k >= c) {
            k -= c;
            x >>= width;
            pos += width;
        }
    }
    return pos;
}

// Blocks per CTA of bsb_keep_gather, and heads per pass over their edges.
#define BSB_KEEP_GROUP 128u
#define BSB_KEEP_HEADS 8u

// The keep gather before a `_x` launch with dropout: per block b < n_blocks and head h <
// heads, 4 words laid out as the block's bitmap (bitmaps + 4b) into
// keep_out[(h * n_blocks + b) * 4 ..], a bit set where its edge is kept. The edge at a bit is
// block_edge_start[b] + the bit's rank in the block (the last block's edges end at n); its
// caller edge x = ids[edge] gives the element x * heads + h, drawn as dropout_factor draws it
// (word i mod 4 of draw i / 4), so the CPU and the other kernels keep the same elements.
// A CTA takes BSB_KEEP_GROUP consecutive blocks, whose edges are consecutive: a thread per edge
// (coalesced ids, every lane drawing) finds its block by binary search over the group's starts
// and its bit by select, and ORs its kept bits into the group's words in shared memory, which
// then go out as one 16-byte store per block and head.
__device__ __forceinline__ void bsb_keep_gather(const u32* __restrict__ ids, u32 n,
                                                const u32* __restrict__ bitmaps,
                                                const u32* __restrict__ block_edge_start,
                                                u32 n_blocks, u32 heads, Dropout drop,
                                                u32* __restrict__ keep_out) {
    __shared__ u32 s_start[BSB_KEEP_GROUP + 1u];
    __shared__ uint4 s_bm[BSB_KEEP_GROUP];
    __shared__ uint4 s_out[BSB_KEEP_HEADS][BSB_KEEP_GROUP];
    const u32 b0 = blockIdx.x * BSB_KEEP_GROUP;
    if (b0 >= n_blocks) return;  // CTA-uniform
    const u32 nb = min(BSB_KEEP_GROUP, n_blocks - b0);
    for (u32 j = threadIdx.x; j <= nb; j += blockDim.x)
        s_start[j] = b0 + j < n_blocks ? __ldg(block_edge_start + b0 + j) : n;
    for (u32 j = threadIdx.x; j < nb; j += blockDim.x)
        s_bm[j] = __ldg(reinterpret_cast<const uint4*>(bitmaps) + b0 + j);
    __syncthreads();
    const u32 e0 = s_start[0], e1 = s_start[nb];
    u32* out_words = reinterpret_cast<u32*>(&s_out[0][0]);
    for (u32 h0 = 0; h0 < heads; h0 += BSB_KEEP_HEADS) {
        const u32 hn = min(BSB_KEEP_HEADS, heads - h0);
        for (u32 j = threadIdx.x; j < hn * nb; j += blockDim.x)
            s_out[j / nb][j % nb] = make_uint4(0u, 0u, 0u, 0u);
        __syncthreads();
        for (u32 p = e0 + threadIdx.x; p < e1; p += blockDim.x) {
            // The block lo with s_start[lo] <= p < s_start[lo + 1] (empty blocks repeat a start).
            u32 lo = 0u, hi = nb;
            while (hi - lo > 1u) {
                const u32 mid = (lo + hi) >> 1;
                if (s_start[mid] <= p) lo = mid;
                else hi = mid;
            }
            const uint4 w = s_bm[lo];
            u32 k = p - s_start[lo], word = 0u, bits = w.x;
            const u32 c0 = __popc(w.x), c1 = __popc(w.y), c2 = __popc(w.z);
            if (k >= c0) {
                k -= c0;
                word = 1u;
                bits = w.y;
                if (k >= c1) {
                    k -= c1;
                    word = 2u;
                    bits = w.z;
                    if (k >= c2) {
                        k -= c2;
                        word = 3u;
                        bits = w.w;
                    }
                }
            }
            const u32 slot = lo * 4u + word, mask = 1u << nth_set_bit(bits, k);
            const u64 first = (u64)__ldg(ids + p) * heads + h0;
            uint4 r = dropout_draws(drop, first >> 2);
#pragma unroll
            for (u32 hh = 0; hh < BSB_KEEP_HEADS; ++hh) {
                if (hh >= hn) break;
                const u64 i = first + hh;
                if (hh > 0u && (i & 3u) == 0u) r = dropout_draws(drop, i >> 2);
                if (dropout_kept(drop, r, (u32)i & 3u))
                    atomicOr(out_words + hh * BSB_KEEP_GROUP * 4u + slot, mask);
            }
        }
        __syncthreads();
        for (u32 j = threadIdx.x; j < hn * nb; j += blockDim.x) {
            const u32 hh = j / nb, b = j % nb;
            reinterpret_cast<uint4*>(keep_out)[(u64)(h0 + hh) * n_blocks + b0 + b] = s_out[hh][b];
        }
        __syncthreads();  // the words are zeroed again for the next heads
    }
}

// The online max of row g + 8r (r = 0, 1) over a step's entries x (score-accumulator layout,
// two blocks, masked to -inf; the row's 4 lanes exchange theirs): m becomes the new running
// max; returns the exponent's offset (the new max, 0 while the row has seen no edge) and sets
// alpha, the factor of what was summed under the old max.
__device__ __forceinline__ float bsb_row_max(const float (&x)[2][4], int r, float& m,
                                             float& alpha) {
    float mx = fmaxf(fmaxf(x[0][2 * r], x[0][2 * r + 1]), fmaxf(x[1][2 * r], x[1][2 * r + 1]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mnew = fmaxf(m, mx);
    const float mu = softmax_base(mnew);
    alpha = bsb_exp2(m - mu);
    m = mnew;
    return mu;
}

// One step (two blocks) of the online softmax of rows g (r = 0) and g + 8 (r = 1): the scores s
// (S-accumulator layout, two blocks) are masked by the blocks' bitmap words (bits[bb][0] holds
// row g, bits[bb][1] row g + 8; bit clear -> -inf), scaled into the log2 domain, and folded
// into the running max m, the running per-lane sum l and the NT accumulator tiles o (rescaled
// to the new max). p receives exp2(x - m), 0 where masked. l stays per lane: the caller sums
// the 4 lanes of a row at the end.
template <int NT, class X = NoBsbExtras>
__device__ __forceinline__ void bsb_online_step(const float (&s)[2][4], const u32 (&bits)[2][2],
                                                u32 shift, float scale_log2, float (&m)[2],
                                                float (&l)[2], float (&p)[2][4],
                                                float (&o)[NT][4], X xt = X()) {
    float x[2][4];
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) {
        const u32 b0 = bits[bb][0] >> shift, b1 = bits[bb][1] >> shift;
        if constexpr (X::ON) {
            x[bb][0] = (b0 & 1u) ? fmaf(s[bb][0], scale_log2, xt.bias_log2(bb, 0)) : SPATTN_NEG_INF;
            x[bb][1] = (b0 & 2u) ? fmaf(s[bb][1], scale_log2, xt.bias_log2(bb, 1)) : SPATTN_NEG_INF;
            x[bb][2] = (b1 & 1u) ? fmaf(s[bb][2], scale_log2, xt.bias_log2(bb, 2)) : SPATTN_NEG_INF;
            x[bb][3] = (b1 & 2u) ? fmaf(s[bb][3], scale_log2, xt.bias_log2(bb, 3)) : SPATTN_NEG_INF;
        } else {
            x[bb][0] = (b0 & 1u) ? s[bb][0] * scale_log2 : SPATTN_NEG_INF;
            x[bb][1] = (b0 & 2u) ? s[bb][1] * scale_log2 : SPATTN_NEG_INF;
            x[bb][2] = (b1 & 1u) ? s[bb][2] * scale_log2 : SPATTN_NEG_INF;
            x[bb][3] = (b1 & 2u) ? s[bb][3] * scale_log2 : SPATTN_NEG_INF;
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        float alpha;
        const float mu = bsb_row_max(x, r, m[r], alpha);
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
            p[bb][2 * r] = bsb_exp2(x[bb][2 * r] - mu);
            p[bb][2 * r + 1] = bsb_exp2(x[bb][2 * r + 1] - mu);
        }
        l[r] = l[r] * alpha + ((p[0][2 * r] + p[0][2 * r + 1]) + (p[1][2 * r] + p[1][2 * r + 1]));
        if constexpr (X::ON) {
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                p[bb][2 * r] *= xt.keep_factor(bb, 2 * r);
                p[bb][2 * r + 1] *= xt.keep_factor(bb, 2 * r + 1);
            }
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            o[nt][2 * r] *= alpha;
            o[nt][2 * r + 1] *= alpha;
        }
    }
}

// O += P V for one step of two blocks, f16 / bf16 (m16n8k16): P the lane's entries in the score
// accumulator's layout (rows g, g + 8; slots 2t, 2t + 1 of each block), V the rows of slots
// 2t, 2t + 1 of block 0 (v0) and block 1 (v1), features g * D8 .. + D8 as loaded (fused_bsb.cu's
// layouts): P becomes the A operand as it is, V's pairs are byte-permuted into B registers.
template <class T, int D8>
__device__ __forceinline__ void bsb_pv_mma(float (&o)[D8][4], const float (&p)[2][4],
                                           const u32 (&v0)[2][D8 / 2], const u32 (&v1)[2][D8 / 2]) {
    const u32 a[4] = {pack2<T>(p[0][0], p[0][1]), pack2<T>(p[0][2], p[0][3]),
                      pack2<T>(p[1][0], p[1][1]), pack2<T>(p[1][2], p[1][3])};
#pragma unroll
    for (int nt = 0; nt < D8; ++nt) {
        const u32 sel = (nt & 1) ? 0x7632u : 0x5410u;
        const u32 bv[2] = {__byte_perm(v0[0][nt / 2], v0[1][nt / 2], sel),
                           __byte_perm(v1[0][nt / 2], v1[1][nt / 2], sel)};
        mma_m16n8k16(o[nt], a, bv, T());
    }
}

// The pieces of the pipelined tile loop for edge features, over a step's n edges from kernel edge
// `first` (its entries xt.e from find_step): each entry's window row by its rank in the step
// (tab) once the previous step's reads are done.
template <class X>
__device__ __forceinline__ void bsb_feat_rows(const X& xt, u32 first) {
    const u32 g = lane_id() >> 2;
    __syncwarp();  // the previous step's reads of tab and val are done
#pragma unroll
    for (int bb = 0; bb < 2; ++bb)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (xt.e[bb][j] != SPATTN_NONE)
                xt.tab[xt.e[bb][j] - first] = (unsigned char)(g + 8u * (j >> 1));
    __syncwarp();
}

// f(hh, j, c, own) for entry (hh, j) of a chunk product in the S layout, which pairs row
// g + 8 (j / 2) with edge c = c0 + 8 hh + 2t + j % 2 of the step; own: c is an edge of the step
// and the row its own. A lane's edges come in even pairs: one 16-bit load of `tab` a pair, read
// whatever n is (tab holds 256 entries; n <= 256, two blocks' bits, so c < c0 + 16 <= 256), so
// no entry needs a branch. Bytes at or past n are stale: `own` holds only where c < n.
template <class X, class F>
__device__ __forceinline__ void bsb_feat_entries(const X& xt, u32 c0, u32 n, F f) {
    const u32 lane = lane_id(), g = lane >> 2, t = lane & 3u;
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const u32 c = c0 + 8u * hh + 2u * t;
        const u32 rows = *reinterpret_cast<const unsigned short*>(xt.tab + c);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 row = (j & 1) ? rows >> 8 : rows & 0xffu;
            f(hh, j, c + (j & 1), c + (j & 1) < n && row == g + 8u * (j >> 1));
        }
    }
}

// x = Q F^T of chunk c0 (16 edges, S layout): the lane holding an edge's own row leaves it in
// val.
template <class X>
__device__ __forceinline__ void bsb_feat_keep(const X& xt, const float (&x)[2][4], u32 c0,
                                              u32 n) {
    bsb_feat_entries(xt, c0, n, [&](int hh, int j, u32 c, bool own) {
        if (own) xt.val[c] = x[hh][j];
    });
}

// Each entry adds its edge's kept score term.
template <class X>
__device__ __forceinline__ void bsb_feat_add(const X& xt, float (&s)[2][4], u32 first) {
    __syncwarp();
#pragma unroll
    for (int bb = 0; bb < 2; ++bb)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (xt.e[bb][j] != SPATTN_NONE) s[bb][j] += xt.val[xt.e[bb][j] - first];
}

// Each entry leaves its probability in val (the slot it read its term from: no other lane
// wrote it since).
template <class X>
__device__ __forceinline__ void bsb_feat_put(const X& xt, const float (&p)[2][4], u32 first) {
#pragma unroll
    for (int bb = 0; bb < 2; ++bb)
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (xt.e[bb][j] != SPATTN_NONE) xt.val[xt.e[bb][j] - first] = p[bb][j];
    __syncwarp();
}

// P' of chunk c0 (A of O += P' F, S layout): the probability of edge c where the row is its
// own, else 0. A lane's pairs of val (bsb_feat_entries' c, c + 1) are loaded whole, in bounds as
// tab's and 8-byte aligned (c even), then selected, never multiplied: a stale value may be NaN.
template <class X>
__device__ __forceinline__ void bsb_feat_chunk_p(const X& xt, float (&pp)[2][4], u32 c0, u32 n) {
    const u32 t = lane_id() & 3u;
    float2 pv[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh)
        pv[hh] = *reinterpret_cast<const float2*>(xt.val + c0 + 8u * hh + 2u * t);
    bsb_feat_entries(xt, c0, n, [&](int hh, int j, u32, bool own) {
        pp[hh][j] = own ? ((j & 1) ? pv[hh].y : pv[hh].x) : 0.0f;
    });
}

// ---- the tensor-core tile loop ----------------------------------------------------------------
// One warp's share of a window's 16x8 blocks: steps of two blocks (b, b + 1) at b = b_begin,
// b_begin + stride, ... < b_end, over features [base, base + DS) of head `head_off / d`.
// (fused_bsb: stride 2, every block of the unit; hybrid: T tensor-core warps with stride 2T.)
// Q rows qr0 (window row g) and qr1 (row g + 8), or SPATTN_NONE for a row past the matrix.
//
// Attention (SPMM false): S = Q K^T by mma, masked by the bitmaps, online softmax in the log2
// domain (scores times scale_log2, exp2), O += P V by mma. On return m[r] is the running max of
// row g + 8r (-inf where the warp saw no edge of the row), l[r] its sum over the 4 lanes of the
// row, o the f32 accumulator (layout in fused_bsb.cu). With fs > 1 warps per group the partial
// scores are summed through `xs` (2 * fs * 256 floats) at named barrier `bar` of `gsize` threads.
//
// SpMM (SPMM true): P is the blocks' bitmap, times the slot weights when `weights` is given
// (128 floats per block, block b's at (b + wbase) * 128, slot r * 8 + c; wbase wraps), and
// O += P V; m and l are left at -inf and 0, and Q and K are not read.
//
// Extras (X::ON) load at the step's top (BsbExtras::begin, EARLY below) where registers allow,
// in slices of at most 128 bytes a row without the next step's K rows in flight; elsewhere
// after S (find_step). The span reads block_edge_start[min(blk0 + 2, end)], so the edge map
// needs n_blocks + 1 entries (fused_bsb's and hybrid's end with the edge count).
template <class T, int DS, bool PIPE, bool SPMM, class X = NoBsbExtras>
__device__ __forceinline__ void bsb_tiles(
    u32 qr0, u32 qr1, const T* __restrict__ q, const u32* __restrict__ block_columns,
    const u32* __restrict__ bitmaps, const float* __restrict__ weights, u32 wbase, u32 b_begin,
    u32 b_end, u32 stride, const T* __restrict__ k, const T* __restrict__ v, u64 hd, u64 head_off,
    u32 d, u32 base, float scale_log2, u32 fs, u32 wig, u32 bar, u32 gsize, float* xs,
    float (&m)[2], float (&l)[2], float (&o)[DS / 8][4], X xt = X()) {
    constexpr bool F32 = sizeof(T) == 4;
    constexpr int EPL = 16 / (int)sizeof(T);  // elements of one 16-byte load
    constexpr int KCH = 4 * EPL;              // features of one group-wide load (2 k-steps)
    constexpr int NKC = SPMM ? 1 : DS / KCH;  // 16-byte loads per lane per K row
    constexpr int NKS = 2 * NKC;              // k-steps per block
    constexpr int D8 = DS / 8;                // n-tiles of P V = features per lane per V row
    constexpr int VW = D8 * (int)sizeof(T) / 4;
    static_assert(DS % KCH == 0 && D8 >= 4, "slice too narrow");
    constexpr bool EARLY = X::ON && !PIPE && DS * sizeof(T) <= 128;
    static_assert(!X::ON || (!SPMM && !X::FEATS), "extras: attention without edge features");

    const u32 lane = lane_id();
    const u32 g = lane >> 2, t = lane & 3u;

    // Q fragments of rows g, g+8 over this warp's features, per k-step.
    u32 qf[NKS][4];
    u32 qs[F32 ? NKS : 1][4];
    if constexpr (!SPMM) {
#pragma unroll
        for (int c = 0; c < NKC; ++c) {
            u32 r0[4], r1[4];
            const u32 f = base + c * KCH + t * EPL;
            bsb_load<T, EPL>(r0, q + (qr0 != SPATTN_NONE ? qr0 : 0u) * hd + head_off, f, d,
                                  qr0 != SPATTN_NONE);
            bsb_load<T, EPL>(r1, q + (qr1 != SPATTN_NONE ? qr1 : 0u) * hd + head_off, f, d,
                                  qr1 != SPATTN_NONE);
#pragma unroll
            for (int ks = 0; ks < 2; ++ks) {
                const u32 a[4] = {r0[2 * ks], r1[2 * ks], r0[2 * ks + 1], r1[2 * ks + 1]};
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    if constexpr (F32) {
                        const float x = __uint_as_float(a[i]);
                        const u32 big = to_tf32(x);
                        qf[2 * c + ks][i] = big;
                        qs[2 * c + ks][i] = to_tf32(x - __uint_as_float(big));
                    } else {
                        qf[2 * c + ks][i] = a[i];
                    }
                }
            }
        }
    }
    if constexpr (!F32) {
#pragma unroll
        for (int i = 0; i < 4; ++i) qs[0][i] = 0u;
    }

    m[0] = SPATTN_NEG_INF;
    m[1] = SPATTN_NEG_INF;
    l[0] = 0.0f;
    l[1] = 0.0f;
#pragma unroll
    for (int nt = 0; nt < D8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[nt][i] = 0.0f;

    // Bit positions of this lane's entries in the words of rows g and g+8: 8*(g%4) + 2t, + 1.
    const u32 shift = 8u * (g & 3u) + 2u * t;
    const u32 upper = g >= 4u ? 1u : 0u;

    // One step: blocks b, b+1. Software pipeline (PIPE): on entry `mc` holds the slots of this
    // step and `kw_use` its K rows (both loaded during the previous step), `mn` the slots of
    // the next step. The step issues its V rows, the next step's K rows (into `kw_fill`) and
    // the slots of the step after (into `mc`, once read), then computes on data already
    // present. Without PIPE a step loads its own K rows first (fewer registers).
    u32 buf = 0;
    auto load_k = [&](u32 (&kw)[2][NKC][4], const BsbStep& st) {
        if constexpr (!SPMM) {
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                const bool okk = st.ck[bb] != SPATTN_NONE;
                const T* kr = k + (okk ? st.ck[bb] : 0u) * hd + head_off;
#pragma unroll
                for (int c = 0; c < NKC; ++c)
                    bsb_load<T, EPL>(kw[bb][c], kr, base + c * KCH + t * EPL, d, okk);
            }
        }
    };
    auto step = [&](u32 b, u32 (&kw_use)[2][NKC][4], u32 (&kw_fill)[2][NKC][4], BsbStep& mc,
                    const BsbStep& mn) {
        // V rows of slots 2t, 2t+1 of both blocks (padding: zeros).
        u32 vw[2][2][VW];
#pragma unroll
        for (int bb = 0; bb < 2; ++bb)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool okv = mc.cv[bb][e] != SPATTN_NONE;
                const T* vr = v + (okv ? mc.cv[bb][e] : 0u) * hd + head_off;
                bsb_load<T, D8>(vw[bb][e], vr, base + g * D8, d, okv);
            }
        const u32 bits[2][2] = {{mc.bm[0][0], mc.bm[0][1]}, {mc.bm[1][0], mc.bm[1][1]}};
        if constexpr (PIPE) {
            load_k(kw_fill, mn);
        } else {
            load_k(kw_use, mc);
        }
        bsb_load_step(mc, block_columns, bitmaps, b + 2u * stride, b_end, g, t, upper);
        // The step's blocks are b and b + 1 (bsb_load_step's), whatever the stride.
        auto words = [&](int, u32 blk, u32(&w)[4]) {
            const uint4 w4 = __ldg(reinterpret_cast<const uint4*>(bitmaps) + blk);
            w[0] = w4.x;
            w[1] = w4.y;
            w[2] = w4.z;
            w[3] = w4.w;
        };
        if constexpr (EARLY) {
            xt.begin(b, b_end, upper, words);
            xt.span(b + stride, b_end);
        }

        float p[2][4];
        if constexpr (SPMM) {
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                float w[4];
                bsb_spmm_weights(weights, b + bb, wbase, b + bb < b_end, g, t, w);
                bsb_spmm_p(bits[bb][0] >> shift, bits[bb][1] >> shift, w, p[bb]);
            }
        } else {
            // S (partial over this warp's features): two accumulators per block when the chain
            // is long, so that consecutive mma do not wait on each other.
            constexpr int NACC = NKS >= 4 ? 2 : 1;
            float s[2][4];
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                float sa[NACC][4];
#pragma unroll
                for (int j = 0; j < NACC; ++j)
#pragma unroll
                    for (int i = 0; i < 4; ++i) sa[j][i] = 0.0f;
#pragma unroll
                for (int ks = 0; ks < NKS; ++ks)
                    bsb_qk<T>(sa[ks % NACC], qf[ks], qs[F32 ? ks : 0],
                              kw_use[bb][ks / 2][2 * (ks % 2)],
                              kw_use[bb][ks / 2][2 * (ks % 2) + 1]);
#pragma unroll
                for (int i = 0; i < 4; ++i)
                    s[bb][i] = NACC == 2 ? sa[0][i] + sa[NACC - 1][i] : sa[0][i];
            }
            // Sum of the group's partials, in warp order (identical in every warp).
            if (fs > 1u) {
                float* xb = xs + buf * fs * 256u;
#pragma unroll
                for (int j = 0; j < 8; ++j) xb[(wig * 8u + j) * 32u + lane] = s[j >> 2][j & 3];
                bsb_group_sync(bar, gsize);
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    float acc = 0.0f;
                    for (u32 w = 0; w < fs; ++w) acc += xb[(w * 8u + j) * 32u + lane];
                    s[j >> 2][j & 3] = acc;
                }
                buf ^= 1u;
            }

            if constexpr (X::ON) {
                if constexpr (EARLY)
                    xt.finish(b, b_end, upper, shift);
                else
                    xt.find_step(b, b_end, upper, shift, words);
                bsb_online_step<D8>(s, bits, shift, scale_log2, m, l, p, o, xt);
            } else {
                bsb_online_step<D8>(s, bits, shift, scale_log2, m, l, p, o);
            }
        }

        // O += P V over this warp's features.
        if constexpr (F32) {
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                const u32 a[4] = {to_tf32(p[bb][0]), to_tf32(p[bb][2]), to_tf32(p[bb][1]),
                                  to_tf32(p[bb][3])};
#pragma unroll
                for (int nt = 0; nt < D8; ++nt) {
                    const u32 bv[2] = {to_tf32(__uint_as_float(vw[bb][0][nt])),
                                       to_tf32(__uint_as_float(vw[bb][1][nt]))};
                    mma_m16n8k8_tf32(o[nt], a, bv);
                }
            }
        } else {
            bsb_pv_mma<T, D8>(o, p, vw[0], vw[1]);
        }
    };

    // Prologue: slots of steps 0 and 1, K rows of step 0. Then steps in ping-pong pairs, so
    // that no register holding a load in flight is ever copied.
    BsbStep ma, mb;
    u32 kwa[2][NKC][4], kwb[2][NKC][4];
    bsb_load_step(ma, block_columns, bitmaps, b_begin, b_end, g, t, upper);
    bsb_load_step(mb, block_columns, bitmaps, b_begin + stride, b_end, g, t, upper);
    if constexpr (PIPE) load_k(kwa, ma);
    if constexpr (EARLY) xt.span(b_begin, b_end);
    for (u32 b = b_begin;;) {
        if (b >= b_end) break;
        step(b, kwa, kwb, ma, mb);
        b += stride;
        if (b >= b_end) break;
        step(b, kwb, kwa, mb, ma);
        b += stride;
    }

    // Row sums over the 4 lanes of each group.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
}

// ---- exact merge of a split window's partials -------------------------------------------------
// The partials of one window and head (parts p_first .. p_end): part_ml holds (max, sum) per
// (part, head, window row) in the log2 domain, part_acc the f32 accumulator per (part, head,
// window row, feature < dp). Run by the `gsize` threads of one group (thread gt), synchronised
// at named barrier `bar`; `mrg` is 2 * 16 floats of the group's shared memory. Writes the
// rows_here output rows of the window: row r goes to out row row_ids[row0 + r] (row0 + r when
// row_ids is null), and where lse is non-null its log2-domain log-sum-exp to lse[that row *
// heads + h] (0 for a row without edges). NQ quads of 4 features per thread must cover
// 16 * dp / 4.
template <class T, int NQ>
__device__ __forceinline__ void bsb_merge_parts(const float* part_ml, const float* part_acc,
                                                u32 p_first, u32 p_end, u32 heads, u32 h, u32 dp,
                                                u32 gt, u32 gsize, u32 bar, float* mrg,
                                                u32 rows_here, const u32* __restrict__ row_ids,
                                                u32 row0, T* __restrict__ out,
                                                float* __restrict__ lse, u64 hd, u64 head_off,
                                                u32 d) {
    // Per row (threads 0..15): the global max and 1 / total sum, one pass.
    if (gt < BSB_WINDOW_ROWS) {
        float mm = SPATTN_NEG_INF, ll = 0.0f;
#pragma unroll 4
        for (u32 pp = p_first; pp < p_end; ++pp) {
            const u64 i = (((u64)pp * heads + h) * BSB_WINDOW_ROWS + gt) * 2u;
            const float m2 = __ldcg(part_ml + i), l2 = __ldcg(part_ml + i + 1u);
            const float mnew = fmaxf(mm, m2);
            const float mu = softmax_base(mnew);
            ll = ll * bsb_exp2(mm - mu) + l2 * bsb_exp2(m2 - mu);
            mm = mnew;
        }
        mrg[gt] = softmax_base(mm);
        mrg[BSB_WINDOW_ROWS + gt] = softmax_inv(ll);
        if (lse != nullptr && gt < rows_here)
            lse[(u64)caller_row(row_ids, row0 + gt) * heads + h] = softmax_lse2(mm, ll);
    }
    bsb_group_sync(bar, gsize);
    // Then every (row, 4 features): NQ quads per thread, all of a part's loads in flight at once.
    const u32 quads_per_row = dp / 4u;
    const u32 quads = BSB_WINDOW_ROWS * quads_per_row;
    u32 qrow[NQ], qf4[NQ];
    float4 acc[NQ];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        const u32 i = min(gt + j * gsize, quads - 1u);
        qrow[j] = i / quads_per_row;
        qf4[j] = (i - qrow[j] * quads_per_row) * 4u;
        acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    for (u32 pp = p_first; pp < p_end; ++pp) {
        const u64 r0 = ((u64)pp * heads + h) * BSB_WINDOW_ROWS;
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            const u64 r = r0 + qrow[j];
            const float c = bsb_exp2(__ldcg(part_ml + r * 2u) - mrg[qrow[j]]);
            const float4 a = __ldcg(reinterpret_cast<const float4*>(part_acc + r * dp + qf4[j]));
            acc[j].x += a.x * c;
            acc[j].y += a.y * c;
            acc[j].z += a.z * c;
            acc[j].w += a.w * c;
        }
    }
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        if (qrow[j] >= rows_here || gt + j * gsize >= quads) continue;
        const float inv = mrg[BSB_WINDOW_ROWS + qrow[j]];
        const float y[4] = {acc[j].x * inv, acc[j].y * inv, acc[j].z * inv, acc[j].w * inv};
        const u32 orow = caller_row(row_ids, row0 + qrow[j]);
        bsb_store<T, 4>(out + (u64)orow * hd + head_off, qf4[j], d, y);
    }
}

// The end of a unit of a split window, after it wrote its partials (part_ml, part_acc) for its
// part: the group (`gsize` threads, thread gt, named barrier `bar`) counts its arrival on the
// window's counter for head h, and the last part to arrive merges every part of the window
// (bsb_merge_parts) into the output rows (and lse, where non-null) and resets the counter for
// the next launch. `mrg` is the group's BSB_MERGE_FLOATS of shared memory.
template <class T, int NQ>
__device__ __forceinline__ void bsb_finish_split(
    u32 split, const u32* __restrict__ split_part_first, u32* __restrict__ counters, u32 heads,
    u32 h, u32 dp, u32 gt, u32 gsize, u32 bar, float* mrg, const float* part_ml,
    const float* part_acc, u32 n_rows, u32 window, const u32* __restrict__ row_ids,
    T* __restrict__ out, float* __restrict__ lse, u64 hd, u64 head_off, u32 d) {
    __threadfence();
    bsb_group_sync(bar, gsize);
    const u32 p_first = split_part_first[split], p_end = split_part_first[split + 1u];
    u32* counter = counters + (u64)split * heads + h;
    u32* flag = reinterpret_cast<u32*>(mrg + 2u * BSB_WINDOW_ROWS);
    if (gt == 0u) *flag = atomicAdd(counter, 1u) == p_end - p_first - 1u ? 1u : 0u;
    bsb_group_sync(bar, gsize);
    if (*flag == 0u) return;
    __threadfence();

    const u32 rows_here = min(BSB_WINDOW_ROWS, n_rows - window * BSB_WINDOW_ROWS);
    bsb_merge_parts<T, NQ>(part_ml, part_acc, p_first, p_end, heads, h, dp, gt, gsize, bar,
                                mrg, rows_here, row_ids, window * BSB_WINDOW_ROWS, out, lse, hd,
                                head_off, d);
    if (gt == 0u) *counter = 0u;  // ready for the next launch
}

// ---- the pipelined tensor-core tile loop: K and V tiles through shared memory -----------------
// f16/bf16 heads of exactly D features (64 or 128), one warp per (unit, head) (fused_bsb_pipe in
// fused_bsb.cu, and the tensor-core warps of hybrid.cu's pipelined kernel). The registers of
// fused_bsb's 128-feature slice hold the K rows of the next step and the V rows of this one in
// flight (255 registers under the CUDA 13 JIT: one or two warps per scheduler). Here cp.async
// copies each step's 16 K rows, 16 V rows and two bitmaps into shared memory, STAGES steps
// ahead, and the warp reads them with ldmatrix: registers hold only the Q fragments, the f32
// accumulator and one step's scores.
//
// Per warp and stage (bsb_pipe_stage_bytes, mirrored by the host): the K tile (16 slots x D
// features: slot r's 16-byte chunk c stored at chunk c ^ (r & 7) of its row, so that the 8 rows
// one ldmatrix reads fall in 8 different bank groups), the V tile (same layout), the 32
// bytes of the two blocks' bitmaps, and in fused_bsb's `_x` kernel the step's staged extras
// (bsb_pipe_x_bytes, BsbStagedExtras). After the stages: the warp's BSB_MERGE_FLOATS of merge
// scratch (bsb_pipe_warp_bytes in all).
//
// Fragments, natural feature order (g = lane / 4, t = lane % 4):
// - Q (A of S = Q K^T, k-step ks): a[0] = Q[g][16ks + 2t, +1], a[1] = the same of row g + 8,
//   a[2], a[3] the same at feature + 8. Loaded once, 4 bytes at a time.
// - K (B, col): ldmatrix of the block's 8 slot rows, chunks 2ks and 2ks + 1.
// - V (B of P V, k = 16 slots, n-tile nt = features 8nt .. 8nt + 7): ldmatrix.trans.
// - O: o[nt][0], o[nt][1] = O[g][8nt + 2t, +1]; o[nt][2], o[nt][3] the same of row g + 8.
//
// SpMM (SPMM true, hybrid.cu's pipelined SpMM): no Q and no K tile; a stage holds the V tile
// and the bitmaps only, and P is the bitmap (times the slot weights of a weighted matrix).

// Steps in flight per warp (the host mirrors it).
#define BSB_PIPE_STAGES 3
// x_bytes: the stage's staged extras (the extras' X_BYTES: bsb_pipe_x_bytes, or 0).
__host__ __device__ constexpr u32 bsb_pipe_stage_bytes(u32 d, bool spmm = false,
                                                       u32 x_bytes = 0u) {
    return (spmm ? 1u : 2u) * 16u * d * 2u + 32u + x_bytes;
}
__host__ __device__ constexpr u32 bsb_pipe_warp_bytes(u32 d, bool spmm = false,
                                                      u32 x_bytes = 0u) {
    return BSB_PIPE_STAGES * bsb_pipe_stage_bytes(d, spmm, x_bytes) + BSB_MERGE_FLOATS * 4u;
}

// Words per unit of the fused kernel's prologue record (unit_pre; the host mirrors it,
// `PRE_WORDS` in fused_tc.rs): the columns of the unit's first two steps (slot l of step s at
// word 16s + l, SPATTN_NONE past the unit), then the caller rows of its window's 16 rows
// (SPATTN_NONE past the matrix). Indexed by the unit alone, so that a warp's first copies and
// Q loads wait for one load, not for the unit's descriptor and then the column ids / row ids.
#define BSB_PIPE_PRE_WORDS 48u

// One step's copies of 16 gathered rows into a stage's tiles: slot r holds the row of column
// __shfl(col, src + r) (SPATTN_NONE: zeros), its 16-byte chunk c at byte r * ROW + (c ^ (r & 7))
// * 16 of the tile (the 8 rows one ldmatrix reads fall in 8 bank groups). A lane copies chunk
// lane % CH of slots lane / CH + (32 / CH) i, of x into the tile at x_off (when X) and of y into
// the tile at y_off; chunks at or past `chunks` are zero-filled (a head narrower than the tile).
template <class T, u32 CH, u32 ROW, bool X>
__device__ __forceinline__ void bsb_pipe_copy_rows(u32 sk, u32 x_off, u32 y_off,
                                                   const T* __restrict__ x,
                                                   const T* __restrict__ y, u32 col, u32 src,
                                                   u64 hd, u64 head_off, u32 chunks) {
    constexpr u32 RPO = 32u / CH;  // rows one warp-wide copy covers
    static_assert(CH * 16u <= ROW && ROW % 128u == 0u, "a tile row holds 8 swizzled chunks");
    const u32 lane = lane_id();
    const u32 cc = lane % CH, rr = lane / CH;
#pragma unroll
    for (u32 i = 0; i < 16u / RPO; ++i) {
        const u32 r = rr + RPO * i;
        const u32 cr = __shfl_sync(0xffffffffu, col, src + r);
        const bool ok = cr != SPATTN_NONE && cc < chunks;
        const u64 off = ok ? (u64)cr * hd + head_off + cc * 8u : 0u;
        const u32 dst = r * ROW + ((cc ^ (r & 7u)) * 16u);
        if (X) cp_async_16(sk + x_off + dst, x + off, ok);
        cp_async_16(sk + y_off + dst, y + off, ok);
    }
}

// The column of slot lane % 16 of step s (block b_begin + 2s + slot / 8) of a pipelined warp's
// unit of `steps` steps over blocks b_begin .. b_end; SPATTN_NONE past the unit.
__device__ __forceinline__ u32 bsb_pipe_step_col(const u32* __restrict__ block_columns,
                                                 u32 b_begin, u32 b_end, u32 steps, u32 s,
                                                 u32 lane) {
    const u32 blk = b_begin + 2u * s + ((lane >> 3) & 1u);
    return (s < steps && blk < b_end) ? __ldg(block_columns + (u64)blk * 8u + (lane & 7u))
                                      : SPATTN_NONE;
}

// The staged extras' span bounds of step s in lanes 16 and 17 (BsbStagedExtras::prefetch),
// loaded a step before the step's copies; 0 past the unit's last step and for extras that are
// not staged.
template <class X>
__device__ __forceinline__ u32 bsb_pipe_step_span(const X& xt, u32 b_begin, u32 b_end, u32 steps,
                                                  u32 s) {
    if constexpr (X::STAGED) {
        return s < steps ? xt.prefetch(b_begin + 2u * s, b_end) : 0u;
    } else {
        return 0u;
    }
}

// What a pipelined warp loads for step s, one load a lane: lanes 0-15 the columns of its slots
// (bsb_pipe_step_col); with a staged bias lanes 16 and 17 its span bounds (bsb_pipe_step_span),
// else lanes 16-31 the columns again (the copies read lanes 0-15). One register and one load
// instruction a step: a second load a step for the span put a long-scoreboard stall on the
// copies' column shuffle (docs/kernels/backward.md).
template <class X>
__device__ __forceinline__ u32 bsb_pipe_step_ids(const u32* __restrict__ block_columns, const X& xt,
                                                 u32 b_begin, u32 b_end, u32 steps, u32 s,
                                                 u32 lane) {
    if constexpr (X::STAGED) {
        if constexpr (X::SPAN) {
            if (lane >= 16u) return bsb_pipe_step_span(xt, b_begin, b_end, steps, s);
        }
    }
    return bsb_pipe_step_col(block_columns, b_begin, b_end, steps, s, lane);
}

// The two bitmaps of step s (16 bytes a block; zeros past b_end) copied to shared address
// `dst` by lanes 0 and 1.
__device__ __forceinline__ void bsb_pipe_copy_bitmaps(u32 dst, const u32* __restrict__ bitmaps,
                                                      u32 b_begin, u32 b_end, u32 s, u32 lane) {
    if (lane < 2u) {
        const u32 blk = b_begin + 2u * s + lane;
        const bool ok = blk < b_end;
        cp_async_16(dst + 16u * lane, bitmaps + (ok ? (u64)blk * 4u : 0u), ok);
    }
}

// The A fragments (NKS k-steps, natural feature order: a[0] = row g, features 16ks + 2t, +1;
// a[1] the same of row g + 8; a[2], a[3] at feature + 8) of window rows rows[0] (g) and rows[1]
// (g + 8) of x at head_off: 4-byte streaming loads (read once: evict first), zeros for a row past
// the matrix (SPATTN_NONE) and for features at or past d (a multiple of 8).
template <class T, int NKS>
__device__ __forceinline__ void bsb_window_afrag(u32 (&f)[NKS][4], const T* __restrict__ x,
                                                 const u32 (&rows)[2], u64 hd, u64 head_off,
                                                 u32 d) {
    const u32 t = lane_id() & 3u;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32* xr = reinterpret_cast<const u32*>(
            x + (rows[r] != SPATTN_NONE ? (u64)rows[r] * hd + head_off : 0u));
#pragma unroll
        for (int ks = 0; ks < NKS; ++ks)
#pragma unroll
            for (int half = 0; half < 2; ++half)
                f[ks][r + 2 * half] = rows[r] != SPATTN_NONE && 16u * ks + 8u * half < d
                                          ? __ldcs(xr + 8 * ks + 4 * half + t)
                                          : 0u;
    }
}

// s = A B^T for block bb (0 or 1) of a step: A the window's fragments (bsb_window_afrag), B the
// block's 8 rows of `tile` (bsb_pipe_copy_rows' layout, rows of ROW bytes) by ldmatrix; two
// accumulators for two independent mma chains.
template <class T, int NKS, u32 ROW>
__device__ __forceinline__ void bsb_tile_scores(float (&s)[4], const u32 (&f)[NKS][4], u32 tile,
                                                u32 bb) {
    static_assert(NKS % 2 == 0, "k-steps in pairs: one ldmatrix_x4 covers 32 features");
    const u32 lane = lane_id(), mq = lane >> 3, mr = lane & 7u;
    float sa[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
    const u32 row = tile + (bb * 8u + mr) * ROW;
#pragma unroll
    for (int kk = 0; kk < NKS / 2; ++kk) {
        u32 r[4];
        ldmatrix_x4(r, row + (((4u * kk + mq) ^ mr) * 16u));
        const u32 b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        mma_m16n8k16(sa[0], f[2 * kk], b0, T());
        mma_m16n8k16(sa[1], f[2 * kk + 1], b1, T());
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) s[j] = sa[0][j] + sa[1][j];
}

// o += A B over a step's 16 slots: A the step's per-entry values p[bb][i] (row g + 8 (i / 2),
// slot 8 bb + 2t + i % 2: P or dS) rounded to T, B the tile's 16 rows (bsb_pipe_copy_rows'
// layout) transposed by ldmatrix; o in natural feature order (n-tile nt: features 8nt .. + 7;
// o[nt][0], o[nt][1] = row g, features 8nt + 2t, +1; o[nt][2], o[nt][3] row g + 8).
template <class T, int NT, u32 ROW>
__device__ __forceinline__ void bsb_tile_pv(float (&o)[NT][4], const float (&p)[2][4], u32 tile) {
    const u32 lane = lane_id(), mq = lane >> 3, mr = lane & 7u;
    const u32 a[4] = {pack2<T>(p[0][0], p[0][1]), pack2<T>(p[0][2], p[0][3]),
                      pack2<T>(p[1][0], p[1][1]), pack2<T>(p[1][2], p[1][3])};
    const u32 vrow = tile + (((mq & 1u) << 3) + mr) * ROW;
#pragma unroll
    for (int j = 0; j < NT / 2; ++j) {
        u32 r[4];
        ldmatrix_x4_trans(r, vrow + (((2u * j + (mq >> 1)) ^ mr) * 16u));
        const u32 b0[2] = {r[0], r[1]}, b1[2] = {r[2], r[3]};
        mma_m16n8k16(o[2 * j], a, b0, T());
        mma_m16n8k16(o[2 * j + 1], a, b1, T());
    }
}

// The caller's rows (Q, out) of window rows g = lane / 4 and g + 8 of `window`: through row_ids
// when the plan renumbered the rows, SPATTN_NONE past the matrix.
__device__ __forceinline__ void bsb_pipe_qrows(const u32* __restrict__ row_ids, u32 window,
                                               u32 n_rows, u32 (&qrow)[2]) {
    const u32 row0 = window * BSB_WINDOW_ROWS + (lane_id() >> 2);
    qrow[0] = row0 < n_rows ? caller_row(row_ids, row0) : SPATTN_NONE;
    qrow[1] = row0 + 8u < n_rows ? caller_row(row_ids, row0 + 8u) : SPATTN_NONE;
}

// Bytes a pipelined stage carries beyond its K and V tiles and bitmaps for extras X: the
// staged extras, and with edge features the tile of the step's first 16 edges' rows.
template <class X>
__host__ __device__ constexpr u32 bsb_pipe_extra_bytes(u32 d) {
    return X::X_BYTES + (X::FEATS ? 32u * d : 0u);
}

// A pipelined warp's shared memory: its stages (extra bytes `xb` a stage) and merge scratch,
// and with edge features their scratch after it: BSB_FEAT_FLOATS floats, then the tile of a
// step's chunks past its first.
__host__ __device__ constexpr u32 bsb_pipe_feat_warp_bytes(u32 d, u32 xb, bool feats) {
    return bsb_pipe_warp_bytes(d, false, xb) + (feats ? 4u * BSB_FEAT_FLOATS + 32u * d : 0u);
}

// The pipelined kernels' feature spans (lane 0: step s's first edge, lane 1: the edge past its
// last; 0 in both past the unit), and the caller ids of a span's first 16 edges (lane l < 16:
// edge l's, NONE past the span), so that a step's feature rows are copied with its K and V.
__device__ __forceinline__ u32 bsb_pipe_feat_span(const u32* __restrict__ starts, u32 b_begin,
                                                  u32 b_end, u32 steps, u32 s) {
    const u32 lane = lane_id();
    if (lane >= 2u || s >= steps) return 0u;
    const u32 blk = b_begin + 2u * s;
    return __ldg(starts + (lane == 0u ? blk : min(blk + 2u, b_end)));
}
__device__ __forceinline__ u32 bsb_pipe_feat_ids(const u32* __restrict__ edge_ids, u32 span) {
    const u32 lane = lane_id();
    const u32 first = __shfl_sync(0xffffffffu, span, 0), end = __shfl_sync(0xffffffffu, span, 1);
    return lane < 16u && first + lane < end ? __ldg(edge_ids + first + lane) : SPATTN_NONE;
}

// The feature rows of edges first .. first + cnt (cnt <= 16) of a step, for `tile` (shared,
// bsb_pipe_copy_rows' layout, zeros past cnt), by plain loads into registers (x: rows rr + RPO i,
// chunk lane % CH) then stores (bsb_pipe_feat_store), outside the cp.async groups: the chunks
// of a step past its first 16 edges. Every slot loads from a valid address (edge 0's row past
// cnt) and the returned bits say which hold a row (bit i: x[i]); the store zeroes the others,
// so that no select waits on the loads before the store.
template <class T, u32 CH>
__device__ __forceinline__ u32 bsb_pipe_feat_load(uint4 (&x)[CH / 2], const T* __restrict__ feats,
                                                  const u32* __restrict__ edge_ids, u32 first,
                                                  u32 cnt, u64 hd, u64 head_off) {
    constexpr u32 RPO = 32u / CH;  // rows one warp-wide load covers
    static_assert(16u / RPO == CH / 2, "16 rows of CH chunks over 32 lanes");
    const u32 lane = lane_id(), cc = lane % CH, rr = lane / CH;
    const u32 id = lane < cnt ? __ldg(edge_ids + first + lane) : SPATTN_NONE;
    u32 ok = 0u;
#pragma unroll
    for (u32 i = 0; i < CH / 2; ++i) {
        const u32 cr = __shfl_sync(0xffffffffu, id, rr + RPO * i);
        const bool on = cr != SPATTN_NONE;
        x[i] = __ldg(reinterpret_cast<const uint4*>(feats + (on ? (u64)cr * hd + head_off : 0u)) +
                     (on ? cc : 0u));
        ok |= (on ? 1u : 0u) << i;
    }
    return ok;
}
template <u32 CH, u32 ROW>
__device__ __forceinline__ void bsb_pipe_feat_store(unsigned char* tile, const uint4 (&x)[CH / 2],
                                                    u32 ok) {
    constexpr u32 RPO = 32u / CH;
    const u32 lane = lane_id(), cc = lane % CH, rr = lane / CH;
    __syncwarp();  // the tile's previous chunk is read
#pragma unroll
    for (u32 i = 0; i < CH / 2; ++i) {
        const u32 r = rr + RPO * i;
        *reinterpret_cast<uint4*>(tile + r * ROW + ((cc ^ (r & 7u)) * 16u)) =
            (ok >> i) & 1u ? x[i] : make_uint4(0u, 0u, 0u, 0u);
    }
    __syncwarp();
}
template <class T, u32 CH, u32 ROW>
__device__ __forceinline__ void bsb_pipe_feat_fill(unsigned char* tile, const T* __restrict__ feats,
                                                   const u32* __restrict__ edge_ids, u32 first,
                                                   u32 cnt, u64 hd, u64 head_off) {
    uint4 x[CH / 2];
    const u32 ok = bsb_pipe_feat_load<T, CH>(x, feats, edge_ids, first, cnt, hd, head_off);
    bsb_pipe_feat_store<CH, ROW>(tile, x, ok);
}

// One warp's pass over blocks b_begin .. b_end of one window (steps of two blocks) for head
// `head_off / D`: Q rows qrow[0] (window row g) and qrow[1] (row g + 8), SPATTN_NONE past the
// matrix. `smem` is the warp's bsb_pipe_warp_bytes(D, SPMM, bsb_pipe_extra_bytes<X>(D)) of
// shared memory (edge features: their scratch follows, bsb_pipe_feat_warp_bytes). On
// return every copy has landed (the stages may be reused), m[r] is the running max of row
// g + 8r in the log2 domain (-inf where the warp saw no edge of the row), l[r] its sum (the
// same in the row's 4 lanes) and o the f32 accumulator (layout above).
// SpMM: q, k and scale_log2 are not read; P is the bitmap, times `weights` when given (128
// floats per block, block b's at (b + wbase) * 128, slot r * 8 + c; wbase wraps); m and l are
// left at 0 (the caller sets the sums its merge needs).
// PRE: col01 holds, in lane j, word j of the unit's prologue record (the columns of steps 0 and
// 1, BSB_PIPE_PRE_WORDS), so the first two steps' copies need no column-id load.
template <class T, int D, bool SPMM = false, bool PRE = false, class X = NoBsbExtras>
__device__ __forceinline__ void bsb_pipe_tiles(
    unsigned char* smem, u32 b_begin, u32 b_end, const u32 (&qrow)[2], const T* __restrict__ q,
    const u32* __restrict__ block_columns, const u32* __restrict__ bitmaps,
    const T* __restrict__ k, const T* __restrict__ v, u64 hd, u64 head_off, float scale_log2,
    const float* __restrict__ weights, u32 wbase, float (&m)[2], float (&l)[2],
    float (&o)[D / 8][4], u32 col01 = 0u, X xt = X()) {
    static_assert(sizeof(T) == 2 && (D == 64 || D == 128), "f16 / bf16, 64 or 128 features");
    static_assert(!(SPMM && X::ON), "no extras in the SpMM");
    constexpr bool STAGED = X::STAGED;  // the extras travel in the stages (BsbStagedExtras)
    constexpr bool FEATS = X::FEATS;    // edge features (BsbFeatExtras): their tile too
    constexpr int STAGES = BSB_PIPE_STAGES;
    constexpr u32 CH = D / 8;               // 16-byte chunks of a row
    constexpr u32 ROW = CH * 16u;           // bytes of a row
    constexpr u32 TILE = 16u * ROW;         // bytes of the K (or V) tile of one step
    constexpr u32 STAGE = bsb_pipe_stage_bytes(D, SPMM, bsb_pipe_extra_bytes<X>(D));
    constexpr u32 VOFF = SPMM ? 0u : TILE;  // the V tile's offset in a stage (K's is 0)
    constexpr u32 BOFF = VOFF + TILE;       // the bitmaps' offset
    constexpr u32 XOFF = BOFF + 32u;        // the staged extras' offset
    constexpr u32 EOFF = XOFF + X::X_BYTES; // the features' tile (FEATS)
    constexpr int NKS = D / 16;             // k-steps of S
    constexpr int NT = D / 8;               // n-tiles of O
    static_assert(STAGE == XOFF + bsb_pipe_extra_bytes<X>(D), "stage layout");
    static_assert(!(FEATS && (SPMM || STAGED)), "features beside unstaged extras only");

    const u32 lane = lane_id();
    const u32 base_s = smem_addr(smem);
    const u32 steps = (b_end - b_begin + 1u) / 2u;
    const u32 g = lane >> 2, t = lane & 3u;

    // Step s's columns (lanes 0-15) and staged extras' span (lanes 16, 17): bsb_pipe_step_ids.
    auto ids_of = [&](u32 s) {
        return bsb_pipe_step_ids(block_columns, xt, b_begin, b_end, steps, s, lane);
    };
    auto span_of = [&](u32 s) { return bsb_pipe_step_span(xt, b_begin, b_end, steps, s); };
    // Features: step s's span and the ids of its first 16 edges, then its rows with its copies.
    auto fspan_of = [&](u32 s) {
        if constexpr (FEATS) {
            return bsb_pipe_feat_span(xt.block_edge_start, b_begin, b_end, steps, s);
        } else {
            return 0u;
        }
    };
    auto fids_of = [&](u32 span) {
        if constexpr (FEATS) {
            return bsb_pipe_feat_ids(xt.edge_ids, span);
        } else {
            return SPATTN_NONE;
        }
    };
    // The copies of step s (its columns in col, lane src + l holding slot l; staged extras:
    // its span bounds `span`; features: lane l < 16 the caller id of its edge l in fid) into
    // stage s % STAGES, then a commit (an empty group past the last step keeps the count
    // uniform).
    auto issue = [&](u32 s, u32 col, u32 src, u32 span, u32 fid) {
        if (s < steps) {
            const u32 sk = base_s + (s % STAGES) * STAGE;
            bsb_pipe_copy_rows<T, CH, ROW, !SPMM>(sk, 0u, VOFF, k, v, col, src, hd, head_off, CH);
            bsb_pipe_copy_bitmaps(sk + BOFF, bitmaps, b_begin, b_end, s, lane);
            if constexpr (STAGED) xt.issue(sk + XOFF, span, b_begin + 2u * s, b_end);
            if constexpr (FEATS)
                bsb_pipe_copy_rows<T, CH, ROW, false>(sk, 0u, EOFF, xt.feats, xt.feats, fid, 0u,
                                                      hd, head_off, CH);
        }
        cp_async_commit();
    };

    // Q fragments. Q is read once and out written once: both streaming (evict first), so that L2
    // keeps the K and V rows that windows share.
    u32 qf[NKS][4];
    if constexpr (!SPMM) bsb_window_afrag<T, NKS>(qf, q, qrow, hd, head_off, D);

    // Features: the ids of steps 0 .. STAGES - 1 and the span of step STAGES; then in step i
    // the copies of step i + STAGES - 1 take the ids loaded in step i - 1 (fids), and the ids of
    // step i + STAGES are loaded from the span loaded in step i - 1 (fspan).
    static_assert(STAGES == 3, "the features' prologue loads three steps' ids");
    u32 fid01[2] = {SPATTN_NONE, SPATTN_NONE}, fids = SPATTN_NONE, fspan = 0u;
    if constexpr (FEATS) {
        const u32 sp[3] = {fspan_of(0u), fspan_of(1u), fspan_of(2u)};
        fspan = fspan_of(3u);
        fid01[0] = fids_of(sp[0]);
        fid01[1] = fids_of(sp[1]);
        fids = fids_of(sp[2]);
    }

    // Prologue: steps 0 .. STAGES - 2 in flight, the columns (and span) of step STAGES - 1
    // loaded.
    u32 col_next;
    if constexpr (PRE) {
        static_assert(STAGES == 3, "the prologue record holds the first STAGES - 1 = 2 steps");
        col_next = ids_of(2u);
        const u32 span0 = span_of(0u), span1 = span_of(1u);
        issue(0u, col01, 0u, span0, fid01[0]);
        issue(1u, col01, 16u, span1, fid01[1]);
    } else {
        col_next = ids_of(0u);
#pragma unroll
        for (u32 s = 0; s + 1u < (u32)STAGES; ++s) {
            const u32 c = col_next;
            col_next = ids_of(s + 1u);
            issue(s, c, 0u, c, fid01[s]);
        }
    }

    m[0] = m[1] = SPMM ? 0.0f : SPATTN_NEG_INF;
    l[0] = l[1] = 0.0f;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.0f;
    const u32 shift = 8u * (g & 3u) + 2u * t, upper = g >= 4u ? 1u : 0u;

    for (u32 i = 0; i < steps; ++i) {
        // SpMM weights of this lane's entries (rows g, g + 8; slots 2t, 2t + 1), loaded before
        // the wait so that their latency overlaps it.
        float w[2][4];
#pragma unroll
        for (int bb = 0; bb < 2 && SPMM; ++bb) {
            const u32 blk = b_begin + 2u * i + bb;
            bsb_spmm_weights(weights, blk, wbase, blk < b_end, g, t, w[bb]);
        }
        cp_async_wait<STAGES - 2>();
        __syncwarp();  // step i's copies by every lane are visible; step i - 1 is read
        {
            const u32 c = col_next;
            col_next = ids_of(i + STAGES);
            issue(i + STAGES - 1u, c, 0u, c, fids);
            if constexpr (FEATS) {
                fids = fids_of(fspan);
                fspan = fspan_of(i + STAGES + 1u);
            }
        }
        const u32 st = i % STAGES;
        const u32 sk = base_s + st * STAGE, sv = sk + VOFF;
        const u32* bw = reinterpret_cast<const u32*>(smem + st * STAGE + BOFF);
        const u32 bits[2][2] = {{bw[upper], bw[2u + upper]}, {bw[4u + upper], bw[6u + upper]}};
        if constexpr (STAGED) {
            // The step's extras, landed in the stage with its tiles.
            xt.load(smem + st * STAGE + XOFF, bw, upper, shift);
        } else if constexpr (X::ON) {
            // The step's blocks and their bitmaps (in the stage, 4 words each), their extras
            // loaded before S so that the loads overlap its mma.
            xt.find_step(b_begin + 2u * i, b_end, upper, shift, [&](int bb, u32, u32(&w)[4]) {
#pragma unroll
                for (int x = 0; x < 4; ++x) w[x] = bw[4 * bb + x];
            });
        }
        float p[2][4];
        if constexpr (SPMM) {
#pragma unroll
            for (int bb = 0; bb < 2; ++bb)
                bsb_spmm_p(bits[bb][0] >> shift, bits[bb][1] >> shift, w[bb], p[bb]);
        } else {
            // Features: the rows of the step's second chunk of 16 edges, if any, loaded
            // before S (their latency overlaps it; later chunks are loaded as they come).
            uint4 f1[FEATS ? CH / 2 : 1];
            u32 f1_ok = 0u;
            if constexpr (FEATS) {
                const u32 n = xt.count[0] + xt.count[1];
                if (n > 16u)
                    f1_ok = bsb_pipe_feat_load<T, CH>(f1, xt.feats, xt.edge_ids, xt.base[0] + 16u,
                                                      min(16u, n - 16u), hd, head_off);
            }
            // S = Q K^T of the two blocks.
            float s[2][4];
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) bsb_tile_scores<T, NKS, ROW>(s[bb], qf, sk, bb);
            if constexpr (FEATS) {
                // + <q, f> of the step's edges: X = Q F^T of each chunk of 16 from a tile in
                // K's layout (the first in the stage, later ones in the overflow tile).
                const u32 first = xt.base[0], n = xt.count[0] + xt.count[1];
                bsb_feat_rows(xt, first);
#pragma unroll 1
                for (u32 c0 = 0; c0 < n; c0 += 16u) {  // warp-uniform
                    u32 tile = sk + EOFF;
                    if (c0 == 16u) {
                        bsb_pipe_feat_store<CH, ROW>(xt.ovf, f1, f1_ok);
                        tile = smem_addr(xt.ovf);
                    } else if (c0 > 16u) {
                        bsb_pipe_feat_fill<T, CH, ROW>(xt.ovf, xt.feats, xt.edge_ids, first + c0,
                                                       min(16u, n - c0), hd, head_off);
                        tile = smem_addr(xt.ovf);
                    }
                    float x[2][4];
                    bsb_tile_scores<T, NKS, ROW>(x[0], qf, tile, 0u);
                    bsb_tile_scores<T, NKS, ROW>(x[1], qf, tile, 1u);
                    bsb_feat_keep(xt, x, c0, n);
                }
                bsb_feat_add(xt, s, first);
            }
            if constexpr (X::ON) {
                bsb_online_step<NT>(s, bits, shift, scale_log2, m, l, p, o, xt);
            } else {
                bsb_online_step<NT>(s, bits, shift, scale_log2, m, l, p, o);
            }
        }

        // O += P V: A = P of the 16 slots, B = V from the tile, transposed by ldmatrix.
        bsb_tile_pv<T, NT, ROW>(o, p, sv);
        if constexpr (FEATS) {
            // + P' F of the step's edges, chunk by chunk as for the scores, last chunk first:
            // the overflow tile still holds it.
            const u32 first = xt.base[0], n = xt.count[0] + xt.count[1];
            const u32 last = n > 0u ? (n - 1u) & ~15u : 0u;
            bsb_feat_put(xt, p, first);
#pragma unroll 1
            for (u32 c0 = last; c0 < n; c0 -= 16u) {  // warp-uniform; ends past 0 by wrapping
                u32 tile = sk + EOFF;
                if (c0 > 0u) {
                    if (c0 != last)
                        bsb_pipe_feat_fill<T, CH, ROW>(xt.ovf, xt.feats, xt.edge_ids, first + c0,
                                                       min(16u, n - c0), hd, head_off);
                    tile = smem_addr(xt.ovf);
                }
                float pp[2][4];
                bsb_feat_chunk_p(xt, pp, c0, n);
                bsb_tile_pv<T, NT, ROW>(o, pp, tile);
            }
        }
    }
    cp_async_wait<0>();  // no copy may land in shared memory after this

#pragma unroll
    for (int r = 0; r < 2 && !SPMM; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
}

// The end of a pipelined warp's unit: a whole window (part SPATTN_NONE) normalises and writes
// its rows qrow (zeros for a row without edges) and, where lse is non-null, their log2-domain
// log-sum-exp (0 without edges; not SpMM); a part of split window `split` leaves its
// partial (m, l and the accumulator of rows g, g + 8) in part_ml / part_acc and the last part to
// arrive merges them (bsb_finish_split, with the merge scratch after the stages of the warp's
// shared memory `smem`). SpMM: the accumulator is the sum itself (m and l are not read).
template <class T, int D, bool SPMM = false, u32 X_BYTES = 0u>
__device__ __forceinline__ void bsb_pipe_finish(
    u32 part, u32 split, const u32* __restrict__ split_part_first, u32* __restrict__ counters,
    u32 heads, u32 h, unsigned char* smem, float* __restrict__ part_ml, float* __restrict__ part_acc,
    u32 n_rows, u32 window, const u32* __restrict__ row_ids, T* __restrict__ out,
    float* __restrict__ lse, u64 hd, u64 head_off, const u32 (&qrow)[2], const float (&m)[2],
    const float (&l)[2], const float (&o)[D / 8][4]) {
    constexpr int NT = D / 8;
    const u32 lane = lane_id(), g = lane >> 2, t = lane & 3u;
    if (part == SPATTN_NONE) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            if (qrow[r] == SPATTN_NONE) continue;
            const float inv = SPMM ? 1.0f : softmax_inv(l[r]);
            if (!SPMM && lse != nullptr && t == 0u)
                lse[(u64)qrow[r] * heads + h] = softmax_lse2(m[r], l[r]);
            u32* orow = reinterpret_cast<u32*>(out + (u64)qrow[r] * hd + head_off);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                __stcs(orow + 4 * nt + t, pack2<T>(o[nt][2 * r] * inv, o[nt][2 * r + 1] * inv));
        }
        return;
    }
    const u64 slot = (u64)part * heads + h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u64 wr = slot * BSB_WINDOW_ROWS + g + 8u * r;
        if (t == 0u) {
            // SpMM: plain sums, merged unscaled (max 0) and divided by 1 (the first part's sum).
            part_ml[wr * 2u] = SPMM ? 0.0f : m[r];
            part_ml[wr * 2u + 1u] = SPMM ? (part == split_part_first[split] ? 1.0f : 0.0f) : l[r];
        }
        float2* arow = reinterpret_cast<float2*>(part_acc + wr * D);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) arow[4 * nt + t] = make_float2(o[nt][2 * r], o[nt][2 * r + 1]);
    }
    float* mrg =
        reinterpret_cast<float*>(smem + BSB_PIPE_STAGES * bsb_pipe_stage_bytes(D, SPMM, X_BYTES));
    bsb_finish_split<T, NT>(split, split_part_first, counters, heads, h, D, lane, 32u, 0u,
                                  mrg, part_ml, part_acc, n_rows, window, row_ids, out,
                                  SPMM ? nullptr : lse, hd, head_off, D);
}

// ---- the CUDA-core edge loops ------------------------------------------------------------------
// SpMM: acc += w_e V[col_e] over edges start .. end of col_indices (w_e = weights[e], or 1 when
// weights is null), lane features as below; 4 edges' V vectors in flight, summed in edge order.
template <class T, int VEC, int NV>
__device__ __forceinline__ void csr_edges_sum(const u32* __restrict__ col_indices,
                                              const float* __restrict__ weights, u32 start,
                                              u32 end, const T* __restrict__ v, u64 hd,
                                              u64 head_off, const bool (&on)[NV],
                                              const u32 (&feat)[NV], float (&acc)[NV][VEC]) {
    u32 e = start;
    for (; e + 4 <= end; e += 4) {
        u32 c[4];
        float w[4], x[4][NV][VEC];
#pragma unroll
        for (int t = 0; t < 4; ++t) {
            c[t] = __ldg(col_indices + e + t);
            w[t] = weights != nullptr ? __ldg(weights + e + t) : 1.0f;
        }
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int j = 0; j < NV; ++j)
                if (on[j]) load_vec<T, VEC>(v + (u64)c[t] * hd + head_off + feat[j], x[t][j]);
#pragma unroll
        for (int t = 0; t < 4; ++t)
#pragma unroll
            for (int j = 0; j < NV; ++j)
                if (on[j])
#pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[j][i] = fmaf(w[t], x[t][j][i], acc[j][i]);
    }
    for (; e < end; ++e) {
        const u32 c = __ldg(col_indices + e);
        const float w = weights != nullptr ? __ldg(weights + e) : 1.0f;
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            if (on[j]) {
                float x[VEC];
                load_vec<T, VEC>(v + (u64)c * hd + head_off + feat[j], x);
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[j][i] = fmaf(w, x[i], acc[j][i]);
            }
        }
    }
}

// Folds a tile's TILE (a power of two) values pairwise, neighbours first: op(op(x0, x1),
// op(x2, x3)) for 4 (the tile's sum and max in csr_edges_online).
template <int TILE, class Op>
__device__ __forceinline__ float tile_fold(const float (&x)[TILE], Op op) {
    float y[TILE];
#pragma unroll
    for (int t = 0; t < TILE; ++t) y[t] = x[t];
#pragma unroll
    for (int w = TILE / 2; w > 0; w /= 2)
#pragma unroll
        for (int t = 0; t < w; ++t) y[t] = op(y[2 * t], y[2 * t + 1]);
    return y[0];
}

// What csr_edges_online adds to an edge beyond q.k and v: nothing (NoEdgeExtras, the plain
// kernels), or attention's extras (EdgeExtras, the `_x` kernels of fused_csr and hybrid's
// CUDA-core warps, the latter in the log2 domain): a score bias added
// after the group's dot product, edge features added to K and V, and the dropout factor on the
// probability that weighs V (not on the running sum: the output is acc / l, the weights after
// dropout). Per-edge data is in the caller's CSR order: caller edge = kernel edge + shift, or
// ids[kernel edge].
struct NoEdgeExtras {
    enum : bool { ON = false, FEATS = false };  // enumerators: no object for NVRTC to emit
};

// FEATS: whether this instantiation reads edge features (feats may still be null); without,
// the tile holds no feature vectors, which keeps the bias / dropout kernels' registers near
// the plain ones'.
template <class T, bool HAS_FEATS = true> struct EdgeExtras {
    enum : bool { ON = true, FEATS = HAS_FEATS };
    const T* __restrict__ bias;   // null, or nnz x bias_heads (bias_heads 1: shared by the heads)
    const T* __restrict__ feats;  // null, or nnz x heads x head_dim
    const u32* __restrict__ ids;  // null: caller edge = e + shift; else ids[e] (hybrid's edges)
    u32 bias_heads, head, heads, shift;
    float bias_scale;             // 1, or log2 e where scores are in the log2 domain
    Dropout drop;                 // threshold 0: none
    __device__ __forceinline__ u64 edge(u32 e) const {
        return ids != nullptr ? (u64)__ldg(ids + e) : (u64)(u32)(e + shift);
    }
    __device__ __forceinline__ float bias_of(u32 e) const {
        if (bias == nullptr) return 0.0f;
        return to_f32(bias[edge(e) * bias_heads + (bias_heads == 1u ? 0u : head)]) * bias_scale;
    }
    __device__ __forceinline__ float keep(u32 e) const {
        return dropout_factor(drop, edge(e) * heads + head);
    }
};

// Attention: one group of g lanes (shuffle mask `mask`) walks edges start .. end of col_indices
// with an online softmax, DF-GNN style: per tile of TILE (a power of two) edges, TILE K and V
// vectors in flight per lane, TILE group reductions interleaved, one rescale. Lane features: NV
// vectors of VEC at feat[j] (on[j]: feat[j] < head_dim), q pre-multiplied by the scale. LOG2:
// scores are in the log2 domain (q scaled by scale * log2 e) and exponentials are exp2 (hybrid,
// to merge with the tensor-core tiles); otherwise natural exp (fused_csr). m, l, acc: the
// running partial, updated. Every lane in `mask` passes the same start and end (other groups
// of the warp may pass other ranges: their masks are disjoint). `xt`: the extras (above); with
// them a score may be -inf (a masked edge), so exponentials are taken against 0 while the
// running max is still -inf. STEP: the warp's groups walk in step (common.cuh, warp_tiles): all
// edges in tiles, the warp's longest range's count of them, a slot past `end` reloading a
// valid edge with score -inf, and full-mask sums (`mask` unused).
template <class T, int VEC, int NV, bool LOG2, int TILE = 4, class X = NoEdgeExtras,
          bool STEP = false>
__device__ __forceinline__ void csr_edges_online(const u32* __restrict__ col_indices, u32 start,
                                                 u32 end, const T* __restrict__ k,
                                                 const T* __restrict__ v, u64 hd, u64 head_off,
                                                 const bool (&on)[NV], const u32 (&feat)[NV],
                                                 const float (&qv)[NV][VEC], u32 mask, u32 g,
                                                 float& m, float& l, float (&acc)[NV][VEC],
                                                 X xt = X()) {
    // Feature vectors held beside V's (one dummy slot without extras).
    constexpr int FT = X::FEATS ? TILE : 1, FNV = X::FEATS ? NV : 1;
    auto ex = [](float x) { return LOG2 ? bsb_exp2(x) : __expf(x); };
    auto rescale = [&](float m_old, float m_new) {
        return LOG2 ? (m_old == SPATTN_NEG_INF ? 0.0f : bsb_exp2(m_old - m_new))
                    : online_rescale(m_old, m_new);
    };
    u32 e = start;
    // In step: the warp's longest range's count of tiles, slots past `end` weighing 0 (those of a
    // nonempty range reload its last edge; an empty range loads nothing, so no other row's values
    // or extras reach it).
    const u32 tiles = STEP ? warp_tiles(end - start, TILE) : 0u;
    const u32 spare = end > 0u ? end - 1u : 0u;
    const bool any = !STEP || end > start;
    for (u32 it = 0; STEP ? it < tiles : e + TILE <= end; ++it, e += TILE) {
        // The kernel edge of each slot (past `end`, a valid one whose score is then -inf).
        u32 pos[TILE], c[TILE];
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
            pos[t] = STEP && e + t >= end ? spare : e + t;
            // Not pos[t] on its own walk: `col_indices + e + t` folds into one base address.
            c[t] = __ldg(STEP ? col_indices + pos[t] : col_indices + e + t);
        }
        float s[TILE];
        HeldV<T, VEC> x[TILE][NV];
        HeldV<T, VEC> f[FT][FNV];
        (void)f;
#pragma unroll
        for (int t = 0; t < TILE; ++t) {
            s[t] = 0.0f;
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                if (on[j] && any) {
                    const u64 off = (u64)c[t] * hd + head_off + feat[j];
                    float kv[VEC];
                    load_vec<T, VEC>(k + off, kv);
                    x[t][j].load(v + off);
                    if constexpr (X::FEATS) {
                        if (xt.feats != nullptr) {
                            const u64 fe = xt.edge(STEP ? pos[t] : e + t);
                            f[t][j].load(xt.feats + fe * hd + head_off + feat[j]);
#pragma unroll
                            for (int i = 0; i < VEC; ++i) kv[i] += f[t][j].at(i);
                        } else {
                            f[t][j].zero();
                        }
                    }
#pragma unroll
                    for (int i = 0; i < VEC; ++i) s[t] = fmaf(qv[j][i], kv[i], s[t]);
                } else {
                    x[t][j].zero();
                    if constexpr (X::FEATS) f[t][j].zero();
                }
            }
        }
        if constexpr (STEP) {
            warp_groups_sums(s, g);
        } else {
            for (u32 o = g >> 1; o > 0; o >>= 1) {
#pragma unroll
                for (int t = 0; t < TILE; ++t) s[t] += __shfl_xor_sync(mask, s[t], o);
            }
        }
        if constexpr (X::ON) {
#pragma unroll
            for (int t = 0; t < TILE; ++t) s[t] += any ? xt.bias_of(STEP ? pos[t] : e + t) : 0.0f;
        }
        if constexpr (STEP) {
#pragma unroll
            for (int t = 0; t < TILE; ++t) s[t] = e + t < end ? s[t] : SPATTN_NEG_INF;
        }
        const float mt = tile_fold(s, [](float a, float b) { return fmaxf(a, b); });
        const float mn = fmaxf(m, mt);
        const float corr = rescale(m, mn);
        m = mn;
        float mr = mn;
        if constexpr (X::ON || STEP) mr = softmax_base(mn);
        float p[TILE];
#pragma unroll
        for (int t = 0; t < TILE; ++t) p[t] = ex(s[t] - mr);
        l = l * corr + tile_fold(p, [](float a, float b) { return a + b; });
        if constexpr (X::ON) {
#pragma unroll
            for (int t = 0; t < TILE; ++t) p[t] *= xt.keep(STEP ? pos[t] : e + t);
        }
#pragma unroll
        for (int j = 0; j < NV; ++j)
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                float a = acc[j][i] * corr;
#pragma unroll
                for (int t = 0; t < TILE; ++t) {
                    if constexpr (X::FEATS) {
                        a = fmaf(p[t], x[t][j].at(i) + f[t][j].at(i), a);
                    } else {
                        a = fmaf(p[t], x[t][j].at(i), a);
                    }
                }
                acc[j][i] = a;
            }
    }
    for (; !STEP && e < end; ++e) {
        const u32 c = __ldg(col_indices + e);
        float s = 0.0f, x[NV][VEC];
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            if (on[j]) {
                float kv[VEC];
                load_vec<T, VEC>(k + (u64)c * hd + head_off + feat[j], kv);
                load_vec<T, VEC>(v + (u64)c * hd + head_off + feat[j], x[j]);
                if constexpr (X::FEATS) {
                    if (xt.feats != nullptr) {
                        float fv[VEC];
                        load_vec<T, VEC>(xt.feats + xt.edge(e) * hd + head_off + feat[j], fv);
#pragma unroll
                        for (int i = 0; i < VEC; ++i) {
                            kv[i] += fv[i];
                            x[j][i] += fv[i];
                        }
                    }
                }
#pragma unroll
                for (int i = 0; i < VEC; ++i) s = fmaf(qv[j][i], kv[i], s);
            } else {
#pragma unroll
                for (int i = 0; i < VEC; ++i) x[j][i] = 0.0f;
            }
        }
        s = group_sum(s, mask, g);
        if constexpr (X::ON) s += xt.bias_of(e);
        const float mn = fmaxf(m, s);
        const float corr = rescale(m, mn);
        float mr = mn;
        if constexpr (X::ON) mr = softmax_base(mn);
        float p = ex(s - mr);
        m = mn;
        l = l * corr + p;
        if constexpr (X::ON) p *= xt.keep(e);
#pragma unroll
        for (int j = 0; j < NV; ++j)
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc[j][i] = fmaf(p, x[j][i], acc[j][i] * corr);
    }
}
