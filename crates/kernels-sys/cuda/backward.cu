// Backward of sparse attention on CSR: the per-edge kernels. The three SpMMs of the backward
// (dQ on A, dK and dV on A^T) are csr_ops.cu's spmm_csr; the two SDDMMs (<q,k> and <dOut,V>)
// are csr_ops.cu's sddmm_csr.
//
// Layouts as in csr_ops.cu: per-edge values nnz x heads f32, edge e head h at e * heads + h,
// edges in CSR order of A (or of A^T where a kernel says so); dense operands rows x heads x
// head_dim. `a_to_t[e]` is the position of A's edge e in A^T's CSR order. Sums in f32; the
// gradient of the scale is accumulated per block in f32 and across blocks in f64.
//
// Row kernels come in two flavours, like the edge softmax: a group of g lanes per (row, head)
// for rows shorter than `long_threshold` edges, and one block per (long row, head). Both run the
// same body through a "team" (the lanes sharing a row): GroupTeam or BlockTeam.

#include "common.cuh"

// ---- teams ----------------------------------------------------------------------------------

// g consecutive lanes of a warp (g a power of two <= 32).
struct GroupTeam {
    u32 lane, size, mask;
    __device__ __forceinline__ float sum(float v) const { return group_sum(v, mask, size); }
    __device__ __forceinline__ float max(float v) const { return group_max(v, mask, size); }
};

// The whole block (a multiple of 32 threads); `scratch` is 32 floats of shared memory. Its
// reductions contain __syncthreads: every thread of the block must call them.
struct BlockTeam {
    u32 lane, size;
    float* scratch;
    __device__ __forceinline__ float sum(float v) const { return block_reduce(v, scratch, false); }
    __device__ __forceinline__ float max(float v) const { return block_reduce(v, scratch, true); }
};

__device__ __forceinline__ GroupTeam group_team(u32 g) {
    GroupTeam t;
    t.lane = lane_id() & (g - 1u);
    t.size = g;
    t.mask = group_mask(g);
    return t;
}

// Adds a block's f32 partial (one per thread) into *acc (f64). Every thread of the block calls.
__device__ __forceinline__ void block_accumulate(float v, float* scratch, double* acc) {
    const float r = block_reduce(v, scratch, false);
    if (threadIdx.x == 0) atomicAdd(acc, (double)r);
}

// ---- row bodies -----------------------------------------------------------------------------

// ds = p * (dp - sum_row(p * dp)) for one (row, head). `ds` may alias `dp`: each element is
// read and then written by the same lane.
template <class Team>
__device__ __forceinline__ void softmax_backward_row(const Team& t, u32 start, u32 end, u32 heads,
                                                     u32 h, const float* p, const float* dp,
                                                     float* ds) {
    float acc = 0.0f;
    for (u32 e = start + t.lane; e < end; e += t.size) {
        const u64 i = (u64)e * heads + h;
        acc = fmaf(p[i], dp[i], acc);
    }
    const float d = t.sum(acc);
    for (u32 e = start + t.lane; e < end; e += t.size) {
        const u64 i = (u64)e * heads + h;
        ds[i] = p[i] * (dp[i] - d);
    }
}

template <class Team>
__device__ __forceinline__ float row_sum(const Team& t, u32 start, u32 end, u32 heads, u32 h,
                                         const float* values) {
    float acc = 0.0f;
    for (u32 e = start + t.lane; e < end; e += t.size) acc += values[(u64)e * heads + h];
    return t.sum(acc);
}

// The fused per-edge backward of one (row, head), from raw = <q, k> and dp = <dOut, V>:
//   s = scale * raw, P = softmax_row(s), D = sum_row(P * dp), dS = P * (dp - D);
// writes scale * dS over dp (A's order, for dQ = scale dS K), and P and scale * dS at A^T's
// positions (for dV = P^T dOut and dK = scale dS^T Q). Returns this lane's share of
// sum dS * raw (the gradient of the scale).
template <class Team>
__device__ __forceinline__ float attention_backward_row(const Team& t, u32 start, u32 end,
                                                        u32 heads, u32 h, float scale,
                                                        const float* __restrict__ raw, float* dp,
                                                        const u32* __restrict__ a_to_t,
                                                        float* __restrict__ p_t,
                                                        float* __restrict__ ds_t) {
    float m = SPATTN_NEG_INF;
    for (u32 e = start + t.lane; e < end; e += t.size) m = fmaxf(m, scale * raw[(u64)e * heads + h]);
    m = t.max(m);
    float l = 0.0f, w = 0.0f;
    for (u32 e = start + t.lane; e < end; e += t.size) {
        const u64 i = (u64)e * heads + h;
        const float x = __expf(scale * raw[i] - m);
        l += x;
        w = fmaf(x, dp[i], w);
    }
    l = t.sum(l);
    w = t.sum(w);
    const float inv = 1.0f / l;
    const float d = w * inv;
    float dscale = 0.0f;
    for (u32 e = start + t.lane; e < end; e += t.size) {
        const u64 i = (u64)e * heads + h;
        const float r = raw[i];
        const float p = __expf(scale * r - m) * inv;
        const float ds = p * (dp[i] - d);
        dscale = fmaf(ds, r, dscale);
        dp[i] = scale * ds;
        const u64 j = (u64)a_to_t[e] * heads + h;
        p_t[j] = p;
        ds_t[j] = scale * ds;
    }
    return dscale;
}

// ---- grid-stride drivers --------------------------------------------------------------------
// ROWS: a group of g lanes per (row, head), rows of >= long_threshold edges skipped.
// LONG: blockIdx.x indexes long_rows, blockIdx.y is the head.

#define SPATTN_FOR_EACH_SHORT_ROW(BODY)                                                        \
    const GroupTeam team = group_team(g);                                                      \
    const u64 group = grid_group(g), groups = grid_groups(g);                                  \
    const u64 total = (u64)n_rows * heads;                                                     \
    for (u64 rh = group; rh < total; rh += groups) {                                           \
        u32 h;                                                                                 \
        const u64 row = split_index(rh, heads, total, h);                                      \
        const u32 start = row_offsets[row], end = row_offsets[row + 1];                        \
        if (end - start >= long_threshold) continue; /* uniform across the group */            \
        BODY                                                                                   \
    }

#define SPATTN_LONG_ROW(BODY)                                                                  \
    __shared__ float scratch[32];                                                              \
    BlockTeam team;                                                                            \
    team.lane = threadIdx.x;                                                                   \
    team.size = blockDim.x;                                                                    \
    team.scratch = scratch;                                                                    \
    const u32 row = long_rows[blockIdx.x];                                                     \
    const u32 h = blockIdx.y;                                                                  \
    const u32 start = row_offsets[row], end = row_offsets[row + 1];                            \
    BODY

// ---- edge softmax backward ------------------------------------------------------------------

extern "C" __global__ void edge_softmax_backward_csr_rows(const u32* __restrict__ row_offsets,
                                                          u32 n_rows, u32 heads,
                                                          const float* p, const float* dp,
                                                          u32 g, u32 long_threshold, float* ds) {
    SPATTN_FOR_EACH_SHORT_ROW(softmax_backward_row(team, start, end, heads, h, p, dp, ds);)
}

extern "C" __global__ void edge_softmax_backward_csr_long_rows(
    const u32* __restrict__ row_offsets, const u32* __restrict__ long_rows, u32 heads,
    const float* p, const float* dp, float* ds) {
    SPATTN_LONG_ROW(softmax_backward_row(team, start, end, heads, h, p, dp, ds);)
}

// ---- fused attention backward (per edge) ------------------------------------------------------

extern "C" __global__ void attention_backward_csr_rows(
    const u32* __restrict__ row_offsets, u32 n_rows, u32 heads, float scale,
    const float* __restrict__ raw, float* dp, const u32* __restrict__ a_to_t,
    float* __restrict__ p_t, float* __restrict__ ds_t, u32 g, u32 long_threshold,
    double* d_scale) {
    __shared__ float reduce_scratch[32];
    float dscale = 0.0f;
    SPATTN_FOR_EACH_SHORT_ROW(dscale += attention_backward_row(team, start, end, heads, h, scale,
                                                               raw, dp, a_to_t, p_t, ds_t);)
    block_accumulate(dscale, reduce_scratch, d_scale);
}

extern "C" __global__ void attention_backward_csr_long_rows(
    const u32* __restrict__ row_offsets, const u32* __restrict__ long_rows, u32 heads,
    float scale, const float* __restrict__ raw, float* dp, const u32* __restrict__ a_to_t,
    float* __restrict__ p_t, float* __restrict__ ds_t, double* d_scale) {
    SPATTN_LONG_ROW(const float dscale = attention_backward_row(team, start, end, heads, h, scale,
                                                                raw, dp, a_to_t, p_t, ds_t);
                    block_accumulate(dscale, scratch, d_scale);)
}

// ---- edge row sums --------------------------------------------------------------------------

template <class T>
__device__ __forceinline__ void edge_row_sum_rows(const u32* __restrict__ row_offsets, u32 n_rows,
                                                  u32 heads, const float* __restrict__ values,
                                                  u32 g, u32 long_threshold, T* __restrict__ out) {
    SPATTN_FOR_EACH_SHORT_ROW(const float s = row_sum(team, start, end, heads, h, values);
                              if (team.lane == 0) out[rh] = from_f32<T>(s);)
}

template <class T>
__device__ __forceinline__ void edge_row_sum_long_rows(const u32* __restrict__ row_offsets,
                                                       const u32* __restrict__ long_rows,
                                                       u32 heads, const float* __restrict__ values,
                                                       T* __restrict__ out) {
    SPATTN_LONG_ROW(const float s = row_sum(team, start, end, heads, h, values);
                    if (threadIdx.x == 0) out[(u64)row * heads + h] = from_f32<T>(s);)
}

// ---- per-(row, head) dot products of two dense matrices ------------------------------------
// out[i * heads + h] = <x[i, h, :], y[i, h, :]> in f32; a group of g lanes per (row, head).

template <class T, int VEC>
__device__ __forceinline__ void row_dot(u32 rows, u32 heads, u32 head_dim,
                                        const T* __restrict__ x, const T* __restrict__ y, u32 g,
                                        float* __restrict__ out) {
    const u32 mask = group_mask(g);
    const u32 lane = lane_id() & (g - 1u);
    const u64 group = grid_group(g), groups = grid_groups(g);
    const u64 total = (u64)rows * heads;
    for (u64 rh = group; rh < total; rh += groups) {
        const u64 base = rh * head_dim;
        float acc = 0.0f;
        for (u32 d = lane * VEC; d < head_dim; d += g * VEC) {
            float a[VEC], b[VEC];
            load_vec<T, VEC>(x + base + d, a);
            load_vec<T, VEC>(y + base + d, b);
#pragma unroll
            for (int i = 0; i < VEC; ++i) acc = fmaf(a[i], b[i], acc);
        }
        acc = group_sum(acc, mask, g);
        if (lane == 0) out[rh] = acc;
    }
}

// ---- elementwise and scatter kernels on per-edge values --------------------------------------

// dst[a_to_t[e] * heads + h] = src[e * heads + h]: A's edge order to A^T's.
extern "C" __global__ void transpose_edge_values_csr_f32(const u32* __restrict__ a_to_t, u32 nnz,
                                                         u32 heads,
                                                         const float* __restrict__ src,
                                                         float* __restrict__ dst) {
    const u64 total = (u64)nnz * heads;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u32 h;
        const u64 e = split_index(i, heads, total, h);
        dst[(u64)a_to_t[e] * heads + h] = src[i];
    }
}

// grad *= (pre >= 0 ? 1 : slope): the derivative of leaky_relu (common.cuh) at `pre`.
extern "C" __global__ void edge_leaky_relu_backward_f32(const float* __restrict__ pre, u64 n,
                                                        float slope, float* __restrict__ grad) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x) {
        if (!(pre[i] >= 0.0f)) grad[i] *= slope;
    }
}

// x *= alpha.
extern "C" __global__ void edge_scale_f32(float* __restrict__ x, u64 n, float alpha) {
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        x[i] *= alpha;
}

// *acc += sum x[i] * y[i] (f32 per thread and block, f64 across blocks).
extern "C" __global__ void edge_dot_f32(const float* __restrict__ x, const float* __restrict__ y,
                                        u64 n, double* acc) {
    __shared__ float scratch[32];
    float s = 0.0f;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (u64)gridDim.x * blockDim.x)
        s = fmaf(x[i], y[i], s);
    block_accumulate(s, scratch, acc);
}

// ---- extern "C" instantiations ----------------------------------------------------------------

#define SPATTN_ROW_DOT(NAME, T, VEC)                                                            \
    extern "C" __global__ void NAME(u32 rows, u32 heads, u32 head_dim, const T* x, const T* y, \
                                    u32 g, float* out) {                                       \
        row_dot<T, VEC>(rows, heads, head_dim, x, y, g, out);                                  \
    }

#define SPATTN_BACKWARD_PER_DTYPE(SUFFIX, T)                                                    \
    extern "C" __global__ void edge_row_sum_csr_rows_##SUFFIX(                                 \
        const u32* row_offsets, u32 n_rows, u32 heads, const float* values, u32 g,             \
        u32 long_threshold, T* out) {                                                          \
        edge_row_sum_rows<T>(row_offsets, n_rows, heads, values, g, long_threshold, out);      \
    }                                                                                          \
    extern "C" __global__ void edge_row_sum_csr_long_rows_##SUFFIX(                            \
        const u32* row_offsets, const u32* long_rows, u32 heads, const float* values, T* out) { \
        edge_row_sum_long_rows<T>(row_offsets, long_rows, heads, values, out);                 \
    }                                                                                          \
    SPATTN_ROW_DOT(row_dot_dense_##SUFFIX##_v1, T, 1)                                           \
    SPATTN_ROW_DOT(row_dot_dense_##SUFFIX##_v2, T, 2)                                           \
    SPATTN_ROW_DOT(row_dot_dense_##SUFFIX##_v4, T, 4)

SPATTN_BACKWARD_PER_DTYPE(f32, float)
SPATTN_BACKWARD_PER_DTYPE(f16, __half)
SPATTN_BACKWARD_PER_DTYPE(bf16, __nv_bfloat16)
SPATTN_ROW_DOT(row_dot_dense_f16_v8, __half, 8)
SPATTN_ROW_DOT(row_dot_dense_bf16_v8, __nv_bfloat16, 8)
