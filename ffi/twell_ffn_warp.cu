// twell_ffn_warp: fused up + down projection from a TwELL gate activation, one or two warps
// per token row, for the rows whose entries all fit the layout; the other rows are left to
// a dense backup (the op gathers them and runs a tensor-core product over their rows).
//
//   gated:      y[t] = sum_j  bf16(g[t,j] * bf16(x[t] . Wu^T[j])) * Wd[j, :]   (j active in row t)
//   non-gated:  y[t] = sum_j  a[t,j] * Wd[j, :]
//
// Grid: one CTA per token row, of kSplit warps (2; 1 where d has a single 256-wide chunk);
// warp w owns chunks [w, w + 1) * kChunks / kSplit of d (x, y's f32 accumulators, and its
// part of every weight row). A CTA that finishes leaves at once, so rows of different
// lengths do not wait for each other, and an SM holds as many rows as registers and shared
// memory allow. One CTA:
//   1. reads the row's tile counts (a lane a tile); the row is "backed up" when a tile is
//      past capacity or the row holds more than `max_entries` entries: it then writes zeros
//      over y[t] and leaves (the op overwrites the row from its dense backup);
//   2. lists the row's entries (column, value) in shared memory, in tile order;
//   3. for each entry, the warps copy its Wu^T row and Wd row into their shared-memory stage
//      by cp.async one entry ahead (the loads in flight take no registers and overlap the
//      arithmetic of the entry before; a lane copies and reads only its own 16-byte
//      pieces); gated, each warp's dot product of x[t] with its part of Wu^T[j] (f32,
//      butterfly sum) meets the other warp's in shared memory behind one barrier (double-
//      buffered slots; both add them in the same order), rounded as the reference rounds u
//      and h; then h * Wd[j, :] is added into the accumulators;
//   4. writes y[t] once, rounded to the element type. No atomics: deterministic.
//      Given the weights' finite columns (a [d] u8 mask, `columns`), the row takes the
//      dense formula's NaN where that formula is not finite and the sum is: every element
//      of a row whose x holds a NaN or Inf (one block-wide vote over the x the warps hold),
//      and the masked-off columns. The op's separate pass over y for the same rule is then
//      not needed (the backed-up rows compute the dense formula itself).
// Traffic: per entry a d-row of Wu^T and a d-row of Wd (L2 hits where the weights fit the
// 50 MB L2: d=2048, f=5632 bf16 is 46 MB), plus x and y once per row and 6 bytes per
// stored slot of the layout. Other forms measured (registers only, more stages, one warp a
// row, a register cap): ffi/notes/twell_ffn_warp.md.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <type_traits>

#include "async_mma.cuh"
#include "common.h"
#include "elements.cuh"

namespace jax_twell {
namespace {

constexpr int kLanes = 32;
constexpr int kV = 8;                  // 2-byte elements per 16-byte lane access
constexpr int kChunk = kLanes * kV;    // 256 elements of d per warp-wide access
constexpr int kMaxChunks = 8;          // d <= 2048 (registers: x and the accumulators)

struct Shapes {
  int64_t rows;
  int d, n_tiles, tile, capacity, max_entries;
  const int32_t* skip;  // device flag (the *_unless handlers): set, the kernel does nothing
  const uint8_t* columns;  // [d] the weights' finite columns (nullptr: no NaN rule in the kernel)
};

// The element type's exponent bits and quiet NaN (bf16 or f16 bit patterns).
template <typename E>
struct Special {
  static constexpr uint32_t kExp = std::is_same_v<E, Bf16> ? 0x7F80u : 0x7C00u;
  static constexpr uint32_t kNaN = std::is_same_v<E, Bf16> ? 0x7FC0u : 0x7E00u;
};

// bits with the dense formula's NaN where `poison` holds and bits is finite (a NaN or Inf
// already there is what the dense sum gives too).
template <typename E>
__device__ __forceinline__ uint32_t Poisoned(uint32_t bits, bool poison) {
  return poison && (bits & Special<E>::kExp) != Special<E>::kExp ? Special<E>::kNaN : bits;
}

// Eight bytes of the columns' mask, loaded where it is used: a volatile load the compiler
// does not hoist above the loop over entries (where eight more live registers would cost
// the kernel occupancy).
__device__ __forceinline__ uint2 LoadMask8(const uint8_t* p) {
  uint2 r;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
  return r;
}

template <typename E>
__device__ __forceinline__ bool AnyNonFinite8(const uint4& a) {
  const uint32_t w[4] = {a.x, a.y, a.z, a.w};
  bool bad = false;
#pragma unroll
  for (int i = 0; i < 4; ++i)
    bad |= (w[i] & Special<E>::kExp) == Special<E>::kExp ||
           (w[i] & (Special<E>::kExp << 16)) == (Special<E>::kExp << 16);
  return bad;
}

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

constexpr int kMaxList = 128;  // entries a row may list (max_entries is at most this)
constexpr int kStages = 2;     // shared-memory stages: copies run one entry ahead

template <int kChunks, int kSplit>
struct RowSmem {
  static constexpr int kPart = kChunks / kSplit;                   // chunks a warp owns
  static constexpr int kWarpStageBytes = 2 * kPart * kChunk * 2;   // its part of Wu^T[j] and Wd[j]
  static constexpr int kStageBytes = kSplit * kWarpStageBytes;
  static constexpr int kBytes = kStages * kStageBytes + kMaxList * 8 + 2 * kSplit * 4;
  // The kernel reading g: a list per warp, the partial slots, and the warps' entry counts.
  static constexpr int kBytesFromG = kStages * kStageBytes + 2 * kMaxList * 8 + 2 * kSplit * 4 + kSplit * 4;
};

// Entry e of a row's list: one list (the TwELL kernel), or two (the kernel reading g: the
// first warp's entries at [0, n0), the second's from kMaxList on), in column order either way.
template <bool kTwoLists>
__device__ __forceinline__ int Slot(int e, int n0) {
  if constexpr (kTwoLists) return e < n0 ? e : e - n0 + kMaxList;
  return e;
}

// Steps 3 and 4 of a row that fits, once its n entries are listed (both kernels): every
// thread of the CTA enters (a barrier a gated entry, one vote at the end).
template <typename E, bool kGated, int kChunks, int kSplit, bool kTwoLists>
__device__ __forceinline__ void RowProducts(const Shapes& s, const uint16_t* __restrict__ x,
                                            const uint16_t* __restrict__ w_up_t, const uint16_t* __restrict__ w_down,
                                            uint16_t* __restrict__ y_row, int64_t row, uint8_t* smem,
                                            const int* list_col, const uint32_t* list_g, float* partial, int n0,
                                            int n) {
  using Smem = RowSmem<kChunks, kSplit>;
  constexpr int kPart = Smem::kPart;
  const int lane = threadIdx.x % kLanes;
  const int part = threadIdx.x / kLanes;
  const int d = s.d;
  // 3. This warp's chunks: i = part * kPart + ii.
  uint4 xr[kPart];
  float acc[kPart][kV];
#pragma unroll
  for (int ii = 0; ii < kPart; ++ii) {
    const int c = (part * kPart + ii) * kChunk + lane * kV;
    xr[ii] = (kGated && c < d) ? LoadRow16(x + row * d + c) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int v = 0; v < kV; ++v) acc[ii][v] = 0.f;
  }
  const uint32_t stage0 = SmemAddr(smem) + part * Smem::kWarpStageBytes;
  auto prefetch = [&](int e) {
    if (e < n) {
      const int64_t j = list_col[Slot<kTwoLists>(e, n0)];
      const uint32_t st = stage0 + (e % kStages) * Smem::kStageBytes;
#pragma unroll
      for (int ii = 0; ii < kPart; ++ii) {
        const int c = (part * kPart + ii) * kChunk + lane * kV;
        const int o = ii * kChunk + lane * kV;
        if (c < d) {
          if (kGated) CpAsync16Shared(st + o * 2, w_up_t + j * d + c);
          CpAsync16Shared(st + (kPart * kChunk + o) * 2, w_down + j * d + c);
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
    const uint8_t* st = smem + part * Smem::kWarpStageBytes + (e % kStages) * Smem::kStageBytes;
    float h = E::ToFloat(list_g[Slot<kTwoLists>(e, n0)]);
    if constexpr (kGated) {
      float p = 0.f;
#pragma unroll
      for (int ii = 0; ii < kPart; ++ii) {
        const int c = (part * kPart + ii) * kChunk + lane * kV;
        if (c < d) p = Dot8<E>(xr[ii], *reinterpret_cast<const uint4*>(st + (ii * kChunk + lane * kV) * 2), p);
      }
      p = WarpSum(p);
      if constexpr (kSplit > 1) {
        float* slot = partial + (e & 1) * kSplit;
        if (lane == 0) slot[part] = p;
        __syncthreads();
        p = slot[0];
#pragma unroll
        for (int w = 1; w < kSplit; ++w) p += slot[w];
      }
      h = Round<E>(h * Round<E>(p));
    }
#pragma unroll
    for (int ii = 0; ii < kPart; ++ii) {
      const int c = (part * kPart + ii) * kChunk + lane * kV;
      if (c < d) Axpy8<E>(h, *reinterpret_cast<const uint4*>(st + (kPart * kChunk + ii * kChunk + lane * kV) * 2), acc[ii]);
    }
  }
  CpAsyncWaitAll();

  // 4. y[t], rounded once. With the finite columns given, first a CTA-wide vote on x[t]
  // (every thread of the CTA reaches it: no exit since step 2's barrier), from the x the
  // gated kernel holds or, non-gated, loaded here (nothing kept live across step 3).
  const bool check = s.columns != nullptr;  // uniform over the grid
  bool row_bad = false;
  if (check) {
    bool bad = false;
#pragma unroll
    for (int ii = 0; ii < kPart; ++ii) {
      const int c = (part * kPart + ii) * kChunk + lane * kV;
      if (c < d) bad |= AnyNonFinite8<E>(kGated ? xr[ii] : LoadRow16(x + row * d + c));
    }
    row_bad = __syncthreads_or(bad);
  }
#pragma unroll
  for (int ii = 0; ii < kPart; ++ii) {
    const int c = (part * kPart + ii) * kChunk + lane * kV;
    if (c < d) {
      uint4 out;
      uint32_t* o = reinterpret_cast<uint32_t*>(&out);
      // 8 columns' finite flags, one byte each (all set where no columns are given)
      const uint2 mask = check ? LoadMask8(s.columns + c) : make_uint2(~0u, ~0u);
      const uint8_t* ok = reinterpret_cast<const uint8_t*>(&mask);
#pragma unroll
      for (int v = 0; v < kV / 2; ++v)
        o[v] = Poisoned<E>(E::FromFloat(acc[ii][2 * v]), row_bad || ok[2 * v] == 0) |
               (Poisoned<E>(E::FromFloat(acc[ii][2 * v + 1]), row_bad || ok[2 * v + 1] == 0) << 16);
      *reinterpret_cast<uint4*>(y_row + c) = out;
    }
  }
}

template <typename E, bool kGated, int kChunks, int kSplit>
__global__ __launch_bounds__(kSplit * kLanes) void TwellWarpFfnKernel(
    const Shapes s, const uint16_t* __restrict__ x, const uint16_t* __restrict__ values,
    const int16_t* __restrict__ cols, const int32_t* __restrict__ counts,
    const uint16_t* __restrict__ w_up_t, const uint16_t* __restrict__ w_down, uint16_t* __restrict__ y) {
  using Smem = RowSmem<kChunks, kSplit>;
  static_assert(kChunks % kSplit == 0, "the warps share d's chunks evenly");
  extern __shared__ __align__(16) uint8_t smem[];
  int* list_col = reinterpret_cast<int*>(smem + kStages * Smem::kStageBytes);
  uint32_t* list_g = reinterpret_cast<uint32_t*>(list_col + kMaxList);
  float* partial = reinterpret_cast<float*>(list_g + kMaxList);  // [2 slots][kSplit warps]
  const int lane = threadIdx.x % kLanes;
  const int part = threadIdx.x / kLanes;
  const int64_t row = blockIdx.x;
  const int d = s.d;
  if (s.skip != nullptr && *s.skip != 0) return;  // the call runs dense (y is written by its backup)
  const int32_t* row_counts = counts + row * s.n_tiles;
  uint16_t* y_row = y + row * d;

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
  if (over || total > s.max_entries) {  // every warp takes the same exit
    for (int c = threadIdx.x * kV; c < d; c += kSplit * kChunk)
      *reinterpret_cast<uint4*>(y_row + c) = make_uint4(0, 0, 0, 0);
    return;
  }
  // 2. The entries, listed by warp 0 (a lane walks its own tile: the tiles' loads are independent).
  if (part == 0) {
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
  RowProducts<E, kGated, kChunks, kSplit, false>(s, x, w_up_t, w_down, y_row, row, smem, list_col, list_g, partial,
                                                 total, total);
}


// The same row, listed from the dense activation g [M, f] (XLA's gate matmul output) instead
// of a TwELL layout: no pack kernel, no tile capacity. Warp w scans its share of g[t]'s
// 16-byte pieces (f / 8 of them, split evenly over the warps) with streaming loads (used
// once: evict first, so they displace few weight rows in L2), lists its non-zeros (the
// pack's test: any bit but the sign set, so NaN counts and -0 does not) in its own list,
// and counts them. The row is backed up when it holds more than max_entries entries; its
// count goes to counts[t] either way (the backup applies the same rule to it).
constexpr int kScanBatch = 4;  // 16-byte pieces a lane loads before it lists any

// Compiled for nine CTAs an SM (77 registers for bf16, gated, d = 2,048, no spills; 126
// and eight CTAs without the bound); the launch then holds it to kFromGCtasPerSm by its
// shared memory (below).
template <typename E, bool kGated, int kChunks, int kSplit>
__global__ __launch_bounds__(kSplit * kLanes, 9) void TwellWarpFfnFromGKernel(
    const Shapes s, int f, const uint16_t* __restrict__ x, const uint16_t* __restrict__ g,
    const uint16_t* __restrict__ w_up_t, const uint16_t* __restrict__ w_down, uint16_t* __restrict__ y,
    int32_t* __restrict__ counts) {
  using Smem = RowSmem<kChunks, kSplit>;
  static_assert(kChunks % kSplit == 0, "the warps share d's chunks evenly");
  extern __shared__ __align__(16) uint8_t smem[];
  int* list_col = reinterpret_cast<int*>(smem + kStages * Smem::kStageBytes);  // [kSplit lists][kMaxList]
  uint32_t* list_g = reinterpret_cast<uint32_t*>(list_col + 2 * kMaxList);
  float* partial = reinterpret_cast<float*>(list_g + 2 * kMaxList);  // [2 slots][kSplit warps]
  int* warp_count = reinterpret_cast<int*>(partial + 2 * kSplit);
  const int lane = threadIdx.x % kLanes;
  const int part = threadIdx.x / kLanes;
  const int64_t row = blockIdx.x;
  const int d = s.d;
  if (s.skip != nullptr && *s.skip != 0) return;
  uint16_t* y_row = y + row * d;

  // 1-2. This warp's pieces of g[t], listed in column order.
  const int pieces = f / kV;
  const int per = (pieces + kSplit - 1) / kSplit;
  const int p_begin = part * per;
  const int p_end = min(pieces, p_begin + per);
  const uint4* g_row = reinterpret_cast<const uint4*>(g + row * f);
  int* my_col = list_col + part * kMaxList;
  uint32_t* my_g = list_g + part * kMaxList;
  int base = 0;
  for (int p0 = p_begin; p0 < p_end; p0 += kScanBatch * kLanes) {
    uint4 v[kScanBatch];
#pragma unroll
    for (int b = 0; b < kScanBatch; ++b) {
      const int q = p0 + b * kLanes + lane;
      v[b] = q < p_end ? __ldcs(g_row + q) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int b = 0; b < kScanBatch; ++b) {
      const uint32_t w[4] = {v[b].x, v[b].y, v[b].z, v[b].w};
      uint32_t mask = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i)
        mask |= ((w[i] & 0x7FFFu) != 0 ? 1u : 0u) << (2 * i) | ((w[i] & 0x7FFF0000u) != 0 ? 1u : 0u) << (2 * i + 1);
      if (__ballot_sync(kFullMask, mask != 0) == 0) continue;  // uniform over the warp
      const int c = __popc(mask);
      const int incl = WarpInclusiveSum(c, lane);
      int slot = base + incl - c;
      const int col0 = (p0 + b * kLanes + lane) * kV;
      const uint64_t lo = (uint64_t{w[1]} << 32) | w[0], hi = (uint64_t{w[3]} << 32) | w[2];
      while (mask != 0) {
        const int i = __ffs(mask) - 1;
        mask &= mask - 1;
        if (slot < kMaxList) {
          my_col[slot] = col0 + i;
          my_g[slot] = static_cast<uint32_t>((i < 4 ? lo >> (16 * i) : hi >> (16 * (i - 4))) & 0xFFFFu);
        }
        ++slot;
      }
      base += __shfl_sync(kFullMask, incl, kLanes - 1);
    }
  }
  if (lane == 0) warp_count[part] = base;
  __syncthreads();
  const int n0 = warp_count[0];
  int total = n0;
#pragma unroll
  for (int w = 1; w < kSplit; ++w) total += warp_count[w];
  if (threadIdx.x == 0) counts[row] = total;
  if (total > s.max_entries) {  // every warp takes the same exit
    for (int c = threadIdx.x * kV; c < d; c += kSplit * kChunk)
      *reinterpret_cast<uint4*>(y_row + c) = make_uint4(0, 0, 0, 0);
    return;
  }
  static_assert(kSplit <= 2, "two lists: the first warp's, then the second's");
  RowProducts<E, kGated, kChunks, kSplit, true>(s, x, w_up_t, w_down, y_row, row, smem, list_col, list_g, partial,
                                                n0, total);
}

template <typename E, bool kGated, int kChunks>
ffi::Error LaunchChunks(cudaStream_t stream, const Shapes& s, const void* x, const void* values, const int16_t* cols,
                        const int32_t* counts, const void* w_up_t, const void* w_down, void* y) {
  constexpr int kSplit = kChunks % 2 == 0 ? 2 : 1;
  auto kernel = TwellWarpFfnKernel<E, kGated, kChunks, kSplit>;
  const int bytes = RowSmem<kChunks, kSplit>::kBytes;
  if (bytes > 48 * 1024 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess)
    return LaunchStatus("TwellWarpFfnKernel (shared memory)");
  kernel<<<static_cast<unsigned>(s.rows), kSplit * kLanes, bytes, stream>>>(
      s, static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(values), cols, counts,
      static_cast<const uint16_t*>(w_up_t), static_cast<const uint16_t*>(w_down), static_cast<uint16_t*>(y));
  return LaunchStatus("TwellWarpFfnKernel");
}

template <typename E, bool kGated>
ffi::Error LaunchTyped(cudaStream_t stream, const Shapes& s, const void* x, const void* values,
                       const int16_t* cols, const int32_t* counts, const void* w_up_t, const void* w_down, void* y) {
  const int chunks = static_cast<int>(CeilDiv(s.d, kChunk));
  // Chunk counts rounded up to a few instantiations; the masked chunks load nothing.
  if (chunks <= 1) return LaunchChunks<E, kGated, 1>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
  if (chunks <= 2) return LaunchChunks<E, kGated, 2>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
  if (chunks <= 4) return LaunchChunks<E, kGated, 4>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
  if (chunks <= 6) return LaunchChunks<E, kGated, 6>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
  return LaunchChunks<E, kGated, 8>(stream, s, x, values, cols, counts, w_up_t, w_down, y);
}

// The checks both handlers make: d within the kernels' registers, the row budget within
// the list, f and M within the grid and the columns' words, the finite columns' mask.
ffi::Error CheckRowShapes(const char* op, int64_t rows, int64_t d, int64_t f, int32_t max_entries,
                          ffi::Buffer<ffi::U8>& columns) {
  if (d % kV != 0 || d > kMaxChunks * kChunk)
    return Invalid(std::string(op) + ": d must be a multiple of 8 and at most " + std::to_string(kMaxChunks * kChunk) +
                   ", got " + std::to_string(d));
  if (max_entries < 0 || max_entries > kMaxList)
    return Invalid(std::string(op) + ": max_entries must be in [0, " + std::to_string(kMaxList) + "]");
  if (f > (int64_t{1} << 30)) return Invalid(std::string(op) + ": f must be < 2^30");
  if (rows >= (int64_t{1} << 31)) return Invalid(std::string(op) + ": M must be < 2^31 (a CTA a row)");
  if (columns.element_count() != 0 && !SameDims(columns.dimensions(), {d}))
    return Invalid(std::string(op) + ": columns must be the weights' [d] finite columns (u8) or empty");
  if (reinterpret_cast<uintptr_t>(columns.untyped_data()) % 8 != 0 && columns.element_count() != 0)
    return Invalid(std::string(op) + ": columns must be 8-byte aligned");
  return ffi::Error::Success();
}

// CTAs an SM the kernel reading g runs at: as many as the TwELL kernel's registers allow it
// (nine), though its own registers would allow eleven (shared memory bounds it there). More
// rows in flight made the TwELL kernel slower (13 CTAs an SM: +8%, ffi/notes/twell_ffn_warp.md).
// JAX_TWELL_WARP_CTAS (1-32) overrides it, for measuring.
constexpr int kFromGCtasPerSm = 9;

int FromGCtasPerSm() {
  static const int ctas = [] {
    const char* v = std::getenv("JAX_TWELL_WARP_CTAS");
    const int n = v != nullptr ? std::atoi(v) : 0;
    return n >= 1 && n <= 32 ? n : kFromGCtasPerSm;
  }();
  return ctas;
}

// Dynamic shared memory that holds the kernel to `ctas` CTAs an SM (at least what it needs).
// The device's shared memory an SM is read once a device (the handler runs on the device
// current to XLA's stream).
int PaddedSmemBytes(int needed, int ctas) {
  constexpr int kDevices = 64;
  static std::atomic<int> per_sm_of[kDevices] = {};    // usable shared memory an SM
  static std::atomic<int> reserved_of[kDevices] = {};  // the runtime's own a CTA
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kDevices) return needed;
  int per_sm = per_sm_of[device].load(std::memory_order_acquire);
  int reserved = reserved_of[device].load(std::memory_order_relaxed);
  if (per_sm == 0) {
    if (cudaDeviceGetAttribute(&per_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor, device) != cudaSuccess ||
        cudaDeviceGetAttribute(&reserved, cudaDevAttrReservedSharedMemoryPerBlock, device) != cudaSuccess)
      return needed;
    reserved_of[device].store(reserved, std::memory_order_relaxed);
    per_sm_of[device].store(per_sm, std::memory_order_release);
  }
  const int padded = (per_sm / ctas - reserved) / 128 * 128;
  return padded > needed ? padded : needed;
}

template <typename E, bool kGated, int kChunks>
ffi::Error LaunchChunksFromG(cudaStream_t stream, const Shapes& s, int f, const void* x, const void* g,
                             const void* w_up_t, const void* w_down, void* y, int32_t* counts) {
  constexpr int kSplit = kChunks % 2 == 0 ? 2 : 1;
  auto kernel = TwellWarpFfnFromGKernel<E, kGated, kChunks, kSplit>;
  const int bytes = PaddedSmemBytes(RowSmem<kChunks, kSplit>::kBytesFromG, FromGCtasPerSm());
  if (bytes > 48 * 1024 && cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes) != cudaSuccess)
    return LaunchStatus("TwellWarpFfnFromGKernel (shared memory)");
  kernel<<<static_cast<unsigned>(s.rows), kSplit * kLanes, bytes, stream>>>(
      s, f, static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(g), static_cast<const uint16_t*>(w_up_t),
      static_cast<const uint16_t*>(w_down), static_cast<uint16_t*>(y), counts);
  return LaunchStatus("TwellWarpFfnFromGKernel");
}

template <typename E, bool kGated>
ffi::Error LaunchTypedFromG(cudaStream_t stream, const Shapes& s, int f, const void* x, const void* g,
                            const void* w_up_t, const void* w_down, void* y, int32_t* counts) {
  const int chunks = static_cast<int>(CeilDiv(s.d, kChunk));
  if (chunks <= 1) return LaunchChunksFromG<E, kGated, 1>(stream, s, f, x, g, w_up_t, w_down, y, counts);
  if (chunks <= 2) return LaunchChunksFromG<E, kGated, 2>(stream, s, f, x, g, w_up_t, w_down, y, counts);
  if (chunks <= 4) return LaunchChunksFromG<E, kGated, 4>(stream, s, f, x, g, w_up_t, w_down, y, counts);
  if (chunks <= 6) return LaunchChunksFromG<E, kGated, 6>(stream, s, f, x, g, w_up_t, w_down, y, counts);
  return LaunchChunksFromG<E, kGated, 8>(stream, s, f, x, g, w_up_t, w_down, y, counts);
}

// Operands: x [M, d], g [M, f] (the activation: relu of the gate matmul, rounded), gated:
// w_up_t [f, d]; w_down [f, d]; columns [d] u8 or empty. Results: y [M, d] (zeros on the
// rows past max_entries), counts [M, 1] (s32, each row's non-zeros of g). Attribute:
// max_entries (at most kMaxList).
template <bool kGated>
ffi::Error TwellWarpFfnFromGImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::AnyBuffer w_up_t,
                                 ffi::AnyBuffer w_down, ffi::Buffer<ffi::U8> columns, ffi::Result<ffi::AnyBuffer> y,
                                 ffi::Result<ffi::Buffer<ffi::S32>> counts, int32_t max_entries) {
  const char* op = kGated ? "twell_ffn_warp_from_g (gated)" : "twell_ffn_warp_from_g";
  auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return Invalid(std::string(op) + ": x must have shape [M, d]");
  const int64_t rows = x_dims[0], d = x_dims[1];
  auto wd_dims = w_down.dimensions();
  if (wd_dims.size() != 2 || wd_dims[1] != d) return Invalid(std::string(op) + ": w_down must have shape [f, d]");
  const int64_t f = wd_dims[0];
  if (!SameDims(g.dimensions(), {rows, f})) return Invalid(std::string(op) + ": g must have shape [M, f]");
  if (kGated && !SameDims(w_up_t.dimensions(), {f, d}))
    return Invalid(std::string(op) + ": w_up_t must have shape [f, d]");
  if (!SameDims(y->dimensions(), {rows, d})) return Invalid(std::string(op) + ": y must have x's shape");
  if (!SameDims(counts->dimensions(), {rows, 1})) return Invalid(std::string(op) + ": counts must have shape [M, 1]");
  const auto dtype = x.element_type();
  if (g.element_type() != dtype || w_down.element_type() != dtype || y->element_type() != dtype ||
      (kGated && w_up_t.element_type() != dtype))
    return Invalid(std::string(op) + ": x, g, weights and y must share one dtype");
  if (auto e = CheckRowShapes(op, rows, d, f, max_entries, columns); e.failure()) return e;
  if (f % kV != 0) return Invalid(std::string(op) + ": f must be a multiple of 8, got " + std::to_string(f));
  if (reinterpret_cast<uintptr_t>(g.untyped_data()) % 16 != 0)
    return Invalid(std::string(op) + ": g must be 16-byte aligned");
  if (rows == 0) return ffi::Error::Success();
  const Shapes s{rows, static_cast<int>(d), 1, static_cast<int>(f), 0, max_entries, nullptr,
                 columns.element_count() != 0 ? columns.typed_data() : nullptr};
  const void* up_t = kGated ? w_up_t.untyped_data() : nullptr;
  switch (dtype) {
    case ffi::DataType::BF16:
      return LaunchTypedFromG<Bf16, kGated>(stream, s, static_cast<int>(f), x.untyped_data(), g.untyped_data(), up_t,
                                            w_down.untyped_data(), y->untyped_data(), counts->typed_data());
    case ffi::DataType::F16:
      return LaunchTypedFromG<F16, kGated>(stream, s, static_cast<int>(f), x.untyped_data(), g.untyped_data(), up_t,
                                           w_down.untyped_data(), y->untyped_data(), counts->typed_data());
    default:
      return Invalid(std::string(op) + ": x must be bf16 or f16");
  }
}

ffi::Error TwellWarpFfnFromGGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::AnyBuffer w_up_t,
                                  ffi::AnyBuffer w_down, ffi::Buffer<ffi::U8> columns, ffi::Result<ffi::AnyBuffer> y,
                                  ffi::Result<ffi::Buffer<ffi::S32>> counts, int32_t max_entries) {
  return TwellWarpFfnFromGImpl<true>(stream, x, g, w_up_t, w_down, columns, y, counts, max_entries);
}

ffi::Error TwellWarpFfnFromGUngated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::AnyBuffer w_down,
                                    ffi::Buffer<ffi::U8> columns, ffi::Result<ffi::AnyBuffer> y,
                                    ffi::Result<ffi::Buffer<ffi::S32>> counts, int32_t max_entries) {
  return TwellWarpFfnFromGImpl<false>(stream, x, g, w_down, w_down, columns, y, counts, max_entries);
}

// Operands: x [M, d], values [M, n_tiles, capacity], cols (s16, same), counts [M, n_tiles]
// (s32), gated: w_up_t [f, d]; w_down [f, d]; result y [M, d]. Attributes: tile (columns a
// tile), max_entries (a row holding more entries is backed up; at most kMaxList).
template <bool kGated>
ffi::Error TwellWarpFfnImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                            ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_up_t,
                            ffi::AnyBuffer w_down, ffi::Buffer<ffi::U8> columns, ffi::Result<ffi::AnyBuffer> y,
                            int32_t tile, int32_t max_entries, const int32_t* skip = nullptr) {
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
  if (auto e = CheckRowShapes(op, rows, d, f, max_entries, columns); e.failure()) return e;
  if (rows == 0) return ffi::Error::Success();
  const Shapes s{rows, static_cast<int>(d), static_cast<int>(n_tiles), tile, static_cast<int>(capacity), max_entries,
                 skip, columns.element_count() != 0 ? columns.typed_data() : nullptr};
  const void* up_t = kGated ? w_up_t.untyped_data() : nullptr;
  switch (dtype) {
    case ffi::DataType::BF16:
      return LaunchTyped<Bf16, kGated>(stream, s, x.untyped_data(), values.untyped_data(), cols.typed_data(),
                                       counts.typed_data(), up_t, w_down.untyped_data(), y->untyped_data());
    case ffi::DataType::F16:
      return LaunchTyped<F16, kGated>(stream, s, x.untyped_data(), values.untyped_data(), cols.typed_data(),
                                      counts.typed_data(), up_t, w_down.untyped_data(), y->untyped_data());
    default:
      return Invalid(std::string(op) + ": x must be bf16 or f16");
  }
}

ffi::Error TwellWarpFfnGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                             ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_up_t,
                             ffi::AnyBuffer w_down, ffi::Buffer<ffi::U8> columns, ffi::Result<ffi::AnyBuffer> y,
                             int32_t tile, int32_t max_entries) {
  return TwellWarpFfnImpl<true>(stream, x, values, cols, counts, w_up_t, w_down, columns, y, tile, max_entries);
}

ffi::Error TwellWarpFfnUngated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                               ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_down,
                               ffi::Buffer<ffi::U8> columns, ffi::Result<ffi::AnyBuffer> y, int32_t tile,
                               int32_t max_entries) {
  return TwellWarpFfnImpl<false>(stream, x, values, cols, counts, w_down, w_down, columns, y, tile, max_entries);
}

// The same with a device flag `skip` (one s32; the per-call choice's "dense"): set, the
// kernel's CTAs return at once, leaving y to the backup that computes every row.
ffi::Error SkipFlag(ffi::Buffer<ffi::S32> skip, const char* op, const int32_t** out) {
  if (skip.element_count() != 1) return Invalid(std::string(op) + ": skip must be one s32 flag");
  *out = skip.typed_data();
  return ffi::Error::Success();
}

ffi::Error TwellWarpFfnGatedUnless(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                                   ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_up_t,
                                   ffi::AnyBuffer w_down, ffi::Buffer<ffi::U8> columns, ffi::Buffer<ffi::S32> skip,
                                   ffi::Result<ffi::AnyBuffer> y, int32_t tile, int32_t max_entries) {
  const int32_t* flag = nullptr;
  if (auto e = SkipFlag(skip, "twell_ffn_warp (gated)", &flag); e.failure()) return e;
  return TwellWarpFfnImpl<true>(stream, x, values, cols, counts, w_up_t, w_down, columns, y, tile, max_entries, flag);
}

ffi::Error TwellWarpFfnUngatedUnless(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                                     ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_down,
                                     ffi::Buffer<ffi::U8> columns, ffi::Buffer<ffi::S32> skip,
                                     ffi::Result<ffi::AnyBuffer> y, int32_t tile, int32_t max_entries) {
  const int32_t* flag = nullptr;
  if (auto e = SkipFlag(skip, "twell_ffn_warp", &flag); e.failure()) return e;
  return TwellWarpFfnImpl<false>(stream, x, values, cols, counts, w_down, w_down, columns, y, tile, max_entries, flag);
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
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()  // columns [d] or []
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnWarp, jax_twell::TwellWarpFfnUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // values
                                  .Arg<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()  // columns [d] or []
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnWarpGatedUnless, jax_twell::TwellWarpFfnGatedUnless,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // values
                                  .Arg<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up_t [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()  // columns [d] or []
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // skip []
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnWarpUnless, jax_twell::TwellWarpFfnUngatedUnless,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // values
                                  .Arg<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()  // columns [d] or []
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // skip []
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnWarpFromGGated, jax_twell::TwellWarpFfnFromGGated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // g [M, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up_t [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()  // columns [d] or []
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, 1]
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnWarpFromG, jax_twell::TwellWarpFfnFromGUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // g [M, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::U8>>()  // columns [d] or []
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, 1]
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
