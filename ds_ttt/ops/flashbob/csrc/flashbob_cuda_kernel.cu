// FlashBoB CUDA kernels on tensor cores: forward, first backward and backward-over-backward.
//
// Math and notation: docs/flashbob_math.md and docs/flashbob.md. Kernels, each a
// pass over one (batch, kv head) group; "row" passes own a block of packed query rows and
// stream key tiles, "column" passes own a block of keys and stream packed query-row tiles:
//   fwd_kernel        row     -> O, stats (m2, 1/l)                 2 GEMMs per tile pair
//   bwd_row_kernel    row     -> dQ, D = <dO, O>                    3
//   bwd_col_kernel    column  -> dK, dV                             4
//   bob_stats_kernel  row     -> D, α = Σ P∘F, E° = Σ P∘P̄°, dŌ = P·U_V + (P∘F)·V − α∘O    5 + 2
//   bob_row_kernel    row     -> Q̄ = τ(S̄·K + dS·U_K)                                     5 + 2
//   bob_col_kernel    column  -> K̄ = τ(S̄ᵀ·Q + dSᵀ·U_Q), V̄ = (P∘h)ᵀ·dO                   5 + 3
// with S̄ = P∘(P̄° − α·(dP − D) − E°) = P∘(P̄ − E). The BoB runs the row-scalar pass first so that
// both output passes can form S̄ per element in fp32 before any rounding: Q̄ and K̄ are then plain
// sums of products (no Ω − α∘R − E°∘B cancellation of separately rounded tiles). dŌ needs no E°
// and α only in its last term, so the scalar pass also forms it; then each row pass keeps one
// D-wide accumulator and the column pass two, which fits the register file at D = 128 without
// spilling (benchmarks/gpu/logs/cuobjdump_resource_usage.txt). The five score products of a tile
// share the fragments of the operands they have in common (bob_scores).
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
// Tile shapes are template parameters (Tiles<BM, BN, warps, ARCH>), grouped into tile sets
// (Shapes<set, D> below): "sm80" (64-row blocks of 4 warps, every sm_80/sm_90 part) and "sm90"
// (128-row blocks of 8 warps, compiled for sm_90 only), picked at run time from the device, plus
// two sets for benchmarks/gpu's tile-shape sweep. None has been measured on a GPU yet.
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

#include <atomic>
#include <cmath>
#include <cstdint>
#include <string>
#include <type_traits>

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

__device__ __forceinline__ int64_t floor_div(int64_t a, int64_t b) {  // b > 0
  return a >= 0 ? a / b : -((-a + b - 1) / b);
}

// The iterations [lo, hi) of a row block's key stream (tile it = keys c_lo + it·BN ...) whose
// tiles are fully visible and full-sized, so they skip the per-element mask. Worked out once per
// block from Geo's rule (Geo::classify) as two 32-bit bounds, rather than classifying each tile
// from the block's 64-bit positions: those stayed live across the key loop, and at D = 128 the
// BoB row kernel spilled one.
struct FullTiles {
  int lo, hi;
  __device__ __forceinline__ bool has(int it) const { return it >= lo && it < hi; }
};
__device__ __forceinline__ FullTiles full_key_tiles(const Geo& g, const RowBlock& rb, int BN,
                                                    int n_tiles) {
  int64_t lo = 0, hi = floor_div(g.Nk - BN - rb.c_lo, BN) + 1;  // c0 + BN <= Nk
  if (g.causal) {
    const int64_t qk = g.q_off - g.k_off;
    // dmin >= 0: the last key is visible to the first row, c0 + BN - 1 <= p_lo + qk
    hi = imin(hi, floor_div(rb.p_lo + qk - BN + 1 - rb.c_lo, BN) + 1);
    // dmax < window: the first key is inside the last row's window, c0 > p_hi - 1 + qk - window
    if (g.window > 0) lo = floor_div(rb.p_hi - 1 + qk - g.window - rb.c_lo, BN) + 1;
  }
  lo = imax(lo, 0);
  hi = imin(hi, n_tiles);
  return FullTiles{(int)lo, (int)imax(hi, lo)};
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

// The same for a column block's stream of packed rows (tile it = rows m_lo + it·BN ...; row m
// has position m / G, so "position >= x" is "m >= G·x").
__device__ __forceinline__ FullTiles full_row_tiles(const Geo& g, const ColBlock& cb, int BN,
                                                    int n_tiles) {
  int64_t lo = 0, hi = floor_div(cb.m_hi - BN - cb.m_lo, BN) + 1;  // m0 + BN <= m_hi
  if (g.causal) {
    const int64_t qk = g.q_off - g.k_off;
    // dmin >= 0: the first row sees the last key, pos(m0) >= c0 + bn - 1 - qk
    const int64_t x = cb.c0 + cb.bn - 1 - qk;
    lo = floor_div(g.G * x - cb.m_lo + BN - 1, BN);
    // dmax < window: the last row's window holds the first key, pos(m0 + BN - 1) <= y
    if (g.window > 0) {
      const int64_t y = g.window - 1 + cb.c0 - qk;
      hi = imin(hi, floor_div(g.G * (y + 1) - BN - cb.m_lo, BN) + 1);
    }
  }
  lo = imax(lo, 0);
  hi = imin(hi, n_tiles);
  return FullTiles{(int)lo, (int)imax(hi, lo)};
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
__device__ __forceinline__ void stream_tiles(int n, Issue issue, Body body) {
  if (n > 0) issue(0);
  for (int it = 0; it < n; ++it) {
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
__device__ __forceinline__ void fwd_pass(const T* __restrict__ q,
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
  const int n_tiles = (int)((rb.c_hi - rb.c_lo + BN - 1) / BN);
  const FullTiles ft = full_key_tiles(g, rb, BN, n_tiles);
  auto issue = [&](int it) {
    const int64_t c0 = rb.c_lo + (int64_t)it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = it % 2;
    load_rows_async<T, D, BN, NT>(Ks + buf * BN * L, K + c0 * D, bn);
    load_rows_async<T, D, BN, NT>(Vs + buf * BN * L, V + c0 * D, bn);
    fbmma::cp_async_commit();
  };
  auto body = [&](int it) {
    const int64_t c0 = rb.c_lo + (int64_t)it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = it % 2;
    const bool full = ft.has(it);
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
                            (full || (c < bn && g.visible(pos[mt][h], c0 + c)));
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

template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT, 1) fwd_kernel(const T* __restrict__ q,
                                                     const T* __restrict__ k,
                                                     const T* __restrict__ v, T* __restrict__ o,
                                                     float* __restrict__ stats, Geo g) {
  if constexpr (compiled_here<TL>())
    fwd_pass<T, D, TL>(q, k, v, o, stats, g);
  else
    not_compiled_here();
}

// ------------------------------------------------------------------------------- first backward
template <typename T, int D, class TL>
__device__ __forceinline__ void bwd_row_pass(
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
  const int n_tiles = (int)((rb.c_hi - rb.c_lo + BN - 1) / BN);
  const FullTiles ft = full_key_tiles(g, rb, BN, n_tiles);
  auto issue = [&](int it) {
    const int64_t c0 = rb.c_lo + (int64_t)it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = it % 2;
    load_rows_async<T, D, BN, NT>(Ks + buf * BN * L, K + c0 * D, bn);
    load_rows_async<T, D, BN, NT>(Vs + buf * BN * L, V + c0 * D, bn);
    fbmma::cp_async_commit();
  };
  auto body = [&](int it) {
    const int64_t c0 = rb.c_lo + (int64_t)it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = it % 2;
    const bool full = ft.has(it);
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
                          (full || (c < bn && g.visible(pos[mt][h], c0 + c)));
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

template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT, 1) bwd_row_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ o, const float* __restrict__ stats, const T* __restrict__ dout,
    T* __restrict__ dq, float* __restrict__ delta, Geo g) {
  if constexpr (compiled_here<TL>())
    bwd_row_pass<T, D, TL>(q, k, v, o, stats, dout, dq, delta, g);
  else
    not_compiled_here();
}

// Per-row fp32 scalars of a tile of packed rows, in shared memory: st holds the row stats as pairs
// (m2, 1/l), 2·n floats; dl, al, e0 hold D, α, E° (null where a pass does not read them). The
// column passes keep one per streamed tile, the BoB row kernel one for its own rows.
// load_row_scalars issues them as cp.async copies (8 bytes per stats pair, 4 per scalar) into
// the caller's open group, so they arrive with the tile's rows instead of stalling every thread
// on a synchronous gather; rows >= nvalid are zero-filled, and 1/l = 0 gives P = 0.
struct RowScalars {
  float *st, *dl, *al, *e0;
  __device__ __forceinline__ float m2(int r) const { return st[2 * r]; }
  __device__ __forceinline__ float il(int r) const { return st[2 * r + 1]; }
  // floats for n rows: st, dl and (BoB) al, e0
  static constexpr int floats(int n, bool bob) { return (bob ? 5 : 3) * n; }
  __device__ static RowScalars at(float* base, int n, bool bob) {
    return RowScalars{base, base + 2 * n, bob ? base + 3 * n : nullptr,
                      bob ? base + 4 * n : nullptr};
  }
};
__device__ __forceinline__ void load_row_scalars(const RowScalars& cs, int n, int NT,
                                                 const Packed& pk, int64_t m0, int nvalid,
                                                 const float* stats, const float* delta,
                                                 const float* alpha, const float* e0) {
  for (int r = threadIdx.x; r < n; r += NT) {
    const bool ok = r < nvalid;
    const int64_t i = ok ? pk.row(m0 + r) : 0;
    fbmma::cp_async_8_zfill(cs.st + 2 * r, stats + 2 * i, ok);
    if (cs.dl) fbmma::cp_async_4_zfill(cs.dl + r, delta + i, ok);
    if (cs.al) fbmma::cp_async_4_zfill(cs.al + r, alpha + i, ok);
    if (cs.e0) fbmma::cp_async_4_zfill(cs.e0 + r, e0 + i, ok);
  }
}

template <typename T, int D, class TL>
__device__ __forceinline__ void bwd_col_pass(
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
  float* sc = reinterpret_cast<float*>(dOs + 2 * BN * L);  // [2][RowScalars::floats(BN)]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
  const ColBlock cb = col_block(g, BM);
  const float scale2 = g.scale * kLog2e;
  const ThreadRows<MT> tr = thread_rows<MT>(warp, lane, cb.bn);
  load_rows_async<T, D, BM, NT>(Ks, k + cb.kv0 * D, cb.bn);
  load_rows_async<T, D, BM, NT>(Vs, v + cb.kv0 * D, cb.bn);
  fbmma::cp_async_commit();
  auto scal = [&](int buf) {
    return RowScalars::at(sc + buf * RowScalars::floats(BN, false), BN, false);
  };

  float dk_acc[MT][DB][4], dv_acc[MT][DB][4];
  zero(dk_acc);
  zero(dv_acc);
  const int n_tiles = (int)((cb.m_hi - cb.m_lo + BN - 1) / BN);
  const FullTiles ft = full_row_tiles(g, cb, BN, n_tiles);
  auto issue = [&](int it) {
    const int64_t m0 = cb.m_lo + (int64_t)it * BN;
    const int nv = (int)imin(BN, cb.m_hi - m0), buf = it % 2;
    load_packed_async<T, D, BN, NT>(Qs + buf * BN * L, q, cb.pk, m0, nv);
    load_packed_async<T, D, BN, NT>(dOs + buf * BN * L, dout, cb.pk, m0, nv);
    load_row_scalars(scal(buf), BN, NT, cb.pk, m0, nv, stats, delta, nullptr, nullptr);
    fbmma::cp_async_commit();
  };
  auto body = [&](int it) {
    const int64_t m0 = cb.m_lo + (int64_t)it * BN;
    const int nv = (int)imin(BN, cb.m_hi - m0), buf = it % 2;
    const RowScalars cs = scal(buf);
    const bool full = ft.has(it);
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
              (full || (c < nv && g.visible(cb.pk.pos(m0 + c), cb.c0 + tr.local[mt][h])));
          const float p = prob(s[mt][nb][e], scale2, cs.m2(c), cs.il(c), ok);
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

template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT, 1) bwd_col_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ stats, const T* __restrict__ dout, const float* __restrict__ delta,
    T* __restrict__ dk, T* __restrict__ dv, Geo g) {
  if constexpr (compiled_here<TL>())
    bwd_col_pass<T, D, TL>(q, k, v, stats, dout, delta, dk, dv, g);
  else
    not_compiled_here();
}

// ------------------------------------------------------------------------------- BoB
// The BoB's score tiles for a warp's rows: s = S, dp = dP, f = F unscaled (two products, each
// skipped when its tangent is absent) and, with WITH_C, c = C. A holds the warp's own rows of the
// block's operands (at the warp's first row), B the streamed tile's:
//   row pass (ROW):   A = {Q, dO, U_Q},  B = {K, V, U_K, U_V}
//   column pass:      A = {K, V, U_K},   B = {Q, dO, U_Q}
// so that in both S = A0·B0ᵀ, F = A2·B0ᵀ + A0·B2ᵀ, dP = A1·B1ᵀ, and C = A1·B3ᵀ (row pass only).
// Fragments that two products share are loaded once per k-step instead of once per product: A0
// and B0 (S and F), and in the row pass A1 (dP and C). Two sweeps over k: S and F (holding A0,
// A2), then dP and C (holding A1), so at most two A fragments per m-tile are live while B
// fragments stream; each B fragment dies after its (at most two) mma. With every tangent a
// k-step issues 3·MT + 4·NB/2 ldmatrix.x4 (row, with C) or 3·MT + 3·NB/2 (without C) for its
// mma, where one GEMM per product issued (MT + NB/2) per product.
template <typename T, int D, int MT, int NB, bool ROW, bool WITH_C>
__device__ __forceinline__ void bob_scores(float (&s)[MT][NB][4], float (&dp)[MT][NB][4],
                                           float (&f)[MT][NB][4], float (&c)[MT][NB][4],
                                           const T* A0, const T* A1, const T* A2, const T* B0,
                                           const T* B1, const T* B2, const T* B3, bool has_uq,
                                           bool has_uk, bool has_uv, int lane) {
  static_assert(NB % 2 == 0, "score tiles have an even number of 8-column blocks");
  static_assert(ROW || !WITH_C, "the column pass computes C on its own (bob_col_kernel)");
  constexpr int L = Smem<D>::LDS;
  // A2 carries U_Q (row) / U_K (column) and meets B0; B2 the other one, and meets A0.
  const bool use_a2 = ROW ? has_uq : has_uk, use_b2 = ROW ? has_uk : has_uq;
  const bool use_c = WITH_C && has_uv;
  zero(s);
  zero(dp);
  zero(f);
  if constexpr (WITH_C) zero(c);
  const int a_off = ((lane % 8) + 8 * ((lane / 8) % 2)) * L + 8 * (lane / 16);
  const int b_off = ((lane % 8) + 8 * (lane / 16)) * L + 8 * ((lane / 8) % 2);
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 16) {  // S and F
    uint32_t a0[MT][4], a2[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      const int o = mt * 16 * L + k0 + a_off;
      fbmma::ldmatrix_x4(a0[mt][0], a0[mt][1], a0[mt][2], a0[mt][3], A0 + o);
      if (use_a2) fbmma::ldmatrix_x4(a2[mt][0], a2[mt][1], a2[mt][2], a2[mt][3], A2 + o);
    }
#pragma unroll
    for (int nb = 0; nb < NB; nb += 2) {
      const int o = nb * 8 * L + k0 + b_off;
      uint32_t b0[2], b1[2];
      fbmma::ldmatrix_x4(b0[0], b0[1], b1[0], b1[1], B0 + o);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        TC<T>::mma(s[mt][nb], a0[mt], b0);
        TC<T>::mma(s[mt][nb + 1], a0[mt], b1);
        if (use_a2) {
          TC<T>::mma(f[mt][nb], a2[mt], b0);
          TC<T>::mma(f[mt][nb + 1], a2[mt], b1);
        }
      }
      if (use_b2) {
        fbmma::ldmatrix_x4(b0[0], b0[1], b1[0], b1[1], B2 + o);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          TC<T>::mma(f[mt][nb], a0[mt], b0);
          TC<T>::mma(f[mt][nb + 1], a0[mt], b1);
        }
      }
    }
  }
#pragma unroll
  for (int k0 = 0; k0 < D; k0 += 16) {  // dP and C
    uint32_t a1[MT][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      fbmma::ldmatrix_x4(a1[mt][0], a1[mt][1], a1[mt][2], a1[mt][3],
                         A1 + mt * 16 * L + k0 + a_off);
#pragma unroll
    for (int nb = 0; nb < NB; nb += 2) {
      const int o = nb * 8 * L + k0 + b_off;
      uint32_t b0[2], b1[2];
      fbmma::ldmatrix_x4(b0[0], b0[1], b1[0], b1[1], B1 + o);
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        TC<T>::mma(dp[mt][nb], a1[mt], b0);
        TC<T>::mma(dp[mt][nb + 1], a1[mt], b1);
      }
      if (use_c) {
        fbmma::ldmatrix_x4(b0[0], b0[1], b1[0], b1[1], B3 + o);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          TC<T>::mma(c[mt][nb], a1[mt], b0);
          TC<T>::mma(c[mt][nb + 1], a1[mt], b1);
        }
      }
    }
  }
}

// Shared-memory layout of the two BoB row passes: own Q, dO, U_Q and the own rows' scalars;
// streamed K, V, U_K, U_V.
template <typename T, int D, class TL>
struct BobRowSmem {
  T *Qs, *dOs, *UQs, *Ks, *Vs, *UKs, *UVs;
  float* sc;  // RowScalars of the block's BM rows
  __device__ explicit BobRowSmem(unsigned char* smem) {
    constexpr int L = Smem<D>::LDS;
    Qs = reinterpret_cast<T*>(smem);
    dOs = Qs + TL::BM * L;
    UQs = dOs + TL::BM * L;
    Ks = UQs + TL::BM * L;  // each streamed operand: [2][BN * L]
    Vs = Ks + 2 * TL::BN * L;
    UKs = Vs + 2 * TL::BN * L;
    UVs = UKs + 2 * TL::BN * L;
    sc = reinterpret_cast<float*>(UVs + 2 * TL::BN * L);
  }
  static constexpr size_t bytes() {
    return Smem<D>::template tile_bytes<T>(3 * TL::BM + 8 * TL::BN) +
           RowScalars::floats(TL::BM, true) * sizeof(float);
  }
};

// Row pass of the BoB, two kernels sharing the score code, each with one D-wide accumulator:
//   STATS = true : bob_stats_kernel, writes D, α, E° of every row and dŌ = P·U_V + (P∘F)·V − α∘O
//                  (neither product needs α or E°, and α is complete at the end of this pass);
//   STATS = false: bob_row_kernel, reads D, α, E° and writes Q̄ = τ(S̄·K + dS·U_K).
// Registers set the shapes at D = 128: with both D-wide accumulators (Q̄ and dŌ) in one kernel,
// as before, the row kernel sat at 255 registers and spilled; split this way each row-pass
// kernel does 7 of the 14 GEMMs per tile pair and keeps 64 fp32 accumulator registers per thread.
template <typename T, int D, class TL, bool STATS>
__device__ __forceinline__ void bob_row_pass(const T* __restrict__ q, const T* __restrict__ k,
                                             const T* __restrict__ v, const T* __restrict__ o,
                                             const float* __restrict__ stats,
                                             const T* __restrict__ dout, const T* __restrict__ uq,
                                             const T* __restrict__ uk, const T* __restrict__ uv,
                                             T* __restrict__ out, float* __restrict__ delta,
                                             float* __restrict__ alpha, float* __restrict__ e0,
                                             const Geo& g) {
  constexpr int L = Smem<D>::LDS, MT = TL::MT, NB = TL::NB, BM = TL::BM, BN = TL::BN,
                NT = TL::NT, DB = D / 8;
  FB_DYNAMIC_SMEM(smem);
  const BobRowSmem<T, D, TL> sm(smem);
  const bool has_uq = uq != nullptr, has_uk = uk != nullptr, has_uv = uv != nullptr;
  const bool has_f = has_uq || has_uk;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, tq = lane % 4;
  const RowBlock rb = row_block(g, BM);
  const int64_t kv = rb.kv0 * D;
  const float scale2 = g.scale * kLog2e;
  const ThreadRows<MT> tr = thread_rows<MT>(warp, lane, rb.bm);
  // Per row: the 32-bit position (G·Nq < 2^31) for the mask; the row scalars (m2, 1/l, and in the
  // row kernel D, α, E°) in shared memory, loaded with the block's rows by cp.async and read per
  // tile; the stats kernel's running sums D, α, E° in registers. Global row indices are
  // recomputed where the epilogue stores.
  int pos[MT][2];
  float dl[MT][2], al[MT][2], ee[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      pos[mt][h] = (int)rb.pk.pos(rb.m0 + tr.local[mt][h]);
      dl[mt][h] = al[mt][h] = ee[mt][h] = 0.f;
    }
  const RowScalars rs = RowScalars::at(sm.sc, BM, true);
  const RowScalars rs_load = STATS ? RowScalars{rs.st, nullptr, nullptr, nullptr} : rs;
  load_packed_async<T, D, BM, NT>(sm.Qs, q, rb.pk, rb.m0, rb.bm);
  load_packed_async<T, D, BM, NT>(sm.dOs, dout, rb.pk, rb.m0, rb.bm);
  if (has_uq) load_packed_async<T, D, BM, NT>(sm.UQs, uq, rb.pk, rb.m0, rb.bm);
  load_row_scalars(rs_load, BM, NT, rb.pk, rb.m0, rb.bm, stats, delta, alpha, e0);
  fbmma::cp_async_commit();
  if constexpr (STATS) {
    int64_t ri[MT][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int h = 0; h < 2; ++h) ri[mt][h] = rb.pk.row(rb.m0 + tr.local[mt][h]);
    row_delta<T, D, MT>(dl, o, dout, ri, tr, lane);
  }

  float acc[MT][DB][4];  // stats kernel: dŌ + α∘O; row kernel: Q̄/τ
  zero(acc);
  const int n_tiles = (int)((rb.c_hi - rb.c_lo + BN - 1) / BN);
  const FullTiles ft = full_key_tiles(g, rb, BN, n_tiles);
  auto issue = [&](int it) {
    const int64_t c0 = rb.c_lo + (int64_t)it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = it % 2;
    load_rows_async<T, D, BN, NT>(sm.Ks + buf * BN * L, k + kv + c0 * D, bn);
    load_rows_async<T, D, BN, NT>(sm.Vs + buf * BN * L, v + kv + c0 * D, bn);
    if (has_uk) load_rows_async<T, D, BN, NT>(sm.UKs + buf * BN * L, uk + kv + c0 * D, bn);
    if (has_uv) load_rows_async<T, D, BN, NT>(sm.UVs + buf * BN * L, uv + kv + c0 * D, bn);
    fbmma::cp_async_commit();
  };
  auto body = [&](int it) {
    const int64_t c0 = rb.c_lo + (int64_t)it * BN;
    const int bn = (int)imin(BN, g.Nk - c0), buf = it % 2;
    const bool full = ft.has(it);
    const T* Kb = sm.Ks + buf * BN * L;
    const T* Vb = sm.Vs + buf * BN * L;
    const T* UKb = sm.UKs + buf * BN * L;
    const T* UVb = sm.UVs + buf * BN * L;
    const int wr = warp * 16 * MT * L;
    float s[MT][NB][4], dp[MT][NB][4], f[MT][NB][4], c[MT][NB][4];
    bob_scores<T, D, MT, NB, true, true>(s, dp, f, c, sm.Qs + wr, sm.dOs + wr, sm.UQs + wr, Kb,
                                         Vb, UKb, UVb, has_uq, has_uk, has_uv, lane);
    // Elementwise in fp32; each 16-column block is rounded into its two A fragments as soon as it
    // is done: (P, P∘F) in the stats kernel, (S̄, dS) in the row kernel.
    uint32_t fr0[MT][NB / 2][4], fr1[MT][NB / 2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2, col = nb * 8 + 2 * tq + e % 2, r = tr.local[mt][h];
          const bool ok = tr.valid[mt][h] && (full || (col < bn && g.visible(pos[mt][h], c0 + col)));
          const float p = prob(s[mt][nb][e], scale2, rs.m2(r), rs.il(r), ok);
          const float fs = f[mt][nb][e] * g.scale;
          if constexpr (STATS) {
            const float dps = dp[mt][nb][e] - dl[mt][h];
            al[mt][h] += p * fs;                      // α (this lane's partial)
            ee[mt][h] += p * (c[mt][nb][e] + fs * dps);  // E°: Σ P∘P̄°, P̄° = C + F∘(dP − D)
            s[mt][nb][e] = p;                         // P
            f[mt][nb][e] = p * fs;                    // P∘F
          } else {
            const float dps = dp[mt][nb][e] - rs.dl[r];
            // S̄ = P∘(P̄° − α·(dP − D) − E°)
            s[mt][nb][e] = p * (c[mt][nb][e] + (fs - rs.al[r]) * dps - rs.e0[r]);
            f[mt][nb][e] = p * dps;  // dS
          }
        }
        if (nb % 2 == 1) {
          pack_afrag<T>(fr0[mt][nb / 2], s[mt][nb - 1], s[mt][nb]);
          pack_afrag<T>(fr1[mt][nb / 2], f[mt][nb - 1], f[mt][nb]);
        }
      }
    if constexpr (STATS) {
      if (has_uv) gemm_ab<T, D, MT, NB / 2>(acc, fr0, UVb, lane);  // P·U_V
      if (has_f) gemm_ab<T, D, MT, NB / 2>(acc, fr1, Vb, lane);    // (P∘F)·V
    } else {
      gemm_ab<T, D, MT, NB / 2>(acc, fr0, Kb, lane);                // S̄·K
      if (has_uk) gemm_ab<T, D, MT, NB / 2>(acc, fr1, UKb, lane);  // dS·U_K
    }
  };
  stream_tiles(n_tiles, issue, body);

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t i = rb.pk.row(rb.m0 + tr.local[mt][h]);
      float a_row = 0.f;
      if constexpr (STATS) {
        a_row = quad_sum(al[mt][h]);
        const float e_row = quad_sum(ee[mt][h]);
        if (tr.valid[mt][h] && tq == 0) {
          delta[i] = dl[mt][h];
          alpha[i] = a_row;
          e0[i] = e_row;
        }
      }
      if (!tr.valid[mt][h]) continue;
      const int64_t x = i * D;
#pragma unroll
      for (int db = 0; db < DB; ++db) {
        const int col = db * 8 + 2 * tq;
        if constexpr (STATS)
          store2(out + x + col, acc[mt][db][2 * h] - a_row * to_f(o[x + col]),
                 acc[mt][db][2 * h + 1] - a_row * to_f(o[x + col + 1]));  // dŌ
        else
          store2(out + x + col, g.scale * acc[mt][db][2 * h],
                 g.scale * acc[mt][db][2 * h + 1]);  // Q̄
      }
    }
}

template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT, 1) bob_stats_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const T* __restrict__ o, const float* __restrict__ stats, const T* __restrict__ dout,
    const T* __restrict__ uq, const T* __restrict__ uk, const T* __restrict__ uv,
    T* __restrict__ dobar, float* __restrict__ delta, float* __restrict__ alpha,
    float* __restrict__ e0, Geo g) {
  if constexpr (compiled_here<TL>())
    bob_row_pass<T, D, TL, true>(q, k, v, o, stats, dout, uq, uk, uv, dobar, delta, alpha, e0, g);
  else
    not_compiled_here();
}

template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT, 1) bob_row_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ stats, const T* __restrict__ dout, const T* __restrict__ uq,
    const T* __restrict__ uk, const T* __restrict__ uv, T* __restrict__ qbar,
    const float* __restrict__ delta, const float* __restrict__ alpha,
    const float* __restrict__ e0, Geo g) {
  // The row kernel only reads the scalars (RowScalars), through pointers the pass also writes in
  // its stats mode; they are never written here.
  if constexpr (compiled_here<TL>())
    bob_row_pass<T, D, TL, false>(q, k, v, nullptr, stats, dout, uq, uk, uv, qbar,
                                  const_cast<float*>(delta), const_cast<float*>(alpha),
                                  const_cast<float*>(e0), g);
  else
    not_compiled_here();
}

// Shared-memory layout of the BoB column pass: own K, V, U_K, U_V; streamed Q, dO, U_Q and the
// five row scalars of each streamed tile.
template <typename T, int D, class TL>
struct BobColSmem {
  T *Ks, *Vs, *UKs, *UVs, *Qs, *dOs, *UQs;
  float* sc;  // [2][RowScalars::floats(BN, true)]: (m2, 1/l) pairs, D, α, E°
  // The block's first output row (ColBlock::kv0), parked here across the key loop for the
  // epilogue: held in a register it was the value ptxas spilled at D = 128 (255 registers).
  int64_t* kv0;
  __device__ explicit BobColSmem(unsigned char* smem) {
    constexpr int L = Smem<D>::LDS;
    Ks = reinterpret_cast<T*>(smem);
    Vs = Ks + TL::BM * L;
    UKs = Vs + TL::BM * L;
    UVs = UKs + TL::BM * L;
    Qs = UVs + TL::BM * L;  // each streamed operand: [2][BN * L]
    dOs = Qs + 2 * TL::BN * L;
    UQs = dOs + 2 * TL::BN * L;
    sc = reinterpret_cast<float*>(UQs + 2 * TL::BN * L);
    kv0 = reinterpret_cast<int64_t*>(sc + 2 * RowScalars::floats(TL::BN, true));
  }
  static constexpr size_t bytes() {
    return Smem<D>::template tile_bytes<T>(4 * TL::BM + 6 * TL::BN) +
           2 * RowScalars::floats(TL::BN, true) * sizeof(float) + sizeof(int64_t);
  }
};

template <typename T, int D, class TL>
__device__ __forceinline__ void bob_col_pass(
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
  if (threadIdx.x == 0) *sm.kv0 = cb.kv0;  // read back after the loop's last barrier
  auto scal = [&](int buf) {
    return RowScalars::at(sm.sc + buf * RowScalars::floats(BN, true), BN, true);
  };

  float kacc[MT][DB][4], vacc[MT][DB][4];
  zero(kacc);
  zero(vacc);
  const int n_tiles = (int)((cb.m_hi - cb.m_lo + BN - 1) / BN);
  const FullTiles ft = full_row_tiles(g, cb, BN, n_tiles);
  auto issue = [&](int it) {
    const int64_t m0 = cb.m_lo + (int64_t)it * BN;
    const int nv = (int)imin(BN, cb.m_hi - m0), buf = it % 2;
    load_packed_async<T, D, BN, NT>(sm.Qs + buf * BN * L, q, cb.pk, m0, nv);
    load_packed_async<T, D, BN, NT>(sm.dOs + buf * BN * L, dout, cb.pk, m0, nv);
    if (has_uq) load_packed_async<T, D, BN, NT>(sm.UQs + buf * BN * L, uq, cb.pk, m0, nv);
    load_row_scalars(scal(buf), BN, NT, cb.pk, m0, nv, stats, delta, alpha, e0);
    fbmma::cp_async_commit();
  };
  auto body = [&](int it) {
    const int64_t m0 = cb.m_lo + (int64_t)it * BN;
    const int nv = (int)imin(BN, cb.m_hi - m0), buf = it % 2;
    const RowScalars cs = scal(buf);
    const bool full = ft.has(it);
    const T* Qb = sm.Qs + buf * BN * L;
    const T* dOb = sm.dOs + buf * BN * L;
    const T* UQb = sm.UQs + buf * BN * L;
    const int wr = warp * 16 * MT * L;
    // Transposed tiles (keys x packed rows). As in bob_row_pass, C = U_V·dOᵀ comes after the
    // products that consume dSᵀ and (P∘h)ᵀ, so four fp32 score tiles are never live at once:
    // S̄ = P∘(C + r) with r = (F − α)∘(dP − D) − E°, and P∘h = P∘(F − α).
    float s[MT][NB][4], dp[MT][NB][4], f[MT][NB][4], c[MT][NB][4];
    bob_scores<T, D, MT, NB, false, false>(s, dp, f, c, sm.Ks + wr, sm.Vs + wr, sm.UKs + wr,
                                           Qb, dOb, UQb, nullptr, has_uq, has_uk, has_uv, lane);
    uint32_t fr_ds[MT][NB / 2][4], fr_ph[MT][NB / 2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int h = e / 2, col = nb * 8 + 2 * tq + e % 2;
          const bool ok =
              tr.valid[mt][h] &&
              (full || (col < nv && g.visible(cb.pk.pos(m0 + col), cb.c0 + tr.local[mt][h])));
          const float p = prob(s[mt][nb][e], scale2, cs.m2(col), cs.il(col), ok);
          const float dps = dp[mt][nb][e] - cs.dl[col];
          const float fa = f[mt][nb][e] * g.scale - cs.al[col];  // h = F − α
          s[mt][nb][e] = p;                             // P
          dp[mt][nb][e] = p * dps;                      // dS
          c[mt][nb][e] = p * fa;                        // P∘h
          f[mt][nb][e] = fa * dps - cs.e0[col];         // r
        }
        if (nb % 2 == 1) {
          pack_afrag<T>(fr_ds[mt][nb / 2], dp[mt][nb - 1], dp[mt][nb]);
          pack_afrag<T>(fr_ph[mt][nb / 2], c[mt][nb - 1], c[mt][nb]);
        }
      }
    if (has_uq) gemm_ab<T, D, MT, NB / 2>(kacc, fr_ds, UQb, lane);
    if (has_f) gemm_ab<T, D, MT, NB / 2>(vacc, fr_ph, dOb, lane);
    zero(c);
    if (has_uv) gemm_abt<T, D, MT, NB>(c, sm.UVs + wr, dOb, lane);  // Cᵀ
    uint32_t fr_sbar[MT][NB / 2][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int nb = 0; nb < NB; ++nb) {
#pragma unroll
        for (int e = 0; e < 4; ++e) c[mt][nb][e] = s[mt][nb][e] * (c[mt][nb][e] + f[mt][nb][e]);
        if (nb % 2 == 1) pack_afrag<T>(fr_sbar[mt][nb / 2], c[mt][nb - 1], c[mt][nb]);
      }
    gemm_ab<T, D, MT, NB / 2>(kacc, fr_sbar, Qb, lane);  // S̄ᵀ·Q
  };
  stream_tiles(n_tiles, issue, body);

  const int64_t kv0 = *sm.kv0;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if (!tr.valid[mt][h]) continue;
      const int64_t x = (kv0 + tr.local[mt][h]) * D;
#pragma unroll
      for (int db = 0; db < DB; ++db) {
        store2(kbar + x + db * 8 + 2 * tq, kacc[mt][db][2 * h] * g.scale,
               kacc[mt][db][2 * h + 1] * g.scale);
        store2(vbar + x + db * 8 + 2 * tq, vacc[mt][db][2 * h], vacc[mt][db][2 * h + 1]);
      }
    }
}

template <typename T, int D, class TL>
__global__ void __launch_bounds__(TL::NT, 1) bob_col_kernel(
    const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
    const float* __restrict__ stats, const T* __restrict__ dout, const T* __restrict__ uq,
    const T* __restrict__ uk, const T* __restrict__ uv, const float* __restrict__ delta,
    const float* __restrict__ alpha, const float* __restrict__ e0, T* __restrict__ kbar,
    T* __restrict__ vbar, Geo g) {
  if constexpr (compiled_here<TL>())
    bob_col_pass<T, D, TL>(q, k, v, stats, dout, uq, uk, uv, delta, alpha, e0, kbar, vbar, g);
  else
    not_compiled_here();
}

// ------------------------------------------------------------------------------- tile sets
// A tile set gives every kernel its Tiles<rows owned per block, rows streamed per stage, warps,
// ARCH> per head dim. All sets are compiled into the one library, so a GPU run can time each of
// them without a rebuild (benchmarks/gpu/bench_flashbob_cuda.py's sweep); the launchers use the
// set chosen for the device unless set_tile_set overrides it. ARCH is the lowest __CUDA_ARCH__ a
// shape is compiled for: its launcher's shared memory is checked at compile time against that
// architecture's opt-in limit per block, and on older architectures the kernel is a stub.
//   sm80          64-row blocks of 4 warps (fwd at D = 64: 128 rows, two m-tiles per warp), sized
//                 to 255 registers and the A100's 163 KB: runs on every sm_80 / sm_90 part, and is
//                 the default below sm_90.
//   sm90          128-row blocks of 8 warps, where the 227 KB of an H100/H200 holds them: every
//                 streamed K/V (or Q/dO) tile feeds twice the rows, and an SM runs 8 warps instead
//                 of 4 (at D = 128 the BoB blocks take 120-190 KB, so one block per SM either way).
//                 The default on parts of compute capability 9.0 or later with 227 KB per block.
//   sm80_half_bn  sm80 with half the rows streamed per stage (fewer registers per score tile, twice
//                 the barriers); for the sweep only, bf16 at D = 128.
//   sm90_half_bn  sm90 likewise.
// The defaults follow from the analysis above (docs/flashbob.md), not from a measurement: no GPU
// has run these kernels yet, and the sweep's numbers decide.
enum TileSetId : int { kSm80 = 0, kSm90, kSm80HalfBN, kSm90HalfBN, kNumTileSets };
constexpr const char* kTileSetNames[kNumTileSets] = {"sm80", "sm90", "sm80_half_bn",
                                                     "sm90_half_bn"};
constexpr int kTileSetArch[kNumTileSets] = {800, 900, 900, 900};

template <int SET, int D>
struct Shapes;  // defined for the (set, head dim) pairs that are instantiated
template <>
struct Shapes<kSm80, 64> {
  using Fwd = Tiles<128, 64, 4>;
  using BwdRow = Tiles<64, 64, 4>;
  using BwdCol = Tiles<64, 64, 4>;
  using BobStats = Tiles<64, 32, 4>;
  using BobRow = Tiles<64, 32, 4>;
  using BobCol = Tiles<64, 32, 4>;
};
template <>
struct Shapes<kSm80, 128> {
  using Fwd = Tiles<64, 64, 4>;
  using BwdRow = Tiles<64, 64, 4>;
  using BwdCol = Tiles<64, 32, 4>;
  using BobStats = Tiles<64, 32, 4>;
  using BobRow = Tiles<64, 32, 4>;
  using BobCol = Tiles<64, 32, 4>;
};
template <>
struct Shapes<kSm90, 64> {
  using Fwd = Shapes<kSm80, 64>::Fwd;  // already 128 rows (4 warps of two m-tiles)
  using BwdRow = Tiles<128, 64, 8, 900>;
  using BwdCol = Tiles<128, 64, 8, 900>;
  using BobStats = Tiles<128, 32, 8, 900>;
  using BobRow = Tiles<128, 32, 8, 900>;
  using BobCol = Tiles<128, 32, 8, 900>;
};
template <>
struct Shapes<kSm90, 128> {
  using Fwd = Tiles<128, 64, 8, 900>;
  using BwdRow = Tiles<128, 64, 8, 900>;
  using BwdCol = Tiles<128, 32, 8, 900>;
  using BobStats = Tiles<128, 32, 8, 900>;
  using BobRow = Tiles<128, 32, 8, 900>;
  using BobCol = Tiles<128, 32, 8, 900>;
};
template <>
struct Shapes<kSm80HalfBN, 128> {
  using Fwd = Tiles<64, 32, 4, 900>;
  using BwdRow = Tiles<64, 32, 4, 900>;
  using BwdCol = Tiles<64, 16, 4, 900>;
  using BobStats = Tiles<64, 16, 4, 900>;
  using BobRow = Tiles<64, 16, 4, 900>;
  using BobCol = Tiles<64, 16, 4, 900>;
};
template <>
struct Shapes<kSm90HalfBN, 128> {
  using Fwd = Tiles<128, 32, 8, 900>;
  using BwdRow = Tiles<128, 32, 8, 900>;
  using BwdCol = Tiles<128, 16, 8, 900>;
  using BobStats = Tiles<128, 16, 8, 900>;
  using BobRow = Tiles<128, 16, 8, 900>;
  using BobCol = Tiles<128, 16, 8, 900>;
};

// The (set, dtype, head dim) combinations that are instantiated: the defaults for both dtypes and
// head dims, the sweep's sets for the benchmark's bf16 at D = 128 (each instantiation costs nvcc
// time on every build).
template <int SET, typename T, int D>
constexpr bool has_shapes() {
  return SET == kSm80 || SET == kSm90 || (D == 128 && std::is_same_v<T, __nv_bfloat16>);
}

// Opt-in shared memory per block of the architectures tile shapes are built for: A100 163 KB,
// H100/H200 227 KB.
constexpr size_t smem_limit(int arch) { return (size_t)(arch >= 900 ? 227 : 163) * 1024; }

// Dynamic shared memory of each kernel at shape TL (what its launcher requests).
enum class Pass { kFwd, kBwdRow, kBwdCol, kBobRow, kBobCol };
template <Pass P, typename T, int D, class TL>
constexpr size_t smem_bytes() {
  if constexpr (P == Pass::kFwd) return Smem<D>::template tile_bytes<T>(TL::BM + 4 * TL::BN);
  if constexpr (P == Pass::kBwdRow) return Smem<D>::template tile_bytes<T>(2 * TL::BM + 4 * TL::BN);
  if constexpr (P == Pass::kBwdCol)
    return Smem<D>::template tile_bytes<T>(2 * TL::BM + 4 * TL::BN) +
           2 * RowScalars::floats(TL::BN, false) * sizeof(float);
  if constexpr (P == Pass::kBobRow) return BobRowSmem<T, D, TL>::bytes();
  if constexpr (P == Pass::kBobCol) return BobColSmem<T, D, TL>::bytes();
}

// The kernel each launcher enqueued last, for error messages: a launch error, or (under
// CUDA_LAUNCH_BLOCKING=1, where every launch waits for its kernel) an execution fault, surfaces at
// the cudaGetLastError right after that kernel, so the binding names it instead of the launcher.
thread_local const char* g_last_kernel = "none";
// The tile set the launchers use: -1 = the device's (device_tile_set), else an override.
std::atomic<int> g_tile_set{-1};

// Launch `kern` (shape TL, `smem` bytes of dynamic shared memory) after opting in to the shared
// memory (above 48 KB it must be requested per kernel).
template <class TL, typename K, typename... A>
cudaError_t launch(const char* name, K kern, dim3 grid, size_t smem, cudaStream_t st, A... args) {
  static_assert(TL::ARCH >= 800, "tile shapes target sm_80 or later");
  constexpr int NT = TL::NT;
  g_last_kernel = name;
  cudaError_t err = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         (int)smem);
  if (err != cudaSuccess) return err;
  FB_LAUNCH(kern, grid, smem, st, args...);
  return cudaGetLastError();
}

template <class TL>
dim3 row_grid(const Geo& g) {
  return dim3((unsigned)((g.G * g.Nq + TL::BM - 1) / TL::BM), (unsigned)(g.B * g.Hkv));
}
template <class TL>
dim3 col_grid(const Geo& g) {
  return dim3((unsigned)((g.Nk + TL::BM - 1) / TL::BM), (unsigned)(g.B * g.Hkv));
}

#define FB_CHECK_SMEM(TL, bytes) \
  static_assert((bytes) <= smem_limit(TL::ARCH), "tile shape exceeds its architecture's shared memory")

template <typename T, int D, class S>
cudaError_t fwd_t(const void* q, const void* k, const void* v, void* o, float* stats, const Geo& g,
                  cudaStream_t st) {
  using TL = typename S::Fwd;
  constexpr size_t smem = smem_bytes<Pass::kFwd, T, D, TL>();
  FB_CHECK_SMEM(TL, smem);
  return launch<TL>("fwd_kernel", fwd_kernel<T, D, TL>, row_grid<TL>(g), smem, st, (const T*)q,
                    (const T*)k, (const T*)v, (T*)o, stats, g);
}

template <typename T, int D, class S>
cudaError_t bwd_t(const void* q, const void* k, const void* v, const void* o, const float* stats,
                  const void* dout, void* dq, void* dk, void* dv, float* delta, const Geo& g,
                  cudaStream_t st) {
  using TR = typename S::BwdRow;
  using TC_ = typename S::BwdCol;
  constexpr size_t smem_r = smem_bytes<Pass::kBwdRow, T, D, TR>(),
                   smem_c = smem_bytes<Pass::kBwdCol, T, D, TC_>();
  FB_CHECK_SMEM(TR, smem_r);
  FB_CHECK_SMEM(TC_, smem_c);
  cudaError_t err = launch<TR>("bwd_row_kernel", bwd_row_kernel<T, D, TR>, row_grid<TR>(g),
                               smem_r, st, (const T*)q, (const T*)k, (const T*)v, (const T*)o,
                               stats, (const T*)dout, (T*)dq, delta, g);
  if (err != cudaSuccess) return err;
  return launch<TC_>("bwd_col_kernel", bwd_col_kernel<T, D, TC_>, col_grid<TC_>(g), smem_c, st,
                     (const T*)q, (const T*)k, (const T*)v, stats, (const T*)dout,
                     (const float*)delta, (T*)dk, (T*)dv, g);
}

template <typename T, int D, class S>
cudaError_t bwd_bwd_t(const void* q, const void* k, const void* v, const void* o,
                      const float* stats, const void* dout, const void* uq, const void* uk,
                      const void* uv, void* qbar, void* kbar, void* vbar, void* dobar,
                      float* delta, float* alpha, float* e0, const Geo& g, cudaStream_t st) {
  using TS = typename S::BobStats;
  using TR = typename S::BobRow;
  using TC_ = typename S::BobCol;
  constexpr size_t smem_s = smem_bytes<Pass::kBobRow, T, D, TS>(),
                   smem_r = smem_bytes<Pass::kBobRow, T, D, TR>(),
                   smem_c = smem_bytes<Pass::kBobCol, T, D, TC_>();
  FB_CHECK_SMEM(TS, smem_s);
  FB_CHECK_SMEM(TR, smem_r);
  FB_CHECK_SMEM(TC_, smem_c);
  cudaError_t err = launch<TS>("bob_stats_kernel", bob_stats_kernel<T, D, TS>, row_grid<TS>(g),
                               smem_s, st, (const T*)q, (const T*)k, (const T*)v, (const T*)o,
                               stats, (const T*)dout, (const T*)uq, (const T*)uk, (const T*)uv,
                               (T*)dobar, delta, alpha, e0, g);
  if (err != cudaSuccess) return err;
  err = launch<TR>("bob_row_kernel", bob_row_kernel<T, D, TR>, row_grid<TR>(g), smem_r, st,
                   (const T*)q, (const T*)k, (const T*)v, stats, (const T*)dout, (const T*)uq,
                   (const T*)uk, (const T*)uv, (T*)qbar, (const float*)delta,
                   (const float*)alpha, (const float*)e0, g);
  if (err != cudaSuccess) return err;
  return launch<TC_>("bob_col_kernel", bob_col_kernel<T, D, TC_>, col_grid<TC_>(g), smem_c, st,
                     (const T*)q, (const T*)k, (const T*)v, stats, (const T*)dout, (const T*)uq,
                     (const T*)uk, (const T*)uv, (const float*)delta, (const float*)alpha,
                     (const float*)e0, (T*)kbar, (T*)vbar, g);
}

// Calls f.operator()<T, D, Shapes<SET, D>>() for the launch's set, dtype and head dim (a generic
// lambda of the launcher), or returns cudaErrorInvalidValue where that combination is not built.
template <int SET, typename T, int D, class F>
cudaError_t call_shapes(F& f) {
  if constexpr (has_shapes<SET, T, D>())
    return f.template operator()<T, D, Shapes<SET, D>>();
  else
    return cudaErrorInvalidValue;
}
template <int SET, class F>
cudaError_t dispatch_type(Dtype dt, int D, F& f) {
  if (dt == Dtype::kBF16 && D == 64) return call_shapes<SET, __nv_bfloat16, 64>(f);
  if (dt == Dtype::kBF16 && D == 128) return call_shapes<SET, __nv_bfloat16, 128>(f);
  if (dt == Dtype::kFP16 && D == 64) return call_shapes<SET, __half, 64>(f);
  if (dt == Dtype::kFP16 && D == 128) return call_shapes<SET, __half, 128>(f);
  return cudaErrorInvalidValue;
}
template <class F>
cudaError_t dispatch(Dtype dt, int D, F&& f) {
  switch (active_tile_set()) {
    case kSm80: return dispatch_type<kSm80>(dt, D, f);
    case kSm90: return dispatch_type<kSm90>(dt, D, f);
    case kSm80HalfBN: return dispatch_type<kSm80HalfBN>(dt, D, f);
    case kSm90HalfBN: return dispatch_type<kSm90HalfBN>(dt, D, f);
    default: return cudaErrorInvalidValue;
  }
}

template <class TL>
void describe_shape(std::string& out, const char* kernel, int D, size_t smem) {
  out += std::string(out.empty() ? "" : ",") + "{\"kernel\":\"" + kernel + "\",\"D\":" +
         std::to_string(D) + ",\"BM\":" + std::to_string(TL::BM) + ",\"BN\":" +
         std::to_string(TL::BN) + ",\"warps\":" + std::to_string(TL::NW) + ",\"arch\":" +
         std::to_string(TL::ARCH) + ",\"smem_bytes\":" + std::to_string(smem) + "}";
}
template <int SET, typename T, int D>
void describe_dim(std::string& out) {
  if constexpr (has_shapes<SET, T, D>()) {
    using S = Shapes<SET, D>;
    describe_shape<typename S::Fwd>(out, "fwd_kernel", D,
                                    smem_bytes<Pass::kFwd, T, D, typename S::Fwd>());
    describe_shape<typename S::BwdRow>(out, "bwd_row_kernel", D,
                                       smem_bytes<Pass::kBwdRow, T, D, typename S::BwdRow>());
    describe_shape<typename S::BwdCol>(out, "bwd_col_kernel", D,
                                       smem_bytes<Pass::kBwdCol, T, D, typename S::BwdCol>());
    describe_shape<typename S::BobStats>(out, "bob_stats_kernel", D,
                                         smem_bytes<Pass::kBobRow, T, D, typename S::BobStats>());
    describe_shape<typename S::BobRow>(out, "bob_row_kernel", D,
                                       smem_bytes<Pass::kBobRow, T, D, typename S::BobRow>());
    describe_shape<typename S::BobCol>(out, "bob_col_kernel", D,
                                       smem_bytes<Pass::kBobCol, T, D, typename S::BobCol>());
  }
}
template <int SET>
std::string describe_set() {
  std::string shapes;
  describe_dim<SET, __nv_bfloat16, 64>(shapes);
  describe_dim<SET, __nv_bfloat16, 128>(shapes);
  const bool all = has_shapes<SET, __half, 64>() && has_shapes<SET, __half, 128>();
  return std::string("{\"id\":") + std::to_string(SET) + ",\"name\":\"" + kTileSetNames[SET] +
         "\",\"arch\":" + std::to_string(kTileSetArch[SET]) + ",\"dtypes\":" +
         (all ? "[\"bf16\",\"fp16\"]" : "[\"bf16\"]") + ",\"shapes\":[" + shapes + "]}";
}

// The current device's compute capability (major·100 + minor·10) and opt-in shared memory per
// block; {0, 0} when it cannot be read (the error is cleared so no launch reports it).
struct DeviceInfo {
  int arch;
  size_t smem;
};
DeviceInfo device_info() {
  int dev = 0, major = 0, minor = 0, smem = 0;
  if (cudaGetDevice(&dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) !=
          cudaSuccess) {
    (void)cudaGetLastError();
    return DeviceInfo{0, 0};
  }
  return DeviceInfo{major * 100 + minor * 10, (size_t)smem};
}

}  // namespace

int num_tile_sets() { return kNumTileSets; }

const char* tile_set_json(int set) {
  static const std::string desc[kNumTileSets] = {describe_set<kSm80>(), describe_set<kSm90>(),
                                                 describe_set<kSm80HalfBN>(),
                                                 describe_set<kSm90HalfBN>()};
  return set >= 0 && set < kNumTileSets ? desc[set].c_str() : nullptr;
}

int device_tile_set() {
  const DeviceInfo d = device_info();
  return d.arch >= 900 && d.smem >= smem_limit(900) ? kSm90 : kSm80;
}

int active_tile_set() {
  const int s = g_tile_set.load();
  return s >= 0 ? s : device_tile_set();
}

cudaError_t set_tile_set(int set) {
  if (set < -1 || set >= kNumTileSets) return cudaErrorInvalidValue;
  g_tile_set.store(set);
  return cudaSuccess;
}

int tile_set() { return g_tile_set.load(); }

const char* tile_set_unavailable(Dtype dt, int D) {
  thread_local std::string why;
  const int set = active_tile_set();
  const bool bf16 = dt == Dtype::kBF16;
  const bool built = set == kSm80 || set == kSm90 || (D == 128 && bf16);
  if (!built) {
    why = std::string("tile set ") + kTileSetNames[set] +
          " is built for bfloat16 at head dim 128 only (a sweep set); set_tile_set(-1) restores "
          "the device's default";
    return why.c_str();
  }
  const DeviceInfo d = device_info();
  if (d.arch != 0 && d.arch < kTileSetArch[set]) {
    why = std::string("tile set ") + kTileSetNames[set] + " is compiled for sm_" +
          std::to_string(kTileSetArch[set] / 10) + " and later; this GPU is sm_" +
          std::to_string(d.arch / 10);
    return why.c_str();
  }
  return nullptr;
}

const char* last_launched_kernel() { return g_last_kernel; }

cudaError_t launch_fwd(Dtype dt, int D, const void* q, const void* k, const void* v, void* o,
                       float* stats, const Geo& g, cudaStream_t stream) {
  return dispatch(dt, D, [&]<typename T, int D_, class S>() {
    return fwd_t<T, D_, S>(q, k, v, o, stats, g, stream);
  });
}

cudaError_t launch_bwd(Dtype dt, int D, const void* q, const void* k, const void* v,
                       const void* o, const float* stats, const void* dout, void* dq, void* dk,
                       void* dv, float* delta, const Geo& g, cudaStream_t stream) {
  return dispatch(dt, D, [&]<typename T, int D_, class S>() {
    return bwd_t<T, D_, S>(q, k, v, o, stats, dout, dq, dk, dv, delta, g, stream);
  });
}

cudaError_t launch_bwd_bwd(Dtype dt, int D, const void* q, const void* k, const void* v,
                           const void* o, const float* stats, const void* dout, const void* uq,
                           const void* uk, const void* uv, void* qbar, void* kbar, void* vbar,
                           void* dobar, float* delta, float* alpha, float* e0, const Geo& g,
                           cudaStream_t stream) {
  return dispatch(dt, D, [&]<typename T, int D_, class S>() {
    return bwd_bwd_t<T, D_, S>(q, k, v, o, stats, dout, uq, uk, uv, qbar, kbar, vbar, dobar, delta,
                               alpha, e0, g, stream);
  });
}

}  // namespace flashbob
