// Dense tensor-core products over the union of a 64-token block's active neurons.
//
// For a block of 64 tokens, let U be the neurons active in any of them (~27% of f at 0.5%
// active, uniform). With A the block's coefficients as a [64, R |U|] matrix (mostly zeros;
// R = 1 or 2 weight rows per neuron) and W_U the rows of U gathered from one or two [f, d]
// tables, Y[block] = A @ W_U is a dense product over the union: no per-entry work beyond
// writing each entry once into A. ffi/notes/training_kernels.md, "Dense products over a
// block's union", has the design, the probe (lab/union_gemm_probe.cu) and its
// measurements.
//
// The layout a caller builds per block (UnionMeta):
//   rows[row_base + i], i < 32 chunks: the union's table rows in K order, R per neuron
//     (R = 2: row id 2 j + r, table r, neuron j); padding rows (id 0) where A is zero;
//   chunk_off[chunk_base + c], c <= chunks: absolute offsets into `ent` of chunk c's words;
//   ent: value bits << 16 | column within the chunk << 8 | token within the block.
// Words of one chunk may come in any order: they land in distinct places of A.
//
// UnionProductKernel: one CTA per (block, 256 kConsumers output columns), blocks fastest; a producer warp
// group scatters each chunk's entries into its (clear) A tile and copies its row slices by
// cp.async (completion on the stage's full barrier, CUTLASS's PipelineAsync); kConsumers
// warp groups, each its own 256 columns over the same A, wait, issue two 64 x 256 x 16
// wgmma, and clear and release the previous stage's A. Five stages of A 4 KB + B
// kConsumers x 16 KB, and the block's chunk offsets. The producer sets the pace, so it
// does as little as it can: no clearing, offsets from shared memory, and 32-bit shared
// addresses with the swizzles worked out once (ffi/notes/training_kernels.md, "The
// producer's profile").
#pragma once

#include <cstdint>
#include <type_traits>

#include "async_mma.cuh"
#include "twell_union.h"
#include "cute/tensor.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/pipeline/pipeline.hpp"

namespace jax_twell {
namespace union_product {

constexpr int kRing = 5;  // pipeline stages

// One chunk's entry words: with T threads and P words each, thread t holds entries
// off + t, off + t + T, ... (registers, loaded ahead of their use); a chunk with more than
// T P entries reads the rest from global memory when used (correct, slower).
template <int T, int P>
struct ChunkWords {
  uint32_t w[P];
  int e0, e1;
};

// A chunk's range [e0, e1) of entry words; empty for chunks outside [0, chunks).
struct ChunkSpan {
  int e0 = 0, e1 = 0;
};

__device__ __forceinline__ ChunkSpan LoadSpan(const int* off, int c, int chunks) {
  ChunkSpan s;
  if (c >= 0 && c < chunks) {
    s.e0 = off[c];
    s.e1 = off[c + 1];
  }
  return s;
}

// Chunk offsets staged in shared memory: the first kStagedOffsets of a block's offsets
// (every block's, at f <= kMaxF), copied once when the CTA starts, so that a chunk's span
// is read without a global load, which would queue behind the copies the producer has in
// flight (ffi/notes/training_kernels.md, "The producer's profile"); offsets past those
// (a larger f) come from global memory.
constexpr int kStagedOffsets = 2 * kMaxF / kChunk + 1;

__device__ __forceinline__ ChunkSpan LoadSpan(const int* staged, const int* off, int c, int chunks) {
  ChunkSpan s;
  if (c >= 0 && c < chunks) {
    if (c + 1 < kStagedOffsets) {
      s.e0 = LdSharedInt(staged + c);
      s.e1 = LdSharedInt(staged + c + 1);
    } else {
      s.e0 = off[c];
      s.e1 = off[c + 1];
    }
  }
  return s;
}

// The words at a span loaded earlier: the loads issue at once (no dependent offset load).
template <int T, int P>
__device__ __forceinline__ ChunkWords<T, P> LoadWords(const uint32_t* ent, ChunkSpan span,
                                                     int t = static_cast<int>(threadIdx.x)) {
  ChunkWords<T, P> cw{};
  cw.e0 = span.e0;
  cw.e1 = span.e1;
#pragma unroll
  for (int i = 0; i < P; ++i) {
    const int e = cw.e0 + t + i * T;
    if (e < cw.e1) cw.w[i] = ent[e];
  }
  return cw;
}

template <int T, int P>
__device__ __forceinline__ ChunkWords<T, P> LoadWords(const uint32_t* ent, const int* off, int c, int chunks,
                                                     int t = static_cast<int>(threadIdx.x)) {
  return LoadWords<T, P>(ent, LoadSpan(off, c, chunks), t);
}

// put(word) for every entry word of the chunk this thread holds.
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

// The 64 x 256 x 16 wgmma for Elem: A K-major, B kMajorB (MN for the row products, K for
// the up product), and the epilogue's packing of two f32 into an Elem pair.
template <typename Elem, cute::GMMA::Major kMajorB = cute::GMMA::Major::MN>
struct MmaFor;
template <cute::GMMA::Major kMajorB>
struct MmaFor<cutlass::bfloat16_t, kMajorB> {
  using Op = cute::SM90_64x256x16_F32BF16BF16_SS<cute::GMMA::Major::K, kMajorB>;
  static __device__ __forceinline__ uint32_t Pack(float a, float b) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};
template <cute::GMMA::Major kMajorB>
struct MmaFor<cutlass::half_t, kMajorB> {
  using Op = cute::SM90_64x256x16_F32F16F16_SS<cute::GMMA::Major::K, kMajorB>;
  static __device__ __forceinline__ uint32_t Pack(float a, float b) {
    const __half2 v = __floats2half2_rn(a, b);
    return *reinterpret_cast<const uint32_t*>(&v);
  }
};

// Byte offsets in the A and B tiles of one stage (16-bit elements; the GMMA layouts of
// Config, checked against CuTe's own by benchmarks/union_layout_check.cu): A, K-major with the
// 64-byte swizzle, for an entry word's (token, column); B, MN-major with the 128-byte
// swizzle, for output column n (a multiple of 8) of union row k.
static_assert(kChunk == 32 && kCols % 64 == 0, "A rows are one 64-byte swizzle atom wide; B spans whole 128-byte atoms");
__host__ __device__ __forceinline__ uint32_t SwizzleA(uint32_t e) {
  const uint32_t o = (e & 0xff) * (2 * kChunk) + ((e >> 7) & 0x1fe);  // token * 64 + column * 2
  return o ^ ((o >> 3) & 0x30);
}
__host__ __device__ __forceinline__ uint32_t SwizzleB(int n, int k) {
  const uint32_t o = ((n / 64) + (kCols / 64) * (k / 8)) * 1024 + (k % 8) * 128 + (n % 64) * 2;
  return o ^ ((o >> 3) & 0x70);
}

// The up product's tiles (K-major, 128-byte swizzle, kUpK = 64 elements a row): row r,
// column c (a multiple of 8).
static_assert(kUpK * 2 == 128, "an up-product tile row is one 128-byte swizzle atom wide");
__host__ __device__ __forceinline__ uint32_t SwizzleK128(int r, int c) {
  const uint32_t o = r * 128 + c * 2;
  return o ^ ((o >> 3) & 0x70);
}

template <typename Elem, int kConsumers>
struct Config {
  static constexpr int kThreads = 128 * (1 + kConsumers);
  static constexpr int kSpan = kCols * kConsumers;  // output columns per CTA
  using LayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW64_Atom<Elem>{},
                                               cute::make_shape(cute::Int<kTok>{}, cute::Int<kChunk>{},
                                                                cute::Int<kRing>{})));
  using LayoutB = decltype(cute::tile_to_shape(cute::GMMA::Layout_MN_SW128_Atom<Elem>{},
                                               cute::make_shape(cute::Int<kCols>{}, cute::Int<kChunk>{},
                                                                cute::Int<kRing>{})));
  using Pipe = cutlass::PipelineAsync<kRing>;
  struct Smem {
    alignas(1024) Elem b[kConsumers][cute::cosize_v<LayoutB>];
    alignas(1024) Elem a[cute::cosize_v<LayoutA>];
    typename Pipe::SharedStorage pipe;
    int off[kStagedOffsets];  // the block's chunk offsets (producer only)
  };
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;  // + alignment slack
};

// y[64 block + t, n0 + c] = sum over the block's union rows i of A[t, i] W[rows[i], n0 + c],
// for rows 64 block + t < out_rows (f32 accumulation, one rounding to Elem); NaN where the
// block is marked over budget (as the per-entry down steps write it). Table rows:
// kRowsPerNeuron = 2: id & 1 selects table1 over table0, row id >> 1; otherwise table0,
// row id. d a multiple of kSpan; grid (blocks, d / kSpan).
template <typename Elem, int kConsumers, int kRowsPerNeuron>
__global__ void __launch_bounds__(Config<Elem, kConsumers>::kThreads, 1)
    UnionProductKernel(const uint16_t* __restrict__ table0, const uint16_t* __restrict__ table1, int d,
                       int64_t out_rows, const UnionMeta* __restrict__ meta, const int* __restrict__ rows,
                       const int* __restrict__ chunk_off, const uint32_t* __restrict__ ent,
                       uint16_t* __restrict__ y) {
  using namespace cute;
  using Cfg = Config<Elem, kConsumers>;
  using Pipe = typename Cfg::Pipe;
  using Words = ChunkWords<128, 4>;
  extern __shared__ unsigned char smem_raw[];
  // The 128-byte swizzle needs 1 KB alignment; the dynamic allocation carries the slack.
  unsigned char* aligned = smem_raw + ((1024 - SmemAddr(smem_raw) % 1024) % 1024);
  auto& s = *reinterpret_cast<typename Cfg::Smem*>(aligned);
  // Blocks fastest: the resident CTAs share one column range, so the rows they read are
  // a quarter of the tables' columns (L2-resident) instead of all of them.
  const int block = blockIdx.x, n0 = blockIdx.y * Cfg::kSpan, tid = threadIdx.x, group = tid / 128;
  const UnionMeta bm = meta[block];
  const int chunks = bm.chunks;
  const int* off = chunk_off + bm.chunk_base;
  typename Pipe::Params params;
  params.role = group == 0 ? Pipe::ThreadCategory::Producer : Pipe::ThreadCategory::Consumer;
  params.producer_arv_count = 128;
  params.consumer_arv_count = 128 * kConsumers;
  Pipe pipe(s.pipe, params);
  {  // every stage's A starts clear; after that the consumers clear a stage before releasing it
    uint4* a4 = reinterpret_cast<uint4*>(s.a);
    for (int i = tid; i < static_cast<int>(sizeof(s.a) / 16); i += Cfg::kThreads) a4[i] = make_uint4(0, 0, 0, 0);
  }
  __syncthreads();  // barriers initialised
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename Cfg::LayoutA{});  // (token, k, stage)

  if (group == 0) {  // producer
    const int* block_rows = rows + bm.row_base;
    auto state = cutlass::make_producer_start_state<Pipe>();
    const int piece = tid % 32;                 // this thread's 16-byte piece of each row slice
    constexpr int kRowsPerThread = kChunk / 4;  // 8: rows tid / 32 + 4 i
    // Addresses as 32-bit shared offsets and one wide multiply-add per row: the layouts'
    // swizzles are fixed per thread and row (B) or two shifts and an xor (A), so the chunk
    // loop needs none of the generic 64-bit pointer arithmetic.
    constexpr uint32_t kAStageBytes = kTok * kChunk * sizeof(Elem);
    constexpr uint32_t kBStageBytes = kCols * kChunk * sizeof(Elem);
    constexpr uint32_t kBTableBytes = sizeof(s.b[0]);
    const uint32_t a_base = SmemAddr(s.a), b_base = SmemAddr(s.b[0]);
    uint32_t b_off[kRowsPerThread];
    CUTE_UNROLL
    for (int i = 0; i < kRowsPerThread; ++i) b_off[i] = SwizzleB(piece * 8, tid / 32 + 4 * i);
    const char* src0 = reinterpret_cast<const char*>(table0 + n0 + piece * 8);
    const char* src1 = reinterpret_cast<const char*>(table1 + n0 + piece * 8);
    const uint32_t row_bytes = static_cast<uint32_t>(d) * sizeof(Elem);
    auto row_src = [&](int id) -> const char* {
      if constexpr (kRowsPerNeuron == 2)
        return ((id & 1) ? src1 : src0) + static_cast<uint64_t>(static_cast<uint32_t>(id) >> 1) * row_bytes;
      else
        return src0 + static_cast<uint64_t>(static_cast<uint32_t>(id)) * row_bytes;
    };
    auto load_rows = [&](int c, int (&r)[kRowsPerThread]) {
      CUTE_UNROLL
      for (int i = 0; i < kRowsPerThread; ++i) r[i] = c < chunks ? block_rows[c * kChunk + tid / 32 + 4 * i] : 0;
    };
    auto produce = [&](const int (&r)[kRowsPerThread], const Words& cw) {
      pipe.producer_acquire(state);
      const int st = state.index();
      const uint32_t a_stage = a_base + st * kAStageBytes;
      ForEachWord(cw, ent, [&](uint32_t e) { StSharedU16(a_stage + SwizzleA(e), e >> 16); });
      // The A stores, visible to the async proxy: fenced before this chunk's copies are
      // issued, so the fence does not wait behind them (the consumers fence the copies'
      // data after their full-barrier wait).
      cutlass::arch::fence_view_async_shared();
      const uint32_t b_stage = b_base + st * kBStageBytes;
      CUTE_UNROLL
      for (int i = 0; i < kRowsPerThread; ++i) {
        const char* src = row_src(r[i]);
        CUTE_UNROLL
        for (int k = 0; k < kConsumers; ++k)
          CpAsync16Shared(b_stage + b_off[i] + k * kBTableBytes, src + k * kCols * sizeof(Elem));
      }
      pipe.producer_commit(state, cutlass::arch::cpasync_barrier_arrive);
      ++state;
    };
    // Row indices and entry words reach registers two chunks ahead, in two sets used in
    // turn: a register is reloaded only after its chunk is issued. A chunk's word offsets
    // are read (from shared memory) a chunk before its words.
    int r0[kRowsPerThread], r1[kRowsPerThread];
    load_rows(0, r0);
    load_rows(1, r1);
    for (int i = tid; i < min(chunks + 1, kStagedOffsets); i += 128) StSharedInt(&s.off[i], off[i]);
    cutlass::arch::NamedBarrier::sync(128, 1);  // the staged offsets are in place
    auto span = [&](int c) { return LoadSpan(s.off, off, c, chunks); };
    ChunkSpan s0 = span(2), s1 = span(3);
    Words w0 = LoadWords<128, 4>(ent, span(0)), w1 = LoadWords<128, 4>(ent, span(1));
    for (int c = 0; c < chunks; c += 2) {
      produce(r0, w0);
      load_rows(c + 2, r0);
      w0 = LoadWords<128, 4>(ent, s0);
      s0 = span(c + 4);
      if (c + 1 >= chunks) break;
      produce(r1, w1);
      load_rows(c + 3, r1);
      w1 = LoadWords<128, 4>(ent, s1);
      s1 = span(c + 5);
    }
    return;
  }

  // consumer warp group `group` owns columns n0 + 256 (group - 1)
  const int consumer = group - 1;
  Tensor sB = make_tensor(make_smem_ptr(s.b[consumer]), typename Cfg::LayoutB{});
  auto mma = make_tiled_mma(typename MmaFor<Elem>::Op{});
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
    if constexpr (kConsumers > 1) cutlass::arch::NamedBarrier::sync(128 * kConsumers, 2);  // all groups are done with it
    {
      uint4* a4 = reinterpret_cast<uint4*>(&sA(0, 0, release.index()));
      for (int i = tid - 128; i < kTok * kChunk / 8; i += 128 * kConsumers) a4[i] = make_uint4(0, 0, 0, 0);
      cutlass::arch::fence_view_async_shared();
    }
    pipe.consumer_release(release);
    ++release;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  const int64_t row0 = static_cast<int64_t>(block) * kTok;
  const int col0 = n0 + consumer * kCols;
  Tensor cY = make_identity_tensor(make_shape(Int<kTok>{}, Int<kCols>{}));
  Tensor tCcY = thr.partition_C(cY);
  // Packed pairs: (i, i + 1) are adjacent columns of one row. Single-element stores made
  // ptxas serialize every wgmma (C7514).
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {
    const int64_t row = row0 + get<0>(tCcY(i));
    const float nan = __int_as_float(0x7fc00000);
    if (row < out_rows)
      *reinterpret_cast<uint32_t*>(y + row * d + col0 + get<1>(tCcY(i))) =
          bm.over_budget ? MmaFor<Elem>::Pack(nan, nan) : MmaFor<Elem>::Pack(acc(i), acc(i + 1));
  }
}


// The up product (the inference FFN's up step): per (256 union neurons, 64-token block),
// U[t, i] = x[t] . Wu^T[rows[i]] over K = d, then u of each of the block's entries read
// from U. A and B are both K-major (x rows and Wu^T rows, 128-byte swizzle, 64 columns of d
// a stage); the producer warp groups' rows are fixed for the whole CTA, so a stage is
// 8 + 2 cp.async per producer thread and nothing else; one consumer warp group issues four
// 64 x 256 x 16 wgmma a stage. Epilogue: U through shared memory (reusing the B ring),
// then one f32 per entry word pair.
//
// Producer warp groups of the up product. One group's 16-byte copies move its rows at
// ~8 TB/s, near the ~8.5 TB/s gathered rows reach from L2 by any means; a second group
// gains ~3% (lab/row_copy_probe.cu; ffi/notes/training_kernels.md, "The up product
// with two producer groups").
constexpr int kUpProducers = 2;

template <typename Elem>
struct UpConfig {
  static constexpr int kStages = 5;
  static constexpr int kThreads = 128 * (kUpProducers + 1);  // producers + one consumer warp group
  using LayoutA = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Elem>{},
                                               cute::make_shape(cute::Int<kTok>{}, cute::Int<kUpK>{},
                                                                cute::Int<kStages>{})));
  using LayoutB = decltype(cute::tile_to_shape(cute::GMMA::Layout_K_SW128_Atom<Elem>{},
                                               cute::make_shape(cute::Int<kUpNeurons>{}, cute::Int<kUpK>{},
                                                                cute::Int<kStages>{})));
  using Pipe = cutlass::PipelineAsync<kStages>;
  static constexpr int kOutStride = kUpNeurons + 4;  // f32 staging row stride (words)
  struct Smem {
    alignas(1024) Elem b[cute::cosize_v<LayoutB>];
    alignas(1024) Elem a[cute::cosize_v<LayoutA>];
    typename Pipe::SharedStorage pipe;
  };
  static_assert(sizeof(Elem) * cute::cosize_v<LayoutB> >= sizeof(float) * kTok * kOutStride,
                "the staged U fits the B ring");
  static constexpr int kSmemBytes = static_cast<int>(sizeof(Smem)) + 1024;
};

// grid (ceil(f / 256), blocks); CTAs past a block's union return at once.
template <typename Elem>
__global__ void __launch_bounds__(UpConfig<Elem>::kThreads, 1)
    UnionUpKernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ table, int d, int64_t x_rows,
                  const UnionMeta* __restrict__ meta, const int* __restrict__ rows,
                  const int* __restrict__ chunk_off, const uint2* __restrict__ pairs, float* __restrict__ out) {
  using namespace cute;
  using Cfg = UpConfig<Elem>;
  using Pipe = typename Cfg::Pipe;
  constexpr int kChunksPerCta = kUpNeurons / kChunk;
  const int block = blockIdx.y, tile = blockIdx.x, tid = threadIdx.x, group = tid / 128;
  const UnionMeta bm = meta[block];
  if (tile * kChunksPerCta >= bm.chunks) return;  // uniform over the CTA, before any barrier
  extern __shared__ unsigned char smem_raw[];
  unsigned char* aligned = smem_raw + ((1024 - SmemAddr(smem_raw) % 1024) % 1024);
  auto& s = *reinterpret_cast<typename Cfg::Smem*>(aligned);
  typename Pipe::Params params;
  params.role = group < kUpProducers ? Pipe::ThreadCategory::Producer : Pipe::ThreadCategory::Consumer;
  params.producer_arv_count = 128 * kUpProducers;
  params.consumer_arv_count = 128;
  Pipe pipe(s.pipe, params);
  __syncthreads();  // barriers initialised
  Tensor sA = make_tensor(make_smem_ptr(s.a), typename Cfg::LayoutA{});  // (token, k, stage)
  Tensor sB = make_tensor(make_smem_ptr(s.b), typename Cfg::LayoutB{});  // (union row, k, stage)
  const int k_steps = d / kUpK;

  // producers: thread tid copies 16-byte piece tid % 8 of rows tid / 8 + kStep i
  constexpr int kStep = 16 * kUpProducers;
  if (group < kUpProducers) {
    const int piece = tid % 8, r0 = tid / 8;
    // Rows past the block's chunks (the last tile's padding, ~half a tile on average) are
    // zero-filled, not read: their U columns are never used.
    const int n_rows = min(kUpNeurons, bm.chunks * kChunk - tile * kUpNeurons);
    const int* my_rows = rows + bm.row_base + tile * kUpNeurons;
    const uint16_t* b_src[kUpNeurons / kStep];
    CUTE_UNROLL
    for (int i = 0; i < kUpNeurons / kStep; ++i) {
      const int r = r0 + kStep * i;
      b_src[i] = table + static_cast<int64_t>(r < n_rows ? my_rows[r] : 0) * d + piece * 8;
    }
    uint32_t b_bytes[kUpNeurons / kStep];  // 16, or 0 for a zero fill
    CUTE_UNROLL
    for (int i = 0; i < kUpNeurons / kStep; ++i) b_bytes[i] = r0 + kStep * i < n_rows ? 16 : 0;
    const uint16_t* a_src[kTok / kStep];
    CUTE_UNROLL
    for (int i = 0; i < kTok / kStep; ++i) {  // tokens past M read the last row: their U is never used
      const int64_t t = min(static_cast<int64_t>(block) * kTok + r0 + kStep * i, x_rows - 1);
      a_src[i] = x + t * d + piece * 8;
    }
    // 32-bit shared addresses: rows r0 + kStep i of both K-major tiles share one swizzle phase
    // (r0 % 8), so each copy lands at this thread's offset plus kStep rows i (as in the row
    // product, the producer's instructions set its pace).
    constexpr uint32_t kRowBytes = kUpK * sizeof(Elem), kBStage = kUpNeurons * kRowBytes, kAStage = kTok * kRowBytes;
    const uint32_t lane_off = SwizzleK128(r0, piece * 8);
    const uint32_t b_base = SmemAddr(s.b) + lane_off, a_base = SmemAddr(s.a) + lane_off;
    auto state = cutlass::make_producer_start_state<Pipe>();
#pragma unroll 1
    for (int k = 0; k < k_steps; ++k) {
      pipe.producer_acquire(state);
      const uint32_t b_stage = b_base + state.index() * kBStage, a_stage = a_base + state.index() * kAStage;
      CUTE_UNROLL
      for (int i = 0; i < kUpNeurons / kStep; ++i) {
        CpAsync16SharedOrZero(b_stage + i * kStep * kRowBytes, b_src[i], b_bytes[i]);
        b_src[i] += kUpK;
      }
      CUTE_UNROLL
      for (int i = 0; i < kTok / kStep; ++i) {
        CpAsync16Shared(a_stage + i * kStep * kRowBytes, a_src[i]);
        a_src[i] += kUpK;
      }
      pipe.producer_commit(state, cutlass::arch::cpasync_barrier_arrive);
      ++state;
    }
    return;
  }

  auto mma = make_tiled_mma(typename MmaFor<Elem, GMMA::Major::K>::Op{});
  const int ctid = tid - 128 * kUpProducers;
  auto thr = mma.get_thread_slice(ctid);
  Tensor tCrA = thr.make_fragment_A(thr.partition_A(sA));
  Tensor tCrB = thr.make_fragment_B(thr.partition_B(sB));
  Tensor acc = partition_fragment_C(mma, make_shape(Int<kTok>{}, Int<kUpNeurons>{}));
  clear(acc);
  warpgroup_fence_operand(acc);
  mma.accumulate_ = GMMA::ScaleOut::One;
  cutlass::PipelineState<Cfg::kStages> read{}, release{};
  auto multiply = [&] {
    pipe.consumer_wait(read);
    cutlass::arch::fence_view_async_shared();  // cp.async (generic proxy) before wgmma reads
    warpgroup_fence_operand(acc);
    warpgroup_arrive();
    gemm(mma, tCrA(_, _, _, read.index()), tCrB(_, _, _, read.index()), acc);
    warpgroup_commit_batch();
    ++read;
  };
  multiply();
#pragma unroll 1
  for (int k = 1; k < k_steps; ++k) {
    multiply();
    warpgroup_wait<1>();
    warpgroup_fence_operand(acc);
    pipe.consumer_release(release);
    ++release;
  }
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);
  // Every stage has landed and been read: the B ring takes U (f32, row stride kOutStride).
  cutlass::arch::NamedBarrier::sync(128, 1);
  float* staged = reinterpret_cast<float*>(s.b);
  Tensor cU = make_identity_tensor(make_shape(Int<kTok>{}, Int<kUpNeurons>{}));
  Tensor tCcU = thr.partition_C(cU);
  CUTE_UNROLL
  for (int i = 0; i < size(acc); i += 2) {  // (i, i + 1): adjacent columns of one row
    *reinterpret_cast<float2*>(staged + get<0>(tCcU(i)) * Cfg::kOutStride + get<1>(tCcU(i))) =
        make_float2(acc(i), acc(i + 1));
  }
  cutlass::arch::NamedBarrier::sync(128, 1);
  const int* off = chunk_off + bm.chunk_base;
  const int lo = off[tile * kChunksPerCta], hi = off[min((tile + 1) * kChunksPerCta, bm.chunks)];
  for (int p = lo + ctid; p < hi; p += 128) {
    const uint2 w = pairs[p];
    out[w.y] = staged[(w.x & 0xff) * Cfg::kOutStride + ((w.x >> 8) & 0xff)];
  }
}

}  // namespace union_product
}  // namespace jax_twell
