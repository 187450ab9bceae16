// twell_ffn_warp: fused up + down projection from a TwELL gate activation, one warp per
// token row, for the rows whose entries all fit the layout; the other rows are left to a
// dense backup (the op gathers them and runs a tensor-core product over their rows).
//
//   gated:      y[t] = sum_j  bf16(g[t,j] * bf16(x[t] . Wu^T[j])) * Wd[j, :]   (j active in row t)
//   non-gated:  y[t] = sum_j  a[t,j] * Wd[j, :]
//
// Grid: ceil(M / 4) CTAs of 4 warps; warp w of CTA b owns token row 4b + w. No shared
// memory, no block barrier: a warp that finishes leaves at once, so rows of different
// lengths do not wait for each other, and the SM takes as many warps as registers allow.
// One warp:
//   1. reads the row's tile counts (a lane a tile); the row is "backed up" when a tile is
//      past capacity or the row holds more than `max_entries` entries: the warp then
//      writes zeros over y[t] and leaves (the op overwrites the row from its dense backup).
//   2. keeps x[t] in registers: lane l holds elements [8 (32 i + l), +8) of each 256-wide
//      chunk i (16 bytes a lane; the d tail masked);
//   3. for each stored entry (j, g), kBatch entries at a time (independent loads in
//      flight): gated, one warp-wide dot product of x[t] with the contiguous row Wu^T[j]
//      (f32 accumulation, butterfly sum), rounded as the reference rounds u and h; then
//      h * Wd[j, :] added into f32 registers (lane-owned columns, as x);
//   4. writes y[t] once, rounded to the element type. No atomics: deterministic.
// Traffic: per entry a d-row of Wu^T and a d-row of Wd (L2 hits where the weights fit the
// 50 MB L2: d=2048, f=5632 bf16 is 46 MB), plus x and y once per row and 6 bytes per
// stored slot of the layout. Where the weights do not fit L2 the rows come from HBM.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "async_mma.cuh"
#include "common.h"
#include "elements.cuh"

namespace jax_twell {
namespace {

constexpr int kWarpsPerCta = 4;
constexpr int kLanes = 32;
constexpr int kV = 8;                  // 2-byte elements per 16-byte lane access
constexpr int kChunk = kLanes * kV;    // 256 elements of d per warp-wide access
constexpr int kMaxChunks = 8;          // d <= 2048 (registers: x and the accumulators)

struct Shapes {
  int64_t rows;
  int d, n_tiles, tile, capacity, max_entries;
};

// Sixteen bytes of 2-byte elements from read-only global memory; the compiler may reorder
// these (no volatile), so several rows' loads are in flight together.
__device__ __forceinline__ uint4 LoadRow16(const void* p) {
  return __ldg(reinterpret_cast<const uint4*>(p));
}

template <typename E>
__device__ __forceinline__ float Dot8(const uint4& a, const uint4& b, float acc) {
  const uint16_t* pa = reinterpret_cast<const uint16_t*>(&a);
  const uint16_t* pb = reinterpret_cast<const uint16_t*>(&b);
#pragma unroll
  for (int i = 0; i < kV; ++i) acc = fmaf(E::ToFloat(pa[i]), E::ToFloat(pb[i]), acc);
  return acc;
}

template <typename E>
__device__ __forceinline__ void Axpy8(float h, const uint4& w, float* acc) {
  const uint16_t* pw = reinterpret_cast<const uint16_t*>(&w);
#pragma unroll
  for (int i = 0; i < kV; ++i) acc[i] = fmaf(h, E::ToFloat(pw[i]), acc[i]);
}

// kChunks: 256-wide chunks of d a lane walks (d <= 256 kChunks); kBatch: entries whose
// weight rows are loaded together.
template <typename E, bool kGated, int kChunks, int kBatch>
__global__ __launch_bounds__(kWarpsPerCta * kLanes) void TwellWarpFfnKernel(
    const Shapes s, const uint16_t* __restrict__ x, const uint16_t* __restrict__ values,
    const int16_t* __restrict__ cols, const int32_t* __restrict__ counts,
    const uint16_t* __restrict__ w_up_t,  // [f, d] (gated)
    const uint16_t* __restrict__ w_down,  // [f, d]
    uint16_t* __restrict__ y) {
  const int lane = threadIdx.x % kLanes;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerCta + threadIdx.x / kLanes;
  if (row >= s.rows) return;
  const int d = s.d;
  const int32_t* row_counts = counts + row * s.n_tiles;

  // 1. Does the row fit? (the op's backup takes it otherwise; the same rule on both sides)
  int total = 0;
  bool over = false;
  for (int k = lane; k < s.n_tiles; k += kLanes) {
    const int c = row_counts[k];
    total += c;
    over |= c > s.capacity;
  }
  total = __reduce_add_sync(kFullMask, total);
  over = __any_sync(kFullMask, over);
  uint16_t* y_row = y + row * d;
  if (over || total > s.max_entries) {
    for (int c = lane * kV; c < d; c += kChunk) *reinterpret_cast<uint4*>(y_row + c) = make_uint4(0, 0, 0, 0);
    return;
  }

  // 2. x[t] in registers (lane-owned 16-byte pieces of each chunk; tail masked to zero).
  uint4 xr[kChunks];
  float acc[kChunks][kV];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = i * kChunk + lane * kV;
    xr[i] = (kGated && c < d) ? LoadRow16(x + row * d + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int v = 0; v < kV; ++v) acc[i][v] = 0.f;
  }

  // 3. The row's entries, tile by tile; a lane holds one stored slot of the tile.
  const int64_t slot_row = row * s.n_tiles;
  for (int k = 0; k < s.n_tiles; ++k) {
    const int count = row_counts[k];  // <= capacity here
    for (int base = 0; base < count; base += kLanes) {
      const int n = min(kLanes, count - base);
      const int64_t slot = (slot_row + k) * s.capacity + base + lane;
      uint32_t my_g = 0;
      int my_col = 0;
      if (lane < n) {
        my_g = values[slot];
        my_col = k * s.tile + cols[slot];
      }
      for (int e = 0; e < n; e += kBatch) {
        int j[kBatch];
        float g[kBatch];
#pragma unroll
        for (int b = 0; b < kBatch; ++b) {
          const int src = min(e + b, n - 1);  // a repeated entry past n gets h = 0 below
          j[b] = __shfl_sync(kFullMask, my_col, src);
          g[b] = e + b < n ? E::ToFloat(__shfl_sync(kFullMask, my_g, src)) : 0.f;
        }
        float h[kBatch];
        if constexpr (kGated) {
          uint4 wu[kBatch][kChunks];
#pragma unroll
          for (int b = 0; b < kBatch; ++b)
#pragma unroll
            for (int i = 0; i < kChunks; ++i) {
              const int c = i * kChunk + lane * kV;
              wu[b][i] = c < d ? LoadRow16(w_up_t + static_cast<int64_t>(j[b]) * d + c) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
          for (int b = 0; b < kBatch; ++b) {
            float p = 0.f;
#pragma unroll
            for (int i = 0; i < kChunks; ++i) p = Dot8<E>(xr[i], wu[b][i], p);
            h[b] = p;
          }
#pragma unroll
          for (int o = 16; o > 0; o >>= 1)
#pragma unroll
            for (int b = 0; b < kBatch; ++b) h[b] += __shfl_xor_sync(kFullMask, h[b], o);
#pragma unroll
          for (int b = 0; b < kBatch; ++b) h[b] = Round<E>(g[b] * Round<E>(h[b]));
        } else {
#pragma unroll
          for (int b = 0; b < kBatch; ++b) h[b] = g[b];
        }
        uint4 wd[kBatch][kChunks];
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
#pragma unroll
          for (int i = 0; i < kChunks; ++i) {
            const int c = i * kChunk + lane * kV;
            wd[b][i] = c < d ? LoadRow16(w_down + static_cast<int64_t>(j[b]) * d + c) : make_uint4(0, 0, 0, 0);
          }
#pragma unroll
        for (int b = 0; b < kBatch; ++b)
#pragma unroll
          for (int i = 0; i < kChunks; ++i) Axpy8<E>(h[b], wd[b][i], acc[i]);
      }
    }
  }

  // 4. y[t], rounded once.
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = i * kChunk + lane * kV;
    if (c < d) {
      uint4 out;
      uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
      for (int v = 0; v < kV / 2; ++v) o[v] = E::FromFloat(acc[i][2 * v]) | (E::FromFloat(acc[i][2 * v + 1]) << 16);
      *reinterpret_cast<uint4*>(y_row + c) = out;
    }
  }
}

// The pipelined form: the same rows and rounding, with each entry's two weight rows
// copied into the warp's own shared-memory stages by cp.async kStages - 1 entries ahead,
// so the loads in flight no longer take registers (which bound the plain form's warps per
// SM, and so its bytes in flight) and the copies overlap the arithmetic of the entries
// before them. A lane copies and reads only its own 16-byte pieces: no barrier at all.
// The row's entries are first listed in shared memory (at most max_entries <= kMaxList).
constexpr int kMaxList = 128;

template <int kChunks, int kStages>
struct PipeSmem {
  static constexpr int kStageBytes = 2 * kChunks * kChunk * 2;  // Wu^T row and Wd row
  static constexpr int kListBytes = kMaxList * 8;
  static constexpr int kBytes = kStages * kStageBytes + kListBytes;
};

// kFloatX: x[t] kept as floats (twice the registers, one conversion less an element of
// each dot product); kMinWarps: the register cap's target of warps per SM (1: none).
template <typename E, bool kGated, int kChunks, int kStages, bool kFloatX, int kMinWarps>
__global__ __launch_bounds__(kLanes, kMinWarps) void TwellWarpFfnPipedKernel(
    const Shapes s, const uint16_t* __restrict__ x, const uint16_t* __restrict__ values,
    const int16_t* __restrict__ cols, const int32_t* __restrict__ counts,
    const uint16_t* __restrict__ w_up_t, const uint16_t* __restrict__ w_down, uint16_t* __restrict__ y) {
  using Smem = PipeSmem<kChunks, kStages>;
  extern __shared__ __align__(16) uint8_t smem[];
  int* list_col = reinterpret_cast<int*>(smem + kStages * Smem::kStageBytes);
  uint32_t* list_g = reinterpret_cast<uint32_t*>(list_col + kMaxList);
  const int lane = threadIdx.x;
  const int64_t row = blockIdx.x;
  const int d = s.d;
  const int32_t* row_counts = counts + row * s.n_tiles;
  uint16_t* y_row = y + row * d;

  // 1. The fit check, and the row's entries listed in shared memory (tile order).
  int total = 0;
  bool over = false;
  for (int k = lane; k < s.n_tiles; k += kLanes) {
    const int c = row_counts[k];
    total += c;
    over |= c > s.capacity;
  }
  total = __reduce_add_sync(kFullMask, total);
  over = __any_sync(kFullMask, over);
  if (over || total > s.max_entries) {
    for (int c = lane * kV; c < d; c += kChunk) *reinterpret_cast<uint4*>(y_row + c) = make_uint4(0, 0, 0, 0);
    return;
  }
  const int64_t slot_row = row * s.n_tiles;
  int base = 0;
  for (int k0 = 0; k0 < s.n_tiles; k0 += kLanes) {
    const int k = k0 + lane;
    const int c = k < s.n_tiles ? row_counts[k] : 0;
    const int incl = WarpInclusiveSum(c, lane);
    const int start = base + incl - c;
    // A lane walks its own tile's entries: the tiles' loads are independent.
    for (int i = 0; i < c; ++i) {
      const int64_t slot = (slot_row + k) * s.capacity + i;
      list_col[start + i] = k * s.tile + cols[slot];
      list_g[start + i] = values[slot];
    }
    base += __shfl_sync(kFullMask, incl, kLanes - 1);
  }
  __syncwarp();
  const int n = base;

  uint4 xr[kFloatX ? 1 : kChunks];
  float xf[kFloatX ? kChunks : 1][kV];
  float acc[kChunks][kV];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = i * kChunk + lane * kV;
    const uint4 xi = (kGated && c < d) ? LoadRow16(x + row * d + c) : make_uint4(0, 0, 0, 0);
    if constexpr (kFloatX) {
      const uint16_t* b = reinterpret_cast<const uint16_t*>(&xi);
#pragma unroll
      for (int v = 0; v < kV; ++v) xf[i][v] = E::ToFloat(b[v]);
    } else {
      xr[i] = xi;
    }
#pragma unroll
    for (int v = 0; v < kV; ++v) acc[i][v] = 0.f;
  }
  const uint32_t stage0 = SmemAddr(smem);
  auto prefetch = [&](int e) {
    if (e < n) {
      const int64_t j = list_col[e];
      const uint32_t st = stage0 + (e % kStages) * Smem::kStageBytes;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int c = i * kChunk + lane * kV;
        if (c < d) {
          if (kGated) CpAsync16Shared(st + c * 2, w_up_t + j * d + c);
          CpAsync16Shared(st + (kChunks * kChunk + c) * 2, w_down + j * d + c);
        }
      }
    }
    CpAsyncCommit();  // an empty group past the end keeps the count of pending groups fixed
  };
#pragma unroll
  for (int e = 0; e < kStages - 1; ++e) prefetch(e);
  for (int e = 0; e < n; ++e) {
    prefetch(e + kStages - 1);
    CpAsyncWaitPending<kStages - 1>();
    const uint8_t* st = smem + (e % kStages) * Smem::kStageBytes;
    float h = E::ToFloat(list_g[e]);
    if constexpr (kGated) {
      float p = 0.f;
#pragma unroll
      for (int i = 0; i < kChunks; ++i) {
        const int c = i * kChunk + lane * kV;
        if (c < d) {
          const uint4 w = *reinterpret_cast<const uint4*>(st + c * 2);
          if constexpr (kFloatX) {
            const uint16_t* pw = reinterpret_cast<const uint16_t*>(&w);
#pragma unroll
            for (int v = 0; v < kV; ++v) p = fmaf(xf[i][v], E::ToFloat(pw[v]), p);
          } else {
            p = Dot8<E>(xr[i], w, p);
          }
        }
      }
      p = WarpSum(p);
      h = Round<E>(h * Round<E>(p));
    }
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = i * kChunk + lane * kV;
      if (c < d) Axpy8<E>(h, *reinterpret_cast<const uint4*>(st + (kChunks * kChunk + c) * 2), acc[i]);
    }
  }
  CpAsyncWaitAll();

#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = i * kChunk + lane * kV;
    if (c < d) {
      uint4 out;
      uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
      for (int v = 0; v < kV / 2; ++v) o[v] = E::FromFloat(acc[i][2 * v]) | (E::FromFloat(acc[i][2 * v + 1]) << 16);
      *reinterpret_cast<uint4*>(y_row + c) = out;
    }
  }
}

// The split form: two warps a row, each owning half of d's chunks (x, y's accumulators
// and its half of every weight row), so each warp holds half the registers and the SM
// twice the warps for the same rows. The up product's two partial sums meet in shared
// memory behind one 64-thread barrier an entry (double-buffered slots); both warps add
// them in the same order, so both round u and h alike.
template <int kChunks, int kStages>
struct SplitSmem {
  static constexpr int kHalf = kChunks / 2;
  static constexpr int kWarpStageBytes = 2 * kHalf * kChunk * 2;  // a half row of Wu^T and of Wd
  static constexpr int kStageBytes = 2 * kWarpStageBytes;
  static constexpr int kBytes = kStages * kStageBytes + kMaxList * 8 + 2 * 2 * 4;
};

template <typename E, bool kGated, int kChunks, int kStages>
__global__ __launch_bounds__(2 * kLanes) void TwellWarpFfnSplitKernel(
    const Shapes s, const uint16_t* __restrict__ x, const uint16_t* __restrict__ values,
    const int16_t* __restrict__ cols, const int32_t* __restrict__ counts,
    const uint16_t* __restrict__ w_up_t, const uint16_t* __restrict__ w_down, uint16_t* __restrict__ y) {
  using Smem = SplitSmem<kChunks, kStages>;
  constexpr int kHalf = Smem::kHalf;
  extern __shared__ __align__(16) uint8_t smem[];
  int* list_col = reinterpret_cast<int*>(smem + kStages * Smem::kStageBytes);
  uint32_t* list_g = reinterpret_cast<uint32_t*>(list_col + kMaxList);
  float* partial = reinterpret_cast<float*>(list_g + kMaxList);  // [2 slots][2 warps]
  const int lane = threadIdx.x % kLanes;
  const int half = threadIdx.x / kLanes;
  const int64_t row = blockIdx.x;
  const int d = s.d;
  const int32_t* row_counts = counts + row * s.n_tiles;
  uint16_t* y_row = y + row * d;

  int total = 0;
  bool over = false;
  for (int k = lane; k < s.n_tiles; k += kLanes) {
    const int c = row_counts[k];
    total += c;
    over |= c > s.capacity;
  }
  total = __reduce_add_sync(kFullMask, total);
  over = __any_sync(kFullMask, over);
  if (over || total > s.max_entries) {  // both warps take the same exit
    for (int c = threadIdx.x * kV; c < d; c += 2 * kChunk) *reinterpret_cast<uint4*>(y_row + c) = make_uint4(0, 0, 0, 0);
    return;
  }
  if (half == 0) {
    const int64_t slot_row = row * s.n_tiles;
    int base = 0;
    for (int k0 = 0; k0 < s.n_tiles; k0 += kLanes) {
      const int k = k0 + lane;
      const int c = k < s.n_tiles ? row_counts[k] : 0;
      const int incl = WarpInclusiveSum(c, lane);
      const int start = base + incl - c;
      for (int i = 0; i < c; ++i) {
        const int64_t slot = (slot_row + k) * s.capacity + i;
        list_col[start + i] = k * s.tile + cols[slot];
        list_g[start + i] = values[slot];
      }
      base += __shfl_sync(kFullMask, incl, kLanes - 1);
    }
  }
  __syncthreads();
  const int n = total;

  // This warp's chunks: i = half * kHalf + ii.
  uint4 xr[kHalf];
  float acc[kHalf][kV];
#pragma unroll
  for (int ii = 0; ii < kHalf; ++ii) {
    const int c = (half * kHalf + ii) * kChunk + lane * kV;
    xr[ii] = (kGated && c < d) ? LoadRow16(x + row * d + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int v = 0; v < kV; ++v) acc[ii][v] = 0.f;
  }
  const uint32_t stage0 = SmemAddr(smem) + half * Smem::kWarpStageBytes;
  auto prefetch = [&](int e) {
    if (e < n) {
      const int64_t j = list_col[e];
      const uint32_t st = stage0 + (e % kStages) * Smem::kStageBytes;
#pragma unroll
      for (int ii = 0; ii < kHalf; ++ii) {
        const int c = (half * kHalf + ii) * kChunk + lane * kV;
        const int o = ii * kChunk + lane * kV;
        if (c < d) {
          if (kGated) CpAsync16Shared(st + o * 2, w_up_t + j * d + c);
          CpAsync16Shared(st + (kHalf * kChunk + o) * 2, w_down + j * d + c);
        }
      }
    }
    CpAsyncCommit();
  };
#pragma unroll
  for (int e = 0; e < kStages - 1; ++e) prefetch(e);
  for (int e = 0; e < n; ++e) {
    prefetch(e + kStages - 1);
    CpAsyncWaitPending<kStages - 1>();
    const uint8_t* st = smem + half * Smem::kWarpStageBytes + (e % kStages) * Smem::kStageBytes;
    float h = E::ToFloat(list_g[e]);
    if constexpr (kGated) {
      float p = 0.f;
#pragma unroll
      for (int ii = 0; ii < kHalf; ++ii) {
        const int c = (half * kHalf + ii) * kChunk + lane * kV;
        if (c < d) p = Dot8<E>(xr[ii], *reinterpret_cast<const uint4*>(st + (ii * kChunk + lane * kV) * 2), p);
      }
      p = WarpSum(p);
      float* slot = partial + (e & 1) * 2;
      if (lane == 0) slot[half] = p;
      __syncthreads();
      h = Round<E>(h * Round<E>(slot[0] + slot[1]));
    }
#pragma unroll
    for (int ii = 0; ii < kHalf; ++ii) {
      const int c = (half * kHalf + ii) * kChunk + lane * kV;
      if (c < d) Axpy8<E>(h, *reinterpret_cast<const uint4*>(st + (kHalf * kChunk + ii * kChunk + lane * kV) * 2), acc[ii]);
    }
  }
  CpAsyncWaitAll();

#pragma unroll
  for (int ii = 0; ii < kHalf; ++ii) {
    const int c = (half * kHalf + ii) * kChunk + lane * kV;
    if (c < d) {
      uint4 out;
      uint32_t* o = reinterpret_cast<uint32_t*>(&out);
#pragma unroll
      for (int v = 0; v < kV / 2; ++v) o[v] = E::FromFloat(acc[ii][2 * v]) | (E::FromFloat(acc[ii][2 * v + 1]) << 16);
      *reinterpret_cast<uint4*>(y_row + c) = out;
    }
  }
}

template <typename E, bool kGated, int kChunks, int kStages>
ffi::Error LaunchSplit(cudaStream_t stream, const Shapes& s, const void* x, const void* values, const int16_t* cols,
                       const int32_t* counts, const void* w_up_t, const void* w_down, void* y) {
  auto kernel = TwellWarpFfnSplitKernel<E, kGated, kChunks, kStages>;
  const int bytes = SplitSmem<kChunks, kStages>::kBytes;
  if (bytes > 48 * 1024 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess)
    return LaunchStatus("TwellWarpFfnSplitKernel (shared memory)");
  kernel<<<static_cast<unsigned>(s.rows), 2 * kLanes, bytes, stream>>>(
      s, static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(values), cols, counts,
      static_cast<const uint16_t*>(w_up_t), static_cast<const uint16_t*>(w_down), static_cast<uint16_t*>(y));
  return LaunchStatus("TwellWarpFfnSplitKernel");
}

template <typename E, bool kGated, int kChunks, int kStages, bool kFloatX = false, int kMinWarps = 1>
ffi::Error LaunchPiped(cudaStream_t stream, const Shapes& s, const void* x, const void* values, const int16_t* cols,
                       const int32_t* counts, const void* w_up_t, const void* w_down, void* y) {
  auto kernel = TwellWarpFfnPipedKernel<E, kGated, kChunks, kStages, kFloatX, kMinWarps>;
  const int bytes = PipeSmem<kChunks, kStages>::kBytes;
  if (bytes > 48 * 1024 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess)
    return LaunchStatus("TwellWarpFfnPipedKernel (shared memory)");
  kernel<<<static_cast<unsigned>(s.rows), kLanes, bytes, stream>>>(
      s, static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(values), cols, counts,
      static_cast<const uint16_t*>(w_up_t), static_cast<const uint16_t*>(w_down), static_cast<uint16_t*>(y));
  return LaunchStatus("TwellWarpFfnPipedKernel");
}

// variant: 0 and 1, the plain form loading 1 or 2 entries' rows at once into registers;
// 2, 3 and 4, the pipelined form with that many shared-memory stages; 5, two stages with x
// kept as floats; 6, two stages under a 128-register cap; 7 and 8, the split form (two
// warps a row) with 2 and 3 stages (the pipelined form where d has one 256-wide chunk).
template <typename E, bool kGated, int kChunks>
ffi::Error LaunchChunks(cudaStream_t stream, const Shapes& s, int variant, const void* x, const void* values,
                        const int16_t* cols, const int32_t* counts, const void* w_up_t, const void* w_down,
                        void* y) {
  switch (variant) {
    case 2: return LaunchPiped<E, kGated, kChunks, 2>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
    case 3: return LaunchPiped<E, kGated, kChunks, 3>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
    case 4: return LaunchPiped<E, kGated, kChunks, 4>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
    case 5: return LaunchPiped<E, kGated, kChunks, 2, true>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
    case 6: return LaunchPiped<E, kGated, kChunks, 2, false, 16>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
    case 7:
      if constexpr (kChunks % 2 == 0)
        return LaunchSplit<E, kGated, kChunks, 2>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
      return LaunchPiped<E, kGated, kChunks, 2>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
    case 8:
      if constexpr (kChunks % 2 == 0)
        return LaunchSplit<E, kGated, kChunks, 3>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
      return LaunchPiped<E, kGated, kChunks, 3>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
    default: break;
  }
  const int64_t ctas = CeilDiv(s.rows, kWarpsPerCta);
  auto args = [&](auto kernel) {
    kernel<<<static_cast<unsigned>(ctas), kWarpsPerCta * kLanes, 0, stream>>>(
        s, static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(values), cols, counts,
        static_cast<const uint16_t*>(w_up_t), static_cast<const uint16_t*>(w_down), static_cast<uint16_t*>(y));
  };
  if (variant == 0)
    args(TwellWarpFfnKernel<E, kGated, kChunks, 1>);
  else
    args(TwellWarpFfnKernel<E, kGated, kChunks, 2>);
  return LaunchStatus("TwellWarpFfnKernel");
}

template <typename E, bool kGated>
ffi::Error LaunchTyped(cudaStream_t stream, const Shapes& s, int variant, const void* x, const void* values,
                       const int16_t* cols, const int32_t* counts, const void* w_up_t, const void* w_down, void* y) {
  const int chunks = static_cast<int>(CeilDiv(s.d, kChunk));
  // Chunk counts rounded up to a few instantiations; the masked chunks load nothing.
  if (chunks <= 1) return LaunchChunks<E, kGated, 1>(stream, s, variant, x, values, cols, counts, w_up_t, w_down, y);
  if (chunks <= 2) return LaunchChunks<E, kGated, 2>(stream, s, variant, x, values, cols, counts, w_up_t, w_down, y);
  if (chunks <= 4) return LaunchChunks<E, kGated, 4>(stream, s, variant, x, values, cols, counts, w_up_t, w_down, y);
  if (chunks <= 6) return LaunchChunks<E, kGated, 6>(stream, s, variant, x, values, cols, counts, w_up_t, w_down, y);
  return LaunchChunks<E, kGated, 8>(stream, s, variant, x, values, cols, counts, w_up_t, w_down, y);
}

// Operands: x [M, d], values [M, n_tiles, capacity], cols (s16, same), counts [M, n_tiles]
// (s32), gated: w_up_t [f, d]; w_down [f, d]; result y [M, d]. Attributes: tile (columns a
// tile), max_entries (a row holding more entries is backed up), variant (LaunchChunks).
template <bool kGated>
ffi::Error TwellWarpFfnImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                            ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_up_t,
                            ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y, int32_t tile,
                            int32_t max_entries, int32_t variant) {
  const char* op = kGated ? "twell_ffn_warp (gated)" : "twell_ffn_warp";
  auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return Invalid(std::string(op) + ": x must have shape [M, d]");
  const int64_t rows = x_dims[0], d = x_dims[1];
  auto v_dims = values.dimensions();
  if (v_dims.size() != 3 || v_dims[0] != rows)
    return Invalid(std::string(op) + ": values must have shape [M, n_tiles, capacity]");
  const int64_t n_tiles = v_dims[1], capacity = v_dims[2];
  if (!SameDims(cols.dimensions(), {rows, n_tiles, capacity}) || !SameDims(counts.dimensions(), {rows, n_tiles}))
    return Invalid(std::string(op) + ": cols must match values' shape and counts be [M, n_tiles]");
  auto wd_dims = w_down.dimensions();
  if (wd_dims.size() != 2 || wd_dims[1] != d) return Invalid(std::string(op) + ": w_down must have shape [f, d]");
  const int64_t f = wd_dims[0];
  if (tile <= 0 || tile % 32 != 0 || tile > 32768 || CeilDiv(f, tile) != n_tiles)
    return Invalid(std::string(op) + ": tile must be a positive multiple of 32 (at most 32768) with "
                   "ceil(f / tile) == n_tiles");
  if (kGated && !SameDims(w_up_t.dimensions(), {f, d}))
    return Invalid(std::string(op) + ": w_up_t must have shape [f, d]");
  if (!SameDims(y->dimensions(), {rows, d})) return Invalid(std::string(op) + ": y must have x's shape");
  const auto dtype = x.element_type();
  if (values.element_type() != dtype || w_down.element_type() != dtype || y->element_type() != dtype ||
      (kGated && w_up_t.element_type() != dtype))
    return Invalid(std::string(op) + ": x, values, weights and y must share one dtype");
  if (d % kV != 0 || d > kMaxChunks * kChunk)
    return Invalid(std::string(op) + ": d must be a multiple of 8 and at most " + std::to_string(kMaxChunks * kChunk) +
                   ", got " + std::to_string(d));
  if (variant < 0 || variant > 8) return Invalid(std::string(op) + ": variant must be in [0, 8]");
  if (variant >= 2 && max_entries > kMaxList)
    return Invalid(std::string(op) + ": max_entries must be at most " + std::to_string(kMaxList) + " (pipelined form)");
  if (max_entries < 0) return Invalid(std::string(op) + ": max_entries must be >= 0");
  if (f > (int64_t{1} << 30) || rows > (int64_t{1} << 40))
    return Invalid(std::string(op) + ": f must be < 2^30");
  if (rows == 0) return ffi::Error::Success();
  const Shapes s{rows, static_cast<int>(d), static_cast<int>(n_tiles), tile, static_cast<int>(capacity), max_entries};
  const void* up_t = kGated ? w_up_t.untyped_data() : nullptr;
  switch (dtype) {
    case ffi::DataType::BF16:
      return LaunchTyped<Bf16, kGated>(stream, s, variant, x.untyped_data(), values.untyped_data(), cols.typed_data(),
                                       counts.typed_data(), up_t, w_down.untyped_data(), y->untyped_data());
    case ffi::DataType::F16:
      return LaunchTyped<F16, kGated>(stream, s, variant, x.untyped_data(), values.untyped_data(), cols.typed_data(),
                                      counts.typed_data(), up_t, w_down.untyped_data(), y->untyped_data());
    default:
      return Invalid(std::string(op) + ": x must be bf16 or f16");
  }
}

ffi::Error TwellWarpFfnGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                             ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_up_t,
                             ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y, int32_t tile,
                             int32_t max_entries, int32_t variant) {
  return TwellWarpFfnImpl<true>(stream, x, values, cols, counts, w_up_t, w_down, y, tile, max_entries, variant);
}

ffi::Error TwellWarpFfnUngated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                               ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_down,
                               ffi::Result<ffi::AnyBuffer> y, int32_t tile, int32_t max_entries, int32_t variant) {
  return TwellWarpFfnImpl<false>(stream, x, values, cols, counts, w_down, w_down, y, tile, max_entries, variant);
}

}  // namespace
}  // namespace jax_twell

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnWarpGated, jax_twell::TwellWarpFfnGated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // values
                                  .Arg<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up_t [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("max_entries")
                                  .Attr<int32_t>("variant"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnWarp, jax_twell::TwellWarpFfnUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // values
                                  .Arg<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("max_entries")
                                  .Attr<int32_t>("variant"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
