// twell_decode: the sparse FFN for decode-sized token counts (M <= 64 is the target; any M
// works), after XLA's gate matmul. Reads only the weight rows of active neurons.
//
//   gated:      y[t] = sum_j  g[t,j] * (x[t] . Wu^T[j]) * Wd[j, :]     (j with g[t,j] != 0)
//   non-gated:  y[t] = sum_j  a[t,j] * Wd[j, :]
//
// g (resp. a) is the dense activation relu(x @ W) [M, f] that XLA's matmul wrote; at decode
// sizes it is small (M * f * 2 bytes, 720 KB at M=64, f=5632) and reading it is cheaper
// than any pack. Two launches:
//
// 1. TwellDecodeUpKernel, grid (f / 256, M), 256 threads: CTA (tile k, token t) finds the
//    active columns of g[t, 256 k .. 256 k + 256) (ballot + prefix over 8 warps, column
//    order), and for each of them (gated) one warp-wide dot x[t] . Wu^T[j] with 16-byte
//    loads of the contiguous row; h = round(g * round(u)) as the reference rounds it. Writes
//    the tile's count and its entries (h bits << 16 | column in tile), in column order.
//    Non-gated: h = a, no dot.
// 2. TwellDecodeDownKernel, grid (ceil(d / (32 V)), M), 128 threads: CTA (column chunk c, token
//    t) lists the token's entries in shared memory (counts -> offsets by a warp scan, then
//    one load per entry, adding the tile to each word), splits the list into four contiguous quarters, one per warp,
//    each accumulating h * Wd[j, chunk] in f32 registers eight rows at a time (eight
//    independent 16-byte loads in flight per lane); the four partial sums are added in warp
//    order and y rounded once. Deterministic; no atomics.
//
// Weight traffic: one Wu^T row and one Wd row per active (token, neuron) pair (8 KB at
// d=2048, bf16), the first touch of a row from HBM, repeats from L2; x, g and y once.
// Exact for every activation pattern (there is no capacity: a tile holds all 256 columns).
// Constraints: bf16 or f16; d a multiple of 8 and at most 8192; f at most 50,000 (the
// token's entry list lives in shared memory).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "async_mma.cuh"
#include "common.h"
#include "elements.cuh"

namespace jax_twell {
namespace {

constexpr int kDecTile = 256;        // columns per up CTA (one per thread)
constexpr int kUpWarps = kDecTile / 32;
constexpr int kDownWarps = 4;
constexpr int kDownThreads = kDownWarps * 32;
constexpr int kDownUnroll = 8;       // Wd rows in flight per warp step
constexpr int kMaxD = 8192;
constexpr int kMaxF = 50000;  // list in shared memory (200 KB); tile index fits 8 bits

struct DecShapes {
  int rows, d, f, n_tiles;
  int splits;  // > 0: the activation comes as split-K f32 partial sums of the gate matmul
};

// The activation bits of (token t, column col < f): from the dense g, or relu of the sum of
// the gate kernel's split-K partials rounded once (NaN propagates, as XLA's relu does).
template <typename E>
__device__ __forceinline__ uint32_t GateBits(const uint16_t* g, const float* partial, int t, int col,
                                            const DecShapes& s) {
  if (s.splits == 0) return g[static_cast<int64_t>(t) * s.f + col];
  float sum = 0.f;
  for (int i = 0; i < s.splits; ++i) sum += partial[(static_cast<int64_t>(i) * s.rows + t) * s.f + col];
  return E::FromFloat(sum > 0.f || sum != sum ? sum : 0.f);
}

// 0. The gate matmul for decode sizes (M <= 64), on tensor cores: partial[split, t, col] =
// sum over the split's rows k of x[t, k] * W[k, col]. CTA (64-column block, K split): W rows
// staged 128 at a time by cp.async (two stages, 16-byte chunks XOR-swizzled by row so the
// ldmatrix.trans phases are conflict-free); warp w owns columns 16 w .. 16 w + 15 for all
// tokens (kMTiles blocks of 16); A fragments read straight from x (L1), B by ldmatrix.trans.
// W is read once in all; the splits keep ~4 CTAs per SM streaming it.
constexpr int kGateCols = 64;
constexpr int kGateWarps = 4;
constexpr int kGateRows = 128;  // rows of W per stage
constexpr int kMaxGateTokens = 64;

template <typename E, int kMTiles>
__global__ void __launch_bounds__(kGateWarps * 32) TwellDecodeGateKernel(const uint16_t* __restrict__ x,
                                                                    const uint16_t* __restrict__ w,
                                                                    float* __restrict__ partial, DecShapes s) {
  __shared__ __align__(128) uint16_t stage[2][kGateRows * kGateCols];
  const int n0 = blockIdx.x * kGateCols, split = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane >> 2, t = lane & 3;
  const int n_chunks = (s.d + kGateRows - 1) / kGateRows;
  const int c0 = static_cast<int>(static_cast<int64_t>(n_chunks) * split / s.splits);
  const int c1 = static_cast<int>(static_cast<int64_t>(n_chunks) * (split + 1) / s.splits);
  auto load = [&](int buf, int chunk) {
    for (int v = threadIdx.x; v < kGateRows * 8; v += kGateWarps * 32) {
      const int r = v / 8, q = v % 8;
      const int k = chunk * kGateRows + r, col = n0 + q * 8;
      uint16_t* dst = stage[buf] + r * kGateCols + (q ^ (r & 7)) * 8;
      if (k < s.d && col < s.f)
        CpAsync16(dst, w + static_cast<int64_t>(k) * s.f + col);
      else
        *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
    }
    CpAsyncCommit();
  };
  // ldmatrix.trans x4: lanes 8j .. 8j + 7 address matrix j = (k rows 0-7 | 8-15) x (the
  // warp's column chunk 0 | 1): b0, b1 of n-block 0, then b0, b1 of n-block 1.
  const int b_row = (lane & 7) | (((lane >> 3) & 1) << 3), b_chunk = 2 * warp + (lane >> 4);
  float acc[kMTiles][2][4] = {};
  if (c0 < c1) load(0, c0);
  for (int c = c0; c < c1; ++c) {
    CpAsyncWaitAll();
    __syncthreads();  // chunk c landed; every warp is done with the other stage
    if (c + 1 < c1) load((c - c0 + 1) % 2, c + 1);
    const uint16_t* st = stage[(c - c0) % 2];
#pragma unroll 2
    for (int kk = 0; kk < kGateRows; kk += 16) {
      const int k = c * kGateRows + kk;
      if (k >= s.d) break;  // d is a multiple of 16
      uint32_t b[4];
      const int r = kk + b_row;
      LdMatrixX4Trans(b, st + r * kGateCols + (b_chunk ^ (r & 7)) * 8);
#pragma unroll
      for (int mt = 0; mt < kMTiles; ++mt) {
        uint32_t a[4];
#pragma unroll
        for (int h = 0; h < 4; ++h) {  // a0: (g, 2t), a1: (g + 8, 2t), a2: (g, 2t + 8), a3: (g + 8, 2t + 8)
          const int m = mt * 16 + g + (h & 1) * 8;
          a[h] = m < s.rows ? *reinterpret_cast<const uint32_t*>(x + static_cast<int64_t>(m) * s.d + k + 2 * t +
                                                                 (h >> 1) * 8)
                            : 0u;
        }
        Mma16816<E>(acc[mt][0], a, b[0], b[1]);
        Mma16816<E>(acc[mt][1], a, b[2], b[3]);
      }
    }
  }
#pragma unroll
  for (int mt = 0; mt < kMTiles; ++mt)
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int m = mt * 16 + g + half * 8, col = n0 + warp * 16 + nt * 8 + 2 * t;
        if (m < s.rows && col < s.f)
          *reinterpret_cast<float2*>(partial + (static_cast<int64_t>(split) * s.rows + m) * s.f + col) =
              make_float2(acc[mt][nt][2 * half], acc[mt][nt][2 * half + 1]);
      }
}

// 1. Active columns of one (tile, token) and, gated, their up dot products.
template <typename E, bool kGated>
__global__ void __launch_bounds__(kDecTile) TwellDecodeUpKernel(const uint16_t* __restrict__ x,
                                                           const uint16_t* __restrict__ g,
                                                           const float* __restrict__ gate_partial,
                                                           const uint16_t* __restrict__ w_up_t,
                                                           int32_t* __restrict__ counts,
                                                           uint32_t* __restrict__ entries, DecShapes s) {
  constexpr int V = Vec<E>::V;
  __shared__ int warp_base[kUpWarps + 1];
  __shared__ uint32_t list[kDecTile];  // g bits << 16 | column in tile
  const int k = blockIdx.x, t = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = k * kDecTile + threadIdx.x;
  const uint32_t bits = col < s.f ? GateBits<E>(g, gate_partial, t, col, s) : 0u;
  const bool active = E::ToFloat(bits) != 0.f;  // NaN counts as active: it reaches y as dense would
  const unsigned ballot = __ballot_sync(kFullMask, active);
  if (lane == 0) warp_base[warp + 1] = __popc(ballot);
  __syncthreads();
  if (threadIdx.x == 0) {
    warp_base[0] = 0;
    for (int w = 0; w < kUpWarps; ++w) warp_base[w + 1] += warp_base[w];
  }
  __syncthreads();
  if (active) list[warp_base[warp] + __popc(ballot & ((1u << lane) - 1))] = (bits << 16) | threadIdx.x;
  const int total = warp_base[kUpWarps];
  const int64_t slot = static_cast<int64_t>(t) * s.n_tiles + k;
  if (threadIdx.x == 0) counts[slot] = total;
  __syncthreads();
  uint32_t* out = entries + slot * kDecTile;
  if constexpr (!kGated) {
    if (threadIdx.x < total) out[threadIdx.x] = list[threadIdx.x];
  } else {
    const uint16_t* x_row = x + static_cast<int64_t>(t) * s.d;
    const int n_vec = s.d / V;
    for (int e = warp; e < total; e += kUpWarps) {
      const uint32_t word = list[e];
      const uint16_t* w_row = w_up_t + static_cast<int64_t>(k * kDecTile + (word & 0xffffu)) * s.d;
      float acc = 0.f;
      for (int i0 = 0; i0 < n_vec; i0 += 32 * 4) {
        uint4 xr[4], wr[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int i = i0 + u * 32 + lane;
          if (i < n_vec) {
            xr[u] = *reinterpret_cast<const uint4*>(x_row + i * V);
            wr[u] = LoadStreaming(w_row + i * V);
          }
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          if (i0 + u * 32 + lane < n_vec) {
            Vec<E> xv, wv;
            xv.Unpack(xr[u]);
            wv.Unpack(wr[u]);
#pragma unroll
            for (int v = 0; v < V; ++v) acc = fmaf(xv.v[v], wv.v[v], acc);
          }
        }
      }
      acc = WarpSum(acc);
      if (lane == 0) {
        const float h = E::ToFloat(word >> 16) * Round<E>(acc);
        out[e] = (E::FromFloat(h) << 16) | (word & 0xffffu);
      }
    }
  }
}

// 2. y[t, chunk] from the token's entries.
template <typename E>
__global__ void __launch_bounds__(kDownThreads) TwellDecodeDownKernel(const int32_t* __restrict__ counts,
                                                                const uint32_t* __restrict__ entries,
                                                                const uint16_t* __restrict__ w_down,
                                                                uint16_t* __restrict__ y, DecShapes s) {
  constexpr int V = Vec<E>::V;
  constexpr int kChunk = 32 * V;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  float* partial = reinterpret_cast<float*>(smem_raw);                 // [kDownWarps][kChunk]
  int* off = reinterpret_cast<int*>(partial + kDownWarps * kChunk);    // [n_tiles + 1]
  uint32_t* list = reinterpret_cast<uint32_t*>(off + s.n_tiles + 1);  // [nnz of the token]
  const int c = blockIdx.x, t = blockIdx.y;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t slot0 = static_cast<int64_t>(t) * s.n_tiles;
  // Offsets of the token's tiles in its list: warp 0 scans 32 tiles at a time.
  if (warp == 0) {
    int base = 0;
    for (int k0 = 0; k0 < s.n_tiles; k0 += 32) {
      const int k = k0 + lane;
      const int count = k < s.n_tiles ? counts[slot0 + k] : 0;
      const int inclusive = WarpInclusiveSum(count, lane);
      if (k < s.n_tiles) off[k] = base + inclusive - count;
      base += __shfl_sync(kFullMask, inclusive, 31);
    }
    if (lane == 0) off[s.n_tiles] = base;
  }
  __syncthreads();
  // The token's entries in (tile, column) order to list[]: one independent load per thread
  // and slot (the slot's tile by binary search over the offsets), so all are in flight at once.
  const int total = off[s.n_tiles];
  for (int p = threadIdx.x; p < total; p += kDownThreads) {
    int k = 0;
    for (int step = 128; step > 0; step >>= 1)  // n_tiles <= 196 (f <= 50,000)
      if (k + step < s.n_tiles && off[k + step] <= p) k += step;
    list[p] = entries[(slot0 + k) * kDecTile + (p - off[k])] | (static_cast<uint32_t>(k) << 8);
  }
  __syncthreads();
  const int lo = static_cast<int>(static_cast<int64_t>(total) * warp / kDownWarps);
  const int hi = static_cast<int>(static_cast<int64_t>(total) * (warp + 1) / kDownWarps);
  const int col = c * kChunk + lane * V;
  const bool in_range = col < s.d;
  float acc[V];
#pragma unroll
  for (int v = 0; v < V; ++v) acc[v] = 0.f;
  for (int p0 = lo; p0 < hi; p0 += kDownUnroll) {
    uint4 raw[kDownUnroll];
    float h[kDownUnroll];
#pragma unroll
    for (int u = 0; u < kDownUnroll; ++u) {
      const int p = p0 + u;
      h[u] = 0.f;
      raw[u] = make_uint4(0, 0, 0, 0);
      if (p < hi) {
        const uint32_t word = list[p];  // h << 16 | tile << 8 | column in tile
        h[u] = E::ToFloat(word >> 16);
        const int64_t row = static_cast<int64_t>((word >> 8) & 0xffu) * kDecTile + (word & 0xffu);
        if (in_range) raw[u] = LoadStreaming(w_down + row * s.d + col);
      }
    }
#pragma unroll
    for (int u = 0; u < kDownUnroll; ++u) {
      Vec<E> w;
      w.Unpack(raw[u]);
#pragma unroll
      for (int v = 0; v < V; ++v) acc[v] = fmaf(h[u], w.v[v], acc[v]);
    }
  }
#pragma unroll
  for (int v = 0; v < V; ++v) partial[warp * kChunk + lane * V + v] = acc[v];
  __syncthreads();
  for (int i = threadIdx.x; i < kChunk; i += kDownThreads) {
    const int cc = c * kChunk + i;
    if (cc >= s.d) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kDownWarps; ++w) sum += partial[w * kChunk + i];
    y[static_cast<int64_t>(t) * s.d + cc] = static_cast<uint16_t>(E::FromFloat(sum));
  }
}

// Partial sums [warps][32 lanes x 8 two-byte elements] f32, offsets, the token's list.
inline int DownSmemBytes(const DecShapes& s) {
  return kDownWarps * 32 * Vec<Bf16>::V * 4 + (s.n_tiles + 1) * 4 + s.n_tiles * kDecTile * 4;
}

template <typename E, int kMTiles>
void LaunchGate(cudaStream_t stream, const DecShapes& s, const void* x, const void* w, float* partial) {
  const dim3 grid((s.f + kGateCols - 1) / kGateCols, s.splits);
  TwellDecodeGateKernel<E, kMTiles><<<grid, kGateWarps * 32, 0, stream>>>(static_cast<const uint16_t*>(x),
                                                                      static_cast<const uint16_t*>(w), partial, s);
}

// w_act: the gate weight [d, f] when the gate runs here (gate_partial given), else null and
// g is the dense activation.
template <typename E, bool kGated>
ffi::Error Launch(cudaStream_t stream, const DecShapes& s, const void* x, const void* g, const void* w_act,
                  float* gate_partial, const void* w_up_t, const void* w_down, void* y, int32_t* counts,
                  uint32_t* entries) {
  if (gate_partial != nullptr) {
    if (s.rows <= 16)
      LaunchGate<E, 1>(stream, s, x, w_act, gate_partial);
    else if (s.rows <= 32)
      LaunchGate<E, 2>(stream, s, x, w_act, gate_partial);
    else
      LaunchGate<E, 4>(stream, s, x, w_act, gate_partial);
    if (auto err = LaunchStatus("TwellDecodeGateKernel"); err.failure()) return err;
  }
  TwellDecodeUpKernel<E, kGated><<<dim3(s.n_tiles, s.rows), kDecTile, 0, stream>>>(
      static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(g), gate_partial,
      static_cast<const uint16_t*>(w_up_t), counts, entries, s);
  if (auto err = LaunchStatus("TwellDecodeUpKernel"); err.failure()) return err;
  constexpr int kChunk = 32 * Vec<E>::V;
  const int smem = DownSmemBytes(s);
  // Past the default 48 KB only (f > ~11,000): nothing host-side on the common path, which
  // XLA may capture into a CUDA graph (the handlers are command-buffer compatible).
  if (smem > 48 * 1024) cudaFuncSetAttribute(TwellDecodeDownKernel<E>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  TwellDecodeDownKernel<E><<<dim3((s.d + kChunk - 1) / kChunk, s.rows), kDownThreads, smem, stream>>>(
      counts, entries, static_cast<const uint16_t*>(w_down), static_cast<uint16_t*>(y), s);
  return LaunchStatus("TwellDecodeDownKernel");
}

// kFused: `act` is the gate weight [d, f] (the gate matmul runs here, split-K partials in
// `partial` [splits, M, f] f32); otherwise `act` is the dense activation g [M, f].
template <bool kGated, bool kFused>
ffi::Error DecodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer act, ffi::AnyBuffer w_up_t,
                      ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y, ffi::Buffer<ffi::F32>* partial,
                      ffi::Result<ffi::Buffer<ffi::S32>> counts, ffi::Result<ffi::Buffer<ffi::U32>> entries) {
  auto a_dims = act.dimensions();
  if (a_dims.size() != 2)
    return Invalid(kFused ? "twell_decode: the gate weight must have shape [d, f]"
                          : "twell_decode: the activation must have shape [M, f]");
  if (w_down.dimensions().size() != 2) return Invalid("twell_decode: w_down must have shape [f, d]");
  const int64_t f = a_dims[1], d = w_down.dimensions()[1];
  const int64_t rows = kFused ? (y->dimensions().size() == 2 ? y->dimensions()[0] : -1) : a_dims[0];
  if (!SameDims(w_down.dimensions(), {f, d})) return Invalid("twell_decode: w_down must have shape [f, d]");
  if (!SameDims(y->dimensions(), {rows, d})) return Invalid("twell_decode: y must have shape [M, d]");
  if ((kGated || kFused) && !SameDims(x.dimensions(), {rows, d}))
    return Invalid("twell_decode: x must have shape [M, d]");
  if (kGated && !SameDims(w_up_t.dimensions(), {f, d})) return Invalid("twell_decode: w_up_t must have shape [f, d]");
  if (kFused && a_dims[0] != d) return Invalid("twell_decode: the gate weight must have shape [d, f]");
  const int64_t n_tiles = CeilDiv(f, kDecTile);
  if (!SameDims(counts->dimensions(), {rows, n_tiles}) || !SameDims(entries->dimensions(), {rows, n_tiles * kDecTile}))
    return Invalid("twell_decode: workspace must be counts [M, ceil(f / 256)] and entries [M, 256 ceil(f / 256)]");
  int64_t splits = 0;
  if (kFused) {
    auto p_dims = partial->dimensions();
    if (p_dims.size() != 3 || p_dims[1] != rows || p_dims[2] != f || p_dims[0] < 1 ||
        p_dims[0] > CeilDiv(d, kGateRows))
      return Invalid("twell_decode: the gate workspace must be [splits, M, f] f32 with 1 <= splits <= ceil(d / 128)");
    splits = p_dims[0];
    if (rows > kMaxGateTokens || d % 16 != 0 || f % 8 != 0)
      return Invalid("twell_decode: the gate kernel takes at most 64 tokens, d a multiple of 16, f a multiple of 8");
  }
  const auto dtype = act.element_type();
  if (w_down.element_type() != dtype || y->element_type() != dtype ||
      ((kGated || kFused) && x.element_type() != dtype) || (kGated && w_up_t.element_type() != dtype))
    return Invalid("twell_decode: x, the activation, the weights and y must share one dtype");
  if (d % 8 != 0 || d > kMaxD || d <= 0)
    return Invalid("twell_decode: d must be a positive multiple of 8 and at most " + std::to_string(kMaxD) +
                   ", got " + std::to_string(d));
  if (f <= 0 || f > kMaxF) return Invalid("twell_decode: f must be in [1, " + std::to_string(kMaxF) + "]");
  if (rows > 65535) return Invalid("twell_decode: at most 65,535 tokens per call");
  if (rows == 0) return ffi::Error::Success();
  const DecShapes s{static_cast<int>(rows), static_cast<int>(d), static_cast<int>(f), static_cast<int>(n_tiles),
                    static_cast<int>(splits)};
  const void* up_t = kGated ? w_up_t.untyped_data() : nullptr;
  const void* xp = (kGated || kFused) ? x.untyped_data() : nullptr;
  const void* g = kFused ? nullptr : act.untyped_data();
  const void* w_act = kFused ? act.untyped_data() : nullptr;
  float* part = kFused ? partial->typed_data() : nullptr;
  switch (dtype) {
    case ffi::DataType::BF16:
      return Launch<Bf16, kGated>(stream, s, xp, g, w_act, part, up_t, w_down.untyped_data(), y->untyped_data(),
                                  counts->typed_data(), entries->typed_data());
    case ffi::DataType::F16:
      return Launch<F16, kGated>(stream, s, xp, g, w_act, part, up_t, w_down.untyped_data(), y->untyped_data(),
                                 counts->typed_data(), entries->typed_data());
    default:
      return Invalid("twell_decode: bf16 or f16 only (f32 runs the other paths)");
  }
}

using Y = ffi::Result<ffi::AnyBuffer>;
using Counts = ffi::Result<ffi::Buffer<ffi::S32>>;
using Entries = ffi::Result<ffi::Buffer<ffi::U32>>;
using Partial = ffi::Result<ffi::Buffer<ffi::F32>>;

ffi::Error DecodeGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::AnyBuffer w_up_t,
                       ffi::AnyBuffer w_down, Y y, Counts counts, Entries entries) {
  return DecodeImpl<true, false>(stream, x, g, w_up_t, w_down, y, nullptr, counts, entries);
}

ffi::Error DecodeUngated(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer w_down, Y y, Counts counts,
                         Entries entries) {
  return DecodeImpl<false, false>(stream, a, a, w_down, w_down, y, nullptr, counts, entries);
}

ffi::Error DecodeFusedGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up_t,
                            ffi::AnyBuffer w_down, Y y, Partial partial, Counts counts, Entries entries) {
  return DecodeImpl<true, true>(stream, x, w_gate, w_up_t, w_down, y, &*partial, counts, entries);
}

ffi::Error DecodeFusedUngated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                              Y y, Partial partial, Counts counts, Entries entries) {
  return DecodeImpl<false, true>(stream, x, w_up, w_down, w_down, y, &*partial, counts, entries);
}

}  // namespace
}  // namespace jax_twell

// Every handler only launches kernels on the stream (no host synchronisation, no host-side
// state on the common path): XLA may capture them into its CUDA graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellDecodeGated, jax_twell::DecodeGated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // g = relu(x @ w_gate) [M, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up_t [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>(),  // entries [M, 256 n_tiles]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellDecode, jax_twell::DecodeUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // a = relu(x @ w_up) [M, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellDecodeFusedGated, jax_twell::DecodeFusedGated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_gate [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up_t [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // gate partials [splits, M, f]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellDecodeFused, jax_twell::DecodeFusedUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f] (the activation's weight)
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
