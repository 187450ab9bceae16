// The hardware facts a CUTLASS kernel is launched with (SM count, active clusters), per
// device, queried once: the query costs a few microseconds, paid by the first call only.
#pragma once

#include <cuda_runtime.h>

#include "cutlass/kernel_hardware_info.h"

namespace jax_twell {

template <class Kernel>
cutlass::KernelHardwareInfo CachedHardwareInfo() {
  constexpr int kMaxDevices = 64;
  static cutlass::KernelHardwareInfo cache[kMaxDevices];
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= kMaxDevices) return cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device);
  if (cache[device].sm_count == 0) cache[device] = cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device);
  return cache[device];
}

}  // namespace jax_twell
