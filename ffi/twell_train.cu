// twell_train: the sparse training FFN on token blocks: a forward that keeps the sparse
// residuals, and the custom_vjp backward, both on the blocked TwELL layout of
// twell_ffn_blocked.cu (device code in twell_blocked.cuh). Notes: ffi/notes/training_kernels.md;
// NumPy model of every step (same indexing, same f32 operation order):
// tests/train_emulation.py.
//
//   gated:      g = relu(x Wg) (TwELL), u = x Wu, h = bf16(g * bf16(u)), y = h Wd
//   non-gated:  h = g = relu(x Wu), y = h Wd
//
// Forward (train_fwd), after the XLA gate matmul and the pack kernel:
//   K0a/b/c layout      as inference: entries `g bits << 16 | flag << 15 | column`.
//   Recompute (train)   grid (tile, block): overflowed tiles, exact g (entry) and u (`up`).
//   K1 Up + TrainFinish gated: u = bf16(sum of d/64 partial dots) -> `up`; h -> h_words.
//   K2 Down             y from h_words (gated) or entries (non-gated, h = g).
//                       mma bit 2: a union product; bit 4: Wd stationary (twell_stationary.cuh).
//   ByColumn            grid (tile, block): entries with g != 0 of each (block, tile)
//                       segment sorted stably by (column, token) -> col_off, by_col.
// Residuals: entries, up, col_off, by_col, seg_start, tok_off (~10 B per entry), plus x.
//
// Backward (train_bwd), c = dl1 / M from the device:
//   K1 Up (dy, Wd)      partial sums of dh = dy[t] . Wd[j], every entry (flagged ones too);
//                       mma bit 3: dh whole from the union up product instead.
//                       mma bit 4: dx by the stationary walks (twell_stationary.cuh,
//                       LaunchStationaryDx): one over Wact^T's rows with coef[1], then (gated)
//                       one over Wu^T's rows with coef[2] that adds the first's f32 sums; the
//                       handler then takes Wact and Wu in their own [d, f] layout.
//   BwdFinish           grid-stride over entries: dh = sum of partials + c sign(h);
//                       coef[0] = h, coef[1] = dh * u (gate; dh non-gated), coef[2] = dh * g.
//   Dx                  grid (d/32, block), like K2: 4 lanes per token hold dx[t, 32 cols] in
//                       f32; per tile the Wg^T and Wu^T slabs [tile, 32] are staged;
//                       acc = fma(coef1, Wg^T[j], acc), then fma(coef2, Wu^T[j], acc).
//   GradOffsets/Records each neuron's entries of all blocks as one contiguous list of
//                       16-byte records (h, coefficients, token), in the sums' order.
//   WeightGrad          grid (tile x 4 parts, d/64), 8 warps of 4 groups of 8 lanes: dWd[j] += h dy[t],
//                       dWg^T[j] += coef1 x[t], dWu^T[j] += coef2 x[t]; [f, d] outputs. A hot
//                       neuron (over 1/16 of the tile's entries) is shared by all 32 groups
//                       first; in a tile with a neuron over 3x the mean the others go to the
//                       warps from a queue in decreasing size, each warp's 4 groups striding
//                       one neuron's list, else one neuron per group; parts added in a
//                       fixed tree.
// Every output element is summed by one lane in a fixed order: deterministic, no atomics.
// Traffic at M=16384, d=2048, f=5632, 0.5% active: weight slabs 16 blocks x 5 x 23 MB =
// 1.85 GB (L2); WeightGrad x/dy slices nnz x d x 4 B = 3.8 GB (L2); partials 2 x 2 x 59 MB.
#include <algorithm>
#include <string>
#include <type_traits>

#include "common.h"
#include "twell_blocked.cuh"
#include "twell_stationary.cuh"
#include "twell_union_layout.cuh"

namespace jax_twell {
namespace {

constexpr int kByColWarps = kThreads / 32;  // 16 warps of 64 tokens
constexpr int kTokenShift = 18;             // by_col word: token << 18 | entry within the segment
constexpr uint32_t kLocalMask = (1u << kTokenShift) - 1;
constexpr int kGradThreads = 256;
#ifndef TWELL_GRAD_LANES
#define TWELL_GRAD_LANES 8
#endif
// lanes of a weight-gradient group, 8 columns each (tests/train_emulation.py's
// GRAD_LANES models the sums' order for 8; other values are timing builds)
constexpr int kGradLanes = TWELL_GRAD_LANES;
constexpr int kGradCols = 8 * kGradLanes;     // a CTA's model columns

// True when the entry's g is non-zero (unfired columns of overflowed tiles hold zeros).
__device__ __forceinline__ bool GateFired(uint32_t word) { return ((word >> 16) & 0x7fffu) != 0; }

__device__ __forceinline__ float Nan() { return __int_as_float(0x7fc00000); }

template <typename E>
__device__ __forceinline__ uint4 Pack8(const float (&v)[8], bool poison) {
  uint32_t out[4];
#pragma unroll
  for (int i = 0; i < 4; ++i)
    out[i] = E::FromFloat(poison ? Nan() : v[2 * i]) | (E::FromFloat(poison ? Nan() : v[2 * i + 1]) << 16);
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Forward, gated: u of the stored entries from the Up partials (range order, rounded), u of
// recomputed entries as written by the recompute step; h = round(g * u) -> h_words.
template <typename E>
__global__ void __launch_bounds__(256) TwellTrainFinishKernel(const float* __restrict__ partial,
                                                  const int32_t* __restrict__ seg_start,
                                                  const uint32_t* __restrict__ entries,
                                                  uint16_t* __restrict__ up, uint32_t* __restrict__ h_words,
                                                  int n_ranges, Shapes s) {
  if (OverBudget(s, seg_start)) return;
  const int64_t total = seg_start[s.n_blocks * s.n_tiles];
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t word = entries[e];
    float u;
    if (word & kFlag) {
      u = E::ToFloat(up[e]);
    } else {
      float sum = 0.f;
      for (int r = 0; r < n_ranges; ++r) sum += partial[static_cast<int64_t>(r) * s.max_entries + e];
      up[e] = static_cast<uint16_t>(E::FromFloat(sum));
      u = Round<E>(sum);
    }
    const float h = Round<E>(E::ToFloat(word >> 16) * u);
    h_words[e] = (E::FromFloat(h) << 16) | (word & 0xffffu);
  }
}

// Per (tile, block) segment: entries with g != 0 sorted stably by (column, token). Warp w
// owns tokens [64 w, 64 w + 64), whose entries are one contiguous range of the segment
// (token-major): the warp walks it 32 entries at a time, the token of an entry from its
// word's token bits and which half of the 64 it lies in. Per-warp column histograms make
// the scatter order fixed; within a step of 32 entries (tokens ascending with the lane),
// lanes of one column take consecutive slots in lane order (__match_any_sync).
__global__ void __launch_bounds__(kThreads) TwellTrainByColumnKernel(const int32_t* __restrict__ tok_off,
                                                         const int32_t* __restrict__ seg_start,
                                                         const uint32_t* __restrict__ entries,
                                                         int32_t* __restrict__ col_off,
                                                         uint32_t* __restrict__ by_col, Shapes s) {
  constexpr int kTokensPerWarp = kBlockTokens / kByColWarps;
  static_assert(kTokensPerWarp == 64, "two 32-token halves per warp (the words hold the token mod 32)");
  __shared__ int start[kByColWarps][kMaxTile];
  __shared__ int scratch[32];
  __shared__ int total;
  if (OverBudget(s, seg_start)) return;
  const int k = blockIdx.x, b = blockIdx.y;
  const int seg = b * s.n_tiles + k;
  const int64_t base = seg_start[seg];
  const int32_t* off = tok_off + static_cast<int64_t>(seg) * (kBlockTokens + 1);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int t0 = warp * kTokensPerWarp;
  const int lo = off[t0], mid = off[t0 + 32], hi = off[t0 + kTokensPerWarp];
  for (int i = threadIdx.x; i < kByColWarps * kMaxTile; i += blockDim.x) (&start[0][0])[i] = 0;
  __syncthreads();
  for (int e = lo + lane; e < hi; e += 32) {
    const uint32_t word = entries[base + e];
    if (GateFired(word)) atomicAdd(&start[warp][word & kColumnMask], 1);
  }
  __syncthreads();
  const int c = threadIdx.x;
  int column_total = 0;
  if (c < kMaxTile)
    for (int w = 0; w < kByColWarps; ++w) column_total += start[w][c];
  const int column_start = BlockExclusiveScan(column_total, scratch, &total);
  if (c <= s.tile) col_off[static_cast<int64_t>(seg) * (s.tile + 1) + c] = c < kMaxTile ? column_start : total;
  if (c < kMaxTile) {
    int run = column_start;
    for (int w = 0; w < kByColWarps; ++w) {
      const int n = start[w][c];
      start[w][c] = run;
      run += n;
    }
  }
  __syncthreads();
  const uint32_t below = (1u << lane) - 1u;
  for (int e0 = lo; e0 < hi; e0 += 32) {
    const int e = e0 + lane;
    const uint32_t word = e < hi ? entries[base + e] : 0u;
    const bool fired = e < hi && GateFired(word);
    const int col = static_cast<int>(word & kColumnMask);
    // Lanes without a fired entry get a key of their own, so they match no one.
    const uint32_t peers = __match_any_sync(0xffffffffu, fired ? col : kMaxTile + lane);
    const int slot = fired ? start[warp][col] + __popc(peers & below) : 0;
    __syncwarp();
    if (fired) {
      if ((peers & below) == 0u) start[warp][col] = slot + __popc(peers);  // the column's first lane
      const int i = t0 + (e >= mid ? 32 : 0) + static_cast<int>((word >> kWordTokenShift) & 31u);
      by_col[base + slot] = (static_cast<uint32_t>(i) << kTokenShift) | static_cast<uint32_t>(e);
    }
    __syncwarp();
  }
}

// Backward: per entry dh, then the coefficients of the three gradient products.
template <typename E, bool kGated>
__global__ void __launch_bounds__(256) TwellTrainBwdFinishKernel(const float* __restrict__ partial,
                                                     const int32_t* __restrict__ seg_start,
                                                     const uint32_t* __restrict__ entries,
                                                     const uint16_t* __restrict__ up,
                                                     const float* __restrict__ l1_grad,
                                                     float* __restrict__ coef, int n_ranges, Shapes s) {
  if (OverBudget(s, seg_start)) return;
  const int64_t total = seg_start[s.n_blocks * s.n_tiles];
  const float c = *l1_grad;
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t word = entries[e];
    float h = 0.f, d_gate = 0.f, d_up = 0.f;
    if (GateFired(word)) {
      float dh = 0.f;
      for (int r = 0; r < n_ranges; ++r) dh += partial[static_cast<int64_t>(r) * s.max_entries + e];
      const float g = E::ToFloat(word >> 16);
      const float u = kGated ? E::ToFloat(up[e]) : 1.f;
      h = kGated ? Round<E>(g * u) : g;
      const float sign = h > 0.f ? 1.f : (h < 0.f ? -1.f : 0.f);
      dh = fmaf(c, sign, dh);  // c * sign is exact: equals dh + c * sign
      d_gate = kGated ? dh * u : dh;
      d_up = dh * g;
    }
    coef[e] = h;
    coef[s.max_entries + e] = d_gate;
    if (kGated) coef[2 * s.max_entries + e] = d_up;
  }
}

template <bool kGated>
struct DxStages {
  using St = Stages<kDownCols>;
  static constexpr int kStage = St::kStage + (kGated ? St::kSlab : 0);
  static int Bytes(int n_tiles) { return 2 * kStage + (n_tiles + 1 + 3) / 4 * 16; }
};

// dx[t] = sum over t's entries (tiles, columns ascending) of coef1 Wact^T[j] (+ coef2 Wu^T[j]).
// Group g (4 lanes) owns tokens g + 128 j, j < 8; lane q of the group columns 8q..8q+7.
template <typename E, bool kGated>
__global__ void __launch_bounds__(kThreads, 1) TwellTrainDxKernel(
    const uint16_t* __restrict__ w_act_t, const uint16_t* __restrict__ w_up_t,
    const int32_t* __restrict__ tok_off, const int32_t* __restrict__ seg_start,
    const uint32_t* __restrict__ entries, const float* __restrict__ coef, uint16_t* __restrict__ dx, Shapes s) {
  constexpr int kGroups = kThreads / kDownLanes;
  constexpr int kTokensPerGroup = kBlockTokens / kGroups;
  using St = Stages<kDownCols>;
  using Dx = DxStages<kGated>;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  int32_t* seg_s = reinterpret_cast<int32_t*>(smem_raw + 2 * Dx::kStage);
  const int r = blockIdx.x, b = blockIdx.y;
  const int col0 = r * kDownCols;
  const int group = threadIdx.x / kDownLanes, q = threadIdx.x % kDownLanes;
  const bool over_budget = OverBudget(s, seg_start);
  const float* coef_gate = coef + s.max_entries;
  const float* coef_up = coef + 2 * s.max_entries;

  float acc[kTokensPerGroup][8];
#pragma unroll
  for (int j = 0; j < kTokensPerGroup; ++j)
#pragma unroll
    for (int v = 0; v < 8; ++v) acc[j][v] = 0.f;

  if (!over_budget) {
    for (int k = threadIdx.x; k <= s.n_tiles; k += blockDim.x) seg_s[k] = seg_start[b * s.n_tiles + k];
    __syncthreads();
    if (kGated) CopySlabRows<kDownCols, false>(reinterpret_cast<uint16_t*>(smem_raw + St::kStage), w_up_t, 0, col0, s);
    StageTile<kDownCols>(smem_raw, w_act_t, tok_off, entries, seg_s, b, 0, col0, s);
    for (int k = 0; k < s.n_tiles; ++k) {
      CpAsyncWaitAll();
      __syncthreads();
      if (k + 1 < s.n_tiles) {
        uint8_t* next = smem_raw + ((k + 1) % 2) * Dx::kStage;
        if (kGated) CopySlabRows<kDownCols, false>(reinterpret_cast<uint16_t*>(next + St::kStage), w_up_t, k + 1, col0, s);
        StageTile<kDownCols>(next, w_act_t, tok_off, entries, seg_s, b, k + 1, col0, s);
      }
      const uint8_t* stage = smem_raw + (k % 2) * Dx::kStage;
      const uint16_t* slab_act = reinterpret_cast<const uint16_t*>(stage);
      const uint16_t* slab_up = reinterpret_cast<const uint16_t*>(stage + St::kStage);
      const int32_t* off = reinterpret_cast<const int32_t*>(stage + St::kSlab);
      const int base = seg_s[k];
      const uint32_t* ent = seg_s[k + 1] - base <= kStageEntries
                                ? reinterpret_cast<const uint32_t*>(stage + St::kSlab + St::kOff)
                                : entries + base;
#pragma unroll
      for (int j = 0; j < kTokensPerGroup; ++j) {
        const int i = group + kGroups * j;
        const int lo = off[i], hi = off[i + 1];  // zero-length past the last token
        for (int e = lo; e < hi; ++e) {
          const uint32_t word = ent[e];
          if (!GateFired(word)) continue;
          const int c = word & kColumnMask;
          const float cg = coef_gate[base + e];
          float wv[8];
          Unpack8<E>(*reinterpret_cast<const uint4*>(slab_act + c * kDownCols + q * 8), wv);
#pragma unroll
          for (int v = 0; v < 8; ++v) acc[j][v] = fmaf(cg, wv[v], acc[j][v]);
          if constexpr (kGated) {
            const float cu = coef_up[base + e];
            Unpack8<E>(*reinterpret_cast<const uint4*>(slab_up + c * kDownCols + q * 8), wv);
#pragma unroll
            for (int v = 0; v < 8; ++v) acc[j][v] = fmaf(cu, wv[v], acc[j][v]);
          }
        }
      }
    }
  }

#pragma unroll
  for (int j = 0; j < kTokensPerGroup; ++j) {
    const int64_t t = static_cast<int64_t>(b) * kBlockTokens + group + kGroups * j;
    if (t >= s.rows) continue;
    *reinterpret_cast<uint4*>(dx + t * s.d + col0 + q * 8) = Pack8<E>(acc[j], over_budget);
  }
}

// dx on tensor cores (bit 1 of the backward's `mma` attribute; what ffn_with_aux runs by
// default). The version-4 down step's structure (twell_blocked.cuh):
// a CTA covers half a block (512 tokens) and 64 columns, warp w tokens [16 w, 16 w + 16)
// with dx[., 64 columns] as mma accumulators; per step of 16 entries, A = the entries'
// coefficients (dh * u for the activation's weight, dh * g for the up weight, rounded to E
// as XLA's dense backward rounds dg and du) one-hot on their token rows, B = the entries'
// Wact^T (and Wu^T) slab rows, both staged in one ring slot. Equal to the CUDA-core dx to
// the rounding of the coefficients to E and the tensor cores' addition order.
constexpr int kDxMmaStages = 3;  // gated: 3 slots of two 32 KB slabs
template <typename E, bool kGated>
__global__ void __launch_bounds__(kFlatThreads, 1) TwellTrainDxMmaKernel(
    const uint16_t* __restrict__ w_act_t, const uint16_t* __restrict__ w_up_t,
    const int32_t* __restrict__ tok_off, const int32_t* __restrict__ seg_start,
    const uint32_t* __restrict__ entries, const float* __restrict__ coef, uint16_t* __restrict__ dx, Shapes s) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint16_t* stages = reinterpret_cast<uint16_t*>(smem_raw);
  const float* coef_gate = coef + s.max_entries;
  const float* coef_up = coef + 2 * s.max_entries;
  const DownMmaThread th = DownMmaThreadOf(seg_start, s);
  const int lane = threadIdx.x % 32;
  float acc[8][4];
  ZeroAcc(acc);

  if (!th.over_budget) {
    WalkRunsV4<kDownMmaTokens, kDxMmaStages, kGated ? 2 : 1>(
        stages, seg_start, entries, w_act_t, w_up_t, tok_off, th.b, th.t0, th.col0, s,
        [&](int base, const uint16_t* slab, int lo, int hi, uint32_t word) {
          const uint32_t* ent = entries + base;
          // Coefficient bits of entry e (0 past the run), in E.
          auto coef_bits = [&](const float* c, int e) { return e < hi ? E::FromFloat(c[base + e]) : 0u; };
          uint32_t cg = coef_bits(coef_gate, lo + (lane & 15));
          uint32_t cu = kGated ? coef_bits(coef_up, lo + (lane & 15)) : 0u;
          for (int pb = lo; pb < hi; pb += 16) {  // warp-uniform
            const int en = pb + 16 + (lane & 15);
            const uint32_t next = en < hi ? ent[en] : 0u;
            const uint32_t next_g = coef_bits(coef_gate, en);
            const uint32_t next_u = kGated ? coef_bits(coef_up, en) : 0u;
            const uint32_t row = pb + (lane & 15) < hi ? ((word >> kWordTokenShift) & 15u) : 0xffu;
            const int c = __shfl_sync(0xffffffffu, static_cast<int>(word & kColumnMask), th.b_entry);
            uint32_t a_g[4], a_u[4];
            OneHotRowsA(cg << 16 | row, th.g, th.t, a_g);
            if constexpr (kGated) OneHotRowsA(cu << 16 | row, th.g, th.t, a_u);
#pragma unroll
            for (int q = 0; q < 4; ++q) {
              uint32_t bf[4];
              LdMatrixX4Trans(bf, slab + Swizzled64(c, 2 * q + th.b_chunk));
              Mma16816<E>(acc[2 * q], a_g, bf[0], bf[1]);
              Mma16816<E>(acc[2 * q + 1], a_g, bf[2], bf[3]);
              if constexpr (kGated) {
                LdMatrixX4Trans(bf, slab + kSlab64Elems + Swizzled64(c, 2 * q + th.b_chunk));
                Mma16816<E>(acc[2 * q], a_u, bf[0], bf[1]);
                Mma16816<E>(acc[2 * q + 1], a_u, bf[2], bf[3]);
              }
            }
            word = next, cg = next_g, cu = next_u;
          }
        });
  }
  StoreWarpRows64<E>(acc, dx, static_cast<int64_t>(th.b) * kBlockTokens + th.t0, th.col0, th.g, th.t, th.over_budget, s);
}

// The weight gradients read each neuron's entries of all token blocks as one contiguous list
// of 16-byte records (h, gate coefficient, up coefficient, token), tile-major, neurons
// ascending, then blocks and tokens ascending: the order of the sums. The lists live in the
// backward's workspace (union_ws, GradWorkspaceOf): records [max_entries] uint4, then the
// lists' starts nrn_off [n_tiles, tile + 1] (the last of a tile its end), then each
// (block, tile) segment's first record per neuron, dstart [blocks, n_tiles, tile].
struct GradWorkspace {
  uint4* records;
  int32_t* nrn_off;
  int32_t* dstart;
  int64_t ints;  // words in all
};

GradWorkspace GradWorkspaceOf(const Shapes& s, void* base) {
  GradWorkspace w{};
  const int64_t record_ints = 4 * s.max_entries;
  const int64_t off_ints = static_cast<int64_t>(s.n_tiles) * (s.tile + 1);
  int32_t* p = static_cast<int32_t*>(base);
  w.records = reinterpret_cast<uint4*>(p);
  w.nrn_off = p == nullptr ? nullptr : p + record_ints;
  w.dstart = p == nullptr ? nullptr : p + record_ints + off_ints;
  w.ints = record_ints + off_ints + static_cast<int64_t>(s.n_blocks) * s.n_tiles * s.tile;
  return w;
}

// Grid (tile k), kMaxTile threads: the starts of tile k's lists. Thread j counts neuron j's
// entries over the blocks; the tiles before k come first.
__global__ void __launch_bounds__(kMaxTile) TwellTrainGradOffsetsKernel(const int32_t* __restrict__ seg_start,
                                                                        const int32_t* __restrict__ col_off,
                                                                        int32_t* __restrict__ nrn_off,
                                                                        int32_t* __restrict__ dstart, Shapes s) {
  __shared__ int scratch[32];
  __shared__ int before_total, tile_total;
  if (OverBudget(s, seg_start)) return;
  const int k = blockIdx.x, j = threadIdx.x;
  int before = 0;  // entries of tiles [0, k), all blocks
  for (int i = threadIdx.x; i < k * s.n_blocks; i += blockDim.x) {
    const int kk = i / s.n_blocks, b = i % s.n_blocks;
    before += col_off[(static_cast<int64_t>(b) * s.n_tiles + kk) * (s.tile + 1) + s.tile];
  }
  BlockExclusiveScan(before, scratch, &before_total);
  const int width = TileWidth(s, k);
  const bool in_tile = j < width;
  int n = 0;
  for (int b = 0; in_tile && b < s.n_blocks; ++b) {
    const int32_t* co = col_off + (static_cast<int64_t>(b) * s.n_tiles + k) * (s.tile + 1);
    n += co[j + 1] - co[j];
  }
  int run = before_total + BlockExclusiveScan(n, scratch, &tile_total);
  int32_t* off = nrn_off + static_cast<int64_t>(k) * (s.tile + 1);
  if (j < s.tile) off[j] = run;
  if (j == 0) off[s.tile] = before_total + tile_total;
  for (int b = 0; j < s.tile && b < s.n_blocks; ++b) {
    const int64_t seg = static_cast<int64_t>(b) * s.n_tiles + k;
    dstart[seg * s.tile + j] = run;
    if (in_tile) run += col_off[seg * (s.tile + 1) + j + 1] - col_off[seg * (s.tile + 1) + j];
  }
}

// Grid (tile k, block b): the records of segment (b, k)'s by_col entries, each at its
// neuron's place (dstart): entry p of the segment belongs to the column j with
// col_off[j] <= p < col_off[j + 1].
template <bool kGated>
__global__ void __launch_bounds__(256) TwellTrainGradRecordsKernel(const int32_t* __restrict__ seg_start,
                                                                   const int32_t* __restrict__ col_off,
                                                                   const uint32_t* __restrict__ by_col,
                                                                   const float* __restrict__ coef,
                                                                   const int32_t* __restrict__ dstart,
                                                                   uint4* __restrict__ records, Shapes s) {
  __shared__ int co[kMaxTile + 1], shift[kMaxTile];
  if (OverBudget(s, seg_start)) return;
  const int k = blockIdx.x, b = blockIdx.y;
  const int64_t seg = static_cast<int64_t>(b) * s.n_tiles + k;
  const int64_t base = seg_start[seg];
  for (int i = threadIdx.x; i <= s.tile; i += blockDim.x) co[i] = col_off[seg * (s.tile + 1) + i];
  __syncthreads();
  for (int i = threadIdx.x; i < s.tile; i += blockDim.x) shift[i] = dstart[seg * s.tile + i] - co[i];
  __syncthreads();
  const int n = co[s.tile];
  for (int p = threadIdx.x; p < n; p += blockDim.x) {
    int lo = 0, hi = s.tile;  // the last j with co[j] <= p: co[lo] <= p < co[hi]
    while (hi - lo > 1) {
      const int mid = (lo + hi) / 2;
      if (co[mid] <= p) lo = mid;
      else hi = mid;
    }
    const uint32_t w = by_col[base + p];
    const int64_t e = base + (w & kLocalMask);
    const uint32_t token = static_cast<uint32_t>(b) * kBlockTokens + (w >> kTokenShift);
    records[shift[lo] + p] = make_uint4(__float_as_uint(coef[e]), __float_as_uint(coef[s.max_entries + e]),
                                        kGated ? __float_as_uint(coef[2 * s.max_entries + e]) : 0u, token);
  }
}

// Weight gradients: grid (tile k, model columns [64 r, 64 r + 64)), 8 warps of 4 groups of
// 8 lanes (a group: 8 columns per lane; kGradLanes, one record read serves its 64 columns).
// With W the tile's entries and n a neuron's (its contiguous list of records, blocks then
// tokens ascending):
// - a hot neuron (16 n > W, at most 15) is shared by all 32 groups first: group g sums the
//   g-th of 32 equal consecutive parts of its list from zero, the 4 groups of a warp add
//   their parts in a butterfly (0+1)+(2+3), then the 8 warps' sums are added in warp order;
// - in a "strided" tile (a non-hot neuron over 3x the tile's mean: trained models' per-neuron
//   spread), every other neuron is taken whole by one warp from a queue in decreasing size
//   (by powers of two): group i of the warp sums entries i, i + 4, i + 8, ... of its list
//   from zero, and the warp adds the 4 sums in the same butterfly;
// - in an even tile (uniform per-neuron rates), group g owns neurons g, g + 32, ... and sums
//   each one's list from zero.
// Which warp takes a neuron does not change its sums, so the queue may be dynamic: a warp
// takes the next neuron when it is done, and the tile's work ends within about one neuron
// of even. A group reads its records kGradBatch at a time, the next batch's records in flight
// with the current batch's x and dy slices. One fixed order of f32 operations per output
// (train_emulation.py follows it).
#ifndef TWELL_GRAD_BATCH
#define TWELL_GRAD_BATCH 4
#endif
#ifndef TWELL_GRAD_SPLIT
#define TWELL_GRAD_SPLIT 4
#endif
#ifndef TWELL_GRAD_MIN_BLOCKS
#define TWELL_GRAD_MIN_BLOCKS 2
#endif
constexpr int kGradBatch = TWELL_GRAD_BATCH;      // records per group in flight
constexpr int kGradMinBlocks = TWELL_GRAD_MIN_BLOCKS;
// CTAs per (tile, column range): each classifies the whole tile (hot neurons, strided or
// not) and sums the neurons of every kGradSplit-th group of kGradGroups, so a neuron's sums are the
// same whichever CTA takes it (the hot list and the queue hold only the CTA's own neurons:
// their order, set by atomics, differs between CTAs); more CTAs per column range keep
// fewer column ranges in flight (their x/dy slices, 2 x 2 kGradCols B x M, stay in L2 at large M).
constexpr int kGradSplit = TWELL_GRAD_SPLIT;
constexpr int kGradGroups = kGradThreads / kGradLanes;
constexpr int kGradWarps = kGradThreads / 32;
constexpr int kWarpGroups = 32 / kGradLanes;  // groups per warp (4)
constexpr int kHotShare = 16;                 // a hot neuron holds over 1/16 of its tile's entries
constexpr int kSizeClasses = 33;              // queue classes: 0 (no entries), 1 + floor(log2 n)
constexpr int kSpreadTile = 3;                // a neuron over 3x its tile's mean makes the tile strided

struct GradAcc {
  float down[8], act[8], up[8];
};

// Adds record x/dy products to acc: dWd += h dy[t], dWg^T += gate x[t], dWu^T += up x[t].
template <typename E, bool kGated>
__device__ __forceinline__ void ApplyGradRecord(GradAcc& acc, const uint4& rec, const uint4& xs, const uint4& ds) {
  float xv[8], dv[8];
  Unpack8<E>(xs, xv);
  Unpack8<E>(ds, dv);
  const float h = __uint_as_float(rec.x), gate = __uint_as_float(rec.y), up = __uint_as_float(rec.z);
#pragma unroll
  for (int v = 0; v < 8; ++v) {
    acc.down[v] = fmaf(h, dv[v], acc.down[v]);
    acc.act[v] = fmaf(gate, xv[v], acc.act[v]);
    if (kGated) acc.up[v] = fmaf(up, xv[v], acc.up[v]);
  }
}

// Adds records rec[0], rec[step], ..., rec[(n - 1) step] to acc in that order.
template <typename E, bool kGated>
__device__ __forceinline__ void AddRecords(GradAcc& acc, const uint4* __restrict__ rec, int n, int step,
                                           const uint16_t* __restrict__ x, const uint16_t* __restrict__ dy, int col,
                                           const Shapes& s) {
  uint4 r[kGradBatch];
#pragma unroll
  for (int m = 0; m < kGradBatch; ++m) r[m] = m < n ? rec[static_cast<int64_t>(m) * step] : make_uint4(0, 0, 0, 0);
  for (int q = 0; q < n; q += kGradBatch) {
    uint4 xs[kGradBatch], ds[kGradBatch], next[kGradBatch];
#pragma unroll
    for (int m = 0; m < kGradBatch; ++m) {
      if (q + m < n) {
        const int64_t t = r[m].w;
        xs[m] = *reinterpret_cast<const uint4*>(x + t * s.d + col);
        ds[m] = *reinterpret_cast<const uint4*>(dy + t * s.d + col);
      }
    }
#pragma unroll
    for (int m = 0; m < kGradBatch; ++m)
      next[m] = q + kGradBatch + m < n ? rec[static_cast<int64_t>(q + kGradBatch + m) * step] : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int m = 0; m < kGradBatch; ++m)
      if (q + m < n) ApplyGradRecord<E, kGated>(acc, r[m], xs[m], ds[m]);
#pragma unroll
    for (int m = 0; m < kGradBatch; ++m) r[m] = next[m];
  }
}

template <typename E, bool kGated>
__device__ __forceinline__ void StoreGrads(const GradAcc& acc, int k, int j, int col, bool poison,
                                           uint16_t* dw_down, uint16_t* dw_act_t, uint16_t* dw_up_t,
                                           const Shapes& s) {
  const int64_t row = static_cast<int64_t>(k) * s.tile + j;
  *reinterpret_cast<uint4*>(dw_down + row * s.d + col) = Pack8<E>(acc.down, poison);
  *reinterpret_cast<uint4*>(dw_act_t + row * s.d + col) = Pack8<E>(acc.act, poison);
  if (kGated) *reinterpret_cast<uint4*>(dw_up_t + row * s.d + col) = Pack8<E>(acc.up, poison);
}

// The groups of a warp add their accumulators in a butterfly, (0+1)+(2+3) in group 0.
template <bool kGated>
__device__ __forceinline__ void WarpGroupSum(GradAcc& acc) {
#pragma unroll
  for (int o = kGradLanes; o < 32; o <<= 1) {  // groups g ^ 1, g ^ 2 of the warp
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      acc.down[v] += __shfl_xor_sync(0xffffffffu, acc.down[v], o);
      acc.act[v] += __shfl_xor_sync(0xffffffffu, acc.act[v], o);
      if (kGated) acc.up[v] += __shfl_xor_sync(0xffffffffu, acc.up[v], o);
    }
  }
}

template <typename E, bool kGated>
__global__ void __launch_bounds__(kGradThreads, kGradMinBlocks) TwellTrainWeightGradKernel(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ dy, const int32_t* __restrict__ seg_start,
    const int32_t* __restrict__ nrn_off, const uint4* __restrict__ records, uint16_t* __restrict__ dw_down,
    uint16_t* __restrict__ dw_act_t, uint16_t* __restrict__ dw_up_t, Shapes s) {
  __shared__ int scratch[32];
  __shared__ int total, n_hot, n_queued, next_item, max_cold;
  __shared__ int start[kMaxTile + 1];
  __shared__ bool is_hot[kMaxTile];
  __shared__ int hot_list[kHotShare], hot_count[kHotShare];
  __shared__ int class_count[kSizeClasses], class_start[kSizeClasses];
  __shared__ int queue[kMaxTile];
  __shared__ float warp_part[kGradWarps][kGradLanes][24];
  const int k = blockIdx.x / kGradSplit, part = blockIdx.x % kGradSplit, r = blockIdx.y;
  const int lane = threadIdx.x % kGradLanes, group = threadIdx.x / kGradLanes;
  const int warp = threadIdx.x / 32, in_warp = group % kWarpGroups;
  const int col = r * kGradCols + lane * 8;
  const bool over_budget = OverBudget(s, seg_start);
  const int width = TileWidth(s, k);
  const bool in_tile = static_cast<int>(threadIdx.x) < width;
  int n = 0;  // neuron threadIdx.x's entries; its list is records[start[j], start[j + 1])
  if (!over_budget) {
    const int32_t* off = nrn_off + static_cast<int64_t>(k) * (s.tile + 1);
    if (in_tile) {
      start[threadIdx.x] = off[threadIdx.x];
      n = off[threadIdx.x + 1] - off[threadIdx.x];
    }
    if (threadIdx.x == 0) start[width] = off[width];
  }
  if (threadIdx.x == 0) n_hot = next_item = max_cold = 0;
  if (threadIdx.x < kSizeClasses) class_count[threadIdx.x] = 0;
  BlockExclusiveScan(n, scratch, &total);  // ends with a barrier: the counters are set
  const bool hot = static_cast<int64_t>(kHotShare) * n > total;
  const int size_class = n > 0 ? 32 - __clz(n) : 0;
  int class_rank = 0;
  // This CTA's neurons: the tile's groups of 64 with index part, part + kGradSplit, ...
  const bool mine = (static_cast<int>(threadIdx.x) / kGradGroups) % kGradSplit == part;
  if (hot && mine) {
    const int slot = atomicAdd(&n_hot, 1);  // at most 15 (each holds over 1/16)
    hot_list[slot] = threadIdx.x;
    hot_count[slot] = n;
  } else if (in_tile && !hot) {
    if (mine) class_rank = atomicAdd(&class_count[size_class], 1);
    atomicMax(&max_cold, n);  // over the whole tile: every part decides "strided" alike
  }
  if (in_tile) is_hot[threadIdx.x] = hot;
  __syncthreads();
  // An even tile (no neuron over kSpreadTile times the tile's mean) keeps one neuron per
  // group: no warp sums, and its groups' loads are already even.
  const bool strided = static_cast<int64_t>(max_cold) * width > static_cast<int64_t>(kSpreadTile) * total;
  if (strided && threadIdx.x == 0) {  // the queue: larger classes first
    int first = 0;
    for (int c = kSizeClasses - 1; c >= 0; --c) class_start[c] = first, first += class_count[c];
    n_queued = first;
  }
  __syncthreads();
  if (strided && in_tile && !hot && mine) queue[class_start[size_class] + class_rank] = threadIdx.x;
  for (int h = 0; h < n_hot; ++h) {  // this CTA's hot neurons first, block-uniform
    const int j = hot_list[h], count = hot_count[h];
    const int a = static_cast<int>(static_cast<int64_t>(count) * group / kGradGroups);
    const int z = static_cast<int>(static_cast<int64_t>(count) * (group + 1) / kGradGroups);
    GradAcc acc = {};
    AddRecords<E, kGated>(acc, records + start[j] + a, z - a, 1, x, dy, col, s);
    WarpGroupSum<kGated>(acc);
    if (in_warp == 0) {
      float* slot = warp_part[warp][lane];
#pragma unroll
      for (int v = 0; v < 8; ++v) slot[v] = acc.down[v], slot[8 + v] = acc.act[v], slot[16 + v] = acc.up[v];
    }
    __syncthreads();
    if (threadIdx.x < kGradLanes) {
      GradAcc sum;
#pragma unroll
      for (int v = 0; v < 8; ++v) {
        sum.down[v] = warp_part[0][lane][v];
        sum.act[v] = warp_part[0][lane][8 + v];
        sum.up[v] = warp_part[0][lane][16 + v];
      }
      for (int w = 1; w < kGradWarps; ++w)
#pragma unroll
        for (int v = 0; v < 8; ++v) {
          sum.down[v] += warp_part[w][lane][v];
          sum.act[v] += warp_part[w][lane][8 + v];
          sum.up[v] += warp_part[w][lane][16 + v];
        }
      StoreGrads<E, kGated>(sum, k, j, col, false, dw_down, dw_act_t, dw_up_t, s);
    }
    __syncthreads();
  }
  __syncthreads();  // the queue is written (when there was no hot neuron)
  if (!strided) {
    for (int jj = part * kGradGroups + group; jj < width; jj += kGradGroups * kGradSplit) {
      if (is_hot[jj]) continue;
      GradAcc acc = {};
      if (!over_budget) {
        AddRecords<E, kGated>(acc, records + start[jj], start[jj + 1] - start[jj], 1, x, dy, col, s);
      }
      StoreGrads<E, kGated>(acc, k, jj, col, over_budget, dw_down, dw_act_t, dw_up_t, s);
    }
    return;
  }
  for (;;) {  // the other neurons, one per warp at a time
    int q = 0;
    if (threadIdx.x % 32 == 0) q = atomicAdd(&next_item, 1);
    q = __shfl_sync(0xffffffffu, q, 0);
    if (q >= n_queued) break;
    const int j = queue[q];
    const int a = start[j], count = start[j + 1] - a;
    GradAcc acc = {};
    if (count > in_warp)
      AddRecords<E, kGated>(acc, records + a + in_warp, (count - in_warp + kWarpGroups - 1) / kWarpGroups,
                            kWarpGroups, x, dy, col, s);
    WarpGroupSum<kGated>(acc);
    if (in_warp == 0) StoreGrads<E, kGated>(acc, k, j, col, over_budget, dw_down, dw_act_t, dw_up_t, s);
  }
}

int64_t FinishBlocks(const Shapes& s) { return std::min<int64_t>(CeilDiv(s.max_entries, 256), 132 * 16); }

template <typename E, bool kGated>
ffi::Error LaunchForward(cudaStream_t stream, const Shapes& s, const uint16_t* x, const uint16_t* values,
                         const int16_t* cols, const int32_t* counts, const uint16_t* w_act, const uint16_t* w_up,
                         const uint16_t* w_up_t, const uint16_t* w_down, uint16_t* y, int32_t* seg_start,
                         int32_t* tok_off, uint32_t* entries, uint16_t* up, uint32_t* h_words, float* partial,
                         int32_t* col_off, uint32_t* by_col, int32_t* stat_order, int32_t mma_bits) {
  // bits 2 and 3, the down and up steps as union products, and bit 4, the down step with
  // the weight stationary (before bit 2): gated only (checked)
  const bool mma = (mma_bits & 1) != 0, down_union = (mma_bits & 4) != 0, up_union = (mma_bits & 8) != 0;
  const bool down_stationary = (mma_bits & 16) != 0;
  const dim3 segments(s.n_tiles, s.n_blocks);
  TwellBlockedLayoutKernel<<<segments, kThreads, 0, stream>>>(counts, tok_off, s);
  TwellBlockedSegScanKernel<<<1, 1024, 0, stream>>>(tok_off, seg_start, s.n_blocks * s.n_tiles);
  TwellBlockedScatterKernel<uint16_t><<<segments, 256, 0, stream>>>(values, cols, counts, tok_off, seg_start,
                                                                    entries, s);
  TwellBlockedRecomputeKernel<E, kGated, kGated><<<segments, kMaxTile, s.d * 2, stream>>>(
      x, counts, w_act, w_up, tok_off, seg_start, entries, s, up);
  ffi::Error status = LaunchStatus("twell_train forward layout");
  if (status.failure()) return status;
  const uint32_t* h_source = entries;
  if constexpr (kGated) {
    if (up_union) {  // u whole in the partials' row 0, the layout after it
      status = LaunchUnionUp<E>(stream, s, tok_off, seg_start, entries, x, w_up_t, partial);
      if (status.failure()) return status;
    } else {
      LaunchUpStep<E>(stream, mma, x, w_up_t, tok_off, seg_start, entries, partial, s);
    }
    TwellTrainFinishKernel<E><<<static_cast<unsigned>(FinishBlocks(s)), 256, 0, stream>>>(
        partial, seg_start, entries, up, h_words, up_union ? 1 : s.d / kUpCols, s);
    status = LaunchStatus("twell_train forward up");
    if (status.failure()) return status;
    h_source = h_words;
  }
  if (kGated && down_stationary) {
    // The walk's layout goes into the partials' workspace too, free once TrainFinish has read it.
    // stat_order: the tokens' order for the backward's dx walk (a residual)
    status = LaunchStationaryDown<E>(stream, s, tok_off, seg_start, h_source, w_down, partial, y, stat_order,
                                     "twell_train forward");
    if (status.failure()) return status;
  } else if (kGated && down_union) {
    // The dh partials' workspace [d/64, max_entries] f32 is free once TrainFinish has read it.
    status = LaunchUnion<E, 1, kWordValues>(stream, s, tok_off, seg_start, h_source, nullptr, w_down, nullptr, partial, y,
                                     "twell_train forward down as a union product");
    if (status.failure()) return status;
  } else {
    LaunchDownStep<E>(stream, mma, w_down, tok_off, seg_start, h_source, y, s);
  }
  TwellTrainByColumnKernel<<<segments, kThreads, 0, stream>>>(tok_off, seg_start, entries, col_off, by_col, s);
  return LaunchStatus("twell_train forward down");
}

template <typename E, bool kGated>
ffi::Error LaunchBackward(cudaStream_t stream, const Shapes& s, const uint16_t* x, const uint16_t* dy,
                          const uint16_t* w_act_t, const uint16_t* w_up_t, const uint16_t* w_down,
                          const int32_t* seg_start, const int32_t* tok_off, const uint32_t* entries,
                          const uint16_t* up, const int32_t* col_off, const uint32_t* by_col, const float* l1_grad,
                          uint16_t* dx, uint16_t* dw_down, uint16_t* dw_act_t, uint16_t* dw_up_t, float* partial,
                          float* coef, int32_t* union_ws, const int32_t* stat_order, int32_t mma) {
  const bool steps_mma = (mma & 1) != 0, dx_mma = (mma & 2) != 0, dx_union = (mma & 4) != 0;
  const bool dh_union = (mma & 8) != 0, dx_stationary = (mma & 16) != 0;
  ffi::Error status = ffi::Error::Success();
  if (dh_union) {  // dh whole in the partials' row 0, the layout after it
    status = LaunchUnionUp<E, kFiredIndex>(stream, s, tok_off, seg_start, entries, dy, w_down, partial);
    if (status.failure()) return status;
  } else {
    LaunchUpStep<E, false>(stream, steps_mma, dy, w_down, tok_off, seg_start, entries, partial, s);
  }
  TwellTrainBwdFinishKernel<E, kGated><<<static_cast<unsigned>(FinishBlocks(s)), 256, 0, stream>>>(
      partial, seg_start, entries, up, l1_grad, coef, dh_union ? 1 : s.d / kUpCols, s);
  status = LaunchStatus("twell_train backward dh");
  if (status.failure()) return status;
  if (dx_stationary) {
    // Wact^T's rows, then (gated) Wu^T's in a second walk, staged from Wact and Wu [d, f]
    // (w_act_t and w_up_t hold the weights themselves here); the layouts and the first
    // walk's sums in the partials (free once BwdFinish has read them)
    status = LaunchStationaryDx<E, kGated>(stream, s, tok_off, seg_start, entries, coef, w_act_t, w_up_t,
                                           reinterpret_cast<int32_t*>(partial), dx, stat_order,
                                           "twell_train backward dx");
    if (status.failure()) return status;
  } else if (dx_union) {
    status = LaunchUnion<E, kGated ? 2 : 1, kCoefValues>(stream, s, tok_off, seg_start, entries, coef, w_act_t, w_up_t,
                                                   union_ws, dx, "twell_train backward dx as a union product");
    if (status.failure()) return status;
  } else if (dx_mma) {
    const int smem = kDxMmaStages * (kGated ? 2 : 1) * kSlab64Bytes;
    cudaFuncSetAttribute(TwellTrainDxMmaKernel<E, kGated>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    TwellTrainDxMmaKernel<E, kGated><<<dim3(s.d / kUpCols, s.n_blocks * (kBlockTokens / kDownMmaHalf)), kFlatThreads,
                                       smem, stream>>>(w_act_t, w_up_t, tok_off, seg_start, entries, coef, dx, s);
  } else {
    const int smem = DxStages<kGated>::Bytes(s.n_tiles);
    cudaFuncSetAttribute(TwellTrainDxKernel<E, kGated>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    TwellTrainDxKernel<E, kGated><<<dim3(s.d / kDownCols, s.n_blocks), kThreads, smem, stream>>>(
        w_act_t, w_up_t, tok_off, seg_start, entries, coef, dx, s);
  }
  status = LaunchStatus("twell_train backward dx");
  if (status.failure()) return status;
  // The weight gradients' lists go into the union layout's workspace, free once dx is done
  // (sized for both).
  const GradWorkspace lists = GradWorkspaceOf(s, union_ws);
  TwellTrainGradOffsetsKernel<<<s.n_tiles, kMaxTile, 0, stream>>>(seg_start, col_off, lists.nrn_off, lists.dstart, s);
  TwellTrainGradRecordsKernel<kGated><<<dim3(s.n_tiles, s.n_blocks), 256, 0, stream>>>(
      seg_start, col_off, by_col, coef, lists.dstart, lists.records, s);
  TwellTrainWeightGradKernel<E, kGated><<<dim3(s.n_tiles * kGradSplit, s.d / kGradCols), kGradThreads, 0, stream>>>(
      x, dy, seg_start, lists.nrn_off, lists.records, dw_down, dw_act_t, dw_up_t, s);
  return LaunchStatus("twell_train backward weight gradients");
}

// Shape checks shared by both passes: x [..., d] (rows flattened), weights [f, d] or [d, f],
// the layout workspace; returns the Shapes (capacity 0 where unknown) or an error message.
struct Checked {
  Shapes s;
  std::string error;
};

Checked CheckLayout(const char* name, ffi::AnyBuffer x, int64_t f, int32_t tile, int64_t capacity, int64_t seg_count,
                    int64_t tok_count, int64_t max_entries) {
  Checked c{};
  auto fail = [&](const std::string& m) {
    c.error = std::string(name) + m;
    return c;
  };
  auto x_dims = x.dimensions();
  if (x_dims.size() < 1) return fail("x must have shape [..., d]");
  const int64_t d = x_dims.back();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < x_dims.size(); ++i) rows *= x_dims[i];
  if (x.element_type() != ffi::DataType::BF16 && x.element_type() != ffi::DataType::F16)
    return fail("x must be bf16 or f16 (f32 runs the dense path)");
  if (f <= 0 || tile <= 0 || tile % 32 != 0 || tile > kMaxTile)
    return fail("tile must be a multiple of 32 and at most 256, and f positive");
  const int64_t n_tiles = CeilDiv(f, tile);
  if (n_tiles > kMaxTiles) return fail("ceil(f / tile) must be at most 4096");
  if (d % kUpCols != 0 || d > 16384) return fail("d must be a multiple of 64 and at most 16384, got " + std::to_string(d));
  if (rows * f >= (int64_t{1} << 31)) return fail("tokens x f must be below 2^31");
  const int64_t n_blocks = CeilDiv(rows, kBlockTokens);
  if (seg_count != n_blocks * n_tiles + 1 || tok_count != n_blocks * n_tiles * (kBlockTokens + 1) ||
      max_entries < 1 || max_entries >= (int64_t{1} << 31))
    return fail("layout buffers must be seg_start [ceil(M/1024)*n_tiles + 1], tok_off [ceil(M/1024), n_tiles, "
                "1025] and entries [max_entries >= 1]");
  c.s = Shapes{rows, static_cast<int>(d), static_cast<int>(f), tile, static_cast<int>(capacity),
               static_cast<int>(n_tiles), static_cast<int>(n_blocks), max_entries};
  return c;
}

bool SameType(ffi::DataType t, std::initializer_list<ffi::DataType> others) {
  for (auto o : others)
    if (o != t) return false;
  return true;
}

template <bool kGated>
ffi::Error ForwardImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::Buffer<ffi::S16> cols,
                       ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_act, ffi::AnyBuffer w_up,
                       ffi::AnyBuffer w_up_t, ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::Buffer<ffi::S32>> seg_start, ffi::Result<ffi::Buffer<ffi::S32>> tok_off,
                       ffi::Result<ffi::Buffer<ffi::U32>> entries, uint16_t* up, int64_t up_count,
                       uint32_t* h_words, int64_t h_count, float* partial, int64_t partial_count,
                       ffi::Result<ffi::Buffer<ffi::S32>> col_off, ffi::Result<ffi::Buffer<ffi::U32>> by_col,
                       int32_t* stat_order, int64_t stat_order_count, int32_t tile, int32_t mma) {
  const char* name = "twell_train forward: ";
  auto a_dims = w_act.dimensions();
  if (a_dims.size() != 2 || x.dimensions().size() < 1 || a_dims[0] != x.dimensions().back())
    return Invalid(std::string(name) + "the activation weight must be [d, f]");
  const int64_t d = a_dims[0], f = a_dims[1];
  auto v_dims = values.dimensions();
  const auto x_dims = x.dimensions();
  if (v_dims.size() != x_dims.size() + 1)
    return Invalid(std::string(name) + "values must have shape [..., n_tiles, capacity] for x [..., d]");
  const int64_t capacity = v_dims.back();
  Checked c = CheckLayout(name, x, f, tile, capacity, seg_start->element_count(), tok_off->element_count(),
                          entries->element_count());
  if (!c.error.empty()) return Invalid(c.error);
  const Shapes& s = c.s;
  bool ok = v_dims[v_dims.size() - 2] == s.n_tiles && cols.dimensions().size() == v_dims.size() &&
            counts.dimensions().size() == x_dims.size() && counts.dimensions().back() == s.n_tiles;
  for (size_t i = 0; ok && i < v_dims.size(); ++i) ok = cols.dimensions()[i] == v_dims[i];
  for (size_t i = 0; ok && i + 1 < x_dims.size(); ++i)
    ok = v_dims[i] == x_dims[i] && counts.dimensions()[i] == x_dims[i];
  if (!ok) return Invalid(std::string(name) + "values/cols/counts must be the TwELL of x's rows with this tile");
  if (!SameDims(w_down.dimensions(), {f, d}) ||
      (kGated && (!SameDims(w_up.dimensions(), {d, f}) || !SameDims(w_up_t.dimensions(), {f, d}))))
    return Invalid(std::string(name) + "w_up must be [d, f], w_up_t and w_down [f, d]");
  const auto dt = x.element_type();
  if (!SameType(dt, {values.element_type(), w_act.element_type(), w_down.element_type(), y->element_type()}) ||
      (kGated && !SameType(dt, {w_up.element_type(), w_up_t.element_type()})))
    return Invalid(std::string(name) + "x, values, weights and y must share one dtype");
  const int64_t e = s.max_entries;
  if (col_off->element_count() != s.n_blocks * s.n_tiles * (tile + 1) || by_col->element_count() != e ||
      (kGated && (up_count != e || h_count != e || partial_count != s.d / kUpCols * e)))
    return Invalid(std::string(name) + "residual/workspace results must be col_off [blocks, n_tiles, tile + 1], "
                   "by_col, up, h_words [max_entries] and partial [d/64, max_entries]");
  // gated: the tokens' order of the down walk (mma bit 4) for the backward, else one unused word
  if (kGated && stat_order_count != ((mma & 16) != 0 ? StatOrderWords(s) : 1))
    return Invalid(std::string(name) + "stat_order must have " +
                   std::to_string((mma & 16) != 0 ? StatOrderWords(s) : 1) +
                   " elements (the down walk's token order with mma bit 4, else 1)");
  if (s.rows == 0) return ffi::Error::Success();
  auto u16 = [](const void* p) { return static_cast<const uint16_t*>(p); };
  const uint16_t* wu = kGated ? u16(w_up.untyped_data()) : nullptr;
  const uint16_t* wut = kGated ? u16(w_up_t.untyped_data()) : nullptr;
  if (const char* refusal = UnionStepsRefusal(s, kGated, mma)) return Invalid(std::string(name) + refusal);
  if (const char* refusal = StationaryDownRefusal(s, kGated, mma)) return Invalid(std::string(name) + refusal);
  auto* launch = dt == ffi::DataType::BF16 ? LaunchForward<Bf16, kGated> : LaunchForward<F16, kGated>;
  return launch(stream, s, u16(x.untyped_data()), u16(values.untyped_data()), cols.typed_data(),
                counts.typed_data(), u16(w_act.untyped_data()), wu, wut, u16(w_down.untyped_data()),
                static_cast<uint16_t*>(y->untyped_data()), seg_start->typed_data(), tok_off->typed_data(),
                entries->typed_data(), up, h_words, partial, col_off->typed_data(), by_col->typed_data(),
                (mma & 16) != 0 ? stat_order : nullptr, mma);
}

template <bool kGated>
ffi::Error BackwardImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer w_act_t,
                        ffi::AnyBuffer w_up_t, ffi::AnyBuffer w_down, ffi::Buffer<ffi::S32> seg_start,
                        ffi::Buffer<ffi::S32> tok_off, ffi::Buffer<ffi::U32> entries, const uint16_t* up,
                        int64_t up_count, ffi::Buffer<ffi::S32> col_off, ffi::Buffer<ffi::U32> by_col,
                        ffi::Buffer<ffi::F32> l1_grad, ffi::Result<ffi::AnyBuffer> dx,
                        ffi::Result<ffi::AnyBuffer> dw_down, ffi::Result<ffi::AnyBuffer> dw_act_t,
                        uint16_t* dw_up_t, ffi::Result<ffi::Buffer<ffi::F32>> partial,
                        ffi::Result<ffi::Buffer<ffi::F32>> coef, ffi::Result<ffi::Buffer<ffi::S32>> union_ws,
                        const int32_t* stat_order, int64_t stat_order_count, int32_t tile, int32_t mma) {
  const char* name = "twell_train backward: ";
  auto wd_dims = w_down.dimensions();
  if (wd_dims.size() != 2 || x.dimensions().size() < 1 || wd_dims[1] != x.dimensions().back())
    return Invalid(std::string(name) + "w_down must be [f, d]");
  const int64_t f = wd_dims[0], d = wd_dims[1];
  Checked c = CheckLayout(name, x, f, tile, 0, seg_start.element_count(), tok_off.element_count(),
                          entries.element_count());
  if (!c.error.empty()) return Invalid(c.error);
  const Shapes& s = c.s;
  const int64_t e = s.max_entries;
  if (dy.dimensions().size() != x.dimensions().size() || dx->dimensions().size() != x.dimensions().size())
    return Invalid(std::string(name) + "dy and dx must have x's shape");
  for (size_t i = 0; i < x.dimensions().size(); ++i)
    if (dy.dimensions()[i] != x.dimensions()[i] || dx->dimensions()[i] != x.dimensions()[i])
      return Invalid(std::string(name) + "dy and dx must have x's shape");
  // With mma bit 4 (dx by the stationary walk) the weights come in their own layout [d, f],
  // which the walk stages from directly; the other dx steps read their transposes [f, d].
  const bool weights_df = (mma & 16) != 0;
  auto weight_ok = [&](ffi::AnyBuffer w) {
    return weights_df ? SameDims(w.dimensions(), {d, f}) : SameDims(w.dimensions(), {f, d});
  };
  if (!weight_ok(w_act_t) || (kGated && !weight_ok(w_up_t)))
    return Invalid(std::string(name) + (weights_df ? "with mma bit 4 the weights (w_gate or, not gated, w_up; w_up) "
                                                     "must be [d, f], in their own layout"
                                                   : "transposed weights must be [f, d]"));
  if (!SameDims(dw_down->dimensions(), {f, d}) || !SameDims(dw_act_t->dimensions(), {f, d}))
    return Invalid(std::string(name) + "weight gradients must be [f, d]");
  const auto dt = x.element_type();
  if (!SameType(dt, {dy.element_type(), w_act_t.element_type(), w_down.element_type(), dx->element_type(),
                     dw_down->element_type(), dw_act_t->element_type()}) ||
      (kGated && w_up_t.element_type() != dt))
    return Invalid(std::string(name) + "x, dy, weights and gradients must share one dtype");
  if (col_off.element_count() != s.n_blocks * s.n_tiles * (tile + 1) || by_col.element_count() != e ||
      (kGated && up_count != e) || l1_grad.element_count() != 1 ||
      partial->element_count() != s.d / kUpCols * e || coef->element_count() != (kGated ? 3 : 2) * e)
    return Invalid(std::string(name) + "residuals must match the forward's (col_off, by_col, up [max_entries]), "
                   "l1_grad [1], partial [d/64, max_entries], coef [3 or 2, max_entries]");
  if ((mma & 8) != 0 && !UnionUpSupported(s))
    return Invalid(std::string(name) + "the dh step as a union product (mma bit 3) needs f at most 65536 and its "
                   "layout (~4 words per entry: d at least 320) within rows 1.. of the partials [d/64, max_entries]");
  if ((mma & 16) != 0 && !StationaryWalkSupported(s, kGated ? 2 : 1, s.d / kUpCols * e))
    return Invalid(std::string(name) + "dx with the weights stationary (mma bit 4) needs f at most 14524, d a "
                   "multiple of 16 (of 8 where f is past 7264) and its workspace (the walk's layout; gated, a second "
                   "layout and an [M, d] f32 buffer) within the partials [d/64, max_entries]");
  int64_t need = GradWorkspaceOf(s, nullptr).ints;  // the weight gradients' lists
  if ((mma & 4) != 0) {
    if (!UnionDxSupported(s, kGated ? 2 : 1))
      return Invalid(std::string(name) + "dx as a union product (mma bit 2) needs d a multiple of 256, f at most "
                     "65536 and its layout below 2^31 words");
    need = std::max(need, UnionLayoutOf(s, kGated ? 2 : 1, nullptr).ints);
  }
  if (union_ws->element_count() != need)
    return Invalid(std::string(name) + "union_ws must have " + std::to_string(need) +
                   " elements (the weight gradients' lists and, with mma bit 2, dx's union layout)");
  if (s.rows == 0) {
    // No tokens: the weight gradients are zero (nothing else to write).
    cudaMemsetAsync(dw_down->untyped_data(), 0, f * d * 2, stream);
    cudaMemsetAsync(dw_act_t->untyped_data(), 0, f * d * 2, stream);
    if (kGated) cudaMemsetAsync(dw_up_t, 0, f * d * 2, stream);
    return LaunchStatus("twell_train backward zero gradients");
  }
  auto u16 = [](const void* p) { return static_cast<const uint16_t*>(p); };
  auto* launch = dt == ffi::DataType::BF16 ? LaunchBackward<Bf16, kGated> : LaunchBackward<F16, kGated>;
  return launch(stream, s, u16(x.untyped_data()), u16(dy.untyped_data()), u16(w_act_t.untyped_data()),
                kGated ? u16(w_up_t.untyped_data()) : nullptr, u16(w_down.untyped_data()), seg_start.typed_data(),
                tok_off.typed_data(), entries.typed_data(), up, col_off.typed_data(), by_col.typed_data(),
                l1_grad.typed_data(), static_cast<uint16_t*>(dx->untyped_data()),
                static_cast<uint16_t*>(dw_down->untyped_data()), static_cast<uint16_t*>(dw_act_t->untyped_data()),
                dw_up_t, partial->typed_data(), coef->typed_data(), union_ws->typed_data(),
                // the forward down walk's token order, where it kept one (the same counts: the
                // same order); else S1-S4 compute it
                (mma & 16) != 0 && stat_order_count == StatOrderWords(s) ? stat_order : nullptr, mma);
}

ffi::Error ForwardGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::Buffer<ffi::S16> cols,
                        ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                        ffi::AnyBuffer w_up_t, ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::Buffer<ffi::S32>> seg_start, ffi::Result<ffi::Buffer<ffi::S32>> tok_off,
                        ffi::Result<ffi::Buffer<ffi::U32>> entries, ffi::Result<ffi::Buffer<ffi::U16>> up,
                        ffi::Result<ffi::Buffer<ffi::U32>> h_words, ffi::Result<ffi::Buffer<ffi::F32>> partial,
                        ffi::Result<ffi::Buffer<ffi::S32>> col_off, ffi::Result<ffi::Buffer<ffi::U32>> by_col,
                        ffi::Result<ffi::Buffer<ffi::S32>> stat_order, int32_t tile, int32_t mma) {
  return ForwardImpl<true>(stream, x, values, cols, counts, w_gate, w_up, w_up_t, w_down, y, seg_start, tok_off,
                           entries, up->typed_data(), up->element_count(), h_words->typed_data(),
                           h_words->element_count(), partial->typed_data(), partial->element_count(), col_off,
                           by_col, stat_order->typed_data(), stat_order->element_count(), tile, mma);
}

ffi::Error ForwardUngated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::Buffer<ffi::S16> cols,
                          ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> seg_start,
                          ffi::Result<ffi::Buffer<ffi::S32>> tok_off, ffi::Result<ffi::Buffer<ffi::U32>> entries,
                          ffi::Result<ffi::Buffer<ffi::S32>> col_off, ffi::Result<ffi::Buffer<ffi::U32>> by_col,
                          int32_t tile, int32_t mma) {
  return ForwardImpl<false>(stream, x, values, cols, counts, w_up, w_up, w_down, w_down, y, seg_start, tok_off,
                            entries, nullptr, 0, nullptr, 0, nullptr, 0, col_off, by_col, nullptr, 0, tile, mma);
}

ffi::Error BackwardGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer w_gate_t,
                         ffi::AnyBuffer w_up_t, ffi::AnyBuffer w_down, ffi::Buffer<ffi::S32> seg_start,
                         ffi::Buffer<ffi::S32> tok_off, ffi::Buffer<ffi::U32> entries, ffi::Buffer<ffi::U16> up,
                         ffi::Buffer<ffi::S32> col_off, ffi::Buffer<ffi::U32> by_col, ffi::Buffer<ffi::F32> l1_grad,
                         ffi::Buffer<ffi::S32> stat_order, ffi::Result<ffi::AnyBuffer> dx,
                         ffi::Result<ffi::AnyBuffer> dw_down,
                         ffi::Result<ffi::AnyBuffer> dw_gate_t, ffi::Result<ffi::AnyBuffer> dw_up_t,
                         ffi::Result<ffi::Buffer<ffi::F32>> partial, ffi::Result<ffi::Buffer<ffi::F32>> coef,
                         ffi::Result<ffi::Buffer<ffi::S32>> union_ws, int32_t tile, int32_t mma) {
  if (!SameDims(dw_up_t->dimensions(), {w_down.dimensions()[0], w_down.dimensions().back()}) ||
      dw_up_t->element_type() != x.element_type())
    return Invalid("twell_train backward: dw_up_t must be [f, d] of x's dtype");
  return BackwardImpl<true>(stream, x, dy, w_gate_t, w_up_t, w_down, seg_start, tok_off, entries, up.typed_data(),
                            up.element_count(), col_off, by_col, l1_grad, dx, dw_down, dw_gate_t,
                            static_cast<uint16_t*>(dw_up_t->untyped_data()), partial, coef, union_ws,
                            stat_order.typed_data(), stat_order.element_count(), tile, mma);
}

ffi::Error BackwardUngated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer dy, ffi::AnyBuffer w_up_t,
                           ffi::AnyBuffer w_down, ffi::Buffer<ffi::S32> seg_start, ffi::Buffer<ffi::S32> tok_off,
                           ffi::Buffer<ffi::U32> entries, ffi::Buffer<ffi::S32> col_off, ffi::Buffer<ffi::U32> by_col,
                           ffi::Buffer<ffi::F32> l1_grad, ffi::Result<ffi::AnyBuffer> dx,
                           ffi::Result<ffi::AnyBuffer> dw_down, ffi::Result<ffi::AnyBuffer> dw_up_t,
                           ffi::Result<ffi::Buffer<ffi::F32>> partial, ffi::Result<ffi::Buffer<ffi::F32>> coef,
                           ffi::Result<ffi::Buffer<ffi::S32>> union_ws, int32_t tile, int32_t mma) {
  return BackwardImpl<false>(stream, x, dy, w_up_t, w_up_t, w_down, seg_start, tok_off, entries, nullptr, 0, col_off,
                             by_col, l1_grad, dx, dw_down, dw_up_t, nullptr, partial, coef, union_ws, nullptr, 0, tile,
                             mma);
}

}  // namespace
}  // namespace jax_twell

namespace ffi_api = xla::ffi;

// The handlers only launch work on the stream (no host synchronisation): XLA may capture
// them into its CUDA graphs, conditionals included.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellTrainFwdGated, jax_twell::ForwardGated,
                              ffi_api::Ffi::Bind()
                                  .Ctx<ffi_api::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi_api::AnyBuffer>()                 // x [..., d]
                                  .Arg<ffi_api::AnyBuffer>()                 // values
                                  .Arg<ffi_api::Buffer<ffi_api::S16>>()      // cols
                                  .Arg<ffi_api::Buffer<ffi_api::S32>>()      // counts
                                  .Arg<ffi_api::AnyBuffer>()                 // w_gate [d, f]
                                  .Arg<ffi_api::AnyBuffer>()                 // w_up [d, f]
                                  .Arg<ffi_api::AnyBuffer>()                 // w_up_t [f, d]
                                  .Arg<ffi_api::AnyBuffer>()                 // w_down [f, d]
                                  .Ret<ffi_api::AnyBuffer>()                 // y
                                  .Ret<ffi_api::Buffer<ffi_api::S32>>()      // seg_start
                                  .Ret<ffi_api::Buffer<ffi_api::S32>>()      // tok_off
                                  .Ret<ffi_api::Buffer<ffi_api::U32>>()      // entries (g words)
                                  .Ret<ffi_api::Buffer<ffi_api::U16>>()      // up (u bits)
                                  .Ret<ffi_api::Buffer<ffi_api::U32>>()      // h_words (workspace)
                                  .Ret<ffi_api::Buffer<ffi_api::F32>>()      // partial (workspace)
                                  .Ret<ffi_api::Buffer<ffi_api::S32>>()      // col_off
                                  .Ret<ffi_api::Buffer<ffi_api::U32>>()      // by_col
                                  .Ret<ffi_api::Buffer<ffi_api::S32>>()      // stat_order (mma bit 4; else [1])
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("mma"),  // bit 0: up/down steps on tensor cores; bits 2, 3: down, up as union products
                              {ffi_api::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellTrainFwd, jax_twell::ForwardUngated,
                              ffi_api::Ffi::Bind()
                                  .Ctx<ffi_api::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi_api::AnyBuffer>()                 // x
                                  .Arg<ffi_api::AnyBuffer>()                 // values
                                  .Arg<ffi_api::Buffer<ffi_api::S16>>()      // cols
                                  .Arg<ffi_api::Buffer<ffi_api::S32>>()      // counts
                                  .Arg<ffi_api::AnyBuffer>()                 // w_up [d, f]
                                  .Arg<ffi_api::AnyBuffer>()                 // w_down [f, d]
                                  .Ret<ffi_api::AnyBuffer>()                 // y
                                  .Ret<ffi_api::Buffer<ffi_api::S32>>()      // seg_start
                                  .Ret<ffi_api::Buffer<ffi_api::S32>>()      // tok_off
                                  .Ret<ffi_api::Buffer<ffi_api::U32>>()      // entries
                                  .Ret<ffi_api::Buffer<ffi_api::S32>>()      // col_off
                                  .Ret<ffi_api::Buffer<ffi_api::U32>>()      // by_col
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("mma"),  // 1: up/down steps on tensor cores
                              {ffi_api::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellTrainBwdGated, jax_twell::BackwardGated,
                              ffi_api::Ffi::Bind()
                                  .Ctx<ffi_api::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi_api::AnyBuffer>()                 // x
                                  .Arg<ffi_api::AnyBuffer>()                 // dy
                                  .Arg<ffi_api::AnyBuffer>()                 // w_gate_t [f, d]
                                  .Arg<ffi_api::AnyBuffer>()                 // w_up_t [f, d]
                                  .Arg<ffi_api::AnyBuffer>()                 // w_down [f, d]
                                  .Arg<ffi_api::Buffer<ffi_api::S32>>()      // seg_start
                                  .Arg<ffi_api::Buffer<ffi_api::S32>>()      // tok_off
                                  .Arg<ffi_api::Buffer<ffi_api::U32>>()      // entries
                                  .Arg<ffi_api::Buffer<ffi_api::U16>>()      // up
                                  .Arg<ffi_api::Buffer<ffi_api::S32>>()      // col_off
                                  .Arg<ffi_api::Buffer<ffi_api::U32>>()      // by_col
                                  .Arg<ffi_api::Buffer<ffi_api::F32>>()      // l1_grad [1] = dl1 / M
                                  .Arg<ffi_api::Buffer<ffi_api::S32>>()      // stat_order (the forward's, or [1])
                                  .Ret<ffi_api::AnyBuffer>()                 // dx
                                  .Ret<ffi_api::AnyBuffer>()                 // dw_down [f, d]
                                  .Ret<ffi_api::AnyBuffer>()                 // dw_gate_t [f, d]
                                  .Ret<ffi_api::AnyBuffer>()                 // dw_up_t [f, d]
                                  .Ret<ffi_api::Buffer<ffi_api::F32>>()      // partial (workspace)
                                  .Ret<ffi_api::Buffer<ffi_api::F32>>()      // coef (workspace)
                                  .Ret<ffi_api::Buffer<ffi_api::S32>>()      // union_ws (workspace: gradient lists, union layout)
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("mma"),  // bit 0: dh step on tensor cores; bit 1: dx too; bit 2: dx, bit 3: dh as union products
                              {ffi_api::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellTrainBwd, jax_twell::BackwardUngated,
                              ffi_api::Ffi::Bind()
                                  .Ctx<ffi_api::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi_api::AnyBuffer>()                 // x
                                  .Arg<ffi_api::AnyBuffer>()                 // dy
                                  .Arg<ffi_api::AnyBuffer>()                 // w_up_t [f, d]
                                  .Arg<ffi_api::AnyBuffer>()                 // w_down [f, d]
                                  .Arg<ffi_api::Buffer<ffi_api::S32>>()      // seg_start
                                  .Arg<ffi_api::Buffer<ffi_api::S32>>()      // tok_off
                                  .Arg<ffi_api::Buffer<ffi_api::U32>>()      // entries
                                  .Arg<ffi_api::Buffer<ffi_api::S32>>()      // col_off
                                  .Arg<ffi_api::Buffer<ffi_api::U32>>()      // by_col
                                  .Arg<ffi_api::Buffer<ffi_api::F32>>()      // l1_grad [1]
                                  .Ret<ffi_api::AnyBuffer>()                 // dx
                                  .Ret<ffi_api::AnyBuffer>()                 // dw_down [f, d]
                                  .Ret<ffi_api::AnyBuffer>()                 // dw_up_t [f, d]
                                  .Ret<ffi_api::Buffer<ffi_api::F32>>()      // partial (workspace)
                                  .Ret<ffi_api::Buffer<ffi_api::F32>>()      // coef (workspace)
                                  .Ret<ffi_api::Buffer<ffi_api::S32>>()      // union_ws (workspace: gradient lists, union layout)
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("mma"),  // bit 0: dh step on tensor cores; bit 1: dx too; bit 2: dx, bit 3: dh as union products
                              {ffi_api::Traits::kCmdBufferCompatible});
