// row_copy_probe: how fast can one SM move gathered weight-row slices from L2 into shared
// memory, by each of the ways Hopper offers, with nothing else running?
//
// The union products (ffi/twell_union.cuh) spend their time on row slices: per chunk of 32
// union rows, 32 slices of 1 KB (512 bf16 columns of a d = 2048 row) gathered from rows
// scattered over one or two [f, d] tables. Today 128 producer threads move them as 2,048
// 16-byte cp.async (LDGSTS) a chunk. The notes (ffi/notes/training_kernels.md, "What the
// probe runs of 2026-12-01 settle") leave one lever: fewer, larger transfers. This probe
// bounds it before anything is built: it runs the union product's producer/consumer ring
// with the products taken out, so the time is the copies' alone.
//
// Layout of the run: a table of R rows x d bf16 (R = 2 f = 11,264 at f = 5632, the dx
// product's two tables, 46 MB, so the rows come from L2 as in the product); one CTA per
// (block, column span), blocks fastest as in the product, each CTA `chunks` chunks of
// random rows (uniform, fixed seed). A ring of 5 stages of 32 KB; stage s is filled by
// the producer warp group and released by a consumer warp that waits for it and reads one
// word of it. Ways to fill a stage:
//   ldgsts    the library's: 16-byte cp.async, 128 threads, completion on the stage's
//             barrier by cp.async.mbarrier.arrive.noinc;
//   bulkP     the bulk copy engine (cp.async.bulk ... complete_tx on the barrier), one
//             request per P bytes of a row slice (P = 128 ... the span), issued by the
//             producer's lanes spread over its four warps;
//   none      the ring with no copies (barrier rounds only).
// Span: the bytes of each row a CTA copies (1,024 = the product's 512 columns; 2,048 and
// 4,096 show what wider slices, or whole rows, would give). Rows per chunk = 32 KB / span.
//
//   ldgsts_rows  16-byte cp.async whose warp instructions each cover R rows (the
//             "request" column) instead of one;
//   walk      the up product's pattern: 256 fixed rows read along d, 128 bytes of each
//             a stage (16-byte cp.async, 128 threads).
// Measured: lab/results/row_copy_probe_4ec7ee8.txt, row_copy_probe_6372667.txt
// (one warp group of cp.async ~5.7-6.1 TB/s, two ~8.5; 1 KB bulk requests ~8.0; the notes'
// "How fast rows can reach shared memory at all").
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a lab/row_copy_probe.cu -o row_copy_probe
// Run:   ./row_copy_probe [rows=11264] [d=2048] [blocks=256] [kb_per_cta=3040]
//        (kb_per_cta: KB of slices per CTA; 3,040 = 95 chunks, the dx product's at 0.5%)
// Prints one line per (way, span, request size): time per launch and TB/s of slices.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <random>
#include <tuple>
#include <vector>

#include "probe_barrier.cuh"

namespace {

constexpr int kStages = 5;
constexpr int kStageBytes = 32 * 1024;

enum Way { kNone = 0, kLdgsts = 1, kBulk = 2, kLdgstsRows = 3, kWalk = 4 };

using namespace probe;

// 16-byte copies of a 32-row chunk of 1 KB slices, each warp instruction on R rows
// (32 / R consecutive pieces of each): instruction j covers row group j % (32 / R) and
// segment j / (32 / R) of the rows.
template <int R, int kP>
__device__ __forceinline__ void CopyRows(uint32_t stage, const char* col0, const int* cr, int64_t row_bytes, int tid) {
  constexpr int L = 32 / R, G = 32 / R;
  const int w = tid / 32, lane = tid % 32;
#pragma unroll
  for (int i = 0; i < 64 / (kP / 32); ++i) {
    const int j = w + (kP / 32) * i;
    const int r = (j % G) * R + lane / L, q = (j / G) * L + lane % L;
    CpAsync16(stage + r * 1024 + q * 16, col0 + cr[r] * row_bytes + q * 16);
  }
}

// rows: per CTA block, chunks x rows_per_chunk row ids. grid (blocks, row_bytes / span).
// kP producer threads and one consumer warp
template <int span, int kP>
__global__ void __launch_bounds__(kP + 32, 1)
    RingKernel(const char* __restrict__ table, int64_t row_bytes, const int* __restrict__ rows, int chunks,
               int way, int piece, unsigned* __restrict__ sink) {
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ __align__(8) uint64_t full[kStages], empty[kStages];
  const int tid = threadIdx.x;
  constexpr int rows_per_chunk = kStageBytes / span;
  // the CTA's row ids, staged in shared memory after the ring (so the copies' addresses
  // wait on nothing but a shared load)
  int* my_rows = reinterpret_cast<int*>(smem + kStages * kStageBytes);
  const int* src_rows = rows + static_cast<int64_t>(blockIdx.x) * chunks * rows_per_chunk;
  for (int i = tid; i < chunks * rows_per_chunk; i += kP + 32) my_rows[i] = src_rows[i];
  const char* col0 = table + static_cast<int64_t>(blockIdx.y) * span;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      // full: the producer's 128 threads arrive (ldgsts: as their copies land; bulk: one
      // arrival with the stage's byte count); empty: the consumer warp's lane 0.
      BarInit(Smem(&full[s]), way == kBulk ? 1 : kP);
      BarInit(Smem(&empty[s]), 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const uint32_t base = Smem(smem);
  if (tid < kP) {
    const int requests_per_row = span / piece;
    const int requests = rows_per_chunk * requests_per_row;
    // request j is issued by lane j / warps of warp j % warps: the warps share the issue
    constexpr int warps = kP / 32;
    const int warp = tid / 32, lane = tid % 32;
    for (int c = 0; c < chunks; ++c) {
      const int s = c % kStages;
      if (c >= kStages) BarWait(Smem(&empty[s]), ((c / kStages) - 1) & 1);
      const uint32_t stage = base + s * kStageBytes;
      const int* cr = my_rows + c * rows_per_chunk;
      if (way == kWalk) {
        // the up product's pattern: 256 fixed rows walked along d, 128 bytes of each a
        // stage (32 stages a set of rows), thread t on piece t % 8 of rows t / 8 + 16 i
        const int* set = my_rows + (c / 32) * 256;
        const int64_t k_off = (c % 32) * 128 + (tid % 8) * 16;
#pragma unroll
        for (int i = 0; i < 16; ++i) {
          const int r = tid / 8 + 16 * i;
          CpAsync16(stage + r * 128 + (tid % 8) * 16, table + set[r] * row_bytes + k_off);
        }
        CpAsyncArrive(Smem(&full[s]));
      } else if (way == kLdgstsRows) {
        if constexpr (span == 1024) {
          if (piece == 1) CopyRows<1, kP>(stage, col0, cr, row_bytes, tid);
          if (piece == 2) CopyRows<2, kP>(stage, col0, cr, row_bytes, tid);
          if (piece == 4) CopyRows<4, kP>(stage, col0, cr, row_bytes, tid);
          if (piece == 8) CopyRows<8, kP>(stage, col0, cr, row_bytes, tid);
          if (piece == 32) CopyRows<32, kP>(stage, col0, cr, row_bytes, tid);
        }
        CpAsyncArrive(Smem(&full[s]));
      } else if (way == kLdgsts) {
        // 16-byte pieces: thread t copies pieces t, t + 128, ... of the chunk (span / 16
        // pieces a row, consecutive threads on consecutive pieces of one row)
        constexpr int pieces_per_row = span / 16;
#pragma unroll
        for (int p = tid; p < kStageBytes / 16; p += kP) {
          const int r = p / pieces_per_row, q = p % pieces_per_row;
          CpAsync16(stage + r * span + q * 16, col0 + cr[r] * row_bytes + q * 16);
        }
        CpAsyncArrive(Smem(&full[s]));
      } else if (way == kBulk) {
        // one arrival carries the stage's byte count; copies landing before it cannot
        // complete the phase (its one pending arrival is still missing)
        if (tid == 0) BarArriveTx(Smem(&full[s]), kStageBytes);
        for (int j = lane * warps + warp; j < requests; j += kP) {
          const int r = j / requests_per_row, q = j % requests_per_row;
          Bulk(stage + r * span + q * piece, col0 + cr[r] * row_bytes + q * piece, piece, Smem(&full[s]));
        }
      } else {
        BarArrive(Smem(&full[s]));
      }
    }
    return;
  }
  // consumer warp: wait for each stage, read a word of it, release it
  const int lane = tid % 32;
  unsigned acc = 0;
  for (int c = 0; c < chunks; ++c) {
    const int s = c % kStages;
    BarWait(Smem(&full[s]), (c / kStages) & 1);
    acc += reinterpret_cast<const unsigned*>(smem + s * kStageBytes)[lane * 256];
    __syncwarp();
    if (lane == 0) BarArrive(Smem(&empty[s]));
  }
  if (acc == 0x12345678u) sink[0] = acc;  // keeps the reads
}

}  // namespace

int main(int argc, char** argv) {
  const int rows = argc > 1 ? atoi(argv[1]) : 11264, d = argc > 2 ? atoi(argv[2]) : 2048;
  const int blocks = argc > 3 ? atoi(argv[3]) : 256, kb_per_cta = argc > 4 ? atoi(argv[4]) : 3040;
  const int64_t row_bytes = int64_t(d) * 2;
  const int chunks = kb_per_cta / 32;
  if (chunks < 1 || chunks > 300 || d % 2048 != 0) {
    printf("kb_per_cta must give 1 to 300 chunks of 32 KB, and d be a multiple of 2048\n");
    return 1;
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  printf("gathered row slices into shared memory: table %d x %d bf16 (%.1f MB), %d blocks, %d chunks of 32 KB per CTA, %s, %d SMs\n",
         rows, d, rows * row_bytes / 1e6, blocks, chunks, prop.name, prop.multiProcessorCount);
  char* table;
  unsigned* sink;
  CHECK(cudaMalloc(&table, rows * row_bytes));
  CHECK(cudaMemset(table, 1, rows * row_bytes));
  CHECK(cudaMalloc(&sink, 4));
  const int smem = kStages * kStageBytes + chunks * 32 * static_cast<int>(sizeof(int));
  CHECK(cudaFuncSetAttribute(RingKernel<1024, 128>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(RingKernel<2048, 128>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(RingKernel<4096, 128>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(RingKernel<1024, 256>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(RingKernel<1024, 512>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  std::mt19937 rng(1);
  struct Case { int way, span, piece; const char* name; bool sorted = false; int producers = 128; };
  const Case cases[] = {
      {kNone, 1024, 1024, "none"},      {kLdgsts, 1024, 16, "ldgsts"},   {kBulk, 1024, 128, "bulk128"},
      {kBulk, 1024, 256, "bulk256"},    {kBulk, 1024, 512, "bulk512"},   {kBulk, 1024, 1024, "bulk1024"},
      {kLdgsts, 2048, 16, "ldgsts"},    {kBulk, 2048, 2048, "bulk2048"}, {kLdgsts, 4096, 16, "ldgsts"},
      {kBulk, 4096, 4096, "bulk4096"},
      // each CTA's rows distinct and in ascending order, as a union's are
      {kLdgsts, 1024, 16, "ldgsts", true}, {kBulk, 1024, 512, "bulk512", true}, {kBulk, 1024, 1024, "bulk1024", true},
      // more producer threads (the library's producer is one warp group of 128)
      {kLdgsts, 1024, 16, "ldgsts", false, 256}, {kLdgsts, 1024, 16, "ldgsts", false, 512},
      {kBulk, 1024, 1024, "bulk1024", false, 256},
      // 16-byte cp.async, each warp instruction on 2, 4, 8 or 32 rows (the "request"
      // column: rows per instruction)
      {kLdgstsRows, 1024, 1, "ldgsts_rows"}, {kLdgstsRows, 1024, 2, "ldgsts_rows"}, {kLdgstsRows, 1024, 4, "ldgsts_rows"},
      {kLdgstsRows, 1024, 8, "ldgsts_rows"},
      {kLdgstsRows, 1024, 32, "ldgsts_rows"}, {kLdgstsRows, 1024, 4, "ldgsts_rows", false, 256},
      // the up product's pattern (whole rows walked 128 bytes a stage; one CTA column)
      {kWalk, 1024, 16, "walk"},
  };
  printf("%-10s %9s %6s %7s %9s %7s %10s %8s\n", "way", "producers", "span", "request", "requests", "rows", "us/launch", "TB/s");
  int failures = 0;
  for (const Case& k : cases) {
    if (k.span > row_bytes) continue;
    const int rows_per_chunk = kStageBytes / k.span;
    std::vector<int> ids(size_t(blocks) * chunks * rows_per_chunk);
    std::uniform_int_distribution<int> pick(0, rows - 1);
    if (!k.sorted) {
      for (int& r : ids) r = pick(rng);
    } else {  // per CTA: a random subset of the rows, ascending (rows repeat only past `rows`)
      const size_t per_cta = size_t(chunks) * rows_per_chunk;
      std::vector<int> all(rows);
      for (int i = 0; i < rows; ++i) all[i] = i;
      for (int b = 0; b < blocks; ++b) {
        std::shuffle(all.begin(), all.end(), rng);
        const size_t n = std::min<size_t>(per_cta, all.size());
        std::sort(all.begin(), all.begin() + n);
        for (size_t i = 0; i < per_cta; ++i) ids[b * per_cta + i] = all[i % n];
        std::sort(all.begin(), all.end());
      }
    }
    int* dev_ids;
    CHECK(cudaMalloc(&dev_ids, ids.size() * sizeof(int)));
    CHECK(cudaMemcpy(dev_ids, ids.data(), ids.size() * sizeof(int), cudaMemcpyHostToDevice));
    const dim3 grid(blocks, k.way == kWalk ? 1u : static_cast<unsigned>(row_bytes / k.span));
    auto launch = [&] {
      const auto args = std::make_tuple(table, row_bytes, dev_ids, chunks, k.way, k.piece, sink);
      auto go = [&](auto kernel, int threads) {
        std::apply([&](auto... a) { kernel<<<grid, threads, smem>>>(a...); }, args);
      };
      if (k.producers == 256) go(RingKernel<1024, 256>, 256 + 32);
      else if (k.producers == 512) go(RingKernel<1024, 512>, 512 + 32);
      else if (k.span == 1024) go(RingKernel<1024, 128>, 160);
      else if (k.span == 2048) go(RingKernel<2048, 128>, 160);
      else go(RingKernel<4096, 128>, 160);
    };
    for (int i = 0; i < 3; ++i) launch();
    cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      printf("%-10s %6d: %s\n", k.name, k.span, cudaGetErrorString(e));
      return 1;
    }
    cudaEvent_t t0, t1;
    cudaEventCreate(&t0);
    cudaEventCreate(&t1);
    const int reps = 20;
    cudaEventRecord(t0);
    for (int i = 0; i < reps; ++i) launch();
    cudaEventRecord(t1);
    CHECK(cudaEventSynchronize(t1));
    float ms = 0;
    cudaEventElapsedTime(&ms, t0, t1);
    const double us = 1e3 * ms / reps;
    const double bytes = double(grid.x) * grid.y * chunks * kStageBytes;
    const int requests = k.way == kBulk ? kStageBytes / k.piece : k.way == kNone ? 0 : kStageBytes / 16;  // per stage
    printf("%-10s %9d %6d %7d %9d %7s %10.1f %8.2f\n", k.name, k.producers, k.span, k.way == kNone ? 0 : k.piece, requests,
           k.sorted ? "sorted" : "random", us,
           k.way == kNone ? 0.0 : bytes / (us * 1e-6) / 1e12);
    CHECK(cudaFree(dev_ids));
  }
  return failures;
}
