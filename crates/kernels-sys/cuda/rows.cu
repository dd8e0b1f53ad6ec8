// Rows moved by index, for the halo exchange of partitioned plans: a rank packs the K/V rows
// each other rank asks for into one contiguous block per receiver (gather), and sums the
// gradient rows sent back to it into its own rows (scatter-add, in f32). Rows are `row_len`
// contiguous elements. Kernel names: {op}_rows_{dtype}.
#include "common.cuh"

// Lanes per row: the power of two >= units (units >= 1), at most 32, so that groups tile a warp
// and short rows do not leave most of it idle.
__device__ __forceinline__ u32 row_group(u32 units) {
    return units >= 32 ? 32u : 1u << (32 - __clz(units - 1));
}

// Rows in groups of `g` lanes, grid-stride: no division per element (it dominated the copy).
#define SPATTN_ROW_GROUPS(r, lane, g, n_rows)                                                   \
    const u64 spattn_t = (u64)blockIdx.x * blockDim.x + threadIdx.x;                            \
    const u32 lane = (u32)(spattn_t % (g));                                                     \
    for (u64 r = spattn_t / (g); r < (n_rows); r += (u64)gridDim.x * blockDim.x / (g))

// dst[i, :] = src[idx[i], :] for i < n_idx, rows of `units` elements of U.
template <class U>
__device__ void gather_units(const U* __restrict__ src, const u32* __restrict__ idx, u64 n_idx,
                             u32 units, U* __restrict__ dst) {
    const u32 g = row_group(units);
    SPATTN_ROW_GROUPS(r, lane, g, n_idx) {
        const U* s = src + (u64)idx[r] * units;
        U* d = dst + r * units;
        for (u32 j = lane; j < units; j += g) d[j] = s[j];
    }
}

// dst[i, :] = src[idx[i], :] for i < n_idx: 16-byte pieces where rows allow them.
template <class T>
__device__ void gather_rows(const T* __restrict__ src, const u32* __restrict__ idx, u64 n_idx,
                            u32 row_len, T* __restrict__ dst) {
    if (row_len == 0) return;
    const u64 bytes = (u64)row_len * sizeof(T);
    if (bytes % 16 == 0 && (((size_t)src | (size_t)dst) & 15) == 0)
        gather_units<uint4>((const uint4*)src, idx, n_idx, (u32)(bytes / 16), (uint4*)dst);
    else
        gather_units<T>(src, idx, n_idx, row_len, dst);
}

// acc[idx[i], :] += src[i, :] for i < n_idx. The indices of one call are distinct (a sender's
// rows), so no two threads add to one element; calls in rank order make the sums deterministic.
template <class T>
__device__ void scatter_add_rows(const T* __restrict__ src, const u32* __restrict__ idx,
                                 u64 n_idx, u32 row_len, float* acc) {
    if (row_len == 0) return;
    const u32 g = row_group(row_len);
    SPATTN_ROW_GROUPS(r, lane, g, n_idx) {
        const T* s = src + r * row_len;
        float* a = acc + (u64)idx[r] * row_len;
        for (u32 j = lane; j < row_len; j += g) a[j] += to_f32(s[j]);
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
