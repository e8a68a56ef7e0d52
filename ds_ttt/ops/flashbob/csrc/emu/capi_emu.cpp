// Test-only: the C ABI (../flashbob_capi.cpp) over the CPU emulator, i.e. the FlashBoB kernels and
// the tensor-core probe compiled as C++ (cuda_emu.h) behind the very functions the prebuilt GPU
// library exports. tests/unit/test_flashbob_builder.py builds it with g++ and drives it through
// ds_ttt/ops/flashbob/capi.py (ctypes) on CPU tensors, so the argument marshalling, the checks and
// the error messages of the prebuilt path are tested without a GPU.
#include "cuda_emu.h"  // must come first: defines FLASHBOB_CUDA_EMU and the CUDA stand-ins

#include "../flashbob_cuda_kernel.cu"
#include "../mma_probe.cu"
#include "../flashbob_capi.cpp"
