// A minimal CUDA execution emulator so flashbob_cuda_kernel.cu runs unchanged on the CPU (tests).
//
// Each block runs as NT host threads (one per CUDA thread, 1-D blocks: threadIdx.x only) that
// share one dynamic-shared-memory buffer (FB_DYNAMIC_SMEM; static __shared__ is not emulated).
// Blocks run one after another. bf16/fp16 are c10::BFloat16 / c10::Half (round-to-nearest-even,
// as __float2bfloat16 / __float2half). A guard region after shared memory catches overruns.
//
// Synchronisation (fb_emu::Block):
//   __syncthreads           a barrier over the block's threads;
//   warp collectives        (__shfl_xor_sync, __shfl_sync, __syncwarp, and the tensor-core
//                           primitives of mma_emu.h) a barrier over the warp (lanes threadIdx.x / 32),
//                           so warps advance independently, as on the GPU. Each lane publishes its
//                           operands into per-warp scratch (double-buffered by the lane's collective
//                           count), passes the warp barrier, then computes its own result.
//   Rules checked loudly:   every lane of a warp must execute the same collective as its n-th
//                           collective (a lane that diverged, exited or ran a different one is
//                           reported, with both lanes' instructions); a block whose live threads
//                           all wait on barriers that can never complete is reported as a deadlock
//                           (instead of hanging). Such errors, and any exception a thread throws,
//                           stop the whole block and surface as a std::runtime_error from the
//                           launch. A thread that returns early leaves the barriers (as exited
//                           threads do on the GPU), but not the warp collectives.
// This checks the kernels' indexing, masking, synchronisation and math; not speed, not timing.
#pragma once

#define FLASHBOB_CUDA_EMU 1

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(x) alignas(x)

using __nv_bfloat16 = c10::BFloat16;
using __half = c10::Half;
inline float __bfloat162float(__nv_bfloat16 x) { return static_cast<float>(x); }
inline float __half2float(__half x) { return static_cast<float>(x); }
inline __nv_bfloat16 __float2bfloat16(float x) { return __nv_bfloat16(x); }
inline __half __float2half(float x) { return __half(x); }
// The high 32 bits of the 64-bit product (PTX mul.hi.u32).
inline unsigned __umulhi(unsigned a, unsigned b) {
  return (unsigned)(((unsigned long long)a * b) >> 32);
}

using cudaError_t = int;
using cudaStream_t = void*;
constexpr int cudaSuccess = 0;
constexpr int cudaErrorInvalidValue = 1;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
enum cudaDeviceAttr {
  cudaDevAttrComputeCapabilityMajor,
  cudaDevAttrComputeCapabilityMinor,
  cudaDevAttrMaxSharedMemoryPerBlockOptin
};
struct dim3 {
  unsigned x, y, z;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

namespace fb_emu {
// The emulated device: compute capability and opt-in shared memory per block, which the launchers
// read to pick their tile set and which bounds a launch's dynamic shared memory. An A100 unless a
// test says otherwise (set_device: the emulator's module exports it as set_emulated_device).
struct Device {
  int major = 8, minor = 0;
  size_t smem_optin = 163 * 1024;
};
inline Device& device() {
  static Device d;
  return d;
}
inline void set_device(int major, int minor, size_t smem_optin) {
  device() = Device{major, minor, smem_optin};
}
constexpr size_t kGuard = 4096;
constexpr int kWarp = 32;

inline std::vector<unsigned char>& smem_buf() {
  static std::vector<unsigned char> b;
  return b;
}
inline size_t& smem_bytes() {  // the launch's dynamic shared memory (without the guard)
  static size_t n = 0;
  return n;
}
inline bool in_smem(const void* p, size_t bytes) {
  const auto* c = static_cast<const unsigned char*>(p);
  const unsigned char* base = smem_buf().data();
  return c >= base && c + bytes <= base + smem_bytes();
}

// Thrown inside a thread once the block has been stopped by an error elsewhere.
struct BlockStopped {};

// One barrier (the block's, or one warp's). Arrivals are counted under the barrier's own mutex
// (so an exiting thread's drop cannot race an arrival); waiters sleep on the generation word
// (C++20 atomic wait: a futex, no mutex to re-take on wake-up).
struct Barrier {
  std::mutex m;
  int expected = 0, arrived = 0;
  std::atomic<uint32_t> generation{0};
};

// Per-warp scratch a collective's lanes publish into (two buffers, by collective-count parity).
struct LaneSlot {
  const char* op = nullptr;  // the collective's name (a string literal)
  uint64_t seq = ~0ull;      // the lane's collective count when it published
  const void* ptr = nullptr;
  uint32_t u[8] = {};
  float f[4] = {};
};
struct WarpScratch {
  LaneSlot slot[2][kWarp];
};

// Deadlock detection: `blocked_` counts threads waiting at a barrier that has not completed for
// them (the thread completing a barrier subtracts its waiters before it returns), `live_` the
// threads not yet exited; blocked == live means no thread can ever complete a barrier.
class Block {
 public:
  Block(int nthreads)
      : nthreads_(nthreads), live_(nthreads), warps_((nthreads + kWarp - 1) / kWarp),
        scratch_(warps_.size()) {
    block_bar_.expected = nthreads;
    for (int w = 0; w < (int)warps_.size(); ++w) warps_[w].expected = warp_size(w);
  }
  int nthreads() const { return nthreads_; }
  int warp_size(int w) const { return std::min(kWarp, nthreads_ - w * kWarp); }
  WarpScratch& scratch(int w) { return scratch_[w]; }

  void sync_block() { wait(block_bar_, "__syncthreads"); }
  void sync_warp(int w, const char* what) { wait(warps_[w], what); }

  // Stop every thread of the block (first message wins) and throw in the caller.
  [[noreturn]] void fail(const std::string& msg) {
    stop(msg);
    throw BlockStopped{};
  }
  // A thread leaves: it no longer counts for the barriers (an exited GPU thread does not block).
  void thread_exit(int tid) {
    drop(block_bar_);
    drop(warps_[tid / kWarp]);
    const int live = live_.fetch_sub(1) - 1;
    if (live > 0 && blocked_.load() == live)
      stop("emulated kernel deadlock: the remaining threads wait at barriers that the exited "
           "threads never reached (early return before __syncthreads or a warp collective?)");
  }
  void record_exception(const std::string& msg) { stop(msg); }
  std::string error() {
    std::lock_guard<std::mutex> l(error_m_);
    return error_;
  }

 private:
  void wait(Barrier& b, const char* what) {
    if (stopped_.load()) throw BlockStopped{};
    uint32_t g;
    {
      std::lock_guard<std::mutex> l(b.m);
      g = b.generation.load();
      if (++b.arrived == b.expected) {
        blocked_.fetch_sub(b.arrived - 1);
        b.arrived = 0;
        b.generation.fetch_add(1);
        b.generation.notify_all();
        return;
      }
    }
    if (blocked_.fetch_add(1) + 1 == live_.load())
      fail(std::string("emulated kernel deadlock: every live thread waits at a barrier that "
                       "cannot complete (last arrival at ") + what +
           "; divergent __syncthreads or a warp collective not executed by all lanes?)");
    while (b.generation.load() == g) b.generation.wait(g);
    if (stopped_.load()) throw BlockStopped{};
  }
  void drop(Barrier& b) {
    std::lock_guard<std::mutex> l(b.m);
    --b.expected;
    if (b.arrived > 0 && b.arrived == b.expected) {
      blocked_.fetch_sub(b.arrived);
      b.arrived = 0;
      b.generation.fetch_add(1);
      b.generation.notify_all();
    }
  }
  void stop(const std::string& msg) {
    {
      std::lock_guard<std::mutex> l(error_m_);
      if (error_.empty()) error_ = msg;
    }
    stopped_.store(true);
    for (Barrier* b : all_barriers()) {  // wake every waiter; they see stopped_ and leave
      b->generation.fetch_add(1);
      b->generation.notify_all();
    }
  }
  std::vector<Barrier*> all_barriers() {
    std::vector<Barrier*> v{&block_bar_};
    for (auto& w : warps_) v.push_back(&w);
    return v;
  }

  int nthreads_;
  std::atomic<int> live_, blocked_{0};
  std::atomic<bool> stopped_{false};
  std::mutex error_m_;
  std::string error_;
  Barrier block_bar_;
  std::vector<Barrier> warps_;
  std::vector<WarpScratch> scratch_;
};

inline Block*& block() {
  static Block* b = nullptr;
  return b;
}
inline thread_local dim3 tl_thread, tl_block;
inline thread_local uint64_t tl_collectives = 0;  // warp collectives this thread has executed
inline dim3 g_grid;

// Start a warp collective: publish into this lane's slot, pass the warp barrier, check that
// every lane of the warp executed the same collective, and return the slots to read.
// The caller fills `mine` through `publish` before the barrier.
template <typename Publish>
inline LaneSlot* warp_collective(const char* op, Publish&& publish) {
  Block& b = *block();
  const int tid = (int)tl_thread.x, w = tid / kWarp, lane = tid % kWarp;
  const uint64_t seq = tl_collectives++;
  LaneSlot* slots = b.scratch(w).slot[seq & 1];
  LaneSlot& mine = slots[lane];
  mine.op = op;
  mine.seq = seq;
  publish(mine);
  b.sync_warp(w, op);
  for (int l = 0; l < b.warp_size(w); ++l) {
    if (slots[l].seq != seq || (slots[l].op != op && std::strcmp(slots[l].op, op) != 0)) {
      const bool same_count = slots[l].seq == seq;
      b.fail("emulated warp collective mismatch in warp " + std::to_string(w) + ": lane " +
             std::to_string(lane) + " executes " + op + " as its collective #" +
             std::to_string(seq) + " but lane " + std::to_string(l) +
             (same_count ? std::string(" executes ") + slots[l].op
                         : std::string(" did not take part (diverged or exited)")) +
             "; warp collectives need every lane of the warp (full-warp masks only)");
    }
  }
  return slots;
}
inline void check_full_mask(unsigned mask, const char* op) {
  if (mask != 0xffffffffu)
    block()->fail(std::string("emulated ") + op + ": only the full-warp mask 0xffffffff is supported");
}
}  // namespace fb_emu

#define threadIdx (fb_emu::tl_thread)
#define blockIdx (fb_emu::tl_block)
#define gridDim (fb_emu::g_grid)
#define FB_DYNAMIC_SMEM(name) unsigned char* name = fb_emu::smem_buf().data()

inline void __syncthreads() { fb_emu::block()->sync_block(); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  fb_emu::check_full_mask(mask, "__syncwarp");
  fb_emu::warp_collective("__syncwarp", [](fb_emu::LaneSlot&) {});
}

namespace fb_emu {
template <typename T>
inline T shuffle(const char* op, unsigned mask, T v, int src_of_lane_fn(int lane, int arg, int width),
                 int arg, int width) {
  static_assert(sizeof(T) == 4, "emulated shuffles move 32-bit values");
  check_full_mask(mask, op);
  if (width <= 0 || width > kWarp || (width & (width - 1)))
    block()->fail(std::string("emulated ") + op + ": width must be a power of two <= 32");
  LaneSlot* s = warp_collective(op, [&](LaneSlot& m) { std::memcpy(&m.u[0], &v, 4); });
  const int lane = (int)tl_thread.x % kWarp;
  const int src = src_of_lane_fn(lane, arg, width);
  T r;
  std::memcpy(&r, &s[src].u[0], 4);
  return r;
}
inline int xor_src(int lane, int mask, int width) {
  const int s = lane ^ mask;  // outside the lane's width-segment: the lane's own value (CUDA rule)
  return (s / width == lane / width) ? s : lane;
}
inline int idx_src(int lane, int src, int width) {
  return (lane / width) * width + (((src % width) + width) % width);
}
}  // namespace fb_emu

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return fb_emu::shuffle("__shfl_xor_sync", mask, v, fb_emu::xor_src, lane_mask, width);
}
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return fb_emu::shuffle("__shfl_sync", mask, v, fb_emu::idx_src, src_lane, width);
}

template <typename K>
inline cudaError_t cudaFuncSetAttribute(K, cudaFuncAttribute, int bytes) {
  return (size_t)bytes <= fb_emu::device().smem_optin ? cudaSuccess : cudaErrorInvalidValue;
}
inline cudaError_t cudaGetDevice(int* dev) {
  *dev = 0;
  return cudaSuccess;
}
inline cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int) {
  const fb_emu::Device& d = fb_emu::device();
  *value = attr == cudaDevAttrComputeCapabilityMajor   ? d.major
           : attr == cudaDevAttrComputeCapabilityMinor ? d.minor
                                                       : (int)d.smem_optin;
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline const char* cudaGetErrorString(cudaError_t e) {
  return e == cudaSuccess ? "success" : "invalid value (emulated)";
}

namespace fb_emu {
inline void run_grid(dim3 grid, int nthreads, size_t smem, const std::function<void()>& body) {
  if (smem > device().smem_optin)
    throw std::runtime_error("emulated launch: shared memory over the emulated device's limit");
  if (nthreads <= 0 || nthreads > 1024)
    throw std::runtime_error("emulated launch: block size must be 1..1024 threads");
  g_grid = grid;
  smem_buf().assign(smem + kGuard, 0xAB);
  smem_bytes() = smem;
  for (unsigned by = 0; by < grid.y; ++by) {
    for (unsigned bx = 0; bx < grid.x; ++bx) {
      Block b(nthreads);
      block() = &b;
      std::vector<std::thread> ts;
      ts.reserve(nthreads);
      for (int t = 0; t < nthreads; ++t)
        ts.emplace_back([&, t] {
          tl_thread = dim3((unsigned)t);
          tl_block = dim3(bx, by);
          tl_collectives = 0;
          try {
            body();
          } catch (const BlockStopped&) {
          } catch (const std::exception& e) {
            b.record_exception(std::string("emulated kernel thread ") + std::to_string(t) +
                               " threw: " + e.what());
          }
          b.thread_exit(t);
        });
      for (auto& th : ts) th.join();
      block() = nullptr;
      if (!b.error().empty())
        throw std::runtime_error(b.error() + " (block " + std::to_string(bx) + "," +
                                 std::to_string(by) + ")");
      for (size_t i = smem; i < smem + kGuard; ++i)
        if (smem_buf()[i] != 0xAB) throw std::runtime_error("emulated kernel overran shared memory");
    }
  }
}
}  // namespace fb_emu

#define FB_LAUNCH(kernel, grid, smem, stream, ...) \
  fb_emu::run_grid(grid, NT, smem, [&] { kernel(__VA_ARGS__); })
