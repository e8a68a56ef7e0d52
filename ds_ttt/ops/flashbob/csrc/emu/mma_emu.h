// CPU emulation of csrc/mma.cuh (namespace fbmma) for the CUDA emulator (cuda_emu.h): ldmatrix,
// mma.sync m16n8k16 (bf16/f16 -> f32), cp.async with commit/wait groups, bf16x2/f16x2 packing.
// Included by mma.cuh under FLASHBOB_CUDA_EMU; tested by tests/unit/test_mma_emu.py and proven
// against the GPU, lane by lane, by tests/ops/test_mma_probe_cuda.py (both run csrc/mma_probe.cu).
//
// The fragment layouts are written from the PTX ISA (release 8.x, "Parallel Thread Execution ISA",
// section 9.7.14 "Warp Level Matrix Multiply-Accumulate Instructions"), not from any kernel:
//   9.7.14.5.8  "Matrix Fragments for mma.m16n8k16 with floating point type" (.f16/.bf16 A, B,
//               and the .f32 accumulators C/D), with groupID = %laneid >> 2 and
//               threadID_in_group = %laneid % 4;
//   9.7.14.5.15 "Warp-level matrix load instruction: ldmatrix" (.m8n8 .b16 .x1/.x2/.x4, .trans);
// and section 9.7.9 "Data Movement and Conversion Instructions": cp.async, cp.async.commit_group,
// cp.async.wait_group / cp.async.wait_all.
//
// Emulation model (see cuda_emu.h for the threads and barriers):
//   ldmatrix, mma   warp collectives: every lane publishes its operands (row address; A/B
//                   registers) into the warp's scratch, the warp passes a barrier, and each lane
//                   then assembles its own result registers from the published operands. All 32
//                   lanes of the warp must execute the same instruction (checked: a diverged lane
//                   is an error, as the ISA's .sync.aligned makes it undefined). The block need not
//                   execute it uniformly: the barrier is per warp.
//   ldmatrix        row addresses of the matrices read (lanes 0..8*num-1) must be 16-byte aligned
//                   and lie inside the launch's dynamic shared memory (checked); the other lanes'
//                   addresses are ignored, as in the ISA. Reads happen after the warp barrier.
//   mma             d = c + sum_k a*b with every product exact and the sum accumulated in double,
//                   rounded once to fp32 (the tensor core's own internal rounding is not modelled:
//                   for inputs whose partial sums are exact in fp32 the two agree bit for bit).
//   cp.async        per-thread queue: the destination bytes (16, or 4/8) are poisoned (0xFF: NaN as bf16,
//                   f16 and f32) at issue; copies join a group at cp_async_commit; cp_async_wait<N>
//                   performs (copies or zero-fills) all but the N newest groups. Data read before
//                   its wait, or by another thread without a __syncthreads after the wait, is
//                   therefore poison or stale, as it may be on the GPU. Copies issued but never
//                   waited for are dropped when the thread exits. Both addresses must be aligned
//                   to the copy's size (checked; for the zfill variants with valid=false too,
//                   though the source is not read), the destination inside shared memory.
#pragma once

#ifndef FLASHBOB_CUDA_EMU
#error "emu/mma_emu.h is the CPU emulation of mma.cuh; include mma.cuh instead"
#endif

#include <cstdint>
#include <cstring>
#include <deque>
#include <string>
#include <vector>

#include "cuda_emu.h"

namespace fbmma {
namespace emu {

inline int lane_id() { return (int)(threadIdx.x % fb_emu::kWarp); }

inline uint16_t load_b16(const void* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}

// ---- ldmatrix (PTX ISA 9.7.14.5.15) -----------------------------------------------------------
// Threads 0-7 give the row addresses of matrix 0, 8-15 of matrix 1, 16-23 of matrix 2, 24-31 of
// matrix 3 (.x1 uses threads 0-7 only, .x2 threads 0-15). Each matrix row is 8 b16 elements (16
// bytes). Destination register i of every lane holds a fragment of matrix i: "each thread in a
// warp holds fragments of a row, a group of four threads an entire row", i.e. lane L holds row
// L >> 2, elements 2*(L % 4) and 2*(L % 4) + 1, the lower column in the low 16 bits. With .trans
// the matrix is delivered transposed (column-major load): lane L holds elements (2*(L % 4), L >> 2)
// and (2*(L % 4) + 1, L >> 2) of the matrix as stored.
template <int NUM, bool TRANS>
inline void ldmatrix(uint32_t (&r)[NUM], const void* smem_row, const char* op) {
  fb_emu::LaneSlot* s =
      fb_emu::warp_collective(op, [&](fb_emu::LaneSlot& m) { m.ptr = smem_row; });
  for (int l = 0; l < 8 * NUM; ++l) {  // the addresses the instruction uses
    const void* p = s[l].ptr;
    if (!fb_emu::in_smem(p, 16) || (reinterpret_cast<uintptr_t>(p) & 15u) != 0)
      fb_emu::block()->fail(std::string("emulated ") + op + ": lane " + std::to_string(l) +
                            " passed a row address that is not 16-byte aligned shared memory "
                            "(row " + std::to_string(l % 8) + " of matrix " +
                            std::to_string(l / 8) + ")");
  }
  const int lane = lane_id(), group = lane >> 2, tig = lane % 4;
  for (int i = 0; i < NUM; ++i) {
    const fb_emu::LaneSlot* rows = s + 8 * i;  // lanes 8i..8i+7: rows 0..7 of matrix i
    uint16_t lo, hi;
    if (!TRANS) {
      const auto* row = static_cast<const unsigned char*>(rows[group].ptr);
      lo = load_b16(row + 2 * (2 * tig));
      hi = load_b16(row + 2 * (2 * tig + 1));
    } else {
      lo = load_b16(static_cast<const unsigned char*>(rows[2 * tig].ptr) + 2 * group);
      hi = load_b16(static_cast<const unsigned char*>(rows[2 * tig + 1].ptr) + 2 * group);
    }
    r[i] = (uint32_t)lo | ((uint32_t)hi << 16);
  }
}

// ---- mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 (PTX ISA 9.7.14.5.8) ----
// Element i of a lane's fragment sits in register i / 2, low half for even i.
//   A (16x16, a0..a7):  row = groupID       for 0 <= i < 2 || 4 <= i < 6, groupID + 8 otherwise
//                       col = threadID_in_group*2 + (i & 1)      for i < 4, + 8 for i >= 4
//   B (16x8,  b0..b3):  row = threadID_in_group*2 + (i & 1)      for i < 2, + 8 for i >= 2
//                       col = groupID
//   C, D (16x8, f32, c0..c3): row = groupID for i < 2, groupID + 8 for i >= 2
//                       col = threadID_in_group*2 + (i & 1)
inline int a_row(int lane, int i) { return (lane >> 2) + ((i < 2 || (i >= 4 && i < 6)) ? 0 : 8); }
inline int a_col(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i < 4 ? 0 : 8); }
inline int b_row(int lane, int i) { return (lane % 4) * 2 + (i & 1) + (i < 2 ? 0 : 8); }
inline int b_col(int lane, int /*i*/) { return lane >> 2; }
inline int c_row(int lane, int i) { return (lane >> 2) + (i < 2 ? 0 : 8); }
inline int c_col(int lane, int i) { return (lane % 4) * 2 + (i & 1); }

inline float bf16_bits_to_float(uint16_t h) {
  const uint32_t u = (uint32_t)h << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float f16_bits_to_float(uint16_t h) {
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

template <bool BF16>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                         const float (&c)[4], const char* op) {
  fb_emu::LaneSlot* s = fb_emu::warp_collective(op, [&](fb_emu::LaneSlot& m) {
    for (int j = 0; j < 4; ++j) m.u[j] = a[j];
    m.u[4] = b[0];
    m.u[5] = b[1];
  });
  auto elem = [](uint32_t reg, int i) -> float {
    const uint16_t h = (uint16_t)((i & 1) ? (reg >> 16) : (reg & 0xffffu));
    return BF16 ? bf16_bits_to_float(h) : f16_bits_to_float(h);
  };
  float A[16][16], B[16][8];
  for (int l = 0; l < fb_emu::kWarp; ++l) {
    for (int i = 0; i < 8; ++i) A[a_row(l, i)][a_col(l, i)] = elem(s[l].u[i / 2], i);
    for (int i = 0; i < 4; ++i) B[b_row(l, i)][b_col(l, i)] = elem(s[l].u[4 + i / 2], i);
  }
  const int lane = lane_id();
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int row = c_row(lane, i), col = c_col(lane, i);
    double acc = c[i];
    for (int k = 0; k < 16; ++k) acc += (double)A[row][k] * (double)B[k][col];
    out[i] = (float)acc;
  }
  for (int i = 0; i < 4; ++i) d[i] = out[i];  // d may alias c
}

// ---- cp.async (PTX ISA 9.7.9: cp.async, cp.async.commit_group, cp.async.wait_group) ----------
constexpr unsigned char kPoison = 0xFF;
struct PendingCopy {
  void* dst;
  const void* src;
  bool fill;  // false: src-size 0, the bytes become zeros
  int bytes;  // 16, 8 or 4
};
struct AsyncQueue {
  std::vector<PendingCopy> uncommitted;
  std::deque<std::vector<PendingCopy>> groups;  // oldest first
};
inline AsyncQueue& queue() {  // one per emulated thread; dies with it (pending copies dropped)
  static thread_local AsyncQueue q;
  return q;
}
inline void issue(void* smem, const void* gmem, bool fill, int bytes, const char* op) {
  const uintptr_t align = (uintptr_t)bytes - 1;
  if (!fb_emu::in_smem(smem, bytes) || (reinterpret_cast<uintptr_t>(smem) & align) != 0)
    fb_emu::block()->fail(std::string("emulated ") + op + ": thread " +
                          std::to_string(threadIdx.x) + " passed a destination that is not " +
                          std::to_string(bytes) + "-byte aligned shared memory");
  if (gmem == nullptr || (reinterpret_cast<uintptr_t>(gmem) & align) != 0)
    fb_emu::block()->fail(std::string("emulated ") + op + ": thread " +
                          std::to_string(threadIdx.x) + " passed a global source that is null or not " +
                          std::to_string(bytes) + "-byte aligned");
  std::memset(smem, kPoison, bytes);
  queue().uncommitted.push_back({smem, gmem, fill, bytes});
}
inline void complete(const std::vector<PendingCopy>& group) {
  for (const auto& c : group) {
    if (c.fill)
      std::memcpy(c.dst, c.src, c.bytes);
    else
      std::memset(c.dst, 0, c.bytes);
  }
}
inline void wait_group(int n) {
  auto& q = queue();
  while ((int)q.groups.size() > n) {
    complete(q.groups.front());
    q.groups.pop_front();
  }
}

}  // namespace emu

// ---- the mma.cuh interface --------------------------------------------------------------------
inline void ldmatrix_x1(uint32_t& r0, const void* smem_row) {
  uint32_t r[1];
  emu::ldmatrix<1, false>(r, smem_row, "ldmatrix.x1");
  r0 = r[0];
}
inline void ldmatrix_x2(uint32_t& r0, uint32_t& r1, const void* smem_row) {
  uint32_t r[2];
  emu::ldmatrix<2, false>(r, smem_row, "ldmatrix.x2");
  r0 = r[0];
  r1 = r[1];
}
inline void ldmatrix_x4(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                        const void* smem_row) {
  uint32_t r[4];
  emu::ldmatrix<4, false>(r, smem_row, "ldmatrix.x4");
  r0 = r[0];
  r1 = r[1];
  r2 = r[2];
  r3 = r[3];
}
inline void ldmatrix_x1_trans(uint32_t& r0, const void* smem_row) {
  uint32_t r[1];
  emu::ldmatrix<1, true>(r, smem_row, "ldmatrix.x1.trans");
  r0 = r[0];
}
inline void ldmatrix_x2_trans(uint32_t& r0, uint32_t& r1, const void* smem_row) {
  uint32_t r[2];
  emu::ldmatrix<2, true>(r, smem_row, "ldmatrix.x2.trans");
  r0 = r[0];
  r1 = r[1];
}
inline void ldmatrix_x4_trans(uint32_t& r0, uint32_t& r1, uint32_t& r2, uint32_t& r3,
                              const void* smem_row) {
  uint32_t r[4];
  emu::ldmatrix<4, true>(r, smem_row, "ldmatrix.x4.trans");
  r0 = r[0];
  r1 = r[1];
  r2 = r[2];
  r3 = r[3];
}

inline void mma_m16n8k16_bf16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                              const float (&c)[4]) {
  emu::mma_m16n8k16<true>(d, a, b, c, "mma.m16n8k16.bf16");
}
inline void mma_m16n8k16_f16(float (&d)[4], const uint32_t (&a)[4], const uint32_t (&b)[2],
                             const float (&c)[4]) {
  emu::mma_m16n8k16<false>(d, a, b, c, "mma.m16n8k16.f16");
}

inline void cp_async_16(void* smem, const void* gmem) {
  emu::issue(smem, gmem, true, 16, "cp.async");
}
inline void cp_async_16_zfill(void* smem, const void* gmem, bool valid) {
  emu::issue(smem, gmem, valid, 16, "cp.async (zfill)");
}
inline void cp_async_4_zfill(void* smem, const void* gmem, bool valid) {
  emu::issue(smem, gmem, valid, 4, "cp.async.ca 4 (zfill)");
}
inline void cp_async_8_zfill(void* smem, const void* gmem, bool valid) {
  emu::issue(smem, gmem, valid, 8, "cp.async.ca 8 (zfill)");
}
inline void cp_async_commit() {
  auto& q = emu::queue();
  q.groups.push_back(std::move(q.uncommitted));  // an empty group is legal (and waited for trivially)
  q.uncommitted.clear();
}
template <int N>
inline void cp_async_wait() {
  static_assert(N >= 0, "cp.async.wait_group N needs N >= 0");
  emu::wait_group(N);
}
inline void cp_async_wait_all() {  // cp.async.wait_all = commit_group + wait_group 0
  cp_async_commit();
  emu::wait_group(0);
}

inline uint32_t pack_bf16x2(float lo, float hi) {
  return (uint32_t)c10::BFloat16(lo).x | ((uint32_t)c10::BFloat16(hi).x << 16);
}
inline uint32_t pack_f16x2(float lo, float hi) {
  return (uint32_t)c10::Half(lo).x | ((uint32_t)c10::Half(hi).x << 16);
}
inline void unpack_bf16x2(uint32_t r, float& lo, float& hi) {
  lo = emu::bf16_bits_to_float((uint16_t)(r & 0xffffu));
  hi = emu::bf16_bits_to_float((uint16_t)(r >> 16));
}
inline void unpack_f16x2(uint32_t r, float& lo, float& hi) {
  lo = emu::f16_bits_to_float((uint16_t)(r & 0xffffu));
  hi = emu::f16_bits_to_float((uint16_t)(r >> 16));
}

}  // namespace fbmma
