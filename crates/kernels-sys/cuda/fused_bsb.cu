// Fused attention on BSB, tensor cores (Fused3S style):
//   out = softmax_row(scale * Q K^T masked by A) V
// in one pass over each 16-row window's 16x8 blocks, FlashAttention-2 style: S = Q K^T of two
// blocks (16 rows x 16 columns) by mma.sync, masked by the blocks' u128 bitmaps to -inf, an
// online softmax (running max from -inf, running sum, f32 accumulator), and P V by mma.sync with
// P taken straight from S's accumulator registers. No score reaches device memory.
//
// Work: an item is (unit, head); a unit is a range of blocks of one window (host schedule,
// largest first). An item is taken by a group of `fs` warps; warp w of the group owns features
// [w*DS, (w+1)*DS) of the head. Each warp computes the partial S over its features, the group
// sums the partials through shared memory (same order in every warp, so all warps hold the
// same S, bit for bit, and the same softmax state), and each warp multiplies P by its slice of
// V. A CTA holds `groups` groups, synchronised by named barriers (id 1 + group).
//
// Windows with more blocks than the host's chunk are split into several units; each leaves an
// exact partial (max, sum, f32 accumulator) per row and head, and the last unit of a window to
// finish (an atomic counter per split window and head) merges them and writes the rows.
//
// Register layouts (g = lane / 4, t = lane % 4; see mma.cuh):
// - SDDMM, f16/bf16: lane t of a group loads 16 bytes = 8 features (8t .. 8t+8 of a 32-feature
//   chunk) of a Q or K row; words 0, 1 feed k-step 0 (a[0]/a[2] or b[0]/b[1]), words 2, 3 k-step
//   1. The contraction over features is a sum, so any feature order shared by Q and K is right.
//   f32 (tf32 m16n8k8, run as 3xTF32 so scores keep f32 accuracy): 4 features per lane, 16 per
//   chunk, the same word roles.
// - S accumulator: c[0], c[1] = S[g][2t, 2t+1], c[2], c[3] = S[g+8][2t, 2t+1]; column n of a
//   block is slot n, whose K row lanes of group g = n loaded.
// - P V, f16/bf16 (m16n8k16): A = the S registers of the two blocks (k = slot of block 0, then of
//   block 1). B[k][n] = V[slot k][feature phi(nt, n)] with phi(nt, n) = base + n*D8 + nt: lane
//   (g, t) loads features base + g*D8 .. + D8 of the V rows of slots 2t, 2t+1 of both blocks,
//   and byte-permutes pairs into b registers. f32 (tf32 m16n8k8, one mma per block): k = t is
//   slot 2t and k = t+4 slot 2t+1, matching the S registers as they are.
// - O accumulator: o[nt][0], o[nt][1] = O[g][phi(nt, 2t)], O[g][phi(nt, 2t+1)]; over nt these
//   are D8 consecutive features (base + 2t*D8 + nt, base + (2t+1)*D8 + nt): vector stores.

#include "common.cuh"
#include "mma.cuh"

#define BSB_WINDOW_ROWS 16u
#define BSB_BLOCK_COLS 8u
// Floats of one group's merge scratch (16 maxima, 16 inverse sums, a flag).
#define BSB_MERGE_FLOATS 64u

// 2^x (ex2.approx: relative error ~2^-22; 2^-inf = 0).
__device__ __forceinline__ float bsb_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Barrier of the `threads` threads of one group (named barrier `id`, or the warp alone).
__device__ __forceinline__ void bsb_group_sync(u32 id, u32 threads) {
    if (threads == 32u) {
        __syncwarp();
    } else {
        asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
    }
}

// N elements of T at row[f0 .. f0 + N) as raw 32-bit words; zero where !valid or feature >= d.
// VEC: 16-byte (or N*sizeof(T)-byte) loads, which needs d*sizeof(T) % 16 == 0 (the host checks)
// and f0 a multiple of the access; else one element at a time. `row` is only dereferenced when
// valid.
template <class T, int N, bool VEC>
__device__ __forceinline__ void bsb_load(u32 (&w)[N * sizeof(T) / 4], const T* __restrict__ row,
                                         u32 f0, u32 d, bool valid) {
    if constexpr (VEC) {
        constexpr int BYTES = N * (int)sizeof(T);
        constexpr int CB = BYTES < 16 ? BYTES : 16;
        constexpr int CE = CB / (int)sizeof(T), CW = CB / 4;
        typedef typename RawOf<CB>::type Raw;
#pragma unroll
        for (int c = 0; c < N / CE; ++c) {
            const u32 f = f0 + c * CE;
            if (valid && f < d) {
                Raw raw = __ldg(reinterpret_cast<const Raw*>(row + f));
                const u32* rw = reinterpret_cast<const u32*>(&raw);
#pragma unroll
                for (int i = 0; i < CW; ++i) w[c * CW + i] = rw[i];
            } else {
#pragma unroll
                for (int i = 0; i < CW; ++i) w[c * CW + i] = 0u;
            }
        }
    } else {
        typedef typename RawOf<sizeof(T)>::type R;
        const R* r = reinterpret_cast<const R*>(row);
#pragma unroll
        for (int i = 0; i < N * (int)sizeof(T) / 4; ++i) w[i] = 0u;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            const u32 f = f0 + i;
            const u32 x = (valid && f < d) ? (u32)__ldg(r + f) : 0u;
            if constexpr (sizeof(T) == 4) {
                w[i] = x;
            } else {
                w[i / 2] |= x << (16 * (i & 1));
            }
        }
    }
}

// Packs floats x[0 .. 4/sizeof(T)) into one 32-bit word of T.
template <class T> __device__ __forceinline__ u32 bsb_word(const float* x) {
    if constexpr (sizeof(T) == 4) {
        return __float_as_uint(x[0]);
    } else {
        return pack2<T>(x[0], x[1]);
    }
}

// Stores x[0 .. N) as T to row[f0 .. f0 + N), features >= d skipped (VEC as in bsb_load).
template <class T, int N, bool VEC>
__device__ __forceinline__ void bsb_store(T* __restrict__ row, u32 f0, u32 d, const float (&x)[N]) {
    if constexpr (VEC) {
        constexpr int BYTES = N * (int)sizeof(T);
        constexpr int CB = BYTES < 16 ? BYTES : 16;
        constexpr int CE = CB / (int)sizeof(T), CW = CB / 4;
        constexpr int EW = 4 / (int)sizeof(T);  // elements per word
        typedef typename RawOf<CB>::type Raw;
#pragma unroll
        for (int c = 0; c < N / CE; ++c) {
            const u32 f = f0 + c * CE;
            if (f < d) {
                Raw raw;
                u32* rw = reinterpret_cast<u32*>(&raw);
#pragma unroll
                for (int i = 0; i < CW; ++i) rw[i] = bsb_word<T>(&x[c * CE + i * EW]);
                *reinterpret_cast<Raw*>(row + f) = raw;
            }
        }
    } else {
#pragma unroll
        for (int i = 0; i < N; ++i)
            if (f0 + i < d) row[f0 + i] = from_f32<T>(x[i]);
    }
}

// S += A B for one k-step of the SDDMM. f16/bf16: one m16n8k16. f32: 3xTF32 m16n8k8
// (a_big b_big + a_big b_small + a_small b_big), so that scores keep f32 accuracy (scores of
// 1e4 would otherwise carry errors of several units); `as` holds the small parts of A.
template <class T>
__device__ __forceinline__ void bsb_qk(float (&s)[4], const u32 (&a)[4], const u32 (&as)[4],
                                       u32 k0, u32 k1) {
    if constexpr (sizeof(T) == 4) {
        const float f0 = __uint_as_float(k0), f1 = __uint_as_float(k1);
        const u32 bb[2] = {to_tf32(f0), to_tf32(f1)};
        const u32 bs[2] = {to_tf32(f0 - __uint_as_float(bb[0])),
                           to_tf32(f1 - __uint_as_float(bb[1]))};
        mma_m16n8k8_tf32(s, as, bb);
        mma_m16n8k8_tf32(s, a, bs);
        mma_m16n8k8_tf32(s, a, bb);
    } else {
        const u32 b[2] = {k0, k1};
        mma_m16n8k16(s, a, b, T());
    }
}

// Column slots and bitmap words of one step (two blocks; a missing second block is all
// padding). Kept raw, as loaded, so that a prefetch never waits on its own load.
struct BsbStep {
    u32 ck[2];     // K: the column of slot g
    u32 cv[2][2];  // V: the columns of slots 2t, 2t+1
    u32 bm[2][2];  // the bitmap words holding rows g and g+8
};

// `bitmap_words` is the bitmaps as u32, 4 per block: word k holds rows 4k .. 4k+3 (8 bits
// each). Row g is in word g / 4 (`upper` = g >= 4), row g+8 in word 2 + g / 4.
__device__ __forceinline__ void bsb_load_step(BsbStep& st, const u32* __restrict__ cols,
                                              const u32* __restrict__ bitmap_words, u32 b,
                                              u32 end, u32 g, u32 t, u32 upper) {
#pragma unroll
    for (int bb = 0; bb < 2; ++bb) {
        const u32 blk = b + bb;
        if (blk < end) {
            const u32* c = cols + (u64)blk * BSB_BLOCK_COLS;
            st.ck[bb] = __ldg(c + g);
            const uint2 cv = __ldg(reinterpret_cast<const uint2*>(c + 2 * t));
            st.cv[bb][0] = cv.x;
            st.cv[bb][1] = cv.y;
            const u32* w = bitmap_words + (u64)blk * 4u + upper;
            st.bm[bb][0] = __ldg(w);
            st.bm[bb][1] = __ldg(w + 2);
        } else {
            st.ck[bb] = SPATTN_NONE;
            st.cv[bb][0] = SPATTN_NONE;
            st.cv[bb][1] = SPATTN_NONE;
            st.bm[bb][0] = 0u;
            st.bm[bb][1] = 0u;
        }
    }
}

template <class T, int DS, bool VEC, bool PIPE>
__device__ __forceinline__ void fused_bsb(
    const uint4* __restrict__ units, const u32* __restrict__ unit_split,
    const u32* __restrict__ split_part_first, u32 n_items, u32 heads, u32 head_dim, u32 fs,
    u32 n_rows, const u32* __restrict__ block_columns, const u32* __restrict__ bitmaps,
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v, float scale_log2,
    T* __restrict__ out, float* __restrict__ part_ml, float* __restrict__ part_acc,
    u32* __restrict__ counters) {
    constexpr bool F32 = sizeof(T) == 4;
    constexpr int EPL = 16 / (int)sizeof(T);  // elements of one 16-byte load
    constexpr int KCH = 4 * EPL;              // features of one group-wide load (2 k-steps)
    constexpr int NKC = DS / KCH;             // 16-byte loads per lane per K row
    constexpr int NKS = 2 * NKC;              // k-steps per block
    constexpr int D8 = DS / 8;                // n-tiles of P V = features per lane per V row
    constexpr int VW = D8 * (int)sizeof(T) / 4;
    static_assert(DS % KCH == 0 && D8 >= 4, "slice too narrow");

    extern __shared__ float bsb_smem[];
    const u32 lane = lane_id(), warp = threadIdx.x >> 5;
    const u32 grp = warp / fs, wig = warp - grp * fs;
    const u32 groups = (blockDim.x >> 5) / fs;
    const u32 item = blockIdx.x * groups + grp;
    if (item >= n_items) return;  // the whole group leaves together
    const u32 gsize = fs * 32u, gt = wig * 32u + lane, bar = grp + 1u;
    const u32 xs_floats = fs > 1u ? 2u * fs * 256u : 0u;
    float* xs = bsb_smem + grp * (xs_floats + BSB_MERGE_FLOATS);
    float* mrg = xs + xs_floats;

    const u32 u = item / heads, h = item - u * heads;
    const uint4 un = units[u];
    const u32 window = un.x, b_begin = un.y, b_end = un.z, part = un.w;
    const u32 g = lane >> 2, t = lane & 3u;
    const u32 d = head_dim, base = wig * DS;
    const u64 hd = (u64)heads * head_dim, head_off = (u64)h * head_dim;
    const u32 row0 = window * BSB_WINDOW_ROWS + g, row1 = row0 + 8u;

    // Q fragments of rows g, g+8 over this warp's features, per k-step.
    u32 qf[NKS][4];
    u32 qs[F32 ? NKS : 1][4];
#pragma unroll
    for (int c = 0; c < NKC; ++c) {
        u32 r0[4], r1[4];
        const u32 f = base + c * KCH + t * EPL;
        bsb_load<T, EPL, VEC>(r0, q + (row0 < n_rows ? row0 : 0u) * hd + head_off, f, d,
                              row0 < n_rows);
        bsb_load<T, EPL, VEC>(r1, q + (row1 < n_rows ? row1 : 0u) * hd + head_off, f, d,
                              row1 < n_rows);
#pragma unroll
        for (int ks = 0; ks < 2; ++ks) {
            const u32 a[4] = {r0[2 * ks], r1[2 * ks], r0[2 * ks + 1], r1[2 * ks + 1]};
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                if constexpr (F32) {
                    const float x = __uint_as_float(a[i]);
                    const u32 big = to_tf32(x);
                    qf[2 * c + ks][i] = big;
                    qs[2 * c + ks][i] = to_tf32(x - __uint_as_float(big));
                } else {
                    qf[2 * c + ks][i] = a[i];
                }
            }
        }
    }
    if constexpr (!F32) {
#pragma unroll
        for (int i = 0; i < 4; ++i) qs[0][i] = 0u;
    }

    float m[2] = {SPATTN_NEG_INF, SPATTN_NEG_INF}, l[2] = {0.0f, 0.0f};
    float o[D8][4];
#pragma unroll
    for (int nt = 0; nt < D8; ++nt)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[nt][i] = 0.0f;

    // Bit positions of this lane's entries in the words of rows g and g+8: 8*(g%4) + 2t, + 1.
    const u32 shift = 8u * (g & 3u) + 2u * t;
    const u32 upper = g >= 4u ? 1u : 0u;

    // One step: blocks b, b+1. Software pipeline (PIPE): on entry `mc` holds the slots of this
    // step and `kw_use` its K rows (both loaded during the previous step), `mn` the slots of
    // the next step. The step issues its V rows, the next step's K rows (into `kw_fill`) and
    // the slots of the step after (into `mc`, once read), then computes on data already
    // present. Without PIPE a step loads its own K rows first (fewer registers).
    u32 buf = 0;
    auto load_k = [&](u32 (&kw)[2][NKC][4], const BsbStep& st) {
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
            const bool okk = st.ck[bb] != SPATTN_NONE;
            const T* kr = k + (okk ? st.ck[bb] : 0u) * hd + head_off;
#pragma unroll
            for (int c = 0; c < NKC; ++c)
                bsb_load<T, EPL, VEC>(kw[bb][c], kr, base + c * KCH + t * EPL, d, okk);
        }
    };
    auto step = [&](u32 b, u32 (&kw_use)[2][NKC][4], u32 (&kw_fill)[2][NKC][4], BsbStep& mc,
                    const BsbStep& mn) {
        // V rows of slots 2t, 2t+1 of both blocks (padding: zeros).
        u32 vw[2][2][VW];
#pragma unroll
        for (int bb = 0; bb < 2; ++bb)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const bool okv = mc.cv[bb][e] != SPATTN_NONE;
                const T* vr = v + (okv ? mc.cv[bb][e] : 0u) * hd + head_off;
                bsb_load<T, D8, VEC>(vw[bb][e], vr, base + g * D8, d, okv);
            }
        const u32 bits[2][2] = {{mc.bm[0][0], mc.bm[0][1]}, {mc.bm[1][0], mc.bm[1][1]}};
        if constexpr (PIPE) {
            load_k(kw_fill, mn);
        } else {
            load_k(kw_use, mc);
        }
        bsb_load_step(mc, block_columns, bitmaps, b + 4u, b_end, g, t, upper);

        // S (partial over this warp's features): two accumulators per block when the chain
        // is long, so that consecutive mma do not wait on each other.
        constexpr int NACC = NKS >= 4 ? 2 : 1;
        float s[2][4];
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
            float sa[NACC][4];
#pragma unroll
            for (int j = 0; j < NACC; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) sa[j][i] = 0.0f;
#pragma unroll
            for (int ks = 0; ks < NKS; ++ks)
                bsb_qk<T>(sa[ks % NACC], qf[ks], qs[F32 ? ks : 0], kw_use[bb][ks / 2][2 * (ks % 2)],
                          kw_use[bb][ks / 2][2 * (ks % 2) + 1]);
#pragma unroll
            for (int i = 0; i < 4; ++i) s[bb][i] = NACC == 2 ? sa[0][i] + sa[NACC - 1][i] : sa[0][i];
        }
        // Sum of the group's partials, in warp order (identical in every warp).
        if (fs > 1u) {
            float* xb = xs + buf * fs * 256u;
#pragma unroll
            for (int j = 0; j < 8; ++j) xb[(wig * 8u + j) * 32u + lane] = s[j >> 2][j & 3];
            bsb_group_sync(bar, gsize);
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                float acc = 0.0f;
                for (u32 w = 0; w < fs; ++w) acc += xb[(w * 8u + j) * 32u + lane];
                s[j >> 2][j & 3] = acc;
            }
            buf ^= 1u;
        }

        // Mask (bitmap bit clear -> -inf) and scale into the log2 domain.
        float x[2][4];
#pragma unroll
        for (int bb = 0; bb < 2; ++bb) {
            const u32 b0 = bits[bb][0] >> shift, b1 = bits[bb][1] >> shift;
            x[bb][0] = (b0 & 1u) ? s[bb][0] * scale_log2 : SPATTN_NEG_INF;
            x[bb][1] = (b0 & 2u) ? s[bb][1] * scale_log2 : SPATTN_NEG_INF;
            x[bb][2] = (b1 & 1u) ? s[bb][2] * scale_log2 : SPATTN_NEG_INF;
            x[bb][3] = (b1 & 2u) ? s[bb][3] * scale_log2 : SPATTN_NEG_INF;
        }

        // Online softmax of rows g (r = 0) and g+8 (r = 1); l stays per lane until the end.
        float p[2][4];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mx = fmaxf(fmaxf(x[0][2 * r], x[0][2 * r + 1]), fmaxf(x[1][2 * r], x[1][2 * r + 1]));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
            const float mnew = fmaxf(m[r], mx);
            const float mu = mnew == SPATTN_NEG_INF ? 0.0f : mnew;
            const float alpha = bsb_exp2(m[r] - mu);
            m[r] = mnew;
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                p[bb][2 * r] = bsb_exp2(x[bb][2 * r] - mu);
                p[bb][2 * r + 1] = bsb_exp2(x[bb][2 * r + 1] - mu);
            }
            l[r] = l[r] * alpha + ((p[0][2 * r] + p[0][2 * r + 1]) + (p[1][2 * r] + p[1][2 * r + 1]));
#pragma unroll
            for (int nt = 0; nt < D8; ++nt) {
                o[nt][2 * r] *= alpha;
                o[nt][2 * r + 1] *= alpha;
            }
        }

        // O += P V over this warp's features.
        if constexpr (F32) {
#pragma unroll
            for (int bb = 0; bb < 2; ++bb) {
                const u32 a[4] = {to_tf32(p[bb][0]), to_tf32(p[bb][2]), to_tf32(p[bb][1]),
                                  to_tf32(p[bb][3])};
#pragma unroll
                for (int nt = 0; nt < D8; ++nt) {
                    const u32 bv[2] = {to_tf32(__uint_as_float(vw[bb][0][nt])),
                                       to_tf32(__uint_as_float(vw[bb][1][nt]))};
                    mma_m16n8k8_tf32(o[nt], a, bv);
                }
            }
        } else {
            const u32 a[4] = {pack2<T>(p[0][0], p[0][1]), pack2<T>(p[0][2], p[0][3]),
                              pack2<T>(p[1][0], p[1][1]), pack2<T>(p[1][2], p[1][3])};
#pragma unroll
            for (int nt = 0; nt < D8; ++nt) {
                const u32 sel = (nt & 1) ? 0x7632u : 0x5410u;
                const u32 bv[2] = {__byte_perm(vw[0][0][nt / 2], vw[0][1][nt / 2], sel),
                                   __byte_perm(vw[1][0][nt / 2], vw[1][1][nt / 2], sel)};
                mma_m16n8k16(o[nt], a, bv, T());
            }
        }
    };

    // Prologue: slots of steps 0 and 1, K rows of step 0. Then steps in ping-pong pairs, so
    // that no register holding a load in flight is ever copied.
    BsbStep ma, mb;
    u32 kwa[2][NKC][4], kwb[2][NKC][4];
    bsb_load_step(ma, block_columns, bitmaps, b_begin, b_end, g, t, upper);
    bsb_load_step(mb, block_columns, bitmaps, b_begin + 2u, b_end, g, t, upper);
    if constexpr (PIPE) load_k(kwa, ma);
    for (u32 b = b_begin;;) {
        if (b >= b_end) break;
        step(b, kwa, kwb, ma, mb);
        b += 2u;
        if (b >= b_end) break;
        step(b, kwb, kwa, mb, ma);
        b += 2u;
    }

    // Row sums over the 4 lanes of each group.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }

    if (part == SPATTN_NONE) {
        // The whole window: normalise and write (a row without edges has l = 0: zeros).
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const u32 row = r == 0 ? row0 : row1;
            if (row < n_rows) {
                const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
                T* orow = out + (u64)row * hd + head_off;
                float y[D8];
#pragma unroll
                for (int nt = 0; nt < D8; ++nt) y[nt] = o[nt][2 * r] * inv;
                bsb_store<T, D8, VEC>(orow, base + 2u * t * D8, d, y);
#pragma unroll
                for (int nt = 0; nt < D8; ++nt) y[nt] = o[nt][2 * r + 1] * inv;
                bsb_store<T, D8, VEC>(orow, base + (2u * t + 1u) * D8, d, y);
            }
        }
        return;
    }

    // A part of a split window: leave (m, l, acc) for rows g, g+8 (all 16 rows, features
    // [base, base + DS) of this warp), then the last part to arrive merges.
    const u32 dp = fs * DS;
    const u64 slot = (u64)part * heads + h;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const u32 wr = g + 8u * r;
        if (wig == 0u && t == 0u) {
            part_ml[(slot * BSB_WINDOW_ROWS + wr) * 2u] = m[r];
            part_ml[(slot * BSB_WINDOW_ROWS + wr) * 2u + 1u] = l[r];
        }
        float* arow = part_acc + (slot * BSB_WINDOW_ROWS + wr) * dp + base;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            float4* dst = reinterpret_cast<float4*>(arow + (2u * t + half) * D8);
#pragma unroll
            for (int c = 0; c < D8 / 4; ++c)
                dst[c] = make_float4(o[4 * c][2 * r + half], o[4 * c + 1][2 * r + half],
                                     o[4 * c + 2][2 * r + half], o[4 * c + 3][2 * r + half]);
        }
    }
    __threadfence();
    bsb_group_sync(bar, gsize);
    const u32 split = unit_split[u];
    const u32 p_first = split_part_first[split], p_end = split_part_first[split + 1u];
    u32* counter = counters + (u64)split * heads + h;
    u32* flag = reinterpret_cast<u32*>(mrg + 2u * BSB_WINDOW_ROWS);
    if (gt == 0u) *flag = atomicAdd(counter, 1u) == p_end - p_first - 1u ? 1u : 0u;
    bsb_group_sync(bar, gsize);
    if (*flag == 0u) return;
    __threadfence();

    // Merge. Per row (threads 0..15): the global max and 1 / total sum, one pass.
    const u32 rows_here = min(BSB_WINDOW_ROWS, n_rows - window * BSB_WINDOW_ROWS);
    if (gt < BSB_WINDOW_ROWS) {
        float mm = SPATTN_NEG_INF, ll = 0.0f;
#pragma unroll 4
        for (u32 pp = p_first; pp < p_end; ++pp) {
            const u64 i = (((u64)pp * heads + h) * BSB_WINDOW_ROWS + gt) * 2u;
            const float m2 = __ldcg(part_ml + i), l2 = __ldcg(part_ml + i + 1u);
            const float mnew = fmaxf(mm, m2);
            const float mu = mnew == SPATTN_NEG_INF ? 0.0f : mnew;
            ll = ll * bsb_exp2(mm - mu) + l2 * bsb_exp2(m2 - mu);
            mm = mnew;
        }
        mrg[gt] = mm == SPATTN_NEG_INF ? 0.0f : mm;
        mrg[BSB_WINDOW_ROWS + gt] = ll > 0.0f ? 1.0f / ll : 0.0f;
    }
    bsb_group_sync(bar, gsize);
    // Then every (row, 4 features): 16 rows x dp/4 quads over fs*32 threads = D8 quads per
    // thread, all of a part's loads in flight at once.
    const u32 quads_per_row = dp / 4u;
    u32 qrow[D8], qf4[D8];
    float4 acc[D8];
#pragma unroll
    for (int j = 0; j < D8; ++j) {
        const u32 i = gt + j * gsize;
        qrow[j] = i / quads_per_row;
        qf4[j] = (i - qrow[j] * quads_per_row) * 4u;
        acc[j] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    }
    for (u32 pp = p_first; pp < p_end; ++pp) {
        const u64 r0 = ((u64)pp * heads + h) * BSB_WINDOW_ROWS;
#pragma unroll
        for (int j = 0; j < D8; ++j) {
            const u64 r = r0 + qrow[j];
            const float c = bsb_exp2(__ldcg(part_ml + r * 2u) - mrg[qrow[j]]);
            const float4 a = __ldcg(reinterpret_cast<const float4*>(part_acc + r * dp + qf4[j]));
            acc[j].x += a.x * c;
            acc[j].y += a.y * c;
            acc[j].z += a.z * c;
            acc[j].w += a.w * c;
        }
    }
#pragma unroll
    for (int j = 0; j < D8; ++j) {
        if (qrow[j] >= rows_here) continue;
        const float inv = mrg[BSB_WINDOW_ROWS + qrow[j]];
        const float y[4] = {acc[j].x * inv, acc[j].y * inv, acc[j].z * inv, acc[j].w * inv};
        bsb_store<T, 4, VEC>(out + (u64)(window * BSB_WINDOW_ROWS + qrow[j]) * hd + head_off,
                             qf4[j], d, y);
    }
    if (gt == 0u) *counter = 0u;  // ready for the next launch
}

#define SPATTN_FUSED_BSB(SUFFIX, T, DS, NAME, VEC, PIPE)                                       \
    extern "C" __global__ void __launch_bounds__(256)                                          \
        fused_bsb_##SUFFIX##_s##DS##NAME(                                                      \
            const uint4* units, const u32* unit_split, const u32* split_part_first,            \
            u32 n_items, u32 heads, u32 head_dim, u32 fs, u32 n_rows, const u32* block_columns, \
            const u32* bitmaps, const T* q, const T* k, const T* v, float scale_log2, T* out,   \
            float* part_ml, float* part_acc, u32* counters) {                                  \
        fused_bsb<T, DS, VEC, PIPE>(units, unit_split, split_part_first, n_items, heads,       \
                                    head_dim, fs, n_rows, block_columns, bitmaps, q, k, v,     \
                                    scale_log2, out, part_ml, part_acc, counters);             \
    }

// The 128-feature slice is software-pipelined (measured a little faster on H100); the narrower
// slices are not (the pipeline's registers cost them warps per SM: slower), nor are
// element-wise rows (head_dim * sizeof(T) not a multiple of 16: their scalar loads would spill).
#define SPATTN_FUSED_BSB_BOTH(SUFFIX, T, DS)                                                   \
    SPATTN_FUSED_BSB(SUFFIX, T, DS, , true, DS == 128)                                         \
    SPATTN_FUSED_BSB(SUFFIX, T, DS, _scalar, false, false)

SPATTN_FUSED_BSB_BOTH(f16, __half, 32)
SPATTN_FUSED_BSB_BOTH(f16, __half, 64)
SPATTN_FUSED_BSB_BOTH(f16, __half, 128)
SPATTN_FUSED_BSB_BOTH(bf16, __nv_bfloat16, 32)
SPATTN_FUSED_BSB_BOTH(bf16, __nv_bfloat16, 64)
SPATTN_FUSED_BSB_BOTH(bf16, __nv_bfloat16, 128)
SPATTN_FUSED_BSB_BOTH(f32, float, 32)
SPATTN_FUSED_BSB_BOTH(f32, float, 64)
