// grouped_gemm_probe: can a GEMM whose row count lives only in device memory run the dense
// products of the default call at cuBLAS's rate? (standalone probe; the first step of the
// plan in ffi/notes/limits.md, "The plan for a call with no conditional").
//
// The default inference call chooses sparse or dense and sizes its dense backup from
// counts on the device; XLA reads such choices on the host (a round trip per conditional).
// CUTLASS's Hopper grouped GEMM with its problem shapes in device memory only launches one
// persistent CTA per SM and reads each group's (M, N, K) on the device. This probe times one
// group of it, bf16 in and out, f32 accumulation, row-major operands as the FFN stores them:
//   up:   [M, d] @ w_up [d, f]     (w_up as stored, f contiguous)
//   down: [M, f] @ w_down [f, d]
// with the device-side M set to all M rows, to M/64 rows (a backup's size) and to 0 rows
// (the side not taken), against cuBLAS on all M rows in the same process. Each time is the
// CUDA-event time of one call over 50 calls after 5 warm-up calls; the grouped GEMM's
// result on all rows is compared with cuBLAS's (largest relative difference).
//
// Prediction (written before the run): all rows within ~3% of cuBLAS at M=16,384 (both are
// persistent wgmma kernels of similar tiles), within ~10% at M=2,048 (fewer tiles than
// 2 waves: tile quantisation decides); M/64 rows at a few microseconds plus M/64 of the
// time; 0 rows at about a launch (~3-5 us).
// First run (30e3002, lab/results/grouped_gemm_probe_30e3002.json): all rows 1.05-1.12x
// cuBLAS's time at M=2,048, 1.13-1.26x at 16,384 and 65,536; M/64 rows 17-58 us; 0 rows
// 6-9 us. Second run adds clusters of two along M (the weight tile multicast to both CTAs,
// as in the fused gate, whose stock cooperative kernel ran 1.06x of XLA's matmul that way).
// Prediction for it: cluster 2 brings the cooperative kernel to ~1.05-1.08x of cuBLAS at
// 16,384 and 65,536 (it halves the weight tiles' L2 reads), no change at 2,048.
//
// Build: nvcc -O3 -std=c++17 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//          -Ilab -I$CUTLASS/include -I$CUTLASS/tools/util/include -I$CUBLAS/include -L$CUBLAS/lib \
//          lab/grouped_gemm_probe.cu -lcublas -o grouped_gemm_probe
//        ($CUBLAS: a CUDA toolkit, or the nvidia-cublas wheel's folder that jax's CUDA
//        plugin installs; without cuBLAS's headers it builds with no baseline)
// Run:   ./grouped_gemm_probe [d f]   (default 2048 5632; M = 2048, 16384, 65536)
#if __has_include(<cublas_v2.h>)
#include <cublas_v2.h>
#define PROBE_CUBLAS 1
#else  // compile check without cuBLAS's headers: no baseline
#define PROBE_CUBLAS 0
#endif

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "probe_gemm.cuh"  // BF16, FillKernel, EventMs

using namespace cute;
using Problem = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;

template <class Schedule, class EpiSchedule, class Tile, class Cluster>
struct Grouped {
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster, cutlass::epilogue::collective::EpilogueTileAuto,
      float, float, void, cutlass::layout::RowMajor*, 8, BF16, cutlass::layout::RowMajor*, 8, EpiSchedule,
      cutlass::epilogue::fusion::LinearCombination<BF16, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, BF16, cutlass::layout::RowMajor*, 8, BF16,
      cutlass::layout::RowMajor*, 8, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;
  using StrideB = typename Kernel::InternalStrideB;
  using StrideD = typename Kernel::InternalStrideD;
};

using Cooperative = Grouped<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                            cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, Shape<_128, _256, _64>,
                            Shape<_1, _1, _1>>;
using Pingpong = Grouped<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                         cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, Shape<_64, _256, _64>,
                         Shape<_1, _1, _1>>;
// Clusters of two CTAs along M: the two share each weight tile (TMA multicast), as the
// fused gate's kernel does.
using Cooperative2 = Grouped<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                             cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, Shape<_128, _256, _64>,
                             Shape<_2, _1, _1>>;
using Cooperative2Wide = Grouped<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative,
                                 cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative, Shape<_256, _128, _64>,
                                 Shape<_2, _1, _1>>;
using Pingpong2 = Grouped<cutlass::gemm::KernelPtrArrayTmaWarpSpecializedPingpong,
                          cutlass::epilogue::PtrArrayTmaWarpSpecializedPingpong, Shape<_64, _256, _64>,
                          Shape<_2, _1, _1>>;

template <class T>
T* DeviceCopy(const T& v) {
  T* p;
  cudaMalloc(&p, sizeof(T));
  cudaMemcpy(p, &v, sizeof(T), cudaMemcpyHostToDevice);
  return p;
}

__global__ void SetRows(Shape<int, int, int>* shape, int rows, int n, int k) { *shape = Shape<int, int, int>{rows, n, k}; }

template <class G>
float TimeGrouped(const char* name, int m, int rows, int n, int k, const BF16* a, const BF16* b, BF16* out) {
  using Gemm = typename G::Gemm;
  auto* shape = DeviceCopy(Shape<int, int, int>{m, n, k});
  SetRows<<<1, 1>>>(shape, rows, n, k);  // the row count the device decides
  const BF16* a_host = a;
  const BF16* b_host = b;
  BF16* d_host = out;
  auto sa = cutlass::make_cute_packed_stride(typename G::StrideA{}, {m, k, 1});
  auto sb = cutlass::make_cute_packed_stride(typename G::StrideB{}, {n, k, 1});
  auto sd = cutlass::make_cute_packed_stride(typename G::StrideD{}, {m, n, 1});
  auto* pa = DeviceCopy(a_host);
  auto* pb = DeviceCopy(b_host);
  auto* pd = DeviceCopy(d_host);
  auto* psa = DeviceCopy(sa);
  auto* psb = DeviceCopy(sb);
  auto* psd = DeviceCopy(sd);
  typename Gemm::Arguments args{cutlass::gemm::GemmUniversalMode::kGrouped,
                                {1, shape, nullptr},  // no host shapes: the device's only
                                {pa, psa, pb, psb},
                                {{}, nullptr, psd, pd, psd},
                                cutlass::KernelHardwareInfo::make_kernel_hardware_info<typename G::Kernel>(0)};
  args.epilogue.thread.alpha = 1.f;
  args.epilogue.thread.beta = 0.f;
  Gemm gemm;
  void* workspace = nullptr;
  const size_t ws = Gemm::get_workspace_size(args);
  if (ws) cudaMalloc(&workspace, ws);
  if (gemm.can_implement(args) != cutlass::Status::kSuccess || gemm.initialize(args, workspace) != cutlass::Status::kSuccess) {
    printf("%-40s cannot run\n", name);
    return 0.f;
  }
  const float ms = EventMs([&] { gemm.run(); });
  const cudaError_t err = cudaGetLastError();
  printf("%-40s rows %6d  %8.4f ms %6.0f TF/s %s\n", name, rows, ms, 2.0 * rows * n * k / (ms * 1e-3) / 1e12,
         err == cudaSuccess ? "" : cudaGetErrorString(err));
  for (void* p : {(void*)shape, (void*)pa, (void*)pb, (void*)pd, (void*)psa, (void*)psb, (void*)psd}) cudaFree(p);
  if (workspace) cudaFree(workspace);
  return ms;
}

#if PROBE_CUBLAS
// cuBLAS, row-major D [m, n] = A [m, k] @ B [k, n]: column-major D^T = B^T A^T.
float TimeCublas(cublasHandle_t h, int m, int n, int k, const BF16* a, const BF16* b, BF16* out) {
  const float one = 1.f, zero = 0.f;
  auto call = [&] {
    cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, &one, b, CUDA_R_16BF, n, a, CUDA_R_16BF, k, &zero, out,
                 CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
  };
  const float ms = EventMs(call);
  printf("%-40s rows %6d  %8.4f ms %6.0f TF/s\n", "cuBLAS", m, ms, 2.0 * m * n * k / (ms * 1e-3) / 1e12);
  return ms;
}

#endif

float MaxRelDiff(const BF16* x, const BF16* y, size_t count) {
  std::vector<BF16> a(count), b(count);
  cudaMemcpy(a.data(), x, count * sizeof(BF16), cudaMemcpyDeviceToHost);
  cudaMemcpy(b.data(), y, count * sizeof(BF16), cudaMemcpyDeviceToHost);
  double num = 0, den = 0;
  for (size_t i = 0; i < count; ++i) {
    const double d = double(float(a[i])) - double(float(b[i]));
    num += d * d;
    den += double(float(b[i])) * double(float(b[i]));
  }
  return float(std::sqrt(num / (den > 0 ? den : 1)));
}

int main(int argc, char** argv) {
  const int d = argc > 2 ? atoi(argv[1]) : 2048, f = argc > 2 ? atoi(argv[2]) : 5632;
#if PROBE_CUBLAS
  cublasHandle_t h;
  cublasCreate(&h);
#endif
  const int max_m = 65536;
  BF16 *x, *w_up, *hid, *w_down, *out, *ref;
  cudaMalloc(&x, size_t(max_m) * d * sizeof(BF16));
  cudaMalloc(&hid, size_t(max_m) * f * sizeof(BF16));
  cudaMalloc(&w_up, size_t(d) * f * sizeof(BF16));
  cudaMalloc(&w_down, size_t(f) * d * sizeof(BF16));
  cudaMalloc(&out, size_t(max_m) * f * sizeof(BF16));
  cudaMalloc(&ref, size_t(max_m) * f * sizeof(BF16));
  FillKernel<<<1024, 256>>>(x, size_t(max_m) * d, 1u);
  FillKernel<<<1024, 256>>>(hid, size_t(max_m) * f, 2u);
  FillKernel<<<1024, 256>>>(w_up, size_t(d) * f, 3u);
  FillKernel<<<1024, 256>>>(w_down, size_t(f) * d, 4u);
  cudaDeviceSynchronize();
  for (int m : {2048, 16384, 65536}) {
    struct Step {
      const char* name;
      const BF16 *a, *b;
      int n, k;
    } steps[] = {{"up", x, w_up, f, d}, {"down", hid, w_down, d, f}};
    for (const Step& s : steps) {
      printf("== %s: [%d, %d] @ [%d, %d]\n", s.name, m, s.k, s.k, s.n);
#if PROBE_CUBLAS
      TimeCublas(h, m, s.n, s.k, s.a, s.b, ref);
#endif
      for (int rows : {m, m / 64, 0}) {
        TimeGrouped<Cooperative>("grouped, cooperative 128x256", m, rows, s.n, s.k, s.a, s.b, out);
        if (rows == m) printf("   relative difference to cuBLAS: %.2e\n", MaxRelDiff(out, ref, size_t(m) * s.n));
        TimeGrouped<Pingpong>("grouped, ping-pong 64x256", m, rows, s.n, s.k, s.a, s.b, out);
        if (rows == m) printf("   relative difference to cuBLAS: %.2e\n", MaxRelDiff(out, ref, size_t(m) * s.n));
        TimeGrouped<Cooperative2>("grouped, cooperative 128x256, cluster 2", m, rows, s.n, s.k, s.a, s.b, out);
        if (rows == m) printf("   relative difference to cuBLAS: %.2e\n", MaxRelDiff(out, ref, size_t(m) * s.n));
        TimeGrouped<Cooperative2Wide>("grouped, cooperative 256x128, cluster 2", m, rows, s.n, s.k, s.a, s.b, out);
        if (rows == m) printf("   relative difference to cuBLAS: %.2e\n", MaxRelDiff(out, ref, size_t(m) * s.n));
        TimeGrouped<Pingpong2>("grouped, ping-pong 64x256, cluster 2", m, rows, s.n, s.k, s.a, s.b, out);
        if (rows == m) printf("   relative difference to cuBLAS: %.2e\n", MaxRelDiff(out, ref, size_t(m) * s.n));
      }
    }
  }
#if PROBE_CUBLAS
  cublasDestroy(h);
#endif
  return 0;
}
