// The down step with the weight stationary in shared memory (mma bit 4 of the gated blocked
// handler): y = h @ Wd where each CTA owns 16 output columns, keeps Wd[:, c0 : c0 + 16]
// (f x 32 bytes) in shared memory for the whole launch, and walks every token's h entries.
// The weight crosses L2 once (|Wd|) instead of once per token block's union; what bounds
// the step is one random 32-byte row read from shared memory per (token, neuron) pair.
// ffi/notes/limits.md ("A fourth family") has the probe runs behind the design.
//
// The walk needs the entries in a layout of its own, built from the blocked layout's h
// entries (after Finish) by five small launches, all in the partials' workspace:
//   S1 StatKeys     grid (chunk of 1024 tokens): per token c = its entries (the stored
//                   count, or the tile width for an overflowed tile, summed over tiles),
//                   key = ceil(c / 4); per chunk a histogram of keys and each token's rank
//                   among the chunk's tokens of its key (stable: token order; match_any in
//                   a warp, a prefix over the warps' counts per key across them).
//   S2 StatScan     one CTA: exclusive prefix over (key descending, chunk ascending), 8,192
//                   values at a time through shared memory.
//   S3 StatOrder    grid (chunk): rank of each token = its key's offset + its rank in the
//                   chunk; order[rank] = token; the key of each group's first token.
//   S4 StatGroups   one CTA: goff = exclusive prefix of 64 x (the group's first key) over
//                   groups of 16 consecutive ranks (the tokens sorted by count,
//                   descending, so a group's rows have about the same length).
//   S5 StatScatter  a warp per token, a lane per tile: its h words to its group's block of the walk layout,
//                   (h bits << 16 | neuron), step j of the group's token i at word
//                   goff[g] + 64 (j / 4) + 4 i + j % 4, zero words to the group's length.
//                   Step order: the entries taken round by round over the four residues
//                   of the neuron mod 4, starting at residue i % 4 (the q-th entry of residue
//                   r goes to step sum_r' min(c_r', q + [(r' - i) % 4 < (r - i) % 4])), so the
//                   four tokens of a shared-memory phase tend to read four different
//                   32-byte slots of a 128-byte line.
//   S6 StatDown     grid (d / 16), 1,024 threads: a warp per group, two threads per token
//                   (8 columns each), four steps per 128-bit load of the layout, f32 FMAs
//                   in step order; y rounded once. Deterministic; no atomics in any output.
// jax_twell/ops/stationary_emulation.py models S1-S6 (order, layout and arithmetic).
#pragma once

#include <cstdint>

#include "common.h"
#include "elements.cuh"
#include "twell_blocked.cuh"

namespace jax_twell {
namespace {

constexpr int kStatCols = 16;      // output columns a CTA owns
constexpr int kStatThreads = 1024;  // S6: 32 warps, one group of 16 tokens each at a time
constexpr int kStatGroup = 16;      // tokens a warp walks together
constexpr int kStatChunk = 1024;    // tokens a CTA of S1 and S3
constexpr int kStatKeys = 2048;     // sort keys ceil(c / 4) < kStatKeys: c <= f <= kStatMaxF
constexpr int kStatScanTile = 8192;  // S2's values staged in shared memory at a time
constexpr int kStatSmemLimit = 232448;
constexpr int kStatMaxF = kStatSmemLimit / (2 * kStatCols);  // 7,264 neurons
constexpr int kStatKeysSmem = kStatChunk / 32 * kStatKeys * 2;  // S1's per-warp counts (16-bit)

// Offsets (in 32-bit words) of the walk's workspace, carved from the partials.
struct StatLayout {
  int64_t hist, info, order, goff, glay, glay_words, total;
};

__host__ __device__ inline StatLayout StatLayoutOf(int64_t rows, int f, int64_t max_entries) {
  const int64_t chunks = (rows + kStatChunk - 1) / kStatChunk;
  const int64_t groups = (rows + kStatGroup - 1) / kStatGroup;
  StatLayout l;
  l.hist = 0;
  l.info = l.hist + chunks * kStatKeys;
  l.order = l.info + rows;
  l.goff = l.order + groups * kStatGroup;
  l.glay = (l.goff + groups + 1 + 3) / 4 * 4;  // 16-byte aligned
  // sum over groups of 64 x the first (longest) row's key <= 16 (f + 3) + sum over tokens of
  // (c + 3): each later group's key is at most every key of the group before it
  l.glay_words = (max_entries + 3 * rows + 16 * (static_cast<int64_t>(f) + 3) + 3) / 4 * 4;
  l.total = l.glay + l.glay_words;
  return l;
}

// The handler's test (mma bit 4): the gated FFN, bf16 or f16, d a multiple of 16, the
// slice within shared memory, neurons within 16 bits, the workspace within the partials.
inline bool StationaryDownSupported(const Shapes& s) {
  return s.d % kStatCols == 0 && s.f <= kStatMaxF &&
         StatLayoutOf(s.rows, s.f, s.max_entries).total <= static_cast<int64_t>(s.d / kUpCols) * s.max_entries;
}

__device__ __forceinline__ int Reserved(const Shapes& s, const int32_t* counts, int64_t t, int k) {
  const int c = counts[t * s.n_tiles + k];
  return c > s.capacity ? TileWidth(s, k) : c;
}

// S1. Ranks within the chunk among tokens of the same key, in token order: within a warp
// by match_any, across warps by a prefix over the warps' counts per key (16-bit counts in
// dynamic shared memory, kStatKeysSmem bytes).
__global__ void __launch_bounds__(kStatChunk) StatKeysKernel(const int32_t* __restrict__ counts,
                                                             const int32_t* __restrict__ seg_start,
                                                             int32_t* __restrict__ ws, Shapes s) {
  extern __shared__ __align__(16) uint16_t wcount[];  // [warp][key]
  if (OverBudget(s, seg_start)) return;
  const StatLayout l = StatLayoutOf(s.rows, s.f, s.max_entries);
  const int64_t chunks = (s.rows + kStatChunk - 1) / kStatChunk;
  const int64_t groups = (s.rows + kStatGroup - 1) / kStatGroup;
  for (int i = threadIdx.x; i < kStatKeysSmem / 4; i += blockDim.x) reinterpret_cast<uint32_t*>(wcount)[i] = 0u;
  // group lengths start at 0 (S3 takes their maximum): this chunk's share of the groups
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * (kStatChunk / kStatGroup) + threadIdx.x;
       g < groups && g < static_cast<int64_t>(blockIdx.x + 1) * (kStatChunk / kStatGroup); g += blockDim.x)
    ws[l.goff + g] = 0;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kStatChunk + threadIdx.x;
  const bool valid = t < s.rows;
  int c = 0;
  if (valid)
    for (int k = 0; k < s.n_tiles; ++k) c += Reserved(s, counts, t, k);
  const int key = (c + 3) / 4;  // < kStatKeys: c <= f <= kStatMaxF
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned valid_lanes = __ballot_sync(kFullMask, valid);
  __syncthreads();
  int wrank = 0;
  if (valid) {
    const unsigned peers = __match_any_sync(valid_lanes, key);
    wrank = __popc(peers & ((1u << lane) - 1u));
    if (lane == __ffs(peers) - 1) wcount[warp * kStatKeys + key] = static_cast<uint16_t>(__popc(peers));
  }
  __syncthreads();
  for (int k = threadIdx.x; k < kStatKeys; k += blockDim.x) {  // per key: prefix over the warps, the total
    int run = 0;
    for (int w = 0; w < kStatChunk / 32; ++w) {
      const int v = wcount[w * kStatKeys + k];
      wcount[w * kStatKeys + k] = static_cast<uint16_t>(run);
      run += v;
    }
    ws[l.hist + static_cast<int64_t>(kStatKeys - 1 - k) * chunks + blockIdx.x] = run;  // in S2's order
  }
  __syncthreads();
  if (valid) ws[l.info + t] = key << 10 | (wcount[warp * kStatKeys + key] + wrank);
}

// S2. In place over hist, stored by S1 in the order of the prefix (key descending, chunk
// ascending): the exclusive prefix, kStatScanTile values at a time through shared memory.
__global__ void __launch_bounds__(1024) StatScanKernel(const int32_t* __restrict__ seg_start, int32_t* __restrict__ ws,
                                                       Shapes s) {
  __shared__ int vals[kStatScanTile];
  __shared__ int scratch[32];
  __shared__ int total;
  if (OverBudget(s, seg_start)) return;
  const int64_t n = (s.rows + kStatChunk - 1) / kStatChunk * kStatKeys;
  constexpr int kPer = kStatScanTile / 1024;
  int carry = 0;
  for (int64_t p0 = 0; p0 < n; p0 += kStatScanTile) {
    int32_t* h = ws + p0;  // hist starts the workspace
    const int len = n - p0 < kStatScanTile ? static_cast<int>(n - p0) : kStatScanTile;
    for (int i = threadIdx.x; i < kStatScanTile; i += blockDim.x) vals[i] = i < len ? h[i] : 0;
    __syncthreads();
    int sum = 0;
#pragma unroll
    for (int j = 0; j < kPer; ++j) sum += vals[threadIdx.x * kPer + j];
    int run = carry + BlockExclusiveScan(sum, scratch, &total);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int v = vals[threadIdx.x * kPer + j];
      vals[threadIdx.x * kPer + j] = run;
      run += v;
    }
    carry += total;
    __syncthreads();
    for (int i = threadIdx.x; i < len; i += blockDim.x) h[i] = vals[i];
    __syncthreads();
  }
}

// S3. info[t] becomes the token's rank; goff[g] the longest row's key of group g (a
// maximum, the same whatever the atomics' order: the first token's key).
__global__ void __launch_bounds__(kStatChunk) StatOrderKernel(const int32_t* __restrict__ seg_start,
                                                              int32_t* __restrict__ ws, Shapes s) {
  if (OverBudget(s, seg_start)) return;
  const StatLayout l = StatLayoutOf(s.rows, s.f, s.max_entries);
  const int64_t chunks = (s.rows + kStatChunk - 1) / kStatChunk;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kStatChunk + threadIdx.x;
  if (t >= s.rows) return;
  const int info = ws[l.info + t];
  const int key = info >> 10;
  const int rank = ws[l.hist + static_cast<int64_t>(kStatKeys - 1 - key) * chunks + blockIdx.x] + (info & 1023);
  ws[l.order + rank] = static_cast<int32_t>(t);
  ws[l.info + t] = rank;
  atomicMax(ws + l.goff + rank / kStatGroup, key);
}

// S4. goff over groups (64 words per ceil(c / 4) of the group's longest row); the last
// group's missing tokens marked -1 in order.
__global__ void __launch_bounds__(1024) StatGroupsKernel(const int32_t* __restrict__ seg_start,
                                                         int32_t* __restrict__ ws, Shapes s) {
  __shared__ int scratch[32];
  __shared__ int total;
  if (OverBudget(s, seg_start)) return;
  const StatLayout l = StatLayoutOf(s.rows, s.f, s.max_entries);
  const int64_t groups = (s.rows + kStatGroup - 1) / kStatGroup;
  int carry = 0;
  for (int64_t g0 = 0; g0 < groups; g0 += blockDim.x) {
    const int64_t g = g0 + threadIdx.x;
    const int words = g < groups ? 4 * kStatGroup * ws[l.goff + g] : 0;
    const int off = BlockExclusiveScan(words, scratch, &total);
    if (g < groups) ws[l.goff + g] = carry + off;
    carry += total;
  }
  if (threadIdx.x == 0) ws[l.goff + groups] = carry;
  for (int64_t r = s.rows + threadIdx.x; r < groups * kStatGroup; r += blockDim.x) ws[l.order + r] = -1;
}

// Exclusive prefix over the warp's lanes of v, and the warp's total.
__device__ __forceinline__ int WarpExclusive(int v, int lane, int* total) {
  const int inc = WarpInclusiveSum(v, lane);
  *total = __shfl_sync(kFullMask, inc, 31);
  return inc - v;
}

// Adds to lc[r] the entries of [e0, e1) whose column is r mod 4 (the tile a multiple of 32,
// so the neuron's residue too).
__device__ __forceinline__ void CountResidues(const uint32_t* entries, int64_t e0, int64_t e1, int (&lc)[4]) {
  for (int64_t e = e0; e < e1; ++e) {
    const int r = static_cast<int>(entries[e] & 3u);
    lc[0] += r == 0;
    lc[1] += r == 1;
    lc[2] += r == 2;
    lc[3] += r == 3;
  }
}

// S5. A warp per token, a lane per tile (32 tiles at a time): entries in the blocked
// layout's order (tiles ascending, then as stored), neurons k * tile + column.
__global__ void __launch_bounds__(256) StatScatterKernel(const int32_t* __restrict__ tok_off,
                                                         const int32_t* __restrict__ seg_start,
                                                         const uint32_t* __restrict__ entries,
                                                         int32_t* __restrict__ ws, Shapes s) {
  if (OverBudget(s, seg_start)) return;
  const StatLayout l = StatLayoutOf(s.rows, s.f, s.max_entries);
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (t >= s.rows) return;  // whole warps
  const int rank = ws[l.info + t];
  const int g = rank / kStatGroup, i = rank % kStatGroup;
  const int64_t base = ws[l.goff + g];
  const int steps = (ws[l.goff + g + 1] - static_cast<int>(base)) / kStatGroup;
  const int64_t b = t / kBlockTokens;
  const int tl = static_cast<int>(t % kBlockTokens);
  uint32_t* glay = reinterpret_cast<uint32_t*>(ws + l.glay);
  auto range = [&](int k, int64_t* e0, int64_t* e1) {
    const int64_t seg = b * s.n_tiles + k;
    const int32_t* off = tok_off + seg * (kBlockTokens + 1) + tl;
    *e0 = seg_start[seg] + off[0];
    *e1 = seg_start[seg] + off[1];
  };
  // pass 1: the token's entries per residue (tile a multiple of 32: n % 4 = column % 4);
  // with at most 32 tiles pass 2 reuses the lane's range and counts
  int cr[4] = {0, 0, 0, 0};
  int64_t keep0 = 0, keep1 = 0;
  int keep[4] = {0, 0, 0, 0};
  for (int kb = 0; kb < s.n_tiles; kb += 32) {
    int lc[4] = {0, 0, 0, 0};
    if (kb + lane < s.n_tiles) {
      int64_t e0, e1;
      range(kb + lane, &e0, &e1);
      keep0 = e0;
      keep1 = e1;
      CountResidues(entries, e0, e1, lc);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      int tot;
      WarpExclusive(lc[r], lane, &tot);
      cr[r] += tot;
      keep[r] = lc[r];
    }
  }
  // pass 2: each entry's step, from the entries of its residue before it
  int carry[4] = {0, 0, 0, 0};
  for (int kb = 0; kb < s.n_tiles; kb += 32) {
    int64_t e0 = 0, e1 = 0;
    int lc[4] = {0, 0, 0, 0};
    const int k = kb + lane;
    if (s.n_tiles <= 32) {
      e0 = keep0;
      e1 = keep1;
#pragma unroll
      for (int r = 0; r < 4; ++r) lc[r] = keep[r];
    } else if (k < s.n_tiles) {
      range(k, &e0, &e1);
      CountResidues(entries, e0, e1, lc);
    }
    int seen[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      int tot;
      seen[r] = carry[r] + WarpExclusive(lc[r], lane, &tot);
      carry[r] += tot;
    }
    for (int64_t e = e0; e < e1; ++e) {
      const uint32_t word = entries[e];
      const int r = static_cast<int>(word & 3u);
      int q = 0;
#pragma unroll
      for (int r2 = 0; r2 < 4; ++r2)
        if (r2 == r) q = seen[r2]++;
      const int dr = (r - i) & 3;
      int j = 0;
#pragma unroll
      for (int r2 = 0; r2 < 4; ++r2) {
        const int cap = q + (((r2 - i) & 3) < dr ? 1 : 0);
        j += cr[r2] < cap ? cr[r2] : cap;
      }
      const uint32_t n = static_cast<uint32_t>(k * s.tile) + (word & kColumnMask);
      glay[base + 4 * kStatGroup * (j / 4) + 4 * i + j % 4] = (word & 0xffff0000u) | n;
    }
  }
  const int c = cr[0] + cr[1] + cr[2] + cr[3];
  for (int j = c + lane; j < steps; j += 32) glay[base + 4 * kStatGroup * (j / 4) + 4 * i + j % 4] = 0u;
}

// S6.
template <typename E>
__global__ void __launch_bounds__(kStatThreads, 1) StatDownKernel(const uint16_t* __restrict__ w_down,
                                                                 const int32_t* __restrict__ seg_start,
                                                                 const int32_t* __restrict__ ws,
                                                                 uint16_t* __restrict__ y, Shapes s) {
  extern __shared__ __align__(128) unsigned char stat_smem[];
  const int c0 = blockIdx.x * kStatCols;
  const int lane = threadIdx.x % 32, q = lane % 2, i = lane / 2;
  const int64_t groups = (s.rows + kStatGroup - 1) / kStatGroup;
  if (OverBudget(s, seg_start)) {  // the fallback (or the caller's NaN check) takes over
    for (int64_t t = threadIdx.x / 2; t < s.rows; t += blockDim.x / 2)
      for (int k = 0; k < 8; ++k) y[t * s.d + c0 + 8 * q + k] = static_cast<uint16_t>(E::FromFloat(__int_as_float(0x7fc00000)));
    return;
  }
  const StatLayout l = StatLayoutOf(s.rows, s.f, s.max_entries);
  {  // Wd[:, c0 : c0 + 16] to shared memory, row n at n * 32 bytes
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(stat_smem));
    for (int p = threadIdx.x; p < 2 * s.f; p += blockDim.x) {
      const int n = p / 2, h = p % 2;
      const uint16_t* src = w_down + static_cast<int64_t>(n) * s.d + c0 + 8 * h;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + p * 16), "l"(src) : "memory");
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
  }
  const unsigned char* my = stat_smem + q * 16;
  const int32_t* goff = ws + l.goff;
  const int32_t* order = ws + l.order;
  const uint32_t* glay = reinterpret_cast<const uint32_t*>(ws + l.glay);
  for (int64_t g = threadIdx.x / 32; g < groups; g += blockDim.x / 32) {
    const int w0 = goff[g], w1 = goff[g + 1];
    const uint4* src = reinterpret_cast<const uint4*>(glay + w0) + i;
    // the last group's places past the last token hold no words (nothing was written there)
    const int t = order[g * kStatGroup + i];
    const int blocks = t >= 0 ? (w1 - w0) / (4 * kStatGroup) : 0;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    uint4 cur = blocks > 0 ? __ldg(src) : make_uint4(0u, 0u, 0u, 0u);
    for (int blk = 0; blk < blocks; ++blk) {
      const uint4 nxt = blk + 1 < blocks ? __ldg(src + kStatGroup * (blk + 1)) : make_uint4(0u, 0u, 0u, 0u);
      const uint32_t words[4] = {cur.x, cur.y, cur.z, cur.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint4 v = *reinterpret_cast<const uint4*>(my + (words[k] & 0xffffu) * (2 * kStatCols));
        const float h = E::ToFloat(words[k] >> 16);
        const uint32_t wv[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          acc[2 * p] = fmaf(h, E::ToFloat(wv[p] & 0xffffu), acc[2 * p]);
          acc[2 * p + 1] = fmaf(h, E::ToFloat(wv[p] >> 16), acc[2 * p + 1]);
        }
      }
      cur = nxt;
    }
    if (t >= 0) {
      uint4 out;
      out.x = E::FromFloat(acc[0]) | E::FromFloat(acc[1]) << 16;
      out.y = E::FromFloat(acc[2]) | E::FromFloat(acc[3]) << 16;
      out.z = E::FromFloat(acc[4]) | E::FromFloat(acc[5]) << 16;
      out.w = E::FromFloat(acc[6]) | E::FromFloat(acc[7]) << 16;
      *reinterpret_cast<uint4*>(y + static_cast<int64_t>(t) * s.d + c0 + 8 * q) = out;
    }
  }
}

template <typename E>
ffi::Error LaunchStationaryDown(cudaStream_t stream, const Shapes& s, const int32_t* counts, const int32_t* tok_off,
                                const int32_t* seg_start, const uint32_t* entries, const uint16_t* w_down,
                                float* partial, uint16_t* y) {
  int32_t* ws = reinterpret_cast<int32_t*>(partial);
  const unsigned chunks = static_cast<unsigned>((s.rows + kStatChunk - 1) / kStatChunk);
  cudaFuncSetAttribute(StatKeysKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kStatKeysSmem);
  StatKeysKernel<<<chunks, kStatChunk, kStatKeysSmem, stream>>>(counts, seg_start, ws, s);
  StatScanKernel<<<1, 1024, 0, stream>>>(seg_start, ws, s);
  StatOrderKernel<<<chunks, kStatChunk, 0, stream>>>(seg_start, ws, s);
  StatGroupsKernel<<<1, 1024, 0, stream>>>(seg_start, ws, s);
  StatScatterKernel<<<static_cast<unsigned>((s.rows + 7) / 8), 256, 0, stream>>>(tok_off, seg_start, entries, ws, s);
  ffi::Error status = LaunchStatus("twell_ffn_blocked stationary layout");
  if (status.failure()) return status;
  const int smem = s.f * 2 * kStatCols;
  cudaFuncSetAttribute(StatDownKernel<E>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  StatDownKernel<E><<<static_cast<unsigned>(s.d / kStatCols), kStatThreads, smem, stream>>>(w_down, seg_start, ws, y, s);
  return LaunchStatus("twell_ffn_blocked stationary down");
}

}  // namespace
}  // namespace jax_twell
