// Elementwise and small-reduction kernels of the layers (GAT, AGNN, graph transformer) and of
// their optimizers: bias add / gradient, per-head dot with an attention vector and its
// gradient, activations, row L2 normalization, head mean, residual adds, SGD and Adam.
// Dense operands are row-major; every sum is accumulated in f32. Kernel names:
// {op}_dense_{dtype}. Sizes that can exceed 2^32 elements are u64 and walked grid-stride.
#include "common.cuh"

// y[i, c] += bias[c] for an n_rows x cols matrix.
template <class T>
__device__ void bias_add(T* y, const T* __restrict__ bias, u64 rows, u32 cols) {
    SPATTN_GRID_STRIDE(i, rows * cols) {
        y[i] = from_f32<T>(to_f32(y[i]) + to_f32(bias[i % cols]));
    }
}

// Attention vectors a head kernel takes at once (GAT's source and target: 2), and weight
// vectors weighted_col_sum sums at once.
#define SPATTN_HEAD_MAX_ATT 4

// part[b, t, c] = the b-th row block's share of sum_i w[t, i, h] * x[i, c] (c = h * dim + d) for
// each of the n_w <= SPATTN_HEAD_MAX_ATT weight vectors (w = 1 where null, n_w = 1): the gradient
// of a bias (heads = 1) or of GAT's attention vectors (every one from one read of x), which
// sum_parts adds up in a fixed order (no float atomics: the same bits every run). Blocks of 256
// threads: a row takes tpr threads (a power of two, at most 32) of vw consecutive columns each
// (vw = 16 / sizeof(T), one vector, where the host found dim a multiple of it; else 1), so a
// block walks 256 / tpr rows at once (narrow matrices keep every lane busy) over grid y's share
// of the rows, then adds its threads' sums per column in a fixed order in shared memory.
template <class T>
__device__ void weighted_col_sum(const T* __restrict__ x, const float* __restrict__ w, u32 rows,
                                 u32 heads, u32 dim, u32 n_w, u32 vw, u32 tpr,
                                 float* __restrict__ part_out) {
    constexpr u32 V = 16u / sizeof(T);
    __shared__ float part[256][V + 1];
    const u32 cols = heads * dim;
    const u32 tid = threadIdx.x, cb = tid & (tpr - 1u), rstep = 256u / tpr;
    const u32 c0 = (blockIdx.x * tpr + cb) * vw;
    const u64 per_w = (u64)rows * heads;
    float acc[SPATTN_HEAD_MAX_ATT][V];
#pragma unroll
    for (u32 t = 0; t < SPATTN_HEAD_MAX_ATT; ++t)
#pragma unroll
        for (u32 j = 0; j < V; ++j) acc[t][j] = 0.0f;
    if (c0 < cols) {
        // vw = V only where dim is a multiple of V: the thread's columns share one head.
        const u32 h = c0 / dim;
        const bool vec = vw == V && ((unsigned long long)x & 15ull) == 0ull;
#pragma unroll 2
        for (u32 i = blockIdx.y * rstep + tid / tpr; i < rows; i += gridDim.y * rstep) {
            const T* xr = x + (u64)i * cols + c0;
            float v[V];
            if (vec) {
                load_vec<T, V>(xr, v);
            } else {
#pragma unroll
                for (u32 j = 0; j < V; ++j) v[j] = j < vw && c0 + j < cols ? to_f32(xr[j]) : 0.0f;
            }
#pragma unroll
            for (u32 t = 0; t < SPATTN_HEAD_MAX_ATT; ++t) {
                if (t >= n_w) break;
                const float wt = w != nullptr ? __ldg(w + t * per_w + (u64)i * heads + h) : 1.0f;
#pragma unroll
                for (u32 j = 0; j < V; ++j) acc[t][j] = fmaf(wt, v[j], acc[t][j]);
            }
        }
    }
    // The block's tpr * vw columns: thread `tid` holds column (tid % tpr) * vw + j of its rows;
    // the first tpr * vw threads each add one column's 256 / tpr shares, in thread order.
#pragma unroll
    for (u32 t = 0; t < SPATTN_HEAD_MAX_ATT; ++t) {
        if (t >= n_w) break;
#pragma unroll
        for (u32 j = 0; j < V; ++j) part[tid][j] = acc[t][j];
        __syncthreads();
        const u32 col = blockIdx.x * tpr * vw + tid;
        if (tid < tpr * vw && col < cols) {
            const u32 owner = tid / vw, j = tid - owner * vw;
            float s = 0.0f;
            for (u32 r = owner; r < 256u; r += tpr) s += part[r][j];
            part_out[((u64)blockIdx.y * n_w + t) * cols + col] = s;
        }
        __syncthreads();
    }
}

// out[c] += sum over p < n_parts of part[p * cols + c], a block per column c: each thread a
// strided share, then block_reduce's fixed tree.
extern "C" __global__ void __launch_bounds__(256)
    sum_parts_f32(const float* __restrict__ part, u32 n_parts, u32 cols, float* out) {
    __shared__ float scratch[32];
    const u32 c = blockIdx.x;
    float s = 0.0f;
    for (u32 p = threadIdx.x; p < n_parts; p += blockDim.x) s += part[(u64)p * cols + c];
    s = block_reduce(s, scratch, false);
    if (threadIdx.x == 0) out[c] += s;
}

// out[k, i, h] = <x[i, h, :], att[k, h, :]> for each of n_att attention vectors: one warp per
// (vector, row, head).
template <class T>
__device__ void head_dot(const T* __restrict__ x, const T* __restrict__ att, u32 rows, u32 heads,
                         u32 dim, u32 n_att, T* out) {
    const u32 lane = lane_id();
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const u64 per = (u64)rows * heads;
    for (u64 q = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; q < per * n_att; q += warps) {
        const u64 k = q / per, p = q - k * per;
        const u32 h = (u32)(p % heads);
        const T* a = att + (k * heads + h) * dim;
        float acc = 0.0f;
        for (u32 d = lane; d < dim; d += 32u) acc += to_f32(x[p * dim + d]) * to_f32(a[d]);
        acc = group_sum(acc, 0xffffffffu, 32);
        if (lane == 0) out[q] = from_f32<T>(acc);
    }
}

// The lanes of one (row, head) of the head kernels below: a head of `dim` features is walked in
// 16-byte vectors of V where dim allows (V dividing dim, the features and the attention vectors
// 16-byte aligned), else one feature at a time, by the smallest power-of-two group of lanes
// covering it (at most 32): a warp reads whole consecutive rows, every load coalesced.
template <class T>
struct HeadWalk {
    bool vec;
    u32 per, g;  // loads a head, lanes a (row, head)
    __device__ HeadWalk(const void* base, const void* att, u32 dim) {
        const u32 v = 16u / sizeof(T);  // no static member: it would be a module global
        vec = dim % v == 0u && (((unsigned long long)base | (unsigned long long)att) & 15ull) == 0ull;
        per = vec ? dim / v : dim;
        g = 1u;
        while (g < per && g < 32u) g <<= 1;
    }
};

// V consecutive values of an attention vector as floats, in 16-byte loads (p 16-byte aligned:
// the vectorized head walks start a head's chunks at multiples of V of a 16-byte aligned
// buffer whose heads hold whole chunks). Scalar loads of the same values were the head
// kernels' bound: 16 a lane, each warp's spread over 8 heads' vectors.
template <class A, int V>
__device__ __forceinline__ void load_att(const A* __restrict__ p, float (&out)[V]) {
    constexpr int C = (int)(16 / sizeof(A)) < V ? (int)(16 / sizeof(A)) : V;
#pragma unroll
    for (int c = 0; c < V; c += C) {
        float t[C];
        load_vec<A, C>(p + c, t);
#pragma unroll
        for (int i = 0; i < C; ++i) out[c + i] = t[i];
    }
}

// out[k, i, h] = <x[i, h, :], att[k, h, :]> in f32 with f32 attention vectors (the Python
// layers' score terms), n_att <= SPATTN_HEAD_MAX_ATT of them from one read of x: a group of
// lanes per (row, head) (HeadWalk), its sums by shuffles.
template <class T>
__device__ void head_dot_f32(const T* __restrict__ x, const float* __restrict__ att, u32 rows,
                             u32 heads, u32 dim, u32 n_att, float* __restrict__ out) {
    const HeadWalk<T> w(x, att, dim);
    constexpr u32 V = 16u / sizeof(T);
    const u32 lane = lane_id() & (w.g - 1u), mask = group_mask(w.g);
    const u64 total = (u64)rows * heads, stride = (u64)heads * dim;
    for (u64 p = grid_group(w.g); p < total; p += grid_groups(w.g)) {
        u32 h;
        split_index(p, heads, total, h);
        const T* xr = x + p * dim;
        const float* a = att + (u64)h * dim;
        float acc[SPATTN_HEAD_MAX_ATT] = {0.0f, 0.0f, 0.0f, 0.0f};
        if (w.vec) {
            for (u32 k = lane; k < w.per; k += w.g) {
                float xv[V];
                load_vec<T, V>(xr + (u64)k * V, xv);
#pragma unroll
                for (u32 t = 0; t < SPATTN_HEAD_MAX_ATT; ++t)
                    if (t < n_att) {
                        float av[V];
                        load_att<float, V>(a + t * stride + k * V, av);
#pragma unroll
                        for (u32 i = 0; i < V; ++i) acc[t] = fmaf(xv[i], av[i], acc[t]);
                    }
            }
        } else {
            for (u32 d = lane; d < dim; d += w.g) {
                const float xv = to_f32(xr[d]);
#pragma unroll
                for (u32 t = 0; t < SPATTN_HEAD_MAX_ATT; ++t)
                    if (t < n_att) acc[t] = fmaf(xv, __ldg(a + t * stride + d), acc[t]);
            }
        }
#pragma unroll
        for (u32 t = 0; t < SPATTN_HEAD_MAX_ATT; ++t) {
            if (t >= n_att) break;
            const float v = group_sum(acc[t], mask, w.g);
            if (lane == 0u) out[t * total + p] = v;
        }
    }
}

// dx[i, h, d] += sum_k de[k, i, h] * att[k, h, d]: the gradient of head_dot (A = T) or
// head_dot_f32 (A = float) with respect to x, every attention vector's in one pass; the lanes
// of head_dot_f32.
template <class T, class A>
__device__ void head_outer_add(const float* __restrict__ de, const A* __restrict__ att, u32 rows,
                               u32 heads, u32 dim, u32 n_att, T* dx) {
    const HeadWalk<T> w(dx, att, dim);
    constexpr u32 V = 16u / sizeof(T);
    const u32 lane = lane_id() & (w.g - 1u);
    const u64 total = (u64)rows * heads, stride = (u64)heads * dim;
    for (u64 p = grid_group(w.g); p < total; p += grid_groups(w.g)) {
        u32 h;
        split_index(p, heads, total, h);
        T* xr = dx + p * dim;
        const A* a = att + (u64)h * dim;
        float e[SPATTN_HEAD_MAX_ATT];
#pragma unroll
        for (u32 t = 0; t < SPATTN_HEAD_MAX_ATT; ++t) e[t] = t < n_att ? de[t * total + p] : 0.0f;
        if (w.vec) {
            for (u32 k = lane; k < w.per; k += w.g) {
                float xv[V];
                load_vec_coherent<T, V>(xr + (u64)k * V, xv);  // written below: no nc cache
#pragma unroll
                for (u32 t = 0; t < SPATTN_HEAD_MAX_ATT; ++t)
                    if (t < n_att) {
                        float av[V];
                        load_att<A, V>(a + t * stride + k * V, av);
#pragma unroll
                        for (u32 i = 0; i < V; ++i) xv[i] = fmaf(e[t], av[i], xv[i]);
                    }
                store_vec<T, V>(xr + (u64)k * V, xv);
            }
        } else {
            for (u32 d = lane; d < dim; d += w.g) {
                float v = to_f32(xr[d]);
#pragma unroll
                for (u32 t = 0; t < SPATTN_HEAD_MAX_ATT; ++t)
                    if (t < n_att) v = fmaf(e[t], to_f32(a[t * stride + d]), v);
                xr[d] = from_f32<T>(v);
            }
        }
    }
}

// Activations: kind 0 = ReLU, 1 = ELU (alpha 1). The backward takes the pre-activation x.
__device__ __forceinline__ float act_fwd(int kind, float x) {
    if (kind == 0) return x > 0.0f ? x : 0.0f;
    return x > 0.0f ? x : expm1f(x);
}
__device__ __forceinline__ float act_grad(int kind, float x) {
    if (kind == 0) return x > 0.0f ? 1.0f : 0.0f;
    return x > 0.0f ? 1.0f : expf(x);
}

template <class T>
__device__ void activation(int kind, const T* __restrict__ x, T* y, u64 n) {
    SPATTN_GRID_STRIDE(i, n) { y[i] = from_f32<T>(act_fwd(kind, to_f32(x[i]))); }
}

template <class T>
__device__ void activation_backward(int kind, const T* __restrict__ x, const T* __restrict__ dy,
                                    T* dx, u64 n) {
    SPATTN_GRID_STRIDE(i, n) { dx[i] = from_f32<T>(to_f32(dy[i]) * act_grad(kind, to_f32(x[i]))); }
}

// The clamp of F.normalize: x / max(||x||, eps).
#define SPATTN_NORM_EPS 1e-12f

// Row L2 normalization, one warp per row: xhat = x / max(||x||, eps), q = beta * xhat (beta a
// device scalar, or 1 where null), inv_norm[i] = 1 / max(||x||, eps), stored negated when the
// clamp was active (the backward then has no projection term).
template <class T>
__device__ void row_normalize(const T* __restrict__ x, u32 rows, u32 cols,
                              const T* __restrict__ beta, T* xhat, T* q, float* inv_norm) {
    const u32 lane = lane_id();
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const float b = beta != nullptr ? to_f32(beta[0]) : 1.0f;
    for (u64 r = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const T* xr = x + r * cols;
        float ss = 0.0f;
        for (u32 c = lane; c < cols; c += 32u) {
            const float v = to_f32(xr[c]);
            ss += v * v;
        }
        ss = group_sum(ss, 0xffffffffu, 32);
        const float norm = sqrtf(ss);
        const bool clamped = !(norm > SPATTN_NORM_EPS);
        const float inv = 1.0f / (clamped ? SPATTN_NORM_EPS : norm);
        for (u32 c = lane; c < cols; c += 32u) {
            const float v = to_f32(xr[c]) * inv;
            xhat[r * cols + c] = from_f32<T>(v);
            if (q != nullptr) q[r * cols + c] = from_f32<T>(b * v);
        }
        if (lane == 0) inv_norm[r] = clamped ? -inv : inv;
    }
}

// Backward of row_normalize with q = beta * xhat feeding a score and xhat a second one:
// g = beta * dq + dk (dk may be null), dx += (g - xhat <xhat, g>) * inv_norm (no projection
// where the clamp was active), and each block's share of sum dq * xhat into dbeta_part[block]
// (where given; sum_parts_f32 adds them to dbeta). One warp per row; blocks of 256 threads.
template <class T>
__device__ void row_normalize_backward(const T* __restrict__ xhat, const float* __restrict__ inv_norm,
                                       const T* __restrict__ dq, const T* __restrict__ dk,
                                       const T* __restrict__ beta, u32 rows, u32 cols, T* dx,
                                       float* __restrict__ dbeta_part) {
    __shared__ float scratch[32];
    const u32 lane = lane_id();
    const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
    const float b = beta != nullptr ? to_f32(beta[0]) : 1.0f;
    float beta_acc = 0.0f;
    for (u64 r = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; r < rows; r += warps) {
        const u64 base = r * cols;
        float dot = 0.0f, dqx = 0.0f;
        for (u32 c = lane; c < cols; c += 32u) {
            const float xh = to_f32(xhat[base + c]);
            const float q = to_f32(dq[base + c]);
            const float g = b * q + (dk != nullptr ? to_f32(dk[base + c]) : 0.0f);
            dot += xh * g;
            dqx += q * xh;
        }
        dot = group_sum(dot, 0xffffffffu, 32);
        beta_acc += group_sum(dqx, 0xffffffffu, 32);
        const float inv_signed = inv_norm[r];
        const float inv = fabsf(inv_signed);
        const float proj = inv_signed > 0.0f ? dot : 0.0f;
        for (u32 c = lane; c < cols; c += 32u) {
            const float xh = to_f32(xhat[base + c]);
            const float g = b * to_f32(dq[base + c]) + (dk != nullptr ? to_f32(dk[base + c]) : 0.0f);
            dx[base + c] = from_f32<T>(to_f32(dx[base + c]) + (g - xh * proj) * inv);
        }
    }
    // Lane 0 of each warp holds the warp's sum (every lane does, after group_sum).
    const float block_sum = block_reduce(lane == 0 ? beta_acc : 0.0f, scratch, false);
    if (threadIdx.x == 0 && dbeta_part != nullptr) dbeta_part[blockIdx.x] = block_sum;
}

// y += alpha * x.
template <class T>
__device__ void axpy(const T* __restrict__ x, float alpha, T* y, u64 n) {
    SPATTN_GRID_STRIDE(i, n) { y[i] = from_f32<T>(to_f32(y[i]) + alpha * to_f32(x[i])); }
}

// y[i, d] = mean_h x[i, h, d].
template <class T>
__device__ void head_mean(const T* __restrict__ x, u32 rows, u32 heads, u32 dim, T* y) {
    SPATTN_GRID_STRIDE(i, (u64)rows * dim) {
        const u64 r = i / dim;
        const u32 d = (u32)(i % dim);
        float s = 0.0f;
        for (u32 h = 0; h < heads; ++h) s += to_f32(x[(r * heads + h) * dim + d]);
        y[i] = from_f32<T>(s / (float)heads);
    }
}

// dx[i, h, d] = scale * dy[i, d] (the gradient of head_mean with scale = 1 / heads).
template <class T>
__device__ void head_broadcast(const T* __restrict__ dy, u32 rows, u32 heads, u32 dim, float scale,
                               T* dx) {
    SPATTN_GRID_STRIDE(i, (u64)rows * heads * dim) {
        const u64 r = i / ((u64)heads * dim);
        const u32 d = (u32)(i % dim);
        dx[i] = from_f32<T>(scale * to_f32(dy[r * dim + d]));
    }
}

// Adam (decoupled weight decay, AdamW, when wd > 0): m, v in f32; the parameter is read and
// written in T, the step computed in f32. bc1 = 1 - beta1^t, bc2 = 1 - beta2^t.
template <class T>
__device__ void adam(T* p, const float* __restrict__ g, float* m, float* v, u64 n, float lr,
                     float b1, float b2, float eps, float bc1, float bc2, float wd) {
    SPATTN_GRID_STRIDE(i, n) {
        const float gi = g[i];
        const float mi = b1 * m[i] + (1.0f - b1) * gi;
        const float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float pi = to_f32(p[i]);
        pi -= lr * wd * pi;
        pi -= lr * (mi / bc1) / (sqrtf(vi / bc2) + eps);
        p[i] = from_f32<T>(pi);
    }
}

// Plain SGD: p -= lr * (g + wd * p).
template <class T>
__device__ void sgd(T* p, const float* __restrict__ g, u64 n, float lr, float wd) {
    SPATTN_GRID_STRIDE(i, n) {
        const float pi = to_f32(p[i]);
        p[i] = from_f32<T>(pi - lr * (g[i] + wd * pi));
    }
}

// ---- extern "C" instantiations: {op}_dense_{dtype} ------------------------------------------

#define SPATTN_LAYERS(S, T)                                                                     \
    extern "C" __global__ void bias_add_dense_##S(T* y, const T* bias, u64 rows, u32 cols) {    \
        bias_add<T>(y, bias, rows, cols);                                                       \
    }                                                                                           \
    extern "C" __global__ void __launch_bounds__(256)                                           \
        weighted_col_sum_dense_##S(const T* x, const float* w, u32 rows, u32 heads, u32 dim,    \
                                   u32 n_w, u32 vw, u32 tpr, float* part) {                     \
        weighted_col_sum<T>(x, w, rows, heads, dim, n_w, vw, tpr, part);                        \
    }                                                                                           \
    extern "C" __global__ void head_dot_dense_##S(const T* x, const T* att, u32 rows, u32 heads, \
                                                  u32 dim, u32 n_att, T* out) {                 \
        head_dot<T>(x, att, rows, heads, dim, n_att, out);                                      \
    }                                                                                           \
    extern "C" __global__ void head_outer_add_dense_##S(const float* de, const T* att, u32 rows,    \
                                                        u32 heads, u32 dim, u32 n_att, T* dx) { \
        head_outer_add<T, T>(de, att, rows, heads, dim, n_att, dx);                             \
    }                                                                                           \
    extern "C" __global__ void head_dot_f32_dense_##S(const T* x, const float* att, u32 rows,   \
                                                      u32 heads, u32 dim, u32 n_att,            \
                                                      float* out) {                             \
        head_dot_f32<T>(x, att, rows, heads, dim, n_att, out);                                  \
    }                                                                                           \
    extern "C" __global__ void head_outer_add_f32_dense_##S(const float* de, const float* att,  \
                                                            u32 rows, u32 heads, u32 dim,       \
                                                            u32 n_att, T* dx) {                 \
        head_outer_add<T, float>(de, att, rows, heads, dim, n_att, dx);                         \
    }                                                                                           \
    extern "C" __global__ void activation_dense_##S(int kind, const T* x, T* y, u64 n) {        \
        activation<T>(kind, x, y, n);                                                           \
    }                                                                                           \
    extern "C" __global__ void activation_backward_dense_##S(int kind, const T* x, const T* dy, \
                                                             T* dx, u64 n) {                    \
        activation_backward<T>(kind, x, dy, dx, n);                                             \
    }                                                                                           \
    extern "C" __global__ void row_normalize_dense_##S(const T* x, u32 rows, u32 cols,         \
                                                       const T* beta, T* xhat, T* q,            \
                                                       float* inv_norm) {                       \
        row_normalize<T>(x, rows, cols, beta, xhat, q, inv_norm);                               \
    }                                                                                           \
    extern "C" __global__ void row_normalize_backward_dense_##S(                               \
        const T* xhat, const float* inv_norm, const T* dq, const T* dk, const T* beta, u32 rows, \
        u32 cols, T* dx, float* dbeta_part) {                                                   \
        row_normalize_backward<T>(xhat, inv_norm, dq, dk, beta, rows, cols, dx, dbeta_part);    \
    }                                                                                           \
    extern "C" __global__ void axpy_dense_##S(const T* x, float alpha, T* y, u64 n) {           \
        axpy<T>(x, alpha, y, n);                                                                \
    }                                                                                           \
    extern "C" __global__ void head_mean_dense_##S(const T* x, u32 rows, u32 heads, u32 dim,    \
                                                   T* y) {                                      \
        head_mean<T>(x, rows, heads, dim, y);                                                   \
    }                                                                                           \
    extern "C" __global__ void head_broadcast_dense_##S(const T* dy, u32 rows, u32 heads,       \
                                                        u32 dim, float scale, T* dx) {          \
        head_broadcast<T>(dy, rows, heads, dim, scale, dx);                                     \
    }                                                                                           \
    extern "C" __global__ void adam_dense_##S(T* p, const float* g, float* m, float* v, u64 n,  \
                                              float lr, float b1, float b2, float eps,          \
                                              float bc1, float bc2, float wd) {                 \
        adam<T>(p, g, m, v, n, lr, b1, b2, eps, bc1, bc2, wd);                                  \
    }                                                                                           \
    extern "C" __global__ void sgd_dense_##S(T* p, const float* g, u64 n, float lr, float wd) { \
        sgd<T>(p, g, n, lr, wd);                                                                \
    }

SPATTN_LAYERS(f32, float)
SPATTN_LAYERS(f16, __half)
SPATTN_LAYERS(bf16, __nv_bfloat16)
