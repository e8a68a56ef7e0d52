// A minimal CUDA execution emulator so flashbob_cuda_kernel.cu runs unchanged on the CPU (tests).
//
// Each block runs as NT host threads (one per CUDA thread) that share one dynamic-shared-memory
// buffer; __syncthreads is a std::barrier; __shfl_xor_sync goes through shared scratch between
// two barriers (valid because our kernels call the shuffles uniformly across the block). Blocks
// run one after another. bf16/fp16 are c10::BFloat16 / c10::Half (round-to-nearest-even, as
// __float2bfloat16 / __float2half). A guard region after shared memory catches overruns.
// This checks the kernels' indexing, masking, synchronisation and math; not speed, not warps.
#pragma once

#define FLASHBOB_CUDA_EMU 1

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __align__(x) alignas(x)

using __nv_bfloat16 = c10::BFloat16;
using __half = c10::Half;
inline float __bfloat162float(__nv_bfloat16 x) { return static_cast<float>(x); }
inline float __half2float(__half x) { return static_cast<float>(x); }
inline __nv_bfloat16 __float2bfloat16(float x) { return __nv_bfloat16(x); }
inline __half __float2half(float x) { return __half(x); }

using cudaError_t = int;
using cudaStream_t = void*;
constexpr int cudaSuccess = 0;
constexpr int cudaErrorInvalidValue = 1;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace fb_emu {
constexpr size_t kSmemLimit = 227 * 1024;  // H100/H200 opt-in maximum per block
constexpr size_t kGuard = 4096;
inline std::vector<unsigned char>& smem_buf() {
  static std::vector<unsigned char> b;
  return b;
}
inline std::barrier<>*& bar() {
  static std::barrier<>* b = nullptr;
  return b;
}
inline std::vector<float>& shfl_buf() {
  static std::vector<float> b;
  return b;
}
inline thread_local dim3 tl_thread, tl_block;
inline dim3 g_grid;
}  // namespace fb_emu

#define threadIdx (fb_emu::tl_thread)
#define blockIdx (fb_emu::tl_block)
#define gridDim (fb_emu::g_grid)
#define FB_DYNAMIC_SMEM(name) unsigned char* name = fb_emu::smem_buf().data()

inline void __syncthreads() { fb_emu::bar()->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
  auto& buf = fb_emu::shfl_buf();
  const unsigned t = threadIdx.x;
  buf[t] = v;
  __syncthreads();
  const float r = buf[t ^ (unsigned)lane_mask];
  __syncthreads();
  return r;
}

template <typename K>
inline cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute, int bytes) {
  return (size_t)bytes <= fb_emu::kSmemLimit ? cudaSuccess : cudaErrorInvalidValue;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "success" : "invalid value (emulated)";
}

namespace fb_emu {
inline void run_grid(dim3 grid, int nthreads, size_t smem, const std::function<void()>& body) {
  if (smem > kSmemLimit) throw std::runtime_error("emulated launch: shared memory over limit");
  g_grid = grid;
  smem_buf().assign(smem + kGuard, 0xAB);
  shfl_buf().assign(nthreads, 0.f);
  for (unsigned by = 0; by < grid.y; ++by) {
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      std::barrier<> b(nthreads);
      bar() = &b;
      std::vector<std::thread> ts;
      ts.reserve(nthreads);
      for (int t = 0; t < nthreads; ++t)
        ts.emplace_back([&, t] {
          tl_thread = dim3((unsigned)t);
          tl_block = dim3(bx, by);
          body();
        });
      for (auto& th : ts) th.join();
      bar() = nullptr;
      for (size_t i = smem; i < smem + kGuard; ++i)
        if (smem_buf()[i] != 0xAB) throw std::runtime_error("emulated kernel overran shared memory");
    }
  }
}
}  // namespace fb_emu

#define FB_LAUNCH(kernel, grid, smem, stream, ...) \
  fb_emu::run_grid(grid, NT, smem, [&] { kernel(__VA_ARGS__); })
