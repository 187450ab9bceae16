// twell_decode: the sparse FFN for decode-sized token counts (M <= 64 is the target; any M
// works for steps 1 and 2). Reads only the weight rows of active neurons.
//
//   gated:      y[t] = sum_j  g[t,j] * (x[t] . Wu^T[j]) * Wd[j, :]     (j with g[t,j] != 0)
//   non-gated:  y[t] = sum_j  a[t,j] * Wd[j, :]
//
// g (resp. a) is the dense activation relu(x @ W) [M, f]: from XLA's matmul, or from our
// gate kernel (step 0, up to 64 tokens). At decode sizes it is small (M * f * 2 bytes, 720 KB
// at M=64, f=5632) and reading it is cheaper than any pack. Then two launches:
//
// 1. TwellDecodeUpKernel, grid (f / 256, M), 256 threads: CTA (tile k, token t) finds the
//    active columns of g[t, 256 k .. 256 k + 256) (ballot + prefix over 8 warps, column
//    order), and for each of them (gated) one warp-wide dot x[t] . Wu^T[j] with 16-byte
//    loads of the contiguous row, eight per lane in flight; h = round(g * round(u)) as the
//    reference rounds it. Writes the tile's count and its entries (h bits << 16 | column in
//    tile), in column order. Non-gated: h = a, no dot.
// 2. TwellDecodeDownKernel, grid (ceil(d / (32 V)), M), 128 threads: CTA (column chunk c, token
//    t) lists the token's entries in shared memory (counts -> offsets by a warp scan, then
//    one load per entry, adding the tile to each word), splits the list into four contiguous
//    quarters, one per warp, each accumulating h * Wd[j, chunk] in f32 registers eight rows
//    at a time (eight independent 16-byte loads in flight per lane); the four partial sums
//    are added in warp order and y rounded once. Deterministic; no atomics.
//
// Weight traffic: one Wu^T row and one Wd row per active (token, neuron) pair (8 KB at
// d=2048, bf16), the first touch of a row from HBM, repeats from L2; x, g and y once.
// Exact for every activation pattern (there is no capacity: a tile holds all 256 columns).
// Constraints: bf16 or f16; d a multiple of 8 and at most 8192; f at most 50,000 (the
// token's entry list lives in shared memory); the gate kernel also d a multiple of 16, f of 8.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
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
constexpr int kUpUnroll = 8;         // 16-byte loads of a Wu^T row in flight per lane
constexpr int kMaxD = 8192;
constexpr int kMaxF = 50000;  // list in shared memory (200 KB); tile index fits 8 bits

struct DecShapes {
  int rows, d, f, n_tiles;
  int splits;  // the gate kernel's K ranges
};

// Programmatic dependent launch (sm_90): the up and down steps are launched allowed to
// start while the previous kernel in the stream finishes (their CTAs get resident and
// wait), and the previous kernel of ours says when that may begin. Wait returns once the
// previous grid has completed and its writes are visible; without the launch attribute
// both are no-ops.
__device__ __forceinline__ void WaitPreviousGrid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void AllowNextGrid() { asm volatile("griddepcontrol.launch_dependents;"); }

// relu of a sum, rounded once; NaN propagates, as XLA's relu does.
template <typename E>
__device__ __forceinline__ uint32_t ReluBits(float v) {
  return E::FromFloat(v > 0.f || v != v ? v : 0.f);
}

// 0. The gate matmul for decode sizes (M <= 64), on tensor cores. CTA (128-column block, K
// range): a cp.async ring of 64 W rows x 128 columns plus the same 64 columns of x for every
// token (16-byte chunks XOR-swizzled by row so every ldmatrix phase is conflict-free; four
// stages, three from 32 tokens, so three CTAs fit an SM). The MMA's M side is W's columns
// (warp w owns columns 16 w .. 16 w + 15: A = W^T by ldmatrix.trans), its N side the tokens
// (B = x by ldmatrix, kNT blocks of 8), so one token wastes 7/8 of an MMA, not 15/16. Each
// CTA ends with its f32 partial tile [tokens][128 columns] in shared memory; the K ranges'
// tiles are then added in range order (deterministic) in one of two ways:
// - kCluster: the K ranges of a column block form a thread-block cluster (at most 8); after a
//   cluster barrier each rank sums its share of the (token, column) pairs over the ranks'
//   tiles through distributed shared memory, applies relu, rounds once and writes g. No
//   partials in global memory, but a cluster must fit one GPC, which can leave SMs empty.
// - otherwise (the default): plain CTAs write their tiles to `partial` [splits, M, f] f32 and
//   the up kernel adds them in range order as it reads g, writing g for the caller.
constexpr int kGateCols = 128;
constexpr int kGateWarps = 8;
constexpr int kGateK = 64;  // W rows per stage
constexpr int kGateMaxSplits = 8;  // portable cluster size
constexpr int kMaxGateTokens = 64;
constexpr int kRedStride = kGateCols + 4;  // f32 row of the partial tile: spreads the stores over the banks

// Stages in the ring: three CTAs fit an SM at every token count (68-72 KB each).
template <int kNT>
constexpr int GateStages() {
  return kNT <= 2 ? 4 : 3;
}
template <int kNT>
constexpr int GateStageElems() {
  return kGateK * kGateCols + 8 * kNT * kGateK;
}
template <int kNT>
constexpr int GateSmemBytes() {
  return std::max(GateStages<kNT>() * GateStageElems<kNT>() * 2, 8 * kNT * kRedStride * 4);
}

template <typename E, int kNT, bool kCluster>
__global__ void __launch_bounds__(kGateWarps * 32) TwellDecodeGateKernel(const uint16_t* __restrict__ x,
                                                                    const uint16_t* __restrict__ w,
                                                                    uint16_t* __restrict__ g,
                                                                    float* __restrict__ partial, DecShapes s) {
  namespace cg = cooperative_groups;
  constexpr int kM = 8 * kNT, kStage = GateStageElems<kNT>(), kThreads = kGateWarps * 32;
  constexpr int kGateStages = GateStages<kNT>();
  extern __shared__ __align__(128) uint16_t gate_smem[];
  const int splits = static_cast<int>(gridDim.y), split = static_cast<int>(blockIdx.y);  // cluster: (1, splits, 1)
  const int n0 = blockIdx.x * kGateCols;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_chunks = (s.d + kGateK - 1) / kGateK;
  const int c0 = n_chunks * split / splits, n_local = n_chunks * (split + 1) / splits - c0;
  // Local chunk i into stage i % kGateStages; one commit group per call, empty past the end.
  auto load = [&](int i) {
    if (i < n_local) {
      uint16_t* ws = gate_smem + (i % kGateStages) * kStage;
      uint16_t* xs = ws + kGateK * kGateCols;
      const int kb = (c0 + i) * kGateK;
      for (int v = threadIdx.x; v < kGateK * (kGateCols / 8); v += kThreads) {
        const int r = v / (kGateCols / 8), q = v % (kGateCols / 8), k = kb + r, col = n0 + q * 8;
        uint16_t* dst = ws + r * kGateCols + (q ^ (r & 7)) * 8;
        if (k < s.d && col < s.f)
          CpAsync16(dst, w + static_cast<int64_t>(k) * s.f + col);
        else
          *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      }
      for (int v = threadIdx.x; v < kM * (kGateK / 8); v += kThreads) {
        const int m = v / (kGateK / 8), q = v % (kGateK / 8), k = kb + q * 8;
        uint16_t* dst = xs + m * kGateK + (q ^ (m & 7)) * 8;
        if (m < s.rows && k < s.d)
          CpAsync16(dst, x + static_cast<int64_t>(m) * s.d + k);
        else
          *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
      }
    }
    CpAsyncCommit();
  };
  // A (ldmatrix.x4.trans): lanes 8j .. 8j + 7 address matrix j = (k rows 0-7 | 8-15 for j >> 1)
  // x (column chunk 2 w + (j & 1)): a0..a3 = (cols 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15).
  const int a_k = (lane & 7) + ((lane >> 4) & 1) * 8, a_chunk = 2 * warp + ((lane >> 3) & 1);
  // B (ldmatrix.x4): matrix j = tokens 8 (j >> 1) .. + 7 of the pair x k chunk (j & 1): b0, b1
  // of one token block, then of the next. One block (kNT = 1): x2, lanes 0-15.
  const int b_m = (lane & 7) + ((lane >> 4) & 1) * 8, b_chunk = (lane >> 3) & 1;
  float acc[kNT][4] = {};
#pragma unroll
  for (int i = 0; i < kGateStages - 1; ++i) load(i);
  for (int i = 0; i < n_local; ++i) {
    CpAsyncWait<kGateStages - 2>();
    __syncthreads();  // chunk i landed for every thread; every warp is done with chunk i - 1's stage
    load(i + kGateStages - 1);
    const uint16_t* ws = gate_smem + (i % kGateStages) * kStage;
    const uint16_t* xs = ws + kGateK * kGateCols;
#pragma unroll
    for (int ks = 0; ks < kGateK / 16; ++ks) {
      uint32_t a[4];
      const int r = ks * 16 + a_k;
      LdMatrixX4Trans(a, ws + r * kGateCols + (a_chunk ^ (r & 7)) * 8);
      if constexpr (kNT == 1) {
        uint32_t b[2];
        const int m = lane & 7, q = 2 * ks + b_chunk;
        LdMatrixX2(b, xs + m * kGateK + (q ^ (m & 7)) * 8);
        Mma16816<E>(acc[0], a, b[0], b[1]);
      } else {
#pragma unroll
        for (int p = 0; p < kNT / 2; ++p) {
          uint32_t b[4];
          const int m = p * 16 + b_m, q = 2 * ks + b_chunk;
          LdMatrixX4(b, xs + m * kGateK + (q ^ (m & 7)) * 8);
          Mma16816<E>(acc[2 * p], a, b[0], b[1]);
          Mma16816<E>(acc[2 * p + 1], a, b[2], b[3]);
        }
      }
    }
  }
  AllowNextGrid();  // only the epilogue is left: the up step's CTAs may get resident
  CpAsyncWaitAll();
  __syncthreads();  // the stages are free: the partial tile [kM tokens][128 columns] f32 reuses them
  float* red = reinterpret_cast<float*>(gate_smem);
  {
    const int col = warp * 16 + (lane >> 2), m = 2 * (lane & 3);  // C: (col g | g + 8, token 2t | 2t + 1)
#pragma unroll
    for (int nt = 0; nt < kNT; ++nt) {
      float* row = red + (nt * 8 + m) * kRedStride + col;
      row[0] = acc[nt][0];
      row[kRedStride] = acc[nt][1];
      row[8] = acc[nt][2];
      row[kRedStride + 8] = acc[nt][3];
    }
  }
  constexpr int kQuads = kGateCols / 4;
  if constexpr (!kCluster) {
    __syncthreads();
    for (int it = threadIdx.x; it < s.rows * kQuads; it += kThreads) {
      const int m = it / kQuads, c = (it % kQuads) * 4;
      if (n0 + c < s.f)  // f is a multiple of 8: a quad is all in or all out
        *reinterpret_cast<float4*>(partial + (static_cast<int64_t>(split) * s.rows + m) * s.f + n0 + c) =
            *reinterpret_cast<const float4*>(red + m * kRedStride + c);
    }
    return;
  }
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every rank's partial tile is complete and visible to the cluster
  for (int it = split * kThreads + threadIdx.x; it < s.rows * kQuads; it += splits * kThreads) {
    const int m = it / kQuads, c = (it % kQuads) * 4;
    if (n0 + c >= s.f) continue;
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int q = 0; q < splits; ++q) {
      const float4 v = *reinterpret_cast<const float4*>(cluster.map_shared_rank(red, q) + m * kRedStride + c);
      sum.x += v.x;
      sum.y += v.y;
      sum.z += v.z;
      sum.w += v.w;
    }
    const uint2 out =
        make_uint2(ReluBits<E>(sum.x) | (ReluBits<E>(sum.y) << 16), ReluBits<E>(sum.z) | (ReluBits<E>(sum.w) << 16));
    *reinterpret_cast<uint2*>(g + static_cast<int64_t>(m) * s.f + n0 + c) = out;
  }
  cluster.sync();  // no rank leaves while another still reads its tile
}

// 1. Active columns of one (tile, token) and, gated, their up dot products.
template <typename E, bool kGated>
__global__ void __launch_bounds__(kDecTile) TwellDecodeUpKernel(const uint16_t* __restrict__ x,
                                                           uint16_t* __restrict__ g,
                                                           const float* __restrict__ gate_partial,
                                                           const uint16_t* __restrict__ w_up_t,
                                                           int32_t* __restrict__ counts,
                                                           uint32_t* __restrict__ entries, DecShapes s) {
  constexpr int V = Vec<E>::V;
  __shared__ int warp_base[kUpWarps + 1];
  __shared__ uint32_t list[kDecTile];  // g bits << 16 | column in tile
  const int k = blockIdx.x, t = blockIdx.y;
  WaitPreviousGrid();  // g (or the gate's partials) comes from the previous kernel
  AllowNextGrid();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int col = k * kDecTile + threadIdx.x;
  uint32_t bits = 0u;
  if (col < s.f) {
    const int64_t at = static_cast<int64_t>(t) * s.f + col;
    if (gate_partial == nullptr) {
      bits = g[at];
    } else {  // the gate kernel's K-range partial sums, added in range order; g written for the caller
      float part[kGateMaxSplits];  // all loads in flight at once (one round trip, not `splits`)
#pragma unroll
      for (int i = 0; i < kGateMaxSplits; ++i)
        part[i] = i < s.splits ? gate_partial[static_cast<int64_t>(i) * s.rows * s.f + at] : 0.f;
      float sum = part[0];
#pragma unroll
      for (int i = 1; i < kGateMaxSplits; ++i) sum += part[i];  // + 0 past `splits`: the same sum
      bits = ReluBits<E>(sum);
      g[at] = static_cast<uint16_t>(bits);
    }
  }
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
      for (int i0 = 0; i0 < n_vec; i0 += 32 * kUpUnroll) {  // d = 2048: the whole row in one round trip
        uint4 wr[kUpUnroll];  // the weight loads in flight; x (read by every active column) from L1 after
#pragma unroll
        for (int u = 0; u < kUpUnroll; ++u) {
          const int i = i0 + u * 32 + lane;
          if (i < n_vec) wr[u] = LoadStreaming(w_row + i * V);
        }
#pragma unroll
        for (int u = 0; u < kUpUnroll; ++u) {
          const int i = i0 + u * 32 + lane;
          if (i < n_vec) {
            Vec<E> xv, wv;
            xv.Unpack(*reinterpret_cast<const uint4*>(x_row + i * V));
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
  WaitPreviousGrid();  // counts and entries come from the up step
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

template <typename E, int kNT>
ffi::Error LaunchGate(cudaStream_t stream, const DecShapes& s, const void* x, const void* w, void* g, float* partial) {
  constexpr int smem = GateSmemBytes<kNT>();
  const bool cluster = partial == nullptr;
  auto kernel = cluster ? TwellDecodeGateKernel<E, kNT, true> : TwellDecodeGateKernel<E, kNT, false>;
  // Not a stream operation: allowed while XLA captures the launch into a CUDA graph.
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeClusterDimension;
  attr[0].val.clusterDim.x = 1;
  attr[0].val.clusterDim.y = static_cast<unsigned>(s.splits);
  attr[0].val.clusterDim.z = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((s.f + kGateCols - 1) / kGateCols, s.splits);
  config.blockDim = dim3(kGateWarps * 32);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attr;
  config.numAttrs = cluster ? 1 : 0;
  cudaLaunchKernelEx(&config, kernel, static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w),
                     static_cast<uint16_t*>(g), partial, s);
  return LaunchStatus("TwellDecodeGateKernel");
}

// w_act: the gate weight [d, f] when the gate runs here (g is then its output; `partial`
// its K-range sums when not summed in a cluster), else null and g is XLA's activation.
template <typename E, bool kGated>
ffi::Error Launch(cudaStream_t stream, const DecShapes& s, const void* x, void* g, const void* w_act,
                  float* partial, const void* w_up_t, const void* w_down, void* y, int32_t* counts,
                  uint32_t* entries) {
  if (w_act != nullptr) {
    ffi::Error err = s.rows <= 8    ? LaunchGate<E, 1>(stream, s, x, w_act, g, partial)
                     : s.rows <= 16 ? LaunchGate<E, 2>(stream, s, x, w_act, g, partial)
                     : s.rows <= 32 ? LaunchGate<E, 4>(stream, s, x, w_act, g, partial)
                                    : LaunchGate<E, 8>(stream, s, x, w_act, g, partial);
    if (err.failure()) return err;
  }
  cudaLaunchAttribute overlap[1];
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(s.n_tiles, s.rows);
  config.blockDim = dim3(kDecTile);
  config.stream = stream;
  config.attrs = overlap;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, TwellDecodeUpKernel<E, kGated>, static_cast<const uint16_t*>(x),
                     static_cast<uint16_t*>(g), static_cast<const float*>(partial),
                     static_cast<const uint16_t*>(w_up_t), counts, entries, s);
  if (auto err = LaunchStatus("TwellDecodeUpKernel"); err.failure()) return err;
  constexpr int kChunk = 32 * Vec<E>::V;
  const int smem = DownSmemBytes(s);
  // Past the default 48 KB only (f > ~11,000): nothing host-side on the common path, which
  // XLA may capture into a CUDA graph (the handlers are command-buffer compatible).
  if (smem > 48 * 1024) cudaFuncSetAttribute(TwellDecodeDownKernel<E>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  config.gridDim = dim3((s.d + kChunk - 1) / kChunk, s.rows);
  config.blockDim = dim3(kDownThreads);
  config.dynamicSmemBytes = smem;
  cudaLaunchKernelEx(&config, TwellDecodeDownKernel<E>, static_cast<const int32_t*>(counts),
                     static_cast<const uint32_t*>(entries), static_cast<const uint16_t*>(w_down),
                     static_cast<uint16_t*>(y), s);
  return LaunchStatus("TwellDecodeDownKernel");
}

// kFused: `act` is the gate weight [d, f] (the gate matmul runs here, in `splits` K ranges,
// and g [M, f] goes to `gate`; `partial` holds the ranges' sums [splits, M, f] f32, or is
// empty when a cluster adds them); otherwise `act` is the dense activation g [M, f].
template <bool kGated, bool kFused>
ffi::Error DecodeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer act, ffi::AnyBuffer w_up_t,
                      ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y, ffi::AnyBuffer* gate, ffi::Buffer<ffi::F32>* partial,
                      int64_t splits,
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
  if (kFused) {
    if (!SameDims(gate->dimensions(), {rows, f})) return Invalid("twell_decode: the gate output must be [M, f]");
    if (splits < 1 || splits > kGateMaxSplits || splits > CeilDiv(d, kGateK))
      return Invalid("twell_decode: the gate kernel's splits must be in [1, min(8, ceil(d / 64))], got " +
                     std::to_string(splits));
    if (rows > kMaxGateTokens || d % 16 != 0 || f % 8 != 0)
      return Invalid("twell_decode: the gate kernel takes at most 64 tokens, d a multiple of 16, f a multiple of 8");
    if (partial->element_count() != 0 && !SameDims(partial->dimensions(), {splits, rows, f}))
      return Invalid("twell_decode: the gate partials must be [splits, M, f] f32, or empty (summed in a cluster)");
  }
  const auto dtype = act.element_type();
  if (w_down.element_type() != dtype || y->element_type() != dtype ||
      ((kGated || kFused) && x.element_type() != dtype) || (kGated && w_up_t.element_type() != dtype) ||
      (kFused && gate->element_type() != dtype))
    return Invalid("twell_decode: x, the activation, the weights and y must share one dtype");
  if (d % 8 != 0 || d > kMaxD || d <= 0)
    return Invalid("twell_decode: d must be a positive multiple of 8 and at most " + std::to_string(kMaxD) +
                   ", got " + std::to_string(d));
  if (f <= 0 || f > kMaxF) return Invalid("twell_decode: f must be in [1, " + std::to_string(kMaxF) + "]");
  if (rows > 65535) return Invalid("twell_decode: at most 65,535 tokens per call");
  if (rows == 0) return ffi::Error::Success();
  const DecShapes s{static_cast<int>(rows), static_cast<int>(d), static_cast<int>(f), static_cast<int>(n_tiles),
                    static_cast<int>(kFused ? splits : 0)};
  const void* up_t = kGated ? w_up_t.untyped_data() : nullptr;
  const void* xp = (kGated || kFused) ? x.untyped_data() : nullptr;
  void* g = kFused ? gate->untyped_data() : act.untyped_data();
  const void* w_act = kFused ? act.untyped_data() : nullptr;
  float* part = kFused && partial->element_count() != 0 ? partial->typed_data() : nullptr;
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
using Gate = ffi::Result<ffi::AnyBuffer>;
using Partial = ffi::Result<ffi::Buffer<ffi::F32>>;

ffi::Error DecodeGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::AnyBuffer w_up_t,
                       ffi::AnyBuffer w_down, Y y, Counts counts, Entries entries) {
  return DecodeImpl<true, false>(stream, x, g, w_up_t, w_down, y, nullptr, nullptr, 0, counts, entries);
}

ffi::Error DecodeUngated(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer w_down, Y y, Counts counts,
                         Entries entries) {
  return DecodeImpl<false, false>(stream, a, a, w_down, w_down, y, nullptr, nullptr, 0, counts, entries);
}

ffi::Error DecodeFusedGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up_t,
                            ffi::AnyBuffer w_down, Y y, Gate gate, Partial partial, Counts counts, Entries entries,
                            int32_t splits) {
  return DecodeImpl<true, true>(stream, x, w_gate, w_up_t, w_down, y, &*gate, &*partial, splits, counts, entries);
}

ffi::Error DecodeFusedUngated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                              Y y, Gate gate, Partial partial, Counts counts, Entries entries, int32_t splits) {
  return DecodeImpl<false, true>(stream, x, w_up, w_down, w_down, y, &*gate, &*partial, splits, counts, entries);
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
                                  .Ret<xla::ffi::AnyBuffer>()  // g = relu(x @ w_gate) [M, f]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // [splits, M, f] K-range sums, or [0]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Attr<int32_t>("splits"),  // K ranges of the gate matmul
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellDecodeFused, jax_twell::DecodeFusedUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f] (the activation's weight)
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // a = relu(x @ w_up) [M, f]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()
                                  .Attr<int32_t>("splits"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
