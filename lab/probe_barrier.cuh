// Shared by the standalone probes (stream_floor.cu, row_copy_probe.cu): a CUDA error check
// and the mbarrier / copy-engine PTX they drive by hand (shared-memory addresses as 32-bit
// offsets; the library's kernels use CUTLASS's pipelines instead).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                              \
  do {                                                                                        \
    cudaError_t e_ = (x);                                                                     \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

namespace probe {

// A device copy of v, with pad zero elements after it (for loads that read ahead).
template <typename T>
T* Upload(const std::vector<T>& v, size_t pad = 0) {
  T* p;
  const size_t n = v.size() + pad;
  CHECK(cudaMalloc(&p, (n > 0 ? n : 1) * sizeof(T)));
  if (!v.empty()) CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  if (pad > 0) CHECK(cudaMemset(p + v.size(), 0, pad * sizeof(T)));
  return p;
}

__device__ __forceinline__ uint32_t Smem(const void* p) { return static_cast<uint32_t>(__cvta_generic_to_shared(p)); }
// An mbarrier at shared address `bar` expecting `count` arrivals a phase.
__device__ __forceinline__ void BarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void BarArrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// One arrival that also expects `bytes` of bulk copies to complete on the phase.
__device__ __forceinline__ void BarArriveTx(uint32_t bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void BarWait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}" ::"r"(bar),
      "r"(parity)
      : "memory");
}
// The bulk copy engine: `bytes` (a multiple of 16) from global `src` to shared `dst`,
// completing on `bar`'s expected bytes.
__device__ __forceinline__ void Bulk(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(dst),
               "l"(src), "r"(bytes), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void CpAsync16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src));
}
// One arrival on `bar` once this thread's earlier cp.async have landed.
__device__ __forceinline__ void CpAsyncArrive(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

}  // namespace probe
