// CUDA-core ops on CSR: SDDMM (dot, GAT and GATv2 forms), edge softmax, SpMM.
//
// Layouts: dense operands rows x heads x head_dim, row-major (hd = heads * head_dim elements per
// row); per-edge values (scores, probabilities) nnz x heads, f32, edges in CSR order. Inputs
// of type T (float, __half, __nv_bfloat16); every sum is accumulated in f32.
//
// Vector width VEC: each lane moves VEC consecutive features at once. The host picks the
// largest VEC in {8,4,2,1} with VEC * sizeof(T) <= 16 that divides head_dim, so a vector
// never straddles two heads and every vector access is aligned.

#include "common.cuh"

// ---- SDDMM, dot form --------------------------------------------------------------------------
// S[e,h] = scale * <Q[row(e),h,:], K[col(e),h,:]>. Edge-parallel (balanced on any degree
// distribution): a group of g lanes takes one edge at a time (grid-stride), walks the heads, and
// its lanes stride over head_dim in vectors. g = smallest power of two >= head_dim / VEC, <= 32.

template <class T, int VEC>
__device__ __forceinline__ void sddmm_csr(const u32* __restrict__ row_indices,
                                          const u32* __restrict__ col_indices, u32 nnz,
                                          const T* __restrict__ q, const T* __restrict__ k,
                                          u32 heads, u32 head_dim, float scale, u32 g,
                                          float* __restrict__ scores) {
    const u32 mask = group_mask(g);
    const u32 lane = lane_id() & (g - 1u);
    const u64 hd = (u64)heads * head_dim;
    const u64 group = grid_group(g), groups = grid_groups(g);
    for (u64 e = group; e < nnz; e += groups) {
        const T* qr = q + (u64)row_indices[e] * hd;
        const T* kr = k + (u64)col_indices[e] * hd;
        for (u32 h = 0; h < heads; ++h) {
            float acc = 0.0f;
            for (u32 d = lane * VEC; d < head_dim; d += g * VEC) {
                float a[VEC], b[VEC];
                load_vec<T, VEC>(qr + (u64)h * head_dim + d, a);
                load_vec<T, VEC>(kr + (u64)h * head_dim + d, b);
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc = fmaf(a[i], b[i], acc);
            }
            acc = group_sum(acc, mask, g);
            if (lane == 0) scores[e * heads + h] = acc * scale;
        }
    }
}

// ---- SDDMM, GAT form (u_add_v) -------------------------------------------------------------
// S[e,h] = a_dst[row(e),h] + a_src[col(e),h]; one thread per (edge, head).

template <class T>
__device__ __forceinline__ void sddmm_gat_csr(const u32* __restrict__ row_indices,
                                              const u32* __restrict__ col_indices, u32 nnz,
                                              const T* __restrict__ a_dst,
                                              const T* __restrict__ a_src, u32 heads,
                                              float* __restrict__ scores) {
    const u64 total = (u64)nnz * heads;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u32 h;
        const u64 e = split_index(i, heads, total, h);
        scores[i] = to_f32(a_dst[(u64)row_indices[e] * heads + h]) +
                    to_f32(a_src[(u64)col_indices[e] * heads + h]);
    }
}

// ---- SDDMM, GATv2 form ------------------------------------------------------------------------
// S[e,h] = sum_d att[h,d] * LeakyReLU(XL[col(e),h,d] + XR[row(e),h,d] (+ EF[e,h,d])): GATv2's
// score, its per-edge sum x_i + x_j never stored. att is f32, heads x head_dim; EF (null for
// none) is per edge, nnz x heads x head_dim of T. Edge-parallel groups as the dot form.

template <class T, int VEC>
__device__ __forceinline__ void sddmm_gatv2_csr(const u32* __restrict__ row_indices,
                                                const u32* __restrict__ col_indices, u32 nnz,
                                                const T* __restrict__ xl,
                                                const T* __restrict__ xr,
                                                const T* __restrict__ ef,
                                                const float* __restrict__ att, float slope,
                                                u32 heads, u32 head_dim, u32 g,
                                                float* __restrict__ scores) {
    const u32 mask = group_mask(g);
    const u32 lane = lane_id() & (g - 1u);
    const u64 hd = (u64)heads * head_dim;
    const u64 group = grid_group(g), groups = grid_groups(g);
    for (u64 e = group; e < nnz; e += groups) {
        const T* l = xl + (u64)col_indices[e] * hd;
        const T* r = xr + (u64)row_indices[e] * hd;
        for (u32 h = 0; h < heads; ++h) {
            float acc = 0.0f;
            for (u32 d = lane * VEC; d < head_dim; d += g * VEC) {
                const u64 o = (u64)h * head_dim + d;
                float a[VEC], b[VEC], c[VEC];
                load_vec<T, VEC>(l + o, a);
                load_vec<T, VEC>(r + o, b);
                if (ef != nullptr) {
                    load_vec<T, VEC>(ef + e * hd + o, c);
                } else {
#pragma unroll
                    for (int i = 0; i < VEC; ++i) c[i] = 0.0f;
                }
#pragma unroll
                for (int i = 0; i < VEC; ++i)
                    acc = fmaf(__ldg(att + o + i), leaky_relu(a[i] + b[i] + c[i], slope), acc);
            }
            acc = group_sum(acc, mask, g);
            if (lane == 0) scores[e * heads + h] = acc;
        }
    }
}

// ---- SpMM ---------------------------------------------------------------------------------
// O[i,h,:] = sum over edges e of row i of P[e,h] * V[col(e),h,:].
//
// Work comes as units: unit u covers edges unit_starts[u] .. unit_starts[u+1] of row
// unit_rows[u]. A row longer than the host's chunk is split into several units (hub rows are
// spread over many groups); every row, empty ones included, has at least one unit, so every
// output row is written. A unit of a split row has a partial (unit_parts[u] != NONE, a row's
// partials consecutive): it stores its partial sum into scratch[part], and spmm_csr_finalize adds
// each split row's partials in order and writes the row. No atomics: bitwise reproducible.
//
// A group of g lanes takes one unit and a tile of g * VEC features (blockIdx.y picks the tile);
// each lane owns VEC accumulators.

template <class T, int VEC>
__device__ __forceinline__ void spmm_csr(const u32* __restrict__ unit_rows,
                                         const u32* __restrict__ unit_starts,
                                         const u32* __restrict__ unit_parts, u32 n_units,
                                         const u32* __restrict__ col_indices,
                                         const float* __restrict__ p, const T* __restrict__ v,
                                         u32 heads, u32 head_dim, u32 g, T* __restrict__ out,
                                         float* __restrict__ scratch) {
    const u32 lane = lane_id() & (g - 1u);
    const u64 hd = (u64)heads * head_dim;
    const u64 col = ((u64)blockIdx.y * g + lane) * VEC;  // first feature of this lane
    const bool active = col < hd;
    const u32 head = active ? (u32)(col / head_dim) : 0u;
    const u64 group = grid_group(g), groups = grid_groups(g);
    for (u64 u = group; u < n_units; u += groups) {
        float acc[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
        const u32 start = unit_starts[u], end = unit_starts[u + 1];
        if (active) {
            u32 e = start;
            // Four edges at a time: four independent gathers in flight per lane.
            for (; e + 4 <= end; e += 4) {
                u32 c[4];
                float w[4], x[4][VEC];
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    c[j] = __ldg(col_indices + e + j);
                    w[j] = __ldg(p + (u64)(e + j) * heads + head);
                }
#pragma unroll
                for (int j = 0; j < 4; ++j) load_vec<T, VEC>(v + (u64)c[j] * hd + col, x[j]);
#pragma unroll
                for (int j = 0; j < 4; ++j)
#pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[i] = fmaf(w[j], x[j][i], acc[i]);
            }
            for (; e < end; ++e) {
                const u32 c = __ldg(col_indices + e);
                const float w = __ldg(p + (u64)e * heads + head);
                float x[VEC];
                load_vec<T, VEC>(v + (u64)c * hd + col, x);
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[i] = fmaf(w, x[i], acc[i]);
            }
            const u32 part = unit_parts[u];
            if (part == SPATTN_NONE) {
                store_vec<T, VEC>(out + (u64)unit_rows[u] * hd + col, acc);
            } else {
                float* s = scratch + (u64)part * hd + col;
#pragma unroll
                for (int i = 0; i < VEC; ++i) s[i] = acc[i];
            }
        }
    }
}

// Writes the rows that were split across units: out[split_rows[s]] = the sum of scratch's
// partials part_first[s] .. part_first[s + 1], added in part order.
template <class T>
__device__ __forceinline__ void spmm_csr_finalize(const u32* __restrict__ split_rows,
                                                  const u32* __restrict__ part_first,
                                                  u32 n_split, u32 hd,
                                                  const float* __restrict__ scratch,
                                                  T* __restrict__ out) {
    const u64 total = (u64)n_split * hd;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (u64)gridDim.x * blockDim.x) {
        u32 f;
        const u64 s = split_index(i, hd, total, f);
        float sum = 0.0f;
        for (u32 k = part_first[s]; k < part_first[s + 1]; ++k) sum += scratch[(u64)k * hd + f];
        out[(u64)split_rows[s] * hd + f] = from_f32<T>(sum);
    }
}

// ---- edge softmax -------------------------------------------------------------------------
// P[e,h] = exp(x_e - max) / sum over the row's edges, x = S[e,h] or LeakyReLU(S[e,h]).
// The running max starts at -inf; a row without edges has nothing to write, and a row whose
// scores are all -inf (masked) gets zeros, as on the CPU (no -inf - -inf). `out` may alias
// `scores` (in place): each element is read before it is written by the same thread.

// A group of g lanes per (row, head): rows of fewer than `long_threshold` edges.
extern "C" __global__ void edge_softmax_csr_rows(const u32* __restrict__ row_offsets, u32 n_rows,
                                                 u32 heads, const float* scores, int leaky,
                                                 float slope, u32 g, u32 long_threshold,
                                                 float* out) {
    const u32 mask = group_mask(g);
    const u32 lane = lane_id() & (g - 1u);
    const u64 group = grid_group(g), groups = grid_groups(g);
    const u64 total = (u64)n_rows * heads;
    for (u64 rh = group; rh < total; rh += groups) {
        u32 h;
        const u64 row = split_index(rh, heads, total, h);
        const u32 start = row_offsets[row], end = row_offsets[row + 1];
        if (end - start >= long_threshold) continue;  // uniform across the group
        float m = SPATTN_NEG_INF;
        for (u32 e = start + lane; e < end; e += g) {
            float x = scores[(u64)e * heads + h];
            if (leaky) x = leaky_relu(x, slope);
            m = fmaxf(m, x);
        }
        m = group_max(m, mask, g);
        m = softmax_base(m);  // all masked: exp(-inf) = 0, and inv = 0 below
        float sum = 0.0f;
        for (u32 e = start + lane; e < end; e += g) {
            float x = scores[(u64)e * heads + h];
            if (leaky) x = leaky_relu(x, slope);
            sum += __expf(x - m);
        }
        sum = group_sum(sum, mask, g);
        const float inv = softmax_inv(sum);
        for (u32 e = start + lane; e < end; e += g) {
            const u64 i = (u64)e * heads + h;
            float x = scores[i];
            if (leaky) x = leaky_relu(x, slope);
            out[i] = __expf(x - m) * inv;
        }
    }
}

// One block per (long row, head): blockIdx.x indexes long_rows, blockIdx.y is the head.
extern "C" __global__ void edge_softmax_csr_long_rows(const u32* __restrict__ row_offsets,
                                                      const u32* __restrict__ long_rows,
                                                      u32 heads, const float* scores, int leaky,
                                                      float slope, float* out) {
    __shared__ float scratch[32];
    const u32 row = long_rows[blockIdx.x];
    const u32 h = blockIdx.y;
    const u32 start = row_offsets[row], end = row_offsets[row + 1];
    float m = SPATTN_NEG_INF;
    for (u32 e = start + threadIdx.x; e < end; e += blockDim.x) {
        float x = scores[(u64)e * heads + h];
        if (leaky) x = leaky_relu(x, slope);
        m = fmaxf(m, x);
    }
    m = block_reduce(m, scratch, true);
    m = softmax_base(m);  // all masked: exp(-inf) = 0, and inv = 0 below
    float sum = 0.0f;
    for (u32 e = start + threadIdx.x; e < end; e += blockDim.x) {
        float x = scores[(u64)e * heads + h];
        if (leaky) x = leaky_relu(x, slope);
        sum += __expf(x - m);
    }
    sum = block_reduce(sum, scratch, false);
    const float inv = softmax_inv(sum);
    for (u32 e = start + threadIdx.x; e < end; e += blockDim.x) {
        const u64 i = (u64)e * heads + h;
        float x = scores[i];
        if (leaky) x = leaky_relu(x, slope);
        out[i] = __expf(x - m) * inv;
    }
}

// ---- GAT from row statistics ------------------------------------------------------------------
// GAT's attention (GatScores: s, z = LeakyReLU(s), P = exp(z - lse_i), W = P f with f the
// dropout factor read from a mask of kept bits, `keep`, or 1 where it is null) walked with no
// per-edge buffer: gat_row_stats leaves lse per (row, head); gat_aggregate sums W-weighted rows
// over the units of A (the forward, out = W x) or of A^T (the backward, dx = W^T dOut, with
// d_src = the column sums of dS); gat_grad_rows, over A's units, forms dS = L' P (f dW - D_i)
// with dW = <dOut_i, x_j> and D_i = <dOut_i, out_i> (the forward's output), sums d_dst per row
// and writes dS in A^T's order (and A's, the bias's gradient, where asked). Every pass is shaped
// like spmm_csr: units of at most UNIT_CHUNK edges, four edges in flight, split rows' partials
// added in order by spmm_csr_finalize (or gat_row_stats_finalize): no float atomics. The passes
// walk their units in `order` where given (walk_unit: a locality order of the rows, whose
// gathered rows then meet in L2); every sum keeps its unit's order, so the bits do not change.
//
// Head lanes: a head's head_dim / VEC vectors sit on hl consecutive lanes (hl a power of two,
// at most 32; lanes past head_dim idle), a group of g lanes holds g / hl heads and blockIdx.y
// picks which; a head's dot is a group_sum over its hl lanes. Lanes of no head (past `heads`)
// take the last head's indices and stay idle.
struct GatLanes {
    u32 h, d;     // head, first feature within it
    bool on;      // holds features
    bool lead;    // the head's first lane (writes the head's scalars)
};

template <int VEC>
__device__ __forceinline__ GatLanes gat_lanes(u32 g, u32 hl, u32 heads, u32 head_dim) {
    const u32 lane = lane_id() & (g - 1u);
    const u32 slot = blockIdx.y * (g / hl) + lane / hl;
    GatLanes l;
    l.d = (lane & (hl - 1u)) * VEC;
    l.on = slot < heads && l.d < head_dim;
    l.h = slot < heads ? slot : heads - 1u;
    l.lead = slot < heads && (lane & (hl - 1u)) == 0u;
    return l;
}

// lse[i, h] = log sum_j exp(z_ij) over row i's edges (0 for a row without edges): a head's hl
// lanes stride over the unit's edges, each with an online (max, sum), merged by shuffles; a
// split row's units leave (max, sum) in part_ml for gat_row_stats_finalize.
extern "C" __global__ void gat_row_stats_csr(const u32* __restrict__ unit_rows,
                                             const u32* __restrict__ unit_starts,
                                             const u32* __restrict__ unit_parts, u32 n_units,
                                             const u32* __restrict__ order,
                                             const u32* __restrict__ col_indices, u32 heads,
                                             u32 g, u32 hl, SPATTN_GAT_SCORES_ARGS,
                                             float* __restrict__ lse,
                                             float2* __restrict__ part_ml) {
    const GatScores sc = SPATTN_GAT_SCORES;
    const u32 mask = group_mask(g), k = lane_id() & (hl - 1u);
    const GatLanes ln = gat_lanes<1>(g, hl, heads, hl);
    const u64 group = grid_group(g), groups = grid_groups(g);
    for (u64 i = group; i < n_units; i += groups) {
        const u64 u = walk_unit(order, i);
        const u32 row = unit_rows[u], start = unit_starts[u], end = unit_starts[u + 1];
        const float ad = __ldg(sc.a_dst + (u64)row * heads + ln.h);
        float m = SPATTN_NEG_INF, l = 0.0f;
        // Four edges a lane per step, every load issued before the arithmetic that waits.
        for (u32 e = start + k; e < end; e += 4u * hl) {
            u32 c[4];
            float s[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 pos = e + j * hl;
                c[j] = __ldg(col_indices + (pos < end ? pos : e));
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 pos = e + j * hl < end ? e + j * hl : e;
                s[j] = ad + __ldg(sc.a_src + (u64)c[j] * heads + ln.h);
                if (sc.bias != nullptr) s[j] += __ldg(sc.bias + (u64)pos * heads + ln.h);
            }
            float mt = m;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                s[j] = leaky_relu(s[j], sc.slope);
                if (e + j * hl < end) mt = fmaxf(mt, s[j]);
            }
            l *= online_rescale(m, mt);
            m = mt;
            // All scores -inf so far (a bias masking edges out): base 0 adds exp(-inf) = 0 for
            // each, and a NaN score makes l (so the row's lse and weights) NaN.
            const float base = softmax_base(m);
#pragma unroll
            for (int j = 0; j < 4; ++j)
                if (e + j * hl < end) l += __expf(s[j] - base);
        }
        const float mh = group_max(m, mask, hl);
        l = group_sum(l * online_rescale(m, mh), mask, hl);
        if (!ln.lead) continue;
        const u32 part = unit_parts[u];
        if (part == SPATTN_NONE) {
            lse[(u64)row * heads + ln.h] = softmax_lse(mh, l);
        } else {
            part_ml[(u64)part * heads + ln.h] = make_float2(mh, l);
        }
    }
}

// The split rows' lse from their units' (max, sum), merged in part order.
extern "C" __global__ void gat_row_stats_finalize(const u32* __restrict__ split_rows,
                                                  const u32* __restrict__ part_first, u32 n_split,
                                                  u32 heads, const float2* __restrict__ part_ml,
                                                  float* __restrict__ lse) {
    const u64 total = (u64)n_split * heads;
    SPATTN_GRID_STRIDE(i, total) {
        u32 h;
        const u64 s = split_index(i, heads, total, h);
        float m = SPATTN_NEG_INF, l = 0.0f;
        for (u32 p = part_first[s]; p < part_first[s + 1]; ++p) {
            const float2 ml = part_ml[(u64)p * heads + h];
            float c1, c2;
            online_merge(m, l, ml.x, ml.y, c1, c2);
        }
        lse[(u64)split_rows[s] * heads + h] = softmax_lse(m, l);
    }
}

// The rows kernels' dropout mask in a walk's order: bit k of bits[w], element i = 32w + k =
// p * heads + h < n, is set where A's element order[p] * heads + h (order null: p * heads + h)
// is kept, by the draws of dropout_factor (bits past n are 0). A thread a word, one Philox
// draw per four consecutive elements of A met (eight a word in A's order, or through A^T's
// edge map with heads a multiple of four).
extern "C" __global__ void dropout_keep_bits(u64 n, u32 heads, const u32* __restrict__ order,
                                             u32 key0, u32 key1, u32 off0, u32 off1,
                                             u32 threshold, float drop_scale,
                                             u32* __restrict__ bits) {
    const Dropout d{key0, key1, off0, off1, threshold, drop_scale};
    const u64 words = (n + 31u) / 32u;
    if (order == nullptr) {
        // A's order: the word's 32 elements are eight whole draws.
        SPATTN_GRID_STRIDE(w, words) {
            u32 b = 0u;
#pragma unroll
            for (u32 k = 0; k < 8u; ++k) {
                const uint4 r = dropout_draws(d, w * 8u + k);
                b |= ((u32)(r.x >= threshold) | (u32)(r.y >= threshold) << 1 |
                      (u32)(r.z >= threshold) << 2 | (u32)(r.w >= threshold) << 3)
                     << (4u * k);
            }
            const u64 past = w * 32u + 32u;  // elements past n get 0 bits
            bits[w] = past <= n ? b : b & ((1u << (u32)(n & 31u)) - 1u);
        }
        return;
    }
    SPATTN_GRID_STRIDE(w, words) {
        const u64 i0 = w * 32u;
        u64 p = i0 / heads;
        u32 h = (u32)(i0 - p * heads);
        u64 drawn = ~0ull;
        uint4 r = make_uint4(0u, 0u, 0u, 0u);
        u32 b = 0u;
        for (u32 k = 0; k < 32u && i0 + k < n; ++k) {
            const u64 edge = __ldg(order + p);
            const u64 el = edge * heads + h;
            if (el >> 2 != drawn) {
                drawn = el >> 2;
                r = dropout_draws(d, drawn);
            }
            b |= (u32)(draw_word(r, (u32)el & 3u) >= threshold) << k;
            if (++h == heads) {
                h = 0u;
                ++p;
            }
        }
        bits[w] = b;
    }
}

// out[r] = sum over the unit's entries of W * rows[entry]: TRANSPOSED false walks A (r a row
// i, entries columns j, rows = x: the forward); true walks A^T (r a column j, entries rows i,
// rows = dOut: the backward's dx; t_to_a gives A's edge of an entry where the bias reads it,
// the mask is drawn in A^T's order, and d_src[j] = sum of ds_t over the entries). Split
// units leave f32 partials
// (scratch: features; scratch_src: d_src) for spmm_csr_finalize.
template <class T, int VEC, bool TRANSPOSED, bool DROP>
__device__ __forceinline__ void gat_aggregate(
    const u32* __restrict__ unit_rows, const u32* __restrict__ unit_starts,
    const u32* __restrict__ unit_parts, u32 n_units, const u32* __restrict__ order,
    const u32* __restrict__ entries, const u32* __restrict__ t_to_a, const T* __restrict__ rows,
    u32 heads, u32 head_dim, u32 g, u32 hl, const GatScores& sc, const u32* __restrict__ keep,
    const float* __restrict__ lse, const float* __restrict__ ds_t, T* __restrict__ out,
    float* __restrict__ d_src, float* __restrict__ scratch, float* __restrict__ scratch_src) {
    const GatLanes ln = gat_lanes<VEC>(g, hl, heads, head_dim);
    if (!ln.on) return;  // no shuffles here: idle lanes can leave
    const u64 hd = (u64)heads * head_dim;
    const u64 feat = (u64)ln.h * head_dim + ln.d;
    const float* own = TRANSPOSED ? sc.a_src : sc.a_dst;
    const float* other = TRANSPOSED ? sc.a_dst : sc.a_src;
    const bool by_edge = TRANSPOSED && t_to_a != nullptr;
    const u64 group = grid_group(g), groups = grid_groups(g);
    for (u64 i = group; i < n_units; i += groups) {
        const u64 u = walk_unit(order, i);
        const u32 r = unit_rows[u], start = unit_starts[u], end = unit_starts[u + 1];
        const float a_own = __ldg(own + (u64)r * heads + ln.h);
        const float lse_own = TRANSPOSED ? 0.0f : __ldg(lse + (u64)r * heads + ln.h);
        float acc[VEC];
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc[i] = 0.0f;
        float dsum = 0.0f;
        // A step's indices are loaded during the step before (prefetched), so each step waits
        // for one round of gathers, issued before the arithmetic.
        u32 c[4], edge[4];
        float dsv[4];
        // Past the unit's end (or in an empty unit, which may end the arrays) a lane reads the
        // last entry before the end, weighed 0; the host takes no graph without entries. The
        // mask is in the walk's order (A's or A^T's): read at the entry, not at its edge.
        const u32 last = end > 0u ? end - 1u : 0u;
        const auto indices = [&](u32 e0, u32 (&ci)[4], u32 (&ei)[4], float (&di)[4]) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 pos = e0 + j < end ? e0 + j : last;
                ci[j] = __ldg(entries + pos);
                ei[j] = by_edge ? __ldg(t_to_a + pos) : pos;
                di[j] = TRANSPOSED ? __ldg(ds_t + (u64)pos * heads + ln.h) : 0.0f;
            }
        };
        indices(start, c, edge, dsv);
        for (u32 e = start; e < end; e += 4) {
            float x[4][VEC], ao[4], lz[4], b[4], f[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                load_vec<T, VEC>(rows + (u64)c[j] * hd + feat, x[j]);
                ao[j] = __ldg(other + (u64)c[j] * heads + ln.h);
                lz[j] = TRANSPOSED ? __ldg(lse + (u64)c[j] * heads + ln.h) : lse_own;
                b[j] = sc.bias != nullptr ? __ldg(sc.bias + (u64)edge[j] * heads + ln.h) : 0.0f;
                const u32 pos = e + j < end ? e + j : last;
                f[j] = DROP ? kept_factor(keep, (u64)pos * heads + ln.h, sc.drop.scale) : 1.0f;
            }
            u32 cn[4], en[4];
            float dn[4];
            indices(e + 4, cn, en, dn);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float p = __expf(leaky_relu(a_own + ao[j] + b[j], sc.slope) - lz[j]);
                const bool in = e + j < end;
                const float w = in ? (DROP ? p * f[j] : p) : 0.0f;
                if (TRANSPOSED && in) dsum += dsv[j];
#pragma unroll
                for (int i = 0; i < VEC; ++i) acc[i] = fmaf(w, x[j][i], acc[i]);
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                c[j] = cn[j];
                edge[j] = en[j];
                dsv[j] = dn[j];
            }
        }
        const u32 part = unit_parts[u];
        if (part == SPATTN_NONE) {
            store_vec<T, VEC>(out + (u64)r * hd + feat, acc);
            if (TRANSPOSED && ln.lead) d_src[(u64)r * heads + ln.h] = dsum;
        } else {
            float* s = scratch + (u64)part * hd + feat;
#pragma unroll
            for (int i = 0; i < VEC; ++i) s[i] = acc[i];
            if (TRANSPOSED && ln.lead) scratch_src[(u64)part * heads + ln.h] = dsum;
        }
    }
}

// dS of every edge of A's units (see above): written at a_to_t[e] in ds_t (A^T's order) and at
// e in d_bias where given; d_dst[i] = sum of the row's dS (split units: partials in
// scratch_dst for spmm_csr_finalize). Every lane of a group takes part in the heads' shuffles:
// lanes past a head's width read its first vector and weigh it 0. For 16-bit types a warp's
// groups walk their units in step (its longest unit's steps; a group past the last unit takes an
// empty one and stores nothing), so the sums are full-mask shuffles (warp_groups_sum); f32 ran
// 0.94x in step at 8 x 32 and keeps each group's own walk (docs/kernels/csr-ops.md).
template <class T, int VEC, bool DROP>
__device__ __forceinline__ void gat_grad_rows(
    const u32* __restrict__ unit_rows, const u32* __restrict__ unit_starts,
    const u32* __restrict__ unit_parts, u32 n_units, const u32* __restrict__ order,
    const u32* __restrict__ col_indices, const u32* __restrict__ a_to_t, const T* __restrict__ x,
    const T* __restrict__ out, const T* __restrict__ d_out, u32 heads, u32 head_dim, u32 g, u32 hl,
    const GatScores& sc, const u32* __restrict__ keep, const float* __restrict__ lse,
    float* __restrict__ ds_t, float* __restrict__ d_bias, float* __restrict__ d_dst,
    float* __restrict__ scratch_dst) {
    constexpr bool STEP = sizeof(T) == 2;
    const u32 mask = group_mask(g);
    const GatLanes ln = gat_lanes<VEC>(g, hl, heads, head_dim);
    const u64 hd = (u64)heads * head_dim;
    const u64 feat = (u64)ln.h * head_dim + (ln.on ? ln.d : 0u);
    const u64 group = grid_group(g), groups = grid_groups(g);
    const auto sum = [&](float v) {
        return STEP ? warp_groups_sum(v, hl) : group_sum(v, mask, hl);
    };
    for (u64 ug = group; warp_more<STEP>(ug, n_units); ug += groups) {
        const u64 u = walk_unit(order, ug < n_units ? ug : n_units - 1u);
        const u32 r = unit_rows[u], start = unit_starts[u];
        const u32 end = ug < n_units ? unit_starts[u + 1] : start;
        // A step's indices are loaded during the step before (the first step's before the
        // row's reduction), so each step waits for one round of gathers.
        u32 c[4], tpos[4];
        float b[4];
        const u32 last = end > 0u ? end - 1u : 0u;  // as in gat_aggregate
        const auto indices = [&](u32 e0, u32 (&ci)[4], u32 (&ti)[4], float (&bi)[4]) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const u32 pos = e0 + j < end ? e0 + j : last;
                ci[j] = __ldg(col_indices + pos);
                ti[j] = __ldg(a_to_t + pos);
                bi[j] = sc.bias != nullptr ? __ldg(sc.bias + (u64)pos * heads + ln.h) : 0.0f;
            }
        };
        indices(start, c, tpos, b);
        float dov[VEC], ov[VEC];
        load_vec<T, VEC>(d_out + (u64)r * hd + feat, dov);
        load_vec<T, VEC>(out + (u64)r * hd + feat, ov);
        const float ad = __ldg(sc.a_dst + (u64)r * heads + ln.h);
        const float lz = __ldg(lse + (u64)r * heads + ln.h);
        float dd = 0.0f;
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            dov[i] = ln.on ? dov[i] : 0.0f;  // an idle lane adds nothing to the heads' dots
            dd = fmaf(dov[i], ov[i], dd);
        }
        const float d_row = sum(dd);
        float dsum = 0.0f;
        const u32 steps = warp_tiles<STEP>(end - start, 4u);
        for (u32 it = 0, e = start; STEP ? it < steps : e < end; ++it, e += 4) {
            HeldV<T, VEC> x4[4];
            float as[4], f[4];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                x4[j].load(x + (u64)c[j] * hd + feat);
                as[j] = __ldg(sc.a_src + (u64)c[j] * heads + ln.h);
                const u32 pos = e + j < end ? e + j : last;
                f[j] = DROP ? kept_factor(keep, (u64)pos * heads + ln.h, sc.drop.scale) : 1.0f;
            }
            u32 cn[4], tn[4];
            float bn[4];
            indices(e + 4, cn, tn, bn);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                float dw = 0.0f;
#pragma unroll
                for (int i = 0; i < VEC; ++i) dw = fmaf(dov[i], x4[j].at(i), dw);
                dw = sum(dw);
                if (e + j >= end) continue;
                const u64 edge = (u64)(e + j) * heads + ln.h;
                const float s = ad + as[j] + b[j];
                const float p = __expf(leaky_relu(s, sc.slope) - lz);
                const float dwf = DROP ? dw * f[j] : dw;
                const float ds = p * (dwf - d_row) * (s >= 0.0f ? 1.0f : sc.slope);
                dsum += ds;
                if (ln.lead) {
                    ds_t[(u64)tpos[j] * heads + ln.h] = ds;
                    if (d_bias != nullptr) d_bias[edge] = ds;
                }
            }
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                c[j] = cn[j];
                tpos[j] = tn[j];
                b[j] = bn[j];
            }
        }
        if (!ln.lead || ug >= n_units) continue;
        const u32 part = unit_parts[u];
        if (part == SPATTN_NONE) {
            d_dst[(u64)r * heads + ln.h] = dsum;
        } else {
            scratch_dst[(u64)part * heads + ln.h] = dsum;
        }
    }
}

// ---- extern "C" instantiations: {op}_csr_{dtype}[_v{VEC}] --------------------------------------

#define SPATTN_SDDMM(NAME, T, VEC)                                                              \
    extern "C" __global__ void NAME(const u32* row_indices, const u32* col_indices, u32 nnz,   \
                                    const T* q, const T* k, u32 heads, u32 head_dim,           \
                                    float scale, u32 g, float* scores) {                       \
        sddmm_csr<T, VEC>(row_indices, col_indices, nnz, q, k, heads, head_dim, scale, g,      \
                          scores);                                                             \
    }

#define SPATTN_SPMM(NAME, T, VEC)                                                               \
    extern "C" __global__ void NAME(const u32* unit_rows, const u32* unit_starts,              \
                                    const u32* unit_parts, u32 n_units, const u32* col_indices, \
                                    const float* p, const T* v, u32 heads, u32 head_dim, u32 g, \
                                    T* out, float* scratch) {                                  \
        spmm_csr<T, VEC>(unit_rows, unit_starts, unit_parts, n_units, col_indices, p, v, heads, \
                         head_dim, g, out, scratch);                                           \
    }

#define SPATTN_SDDMM_GATV2(NAME, T, VEC)                                                        \
    extern "C" __global__ void NAME(const u32* row_indices, const u32* col_indices, u32 nnz,   \
                                    const T* xl, const T* xr, const T* ef, const float* att,   \
                                    float slope, u32 heads, u32 head_dim, u32 g,               \
                                    float* scores) {                                           \
        sddmm_gatv2_csr<T, VEC>(row_indices, col_indices, nnz, xl, xr, ef, att, slope, heads,  \
                                head_dim, g, scores);                                          \
    }

// The GAT row-statistics passes for one dtype and vector width, without dropout and with it
// ("_drop": the factors read from a keep mask; the others hold no registers for it; a
// generator in the kernels instead cost 90-106 registers). gat_grad_rows of 16-bit types
// is held to 3 blocks a SM (80 registers, its gathered rows held as stored bits to fit;
// unbounded at 2 blocks: backward 1.61 against 1.47 ms on ogbn-arxiv at 8 x 32 f16); of f32 it
// is left unbounded (70 registers: 2.42 against 2.65 ms held to 3 blocks). GB: those bounds,
// empty for f32.
#define SPATTN_GAT_BOUNDS_16 __launch_bounds__(256, 3)
#define SPATTN_GAT_ROWS_K(SUFFIX, T, VEC, DROP, D, GB)                                             \
    extern "C" __global__ void gat_aggregate##D##_csr_##SUFFIX##_v##VEC(                           \
        const u32* unit_rows, const u32* unit_starts, const u32* unit_parts, u32 n_units,          \
        const u32* order, const u32* col_indices, const T* x, u32 heads, u32 head_dim, u32 g,      \
        u32 hl, SPATTN_GAT_SCORES_ARGS, const u32* keep, const float* lse, T* out,                 \
        float* scratch) {                                                                          \
        const GatScores sc = SPATTN_GAT_SCORES;                                                    \
        gat_aggregate<T, VEC, false, DROP>(unit_rows, unit_starts, unit_parts, n_units, order,     \
                                           col_indices, nullptr, x, heads, head_dim, g, hl, sc,    \
                                           keep, lse, nullptr, out, nullptr, scratch, nullptr);    \
    }                                                                                              \
    extern "C" __global__ void gat_aggregate_t##D##_csr_##SUFFIX##_v##VEC(                         \
        const u32* unit_rows, const u32* unit_starts, const u32* unit_parts, u32 n_units,          \
        const u32* order, const u32* row_indices, const u32* t_to_a, const T* d_out, u32 heads,    \
        u32 head_dim, u32 g, u32 hl, SPATTN_GAT_SCORES_ARGS, const u32* keep, const float* lse,    \
        const float* ds_t, T* dx, float* d_src, float* scratch, float* scratch_src) {              \
        const GatScores sc = SPATTN_GAT_SCORES;                                                    \
        gat_aggregate<T, VEC, true, DROP>(unit_rows, unit_starts, unit_parts, n_units, order,      \
                                          row_indices, t_to_a, d_out, heads, head_dim, g, hl,      \
                                          sc, keep, lse, ds_t, dx, d_src, scratch,                 \
                                          scratch_src);                                            \
    }                                                                                              \
    extern "C" __global__ void GB gat_grad_rows##D##_csr_##SUFFIX##_v##VEC(                        \
        const u32* unit_rows, const u32* unit_starts, const u32* unit_parts, u32 n_units,          \
        const u32* order, const u32* col_indices, const u32* a_to_t, const T* x, const T* out,     \
        const T* d_out, u32 heads, u32 head_dim, u32 g, u32 hl, SPATTN_GAT_SCORES_ARGS,            \
        const u32* keep, const float* lse, float* ds_t, float* d_bias, float* d_dst,               \
        float* scratch_dst) {                                                                      \
        const GatScores sc = SPATTN_GAT_SCORES;                                                    \
        gat_grad_rows<T, VEC, DROP>(unit_rows, unit_starts, unit_parts, n_units, order,            \
                                    col_indices, a_to_t, x, out, d_out, heads, head_dim, g, hl,    \
                                    sc, keep, lse, ds_t, d_bias, d_dst, scratch_dst);              \
    }
#define SPATTN_GAT_ROWS(SUFFIX, T, VEC, GB)                                                        \
    SPATTN_GAT_ROWS_K(SUFFIX, T, VEC, false, , GB)                                                 \
    SPATTN_GAT_ROWS_K(SUFFIX, T, VEC, true, _drop, GB)

#define SPATTN_PER_DTYPE(SUFFIX, T, GB)                                                            \
    extern "C" __global__ void sddmm_gat_csr_##SUFFIX(const u32* row_indices,                  \
                                                      const u32* col_indices, u32 nnz,         \
                                                      const T* a_dst, const T* a_src,          \
                                                      u32 heads, float* scores) {              \
        sddmm_gat_csr<T>(row_indices, col_indices, nnz, a_dst, a_src, heads, scores);          \
    }                                                                                          \
    extern "C" __global__ void spmm_csr_finalize_##SUFFIX(                                     \
        const u32* split_rows, const u32* part_first, u32 n_split, u32 hd, const float* scratch, \
        T* out) {                                                                              \
        spmm_csr_finalize<T>(split_rows, part_first, n_split, hd, scratch, out);               \
    }                                                                                          \
    SPATTN_SDDMM(sddmm_csr_##SUFFIX##_v1, T, 1)                                                 \
    SPATTN_SDDMM(sddmm_csr_##SUFFIX##_v2, T, 2)                                                 \
    SPATTN_SDDMM(sddmm_csr_##SUFFIX##_v4, T, 4)                                                 \
    SPATTN_SDDMM_GATV2(sddmm_gatv2_csr_##SUFFIX##_v1, T, 1)                                     \
    SPATTN_SDDMM_GATV2(sddmm_gatv2_csr_##SUFFIX##_v2, T, 2)                                     \
    SPATTN_SDDMM_GATV2(sddmm_gatv2_csr_##SUFFIX##_v4, T, 4)                                     \
    SPATTN_SPMM(spmm_csr_##SUFFIX##_v1, T, 1)                                                   \
    SPATTN_SPMM(spmm_csr_##SUFFIX##_v2, T, 2)                                                   \
    SPATTN_SPMM(spmm_csr_##SUFFIX##_v4, T, 4)                                                   \
    SPATTN_GAT_ROWS(SUFFIX, T, 1, GB)                                                           \
    SPATTN_GAT_ROWS(SUFFIX, T, 2, GB)                                                           \
    SPATTN_GAT_ROWS(SUFFIX, T, 4, GB)

SPATTN_PER_DTYPE(f32, float, )
SPATTN_PER_DTYPE(f16, __half, SPATTN_GAT_BOUNDS_16)
SPATTN_PER_DTYPE(bf16, __nv_bfloat16, SPATTN_GAT_BOUNDS_16)
// 16-byte vectors of 16-bit types.
SPATTN_SDDMM(sddmm_csr_f16_v8, __half, 8)
SPATTN_SDDMM(sddmm_csr_bf16_v8, __nv_bfloat16, 8)
SPATTN_SDDMM_GATV2(sddmm_gatv2_csr_f16_v8, __half, 8)
SPATTN_SDDMM_GATV2(sddmm_gatv2_csr_bf16_v8, __nv_bfloat16, 8)
SPATTN_SPMM(spmm_csr_f16_v8, __half, 8)
SPATTN_SPMM(spmm_csr_bf16_v8, __nv_bfloat16, 8)
SPATTN_GAT_ROWS(f16, __half, 8, SPATTN_GAT_BOUNDS_16)
SPATTN_GAT_ROWS(bf16, __nv_bfloat16, 8, SPATTN_GAT_BOUNDS_16)
