// Shared helpers for the jax-twell FFI handlers: error reporting and launch checks.
#pragma once

#include <cuda_runtime.h>

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

inline int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace jax_twell
