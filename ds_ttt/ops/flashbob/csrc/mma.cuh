// Tensor-core primitives for the FlashBoB CUDA kernels (sm_80+): ldmatrix, mma.sync m16n8k16,
// cp.async, bf16x2/f16x2 packing. Namespace fbmma, every function __device__ __forceinline__.
//
// On the GPU each function is one inline-PTX instruction (PTX ISA, "Warp Level Matrix Multiply-
// Accumulate Instructions": ldmatrix, mma; "Data Movement and Conversion Instructions": cp.async).
// Under FLASHBOB_CUDA_EMU (csrc/emu/cuda_emu.h, tests on the CPU) the same names come from
// emu/mma_emu.h, which executes them with the PTX ISA's fragment layouts. Both sides are checked
// against each other, per lane, by tests/ops/test_mma_probe_cuda.py (csrc/mma_probe.cu); the
// emulator alone against plain matrix products by tests/unit/test_mma_emu.py.
//
// Interface (keep it; additions are marked "added" and never rename an entry):
//   ldmatrix_x{1,2,4}[_trans](r0[, r1[, r2, r3]], smem_row)
//       ldmatrix.sync.aligned.m8n8.x{1,2,4}{,.trans}.shared.b16. Lane L passes the shared-memory
//       address (16-byte aligned) of row (L % 8) of matrix (L / 8); lanes beyond the matrix count
//       pass any valid shared address. One 32-bit register per matrix; without .trans lane L
//       holds elements (row L/4, cols 2(L%4), 2(L%4)+1) of each 8x8 matrix, low half first;
//       with .trans it holds (rows 2(L%4), 2(L%4)+1, col L/4) of the stored matrix.
//   mma_m16n8k16_bf16(d, a, b, c) / mma_m16n8k16_f16(d, a, b, c)
//       mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32, d = a*b + c, with
//       g = L/4, t = L%4:  a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..],
//       a[3] = A[g+8][2t+8..];  b[0] = B[2t..2t+1][g], b[1] = B[2t+8..2t+9][g];
//       c/d[0..1] = C[g][2t..2t+1], c/d[2..3] = C[g+8][2t..2t+1]. d may alias c.
//   cp_async_16(smem, gmem)                cp.async.cg.shared.global [smem], [gmem], 16
//   cp_async_16_zfill(smem, gmem, valid)   same with src-size = valid ? 16 : 0 (zero fill);
//                                          gmem must still be a valid address when !valid
//   cp_async_4_zfill(smem, gmem, valid)    added: cp.async.ca.shared.global [smem], [gmem], 4, src-size
//   cp_async_8_zfill(smem, gmem, valid)    added: the same with 8 bytes (.ca: .cg copies 16 only);
//                                          both addresses aligned to the copy's size
//   cp_async_commit()                      cp.async.commit_group
//   cp_async_wait<N>()                     cp.async.wait_group N (all but the N newest groups done)
//   cp_async_wait_all()                    added: cp.async.wait_all (commit + wait_group 0)
//   pack_bf16x2(lo, hi) / pack_f16x2(lo, hi)    round-to-nearest-even, lo in bits 0..15
//   unpack_bf16x2(r, lo, hi) / unpack_f16x2(r, lo, hi)   added: the inverse (exact)
// Both 16-byte cp.async addresses must be 16-byte aligned; the data is visible to the issuing
// thread after the wait and to the other threads only after a __syncthreads that follows it.
#pragma once

#include <cstdint>

#ifdef FLASHBOB_CUDA_EMU
#include "emu/mma_emu.h"
#else

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 800
#error "mma.cuh needs sm_80 or later (bf16 mma.sync m16n8k16, cp.async)"
#endif

namespace fbmma {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- ldmatrix ---------------------------------------------------------------------------------
__device__ __forceinline__ void ldmatrix_x1(uint32_t& r0, const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n"
               : "=r"(r0) : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t& r0, uint32_t& r1, const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r0), "=r"(r1) : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                                            const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x1_trans(uint32_t& r0, const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
               : "=r"(r0) : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t& r0, uint32_t& r1,
                                                  const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r0), "=r"(r1) : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                  uint32_t& r3, const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3) : "r"(smem_addr(smem_row)));
}

// ---- mma.sync m16n8k16, fp32 accumulate -------------------------------------------------------
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4],
                                                  const uint32_t (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}
__device__ __forceinline__ void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4],
                                                 const uint32_t (&b)[2], const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%10, %11, %12, %13};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
        "f"(c[2]), "f"(c[3]));
}

// ---- cp.async (global -> shared, 16 bytes, bypassing L1) -------------------------------------
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem)
               : "memory");
}
__device__ __forceinline__ void cp_async_16_zfill(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}
// 4- and 8-byte copies (the per-row fp32 scalars of the column passes), through L1 (.ca: the only
// variant with sizes below 16), zero-filled when !valid.
__device__ __forceinline__ void cp_async_4_zfill(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 4 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_8_zfill(void* smem, const void* gmem, bool valid) {
  const int src_bytes = valid ? 8 : 0;
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(smem_addr(smem)),
               "l"(gmem), "r"(src_bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  static_assert(N >= 0, "cp.async.wait_group N needs N >= 0");
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}

// ---- packing ----------------------------------------------------------------------------------
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);  // .x = lo sits in the low 16 bits
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 v = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ void unpack_bf16x2(uint32_t r, float& lo, float& hi) {
  const __nv_bfloat162 v = *reinterpret_cast<const __nv_bfloat162*>(&r);
  lo = __low2float(v);
  hi = __high2float(v);
}
__device__ __forceinline__ void unpack_f16x2(uint32_t r, float& lo, float& hi) {
  const __half2 v = *reinterpret_cast<const __half2*>(&r);
  lo = __low2float(v);
  hi = __high2float(v);
}

}  // namespace fbmma

#endif  // FLASHBOB_CUDA_EMU
