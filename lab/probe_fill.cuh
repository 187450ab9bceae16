// The standalone probes' operand fill: values in [-1, 1] in steps of 1e-3 from a hash of
// the index, so the operands have random bits, as real ones do (a GEMM's power, and so its
// clock, depends on them). T: any 16-bit float type constructible from float.
#pragma once

#include <cstddef>
#include <cstdint>

template <class T>
__global__ void FillKernel(T* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint32_t h = uint32_t(i) * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = T((int(h % 2001) - 1000) * 1e-3f);
  }
}
