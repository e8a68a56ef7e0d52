// Interface of the tensor-core probe kernels (mma_probe.cu): the probes, their arguments and the
// launcher. Shared by the kernel source and its two bindings (mma_probe_bindings.h).
#pragma once

#include <cstddef>
#include <cstdint>

#ifndef FLASHBOB_CUDA_EMU
#include <cuda_runtime.h>
#endif

namespace mma_probe {

enum ProbeOp : int {  // see mma_probe.cu for what each probe does
  kLdmatrix = 0,
  kMma = 1,
  kLdmatrixMma = 2,
  kCpAsync = 3,
  kPack = 4,
  kBadDivergent = 100,  // misuse probes: emulator tests only, undefined on a GPU
  kBadMixed = 101,
  kBadAddress = 102,
  kBadAlign = 103,
  kReadEarly = 104,
  kBadDeadlock = 105,
};

struct Args {
  int op, variant, nthreads, n16;
  const uint16_t* src16;  // device (global) memory
  const int* offsets;
  const uint32_t* in_u;
  const float* in_f;
  uint32_t* out_u;
  float* out_f;
};

// Shared memory a probe needs, in bytes.
size_t probe_smem_bytes(const Args& a);
// Launch one block of a.nthreads threads; returns the launch error (cudaSuccess when fine). The
// emulated launch throws std::runtime_error on a kernel error (misuse, deadlock).
cudaError_t launch(const Args& a);

}  // namespace mma_probe
