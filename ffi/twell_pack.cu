// twell_pack: dense activation g [..., M, f] -> TwELL (values, cols, counts).
//
// A warp packs a (row, tile) pair: a lane reads V consecutive elements (16 bytes) per step,
// so one warp step covers 32*V columns of its tile with a single coalesced load; a
// warp-wide prefix sum of per-lane non-zero counts gives each non-zero its slot, so entries
// stay in column order and the output is deterministic. Tiles of 32, 64 or 128 V columns
// (256, 512, 1024 for 2-byte elements) with f a multiple of V run TwellPackBatchKernel,
// each warp several pairs with all their loads in flight; anything else TwellPackKernel.
// Entries past `capacity` are not stored; the true count is, which flags the tile for
// exact recomputation by its consumer (nothing is dropped silently).
// Traffic: reads M*f elements once; writes M*n_tiles*(capacity*(elem+2) + 4) bytes.
#include <cstdint>

#include "common.h"
#include "elements.cuh"

namespace jax_twell {
namespace {

constexpr int kWarpsPerBlock = 8;

// Elements are moved as raw bits; a value is a non-zero unless all bits but the sign are
// clear (so -0 counts as zero and NaN as non-zero, as `g != 0` does in the reference).
template <typename Bits>
__device__ __forceinline__ bool IsNonZero(Bits bits) {
  constexpr Bits kMagnitude = static_cast<Bits>(~(Bits(1) << (8 * sizeof(Bits) - 1)));
  return (bits & kMagnitude) != 0;
}

// One step of a warp's pass over a tile: lane `lane` holds V consecutive elements starting
// at column `c` of the tile (c = step base + lane V). A warp-wide prefix sum of the lanes'
// non-zero counts gives each non-zero its slot, so entries stay in column order; slots past
// `capacity` are counted, not stored. Returns the tile's count after this step.
template <typename Bits, int V>
__device__ __forceinline__ int PackStep(const Bits (&v)[V], int c, int count, int lane, Bits* out_values,
                                        int16_t* out_cols, int capacity) {
  unsigned nonzero = 0;
#pragma unroll
  for (int i = 0; i < V; ++i) nonzero |= IsNonZero(v[i]) ? (1u << i) : 0u;
  const int mine = __popc(nonzero);
  const int inclusive = WarpInclusiveSum(mine, lane);
  int slot = count + inclusive - mine;
#pragma unroll
  for (int i = 0; i < V; ++i) {
    if ((nonzero >> i) & 1u) {
      if (slot < capacity) {
        out_values[slot] = v[i];
        out_cols[slot] = static_cast<int16_t>(c + i);
      }
      ++slot;
    }
  }
  return count + __shfl_sync(kFullMask, inclusive, 31);
}

// True when any of the sixteen bytes of elements is a non-zero (IsNonZero on each).
template <typename Bits>
__device__ __forceinline__ bool AnyNonZero(const uint4& raw) {
  constexpr uint32_t kMagnitudes = sizeof(Bits) == 2 ? 0x7fff7fffu : 0x7fffffffu;
  return ((raw.x | raw.y | raw.z | raw.w) & kMagnitudes) != 0;
}

// PackStep for a step where few lanes hold non-zeros (`active`, a ballot of AnyNonZero):
// the active lanes one after another, in lane (column) order, each one's V elements spread
// over lanes 0..V-1 and ordered by a ballot. About 20 instructions per active lane against
// ~100 for the prefix sum's step, which at 0.5% active (~1.3 active lanes per 256-wide
// tile) left the kernel bound by instruction issue, not memory.
template <typename Bits, int V>
__device__ __forceinline__ int PackStepFew(const uint4& raw, unsigned active, int c, int count, int lane,
                                           Bits* out_values, int16_t* out_cols, int capacity) {
  constexpr int kPerWord = 4 / sizeof(Bits);
  const int word = lane / kPerWord;  // lane's element's word, for lanes below V
  const int shift = 8 * static_cast<int>(sizeof(Bits)) * (lane % kPerWord);
  while (active != 0) {
    const int src = __ffs(static_cast<int>(active)) - 1;
    active &= active - 1;
    const uint32_t w0 = __shfl_sync(kFullMask, raw.x, src), w1 = __shfl_sync(kFullMask, raw.y, src);
    const uint32_t w2 = __shfl_sync(kFullMask, raw.z, src), w3 = __shfl_sync(kFullMask, raw.w, src);
    const uint32_t w = word == 0 ? w0 : word == 1 ? w1 : word == 2 ? w2 : w3;
    const Bits v = static_cast<Bits>(w >> shift);
    const bool nonzero = lane < V && IsNonZero(v);
    const unsigned bits = __ballot_sync(kFullMask, nonzero);
    const int slot = count + __popc(bits & ((1u << lane) - 1u));
    if (nonzero && slot < capacity) {
      out_values[slot] = v;
      out_cols[slot] = static_cast<int16_t>(c + src * V + lane);
    }
    count += __popc(bits);
  }
  return count;
}

// Lanes holding non-zeros up to which a step takes PackStepFew: where its ~20 instructions
// per active lane stay below the prefix-sum step's ~100 (swept: any bound from 2 to 16 times the
// same, 0 costs +11 us at M=16384; notes/twell_pack.md).
// TWELL_PACK_FEW_LANES overrides it for timing probes (0: only empty steps skip).
#ifndef TWELL_PACK_FEW_LANES
#define TWELL_PACK_FEW_LANES 4
#endif
constexpr int kFewLanes = TWELL_PACK_FEW_LANES;

// A tile's unused slots zero-filled (the format never holds uninitialised memory) and its
// true count, which flags a tile past capacity for exact recomputation by its consumer.
template <typename Bits>
__device__ __forceinline__ void FinishTile(int count, int lane, Bits* out_values, int16_t* out_cols,
                                           int32_t* out_count, int capacity) {
  for (int p = count + lane; p < capacity; p += 32) {
    out_values[p] = Bits(0);
    out_cols[p] = 0;
  }
  if (lane == 0) *out_count = count;
}

// Any tile and alignment: one warp per (row, tile) pair, 32 V columns per step.
template <typename Bits>
__global__ void TwellPackKernel(const Bits* __restrict__ g, Bits* __restrict__ values,
                                int16_t* __restrict__ cols, int32_t* __restrict__ counts,
                                int64_t rows, int64_t f, int tile, int capacity,
                                int n_tiles, bool vector_loads, const int32_t* __restrict__ skip) {
  constexpr int V = 16 / sizeof(Bits);
  const int64_t warp = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (warp >= rows * n_tiles) return;  // uniform per warp
  if (skip != nullptr && *skip != 0) {  // the call runs dense: empty tiles (the backup lists no row)
    if (lane == 0) counts[warp] = 0;
    return;
  }
  const int64_t row = warp / n_tiles;
  const int64_t col0 = static_cast<int64_t>(warp % n_tiles) * tile;
  const int64_t tile_end = min(col0 + tile, f);
  const Bits* g_row = g + row * f;

  int count = 0;
  for (int64_t base = col0; base < tile_end; base += 32 * V) {
    const int64_t c = base + static_cast<int64_t>(lane) * V;
    Bits v[V];
    if (vector_loads && c + V <= tile_end) {
      const uint4 packed = *reinterpret_cast<const uint4*>(g_row + c);
      const Bits* unpacked = reinterpret_cast<const Bits*>(&packed);
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = unpacked[i];
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) v[i] = (c + i < tile_end) ? g_row[c + i] : Bits(0);
    }
    count = PackStep(v, static_cast<int>(c - col0), count, lane, values + warp * capacity, cols + warp * capacity,
                     capacity);
  }
  FinishTile(count, lane, values + warp * capacity, cols + warp * capacity, counts + warp, capacity);
}

// The common layouts (tile = 32 V kSteps, f a multiple of V, g 16-byte aligned): each warp
// packs kItems consecutive (row, tile) pairs and issues all their 16-byte loads before
// packing any, so that kLoads loads per lane are in flight (one per warp left the kernel
// latency-bound; four measured faster than eight: ffi/notes/twell_pack.md).
constexpr int kLoads = 4;

template <typename Bits, int kSteps>
__global__ void TwellPackBatchKernel(const Bits* __restrict__ g, Bits* __restrict__ values,
                                     int16_t* __restrict__ cols, int32_t* __restrict__ counts, int64_t items,
                                     int64_t f, int capacity, int n_tiles, const int32_t* __restrict__ skip) {
  constexpr int V = 16 / sizeof(Bits);
  constexpr int kItems = kLoads / kSteps;
  constexpr int kTile = 32 * V * kSteps;
  static_assert(kItems * kSteps == kLoads, "kSteps must divide kLoads");
  const int64_t item0 = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32 * kItems;
  const int lane = threadIdx.x % 32;
  if (item0 >= items) return;  // uniform per warp
  if (skip != nullptr && *skip != 0) {  // the call runs dense: empty tiles (the backup lists no row)
    if (lane < kItems && item0 + lane < items) counts[item0 + lane] = 0;
    return;
  }

  uint4 raw[kItems][kSteps];
  int64_t row = item0 / n_tiles;  // one division per warp: the pairs follow in (row, tile) order
  int tile = static_cast<int>(item0 - row * n_tiles);
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const bool valid = item0 + i < items;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const int64_t c = static_cast<int64_t>(tile) * kTile + s * 32 * V + lane * V;  // f % V == 0: all V in or none
      raw[i][s] = valid && c < f ? LoadStreaming(g + row * f + c) : make_uint4(0, 0, 0, 0);
    }
    if (++tile == n_tiles) {
      tile = 0;
      ++row;
    }
  }
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const int64_t item = item0 + i;
    if (item >= items) break;
    int count = 0;
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      const unsigned active = __ballot_sync(kFullMask, AnyNonZero<Bits>(raw[i][s]));
      if (__popc(active) <= kFewLanes) {
        count = PackStepFew<Bits, V>(raw[i][s], active, s * 32 * V, count, lane, values + item * capacity,
                                     cols + item * capacity, capacity);
        continue;
      }
      Bits v[V];
      const Bits* unpacked = reinterpret_cast<const Bits*>(&raw[i][s]);
#pragma unroll
      for (int k = 0; k < V; ++k) v[k] = unpacked[k];
      count = PackStep(v, s * 32 * V + lane * V, count, lane, values + item * capacity, cols + item * capacity,
                       capacity);
    }
    FinishTile(count, lane, values + item * capacity, cols + item * capacity, counts + item, capacity);
  }
}

template <typename Bits, int kSteps>
void LaunchBatch(cudaStream_t stream, const void* g, void* values, int16_t* cols, int32_t* counts, int64_t items,
                 int64_t f, int capacity, int n_tiles, const int32_t* skip) {
  constexpr int kItemsPerBlock = kWarpsPerBlock * (kLoads / kSteps);
  TwellPackBatchKernel<Bits, kSteps><<<CeilDiv(items, kItemsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(
      static_cast<const Bits*>(g), static_cast<Bits*>(values), cols, counts, items, f, capacity, n_tiles, skip);
}

template <typename Bits>
ffi::Error LaunchPack(cudaStream_t stream, const void* g, void* values, int16_t* cols,
                      int32_t* counts, int64_t rows, int64_t f, int tile, int capacity,
                      int n_tiles, const int32_t* skip) {
  constexpr int V = 16 / sizeof(Bits);
  const bool vector_loads = (f % V == 0) && (tile % V == 0) &&
                            (reinterpret_cast<uintptr_t>(g) % 16 == 0);
  const int64_t items = rows * n_tiles;
  if (vector_loads && tile == 32 * V) {
    LaunchBatch<Bits, 1>(stream, g, values, cols, counts, items, f, capacity, n_tiles, skip);
  } else if (vector_loads && tile == 64 * V) {
    LaunchBatch<Bits, 2>(stream, g, values, cols, counts, items, f, capacity, n_tiles, skip);
  } else if (vector_loads && tile == 128 * V) {
    LaunchBatch<Bits, 4>(stream, g, values, cols, counts, items, f, capacity, n_tiles, skip);
  } else {
    TwellPackKernel<Bits><<<CeilDiv(items, kWarpsPerBlock), kWarpsPerBlock * 32, 0, stream>>>(
        static_cast<const Bits*>(g), static_cast<Bits*>(values), cols, counts, rows, f, tile, capacity, n_tiles,
        vector_loads, skip);
  }
  return LaunchStatus("twell_pack");
}

ffi::Error TwellPackCore(cudaStream_t stream, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> values,
                         ffi::Result<ffi::Buffer<ffi::S16>> cols,
                         ffi::Result<ffi::Buffer<ffi::S32>> counts, int32_t tile,
                         int32_t capacity, const int32_t* skip) {
  // Leading dimensions are flattened: g is [..., f] and the outputs [..., n_tiles, capacity].
  auto g_dims = g.dimensions();
  if (g_dims.size() < 1) return Invalid("twell_pack: g must have rank >= 1 [..., f]");
  const int64_t f = g_dims.back();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < g_dims.size(); ++i) rows *= g_dims[i];
  if (tile <= 0 || tile % 32 != 0 || tile > 32768)
    return Invalid("twell_pack: tile must be a positive multiple of 32, at most 32768");
  if (capacity <= 0 || capacity > tile)
    return Invalid("twell_pack: capacity must be in [1, tile]");
  const int64_t n_tiles = CeilDiv(f, tile);
  auto v_dims = values->dimensions();
  auto c_dims = cols->dimensions();
  auto n_dims = counts->dimensions();
  const size_t rank = g_dims.size();
  bool shapes_ok = v_dims.size() == rank + 1 && c_dims.size() == rank + 1 && n_dims.size() == rank;
  for (size_t i = 0; shapes_ok && i + 1 < rank; ++i)
    shapes_ok = v_dims[i] == g_dims[i] && c_dims[i] == g_dims[i] && n_dims[i] == g_dims[i];
  shapes_ok = shapes_ok && v_dims[rank - 1] == n_tiles && v_dims[rank] == capacity &&
              c_dims[rank - 1] == n_tiles && c_dims[rank] == capacity && n_dims[rank - 1] == n_tiles;
  if (!shapes_ok)
    return Invalid("twell_pack: outputs must be values/cols [..., ceil(f/tile), capacity] and "
                   "counts [..., ceil(f/tile)] for g [..., f]");
  if (values->element_type() != g.element_type())
    return Invalid("twell_pack: values must have the dtype of g");
  if (rows == 0 || f == 0) return ffi::Error::Success();
  switch (g.element_type()) {
    case ffi::DataType::BF16:
    case ffi::DataType::F16:
      return LaunchPack<uint16_t>(stream, g.untyped_data(), values->untyped_data(),
                                  cols->typed_data(), counts->typed_data(), rows, f, tile,
                                  capacity, static_cast<int>(n_tiles), skip);
    case ffi::DataType::F32:
      return LaunchPack<uint32_t>(stream, g.untyped_data(), values->untyped_data(),
                                  cols->typed_data(), counts->typed_data(), rows, f, tile,
                                  capacity, static_cast<int>(n_tiles), skip);
    default:
      return Invalid("twell_pack: g must be bf16, f16 or f32");
  }
}

ffi::Error TwellPackImpl(cudaStream_t stream, ffi::AnyBuffer g, ffi::Result<ffi::AnyBuffer> values,
                         ffi::Result<ffi::Buffer<ffi::S16>> cols, ffi::Result<ffi::Buffer<ffi::S32>> counts,
                         int32_t tile, int32_t capacity) {
  return TwellPackCore(stream, g, values, cols, counts, tile, capacity, nullptr);
}

// The same with a device flag `skip` (one s32; the per-call choice's "dense"): set, the
// kernels write zero counts and return (values and cols are left unwritten): every tile
// reads as empty, so a backup after the warp kernel lists no row.
ffi::Error TwellPackUnlessImpl(cudaStream_t stream, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> skip,
                               ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::Buffer<ffi::S16>> cols,
                               ffi::Result<ffi::Buffer<ffi::S32>> counts, int32_t tile, int32_t capacity) {
  if (skip.element_count() != 1) return Invalid("twell_pack: skip must be one s32 flag");
  return TwellPackCore(stream, g, values, cols, counts, tile, capacity, skip.typed_data());
}

}  // namespace
}  // namespace jax_twell

// The handlers only launch work on the stream (no host synchronisation): XLA may capture
// them into its CUDA graphs, conditionals included.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellPack, jax_twell::TwellPackImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("capacity"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellPackUnless, jax_twell::TwellPackUnlessImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // skip []
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("capacity"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
