// Tensor-core wrappers shared by every tensor-core kernel (ME-BCRS ops, fused BSB attention,
// hybrid): warp-level mma.sync on sm_80+, always accumulating in f32. Append new wrappers at
// the end; keep one copy of each here.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k16" / ".m16n8k8"), with
// g = lane / 4 (group) and t = lane % 4 (thread in group):
//
// m16n8k16, A (16 x 16, row-major) f16/bf16, 4 registers of 2 elements:
//   a[0] = A[g    ][2t, 2t+1]      a[1] = A[g + 8][2t, 2t+1]
//   a[2] = A[g    ][2t+8, 2t+9]    a[3] = A[g + 8][2t+8, 2t+9]
// m16n8k16, B (16 x 8, "col": element (k, n)), 2 registers of 2 elements:
//   b[0] = B[2t, 2t+1][g]          b[1] = B[2t+8, 2t+9][g]
// C/D (16 x 8) f32, 4 registers:
//   c[0], c[1] = C[g][2t, 2t+1]    c[2], c[3] = C[g + 8][2t, 2t+1]
//
// m16n8k8 tf32, A (16 x 8): a[0] = A[g][t], a[1] = A[g+8][t], a[2] = A[g][t+4], a[3] = A[g+8][t+4]
//                B (8 x 8):  b[0] = B[t][g], b[1] = B[t+4][g]; C/D as above.
#pragma once

#include "common.cuh"

// Two f32 rounded to f16 (round to nearest) packed low-first into one 32-bit register.
__device__ __forceinline__ u32 pack_f16x2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

// Two f32 rounded to bf16 (round to nearest) packed low-first.
__device__ __forceinline__ u32 pack_bf16x2(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<u32*>(&h);
}

// Packs two values of T (f16 or bf16) for an mma operand register.
template <class T> __device__ __forceinline__ u32 pack2(float lo, float hi);
template <> __device__ __forceinline__ u32 pack2<__half>(float lo, float hi) { return pack_f16x2(lo, hi); }
template <> __device__ __forceinline__ u32 pack2<__nv_bfloat16>(float lo, float hi) {
    return pack_bf16x2(lo, hi);
}

// f32 -> tf32 (round to nearest, ties away: cvt.rna), as the 32-bit operand register.
__device__ __forceinline__ u32 to_tf32(float x) {
    u32 r;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(r) : "f"(x));
    return r;
}

// D = A * B + D, m16n8k16, f16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2],
                                             __half) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D = A * B + D, m16n8k16, bf16 inputs, f32 accumulators.
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const u32 (&a)[4], const u32 (&b)[2],
                                             __nv_bfloat16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// D = A * B + D, m16n8k8, tf32 inputs (registers from to_tf32), f32 accumulators.
__device__ __forceinline__ void mma_m16n8k8_tf32(float (&d)[4], const u32 (&a)[4],
                                                 const u32 (&b)[2]) {
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ---- 2 x 2 transposes of 16-bit pairs (prmt) --------------------------------------------------
// x = (x.lo, x.hi) and y = (y.lo, y.hi) are two rows of a 2 x 2 block of f16/bf16; these give
// its columns: (x.lo, y.lo) and (x.hi, y.hi). Gathered rows become mma operand registers whose
// two halves come from two different rows (swap-and-transpose SpMM: one register holds one
// feature of two neighbouring vectors).
__device__ __forceinline__ u32 pair_lo(u32 x, u32 y) { return __byte_perm(x, y, 0x5410); }
__device__ __forceinline__ u32 pair_hi(u32 x, u32 y) { return __byte_perm(x, y, 0x7632); }

// ---- asynchronous copies to shared memory and ldmatrix (sm_80+) -------------------------------

// The shared-memory address of a generic pointer into shared memory.
__device__ __forceinline__ u32 smem_addr(const void* p) {
    return (u32)__cvta_generic_to_shared(p);
}

// 16 bytes global -> shared without registers (cp.async.cg: through L2 only). `fill` false
// writes 16 zero bytes and reads nothing (src-size 0); src must still be a valid address.
__device__ __forceinline__ void cp_async_16(u32 dst, const void* src, bool fill) {
    const int n = fill ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}

// Asynchronous copy of 4 bytes global -> shared (through L1: .cg takes 16 bytes only).
__device__ __forceinline__ void cp_async_4(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(dst), "l"(src) : "memory");
}

// 8 bytes global -> shared without registers (cp.async.ca: .cg takes 16 bytes only). `fill`
// false writes 8 zero bytes and reads nothing (src-size 0); src must still be a valid address.
__device__ __forceinline__ void cp_async_8(u32 dst, const void* src, bool fill) {
    const int n = fill ? 8 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(n)
                 : "memory");
}

// Closes the group of this thread's cp.async issued since the last commit.
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// Waits until at most N of this thread's committed cp.async groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Four 8 x 8 b16 matrices from shared memory, transposed: lanes 8q .. 8q+7 give the addresses
// of the 8 rows (16 bytes each) of matrix q, and r[q] of lane (g, t) holds elements
// (row 2t, column g) and (row 2t+1, column g) of matrix q, low half first.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

// Four 8 x 8 b16 matrices from shared memory, as stored: lanes 8q .. 8q+7 give the addresses of
// the 8 rows (16 bytes each) of matrix q, and r[q] of lane (g, t) holds elements (row g,
// columns 2t, 2t+1) of matrix q, low half first.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], u32 addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
