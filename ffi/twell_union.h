// Host interface of the union product (twell_union.cuh has the design): the per-block
// layout a caller builds, and the launch.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_twell {
namespace union_product {

constexpr int kTok = 64;    // tokens per block (A rows)
constexpr int kCols = 256;  // output columns per consumer warp group
constexpr int kChunk = 32;  // union rows per K step
constexpr int kUpNeurons = 256;  // the up product: union neurons per CTA (kUpNeurons / kChunk chunks)
constexpr int kUpK = 64;         // the up product: d columns per pipeline stage
constexpr int kMaxF = 65536;     // the largest f the union layouts and products take

struct UnionMeta {
  int chunks;      // K steps (R |U| / 32, rounded up)
  int row_base;    // first of the block's rows in `rows`
  int chunk_base;  // first of its chunk offsets in `chunk_off` (chunks + 1 values)
  int over_budget;  // 1: the entries did not fit the caller's budget; the block's outputs are NaN
};

// y[64 b + t, :] for blocks b < n_blocks, rows 64 b + t < out_rows: the union product over
// tables of [*, d] bf16 (bf16 = true) or f16 elements; rows_per_neuron 1 (table0) or 2
// (table0, table1 interleaved by row id). d must be a multiple of 256. Returns the launch
// error, if any.
cudaError_t LaunchProduct(cudaStream_t stream, bool bf16, int rows_per_neuron, const uint16_t* table0,
                          const uint16_t* table1, int d, int64_t out_rows, int n_blocks, const UnionMeta* meta,
                          const int* rows, const int* chunk_off, const uint32_t* ent, uint16_t* y);

// The up product: out[e] = x[64 b + t] . table[rows[i]] (f32) for every word pair
// (i % 256 << 8 | t, e) of block b's chunks, i its union row; x [out_rows, d], table [f, d],
// both bf16 (bf16 = true) or f16; d a multiple of 64. One CTA per (256 union rows, block).
cudaError_t LaunchUpProduct(cudaStream_t stream, bool bf16, const uint16_t* x, const uint16_t* table, int d, int f,
                            int64_t out_rows, int n_blocks, const UnionMeta* meta, const int* rows,
                            const int* chunk_off, const uint2* pairs, float* out);

}  // namespace union_product
}  // namespace jax_twell
