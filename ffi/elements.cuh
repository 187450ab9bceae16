// Element types of the kernels, moved as raw bits: conversion to and from f32, and the
// rounding through the element type that the pure-JAX reference applies to intermediates.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace jax_twell {

// ToFloat reads the low bits of its argument; FromFloat returns the bits zero-extended to
// 32 bits, so callers can shift them into packed words without signed overflow.
struct Bf16 {
  using Bits = uint16_t;
  __device__ static float ToFloat(uint32_t b) { return __uint_as_float((b & 0xffffu) << 16); }
  __device__ static uint32_t FromFloat(float v) { return __bfloat16_as_ushort(__float2bfloat16_rn(v)); }
};
struct F16 {
  using Bits = uint16_t;
  __device__ static float ToFloat(uint32_t b) { return __half2float(__ushort_as_half(static_cast<uint16_t>(b))); }
  __device__ static uint32_t FromFloat(float v) { return __half_as_ushort(__float2half_rn(v)); }
};
struct F32 {
  using Bits = uint32_t;
  __device__ static float ToFloat(uint32_t b) { return __uint_as_float(b); }
  __device__ static uint32_t FromFloat(float v) { return __float_as_uint(v); }
};

// Rounds through the element type, as the reference rounds its intermediates.
template <typename E>
__device__ __forceinline__ float Round(float v) {
  return E::ToFloat(E::FromFloat(v));
}

constexpr unsigned kFullMask = 0xffffffffu;

// Sixteen bytes of elements, as floats.
template <typename E>
struct Vec {
  static constexpr int V = 16 / sizeof(typename E::Bits);
  float v[V];
  __device__ __forceinline__ void Unpack(const uint4& raw) {
    const typename E::Bits* b = reinterpret_cast<const typename E::Bits*>(&raw);
#pragma unroll
    for (int i = 0; i < V; ++i) v[i] = E::ToFloat(b[i]);
  }
};

// Weights are streamed once per use and shared by nothing else in the SM: skip L1.
__device__ __forceinline__ uint4 LoadStreaming(const void* p) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
               : "l"(p));
  return r;
}

// Inclusive prefix sum of v over the lanes of a full warp (lane = threadIdx.x % 32).
__device__ __forceinline__ int WarpInclusiveSum(int v, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int other = __shfl_up_sync(kFullMask, v, o);
    if (lane >= o) v += other;
  }
  return v;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

}  // namespace jax_twell
