// twell_decode_rows: the whole FFN for one to four tokens in two launches, from weights stored
// by neuron ([f, d]: the gate weight transposed, as the up weight already is for decode).
//
//   gated:      y[t] = sum_j h[t,j] Wd[j, :],  h = round(g * round(x[t] . Wu^T[j])),  g = relu(x[t] . Wg^T[j])
//   non-gated:  y[t] = sum_j a[t,j] Wd[j, :],  a = relu(x[t] . Wa^T[j])
//
// At one token the FFN is three matrix-vector products that stream 3 d f weight elements; a
// sparse FFN needs only the gate's d f and then one Wu^T row and one Wd row per active neuron.
// The gate is read here row by row (the neuron's d contiguous elements), so every warp
// streams whole 4 KB rows (d = 2048, bf16) and no K range needs a second pass to be summed:
//
// 1. TwellDecodeRowsKernel, grid ceil(f / 16), 256 threads: CTA c owns neurons [16 c, 16 c + 16),
//    warp w neurons 16 c + 2 w and + 1. Each warp issues the loads of both its gate rows
//    (1024 elements of each per pass, four 16-byte loads per lane and row in flight; three
//    CTAs per SM) before x (at most four tokens) is staged in shared memory, then dots them
//    with every token, sums over the lanes and applies relu, rounding once as XLA's matmul
//    does. Gated, a neuron active for some token loads its Wu^T row the
//    same way for the up dot products. Then all 256 threads add the CTA's active neurons'
//    Wd rows, weighted by h, in neuron order (thread = 8 model columns, every active row's
//    load in flight at once), and write the CTA's f32 partial y for each token that has an
//    active neuron here, plus per token the number of such neurons (0: nothing written).
// 2. TwellDecodeRowsSumKernel, grid (ceil(d / 32), M), 256 threads, launched to overlap the
//    first one's tail: lists the CTAs with a partial for its token (in CTA order); each of
//    32 groups of 8 lanes adds every 32nd of them over 32 columns (4 per lane, eight
//    partials in flight), the 32 sums are added in group order and rounded once.
// Deterministic, no atomics, exact for every activation pattern (nothing has a capacity).
// Constraints: bf16 or f16; 1-4 tokens; d a multiple of 8 and at most 8192; f at most
// 1,048,576 (the partial workspace is [ceil(f / 16), M, d] f32, touched only where active).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <string>

#include "common.h"
#include "elements.cuh"

namespace jax_twell {
namespace {

constexpr int kRowsWarps = 8;
constexpr int kRowsThreads = kRowsWarps * 32;
constexpr int kRowsPerWarp = 2;
constexpr int kRowsPerCta = kRowsWarps * kRowsPerWarp;  // 16 neurons
constexpr int kRowsChunk = 32 * 8 * 4;                  // elements of a row in flight per pass (1024)
constexpr int kRowsMaxTokens = 4;
constexpr int kRowsMaxD = 8192;
constexpr int kRowsMaxF = 1 << 20;

struct RowsShapes {
  int rows, d, f, n_ctas;
};

__device__ __forceinline__ void RowsWaitPreviousGrid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void RowsAllowNextGrid() { asm volatile("griddepcontrol.launch_dependents;"); }

// Row r of a warp's pair (row0 + r of `w`, nothing where not `want`ed: zeros), elements
// [base, base + 1024): lane's 16-byte vectors 8 (lane + 32 i) .. + 7 into raw[r][i], all in
// flight at once.
constexpr int kRowsVecs = kRowsChunk / (32 * 8);
__device__ __forceinline__ void IssueRows(uint4 raw[kRowsPerWarp][kRowsVecs], const uint16_t* __restrict__ w,
                                          int64_t row0, const bool want[kRowsPerWarp], int base, int d, int lane) {
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int i = 0; i < kRowsVecs; ++i) {
      const int e = base + 8 * (lane + 32 * i);
      raw[r][i] = want[r] && e < d ? LoadStreaming(w + (row0 + r) * d + e) : make_uint4(0, 0, 0, 0);
    }
  }
}

// acc[r][t] += the lane's share of raw[r] . x[t] over [base, base + 1024); each weight
// vector unpacked once for every token.
template <typename E, int kM>
__device__ __forceinline__ void AccumulateRows(const uint4 raw[kRowsPerWarp][kRowsVecs], const uint16_t* xs, int base,
                                               int d, int lane, float acc[kRowsPerWarp][kM]) {
#pragma unroll
  for (int i = 0; i < kRowsVecs; ++i) {
    const int e = base + 8 * (lane + 32 * i);
    if (e >= d) break;
    Vec<E> wv[kRowsPerWarp];
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) wv[r].Unpack(raw[r][i]);
#pragma unroll
    for (int t = 0; t < kM; ++t) {
      Vec<E> xv;
      xv.Unpack(*reinterpret_cast<const uint4*>(xs + t * d + e));
#pragma unroll
      for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
        for (int v = 0; v < 8; ++v) acc[r][t] = fmaf(wv[r].v[v], xv.v[v], acc[r][t]);
      }
    }
  }
}

// acc[r][t] = row row0 + r of `w` . x[t] over all d, summed over the warp (every lane gets
// it); a row not `want`ed reads nothing and gives 0. `raw` holds the first pass, already
// issued (IssueRows at base 0): the caller may overlap it with other work.
template <typename E, int kM>
__device__ __forceinline__ void FinishDotRows(uint4 raw[kRowsPerWarp][kRowsVecs], const uint16_t* __restrict__ w,
                                              int64_t row0, const bool want[kRowsPerWarp], const uint16_t* xs, int d,
                                              int lane, float acc[kRowsPerWarp][kM]) {
  for (int base = 0;;) {
    AccumulateRows<E, kM>(raw, xs, base, d, lane, acc);
    base += kRowsChunk;
    if (base >= d) break;
    IssueRows(raw, w, row0, want, base, d, lane);
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
    for (int t = 0; t < kM; ++t) acc[r][t] = WarpSum(acc[r][t]);
  }
}

template <typename E, int kM, bool kGated>
__global__ void __launch_bounds__(kRowsThreads, 3) TwellDecodeRowsKernel(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ w_act_t, const uint16_t* __restrict__ w_up_t,
    const uint16_t* __restrict__ w_down, uint16_t* __restrict__ g, float* __restrict__ partial,
    int32_t* __restrict__ flags, RowsShapes s) {
  extern __shared__ __align__(16) uint16_t xs[];  // [kM][d]; rows past M are zeros
  __shared__ uint32_t h_bits[kRowsPerCta][kM];     // h (0: inactive) of neuron n, token t
  __shared__ int active_rows[kRowsPerCta + 1];     // local neurons active for some token, in order; [16] = count
  __shared__ int token_count[kM];                   // per token, its active neurons here
  const int cta = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n_base = cta * kRowsPerCta;
  const int row0 = n_base + warp * kRowsPerWarp;
  bool want[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) want[r] = row0 + r < s.f;
  uint4 raw[kRowsPerWarp][kRowsVecs];
  IssueRows(raw, w_act_t, row0, want, 0, s.d, lane);  // the gate rows' first pass, in flight while x is staged
  for (int i = threadIdx.x; i < kM * s.d / 8; i += kRowsThreads) {
    const int t = i / (s.d / 8), e = 8 * (i % (s.d / 8));
    *reinterpret_cast<uint4*>(xs + t * s.d + e) =
        t < s.rows ? *reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t) * s.d + e) : make_uint4(0, 0, 0, 0);
  }
  __syncthreads();

  float acc[kRowsPerWarp][kM] = {};
  FinishDotRows<E, kM>(raw, w_act_t, row0, want, xs, s.d, lane, acc);
  uint32_t a_bits[kRowsPerWarp][kM];
  bool any[kRowsPerWarp];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    any[r] = false;
#pragma unroll
    for (int t = 0; t < kM; ++t) {
      const float v = acc[r][t];
      a_bits[r][t] = want[r] && t < s.rows ? E::FromFloat(v > 0.f || v != v ? v : 0.f) : 0u;
      any[r] |= E::ToFloat(a_bits[r][t]) != 0.f;  // NaN counts as active: it reaches y as dense would
      if (want[r] && t < s.rows && lane == t) g[static_cast<int64_t>(t) * s.f + row0 + r] = a_bits[r][t];
    }
  }
  if constexpr (kGated) {
    float u[kRowsPerWarp][kM] = {};
    if (any[0] || any[1]) {
      IssueRows(raw, w_up_t, row0, any, 0, s.d, lane);
      FinishDotRows<E, kM>(raw, w_up_t, row0, any, xs, s.d, lane, u);
    }
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int t = 0; t < kM; ++t) {
        const float gv = E::ToFloat(a_bits[r][t]);
        a_bits[r][t] = gv != 0.f ? E::FromFloat(gv * Round<E>(u[r][t])) : 0u;
      }
    }
  }
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
#pragma unroll
      for (int t = 0; t < kM; ++t) h_bits[warp * kRowsPerWarp + r][t] = any[r] ? a_bits[r][t] : 0u;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {  // the active neurons in order, and per token how many (the sum kernel's flags)
    int n_active = 0, count[kM] = {};
    for (int n = 0; n < kRowsPerCta; ++n) {
      bool a = false;
#pragma unroll
      for (int t = 0; t < kM; ++t) {
        const bool on = h_bits[n][t] != 0u;
        count[t] += on;
        a |= on;
      }
      if (a) active_rows[n_active++] = n;
    }
    active_rows[kRowsPerCta] = n_active;
#pragma unroll
    for (int t = 0; t < kM; ++t) token_count[t] = count[t];
  }
  RowsAllowNextGrid();  // the sum kernel's CTAs may get resident; they wait for this grid to finish
  __syncthreads();
  const int n_active = active_rows[kRowsPerCta];
  if (threadIdx.x < s.rows) flags[static_cast<int64_t>(cta) * s.rows + threadIdx.x] = token_count[threadIdx.x];
  if (n_active == 0) return;
  // Down: thread = 8 model columns per 2048-column pass; every active row's load in flight.
  for (int c0 = 8 * threadIdx.x; c0 < s.d; c0 += 8 * kRowsThreads) {
    float y[kM][8] = {};
    for (int i0 = 0; i0 < n_active; i0 += 8) {
      uint4 raw[8];
#pragma unroll
      for (int k = 0; k < 8; ++k)
        raw[k] = i0 + k < n_active
                     ? LoadStreaming(w_down + static_cast<int64_t>(n_base + active_rows[i0 + k]) * s.d + c0)
                     : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        if (i0 + k >= n_active) break;
        Vec<E> wv;
        wv.Unpack(raw[k]);
        const int n = active_rows[i0 + k];
#pragma unroll
        for (int t = 0; t < kM; ++t) {
          const float h = E::ToFloat(h_bits[n][t]);
#pragma unroll
          for (int v = 0; v < 8; ++v) y[t][v] = fmaf(h, wv.v[v], y[t][v]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kM; ++t) {
      if (t >= s.rows) break;
      if (token_count[t] == 0) continue;
      float* out = partial + (static_cast<int64_t>(cta) * s.rows + t) * s.d + c0;
      reinterpret_cast<float4*>(out)[0] = make_float4(y[t][0], y[t][1], y[t][2], y[t][3]);
      reinterpret_cast<float4*>(out)[1] = make_float4(y[t][4], y[t][5], y[t][6], y[t][7]);
    }
  }
}

// y[t, 32 b .. 32 b + 32) = the CTAs' partials for token t. The CTA lists the CTAs with a
// partial for t (in order); its 32 groups of 8 lanes each read one listed partial's 32 columns
// (one 128-byte line, 4 columns a lane) at a time, group q taking the listed partials
// q, q + 32, q + 64, ... (eight of them in flight a round), and the 32 group sums are added
// in group order, rounded once: a fixed order, so the result does not depend on timing.
// Narrow column blocks make the grid wide (d / 32 CTAs a token): a fully active token's
// f / 16 partials (2.9 MB at d = 2048, f = 5632) are read by 64 CTAs in two rounds.
constexpr int kSumCols = 32;
constexpr int kSumGroupLanes = kSumCols / 4;                 // 8 lanes a group, 4 columns each
constexpr int kSumGroups = kRowsThreads / kSumGroupLanes;  // 32 groups a CTA
constexpr int kSumInFlight = 8;                             // listed partials in flight a group
constexpr int kSumListMax = 4096;                           // CTAs listed per pass
template <typename E>
__global__ void __launch_bounds__(kRowsThreads) TwellDecodeRowsSumKernel(const float* __restrict__ partial,
                                                                      const int32_t* __restrict__ flags,
                                                                      uint16_t* __restrict__ y, RowsShapes s) {
  __shared__ int list[kSumListMax];
  __shared__ int warp_count[kRowsWarps + 1];
  __shared__ float sums[kSumGroups][kSumCols];
  const int b = blockIdx.x, t = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = threadIdx.x / kSumGroupLanes, sub = threadIdx.x % kSumGroupLanes;
  RowsWaitPreviousGrid();  // the partials and flags come from the rows kernel
  const int c0 = b * kSumCols + 4 * sub;
  const bool in_range = c0 < s.d;  // d is a multiple of 8: all four columns or none
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int p0 = 0; p0 < s.n_ctas; p0 += kSumListMax) {
    // List the CTAs of [p0, p0 + kSumListMax) with a partial for token t, in order.
    int base = 0;
    for (int q = p0; q < min(s.n_ctas, p0 + kSumListMax); q += kRowsThreads) {
      const int c = q + threadIdx.x;
      const bool has = c < s.n_ctas && c < p0 + kSumListMax && flags[static_cast<int64_t>(c) * s.rows + t] > 0;
      const unsigned ballot = __ballot_sync(kFullMask, has);
      if (lane == 0) warp_count[warp + 1] = __popc(ballot);
      __syncthreads();
      if (threadIdx.x == 0) {
        warp_count[0] = base;
        for (int w = 0; w < kRowsWarps; ++w) warp_count[w + 1] += warp_count[w];
      }
      __syncthreads();
      if (has) list[warp_count[warp] + __popc(ballot & ((1u << lane) - 1))] = c;
      base = warp_count[kRowsWarps];
      __syncthreads();
    }
    for (int i0 = group; i0 < base; i0 += kSumInFlight * kSumGroups) {
      // Every load unconditional (past the list: its last entry; past d: column 0), so all
      // eight are in flight at once; only the listed ones are added.
      float4 raw[kSumInFlight];
#pragma unroll
      for (int k = 0; k < kSumInFlight; ++k) {
        const int i = min(i0 + k * kSumGroups, base - 1);
        raw[k] = *reinterpret_cast<const float4*>(partial + (static_cast<int64_t>(list[i]) * s.rows + t) * s.d +
                                                  (in_range ? c0 : 0));
      }
#pragma unroll
      for (int k = 0; k < kSumInFlight; ++k) {
        if (i0 + k * kSumGroups < base) acc.x += raw[k].x, acc.y += raw[k].y, acc.z += raw[k].z, acc.w += raw[k].w;
      }
    }
    __syncthreads();  // `list` is rewritten by the next pass
  }
  sums[group][4 * sub + 0] = acc.x;
  sums[group][4 * sub + 1] = acc.y;
  sums[group][4 * sub + 2] = acc.z;
  sums[group][4 * sub + 3] = acc.w;
  __syncthreads();
  const int col = b * kSumCols + threadIdx.x;
  if (threadIdx.x < kSumCols && col < s.d) {
    float sum = 0.f;
#pragma unroll 8
    for (int q = 0; q < kSumGroups; ++q) sum += sums[q][threadIdx.x];
    y[static_cast<int64_t>(t) * s.d + col] = static_cast<uint16_t>(E::FromFloat(sum));
  }
}

template <typename E, int kM, bool kGated>
ffi::Error LaunchRows(cudaStream_t stream, const RowsShapes& s, const void* x, const void* w_act_t,
                      const void* w_up_t, const void* w_down, void* g, float* partial, int32_t* flags, void* y) {
  const int smem = kM * s.d * 2;
  auto kernel = TwellDecodeRowsKernel<E, kM, kGated>;
  // Past the default 48 KB only (4 tokens at d > 6144): nothing host-side on the common
  // path, which XLA may capture into a CUDA graph.
  if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  kernel<<<s.n_ctas, kRowsThreads, smem, stream>>>(
      static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(w_act_t), static_cast<const uint16_t*>(w_up_t),
      static_cast<const uint16_t*>(w_down), static_cast<uint16_t*>(g), partial, flags, s);
  if (auto err = LaunchStatus("TwellDecodeRowsKernel"); err.failure()) return err;
  cudaLaunchAttribute overlap[1];
  overlap[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  overlap[0].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((s.d + kSumCols - 1) / kSumCols, s.rows);
  config.blockDim = dim3(kRowsThreads);
  config.stream = stream;
  config.attrs = overlap;
  config.numAttrs = 1;
  cudaLaunchKernelEx(&config, TwellDecodeRowsSumKernel<E>, static_cast<const float*>(partial),
                     static_cast<const int32_t*>(flags), static_cast<uint16_t*>(y), s);
  return LaunchStatus("TwellDecodeRowsSumKernel");
}

template <typename E, bool kGated>
ffi::Error DispatchRows(cudaStream_t stream, const RowsShapes& s, const void* x, const void* w_act_t,
                        const void* w_up_t, const void* w_down, void* g, float* partial, int32_t* flags, void* y) {
  switch (s.rows) {
    case 1:
      return LaunchRows<E, 1, kGated>(stream, s, x, w_act_t, w_up_t, w_down, g, partial, flags, y);
    case 2:
      return LaunchRows<E, 2, kGated>(stream, s, x, w_act_t, w_up_t, w_down, g, partial, flags, y);
    default:
      return LaunchRows<E, 4, kGated>(stream, s, x, w_act_t, w_up_t, w_down, g, partial, flags, y);
  }
}

template <bool kGated>
ffi::Error DecodeRowsImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w_act_t, ffi::AnyBuffer w_up_t,
                          ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> g,
                          ffi::Result<ffi::Buffer<ffi::F32>> partial, ffi::Result<ffi::Buffer<ffi::S32>> flags) {
  auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return Invalid("twell_decode_rows: x must have shape [M, d]");
  const int64_t rows = x_dims[0], d = x_dims[1];
  if (w_act_t.dimensions().size() != 2 || w_act_t.dimensions()[1] != d)
    return Invalid(kGated ? "twell_decode_rows: w_gate_t must have shape [f, d]"
                          : "twell_decode_rows: w_up_t (the activation's weight) must have shape [f, d]");
  const int64_t f = w_act_t.dimensions()[0];
  if (kGated && !SameDims(w_up_t.dimensions(), {f, d})) return Invalid("twell_decode_rows: w_up_t must have shape [f, d]");
  if (!SameDims(w_down.dimensions(), {f, d})) return Invalid("twell_decode_rows: w_down must have shape [f, d]");
  if (!SameDims(y->dimensions(), {rows, d})) return Invalid("twell_decode_rows: y must have shape [M, d]");
  if (!SameDims(g->dimensions(), {rows, f})) return Invalid("twell_decode_rows: the activation output must be [M, f]");
  const int64_t n_ctas = CeilDiv(f, kRowsPerCta);
  if (!SameDims(partial->dimensions(), {n_ctas, rows, d}) || !SameDims(flags->dimensions(), {n_ctas, rows}))
    return Invalid("twell_decode_rows: workspace must be partial [ceil(f / 16), M, d] f32 and flags [ceil(f / 16), M]");
  const auto dtype = x.element_type();
  if (w_act_t.element_type() != dtype || w_down.element_type() != dtype || y->element_type() != dtype ||
      g->element_type() != dtype || (kGated && w_up_t.element_type() != dtype))
    return Invalid("twell_decode_rows: x, the weights, y and the activation must share one dtype");
  if (rows < 0 || rows > kRowsMaxTokens)
    return Invalid("twell_decode_rows: at most " + std::to_string(kRowsMaxTokens) + " tokens, got " +
                   std::to_string(rows));
  if (d % 8 != 0 || d <= 0 || d > kRowsMaxD)
    return Invalid("twell_decode_rows: d must be a positive multiple of 8 and at most " + std::to_string(kRowsMaxD) +
                   ", got " + std::to_string(d));
  if (f <= 0 || f > kRowsMaxF) return Invalid("twell_decode_rows: f must be in [1, " + std::to_string(kRowsMaxF) + "]");
  if (rows == 0) return ffi::Error::Success();
  const RowsShapes s{static_cast<int>(rows), static_cast<int>(d), static_cast<int>(f), static_cast<int>(n_ctas)};
  const void* up_t = kGated ? w_up_t.untyped_data() : nullptr;
  switch (dtype) {
    case ffi::DataType::BF16:
      return DispatchRows<Bf16, kGated>(stream, s, x.untyped_data(), w_act_t.untyped_data(), up_t,
                                        w_down.untyped_data(), g->untyped_data(), partial->typed_data(),
                                        flags->typed_data(), y->untyped_data());
    case ffi::DataType::F16:
      return DispatchRows<F16, kGated>(stream, s, x.untyped_data(), w_act_t.untyped_data(), up_t,
                                       w_down.untyped_data(), g->untyped_data(), partial->typed_data(),
                                       flags->typed_data(), y->untyped_data());
    default:
      return Invalid("twell_decode_rows: bf16 or f16 only (f32 runs the other paths)");
  }
}

ffi::Error DecodeRowsGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w_gate_t, ffi::AnyBuffer w_up_t,
                           ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> g,
                           ffi::Result<ffi::Buffer<ffi::F32>> partial, ffi::Result<ffi::Buffer<ffi::S32>> flags) {
  return DecodeRowsImpl<true>(stream, x, w_gate_t, w_up_t, w_down, y, g, partial, flags);
}

ffi::Error DecodeRowsUngated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w_up_t, ffi::AnyBuffer w_down,
                             ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> a,
                             ffi::Result<ffi::Buffer<ffi::F32>> partial, ffi::Result<ffi::Buffer<ffi::S32>> flags) {
  return DecodeRowsImpl<false>(stream, x, w_up_t, w_up_t, w_down, y, a, partial, flags);
}

}  // namespace
}  // namespace jax_twell

// Both handlers only launch kernels on the stream: XLA may capture them into its CUDA graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellDecodeRowsGated, jax_twell::DecodeRowsGated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_gate_t [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up_t [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // g = relu(x @ w_gate) [M, f]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // partial [ceil(f / 16), M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>(),  // flags [ceil(f / 16), M]
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellDecodeRows, jax_twell::DecodeRowsUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up_t [f, d] (the activation's weight)
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // a = relu(x @ w_up) [M, f]
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>(),
                              {xla::ffi::Traits::kCmdBufferCompatible});
