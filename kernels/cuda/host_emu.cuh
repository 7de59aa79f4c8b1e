// Host emulation of the small CUDA subset the kernels use, so that the exact kernel source runs on a CPU
// (g++ -std=c++20 -pthread) for parity tests on machines without a GPU. Test infrastructure only.
//
// Model: blocks run one after another; the threads of a block are real std::threads, so __syncthreads
// is a block barrier and the warp shuffles exchange through a per-warp buffer between two warp barriers.
// `__shared__` becomes `static` (one copy, shared by the block's threads, reused by the next block).
// All kernels here call shuffles and __syncwarp with full warps, which this emulation requires.
#pragma once
#include <algorithm>
#include <atomic>
#include <barrier>
#include <math.h>  // expf, exp2f, logf, ... in the global namespace, as on the device
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)
#define __align__(n) alignas(n)

struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct emu_dim3 { unsigned x = 1, y = 1, z = 1; };

namespace lopa_emu {

inline thread_local emu_dim3 tl_thread_idx, tl_block_idx;
inline emu_dim3 g_block_dim, g_grid_dim;

struct BlockState {
  std::unique_ptr<std::barrier<>> block_bar;
  std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
  std::vector<uint64_t> exch;
  std::vector<unsigned> frag;  // 6 words per thread: the mma operands of one warp, gathered
};
inline BlockState* g_block = nullptr;
inline std::vector<unsigned char> g_dyn_smem;

inline unsigned char* dynamic_smem() { return g_dyn_smem.data(); }
inline std::atomic<long> g_misaligned{0};
inline void check_align(const void* p, size_t a) {
  if (reinterpret_cast<uintptr_t>(p) % a) g_misaligned.fetch_add(1);
}
inline unsigned flat_tid() {
  return tl_thread_idx.x + g_block_dim.x * (tl_thread_idx.y + g_block_dim.y * tl_thread_idx.z);
}
inline void syncthreads() { g_block->block_bar->arrive_and_wait(); }
inline void syncwarp() { g_block->warp_bar[flat_tid() / 32]->arrive_and_wait(); }

template <typename T>
inline T shfl_from(T v, unsigned src_lane) {
  static_assert(sizeof(T) <= 8, "shuffle of at most 8 bytes");
  const unsigned tid = flat_tid(), base = tid & ~31u;
  uint64_t w = 0;
  std::memcpy(&w, &v, sizeof(T));
  g_block->exch[tid] = w;
  syncwarp();
  uint64_t r = g_block->exch[base + (src_lane & 31u)];
  syncwarp();  // nobody overwrites the buffer before every lane has read it
  T out;
  std::memcpy(&out, &r, sizeof(T));
  return out;
}

// mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}: the PTX fragment layout, lane = 4*g + t:
//   A 16x16 (row): a0 (g, 2t..2t+1)  a1 (g+8, 2t..)  a2 (g, 2t+8..)  a3 (g+8, 2t+8..)  (low half = lower col)
//   B 16x8 (col):  b0 (k 2t..2t+1, n g)  b1 (k 2t+8..2t+9, n g)
//   C/D 16x8:      d0,d1 (g, 2t..2t+1)  d2,d3 (g+8, 2t..2t+1)
inline float half_to_float(unsigned short h);
inline void mma_16816(float* d, const unsigned* a, const unsigned* b, const float* c, bool bf16) {
  const unsigned tid = flat_tid(), base = tid & ~31u, lane = tid & 31u;
  unsigned* f = g_block->frag.data();
  for (int w = 0; w < 4; ++w) f[tid * 6 + w] = a[w];
  f[tid * 6 + 4] = b[0];
  f[tid * 6 + 5] = b[1];
  syncwarp();
  auto cvt = [bf16](unsigned short h) {
    if (bf16) { uint32_t u = (uint32_t)h << 16; float x; std::memcpy(&x, &u, 4); return x; }
    return half_to_float(h);
  };
  auto half_of = [](unsigned w, int hi) { return (unsigned short)(hi ? w >> 16 : w & 0xffffu); };
  float A[16][16], B[16][8];
  for (unsigned l = 0; l < 32; ++l) {
    const unsigned g = l >> 2, t = l & 3;
    const unsigned* o = f + (base + l) * 6;
    for (int e = 0; e < 2; ++e) {
      A[g][2 * t + e] = cvt(half_of(o[0], e));
      A[g + 8][2 * t + e] = cvt(half_of(o[1], e));
      A[g][2 * t + 8 + e] = cvt(half_of(o[2], e));
      A[g + 8][2 * t + 8 + e] = cvt(half_of(o[3], e));
      B[2 * t + e][g] = cvt(half_of(o[4], e));
      B[2 * t + 8 + e][g] = cvt(half_of(o[5], e));
    }
  }
  syncwarp();
  const unsigned g = lane >> 2, t = lane & 3;
  const unsigned rows[4] = {g, g, g + 8, g + 8}, cols[4] = {2 * t, 2 * t + 1, 2 * t, 2 * t + 1};
  for (int e = 0; e < 4; ++e) {
    float acc = c[e];
    for (int k = 0; k < 16; ++k) acc += A[rows[e]][k] * B[k][cols[e]];
    d[e] = acc;
  }
}

// Runs kernel(args...) over the grid, one block at a time.
template <typename F>
void launch(emu_dim3 grid, emu_dim3 block, size_t smem_bytes, F&& body) {
  const unsigned nthreads = block.x * block.y * block.z;
  g_block_dim = block;
  g_grid_dim = grid;
  g_dyn_smem.assign(smem_bytes + 16, 0xCD);  // poisoned like uninitialised memory
  BlockState st;
  st.block_bar = std::make_unique<std::barrier<>>(nthreads);
  for (unsigned w = 0; w < (nthreads + 31) / 32; ++w)
    st.warp_bar.push_back(std::make_unique<std::barrier<>>(std::min(32u, nthreads - 32 * w)));
  st.exch.assign(nthreads, 0);
  st.frag.assign(nthreads * 6, 0);
  g_block = &st;
  // One std::thread per CUDA thread for the whole launch; they walk the blocks in order and meet at a
  // barrier after each one, so the next block starts only when the previous one (and its use of the
  // `static` shared memory) is finished. Every thread reaches that barrier even after an early return.
  std::vector<std::thread> threads;
  threads.reserve(nthreads);
  for (unsigned t = 0; t < nthreads; ++t)
    threads.emplace_back([&, t] {
      tl_thread_idx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
      for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
          for (unsigned bx = 0; bx < grid.x; ++bx) {
            tl_block_idx = {bx, by, bz};
            body();
            st.block_bar->arrive_and_wait();
          }
    });
  for (auto& th : threads) th.join();
  g_block = nullptr;
}

inline float half_to_float(unsigned short h) {
  _Float16 x;
  std::memcpy(&x, &h, 2);
  return (float)x;
}
inline unsigned short float_to_half(float f) {
  _Float16 x = (_Float16)f;  // round to nearest even
  unsigned short h;
  std::memcpy(&h, &x, 2);
  return h;
}
inline unsigned short float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return (unsigned short)(u >> 16);
}

}  // namespace lopa_emu

#define threadIdx (::lopa_emu::tl_thread_idx)
#define blockIdx (::lopa_emu::tl_block_idx)
#define blockDim (::lopa_emu::g_block_dim)
#define gridDim (::lopa_emu::g_grid_dim)

inline void __syncthreads() { lopa_emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { lopa_emu::syncwarp(); }
template <typename T> inline T __shfl_xor_sync(unsigned, T v, int m) {
  return lopa_emu::shfl_from(v, (lopa_emu::flat_tid() & 31u) ^ (unsigned)m);
}
template <typename T> inline T __shfl_sync(unsigned, T v, int src) { return lopa_emu::shfl_from(v, (unsigned)src); }
inline unsigned __ballot_sync(unsigned, int pred) {
  unsigned r = 0;
  for (unsigned l = 0; l < 32; ++l) r |= (lopa_emu::shfl_from(pred ? 1u : 0u, l) & 1u) << l;
  return r;
}
inline float __fadd_rn(float a, float b) { return a + b; }  // x86-64 without -mfma: no contraction
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; std::memcpy(&f, &u, 4); return f; }
inline int __float_as_int(float f) { int u; std::memcpy(&u, &f, 4); return u; }

// Launch by name from a foreign caller (ctypes), CUDA-driver style: argv[i] points at argument i.
#include <tuple>
#include <type_traits>
#include <utility>
namespace lopa_emu {
template <typename... A, size_t... I>
void call_argv(void (*k)(A...), void** argv, std::index_sequence<I...>) {
  k(*static_cast<std::remove_reference_t<A>*>(argv[I])...);
}
template <typename... A>
void launch_argv(void (*k)(A...), const unsigned* d, size_t smem, void** argv) {
  launch(emu_dim3{d[0], d[1], d[2]}, emu_dim3{d[3], d[4], d[5]}, smem,
         [&] { call_argv(k, argv, std::index_sequence_for<A...>{}); });
}
}  // namespace lopa_emu
// One translation unit per emulation library includes this header, so a non-inline definition is fine.
extern "C" long emu_misaligned_take() { return lopa_emu::g_misaligned.exchange(0); }
#define LOPA_EMU_EXPORT(name)                                                        \
  extern "C" void emu_launch_##name(const unsigned* dims, size_t smem, void** argv) { \
    lopa_emu::launch_argv(name, dims, smem, argv);                                    \
  }
