// Backward of sparse attention on CSR: the per-edge kernels. The three SpMMs of the backward
// (dQ on A, dK and dV on A^T) are csr_ops.cu's spmm_csr; the two SDDMMs (<q,k> and <dOut,V>)
// are csr_ops.cu's sddmm_csr.
//
// Layouts as in csr_ops.cu: per-edge values nnz x heads f32, edge e head h at e * heads + h,
// edges in CSR order of A (or of A^T where a kernel says so); dense operands rows x heads x
// head_dim. `a_to_t[e]` is the position of A's edge e in A^T's CSR order. Sums in f32; the
// gradient of the scale is one f32 share per (row, head), summed in f64 in a fixed order by
// sum_in_order_f32 (no float atomics anywhere: the same bits every run).
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

// Each (row, head) writes its share of the scale's gradient, Σ_row dS ⊙ raw, to
// dscale_rows[row * heads + h] (rows without edges 0); sum_in_order_f32 adds them up.
extern "C" __global__ void attention_backward_csr_rows(
    const u32* __restrict__ row_offsets, u32 n_rows, u32 heads, float scale,
    const float* __restrict__ raw, float* dp, const u32* __restrict__ a_to_t,
    float* __restrict__ p_t, float* __restrict__ ds_t, u32 g, u32 long_threshold,
    float* __restrict__ dscale_rows) {
    SPATTN_FOR_EACH_SHORT_ROW(
        const float share = team.sum(attention_backward_row(team, start, end, heads, h, scale,
                                                            raw, dp, a_to_t, p_t, ds_t));
        if (team.lane == 0u) dscale_rows[rh] = share;)
}

extern "C" __global__ void attention_backward_csr_long_rows(
    const u32* __restrict__ row_offsets, const u32* __restrict__ long_rows, u32 heads,
    float scale, const float* __restrict__ raw, float* dp, const u32* __restrict__ a_to_t,
    float* __restrict__ p_t, float* __restrict__ ds_t, float* __restrict__ dscale_rows) {
    SPATTN_LONG_ROW(
        const float share = team.sum(attention_backward_row(team, start, end, heads, h, scale,
                                                            raw, dp, a_to_t, p_t, ds_t));
        if (threadIdx.x == 0u) dscale_rows[(u64)row * heads + h] = share;)
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

// *out = sum over [0, n) of x[i] (times y[i] where y is given), in f64 and a fixed order: block b
// sums its contiguous chunk (each thread a strided share, then block_sum_f64's fixed tree) into
// block_sums[b] (gridDim.x entries), and the last block to finish adds those (each thread a
// strided share, then the same tree).
// The same inputs and grid give the same bits on every run.
extern "C" __global__ void __launch_bounds__(256)
    sum_in_order_f32(const float* __restrict__ x, const float* __restrict__ y, u64 n,
                     double* __restrict__ block_sums, u32* __restrict__ counter,
                     double* __restrict__ out) {
    __shared__ double scratch[32];
    const u64 chunk = (n + gridDim.x - 1u) / gridDim.x;
    const u64 begin = (u64)blockIdx.x * chunk, end = min(n, begin + chunk);
    double s = 0.0;
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x)
        s += y != nullptr ? (double)x[i] * (double)y[i] : (double)x[i];
    s = block_sum_f64(s, scratch);
    if (threadIdx.x == 0) block_sums[blockIdx.x] = s;
    if (last_block_to_finish(counter)) {
        double t = 0.0;
        for (u32 b = threadIdx.x; b < gridDim.x; b += blockDim.x) t += __ldcg(block_sums + b);
        t = block_sum_f64(t, scratch);
        if (threadIdx.x == 0) {
            *out = t;
            *counter = 0u;
        }
    }
}

// t_to_a[a_to_t[e]] = e: the inverse of A's edge map to A^T (A^T's entries' edges of A).
extern "C" __global__ void invert_edge_map_u32(const u32* __restrict__ a_to_t, u32 nnz,
                                               u32* __restrict__ t_to_a) {
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < nnz;
         e += (u64)gridDim.x * blockDim.x)
        t_to_a[a_to_t[e]] = (u32)e;
}

// ---- GATv2's edge gradients --------------------------------------------------------------------
// On a CSR M (A, or A^T with edge_ids giving each entry's edge of A): per row r, head h and
// feature d,
//   out[r,h,d] (= or +=) sum over the entries e of row r of  t_e = ds[id,h] * att[h,d] * lrelu'(z)
// with z = x_self[r,h,d] + x_other[col(e),h,d] (+ ef[id,h,d]), id = edge_ids[e] (or e). On A
// (x_self = XR, x_other = XL) that is dXR; on A^T (x_self = XL, x_other = XR) the score's share
// of dXL, added to the aggregation's. Where d_ef is given each t_e is also written there (per
// edge), and where d_att_rows is, the row's sum of ds * lrelu(z) (each row's share of d_att,
// summed over rows by the caller: no atomics).
//
// A warp per (row, head): gf lanes split the features (VEC each), the warp's 32 / gf slots of
// gf lanes take every (32/gf)-th edge of the row, and the slots' partial sums meet by
// shuffles in a fixed order (deterministic). Every (row, head, feature) is written, empty rows
// included.

template <class T, int VEC>
__device__ __forceinline__ void gatv2_edge_grad(
    const u32* __restrict__ row_offsets, u32 n_rows, const u32* __restrict__ col_indices,
    const u32* __restrict__ edge_ids, u32 heads, u32 head_dim, const T* __restrict__ x_self,
    const T* __restrict__ x_other, const T* __restrict__ ef, const float* __restrict__ att,
    float slope, const float* __restrict__ ds, u32 gf, int accumulate, T* out,
    T* __restrict__ d_ef, float* __restrict__ d_att_rows) {
    const u32 lane = lane_id();
    const u32 fl = lane & (gf - 1u), slot = lane / gf, slots = 32u / gf;
    const u64 hd = (u64)heads * head_dim;
    const u64 warp = grid_group(32u), warps = grid_groups(32u);
    const u64 total = (u64)n_rows * heads;
    for (u64 rh = warp; rh < total; rh += warps) {
        u32 h;
        const u64 row = split_index(rh, heads, total, h);
        const u32 start = row_offsets[row], end = row_offsets[row + 1];
        for (u32 d0 = 0; d0 < head_dim; d0 += gf * VEC) {  // uniform across the warp
            const u32 d = d0 + fl * VEC;
            const bool active = d < head_dim;
            const u64 o = (u64)h * head_dim + (active ? d : 0u);
            float xs[VEC], w[VEC], acc[VEC], acc_att[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                xs[i] = 0.0f;
                w[i] = 0.0f;
                acc[i] = 0.0f;
                acc_att[i] = 0.0f;
            }
            if (active) {
                load_vec<T, VEC>(x_self + row * hd + o, xs);
#pragma unroll
                for (int i = 0; i < VEC; ++i) w[i] = __ldg(att + o + i);
                for (u32 e = start + slot; e < end; e += slots) {
                    const u64 id = edge_ids != nullptr ? (u64)__ldg(edge_ids + e) : (u64)e;
                    const float s = __ldg(ds + id * heads + h);
                    float xo[VEC], f[VEC], t[VEC];
                    load_vec<T, VEC>(x_other + (u64)__ldg(col_indices + e) * hd + o, xo);
                    if (ef != nullptr) {
                        load_vec<T, VEC>(ef + id * hd + o, f);
                    } else {
#pragma unroll
                        for (int i = 0; i < VEC; ++i) f[i] = 0.0f;
                    }
#pragma unroll
                    for (int i = 0; i < VEC; ++i) {
                        const float z = xs[i] + xo[i] + f[i];
                        t[i] = s * w[i] * (z >= 0.0f ? 1.0f : slope);
                        acc[i] += t[i];
                        acc_att[i] = fmaf(s, leaky_relu(z, slope), acc_att[i]);
                    }
                    if (d_ef != nullptr) store_vec<T, VEC>(d_ef + id * hd + o, t);
                }
            }
            // The slots' partials, in a fixed order: lanes of one feature chunk differ in
            // the bits above gf.
            for (u32 off = gf; off < 32u; off <<= 1) {
#pragma unroll
                for (int i = 0; i < VEC; ++i) {
                    acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], off);
                    acc_att[i] += __shfl_xor_sync(0xffffffffu, acc_att[i], off);
                }
            }
            if (active && slot == 0) {
                T* dst = out + row * hd + o;
                if (accumulate) {
                    float prev[VEC];
                    load_vec_coherent<T, VEC>(dst, prev);
#pragma unroll
                    for (int i = 0; i < VEC; ++i) acc[i] += prev[i];
                }
                store_vec<T, VEC>(dst, acc);
                if (d_att_rows != nullptr) {
#pragma unroll
                    for (int i = 0; i < VEC; ++i) d_att_rows[row * hd + o + i] = acc_att[i];
                }
            }
        }
    }
}

// ---- fused backward: one row pass over A, one column pass over A^T ---------------------------
// The FlashAttention-2 pattern on sparse rows, without any nnz x heads buffer (but EF's
// pairs). With s = scale * r, r = <q_i, k_j>, dP = <dOut_i, v_j>, P the row softmax of s,
// D_i = sum_j P dP and dS = P (dP - D_i):
//   row pass (a group of g lanes per (unit of A, head)): an online softmax over the unit's edges
//     that also carries w = sum x dP, a1 = sum x dP r, a2 = sum x r and, per feature,
//     ak = sum x k_j and adk = sum x dP k_j (x = exp(s - m), all rescaled with m). At the row's
//     end: D = w / l, dQ_i = scale / l (adk - D ak), the row's share of dscale (a1 - D a2) / l,
//     and the row statistics (m + log l, D) the column pass reads;
//   column pass (a group per (unit of A^T, head), i.e. the edges into column j):
//     P = exp(s - lse_i), dS = P (dP - D_i), dV_j = sum P dOut_i, dK_j = scale sum dS q_i.
// Both passes gather two feature rows per edge (k, v; then q, dOut); the column pass recomputes
// the scores, or with edge terms (features, a bias, dropout) reads the row pass's (s, dP) pairs.
// Determinism: no floating-point atomics. A unit of a split row leaves its partial in its slot;
// the last unit of the row to finish (an integer counter per (split row, head)) merges all of the
// row's partials in slot order, so the result does not depend on which unit merges, and resets
// the counter. dscale: each row's share per head into dscale_rows (written by the row's one
// unit, or the unit that merges it), summed afterwards in a fixed order (sum_in_order_f32): no
// block-wide barrier or fence, so a block's groups finish on their own.

#define SPATTN_ROW_PARTIAL 5  // m, l, w, a1, a2

// A split row's unit's scalars (m, l, w, a1, a2) into its partial's slot `ps`.
__device__ __forceinline__ void store_row_partial(float* ps, float m, float l, float w, float a1,
                                                  float a2) {
    ps[0] = m;
    ps[1] = l;
    ps[2] = w;
    ps[3] = a1;
    ps[4] = a2;
}

// Merges the partial at `ps` into (m, l, w, a1, a2); c1, c2 rescale the caller's vectors.
__device__ __forceinline__ void merge_row_partial(const float* ps, float& m, float& l, float& w,
                                                  float& a1, float& a2, float& c1, float& c2) {
    online_merge(m, l, __ldcg(ps), __ldcg(ps + 1), c1, c2);
    w = w * c1 + __ldcg(ps + 2) * c2;
    a1 = a1 * c1 + __ldcg(ps + 3) * c2;
    a2 = a2 * c1 + __ldcg(ps + 4) * c2;
}

// The lane's vectors of a head: vector j starts at feature feat[j], held where on[j].
template <int VEC, int NV>
__device__ __forceinline__ void head_lanes(u32 lane, u32 g, u32 head_dim, bool (&on)[NV],
                                           u32 (&feat)[NV]) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        feat[j] = (lane + j * g) * VEC;
        on[j] = feat[j] < head_dim;
    }
}

template <int VEC, int NV>
__device__ __forceinline__ void zero_lanes(float (&x)[NV][VEC]) {
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) x[j][i] = 0.0f;
}

// The lanes' vectors a walk in step loads: none for a group without edges (an empty unit, or
// past its last unit-head), whose tiles then read zeros, so no other row's values reach it.
template <int NV>
__device__ __forceinline__ void loading_lanes(const bool (&on)[NV], bool any, bool (&ld)[NV]) {
#pragma unroll
    for (int j = 0; j < NV; ++j) ld[j] = on[j] && any;
}

// The lanes' features of one head of a row of x (zeros where a lane holds none).
template <class T, int VEC, int NV>
__device__ __forceinline__ void load_head(const T* __restrict__ row, const bool (&on)[NV],
                                          const u32 (&feat)[NV], float (&out)[NV][VEC]) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        if (on[j]) {
            load_vec<T, VEC>(row + feat[j], out[j]);
        } else {
#pragma unroll
            for (int i = 0; i < VEC; ++i) out[j][i] = 0.0f;
        }
    }
}

template <class T, int VEC, int NV>
__device__ __forceinline__ void store_head(T* row, const bool (&on)[NV], const u32 (&feat)[NV],
                                           const float (&x)[NV][VEC], float factor) {
#pragma unroll
    for (int j = 0; j < NV; ++j) {
        if (on[j]) {
            float o[VEC];
#pragma unroll
            for (int i = 0; i < VEC; ++i) o[i] = x[j][i] * factor;
            store_vec<T, VEC>(row + feat[j], o);
        }
    }
}

template <int VEC, int NV>
__device__ __forceinline__ float dot_lanes(const float (&a)[NV][VEC], const float (&b)[NV][VEC]) {
    float acc = 0.0f;
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) acc = fmaf(a[j][i], b[j][i], acc);
    return acc;
}

// x = x * c + y * d over the lane's features.
template <int VEC, int NV>
__device__ __forceinline__ void axpby(float (&x)[NV][VEC], float c, const float (&y)[NV][VEC],
                                      float d) {
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) x[j][i] = fmaf(y[j][i], d, x[j][i] * c);
}

// A split unit's features in slot `slot` of `part` (2 vectors of head_dim per slot).
template <int VEC, int NV>
__device__ __forceinline__ void store_part(float* __restrict__ part, u64 slot, u32 head_dim,
                                           const bool (&on)[NV], const u32 (&feat)[NV],
                                           const float (&a)[NV][VEC], const float (&b)[NV][VEC]) {
    float* pa = part + slot * 2u * head_dim;
#pragma unroll
    for (int j = 0; j < NV; ++j)
        if (on[j])
#pragma unroll
            for (int i = 0; i < VEC; ++i) {
                pa[feat[j] + i] = a[j][i];
                pa[head_dim + feat[j] + i] = b[j][i];
            }
}

template <int VEC, int NV>
__device__ __forceinline__ void load_part(const float* part, u64 slot, u32 head_dim,
                                          const bool (&on)[NV], const u32 (&feat)[NV],
                                          float (&a)[NV][VEC], float (&b)[NV][VEC]) {
    const float* pa = part + slot * 2u * head_dim;
#pragma unroll
    for (int j = 0; j < NV; ++j)
#pragma unroll
        for (int i = 0; i < VEC; ++i) {
            a[j][i] = on[j] ? __ldcg(pa + feat[j] + i) : 0.0f;
            b[j][i] = on[j] ? __ldcg(pa + head_dim + feat[j] + i) : 0.0f;
        }
}

// The unit schedule of a CSR (csr_ops.cu's SpMM units plus their partial slots): unit u covers
// edges starts[u] .. starts[u+1] of row rows[u]; a unit of a split row has slots[u] (its split
// row) and parts[u] (its partial), the split row s owning partials part_first[s] ..
// part_first[s+1]. `order` (null: 0, 1, ...) lists the units in the order the grid walks them:
// a locality order of the rows keeps the K/V (or Q/dOut) rows gathered at one time in L2.
struct Units {
    const u32* rows;
    const u32* starts;
    const u32* slots;
    const u32* parts;
    const u32* part_first;
    u32 n;
    const u32* order;
};

// The unit walked i-th (i < n).
__device__ __forceinline__ u64 unit_at(const Units& un, u64 i) { return walk_unit(un.order, i); }

// A walk in step's unit-head uh (< total), or, for a group past its last one (act false), the
// last unit-head with no edges, which the pass walks in step and stores nothing for.
struct StepUnit {
    u64 u;
    u32 h, row, start, end;
    bool act;
};
__device__ __forceinline__ StepUnit step_unit(const Units& un, u64 uh, u32 heads, u64 total) {
    StepUnit s;
    s.act = uh < total;
    s.u = unit_at(un, split_index(s.act ? uh : total - 1u, heads, total, s.h));
    s.row = un.rows[s.u];
    s.start = un.starts[s.u];
    s.end = s.act ? un.starts[s.u + 1] : s.start;
    return s;
}

// EF (edge terms): edge features (FEAT kernels only), row e of ef (nnz x heads x head_dim)
// added to the key and the value of A's edge e (CSR position e): k' = k_j + e_ij, v' = v_j + e_ij
// in every formula above; a score bias b_e (bias: null, or nnz x bias_heads, 1 when shared by
// the heads) added to the scaled score, s = scale r + b_e (-inf masks the edge); each edge's
// score s and dP go to edge_sd[e * heads + h] for the column pass. With dropout (`keep` A's
// kept bits, null without): dP = f <dOut_i, v'> with f = kept_factor, the forward having
// aggregated P f v'.
// FEAT (EF kernels): whether a feature row is read; a bias or dropout without features runs the
// twin without (`_drop`), so that the `_ef` kernel issues a tile's feature loads with its K and
// V loads instead of behind a runtime branch each.
template <class T, int VEC, int NV, int TILE, bool EF, bool FEAT>
__device__ __forceinline__ void backward_row_pass(
    Units un, const u32* __restrict__ col_indices, const T* __restrict__ q,
    const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ d_out, u32 heads,
    u32 head_dim, float scale, u32 g, T* __restrict__ dq, float2* __restrict__ stats,
    float* part_stats, float* part_acc, u32* counters, float* __restrict__ dscale_rows,
    const T* __restrict__ ef, float2* __restrict__ edge_sd, const u32* __restrict__ keep,
    float keep_scale, const T* __restrict__ bias, u32 bias_heads) {
    static_assert(EF || !FEAT, "features come with the edge terms' pairs");
    const u32 mask = group_mask(g), lane = lane_id() & (g - 1u);
    const u64 hd = (u64)heads * head_dim;
    const u64 group = grid_group(g), groups = grid_groups(g);
    const u64 total = (u64)un.n * heads;
    for (u64 uh = group; warp_more(uh, total); uh += groups) {
        const auto [u, h, row, start, end, act] = step_unit(un, uh, heads, total);
        const u64 head_off = (u64)h * head_dim;
        bool on[NV];
        u32 feat[NV];
        head_lanes<VEC, NV>(lane, g, head_dim, on, feat);
        float qv[NV][VEC], dov[NV][VEC], ak[NV][VEC], adk[NV][VEC];
        load_head<T, VEC, NV>(q + row * hd + head_off, on, feat, qv);
        load_head<T, VEC, NV>(d_out + row * hd + head_off, on, feat, dov);
        zero_lanes<VEC, NV>(ak);
        zero_lanes<VEC, NV>(adk);
        float m = SPATTN_NEG_INF, l = 0.0f, w = 0.0f, a1 = 0.0f, a2 = 0.0f;
        // The warp's groups walk in step: its longest unit's tiles (warp_groups_sum).
        const u32 tiles = warp_tiles(end - start, TILE), spare = end > 0u ? end - 1u : 0u;
        bool ld[NV];
        loading_lanes<NV>(on, start < end, ld);
        for (u32 it = 0, e = start; it < tiles; ++it, e += TILE) {
            float kk[TILE][NV][VEC], vv[TILE][NV][VEC];
            float r[TILE], dp[TILE], sb[TILE];
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                // Past the unit's end a lane reloads a valid edge and weighs it 0.
                const u32 pos = e + t < end ? e + t : spare;
                const u32 c = __ldg(col_indices + pos);
                load_head<T, VEC, NV>(k + c * hd + head_off, ld, feat, kk[t]);
                load_head<T, VEC, NV>(v + c * hd + head_off, ld, feat, vv[t]);
                if constexpr (EF) {
                    sb[t] = bias == nullptr ? 0.0f
                                            : to_f32(__ldg(bias + (u64)pos * bias_heads +
                                                           (bias_heads == 1u ? 0u : h)));
                    if constexpr (FEAT) {
                        float ee[NV][VEC];
                        load_head<T, VEC, NV>(ef + (u64)pos * hd + head_off, ld, feat, ee);
                        axpby<VEC, NV>(kk[t], 1.0f, ee, 1.0f);
                        axpby<VEC, NV>(vv[t], 1.0f, ee, 1.0f);
                    }
                }
            }
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                r[t] = warp_groups_sum(dot_lanes<VEC, NV>(qv, kk[t]), g);
                dp[t] = warp_groups_sum(dot_lanes<VEC, NV>(dov, vv[t]), g);
                // The score s (sb: it holds the bias until now).
                if constexpr (EF) sb[t] += scale * r[t];
                else sb[t] = scale * r[t];
                if constexpr (EF) {
                    dp[t] *= kept_factor(keep, (u64)(e + t < end ? e + t : spare) * heads + h,
                                         keep_scale);
                    if (lane == 0u && e + t < end)
                        edge_sd[(u64)(e + t) * heads + h] = make_float2(sb[t], dp[t]);
                }
            }
            float mt = m;
#pragma unroll
            for (int t = 0; t < TILE; ++t)
                if (e + t < end) mt = fmaxf(mt, sb[t]);
            const float c = online_rescale(m, mt);
            m = mt;
            // A row masked so far (every bias -inf) keeps m = -inf: base 0 weighs its edges
            // exp(-inf) = 0 and keeps a NaN score NaN.
            const float base = EF ? softmax_base(m) : m;
            l *= c;
            w *= c;
            a1 *= c;
            a2 *= c;
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                const float x = e + t < end ? __expf(sb[t] - base) : 0.0f;
                const float xd = x * dp[t];
                l += x;
                w += xd;
                a1 = fmaf(xd, r[t], a1);
                a2 = fmaf(x, r[t], a2);
                // The first edge of the tile also rescales the accumulators.
                axpby<VEC, NV>(ak, t == 0 ? c : 1.0f, kk[t], x);
                axpby<VEC, NV>(adk, t == 0 ? c : 1.0f, kk[t], xd);
            }
        }
        if (!act) continue;
        const u32 part = un.parts[u];
        if (part != SPATTN_NONE) {
            const u64 slot = (u64)part * heads + h;
            if (lane == 0u) store_row_partial(part_stats + slot * SPATTN_ROW_PARTIAL, m, l, w, a1, a2);
            store_part<VEC, NV>(part_acc, slot, head_dim, on, feat, ak, adk);
            const u32 s = un.slots[u], p0 = un.part_first[s], p1 = un.part_first[s + 1];
            u32* counter = counters + (u64)s * heads + h;
            if (!last_to_finish(counter, p1 - p0, mask, lane, g)) continue;
            m = SPATTN_NEG_INF;
            l = w = a1 = a2 = 0.0f;
            zero_lanes<VEC, NV>(ak);
            zero_lanes<VEC, NV>(adk);
            for (u32 p = p0; p < p1; ++p) {
                const u64 sl = (u64)p * heads + h;
                float c1, c2;
                merge_row_partial(part_stats + sl * SPATTN_ROW_PARTIAL, m, l, w, a1, a2, c1, c2);
                float pk[NV][VEC], pdk[NV][VEC];
                load_part<VEC, NV>(part_acc, sl, head_dim, on, feat, pk, pdk);
                axpby<VEC, NV>(ak, c1, pk, c2);
                axpby<VEC, NV>(adk, c1, pdk, c2);
            }
            if (lane == 0u) *counter = 0u;
        }
        // The row's end: a row without edges has l = 0 and gets zeros.
        const float inv = softmax_inv(l);
        const float d = w * inv;
        if (lane == 0u) {
            const u64 rh = (u64)row * heads + h;
            dscale_rows[rh] = (a1 - d * a2) * inv;
            // A NaN sum (a NaN score) gives a NaN lse: the column pass's P is NaN on the row.
            stats[rh] = make_float2(softmax_lse(m, l), d);
        }
        axpby<VEC, NV>(adk, 1.0f, ak, -d);
        store_head<T, VEC, NV>(dq + row * hd + head_off, on, feat, adk, scale * inv);
    }
}

// EF: A^T's entry e is A's edge t_to_a[e]; its score s and dP come from the row pass
// (edge_sd: no feature row read, no dot product here), and its gradient
// dE = scale dS q_i + P f dOut_i is written to row t_to_a[e] of d_ef (DE: the features' pass;
// a bias or dropout alone runs without it), each edge by the one unit holding it: no sums
// across units; f the edge's dropout factor (keep, A's order; 1 without), which weighs dV's
// terms too. (A bias's gradient dS is left to edge_pair_bias_grad, from the pairs and stats.)
template <class T, int VEC, int NV, int TILE, bool EF, bool DE>
__device__ __forceinline__ void backward_col_pass(
    Units un, const u32* __restrict__ row_indices, const T* __restrict__ q,
    const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ d_out, u32 heads,
    u32 head_dim, float scale, u32 g, const float2* __restrict__ stats, T* __restrict__ dk,
    T* __restrict__ dv, float* part_acc, u32* counters, const u32* __restrict__ t_to_a,
    T* __restrict__ d_ef, const float2* __restrict__ edge_sd, const u32* __restrict__ keep,
    float keep_scale) {
    const u32 mask = group_mask(g), lane = lane_id() & (g - 1u);
    const u64 hd = (u64)heads * head_dim;
    const u64 group = grid_group(g), groups = grid_groups(g);
    const u64 total = (u64)un.n * heads;
    for (u64 uh = group; warp_more<!EF>(uh, total); uh += groups) {
        const auto [u, h, col, start, end, act] = step_unit(un, uh, heads, total);
        const u64 head_off = (u64)h * head_dim;
        bool on[NV];
        u32 feat[NV];
        head_lanes<VEC, NV>(lane, g, head_dim, on, feat);
        float kv[EF ? 1 : NV][VEC], vv[EF ? 1 : NV][VEC], adk[NV][VEC], adv[NV][VEC];
        if constexpr (!EF) {
            load_head<T, VEC, NV>(k + col * hd + head_off, on, feat, kv);
            load_head<T, VEC, NV>(v + col * hd + head_off, on, feat, vv);
        }
        zero_lanes<VEC, NV>(adk);
        zero_lanes<VEC, NV>(adv);
        // The warp's groups walk in step for the sums (warp_groups_sum; EF reads its pairs and
        // takes none, so each group walks its own unit).
        const u32 tiles = warp_tiles<!EF>(end - start, TILE), spare = end > 0u ? end - 1u : 0u;
        bool ld[NV];
        loading_lanes<NV>(on, EF || start < end, ld);
        for (u32 it = 0, e = start; EF ? e < end : it < tiles; ++it, e += TILE) {
            float qq[TILE][NV][VEC], oo[TILE][NV][VEC];
            float2 st[TILE], sd[EF ? TILE : 1];
            u32 id[TILE];
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                const u32 pos = e + t < end ? e + t : spare;
                const u32 i = __ldg(row_indices + pos);
                load_head<T, VEC, NV>(q + i * hd + head_off, ld, feat, qq[t]);
                load_head<T, VEC, NV>(d_out + i * hd + head_off, ld, feat, oo[t]);
                st[t] = __ldg(stats + (u64)i * heads + h);
                // A column without edges reads another row's D: 0 instead keeps its dS 0.
                if (!EF && end == start) st[t].y = 0.0f;
                if constexpr (EF) {
                    id[t] = __ldg(t_to_a + pos);
                    sd[t] = __ldg(edge_sd + (u64)id[t] * heads + h);
                }
            }
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                float s, dp;
                if constexpr (EF) {
                    s = sd[t].x;
                    dp = sd[t].y;
                } else {
                    s = scale * warp_groups_sum(dot_lanes<VEC, NV>(qq[t], kv), g);
                    dp = warp_groups_sum(dot_lanes<VEC, NV>(oo[t], vv), g);
                }
                const float p = e + t < end ? __expf(s - st[t].x) : 0.0f;
                const float ds = p * (dp - st[t].y);
                float pf = p;
                if constexpr (EF) pf *= kept_factor(keep, (u64)id[t] * heads + h, keep_scale);
                axpby<VEC, NV>(adv, 1.0f, oo[t], pf);
                axpby<VEC, NV>(adk, 1.0f, qq[t], ds);
                if constexpr (EF && DE) {
                    if (e + t < end) {
                        float de[NV][VEC];
#pragma unroll
                        for (int j = 0; j < NV; ++j)
#pragma unroll
                            for (int x = 0; x < VEC; ++x)
                                de[j][x] = fmaf(qq[t][j][x], scale * ds, oo[t][j][x] * pf);
                        store_head<T, VEC, NV>(d_ef + (u64)id[t] * hd + head_off, on, feat, de,
                                               1.0f);
                    }
                }
            }
        }
        if (!act) continue;
        const u32 part = un.parts[u];
        if (part != SPATTN_NONE) {
            const u64 slot = (u64)part * heads + h;
            store_part<VEC, NV>(part_acc, slot, head_dim, on, feat, adk, adv);
            const u32 s = un.slots[u], p0 = un.part_first[s], p1 = un.part_first[s + 1];
            u32* counter = counters + (u64)s * heads + h;
            if (!last_to_finish(counter, p1 - p0, mask, lane, g)) continue;
            zero_lanes<VEC, NV>(adk);
            zero_lanes<VEC, NV>(adv);
            for (u32 p = p0; p < p1; ++p) {
                float pk[NV][VEC], pv[NV][VEC];
                load_part<VEC, NV>(part_acc, (u64)p * heads + h, head_dim, on, feat, pk, pv);
                axpby<VEC, NV>(adk, 1.0f, pk, 1.0f);
                axpby<VEC, NV>(adv, 1.0f, pv, 1.0f);
            }
            if (lane == 0u) *counter = 0u;
        }
        store_head<T, VEC, NV>(dk + col * hd + head_off, on, feat, adk, scale);
        store_head<T, VEC, NV>(dv + col * hd + head_off, on, feat, adv, 1.0f);
    }
}

// ---- GAT's fused backward: the same two passes with additive scores ------------------------
// s = a_dst[i] + a_src[j] (+ bias_e), z = LeakyReLU(s), P the row softmax of z; the forward
// aggregated x with W = P f (f the dropout factor: 0 or 1 / (1 - rate); 1 without dropout).
// With dW = <dOut_i, x_j>, dP = dW f, D_i = sum_j P dP and dS = P (dP - D_i) L' (L' = 1 at
// s >= 0, the slope below):
//   row pass (a group per (unit of A, head), dOut_i held, x_j gathered): an online softmax of z
//     carrying w = sum e dP, a1 = sum e dP L', a2 = sum e L' (e = exp(z - m)); at the row's end
//     D = w / l, d_dst_i = sum_j dS = (a1 - D a2) / l and the statistics (m + log l, D);
//   column pass (a group per (unit of A^T, head), x_j held, dOut_i gathered): P from lse_i and
//     dS from D_i, dW recomputed: dx_j = sum_i W dOut_i, d_src_j = sum_i dS, and each edge's dS
//     (the bias's gradient) where asked, written by the one unit holding the edge.
// One gather per edge and pass, no nnz x heads buffer (but the bias's gradient), no float
// atomics: split rows and columns merge their units' partials as the attention's passes do.
template <class T, int VEC, int NV, int TILE>
__device__ __forceinline__ void gat_backward_row_pass(
    Units un, const u32* __restrict__ col_indices, const T* __restrict__ x,
    const T* __restrict__ d_out, u32 heads, u32 head_dim, u32 g, GatScores sc,
    float2* __restrict__ stats, float* __restrict__ d_dst, float* part_stats, u32* counters) {
    const u32 mask = group_mask(g), lane = lane_id() & (g - 1u);
    const u64 hd = (u64)heads * head_dim;
    const u64 group = grid_group(g), groups = grid_groups(g);
    const u64 total = (u64)un.n * heads;
    for (u64 uh = group; uh < total; uh += groups) {
        u32 h;
        const u64 u = unit_at(un, split_index(uh, heads, total, h));
        const u32 row = un.rows[u], start = un.starts[u], end = un.starts[u + 1];
        const u64 head_off = (u64)h * head_dim;
        bool on[NV];
        u32 feat[NV];
        head_lanes<VEC, NV>(lane, g, head_dim, on, feat);
        float dov[NV][VEC];
        load_head<T, VEC, NV>(d_out + row * hd + head_off, on, feat, dov);
        float m = SPATTN_NEG_INF, l = 0.0f, w = 0.0f, a1 = 0.0f, a2 = 0.0f;
        for (u32 e = start; e < end; e += TILE) {
            float xx[TILE][NV][VEC], s[TILE], f[TILE];
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                // Past the unit's end, a lane reloads the tile's first edge and weighs it 0.
                const u32 pos = e + t < end ? e + t : e;
                const u32 c = __ldg(col_indices + pos);
                load_head<T, VEC, NV>(x + c * hd + head_off, on, feat, xx[t]);
                s[t] = gat_score(sc, row, c, pos, heads, h);
                f[t] = dropout_factor(sc.drop, (u64)pos * heads + h);
            }
            float z[TILE], dp[TILE];
            float mt = m;
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                dp[t] = group_sum(dot_lanes<VEC, NV>(dov, xx[t]), mask, g) * f[t];
                z[t] = leaky_relu(s[t], sc.slope);
                if (e + t < end) mt = fmaxf(mt, z[t]);
            }
            const float c = online_rescale(m, mt);
            m = mt;
            // Every score so far masked by a -inf bias: base 0, as in the attention row pass.
            const float base = softmax_base(m);
            l *= c;
            w *= c;
            a1 *= c;
            a2 *= c;
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                const float ex = e + t < end ? __expf(z[t] - base) : 0.0f;
                const float lp = s[t] >= 0.0f ? 1.0f : sc.slope;
                const float xd = ex * dp[t];
                l += ex;
                w += xd;
                a1 = fmaf(xd, lp, a1);
                a2 = fmaf(ex, lp, a2);
            }
        }
        const u32 part = un.parts[u];
        if (part != SPATTN_NONE) {
            const u64 slot = (u64)part * heads + h;
            if (lane == 0u) store_row_partial(part_stats + slot * SPATTN_ROW_PARTIAL, m, l, w, a1, a2);
            const u32 s = un.slots[u], p0 = un.part_first[s], p1 = un.part_first[s + 1];
            u32* counter = counters + (u64)s * heads + h;
            if (!last_to_finish(counter, p1 - p0, mask, lane, g)) continue;
            m = SPATTN_NEG_INF;
            l = w = a1 = a2 = 0.0f;
            for (u32 p = p0; p < p1; ++p) {
                float c1, c2;
                merge_row_partial(part_stats + ((u64)p * heads + h) * SPATTN_ROW_PARTIAL, m, l, w,
                                  a1, a2, c1, c2);
            }
            if (lane == 0u) *counter = 0u;
        }
        // The row's end: a row without edges has l = 0 and gets zeros.
        if (lane == 0u) {
            const float inv = softmax_inv(l);
            const float d = w * inv;
            d_dst[(u64)row * heads + h] = (a1 - d * a2) * inv;
            stats[(u64)row * heads + h] = make_float2(softmax_lse(m, l), d);
        }
    }
}

// t_to_a: A's edge of each entry of A^T (null where neither a bias, dropout nor the bias's
// gradient needs it: the edge then only indexes those). A split column's partial is head_dim
// floats of dx and one of d_src, at (part, head) * (head_dim + 1).
template <class T, int VEC, int NV, int TILE>
__device__ __forceinline__ void gat_backward_col_pass(
    Units un, const u32* __restrict__ row_indices, const u32* __restrict__ t_to_a,
    const T* __restrict__ x, const T* __restrict__ d_out, u32 heads, u32 head_dim, u32 g,
    GatScores sc, const float2* __restrict__ stats, T* __restrict__ dx, float* __restrict__ d_src,
    float* __restrict__ d_bias, float* part_acc, u32* counters) {
    const u32 mask = group_mask(g), lane = lane_id() & (g - 1u);
    const u64 hd = (u64)heads * head_dim;
    const u64 group = grid_group(g), groups = grid_groups(g);
    const u64 total = (u64)un.n * heads;
    for (u64 uh = group; uh < total; uh += groups) {
        u32 h;
        const u64 u = unit_at(un, split_index(uh, heads, total, h));
        const u32 col = un.rows[u], start = un.starts[u], end = un.starts[u + 1];
        const u64 head_off = (u64)h * head_dim;
        bool on[NV];
        u32 feat[NV];
        head_lanes<VEC, NV>(lane, g, head_dim, on, feat);
        float xv[NV][VEC], acc[NV][VEC];
        load_head<T, VEC, NV>(x + col * hd + head_off, on, feat, xv);
        zero_lanes<VEC, NV>(acc);
        float dsum = 0.0f;
        for (u32 e = start; e < end; e += TILE) {
            float oo[TILE][NV][VEC], s[TILE], f[TILE];
            float2 st[TILE];
            u32 id[TILE];
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                const u32 pos = e + t < end ? e + t : e;
                const u32 i = __ldg(row_indices + pos);
                id[t] = t_to_a != nullptr ? __ldg(t_to_a + pos) : pos;
                load_head<T, VEC, NV>(d_out + i * hd + head_off, on, feat, oo[t]);
                st[t] = __ldg(stats + (u64)i * heads + h);
                s[t] = gat_score(sc, i, col, id[t], heads, h);
                f[t] = dropout_factor(sc.drop, (u64)id[t] * heads + h);
            }
#pragma unroll
            for (int t = 0; t < TILE; ++t) {
                const float dp = group_sum(dot_lanes<VEC, NV>(oo[t], xv), mask, g) * f[t];
                const float z = leaky_relu(s[t], sc.slope);
                const float p = e + t < end ? __expf(z - st[t].x) : 0.0f;
                const float ds = p * (dp - st[t].y) * (s[t] >= 0.0f ? 1.0f : sc.slope);
                axpby<VEC, NV>(acc, 1.0f, oo[t], p * f[t]);
                dsum += ds;
                if (d_bias != nullptr && lane == 0u && e + t < end)
                    d_bias[(u64)id[t] * heads + h] = ds;
            }
        }
        const u32 part = un.parts[u];
        if (part != SPATTN_NONE) {
            float* pa = part_acc + ((u64)part * heads + h) * (head_dim + 1u);
#pragma unroll
            for (int j = 0; j < NV; ++j)
                if (on[j])
#pragma unroll
                    for (int i = 0; i < VEC; ++i) pa[feat[j] + i] = acc[j][i];
            if (lane == 0u) pa[head_dim] = dsum;
            const u32 s = un.slots[u], p0 = un.part_first[s], p1 = un.part_first[s + 1];
            u32* counter = counters + (u64)s * heads + h;
            if (!last_to_finish(counter, p1 - p0, mask, lane, g)) continue;
            zero_lanes<VEC, NV>(acc);
            dsum = 0.0f;
            for (u32 p = p0; p < p1; ++p) {
                const float* pp = part_acc + ((u64)p * heads + h) * (head_dim + 1u);
#pragma unroll
                for (int j = 0; j < NV; ++j)
#pragma unroll
                    for (int i = 0; i < VEC; ++i)
                        acc[j][i] += on[j] ? __ldcg(pp + feat[j] + i) : 0.0f;
                dsum += __ldcg(pp + head_dim);
            }
            if (lane == 0u) *counter = 0u;
        }
        store_head<T, VEC, NV>(dx + col * hd + head_off, on, feat, acc, 1.0f);
        if (lane == 0u) d_src[(u64)col * heads + h] = dsum;
    }
}

#define SPATTN_BWD_UNITS_ARGS                                                                   \
    const u32 *unit_rows, const u32 *unit_starts, const u32 *unit_slots, const u32 *unit_parts, \
        const u32 *part_first, u32 n_units, const u32 *unit_order
#define SPATTN_BWD_UNITS                                                                        \
    {unit_rows, unit_starts, unit_slots, unit_parts, part_first, n_units, unit_order}

// Every pass takes the edge terms' arguments (ef, edge_sd, bias; t_to_a, d_ef, edge_sd)
// and the dropout's kept bits and scale, used by the EF kernels only (`_ef` in the name: edge
// features, with a bias or dropout or not; `_drop`: a bias or dropout without features, the row
// pass reading no feature row (ef null) and the column pass writing none (d_ef null)), null for
// the others.
// The row pass writes edge_sd, the column pass reads it.
#define SPATTN_BACKWARD_ROWS_K(NAME, T, VEC, NV, TILE, MINB, EF, FEAT)                          \
    extern "C" __global__ void __launch_bounds__(256, MINB) NAME(                              \
        SPATTN_BWD_UNITS_ARGS, const u32* col_indices, const T* q, const T* k, const T* v,     \
        const T* d_out, u32 heads, u32 head_dim, float scale, u32 g, T* dq, float2* stats,     \
        float* part_stats, float* part_acc, u32* counters, float* dscale_rows, const T* ef,     \
        float2* edge_sd, const u32* keep, float keep_scale, const T* bias, u32 bias_heads) {   \
        const Units un = SPATTN_BWD_UNITS;                                                     \
        backward_row_pass<T, VEC, NV, TILE, EF, FEAT>(un, col_indices, q, k, v, d_out, heads,  \
                                                      head_dim, scale, g, dq, stats,           \
                                                      part_stats, part_acc, counters,          \
                                                      dscale_rows, ef, edge_sd, keep,          \
                                                      keep_scale, bias, bias_heads);           \
    }
#define SPATTN_BACKWARD_COLS_K(NAME, T, VEC, NV, TILE, MINB, EF, DE)                            \
    extern "C" __global__ void __launch_bounds__(256, MINB) NAME(                              \
        SPATTN_BWD_UNITS_ARGS, const u32* row_indices, const T* q, const T* k, const T* v,     \
        const T* d_out, u32 heads, u32 head_dim, float scale, u32 g, const float2* stats,      \
        T* dk, T* dv, float* part_acc, u32* counters, const u32* t_to_a, T* d_ef,              \
        const float2* edge_sd, const u32* keep, float keep_scale) {                            \
        const Units un = SPATTN_BWD_UNITS;                                                     \
        backward_col_pass<T, VEC, NV, TILE, EF, DE>(un, row_indices, q, k, v, d_out, heads,    \
                                                    head_dim, scale, g, stats, dk, dv,         \
                                                    part_acc, counters, t_to_a, d_ef, edge_sd, \
                                                    keep, keep_scale);                         \
    }
// Edges per step and the blocks of 256 threads per SM asked of the register allocator, by
// features a lane (docs/kernels/backward.md, "Tried"): 4 or fewer take one edge a step at 6
// blocks (42 registers), 8 two edges at 4 blocks (64), 16 two edges at 3 blocks (85). The host
// launches the attention passes in blocks of 64 (four times as many a SM), GAT's in blocks of 256.
#define SPATTN_BWD_TILE_OF(F) ((F) <= 4 ? 1 : 2)
#define SPATTN_BWD_MINB_OF(F) ((F) <= 4 ? 6 : (F) <= 8 ? 4 : 3)
// With edge features a lane of the row pass holds each edge's feature vector too: one block a
// SM fewer (the column pass, with no feature or K/V row, shares the bound; not timed apart).
#define SPATTN_BWD_MINB_EF_OF(F) (SPATTN_BWD_MINB_OF(F) - 1)
// GAT's passes hold the dropout's generator beside two edges in flight: 3 blocks a SM (85
// registers, no spills) up to 8 features a lane, 2 at 16 (the attention's bounds spill them).
#define SPATTN_GAT_BWD_MINB_OF(F) ((F) <= 8 ? 3 : 2)
#define SPATTN_GAT_BACKWARD_K(NAME_R, NAME_C, T, VEC, NV, TILE, MINB)                           \
    extern "C" __global__ void __launch_bounds__(256, MINB) NAME_R(                             \
        SPATTN_BWD_UNITS_ARGS, const u32* col_indices, const T* x, const T* d_out, u32 heads,   \
        u32 head_dim, u32 g, SPATTN_GAT_SCORES_ARGS, float2* stats, float* d_dst,           \
        float* part_stats, u32* counters) {                                                     \
        const Units un = SPATTN_BWD_UNITS;                                                      \
        const GatScores sc = SPATTN_GAT_SCORES;                                             \
        gat_backward_row_pass<T, VEC, NV, TILE>(un, col_indices, x, d_out, heads, head_dim, g,  \
                                                sc, stats, d_dst, part_stats, counters);        \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(256, MINB) NAME_C(                             \
        SPATTN_BWD_UNITS_ARGS, const u32* row_indices, const u32* t_to_a, const T* x,           \
        const T* d_out, u32 heads, u32 head_dim, u32 g, SPATTN_GAT_SCORES_ARGS,             \
        const float2* stats, T* dx, float* d_src, float* d_bias, float* part_acc,               \
        u32* counters) {                                                                        \
        const Units un = SPATTN_BWD_UNITS;                                                      \
        const GatScores sc = SPATTN_GAT_SCORES;                                             \
        gat_backward_col_pass<T, VEC, NV, TILE>(un, row_indices, t_to_a, x, d_out, heads,       \
                                                head_dim, g, sc, stats, dx, d_src, d_bias,      \
                                                part_acc, counters);                            \
    }
#define SPATTN_BACKWARD_FUSED(SUFFIX, T, VEC, NV)                                              \
    SPATTN_BACKWARD_ROWS_K(attention_backward_rows_##SUFFIX##_v##VEC##_n##NV, T, VEC, NV,      \
                           SPATTN_BWD_TILE_OF(VEC * NV), SPATTN_BWD_MINB_OF(VEC * NV), false,  \
                           false)                                                              \
    SPATTN_BACKWARD_COLS_K(attention_backward_cols_##SUFFIX##_v##VEC##_n##NV, T, VEC, NV,      \
                           SPATTN_BWD_TILE_OF(VEC * NV), SPATTN_BWD_MINB_OF(VEC * NV), false,  \
                           false)                                                              \
    SPATTN_BACKWARD_ROWS_K(attention_backward_rows_ef_##SUFFIX##_v##VEC##_n##NV, T, VEC, NV,   \
                           SPATTN_BWD_TILE_OF(VEC * NV), SPATTN_BWD_MINB_EF_OF(VEC * NV), true, \
                           true)                                                               \
    SPATTN_BACKWARD_ROWS_K(attention_backward_rows_drop_##SUFFIX##_v##VEC##_n##NV, T, VEC, NV, \
                           SPATTN_BWD_TILE_OF(VEC * NV), SPATTN_BWD_MINB_EF_OF(VEC * NV), true, \
                           false)                                                              \
    SPATTN_BACKWARD_COLS_K(attention_backward_cols_ef_##SUFFIX##_v##VEC##_n##NV, T, VEC, NV,   \
                           SPATTN_BWD_TILE_OF(VEC * NV), SPATTN_BWD_MINB_EF_OF(VEC * NV), true, \
                           true)                                                               \
    SPATTN_BACKWARD_COLS_K(attention_backward_cols_drop_##SUFFIX##_v##VEC##_n##NV, T, VEC, NV, \
                           SPATTN_BWD_TILE_OF(VEC * NV), SPATTN_BWD_MINB_EF_OF(VEC * NV), true, \
                           false)                                                              \
    SPATTN_GAT_BACKWARD_K(gat_backward_rows_##SUFFIX##_v##VEC##_n##NV,                          \
                          gat_backward_cols_##SUFFIX##_v##VEC##_n##NV, T, VEC, NV,              \
                          SPATTN_BWD_TILE_OF(VEC * NV), SPATTN_GAT_BWD_MINB_OF(VEC * NV))

// The layouts the host launches (ops/src/backward/fused.rs, `layout`): one vector a lane of any
// width, or up to 16 features a lane in 16-byte vectors (head_dim up to 512 for f32 in multiples
// of 4, for f16 / bf16 in multiples of 8); other heads take the per-edge backward.
#define SPATTN_BACKWARD_FUSED_DTYPE(SUFFIX, T, WIDE)                                           \
    SPATTN_BACKWARD_FUSED(SUFFIX, T, 1, 1)                                                     \
    SPATTN_BACKWARD_FUSED(SUFFIX, T, 2, 1)                                                     \
    SPATTN_BACKWARD_FUSED(SUFFIX, T, 4, 1)                                                     \
    SPATTN_BACKWARD_FUSED(SUFFIX, T, WIDE, 2)
SPATTN_BACKWARD_FUSED_DTYPE(f32, float, 4)
SPATTN_BACKWARD_FUSED(f32, float, 4, 4)
SPATTN_BACKWARD_FUSED_DTYPE(f16, __half, 8)
SPATTN_BACKWARD_FUSED(f16, __half, 8, 1)
SPATTN_BACKWARD_FUSED_DTYPE(bf16, __nv_bfloat16, 8)
SPATTN_BACKWARD_FUSED(bf16, __nv_bfloat16, 8, 1)

// ---- extern "C" instantiations ----------------------------------------------------------------

#define SPATTN_GATV2_GRAD(NAME, T, VEC)                                                         \
    extern "C" __global__ void NAME(const u32* row_offsets, u32 n_rows, const u32* col_indices, \
                                    const u32* edge_ids, u32 heads, u32 head_dim,              \
                                    const T* x_self, const T* x_other, const T* ef,            \
                                    const float* att, float slope, const float* ds, u32 g,     \
                                    int accumulate, T* out, T* d_ef, float* d_att_rows) {      \
        gatv2_edge_grad<T, VEC>(row_offsets, n_rows, col_indices, edge_ids, heads, head_dim,   \
                                x_self, x_other, ef, att, slope, ds, g, accumulate, out, d_ef, \
                                d_att_rows);                                                   \
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
    SPATTN_GATV2_GRAD(gatv2_edge_grad_csr_##SUFFIX##_v1, T, 1)                                  \
    SPATTN_GATV2_GRAD(gatv2_edge_grad_csr_##SUFFIX##_v2, T, 2)                                  \
    SPATTN_GATV2_GRAD(gatv2_edge_grad_csr_##SUFFIX##_v4, T, 4)

SPATTN_BACKWARD_PER_DTYPE(f32, float)
SPATTN_BACKWARD_PER_DTYPE(f16, __half)
SPATTN_BACKWARD_PER_DTYPE(bf16, __nv_bfloat16)
SPATTN_GATV2_GRAD(gatv2_edge_grad_csr_f16_v8, __half, 8)
SPATTN_GATV2_GRAD(gatv2_edge_grad_csr_bf16_v8, __nv_bfloat16, 8)
