// Dense CUTLASS GEMM timing shared by the standalone probes (gemm_probe.cu,
// union_gemm_probe.cu): D [m, f] = x [m, d] @ w, bf16 in and out, f32 accumulation.
#pragma once

#include <cstdio>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "probe_fill.cuh"  // FillKernel

using BF16 = cutlass::bfloat16_t;

// CUDA-event milliseconds of one call() over `reps` calls, after 5 warm-up calls.
template <class Call>
float EventMs(Call call, int reps = 50) {
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  for (int i = 0; i < 5; ++i) call();
  cudaEventRecord(t0);
  for (int i = 0; i < reps; ++i) call();
  cudaEventRecord(t1);
  cudaEventSynchronize(t1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, t0, t1);
  cudaEventDestroy(t0);
  cudaEventDestroy(t1);
  return ms / reps;
}

// Prints and returns the CUDA-event time of one call (5 warm-up calls, then 50 timed).
template <class Gemm>
float TimeRuns(const char* name, Gemm& gemm, typename Gemm::Arguments const& args, int m, int d, int f) {
  const float ms = EventMs([&] {
    gemm.initialize(args, nullptr);
    gemm.run();
  });
  const cudaError_t err = cudaGetLastError();
  printf("%-44s %8.3f ms %6.0f TF/s %s\n", name, ms, 2.0 * m * d * f / (ms * 1e-3) / 1e12,
         err == cudaSuccess ? "" : cudaGetErrorString(err));
  return ms;
}

template <class Schedule, class EpiSchedule, class Tile, class Cluster, class LayoutB>
float TimeGemm(const char* name, int m, int d, int f, const BF16* x, const BF16* w, BF16* out) {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, void, cutlass::layout::RowMajor, 8, BF16, cutlass::layout::RowMajor, 8, EpiSchedule>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, BF16, cutlass::layout::RowMajor, 8, BF16, LayoutB, 8, float,
      Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  auto sa = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, {m, d, 1});
  auto sb = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, {f, d, 1});
  auto sd = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, {m, f, 1});
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGemm,
                                {m, f, d, 1},
                                {x, sa, w, sb},
                                {{1.f, 0.f}, nullptr, sd, out, sd},
                                cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(0)};
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess || Gemm::get_workspace_size(args) != 0) {
    printf("%-44s cannot run\n", name);
    return 0.f;
  }
  return TimeRuns(name, gemm, args, m, d, f);
}

