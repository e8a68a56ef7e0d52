// FlashBoB CUDA binding: validates inputs (TORCH_CHECK) and calls the launchers of the
// tensor-core kernels (flashbob_cuda_kernel.cu, sm_80+) on the current stream. Exports fwd, bwd,
// bwd_bwd with the same signatures as the CPU extension (flashbob_cpu.cpp), so
// ds_ttt/ops/flashbob/function.py is backend-agnostic. Storage bf16/fp16, head dim 64 or 128;
// stats and row scalars fp32.
// Only c10 CUDA headers (no ATen/cuda/CUDAContext.h: it needs cuBLAS/cuSPARSE headers).
#include <torch/extension.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "flashbob_cuda.h"

namespace {

void check_input(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got ", t.device());
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", t.device(), ", q on ", ref.device());
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), name, " dtype ", t.scalar_type(),
              " differs from q dtype ", ref.scalar_type());
  TORCH_CHECK(t.dim() == 4, name, " must have rank 4 [B, H, N, D], got ", t.dim());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  // The kernels stream rows with 16-byte cp.async: a contiguous view that starts mid-row (a
  // storage offset that is not a multiple of 8 elements) would fault on the GPU.
  TORCH_CHECK(reinterpret_cast<std::uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must start at a 16-byte aligned address (storage offset ", t.storage_offset(),
              " elements); pass ", name, ".clone()");
}

void check_like(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  check_input(t, name, ref);
  TORCH_CHECK(t.sizes() == ref.sizes(), name, " shape ", t.sizes(), " must equal ", ref.sizes());
}

flashbob::Geo make_geo(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                       int64_t window, int64_t q_off, int64_t k_off, double scale) {
  check_input(q, "q", q);
  check_input(k, "k", q);
  check_input(v, "v", q);
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf,
              "flashbob cuda supports bfloat16/float16, got ", q.scalar_type());
  TORCH_CHECK(q.size(3) == 64 || q.size(3) == 128, "flashbob cuda supports head dim 64/128, got ",
              q.size(3));
  TORCH_CHECK(k.sizes() == v.sizes(), "k and v shapes differ");
  TORCH_CHECK(q.size(0) == k.size(0) && q.size(3) == k.size(3), "q/k batch or head dim differ");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "Hq must be a multiple of Hkv");
  TORCH_CHECK(window >= 0 && (causal || window == 0), "window must be >= 0 and needs causal");
  TORCH_CHECK(q.size(0) * q.size(1) < 65536 && k.size(0) * k.size(1) < 65536,
              "B*H must be < 65536 (grid.y)");
  // Packed rows are divided by G in 32 bits (Packed in flashbob_cuda_tiles.cuh).
  TORCH_CHECK(q.size(2) * (q.size(1) / k.size(1)) < (int64_t{1} << 31),
              "Nq * (Hq / Hkv) must be < 2^31, got ", q.size(2), " * ", q.size(1) / k.size(1));
  return flashbob::Geo{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2),
                       k.size(2), causal, window, q_off, k_off, static_cast<float>(scale)};
}

flashbob::Dtype dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? flashbob::Dtype::kBF16 : flashbob::Dtype::kFP16;
}

void check_stats(const at::Tensor& stats, const flashbob::Geo& g, const at::Tensor& q) {
  TORCH_CHECK(stats.is_cuda() && stats.device() == q.device() && stats.is_contiguous() &&
                  stats.scalar_type() == at::kFloat && stats.numel() == g.B * g.Hq * g.Nq * 2,
              "stats must be a contiguous float32 CUDA tensor [B, Hq, Nq, 2]");
}

// The active tile set must be built for this dtype / head dim and this GPU (flashbob_cuda.h).
void check_tile_set(const at::Tensor& q) {
  const char* why = flashbob::tile_set_unavailable(dtype_of(q), (int)q.size(3));
  TORCH_CHECK(why == nullptr, "flashbob cuda: ", why ? why : "");
}

void check_launch(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "flashbob cuda ", what, " failed in ",
              flashbob::last_launched_kernel(), ": ", cudaGetErrorString(err),
              " (an execution fault is reported by the kernel it happened in only with "
              "CUDA_LAUNCH_BLOCKING=1)");
}

std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, int64_t window, int64_t q_off, int64_t k_off,
                            double scale) {
  const auto g = make_geo(q, k, v, causal, window, q_off, k_off, scale);
  const c10::cuda::CUDAGuard guard(q.device());
  check_tile_set(q);
  auto o = at::empty_like(q);
  auto stats = at::empty({g.B, g.Hq, g.Nq, 2}, q.options().dtype(at::kFloat));
  check_launch(flashbob::launch_fwd(dtype_of(q), (int)q.size(3), q.data_ptr(), k.data_ptr(),
                                    v.data_ptr(), o.data_ptr(), stats.data_ptr<float>(), g,
                                    c10::cuda::getCurrentCUDAStream()),
               "fwd");
  return {o, stats};
}

std::vector<at::Tensor> bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& o, const at::Tensor& stats, const at::Tensor& dout,
                            bool causal, int64_t window, int64_t q_off, int64_t k_off,
                            double scale) {
  const auto g = make_geo(q, k, v, causal, window, q_off, k_off, scale);
  check_like(o, "o", q);
  check_like(dout, "dout", q);
  check_stats(stats, g, q);
  const c10::cuda::CUDAGuard guard(q.device());
  check_tile_set(q);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  auto delta = at::empty({g.B, g.Hq, g.Nq}, q.options().dtype(at::kFloat));
  check_launch(flashbob::launch_bwd(dtype_of(q), (int)q.size(3), q.data_ptr(), k.data_ptr(),
                                    v.data_ptr(), o.data_ptr(), stats.data_ptr<float>(),
                                    dout.data_ptr(), dq.data_ptr(), dk.data_ptr(), dv.data_ptr(),
                                    delta.data_ptr<float>(), g,
                                    c10::cuda::getCurrentCUDAStream()),
               "bwd");
  return {dq, dk, dv};
}

// dq is accepted for signature parity with the CPU op but unused: the kernels form
// S̄ = P∘(P̄° − α·(dP − D) − E°) per element in fp32 and need no first-order dQ (see the .cu).
std::vector<at::Tensor> bwd_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& o, const at::Tensor& stats,
                                const at::Tensor& dout, const at::Tensor& dq,
                                const std::optional<at::Tensor>& uq,
                                const std::optional<at::Tensor>& uk,
                                const std::optional<at::Tensor>& uv, bool causal, int64_t window,
                                int64_t q_off, int64_t k_off, double scale) {
  const auto g = make_geo(q, k, v, causal, window, q_off, k_off, scale);
  check_like(o, "o", q);
  check_like(dout, "dout", q);
  check_like(dq, "dq", q);
  check_stats(stats, g, q);
  if (uq) check_like(*uq, "uq", q);
  if (uk) check_like(*uk, "uk", k);
  if (uv) check_like(*uv, "uv", k);
  TORCH_CHECK(uq || uk || uv, "bwd_bwd needs at least one tangent");
  const c10::cuda::CUDAGuard guard(q.device());
  check_tile_set(q);
  auto qbar = at::empty_like(q), dobar = at::empty_like(q);
  auto kbar = at::empty_like(k), vbar = at::empty_like(v);
  auto delta = at::empty({g.B, g.Hq, g.Nq}, q.options().dtype(at::kFloat));
  auto alpha = at::empty_like(delta), e0 = at::empty_like(delta);
  auto ptr = [](const std::optional<at::Tensor>& t) -> const void* {
    return t ? t->data_ptr() : nullptr;
  };
  check_launch(flashbob::launch_bwd_bwd(dtype_of(q), (int)q.size(3), q.data_ptr(), k.data_ptr(),
                                        v.data_ptr(), o.data_ptr(), stats.data_ptr<float>(),
                                        dout.data_ptr(), ptr(uq), ptr(uk), ptr(uv),
                                        qbar.data_ptr(), kbar.data_ptr(), vbar.data_ptr(),
                                        dobar.data_ptr(), delta.data_ptr<float>(),
                                        alpha.data_ptr<float>(), e0.data_ptr<float>(), g,
                                        c10::cuda::getCurrentCUDAStream()),
               "bwd_bwd");
  return {qbar, kbar, vbar, dobar, delta, alpha, e0};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FlashBoB CUDA kernels: attention forward, backward and backward-over-backward";
  m.def("fwd", &fwd, "forward -> (o, stats [B, Hq, Nq, 2] fp32)");
  m.def("bwd", &bwd, "first backward -> (dq, dk, dv)");
  m.def("bwd_bwd", &bwd_bwd, "backward over backward -> (q̄, k̄, v̄, dō, D, α, E°)");
  // Tile sets (flashbob_cuda.h); ds_ttt/ops/flashbob/tiles.py wraps these.
  m.def("num_tile_sets", &flashbob::num_tile_sets);
  m.def("tile_set_json", [](int set) {
    const char* j = flashbob::tile_set_json(set);
    TORCH_CHECK(j != nullptr, "flashbob cuda: no tile set ", set);
    return std::string(j);
  });
  m.def("set_tile_set", [](int set) {
    TORCH_CHECK(flashbob::set_tile_set(set) == cudaSuccess, "flashbob cuda: no tile set ", set,
                " (0..", flashbob::num_tile_sets() - 1, ", or -1 for the device's)");
  });
  m.def("tile_set", &flashbob::tile_set);
  m.def("device_tile_set", &flashbob::device_tile_set);
  m.def("active_tile_set", &flashbob::active_tile_set);
}
