// C ABI of the FlashBoB CUDA kernels and of the tensor-core probe: no torch, no pybind, so one
// library compiled on the CPU machine (benchmarks/gpu/prebuild_ops.py: nvcc for sm_80 + sm_90,
// cudart linked statically) loads on a GPU machine with any torch and any Python; the GPU check
// then needs no JIT. ds_ttt/ops/flashbob/capi.py calls it through ctypes with the same checks and
// signatures as the torch binding (flashbob_cuda.cpp) and the probe binding (mma_probe_bindings.h).
// Also compiled against the CPU emulator (emu/capi_emu.cpp) so tests/unit check the ctypes path.
//
// geo = {B, Hq, Hkv, G, Nq, Nk, causal, window, q_off, k_off} as int64; every launcher returns
// its cudaError_t as int (0 = success); flashbob_last_kernel() names the kernel it enqueued last.
#include <cstdint>

#include "flashbob_cuda.h"
#include "mma_probe.h"

namespace {
flashbob::Geo geo_of(const int64_t* g, float scale) {
  return flashbob::Geo{g[0], g[1], g[2], g[3], g[4], g[5], g[6] != 0, g[7], g[8], g[9], scale};
}
flashbob::Dtype dtype_of(int dt) { return dt == 0 ? flashbob::Dtype::kBF16 : flashbob::Dtype::kFP16; }
}  // namespace

extern "C" {

int flashbob_capi_version() { return 2; }

const char* flashbob_last_kernel() { return flashbob::last_launched_kernel(); }

const char* flashbob_error_string(int err) { return cudaGetErrorString((cudaError_t)err); }

// Tile sets (flashbob_cuda.h). tile_set_unavailable: nullptr when the active set can launch.
int flashbob_num_tile_sets() { return flashbob::num_tile_sets(); }
const char* flashbob_tile_set_json(int set) { return flashbob::tile_set_json(set); }
int flashbob_set_tile_set(int set) { return (int)flashbob::set_tile_set(set); }
int flashbob_tile_set() { return flashbob::tile_set(); }
int flashbob_device_tile_set() { return flashbob::device_tile_set(); }
int flashbob_active_tile_set() { return flashbob::active_tile_set(); }
const char* flashbob_tile_set_unavailable(int dt, int D) {
  return flashbob::tile_set_unavailable(dtype_of(dt), D);
}

int flashbob_fwd(int dt, int D, const void* q, const void* k, const void* v, void* o, float* stats,
                 const int64_t* geo, float scale, void* stream) {
  return (int)flashbob::launch_fwd(dtype_of(dt), D, q, k, v, o, stats, geo_of(geo, scale),
                                   (cudaStream_t)stream);
}

int flashbob_bwd(int dt, int D, const void* q, const void* k, const void* v, const void* o,
                 const float* stats, const void* dout, void* dq, void* dk, void* dv, float* delta,
                 const int64_t* geo, float scale, void* stream) {
  return (int)flashbob::launch_bwd(dtype_of(dt), D, q, k, v, o, stats, dout, dq, dk, dv, delta,
                                   geo_of(geo, scale), (cudaStream_t)stream);
}

int flashbob_bwd_bwd(int dt, int D, const void* q, const void* k, const void* v, const void* o,
                     const float* stats, const void* dout, const void* uq, const void* uk,
                     const void* uv, void* qbar, void* kbar, void* vbar, void* dobar, float* delta,
                     float* alpha, float* e0, const int64_t* geo, float scale, void* stream) {
  return (int)flashbob::launch_bwd_bwd(dtype_of(dt), D, q, k, v, o, stats, dout, uq, uk, uv, qbar,
                                       kbar, vbar, dobar, delta, alpha, e0, geo_of(geo, scale),
                                       (cudaStream_t)stream);
}

int mma_probe_run(int op, int variant, int nthreads, int n16, const void* src16,
                  const void* offsets, const void* in_u, const void* in_f, void* out_u,
                  void* out_f) {
  mma_probe::Args a{op,
                    variant,
                    nthreads,
                    n16,
                    static_cast<const uint16_t*>(src16),
                    static_cast<const int*>(offsets),
                    static_cast<const uint32_t*>(in_u),
                    static_cast<const float*>(in_f),
                    static_cast<uint32_t*>(out_u),
                    static_cast<float*>(out_f)};
  return (int)mma_probe::launch(a);
}

}  // extern "C"
