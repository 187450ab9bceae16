// gemm_probe: how fast can stock CUTLASS GEMMs run the gate's shape (standalone probe).
//
// The fused gate kernel (ffi/twell_gate.cu) is a CUTLASS GEMM with a TwELL epilogue; its
// cooperative 128 x 256 configuration runs at ~0.65x of XLA's matmul where its ping-pong
// 64 x 256 one runs at ~0.86x. This probe times plain GEMMs (D = x @ w in bf16, CUTLASS's
// own TMA epilogue) of the same shape in several configurations, to tell whether the
// main loop of a configuration or the TwELL epilogue sets the fused kernel's speed:
// schedule (cooperative / ping-pong), tile, cluster, and w's layout (as stored, [d, f]
// with f contiguous, or transposed).
//
// It also times the fused kernel's GEMM with its TwELL epilogue (ffi/twell_gate_epilogue.cuh),
// whole and with only its first steps, to tell what each step costs.
//
// Build: nvcc -O3 -std=c++17 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//          -Iffi -I$CUTLASS/include -I$CUTLASS/tools/util/include lab/gemm_probe.cu -o gemm_probe
// Run:   ./gemm_probe [M d f]   (default 16384 2048 5632); CUDA-event time of 50 calls.
#include <cstdio>
#include <cstdlib>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "probe_gemm.cuh"
#include "twell_gate_epilogue.cuh"

using namespace cute;


// x[:, 0] = 1 and w[0, :] = -shift: every pre-activation shifted down, so that with the
// fill's uniform values (variance 1/3 each) about 0.5% of the gate is positive.
__global__ void SparsifyKernel(BF16* x, BF16* w, int m, int d, int f, float shift) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < m || i < f; i += gridDim.x * blockDim.x) {
    if (i < m) x[size_t(i) * d] = BF16(1.f);
    if (i < f) w[i] = BF16(-shift);
  }
}

// The fused gate kernel's GEMM with its TwELL epilogue, whole (kSteps 7) or in part (the
// steps of twell_gate_epilogue.cuh: 0 none, 1 masks and counts, 3 and the slots staged).
template <class Schedule, class Tile, class Cluster, int kSteps>
float TimeTwell(const char* name, int m, int d, int f, const BF16* x, const BF16* w, uint16_t* values, int16_t* cols,
                int32_t* counts) {
  using Epilogue =
      cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<jax_twell::TwellPackEpilogue<BF16, kSteps>>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, BF16, cutlass::layout::RowMajor, 8, BF16,
      cutlass::layout::RowMajor, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename jax_twell::TwellPackEpilogue<BF16, kSteps>::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  auto sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {m, d, 1});
  auto sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {f, d, 1});
  const int n_tiles = (f + 255) / 256;
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {m, f, d, 1},
                                {x, sa, w, sb},
                                {values, cols, counts, m, n_tiles, 32},
                                cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(0)};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess) {
    printf("%-44s cannot run\n", name);
    return 0.f;
  }
  return TimeRuns(name, gemm, args, m, d, f);
}

int main(int argc, char** argv) {
  const int m = argc > 1 ? atoi(argv[1]) : 16384, d = argc > 2 ? atoi(argv[2]) : 2048, f = argc > 3 ? atoi(argv[3]) : 5632;
  BF16 *x, *w, *out;
  cudaMalloc(&x, sizeof(BF16) * size_t(m) * d);
  cudaMalloc(&w, sizeof(BF16) * size_t(d) * f);
  cudaMalloc(&out, sizeof(BF16) * size_t(m) * f);
  FillKernel<<<1024, 256>>>(x, size_t(m) * d, 1u);
  FillKernel<<<1024, 256>>>(w, size_t(d) * f, 2u);
  SparsifyKernel<<<256, 256>>>(x, w, m, d, f, 2.576f * sqrtf((d - 1) / 9.f));
  printf("M=%d d=%d f=%d, ~0.5%% of x @ w positive; plain GEMMs D = x @ w (bf16, CUTLASS TMA epilogue), then the TwELL epilogue\n", m, d, f);
  using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using Ping = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
  using PingEpi = cutlass::epilogue::TmaWarpSpecialized;
  using NMajor = cutlass::layout::RowMajor;     // w [d, f] as stored
  using KMajor = cutlass::layout::ColumnMajor;  // w stored transposed, [f, d]
  using T128x256 = Shape<_128, _256, _64>;
  using T64x256 = Shape<_64, _256, _64>;
  using T256x128 = Shape<_256, _128, _64>;
  TimeGemm<Coop, CoopEpi, T128x256, Shape<_2, _1, _1>, NMajor>("cooperative 128x256 cluster 2x1 w[d,f]", m, d, f, x, w, out);
  TimeGemm<Coop, CoopEpi, T128x256, Shape<_1, _1, _1>, NMajor>("cooperative 128x256 cluster 1x1 w[d,f]", m, d, f, x, w, out);
  TimeGemm<Coop, CoopEpi, T128x256, Shape<_1, _2, _1>, NMajor>("cooperative 128x256 cluster 1x2 w[d,f]", m, d, f, x, w, out);
  TimeGemm<Coop, CoopEpi, T128x256, Shape<_2, _1, _1>, KMajor>("cooperative 128x256 cluster 2x1 w[f,d]", m, d, f, x, w, out);
  TimeGemm<Coop, CoopEpi, T256x128, Shape<_2, _1, _1>, NMajor>("cooperative 256x128 cluster 2x1 w[d,f]", m, d, f, x, w, out);
  TimeGemm<Ping, PingEpi, T64x256, Shape<_2, _1, _1>, NMajor>("ping-pong 64x256 cluster 2x1 w[d,f]", m, d, f, x, w, out);
  TimeGemm<Ping, PingEpi, T64x256, Shape<_2, _1, _1>, KMajor>("ping-pong 64x256 cluster 2x1 w[f,d]", m, d, f, x, w, out);
  // The TwELL epilogue (capacity 32), whole and in part, at ~0.5% active.
  const int n_tiles = (f + 255) / 256;
  uint16_t* values;
  int16_t* cols;
  int32_t* counts;
  cudaMalloc(&values, sizeof(uint16_t) * size_t(m) * n_tiles * 32);
  cudaMalloc(&cols, sizeof(int16_t) * size_t(m) * n_tiles * 32);
  cudaMalloc(&counts, sizeof(int32_t) * size_t(m) * n_tiles);
  using T128 = Shape<_128, _256, _64>;
  using C2 = Shape<_2, _1, _1>;
  TimeTwell<Coop, T128, C2, 0>("twell cooperative, main loop only", m, d, f, x, w, values, cols, counts);
  TimeTwell<Coop, T128, C2, 1>("twell cooperative, + masks and counts", m, d, f, x, w, values, cols, counts);
  TimeTwell<Coop, T128, C2, 3>("twell cooperative, + slots staged", m, d, f, x, w, values, cols, counts);
  TimeTwell<Coop, T128, C2, 7>("twell cooperative, whole epilogue", m, d, f, x, w, values, cols, counts);
  TimeTwell<Ping, T64x256, C2, 0>("twell ping-pong, main loop only", m, d, f, x, w, values, cols, counts);
  TimeTwell<Ping, T64x256, C2, 7>("twell ping-pong, whole epilogue", m, d, f, x, w, values, cols, counts);
  cudaFree(values);
  cudaFree(cols);
  cudaFree(counts);
  cudaFree(x);
  cudaFree(w);
  cudaFree(out);
  return 0;
}
