// The union product's launch (kernel: twell_union.cuh). Compiled with NDEBUG: CUTLASS's
// device asserts are calls, which would serialize the wgmma pipeline (ptxas C7510).
#include "twell_union.cuh"

namespace jax_twell {
namespace union_product {
namespace {

template <typename Elem, int kConsumers, int kRowsPerNeuron>
cudaError_t Launch(cudaStream_t stream, const uint16_t* table0, const uint16_t* table1, int d, int64_t out_rows,
                   int n_blocks, const UnionMeta* meta, const int* rows, const int* chunk_off, const uint32_t* ent,
                   uint16_t* y) {
  using Cfg = Config<Elem, kConsumers>;
  auto* kernel = UnionProductKernel<Elem, kConsumers, kRowsPerNeuron>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  kernel<<<dim3(n_blocks, d / Cfg::kSpan), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(
      table0, table1, d, out_rows, meta, rows, chunk_off, ent, y);
  return cudaGetLastError();
}

template <typename Elem, int kRowsPerNeuron>
cudaError_t LaunchFor(cudaStream_t stream, const uint16_t* table0, const uint16_t* table1, int d, int64_t out_rows,
                      int n_blocks, const UnionMeta* meta, const int* rows, const int* chunk_off,
                      const uint32_t* ent, uint16_t* y) {
  // Two consumer warp groups (512 columns a CTA) where d allows: measured 0.71 against
  // 0.73 ms for one (benchmarks/results/union_probe_ws.txt).
  if (d % (2 * kCols) == 0)
    return Launch<Elem, 2, kRowsPerNeuron>(stream, table0, table1, d, out_rows, n_blocks, meta, rows, chunk_off, ent,
                                           y);
  return Launch<Elem, 1, kRowsPerNeuron>(stream, table0, table1, d, out_rows, n_blocks, meta, rows, chunk_off, ent,
                                         y);
}

}  // namespace

cudaError_t LaunchProduct(cudaStream_t stream, bool bf16, int rows_per_neuron, const uint16_t* table0,
                          const uint16_t* table1, int d, int64_t out_rows, int n_blocks, const UnionMeta* meta,
                          const int* rows, const int* chunk_off, const uint32_t* ent, uint16_t* y) {
  if (d % kCols != 0 || (rows_per_neuron != 1 && rows_per_neuron != 2)) return cudaErrorInvalidValue;
  if (n_blocks == 0) return cudaSuccess;
  if (bf16)
    return rows_per_neuron == 2
               ? LaunchFor<cutlass::bfloat16_t, 2>(stream, table0, table1, d, out_rows, n_blocks, meta, rows,
                                                   chunk_off, ent, y)
               : LaunchFor<cutlass::bfloat16_t, 1>(stream, table0, table1, d, out_rows, n_blocks, meta, rows,
                                                   chunk_off, ent, y);
  return rows_per_neuron == 2 ? LaunchFor<cutlass::half_t, 2>(stream, table0, table1, d, out_rows, n_blocks, meta,
                                                              rows, chunk_off, ent, y)
                              : LaunchFor<cutlass::half_t, 1>(stream, table0, table1, d, out_rows, n_blocks, meta,
                                                              rows, chunk_off, ent, y);
}

namespace {
template <typename Elem>
cudaError_t LaunchUp(cudaStream_t stream, const uint16_t* x, const uint16_t* table, int d, int f, int64_t out_rows,
                     int n_blocks, const UnionMeta* meta, const int* rows, const int* chunk_off, const uint2* pairs,
                     float* out) {
  using Cfg = UpConfig<Elem>;
  auto* kernel = UnionUpKernel<Elem>;
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Cfg::kSmemBytes);
  if (e != cudaSuccess) return e;
  const int tiles = (f + kUpNeurons - 1) / kUpNeurons;
  kernel<<<dim3(tiles, n_blocks), Cfg::kThreads, Cfg::kSmemBytes, stream>>>(x, table, d, out_rows, meta, rows,
                                                                             chunk_off, pairs, out);
  return cudaGetLastError();
}
}  // namespace

cudaError_t LaunchUpProduct(cudaStream_t stream, bool bf16, const uint16_t* x, const uint16_t* table, int d, int f,
                            int64_t out_rows, int n_blocks, const UnionMeta* meta, const int* rows,
                            const int* chunk_off, const uint2* pairs, float* out) {
  if (d % kUpK != 0 || d <= 0 || f <= 0 || out_rows <= 0) return cudaErrorInvalidValue;
  if (n_blocks == 0) return cudaSuccess;
  return bf16 ? LaunchUp<cutlass::bfloat16_t>(stream, x, table, d, f, out_rows, n_blocks, meta, rows, chunk_off,
                                              pairs, out)
              : LaunchUp<cutlass::half_t>(stream, x, table, d, f, out_rows, n_blocks, meta, rows, chunk_off, pairs,
                                          out);
}

}  // namespace union_product
}  // namespace jax_twell
