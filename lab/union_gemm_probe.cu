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
//          -Iffi -I$CUTLASS/include -I$CUTLASS/tools/util/include lab/union_gemm_probe.cu -o union_gemm_probe
// Kernels: the mma.sync one, a wgmma one (namespace wg) and the library's warp-specialized
// wgmma one (ffi/twell_union.cuh), which the training backward runs for dx.
// Measured: union_probe_d2b0ab9.txt, union_probe_aac403c.txt, union_probe_ws.txt,
//           union_probe_producer_variants.txt; the variants of e5f4905 (128-token blocks,
//           ring depth, two-chunk stages, ...): union_probe_{128_blocks,ring_depth,mma_lag,
//           ablations,two_chunk_stages,lookahead}.txt; consumers scattering A (58f6344):
//           union_probe_consumer_scatter.txt; consumers copying their B slices (6372667,
//           -DTWELL_UNION_CONSUMER_COPIES=1 or 2): union_probe_consumer_copies.txt.
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


#include "async_mma.cuh"
#include "probe_gemm.cuh"
#include "twell_union.cuh"

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

// Entry words per chunk, loaded ahead: the library's helpers (ffi/twell_union.cuh).
// Entry word: value bits << 16 | column within the chunk << 8 | token within the block.
using jax_twell::union_product::ChunkWords;
using jax_twell::union_product::ForEachWord;
using jax_twell::union_product::LoadWords;

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

// The warp-specialized wgmma kernel (one producer warp group, two consumers) is the
// library's UnionProductKernel (ffi/twell_union.cuh), launched below on one interleaved
// table (row id = 2 n + j), which it reads as a single table. Its variants measured here
// and since removed (two producers, TMA row copies): ffi/notes/training_kernels.md.
using WsConfig = jax_twell::union_product::Config<cutlass::bfloat16_t, 2>;
static_assert(sizeof(BlockMeta) == sizeof(jax_twell::union_product::UnionMeta), "the same per-block record");


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
  return g;
}

void FreeProblem(DeviceProblem& g) {
  for (void* q : {static_cast<void*>(g.w), static_cast<void*>(g.y), static_cast<void*>(g.meta),
                  static_cast<void*>(g.rows), static_cast<void*>(g.chunk_off), static_cast<void*>(g.ent)})
    cudaFree(q);
}

enum Kind { kMmaSync, kWgmma, kWarpSpecialized };
const char* KindName(int kind) {
  return kind == kMmaSync ? "mma.sync" : kind == kWgmma ? "wgmma" : "wgmma, warp-specialized (library)";
}

void Launch(const Problem& p, const DeviceProblem& g, int kind) {
  const dim3 grid(p.d / kCols, p.m / kTok);
  if (kind == kWarpSpecialized)
    jax_twell::union_product::UnionProductKernel<cutlass::bfloat16_t, 2, 1>
        <<<dim3(p.m / kTok, p.d / WsConfig::kSpan), WsConfig::kThreads, WsConfig::kSmemBytes>>>(
            g.w, nullptr, p.d, p.m, reinterpret_cast<const jax_twell::union_product::UnionMeta*>(g.meta), g.rows,
            g.chunk_off, g.ent, g.y);
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
    const double v = FromBf16(y[i]);
    if (!std::isfinite(v)) return INFINITY;  // unwritten (the NaN fill) or overflowed: fails
    err = std::max(err, std::abs(v - ref[i]));
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
  if (m % kTok != 0 || d % WsConfig::kSpan != 0 || 2 * f / kChunk + 1 >= kMaxChunks) {
    printf("M must be a multiple of %d, d of %d, and 2 f / %d below %d\n", kTok, WsConfig::kSpan, kChunk, kMaxChunks);
    return 1;
  }
  const bool layouts_ok = wg::CheckLayouts();
  printf("wgmma shared-memory layouts (host check): %s\n", layouts_ok ? "ok" : "FAILED");
  int devices = 0;
  if (!layouts_ok || cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) return layouts_ok ? 0 : 1;
  cudaFuncSetAttribute(UnionGemmKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(SmemLayout));
  cudaFuncSetAttribute(wg::Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, sizeof(wg::Smem));
  cudaFuncSetAttribute(jax_twell::union_product::UnionProductKernel<cutlass::bfloat16_t, 2, 1>,
                       cudaFuncAttributeMaxDynamicSharedMemorySize, WsConfig::kSmemBytes);

  // Correctness on a small problem (both row counts per neuron, a dense-ish fraction so
  // that chunks hold many entries), against a double-precision host sum.
  int bad = 0;
  for (int kind : {kMmaSync, kWgmma, kWarpSpecialized})
    for (int per_neuron : {1, 2})
      for (double frac : {0.01, 0.2}) {
        Problem p = MakeProblem(256, 512, 1000, frac, per_neuron, 7u + per_neuron);
        DeviceProblem g = UploadProblem(p);
        cudaMemset(g.y, 0xff, sizeof(uint16_t) * size_t(p.m) * p.d);  // NaN: an output left unwritten fails
        Launch(p, g, kind);
        cudaError_t e = cudaGetLastError();  // a launch that could not start (its shared memory, say)
        if (e == cudaSuccess) e = cudaDeviceSynchronize();
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
    for (int kind : {kMmaSync, kWgmma, kWarpSpecialized}) {
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
