// Shared device helpers of every spattn kernel: integer types, dtype conversions, vector
// loads/stores, group (sub-warp) reductions. One copy here; kernels include it.
#pragma once

#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef unsigned int u32;
typedef unsigned long long u64;

#define SPATTN_NONE 0xffffffffu
// -inf without math.h (NVRTC has no INFINITY macro).
#define SPATTN_NEG_INF __int_as_float(0xff800000)

// Grid-stride loop over [0, n) (u64: sizes past 2^32 elements).
#define SPATTN_GRID_STRIDE(i, n)                                                                \
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                         \
         i += (u64)gridDim.x * blockDim.x)

// ---- scalar conversions -------------------------------------------------------------------

__device__ __forceinline__ float to_f32(float x) { return x; }
__device__ __forceinline__ float to_f32(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_f32(float x);
template <> __device__ __forceinline__ float from_f32<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_f32<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float x) {
    return __float2bfloat16_rn(x);
}

// ---- vector loads and stores --------------------------------------------------------------
// `VEC` consecutive elements of type T moved as one access of sizeof(T) * VEC bytes (2..16).
// The caller guarantees alignment: the element offset is a multiple of VEC and buffers come
// from cuMemAlloc (256-byte aligned).

template <int BYTES> struct RawOf;
template <> struct RawOf<2> { typedef unsigned short type; };
template <> struct RawOf<4> { typedef unsigned int type; };
template <> struct RawOf<8> { typedef uint2 type; };
template <> struct RawOf<16> { typedef uint4 type; };

template <class T, int VEC>
__device__ __forceinline__ void load_vec(const T* __restrict__ p, float (&out)[VEC]) {
    typedef typename RawOf<sizeof(T) * VEC>::type Raw;
    Raw raw = __ldg(reinterpret_cast<const Raw*>(p));
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_f32(e[i]);
}

// Plain (coherent) load: for data written earlier in the same kernel.
template <class T, int VEC>
__device__ __forceinline__ void load_vec_coherent(const T* p, float (&out)[VEC]) {
    typedef typename RawOf<sizeof(T) * VEC>::type Raw;
    Raw raw = *reinterpret_cast<const Raw*>(p);
    const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) out[i] = to_f32(e[i]);
}

template <class T, int VEC>
__device__ __forceinline__ void store_vec(T* p, const float (&in)[VEC]) {
    typedef typename RawOf<sizeof(T) * VEC>::type Raw;
    Raw raw;
    T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
    for (int i = 0; i < VEC; ++i) e[i] = from_f32<T>(in[i]);
    *reinterpret_cast<Raw*>(p) = raw;
}

// A lane's vector of VEC features held from its load to its use (csr_edges_online's V and edge
// vectors, gat_grad_rows' gathered rows): the stored bits for f16/bf16 (half the registers of
// floats for VEC >= 2, where occupancy is register-bound) and floats for f32 (same registers
// either way; the float form schedules better on small graphs).
template <class T, int VEC> struct HeldV {
    typedef typename RawOf<sizeof(T) * VEC>::type Raw;
    Raw raw;
    __device__ __forceinline__ void load(const T* __restrict__ p) {
        raw = __ldg(reinterpret_cast<const Raw*>(p));
    }
    __device__ __forceinline__ void zero() { raw = Raw(); }
    __device__ __forceinline__ float at(int i) const {
        return to_f32(reinterpret_cast<const T*>(&raw)[i]);
    }
};
template <int VEC> struct HeldV<float, VEC> {
    float x[VEC];
    __device__ __forceinline__ void load(const float* __restrict__ p) { load_vec<float, VEC>(p, x); }
    __device__ __forceinline__ void zero() {
#pragma unroll
        for (int i = 0; i < VEC; ++i) x[i] = 0.0f;
    }
    __device__ __forceinline__ float at(int i) const { return x[i]; }
};

// One lane's share of <x[0..n), y[0..n)> in f32: lane `lane` of a group of `g` takes the
// VEC-element chunks lane, lane + g, ... (n a multiple of VEC); the caller sums the group's.
template <class T, int VEC>
__device__ __forceinline__ float lane_dot(const T* __restrict__ x, const T* __restrict__ y, u32 n,
                                          u32 lane, u32 g) {
    float acc = 0.0f;
    for (u32 d = lane * VEC; d < n; d += g * VEC) {
        float a[VEC], b[VEC];
        load_vec<T, VEC>(x + d, a);
        load_vec<T, VEC>(y + d, b);
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc = fmaf(a[i], b[i], acc);
    }
    return acc;
}

// ---- grid-stride indices ------------------------------------------------------------------
// A 64-bit `/` by a run-time value compiles to a ~70-instruction routine and can keep registers
// live across the loop it indexes (docs/kernels/csr-ops.md and fused-csr.md).

// This thread's group of g consecutive lanes (g a power of two, 1..32) in a 1-D grid, and the
// number of groups in the grid: shifts, no division.
__device__ __forceinline__ u64 grid_group(u32 g) {
    return ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> (__ffs(g) - 1);
}
__device__ __forceinline__ u64 grid_groups(u32 g) {
    return ((u64)gridDim.x * blockDim.x) >> (__ffs(g) - 1);
}

// The unit a grid walks i-th: order[i], or i where order is null (units as numbered). A
// locality order of the rows keeps the rows gathered at one time in L2.
__device__ __forceinline__ u64 walk_unit(const u32* order, u64 i) {
    return order == nullptr ? i : __ldg(order + i);
}

// i / n, with i - (i / n) * n in `rem`, for an index i < total: no division when n == 1, a 32-bit
// one when total fits 32 bits (a branch uniform across the grid), the 64-bit one otherwise.
__device__ __forceinline__ u64 split_index(u64 i, u32 n, u64 total, u32& rem) {
    if (n == 1u) {
        rem = 0u;
        return i;
    }
    if (total <= 0xffffffffull) {
        const u32 a = (u32)i, q = a / n;
        rem = a - q * n;
        return q;
    }
    const u64 q = i / n;
    rem = (u32)(i - q * n);
    return q;
}

// ---- groups of lanes ------------------------------------------------------------------------
// A group is `g` consecutive lanes of a warp, g a power of two in 1..32, aligned to g.

__device__ __forceinline__ u32 lane_id() { return threadIdx.x & 31u; }

// The shuffle mask of the calling lane's group.
__device__ __forceinline__ u32 group_mask(u32 g) {
    if (g >= 32u) return 0xffffffffu;
    return ((1u << g) - 1u) << (lane_id() & ~(g - 1u));
}

// ---- groups of a warp in step --------------------------------------------------------------
// A group's shuffles with its own mask cost ptxas a convergence check each (MATCH, REDUX, VOTEU
// and a branch); where a warp's groups walk their units in step (a loop while warp_more, tiles
// counted by warp_tiles) every lane reaches each shuffle, so full-mask ones, unrolled, serve.

// STEP false: each group on its own (i < n; its own unit's tiles), for loops without sums.

// Whether any lane of the warp still has work (i < n); every lane of the warp calls it.
template <bool STEP = true>
__device__ __forceinline__ bool warp_more(u64 i, u64 n) {
    return STEP ? __any_sync(0xffffffffu, i < n) : i < n;
}

// The tiles of `tile` edges the warp walks for a unit of `len`: its longest unit's. Units hold
// at most 64 edges, so a walk passes its own end by less than the 255 that MAX_NNZ leaves free.
template <bool STEP = true>
__device__ __forceinline__ u32 warp_tiles(u32 len, u32 tile) {
    const u32 t = (len + tile - 1u) / tile;
    return STEP ? __reduce_max_sync(0xffffffffu, t) : t;
}

// The sums over each group of g lanes (a power of two) of N values, when the warp's 32 lanes
// call it together: each in group_sum's order (bitwise the same), a level's N shuffles
// together (csr_edges_online's tile; the backward's passes ran 0.92-0.98x at 8 heads with their
// sums grouped so, more spills, and sum one value at a time).
template <int N>
__device__ __forceinline__ void warp_groups_sums(float (&v)[N], u32 g) {
#pragma unroll
    for (u32 o = 16; o > 0; o >>= 1)
        if (o < g)
#pragma unroll
            for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);
}

// One value's.
__device__ __forceinline__ float warp_groups_sum(float v, u32 g) {
    float x[1] = {v};
    warp_groups_sums(x, g);
    return x[0];
}

__device__ __forceinline__ float group_sum(float v, u32 mask, u32 g) {
    for (u32 o = g >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(mask, v, o);
    return v;
}

__device__ __forceinline__ float group_max(float v, u32 mask, u32 g) {
    for (u32 o = g >> 1; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(mask, v, o));
    return v;
}

// Whole-block reduction for blocks of a multiple of 32 threads (at most 1024). `scratch` holds
// 32 floats of shared memory. Every thread gets the result. Contains __syncthreads: call it from
// every thread of the block.
__device__ __forceinline__ float block_reduce(float v, float* scratch, bool is_max) {
    const u32 lane = lane_id(), warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = is_max ? group_max(v, 0xffffffffu, 32) : group_sum(v, 0xffffffffu, 32);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float r = lane < warps ? scratch[lane] : (is_max ? SPATTN_NEG_INF : 0.0f);
    r = is_max ? group_max(r, 0xffffffffu, 32) : group_sum(r, 0xffffffffu, 32);
    return r;
}

// Sum over the block in f64 (blocks of a multiple of 32 threads, scratch of 32 doubles). Every
// thread of the block calls; thread 0 gets the result.
__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    for (u32 o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane_id() == 0) scratch[threadIdx.x >> 5] = v;
    __syncthreads();
    double r = 0.0;
    if (threadIdx.x == 0)
        for (u32 w = 0; w < (blockDim.x >> 5); ++w) r += scratch[w];
    return r;
}

// Whether this block is the last of the grid to get here: call it from every thread after
// thread 0 stored the block's partial; the last block then reads the others' partials with
// __ldcg (past L1) and resets *counter for the next launch. Sums taken that way, in block order,
// do not depend on which block finished last (no float atomics).
__device__ __forceinline__ bool last_block_to_finish(u32* counter) {
    __shared__ bool last;
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(counter, 1u) + 1u == gridDim.x;
    }
    __syncthreads();
    if (last) __threadfence();
    return last;
}

// Publishes a split unit's partial (already stored by every lane of the group) and returns
// whether this group is the last of the row's `parts` units to do so, i.e. the one to merge.
// The counter is reset by the merging group.
__device__ __forceinline__ bool last_to_finish(u32* counter, u32 parts, u32 mask, u32 lane,
                                               u32 g) {
    __threadfence();
    __syncwarp(mask);
    u32 old = 0u;
    if (lane == 0u) old = atomicAdd(counter, 1u);
    old = __shfl_sync(mask, old, 0, g);
    if (old + 1u != parts) return false;
    __threadfence();
    return true;
}

// ---- renumbered rows -------------------------------------------------------------------------
// The tensor-core formats may tile rows in a renumbered order: kernels then load Q and store the
// output through row_ids (renumbered row -> the caller's row). row_ids null: no renumbering.
// `row` must be < the matrix's rows.
__device__ __forceinline__ u32 caller_row(const u32* __restrict__ row_ids, u32 row) {
    return row_ids != nullptr ? __ldg(row_ids + row) : row;
}

// ---- numerics -------------------------------------------------------------------------------

__device__ __forceinline__ float leaky_relu(float x, float slope) { return x >= 0.0f ? x : x * slope; }

// ---- online softmax (FlashAttention-style running max / sum) ------------------------------
// A partial softmax over some of a row's edges is (m, l, acc): the running max m (from -inf),
// the sum l of exp(s - m), and acc = sum of exp(s - m) * v. Two partials of the same row merge
// exactly by rescaling both to the larger max.

// The value a row's exponentials subtract: its max m, or 0 where every score seen is -inf
// (masked, or none), so that exp(-inf - base) = 0 rather than exp(-inf - -inf) = NaN.
__device__ __forceinline__ float softmax_base(float m) { return m == SPATTN_NEG_INF ? 0.0f : m; }

// A row's 1 / sum, or 0 where the sum is 0 (every score -inf, or no edge); a NaN sum (a NaN
// score) gives NaN, so the row is NaN.
__device__ __forceinline__ float softmax_inv(float l) { return l == 0.0f ? 0.0f : 1.0f / l; }

// A row's log-sum-exp m + log l (natural log), or 0 where l = 0; NaN for a NaN sum.
__device__ __forceinline__ float softmax_lse(float m, float l) {
    return l == 0.0f ? 0.0f : m + logf(l);
}

// The same in the log2 domain (m a max of scores times log2 e: the tensor-core kernels').
__device__ __forceinline__ float softmax_lse2(float m, float l) {
    return l == 0.0f ? 0.0f : m + log2f(l);
}

// exp(m_old - m_new) for m_new >= m_old, with exp(-inf - x) = 0 and no NaN when both are -inf.
__device__ __forceinline__ float online_rescale(float m_old, float m_new) {
    return m_old == SPATTN_NEG_INF ? 0.0f : __expf(m_old - m_new);
}

// Merges partial (m2, l2) into (m, l); returns the factors (c1 for the old acc, c2 for acc2):
// acc = acc * c1 + acc2 * c2.
__device__ __forceinline__ void online_merge(float& m, float& l, float m2, float l2, float& c1,
                                             float& c2) {
    const float mn = fmaxf(m, m2);
    c1 = online_rescale(m, mn);
    c2 = online_rescale(m2, mn);
    m = mn;
    l = l * c1 + l2 * c2;
}

// ---- dropout: Philox 4x32-10 -----------------------------------------------------------------
// The mask of element i = edge * heads + head (the caller's CSR order) is word i mod 4 of
// philox4x32_10(counter {c lo, c hi, offset lo, offset hi}, key {seed lo, seed hi}) with
// c = i / 4, kept when >= threshold, as ops/src/dropout.rs defines it: every kernel and the
// CPU draw the same mask, and one draw serves four consecutive elements (heads of an edge).

__device__ __forceinline__ uint4 philox4x32_10(uint4 c, uint2 k) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k.x += 0x9E3779B9u;
            k.y += 0xBB67AE85u;
        }
        const u32 hi0 = __umulhi(0xD2511F53u, c.x), lo0 = 0xD2511F53u * c.x;
        const u32 hi1 = __umulhi(0xCD9E8D57u, c.z), lo1 = 0xCD9E8D57u * c.z;
        c = make_uint4(hi1 ^ c.y ^ k.x, lo1, hi0 ^ c.w ^ k.y, lo0);
    }
    return c;
}

// The dropout of one attention-weight element: (key0, key1) the seed's words, (off0, off1) the
// offset's, `threshold` = floor(rate * 2^32) (0: nothing is dropped).
struct Dropout {
    u32 key0, key1, off0, off1, threshold;
    float scale;  // 1 / (1 - rate)
};

// The four draws of elements 4c .. 4c + 3.
__device__ __forceinline__ uint4 dropout_draws(const Dropout& d, u64 c) {
    return philox4x32_10(make_uint4((u32)c, (u32)(c >> 32), d.off0, d.off1),
                         make_uint2(d.key0, d.key1));
}

// Word j < 4 of r.
__device__ __forceinline__ u32 draw_word(uint4 r, u32 j) {
    return j == 0u ? r.x : j == 1u ? r.y : j == 2u ? r.z : r.w;
}

// Whether the element at word j of its draw r is kept.
__device__ __forceinline__ bool dropout_kept(const Dropout& d, uint4 r, u32 j) {
    return draw_word(r, j) >= d.threshold;
}

// The factor (0, or 1 / (1 - rate)) of the element at word j of its draw r.
__device__ __forceinline__ float dropout_factor_of(const Dropout& d, uint4 r, u32 j) {
    return dropout_kept(d, r, j) ? d.scale : 0.0f;
}

__device__ __forceinline__ float dropout_factor(const Dropout& d, u64 i) {
    if (d.threshold == 0u) return 1.0f;
    return dropout_factor_of(d, dropout_draws(d, i >> 2), (u32)i & 3u);
}

// The dropout factor of element i (edge * heads + head) from a mask of kept bits (bit i mod 32
// of word i / 32, as dropout_keep_bits writes them): 0 or scale; 1 without a mask.
__device__ __forceinline__ float kept_factor(const u32* __restrict__ keep, u64 i, float scale) {
    if (keep == nullptr) return 1.0f;
    return (__ldg(keep + (i >> 5)) >> (u32)(i & 31u)) & 1u ? scale : 0.0f;
}

// ---- GAT's scores ---------------------------------------------------------------------------
// s = a_dst[i] + a_src[j] (+ bias_e), z = LeakyReLU(s), P the row softmax of z, W = P f (f the
// dropout factor of A's edge e and the head): what GAT's kernels (csr_ops.cu, backward.cu) read.
struct GatScores {
    const float* a_dst;  // n_rows x heads
    const float* a_src;  // n_cols x heads
    const float* bias;   // null, or nnz x heads in A's CSR order
    float slope;
    Dropout drop;        // threshold 0: none
};

// The pre-activation score of A's edge e from row i to column j, head h.
__device__ __forceinline__ float gat_score(const GatScores& sc, u32 i, u32 j, u64 e, u32 heads,
                                           u32 h) {
    float s = __ldg(sc.a_dst + (u64)i * heads + h) + __ldg(sc.a_src + (u64)j * heads + h);
    if (sc.bias != nullptr) s += __ldg(sc.bias + e * heads + h);
    return s;
}

// The kernel arguments of GatScores: the score terms a_dst, a_src, the bias (or null), the
// slope and the dropout's words (threshold 0: none); and the struct built from them.
#define SPATTN_GAT_SCORES_ARGS                                                              \
    const float *a_dst, const float *a_src, const float *bias, float slope, u32 key0, u32 key1, \
        u32 off0, u32 off1, u32 threshold, float drop_scale
#define SPATTN_GAT_SCORES                                                                   \
    {a_dst, a_src, bias, slope, {key0, key1, off0, off1, threshold, drop_scale}}
