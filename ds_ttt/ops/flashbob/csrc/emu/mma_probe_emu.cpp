// Test-only build of the tensor-core probe kernels (../mma_probe.cu) on the CPU, through the
// CUDA emulator (cuda_emu.h) and the emulated primitives (mma_emu.h, pulled in by mma.cuh).
// Built by ds_ttt/ops/flashbob/probe_builder.py; used by tests/unit/test_mma_emu.py.
#include "cuda_emu.h"  // must come first: defines FLASHBOB_CUDA_EMU and the CUDA stand-ins

#include "../mma_probe.cu"

#define MMA_PROBE_ON_CUDA 0
#include "../mma_probe_bindings.h"
