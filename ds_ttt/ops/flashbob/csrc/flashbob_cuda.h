// FlashBoB CUDA kernels: shared declarations between the binding (flashbob_cuda.cpp, g++) and the
// kernels (flashbob_cuda_kernel.cu, nvcc). No torch headers here: the .cu stays torch-free.
//
// Layout: q/o/do/uq [B, Hq, Nq, D], k/v/uk/uv [B, Hkv, Nk, D], contiguous bf16 or fp16;
// stats [B, Hq, Nq, 2] fp32 = (row max m2 in log2 units, 1 / row sum); row scalars fp32.
#pragma once

#include <cstdint>
#ifndef FLASHBOB_CUDA_EMU
#include <cuda_runtime.h>
#endif

#ifdef __CUDACC__
#define FB_HD __host__ __device__ __forceinline__
#else
#define FB_HD inline
#endif

namespace flashbob {

struct Geo {
  int64_t B, Hq, Hkv, G, Nq, Nk;
  bool causal;
  int64_t window, q_off, k_off;
  float scale;

  // 0: tile empty, 1: partially visible, 2: fully visible. Local rows [r0, r1), cols [c0, c1).
  FB_HD int classify(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    if (!causal) return 2;
    const int64_t dmin = (r0 + q_off) - (c1 - 1 + k_off);
    const int64_t dmax = (r1 - 1 + q_off) - (c0 + k_off);
    if (dmax < 0) return 0;
    if (window > 0 && dmin >= window) return 0;
    if (dmin >= 0 && (window == 0 || dmax < window)) return 2;
    return 1;
  }
  FB_HD bool visible(int64_t r, int64_t c) const {
    if (!causal) return true;
    const int64_t d = (r + q_off) - (c + k_off);
    return d >= 0 && (window == 0 || d < window);
  }
  FB_HD void col_range(int64_t r0, int64_t r1, int64_t& lo, int64_t& hi) const {
    lo = 0;
    hi = Nk;
    if (!causal) return;
    const int64_t h = r1 - 1 + q_off - k_off + 1;
    hi = h < 0 ? 0 : (h < Nk ? h : Nk);
    if (window > 0) {
      const int64_t l = r0 + q_off - k_off - window + 1;
      lo = l < 0 ? 0 : (l < hi ? l : hi);
    }
  }
  FB_HD void row_range(int64_t c0, int64_t c1, int64_t& lo, int64_t& hi) const {
    lo = 0;
    hi = Nq;
    if (!causal) return;
    const int64_t l = c0 + k_off - q_off;
    lo = l < 0 ? 0 : (l < Nq ? l : Nq);
    if (window > 0) {
      const int64_t h = c1 - 1 + k_off - q_off + window;
      hi = h < lo ? lo : (h < Nq ? h : Nq);
    }
  }
};

enum class Dtype { kBF16, kFP16 };

// All launchers enqueue on `stream`; they return cudaSuccess or the launch error.
cudaError_t launch_fwd(Dtype dt, int D, const void* q, const void* k, const void* v, void* o,
                       float* stats, const Geo& g, cudaStream_t stream);

cudaError_t launch_bwd(Dtype dt, int D, const void* q, const void* k, const void* v,
                       const void* o, const float* stats, const void* dout, void* dq, void* dk,
                       void* dv, float* delta, const Geo& g, cudaStream_t stream);

// uq/uk/uv may be null (zero tangent: its products are skipped). Writes q̄, k̄, v̄, dō and the
// row scalars D (delta), α (alpha), E° (e0) used by the column pass.
cudaError_t launch_bwd_bwd(Dtype dt, int D, const void* q, const void* k, const void* v,
                           const void* o, const float* stats, const void* dout, const void* uq,
                           const void* uk, const void* uv, void* qbar, void* kbar, void* vbar,
                           void* dobar, float* delta, float* alpha, float* e0, const Geo& g,
                           cudaStream_t stream);

// Tile sets: the tile shapes of all six kernels for one kind of GPU (flashbob_cuda_kernel.cu lists
// them). The launchers use active_tile_set(): the override from set_tile_set, or, when that is -1
// (the default), device_tile_set(), the set for the current device (sm90 on compute capability
// 9.0+ with 227 KB of shared memory per block, else sm80).
int num_tile_sets();
// {"id", "name", "arch", "dtypes", "shapes": [{"kernel", "D", "BM", "BN", "warps", "arch",
// "smem_bytes"}, ...]} as JSON, or nullptr for an unknown set.
const char* tile_set_json(int set);
int device_tile_set();
int active_tile_set();
cudaError_t set_tile_set(int set);  // -1: by device; cudaErrorInvalidValue when out of range
int tile_set();                     // the override (-1: none)
// Why the active set cannot launch this dtype / head dim on the current device (a sweep set is
// built for bf16 at D = 128 only; a set compiled for sm_90 cannot run on sm_80), or nullptr.
const char* tile_set_unavailable(Dtype dt, int D);

// Name of the kernel the launchers on this thread enqueued last ("fwd_kernel", ..., "bob_col_kernel";
// "none" before any launch): where a launcher's error came from.
const char* last_launched_kernel();

}  // namespace flashbob
