// Rows moved on the device. By index, for the halo exchange of partitioned plans: a rank packs
// the K/V rows each other rank asks for into one contiguous block per receiver (gather), and sums
// the gradient rows sent back to it into its own rows (scatter-add, in f32); rows are `row_len`
// contiguous elements. Resized, for the tensor-core kernels, which read heads of whole 16-byte
// vectors: rows of `src_len` elements padded with zeros or cut to `dst_len`. Kernel names:
// {op}_rows_{dtype}.
#include "common.cuh"

// A group of g lanes per row (g a power of two in 1..32, chosen by the host for the row's
// pieces), rows grid-stride.

// dst[i, :] = src[idx[i], :] for i < n_idx, rows of `units` elements of U.
template <class U>
__device__ void gather_units(const U* __restrict__ src, const u32* __restrict__ idx, u64 n_idx,
                             u32 units, u32 g, U* __restrict__ dst) {
    const u32 lane = lane_id() & (g - 1u);
    const u64 groups = grid_groups(g);
    for (u64 r = grid_group(g); r < n_idx; r += groups) {
        const U* s = src + (u64)idx[r] * units;
        U* d = dst + r * units;
        for (u32 j = lane; j < units; j += g) d[j] = s[j];
    }
}

// dst[i, :] = src[idx[i], :] for i < n_idx: 16-byte pieces where rows allow them.
template <class T>
__device__ void gather_rows(const T* __restrict__ src, const u32* __restrict__ idx, u64 n_idx,
                            u32 row_len, u32 g, T* __restrict__ dst) {
    const u64 bytes = (u64)row_len * sizeof(T);
    if (bytes % 16 == 0 && (((size_t)src | (size_t)dst) & 15) == 0)
        gather_units<uint4>((const uint4*)src, idx, n_idx, (u32)(bytes / 16), g, (uint4*)dst);
    else
        gather_units<T>(src, idx, n_idx, row_len, g, dst);
}

// acc[idx[i], :] += src[i, :] for i < n_idx. The indices of one call are distinct (a sender's
// rows), so no two threads add to one element; calls in rank order make the sums deterministic.
template <class T>
__device__ void scatter_add_rows(const T* __restrict__ src, const u32* __restrict__ idx,
                                 u64 n_idx, u32 row_len, u32 g, float* acc) {
    const u32 lane = lane_id() & (g - 1u);
    const u64 groups = grid_groups(g);
    for (u64 r = grid_group(g); r < n_idx; r += groups) {
        const T* s = src + r * row_len;
        float* a = acc + (u64)idx[r] * row_len;
        for (u32 j = lane; j < row_len; j += g) a[j] += to_f32(s[j]);
    }
}

// dst[r, j] = src[r, j] for j < min(src_len, dst_len), 0 for src_len <= j < dst_len; rows
// r < n_rows. A thread writes W consecutive elements of a dst row in one store (W · sizeof(T) <=
// 16 bytes, W divides dst_len), grid-stride over the flat chunks (a group of lanes a row left
// most of each warp idle on short heads).
template <class T, int W>
__device__ void resize_chunks(const T* __restrict__ src, u64 n_rows, u32 src_len, u32 dst_len,
                              T* __restrict__ dst) {
    typedef typename RawOf<sizeof(T) * W>::type Raw;
    const u32 per_row = dst_len / W;
    const u64 total = n_rows * per_row;
    // Whole source chunks load as one vector too when source rows are W-aligned.
    const bool vec_src = src_len % W == 0 && ((size_t)src & (sizeof(Raw) - 1)) == 0;
    for (u64 c = grid_group(1u); c < total; c += grid_groups(1u)) {
        u32 jc;
        const u64 r = split_index(c, per_row, total, jc);
        const u32 j = jc * W;
        const T* s = src + r * src_len + j;
        Raw raw;
        if (vec_src && j < src_len) {
            raw = *reinterpret_cast<const Raw*>(s);
        } else {
            T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
            for (int k = 0; k < W; ++k) e[k] = j + k < src_len ? s[k] : from_f32<T>(0.0f);
        }
        *reinterpret_cast<Raw*>(dst + c * W) = raw;
    }
}

// resize_chunks with the widest W <= w (a power of two) that divides dst_len and dst's alignment.
template <class T, int W>
__device__ void resize_widest(const T* __restrict__ src, u64 n_rows, u32 src_len, u32 dst_len,
                              u32 w, T* __restrict__ dst) {
    if constexpr (W > 1) {
        if (w < W || dst_len % W != 0 || ((size_t)dst & (W * sizeof(T) - 1)) != 0) {
            resize_widest<T, W / 2>(src, n_rows, src_len, dst_len, w, dst);
            return;
        }
    }
    resize_chunks<T, W>(src, n_rows, src_len, dst_len, dst);
}

template <class T>
__device__ void resize_rows(const T* __restrict__ src, u64 n_rows, u32 src_len, u32 dst_len,
                            u32 w, T* __restrict__ dst) {
    resize_widest<T, 16 / sizeof(T)>(src, n_rows, src_len, dst_len, w, dst);
}

#define SPATTN_ROWS(S, T)                                                                       \
    extern "C" __global__ void gather_rows_##S(const T* src, const u32* idx, u64 n_idx,         \
                                               u32 row_len, u32 g, T* dst) {                    \
        gather_rows<T>(src, idx, n_idx, row_len, g, dst);                                       \
    }                                                                                           \
    extern "C" __global__ void scatter_add_rows_##S(const T* src, const u32* idx, u64 n_idx,    \
                                                    u32 row_len, u32 g, float* acc) {           \
        scatter_add_rows<T>(src, idx, n_idx, row_len, g, acc);                                  \
    }                                                                                           \
    extern "C" __global__ void resize_rows_##S(u32 src_len, u32 dst_len, u32 w,                 \
                                               const T* s0, u64 r0, T* d0,                      \
                                               const T* s1, u64 r1, T* d1,                      \
                                               const T* s2, u64 r2, T* d2,                      \
                                               const T* s3, u64 r3, T* d3) {                    \
        /* blockIdx.y picks the pair: one launch resizes up to four buffers */                  \
        const u32 y = blockIdx.y;                                                               \
        resize_rows<T>(y == 0 ? s0 : y == 1 ? s1 : y == 2 ? s2 : s3,                            \
                       y == 0 ? r0 : y == 1 ? r1 : y == 2 ? r2 : r3, src_len, dst_len, w,       \
                       y == 0 ? d0 : y == 1 ? d1 : y == 2 ? d2 : d3);                           \
    }

SPATTN_ROWS(f32, float)
SPATTN_ROWS(f16, __half)
SPATTN_ROWS(bf16, __nv_bfloat16)
