// twell_ffn: fused up + down projection of the sparse FFN from a TwELL gate activation.
//
//   gated:      y[t] = sum_j  g[t,j] * (x[t] . Wu[:, j]) * Wd[j, :]     (j active in row t)
//   non-gated:  y[t] = sum_j  a[t,j] * Wd[j, :]
//
// Grid: one CTA (8 warps) per token row; the hardware block scheduler hands rows to SMs as
// they free up, which balances heavy-tailed rows (a row with 300 active neurons occupies
// one CTA longer while others stream past it).
// One CTA:
//   1. stages x[t] in shared memory and scans the row's tile counts into a flat entry list
//      (tiles over capacity are set aside);
//   2. up (gated only): the warps share the entries, four at a time per warp; each entry is
//      one warp-wide dot product of x[t] with the contiguous row Wu^T[j] (d elements);
//      h = bf16(g * bf16(u)), rounded as the reference rounds it, kept in shared memory;
//   3. down: warp w owns d-chunks w, w+8, ... (a chunk is 32 lanes x 16 bytes); for each
//      entry it reads that chunk of Wd[j] and accumulates in f32 registers;
//   4. overflowed tiles (count > capacity: entries past capacity were not stored) are
//      recomputed exactly: all threads compute relu(x . Wg[:, c]) and x . Wu[:, c] for every
//      column c of the tile (coalesced row reads of the [d, f] weights), then the down step
//      adds the tile's non-zero h. Slow (2 MB of weight reads per tile) but exact; rows that
//      dense are routed to XLA by the op's dense-crossover rule anyway.
//   5. y[t] is written once, rounded to the activation dtype. No atomics: deterministic.
// Traffic: per active (row, neuron) pair, one d-row of Wu^T and one d-row of Wd (mostly L2
// hits), so about nnz * d * 2 * itemsize bytes; plus x and y once.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <string>

#include "common.h"
#include "elements.cuh"
#include "twell_ffn.h"

namespace jax_twell {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
// A warp owns at most this many d-chunks, so d <= kWarps * kMaxChunksPerWarp * 32 * V
// (8192 for 2-byte types, 4096 for f32).
constexpr int kMaxChunksPerWarp = 4;
constexpr int kEntriesPerStep = 4;

struct Shapes {
  int64_t rows;
  int d, f, tile, capacity, n_tiles;
};

// Shared-memory layout of one CTA (offsets in bytes, each 16-byte aligned).
struct Smem {
  int x, entry_h, entry_col, tile_offset, over_tiles, h_tile, scalars, total;
  __host__ __device__ Smem(const Shapes& s, int itemsize) {
    auto align = [](int v) { return (v + 15) / 16 * 16; };
    const int slots = s.n_tiles * s.capacity;
    x = 0;
    entry_h = align(x + s.d * itemsize);
    entry_col = align(entry_h + slots * 4);
    tile_offset = align(entry_col + slots * 4);
    over_tiles = align(tile_offset + (s.n_tiles + 1) * 4);
    h_tile = align(over_tiles + s.n_tiles * 4);
    scalars = align(h_tile + s.tile * 4);
    total = align(scalars + 16);
  }
};

// One token row, by the whole CTA (steps 1-5 above).
template <typename E, bool kGated>
__device__ __forceinline__ void FfnRow(const int64_t row, const typename E::Bits* __restrict__ x,
                                       const typename E::Bits* __restrict__ values,
                                       const int16_t* __restrict__ cols, const int32_t* __restrict__ counts,
                                       const typename E::Bits* __restrict__ w_act,   // [d, f]
                                       const typename E::Bits* __restrict__ w_up,    // [d, f] (gated)
                                       const typename E::Bits* __restrict__ w_up_t,  // [f, d] (gated)
                                       const typename E::Bits* __restrict__ w_down,  // [f, d]
                                       typename E::Bits* __restrict__ y, const Shapes& s) {
  using Bits = typename E::Bits;
  constexpr int V = Vec<E>::V;
  constexpr int kChunk = 32 * V;  // elements of d per warp-wide 16-byte access
  extern __shared__ __align__(16) uint8_t smem_raw[];
  const Smem layout(s, sizeof(Bits));
  Bits* x_s = reinterpret_cast<Bits*>(smem_raw + layout.x);
  float* entry_h = reinterpret_cast<float*>(smem_raw + layout.entry_h);
  int* entry_col = reinterpret_cast<int*>(smem_raw + layout.entry_col);
  int* tile_offset = reinterpret_cast<int*>(smem_raw + layout.tile_offset);
  int* over_tiles = reinterpret_cast<int*>(smem_raw + layout.over_tiles);
  float* h_tile = reinterpret_cast<float*>(smem_raw + layout.h_tile);
  int* n_over_s = reinterpret_cast<int*>(smem_raw + layout.scalars);

  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int d = s.d;
  const Bits* x_row = x + row * d;
  const int64_t slot0 = row * s.n_tiles;

  // 1. x row into shared memory (d is a multiple of V, rows 16-byte aligned).
  for (int c = threadIdx.x * V; c < d; c += kThreads * V)
    *reinterpret_cast<uint4*>(x_s + c) = *reinterpret_cast<const uint4*>(x_row + c);
  // Warp 0 scans the stored counts into entry offsets and lists the overflowed tiles.
  if (warp == 0) {
    int base = 0, n_over = 0;
    for (int k0 = 0; k0 < s.n_tiles; k0 += 32) {
      const int k = k0 + lane;
      const int count = k < s.n_tiles ? counts[slot0 + k] : 0;
      const bool over = count > s.capacity;
      const int stored = over ? 0 : count;
      const int inclusive = WarpInclusiveSum(stored, lane);
      if (k < s.n_tiles) tile_offset[k] = base + inclusive - stored;
      const unsigned over_mask = __ballot_sync(kFullMask, over);
      if (over) over_tiles[n_over + __popc(over_mask & ((1u << lane) - 1))] = k;
      n_over += __popc(over_mask);
      base += __shfl_sync(kFullMask, inclusive, 31);
    }
    if (lane == 0) {
      tile_offset[s.n_tiles] = base;
      *n_over_s = n_over;
    }
  }
  __syncthreads();
  // Flat entry list: column and gate value of every stored entry, tile by tile.
  for (int k = warp; k < s.n_tiles; k += kWarps) {
    const int begin = tile_offset[k], n = tile_offset[k + 1] - begin;
    const int64_t src = (slot0 + k) * s.capacity;
    for (int e = lane; e < n; e += 32) {
      entry_col[begin + e] = k * s.tile + cols[src + e];
      entry_h[begin + e] = E::ToFloat(values[src + e]);
    }
  }
  const int n_entries = tile_offset[s.n_tiles];
  const int n_over = *n_over_s;
  __syncthreads();

  // 2. Up projection at the active entries: h = g * u, rounded like the reference.
  if constexpr (kGated) {
    for (int e0 = warp * kEntriesPerStep; e0 < n_entries; e0 += kWarps * kEntriesPerStep) {
      float acc[kEntriesPerStep];
      const Bits* rows_t[kEntriesPerStep];
#pragma unroll
      for (int i = 0; i < kEntriesPerStep; ++i) {
        acc[i] = 0.f;
        const int e = min(e0 + i, n_entries - 1);
        rows_t[i] = w_up_t + static_cast<int64_t>(entry_col[e]) * d;
      }
      for (int c = lane * V; c < d; c += kChunk) {
        Vec<E> xv;
        xv.Unpack(*reinterpret_cast<const uint4*>(x_s + c));
        uint4 raw[kEntriesPerStep];
#pragma unroll
        for (int i = 0; i < kEntriesPerStep; ++i) raw[i] = LoadStreaming(rows_t[i] + c);
#pragma unroll
        for (int i = 0; i < kEntriesPerStep; ++i) {
          Vec<E> wv;
          wv.Unpack(raw[i]);
#pragma unroll
          for (int v = 0; v < V; ++v) acc[i] = fmaf(xv.v[v], wv.v[v], acc[i]);
        }
      }
#pragma unroll
      for (int i = 0; i < kEntriesPerStep; ++i) acc[i] = WarpSum(acc[i]);
      if (lane < kEntriesPerStep && e0 + lane < n_entries) {
        float u = acc[0];
#pragma unroll
        for (int i = 1; i < kEntriesPerStep; ++i)
          if (lane == i) u = acc[i];
        const int e = e0 + lane;
        entry_h[e] = Round<E>(entry_h[e] * Round<E>(u));
      }
    }
    __syncthreads();
  }

  // 3. Down projection: each warp accumulates its d-chunks over all entries.
  float acc[kMaxChunksPerWarp][V];
#pragma unroll
  for (int q = 0; q < kMaxChunksPerWarp; ++q)
#pragma unroll
    for (int v = 0; v < V; ++v) acc[q][v] = 0.f;
  auto accumulate = [&](float h, int64_t j) {
    const Bits* wd_row = w_down + j * d;
#pragma unroll
    for (int q = 0; q < kMaxChunksPerWarp; ++q) {
      const int c = (warp + q * kWarps) * kChunk + lane * V;
      if (c < d) {
        Vec<E> wv;
        wv.Unpack(LoadStreaming(wd_row + c));
#pragma unroll
        for (int v = 0; v < V; ++v) acc[q][v] = fmaf(h, wv.v[v], acc[q][v]);
      }
    }
  };
#pragma unroll 4
  for (int e = 0; e < n_entries; ++e) accumulate(entry_h[e], entry_col[e]);

  // 4. Overflowed tiles, recomputed exactly from (x, w_act[, w_up]).
  for (int o = 0; o < n_over; ++o) {
    const int k = over_tiles[o];
    const int col0 = k * s.tile;
    const int width = min(s.tile, s.f - col0);
    for (int c = threadIdx.x; c < width; c += kThreads) {
      const Bits* wa = w_act + col0 + c;
      float pre = 0.f, up = 0.f;
#pragma unroll 4
      for (int i = 0; i < d; ++i) {
        const float xi = E::ToFloat(x_s[i]);
        pre = fmaf(xi, E::ToFloat(wa[static_cast<int64_t>(i) * s.f]), pre);
        if constexpr (kGated) up = fmaf(xi, E::ToFloat(w_up[static_cast<int64_t>(i) * s.f + col0 + c]), up);
      }
      const float g = Round<E>(fmaxf(pre, 0.f));
      h_tile[c] = kGated ? Round<E>(g * Round<E>(up)) : g;
    }
    __syncthreads();
    for (int c = 0; c < width; ++c) {
      const float h = h_tile[c];  // uniform across the CTA
      if (h != 0.f) accumulate(h, col0 + c);
    }
    __syncthreads();
  }

  // 5. y row, rounded once.
  Bits* y_row = y + row * d;
#pragma unroll
  for (int q = 0; q < kMaxChunksPerWarp; ++q) {
    const int c = (warp + q * kWarps) * kChunk + lane * V;
    if (c < d) {
      uint4 out;
      Bits* o = reinterpret_cast<Bits*>(&out);
#pragma unroll
      for (int v = 0; v < V; ++v) o[v] = E::FromFloat(acc[q][v]);
      *reinterpret_cast<uint4*>(y_row + c) = out;
    }
  }
}

#define TWELL_FFN_PARAMS                                                                            \
  const typename E::Bits *__restrict__ x, const typename E::Bits *__restrict__ values,              \
      const int16_t *__restrict__ cols, const int32_t *__restrict__ counts,                         \
      const typename E::Bits *__restrict__ w_act, const typename E::Bits *__restrict__ w_up,        \
      const typename E::Bits *__restrict__ w_up_t, const typename E::Bits *__restrict__ w_down,     \
      typename E::Bits *__restrict__ y, Shapes s

// One CTA per token row: the hardware scheduler balances heavy rows.
template <typename E, bool kGated>
__global__ void __launch_bounds__(kThreads, 3) TwellFfnKernel(TWELL_FFN_PARAMS) {
  FfnRow<E, kGated>(blockIdx.x, x, values, cols, counts, w_act, w_up, w_up_t, w_down, y, s);
}

// The blocked kernel's fallback, launched after it in the same handler: a grid of at most a
// few CTAs per SM that exits at once unless the blocked kernel's entries overflowed its
// workspace (*needed > max_entries, read on the device), and then computes every row.
template <typename E, bool kGated>
__global__ void __launch_bounds__(kThreads, 3)
    TwellFfnFallbackKernel(TWELL_FFN_PARAMS, const int32_t* __restrict__ needed, int64_t max_entries) {
  if (*needed <= max_entries) return;
  for (int64_t row = blockIdx.x; row < s.rows; row += gridDim.x) {
    FfnRow<E, kGated>(row, x, values, cols, counts, w_act, w_up, w_up_t, w_down, y, s);
    __syncthreads();  // the next row reuses the shared memory
  }
}
#undef TWELL_FFN_PARAMS

// needed == nullptr: the row kernel, a CTA per row. Else the fallback kernel, which runs
// only where *needed > max_entries (on the device).
template <typename E, bool kGated>
ffi::Error Launch(cudaStream_t stream, const Shapes& s, const void* x, const void* values,
                  const int16_t* cols, const int32_t* counts, const void* w_act,
                  const void* w_up, const void* w_up_t, const void* w_down, void* y,
                  const int32_t* needed = nullptr, int64_t max_entries = 0) {
  using Bits = typename E::Bits;
  const Smem layout(s, sizeof(Bits));
  auto kernel = TwellFfnKernel<E, kGated>;
  auto fallback = TwellFfnFallbackKernel<E, kGated>;
  int device = 0, max_smem = 0, n_sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (layout.total > max_smem)
    return Invalid("twell_ffn: d, ceil(f/tile)*capacity and tile need " +
                   std::to_string(layout.total) + " bytes of shared memory per row, over the " +
                   std::to_string(max_smem) + " this GPU allows; use a smaller capacity or tile");
  if (layout.total > 48 * 1024) {
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, layout.total);
    cudaFuncSetAttribute(fallback, cudaFuncAttributeMaxDynamicSharedMemorySize, layout.total);
  }
  const auto* x_ = static_cast<const Bits*>(x);
  const auto* values_ = static_cast<const Bits*>(values);
  const auto* w_act_ = static_cast<const Bits*>(w_act);
  const auto* w_up_ = static_cast<const Bits*>(w_up);
  const auto* w_up_t_ = static_cast<const Bits*>(w_up_t);
  const auto* w_down_ = static_cast<const Bits*>(w_down);
  if (needed == nullptr) {
    kernel<<<static_cast<unsigned>(s.rows), kThreads, layout.total, stream>>>(x_, values_, cols, counts, w_act_, w_up_,
                                                                            w_up_t_, w_down_, static_cast<Bits*>(y), s);
    return LaunchStatus("twell_ffn");
  }
  cudaDeviceGetAttribute(&n_sms, cudaDevAttrMultiProcessorCount, device);
  const int64_t grid = std::min<int64_t>(s.rows, 3 * static_cast<int64_t>(std::max(n_sms, 1)));
  fallback<<<static_cast<unsigned>(grid), kThreads, layout.total, stream>>>(
      x_, values_, cols, counts, w_act_, w_up_, w_up_t_, w_down_, static_cast<Bits*>(y), s, needed, max_entries);
  return LaunchStatus("twell_ffn fallback");
}

// Operands (gated): x [..., d], values/cols [..., n_tiles, capacity], counts [..., n_tiles],
// w_gate [d, f], w_up [d, f], w_up_t [f, d], w_down [f, d]; result y [..., d].
// Non-gated: the same without w_up and w_up_t (w_act is then the up weight).
template <bool kGated>
ffi::Error TwellFfnImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                        ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts,
                        ffi::AnyBuffer w_act, ffi::AnyBuffer w_up, ffi::AnyBuffer w_up_t,
                        ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y, int32_t tile) {
  auto x_dims = x.dimensions();
  if (x_dims.size() < 1) return Invalid("twell_ffn: x must have shape [..., d]");
  const int64_t d = x_dims.back();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < x_dims.size(); ++i) rows *= x_dims[i];
  auto a_dims = w_act.dimensions();
  if (a_dims.size() != 2 || a_dims[0] != d)
    return Invalid("twell_ffn: the activation weight must have shape [d, f]");
  const int64_t f = a_dims[1];
  auto v_dims = values.dimensions();
  if (v_dims.size() != x_dims.size() + 1)
    return Invalid("twell_ffn: values must have shape [..., n_tiles, capacity] for x [..., d]");
  const int64_t n_tiles = v_dims[v_dims.size() - 2];
  const int64_t capacity = v_dims.back();
  if (n_tiles <= 0 || f <= 0) return Invalid("twell_ffn: f must be positive");
  if (tile <= 0 || tile % 32 != 0 || CeilDiv(f, tile) != n_tiles)
    return Invalid("twell_ffn: tile must be a positive multiple of 32 with ceil(f / tile) == n_tiles");
  bool ok = cols.dimensions().size() == v_dims.size() && counts.dimensions().size() == x_dims.size();
  for (size_t i = 0; ok && i < v_dims.size(); ++i) ok = cols.dimensions()[i] == v_dims[i];
  for (size_t i = 0; ok && i + 1 < x_dims.size(); ++i)
    ok = v_dims[i] == x_dims[i] && counts.dimensions()[i] == x_dims[i];
  ok = ok && counts.dimensions().back() == n_tiles;
  if (!ok)
    return Invalid("twell_ffn: values/cols [..., n_tiles, capacity] and counts [..., n_tiles] "
                   "must share x's leading dimensions");
  if (!SameDims(w_down.dimensions(), {f, d})) return Invalid("twell_ffn: w_down must have shape [f, d]");
  if (kGated && (!SameDims(w_up.dimensions(), {d, f}) || !SameDims(w_up_t.dimensions(), {f, d})))
    return Invalid("twell_ffn: w_up must have shape [d, f] and w_up_t [f, d]");
  bool y_ok = y->dimensions().size() == x_dims.size();
  for (size_t i = 0; y_ok && i < x_dims.size(); ++i) y_ok = y->dimensions()[i] == x_dims[i];
  if (!y_ok) return Invalid("twell_ffn: y must have x's shape");
  const auto dtype = x.element_type();
  if (values.element_type() != dtype || w_act.element_type() != dtype ||
      w_down.element_type() != dtype || y->element_type() != dtype ||
      (kGated && (w_up.element_type() != dtype || w_up_t.element_type() != dtype)))
    return Invalid("twell_ffn: x, values, weights and y must share one dtype");
  const int itemsize = dtype == ffi::DataType::F32 ? 4 : 2;
  const int vec = 16 / itemsize;
  const int64_t max_d = static_cast<int64_t>(kWarps) * kMaxChunksPerWarp * 32 * vec;
  if (d % vec != 0 || d > max_d)
    return Invalid("twell_ffn: d must be a multiple of " + std::to_string(vec) + " and at most " +
                   std::to_string(max_d) + " for this dtype, got " + std::to_string(d));
  if (f > (int64_t{1} << 30) || rows > 0x7fffffff)
    return Invalid("twell_ffn: f must be < 2^30 and the token count < 2^31");
  if (rows == 0) return ffi::Error::Success();
  const Shapes s{rows, static_cast<int>(d), static_cast<int>(f), static_cast<int>(tile),
                 static_cast<int>(capacity), static_cast<int>(n_tiles)};
  const void* up = kGated ? w_up.untyped_data() : nullptr;
  const void* up_t = kGated ? w_up_t.untyped_data() : nullptr;
  switch (dtype) {
    case ffi::DataType::BF16:
      return Launch<Bf16, kGated>(stream, s, x.untyped_data(), values.untyped_data(), cols.typed_data(),
                                  counts.typed_data(), w_act.untyped_data(), up, up_t,
                                  w_down.untyped_data(), y->untyped_data());
    case ffi::DataType::F16:
      return Launch<F16, kGated>(stream, s, x.untyped_data(), values.untyped_data(), cols.typed_data(),
                                 counts.typed_data(), w_act.untyped_data(), up, up_t,
                                 w_down.untyped_data(), y->untyped_data());
    case ffi::DataType::F32:
      return Launch<F32, kGated>(stream, s, x.untyped_data(), values.untyped_data(), cols.typed_data(),
                                 counts.typed_data(), w_act.untyped_data(), up, up_t,
                                 w_down.untyped_data(), y->untyped_data());
    default:
      return Invalid("twell_ffn: x must be bf16, f16 or f32");
  }
}

ffi::Error TwellFfnGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                         ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts,
                         ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up, ffi::AnyBuffer w_up_t,
                         ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y, int32_t tile) {
  return TwellFfnImpl<true>(stream, x, values, cols, counts, w_gate, w_up, w_up_t, w_down, y, tile);
}

ffi::Error TwellFfnUngated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                           ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts,
                           ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                           ffi::Result<ffi::AnyBuffer> y, int32_t tile) {
  return TwellFfnImpl<false>(stream, x, values, cols, counts, w_up, w_up, w_down, w_down, y, tile);
}

}  // namespace

ffi::Error LaunchRowFallback(cudaStream_t stream, bool bf16, bool gated, int64_t rows, int d, int f, int tile,
                             int capacity, int n_tiles, const void* x, const void* values, const int16_t* cols,
                             const int32_t* counts, const void* w_act, const void* w_up, const void* w_up_t,
                             const void* w_down, void* y, const int32_t* needed, int64_t max_entries) {
  const int64_t max_d = static_cast<int64_t>(kWarps) * kMaxChunksPerWarp * 32 * 8;
  if (d % 8 != 0 || d > max_d)
    return Invalid("twell_ffn fallback: d must be a multiple of 8 and at most " + std::to_string(max_d));
  if (rows == 0) return ffi::Error::Success();
  const Shapes s{rows, d, f, tile, capacity, n_tiles};
  if (bf16)
    return gated ? Launch<Bf16, true>(stream, s, x, values, cols, counts, w_act, w_up, w_up_t, w_down, y, needed, max_entries)
                 : Launch<Bf16, false>(stream, s, x, values, cols, counts, w_act, w_up, w_up_t, w_down, y, needed, max_entries);
  return gated ? Launch<F16, true>(stream, s, x, values, cols, counts, w_act, w_up, w_up_t, w_down, y, needed, max_entries)
               : Launch<F16, false>(stream, s, x, values, cols, counts, w_act, w_up, w_up_t, w_down, y, needed, max_entries);
}

}  // namespace jax_twell

// The handlers only launch work on the stream (no host synchronisation): XLA may capture
// them into its CUDA graphs, conditionals included.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnGated, jax_twell::TwellFfnGated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // values
                                  .Arg<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // w_gate [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up_t [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("tile"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfn, jax_twell::TwellFfnUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // values
                                  .Arg<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<int32_t>("tile"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
