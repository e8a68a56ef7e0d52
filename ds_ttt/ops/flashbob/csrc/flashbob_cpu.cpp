// FlashBoB CPU kernels: tiled forward, first backward and exact backward-over-backward (BoB)
// of softmax attention with GQA, causal/sliding-window masks and absolute offsets.
//
// Math and schedule: docs/flashbob_math.md (notation kept: S, P, dP, dS, F, C, P̄°,
// h, P̄, S̄; row scalars L, D, α, E°, E). Layout: q/o/do [B, Hq, Nq, D], k/v [B, Hkv, Nk, D],
// contiguous; query head h reads KV head h / G (G = Hq / Hkv), K/V are never repeated.
//
// Every pass streams BM x BN tiles (64 x 64) and keeps only O(BM·D + BM·BN) scratch per thread;
// the N x N matrices are recomputed, never stored. Two-pass schedule without atomics:
//   row pass    : one task per (batch, q head, row block); streams key tiles
//                 (forward O and L; first-backward D and dQ; BoB Q̄, dŌ, α, E)
//   column pass : one task per (batch, kv head, column block); streams the G·Nq query rows of
//                 the group (first-backward dK, dV; BoB K̄, V̄), so GQA sums need no atomics.
// Tasks are scheduled dynamically over OpenMP threads (heaviest causal blocks first).
// Tiles the mask empties are skipped; fully visible tiles skip per-element masking.
// P = exp2(S·τ·log2 e − m2) / l with per-row stats (m2, 1/l). Scalars and accumulators are in T (float or double).
// Fully masked rows store (m2, 1/l) = (+inf, 0) and produce exact zeros.
//
// Small GEMMs are written as register-blocked outer products (4 rows x 2 vector widths of
// accumulators) whose inner loops are contiguous so -O3 -march=native vectorizes them.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

namespace {

constexpr int BM = 64;  // query rows per tile
constexpr int BN = 64;  // key columns per tile

// C[M x N] += A[M x K] · B[K x N]; A(i, k) = A[i*ars + k*acs], B(k, j) = B[k*ldb + j],
// C(i, j) = C[i*ldc + j]. Register-blocked MR x NR micro-kernel with a generic tail.
template <typename T>
inline void gemm_acc(int M, int N, int K, const T* __restrict A, int64_t ars, int64_t acs,
                     const T* __restrict B, int64_t ldb, T* __restrict C, int64_t ldc) {
  constexpr int MR = 4;
  constexpr int NR = 128 / sizeof(T);  // two 512-bit vectors per row
  int i0 = 0;
  for (; i0 + MR <= M; i0 += MR) {
    int j0 = 0;
    for (; j0 + NR <= N; j0 += NR) {
      T acc[MR][NR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
#pragma omp simd
        for (int c = 0; c < NR; ++c) acc[r][c] = C[(int64_t)(i0 + r) * ldc + j0 + c];
      for (int k = 0; k < K; ++k) {
        const T* __restrict b = B + (int64_t)k * ldb + j0;
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r) {
          const T a = A[(int64_t)(i0 + r) * ars + (int64_t)k * acs];
#pragma omp simd
          for (int c = 0; c < NR; ++c) acc[r][c] += a * b[c];
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r)
#pragma omp simd
        for (int c = 0; c < NR; ++c) C[(int64_t)(i0 + r) * ldc + j0 + c] = acc[r][c];
    }
    if (j0 < N) {  // column tail
      for (int r = 0; r < MR; ++r) {
        T* __restrict crow = C + (int64_t)(i0 + r) * ldc;
        for (int k = 0; k < K; ++k) {
          const T a = A[(int64_t)(i0 + r) * ars + (int64_t)k * acs];
          const T* __restrict b = B + (int64_t)k * ldb;
#pragma omp simd
          for (int c = j0; c < N; ++c) crow[c] += a * b[c];
        }
      }
    }
  }
  for (; i0 < M; ++i0) {  // row tail
    T* __restrict crow = C + (int64_t)i0 * ldc;
    for (int k = 0; k < K; ++k) {
      const T a = A[(int64_t)i0 * ars + (int64_t)k * acs];
      const T* __restrict b = B + (int64_t)k * ldb;
#pragma omp simd
      for (int c = 0; c < N; ++c) crow[c] += a * b[c];
    }
  }
}

// dst[d*BN + j] = src[j*D + d] for j < n (a D x BN panel; columns >= n are not read).
template <typename T>
inline void transpose_tile(const T* __restrict src, int n, int D, T* __restrict dst) {
  for (int j = 0; j < n; ++j)
    for (int d = 0; d < D; ++d) dst[(int64_t)d * BN + j] = src[(int64_t)j * D + d];
}

template <typename T>
inline void zero(T* p, int64_t n) { std::fill(p, p + n, T(0)); }

struct Geometry {
  int64_t B, Hq, Hkv, G, Nq, Nk, D;
  bool causal;
  int64_t window, q_off, k_off;

  // 0: tile empty, 1: partially visible, 2: fully visible. Rows [r0, r1), cols [c0, c1) local.
  int classify(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    if (!causal) return 2;
    const int64_t dmin = (r0 + q_off) - (c1 - 1 + k_off);
    const int64_t dmax = (r1 - 1 + q_off) - (c0 + k_off);
    if (dmax < 0) return 0;
    if (window > 0 && dmin >= window) return 0;
    if (dmin >= 0 && (window == 0 || dmax < window)) return 2;
    return 1;
  }
  bool visible(int64_t r, int64_t c) const {
    if (!causal) return true;
    const int64_t d = (r + q_off) - (c + k_off);
    return d >= 0 && (window == 0 || d < window);
  }
  // Column range [lo, hi) that rows [r0, r1) may see.
  void col_range(int64_t r0, int64_t r1, int64_t& lo, int64_t& hi) const {
    lo = 0;
    hi = Nk;
    if (!causal) return;
    hi = std::min<int64_t>(Nk, std::max<int64_t>(0, r1 - 1 + q_off - k_off + 1));
    if (window > 0) lo = std::min<int64_t>(hi, std::max<int64_t>(0, r0 + q_off - k_off - window + 1));
  }
  // Row range [lo, hi) that may see columns [c0, c1).
  void row_range(int64_t c0, int64_t c1, int64_t& lo, int64_t& hi) const {
    lo = 0;
    hi = Nq;
    if (!causal) return;
    lo = std::min<int64_t>(Nq, std::max<int64_t>(0, c0 + k_off - q_off));
    if (window > 0) hi = std::max<int64_t>(lo, std::min<int64_t>(Nq, c1 - 1 + k_off - q_off + window));
  }
};

constexpr double kLog2e = 1.4426950408889634;

// exp2 that vectorizes inside `omp simd` loops (glibc's vector exp2f needs -ffast-math, which we
// avoid). float: 2^n · p(f), n = round(x), f = x − n ∈ [−½, ½], Cephes' degree-6 polynomial
// (relative error ~2e-7, about 1-2 ulp); x < −126 (including −inf) gives exactly 0. All calls
// here have x <= ~0 (logits minus the row max), so overflow cannot occur; x is clamped anyway.
// double (tests) uses std::exp2.
inline float exp2_vec(float x) {
  const float xc = std::min(std::max(x, -126.f), 126.f);
  const float n = std::nearbyint(xc);
  const float f = xc - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -126.f ? 0.f : p * scale;
}
inline double exp2_vec(double x) { return std::exp2(x); }

// P tile: S = Q·Kᵀ (kT is the D x BN panel), P = exp2(S·scale2 − m2)·inv_l, zero where masked.
// stats holds (m2, inv_l) per row: the row max in log2 units and 1 / Σ exp2(S·scale2 − m2).
// Keeping m2 and l apart (instead of one L = m + log l) keeps P's relative error at a few ulps:
// exp2(S2 − L2) would carry |L2|·eps, which the BoB cancellations (Ω − E°∘B) amplify.
template <typename T>
inline void compute_p(const Geometry& g, const T* Q, const T* kT, const T* stats, int64_t r0,
                      int bm, int64_t c0, int bn, int cls, T scale2, T* P) {
  const int D = (int)g.D;
  for (int i = 0; i < bm; ++i) zero(P + (int64_t)i * BN, bn);
  gemm_acc<T>(bm, bn, D, Q, D, 1, kT, BN, P, BN);
  for (int i = 0; i < bm; ++i) {
    T* row = P + (int64_t)i * BN;
    const T m2 = stats[2 * i], inv_l = stats[2 * i + 1];
    if (inv_l == T(0)) {  // fully masked row
      zero(row, bn);
      continue;
    }
#pragma omp simd
    for (int j = 0; j < bn; ++j) row[j] = exp2_vec(row[j] * scale2 - m2) * inv_l;
    if (cls == 1)
      for (int j = 0; j < bn; ++j)
        if (!g.visible(r0 + i, c0 + j)) row[j] = T(0);
  }
}

// ---------------------------------------------------------------- forward (row pass)
template <typename T>
void fwd_impl(const Geometry& g, const T* q, const T* k, const T* v, T* o, T* stats, T scale) {
  const int64_t D = g.D, nrb = (g.Nq + BM - 1) / BM, total = g.B * g.Hq * nrb;
  const T scale2 = scale * T(kLog2e);
  const T ninf = -std::numeric_limits<T>::infinity();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<T> kT(D * BN), S(BM * BN), acc(BM * D), m(BM), l(BM);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < total; ++w) {
      const int64_t rb = nrb - 1 - (w % nrb), bh = w / nrb, b = bh / g.Hq, h = bh % g.Hq;
      const int64_t hk = h / g.G, r0 = rb * BM;
      const int bm = (int)std::min<int64_t>(BM, g.Nq - r0);
      const T* Q = q + ((b * g.Hq + h) * g.Nq + r0) * D;
      const T* K = k + (b * g.Hkv + hk) * g.Nk * D;
      const T* V = v + (b * g.Hkv + hk) * g.Nk * D;
      std::fill(m.begin(), m.end(), ninf);
      std::fill(l.begin(), l.end(), T(0));
      zero(acc.data(), BM * D);
      int64_t lo, hi;
      g.col_range(r0, r0 + bm, lo, hi);
      for (int64_t c0 = (lo / BN) * BN; c0 < hi; c0 += BN) {
        const int bn = (int)std::min<int64_t>(BN, g.Nk - c0);
        const int cls = g.classify(r0, r0 + bm, c0, c0 + bn);
        if (cls == 0) continue;
        transpose_tile(K + c0 * D, bn, (int)D, kT.data());
        for (int i = 0; i < bm; ++i) zero(S.data() + (int64_t)i * BN, bn);
        gemm_acc<T>(bm, bn, (int)D, Q, D, 1, kT.data(), BN, S.data(), BN);
        for (int i = 0; i < bm; ++i) {
          T* row = S.data() + (int64_t)i * BN;
          T mx = ninf;
          for (int j = 0; j < bn; ++j) {
            T x = row[j] * scale2;
            if (cls == 1 && !g.visible(r0 + i, c0 + j)) x = ninf;
            row[j] = x;
            mx = std::max(mx, x);
          }
          if (mx == ninf) {  // nothing visible in this tile for row i
            zero(row, bn);
            continue;
          }
          const T mnew = std::max(m[i], mx);
          const T corr = exp2_vec(m[i] - mnew);  // 0 when m[i] = -inf
          T sum = 0;
#pragma omp simd reduction(+ : sum)
          for (int j = 0; j < bn; ++j) {
            const T p = exp2_vec(row[j] - mnew);
            row[j] = p;
            sum += p;
          }
          l[i] = l[i] * corr + sum;
          m[i] = mnew;
          if (corr != T(1)) {
            T* a = acc.data() + (int64_t)i * D;
#pragma omp simd
            for (int d = 0; d < D; ++d) a[d] *= corr;
          }
        }
        gemm_acc<T>(bm, (int)D, bn, S.data(), BN, 1, V + c0 * D, D, acc.data(), D);
      }
      T* O = o + ((b * g.Hq + h) * g.Nq + r0) * D;
      T* st = stats + ((b * g.Hq + h) * g.Nq + r0) * 2;
      for (int i = 0; i < bm; ++i) {
        if (l[i] > T(0)) {
          const T inv = T(1) / l[i];
          for (int d = 0; d < D; ++d) O[i * D + d] = acc[i * D + d] * inv;
          st[2 * i] = m[i];
          st[2 * i + 1] = inv;
        } else {  // fully masked row: O = 0 and P = 0 in every backward pass
          for (int d = 0; d < D; ++d) O[i * D + d] = T(0);
          st[2 * i] = std::numeric_limits<T>::infinity();
          st[2 * i + 1] = T(0);
        }
      }
    }
  }
}

// ---------------------------------------------------------------- first backward
template <typename T>
void bwd_impl(const Geometry& g, const T* q, const T* k, const T* v, const T* o, const T* lse,
              const T* dout, T* dq, T* dk, T* dv, T* delta, T scale) {
  const int64_t D = g.D, nrb = (g.Nq + BM - 1) / BM, ncb = (g.Nk + BN - 1) / BN;
  const T scale2 = scale * T(kLog2e);
  // D_i = <dO_i, O_i>
  at::parallel_for(0, g.B * g.Hq * g.Nq, 1024, [&](int64_t s, int64_t e) {
    for (int64_t r = s; r < e; ++r) {
      double acc = 0;
      for (int64_t d = 0; d < D; ++d) acc += (double)dout[r * D + d] * o[r * D + d];
      delta[r] = (T)acc;
    }
  });
  // Row pass: dQ = τ Σ_j dS K.
  const int64_t total_r = g.B * g.Hq * nrb;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<T> kT(D * BN), vT(D * BN), P(BM * BN), dP(BM * BN), acc(BM * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < total_r; ++w) {
      const int64_t rb = nrb - 1 - (w % nrb), bh = w / nrb, b = bh / g.Hq, h = bh % g.Hq;
      const int64_t hk = h / g.G, r0 = rb * BM, row_base = (b * g.Hq + h) * g.Nq + r0;
      const int bm = (int)std::min<int64_t>(BM, g.Nq - r0);
      const T* Q = q + row_base * D;
      const T* dO = dout + row_base * D;
      const T* Dl = delta + row_base;
      const T* K = k + (b * g.Hkv + hk) * g.Nk * D;
      const T* V = v + (b * g.Hkv + hk) * g.Nk * D;
            zero(acc.data(), BM * D);
      int64_t lo, hi;
      g.col_range(r0, r0 + bm, lo, hi);
      for (int64_t c0 = (lo / BN) * BN; c0 < hi; c0 += BN) {
        const int bn = (int)std::min<int64_t>(BN, g.Nk - c0);
        const int cls = g.classify(r0, r0 + bm, c0, c0 + bn);
        if (cls == 0) continue;
        transpose_tile(K + c0 * D, bn, (int)D, kT.data());
        transpose_tile(V + c0 * D, bn, (int)D, vT.data());
        compute_p(g, Q, kT.data(), lse + row_base * 2, r0, bm, c0, bn, cls, scale2, P.data());
        for (int i = 0; i < bm; ++i) zero(dP.data() + (int64_t)i * BN, bn);
        gemm_acc<T>(bm, bn, (int)D, dO, D, 1, vT.data(), BN, dP.data(), BN);
        for (int i = 0; i < bm; ++i) {
          T* ds = dP.data() + (int64_t)i * BN;
          const T* p = P.data() + (int64_t)i * BN;
          const T di = Dl[i];
#pragma omp simd
          for (int j = 0; j < bn; ++j) ds[j] = p[j] * (ds[j] - di);
        }
        gemm_acc<T>(bm, (int)D, bn, dP.data(), BN, 1, K + c0 * D, D, acc.data(), D);
      }
      T* dQ = dq + row_base * D;
      for (int64_t x = 0; x < bm * D; ++x) dQ[x] = acc[x] * scale;
    }
  }
  // Column pass: dV = Pᵀ dO, dK = τ dSᵀ Q over the G·Nq rows of the group.
  const int64_t total_c = g.B * g.Hkv * ncb;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    std::vector<T> kT(D * BN), vT(D * BN), P(BM * BN), dP(BM * BN), dk_acc(BN * D), dv_acc(BN * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < total_c; ++w) {
      const int64_t cb = w % ncb, bk = w / ncb, b = bk / g.Hkv, hk = bk % g.Hkv, c0 = cb * BN;
      const int bn = (int)std::min<int64_t>(BN, g.Nk - c0);
      const int64_t kv_base = (b * g.Hkv + hk) * g.Nk + c0;
      transpose_tile(k + kv_base * D, bn, (int)D, kT.data());
      transpose_tile(v + kv_base * D, bn, (int)D, vT.data());
      zero(dk_acc.data(), BN * D);
      zero(dv_acc.data(), BN * D);
      int64_t lo, hi;
      g.row_range(c0, c0 + bn, lo, hi);
      for (int64_t gi = 0; gi < g.G; ++gi) {
        const int64_t h = hk * g.G + gi;
        for (int64_t r0 = (lo / BM) * BM; r0 < hi; r0 += BM) {
          const int bm = (int)std::min<int64_t>(BM, g.Nq - r0);
          const int cls = g.classify(r0, r0 + bm, c0, c0 + bn);
          if (cls == 0) continue;
          const int64_t row_base = (b * g.Hq + h) * g.Nq + r0;
          const T* Q = q + row_base * D;
          const T* dO = dout + row_base * D;
                    compute_p(g, Q, kT.data(), lse + row_base * 2, r0, bm, c0, bn, cls, scale2, P.data());
          for (int i = 0; i < bm; ++i) zero(dP.data() + (int64_t)i * BN, bn);
          gemm_acc<T>(bm, bn, (int)D, dO, D, 1, vT.data(), BN, dP.data(), BN);
          for (int i = 0; i < bm; ++i) {
            T* ds = dP.data() + (int64_t)i * BN;
            const T* p = P.data() + (int64_t)i * BN;
            const T di = delta[row_base + i];
#pragma omp simd
            for (int j = 0; j < bn; ++j) ds[j] = p[j] * (ds[j] - di);
          }
          gemm_acc<T>(bn, (int)D, bm, P.data(), 1, BN, dO, D, dv_acc.data(), D);
          gemm_acc<T>(bn, (int)D, bm, dP.data(), 1, BN, Q, D, dk_acc.data(), D);
        }
      }
      for (int64_t x = 0; x < bn * D; ++x) {
        dk[kv_base * D + x] = dk_acc[x] * scale;
        dv[kv_base * D + x] = dv_acc[x];
      }
    }
  }
}

// ---------------------------------------------------------------- backward over backward
// Tangent availability decides which products run (zero tangents are skipped).
template <typename T>
struct BobTiles {
  // Per-tile recomputation shared by both passes: P, dPs = dP − D, F, P̄° (in Pb0).
  std::vector<T> kT, vT, ukT, uvT, P, dPs, F, Pb0, W;
  explicit BobTiles(int64_t D)
      : kT(D * BN), vT(D * BN), ukT(D * BN), uvT(D * BN), P(BM * BN), dPs(BM * BN), F(BM * BN),
        Pb0(BM * BN), W(BM * BN) {}
};

template <typename T>
inline void bob_tile(const Geometry& g, BobTiles<T>& t, const T* Q, const T* dO, const T* UQ,
                     const T* stats, const T* Dl, int64_t r0, int bm, int64_t c0, int bn, int cls,
                     T scale, T scale2, bool has_uq, bool has_uk, bool has_uv) {
  const int D = (int)g.D;
  const bool has_f = has_uq || has_uk;
  compute_p(g, Q, t.kT.data(), stats, r0, bm, c0, bn, cls, scale2, t.P.data());
  for (int i = 0; i < bm; ++i) zero(t.dPs.data() + (int64_t)i * BN, bn);
  gemm_acc<T>(bm, bn, D, dO, D, 1, t.vT.data(), BN, t.dPs.data(), BN);  // dP
  if (has_f) {
    for (int i = 0; i < bm; ++i) zero(t.F.data() + (int64_t)i * BN, bn);
    if (has_uq) gemm_acc<T>(bm, bn, D, UQ, D, 1, t.kT.data(), BN, t.F.data(), BN);
    if (has_uk) gemm_acc<T>(bm, bn, D, Q, D, 1, t.ukT.data(), BN, t.F.data(), BN);
  }
  for (int i = 0; i < bm; ++i) zero(t.Pb0.data() + (int64_t)i * BN, bn);
  if (has_uv) gemm_acc<T>(bm, bn, D, dO, D, 1, t.uvT.data(), BN, t.Pb0.data(), BN);  // C
  for (int i = 0; i < bm; ++i) {
    T* f = t.F.data() + (int64_t)i * BN;
    T* pb0 = t.Pb0.data() + (int64_t)i * BN;
    const T* dp = t.dPs.data() + (int64_t)i * BN;
    const T di = Dl[i];
    if (has_f) {
#pragma omp simd
      for (int j = 0; j < bn; ++j) {
        f[j] *= scale;                   // F = τ(U_Q Kᵀ + Q U_Kᵀ)
        pb0[j] += f[j] * (dp[j] - di);   // P̄° = C + F ∘ (dP − D)
      }
    }
  }
}

template <typename T>
void bwd_bwd_impl(const Geometry& g, const T* q, const T* k, const T* v, const T* o, const T* lse,
                  const T* dout, const T* dq, const T* uq, const T* uk, const T* uv, T* qbar,
                  T* kbar, T* vbar, T* dobar, T* delta, T* alpha, T* ecorr, T scale) {
  const int64_t D = g.D, nrb = (g.Nq + BM - 1) / BM, ncb = (g.Nk + BN - 1) / BN;
  const T scale2 = scale * T(kLog2e);
  const bool has_uq = uq != nullptr, has_uk = uk != nullptr, has_uv = uv != nullptr;
  const bool has_f = has_uq || has_uk;

  // ---- row pass: Q̄, dŌ and the row scalars D, α, E.
  const int64_t total_r = g.B * g.Hq * nrb;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    BobTiles<T> t(D);
    std::vector<T> tmp(BM * D), Dl(BM);
    std::vector<double> aout(BM * D), omega(BM * D), bacc(BM * D), al(BM), e0(BM);
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < total_r; ++w) {
      const int64_t rb = nrb - 1 - (w % nrb), bh = w / nrb, b = bh / g.Hq, h = bh % g.Hq;
      const int64_t hk = h / g.G, r0 = rb * BM, row_base = (b * g.Hq + h) * g.Nq + r0;
      const int bm = (int)std::min<int64_t>(BM, g.Nq - r0);
      const T* Q = q + row_base * D;
      const T* dO = dout + row_base * D;
      const T* O = o + row_base * D;
      const T* UQ = has_uq ? uq + row_base * D : nullptr;
      const int64_t kv0 = (b * g.Hkv + hk) * g.Nk * D;
      const T* K = k + kv0;
      const T* V = v + kv0;
      const T* UK = has_uk ? uk + kv0 : nullptr;
      const T* UV = has_uv ? uv + kv0 : nullptr;
      for (int i = 0; i < bm; ++i) {
        double acc = 0;
        for (int64_t d = 0; d < D; ++d) acc += (double)dO[i * D + d] * O[i * D + d];
        Dl[i] = (T)acc;
        al[i] = 0;
        e0[i] = 0;
      }
      std::fill(aout.begin(), aout.end(), 0.0);
      std::fill(omega.begin(), omega.end(), 0.0);
      std::fill(bacc.begin(), bacc.end(), 0.0);
      int64_t lo, hi;
      g.col_range(r0, r0 + bm, lo, hi);
      for (int64_t c0 = (lo / BN) * BN; c0 < hi; c0 += BN) {
        const int bn = (int)std::min<int64_t>(BN, g.Nk - c0);
        const int cls = g.classify(r0, r0 + bm, c0, c0 + bn);
        if (cls == 0) continue;
        transpose_tile(K + c0 * D, bn, (int)D, t.kT.data());
        transpose_tile(V + c0 * D, bn, (int)D, t.vT.data());
        if (has_uk) transpose_tile(UK + c0 * D, bn, (int)D, t.ukT.data());
        if (has_uv) transpose_tile(UV + c0 * D, bn, (int)D, t.uvT.data());
        bob_tile(g, t, Q, dO, UQ, lse + row_base * 2, Dl.data(), r0, bm, c0, bn, cls, scale, scale2,
                 has_uq, has_uk, has_uv);
        // Row sums α += Σ P∘F, E° += Σ P∘P̄°; dS = P∘(dP − D) in place of dPs; W = P∘P̄°.
        for (int i = 0; i < bm; ++i) {
          const T* p = t.P.data() + (int64_t)i * BN;
          T* ds = t.dPs.data() + (int64_t)i * BN;
          T* f = t.F.data() + (int64_t)i * BN;
          T* wpb = t.Pb0.data() + (int64_t)i * BN;
          const T di = Dl[i];
          double sa = 0, se = 0;  // row sums in double: they feed cancellations (E = E° − αD)
          if (has_f) {
#pragma omp simd reduction(+ : sa)
            for (int j = 0; j < bn; ++j) {
              f[j] *= p[j];  // now P∘F
              sa += f[j];
            }
          }
#pragma omp simd reduction(+ : se)
          for (int j = 0; j < bn; ++j) {
            wpb[j] *= p[j];  // now P∘P̄°
            se += wpb[j];
            ds[j] = p[j] * (ds[j] - di);
          }
          al[i] += sa;
          e0[i] += se;
        }
        // Each tile's products go to T scratch, then into double accumulators (for float this
        // halves the error of Q̄ = τ(Ω − E°∘B) − α∘dQ, whose terms partly cancel).
        const T* Kt = K + c0 * D;
        const int64_t n = (int64_t)bm * D;
        if (has_uv || has_f) {
          zero(tmp.data(), n);
          if (has_uv) gemm_acc<T>(bm, (int)D, bn, t.P.data(), BN, 1, UV + c0 * D, D, tmp.data(), D);
          if (has_f) gemm_acc<T>(bm, (int)D, bn, t.F.data(), BN, 1, V + c0 * D, D, tmp.data(), D);
          for (int64_t x = 0; x < n; ++x) aout[x] += tmp[x];
        }
        zero(tmp.data(), n);
        gemm_acc<T>(bm, (int)D, bn, t.Pb0.data(), BN, 1, Kt, D, tmp.data(), D);
        if (has_uk) gemm_acc<T>(bm, (int)D, bn, t.dPs.data(), BN, 1, UK + c0 * D, D, tmp.data(), D);
        for (int64_t x = 0; x < n; ++x) omega[x] += tmp[x];
        zero(tmp.data(), n);
        gemm_acc<T>(bm, (int)D, bn, t.P.data(), BN, 1, Kt, D, tmp.data(), D);
        for (int64_t x = 0; x < n; ++x) bacc[x] += tmp[x];
      }
      // Epilogue: E = E° − α D; dŌ = P U_V + (P∘F) V − α∘O; Q̄ = τ(Ω − E°∘B) − α∘dQ.
      const T* dQ = dq + row_base * D;
      T* QB = qbar + row_base * D;
      T* DOB = dobar + row_base * D;
      for (int i = 0; i < bm; ++i) {
        delta[row_base + i] = Dl[i];
        alpha[row_base + i] = al[i];
        ecorr[row_base + i] = (T)e0[i];  // the column pass uses E° (see S̄ there); E = E° − α·D
        for (int64_t d = 0; d < D; ++d) {
          const int64_t x = i * D + d;
          DOB[x] = (T)(aout[x] - al[i] * O[x]);
          QB[x] = (T)(scale * (omega[x] - e0[i] * bacc[x]) - al[i] * dQ[x]);
        }
      }
    }
  }

  // ---- column pass: K̄ = τ(S̄ᵀ Q + dSᵀ U_Q), V̄ = (P∘h)ᵀ dO over the group's G·Nq rows.
  const int64_t total_c = g.B * g.Hkv * ncb;
#pragma omp parallel num_threads(at::get_num_threads())
  {
    BobTiles<T> t(D);
    std::vector<T> kt(BN * D), vt(BN * D);  // one row tile's contribution
    std::vector<double> kb(BN * D), vb(BN * D);  // sums over the G·Nq rows: double for float
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < total_c; ++w) {
      const int64_t cb = w % ncb, bk = w / ncb, b = bk / g.Hkv, hk = bk % g.Hkv, c0 = cb * BN;
      const int bn = (int)std::min<int64_t>(BN, g.Nk - c0);
      const int64_t kv_base = (b * g.Hkv + hk) * g.Nk + c0;
      transpose_tile(k + kv_base * D, bn, (int)D, t.kT.data());
      transpose_tile(v + kv_base * D, bn, (int)D, t.vT.data());
      if (has_uk) transpose_tile(uk + kv_base * D, bn, (int)D, t.ukT.data());
      if (has_uv) transpose_tile(uv + kv_base * D, bn, (int)D, t.uvT.data());
      std::fill(kb.begin(), kb.end(), 0.0);
      std::fill(vb.begin(), vb.end(), 0.0);
      int64_t lo, hi;
      g.row_range(c0, c0 + bn, lo, hi);
      for (int64_t gi = 0; gi < g.G; ++gi) {
        const int64_t h = hk * g.G + gi;
        for (int64_t r0 = (lo / BM) * BM; r0 < hi; r0 += BM) {
          const int bm = (int)std::min<int64_t>(BM, g.Nq - r0);
          const int cls = g.classify(r0, r0 + bm, c0, c0 + bn);
          if (cls == 0) continue;
          const int64_t row_base = (b * g.Hq + h) * g.Nq + r0;
          const T* Q = q + row_base * D;
          const T* dO = dout + row_base * D;
          const T* UQ = has_uq ? uq + row_base * D : nullptr;
          const T* Dl = delta + row_base;
          const T* al = alpha + row_base;
          const T* E0 = ecorr + row_base;
                    bob_tile(g, t, Q, dO, UQ, lse + row_base * 2, Dl, r0, bm, c0, bn, cls, scale, scale2, has_uq,
                   has_uk, has_uv);
          // W = P∘h = P∘(F − α) ; S̄ = P∘(P̄° − α dP − E) (into Pb0) ; dS = P∘(dP − D) (into dPs).
          for (int i = 0; i < bm; ++i) {
            const T* p = t.P.data() + (int64_t)i * BN;
            const T* f = t.F.data() + (int64_t)i * BN;
            T* wh = t.W.data() + (int64_t)i * BN;
            T* sb = t.Pb0.data() + (int64_t)i * BN;
            T* ds = t.dPs.data() + (int64_t)i * BN;
            const T a = al[i], e = E0[i], di = Dl[i];
            if (has_f) {
#pragma omp simd
              for (int j = 0; j < bn; ++j) wh[j] = p[j] * (f[j] - a);
            }
#pragma omp simd
            for (int j = 0; j < bn; ++j) {
              const T dps = ds[j] - di;
              // S̄ = P∘(P̄ − E) = P∘(P̄° − α·dP − E° + α·D) = P∘(P̄° − α·(dP − D) − E°):
              // the grouped form avoids cancelling the large α·dP against α·D.
              sb[j] = p[j] * (sb[j] - a * dps - e);
              ds[j] = p[j] * dps;
            }
          }
          if (has_f) {
            zero(vt.data(), bn * D);
            gemm_acc<T>(bn, (int)D, bm, t.W.data(), 1, BN, dO, D, vt.data(), D);
            for (int64_t x = 0; x < bn * D; ++x) vb[x] += vt[x];
          }
          zero(kt.data(), bn * D);
          gemm_acc<T>(bn, (int)D, bm, t.Pb0.data(), 1, BN, Q, D, kt.data(), D);
          if (has_uq) gemm_acc<T>(bn, (int)D, bm, t.dPs.data(), 1, BN, UQ, D, kt.data(), D);
          for (int64_t x = 0; x < bn * D; ++x) kb[x] += kt[x];
        }
      }
      for (int64_t x = 0; x < bn * D; ++x) {
        kbar[kv_base * D + x] = (T)(kb[x] * scale);
        vbar[kv_base * D + x] = (T)vb[x];
      }
    }
  }
}

// ---------------------------------------------------------------- bindings
void check_input(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor, got ", t.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), name, " dtype ", t.scalar_type(),
              " differs from q dtype ", ref.scalar_type());
  TORCH_CHECK(t.dim() == 4, name, " must have rank 4 [B, H, N, D], got ", t.dim());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

Geometry make_geometry(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                       int64_t window, int64_t q_off, int64_t k_off) {
  check_input(q, "q", q);
  check_input(k, "k", q);
  check_input(v, "v", q);
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
              "flashbob cpu supports float32/float64, got ", q.scalar_type());
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v shapes differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "q/k batch or head dim differ");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(causal || window == 0, "window requires causal");
  Geometry g{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), k.size(2),
             q.size(3), causal, window, q_off, k_off};
  return g;
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  check_input(t, name, ref);
  TORCH_CHECK(t.sizes() == ref.sizes(), name, " shape ", t.sizes(), " must equal ", ref.sizes());
}

std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, int64_t window, int64_t q_off, int64_t k_off,
                            double scale) {
  const Geometry g = make_geometry(q, k, v, causal, window, q_off, k_off);
  auto o = at::empty_like(q);
  auto lse = at::empty({g.B, g.Hq, g.Nq, 2}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "flashbob_fwd", [&] {
    fwd_impl<scalar_t>(g, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                       o.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), (scalar_t)scale);
  });
  return {o, lse};
}

std::vector<at::Tensor> bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& o, const at::Tensor& lse, const at::Tensor& dout,
                            bool causal, int64_t window, int64_t q_off, int64_t k_off,
                            double scale) {
  const Geometry g = make_geometry(q, k, v, causal, window, q_off, k_off);
  check_like(o, "o", q);
  check_like(dout, "dout", q);
  TORCH_CHECK(lse.is_contiguous() && lse.numel() == g.B * g.Hq * g.Nq * 2 &&
                  lse.scalar_type() == q.scalar_type(), "stats must be contiguous [B, Hq, Nq, 2]");
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  auto delta = at::empty({g.B, g.Hq, g.Nq}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "flashbob_bwd", [&] {
    bwd_impl<scalar_t>(g, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(), v.data_ptr<scalar_t>(),
                       o.data_ptr<scalar_t>(), lse.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(),
                       dq.data_ptr<scalar_t>(), dk.data_ptr<scalar_t>(), dv.data_ptr<scalar_t>(),
                       delta.data_ptr<scalar_t>(), (scalar_t)scale);
  });
  return {dq, dk, dv};
}

// Returns {q̄, k̄, v̄, dŌ, D, α, E}. Absent tangents (None) are zero and their products skipped;
// at least one tangent must be given.
std::vector<at::Tensor> bwd_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& o, const at::Tensor& lse, const at::Tensor& dout,
                                const at::Tensor& dq, const std::optional<at::Tensor>& uq,
                                const std::optional<at::Tensor>& uk,
                                const std::optional<at::Tensor>& uv, bool causal, int64_t window,
                                int64_t q_off, int64_t k_off, double scale) {
  const Geometry g = make_geometry(q, k, v, causal, window, q_off, k_off);
  check_like(o, "o", q);
  check_like(dout, "dout", q);
  check_like(dq, "dq", q);
  if (uq) check_like(*uq, "uq", q);
  if (uk) check_like(*uk, "uk", k);
  if (uv) check_like(*uv, "uv", k);
  TORCH_CHECK(uq || uk || uv, "bwd_bwd needs at least one tangent");
  TORCH_CHECK(lse.is_contiguous() && lse.numel() == g.B * g.Hq * g.Nq * 2 &&
                  lse.scalar_type() == q.scalar_type(), "stats must be contiguous [B, Hq, Nq, 2]");
  auto qbar = at::empty_like(q), dobar = at::empty_like(q);
  auto kbar = at::empty_like(k), vbar = at::empty_like(v);
  auto delta = at::empty({g.B, g.Hq, g.Nq}, q.options());
  auto alpha = at::empty_like(delta), ecorr = at::empty_like(delta);
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "flashbob_bwd_bwd", [&] {
    auto ptr = [](const std::optional<at::Tensor>& t) -> const scalar_t* {
      return t ? t->data_ptr<scalar_t>() : nullptr;
    };
    bwd_bwd_impl<scalar_t>(g, q.data_ptr<scalar_t>(), k.data_ptr<scalar_t>(),
                           v.data_ptr<scalar_t>(), o.data_ptr<scalar_t>(),
                           lse.data_ptr<scalar_t>(), dout.data_ptr<scalar_t>(),
                           dq.data_ptr<scalar_t>(), ptr(uq), ptr(uk), ptr(uv),
                           qbar.data_ptr<scalar_t>(), kbar.data_ptr<scalar_t>(),
                           vbar.data_ptr<scalar_t>(), dobar.data_ptr<scalar_t>(),
                           delta.data_ptr<scalar_t>(), alpha.data_ptr<scalar_t>(),
                           ecorr.data_ptr<scalar_t>(), (scalar_t)scale);
  });
  return {qbar, kbar, vbar, dobar, delta, alpha, ecorr};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FlashBoB CPU kernels: tiled attention forward, backward and backward-over-backward";
  m.def("fwd", &fwd, "forward -> (o, stats [B, Hq, Nq, 2] = (row max m2, 1/l))");
  m.def("bwd", &bwd, "first backward -> (dq, dk, dv)");
  m.def("bwd_bwd", &bwd_bwd, "backward over backward -> (q̄, k̄, v̄, dō, D, α, E)");
}
