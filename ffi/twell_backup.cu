// twell_backup: the warp path's dense backup with its row count on the device.
//
// The warp kernel (twell_ffn_warp.cu) leaves zeros on the rows whose entries do not fit
// (a tile past capacity, or more than max_entries entries). This handler computes those
// rows densely, with no host round trip: how many there are is known only on the device,
// and every launch below reads it there.
//
//   1. BackupListKernel: one warp a row applies the warp kernel's rule to the TwELL counts
//      and appends the backed-up rows to a list (an atomic counter, zeroed first by a
//      memset). The list's order varies from run to run; no result depends on it.
//   2. BackupKernel, one cooperative launch of persistent CTAs that reads the count and
//      returns at once when it is zero; else, chunk by chunk of the scratch's rows:
//      - where the caller has no g (the gate was packed in its matmul's epilogue): the
//        listed rows' activation, h[i] = bf16(relu(x[r] @ Wg)) (r = list[i]);
//      - gated: h[i] = bf16(g * bf16(x[r] @ Wu)), g = g[r] or the recomputed h[i] (in
//        place), rounded as the reference rounds u and h;
//      - y[r] = bf16(h[i] @ Wd) (non-gated with g given: g[r] @ Wd, no scratch);
//      a grid barrier between a product and the next one that reads it, and between chunks.
// The products are tensor-core tiles (mma.sync m16n8k16, f32 accumulators; 64 x 64 x 32
// tiles, four warps, a four-stage cp.async pipeline), shared out over the grid; a product
// with fewer tiles than half the grid splits its K loop over CTAs (f32 partial tiles in a
// scratch, then a reduction phase in slice order that applies the product's epilogue). The
// scratch holds a chunk of rows ([chunk, f], the caller's choice), so any number of rows is
// exact at a bounded memory cost. Each row's sums run over K in an order fixed by the
// shapes, the row count and the device (its CTAs), whatever its place in the list or chunk: the results are
// deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "async_mma.cuh"
#include "common.h"
#include "elements.cuh"

namespace jax_twell {
namespace {

constexpr int kBM = 64, kBN = 64, kBK = 32;
constexpr int kStages = 4;
constexpr int kThreads = 128;         // four warps, 2 x 2 over the tile, 32 x 32 each
constexpr int kAStride = kBK + 8;     // elements a row of the A stage: 80 bytes, ldmatrix without bank conflicts
constexpr int kBStride = kBN + 8;     // 144 bytes
constexpr int kAStage = kBM * kAStride;
constexpr int kBStage = kBK * kBStride;
constexpr int kSmemBytes = kStages * (kAStage + kBStage) * 2;
constexpr int kListWarps = 8;
// Split-K: a product with fewer tiles than half the grid's CTAs splits its K loop into up
// to kMaxSplit slices, each a work item whose f32 partial tile goes to a scratch of
// kPartialTiles tiles; a reduction phase then sums the slices in slice order (a fixed order:
// deterministic) and applies the product's epilogue. A few backed-up rows then take a few
// microseconds instead of one tile's whole K loop (176 steps of 32 for f = 5,632).
constexpr int kMaxSplit = 16;
constexpr int kPartialTiles = 512;  // 8 MB of f32 64 x 64 tiles
constexpr int kTileElems = kBM * kBN;

__global__ __launch_bounds__(kListWarps * 32) void BackupListKernel(int64_t rows, int n_tiles, int capacity,
                                                                     int max_entries, const int32_t* __restrict__ counts,
                                                                     int32_t* __restrict__ list,
                                                                     int32_t* __restrict__ count) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kListWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int32_t* row_counts = counts + row * n_tiles;
  int total = 0;
  bool over = false;
  for (int k = lane; k < n_tiles; k += 32) {
    const int c = row_counts[k];
    total += c;
    over |= c > capacity;
  }
  total = __reduce_add_sync(kFullMask, total);
  over = __any_sync(kFullMask, over);
  if (lane == 0 && (over || total > max_entries)) list[atomicAdd(count, 1)] = static_cast<int32_t>(row);
}

struct GemmArgs {
  const uint16_t* a;  // A rows: a + list[i] * lda (kGatherA) or a + i * lda
  int64_t lda;
  const uint16_t* b;  // B [K, N], row-major
  int64_t ldb;
  uint16_t* c;        // C rows: c + list[i] * ldc (kStoreRows) or c + i * ldc
  int64_t ldc;
  const uint16_t* g;  // kScaleRows: the gate's rows g + list[i] * ldg; kScaleCompact: g + i * ldg
  int64_t ldg;
  const int32_t* list;  // this chunk's part of the list: position i is list[i]
  int n, k;
};

// What a product's epilogue does with its f32 sums v of list position i (row r = list[i]).
enum Epilogue : int {
  kStoreRows = 0,     // c[r] = bf16(v)
  kRelu = 1,          // c[i] = bf16(relu(v))
  kScaleRows = 2,     // c[i] = bf16(g[r] * bf16(v))
  kScaleCompact = 3,  // c[i] = bf16(g[i] * bf16(v))
};

// The epilogue of a product for list position i (row r = list[i]) and columns col, col + 1
// (col even, below n): the f32 sums v0, v1 rounded and stored as kEpi says.
template <typename E, int kEpi>
__device__ __forceinline__ void StorePair(const GemmArgs& p, int i, int col, float v0, float v1) {
  const int64_t r = p.list[i];
  uint16_t* out;
  if constexpr (kEpi == kStoreRows) {
    out = p.c + r * p.ldc + col;
  } else {
    if constexpr (kEpi == kRelu) {  // NaN stays NaN, as XLA's max has it (fmaxf would drop it)
      v0 = isnan(v0) ? v0 : fmaxf(v0, 0.f);
      v1 = isnan(v1) ? v1 : fmaxf(v1, 0.f);
    } else {
      // L2, not L1: in the compact form g is this call's scratch, rewritten chunk by chunk.
      const int64_t grow = kEpi == kScaleRows ? r : static_cast<int64_t>(i);
      const uint32_t gv = __ldcg(reinterpret_cast<const unsigned int*>(p.g + grow * p.ldg + col));
      v0 = E::ToFloat(gv) * Round<E>(v0);
      v1 = E::ToFloat(gv >> 16) * Round<E>(v1);
    }
    out = p.c + static_cast<int64_t>(i) * p.ldc + col;
  }
  *reinterpret_cast<uint32_t*>(out) = E::FromFloat(v0) | (E::FromFloat(v1) << 16);
}

// How many K slices a product of `tiles` tiles and `k_steps` K steps runs as (1: no
// split): every CTA computes the same value, so the barriers that follow a split are
// reached by all. With `partials` null, never split.
__device__ __forceinline__ int SplitOf(int tiles, int k_steps, const float* partials) {
  if (partials == nullptr || tiles * 2 > static_cast<int>(gridDim.x)) return 1;
  int split = min(min(kMaxSplit, static_cast<int>(gridDim.x) / tiles), min(kPartialTiles / tiles, max(1, k_steps / 4)));
  if (split <= 1) return 1;
  const int k_per = (k_steps + split - 1) / split;
  return (k_steps + k_per - 1) / k_per;  // every slice non-empty
}

// One product over the `count` list positions of a chunk, its work items shared out over
// the grid (item t to CTA t mod gridDim.x): its tiles, or with a split (SplitOf) each
// tile's K slices, whose f32 partials go to `partials` for ReducePhase. Returns the split.
template <typename E, bool kGatherA, int kEpi>
__device__ __forceinline__ int GemmPhase(const GemmArgs& p, int count, uint16_t* smem, float* partials) {
  uint16_t* sa = smem;
  uint16_t* sb = smem + kStages * kAStage;
  const int col_tiles = (p.n + kBN - 1) / kBN;
  const int tiles = ((count + kBM - 1) / kBM) * col_tiles;
  const int k_steps_all = (p.k + kBK - 1) / kBK;
  const int split = SplitOf(tiles, k_steps_all, partials);
  const int k_per = (k_steps_all + split - 1) / split;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / 2, wn = warp % 2;

  for (int t = blockIdx.x; t < tiles * split; t += gridDim.x) {
    const int tile = t % tiles, slice = t / tiles;
    const int ks0 = slice * k_per;
    const int k_steps = min(k_steps_all, ks0 + k_per) - ks0;
    const int row0 = (tile / col_tiles) * kBM, col0 = (tile % col_tiles) * kBN;
    // This thread's two 16-byte pieces of each stage's A (64 rows x 4) and B (32 rows x 8).
    const uint16_t* a_src[2];
    bool a_ok[2];
    int a_dst[2], a_k[2];
    const uint16_t* b_src[2];
    bool b_ok[2];
    int b_dst[2], b_k[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int q = tid + j * kThreads;
      const int r = q >> 2, kc = (q & 3) * 8;
      const int i = row0 + r;
      a_ok[j] = i < count;
      const int64_t arow = kGatherA ? (a_ok[j] ? p.list[i] : 0) : (a_ok[j] ? i : 0);
      a_src[j] = p.a + arow * p.lda + kc;
      a_dst[j] = r * kAStride + kc;
      a_k[j] = kc;
      const int br = q >> 3, nc = (q & 7) * 8;
      b_ok[j] = col0 + nc < p.n;
      b_src[j] = p.b + static_cast<int64_t>(br) * p.ldb + (b_ok[j] ? col0 + nc : 0);
      b_dst[j] = br * kBStride + nc;
      b_k[j] = br;
    }
    auto load_stage = [&](int ks, int stage) {  // ks counts from this slice's first step
      const int k0 = (ks0 + ks) * kBK;
      const uint32_t a_base = SmemAddr(sa + stage * kAStage), b_base = SmemAddr(sb + stage * kBStage);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool ok = a_ok[j] && k0 + a_k[j] < p.k;
        CpAsync16SharedOrZero(a_base + a_dst[j] * 2, ok ? a_src[j] + k0 : p.a, ok ? 16 : 0);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool ok = b_ok[j] && k0 + b_k[j] < p.k;
        CpAsync16SharedOrZero(b_base + b_dst[j] * 2, ok ? b_src[j] + static_cast<int64_t>(k0) * p.ldb : p.b,
                              ok ? 16 : 0);
      }
    };

    float acc[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[mi][ni][v] = 0.f;

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_steps) load_stage(s, s);
      CpAsyncCommit();
    }
    for (int ks = 0; ks < k_steps; ++ks) {
      CpAsyncWait<kStages - 2>();
      __syncthreads();  // stage ks is in; stage ks - 1, which the prefetch below overwrites, is read
      const int next = ks + kStages - 1;
      if (next < k_steps) load_stage(next, next % kStages);
      CpAsyncCommit();
      const uint16_t* A = sa + (ks % kStages) * kAStage;
      const uint16_t* B = sb + (ks % kStages) * kBStage;
#pragma unroll
      for (int kk = 0; kk < kBK; kk += 16) {
        uint32_t af[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
          LdMatrixX4(af[mi], A + (wm * 32 + mi * 16 + (lane & 15)) * kAStride + kk + (lane >> 4) * 8);
        uint32_t bf[4][2];
#pragma unroll
        for (int nj = 0; nj < 2; ++nj) {
          uint32_t r[4];
          LdMatrixX4Trans(r, B + (kk + ((lane >> 3) & 1) * 8 + (lane & 7)) * kBStride + wn * 32 + nj * 16 +
                                 (lane >> 4) * 8);
          bf[2 * nj][0] = r[0];
          bf[2 * nj][1] = r[1];
          bf[2 * nj + 1][0] = r[2];
          bf[2 * nj + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
          for (int ni = 0; ni < 4; ++ni) Mma16816<E>(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
      }
    }
    CpAsyncWait<0>();
    __syncthreads();  // the next tile's prologue overwrites the stages

    // Accumulator (mi, ni): rows lane / 4 and lane / 4 + 8 of its 16, columns 2 (lane % 4) + {0, 1}.
    float* part = split > 1 ? partials + (static_cast<int64_t>(slice) * tiles + tile) * kTileElems : nullptr;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int lr = wm * 32 + mi * 16 + (lane >> 2) + half * 8;
        const int i = row0 + lr;
        if (split == 1 && i >= count) continue;
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int lc = wn * 32 + ni * 8 + (lane & 3) * 2;
          const float v0 = acc[mi][ni][2 * half], v1 = acc[mi][ni][2 * half + 1];
          if (split > 1) {  // the whole tile (rows and columns past the ends hold zeros)
            *reinterpret_cast<float2*>(part + lr * kBN + lc) = make_float2(v0, v1);
          } else if (col0 + lc < p.n) {
            StorePair<E, kEpi>(p, i, col0 + lc, v0, v1);
          }
        }
      }
    }
  }
  return split;
}

// After a split GemmPhase and a grid barrier: each (list position, column pair) of the
// product summed over its `split` slices in slice order, then stored by the epilogue.
template <typename E, int kEpi>
__device__ __forceinline__ void ReducePhase(const GemmArgs& p, int count, const float* partials, int split) {
  const int col_tiles = (p.n + kBN - 1) / kBN;
  const int tiles = ((count + kBM - 1) / kBM) * col_tiles;
  const int pairs = p.n / 2;
  const int64_t total = static_cast<int64_t>(count) * pairs;
  for (int64_t q = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; q < total;
       q += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(q / pairs), col = static_cast<int>(q % pairs) * 2;
    const int tile = (i / kBM) * col_tiles + col / kBN;
    const int64_t offset = static_cast<int64_t>(tile) * kTileElems + (i % kBM) * kBN + col % kBN;
    float v0 = 0.f, v1 = 0.f;
    for (int s = 0; s < split; ++s) {
      const float2 v = __ldcg(reinterpret_cast<const float2*>(partials + static_cast<int64_t>(s) * tiles * kTileElems + offset));
      v0 += v.x;
      v1 += v.y;
    }
    StorePair<E, kEpi>(p, i, col, v0, v1);
  }
}

// A barrier of the whole grid (all CTAs are resident: the launch is cooperative). The
// counter only grows: barrier k (from 1) waits for k arrivals a CTA. Stores before it are
// made visible by the arriving thread's fence; the reads after it go to L2 (cp.async.cg
// and __ldcg) or follow the waiting thread's fence.
__device__ __forceinline__ void GridBarrier(unsigned int* counter, unsigned int k) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    const unsigned int target = k * gridDim.x;
    unsigned int seen;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
      if (seen < target) __nanosleep(64);
    } while (seen < target);
    __threadfence();
  }
  __syncthreads();
}

// The operands of one backup call; null pointers for what the form does not take.
struct BackupOperands {
  const void* x;       // [M, d] (null: non-gated with g given)
  const void* g;       // [M, f] the packed activation (null: recomputed from x and w_act)
  const void* w_act;   // [d, f] the activation's weight, where g is recomputed
  const void* w_up;    // [d, f] (null: non-gated)
  const void* w_down;  // [f, d]
  void* y;             // [M, d]
  void* h;             // [chunk, f] compact scratch (gated, or g recomputed)
  int32_t* list;       // [M + 2]: the rows, then their count, then the barrier's counter
  float* partials;     // [kPartialTiles * kBM * kBN] the split products' f32 partial tiles
  int64_t d, f, chunk;
};

// The backup's products, chunk by chunk of `o.chunk` listed rows (the scratch's rows):
// [the activation recomputed,] [h,] y, with a grid barrier where a product reads what the
// one before wrote, and between chunks (the next one rewrites the scratch).
template <typename E, bool kGated, bool kRecompute>
__global__ __launch_bounds__(kThreads) void BackupKernel(const BackupOperands o, const int32_t* count_in,
                                                         unsigned int* barrier) {
  extern __shared__ __align__(16) uint16_t smem[];
  const int count = *count_in;  // written by the list kernel before this launch
  if (count == 0) return;  // every CTA reads the same count: all return, or none
  unsigned int barriers = 0;
  const auto* x = static_cast<const uint16_t*>(o.x);
  const auto* g = static_cast<const uint16_t*>(o.g);
  auto* h = static_cast<uint16_t*>(o.h);
  const int fi = static_cast<int>(o.f), di = static_cast<int>(o.d);
  constexpr bool kCompact = kGated || kRecompute;  // the down product reads h, else g's own rows
  const int64_t chunk = kCompact ? o.chunk : count;
  for (int64_t c0 = 0; c0 < count; c0 += chunk) {
    if (c0 > 0) GridBarrier(barrier, ++barriers);  // the chunk before has read the scratch
    const int n = static_cast<int>(std::min<int64_t>(chunk, count - c0));
    const int32_t* list = o.list + c0;
    // A split product's partials are reduced after a barrier; the partials scratch is
    // rewritten only by a later product, after the barrier that follows this one's reduction.
    if constexpr (kRecompute) {  // h[i] = bf16(relu(x[r] @ W))
      const GemmArgs act{x, o.d, static_cast<const uint16_t*>(o.w_act), o.f, h, o.f, nullptr, 0, list, fi, di};
      if (const int split = GemmPhase<E, true, kRelu>(act, n, smem, o.partials); split > 1) {
        GridBarrier(barrier, ++barriers);
        ReducePhase<E, kRelu>(act, n, o.partials, split);
      }
      GridBarrier(barrier, ++barriers);
    }
    if constexpr (kGated) {  // h[i] = bf16(g * bf16(x[r] @ Wu)), g = g[r] or (recomputed) h[i], in place
      constexpr int kEpi = kRecompute ? kScaleCompact : kScaleRows;
      const GemmArgs up{x, o.d, static_cast<const uint16_t*>(o.w_up), o.f, h, o.f, kRecompute ? h : g, o.f,
                        list, fi, di};
      if (const int split = GemmPhase<E, true, kEpi>(up, n, smem, o.partials); split > 1) {
        GridBarrier(barrier, ++barriers);
        ReducePhase<E, kEpi>(up, n, o.partials, split);
      }
      GridBarrier(barrier, ++barriers);
    }
    const GemmArgs down{kCompact ? h : g, o.f, static_cast<const uint16_t*>(o.w_down), o.d,
                        static_cast<uint16_t*>(o.y), o.d, nullptr, 0, list, di, fi};
    if (const int split = GemmPhase<E, !kCompact, kStoreRows>(down, n, smem, o.partials); split > 1) {
      GridBarrier(barrier, ++barriers);
      ReducePhase<E, kStoreRows>(down, n, o.partials, split);
    }
  }
}

// The error a runtime call returned (launches through cudaLaunchKernelEx and memsets report
// theirs this way, not only through cudaGetLastError), cleared from the thread's last error.
ffi::Error CallStatus(cudaError_t err, const char* what) {
  cudaGetLastError();
  if (err != cudaSuccess)
    return ffi::Error::Internal(std::string("jax-twell: ") + what + " failed: " + cudaGetErrorString(err));
  return ffi::Error::Success();
}

// How many CTAs of `kernel` the current device holds at once (its SMs times the CTAs an SM
// holds at kThreads threads and kSmemBytes of shared memory), cached per device: a
// cooperative grid larger than this fails to launch, and its grid barriers need every CTA
// resident. Returns an error where the runtime cannot say.
template <typename Kernel>
ffi::Error ResidentCtas(Kernel kernel, int* resident) {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices] = {};
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) {
    cudaGetLastError();
    return ffi::Error::Internal(std::string("jax-twell: cudaGetDevice failed: ") + cudaGetErrorString(err));
  }
  if (device >= 0 && device < kMaxDevices) {
    if (const int known = cached[device].load(std::memory_order_relaxed); known > 0) {
      *resident = known;
      return ffi::Error::Success();
    }
  }
  int sms = 0, per_sm = 0;
  cudaError_t err = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  if (err == cudaSuccess) err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, kSmemBytes);
  if (err != cudaSuccess || sms < 1 || per_sm < 1) {
    cudaGetLastError();
    return ffi::Error::Internal(std::string("jax-twell: the backup kernel's occupancy is unknown: ") +
                                (err != cudaSuccess ? cudaGetErrorString(err) : "no CTA fits an SM"));
  }
  if (device >= 0 && device < kMaxDevices) cached[device].store(sms * per_sm, std::memory_order_relaxed);
  *resident = sms * per_sm;
  return ffi::Error::Success();
}

template <typename E, bool kGated, bool kRecompute>
ffi::Error LaunchBackup(cudaStream_t stream, int64_t rows, const BackupOperands& o) {
  auto kernel = BackupKernel<E, kGated, kRecompute>;
  int resident = 0;
  if (auto e = ResidentCtas(kernel, &resident); e.failure()) return e;
  // Every CTA must be resident (the barriers); no more than the largest product's tiles.
  const int64_t most_rows = (kGated || kRecompute) ? std::min(rows, o.chunk) : rows;
  const int64_t max_tiles = CeilDiv(most_rows, kBM) * CeilDiv(std::max(o.d, o.f), kBN);
  // (times kMaxSplit: a product of few tiles splits its K loop over more CTAs)
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_tiles * kMaxSplit, int64_t{resident})));
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  cudaLaunchAttribute cooperative = {};
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  config.attrs = &cooperative;
  config.numAttrs = 1;
  const int32_t* count = o.list + rows;
  auto* barrier = reinterpret_cast<unsigned int*>(o.list + rows + 1);
  return CallStatus(cudaLaunchKernelEx(&config, kernel, o, count, barrier), "cooperative launch of BackupKernel");
}

template <typename E>
ffi::Error LaunchTyped(cudaStream_t stream, int64_t rows, int n_tiles, int capacity, int max_entries,
                       const int32_t* counts, const BackupOperands& o) {
  int32_t* count = o.list + rows;  // then the barrier's counter
  // An error left by an earlier launch on this thread is reported, not cleared unseen.
  if (cudaError_t earlier = cudaPeekAtLastError(); earlier != cudaSuccess)
    return CallStatus(earlier, "a launch before the backup");
  if (auto e = CallStatus(cudaMemsetAsync(count, 0, 2 * sizeof(int32_t), stream), "backup memset"); e.failure())
    return e;
  BackupListKernel<<<static_cast<unsigned>(CeilDiv(rows, kListWarps)), kListWarps * 32, 0, stream>>>(
      rows, n_tiles, capacity, max_entries, counts, o.list, count);
  if (auto e = LaunchStatus("BackupListKernel"); e.failure()) return e;
  const bool gated = o.w_up != nullptr, recompute = o.g == nullptr;
  if (gated && recompute) return LaunchBackup<E, true, true>(stream, rows, o);
  if (gated) return LaunchBackup<E, true, false>(stream, rows, o);
  if (recompute) return LaunchBackup<E, false, true>(stream, rows, o);
  return LaunchBackup<E, false, false>(stream, rows, o);
}

// Dimension codes of Operand::dims: -1 = M, -2 = d, -3 = f.
constexpr int64_t kM = -1, kD = -2, kF = -3;

// Checks the shapes and dtypes of one backup call and launches it: M from counts, f and d
// from w_down; `operands` lists (name, buffer, expected dims) of the others the form takes.
struct Operand {
  const char* name;
  const ffi::AnyBuffer* buffer;
  int64_t dims[2];  // codes kM, kD, kF below
};

ffi::Error BackupCall(const char* op, cudaStream_t stream, std::initializer_list<Operand> operands,
                      ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                      ffi::Result<ffi::AnyBuffer> y, ffi::AnyBuffer::Dimensions h_dims, ffi::DataType h_type,
                      ffi::Result<ffi::Buffer<ffi::S32>> list, ffi::Result<ffi::Buffer<ffi::F32>> partials,
                      int32_t capacity, int32_t max_entries, BackupOperands o) {
  auto c_dims = counts.dimensions();
  auto wd_dims = w_down.dimensions();
  if (c_dims.size() != 2 || wd_dims.size() != 2)
    return Invalid(std::string(op) + ": counts must have shape [M, n_tiles] and w_down [f, d]");
  const int64_t rows = c_dims[0], f = wd_dims[0], d = wd_dims[1];
  const auto dtype = w_down.element_type();
  for (const Operand& a : operands) {
    auto size = [&](int64_t code) { return code == -1 ? rows : code == -2 ? d : f; };
    auto got = a.buffer->dimensions();
    const bool same = got.size() == 2 && got[0] == size(a.dims[0]) && got[1] == size(a.dims[1]);
    if (!same) return Invalid(std::string(op) + ": " + a.name + " has the wrong shape (M, d, f from counts and w_down)");
    if (a.buffer->element_type() != dtype) return Invalid(std::string(op) + ": " + a.name + " must have w_down's dtype");
  }
  if (!SameDims(y_in.dimensions(), {rows, d}) || !SameDims(y->dimensions(), {rows, d}) ||
      y->element_type() != dtype || y_in.element_type() != dtype)
    return Invalid(std::string(op) + ": y must have shape [M, d] and w_down's dtype");
  int64_t chunk = rows;
  if (o.h != nullptr) {
    if (h_dims.size() != 2 || h_dims[0] < 1 || h_dims[0] > std::max<int64_t>(rows, 1) || h_dims[1] != f ||
        h_type != dtype)
      return Invalid(std::string(op) + ": h must have shape [chunk, f] (1 <= chunk <= M) and w_down's dtype");
    chunk = h_dims[0];
  }
  if (!SameDims(list->dimensions(), {rows + 2})) return Invalid(std::string(op) + ": list must have shape [M + 2]");
  if (!SameDims(partials->dimensions(), {int64_t{kPartialTiles} * kTileElems}))
    return Invalid(std::string(op) + ": partials must have shape [" + std::to_string(kPartialTiles * kTileElems) + "]");
  if (d % 8 != 0 || f % 8 != 0) return Invalid(std::string(op) + ": d and f must be multiples of 8");
  // Below 2^30, so that the tile counts' rounding-up sums stay in int.
  if (rows >= (int64_t{1} << 30) || f >= (int64_t{1} << 30) || d >= (int64_t{1} << 30))
    return Invalid(std::string(op) + ": M, d and f must be below 2^30");
  if (capacity < 0 || max_entries < 0) return Invalid(std::string(op) + ": capacity and max_entries must be >= 0");
  if (y->untyped_data() != y_in.untyped_data())
    return Invalid(std::string(op) + ": y must alias y_in (input_output_aliases)");
  if (rows == 0) return ffi::Error::Success();
  o.w_down = w_down.untyped_data();
  o.y = y->untyped_data();
  o.list = list->typed_data();
  o.partials = partials->typed_data();
  o.d = d;
  o.f = f;
  o.chunk = chunk;
  const int n_tiles = static_cast<int>(c_dims[1]);
  switch (dtype) {
    case ffi::DataType::BF16:
      return LaunchTyped<Bf16>(stream, rows, n_tiles, capacity, max_entries, counts.typed_data(), o);
    case ffi::DataType::F16:
      return LaunchTyped<F16>(stream, rows, n_tiles, capacity, max_entries, counts.typed_data(), o);
    default:
      return Invalid(std::string(op) + ": the operands must be bf16 or f16");
  }
}

// Results, every form: y [M, d] (y_in, aliased, with the backed-up rows written), list
// [M + 2] s32 (the backed-up rows, then their count, then the grid barrier's counter),
// partials [kPartialTiles * 64 * 64] f32 (scratch of the split products);
// gated or recomputing forms: h [chunk, f] (scratch, 1 <= chunk <= M). Attributes: capacity (TwELL slots a tile) and max_entries (the warp kernel's
// row budget): the warp kernel's rule, applied to the TwELL counts [M, n_tiles] s32.

// Gated, g given: x [M, d], g [M, f], counts, w_up [d, f], w_down [f, d], y_in [M, d].
ffi::Error BackupGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> counts,
                       ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::Buffer<ffi::S32>> list,
                       ffi::Result<ffi::Buffer<ffi::F32>> partials, int32_t capacity, int32_t max_entries) {
  BackupOperands o{x.untyped_data(), g.untyped_data(), nullptr, w_up.untyped_data(), nullptr, nullptr,
                   h->untyped_data(), nullptr, nullptr, 0, 0, 0};
  return BackupCall("ffn_backup (gated)", stream, {{"x", &x, {kM, kD}}, {"g", &g, {kM, kF}}, {"w_up", &w_up, {kD, kF}}},
                    counts, w_down, y_in, y, h->dimensions(), h->element_type(), list, partials, capacity, max_entries, o);
}

// Non-gated, g given (the activation): g [M, f], counts, w_down [f, d], y_in [M, d].
ffi::Error BackupUngated(cudaStream_t stream, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_down,
                         ffi::AnyBuffer y_in, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> list,
                         ffi::Result<ffi::Buffer<ffi::F32>> partials, int32_t capacity, int32_t max_entries) {
  BackupOperands o{nullptr, g.untyped_data(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, 0, 0, 0};
  return BackupCall("ffn_backup", stream, {{"g", &g, {kM, kF}}}, counts, w_down, y_in, y, {}, ffi::DataType::BF16,
                    list, partials, capacity, max_entries, o);
}

// Gated, the gate recomputed for the listed rows (no g: it was packed in its matmul's
// epilogue): x [M, d], counts, w_gate [d, f], w_up [d, f], w_down [f, d], y_in [M, d].
ffi::Error BackupGatedFromX(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> counts,
                            ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                            ffi::Result<ffi::Buffer<ffi::S32>> list, ffi::Result<ffi::Buffer<ffi::F32>> partials,
                            int32_t capacity, int32_t max_entries) {
  BackupOperands o{x.untyped_data(), nullptr, w_gate.untyped_data(), w_up.untyped_data(), nullptr, nullptr,
                   h->untyped_data(), nullptr, nullptr, 0, 0, 0};
  return BackupCall("ffn_backup (gated, from x)", stream,
                    {{"x", &x, {kM, kD}}, {"w_gate", &w_gate, {kD, kF}}, {"w_up", &w_up, {kD, kF}}}, counts, w_down,
                    y_in, y, h->dimensions(), h->element_type(), list, partials, capacity, max_entries, o);
}

// Non-gated, the activation recomputed for the listed rows: x [M, d], counts, w_act [d, f],
// w_down [f, d], y_in [M, d].
ffi::Error BackupUngatedFromX(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> counts,
                              ffi::AnyBuffer w_act, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                              ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                              ffi::Result<ffi::Buffer<ffi::S32>> list, ffi::Result<ffi::Buffer<ffi::F32>> partials,
                              int32_t capacity, int32_t max_entries) {
  BackupOperands o{x.untyped_data(), nullptr, w_act.untyped_data(), nullptr, nullptr, nullptr, h->untyped_data(),
                   nullptr, nullptr, 0, 0, 0};
  return BackupCall("ffn_backup (from x)", stream, {{"x", &x, {kM, kD}}, {"w_act", &w_act, {kD, kF}}}, counts, w_down,
                    y_in, y, h->dimensions(), h->element_type(), list, partials, capacity, max_entries, o);
}

}  // namespace
}  // namespace jax_twell

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackupGated, jax_twell::BackupGated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // g [M, f]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // h [chunk, f] (scratch)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 2]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // partials (scratch)
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackup, jax_twell::BackupUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // a [M, f] (the activation)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 2]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // partials (scratch)
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackupGatedFromX, jax_twell::BackupGatedFromX,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_gate [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // h [chunk, f] (scratch)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 2]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // partials (scratch)
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackupFromX, jax_twell::BackupUngatedFromX,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_act [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // h [chunk, f] (scratch)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 2]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // partials (scratch)
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
