// Test-only build of the FlashBoB CUDA kernels on the CPU (see cuda_emu.h). It exports fwd, bwd
// and bwd_bwd with the CUDA op's signatures but takes CPU bf16/fp16 tensors, and runs the very
// same kernel and launcher source (flashbob_cuda_kernel.cu) through the emulator.
#include "cuda_emu.h"  // must come first: defines FLASHBOB_CUDA_EMU and the CUDA stand-ins

#include "../flashbob_cuda_kernel.cu"

#include <torch/extension.h>

#include <optional>
#include <vector>

namespace {

flashbob::Geo make_geo(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                       int64_t window, int64_t q_off, int64_t k_off, double scale) {
  for (const auto* t : {&q, &k, &v}) {
    TORCH_CHECK(t->device().is_cpu() && t->is_contiguous() && t->dim() == 4,
                "emulated cuda op wants contiguous 4-d CPU tensors");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), "dtype mismatch");
  }
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf, "bf16/fp16 only");
  TORCH_CHECK(q.size(3) == 64 || q.size(3) == 128, "head dim 64/128 only");
  return flashbob::Geo{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2),
                       k.size(2), causal, window, q_off, k_off, static_cast<float>(scale)};
}

flashbob::Dtype dtype_of(const at::Tensor& t) {
  return t.scalar_type() == at::kBFloat16 ? flashbob::Dtype::kBF16 : flashbob::Dtype::kFP16;
}

void ok(cudaError_t e, const char* what) { TORCH_CHECK(e == cudaSuccess, what, " failed: ", e); }

// As the CUDA binding: the active tile set must be built for this dtype / head dim and device.
void check_tile_set(const at::Tensor& q) {
  const char* why = flashbob::tile_set_unavailable(dtype_of(q), (int)q.size(3));
  TORCH_CHECK(why == nullptr, "flashbob cuda: ", why ? why : "");
}

std::vector<at::Tensor> fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            bool causal, int64_t window, int64_t q_off, int64_t k_off,
                            double scale) {
  const auto g = make_geo(q, k, v, causal, window, q_off, k_off, scale);
  check_tile_set(q);
  auto o = at::empty_like(q);
  auto stats = at::empty({g.B, g.Hq, g.Nq, 2}, q.options().dtype(at::kFloat));
  ok(flashbob::launch_fwd(dtype_of(q), (int)q.size(3), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                          o.data_ptr(), stats.data_ptr<float>(), g, nullptr), "fwd");
  return {o, stats};
}

std::vector<at::Tensor> bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const at::Tensor& o, const at::Tensor& stats, const at::Tensor& dout,
                            bool causal, int64_t window, int64_t q_off, int64_t k_off,
                            double scale) {
  const auto g = make_geo(q, k, v, causal, window, q_off, k_off, scale);
  check_tile_set(q);
  auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  auto delta = at::empty({g.B, g.Hq, g.Nq}, q.options().dtype(at::kFloat));
  ok(flashbob::launch_bwd(dtype_of(q), (int)q.size(3), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                          o.data_ptr(), stats.data_ptr<float>(), dout.contiguous().data_ptr(),
                          dq.data_ptr(), dk.data_ptr(), dv.data_ptr(), delta.data_ptr<float>(), g,
                          nullptr), "bwd");
  return {dq, dk, dv};
}

std::vector<at::Tensor> bwd_bwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& o, const at::Tensor& stats,
                                const at::Tensor& dout, const at::Tensor& dq,
                                const std::optional<at::Tensor>& uq,
                                const std::optional<at::Tensor>& uk,
                                const std::optional<at::Tensor>& uv, bool causal, int64_t window,
                                int64_t q_off, int64_t k_off, double scale) {
  const auto g = make_geo(q, k, v, causal, window, q_off, k_off, scale);
  check_tile_set(q);
  (void)dq;
  auto qbar = at::empty_like(q), dobar = at::empty_like(q);
  auto kbar = at::empty_like(k), vbar = at::empty_like(v);
  auto delta = at::empty({g.B, g.Hq, g.Nq}, q.options().dtype(at::kFloat));
  auto alpha = at::empty_like(delta), e0 = at::empty_like(delta);
  auto ptr = [](const std::optional<at::Tensor>& t) -> const void* {
    return t ? t->data_ptr() : nullptr;
  };
  ok(flashbob::launch_bwd_bwd(dtype_of(q), (int)q.size(3), q.data_ptr(), k.data_ptr(),
                              v.data_ptr(), o.data_ptr(), stats.data_ptr<float>(),
                              dout.data_ptr(), ptr(uq), ptr(uk), ptr(uv), qbar.data_ptr(),
                              kbar.data_ptr(), vbar.data_ptr(), dobar.data_ptr(),
                              delta.data_ptr<float>(), alpha.data_ptr<float>(),
                              e0.data_ptr<float>(), g, nullptr), "bwd_bwd");
  return {qbar, kbar, vbar, dobar, delta, alpha, e0};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "FlashBoB CUDA kernels run by a CPU emulator (tests only)";
  m.def("fwd", &fwd);
  m.def("bwd", &bwd);
  m.def("bwd_bwd", &bwd_bwd);
  m.def("last_launched_kernel", [] { return std::string(flashbob::last_launched_kernel()); },
        "the kernel the launchers enqueued last on this thread (error messages name it)");
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
  m.def("set_emulated_device",
        [](int major, int minor, int64_t smem_optin) {
          fb_emu::set_device(major, minor, (size_t)smem_optin);
        },
        "the emulated GPU: compute capability and opt-in shared memory per block (bytes); an "
        "A100 (8, 0, 163 KB) until set");
}
