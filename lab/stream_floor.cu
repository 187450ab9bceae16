// stream_floor: how fast one kernel can stream a decode layer's gate weight (f rows of d
// bf16, stored by neuron) from HBM and dot every row with one token, on this GPU.
//
// The decode rows kernel (ffi/twell_decode_rows.cu) is this stream plus a short tail; this
// program measures the stream alone, with two ways of moving the bytes:
//   lsu   each warp loads whole rows into registers (16-byte loads, `ld.global.nc`), P rows
//         in flight per warp, over a persistent grid (CTAs per SM from the occupancy
//         calculator) or one CTA per 8 x P rows ("oneshot": every load issued at once);
//   tma   each warp owns a ring of S shared-memory stages, one row each, filled by the bulk
//         copy engine (`cp.async.bulk` completing on an mbarrier); lane 0 refills a stage
//         as soon as the warp has read it.
// Each launch reads the next of 8 copies of the weight (8 x 23 MB at d=2048, f=5632, more
// than L2 holds), so every byte comes from HBM, as in a stack of layers. Time per launch =
// CUDA-event time of 200 back-to-back launches / 200 (launch gaps included, as a decode
// step sees them).
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Iffi lab/stream_floor.cu -o stream_floor
// Run:   ./stream_floor [d=2048] [f=5632]   (prints a table; --json prints JSON lines too)
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "elements.cuh"

#include "probe_barrier.cuh"

using namespace probe;

constexpr int kD = 2048;               // elements per row (compile-time: the lane's share is 8 vectors)
constexpr int kVecs = kD / (32 * 8);   // 16-byte vectors per lane per row

using jax_twell::LoadStreaming;  // 16-byte loads that skip L1 (the kernels' own)

__device__ __forceinline__ float Dot8(uint4 w, uint4 x, float acc) {
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&x);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
    acc = fmaf(fa.x, fb.x, acc);
    acc = fmaf(fa.y, fb.y, acc);
  }
  return acc;
}

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Rows gw, gw + W, gw + 2W, ... of the warp (W = warps in the grid), P in flight.
template <int P>
__global__ void __launch_bounds__(256) LsuRows(const uint16_t* __restrict__ w, int rows, const uint16_t* __restrict__ x,
                                               float* __restrict__ out) {
  const int lane = threadIdx.x % 32;
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nw = gridDim.x * blockDim.x / 32;
  uint4 xv[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) xv[i] = *reinterpret_cast<const uint4*>(x + 8 * (lane + 32 * i));
  uint4 buf[P][kVecs];
#pragma unroll
  for (int p = 0; p < P; ++p) {
    const int row = gw + p * nw;
#pragma unroll
    for (int i = 0; i < kVecs; ++i)
      buf[p][i] = row < rows ? LoadStreaming(w + static_cast<int64_t>(row) * kD + 8 * (lane + 32 * i)) : make_uint4(0, 0, 0, 0);
  }
  for (int k = 0;; k += P) {
#pragma unroll
    for (int p = 0; p < P; ++p) {
      const int row = gw + (k + p) * nw;
      if (row >= rows) return;
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) acc = Dot8(buf[p][i], xv[i], acc);
      const int next = row + P * nw;
#pragma unroll
      for (int i = 0; i < kVecs; ++i)
        buf[p][i] = next < rows ? LoadStreaming(w + static_cast<int64_t>(next) * kD + 8 * (lane + 32 * i)) : make_uint4(0, 0, 0, 0);
      acc = WarpSum(acc);
      if (lane == 0) out[row] = acc;
    }
  }
}

// One row by the bulk copy engine into `dst`, completing on `bar` (one arrival with its bytes).
__device__ __forceinline__ void BulkRow(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  BarArriveTx(Smem(bar), bytes);
  Bulk(Smem(dst), src, bytes, Smem(bar));
}

// Warp-private ring of S one-row stages filled by the bulk copy engine.
template <int S>
__global__ void __launch_bounds__(256) TmaRows(const uint16_t* __restrict__ w, int rows, const uint16_t* __restrict__ x,
                                               float* __restrict__ out) {
  extern __shared__ __align__(128) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int gw = (blockIdx.x * blockDim.x + threadIdx.x) / 32, nw = gridDim.x * blockDim.x / 32;
  constexpr uint32_t kRowBytes = kD * 2;
  uint8_t* ring = smem + static_cast<size_t>(warp) * S * kRowBytes;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem + static_cast<size_t>(blockDim.x / 32) * S * kRowBytes) + warp * S;
  if (lane == 0) {
    for (int s = 0; s < S; ++s) BarInit(Smem(bars + s), 1);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncwarp();
  if (lane == 0) {
    for (int s = 0; s < S; ++s) {
      const int row = gw + s * nw;
      if (row < rows) BulkRow(ring + s * kRowBytes, w + static_cast<int64_t>(row) * kD, kRowBytes, bars + s);
    }
  }
  uint4 xv[kVecs];
#pragma unroll
  for (int i = 0; i < kVecs; ++i) xv[i] = *reinterpret_cast<const uint4*>(x + 8 * (lane + 32 * i));
  for (int k = 0;; ++k) {
    const int row = gw + k * nw;
    if (row >= rows) return;
    const int s = k % S;
    BarWait(Smem(bars + s), (k / S) & 1);
    const uint4* stage = reinterpret_cast<const uint4*>(ring + s * kRowBytes);
    float acc = 0.f;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) acc = Dot8(stage[lane + 32 * i], xv[i], acc);
    __syncwarp();
    const int next = row + S * nw;
    if (lane == 0 && next < rows) {
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
      BulkRow(ring + s * kRowBytes, w + static_cast<int64_t>(next) * kD, kRowBytes, bars + s);
    }
    acc = WarpSum(acc);
    if (lane == 0) out[row] = acc;
  }
}

struct Result {
  const char* name;
  int ctas_per_sm, grid, depth;
  float us;
};

template <typename Kernel>
Result Time(const char* name, Kernel kernel, int grid, int smem, int depth, const std::vector<uint16_t*>& w, int rows,
            const uint16_t* x, float* out, int sms) {
  if (smem > 48 * 1024) CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, 256, smem));
  if (grid <= 0) grid = per_sm * sms;  // persistent: one wave
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  const int warm = 16, reps = 200;
  for (int i = 0; i < warm; ++i) kernel<<<grid, 256, smem>>>(w[i % w.size()], rows, x, out);
  CHECK(cudaEventRecord(a));
  for (int i = 0; i < reps; ++i) kernel<<<grid, 256, smem>>>(w[i % w.size()], rows, x, out);
  CHECK(cudaEventRecord(b));
  CHECK(cudaEventSynchronize(b));
  CHECK(cudaGetLastError());
  float ms = 0.f;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  return Result{name, per_sm, grid, depth, 1e3f * ms / reps};
}

int main(int argc, char** argv) {
  bool json = false;
  int f = 5632;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--json")) json = true;
    else f = std::atoi(argv[i]);
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const size_t bytes = static_cast<size_t>(f) * kD * 2;
  std::vector<uint16_t*> w(8);
  std::vector<uint16_t> host(static_cast<size_t>(f) * kD);
  for (size_t i = 0; i < host.size(); ++i) host[i] = 0x3c00 + (i * 2654435761u >> 20) % 64;  // small bf16 values
  for (auto& p : w) {
    CHECK(cudaMalloc(&p, bytes));
    CHECK(cudaMemcpy(p, host.data(), bytes, cudaMemcpyHostToDevice));
  }
  uint16_t* x;
  float* out;
  CHECK(cudaMalloc(&x, kD * 2));
  CHECK(cudaMemcpy(x, host.data(), kD * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&out, f * sizeof(float)));
  std::vector<Result> res;
  res.push_back(Time("lsu P1", LsuRows<1>, 0, 0, 1, w, f, x, out, sms));
  res.push_back(Time("lsu P2", LsuRows<2>, 0, 0, 2, w, f, x, out, sms));
  res.push_back(Time("lsu P3", LsuRows<3>, 0, 0, 3, w, f, x, out, sms));
  res.push_back(Time("lsu oneshot P2", LsuRows<2>, (f + 15) / 16, 0, 2, w, f, x, out, sms));
  res.push_back(Time("lsu oneshot P1", LsuRows<1>, (f + 7) / 8, 0, 1, w, f, x, out, sms));
  const int row_bytes = kD * 2;
  for (int s : {2, 3, 4, 6}) {
    const int smem = 8 * s * (row_bytes + 8);
    auto k = s == 2 ? TmaRows<2> : s == 3 ? TmaRows<3> : s == 4 ? TmaRows<4> : TmaRows<6>;
    char* name = new char[32];
    std::snprintf(name, 32, "tma S%d", s);
    res.push_back(Time(name, k, 0, smem, s, w, f, x, out, sms));
  }
  std::printf("stream of %d x %d bf16 (%.1f MB) per launch, %s, %d SMs\n", f, kD, bytes / 1e6, prop.name, sms);
  std::printf("%-16s %7s %6s %6s %9s %8s\n", "kernel", "CTA/SM", "grid", "depth", "us", "TB/s");
  for (auto& r : res) {
    std::printf("%-16s %7d %6d %6d %9.2f %8.2f\n", r.name, r.ctas_per_sm, r.grid, r.depth, r.us, bytes / (r.us * 1e-6) / 1e12);
    if (json)
      std::printf("{\"kernel\": \"%s\", \"ctas_per_sm\": %d, \"grid\": %d, \"depth\": %d, \"us\": %.3f, \"bytes\": %zu}\n", r.name,
                  r.ctas_per_sm, r.grid, r.depth, r.us, bytes);
  }
  return 0;
}
