// Probe kernels for the tensor-core primitives of mma.cuh: each runs one primitive on known data
// and stores every lane's result registers, so the CPU emulation (emu/mma_emu.h) can be compared
// with plain matrix products (tests/unit/test_mma_emu.py) and with the GPU itself, lane by lane
// (tests/ops/test_mma_probe_cuda.py). Built for the CPU by emu/mma_probe_emu.cpp and for the GPU
// by mma_probe_cuda.cpp (builders in ds_ttt/ops/flashbob/probe_builder.py). Not part of the op.
//
// One launch = one block of `nthreads` threads (a multiple of 32: each warp runs the probe on its
// own slice of the inputs, which checks that warps do not see each other's operands).
// Probes (ProbeOp), with w = warp, L = lane, t = w*32 + L:
//   kLdmatrix   src16 (n16 b16 values) is copied into shared memory; lane t passes the address
//               src16 + offsets[t] (elements) to ldmatrix_x{1,2,4}[_trans] (variant 0..5 =
//               x1, x2, x4, x1.trans, x2.trans, x4.trans); out_u[t*4 + i] = register i (0 if unused).
//   kMma        a = in_u[t*6 + 0..3], b = in_u[t*6 + 4..5], c = in_f[t*4 + 0..3];
//               out_f[t*4 + i] = d[i] of mma_m16n8k16_{bf16 (variant 0), f16 (1)};
//               variants 2 / 3: the same with d aliasing c.
//   kLdmatrixMma  warp w multiplies A_w (16x16, row-major, src16 + w*512, row stride 16) by B_w
//               (src16 + w*512 + 256): variant 0/1 = bf16/f16 with B stored N x K (8 rows of 16,
//               loaded by ldmatrix_x2), variant 2/3 = bf16/f16 with B stored K x N (16 rows of 8,
//               loaded by ldmatrix_x2_trans); A by ldmatrix_x4; C = 0. out_f[w*128 + r*8 + c] = D.
//   kCpAsync    three groups of 16-byte copies per thread from src16 (as bytes) into shared memory,
//               chunk j of group s at smem + 16*(s*nthreads + t): group 0 by cp_async_16, groups 1
//               and 2 by cp_async_16_zfill with valid = (chunk % 5 != 3); then snapshots of the
//               whole staging area into out_u (n = 3*nthreads*4 words per snapshot) after
//               wait<2>, wait<1>, wait<0> (each followed by __syncthreads), and one more after
//               a fourth group (group 0's chunks again, by cp_async_16) and cp_async_wait_all.
//               Variant 1: the same chunks and validity, each copied as three small copies
//               (bytes 0..7 by cp_async_8_zfill, 8..11 and 12..15 by cp_async_4_zfill; the fourth
//               group with valid = true), so the expected snapshots are those of variant 0.
//   kPack       out_u[t*2 + 0] = pack_bf16x2(in_f[t*2], in_f[t*2+1]), out_u[t*2 + 1] = pack_f16x2;
//               out_f[t*4 + 0..1] = unpack_bf16x2(out_u[t*2]), out_f[t*4 + 2..3] = unpack_f16x2.
//   Misuse (emulator tests only; undefined behaviour on a GPU, never launched there):
//   kBadDivergent  lanes 0..15 of each warp execute ldmatrix_x4, lanes 16..31 do not.
//   kBadMixed      even lanes execute ldmatrix_x1, odd lanes mma_m16n8k16_bf16.
//   kBadAddress    ldmatrix_x1 with lane 3 passing a global (not shared) address.
//   kBadAlign      ldmatrix_x1 with row addresses 2 bytes off 16-byte alignment.
//   kBadDeadlock   lanes 0..15 execute ldmatrix_x1 while lanes 16..31 wait in __syncthreads.
//   kReadEarly     one cp_async_16 per thread, then a read of its destination before any wait
//                  (out_u[t*4 + 0..3]; the emulator poisons the destination until the wait).
#ifndef FLASHBOB_CUDA_EMU
#include <cuda_runtime.h>
#define FB_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

#include <cstddef>
#include <cstdint>

#include "mma.cuh"
#include "mma_probe.h"

namespace mma_probe {

namespace {

__device__ __forceinline__ void copy_to_smem(uint16_t* s, const uint16_t* g, int n, int nthreads) {
  for (int i = threadIdx.x; i < n; i += nthreads) s[i] = g[i];
}

__device__ void probe_ldmatrix(const Args& a, uint16_t* s) {
  copy_to_smem(s, a.src16, a.n16, a.nthreads);
  __syncthreads();
  const int t = threadIdx.x;
  const uint16_t* p = s + a.offsets[t];
  uint32_t r[4] = {0, 0, 0, 0};
  switch (a.variant) {
    case 0: fbmma::ldmatrix_x1(r[0], p); break;
    case 1: fbmma::ldmatrix_x2(r[0], r[1], p); break;
    case 2: fbmma::ldmatrix_x4(r[0], r[1], r[2], r[3], p); break;
    case 3: fbmma::ldmatrix_x1_trans(r[0], p); break;
    case 4: fbmma::ldmatrix_x2_trans(r[0], r[1], p); break;
    default: fbmma::ldmatrix_x4_trans(r[0], r[1], r[2], r[3], p); break;
  }
  for (int i = 0; i < 4; ++i) a.out_u[t * 4 + i] = r[i];
}

__device__ void probe_mma(const Args& a) {
  const int t = threadIdx.x;
  uint32_t ra[4], rb[2];
  float c[4], d[4];
  for (int i = 0; i < 4; ++i) ra[i] = a.in_u[t * 6 + i];
  rb[0] = a.in_u[t * 6 + 4];
  rb[1] = a.in_u[t * 6 + 5];
  for (int i = 0; i < 4; ++i) c[i] = a.in_f[t * 4 + i];
  switch (a.variant) {
    case 0: fbmma::mma_m16n8k16_bf16(d, ra, rb, c); break;
    case 1: fbmma::mma_m16n8k16_f16(d, ra, rb, c); break;
    case 2: fbmma::mma_m16n8k16_bf16(c, ra, rb, c); break;
    default: fbmma::mma_m16n8k16_f16(c, ra, rb, c); break;
  }
  const float* res = a.variant >= 2 ? c : d;
  for (int i = 0; i < 4; ++i) a.out_f[t * 4 + i] = res[i];
}

// Addresses follow the ldmatrix rule only (lane L: row L % 8 of matrix L / 8), and the matrix
// order follows the mma operand order: a0..a3 = A rows 0-7/8-15 x cols 0-7, then cols 8-15.
__device__ void probe_ldmatrix_mma(const Args& a, uint16_t* s) {
  copy_to_smem(s, a.src16, a.n16, a.nthreads);
  __syncthreads();
  const int w = threadIdx.x / 32, L = threadIdx.x % 32, m = L / 8, r = L % 8;
  const uint16_t* A = s + w * 512;
  const uint16_t* B = A + 256;
  uint32_t ra[4], rb[2];
  fbmma::ldmatrix_x4(ra[0], ra[1], ra[2], ra[3], A + (8 * (m & 1) + r) * 16 + 8 * (m >> 1));
  if (a.variant < 2) {  // B^T (N x K, row stride 16): matrix m (m < 2) = columns 8m..8m+7 of B^T
    fbmma::ldmatrix_x2(rb[0], rb[1], B + r * 16 + 8 * (m & 1));
  } else {  // B (K x N, row stride 8): matrix m = rows 8m..8m+7
    fbmma::ldmatrix_x2_trans(rb[0], rb[1], B + (8 * (m & 1) + r) * 8);
  }
  float c[4] = {0.f, 0.f, 0.f, 0.f}, d[4];
  if (a.variant % 2 == 0)
    fbmma::mma_m16n8k16_bf16(d, ra, rb, c);
  else
    fbmma::mma_m16n8k16_f16(d, ra, rb, c);
  const int g = L >> 2, tig = L % 4;
  for (int i = 0; i < 4; ++i)  // accumulator layout: row g (+8 for i >= 2), col 2*tig + (i & 1)
    a.out_f[w * 128 + (g + (i < 2 ? 0 : 8)) * 8 + 2 * tig + (i & 1)] = d[i];
}

__device__ void snapshot(const Args& a, const unsigned char* s, int k) {
  __syncthreads();
  const int words = 3 * a.nthreads * 4;
  for (int i = threadIdx.x; i < words; i += a.nthreads) {
    uint32_t v;
    const unsigned char* p = s + 4 * i;
    v = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
    a.out_u[k * words + i] = v;
  }
  __syncthreads();
}

// One 16-byte chunk as an 8-byte and two 4-byte cp.async.ca copies (variant 1).
__device__ void cp_async_small(unsigned char* s, const unsigned char* g, bool valid) {
  fbmma::cp_async_8_zfill(s, g, valid);
  fbmma::cp_async_4_zfill(s + 8, g + 8, valid);
  fbmma::cp_async_4_zfill(s + 12, g + 12, valid);
}

__device__ void probe_cp_async(const Args& a, unsigned char* s) {
  const int t = threadIdx.x, n = a.nthreads;
  const unsigned char* g = reinterpret_cast<const unsigned char*>(a.src16);
  const bool small = a.variant == 1;
  for (int grp = 0; grp < 3; ++grp) {
    const int chunk = grp * n + t;
    const bool valid = grp == 0 || chunk % 5 != 3;
    if (small)
      cp_async_small(s + 16 * chunk, g + 16 * chunk, valid);
    else if (grp == 0)
      fbmma::cp_async_16(s + 16 * chunk, g + 16 * chunk);
    else
      fbmma::cp_async_16_zfill(s + 16 * chunk, g + 16 * chunk, valid);
    fbmma::cp_async_commit();
  }
  fbmma::cp_async_wait<2>();
  snapshot(a, s, 0);
  fbmma::cp_async_wait<1>();
  snapshot(a, s, 1);
  fbmma::cp_async_wait<0>();
  snapshot(a, s, 2);
  if (small)  // group 2's source into group 0's slot
    cp_async_small(s + 16 * t, g + 16 * (2 * n + t), true);
  else
    fbmma::cp_async_16(s + 16 * t, g + 16 * (2 * n + t));
  fbmma::cp_async_wait_all();
  snapshot(a, s, 3);
}

__device__ void probe_pack(const Args& a) {
  const int t = threadIdx.x;
  const float lo = a.in_f[t * 2], hi = a.in_f[t * 2 + 1];
  const uint32_t pb = fbmma::pack_bf16x2(lo, hi), ph = fbmma::pack_f16x2(lo, hi);
  a.out_u[t * 2] = pb;
  a.out_u[t * 2 + 1] = ph;
  fbmma::unpack_bf16x2(pb, a.out_f[t * 4], a.out_f[t * 4 + 1]);
  fbmma::unpack_f16x2(ph, a.out_f[t * 4 + 2], a.out_f[t * 4 + 3]);
}

__device__ void probe_misuse(const Args& a, unsigned char* s) {
  const int L = threadIdx.x % 32;
  uint32_t r[4] = {0, 0, 0, 0};
  const uint16_t* s16 = reinterpret_cast<const uint16_t*>(s);
  if (a.op == kBadDivergent) {
    if (L < 16) fbmma::ldmatrix_x4(r[0], r[1], r[2], r[3], s16 + 8 * L);
  } else if (a.op == kBadMixed) {
    if (L % 2 == 0) {
      fbmma::ldmatrix_x1(r[0], s16 + 8 * (L % 8));
    } else {
      const uint32_t ra[4] = {0, 0, 0, 0}, rb[2] = {0, 0};
      const float c[4] = {0, 0, 0, 0};
      float d[4];
      fbmma::mma_m16n8k16_bf16(d, ra, rb, c);
    }
  } else if (a.op == kBadAddress) {
    fbmma::ldmatrix_x1(r[0], L == 3 ? static_cast<const void*>(a.src16) : s16 + 8 * (L % 8));
  } else if (a.op == kBadAlign) {
    fbmma::ldmatrix_x1(r[0], s16 + 8 * (L % 8) + 1);
  } else if (a.op == kBadDeadlock) {
    if (L < 16)
      fbmma::ldmatrix_x1(r[0], s16 + 8 * (L % 8));
    else
      __syncthreads();
  } else if (a.op == kReadEarly) {
    const int t = threadIdx.x;
    fbmma::cp_async_16(s + 16 * t, reinterpret_cast<const unsigned char*>(a.src16) + 16 * t);
    fbmma::cp_async_commit();
    const uint32_t* mine = reinterpret_cast<const uint32_t*>(s + 16 * t);
    for (int i = 0; i < 4; ++i) a.out_u[t * 4 + i] = mine[i];
    fbmma::cp_async_wait<0>();
  }
  a.out_u[threadIdx.x * 4] ^= r[0];
}

__global__ void probe_kernel(Args a) {
  FB_DYNAMIC_SMEM(smem);
  uint16_t* s16 = reinterpret_cast<uint16_t*>(smem);
  switch (a.op) {
    case kLdmatrix: probe_ldmatrix(a, s16); break;
    case kMma: probe_mma(a); break;
    case kLdmatrixMma: probe_ldmatrix_mma(a, s16); break;
    case kCpAsync: probe_cp_async(a, smem); break;
    case kPack: probe_pack(a); break;
    default: probe_misuse(a, smem); break;
  }
}

}  // namespace

size_t probe_smem_bytes(const Args& a) {
  if (a.op == kCpAsync || a.op == kReadEarly) return (size_t)3 * a.nthreads * 16;
  const size_t n = (size_t)a.n16 * 2;
  return ((n + 15) / 16) * 16 < 1024 ? 1024 : ((n + 15) / 16) * 16;
}

cudaError_t launch(const Args& a) {
  const size_t smem = probe_smem_bytes(a);
#ifdef FLASHBOB_CUDA_EMU
  fb_emu::run_grid(dim3(1), a.nthreads, smem, [&] { probe_kernel(a); });
  return cudaSuccess;
#else
  probe_kernel<<<1, a.nthreads, smem>>>(a);
  return cudaGetLastError();
#endif
}

}  // namespace mma_probe
