// FlashBoB CUDA kernels: forward, first backward and the two-pass backward-over-backward.
//
// Same math, notation and schedule as the CPU kernel (flashbob_cpu.cpp, flashbob_math.md):
//   fwd_kernel      row pass   (batch, q head, 64-row block)   -> O, stats (m2, 1/l)
//   bwd_row_kernel  row pass                                   -> dQ, D
//   bwd_col_kernel  column pass (batch, kv head, 64-col block) -> dK, dV  (GQA: G·Nq rows)
//   bob_row_kernel  row pass                                   -> Q̄, dŌ, D, α, E°
//   bob_col_kernel  column pass                                -> K̄, V̄
// bf16/fp16 storage, fp32 everywhere else (scores, derived tiles, accumulators, row scalars).
// 256 threads per block; thread (ty, tx) = (tid / 16, tid % 16) owns score rows ty + 16a and
// columns tx + 16b (a, b < 4) of a 64 x 64 tile, and output rows ty + 16a, columns tx + 16e
// (e < D/16). The 16 threads sharing a row sit in one half-warp: row reductions are shuffles.
// Derived tiles (P, P∘F, P∘P̄°, dS, S̄, P∘h) go through shared memory in fp32. Q̄ uses the
// no-reuse form τ(Ω − α∘R − E°∘B) with R = dS·K in fp32 (the saved dQ is only bf16).
// CUDA cores only (no tensor cores yet): correct first, fast later (see docs/flashbob.md).
//
// The same source also compiles as plain C++ under FLASHBOB_CUDA_EMU (csrc/emu/cuda_emu.h: one
// host thread per CUDA thread, std::barrier for __syncthreads), so the kernels' logic is tested
// on CPU by tests/unit/test_flashbob_cuda_emu.py before any GPU session.
#ifdef FLASHBOB_FORCE_COMPILE_ERROR
#error "FLASHBOB_FORCE_COMPILE_ERROR: deliberate failure to test .ci/cuda_build_check.sh"
#endif
#ifndef FLASHBOB_CUDA_EMU
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define FB_DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#define FB_LAUNCH(kernel, grid, smem, stream, ...) kernel<<<grid, NT, smem, stream>>>(__VA_ARGS__)
#endif

#include <cmath>
#include <cstdint>

#include "flashbob_cuda.h"

namespace flashbob {
namespace {

constexpr int BM = 64, BN = 64, NT = 256;
constexpr int SP = BN + 4;  // fp32 score-tile row stride
constexpr float kLog2e = 1.4426950408889634f;

template <int D>
struct Cfg {
  static constexpr int LDS = D + 8;  // storage-tile row stride (elements): fewer bank conflicts
  static constexpr int E = D / 16;   // output columns per thread
};

__host__ __device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }

__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }
template <typename T>
__device__ __forceinline__ T from_f(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <>
__device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

__device__ __forceinline__ float sum16(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float max16(float v) {
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// rows x D tile from global (row stride D) into shared (row stride LDS); zero rows >= nvalid.
template <typename T, int D>
__device__ __forceinline__ void load_tile(T* s, const T* g, int nvalid) {
  for (int idx = threadIdx.x; idx < BM * D; idx += NT) {
    const int r = idx / D, d = idx % D;
    s[r * Cfg<D>::LDS + d] = r < nvalid ? g[(int64_t)r * D + d] : from_f<T>(0.f);
  }
}

// acc[a][b] += Σ_d A[ty+16a][d] · B[tx+16b][d]   (score micro-tile: A rows, B rows as columns)
template <typename T, int D>
__device__ __forceinline__ void mt_dot(float (&acc)[4][4], const T* A, const T* Bt, int ty, int tx) {
  constexpr int L = Cfg<D>::LDS;
#pragma unroll 4
  for (int d = 0; d < D; ++d) {
    float a[4], b[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      a[i] = to_f(A[(ty + 16 * i) * L + d]);
      b[i] = to_f(Bt[(tx + 16 * i) * L + d]);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
  }
}

// acc[a][e] += Σ_j X[ty+16a][j] · Y[j][tx+16e]   (row-pass output: X fp32 score tile)
template <typename T, int D>
__device__ __forceinline__ void mt_rows(float (&acc)[4][D / 16], const float* X, const T* Y, int ty,
                                        int tx) {
  constexpr int L = Cfg<D>::LDS, E = Cfg<D>::E;
#pragma unroll 2
  for (int j = 0; j < BN; ++j) {
    float x[4], y[E];
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = X[(ty + 16 * i) * SP + j];
#pragma unroll
    for (int e = 0; e < E; ++e) y[e] = to_f(Y[j * L + tx + 16 * e]);
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int e = 0; e < E; ++e) acc[i][e] = fmaf(x[i], y[e], acc[i][e]);
  }
}

// acc[a][e] += Σ_i X[i][ty+16a] · Y[i][tx+16e]   (column-pass output: Xᵀ·Y)
template <typename T, int D>
__device__ __forceinline__ void mt_cols(float (&acc)[4][D / 16], const float* X, const T* Y, int ty,
                                        int tx) {
  constexpr int L = Cfg<D>::LDS, E = Cfg<D>::E;
#pragma unroll 2
  for (int i = 0; i < BM; ++i) {
    float x[4], y[E];
#pragma unroll
    for (int a = 0; a < 4; ++a) x[a] = X[i * SP + ty + 16 * a];
#pragma unroll
    for (int e = 0; e < E; ++e) y[e] = to_f(Y[i * L + tx + 16 * e]);
#pragma unroll
    for (int a = 0; a < 4; ++a)
#pragma unroll
      for (int e = 0; e < E; ++e) acc[a][e] = fmaf(x[a], y[e], acc[a][e]);
  }
}

template <int R, int C>
__device__ __forceinline__ void zero_acc(float (&a)[R][C]) {
#pragma unroll
  for (int i = 0; i < R; ++i)
#pragma unroll
    for (int j = 0; j < C; ++j) a[i][j] = 0.f;
}

// P for a score micro-tile: exp2(s·scale2 − m2)·inv_l where visible, else 0.
__device__ __forceinline__ float prob(float s, float scale2, float m2, float il, bool ok) {
  return (ok && il > 0.f) ? exp2f(s * scale2 - m2) * il : 0.f;
}

// ------------------------------------------------------------------------------- forward
template <typename T, int D>
__global__ void __launch_bounds__(NT) fwd_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                 const T* __restrict__ v, T* __restrict__ o,
                                                 float* __restrict__ stats, Geo g) {
  constexpr int L = Cfg<D>::LDS, E = Cfg<D>::E;
  FB_DYNAMIC_SMEM(smem);
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = Qs + BM * L;
  T* Vs = Ks + BN * L;
  float* Ps = reinterpret_cast<float*>(Vs + BN * L);
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int64_t rb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y;
  const int64_t b = bh / g.Hq, h = bh % g.Hq, hk = h / g.G, r0 = rb * BM;
  const int bm = (int)imin(BM, g.Nq - r0);
  const int64_t row_base = (b * g.Hq + h) * g.Nq + r0;
  const T* K = k + (b * g.Hkv + hk) * g.Nk * D;
  const T* V = v + (b * g.Hkv + hk) * g.Nk * D;
  const float scale2 = g.scale * kLog2e;
  load_tile<T, D>(Qs, q + row_base * D, bm);
  float m[4], l[4], acc[4][E];
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    m[a] = -INFINITY;
    l[a] = 0.f;
  }
  zero_acc(acc);
  int64_t lo, hi;
  g.col_range(r0, r0 + bm, lo, hi);
  for (int64_t c0 = (lo / BN) * BN; c0 < hi; c0 += BN) {
    const int bn = (int)imin(BN, g.Nk - c0);
    const int cls = g.classify(r0, r0 + bm, c0, c0 + bn);
    if (cls == 0) continue;  // uniform across the block
    __syncthreads();
    load_tile<T, D>(Ks, K + c0 * D, bn);
    load_tile<T, D>(Vs, V + c0 * D, bn);
    __syncthreads();
    float s[4][4];
    zero_acc(s);
    mt_dot<T, D>(s, Qs, Ks, ty, tx);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int r = ty + 16 * a;
      float x[4], mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = tx + 16 * j;
        const bool ok = r < bm && c < bn && (cls == 2 || g.visible(r0 + r, c0 + c));
        x[j] = ok ? s[a][j] * scale2 : -INFINITY;
        mx = fmaxf(mx, x[j]);
      }
      mx = max16(mx);
      const float mnew = fmaxf(m[a], mx);
      float corr = 1.f, sum = 0.f;
      if (mnew == -INFINITY) {
#pragma unroll
        for (int j = 0; j < 4; ++j) x[j] = 0.f;
      } else {
        corr = exp2f(m[a] - mnew);  // 0 when m = -inf
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          x[j] = exp2f(x[j] - mnew);
          sum += x[j];
        }
      }
      sum = sum16(sum);
      l[a] = l[a] * corr + sum;
      m[a] = mnew;
#pragma unroll
      for (int e = 0; e < E; ++e) acc[a][e] *= corr;
#pragma unroll
      for (int j = 0; j < 4; ++j) Ps[r * SP + tx + 16 * j] = x[j];
    }
    __syncthreads();
    mt_rows<T, D>(acc, Ps, Vs, ty, tx);
  }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int r = ty + 16 * a;
    if (r >= bm) continue;
    const float inv = l[a] > 0.f ? 1.f / l[a] : 0.f;
#pragma unroll
    for (int e = 0; e < E; ++e) o[(row_base + r) * D + tx + 16 * e] = from_f<T>(acc[a][e] * inv);
    if (tx == 0) {
      stats[(row_base + r) * 2] = l[a] > 0.f ? m[a] : INFINITY;
      stats[(row_base + r) * 2 + 1] = inv;
    }
  }
}

// Row scalars of a row block into shared memory: m2, 1/l and D = <dO, O> (0 beyond bm).
template <typename T, int D>
__device__ __forceinline__ void load_row_scalars(float* M2, float* IL, float* Dl, const float* stats,
                                                 const T* O, const T* dO, int64_t row_base,
                                                 int bm, float* delta_out) {
  for (int r = threadIdx.x; r < BM; r += NT) {
    float m2 = INFINITY, il = 0.f, dd = 0.f;
    if (r < bm) {
      m2 = stats[(row_base + r) * 2];
      il = stats[(row_base + r) * 2 + 1];
      const T* orow = O + (row_base + r) * D;
      const T* drow = dO + (row_base + r) * D;
      for (int d = 0; d < D; ++d) dd = fmaf(to_f(drow[d]), to_f(orow[d]), dd);
      if (delta_out) delta_out[row_base + r] = dd;
    }
    M2[r] = m2;
    IL[r] = il;
    Dl[r] = dd;
  }
}

// ------------------------------------------------------------------------------- first backward
template <typename T, int D>
__global__ void __launch_bounds__(NT) bwd_row_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                     const T* __restrict__ v, const T* __restrict__ o,
                                                     const float* __restrict__ stats,
                                                     const T* __restrict__ dout, T* __restrict__ dq,
                                                     float* __restrict__ delta, Geo g) {
  constexpr int L = Cfg<D>::LDS, E = Cfg<D>::E;
  FB_DYNAMIC_SMEM(smem);
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + BM * L;
  T* Ks = dOs + BM * L;
  T* Vs = Ks + BN * L;
  float* dSs = reinterpret_cast<float*>(Vs + BN * L);
  float* M2 = dSs + BM * SP;
  float* IL = M2 + BM;
  float* Dl = IL + BM;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int64_t rb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y;
  const int64_t b = bh / g.Hq, h = bh % g.Hq, hk = h / g.G, r0 = rb * BM;
  const int bm = (int)imin(BM, g.Nq - r0);
  const int64_t row_base = (b * g.Hq + h) * g.Nq + r0;
  const T* K = k + (b * g.Hkv + hk) * g.Nk * D;
  const T* V = v + (b * g.Hkv + hk) * g.Nk * D;
  const float scale2 = g.scale * kLog2e;
  load_tile<T, D>(Qs, q + row_base * D, bm);
  load_tile<T, D>(dOs, dout + row_base * D, bm);
  load_row_scalars<T, D>(M2, IL, Dl, stats, o, dout, row_base, bm, delta);
  float acc[4][E];
  zero_acc(acc);
  int64_t lo, hi;
  g.col_range(r0, r0 + bm, lo, hi);
  for (int64_t c0 = (lo / BN) * BN; c0 < hi; c0 += BN) {
    const int bn = (int)imin(BN, g.Nk - c0);
    const int cls = g.classify(r0, r0 + bm, c0, c0 + bn);
    if (cls == 0) continue;
    __syncthreads();
    load_tile<T, D>(Ks, K + c0 * D, bn);
    load_tile<T, D>(Vs, V + c0 * D, bn);
    __syncthreads();
    float s[4][4], dp[4][4];
    zero_acc(s);
    zero_acc(dp);
    mt_dot<T, D>(s, Qs, Ks, ty, tx);
    mt_dot<T, D>(dp, dOs, Vs, ty, tx);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int r = ty + 16 * a;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = tx + 16 * j;
        const bool ok = r < bm && c < bn && (cls == 2 || g.visible(r0 + r, c0 + c));
        const float p = prob(s[a][j], scale2, M2[r], IL[r], ok);
        dSs[r * SP + c] = p * (dp[a][j] - Dl[r]);
      }
    }
    __syncthreads();
    mt_rows<T, D>(acc, dSs, Ks, ty, tx);
  }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int r = ty + 16 * a;
    if (r >= bm) continue;
#pragma unroll
    for (int e = 0; e < E; ++e)
      dq[(row_base + r) * D + tx + 16 * e] = from_f<T>(acc[a][e] * g.scale);
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(NT) bwd_col_kernel(const T* __restrict__ q, const T* __restrict__ k,
                                                     const T* __restrict__ v,
                                                     const float* __restrict__ stats,
                                                     const T* __restrict__ dout,
                                                     const float* __restrict__ delta,
                                                     T* __restrict__ dk, T* __restrict__ dv, Geo g) {
  constexpr int L = Cfg<D>::LDS, E = Cfg<D>::E;
  FB_DYNAMIC_SMEM(smem);
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + BN * L;
  T* Qs = Vs + BN * L;
  T* dOs = Qs + BM * L;
  float* Ps = reinterpret_cast<float*>(dOs + BM * L);
  float* dSs = Ps + BM * SP;
  float* M2 = dSs + BM * SP;
  float* IL = M2 + BM;
  float* Dl = IL + BM;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int64_t cb = blockIdx.x, bk = blockIdx.y, b = bk / g.Hkv, hk = bk % g.Hkv, c0 = cb * BN;
  const int bn = (int)imin(BN, g.Nk - c0);
  const int64_t kv_base = (b * g.Hkv + hk) * g.Nk + c0;
  const float scale2 = g.scale * kLog2e;
  load_tile<T, D>(Ks, k + kv_base * D, bn);
  load_tile<T, D>(Vs, v + kv_base * D, bn);
  float dk_acc[4][E], dv_acc[4][E];
  zero_acc(dk_acc);
  zero_acc(dv_acc);
  int64_t lo, hi;
  g.row_range(c0, c0 + bn, lo, hi);
  for (int64_t gi = 0; gi < g.G; ++gi) {
    const int64_t h = hk * g.G + gi;
    for (int64_t r0 = (lo / BM) * BM; r0 < hi; r0 += BM) {
      const int bm = (int)imin(BM, g.Nq - r0);
      const int cls = g.classify(r0, r0 + bm, c0, c0 + bn);
      if (cls == 0) continue;
      const int64_t row_base = (b * g.Hq + h) * g.Nq + r0;
      __syncthreads();
      load_tile<T, D>(Qs, q + row_base * D, bm);
      load_tile<T, D>(dOs, dout + row_base * D, bm);
      for (int r = tid; r < BM; r += NT) {
        M2[r] = r < bm ? stats[(row_base + r) * 2] : INFINITY;
        IL[r] = r < bm ? stats[(row_base + r) * 2 + 1] : 0.f;
        Dl[r] = r < bm ? delta[row_base + r] : 0.f;
      }
      __syncthreads();
      float s[4][4], dp[4][4];
      zero_acc(s);
      zero_acc(dp);
      mt_dot<T, D>(s, Qs, Ks, ty, tx);
      mt_dot<T, D>(dp, dOs, Vs, ty, tx);
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int r = ty + 16 * a;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = tx + 16 * j;
          const bool ok = r < bm && c < bn && (cls == 2 || g.visible(r0 + r, c0 + c));
          const float p = prob(s[a][j], scale2, M2[r], IL[r], ok);
          Ps[r * SP + c] = p;
          dSs[r * SP + c] = p * (dp[a][j] - Dl[r]);
        }
      }
      __syncthreads();
      mt_cols<T, D>(dv_acc, Ps, dOs, ty, tx);
      mt_cols<T, D>(dk_acc, dSs, Qs, ty, tx);
    }
  }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int c = ty + 16 * a;
    if (c >= bn) continue;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      dk[(kv_base + c) * D + tx + 16 * e] = from_f<T>(dk_acc[a][e] * g.scale);
      dv[(kv_base + c) * D + tx + 16 * e] = from_f<T>(dv_acc[a][e]);
    }
  }
}

// ------------------------------------------------------------------------------- BoB
// Score micro-tiles shared by both BoB passes: S, dP, F = U_Q Kᵀ + Q U_Kᵀ (unscaled), C = dO U_Vᵀ.
template <typename T, int D>
__device__ __forceinline__ void bob_scores(float (&s)[4][4], float (&dp)[4][4], float (&f)[4][4],
                                           float (&c)[4][4], const T* Qs, const T* dOs,
                                           const T* UQs, const T* Ks, const T* Vs, const T* UKs,
                                           const T* UVs, bool has_uq, bool has_uk, bool has_uv,
                                           int ty, int tx) {
  zero_acc(s);
  zero_acc(dp);
  zero_acc(f);
  zero_acc(c);
  mt_dot<T, D>(s, Qs, Ks, ty, tx);
  mt_dot<T, D>(dp, dOs, Vs, ty, tx);
  if (has_uq) mt_dot<T, D>(f, UQs, Ks, ty, tx);
  if (has_uk) mt_dot<T, D>(f, Qs, UKs, ty, tx);
  if (has_uv) mt_dot<T, D>(c, dOs, UVs, ty, tx);
}

template <typename T, int D>
__global__ void __launch_bounds__(NT) bob_row_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ o, const float* __restrict__ stats, const T* __restrict__ dout,
    const T* __restrict__ uq, const T* __restrict__ uk, const T* __restrict__ uv,
    T* __restrict__ qbar, T* __restrict__ dobar, float* __restrict__ delta,
    float* __restrict__ alpha, float* __restrict__ e0, Geo g) {
  constexpr int L = Cfg<D>::LDS, E = Cfg<D>::E;
  FB_DYNAMIC_SMEM(smem);
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + BM * L;
  T* UQs = dOs + BM * L;
  T* Ks = UQs + BM * L;
  T* Vs = Ks + BN * L;
  T* UKs = Vs + BN * L;
  T* UVs = UKs + BN * L;
  float* Ps = reinterpret_cast<float*>(UVs + BN * L);
  float* PFs = Ps + BM * SP;
  float* PPs = PFs + BM * SP;
  float* dSs = PPs + BM * SP;
  float* M2 = dSs + BM * SP;
  float* IL = M2 + BM;
  float* Dl = IL + BM;
  const bool has_uq = uq != nullptr, has_uk = uk != nullptr, has_uv = uv != nullptr;
  const bool has_f = has_uq || has_uk;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int64_t rb = gridDim.x - 1 - blockIdx.x, bh = blockIdx.y;
  const int64_t b = bh / g.Hq, h = bh % g.Hq, hk = h / g.G, r0 = rb * BM;
  const int bm = (int)imin(BM, g.Nq - r0);
  const int64_t row_base = (b * g.Hq + h) * g.Nq + r0;
  const int64_t kv0 = (b * g.Hkv + hk) * g.Nk * D;
  const float scale2 = g.scale * kLog2e;
  load_tile<T, D>(Qs, q + row_base * D, bm);
  load_tile<T, D>(dOs, dout + row_base * D, bm);
  if (has_uq) load_tile<T, D>(UQs, uq + row_base * D, bm);
  load_row_scalars<T, D>(M2, IL, Dl, stats, o, dout, row_base, bm, delta);
  float aout[4][E], omega[4][E], bacc[4][E], racc[4][E], sa[4], se[4];
  zero_acc(aout);
  zero_acc(omega);
  zero_acc(bacc);
  zero_acc(racc);
#pragma unroll
  for (int a = 0; a < 4; ++a) sa[a] = se[a] = 0.f;
  int64_t lo, hi;
  g.col_range(r0, r0 + bm, lo, hi);
  for (int64_t c0 = (lo / BN) * BN; c0 < hi; c0 += BN) {
    const int bn = (int)imin(BN, g.Nk - c0);
    const int cls = g.classify(r0, r0 + bm, c0, c0 + bn);
    if (cls == 0) continue;
    __syncthreads();
    load_tile<T, D>(Ks, k + kv0 + c0 * D, bn);
    load_tile<T, D>(Vs, v + kv0 + c0 * D, bn);
    if (has_uk) load_tile<T, D>(UKs, uk + kv0 + c0 * D, bn);
    if (has_uv) load_tile<T, D>(UVs, uv + kv0 + c0 * D, bn);
    __syncthreads();
    float s[4][4], dp[4][4], f[4][4], cc[4][4];
    bob_scores<T, D>(s, dp, f, cc, Qs, dOs, UQs, Ks, Vs, UKs, UVs, has_uq, has_uk, has_uv, ty, tx);
#pragma unroll
    for (int a = 0; a < 4; ++a) {
      const int r = ty + 16 * a;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int c = tx + 16 * j;
        const bool ok = r < bm && c < bn && (cls == 2 || g.visible(r0 + r, c0 + c));
        const float p = prob(s[a][j], scale2, M2[r], IL[r], ok);
        const float dps = dp[a][j] - Dl[r];
        const float fs = f[a][j] * g.scale;
        const float pb0 = cc[a][j] + fs * dps;  // P̄° = C + F∘(dP − D)
        Ps[r * SP + c] = p;
        PFs[r * SP + c] = p * fs;
        PPs[r * SP + c] = p * pb0;
        dSs[r * SP + c] = p * dps;
        sa[a] += p * fs;   // α
        se[a] += p * pb0;  // E°
      }
    }
    __syncthreads();
    if (has_uv) mt_rows<T, D>(aout, Ps, UVs, ty, tx);
    if (has_f) mt_rows<T, D>(aout, PFs, Vs, ty, tx);
    mt_rows<T, D>(omega, PPs, Ks, ty, tx);
    if (has_uk) mt_rows<T, D>(omega, dSs, UKs, ty, tx);
    mt_rows<T, D>(bacc, Ps, Ks, ty, tx);
    if (has_f) mt_rows<T, D>(racc, dSs, Ks, ty, tx);
  }
  // Epilogue: dŌ = P U_V + (P∘F) V − α∘O ; Q̄ = τ(Ω − α∘R − E°∘B).
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int r = ty + 16 * a;
    const float al = sum16(sa[a]), ee = sum16(se[a]);
    if (r >= bm) continue;
    if (tx == 0) {
      alpha[row_base + r] = al;
      e0[row_base + r] = ee;
    }
#pragma unroll
    for (int e = 0; e < E; ++e) {
      const int64_t x = (row_base + r) * D + tx + 16 * e;
      dobar[x] = from_f<T>(aout[a][e] - al * to_f(o[x]));
      qbar[x] = from_f<T>(g.scale * (omega[a][e] - al * racc[a][e] - ee * bacc[a][e]));
    }
  }
}

template <typename T, int D>
__global__ void __launch_bounds__(NT) bob_col_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ stats, const T* __restrict__ dout, const T* __restrict__ uq,
    const T* __restrict__ uk, const T* __restrict__ uv, const float* __restrict__ delta,
    const float* __restrict__ alpha, const float* __restrict__ e0, T* __restrict__ kbar,
    T* __restrict__ vbar, Geo g) {
  constexpr int L = Cfg<D>::LDS, E = Cfg<D>::E;
  FB_DYNAMIC_SMEM(smem);
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + BN * L;
  T* UKs = Vs + BN * L;
  T* UVs = UKs + BN * L;
  T* Qs = UVs + BN * L;
  T* dOs = Qs + BM * L;
  T* UQs = dOs + BM * L;
  float* Ws = reinterpret_cast<float*>(UQs + BM * L);
  float* Sbs = Ws + BM * SP;
  float* dSs = Sbs + BM * SP;
  float* M2 = dSs + BM * SP;
  float* IL = M2 + BM;
  float* Dl = IL + BM;
  float* Al = Dl + BM;
  float* E0 = Al + BM;
  const bool has_uq = uq != nullptr, has_uk = uk != nullptr, has_uv = uv != nullptr;
  const bool has_f = has_uq || has_uk;
  const int tid = threadIdx.x, ty = tid / 16, tx = tid % 16;
  const int64_t cb = blockIdx.x, bk = blockIdx.y, b = bk / g.Hkv, hk = bk % g.Hkv, c0 = cb * BN;
  const int bn = (int)imin(BN, g.Nk - c0);
  const int64_t kv_base = (b * g.Hkv + hk) * g.Nk + c0;
  const float scale2 = g.scale * kLog2e;
  load_tile<T, D>(Ks, k + kv_base * D, bn);
  load_tile<T, D>(Vs, v + kv_base * D, bn);
  if (has_uk) load_tile<T, D>(UKs, uk + kv_base * D, bn);
  if (has_uv) load_tile<T, D>(UVs, uv + kv_base * D, bn);
  float kacc[4][E], vacc[4][E];
  zero_acc(kacc);
  zero_acc(vacc);
  int64_t lo, hi;
  g.row_range(c0, c0 + bn, lo, hi);
  for (int64_t gi = 0; gi < g.G; ++gi) {
    const int64_t h = hk * g.G + gi;
    for (int64_t r0 = (lo / BM) * BM; r0 < hi; r0 += BM) {
      const int bm = (int)imin(BM, g.Nq - r0);
      const int cls = g.classify(r0, r0 + bm, c0, c0 + bn);
      if (cls == 0) continue;
      const int64_t row_base = (b * g.Hq + h) * g.Nq + r0;
      __syncthreads();
      load_tile<T, D>(Qs, q + row_base * D, bm);
      load_tile<T, D>(dOs, dout + row_base * D, bm);
      if (has_uq) load_tile<T, D>(UQs, uq + row_base * D, bm);
      for (int r = tid; r < BM; r += NT) {
        const bool in = r < bm;
        M2[r] = in ? stats[(row_base + r) * 2] : INFINITY;
        IL[r] = in ? stats[(row_base + r) * 2 + 1] : 0.f;
        Dl[r] = in ? delta[row_base + r] : 0.f;
        Al[r] = in ? alpha[row_base + r] : 0.f;
        E0[r] = in ? e0[row_base + r] : 0.f;
      }
      __syncthreads();
      float s[4][4], dp[4][4], f[4][4], cc[4][4];
      bob_scores<T, D>(s, dp, f, cc, Qs, dOs, UQs, Ks, Vs, UKs, UVs, has_uq, has_uk, has_uv, ty,
                       tx);
#pragma unroll
      for (int a = 0; a < 4; ++a) {
        const int r = ty + 16 * a;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int c = tx + 16 * j;
          const bool ok = r < bm && c < bn && (cls == 2 || g.visible(r0 + r, c0 + c));
          const float p = prob(s[a][j], scale2, M2[r], IL[r], ok);
          const float dps = dp[a][j] - Dl[r];
          const float fs = f[a][j] * g.scale;
          const float pb0 = cc[a][j] + fs * dps;
          Ws[r * SP + c] = p * (fs - Al[r]);                       // P∘h
          Sbs[r * SP + c] = p * (pb0 - Al[r] * dps - E0[r]);       // S̄ = P∘(P̄ − E)
          dSs[r * SP + c] = p * dps;                               // dS
        }
      }
      __syncthreads();
      if (has_f) mt_cols<T, D>(vacc, Ws, dOs, ty, tx);
      mt_cols<T, D>(kacc, Sbs, Qs, ty, tx);
      if (has_uq) mt_cols<T, D>(kacc, dSs, UQs, ty, tx);
    }
  }
#pragma unroll
  for (int a = 0; a < 4; ++a) {
    const int c = ty + 16 * a;
    if (c >= bn) continue;
#pragma unroll
    for (int e = 0; e < E; ++e) {
      kbar[(kv_base + c) * D + tx + 16 * e] = from_f<T>(kacc[a][e] * g.scale);
      vbar[(kv_base + c) * D + tx + 16 * e] = from_f<T>(vacc[a][e]);
    }
  }
}

// ------------------------------------------------------------------------------- launchers
template <int D, typename T>
constexpr size_t tiles_bytes(int n_storage, int n_scores, int n_scalars) {
  return (size_t)n_storage * BM * Cfg<D>::LDS * sizeof(T) + (size_t)n_scores * BM * SP * 4 +
         (size_t)n_scalars * BM * 4;
}

// Kernels use more than 48 KB of dynamic shared memory (up to ~188 KB for the BoB row pass at
// D = 128): opt in per kernel before launching.
template <typename K>
cudaError_t allow_smem(K kernel, size_t smem) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
}

template <typename T, int D>
cudaError_t fwd_t(const void* q, const void* k, const void* v, void* o, float* stats, const Geo& g,
                  cudaStream_t st) {
  const dim3 grid((unsigned)((g.Nq + BM - 1) / BM), (unsigned)(g.B * g.Hq));
  const size_t smem = tiles_bytes<D, T>(3, 1, 0);
  auto kern = fwd_kernel<T, D>;
  cudaError_t err = allow_smem(kern, smem);
  if (err != cudaSuccess) return err;
  FB_LAUNCH(kern, grid, smem, st, (const T*)q, (const T*)k, (const T*)v, (T*)o, stats, g);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t bwd_t(const void* q, const void* k, const void* v, const void* o, const float* stats,
                  const void* dout, void* dq, void* dk, void* dv, float* delta, const Geo& g,
                  cudaStream_t st) {
  const dim3 grid_r((unsigned)((g.Nq + BM - 1) / BM), (unsigned)(g.B * g.Hq));
  const size_t smem_r = tiles_bytes<D, T>(4, 1, 3);
  auto kr = bwd_row_kernel<T, D>;
  cudaError_t err = allow_smem(kr, smem_r);
  if (err != cudaSuccess) return err;
  FB_LAUNCH(kr, grid_r, smem_r, st, (const T*)q, (const T*)k, (const T*)v, (const T*)o, stats,
                                 (const T*)dout, (T*)dq, delta, g);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const dim3 grid_c((unsigned)((g.Nk + BN - 1) / BN), (unsigned)(g.B * g.Hkv));
  const size_t smem_c = tiles_bytes<D, T>(4, 2, 3);
  auto kc = bwd_col_kernel<T, D>;
  if ((err = allow_smem(kc, smem_c)) != cudaSuccess) return err;
  FB_LAUNCH(kc, grid_c, smem_c, st, (const T*)q, (const T*)k, (const T*)v, stats, (const T*)dout,
                                 delta, (T*)dk, (T*)dv, g);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t bwd_bwd_t(const void* q, const void* k, const void* v, const void* o,
                      const float* stats, const void* dout, const void* uq, const void* uk,
                      const void* uv, void* qbar, void* kbar, void* vbar, void* dobar,
                      float* delta, float* alpha, float* e0, const Geo& g, cudaStream_t st) {
  const dim3 grid_r((unsigned)((g.Nq + BM - 1) / BM), (unsigned)(g.B * g.Hq));
  const size_t smem_r = tiles_bytes<D, T>(7, 4, 3);
  auto kr = bob_row_kernel<T, D>;
  cudaError_t err = allow_smem(kr, smem_r);
  if (err != cudaSuccess) return err;
  FB_LAUNCH(kr, grid_r, smem_r, st, (const T*)q, (const T*)k, (const T*)v, (const T*)o, stats,
                                 (const T*)dout, (const T*)uq, (const T*)uk, (const T*)uv,
                                 (T*)qbar, (T*)dobar, delta, alpha, e0, g);
  if ((err = cudaGetLastError()) != cudaSuccess) return err;
  const dim3 grid_c((unsigned)((g.Nk + BN - 1) / BN), (unsigned)(g.B * g.Hkv));
  const size_t smem_c = tiles_bytes<D, T>(7, 3, 5);
  auto kc = bob_col_kernel<T, D>;
  if ((err = allow_smem(kc, smem_c)) != cudaSuccess) return err;
  FB_LAUNCH(kc, grid_c, smem_c, st, (const T*)q, (const T*)k, (const T*)v, stats, (const T*)dout,
                                 (const T*)uq, (const T*)uk, (const T*)uv, delta, alpha, e0,
                                 (T*)kbar, (T*)vbar, g);
  return cudaGetLastError();
}

}  // namespace

#define FB_DISPATCH(dt, D, FN, ...)                                                     \
  do {                                                                                  \
    if ((dt) == Dtype::kBF16 && (D) == 64) return FN<__nv_bfloat16, 64>(__VA_ARGS__);   \
    if ((dt) == Dtype::kBF16 && (D) == 128) return FN<__nv_bfloat16, 128>(__VA_ARGS__); \
    if ((dt) == Dtype::kFP16 && (D) == 64) return FN<__half, 64>(__VA_ARGS__);          \
    if ((dt) == Dtype::kFP16 && (D) == 128) return FN<__half, 128>(__VA_ARGS__);        \
    return cudaErrorInvalidValue;                                                       \
  } while (0)

cudaError_t launch_fwd(Dtype dt, int D, const void* q, const void* k, const void* v, void* o,
                       float* stats, const Geo& g, cudaStream_t stream) {
  FB_DISPATCH(dt, D, fwd_t, q, k, v, o, stats, g, stream);
}

cudaError_t launch_bwd(Dtype dt, int D, const void* q, const void* k, const void* v,
                       const void* o, const float* stats, const void* dout, void* dq, void* dk,
                       void* dv, float* delta, const Geo& g, cudaStream_t stream) {
  FB_DISPATCH(dt, D, bwd_t, q, k, v, o, stats, dout, dq, dk, dv, delta, g, stream);
}

cudaError_t launch_bwd_bwd(Dtype dt, int D, const void* q, const void* k, const void* v,
                           const void* o, const float* stats, const void* dout, const void* uq,
                           const void* uk, const void* uv, void* qbar, void* kbar, void* vbar,
                           void* dobar, float* delta, float* alpha, float* e0, const Geo& g,
                           cudaStream_t stream) {
  FB_DISPATCH(dt, D, bwd_bwd_t, q, k, v, o, stats, dout, uq, uk, uv, qbar, kbar, vbar, dobar,
              delta, alpha, e0, g, stream);
}

}  // namespace flashbob
