// Warp-level tensor-core tile primitives shared by the FlashBoB CUDA kernels
// (flashbob_cuda_kernel.cu includes this file; it is not compiled on its own).
//
// Every GEMM is mma.sync m16n8k16 with fp32 accumulation (csrc/mma.cuh, namespace fbmma; under
// FLASHBOB_CUDA_EMU the same calls run on the CPU emulator). Notation, with lane L of a warp,
// g = L / 4 and t = L % 4 (the PTX ISA's groupID / threadID_in_group):
//   - a score tile float s[MT][NB][4] is a (16·MT) x (8·NB) fp32 accumulator of one warp;
//     s[mt][nb][e] holds row 16·mt + g + 8·(e / 2), column 8·nb + 2t + (e % 2);
//   - an output tile float o[MT][D/8][4] is the same layout over D columns;
//   - an A-fragment tile uint32_t p[MT][NB/2][4] is the same scores rounded to bf16/fp16 pairs
//     in the layout of mma's A operand (16 x 16 per [mt][kk]); to_afrag converts in registers:
//     the accumulator of columns 16kk..16kk+15 is exactly the A operand of that k-step.
// Shared-memory tiles are row-major with row stride D + 8 elements (16-byte rows for cp.async and
// ldmatrix; the 8-element pad shifts consecutive rows by 4 banks, so ldmatrix is conflict-free).
#pragma once

#include <cstdint>
#include <cstring>

#include "mma.cuh"

namespace flashbob {
namespace {

constexpr float kLog2e = 1.4426950408889634f;

// Tile shape of one kernel: BM rows owned by the block (queries in row passes, keys in column
// passes), BN rows of the streamed operand per pipeline stage, NW warps; ARCH the lowest
// __CUDA_ARCH__ its device code is compiled for (tile sets in flashbob_cuda_kernel.cu). Warp w
// owns rows [16·MT·w, 16·MT·(w+1)).
template <int BM_, int BN_, int NW_, int ARCH_ = 800>
struct Tiles {
  static constexpr int BM = BM_, BN = BN_, NW = NW_, NT = 32 * NW_, MT = BM_ / (16 * NW_);
  static constexpr int NB = BN_ / 8, ARCH = ARCH_;
  static_assert(BM_ % (16 * NW_) == 0, "BM must be a multiple of 16 x warps");
  static_assert(BN_ % 16 == 0, "BN must be a multiple of 16");
};

// Whether this compilation pass builds the device code of shape TL: every host pass (and the CPU
// emulator), and device passes for __CUDA_ARCH__ >= TL::ARCH. Below that a kernel is the stub
// not_compiled_here(), which the launchers never start (they pick shapes by device).
template <class TL>
__host__ __device__ constexpr bool compiled_here() {
#ifdef __CUDA_ARCH__
  return __CUDA_ARCH__ >= TL::ARCH;
#else
  return true;
#endif
}
__device__ __forceinline__ void not_compiled_here() {
#ifdef __CUDA_ARCH__
  __trap();
#endif
}

template <int D>
struct Smem {
  static constexpr int LDS = D + 8;  // row stride (elements) of every shared bf16/fp16 tile
  template <typename T>
  static constexpr size_t tile_bytes(int rows) { return (size_t)rows * LDS * sizeof(T); }
};

__host__ __device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__host__ __device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

// The mma / pack pair of one storage type.
template <typename T>
struct TC;
template <>
struct TC<__nv_bfloat16> {
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    fbmma::mma_m16n8k16_bf16(d, a, b, d);
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    return fbmma::pack_bf16x2(lo, hi);
  }
};
template <>
struct TC<__half> {
  static __device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
    fbmma::mma_m16n8k16_f16(d, a, b, d);
  }
  static __device__ __forceinline__ uint32_t pack(float lo, float hi) {
    return fbmma::pack_f16x2(lo, hi);
  }
};

// Two adjacent elements (p 4-byte aligned) from two floats, rounded to nearest even.
template <typename T>
__device__ __forceinline__ void store2(T* p, float lo, float hi) {
  const uint32_t w = TC<T>::pack(lo, hi);
#ifdef FLASHBOB_CUDA_EMU
  std::memcpy(p, &w, 4);
#else
  *reinterpret_cast<uint32_t*>(p) = w;
#endif
}

__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
  return v;
}

template <int A, int B>
__device__ __forceinline__ void zero(float (&x)[A][B][4]) {
#pragma unroll
  for (int i = 0; i < A; ++i)
#pragma unroll
    for (int j = 0; j < B; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) x[i][j][e] = 0.f;
}

// Rows of one (batch, kv head) group in packed order: packed row m is position m / G of query head
// hk·G + m % G (GQA head packing: the G heads that share a K/V head are one row space of G·Nq
// rows, so one block's K/V tiles serve all of them; G = 1 is plain multi-head attention).
//
// G is a runtime value, and a 64-bit `/` or `%` by it is a ~70-instruction software routine on the
// GPU, paid per streamed row and per masked score element. So the division by the block-invariant
// G is strength-reduced to one 32-bit multiply-high and a shift (Granlund & Montgomery 1994, as in
// CUTLASS's FastDivmod): with p = 31 + ceil(log2 G), mul = ceil(2^p / G), m / G = umulhi(m, mul)
// >> (p - 32), exact for every m < 2^31 (the binding requires G·Nq < 2^31); G = 1 is the identity.
struct Packed {
  int64_t head0, Nq;  // head0 = b·Hq + hk·G
  uint32_t G, mul, shift;
  __device__ __forceinline__ static Packed make(int64_t head0, int64_t G, int64_t Nq) {
    uint32_t lg = 0;
    while ((1ull << lg) < (uint64_t)G) ++lg;  // ceil(log2 G)
    const uint32_t mul = G == 1 ? 0u : (uint32_t)(((1ull << (31 + lg)) + G - 1) / G);
    return Packed{head0, Nq, (uint32_t)G, mul, G == 1 ? 0u : lg - 1};
  }
  __device__ __forceinline__ uint32_t pos(int64_t m) const {
    return G == 1 ? (uint32_t)m : __umulhi((uint32_t)m, mul) >> shift;
  }
  __device__ __forceinline__ int64_t row(int64_t m) const {
    const uint32_t p = pos(m), h = (uint32_t)m - p * G;
    return (head0 + h) * Nq + p;
  }
};

// cp.async `ROWS` rows of D elements into a shared tile; rows >= nvalid are zero-filled.
// Contiguous rows starting at `g`:
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void load_rows_async(T* s, const T* g, int nvalid) {
  constexpr int CH = D / 8, L = Smem<D>::LDS;
  for (int i = threadIdx.x; i < ROWS * CH; i += NT) {
    const int r = i / CH, c = (i % CH) * 8;
    const bool ok = r < nvalid;
    fbmma::cp_async_16_zfill(s + r * L + c, g + (ok ? (int64_t)r * D + c : 0), ok);
  }
}
// Packed rows m0 .. m0 + ROWS - 1 of tensor `g` [B, Hq, Nq, D]:
template <typename T, int D, int ROWS, int NT>
__device__ __forceinline__ void load_packed_async(T* s, const T* g, const Packed& pk, int64_t m0,
                                                  int nvalid) {
  constexpr int CH = D / 8, L = Smem<D>::LDS;
  for (int i = threadIdx.x; i < ROWS * CH; i += NT) {
    const int r = i / CH, c = (i % CH) * 8;
    const bool ok = r < nvalid;
    fbmma::cp_async_16_zfill(s + r * L + c, g + (ok ? pk.row(m0 + r) * D + c : 0), ok);
  }
}

// s[mt][nb] += A[rows of this warp] · B[8nb .. 8nb+7]ᵀ over k = 0..D-1.
// A: shared tile pointer at this warp's first row; B: shared tile of 8·NB rows (both stride LDS).
template <typename T, int D, int MT, int NB>
__device__ __forceinline__ void gemm_abt(float (&s)[MT][NB][4], const T* A, const T* B, int lane) {
  static_assert(NB % 2 == 0, "score tiles have an even number of 8-column blocks");
  constexpr int L = Smem<D>::LDS;
  const int a_row = (lane % 8) + 8 * ((lane / 8) % 2), a_col = 8 * (lane / 16);
  const int b_row = (lane % 8) + 8 * (lane / 16), b_col = 8 * ((lane / 8) % 2);
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 16) {
    uint32_t a[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      fbmma::ldmatrix_x4(a[mt][0], a[mt][1], a[mt][2], a[mt][3],
                         A + (mt * 16 + a_row) * L + k0 + a_col);
#pragma unroll
    for (int nb = 0; nb < NB; nb += 2) {
      uint32_t b0[2], b1[2];
      fbmma::ldmatrix_x4(b0[0], b0[1], b1[0], b1[1], B + (nb * 8 + b_row) * L + k0 + b_col);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        TC<T>::mma(s[mt][nb], a[mt], b0);
        TC<T>::mma(s[mt][nb + 1], a[mt], b1);
      }
    }
  }
}

// o[mt][db] += P[mt] · B over k = 0..16·KK-1, P as A fragments (registers), B a shared tile of
// 16·KK rows (the k dimension) x D columns, read transposed by ldmatrix.trans.
template <typename T, int D, int MT, int KK>
__device__ __forceinline__ void gemm_ab(float (&o)[MT][D / 8][4], const uint32_t (&p)[MT][KK][4],
                                        const T* B, int lane) {
  constexpr int L = Smem<D>::LDS;
  const int b_row = (lane % 8) + 8 * ((lane / 8) % 2), b_col = 8 * (lane / 16);
#pragma unroll
  for (int kk = 0; kk < KK; ++kk) {
#pragma unroll
    for (int db = 0; db < D / 8; db += 2) {
      uint32_t b0[2], b1[2];
      fbmma::ldmatrix_x4_trans(b0[0], b0[1], b1[0], b1[1],
                               B + (kk * 16 + b_row) * L + db * 8 + b_col);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        TC<T>::mma(o[mt][db], p[mt][kk], b0);
        TC<T>::mma(o[mt][db + 1], p[mt][kk], b1);
      }
    }
  }
}

// The A fragment (rounded to T) of one 16-column block of a score tile: its two 8-column
// accumulators lo (columns 0..7) and hi (8..15), in registers.
template <typename T>
__device__ __forceinline__ void pack_afrag(uint32_t (&p)[4], const float (&lo)[4],
                                           const float (&hi)[4]) {
  p[0] = TC<T>::pack(lo[0], lo[1]);
  p[1] = TC<T>::pack(lo[2], lo[3]);
  p[2] = TC<T>::pack(hi[0], hi[1]);
  p[3] = TC<T>::pack(hi[2], hi[3]);
}

// A fragments (rounded to T) of a whole score tile.
template <typename T, int MT, int NB>
__device__ __forceinline__ void to_afrag(uint32_t (&p)[MT][NB / 2][4],
                                         const float (&s)[MT][NB][4]) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int kk = 0; kk < NB / 2; ++kk) pack_afrag<T>(p[mt][kk], s[mt][2 * kk], s[mt][2 * kk + 1]);
}

// P from a raw score, the saved row stats (m2 = max of scale2·s, il = 1 / row sum) and the mask.
__device__ __forceinline__ float prob(float s, float scale2, float m2, float il, bool ok) {
  return (ok && il > 0.f) ? exp2f(s * scale2 - m2) * il : 0.f;
}

}  // namespace
}  // namespace flashbob
