// Shared helpers for the jax-twell FFI handlers: error reporting and launch checks.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace jax_twell {

namespace ffi = xla::ffi;

// Reports the last CUDA error after a launch as an FFI error naming the kernel.
inline ffi::Error LaunchStatus(const char* kernel) {
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax-twell: launch of ") + kernel +
                                " failed: " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

inline ffi::Error Invalid(const std::string& message) {
  return ffi::Error::InvalidArgument("jax-twell: " + message);
}

// True when a buffer has exactly the dimensions ``b``.
inline bool SameDims(ffi::AnyBuffer::Dimensions a, std::initializer_list<int64_t> b) {
  if (a.size() != b.size()) return false;
  size_t i = 0;
  for (int64_t v : b)
    if (a[i++] != v) return false;
  return true;
}

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace jax_twell
