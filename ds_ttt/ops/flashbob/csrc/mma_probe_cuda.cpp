// Test-only GPU build of the tensor-core probe kernels: Python bindings (host, C++) for
// mma_probe.cu (nvcc). Built by ds_ttt/ops/flashbob/probe_builder.py; used by
// tests/ops/test_mma_probe_cuda.py, which compares every lane's registers with the emulator's.
#define MMA_PROBE_ON_CUDA 1
#include "mma_probe_bindings.h"
