// Fused attention on CSR, CUDA cores (DF-GNN style): out = softmax_row(scale * Q K^T masked by A) V
// in one pass over each row's edges with an online softmax (running max, running sum, f32
// accumulator); no scores ever reach device memory.
//
// Work comes as units (see csr_ops.cu): unit u covers edges unit_starts[u] .. unit_starts[u+1]
// of row unit_rows[u]; rows longer than the host's chunk are split into several units. A group of
// g lanes takes one (unit, head); in f32 a warp's groups walk their units in step
// (csr_edges_online's STEP), so the dot products' sums are full-mask shuffles. Plain kernels:
// each lane owns NV vectors of VEC features of the head (feature (lane + j*g) * VEC for j < NV),
// with q in registers; per tile of 4 edges: 4 K and 4 V vectors in flight per lane, 4 group
// reductions interleaved, one rescale (in step, a unit's last tile may be partial: its empty
// slots weigh 0; else single edges finish the unit).
//
// Short-tile kernels (`_t2`): each lane owns one vector (feature lane_in_subgroup * VEC, VEC as
// wide as the host's layout allows) and edges come in tiles of 2. The g lanes form es >= 1
// subgroups of g / es lanes; subgroup i walks the i-th of es equal shares of the unit's edges
// (its own running max, sum and accumulator), and the es partials are merged exactly by
// shuffles at the unit's end. es = 1 ("narrow" groups of 8 or 16 lanes, several units a warp):
// fewer instructions per edge than the plain kernels' 32 lanes of narrow vectors. es > 1
// ("split" groups of 32 lanes): also a hub unit's chain of steps es times shorter, for launches
// of a few waves, at a few shuffles per unit for the merge (the plan chooses, fused_csr.rs).
//
// A unit of an unsplit row writes its output row directly (zeros for a row without edges). A
// unit of a split row writes its partial (m, l, acc) to slot unit_parts[u]; fused_csr_merge then
// merges the partials of each split row exactly.
//
// Each kernel has two twins that also take attention's extras (csr_edges_online's EdgeExtras)
// in the caller's CSR order: `_x` a score bias and dropout, `_xf` edge features on K and V too.
// Dropout scales only what weighs V, so acc / l is the output and the partials merge as they
// are; a row whose every edge is masked (-inf bias) has l = 0 and writes zeros.

#include "attention_tiles.cuh"

// The extras of the `_x` kernels (see EdgeExtras): bias (null, or nnz x bias_heads), edge
// features (null, or nnz x heads x head_dim), dropout, all in the caller's CSR order; unit u's
// edges are the caller's edges e + unit_shift[u] (null: the same).
template <class T> struct ExtrasArgs {
    const T* bias;
    u32 bias_heads;
    const T* feats;
    const u32* unit_shift;
    Dropout drop;
};

template <class T, int VEC, int NV, int TILE, bool SPLIT, bool EXTRAS, bool FEATS = false>
__device__ __forceinline__ void fused_csr(const u32* __restrict__ unit_rows,
                                          const u32* __restrict__ unit_starts,
                                          const u32* __restrict__ unit_parts, u32 n_units,
                                          const u32* __restrict__ col_indices,
                                          const T* __restrict__ q, const T* __restrict__ k,
                                          const T* __restrict__ v, u32 heads, u32 head_dim,
                                          float scale, u32 g, u32 es, T* __restrict__ out,
                                          float* __restrict__ part_ml,
                                          float* __restrict__ part_acc,
                                          const ExtrasArgs<T>* xa) {
    // The group's g lanes form es subgroups of gs lanes (es = 1 unless SPLIT; the host passes
    // es and g powers of two, es dividing g); subgroup `sub` walks edges s0 .. s1, its share of
    // the unit's, and the es partials are merged by shuffles at the end (an empty share leaves
    // m = -inf, l = 0, acc = 0, which merges as nothing). Shifts, not divisions.
    const u32 es_log2 = SPLIT ? (u32)(__ffs(es) - 1) : 0u;
    const u32 gs = g >> es_log2;
    const u32 mask = group_mask(g), sub_mask = group_mask(gs);
    const u32 glane = lane_id() & (g - 1u);
    const u32 sub = glane >> (u32)(__ffs(gs) - 1), lane = glane & (gs - 1u);
    const u64 hd = (u64)heads * head_dim;
    const u64 group = grid_group(g), groups = grid_groups(g);
    const u64 total = (u64)n_units * heads;
    // f32 walks in step; f16 / bf16 ran 0.97-1.0x so (docs/kernels/fused-csr.md) and do not.
    constexpr bool STEP = sizeof(T) == 4;
    for (u64 uh = group; warp_more<STEP>(uh, total); uh += groups) {
        // A group past its last unit-head takes the last one's row with no edges, stores nothing.
        const bool act = !STEP || uh < total;
        u32 h;
        const u64 u = split_index(act ? uh : total - 1u, heads, total, h);
        const u32 row = unit_rows[u];
        const u32 start = unit_starts[u], end = act ? unit_starts[u + 1] : start;
        const u32 len = end - start;
        const u32 s0 = start + (u32)(((u64)len * sub) >> es_log2);
        const u32 s1 = start + (u32)(((u64)len * (sub + 1u)) >> es_log2);
        const u64 head_off = (u64)h * head_dim;

        bool on[NV];
        u32 feat[NV];
        float qv[NV][VEC], acc[NV][VEC];
#pragma unroll
        for (int j = 0; j < NV; ++j) {
            feat[j] = (lane + j * gs) * VEC;
            on[j] = feat[j] < head_dim;
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                acc[j][i] = 0.0f;
                qv[j][i] = 0.0f;
            }
            if (on[j]) {
                load_vec<T, VEC>(q + (u64)row * hd + head_off + feat[j], qv[j]);
#pragma unroll
                for (int i = 0; i < VEC; ++i) qv[j][i] *= scale;
            }
        }
        float m = SPATTN_NEG_INF, l = 0.0f;
        if constexpr (EXTRAS) {
            const EdgeExtras<T, FEATS> xt = {xa->bias,
                                      xa->feats,
                                      nullptr,
                                      xa->bias_heads,
                                      h,
                                      heads,
                                      xa->unit_shift != nullptr ? xa->unit_shift[u] : 0u,
                                      1.0f,
                                      xa->drop};
            csr_edges_online<T, VEC, NV, false, TILE, EdgeExtras<T, FEATS>, STEP>(
                col_indices, s0, s1, k, v, hd, head_off, on, feat, qv, sub_mask, gs, m, l, acc, xt);
        } else {
            csr_edges_online<T, VEC, NV, false, TILE, NoEdgeExtras, STEP>(
                col_indices, s0, s1, k, v, hd, head_off, on, feat, qv, sub_mask, gs, m, l, acc);
        }
        for (u32 o = gs; SPLIT && o < g; o <<= 1) {
            const float m2 = __shfl_xor_sync(mask, m, o), l2 = __shfl_xor_sync(mask, l, o);
            float c1, c2;
            online_merge(m, l, m2, l2, c1, c2);
#pragma unroll
            for (int j = 0; j < NV; ++j)
#pragma unroll
                for (int i = 0; i < VEC; ++i)
                    acc[j][i] = acc[j][i] * c1 + __shfl_xor_sync(mask, acc[j][i], o) * c2;
        }
        if (!act || (SPLIT && sub != 0u)) continue;

        const u32 part = unit_parts[u];
        if (part == SPATTN_NONE) {
            // A row without edges has l = 0: write zeros.
            const float inv = softmax_inv(l);
#pragma unroll
            for (int j = 0; j < NV; ++j) {
                if (on[j]) {
                    float o[VEC];
#pragma unroll
                    for (int i = 0; i < VEC; ++i) o[i] = acc[j][i] * inv;
                    store_vec<T, VEC>(out + (u64)row * hd + head_off + feat[j], o);
                }
            }
        } else {
            const u64 slot = (u64)part * heads + h;
            if (lane == 0) {
                part_ml[2 * slot] = m;
                part_ml[2 * slot + 1] = l;
            }
#pragma unroll
            for (int j = 0; j < NV; ++j)
                if (on[j])
#pragma unroll
                    for (int i = 0; i < VEC; ++i)
                        part_acc[slot * head_dim + feat[j] + i] = acc[j][i];
        }
    }
}

// Merges the partials of each split row: one thread per (split row, head, feature).
// Partials of split row s are part_first[s] .. part_first[s+1].
template <class T>
__device__ __forceinline__ void fused_csr_merge(const u32* __restrict__ split_rows,
                                                const u32* __restrict__ part_first, u32 n_split,
                                                u32 heads, u32 head_dim,
                                                const float* __restrict__ part_ml,
                                                const float* __restrict__ part_acc,
                                                T* __restrict__ out) {
    const u64 hd = (u64)heads * head_dim;
    const u64 total = (u64)n_split * hd;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        const u64 s = i / hd;
        const u64 rem = i - s * hd;
        u32 d;
        const u32 h = (u32)split_index(rem, head_dim, hd, d);
        float m = SPATTN_NEG_INF, l = 0.0f, a = 0.0f;
        for (u32 p = part_first[s]; p < part_first[s + 1]; ++p) {
            const u64 slot = (u64)p * heads + h;
            float c1, c2;
            online_merge(m, l, part_ml[2 * slot], part_ml[2 * slot + 1], c1, c2);
            a = a * c1 + part_acc[slot * head_dim + d] * c2;
        }
        // l is 0 for a row masked whole, NaN for a NaN score (the row's output NaN).
        out[(u64)split_rows[s] * hd + rem] = from_f32<T>(l != 0.0f ? a / l : 0.0f);
    }
}

// The `_x` twins: `_x` takes a bias and dropout, `_xf` edge features too (FEATS: the tile then
// holds the features beside V, which costs registers the others need not pay).
#define SPATTN_FUSED_X(NAME, T, VEC, NV, TILE, SPLIT, FEATS)                                    \
    extern "C" __global__ void NAME(                                                            \
        const u32* unit_rows, const u32* unit_starts, const u32* unit_parts, u32 n_units,       \
        const u32* col_indices, const T* q, const T* k, const T* v, u32 heads, u32 head_dim,    \
        float scale, u32 g, u32 es, T* out, float* part_ml, float* part_acc, const T* bias,     \
        u32 bias_heads, const T* feats, const u32* unit_shift, u32 key0, u32 key1, u32 off0,    \
        u32 off1, u32 threshold, float drop_scale) {                                            \
        const ExtrasArgs<T> xa = {bias,       bias_heads, feats, unit_shift,                    \
                                  {key0, key1, off0, off1, threshold, drop_scale}};             \
        fused_csr<T, VEC, NV, TILE, SPLIT, true, FEATS>(unit_rows, unit_starts, unit_parts,     \
                                                        n_units, col_indices, q, k, v, heads,   \
                                                        head_dim, scale, g, es, out, part_ml,   \
                                                        part_acc, &xa);                         \
    }
#define SPATTN_FUSED_T(NAME, T, VEC, NV, TILE, SPLIT)                                           \
    extern "C" __global__ void NAME(const u32* unit_rows, const u32* unit_starts,               \
                                    const u32* unit_parts, u32 n_units, const u32* col_indices, \
                                    const T* q, const T* k, const T* v, u32 heads,              \
                                    u32 head_dim, float scale, u32 g, u32 es, T* out,           \
                                    float* part_ml, float* part_acc) {                          \
        fused_csr<T, VEC, NV, TILE, SPLIT, false>(unit_rows, unit_starts, unit_parts, n_units,  \
                                                  col_indices, q, k, v, heads, head_dim, scale, \
                                                  g, es, out, part_ml, part_acc, nullptr);      \
    }                                                                                           \
    SPATTN_FUSED_X(NAME##_x, T, VEC, NV, TILE, SPLIT, false)                                     \
    SPATTN_FUSED_X(NAME##_xf, T, VEC, NV, TILE, SPLIT, true)
#define SPATTN_FUSED(SUFFIX, T, VEC, NV)                                                        \
    SPATTN_FUSED_T(fused_csr_##SUFFIX##_v##VEC##_n##NV, T, VEC, NV, 4, false)
// Short-tile kernels: one vector per lane (a group or subgroup of fewer than 32 lanes covers the
// head), tiles of 2 edges, groups split into es >= 1 subgroups. VEC 4 and 8 only: the host runs
// them where the plain layout fills a warp yet at most 16 lanes hold the head one vector each,
// which vectors of 1 or 2 features never allow (short_layout in ops/src/fused/csr.rs).
#define SPATTN_FUSED_SHORT(SUFFIX, T, VEC)                                                      \
    SPATTN_FUSED_T(fused_csr_##SUFFIX##_v##VEC##_n1_t2, T, VEC, 1, 2, true)

#define SPATTN_FUSED_PLAIN(SUFFIX, T, VEC)                                                      \
    SPATTN_FUSED(SUFFIX, T, VEC, 1)                                                             \
    SPATTN_FUSED(SUFFIX, T, VEC, 2)                                                             \
    SPATTN_FUSED(SUFFIX, T, VEC, 4)

#define SPATTN_FUSED_NV(SUFFIX, T, VEC)                                                         \
    SPATTN_FUSED_SHORT(SUFFIX, T, VEC)                                                          \
    SPATTN_FUSED_PLAIN(SUFFIX, T, VEC)

#define SPATTN_FUSED_DTYPE(SUFFIX, T)                                                           \
    extern "C" __global__ void fused_csr_merge_##SUFFIX(                                        \
        const u32* split_rows, const u32* part_first, u32 n_split, u32 heads, u32 head_dim,     \
        const float* part_ml, const float* part_acc, T* out) {                                  \
        fused_csr_merge<T>(split_rows, part_first, n_split, heads, head_dim, part_ml, part_acc,  \
                           out);                                                                \
    }                                                                                           \
    SPATTN_FUSED_PLAIN(SUFFIX, T, 1)                                                            \
    SPATTN_FUSED_PLAIN(SUFFIX, T, 2)                                                            \
    SPATTN_FUSED_NV(SUFFIX, T, 4)

SPATTN_FUSED_DTYPE(f32, float)
SPATTN_FUSED_DTYPE(f16, __half)
SPATTN_FUSED_DTYPE(bf16, __nv_bfloat16)
SPATTN_FUSED_NV(f16, __half, 8)
SPATTN_FUSED_NV(bf16, __nv_bfloat16, 8)
