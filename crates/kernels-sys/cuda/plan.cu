// Plans built on the GPU: a graph's CSR (with the CUDA-core kernels' schedules), its transpose
// and edge map, and the BSB of fused-tc, from an edge list in device memory, by sort, scan and
// scatter kernels with no copy of the graph to the host (docs/kernels/plan.md). The host reads
// back one status block per build (sizes, statistics, the first bad edge).
#include "attention_tiles.cuh"  // common.cuh, and BSB_PIPE_PRE_WORDS of the prologue records

#define PLAN_THREADS 256
#define PLAN_ITEMS 8
// Elements per tile of the scans and the radix sort: 256 threads x 8.
#define PLAN_TILE (PLAN_THREADS * PLAN_ITEMS)
#define PLAN_WARPS (PLAN_THREADS / 32)
#define RADIX_BINS 256
// csr_ops::UNIT_CHUNK and SoftmaxSchedule::DEFAULT_LONG_THRESHOLD (device_plan.rs checks both).
#define PLAN_UNIT_CHUNK 64u
#define PLAN_LONG_ROW 256u
#define PLAN_BUCKETS 33

// The status block's words (u64; zeroed by the host before a build). Mirrored by device_plan.rs.
#define ST_BAD 0            // max over bad input edges e of (~0 - e); 0: none
#define ST_UNSORTED 1       // non-zero: the keys are out of order (the sort runs)
#define ST_DUPLICATES 2     // input edges repeating an earlier input edge
#define ST_MIN_DEGREE_INV 3 // max over rows of (~0 - degree); 0: no rows
#define ST_MAX_DEGREE 4
#define ST_NNZ 5            // distinct edges (written by the CSR's last key)
#define ST_HISTOGRAM 8      // PLAN_BUCKETS words: rows per degree bucket (0; 1; 2-3; 4-7; ...)
#define ST_TOTALS 42        // 4 words: units, split rows, partials, long rows (the schedules')

// ---- edge keys --------------------------------------------------------------------------------
// Key of edge (row, col): row << col_bits | col (rows = targets, cols = sources). Keys 0..E are
// the input edges, E..2E their reverses (symmetrize), then one self loop per node (self_loops);
// vals[i] = i. An input edge with an id out of range is recorded in the status (the first one
// wins) and keyed as (0, 0), so no later kernel indexes past the graph. A key smaller than the
// one before it flags the status: the sort runs only then.

// Key i of the list (see above); `bad` where input edge i has an id out of range.
template <class I>
__device__ __forceinline__ u64 edge_key(u64 i, const I* __restrict__ src, u64 src_stride,
                                        const I* __restrict__ dst, u64 dst_stride, u64 n_edges,
                                        u64 listed, u32 n_rows, u32 n_cols, u32 col_bits,
                                        bool& bad) {
    u64 row = 0, col = 0;
    bad = false;
    if (i < listed) {
        const u64 e = i < n_edges ? i : i - n_edges;
        const long long s = (long long)src[e * src_stride];
        const long long d = (long long)dst[e * dst_stride];
        if (s >= 0 && d >= 0 && (unsigned long long)s < n_cols && (unsigned long long)d < n_rows) {
            // Reverses exist only for square graphs: (s, d) is in range too.
            row = i < n_edges ? (u64)d : (u64)s;
            col = i < n_edges ? (u64)s : (u64)d;
        } else {
            bad = i < n_edges;
        }
    } else {
        row = col = i - listed;
    }
    return (row << col_bits) | col;
}

template <class I>
__device__ void edge_keys(const I* __restrict__ src, u64 src_stride, const I* __restrict__ dst,
                          u64 dst_stride, u64 n_edges, u32 n_rows, u32 n_cols, u32 col_bits,
                          u32 symmetrize, u32 n_loops, u64* __restrict__ keys,
                          u32* __restrict__ vals, u64* status) {
    const u64 listed = symmetrize ? 2 * n_edges : n_edges;
    const u64 total = listed + n_loops;
    SPATTN_GRID_STRIDE(i, total) {
        bool bad, prev_bad;
        const u64 key =
            edge_key(i, src, src_stride, dst, dst_stride, n_edges, listed, n_rows, n_cols, col_bits, bad);
        if (bad) atomicMax(status + ST_BAD, ~0ull - i);
        if (i > 0 && key < edge_key(i - 1, src, src_stride, dst, dst_stride, n_edges, listed,
                                    n_rows, n_cols, col_bits, prev_bad))
            atomicOr(status + ST_UNSORTED, 1ull);
        keys[i] = key;
        vals[i] = (u32)i;
    }
}

#define PLAN_EDGE_KEYS(S, I)                                                                    \
    extern "C" __global__ void plan_edge_keys_##S(                                              \
        const I* src, u64 src_stride, const I* dst, u64 dst_stride, u64 n_edges, u32 n_rows,    \
        u32 n_cols, u32 col_bits, u32 symmetrize, u32 n_loops, u64* keys, u32* vals,            \
        u64* status) {                                                                          \
        edge_keys<I>(src, src_stride, dst, dst_stride, n_edges, n_rows, n_cols, col_bits,       \
                     symmetrize, n_loops, keys, vals, status);                                  \
    }

PLAN_EDGE_KEYS(i32, int)
PLAN_EDGE_KEYS(i64, long long)
PLAN_EDGE_KEYS(u32, unsigned int)

// Keys of a transposed CSR: edge e of row r and column c becomes c << row_bits | r, value e.
// The CSR is sorted by row, so a stable sort by the column bits alone sorts these. With `count`
// (the entry count on the device, when the CSR's buffers are sized by a bound), entries past it
// get the largest key: they sort after every real one.
extern "C" __global__ void plan_transpose_keys(const u32* __restrict__ row_indices,
                                               const u32* __restrict__ col_indices, u64 n,
                                               const u64* count, u32 row_bits,
                                               u64* __restrict__ keys, u32* __restrict__ vals) {
    const u64 real = count != nullptr ? min(*count, n) : n;
    SPATTN_GRID_STRIDE(e, n) {
        keys[e] = e < real ? ((u64)col_indices[e] << row_bits) | row_indices[e] : ~0ull;
        vals[e] = (u32)e;
    }
}

// ---- scans ------------------------------------------------------------------------------------
// Exclusive prefix sums over u32 or uint4 (four independent sums), in tiles of PLAN_TILE: one
// block looping over the tiles where they are few, else one pass with decoupled look-back.

__device__ __forceinline__ u32 plan_add(u32 a, u32 b) { return a + b; }
__device__ __forceinline__ uint4 plan_add(uint4 a, uint4 b) {
    return make_uint4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}
__device__ __forceinline__ u32 plan_sub(u32 a, u32 b) { return a - b; }
__device__ __forceinline__ uint4 plan_sub(uint4 a, uint4 b) {
    return make_uint4(a.x - b.x, a.y - b.y, a.z - b.z, a.w - b.w);
}
template <class T> __device__ __forceinline__ T plan_zero();
template <> __device__ __forceinline__ u32 plan_zero<u32>() { return 0u; }
template <> __device__ __forceinline__ uint4 plan_zero<uint4>() { return make_uint4(0, 0, 0, 0); }
__device__ __forceinline__ u32 plan_shfl_up(u32 v, u32 o) { return __shfl_up_sync(0xffffffffu, v, o); }
__device__ __forceinline__ uint4 plan_shfl_up(uint4 v, u32 o) {
    return make_uint4(__shfl_up_sync(0xffffffffu, v.x, o), __shfl_up_sync(0xffffffffu, v.y, o),
                      __shfl_up_sync(0xffffffffu, v.z, o), __shfl_up_sync(0xffffffffu, v.w, o));
}
__device__ __forceinline__ u32 plan_shfl_xor(u32 v, u32 m) { return __shfl_xor_sync(0xffffffffu, v, m); }
__device__ __forceinline__ uint4 plan_shfl_xor(uint4 v, u32 m) {
    return make_uint4(__shfl_xor_sync(0xffffffffu, v.x, m), __shfl_xor_sync(0xffffffffu, v.y, m),
                      __shfl_xor_sync(0xffffffffu, v.z, m), __shfl_xor_sync(0xffffffffu, v.w, m));
}

// Inclusive prefix sum of v over the warp's first `width` lanes (every lane calls it).
template <class T>
__device__ __forceinline__ T warp_inclusive(T v, u32 lane, u32 width = 32) {
#pragma unroll
    for (u32 o = 1; o < width; o <<= 1) {
        const T y = plan_shfl_up(v, o);
        if (lane >= o) v = plan_add(v, y);
    }
    return v;
}

// Scans in[base .. base + PLAN_TILE) (elements past n read as 0) into out (written below n),
// each output plus `carry`; returns the tile's sum. Every thread of the block calls it.
template <class T>
__device__ T scan_tile(const T* in, T* out, u64 base, u64 n, T carry, T* buf, T* warp_sums) {
    const u32 lane = lane_id(), warp = threadIdx.x >> 5;
    for (u32 k = threadIdx.x; k < PLAN_TILE; k += PLAN_THREADS) {
        const u64 i = base + k;
        buf[k] = i < n ? in[i] : plan_zero<T>();
    }
    __syncthreads();
    T local[PLAN_ITEMS];
    T sum = plan_zero<T>();
#pragma unroll
    for (int j = 0; j < PLAN_ITEMS; ++j) {
        local[j] = buf[threadIdx.x * PLAN_ITEMS + j];
        sum = plan_add(sum, local[j]);
    }
    const T incl = warp_inclusive(sum, lane);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        const T w = warp_inclusive(lane < PLAN_WARPS ? warp_sums[lane] : plan_zero<T>(), lane,
                                   PLAN_WARPS);
        if (lane < PLAN_WARPS) warp_sums[lane] = w;
    }
    __syncthreads();
    T run = plan_add(carry, plan_sub(incl, sum));
    if (warp > 0) run = plan_add(run, warp_sums[warp - 1]);
#pragma unroll
    for (int j = 0; j < PLAN_ITEMS; ++j) {
        buf[threadIdx.x * PLAN_ITEMS + j] = run;
        run = plan_add(run, local[j]);
    }
    __syncthreads();
    for (u32 k = threadIdx.x; k < PLAN_TILE; k += PLAN_THREADS) {
        const u64 i = base + k;
        if (i < n) out[i] = buf[k];
    }
    const T total = warp_sums[PLAN_WARPS - 1];
    __syncthreads();  // buf and warp_sums are reused by the caller's next tile
    return total;
}

// One block: the tile sums scanned in place, their total into *total_out.
template <class T>
__device__ void scan_sums(T* sums, u64 n_tiles, T* total_out) {
    __shared__ T buf[PLAN_TILE];
    __shared__ T warp_sums[PLAN_WARPS];
    T carry = plan_zero<T>();
    for (u64 base = 0; base < n_tiles; base += PLAN_TILE)
        carry = plan_add(carry, scan_tile(sums, sums, base, n_tiles, carry, buf, warp_sums));
    if (threadIdx.x == 0) *total_out = carry;
}

// One pass over many tiles, in place (decoupled look-back): tiles take tickets from a counter
// that only grows (every block of every launch takes one; the host passes the launch's first),
// tile = ticket - first, in the order blocks start, so a tile waits only on started blocks.
// A tile's status word is ticket << 2 | state: status words of earlier launches never read as
// ready (the host keeps the status words apart from the sums, whatever each launch's size).
// Its aggregate (state 1) or inclusive prefix (state 2) is written before the word, behind a
// fence. The first warp looks back, 32 tiles at a time. The last tile writes the total to data[n].
#define SCAN_AGGREGATE 1ull
#define SCAN_INCLUSIVE 2ull

template <class T>
__device__ void scan_pass(T* data, u64 n, unsigned long long* tickets, u64 first, T* aggregates,
                          T* inclusives, u64* status) {
    __shared__ T buf[PLAN_TILE];
    __shared__ T warp_sums[PLAN_WARPS];
    __shared__ u64 tile_s;
    __shared__ T carry_s;
    const u32 lane = lane_id(), warp = threadIdx.x >> 5;
    if (threadIdx.x == 0) tile_s = atomicAdd(tickets, 1ull) - first;
    __syncthreads();
    const u64 tile = tile_s, base = tile * PLAN_TILE;
    T sum = plan_zero<T>();
    for (u32 k = threadIdx.x; k < PLAN_TILE; k += PLAN_THREADS) {
        const u64 i = base + k;
        if (i < n) sum = plan_add(sum, data[i]);
    }
    sum = warp_inclusive(sum, lane);
    if (lane == 31) warp_sums[warp] = sum;
    __syncthreads();
    if (warp == 0) {
        T total = plan_zero<T>();
        for (int w = 0; w < PLAN_WARPS; ++w) total = plan_add(total, warp_sums[w]);
        volatile u64* st = status;
        T carry = plan_zero<T>();
        if (tile > 0) {
            if (lane == 0) {
                __stcg(aggregates + tile, total);
                __threadfence();
                st[tile] = (first + tile) << 2 | SCAN_AGGREGATE;
            }
            // The warp looks back 32 tiles at a time, lane l at tile hi - l, until a window holds
            // an inclusive prefix (tile 0's is): the sum of its tiles up to the newest such.
            for (long long hi = (long long)tile - 1;; hi -= 32) {
                const long long j = hi - (long long)lane;
                u64 word = 0;
                if (j >= 0) {
                    do word = st[j];
                    while ((word >> 2) != first + (u64)j || (word & 3ull) == 0);
                }
                __syncwarp();
                __threadfence();
                const bool inclusive = j >= 0 && (word & 3ull) == SCAN_INCLUSIVE;
                const u32 found = __ballot_sync(0xffffffffu, inclusive);
                const u32 last = found != 0 ? (u32)__ffs(found) - 1 : 31u;
                T v = plan_zero<T>();
                if (j >= 0 && lane <= last) v = __ldcg((inclusive ? inclusives : aggregates) + j);
#pragma unroll
                for (u32 o = 16; o > 0; o >>= 1) v = plan_add(v, plan_shfl_xor(v, o));
                carry = plan_add(carry, v);
                if (found != 0) break;
            }
        }
        if (lane == 0) {
            __stcg(inclusives + tile, plan_add(carry, total));
            __threadfence();
            st[tile] = (first + tile) << 2 | SCAN_INCLUSIVE;
            if (base + PLAN_TILE >= n) data[n] = plan_add(carry, total);
            carry_s = carry;
        }
    }
    __syncthreads();
    scan_tile(data, data, base, n, carry_s, buf, warp_sums);
}

#define PLAN_SCAN(S, T)                                                                         \
    extern "C" __global__ void __launch_bounds__(PLAN_THREADS)                                  \
        plan_scan_sums_##S(T* sums, u64 n_tiles, T* total_out) {                                \
        scan_sums<T>(sums, n_tiles, total_out);                                                 \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(PLAN_THREADS)                                  \
        plan_scan_pass_##S(T* data, u64 n, unsigned long long* tickets, u64 first,              \
                           T* aggregates, T* inclusives, u64* status) {                         \
        scan_pass<T>(data, n, tickets, first, aggregates, inclusives, status);                  \
    }

PLAN_SCAN(u32, u32)
PLAN_SCAN(u32x4, uint4)

// ---- radix sort -------------------------------------------------------------------------------
// Onesweep LSD passes of 8 bits over u64 keys with u32 values, stable (Adinets and Merrill): one
// launch counts every pass's digits over all keys; each pass is then one launch whose blocks take
// tile ids in the order they start, rank their tile's keys by digit, and find each digit's place
// among the earlier tiles by decoupled look-back, so no pass waits for a separate scan. With
// `unsorted` non-null and its word 0, the keys are already in order: the passes do nothing but
// the last of an odd count, which copies (the host expects the result in the other buffer).

#define RADIX_MAX_PASSES 8
// A look-back word: tag << 34 | flag << 32 | count. Flag LB_AGGREGATE: the tile's own count of
// the digit; LB_INCLUSIVE: the count over every tile up to it. The tag is the pass's, unique per
// launch of a workspace, so a word left by an earlier pass reads as not yet written (no zeroing).
#define LB_AGGREGATE 1ull
#define LB_INCLUSIVE 2ull
#define LB_BATCH 4

// counts[p * RADIX_BINS + d] += the keys whose digit p (bits shift + 8p ..) is d; `counts` is
// zeroed by the host first.
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
    plan_radix_histogram(const u64* __restrict__ keys, u64 n, u32 shift, u32 n_passes,
                         u32* __restrict__ counts, const u64* unsorted) {
    if (unsorted != nullptr && *unsorted == 0) return;
    __shared__ u32 hist[RADIX_MAX_PASSES * RADIX_BINS];
    for (u32 j = threadIdx.x; j < n_passes * RADIX_BINS; j += PLAN_THREADS) hist[j] = 0;
    __syncthreads();
    const u64 base = (u64)blockIdx.x * PLAN_TILE;
#pragma unroll
    for (int k = 0; k < PLAN_ITEMS; ++k) {
        const u64 i = base + (u64)k * PLAN_THREADS + threadIdx.x;
        if (i < n) {
            const u64 key = keys[i];
            for (u32 p = 0; p < n_passes; ++p)
                atomicAdd(&hist[p * RADIX_BINS + ((u32)(key >> (shift + 8 * p)) & (RADIX_BINS - 1))], 1u);
        }
    }
    __syncthreads();
    for (u32 j = threadIdx.x; j < n_passes * RADIX_BINS; j += PLAN_THREADS)
        if (hist[j] != 0) atomicAdd(&counts[j], hist[j]);
}

// One pass by digit `shift`: `totals` the pass's 256 digit counts (plan_radix_histogram's),
// `next_tile` a counter zeroed by the host, `lookback` a word per (tile, digit). Each warp takes
// 256 consecutive keys of its tile, 32 at a time: the rank of a key among the equal digits
// before it is its warp's count so far plus the lanes of its match below it.
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
    plan_radix_onesweep(const u64* __restrict__ keys_in, const u32* __restrict__ vals_in,
                        u64* __restrict__ keys_out, u32* __restrict__ vals_out, u64 n, u32 shift,
                        const u32* __restrict__ totals, u32* next_tile, u64* lookback, u32 tag,
                        u32 copy_if_sorted, const u64* unsorted) {
    if (unsorted != nullptr && *unsorted == 0) {
        const u64 base = (u64)blockIdx.x * PLAN_TILE;
        if (copy_if_sorted) {
            for (u32 k = threadIdx.x; k < PLAN_TILE; k += PLAN_THREADS) {
                const u64 i = base + k;
                if (i < n) {
                    keys_out[i] = keys_in[i];
                    vals_out[i] = vals_in[i];
                }
            }
        }
        return;
    }
    __shared__ u32 warp_next[PLAN_WARPS][RADIX_BINS];
    __shared__ u32 warp_sums[PLAN_WARPS];
    __shared__ u32 tile_id;
    const u32 lane = lane_id(), warp = threadIdx.x >> 5;
    // Ids in start order: a tile waits only on tiles whose blocks have started, so it never
    // waits on a block that cannot be scheduled.
    if (threadIdx.x == 0) tile_id = atomicAdd(next_tile, 1u);
    for (u32 j = threadIdx.x; j < PLAN_WARPS * RADIX_BINS; j += PLAN_THREADS)
        (&warp_next[0][0])[j] = 0;
    __syncthreads();
    const u64 tile = tile_id;
    const u64 wbase = tile * PLAN_TILE + (u64)warp * (32 * PLAN_ITEMS);
    u64 key[PLAN_ITEMS];
    u32 val[PLAN_ITEMS], digit[PLAN_ITEMS];
#pragma unroll
    for (int k = 0; k < PLAN_ITEMS; ++k) {
        const u64 i = wbase + (u64)k * 32 + lane;
        const bool in = i < n;
        key[k] = in ? keys_in[i] : 0;
        val[k] = in ? vals_in[i] : 0;
        digit[k] = in ? (u32)(key[k] >> shift) & (RADIX_BINS - 1) : RADIX_BINS;  // none
    }
#pragma unroll
    for (int k = 0; k < PLAN_ITEMS; ++k) {
        const u32 peers = __match_any_sync(0xffffffffu, digit[k]);
        if (digit[k] < RADIX_BINS && lane == (u32)__ffs(peers) - 1)
            warp_next[warp][digit[k]] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();
    // Thread d: the tile's count of digit d, published before anything is awaited.
    const u32 d = threadIdx.x;
    u32 count = 0;
#pragma unroll
    for (int w = 0; w < PLAN_WARPS; ++w) count += warp_next[w][d];
    volatile u64* status = lookback;
    const u64 tagged = (u64)tag << 34;
    status[tile * RADIX_BINS + d] = tagged | ((tile == 0 ? LB_INCLUSIVE : LB_AGGREGATE) << 32) | count;
    // Digit d's first slot over all tiles: the keys of the digits below it.
    const u32 total = totals[d];
    const u32 incl = warp_inclusive(total, lane);
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    u32 run = incl - total;
    for (u32 w = 0; w < warp; ++w) run += warp_sums[w];
    // Then the keys of digit d in the tiles before this one.
    if (tile > 0) {
        // Four words read at once (their latencies overlap), taken in order down to the first
        // inclusive one; a word not yet written for this pass is read again from there.
        u32 before = 0;
        long long j = (long long)tile - 1;
        for (bool done = false; !done;) {
            u64 words[LB_BATCH];
#pragma unroll
            for (int q = 0; q < LB_BATCH; ++q)
                words[q] = j - q >= 0 ? status[(u64)(j - q) * RADIX_BINS + d] : 0;
#pragma unroll
            for (int q = 0; q < LB_BATCH && !done; ++q) {
                // Tile 0 writes an inclusive word, so j - q >= 0 wherever this is reached.
                if ((words[q] >> 34) != tag) break;  // not yet written by tile j - q
                before += (u32)words[q];
                done = ((words[q] >> 32) & 3ull) == LB_INCLUSIVE;
                --j;
            }
        }
        status[tile * RADIX_BINS + d] = tagged | (LB_INCLUSIVE << 32) | (before + count);
        run += before;
    }
#pragma unroll
    for (int w = 0; w < PLAN_WARPS; ++w) {
        const u32 c = warp_next[w][d];
        warp_next[w][d] = run;
        run += c;
    }
    __syncthreads();
    const u32 below = (1u << lane) - 1u;
#pragma unroll
    for (int k = 0; k < PLAN_ITEMS; ++k) {
        const u32 peers = __match_any_sync(0xffffffffu, digit[k]);
        const bool real = digit[k] < RADIX_BINS;
        if (real) {
            const u32 pos = warp_next[warp][digit[k]] + __popc(peers & below);
            keys_out[pos] = key[k];
            vals_out[pos] = val[k];
        }
        __syncwarp();
        if (real && lane == (u32)__ffs(peers) - 1) warp_next[warp][digit[k]] += __popc(peers);
        __syncwarp();
    }
}

// ---- CSR from sorted keys -----------------------------------------------------------------------

// flags[i] = 1 where key i starts a run of equal keys (a distinct edge); counts the input edges
// that repeat an earlier input edge (a stable sort keeps equal keys in input order, input edges
// first).
extern "C" __global__ void plan_unique_flags(const u64* __restrict__ keys,
                                             const u32* __restrict__ vals, u64 n, u64 n_input,
                                             u32* __restrict__ flags, u64* status) {
    SPATTN_GRID_STRIDE(i, n) {
        const bool repeat = i > 0 && keys[i] == keys[i - 1];
        flags[i] = repeat ? 0u : 1u;
        if (repeat && vals[i] < n_input) atomicAdd(status + ST_DUPLICATES, 1ull);
    }
}

// The CSR of n sorted keys: distinct key i goes to entry u = ex[i] (ex: the exclusive scan of
// the flags, n + 1 long; null: every key is distinct, u = i). Row offset r is the entry of the
// first key of a row ≥ r, found by thread r's binary search (a row after a long run of empty
// ones costs no thread more than a search); the last key writes the edge count into the status.
// Input edge v (vals below n_input) maps to its entry in positions (i64, for torch) and/or map
// (u32); with positions, the self loop keyed v ≥ loop_base (u64 max: none asked for) to
// positions[n_input + v − loop_base]. With `count`, only the first *count keys are the CSR's.
extern "C" __global__ void plan_csr_build(const u64* __restrict__ keys,
                                          const u32* __restrict__ vals, u64 n_keys,
                                          const u64* count, const u32* __restrict__ ex,
                                          u32 col_bits, u32 n_rows,
                                          u64 n_input, u64 loop_base, u32* __restrict__ row_offsets,
                                          u32* __restrict__ col_indices,
                                          u32* __restrict__ row_indices,
                                          long long* __restrict__ positions,
                                          u32* __restrict__ map, u64* status) {
    const u64 col_mask = (1ull << col_bits) - 1;
    const u64 n = count != nullptr ? min(*count, n_keys) : n_keys;
    SPATTN_GRID_STRIDE(t, max(n, (u64)n_rows + 1)) {
        if (t <= n_rows) {
            const u64 lowest = (u64)t << col_bits;  // row t's smallest key
            u64 lo = 0, hi = n;
            while (lo < hi) {
                const u64 mid = (lo + hi) / 2;
                if (keys[mid] < lowest) lo = mid + 1;
                else hi = mid;
            }
            row_offsets[t] = ex != nullptr ? ex[lo] : (u32)lo;  // ex[n]: the distinct keys
        }
        if (t >= n) continue;
        const u64 i = t;
        const u64 key = keys[i];
        const u32 row = (u32)(key >> col_bits);
        const bool first = i == 0 || keys[i - 1] != key;
        const u32 u = ex != nullptr ? ex[i] + (first ? 1u : 0u) - 1u : (u32)i;
        if (first) {
            col_indices[u] = (u32)(key & col_mask);
            if (row_indices != nullptr) row_indices[u] = row;
        }
        if (i == n - 1) status[ST_NNZ] = u + 1;
        const u32 v = vals[i];
        if (v < n_input) {
            if (positions != nullptr) positions[v] = (long long)u;
            if (map != nullptr) map[v] = u;
        } else if (positions != nullptr && v >= loop_base) {
            positions[n_input + (v - loop_base)] = (long long)u;
        }
    }
}

// ---- row schedules and degree statistics ------------------------------------------------------

// Per row: (units of at most PLAN_UNIT_CHUNK edges, 1 if split, its units if split, 1 if long),
// scanned next into each row's first unit, slot, first partial and long-row index; and the
// degree statistics into the status.
extern "C" __global__ void __launch_bounds__(PLAN_THREADS)
    plan_row_counts(const u32* __restrict__ row_offsets, u32 n_rows, uint4* __restrict__ counts,
                    u64* status) {
    __shared__ u32 hist[PLAN_BUCKETS];
    for (u32 j = threadIdx.x; j < PLAN_BUCKETS; j += PLAN_THREADS) hist[j] = 0;
    __syncthreads();
    u32 lo = 0xffffffffu, hi = 0;
    bool seen = false;
    SPATTN_GRID_STRIDE(r, (u64)n_rows) {
        const u32 deg = row_offsets[r + 1] - row_offsets[r];
        const u32 units = deg == 0 ? 1u : (deg + PLAN_UNIT_CHUNK - 1) / PLAN_UNIT_CHUNK;
        const u32 split = deg > PLAN_UNIT_CHUNK ? 1u : 0u;
        counts[r] = make_uint4(units, split, split ? units : 0u, deg >= PLAN_LONG_ROW ? 1u : 0u);
        atomicAdd(&hist[deg == 0 ? 0 : 32 - __clz(deg)], 1u);
        lo = min(lo, deg);
        hi = max(hi, deg);
        seen = true;
    }
    lo = __reduce_min_sync(0xffffffffu, lo);
    hi = __reduce_max_sync(0xffffffffu, hi);
    if (__any_sync(0xffffffffu, seen) && lane_id() == 0) {
        atomicMax(status + ST_MIN_DEGREE_INV, ~0ull - lo);
        atomicMax(status + ST_MAX_DEGREE, (u64)hi);
    }
    __syncthreads();
    for (u32 j = threadIdx.x; j < PLAN_BUCKETS; j += PLAN_THREADS)
        if (hist[j] != 0) atomicAdd(status + ST_HISTOGRAM + j, (u64)hist[j]);
}

// The CSR kernels' schedules from the scanned counts `ex` (n_rows + 1 entries): RowUnits (rows,
// starts, slots, partials of each unit; split rows and their first partials) and the long rows
// of the edge softmax, in row order, as spattn_ops::schedule builds them on the host.
extern "C" __global__ void plan_row_units(const u32* __restrict__ row_offsets, u32 n_rows,
                                          const uint4* __restrict__ ex,
                                          u32* __restrict__ unit_rows,
                                          u32* __restrict__ unit_starts,
                                          u32* __restrict__ unit_slots,
                                          u32* __restrict__ unit_parts,
                                          u32* __restrict__ split_rows,
                                          u32* __restrict__ part_first,
                                          u32* __restrict__ long_rows, u64* status) {
    SPATTN_GRID_STRIDE(r, (u64)n_rows) {
        const u32 s = row_offsets[r], e = row_offsets[r + 1], deg = e - s;
        const uint4 x = ex[r];  // first unit, slot, first partial, long-row index
        const bool split = deg > PLAN_UNIT_CHUNK;
        const u32 units = deg == 0 ? 1u : (deg + PLAN_UNIT_CHUNK - 1) / PLAN_UNIT_CHUNK;
        for (u32 j = 0; j < units; ++j) {
            unit_rows[x.x + j] = (u32)r;
            unit_starts[x.x + j] = s + j * PLAN_UNIT_CHUNK;
            unit_slots[x.x + j] = split ? x.y : SPATTN_NONE;
            unit_parts[x.x + j] = split ? x.z + j : SPATTN_NONE;
        }
        if (split) {
            split_rows[x.y] = (u32)r;
            part_first[x.y] = x.z;
        }
        if (deg >= PLAN_LONG_ROW) long_rows[x.w] = (u32)r;
        if (r + 1 == n_rows) {
            const uint4 t = ex[n_rows];
            unit_starts[t.x] = e;
            part_first[t.y] = t.z;
            status[ST_TOTALS] = t.x;
            status[ST_TOTALS + 1] = t.y;
            status[ST_TOTALS + 2] = t.z;
            status[ST_TOTALS + 3] = t.w;
        }
    }
}

// ---- BSB and ME-BCRS ---------------------------------------------------------------------------
// A window's edges (rows 2^b w .. 2^b (w + 1), b = win_bits: 4 for BSB, 3 for ME-BCRS; contiguous
// in the CSR) ordered by (column, row in window): edge e of row r goes to place sum over the
// window's other rows q of (their columns below c) + (rows q < r holding c itself) + (its own
// index in row r). The window-ordered key w << (32 + b) | c << b | (r mod 2^b) (w < 2^(32 - b):
// 64 bits) then gives the distinct columns (runs of w, c: equal keys >> b): BSB's blocks and
// bits, ME-BCRS's vectors and masks. edge_of_place (nullable) receives each place's edge.

extern "C" __global__ void plan_bsb_rank(const u32* __restrict__ row_offsets,
                                         const u32* __restrict__ col_indices,
                                         const u32* __restrict__ row_indices, u32 n_rows,
                                         u64 nnz, u32 win_bits, u64* __restrict__ wkeys,
                                         u32* __restrict__ edge_of_place) {
    const u32 win_rows = 1u << win_bits;
    SPATTN_GRID_STRIDE(e, nnz) {
        const u32 r = row_indices[e], c = col_indices[e];
        const u32 r0 = r & ~(win_rows - 1u);
        const u32 r1 = (u32)min((u64)r0 + win_rows, (u64)n_rows);
        u32 pos = (u32)e - row_offsets[r];
        for (u32 q = r0; q < r1; ++q) {
            if (q == r) continue;
            const u32 begin = row_offsets[q], end = row_offsets[q + 1];
            u32 lo = begin, hi = end;
            while (lo < hi) {
                const u32 mid = lo + ((hi - lo) >> 1);
                if (col_indices[mid] < c)
                    lo = mid + 1;
                else
                    hi = mid;
            }
            pos += lo - begin;
            if (q < r && lo < end && col_indices[lo] == c) ++pos;
        }
        const u64 p = (u64)row_offsets[r0] + pos;
        wkeys[p] = ((u64)(r >> win_bits) << (32 + win_bits)) | ((u64)c << win_bits) |
                   (r & (win_rows - 1u));
        if (edge_of_place) edge_of_place[p] = (u32)e;
    }
}

// flags[p] = 1 where window-ordered edge p is the first of its (window, column).
extern "C" __global__ void plan_bsb_flags(const u64* __restrict__ wkeys, u64 nnz, u32 win_bits,
                                          u32* __restrict__ flags) {
    SPATTN_GRID_STRIDE(p, nnz) {
        flags[p] = (p == 0 || (wkeys[p] >> win_bits) != (wkeys[p - 1] >> win_bits)) ? 1u : 0u;
    }
}

// Blocks of each window: its distinct columns (from their exclusive scan dex, nnz + 1 entries)
// over 8, rounded up; scanned next into the window offsets, which the host reads back.
extern "C" __global__ void plan_bsb_window_blocks(const u32* __restrict__ row_offsets, u32 n_rows,
                                                  u32 n_windows, const u32* __restrict__ dex,
                                                  u32* __restrict__ window_blocks) {
    SPATTN_GRID_STRIDE(w, (u64)n_windows) {
        const u32 a = row_offsets[w * 16], b = row_offsets[min(w * 16 + 16, (u64)n_rows)];
        const u32 blocks = (dex[b] - dex[a] + 7) / 8;
        window_blocks[w] = blocks;
    }
}

// Each distinct column into its block's slot, each edge's bit into its block's bitmap (4 u32
// words per block, bit r * 8 + slot: the byte image of the host's u128). block_columns is
// PADDING-filled and the bitmaps zeroed before.
extern "C" __global__ void plan_bsb_fill(const u64* __restrict__ wkeys, u64 nnz,
                                         const u32* __restrict__ dex,
                                         const u32* __restrict__ row_offsets,
                                         const u32* __restrict__ window_offsets,
                                         u32* __restrict__ block_columns,
                                         u32* __restrict__ bitmap_words) {
    SPATTN_GRID_STRIDE(p, nnz) {
        const u64 k = wkeys[p];
        const u32 w = (u32)(k >> 36), c = (u32)(k >> 4), r = (u32)k & 15u;
        const bool first = p == 0 || (wkeys[p - 1] >> 4) != (k >> 4);
        const u32 d = dex[p] + (first ? 1u : 0u) - 1u;
        const u32 local = d - dex[row_offsets[w * 16]];
        const u32 block = window_offsets[w] + (local >> 3), slot = local & 7u;
        if (first) block_columns[(u64)block * 8 + slot] = c;
        const u32 bit = r * 8 + slot;
        atomicOr(bitmap_words + (u64)block * 4 + (bit >> 5), 1u << (bit & 31u));
    }
}

// ME-BCRS (8-row windows): row_pointers[w] = the vectors before window w (w ≤ n_windows), from
// the exclusive scan dex of the window-ordered first-of-(window, column) flags (nnz + 1 entries).
extern "C" __global__ void plan_mebcrs_pointers(const u32* __restrict__ row_offsets, u32 n_rows,
                                                u32 n_windows, const u32* __restrict__ dex,
                                                u32* __restrict__ row_pointers) {
    SPATTN_GRID_STRIDE(w, (u64)n_windows + 1) {
        row_pointers[w] = dex[row_offsets[min(w * 8, (u64)n_rows)]];
    }
}

// Each window-ordered edge p (keys of 8-row windows: w << 35 | c << 3 | r): its vector d (window
// order: dex[p], less one past the run's first), its slot d · 8 + r into edge_to_slot at its edge; a run's first edge writes the
// vector's column and its mask, the OR of the run's (at most 8) rows. No atomics: each vector
// is written by one thread.
extern "C" __global__ void plan_mebcrs_fill(const u64* __restrict__ wkeys, u64 nnz,
                                            const u32* __restrict__ dex,
                                            const u32* __restrict__ edge_of_place,
                                            u32* __restrict__ column_indices,
                                            unsigned char* __restrict__ row_masks,
                                            u32* __restrict__ edge_to_slot) {
    SPATTN_GRID_STRIDE(p, nnz) {
        const u64 k = wkeys[p];
        const bool first = p == 0 || (wkeys[p - 1] >> 3) != (k >> 3);
        const u32 d = dex[p] + (first ? 1u : 0u) - 1u;
        edge_to_slot[edge_of_place[p]] = d * 8u + ((u32)k & 7u);
        if (!first) continue;
        column_indices[d] = (u32)(k >> 3);
        u32 mask = 0;
        for (u64 q = p; q < nnz && (wkeys[q] >> 3) == (k >> 3); ++q)
            mask |= 1u << ((u32)wkeys[q] & 7u);
        row_masks[d] = (unsigned char)mask;
    }
}

// ---- fused-tc's extras edge map ---------------------------------------------------------------
// Per block its first edge in block-and-bit order (bits row-major), then per edge in that order
// its caller edge: the popcounts of the blocks scanned into starts, then each entry's rank among
// its block's bits. For a BSB in the graph's own row order (no caller-row lookup).

// counts[b] = the edges of block b (its bitmap's popcount); scanned next into the starts.
extern "C" __global__ void plan_bsb_block_edges(const u64* __restrict__ bitmap_words, u32 n_blocks,
                                                u32* __restrict__ counts) {
    SPATTN_GRID_STRIDE(b, (u64)n_blocks) {
        counts[b] = __popcll(bitmap_words[2 * b]) + __popcll(bitmap_words[2 * b + 1]);
    }
}

// Entry e (row r, column c) of the CSR the BSB was built from: c's slot among its window's block
// columns (ascending, padding last) by binary search, its bit r mod 16 · 8 + slot, and its rank
// among the block's set bits below it; ids[starts[block] + rank] = ids_of[e] (e where null). An
// entry whose column or bit the BSB lacks (a CSR of another graph) writes nothing.
extern "C" __global__ void plan_bsb_edge_ids(const u32* __restrict__ row_indices,
                                             const u32* __restrict__ col_indices, u64 nnz,
                                             const u32* __restrict__ ids_of,
                                             const u32* __restrict__ window_offsets,
                                             const u32* __restrict__ block_columns,
                                             const u64* __restrict__ bitmap_words,
                                             const u32* __restrict__ starts, u32* __restrict__ ids) {
    SPATTN_GRID_STRIDE(e, nnz) {
        const u32 r = row_indices[e], c = col_indices[e], w = r >> 4;
        const u32 end = window_offsets[w + 1] * 8u;
        u32 lo = window_offsets[w] * 8u, hi = end;
        while (lo < hi) {
            const u32 mid = lo + ((hi - lo) >> 1);
            if (block_columns[mid] < c)
                lo = mid + 1;
            else
                hi = mid;
        }
        if (lo == end || block_columns[lo] != c) continue;
        const u32 block = lo >> 3, bit = (r & 15u) * 8u + (lo & 7u);
        const u64 w0 = bitmap_words[2 * (u64)block], w1 = bitmap_words[2 * (u64)block + 1];
        const u64 mine = bit < 64 ? w0 >> bit : w1 >> (bit - 64);
        if (!(mine & 1ull)) continue;
        const u32 rank = bit < 64 ? __popcll(w0 & ((1ull << bit) - 1ull))
                                  : __popcll(w0) + __popcll(w1 & ((1ull << (bit - 64)) - 1ull));
        const u64 p = (u64)starts[block] + rank;
        if (p < nnz) ids[p] = ids_of ? ids_of[e] : (u32)e;
    }
}

// ---- fused-tc's prologue records --------------------------------------------------------------
// Per unit (window, first block, end block, part), BSB_PIPE_PRE_WORDS words: slot l of step
// s < 2 (block first + 2 s + l / 8, column l % 8; NONE past the unit) at 16 s + l, then the
// caller row of each of the window's 16 rows (NONE past the matrix).
extern "C" __global__ void plan_tc_prologue(const u32* __restrict__ units, u32 n_units,
                                            const u32* __restrict__ block_columns,
                                            const u32* __restrict__ row_ids, u32 n_rows,
                                            u32* __restrict__ pre) {
    SPATTN_GRID_STRIDE(i, (u64)n_units * BSB_PIPE_PRE_WORDS) {
        const u64 unit = i / BSB_PIPE_PRE_WORDS;
        const u32 j = (u32)(i - unit * BSB_PIPE_PRE_WORDS);
        const u32 w = units[unit * 4], first = units[unit * 4 + 1], end = units[unit * 4 + 2];
        u32 v;
        if (j < 32) {
            const u32 block = first + 2 * (j / 16) + (j % 16) / 8;
            v = block < end ? block_columns[(u64)block * 8 + j % 8] : SPATTN_NONE;
        } else {
            const u64 row = (u64)w * 16 + (j - 32);
            v = row < n_rows ? caller_row(row_ids, (u32)row) : SPATTN_NONE;
        }
        pre[i] = v;
    }
}

// ---- helpers -----------------------------------------------------------------------------------

// out[i] = i: the edge CSR's columns (edge e of A at column e).
extern "C" __global__ void plan_iota_u32(u32* __restrict__ out, u64 n) {
    SPATTN_GRID_STRIDE(i, n) { out[i] = (u32)i; }
}

// out[i] = (i64)in[i]: device index arrays as torch's int64.
extern "C" __global__ void plan_widen_u32_i64(const u32* __restrict__ in, u64 n,
                                              long long* __restrict__ out) {
    SPATTN_GRID_STRIDE(i, n) { out[i] = (long long)in[i]; }
}
