// Python bindings of the tensor-core probe (mma_probe.cu), shared by its CPU-emulated build
// (emu/mma_probe_emu.cpp, CPU tensors) and its GPU build (mma_probe_cuda.cpp, CUDA tensors).
// The includer defines MMA_PROBE_ON_CUDA to 1 (GPU) or 0 (emulator) before including this file.
//
//   run(op, variant, nthreads, src16, offsets, in_u, in_f, n_out_u, n_out_f) -> (out_u, out_f)
//     src16 int16, offsets int32, in_u int32 (uint32 bit patterns), in_f float32, all 1-d and
//     contiguous on the build's device (empty tensors where a probe reads nothing); out_u int32
//     and out_f float32 of the given sizes, zero-initialised. See mma_probe.cu for the probes.
#pragma once

#include <torch/extension.h>

#include <string>
#include <tuple>

#include "mma_probe.h"

namespace mma_probe {

inline void check_input(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.dim() == 1 && t.is_contiguous(), "mma probe: ", name,
              " must be a contiguous 1-d tensor");
  TORCH_CHECK(t.scalar_type() == dtype, "mma probe: ", name, " must be ", dtype, ", got ",
              t.scalar_type());
  TORCH_CHECK(t.is_cuda() == (MMA_PROBE_ON_CUDA != 0), "mma probe: ", name, " must be on ",
              MMA_PROBE_ON_CUDA ? "the GPU" : "the CPU");
}

inline std::tuple<at::Tensor, at::Tensor> run(int64_t op, int64_t variant, int64_t nthreads,
                                              const at::Tensor& src16, const at::Tensor& offsets,
                                              const at::Tensor& in_u, const at::Tensor& in_f,
                                              int64_t n_out_u, int64_t n_out_f) {
  check_input(src16, at::kShort, "src16");
  check_input(offsets, at::kInt, "offsets");
  check_input(in_u, at::kInt, "in_u");
  check_input(in_f, at::kFloat, "in_f");
  TORCH_CHECK(nthreads > 0 && nthreads <= 1024 && nthreads % 32 == 0,
              "mma probe: nthreads must be a multiple of 32 in 32..1024, got ", nthreads);
  auto out_u = at::zeros({n_out_u}, in_u.options());
  auto out_f = at::zeros({n_out_f}, in_f.options());
  Args a{(int)op,
         (int)variant,
         (int)nthreads,
         (int)src16.numel(),
         reinterpret_cast<const uint16_t*>(src16.data_ptr<int16_t>()),
         offsets.data_ptr<int>(),
         reinterpret_cast<const uint32_t*>(in_u.data_ptr<int>()),
         in_f.data_ptr<float>(),
         reinterpret_cast<uint32_t*>(out_u.data_ptr<int>()),
         out_f.data_ptr<float>()};
  const cudaError_t e = launch(a);
  TORCH_CHECK(e == cudaSuccess, "mma probe launch failed: ", cudaGetErrorString(e));
  return {out_u, out_f};
}

}  // namespace mma_probe

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = MMA_PROBE_ON_CUDA ? "tensor-core probe kernels on the GPU (tests only)"
                              : "tensor-core probe kernels on the CPU emulator (tests only)";
  m.def("run", &mma_probe::run);
}
