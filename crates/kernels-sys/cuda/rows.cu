// Rows moved by index, for the halo exchange of partitioned plans: a rank packs the K/V rows
// each other rank asks for into one contiguous block per receiver (gather), and sums the
// gradient rows sent back to it into its own rows (scatter-add, in f32). Rows are `row_len`
// contiguous elements. Kernel names: {op}_rows_{dtype}.
#include "common.cuh"

// dst[i, :] = src[idx[i], :] for i < n_idx.
template <class T>
__device__ void gather_rows(const T* __restrict__ src, const u32* __restrict__ idx, u64 n_idx,
                            u32 row_len, T* __restrict__ dst) {
    SPATTN_GRID_STRIDE(i, n_idx * row_len) {
        const u64 r = i / row_len;
        dst[i] = src[(u64)idx[r] * row_len + (i - r * row_len)];
    }
}

// acc[idx[i], :] += src[i, :] for i < n_idx. The indices of one call are distinct (a sender's
// rows), so no two threads add to one element; calls in rank order make the sums deterministic.
template <class T>
__device__ void scatter_add_rows(const T* __restrict__ src, const u32* __restrict__ idx,
                                 u64 n_idx, u32 row_len, float* acc) {
    SPATTN_GRID_STRIDE(i, n_idx * row_len) {
        const u64 r = i / row_len;
        acc[(u64)idx[r] * row_len + (i - r * row_len)] += to_f32(src[i]);
    }
}

#define SPATTN_ROWS(S, T)                                                                       \
    extern "C" __global__ void gather_rows_##S(const T* src, const u32* idx, u64 n_idx,         \
                                               u32 row_len, T* dst) {                           \
        gather_rows<T>(src, idx, n_idx, row_len, dst);                                          \
    }                                                                                           \
    extern "C" __global__ void scatter_add_rows_##S(const T* src, const u32* idx, u64 n_idx,    \
                                                    u32 row_len, float* acc) {                  \
        scatter_add_rows<T>(src, idx, n_idx, row_len, acc);                                     \
    }

SPATTN_ROWS(f32, float)
SPATTN_ROWS(f16, __half)
SPATTN_ROWS(bf16, __nv_bfloat16)
