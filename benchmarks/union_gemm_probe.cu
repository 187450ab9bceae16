// union_gemm_probe: how fast can a sparse-A x gathered-B GEMM over small token blocks run
// the products of the sparse FFN whose output is dense per token (standalone probe, not
// the library; ffi/notes/training_kernels.md, "Dense products over a block's union").
//
// For a block of 64 tokens, the union U of the neurons active in any of them is ~27% of f
// at 0.5% active (f = 5632). Then, with A the block's coefficients as a [64, |U|] matrix
// (mostly zeros) and W_U the weight rows of U gathered from W [R, d],
//
//   Y[block] = A @ W_U          (training dx: R = 2f, rows Wg^T and Wu^T; the inference
//                                down projection: R = f, rows Wd)
//
// is a dense tensor-core product over ~27% of the neurons instead of the per-entry gathers
// of the blocked kernels (twell_blocked.cuh), whose bookkeeping per entry bounds them.
//
// The kernel: one CTA per (256 output columns, 64-token block), 8 warps of 32 x 64; K runs
// over the union's rows in chunks of 32: the rows' 256-column slices by cp.async into a
// 5-stage ring (padded rows, conflict-free ldmatrix.trans), the chunk's A tile scattered
// from the entries into one of three zeroed buffers (the previous chunk's entries cleared
// again), one barrier per chunk, m16n8k16 products.
//
// Build: nvcc -O3 -std=c++17 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr \
//          -Iffi -I$CUTLASS/include -I$CUTLASS/tools/util/include benchmarks/union_gemm_probe.cu -o union_gemm_probe
// Kernels: the mma.sync one, a wgmma one (namespace wg) and a warp-specialized wgmma one
// (namespace ws; -DWS_PRODUCERS / -DWS_CONSUMERS set its warp groups, 1 and 2 by default).
// Measured: union_probe_d2b0ab9.txt, union_probe_aac403c.txt, union_probe_ws.txt.
// Run:   ./union_gemm_probe [M d f active]   (default 16384 2048 5632 0.005): checks a small
//        problem against a host reference, then times the headline shape's dx (two weights)
//        and down projection (one), and the dense CUTLASS GEMMs they replace.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include <cuda.h>
#include <cudaTypedefs.h>

#include "async_mma.cuh"
#include "cutlass/pipeline/pipeline.hpp"
#include "probe_gemm.cuh"

namespace {

using jax_twell::Bf16;

constexpr int kTok = 64;       // tokens per block (CTA rows)
constexpr int kCols = 256;     // output columns per CTA
constexpr int kChunk = 32;     // union rows per K step
constexpr int kStages = 5;     // B ring: four chunks in flight while one is multiplied
constexpr int kBPitch = kCols + 8;   // bf16 per B row in shared memory (528 B: ldmatrix conflict-free)
constexpr int kAPitch = kChunk + 8;  // bf16 per A row (80 B: conflict-free)
constexpr int kThreads = 256;

struct BlockMeta {
  int chunks;     // K steps (union rows / 32, rounded up)
  int row_base;   // first of the block's rows in `rows`
  int chunk_base; // first of its chunk offsets in `chunk_off` (chunks + 1 values)
  int pad;
};

constexpr int kMaxChunks = 1024;  // K steps per block (the host refuses more)
constexpr int kPer = 2;            // entry words per thread held in registers per chunk

struct SmemLayout {
  uint16_t b[kStages][kChunk][kBPitch];
  uint16_t a[3][kTok][kAPitch];
  int off[kMaxChunks + 1];  // the block's chunk offsets into `ent`
};

// One chunk's entry words: with T threads and P words each, thread i holds entries
// off + i, off + i + T, ... (registers, loaded a chunk ahead of their use); a chunk with
// more than T P entries reads the rest from global memory when used (correct, slower).
// Entry word: value bits << 16 | column within the chunk << 8 | token within the block.
template <int T, int P>
struct ChunkWords {
  uint32_t w[P];
  int e0, e1;
};

template <int T, int P>
__device__ __forceinline__ ChunkWords<T, P> LoadWords(const uint32_t* ent, const int* off, int c, int chunks,
                                                     int t = static_cast<int>(threadIdx.x)) {
  ChunkWords<T, P> cw{};
  if (c < 0 || c >= chunks) return cw;
  cw.e0 = off[c];
  cw.e1 = off[c + 1];
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int e = cw.e0 + t + i * T;
    if (e < cw.e1) cw.w[i] = ent[e];
  }
  return cw;
}

// put(word) for every entry word of the chunk.
template <int T, int P, class Put>
__device__ __forceinline__ void ForEachWord(const ChunkWords<T, P>& cw, const uint32_t* ent, Put put,
                                            int t = static_cast<int>(threadIdx.x)) {
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int e = cw.e0 + t + i * T;
    if (e < cw.e1) put(cw.w[i]);
  }
  for (int e = cw.e0 + t + P * T; e < cw.e1; e += T) put(ent[e]);
}

using Words = ChunkWords<kThreads, kPer>;

// The chunk's entries into (clear: out of) a row-major A tile.
__device__ __forceinline__ void Scatter(uint16_t (*a)[kAPitch], const Words& cw, const uint32_t* ent, bool clear) {
  ForEachWord(cw, ent, [&](uint32_t w) { a[w & 0xff][(w >> 8) & 0xff] = clear ? uint16_t{0} : static_cast<uint16_t>(w >> 16); });
}

__global__ void __launch_bounds__(kThreads) UnionGemmKernel(const uint16_t* __restrict__ w, int d,
                                                            const BlockMeta* __restrict__ meta,
                                                            const int* __restrict__ rows,
                                                            const int* __restrict__ chunk_off,
                                                            const uint32_t* __restrict__ ent,
                                                            uint16_t* __restrict__ y) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  SmemLayout& s = *reinterpret_cast<SmemLayout*>(smem_raw);
  const int block = blockIdx.y, n0 = blockIdx.x * kCols;
  const BlockMeta bm = meta[block];
  const int chunks = bm.chunks;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int wm = warp / 4, wn = warp % 4;  // warp tile: rows 32 wm.., columns 64 wn..
  const int* block_rows = rows + bm.row_base;
  const int piece = tid % 32;              // this thread's 16-byte piece of each row slice
  const uint16_t* w_col = w + n0 + piece * 8;

  // Row indices of chunk c that this thread copies (rows tid / 32 + 8 i), loaded a chunk
  // before their copies are issued.
  auto load_rows = [&](int c, int (&r)[4]) {
#pragma unroll
    for (int i = 0; i < 4; ++i) r[i] = c < chunks ? block_rows[c * kChunk + tid / 32 + 8 * i] : 0;
  };
  // The B slice of chunk c (rows r) into stage c % kStages; one commit group per call.
  auto load_b = [&](int c, const int (&r)[4]) {
    if (c < chunks) {
#pragma unroll
      for (int i = 0; i < 4; ++i)
        jax_twell::CpAsync16(&s.b[c % kStages][tid / 32 + 8 * i][piece * 8], w_col + static_cast<int64_t>(r[i]) * d);
    }
    jax_twell::CpAsyncCommit();
  };

  for (int i = tid; i < 3 * kTok * kAPitch / 8; i += kThreads)
    reinterpret_cast<uint4*>(&s.a[0][0][0])[i] = make_uint4(0, 0, 0, 0);
  for (int i = tid; i <= chunks; i += kThreads) s.off[i] = chunk_off[bm.chunk_base + i];
  int r[4];
#pragma unroll
  for (int c = 0; c < kStages - 1; ++c) {
    load_rows(c, r);
    load_b(c, r);
  }
  load_rows(kStages - 1, r);
  __syncthreads();
  Words prev = LoadWords<kThreads, kPer>(ent, s.off, -1, chunks), cur = LoadWords<kThreads, kPer>(ent, s.off, 0, chunks);
  Words next = LoadWords<kThreads, kPer>(ent, s.off, 1, chunks);
  Scatter(s.a[0], cur, ent, false);

  float acc[2][8][4] = {};
  for (int c = 0; c < chunks; ++c) {
    jax_twell::CpAsyncWait<kStages - 2>();
    __syncthreads();  // B(c) and A(c) visible; every warp is past the products of chunk c - 1
    load_b(c + kStages - 1, r);  // into the stage chunk c - 1 used
    load_rows(c + kStages, r);
    const Words after = LoadWords<kThreads, kPer>(ent, s.off, c + 2, chunks);
    Scatter(s.a[(c + 2) % 3], prev, ent, true);  // chunk c - 1's buffer is chunk c + 2's
    Scatter(s.a[(c + 1) % 3], next, ent, false);
    uint16_t (*a)[kAPitch] = s.a[c % 3];
    uint16_t (*b)[kBPitch] = s.b[c % kStages];
#pragma unroll
    for (int k = 0; k < kChunk; k += 16) {
      uint32_t af[2][4];
#pragma unroll
      for (int i = 0; i < 2; ++i)
        jax_twell::LdMatrixX4(af[i], &a[32 * wm + 16 * i + lane % 16][k + (lane / 16) * 8]);
#pragma unroll
      for (int j = 0; j < 8; j += 2) {
        uint32_t bf[4];  // n-tiles j and j + 1: rows k + (lane % 16), columns 8 (j + lane / 16)
        jax_twell::LdMatrixX4Trans(bf, &b[k + lane % 16][64 * wn + 8 * (j + lane / 16)]);
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          jax_twell::Mma16816<Bf16>(acc[i][j], af[i], bf[0], bf[1]);
          jax_twell::Mma16816<Bf16>(acc[i][j + 1], af[i], bf[2], bf[3]);
        }
      }
    }
    prev = cur;
    cur = next;
    next = after;
  }
  jax_twell::CpAsyncWait<0>();
  const int64_t row0 = static_cast<int64_t>(block) * kTok + 32 * wm + lane / 4;
#pragma unroll
  for (int i = 0; i < 2; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int64_t rr = row0 + 16 * i + 8 * h;
        const int col = n0 + 64 * wn + 8 * j + 2 * (lane % 4);
        const uint32_t bits = Bf16::FromFloat(acc[i][j][2 * h]) | (Bf16::FromFloat(acc[i][j][2 * h + 1]) << 16);
        *reinterpret_cast<uint32_t*>(&y[rr * d + col]) = bits;
      }
}


// The same product on wgmma (written after the mma.sync kernel measured issue-bound): one
// warp group per CTA holds the 64 x 256 f32 tile (128 registers a thread); A [64, 32]
// K-major with the 64-byte swizzle, B [256, 32] N-major with the 128-byte swizzle (the row
// slices' 16-byte pieces land where CuTe's layout puts them); per chunk two asynchronous
// 64 x 256 x 16 instructions, issued right after the chunk's barrier, run while the warp
// group issues the next copies and scatters the next A tile.
namespace wg {
using namespace cute;
using T = cutlass::bfloat16_t;
constexpr int kThreads = 128;
constexpr int kPer = 4;  // entry words per thread held in registers per chunk
using LayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<T>{}, make_shape(Int<kTok>{}, Int<kChunk>{}, Int<3>{})));
using LayoutB =
    decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, make_shape(Int<kCols>{}, Int<kChunk>{}, Int<kStages>{})));
using Mma = decltype(make_tiled_mma(SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>{}));

struct Smem {
  alignas(1024) T b[cosize_v<LayoutB>];
  alignas(1024) T a[cosize_v<LayoutA>];
  int off[kMaxChunks + 1];
};

using Words = ChunkWords<kThreads, kPer>;

// The chunk's entries into (clear: out of) A's swizzled tile.
template <class TensorA>
__device__ __forceinline__ void Scatter(TensorA sa, const Words& cw, const uint32_t* ent, bool clear) {
  ForEachWord(cw, ent, [&](uint32_t w) {
    sa(static_cast<int>(w & 0xff), static_cast<int>((w >> 8) & 0xff)) =
        clear ? T(0.f) : T::bitcast(static_cast<uint16_t>(w >> 16));
  });
}

__global__ void __launch_bounds__(kThreads) Kernel(const uint16_t* __restrict__ w, int d,
                                                   const BlockMeta* __restrict__ meta, const int* __restrict__ rows,
                                                   const int* __restrict__ chunk_off, const uint32_t* __restrict__ ent,
                                                   uint16_t* __restrict__ y) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  if (jax_twell::SmemAddr(smem_raw) % 1024 != 0) __trap();  // the 128-byte swizzle needs 1 KB alignment
  Tensor sA = make_tensor(make_smem_ptr(s.a), LayoutA{});  // (token, k, buffer)
  Tensor sB = make_tensor(make_smem_ptr(s.b), LayoutB{});  // (column, k, stage)
  const int block = blockIdx.y, n0 = blockIdx.x * kCols;
  const BlockMeta bm = meta[block];
  const int chunks = bm.chunks, tid = threadIdx.x;
  const int* block_rows = rows + bm.row_base;
  const int piece = tid % 32;  // this thread's 16-byte piece (8 columns) of each row slice
  const uint16_t* w_col = w + n0 + piece * 8;
  constexpr int kRowsPerThread = kChunk * 32 / kThreads;  // 8

  auto load_rows = [&](int c, int (&r)[kRowsPerThread]) {
    CUTE_UNROLL
    for (int i = 0; i < kRowsPerThread; ++i) r[i] = c < chunks ? block_rows[c * kChunk + tid / 32 + 4 * i] : 0;
  };
  auto load_b = [&](int c, const int (&r)[kRowsPerThread]) {
    if (c < chunks) {
      CUTE_UNROLL
      for (int i = 0; i < kRowsPerThread; ++i)
        jax_twell::CpAsync16(&sB(piece * 8, tid / 32 + 4 * i, c % kStages), w_col + static_cast<int64_t>(r[i]) * d);
    }
    jax_twell::CpAsyncCommit();
  };

  for (int i = tid; i < static_cast<int>(cosize_v<LayoutA>) / 8; i += kThreads)
    reinterpret_cast<uint4*>(s.a)[i] = make_uint4(0, 0, 0, 0);
  for (int i = tid; i <= chunks; i += kThreads) s.off[i] = chunk_off[bm.chunk_base + i];
  int r[kRowsPerThread];
  CUTE_UNROLL
  for (int c = 0; c < kStages - 1; ++c) {
    load_rows(c, r);
    load_b(c, r);
  }
  load_rows(kStages - 1, r);
  __syncthreads();
  Words prev = LoadWords<kThreads, kPer>(ent, s.off, -1, chunks), cur = LoadWords<kThreads, kPer>(ent, s.off, 0, chunks);
  Words next = LoadWords<kThreads, kPer>(ent, s.off, 1, chunks);
  Scatter(sA(_, _, 0), cur, ent, false);
  cutlass::arch::fence_view_async_shared();

  Mma mma;
  auto thr = mma.get_thread_slice(tid);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));  // descriptors (mma, m, k, buffer)
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));  // (mma, n, k, stage)
  Tensor acc = partition_fragment_C(mma, make_shape(Int<kTok>{}, Int<kCols>{}));
  clear(acc);
  mma.accumulate_ = GMMA::ScaleOut::One;

  for (int c = 0; c < chunks; ++c) {
    jax_twell::CpAsyncWait<kStages - 2>();
    cutlass::arch::fence_view_async_shared();  // this thread's copies, visible to the async proxy
    __syncthreads();  // every copy of B(c) and every store of A(c) done; chunk c - 1's products done
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    gemm(mma, tCrA(_, _, _, c % 3), tCrB(_, _, _, c % kStages), acc);
    warpgroup_commit_batch();
    load_b(c + kStages - 1, r);  // into the stage chunk c - 1 used
    load_rows(c + kStages, r);
    const Words after = LoadWords<kThreads, kPer>(ent, s.off, c + 2, chunks);
    Scatter(sA(_, _, (c + 2) % 3), prev, ent, true);  // chunk c - 1's buffer is chunk c + 2's
    Scatter(sA(_, _, (c + 1) % 3), next, ent, false);
    cutlass::arch::fence_view_async_shared();
    warpgroup_wait<0>();
    warpgroup_fence_operand(acc);
    prev = cur;
    cur = next;
    next = after;
  }
  jax_twell::CpAsyncWait<0>();
  Tensor gY = make_tensor(make_gmem_ptr(reinterpret_cast<T*>(y) + static_cast<int64_t>(block) * kTok * d + n0),
                          make_layout(make_shape(Int<kTok>{}, Int<kCols>{}), make_stride(d, Int<1>{})));
  Tensor tCgY = thr.partition_C(gY);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); ++i) tCgY(i) = T(acc(i));
}
// Host check of the shared-memory layouts the kernel relies on: every (column, k, stage) of
// B and (token, k, buffer) of A has its own element; the 8 columns of a copy piece are 8
// consecutive elements starting 16-byte aligned (one cp.async of 16 bytes lands them).
inline bool CheckLayouts() {
  LayoutB lb{};
  LayoutA la{};
  std::vector<int> seen_b(cosize_v<LayoutB>, 0), seen_a(cosize_v<LayoutA>, 0);
  bool ok = true;
  for (int st = 0; st < kStages; ++st)
    for (int k = 0; k < kChunk; ++k)
      for (int n = 0; n < kCols; ++n) {
        const int o = static_cast<int>(lb(n, k, st));
        ok &= o >= 0 && o < static_cast<int>(cosize_v<LayoutB>) && seen_b[o]++ == 0;
        if (n % 8 == 0) {
          ok &= o % 8 == 0;
          for (int j = 1; j < 8; ++j) ok &= static_cast<int>(lb(n + j, k, st)) == o + j;
        }
      }
  for (int b = 0; b < 3; ++b)
    for (int k = 0; k < kChunk; ++k)
      for (int t = 0; t < kTok; ++t) {
        const int o = static_cast<int>(la(t, k, b));
        ok &= o >= 0 && o < static_cast<int>(cosize_v<LayoutA>) && seen_a[o]++ == 0;
      }
  return ok;
}
}  // namespace wg

// Warp-specialized wgmma version (written after Nsight Compute showed the one-warp-group
// kernel latency-bound: 0.29 issues per scheduler, tensor pipe 24% busy, L2 35%). One
// producer warp group clears and scatters each chunk's A tile and copies its row slices
// (cp.async, completion on the stage's full barrier); two consumer warp groups, each its
// own 256 output columns over the same A, only wait, multiply and release. Five stages of
// (A 4 KB, B 2 x 16 KB) keep four chunks in flight ahead of the products.
namespace ws {
using namespace cute;
using T = cutlass::bfloat16_t;
#ifndef WS_PRODUCERS
#define WS_PRODUCERS 1
#endif
#ifndef WS_CONSUMERS
#define WS_CONSUMERS 2
#endif
constexpr int kProducers = WS_PRODUCERS;  // warp groups, taking alternate chunks
constexpr int kConsumers = WS_CONSUMERS;  // warp groups, each its own 256 columns
constexpr int kThreads = 128 * (kProducers + kConsumers);
constexpr int kRing = 5;
constexpr int kSpan = kCols * kConsumers;  // output columns per CTA
// (Two producers and two consumers, 512 threads, do not compile: the launch bound caps every
// thread at 128 registers and a 64 x 256 accumulator needs 128 of its own; ptxas does not
// allocate per warp-group role.)
static_assert(kThreads <= 384, "a consumer's 64 x 256 accumulator needs more than 128 registers");
using LayoutA = decltype(tile_to_shape(GMMA::Layout_K_SW64_Atom<T>{}, make_shape(Int<kTok>{}, Int<kChunk>{}, Int<kRing>{})));
using LayoutB =
    decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<T>{}, make_shape(Int<kCols>{}, Int<kChunk>{}, Int<kRing>{})));
using Mma = decltype(make_tiled_mma(SM90_64x256x16_F32BF16BF16_SS<GMMA::Major::K, GMMA::Major::MN>{}));
using Pipe = cutlass::PipelineAsync<kRing>;

struct Smem {
  alignas(1024) T b[kConsumers][cosize_v<LayoutB>];
  alignas(1024) T a[cosize_v<LayoutA>];
  int off[kMaxChunks + 1];
  typename Pipe::SharedStorage pipe;
};

using Words = ChunkWords<128, 4>;

// Element offset of the first column of row k's 64-column atom row `a` in stage st of a B
// tile: where a 1-row TMA box lands (the 128-byte swizzle permutes within the row).
__host__ __device__ constexpr int TmaRowOffset(int a, int k, int st) {
  return 64 * (k % 8) + 512 * a + 2048 * (k / 8) + 8192 * st;
}

// kTma: the row slices come by TMA (one lane per union row of the chunk, a 1-row box per
// 64 columns) and producer warps 1-3 scatter A; otherwise every producer thread copies
// 16-byte pieces by cp.async and scatters A.
template <bool kTma>
__global__ void __launch_bounds__(kThreads, 1) Kernel(const uint16_t* __restrict__ w, int d,
                                                      const BlockMeta* __restrict__ meta, const int* __restrict__ rows,
                                                      const int* __restrict__ chunk_off, const uint32_t* __restrict__ ent,
                                                      uint16_t* __restrict__ y, const __grid_constant__ CUtensorMap tmap) {
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  Smem& s = *reinterpret_cast<Smem*>(smem_raw);
  if (jax_twell::SmemAddr(smem_raw) % 1024 != 0) __trap();  // the 128-byte swizzle needs 1 KB alignment
  const int block = blockIdx.y, n0 = blockIdx.x * kSpan, tid = threadIdx.x, group = tid / 128;
  const BlockMeta bm = meta[block];
  const int chunks = bm.chunks;
  for (int i = tid; i <= chunks; i += kThreads) s.off[i] = chunk_off[bm.chunk_base + i];
  typename Pipe::Params params;
  params.role = group < kProducers ? Pipe::ThreadCategory::Producer : Pipe::ThreadCategory::Consumer;
  params.producer_arv_count = kTma ? 96 + 1 : 128;  // TMA: warps 1-3, and lane 0 of warp 0 with the bytes
  params.consumer_arv_count = 128 * kConsumers;
  Pipe pipe(s.pipe, params);
  __syncthreads();  // barriers initialised, chunk offsets in shared memory
  Tensor sA = make_tensor(make_smem_ptr(s.a), LayoutA{});  // (token, k, stage)

  if (kTma && group == 0) {
    static_assert(!kTma || kProducers == 1, "the TMA producer is one warp group");
    const int t = tid % 128;
    auto state = cutlass::make_producer_start_state<Pipe>();
    if (t < 32) {  // warp 0: lane l copies union row l of each chunk
      const int* block_rows = rows + bm.row_base;
      int r0 = chunks > 0 ? block_rows[t] : 0, r1 = chunks > 1 ? block_rows[kChunk + t] : 0;
      constexpr uint32_t kBytes = kChunk * kSpan * 2;
      auto produce = [&](int r) {
        pipe.producer_acquire(state);
        const int st = state.index();
        uint64_t* full = pipe.producer_get_barrier(state);
        if (t == 0) cutlass::arch::ClusterTransactionBarrier::arrive_and_expect_tx(full, kBytes);
        __syncwarp();
        CUTE_UNROLL
        for (int k = 0; k < kConsumers; ++k)
          CUTE_UNROLL
          for (int a = 0; a < kCols / 64; ++a)
            SM90_TMA_LOAD_2D::copy(&tmap, full, static_cast<uint64_t>(TMA::CacheHintSm90::EVICT_NORMAL),
                                   s.b[k] + TmaRowOffset(a, t, st), n0 + k * kCols + 64 * a, r);
        ++state;
      };
      for (int c = 0; c < chunks; c += 2) {
        produce(r0);
        r0 = c + 2 < chunks ? block_rows[(c + 2) * kChunk + t] : 0;
        if (c + 1 >= chunks) break;
        produce(r1);
        r1 = c + 3 < chunks ? block_rows[(c + 3) * kChunk + t] : 0;
      }
      return;
    }
    const int u = t - 32;  // warps 1-3: the A tiles
    using Words96 = ChunkWords<96, 4>;
    auto produce = [&](const Words96& cw) {
      pipe.producer_acquire(state);
      const int st = state.index();
      uint4* a4 = reinterpret_cast<uint4*>(&sA(0, 0, st));
      for (int i = u; i < kTok * kChunk / 8; i += 96) a4[i] = make_uint4(0, 0, 0, 0);
      cutlass::arch::NamedBarrier::sync(96, 1);  // the stage's A is clear before any entry lands
      ForEachWord(
          cw, ent,
          [&](uint32_t e) {
            sA(static_cast<int>(e & 0xff), static_cast<int>((e >> 8) & 0xff), st) =
                T::bitcast(static_cast<uint16_t>(e >> 16));
          },
          u);
      cutlass::arch::fence_view_async_shared();
      pipe.producer_commit(state);
      ++state;
    };
    Words96 w0 = LoadWords<96, 4>(ent, s.off, 0, chunks, u), w1 = LoadWords<96, 4>(ent, s.off, 1, chunks, u);
    for (int c = 0; c < chunks; c += 2) {
      produce(w0);
      w0 = LoadWords<96, 4>(ent, s.off, c + 2, chunks, u);
      if (c + 1 >= chunks) break;
      produce(w1);
      w1 = LoadWords<96, 4>(ent, s.off, c + 3, chunks, u);
    }
    return;
  }
  if (group < kProducers) {  // producer warp group `group`: chunks group, group + kProducers, ...
    const int t = tid % 128;
    const int* block_rows = rows + bm.row_base;
    const int piece = t % 32;  // this thread's 16-byte piece of each row slice
    constexpr int kRowsPerThread = kChunk / 4;  // 8: rows t / 32 + 4 i
    auto load_rows = [&](int c, int (&r)[kRowsPerThread]) {
      CUTE_UNROLL
      for (int i = 0; i < kRowsPerThread; ++i) r[i] = c < chunks ? block_rows[c * kChunk + t / 32 + 4 * i] : 0;
    };
    // Row indices and entry words reach registers two of this warp group's chunks ahead,
    // in two sets used in turn: a register is reloaded only after its chunk is done, so no
    // instruction waits on a load issued in the same iteration.
    auto state = cutlass::make_producer_start_state<Pipe>();
    state.advance(group);
    auto produce = [&](int c, const int (&r)[kRowsPerThread], const Words& cw) {
      pipe.producer_acquire(state);
      const int st = state.index();
      uint4* a4 = reinterpret_cast<uint4*>(&sA(0, 0, st));
      for (int i = t; i < kTok * kChunk / 8; i += 128) a4[i] = make_uint4(0, 0, 0, 0);
      cutlass::arch::NamedBarrier::sync(128, 1 + group);  // the stage's A is clear before any entry lands
      ForEachWord(
          cw, ent,
          [&](uint32_t e) {
            sA(static_cast<int>(e & 0xff), static_cast<int>((e >> 8) & 0xff), st) =
                T::bitcast(static_cast<uint16_t>(e >> 16));
          },
          t);
      CUTE_UNROLL
      for (int k = 0; k < kConsumers; ++k) {
        Tensor sB = make_tensor(make_smem_ptr(s.b[k]), LayoutB{});
        const uint16_t* w_col = w + n0 + k * kCols + piece * 8;
        CUTE_UNROLL
        for (int i = 0; i < kRowsPerThread; ++i)
          jax_twell::CpAsync16(&sB(piece * 8, t / 32 + 4 * i, st), w_col + static_cast<int64_t>(r[i]) * d);
      }
      cutlass::arch::fence_view_async_shared();  // the A stores, visible to the async proxy
      pipe.producer_commit(state, cutlass::arch::cpasync_barrier_arrive);
      state.advance(kProducers);
    };
    int r0[kRowsPerThread], r1[kRowsPerThread];
    load_rows(group, r0);
    load_rows(group + kProducers, r1);
    Words w0 = LoadWords<128, 4>(ent, s.off, group, chunks, t);
    Words w1 = LoadWords<128, 4>(ent, s.off, group + kProducers, chunks, t);
    for (int c = group; c < chunks; c += 2 * kProducers) {
      produce(c, r0, w0);
      load_rows(c + 2 * kProducers, r0);
      w0 = LoadWords<128, 4>(ent, s.off, c + 2 * kProducers, chunks, t);
      if (c + kProducers >= chunks) break;
      produce(c + kProducers, r1, w1);
      load_rows(c + 3 * kProducers, r1);
      w1 = LoadWords<128, 4>(ent, s.off, c + 3 * kProducers, chunks, t);
    }
    return;
  }

  // consumers: warp group kProducers + k owns columns n0 + 256 k
  const int consumer = group - kProducers;
  Tensor sB = make_tensor(make_smem_ptr(s.b[consumer]), LayoutB{});
  Mma mma;
  auto thr = mma.get_thread_slice(tid % 128);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, make_shape(Int<kTok>{}, Int<kCols>{}));
  clear(acc);
  warpgroup_fence_operand(acc);
  mma.accumulate_ = GMMA::ScaleOut::One;
  cutlass::PipelineState<kRing> read{}, release{};
  auto multiply = [&] {  // chunk `read`'s products, issued asynchronously
    pipe.consumer_wait(read);
    cutlass::arch::fence_view_async_shared();
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    gemm(mma, tCrA(_, _, _, read.index()), tCrB(_, _, _, read.index()), acc);
    warpgroup_commit_batch();
    ++read;
  };
  if (chunks > 0) multiply();
#pragma unroll 1
  for (int c = 1; c < chunks; ++c) {
    multiply();
    warpgroup_wait<1>();  // chunk c - 1's products are done: release its stage
    warpgroup_fence_operand(acc);
    pipe.consumer_release(release);
    ++release;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  Tensor gY = make_tensor(make_gmem_ptr(reinterpret_cast<T*>(y) + static_cast<int64_t>(block) * kTok * d + n0 +
                                        consumer * kCols),
                          make_layout(make_shape(Int<kTok>{}, Int<kCols>{}), make_stride(d, Int<1>{})));
  Tensor tCgY = thr.partition_C(gY);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {  // (i, i + 1): adjacent columns of one row
    const __nv_bfloat162 v = __floats2bfloat162_rn(acc(i), acc(i + 1));
    *reinterpret_cast<__nv_bfloat162*>(&tCgY(i)) = v;
  }
}

// Host check: each (64-column atom row, k, stage) of B occupies exactly the 64 elements from
// TmaRowOffset on before the swizzle, which on the device acts on the shared-memory address
// (bytes 4-6 ^= bytes 7-9, TMA's 128-byte pattern, atoms 1 KB aligned) and so permutes
// 16-byte pieces within each 128-byte row: a 1-row TMA box written there lands where the
// layout expects it.
inline bool CheckTmaRows() {
  const auto lb = LayoutB{}.layout_b();
  for (int st = 0; st < kRing; ++st)
    for (int k = 0; k < kChunk; ++k)
      for (int a = 0; a < kCols / 64; ++a) {
        int lo = 1 << 30, hi = -1;
        for (int n = 64 * a; n < 64 * a + 64; ++n) {
          lo = std::min(lo, static_cast<int>(lb(n, k, st)));
          hi = std::max(hi, static_cast<int>(lb(n, k, st)));
        }
        if (lo != TmaRowOffset(a, k, st) || hi != lo + 63) return false;
      }
  return true;
}
}  // namespace ws


uint16_t ToBf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float FromBf16(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}

// A problem on the host: every token's active neurons (Bernoulli(active) over f), the
// per-block unions, rows (per_neuron rows of W per union neuron: 2 for dx, 1 for down),
// entries sorted by union row with their chunk offsets, and random coefficients.
struct Problem {
  int m, d, f, per_neuron;
  std::vector<uint16_t> w;  // [per_neuron * f, d]
  std::vector<BlockMeta> meta;
  std::vector<int> rows, chunk_off;
  std::vector<uint32_t> ent;
  int64_t union_rows = 0, entries = 0;
};

Problem MakeProblem(int m, int d, int f, double active, int per_neuron, uint32_t seed) {
  Problem p;
  p.m = m;
  p.d = d;
  p.f = f;
  p.per_neuron = per_neuron;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> uni(-1.f, 1.f);
  p.w.resize(static_cast<size_t>(per_neuron) * f * d);
  for (auto& v : p.w) v = ToBf16(uni(rng) * 0.05f);
  std::bernoulli_distribution on(active);
  std::vector<int> pos(f);
  for (int b = 0; b < m / kTok; ++b) {
    std::vector<std::vector<int>> act(kTok);
    std::vector<char> in_union(f, 0);
    for (int t = 0; t < kTok; ++t)
      for (int n = 0; n < f; ++n)
        if (on(rng)) {
          act[t].push_back(n);
          in_union[n] = 1;
        }
    int u = 0;
    for (int n = 0; n < f; ++n) pos[n] = in_union[n] ? u++ : -1;
    const int urows = u * per_neuron, chunks = (urows + kChunk - 1) / kChunk;
    BlockMeta bm{chunks, static_cast<int>(p.rows.size()), static_cast<int>(p.chunk_off.size()), 0};
    p.meta.push_back(bm);
    for (int n = 0; n < f; ++n)
      if (in_union[n])
        for (int j = 0; j < per_neuron; ++j) p.rows.push_back(n * per_neuron + j);
    for (int i = urows; i < chunks * kChunk; ++i) p.rows.push_back(0);  // padding rows: A is zero there
    std::vector<std::vector<uint32_t>> by_chunk(chunks);
    for (int t = 0; t < kTok; ++t)
      for (int n : act[t])
        for (int j = 0; j < per_neuron; ++j) {
          const int r = pos[n] * per_neuron + j;
          const uint16_t v = ToBf16(uni(rng));
          by_chunk[r / kChunk].push_back(static_cast<uint32_t>(v) << 16 | static_cast<uint32_t>(r % kChunk) << 8 |
                                         static_cast<uint32_t>(t));
        }
    for (int c = 0; c < chunks; ++c) {
      p.chunk_off.push_back(static_cast<int>(p.ent.size()));
      p.ent.insert(p.ent.end(), by_chunk[c].begin(), by_chunk[c].end());
    }
    p.chunk_off.push_back(static_cast<int>(p.ent.size()));
    p.union_rows += urows;
  }
  p.entries = static_cast<int64_t>(p.ent.size());
  return p;
}

struct DeviceProblem {
  uint16_t *w = nullptr, *y = nullptr;
  BlockMeta* meta = nullptr;
  int *rows = nullptr, *chunk_off = nullptr;
  uint32_t* ent = nullptr;
  CUtensorMap tmap{};  // W [rows, d] bf16, 1-row boxes of 64 columns, 128-byte swizzle
};

template <class T>
T* Upload(const std::vector<T>& v) {
  T* p = nullptr;
  cudaMalloc(&p, std::max<size_t>(1, v.size()) * sizeof(T));
  cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}

DeviceProblem UploadProblem(const Problem& p) {
  DeviceProblem g;
  g.w = Upload(p.w);
  g.meta = Upload(p.meta);
  g.rows = Upload(p.rows);
  g.chunk_off = Upload(p.chunk_off);
  g.ent = Upload(p.ent);
  cudaMalloc(&g.y, sizeof(uint16_t) * size_t(p.m) * p.d);
  static PFN_cuTensorMapEncodeTiled_v12000 encode = nullptr;
  if (encode == nullptr) {
    cudaDriverEntryPointQueryResult q;
    cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", reinterpret_cast<void**>(&encode), cudaEnableDefault, &q);
  }
  const int64_t w_rows = static_cast<int64_t>(p.w.size()) / p.d;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(p.d), static_cast<cuuint64_t>(w_rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(p.d) * 2};
  const cuuint32_t box[2] = {64, 1}, elem[2] = {1, 1};
  const CUresult e = encode(&g.tmap, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, g.w, dims, strides, box, elem,
                            CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                            CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (e != CUDA_SUCCESS) printf("cuTensorMapEncodeTiled failed: %d\n", static_cast<int>(e));
  return g;
}

void FreeProblem(DeviceProblem& g) {
  for (void* q : {static_cast<void*>(g.w), static_cast<void*>(g.y), static_cast<void*>(g.meta),
                  static_cast<void*>(g.rows), static_cast<void*>(g.chunk_off), static_cast<void*>(g.ent)})
    cudaFree(q);
}

enum Kind { kMmaSync, kWgmma, kWarpSpecialized, kWarpSpecializedTma };
const char* KindName(int kind) {
  return kind == kMmaSync ? "mma.sync" : kind == kWgmma ? "wgmma" : kind == kWarpSpecialized ? "wgmma, warp-specialized" : "wgmma, warp-specialized, TMA rows";
}

void Launch(const Problem& p, const DeviceProblem& g, int kind) {
  const dim3 grid(p.d / kCols, p.m / kTok);
  if (kind == kWarpSpecialized || kind == kWarpSpecializedTma) {
    auto kernel = kind == kWarpSpecialized ? ws::Kernel<false> : ws::Kernel<true>;
    kernel<<<dim3(p.d / ws::kSpan, p.m / kTok), ws::kThreads, sizeof(ws::Smem)>>>(g.w, p.d, g.meta, g.rows, g.chunk_off,
                                                                               g.ent, g.y, g.tmap);
  }
  else if (kind == kWgmma)
    wg::Kernel<<<grid, wg::kThreads, sizeof(wg::Smem)>>>(g.w, p.d, g.meta, g.rows, g.chunk_off, g.ent, g.y);
  else
    UnionGemmKernel<<<grid, kThreads, sizeof(SmemLayout)>>>(g.w, p.d, g.meta, g.rows, g.chunk_off, g.ent, g.y);
}

// Largest |kernel - reference| over every output, relative to the largest |reference|.
double CheckAgainstHost(const Problem& p, const DeviceProblem& g) {
  std::vector<uint16_t> y(size_t(p.m) * p.d);
  cudaMemcpy(y.data(), g.y, y.size() * 2, cudaMemcpyDeviceToHost);
  std::vector<double> ref(size_t(p.m) * p.d, 0.0);
  for (int b = 0; b < p.m / kTok; ++b) {
    const BlockMeta& bm = p.meta[b];
    for (int c = 0; c < bm.chunks; ++c)
      for (int e = p.chunk_off[bm.chunk_base + c]; e < p.chunk_off[bm.chunk_base + c + 1]; ++e) {
        const uint32_t word = p.ent[e];
        const int t = word & 0xff, r = p.rows[bm.row_base + c * kChunk + ((word >> 8) & 0xff)];
        const double v = FromBf16(static_cast<uint16_t>(word >> 16));
        for (int k = 0; k < p.d; ++k)
          ref[(size_t(b) * kTok + t) * p.d + k] += v * FromBf16(p.w[size_t(r) * p.d + k]);
      }
  }
  double err = 0, scale = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    err = std::max(err, std::abs(FromBf16(y[i]) - ref[i]));
    scale = std::max(scale, std::abs(ref[i]));
  }
  return err / std::max(scale, 1e-30);
}

float TimeKernel(const Problem& p, const DeviceProblem& g, int reps, int kind) {
  for (int i = 0; i < 3; ++i) Launch(p, g, kind);
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  cudaEventRecord(t0);
  for (int i = 0; i < reps; ++i) Launch(p, g, kind);
  cudaEventRecord(t1);
  cudaEventSynchronize(t1);
  float ms = 0.f;
  cudaEventElapsedTime(&ms, t0, t1);
  return ms / reps;
}

}  // namespace

int main(int argc, char** argv) {
  const int m = argc > 1 ? atoi(argv[1]) : 16384, d = argc > 2 ? atoi(argv[2]) : 2048;
  const int f = argc > 3 ? atoi(argv[3]) : 5632;
  const double active = argc > 4 ? atof(argv[4]) : 0.005;
  if (m % kTok != 0 || d % ws::kSpan != 0 || 2 * f / kChunk + 1 >= kMaxChunks) {
    printf("M must be a multiple of %d, d of %d, and 2 f / %d below %d\n", kTok, ws::kSpan, kChunk, kMaxChunks);
    return 1;
  }
  const bool layouts_ok = wg::CheckLayouts() && ws::CheckTmaRows();
  printf("wgmma shared-memory layouts (host check): %s\n", layouts_ok ? "ok" : "FAILED");
  int devices = 0;
  if (!layouts_ok || cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return layouts_ok ? 0 : 1;
  cudaFuncSetAttribute(UnionGemmKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(SmemLayout));
  cudaFuncSetAttribute(wg::Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(wg::Smem));
  cudaFuncSetAttribute(ws::Kernel<false>, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(ws::Smem));
  cudaFuncSetAttribute(ws::Kernel<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(ws::Smem));

  // Correctness on a small problem (both row counts per neuron, a dense-ish fraction so
  // that chunks hold many entries), against a double-precision host sum.
  int bad = 0;
  for (int kind : {kMmaSync, kWgmma, kWarpSpecialized, kWarpSpecializedTma})
    for (int per_neuron : {1, 2})
      for (double frac : {0.01, 0.2}) {
        Problem p = MakeProblem(256, 512, 1000, frac, per_neuron, 7u + per_neuron);
        DeviceProblem g = UploadProblem(p);
        cudaMemset(g.y, 0xff, sizeof(uint16_t) * size_t(p.m) * p.d);  // NaN: an output left unwritten fails
        Launch(p, g, kind);
        const cudaError_t e = cudaDeviceSynchronize();
        const double rel = CheckAgainstHost(p, g);
        const bool ok = e == cudaSuccess && rel < 1e-2;
        bad += !ok;
        printf("check %s per_neuron=%d active=%.2f: max error %.2e of the largest output %s %s\n",
               KindName(kind), per_neuron, frac, rel, ok ? "ok" : "FAILED",
               e == cudaSuccess ? "" : cudaGetErrorString(e));
        FreeProblem(g);
      }

  printf("M=%d d=%d f=%d, %.2f%% active, uniform; %d-token blocks, %d KB shared memory per CTA\n", m, d, f,
         100 * active, kTok, static_cast<int>(sizeof(SmemLayout) / 1024));
  for (int per_neuron : {2, 1}) {
    Problem p = MakeProblem(m, d, f, active, per_neuron, 1u);
    DeviceProblem g = UploadProblem(p);
    for (int kind : {kMmaSync, kWgmma, kWarpSpecialized, kWarpSpecializedTma}) {
      const float ms = TimeKernel(p, g, 20, kind);
      const cudaError_t e = cudaGetLastError();
      const double union_frac = double(p.union_rows) / (double(m / kTok) * per_neuron * f);
      const double flops = 2.0 * kTok * double(p.union_rows) * d;
      char name[96];
      snprintf(name, sizeof(name), "union %s, %s", per_neuron == 2 ? "dx (Wg^T, Wu^T rows)" : "down (Wd rows)",
               KindName(kind));
      printf("%-56s %8.3f ms  union %.1f%% of rows, %.0f TF/s on the union, %.2f GB of rows %s\n", name, ms,
             100 * union_frac, flops / (ms * 1e-3) / 1e12, double(p.union_rows) * d * 2 / 1e9,
             e == cudaSuccess ? "" : cudaGetErrorString(e));
    }
    FreeProblem(g);
  }
  // The dense products they replace: dx = [dg | du] @ [Wg^T; Wu^T] (K = 2f) and y = h @ Wd.
  BF16 *a, *b, *out;
  cudaMalloc(&a, sizeof(BF16) * size_t(m) * 2 * f);
  cudaMalloc(&b, sizeof(BF16) * size_t(2) * f * d);
  cudaMalloc(&out, sizeof(BF16) * size_t(m) * d);
  FillKernel<<<1024, 256>>>(a, size_t(m) * 2 * f, 1u);
  FillKernel<<<1024, 256>>>(b, size_t(2) * f * d, 2u);
  using Coop = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
  using CoopEpi = cutlass::epilogue::TmaWarpSpecializedCooperative;
  using T128x256 = cute::Shape<cute::_128, cute::_256, cute::_64>;
  using C2 = cute::Shape<cute::_2, cute::_1, cute::_1>;
  TimeGemm<Coop, CoopEpi, T128x256, C2, cutlass::layout::RowMajor>("dense dx, CUTLASS (K = 2f)", m, 2 * f, d, a, b,
                                                                     out);
  TimeGemm<Coop, CoopEpi, T128x256, C2, cutlass::layout::RowMajor>("dense down, CUTLASS (K = f)", m, f, d, a, b, out);
  cudaFree(a);
  cudaFree(b);
  cudaFree(out);
  return bad;
}
