// Per-edge kernels of attention's extras on CSR (the unfused path and the backward): a score
// bias added per edge (per head, or one value shared by the heads), dropout on per-edge values
// (the Philox mask of common.cuh), the shared bias's gradient (from f32 values, or from the
// tensor-core backward's per-head values), casts, and the edge features'
// gradient; and the layers' edge attributes placed in CSR order with the self loops' rows filled.
// Per-edge values are nnz x heads, edge-major, f32. Kernel names: edge_{op}[_dtype].
#include "common.cuh"

// s[e * heads + h] += b[e] (shared) or b[e * heads + h].
template <class T>
__device__ void edge_bias_add(float* s, const T* __restrict__ b, u64 nnz, u32 heads, u32 shared) {
    SPATTN_GRID_STRIDE(i, nnz * heads) {
        s[i] += to_f32(b[shared ? i / heads : i]);
    }
}

// out[e] = sum over h of x[e * heads + h] in f32, in head order, rounded to T (the gradient of
// a shared bias from f32 per-edge values).
template <class T>
__device__ void edge_head_sum(const float* __restrict__ x, u64 nnz, u32 heads, T* out) {
    SPATTN_GRID_STRIDE(e, nnz) {
        float s = 0.0f;
        for (u32 h = 0; h < heads; ++h) s += x[e * heads + h];
        out[e] = from_f32<T>(s);
    }
}

// A bias's gradient from the fused backward's row pass: per entry x of A^T (a thread each), A's
// edge e = t_to_a[x] of row i = rows[x] has dS = P (dP - D_i) per head, with (s, dP) its pair
// sd[e * heads + h] and (lse_i, D_i) = stats[i * heads + h], P = exp(s - lse_i), as the column
// pass computes it; out[e] = the sum over the heads in head order (shared), else
// out[e * heads + h] = dS; rounded to T.
template <class T>
__device__ void edge_pair_bias_grad(const u32* __restrict__ rows, const u32* __restrict__ t_to_a,
                                    const float2* __restrict__ sd,
                                    const float2* __restrict__ stats, u64 nnz, u32 heads,
                                    u32 shared, T* out) {
    SPATTN_GRID_STRIDE(x, nnz) {
        const u64 e = t_to_a[x], i = rows[x];
        float sum = 0.0f;
        for (u32 h = 0; h < heads; ++h) {
            const float2 p = sd[e * heads + h], st = stats[i * heads + h];
            const float ds = __expf(p.x - st.x) * (p.y - st.y);
            if (shared) sum += ds;
            else out[e * heads + h] = from_f32<T>(ds);
        }
        if (shared) out[e] = from_f32<T>(sum);
    }
}

// out[i] = x[i] rounded to T.
template <class T>
__device__ void edge_cast(const float* __restrict__ x, u64 n, T* out) {
    SPATTN_GRID_STRIDE(i, n) { out[i] = from_f32<T>(x[i]); }
}

// out[i] = x[i] in f32 (exact).
template <class T>
__device__ void edge_widen(const T* __restrict__ x, u64 n, float* out) {
    SPATTN_GRID_STRIDE(i, n) { out[i] = to_f32(x[i]); }
}

// The edge features' gradient: per edge e = (i, j) of row i, head h and feature d,
// out[e, h, d] = a[e, h] * x[i, h, d] + b[e, h] * y[i, h, d]. One warp per chunk of
// SPATTN_COMBINE_EDGES consecutive edges, so that a hub row spreads over many warps: the
// chunk's first row by binary search in row_offsets, the next ones by walking.
#define SPATTN_COMBINE_EDGES 32u
template <class T>
__device__ void edge_row_combine(const u32* __restrict__ row_offsets, u32 n_rows, u32 nnz,
                                 u32 heads, u32 dim, const float* __restrict__ a,
                                 const T* __restrict__ x, const float* __restrict__ b,
                                 const T* __restrict__ y, T* out) {
    const u32 lane = lane_id();
    const u64 hd = (u64)heads * dim;
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 chunks = ((u64)nnz + SPATTN_COMBINE_EDGES - 1u) / SPATTN_COMBINE_EDGES;
    for (u64 c = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; c < chunks; c += warps) {
        const u32 e0 = (u32)(c * SPATTN_COMBINE_EDGES);
        const u32 e1 = min(e0 + SPATTN_COMBINE_EDGES, nnz);
        // The last row starting at or before e0 (row_offsets[n_rows] = nnz > e0).
        u32 lo = 0u, hi = n_rows;
        while (hi - lo > 1u) {
            const u32 mid = lo + (hi - lo) / 2u;
            if (__ldg(row_offsets + mid) <= e0) lo = mid;
            else hi = mid;
        }
        u64 i = lo;
        u32 end = __ldg(row_offsets + i + 1u);
        for (u32 e = e0; e < e1; ++e) {
            while (e >= end) end = __ldg(row_offsets + (++i) + 1u);
            for (u64 f = lane; f < hd; f += 32u) {
                const u32 h = (u32)(f / dim);
                const float v = a[(u64)e * heads + h] * to_f32(x[i * hd + f]) +
                                b[(u64)e * heads + h] * to_f32(y[i * hd + f]);
                out[(u64)e * hd + f] = from_f32<T>(v);
            }
        }
    }
}

// Edge attributes moved to a graph's CSR order (the layers' `edge_attr` rows): row e of the
// input goes to slot pos[e] (a position outside [0, nnz) is skipped), converted to O.
template <class T, class O>
__device__ void edge_rows_place(const T* __restrict__ x, u64 rows, u32 f,
                                const long long* __restrict__ pos, u64 nnz, O* out) {
    SPATTN_GRID_STRIDE(i, rows * f) {
        const u64 e = i / f;
        const long long p = pos[e];
        if (p >= 0 && (u64)p < nnz) out[(u64)p * f + (i - e * f)] = from_f32<O>(to_f32(x[i]));
    }
}

// The added self loops' rows (PyG's add_self_loops(fill_value=...)): row i's loop, at slot
// pos_loop[i] of row i, gets the mean (mode 0) or sum (1) of the row's other slots, feature
// by feature in slot order (f32 sums: the same bits every run), or `value` (2), rounded to the
// attributes' type T (the loops' attributes are attributes) before O. One warp a row, its lanes
// over the features.
template <class T, class O>
__device__ void edge_rows_fill(const u32* __restrict__ row_offsets, u32 n_rows,
                               const long long* __restrict__ pos_loop, u64 nnz, u32 f, u32 mode,
                               float value, O* out) {
    const u32 lane = lane_id();
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    for (u64 i = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; i < n_rows; i += warps) {
        const long long p = pos_loop[i];
        const u32 start = row_offsets[i], end = row_offsets[i + 1u];
        if (p < (long long)start || p >= (long long)end || (u64)p >= nnz) continue;
        for (u32 k = lane; k < f; k += 32u) {
            float s = value;
            if (mode != 2u) {
                s = 0.0f;
                for (u32 q = start; q < end; ++q)
                    if ((long long)q != p) s += to_f32(out[(u64)q * f + k]);
                if (mode == 0u) s /= (float)max(end - start - 1u, 1u);
            }
            out[(u64)p * f + k] = from_f32<O>(to_f32(from_f32<T>(s)));
        }
    }
}

#define SPATTN_EDGE_ROWS(S, T, SO, O)                                                           \
    extern "C" __global__ void edge_rows_place_##S##_##SO(const T* x, u64 rows, u32 f,          \
                                                          const long long* pos, u64 nnz,        \
                                                          O* out) {                             \
        edge_rows_place<T, O>(x, rows, f, pos, nnz, out);                                       \
    }                                                                                           \
    extern "C" __global__ void edge_rows_fill_##S##_##SO(const u32* row_offsets, u32 n_rows,    \
                                                         const long long* pos_loop, u64 nnz,    \
                                                         u32 f, u32 mode, float value,          \
                                                         O* out) {                              \
        edge_rows_fill<T, O>(row_offsets, n_rows, pos_loop, nnz, f, mode, value, out);          \
    }

SPATTN_EDGE_ROWS(f32, float, f32, float)
SPATTN_EDGE_ROWS(f16, __half, f32, float)
SPATTN_EDGE_ROWS(bf16, __nv_bfloat16, f32, float)
SPATTN_EDGE_ROWS(f16, __half, f16, __half)
SPATTN_EDGE_ROWS(bf16, __nv_bfloat16, bf16, __nv_bfloat16)

// x[i] *= the dropout factor of element i (0 or 1 / (1 - rate)); one Philox draw per four
// consecutive elements (the draw they share).
extern "C" __global__ void edge_dropout(float* x, u64 n, u32 key0, u32 key1, u32 off0, u32 off1,
                                        u32 threshold, float scale) {
    const Dropout d = {key0, key1, off0, off1, threshold, scale};
    SPATTN_GRID_STRIDE(c, (n + 3u) / 4u) {
        const uint4 r = dropout_draws(d, c);
        const u64 end = min(n, 4u * c + 4u);
        for (u64 i = 4u * c; i < end; ++i) x[i] *= dropout_factor_of(d, r, (u32)i & 3u);
    }
}

// y[i] += x[i].
extern "C" __global__ void edge_add(const float* x, u64 n, float* y) {
    SPATTN_GRID_STRIDE(i, n) { y[i] += x[i]; }
}

#define SPATTN_EDGE_EXTRAS(S, T)                                                                \
    extern "C" __global__ void edge_bias_add_##S(float* s, const T* b, u64 nnz, u32 heads,      \
                                                 u32 shared) {                                  \
        edge_bias_add<T>(s, b, nnz, heads, shared);                                             \
    }                                                                                           \
    extern "C" __global__ void edge_head_sum_##S(const float* x, u64 nnz, u32 heads, T* out) {  \
        edge_head_sum<T>(x, nnz, heads, out);                                                   \
    }                                                                                           \
    extern "C" __global__ void edge_pair_bias_grad_##S(const u32* rows, const u32* t_to_a,      \
                                                       const float2* sd, const float2* stats,   \
                                                       u64 nnz, u32 heads, u32 shared, T* out) { \
        edge_pair_bias_grad<T>(rows, t_to_a, sd, stats, nnz, heads, shared, out);               \
    }                                                                                           \
    extern "C" __global__ void edge_cast_##S(const float* x, u64 n, T* out) {                   \
        edge_cast<T>(x, n, out);                                                                \
    }                                                                                           \
    extern "C" __global__ void edge_widen_##S(const T* x, u64 n, float* out) {                  \
        edge_widen<T>(x, n, out);                                                               \
    }                                                                                           \
    extern "C" __global__ void edge_row_combine_##S(const u32* row_offsets, u32 n_rows,         \
                                                    u32 nnz, u32 heads, u32 dim, const float* a, \
                                                    const T* x, const float* b, const T* y,     \
                                                    T* out) {                                   \
        edge_row_combine<T>(row_offsets, n_rows, nnz, heads, dim, a, x, b, y, out);             \
    }

SPATTN_EDGE_EXTRAS(f32, float)
SPATTN_EDGE_EXTRAS(f16, __half)
SPATTN_EDGE_EXTRAS(bf16, __nv_bfloat16)
