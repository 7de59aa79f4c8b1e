// Shared helpers for lopa_fast's CUDA kernels: 16-bit storage types, 16-byte loads, warp reductions.
//
// Self-contained on purpose: no CUDA or C++ standard headers, so the same text compiles under
//   nvcc (CI compile check, __CUDACC__), NVRTC (the runtime loader, __CUDACC_RTC__, no include path
//   needed) and a host C++ compiler with host_emu.cuh (CPU parity tests of the exact kernel source).
// Storage types are plain 16-bit words; conversions are single PTX cvt instructions on the device.
#pragma once

// Codes and tile sizes are defined once in Python (lopa_fast/reference/attention_modes.py, lopa_fast/ops/cuda/constants.py)
// and reach every compiler (NVRTC, nvcc, the host emulation) as -D flags.
#if !defined(LOPA_MODE_BLOCK_CAUSAL) || !defined(LOPA_ATTN_WARPS)
#error "compile with the -D flags of lopa_fast.ops.cuda.constants.define_flags()"
#endif
static_assert(LOPA_MODE_FULL != LOPA_MODE_BLOCK_CAUSAL && LOPA_MODE_FULL != LOPA_MODE_CAUSAL &&
                  LOPA_MODE_BLOCK_CAUSAL != LOPA_MODE_CAUSAL,
              "attention mode codes are distinct");

#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define LOPA_DEVICE_BUILD 1
#define LOPA_INLINE __device__ __forceinline__
#else
#include "host_emu.cuh"
#define LOPA_INLINE inline
#endif

namespace lopa {

struct bf16 { unsigned short u; static constexpr bool kIsBf16 = true; };
struct f16 { unsigned short u; static constexpr bool kIsBf16 = false; };

#define LOPA_NEG_INF (-__int_as_float(0x7f800000))

LOPA_INLINE float to_float(float x) { return x; }
LOPA_INLINE float to_float(bf16 x) { return __uint_as_float(((unsigned)x.u) << 16); }  // exact
LOPA_INLINE float half_bits_to_float(unsigned short h) {
#ifdef LOPA_DEVICE_BUILD
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
#else
  return lopa_emu::half_to_float(h);
#endif
}
LOPA_INLINE float to_float(f16 x) { return half_bits_to_float(x.u); }

// Every vector access goes through vptr: a plain cast on the device; on the host emulation it also counts
// misaligned addresses (a misaligned 16-byte access is a fault on the GPU and silent on a CPU).
template <typename V, typename P>
LOPA_INLINE V* vptr(P* p) {
#ifndef LOPA_DEVICE_BUILD
  lopa_emu::check_align(p, sizeof(V));
#endif
  return reinterpret_cast<V*>(p);
}

template <typename T> struct From;
template <> struct From<float> { static LOPA_INLINE float cvt(float x) { return x; } };
template <> struct From<bf16> {
  static LOPA_INLINE bf16 cvt(float x) {
    bf16 r;
#ifdef LOPA_DEVICE_BUILD
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r.u) : "f"(x));  // round to nearest even, as torch
#else
    r.u = lopa_emu::float_to_bf16(x);
#endif
    return r;
  }
};
template <> struct From<f16> {
  static LOPA_INLINE f16 cvt(float x) {
    f16 r;
#ifdef LOPA_DEVICE_BUILD
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r.u) : "f"(x));
#else
    r.u = lopa_emu::float_to_half(x);
#endif
    return r;
  }
};

// Elements of T in one 16-byte vector: 8 for 16-bit types, 4 for float.
template <typename T> struct Vec { static constexpr int N = 16 / sizeof(T); };

LOPA_INLINE void unpack2(unsigned w, bf16, float* o) {
  o[0] = __uint_as_float(w << 16);
  o[1] = __uint_as_float(w & 0xffff0000u);
}
LOPA_INLINE void unpack2(unsigned w, f16, float* o) {
  o[0] = half_bits_to_float((unsigned short)(w & 0xffffu));
  o[1] = half_bits_to_float((unsigned short)(w >> 16));
}

// One 16-byte load (p must be 16-byte aligned) converted to Vec<T>::N floats.
LOPA_INLINE void load_vec(const float* p, float* o) {
  float4 v = *vptr<const float4>(p);
  o[0] = v.x; o[1] = v.y; o[2] = v.z; o[3] = v.w;
}
template <typename T>
LOPA_INLINE void load_vec(const T* p, float* o) {
  uint4 v = *vptr<const uint4>(p);
  unpack2(v.x, T{}, o); unpack2(v.y, T{}, o + 2); unpack2(v.z, T{}, o + 4); unpack2(v.w, T{}, o + 6);
}

// N consecutive elements (N*sizeof(T) bytes, naturally aligned) to floats: the narrow loads of the
// attention P*V loop, where each lane owns D/32 output dims.
template <typename T, int N> struct LoadN {
  static LOPA_INLINE void run(const T* p, float* o) {
#pragma unroll
    for (int k = 0; k < N; ++k) o[k] = to_float(p[k]);
  }
};
template <typename T> struct LoadN<T, 4> {  // 16-bit T: one 8-byte load
  static LOPA_INLINE void run(const T* p, float* o) {
    uint2 v = *vptr<const uint2>(p);
    unpack2(v.x, T{}, o); unpack2(v.y, T{}, o + 2);
  }
};
template <> struct LoadN<float, 4> {
  static LOPA_INLINE void run(const float* p, float* o) { load_vec(p, o); }
};

LOPA_INLINE float warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}
LOPA_INLINE float warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Two floats -> one 32-bit word of two 16-bit T values (lo in the low half), round to nearest even.
template <typename T>
LOPA_INLINE unsigned pack2(float lo, float hi, T) {
#ifdef LOPA_DEVICE_BUILD
  unsigned r;
  if constexpr (T::kIsBf16) {
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  } else {
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  }
  return r;
#else
  return (unsigned)From<T>::cvt(lo).u | ((unsigned)From<T>::cvt(hi).u << 16);
#endif
}

// d = a * b + c on the tensor cores: mma.sync m16n8k16, fp32 accumulate (fragment layout: host_emu.cuh).
template <typename T>
LOPA_INLINE void mma_16816(float* d, const unsigned* a, const unsigned* b, const float* c) {
#ifdef LOPA_DEVICE_BUILD
#define LOPA_MMA_16816_ASM(TY)                                                                                 \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TY "." TY ".f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, " \
               "{%10,%11,%12,%13};"                                                                          \
               : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                                \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),       \
                 "f"(c[2]), "f"(c[3]))
  if constexpr (T::kIsBf16) {
    LOPA_MMA_16816_ASM("bf16");
  } else {
    LOPA_MMA_16816_ASM("f16");
  }
#undef LOPA_MMA_16816_ASM
#else
  lopa_emu::mma_16816(d, a, b, c, T::kIsBf16);
#endif
}

}  // namespace lopa

// Dynamic shared memory: one extern array per kernel on the device; a per-block static buffer in the
// host emulation (blocks run one at a time there).
#ifdef LOPA_DEVICE_BUILD
#define LOPA_DYNAMIC_SMEM(ptr) \
  extern __shared__ __align__(16) unsigned char lopa_dyn_smem_[]; \
  unsigned char* ptr = lopa_dyn_smem_
#else
#define LOPA_DYNAMIC_SMEM(ptr) unsigned char* ptr = lopa_emu::dynamic_smem()
#endif
