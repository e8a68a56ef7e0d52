// FlashBoB CUDA kernels on tensor cores: forward, first backward and backward-over-backward.
//
// Math and notation: flashbob_math.md (../shared/design) and docs/flashbob.md. Kernels, each a
// pass over one (batch, kv head) group; "row" passes own a block of packed query rows and
// stream key tiles, "column" passes own a block of keys and stream packed query-row tiles:
//   fwd_kernel        row     -> O, stats (m2, 1/l)                 2 GEMMs per tile pair
//   bwd_row_kernel    row     -> dQ, D = <dO, O>                    3
//   bwd_col_kernel    column  -> dK, dV                             4
//   bob_stats_kernel  row     -> D, α = Σ P∘F, E° = Σ P∘P̄°          5
//   bob_row_kernel    row     -> Q̄ = τ(S̄·K + dS·U_K), dŌ = P·U_V + (P∘F)·V − α∘O    5 + 4
//   bob_col_kernel    column  -> K̄ = τ(S̄ᵀ·Q + dSᵀ·U_Q), V̄ = (P∘h)ᵀ·dO              5 + 3
// with S̄ = P∘(P̄° − α·(dP − D) − E°) = P∘(P̄ − E). The BoB runs the row-scalar pass first so that
// both output passes can form S̄ per element in fp32 before any rounding: Q̄ and K̄ are then plain
// sums of products (no Ω − α∘R − E°∘B cancellation of separately rounded tiles), and each output
// pass keeps only two accumulators.
//
// GQA / MQA by head packing: the G = Hq/Hkv query heads of a kv head form one row space of G·Nq
// packed rows (row m = position m/G of head hk·G + m%G). Row blocks mix heads and load each K/V
// tile once for all of them; column blocks stream the whole group, so dK, dV, K̄, V̄ sum over the
// group without atomics. Tiles that causal/window masks empty are never visited (the streamed
// range is the visible band); fully visible tiles skip the per-element mask.
//
// Every GEMM is mma.sync m16n8k16 (bf16 or fp16 inputs, fp32 accumulation) fed by ldmatrix;
// streamed tiles are double-buffered with cp.async (the load of tile i+1 overlaps the math of
// tile i). Scores stay in registers: the fp32 accumulator of a score tile becomes the A operand of
// the next GEMM by packing pairs (flashbob_cuda_tiles.cuh), so P, dS, S̄, P∘F, P∘h never touch
// shared memory. Column passes compute transposed scores (keys x queries) so that Pᵀ, dSᵀ, S̄ᵀ
// are A operands too. Softmax statistics, row scalars and all elementwise math are fp32; only
// GEMM inputs are bf16/fp16 (as in FlashAttention).
//
// Tile shapes are template parameters (Tiles<BM, BN, warps>), chosen per kernel and head dim in
// Shapes<D> below (overridable at compile time for a GPU sweep); the values there are starting
// points, not tuned on a GPU yet.
//
// The same source compiles as C++ under FLASHBOB_CUDA_EMU (csrc/emu/: one host thread per CUDA
// thread, tensor-core instructions emulated with the PTX ISA's fragment layouts), so the kernels
// are checked on the CPU by tests/unit/test_flashbob_cuda_emu.py. Block-level control flow is
// uniform (every thread runs every shuffle, ldmatrix and mma), as the emulator requires.
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
#include "flashbob_cuda_tiles.cuh"

namespace flashbob {
namespace {

// ------------------------------------------------------------------------------- block geometry
// Row pass: packed rows [m0, m0 + bm) of kv group (b, hk); positions [p_lo, p_hi); keys to stream
// [c_lo, c_hi) (the union of the rows' visible ranges).
struct RowBlock {
  Packed pk;
  int64_t kv0, m0, p_lo, p_hi, c_lo, c_hi;
  int bm;
};

__device__ __forceinline__ RowBlock row_block(const Geo& g, int BM) {
  RowBlock r;
  const int64_t bk = blockIdx.y, b = bk / g.Hkv, hk = bk % g.Hkv, M = g.G * g.Nq;
  r.pk = Packed::make(b * g.Hq + hk * g.G, g.G, g.Nq);
  r.kv0 = (b * g.Hkv + hk) * g.Nk;
  r.m0 = (int64_t)(gridDim.x - 1 - blockIdx.x) * BM;  // heaviest causal blocks first
  r.bm = (int)imin(BM, M - r.m0);
  r.p_lo = r.m0 / g.G;
  r.p_hi = (r.m0 + r.bm - 1) / g.G + 1;
  g.col_range(r.p_lo, r.p_hi, r.c_lo, r.c_hi);
  return r;
}

// Column pass: keys [c0, c0 + bn) of kv group (b, hk); packed rows to stream [m_lo, m_hi).
struct ColBlock {
  Packed pk;
  int64_t kv0, c0, m_lo, m_hi;
  int bn;
};

__device__ __forceinline__ ColBlock col_block(const Geo& g, int BM) {
  ColBlock c;
  const int64_t bk = blockIdx.y, b = bk / g.Hkv, hk = bk % g.Hkv;
  c.pk = Packed::make(b * g.Hq + hk * g.G, g.G, g.Nq);
  c.c0 = (int64_t)blockIdx.x * BM;
  c.bn = (int)imin(BM, g.Nk - c.c0);
  c.kv0 = (b * g.Hkv + hk) * g.Nk + c.c0;
  int64_t lo, hi;
  g.row_range(c.c0, c.c0 + c.bn, lo, hi);
  c.m_lo = lo * g.G;
  c.m_hi = hi * g.G;
  return c;
}

// The rows of a warp's tile that this thread holds: [mt][h] = local row 16·mt + g + 8h.
template <int MT>
struct ThreadRows {
  int local[MT][2];
  bool valid[MT][2];
};
template <int MT>
__device__ __forceinline__ ThreadRows<MT> thread_rows(int warp, int lane, int nvalid) {
  ThreadRows<MT> tr;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tr.local[mt][h] = warp * 16 * MT + mt * 16 + lane / 4 + 8 * h;
      tr.valid[mt][h] = tr.local[mt][h] < nvalid;
    }
  return tr;
}

// Double-buffered stream of n tiles: issue(i) starts the cp.async loads of tile i into buffer
// i % 2 and commits them; body(i) runs once tile i (and everything committed before it) is in
// shared memory for every thread. Groups committed before the call are complete at body(0).
template <class Issue, class Body>
__device__ __forceinline__ void stream_tiles(int64_t n, Issue issue, Body body) {
  if (n > 0) issue(0);
  for (int64_t it = 0; it < n; ++it) {
    if (it + 1 < n) {
      issue(it + 1);
      fbmma::cp_async_wait<1>();
    } else {
      fbmma::cp_async_wait<0>();
    }
    __syncthreads();
    body(it);
    __syncthreads();  // buffer it % 2 is refilled by issue(it + 2)
  }
  fbmma::cp_async_wait<0>();
  __syncthreads();
}

// D_i = <dO_i, O_i> (fp32) of this thread's rows: each quad lane sums D/4 columns, then the quad.
template <typename T, int D, int MT>
__device__ __forceinline__ void row_delta(float (&dl)[MT][2], const T* o, const T* dout,
                                          const int64_t (&ri)[MT][2], const ThreadRows<MT>& tr,
                                          int lane) {
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float acc = 0.f;
      if (tr.valid[mt][h]) {
        const T* orow = o + ri[mt][h] * D;
        const T* drow = dout + ri[mt][h] * D;
#pragma unroll
        for (int db = 0; db < D / 8; ++db)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = db * 8 + 2 * (lane % 4) + e;
            acc = fmaf(to_f(drow[c]), to_f(orow[c]), acc);
          }
      }
      dl[mt][h] = quad_sum(acc);
    }
}

// ------------------------------------------------------------------------------- forward
template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT) fwd_kernel(const T* __restrict__ q,
                                                     const T* __restrict__ k,
                                                     const T* __restrict__ v, T* __restrict__ o,
                                                     float* __restrict__ stats, Geo g) {
  constexpr int L = Smem<D>::LDS, MT = TL::MT, NB = TL::NB, BM = TL::BM, BN = TL::BN,
                NT = TL::NT, DB = D / 8;
  FB_DYNAMIC_SMEM(smem);
  T* Qs = reinterpret_cast<T*>(smem);
  T* Ks = Qs + BM * L;  // [2][BN * L]
  T* Vs = Ks + 2 * BN * L;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
  const RowBlock rb = row_block(g, BM);
  const T* K = k + rb.kv0 * D;
  const T* V = v + rb.kv0 * D;
  const float scale2 = g.scale * kLog2e;
  const ThreadRows<MT> tr = thread_rows<MT>(warp, lane, rb.bm);
  int64_t ri[MT][2], pos[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ri[mt][h] = rb.pk.row(rb.m0 + tr.local[mt][h]);
      pos[mt][h] = rb.pk.pos(rb.m0 + tr.local[mt][h]);
    }
  load_packed_async<T, D, BM, NT>(Qs, q, rb.pk, rb.m0, rb.bm);
  fbmma::cp_async_commit();

  float m_run[MT][2], l_run[MT][2], acc[MT][DB][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      m_run[mt][h] = -INFINITY;
      l_run[mt][h] = 0.f;
    }
  zero(acc);
  const int64_t n_tiles = (rb.c_hi - rb.c_lo + BN - 1) / BN;
  auto issue = [&](int64_t it) {
    const int64_t c0 = rb.c_lo + it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = (int)(it % 2);
    load_rows_async<T, D, BN, NT>(Ks + buf * BN * L, K + c0 * D, bn);
    load_rows_async<T, D, BN, NT>(Vs + buf * BN * L, V + c0 * D, bn);
    fbmma::cp_async_commit();
  };
  auto body = [&](int64_t it) {
    const int64_t c0 = rb.c_lo + it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = (int)(it % 2);
    const int cls = g.classify(rb.p_lo, rb.p_hi, c0, c0 + bn);
    const bool full = cls == 2 && bn == BN;
    float s[MT][NB][4];
    zero(s);
    gemm_abt<T, D, MT, NB>(s, Qs + warp * 16 * MT * L, Ks + buf * BN * L, lane);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float mx = -INFINITY;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int c = nb * 8 + 2 * tq + e;
            const bool ok = tr.valid[mt][h] &&
                            (full || (c < bn && (cls == 2 || g.visible(pos[mt][h], c0 + c))));
            const float x = ok ? s[mt][nb][2 * h + e] * scale2 : -INFINITY;
            s[mt][nb][2 * h + e] = x;
            mx = fmaxf(mx, x);
          }
        mx = quad_max(mx);
        const float m_new = fmaxf(m_run[mt][h], mx);
        const bool none = m_new == -INFINITY;
        const float corr = none ? 1.f : exp2f(m_run[mt][h] - m_new);  // 0 when m_run = -inf
        float sum = 0.f;
#pragma unroll
        for (int nb = 0; nb < NB; ++nb)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const float p = none ? 0.f : exp2f(s[mt][nb][2 * h + e] - m_new);
            s[mt][nb][2 * h + e] = p;
            sum += p;
          }
        l_run[mt][h] = l_run[mt][h] * corr + sum;  // this lane's partial row sum
        m_run[mt][h] = m_new;
#pragma unroll
        for (int db = 0; db < DB; ++db) {
          acc[mt][db][2 * h] *= corr;
          acc[mt][db][2 * h + 1] *= corr;
        }
      }
    uint32_t pf[MT][NB / 2][4];
    to_afrag<T, MT, NB>(pf, s);
    gemm_ab<T, D, MT, NB / 2>(acc, pf, Vs + buf * BN * L, lane);
  };
  stream_tiles(n_tiles, issue, body);

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float l = quad_sum(l_run[mt][h]);
      const float inv = l > 0.f ? 1.f / l : 0.f;
      if (!tr.valid[mt][h]) continue;
      T* orow = o + ri[mt][h] * D;
#pragma unroll
      for (int db = 0; db < DB; ++db)
        store2(orow + db * 8 + 2 * tq, acc[mt][db][2 * h] * inv, acc[mt][db][2 * h + 1] * inv);
      if (tq == 0) {
        stats[ri[mt][h] * 2] = l > 0.f ? m_run[mt][h] : INFINITY;
        stats[ri[mt][h] * 2 + 1] = inv;
      }
    }
}

// ------------------------------------------------------------------------------- first backward
template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT) bwd_row_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ o, const float* __restrict__ stats, const T* __restrict__ dout,
    T* __restrict__ dq, float* __restrict__ delta, Geo g) {
  constexpr int L = Smem<D>::LDS, MT = TL::MT, NB = TL::NB, BM = TL::BM, BN = TL::BN,
                NT = TL::NT, DB = D / 8;
  FB_DYNAMIC_SMEM(smem);
  T* Qs = reinterpret_cast<T*>(smem);
  T* dOs = Qs + BM * L;
  T* Ks = dOs + BM * L;  // [2][BN * L]
  T* Vs = Ks + 2 * BN * L;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
  const RowBlock rb = row_block(g, BM);
  const T* K = k + rb.kv0 * D;
  const T* V = v + rb.kv0 * D;
  const float scale2 = g.scale * kLog2e;
  const ThreadRows<MT> tr = thread_rows<MT>(warp, lane, rb.bm);
  int64_t ri[MT][2], pos[MT][2];
  float m2[MT][2], il[MT][2], dl[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ri[mt][h] = rb.pk.row(rb.m0 + tr.local[mt][h]);
      pos[mt][h] = rb.pk.pos(rb.m0 + tr.local[mt][h]);
      m2[mt][h] = tr.valid[mt][h] ? stats[ri[mt][h] * 2] : INFINITY;
      il[mt][h] = tr.valid[mt][h] ? stats[ri[mt][h] * 2 + 1] : 0.f;
    }
  load_packed_async<T, D, BM, NT>(Qs, q, rb.pk, rb.m0, rb.bm);
  load_packed_async<T, D, BM, NT>(dOs, dout, rb.pk, rb.m0, rb.bm);
  fbmma::cp_async_commit();
  row_delta<T, D, MT>(dl, o, dout, ri, tr, lane);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      if (tr.valid[mt][h] && tq == 0) delta[ri[mt][h]] = dl[mt][h];

  float acc[MT][DB][4];
  zero(acc);
  const int64_t n_tiles = (rb.c_hi - rb.c_lo + BN - 1) / BN;
  auto issue = [&](int64_t it) {
    const int64_t c0 = rb.c_lo + it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = (int)(it % 2);
    load_rows_async<T, D, BN, NT>(Ks + buf * BN * L, K + c0 * D, bn);
    load_rows_async<T, D, BN, NT>(Vs + buf * BN * L, V + c0 * D, bn);
    fbmma::cp_async_commit();
  };
  auto body = [&](int64_t it) {
    const int64_t c0 = rb.c_lo + it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = (int)(it % 2);
    const int cls = g.classify(rb.p_lo, rb.p_hi, c0, c0 + bn);
    const bool full = cls == 2 && bn == BN;
    float s[MT][NB][4], dp[MT][NB][4];
    zero(s);
    zero(dp);
    gemm_abt<T, D, MT, NB>(s, Qs + warp * 16 * MT * L, Ks + buf * BN * L, lane);
    gemm_abt<T, D, MT, NB>(dp, dOs + warp * 16 * MT * L, Vs + buf * BN * L, lane);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2, c = nb * 8 + 2 * tq + e % 2;
          const bool ok = tr.valid[mt][h] &&
                          (full || (c < bn && (cls == 2 || g.visible(pos[mt][h], c0 + c))));
          const float p = prob(s[mt][nb][e], scale2, m2[mt][h], il[mt][h], ok);
          dp[mt][nb][e] = p * (dp[mt][nb][e] - dl[mt][h]);  // dS
        }
    uint32_t df[MT][NB / 2][4];
    to_afrag<T, MT, NB>(df, dp);
    gemm_ab<T, D, MT, NB / 2>(acc, df, Ks + buf * BN * L, lane);
  };
  stream_tiles(n_tiles, issue, body);

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!tr.valid[mt][h]) continue;
      T* row = dq + ri[mt][h] * D;
#pragma unroll
      for (int db = 0; db < DB; ++db)
        store2(row + db * 8 + 2 * tq, acc[mt][db][2 * h] * g.scale,
               acc[mt][db][2 * h + 1] * g.scale);
    }
}

// Per-row scalars of one streamed tile of packed rows, into shared arrays (column passes).
struct ColScalars {
  float *m2, *il, *dl, *al, *e0;  // al/e0 may be null (first backward)
};
__device__ __forceinline__ void load_col_scalars(const ColScalars& cs, int BN, int NT,
                                                 const Packed& pk, int64_t m0, int nvalid,
                                                 const float* stats, const float* delta,
                                                 const float* alpha, const float* e0) {
  for (int r = threadIdx.x; r < BN; r += NT) {
    const bool ok = r < nvalid;
    const int64_t i = ok ? pk.row(m0 + r) : 0;
    cs.m2[r] = ok ? stats[i * 2] : INFINITY;
    cs.il[r] = ok ? stats[i * 2 + 1] : 0.f;
    cs.dl[r] = ok ? delta[i] : 0.f;
    if (cs.al) cs.al[r] = ok ? alpha[i] : 0.f;
    if (cs.e0) cs.e0[r] = ok ? e0[i] : 0.f;
  }
}

template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT) bwd_col_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ stats, const T* __restrict__ dout, const float* __restrict__ delta,
    T* __restrict__ dk, T* __restrict__ dv, Geo g) {
  constexpr int L = Smem<D>::LDS, MT = TL::MT, NB = TL::NB, BM = TL::BM, BN = TL::BN,
                NT = TL::NT, DB = D / 8;
  FB_DYNAMIC_SMEM(smem);
  T* Ks = reinterpret_cast<T*>(smem);
  T* Vs = Ks + BM * L;
  T* Qs = Vs + BM * L;  // [2][BN * L]
  T* dOs = Qs + 2 * BN * L;
  float* sc = reinterpret_cast<float*>(dOs + 2 * BN * L);  // [3][2][BN]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
  const ColBlock cb = col_block(g, BM);
  const float scale2 = g.scale * kLog2e;
  const ThreadRows<MT> tr = thread_rows<MT>(warp, lane, cb.bn);
  load_rows_async<T, D, BM, NT>(Ks, k + cb.kv0 * D, cb.bn);
  load_rows_async<T, D, BM, NT>(Vs, v + cb.kv0 * D, cb.bn);
  fbmma::cp_async_commit();
  auto scal = [&](int buf) {
    return ColScalars{sc + buf * BN, sc + (2 + buf) * BN, sc + (4 + buf) * BN, nullptr, nullptr};
  };

  float dk_acc[MT][DB][4], dv_acc[MT][DB][4];
  zero(dk_acc);
  zero(dv_acc);
  const int64_t n_tiles = (cb.m_hi - cb.m_lo + BN - 1) / BN;
  auto issue = [&](int64_t it) {
    const int64_t m0 = cb.m_lo + it * BN;
    const int nv = (int)imin(BN, cb.m_hi - m0), buf = (int)(it % 2);
    load_packed_async<T, D, BN, NT>(Qs + buf * BN * L, q, cb.pk, m0, nv);
    load_packed_async<T, D, BN, NT>(dOs + buf * BN * L, dout, cb.pk, m0, nv);
    fbmma::cp_async_commit();
    load_col_scalars(scal(buf), BN, NT, cb.pk, m0, nv, stats, delta, nullptr, nullptr);
  };
  auto body = [&](int64_t it) {
    const int64_t m0 = cb.m_lo + it * BN;
    const int nv = (int)imin(BN, cb.m_hi - m0), buf = (int)(it % 2);
    const ColScalars cs = scal(buf);
    const int cls = g.classify(cb.pk.pos(m0), cb.pk.pos(m0 + nv - 1) + 1, cb.c0, cb.c0 + cb.bn);
    const bool full = cls == 2 && nv == BN;
    float s[MT][NB][4], dp[MT][NB][4];  // transposed: rows keys, columns packed query rows
    zero(s);
    zero(dp);
    gemm_abt<T, D, MT, NB>(s, Ks + warp * 16 * MT * L, Qs + buf * BN * L, lane);
    gemm_abt<T, D, MT, NB>(dp, Vs + warp * 16 * MT * L, dOs + buf * BN * L, lane);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2, c = nb * 8 + 2 * tq + e % 2;
          const bool ok =
              tr.valid[mt][h] &&
              (full || (c < nv && (cls == 2 || g.visible(cb.pk.pos(m0 + c),
                                                         cb.c0 + tr.local[mt][h]))));
          const float p = prob(s[mt][nb][e], scale2, cs.m2[c], cs.il[c], ok);
          s[mt][nb][e] = p;
          dp[mt][nb][e] = p * (dp[mt][nb][e] - cs.dl[c]);  // dSᵀ
        }
    uint32_t f[MT][NB / 2][4];
    to_afrag<T, MT, NB>(f, s);
    gemm_ab<T, D, MT, NB / 2>(dv_acc, f, dOs + buf * BN * L, lane);
    to_afrag<T, MT, NB>(f, dp);
    gemm_ab<T, D, MT, NB / 2>(dk_acc, f, Qs + buf * BN * L, lane);
  };
  stream_tiles(n_tiles, issue, body);

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!tr.valid[mt][h]) continue;
      const int64_t x = (cb.kv0 + tr.local[mt][h]) * D;
#pragma unroll
      for (int db = 0; db < DB; ++db) {
        store2(dk + x + db * 8 + 2 * tq, dk_acc[mt][db][2 * h] * g.scale,
               dk_acc[mt][db][2 * h + 1] * g.scale);
        store2(dv + x + db * 8 + 2 * tq, dv_acc[mt][db][2 * h], dv_acc[mt][db][2 * h + 1]);
      }
    }
}

// ------------------------------------------------------------------------------- BoB
// The four score tiles of the BoB, for a warp's rows: s = A_s·B_sᵀ (S), dp (dP), f (F unscaled,
// sum of two products, each skipped when its tangent is absent), c (C). Row passes pass
// (Q, K), (dO, V), (U_Q, K) + (Q, U_K), (dO, U_V); column passes the transposes
// (K, Q), (V, dO), (K, U_Q) + (U_K, Q), (U_V, dO).
template <typename T, int D, int MT, int NB>
__device__ __forceinline__ void bob_scores(float (&s)[MT][NB][4], float (&dp)[MT][NB][4],
                                           float (&f)[MT][NB][4], float (&c)[MT][NB][4],
                                           const T* sA, const T* sB, const T* dpA, const T* dpB,
                                           const T* f1A, const T* f1B, const T* f2A,
                                           const T* f2B, const T* cA, const T* cB, bool has_f1,
                                           bool has_f2, bool has_c, int lane) {
  zero(s);
  zero(dp);
  zero(f);
  zero(c);
  gemm_abt<T, D, MT, NB>(s, sA, sB, lane);
  gemm_abt<T, D, MT, NB>(dp, dpA, dpB, lane);
  if (has_f1) gemm_abt<T, D, MT, NB>(f, f1A, f1B, lane);
  if (has_f2) gemm_abt<T, D, MT, NB>(f, f2A, f2B, lane);
  if (has_c) gemm_abt<T, D, MT, NB>(c, cA, cB, lane);
}

// Shared-memory layout of the two BoB row passes: own Q, dO, U_Q; streamed K, V, U_K, U_V.
template <typename T, int D, class TL>
struct BobRowSmem {
  static constexpr int L = Smem<D>::LDS;
  T *Qs, *dOs, *UQs, *Ks, *Vs, *UKs, *UVs;
  __device__ explicit BobRowSmem(unsigned char* smem) {
    Qs = reinterpret_cast<T*>(smem);
    dOs = Qs + TL::BM * L;
    UQs = dOs + TL::BM * L;
    Ks = UQs + TL::BM * L;  // each streamed operand: [2][BN * L]
    Vs = Ks + 2 * TL::BN * L;
    UKs = Vs + 2 * TL::BN * L;
    UVs = UKs + 2 * TL::BN * L;
  }
  static constexpr size_t bytes() {
    return Smem<D>::template tile_bytes<T>(3 * TL::BM + 8 * TL::BN);
  }
};

// Row pass of the BoB, two modes sharing the score code:
//   STATS = true : bob_stats_kernel, writes D, α, E° of every row;
//   STATS = false: bob_row_kernel, reads them and writes Q̄, dŌ.
template <typename T, int D, class TL, bool STATS>
__device__ __forceinline__ void bob_row_pass(const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const T* __restrict__ o,
                                             const float* __restrict__ stats,
                                             const T* __restrict__ dout, const T* __restrict__ uq,
                                             const T* __restrict__ uk, const T* __restrict__ uv,
                                             T* __restrict__ qbar, T* __restrict__ dobar,
                                             float* __restrict__ delta,
                                             float* __restrict__ alpha, float* __restrict__ e0,
                                             const Geo& g) {
  constexpr int L = Smem<D>::LDS, MT = TL::MT, NB = TL::NB, BM = TL::BM, BN = TL::BN,
                NT = TL::NT, DB = STATS ? 1 : D / 8;
  FB_DYNAMIC_SMEM(smem);
  const BobRowSmem<T, D, TL> sm(smem);
  const bool has_uq = uq != nullptr, has_uk = uk != nullptr, has_uv = uv != nullptr;
  const bool has_f = has_uq || has_uk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
  const RowBlock rb = row_block(g, BM);
  const int64_t kv = rb.kv0 * D;
  const float scale2 = g.scale * kLog2e;
  const ThreadRows<MT> tr = thread_rows<MT>(warp, lane, rb.bm);
  int64_t ri[MT][2], pos[MT][2];
  float m2[MT][2], il[MT][2], dl[MT][2], al[MT][2], ee[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const bool ok = tr.valid[mt][h];
      const int64_t i = rb.pk.row(rb.m0 + tr.local[mt][h]);
      ri[mt][h] = i;
      pos[mt][h] = rb.pk.pos(rb.m0 + tr.local[mt][h]);
      m2[mt][h] = ok ? stats[i * 2] : INFINITY;
      il[mt][h] = ok ? stats[i * 2 + 1] : 0.f;
      al[mt][h] = (!STATS && ok) ? alpha[i] : 0.f;  // STATS: running sums
      ee[mt][h] = (!STATS && ok) ? e0[i] : 0.f;
      if (!STATS) dl[mt][h] = ok ? delta[i] : 0.f;
    }
  load_packed_async<T, D, BM, NT>(sm.Qs, q, rb.pk, rb.m0, rb.bm);
  load_packed_async<T, D, BM, NT>(sm.dOs, dout, rb.pk, rb.m0, rb.bm);
  if (has_uq) load_packed_async<T, D, BM, NT>(sm.UQs, uq, rb.pk, rb.m0, rb.bm);
  fbmma::cp_async_commit();
  if (STATS) row_delta<T, D, MT>(dl, o, dout, ri, tr, lane);

  float qacc[MT][DB][4], oacc[MT][DB][4];  // Q̄/τ and dŌ + α∘O (row kernel only)
  zero(qacc);
  zero(oacc);
  const int64_t n_tiles = (rb.c_hi - rb.c_lo + BN - 1) / BN;
  auto issue = [&](int64_t it) {
    const int64_t c0 = rb.c_lo + it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = (int)(it % 2);
    load_rows_async<T, D, BN, NT>(sm.Ks + buf * BN * L, k + kv + c0 * D, bn);
    load_rows_async<T, D, BN, NT>(sm.Vs + buf * BN * L, v + kv + c0 * D, bn);
    if (has_uk) load_rows_async<T, D, BN, NT>(sm.UKs + buf * BN * L, uk + kv + c0 * D, bn);
    if (has_uv) load_rows_async<T, D, BN, NT>(sm.UVs + buf * BN * L, uv + kv + c0 * D, bn);
    fbmma::cp_async_commit();
  };
  auto body = [&](int64_t it) {
    const int64_t c0 = rb.c_lo + it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = (int)(it % 2);
    const int cls = g.classify(rb.p_lo, rb.p_hi, c0, c0 + bn);
    const bool full = cls == 2 && bn == BN;
    const T* Kb = sm.Ks + buf * BN * L;
    const T* Vb = sm.Vs + buf * BN * L;
    const T* UKb = sm.UKs + buf * BN * L;
    const T* UVb = sm.UVs + buf * BN * L;
    const int wr = warp * 16 * MT * L;
    float s[MT][NB][4], dp[MT][NB][4], f[MT][NB][4], c[MT][NB][4];
    bob_scores<T, D, MT, NB>(s, dp, f, c, sm.Qs + wr, Kb, sm.dOs + wr, Vb, sm.UQs + wr, Kb,
                             sm.Qs + wr, UKb, sm.dOs + wr, UVb, has_uq, has_uk, has_uv, lane);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2, col = nb * 8 + 2 * tq + e % 2;
          const bool ok = tr.valid[mt][h] &&
                          (full || (col < bn && (cls == 2 || g.visible(pos[mt][h], c0 + col))));
          const float p = prob(s[mt][nb][e], scale2, m2[mt][h], il[mt][h], ok);
          const float dps = dp[mt][nb][e] - dl[mt][h];
          const float fs = f[mt][nb][e] * g.scale;
          const float pb0 = c[mt][nb][e] + fs * dps;  // P̄° = C + F∘(dP − D)
          if constexpr (STATS) {
            al[mt][h] += p * fs;   // α (this lane's partial)
            ee[mt][h] += p * pb0;  // E°
          } else {
            s[mt][nb][e] = p;                                                // P
            dp[mt][nb][e] = p * dps;                                         // dS
            f[mt][nb][e] = p * fs;                                           // P∘F
            c[mt][nb][e] = p * (pb0 - al[mt][h] * dps - ee[mt][h]);          // S̄
          }
        }
    if constexpr (!STATS) {
      uint32_t fr[MT][NB / 2][4];
      to_afrag<T, MT, NB>(fr, c);
      gemm_ab<T, D, MT, NB / 2>(qacc, fr, Kb, lane);
      if (has_uk) {
        to_afrag<T, MT, NB>(fr, dp);
        gemm_ab<T, D, MT, NB / 2>(qacc, fr, UKb, lane);
      }
      if (has_uv) {
        to_afrag<T, MT, NB>(fr, s);
        gemm_ab<T, D, MT, NB / 2>(oacc, fr, UVb, lane);
      }
      if (has_f) {
        to_afrag<T, MT, NB>(fr, f);
        gemm_ab<T, D, MT, NB / 2>(oacc, fr, Vb, lane);
      }
    }
  };
  stream_tiles(n_tiles, issue, body);

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (STATS) {
        const float a_row = quad_sum(al[mt][h]), e_row = quad_sum(ee[mt][h]);
        if (tr.valid[mt][h] && tq == 0) {
          delta[ri[mt][h]] = dl[mt][h];
          alpha[ri[mt][h]] = a_row;
          e0[ri[mt][h]] = e_row;
        }
        continue;
      }
      if (!tr.valid[mt][h]) continue;
      const int64_t x = ri[mt][h] * D;
#pragma unroll
      for (int db = 0; db < DB; ++db) {
        const int col = db * 8 + 2 * tq;
        store2(qbar + x + col, g.scale * qacc[mt][db][2 * h], g.scale * qacc[mt][db][2 * h + 1]);
        store2(dobar + x + col, oacc[mt][db][2 * h] - al[mt][h] * to_f(o[x + col]),
               oacc[mt][db][2 * h + 1] - al[mt][h] * to_f(o[x + col + 1]));
      }
    }
}

template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT) bob_stats_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ o, const float* __restrict__ stats, const T* __restrict__ dout,
    const T* __restrict__ uq, const T* __restrict__ uk, const T* __restrict__ uv,
    float* __restrict__ delta, float* __restrict__ alpha, float* __restrict__ e0, Geo g) {
  bob_row_pass<T, D, TL, true>(q, k, v, o, stats, dout, uq, uk, uv, nullptr, nullptr, delta,
                               alpha, e0, g);
}

template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT) bob_row_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ o, const float* __restrict__ stats, const T* __restrict__ dout,
    const T* __restrict__ uq, const T* __restrict__ uk, const T* __restrict__ uv,
    T* __restrict__ qbar, T* __restrict__ dobar, float* __restrict__ delta,
    float* __restrict__ alpha, float* __restrict__ e0, Geo g) {
  bob_row_pass<T, D, TL, false>(q, k, v, o, stats, dout, uq, uk, uv, qbar, dobar, delta, alpha,
                                e0, g);
}

// Shared-memory layout of the BoB column pass: own K, V, U_K, U_V; streamed Q, dO, U_Q and the
// five row scalars of each streamed tile.
template <typename T, int D, class TL>
struct BobColSmem {
  static constexpr int L = Smem<D>::LDS;
  T *Ks, *Vs, *UKs, *UVs, *Qs, *dOs, *UQs;
  float* sc;  // [5][2][BN]: m2, 1/l, D, α, E°
  __device__ explicit BobColSmem(unsigned char* smem) {
    Ks = reinterpret_cast<T*>(smem);
    Vs = Ks + TL::BM * L;
    UKs = Vs + TL::BM * L;
    UVs = UKs + TL::BM * L;
    Qs = UVs + TL::BM * L;  // each streamed operand: [2][BN * L]
    dOs = Qs + 2 * TL::BN * L;
    UQs = dOs + 2 * TL::BN * L;
    sc = reinterpret_cast<float*>(UQs + 2 * TL::BN * L);
  }
  static constexpr size_t bytes() {
    return Smem<D>::template tile_bytes<T>(4 * TL::BM + 6 * TL::BN) + 10 * TL::BN * sizeof(float);
  }
};

template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT) bob_col_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ stats, const T* __restrict__ dout, const T* __restrict__ uq,
    const T* __restrict__ uk, const T* __restrict__ uv, const float* __restrict__ delta,
    const float* __restrict__ alpha, const float* __restrict__ e0, T* __restrict__ kbar,
    T* __restrict__ vbar, Geo g) {
  constexpr int L = Smem<D>::LDS, MT = TL::MT, NB = TL::NB, BM = TL::BM, BN = TL::BN,
                NT = TL::NT, DB = D / 8;
  FB_DYNAMIC_SMEM(smem);
  const BobColSmem<T, D, TL> sm(smem);
  const bool has_uq = uq != nullptr, has_uk = uk != nullptr, has_uv = uv != nullptr;
  const bool has_f = has_uq || has_uk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
  const ColBlock cb = col_block(g, BM);
  const float scale2 = g.scale * kLog2e;
  const ThreadRows<MT> tr = thread_rows<MT>(warp, lane, cb.bn);
  load_rows_async<T, D, BM, NT>(sm.Ks, k + cb.kv0 * D, cb.bn);
  load_rows_async<T, D, BM, NT>(sm.Vs, v + cb.kv0 * D, cb.bn);
  if (has_uk) load_rows_async<T, D, BM, NT>(sm.UKs, uk + cb.kv0 * D, cb.bn);
  if (has_uv) load_rows_async<T, D, BM, NT>(sm.UVs, uv + cb.kv0 * D, cb.bn);
  fbmma::cp_async_commit();
  auto scal = [&](int buf) {
    float* s0 = sm.sc + buf * BN;
    return ColScalars{s0, s0 + 2 * BN, s0 + 4 * BN, s0 + 6 * BN, s0 + 8 * BN};
  };

  float kacc[MT][DB][4], vacc[MT][DB][4];
  zero(kacc);
  zero(vacc);
  const int64_t n_tiles = (cb.m_hi - cb.m_lo + BN - 1) / BN;
  auto issue = [&](int64_t it) {
    const int64_t m0 = cb.m_lo + it * BN;
    const int nv = (int)imin(BN, cb.m_hi - m0), buf = (int)(it % 2);
    load_packed_async<T, D, BN, NT>(sm.Qs + buf * BN * L, q, cb.pk, m0, nv);
    load_packed_async<T, D, BN, NT>(sm.dOs + buf * BN * L, dout, cb.pk, m0, nv);
    if (has_uq) load_packed_async<T, D, BN, NT>(sm.UQs + buf * BN * L, uq, cb.pk, m0, nv);
    fbmma::cp_async_commit();
    load_col_scalars(scal(buf), BN, NT, cb.pk, m0, nv, stats, delta, alpha, e0);
  };
  auto body = [&](int64_t it) {
    const int64_t m0 = cb.m_lo + it * BN;
    const int nv = (int)imin(BN, cb.m_hi - m0), buf = (int)(it % 2);
    const ColScalars cs = scal(buf);
    const int cls = g.classify(cb.pk.pos(m0), cb.pk.pos(m0 + nv - 1) + 1, cb.c0, cb.c0 + cb.bn);
    const bool full = cls == 2 && nv == BN;
    const T* Qb = sm.Qs + buf * BN * L;
    const T* dOb = sm.dOs + buf * BN * L;
    const T* UQb = sm.UQs + buf * BN * L;
    const int wr = warp * 16 * MT * L;
    float s[MT][NB][4], dp[MT][NB][4], f[MT][NB][4], c[MT][NB][4];  // transposed tiles
    bob_scores<T, D, MT, NB>(s, dp, f, c, sm.Ks + wr, Qb, sm.Vs + wr, dOb, sm.Ks + wr, UQb,
                             sm.UKs + wr, Qb, sm.UVs + wr, dOb, has_uq, has_uk, has_uv, lane);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2, col = nb * 8 + 2 * tq + e % 2;
          const bool ok =
              tr.valid[mt][h] &&
              (full || (col < nv && (cls == 2 || g.visible(cb.pk.pos(m0 + col),
                                                           cb.c0 + tr.local[mt][h]))));
          const float p = prob(s[mt][nb][e], scale2, cs.m2[col], cs.il[col], ok);
          const float dps = dp[mt][nb][e] - cs.dl[col];
          const float fs = f[mt][nb][e] * g.scale;
          const float pb0 = c[mt][nb][e] + fs * dps;
          const float a = cs.al[col];
          s[mt][nb][e] = p * (fs - a);                               // P∘h
          c[mt][nb][e] = p * (pb0 - a * dps - cs.e0[col]);           // S̄
          dp[mt][nb][e] = p * dps;                                   // dS
        }
    uint32_t fr[MT][NB / 2][4];
    to_afrag<T, MT, NB>(fr, c);
    gemm_ab<T, D, MT, NB / 2>(kacc, fr, Qb, lane);
    if (has_uq) {
      to_afrag<T, MT, NB>(fr, dp);
      gemm_ab<T, D, MT, NB / 2>(kacc, fr, UQb, lane);
    }
    if (has_f) {
      to_afrag<T, MT, NB>(fr, s);
      gemm_ab<T, D, MT, NB / 2>(vacc, fr, dOb, lane);
    }
  };
  stream_tiles(n_tiles, issue, body);

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!tr.valid[mt][h]) continue;
      const int64_t x = (cb.kv0 + tr.local[mt][h]) * D;
#pragma unroll
      for (int db = 0; db < DB; ++db) {
        store2(kbar + x + db * 8 + 2 * tq, kacc[mt][db][2 * h] * g.scale,
               kacc[mt][db][2 * h + 1] * g.scale);
        store2(vbar + x + db * 8 + 2 * tq, vacc[mt][db][2 * h], vacc[mt][db][2 * h + 1]);
      }
    }
}

// ------------------------------------------------------------------------------- launchers
// Tile shapes per kernel and head dim: Tiles<rows owned per block, rows streamed per stage, warps>.
// Starting points sized to the register file (two D-wide fp32 accumulators plus up to four score
// tiles per thread) and to the A100's 163 KB of opt-in shared memory per block (H100/H200: 227
// KB), so the defaults run on every sm_80 / sm_90 part; tune on a GPU. A sweep overrides one with
// a packed decimal BM·10000 + BN·10 + warps at compile time, e.g.
//   DS_TTT_FLASHBOB_NVCC_FLAGS="-DFLASHBOB_TILES_BOB_ROW_D128=1280328"   (BM 128, BN 32, 8 warps)
// (one number, because nvcc splits -D values at commas).
template <int PACKED>
using TilesOf = Tiles<PACKED / 10000, (PACKED / 10) % 1000, PACKED % 10>;
#ifndef FLASHBOB_TILES_FWD_D64
#define FLASHBOB_TILES_FWD_D64 1280644
#endif
#ifndef FLASHBOB_TILES_BWD_ROW_D64
#define FLASHBOB_TILES_BWD_ROW_D64 640644
#endif
#ifndef FLASHBOB_TILES_BWD_COL_D64
#define FLASHBOB_TILES_BWD_COL_D64 640644
#endif
#ifndef FLASHBOB_TILES_BOB_STATS_D64
#define FLASHBOB_TILES_BOB_STATS_D64 640644
#endif
#ifndef FLASHBOB_TILES_BOB_ROW_D64
#define FLASHBOB_TILES_BOB_ROW_D64 640324
#endif
#ifndef FLASHBOB_TILES_BOB_COL_D64
#define FLASHBOB_TILES_BOB_COL_D64 640324
#endif
#ifndef FLASHBOB_TILES_FWD_D128
#define FLASHBOB_TILES_FWD_D128 640644
#endif
#ifndef FLASHBOB_TILES_BWD_ROW_D128
#define FLASHBOB_TILES_BWD_ROW_D128 640644
#endif
#ifndef FLASHBOB_TILES_BWD_COL_D128
#define FLASHBOB_TILES_BWD_COL_D128 640324
#endif
#ifndef FLASHBOB_TILES_BOB_STATS_D128
#define FLASHBOB_TILES_BOB_STATS_D128 640324
#endif
#ifndef FLASHBOB_TILES_BOB_ROW_D128
#define FLASHBOB_TILES_BOB_ROW_D128 640324
#endif
#ifndef FLASHBOB_TILES_BOB_COL_D128
#define FLASHBOB_TILES_BOB_COL_D128 640324
#endif
template <int D>
struct Shapes;
template <>
struct Shapes<64> {
  using Fwd = TilesOf<FLASHBOB_TILES_FWD_D64>;
  using BwdRow = TilesOf<FLASHBOB_TILES_BWD_ROW_D64>;
  using BwdCol = TilesOf<FLASHBOB_TILES_BWD_COL_D64>;
  using BobStats = TilesOf<FLASHBOB_TILES_BOB_STATS_D64>;
  using BobRow = TilesOf<FLASHBOB_TILES_BOB_ROW_D64>;
  using BobCol = TilesOf<FLASHBOB_TILES_BOB_COL_D64>;
};
template <>
struct Shapes<128> {
  using Fwd = TilesOf<FLASHBOB_TILES_FWD_D128>;
  using BwdRow = TilesOf<FLASHBOB_TILES_BWD_ROW_D128>;
  using BwdCol = TilesOf<FLASHBOB_TILES_BWD_COL_D128>;
  using BobStats = TilesOf<FLASHBOB_TILES_BOB_STATS_D128>;
  using BobRow = TilesOf<FLASHBOB_TILES_BOB_ROW_D128>;
  using BobCol = TilesOf<FLASHBOB_TILES_BOB_COL_D128>;
};

// Shared memory every kernel's shape must fit (checked at compile time): the A100's opt-in limit
// per block, the smallest of the targets. A sweep for H100/H200 only may raise it to 227 KB with
// -DFLASHBOB_SMEM_LIMIT_KB=227.
#ifndef FLASHBOB_SMEM_LIMIT_KB
#define FLASHBOB_SMEM_LIMIT_KB 163
#endif
constexpr size_t kSmemLimit = (size_t)FLASHBOB_SMEM_LIMIT_KB * 1024;

// The kernel each launcher enqueued last, for error messages: a launch error, or (under
// CUDA_LAUNCH_BLOCKING=1, where every launch waits for its kernel) an execution fault, surfaces at
// the cudaGetLastError right after that kernel, so the binding names it instead of the launcher.
thread_local const char* g_last_kernel = "none";

// Kernels may use more than 48 KB of dynamic shared memory: opt in per kernel before launching.
template <typename K>
cudaError_t allow_smem(K kernel, size_t smem) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
}

template <class TL>
dim3 row_grid(const Geo& g) {
  return dim3((unsigned)((g.G * g.Nq + TL::BM - 1) / TL::BM), (unsigned)(g.B * g.Hkv));
}
template <class TL>
dim3 col_grid(const Geo& g) {
  return dim3((unsigned)((g.Nk + TL::BM - 1) / TL::BM), (unsigned)(g.B * g.Hkv));
}

template <typename T, int D>
cudaError_t fwd_t(const void* q, const void* k, const void* v, void* o, float* stats, const Geo& g,
                  cudaStream_t st) {
  using TL = typename Shapes<D>::Fwd;
  constexpr int NT = TL::NT;
  constexpr size_t smem = Smem<D>::template tile_bytes<T>(TL::BM + 4 * TL::BN);
  static_assert(smem <= kSmemLimit, "tile shape exceeds FLASHBOB_SMEM_LIMIT_KB");
  auto kern = fwd_kernel<T, D, TL>;
  g_last_kernel = "fwd_kernel";
  cudaError_t err = allow_smem(kern, smem);
  if (err != cudaSuccess) return err;
  FB_LAUNCH(kern, row_grid<TL>(g), smem, st, (const T*)q, (const T*)k, (const T*)v, (T*)o, stats,
            g);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t bwd_t(const void* q, const void* k, const void* v, const void* o, const float* stats,
                  const void* dout, void* dq, void* dk, void* dv, float* delta, const Geo& g,
                  cudaStream_t st) {
  cudaError_t err;
  {
    using TL = typename Shapes<D>::BwdRow;
    constexpr int NT = TL::NT;
    constexpr size_t smem = Smem<D>::template tile_bytes<T>(2 * TL::BM + 4 * TL::BN);
    static_assert(smem <= kSmemLimit, "tile shape exceeds FLASHBOB_SMEM_LIMIT_KB");
    auto kern = bwd_row_kernel<T, D, TL>;
    g_last_kernel = "bwd_row_kernel";
    if ((err = allow_smem(kern, smem)) != cudaSuccess) return err;
    FB_LAUNCH(kern, row_grid<TL>(g), smem, st, (const T*)q, (const T*)k, (const T*)v,
              (const T*)o, stats, (const T*)dout, (T*)dq, delta, g);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  {
    using TL = typename Shapes<D>::BwdCol;
    constexpr int NT = TL::NT;
    constexpr size_t smem =
        Smem<D>::template tile_bytes<T>(2 * TL::BM + 4 * TL::BN) + 6 * TL::BN * sizeof(float);
    static_assert(smem <= kSmemLimit, "tile shape exceeds FLASHBOB_SMEM_LIMIT_KB");
    auto kern = bwd_col_kernel<T, D, TL>;
    g_last_kernel = "bwd_col_kernel";
    if ((err = allow_smem(kern, smem)) != cudaSuccess) return err;
    FB_LAUNCH(kern, col_grid<TL>(g), smem, st, (const T*)q, (const T*)k, (const T*)v, stats,
              (const T*)dout, (const float*)delta, (T*)dk, (T*)dv, g);
  }
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t bwd_bwd_t(const void* q, const void* k, const void* v, const void* o,
                      const float* stats, const void* dout, const void* uq, const void* uk,
                      const void* uv, void* qbar, void* kbar, void* vbar, void* dobar,
                      float* delta, float* alpha, float* e0, const Geo& g, cudaStream_t st) {
  cudaError_t err;
  {
    using TL = typename Shapes<D>::BobStats;
    constexpr int NT = TL::NT;
    constexpr size_t smem = BobRowSmem<T, D, TL>::bytes();
    static_assert(smem <= kSmemLimit, "tile shape exceeds FLASHBOB_SMEM_LIMIT_KB");
    auto kern = bob_stats_kernel<T, D, TL>;
    g_last_kernel = "bob_stats_kernel";
    if ((err = allow_smem(kern, smem)) != cudaSuccess) return err;
    FB_LAUNCH(kern, row_grid<TL>(g), smem, st, (const T*)q, (const T*)k, (const T*)v,
              (const T*)o, stats, (const T*)dout, (const T*)uq, (const T*)uk, (const T*)uv, delta,
              alpha, e0, g);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  {
    using TL = typename Shapes<D>::BobRow;
    constexpr int NT = TL::NT;
    constexpr size_t smem = BobRowSmem<T, D, TL>::bytes();
    static_assert(smem <= kSmemLimit, "tile shape exceeds FLASHBOB_SMEM_LIMIT_KB");
    auto kern = bob_row_kernel<T, D, TL>;
    g_last_kernel = "bob_row_kernel";
    if ((err = allow_smem(kern, smem)) != cudaSuccess) return err;
    FB_LAUNCH(kern, row_grid<TL>(g), smem, st, (const T*)q, (const T*)k, (const T*)v,
              (const T*)o, stats, (const T*)dout, (const T*)uq, (const T*)uk, (const T*)uv,
              (T*)qbar, (T*)dobar, delta, alpha, e0, g);
    if ((err = cudaGetLastError()) != cudaSuccess) return err;
  }
  {
    using TL = typename Shapes<D>::BobCol;
    constexpr int NT = TL::NT;
    constexpr size_t smem = BobColSmem<T, D, TL>::bytes();
    static_assert(smem <= kSmemLimit, "tile shape exceeds FLASHBOB_SMEM_LIMIT_KB");
    auto kern = bob_col_kernel<T, D, TL>;
    g_last_kernel = "bob_col_kernel";
    if ((err = allow_smem(kern, smem)) != cudaSuccess) return err;
    FB_LAUNCH(kern, col_grid<TL>(g), smem, st, (const T*)q, (const T*)k, (const T*)v, stats,
              (const T*)dout, (const T*)uq, (const T*)uk, (const T*)uv, (const float*)delta,
              (const float*)alpha, (const float*)e0, (T*)kbar, (T*)vbar, g);
  }
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

const char* last_launched_kernel() { return g_last_kernel; }

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
