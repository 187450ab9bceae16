// Device code of the token-blocked TwELL kernels (layout, recompute, up, finish, down),
// shared by the inference handlers (twell_ffn_blocked.cu) and the training handlers
// (twell_train.cu). The layout and arithmetic are those described at the top of
// twell_ffn_blocked.cu and modelled in tests/blocked_emulation.py.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "common.h"
#include "async_mma.cuh"
#include "elements.cuh"

namespace jax_twell {
namespace {

constexpr int kBlockTokens = 1024;
constexpr int kUpCols = 64;
constexpr int kUpLanes = 8;
constexpr int kDownCols = 32;
constexpr int kDownLanes = 4;
constexpr int kMaxTile = 256;
constexpr int kThreads = 512;
constexpr int kStageEntries = 4096;  // larger segments are read from global memory
constexpr int kMaxTiles = 4096;
// Entry word: value bits << 16 | kFlag (overflowed tile) | (token % 32) << 8 | column.
// The token field is the entry's row within the 32-token run a warp of K1/K2 owns, so the
// steps need no token lookup (blocked_emulation.py models the same word).
constexpr uint32_t kFlag = 0x8000u;
constexpr uint32_t kColumnMask = 0xffu;  // tiles hold at most kMaxTile = 256 columns
constexpr int kWordTokenShift = 8;
__host__ __device__ constexpr uint32_t TokenBits(int64_t token_in_block) {
  return static_cast<uint32_t>(token_in_block & 31) << kWordTokenShift;
}

// Eight 2-byte elements of a 16-byte vector, as floats.
template <typename E>
__device__ __forceinline__ void Unpack8(const uint4& raw, float (&v)[8]) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    v[2 * i] = E::ToFloat(w[i] & 0xffffu);
    v[2 * i + 1] = E::ToFloat(w[i] >> 16);
  }
}

struct Shapes {
  int64_t rows;
  int d, f, tile, capacity, n_tiles, n_blocks;
  int64_t max_entries;
};

__device__ __forceinline__ int TileWidth(const Shapes& s, int k) { return min(s.tile, s.f - k * s.tile); }
__device__ __forceinline__ bool OverBudget(const Shapes& s, const int32_t* seg_start) {
  return seg_start[s.n_blocks * s.n_tiles] > s.max_entries;
}

// Block-wide exclusive scan of one int per thread (blockDim.x a multiple of 32, <= 1024).
__device__ int BlockExclusiveScan(int v, int* scratch, int* total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
  int inclusive = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int other = __shfl_up_sync(0xffffffffu, inclusive, o);
    if (lane >= o) inclusive += other;
  }
  if (lane == 31) scratch[warp] = inclusive;
  __syncthreads();
  if (warp == 0) {
    int w = lane < n_warps ? scratch[lane] : 0;
    int wi = w;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int other = __shfl_up_sync(0xffffffffu, wi, o);
      if (lane >= o) wi += other;
    }
    if (lane < n_warps) scratch[lane] = wi - w;
    if (lane == 31) *total = wi;
  }
  __syncthreads();
  const int result = scratch[warp] + inclusive - v;
  __syncthreads();  // scratch may be reused by the caller
  return result;
}

// K0a. Thread i holds tokens 2i and 2i+1 of the block.
__global__ void __launch_bounds__(kThreads) TwellBlockedLayoutKernel(const int32_t* __restrict__ counts,
                                                         int32_t* __restrict__ tok_off, Shapes s) {
  __shared__ int scratch[32];
  __shared__ int total;
  const int k = blockIdx.x, b = blockIdx.y;
  const int width = TileWidth(s, k);
  int r[2];
#pragma unroll
  for (int q = 0; q < 2; ++q) {
    const int64_t t = static_cast<int64_t>(b) * kBlockTokens + 2 * threadIdx.x + q;
    const int c = t < s.rows ? counts[t * s.n_tiles + k] : 0;
    r[q] = c > s.capacity ? width : c;
  }
  const int base = BlockExclusiveScan(r[0] + r[1], scratch, &total);
  int32_t* off = tok_off + (static_cast<int64_t>(b) * s.n_tiles + k) * (kBlockTokens + 1);
  off[2 * threadIdx.x] = base;
  off[2 * threadIdx.x + 1] = base + r[0];
  if (threadIdx.x == 0) off[kBlockTokens] = total;
}

// K0b. Segment totals are tok_off[seg][kBlockTokens]; seg_start has one more slot (total).
__global__ void __launch_bounds__(1024) TwellBlockedSegScanKernel(const int32_t* __restrict__ tok_off,
                                                      int32_t* __restrict__ seg_start, int n_seg) {
  __shared__ int scratch[32];
  __shared__ int total;
  int carry = 0;  // fits: the handler checks M * f < 2^31
  for (int s0 = 0; s0 < n_seg; s0 += blockDim.x) {
    const int seg = s0 + threadIdx.x;
    const int len = seg < n_seg ? tok_off[static_cast<int64_t>(seg) * (kBlockTokens + 1) + kBlockTokens] : 0;
    const int off = BlockExclusiveScan(len, scratch, &total);
    if (seg < n_seg) seg_start[seg] = carry + off;
    carry += total;
  }
  if (threadIdx.x == 0) seg_start[n_seg] = carry;
}

// K0c. One thread per token of the (block, tile) segment, copying its entries (1.3 on
// average at 0.5% density: a warp per token, the first version, left most lanes idle).
template <typename Bits>
__global__ void __launch_bounds__(256) TwellBlockedScatterKernel(const Bits* __restrict__ values,
                                                     const int16_t* __restrict__ cols,
                                                     const int32_t* __restrict__ counts,
                                                     const int32_t* __restrict__ tok_off,
                                                     const int32_t* __restrict__ seg_start,
                                                     uint32_t* __restrict__ entries, Shapes s) {
  const int k = blockIdx.x, b = blockIdx.y;
  const int seg = b * s.n_tiles + k;
  const int32_t* off = tok_off + static_cast<int64_t>(seg) * (kBlockTokens + 1);
  const int64_t base = seg_start[seg];
  const int width = TileWidth(s, k);
  for (int i = threadIdx.x; i < kBlockTokens; i += blockDim.x) {
    const int64_t t = static_cast<int64_t>(b) * kBlockTokens + i;
    if (t >= s.rows) break;
    const int c = counts[t * s.n_tiles + k];
    const int64_t e0 = base + off[i];
    if (c <= s.capacity) {
      const int64_t src = (t * s.n_tiles + k) * s.capacity;
      for (int e = 0; e < c; ++e)
        if (e0 + e < s.max_entries)
          entries[e0 + e] = (static_cast<uint32_t>(values[src + e]) << 16) | TokenBits(i) |
                            (static_cast<uint32_t>(cols[src + e]) & kColumnMask);
    } else {
      for (int e = 0; e < width; ++e)
        if (e0 + e < s.max_entries) entries[e0 + e] = kFlag | TokenBits(i) | static_cast<uint32_t>(e);
    }
  }
}

// Overflowed (token, tile) pairs of a (block, tile): one thread per column of the tile.
// kTrain (gated training forward): the entry keeps g and `up` receives u, the residuals the
// backward reads; otherwise the entry receives h.
template <typename E, bool kGated, bool kTrain = false>
__global__ void __launch_bounds__(kMaxTile) TwellBlockedRecomputeKernel(
    const uint16_t* __restrict__ x, const int32_t* __restrict__ counts,
    const uint16_t* __restrict__ w_act, const uint16_t* __restrict__ w_up,
    const int32_t* __restrict__ tok_off, const int32_t* __restrict__ seg_start,
    uint32_t* __restrict__ entries, Shapes s, uint16_t* __restrict__ up = nullptr) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint16_t* x_s = reinterpret_cast<uint16_t*>(smem_raw);
  __shared__ int over_tokens[kBlockTokens];
  __shared__ int n_over;
  if (OverBudget(s, seg_start)) return;
  const int k = blockIdx.x, b = blockIdx.y;
  const int seg = b * s.n_tiles + k;
  if (threadIdx.x == 0) n_over = 0;
  __syncthreads();
  // The list order only decides which token this CTA recomputes first, not any value.
  for (int i = threadIdx.x; i < kBlockTokens; i += blockDim.x) {
    const int64_t t = static_cast<int64_t>(b) * kBlockTokens + i;
    if (t < s.rows && counts[t * s.n_tiles + k] > s.capacity) over_tokens[atomicAdd(&n_over, 1)] = i;
  }
  __syncthreads();
  const int width = TileWidth(s, k);
  const int col = k * s.tile + threadIdx.x;
  for (int o = 0; o < n_over; ++o) {
    const int i = over_tokens[o];
    const int64_t t = static_cast<int64_t>(b) * kBlockTokens + i;
    for (int c = threadIdx.x; c < s.d; c += blockDim.x) x_s[c] = x[t * s.d + c];
    __syncthreads();
    if (threadIdx.x < width) {
      float pre = 0.f, u_sum = 0.f;
      for (int c = 0; c < s.d; ++c) {
        const float xc = E::ToFloat(x_s[c]);
        pre = fmaf(xc, E::ToFloat(w_act[static_cast<int64_t>(c) * s.f + col]), pre);
        if constexpr (kGated) u_sum = fmaf(xc, E::ToFloat(w_up[static_cast<int64_t>(c) * s.f + col]), u_sum);
      }
      const float g = Round<E>(pre > 0.f ? pre : 0.f);
      const float h = kGated ? Round<E>(g * Round<E>(u_sum)) : g;
      const int64_t e = seg_start[seg] + tok_off[static_cast<int64_t>(seg) * (kBlockTokens + 1) + i] + threadIdx.x;
      if constexpr (kTrain) {
        entries[e] = (E::FromFloat(g) << 16) | kFlag | TokenBits(i) | static_cast<uint32_t>(threadIdx.x);
        up[e] = static_cast<uint16_t>(E::FromFloat(u_sum));
      } else {
        entries[e] = (E::FromFloat(h) << 16) | kFlag | TokenBits(i) | static_cast<uint32_t>(threadIdx.x);
      }
    }
    __syncthreads();
  }
}

// Shared-memory stages of K1/K2: weight slab [kMaxTile, kCols], token offsets, entries.
template <int kCols>
struct Stages {
  static constexpr int kSlab = kMaxTile * kCols * 2;
  static constexpr int kOff = (kBlockTokens + 1 + 3) / 4 * 16;
  static constexpr int kEnt = kStageEntries * 4;
  static constexpr int kStage = kSlab + kOff + kEnt;
  static int Bytes(int n_tiles) { return 2 * kStage + (n_tiles + 1 + 3) / 4 * 16; }
};

// Stages tile k of block b into buffer `stage`: the slab rows w[k*tile + c, col0 .. col0+kCols)
// (w is [f, d]), the segment's token offsets and, when they fit, its entries.
template <int kCols>
__device__ void StageTile(uint8_t* stage, const uint16_t* w, const int32_t* tok_off,
                          const uint32_t* entries, const int32_t* seg_s, int b, int k, int col0,
                          const Shapes& s) {
  constexpr int kVecs = kCols / 8;  // 16-byte vectors per slab row
  uint16_t* slab = reinterpret_cast<uint16_t*>(stage);
  int32_t* off = reinterpret_cast<int32_t*>(stage + Stages<kCols>::kSlab);
  uint32_t* ent = reinterpret_cast<uint32_t*>(stage + Stages<kCols>::kSlab + Stages<kCols>::kOff);
  const int width = TileWidth(s, k);
  const int64_t row0 = static_cast<int64_t>(k) * s.tile;
  for (int v = threadIdx.x; v < width * kVecs; v += blockDim.x) {
    const int row = v / kVecs, q = v % kVecs;
    CpAsync16(slab + row * kCols + q * 8, w + (row0 + row) * s.d + col0 + q * 8);
  }
  const int seg = b * s.n_tiles + k;
  const int32_t* off_g = tok_off + static_cast<int64_t>(seg) * (kBlockTokens + 1);
  for (int i = threadIdx.x; i <= kBlockTokens; i += blockDim.x) CpAsync4(off + i, off_g + i);
  const int base = seg_s[k], len = seg_s[k + 1] - base;
  if (len <= kStageEntries)
    for (int e = threadIdx.x; e < len; e += blockDim.x) CpAsync4(ent + e, entries + base + e);
  CpAsyncCommit();
}

// K1 and K2 share one work split: warp w of the CTA owns tokens [32 w, 32 w + 32) of the
// block, whose entries in a tile are one contiguous run [off[32 w], off[32 w + 32)). The
// warp walks that run flat, a few entries at a time (4 per step in K1, 8 in K2), so lane
// groups never wait for a token with more entries than theirs (the token-per-group split
// of the first version lost about half its issue slots that way). The token of each entry
// comes from a per-warp table the warp fills from the offsets before each chunk of entries.
constexpr int kFlatThreads = 1024;                                // K1/K2 CTA size: 32 warps
constexpr int kWarpTokens = kBlockTokens / (kFlatThreads / 32);  // 32: one token per lane
constexpr int kWarpChunk = 128;                                  // entries per token-table fill

// Per-tile shared-memory stage of K1/K2: weight slab [kMaxTile, kCols] and token offsets.
template <int kCols>
struct SlabStage {
  static constexpr int kSlab = kMaxTile * kCols * 2;
  static constexpr int kOff = (kBlockTokens + 1 + 3) / 4 * 16;
  static constexpr int kBytes = kSlab + kOff;
};
constexpr int kTokTableBytes = (kFlatThreads / 32) * kWarpChunk * 2;
__host__ __device__ constexpr int SegBytes(int n_tiles) { return (n_tiles + 1 + 3) / 4 * 16; }

// Up: x[block, 64 columns] (128 KB), two stages, token tables, segment starts.
constexpr int kUpX = kBlockTokens * kUpCols * 2;
inline int UpSmemBytes(int n_tiles) { return kUpX + 2 * SlabStage<kUpCols>::kBytes + kTokTableBytes + SegBytes(n_tiles); }

// Stages tile k into `stage`: slab rows w[k*tile + c, col0 .. col0+kCols) (w is [f, d])
// and the (block, tile) segment's token offsets.
// Swizzled rows for ldmatrix gathers: 16-byte chunk q of row r is stored at chunk
// q ^ (r & 7) (rows of 8 chunks, 128 B) or q ^ ((r >> 1) & 3) (rows of 4 chunks, 64 B), so
// that the eight rows one ldmatrix phase reads rarely share banks (never when consecutive).
template <int kVecs>
__host__ __device__ constexpr int SwizzleChunk(int row, int q) {
  static_assert(kVecs == 8 || kVecs == 4, "swizzled rows hold 4 or 8 chunks of 16 bytes");
  return kVecs == 8 ? (q ^ (row & 7)) : (q ^ ((row >> 1) & 3));
}

// Issues (no commit) the cp.async copies of tile k's slab rows w[k*tile + c, col0 .. col0 +
// kCols) (w is [f, d]) into slab [kMaxTile, kCols], stored with SwizzleChunk if kSwizzle.
template <int kCols, bool kSwizzle>
__device__ void CopySlabRows(uint16_t* slab, const uint16_t* w, int k, int col0, const Shapes& s) {
  constexpr int kVecs = kCols / 8;
  const int width = TileWidth(s, k);
  const int64_t row0 = static_cast<int64_t>(k) * s.tile;
  for (int v = threadIdx.x; v < width * kVecs; v += blockDim.x) {
    const int row = v / kVecs, q = v % kVecs;
    int qs = q;
    if constexpr (kSwizzle) qs = SwizzleChunk<kVecs>(row, q);
    CpAsync16(slab + row * kCols + qs * 8, w + (row0 + row) * s.d + col0 + q * 8);
  }
}

// kSwizzle: the slab rows are stored with SwizzleChunk.
template <int kCols, bool kSwizzle = false>
__device__ void StageSlabAndOffsets(uint8_t* stage, const uint16_t* w, const int32_t* tok_off, int b, int k,
                                    int col0, const Shapes& s) {
  CopySlabRows<kCols, kSwizzle>(reinterpret_cast<uint16_t*>(stage), w, k, col0, s);
  int32_t* off = reinterpret_cast<int32_t*>(stage + SlabStage<kCols>::kSlab);
  const int32_t* off_g = tok_off + (static_cast<int64_t>(b) * s.n_tiles + k) * (kBlockTokens + 1);
  for (int i = threadIdx.x; i <= kBlockTokens; i += blockDim.x) CpAsync4(off + i, off_g + i);
  CpAsyncCommit();
}

// tok[p - p0] = token (index in the block) of entry p, for p in [p0, p1), over this warp's
// tokens [t0, t0 + kWarpTokens). Ends with __syncwarp.
__device__ __forceinline__ void FillTokenTable(const int32_t* off, int t0, int p0, int p1, uint16_t* tok) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int j = lane; j < kWarpTokens; j += 32) {
    const int a = max(off[t0 + j], p0), e = min(off[t0 + j + 1], p1);
    for (int p = a; p < e; ++p) tok[p - p0] = static_cast<uint16_t>(t0 + j);
  }
  __syncwarp();
}

// Shared memory of the flat-walk kernels after their leading block (x for K1, nothing for
// K2 v3): two slab stages, the per-warp token tables, the segment starts.
struct FlatSmem {
  uint8_t* stages;
  uint16_t* tok;  // this warp's table
  int32_t* seg_s;
};
template <int kCols>
__device__ __forceinline__ FlatSmem CarveFlatSmem(uint8_t* base) {
  uint8_t* tables = base + 2 * SlabStage<kCols>::kBytes;
  return {base, reinterpret_cast<uint16_t*>(tables) + (threadIdx.x / 32) * kWarpChunk,
          reinterpret_cast<int32_t*>(tables + kTokTableBytes)};
}

// x[block b, columns col0 .. col0 + 64) into x_s by cp.async (rows past the last token are
// zero), swizzled for ldmatrix or plain. Lands with the first stage's wait.
template <bool kSwizzle>
__device__ void StageXBlock(uint16_t* x_s, const uint16_t* x, int b, int col0, const Shapes& s) {
  constexpr int kVecs = kUpCols / 8;
  for (int v = threadIdx.x; v < kBlockTokens * kVecs; v += blockDim.x) {
    const int i = v / kVecs, c = v % kVecs;
    const int64_t t = static_cast<int64_t>(b) * kBlockTokens + i;
    uint16_t* dst = x_s + i * kUpCols + (kSwizzle ? SwizzleChunk<kVecs>(i, c) : c) * 8;
    if (t < s.rows)
      CpAsync16(dst, x + t * s.d + col0 + c * 8);
    else
      *reinterpret_cast<uint4*>(dst) = make_uint4(0, 0, 0, 0);
  }
}

// The tile walk the flat-walk kernels share: loads the block's segment starts, stages the
// slabs of w ([f, d], columns col0 .. col0 + kCols) and token offsets two tiles deep, and
// for each tile calls body(segment start, slab, p0, p1) once per chunk [p0, p1) of this
// warp's entry run, with the warp's token table filled for that chunk.
template <int kCols, bool kSwizzle, typename Body>
__device__ void WalkWarpRuns(const FlatSmem& m, const int32_t* seg_start, const uint16_t* w, const int32_t* tok_off,
                             int b, int col0, const Shapes& s, Body&& body) {
  using St = SlabStage<kCols>;
  const int t0 = (threadIdx.x / 32) * kWarpTokens;
  for (int k = threadIdx.x; k <= s.n_tiles; k += blockDim.x) m.seg_s[k] = seg_start[b * s.n_tiles + k];
  __syncthreads();
  StageSlabAndOffsets<kCols, kSwizzle>(m.stages, w, tok_off, b, 0, col0, s);
  for (int k = 0; k < s.n_tiles; ++k) {
    CpAsyncWaitAll();
    __syncthreads();  // stage k landed; every warp is done with stage k - 1
    if (k + 1 < s.n_tiles)
      StageSlabAndOffsets<kCols, kSwizzle>(m.stages + ((k + 1) % 2) * St::kBytes, w, tok_off, b, k + 1, col0, s);
    const uint8_t* stage = m.stages + (k % 2) * St::kBytes;
    const uint16_t* slab = reinterpret_cast<const uint16_t*>(stage);
    const int32_t* off = reinterpret_cast<const int32_t*>(stage + St::kSlab);
    const int lo = off[t0], hi = off[t0 + kWarpTokens];
    for (int p0 = lo; p0 < hi; p0 += kWarpChunk) {
      const int p1 = min(hi, p0 + kWarpChunk);
      __syncwarp();  // the previous chunk's table reads are done
      FillTokenTable(off, t0, p0, p1, m.tok);
      body(m.seg_s[k], slab, p0, p1);
    }
  }
}

// K1. Per entry (token t, column c of tile k) and d-range r of 64 columns: 8 lanes, lane q
// dotting columns 8q..8q+7 of x[t] and Wu^T[k*tile + c] (f32 fma chain), then a butterfly
// over xor 4, 2, 1 -> partial[r, entry]. x for the CTA's block and range sits in shared
// memory; Wu^T slabs are staged per tile (cp.async, two stages).
// kSkipFlagged: entries of overflowed tiles are left out (inference: recomputed whole);
// the training backward (dy . Wd rows, twell_train.cu) visits them too.
template <typename E, bool kSkipFlagged = true>
__global__ void __launch_bounds__(kFlatThreads, 1) TwellBlockedUpKernel(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ w_up_t,
    const int32_t* __restrict__ tok_off, const int32_t* __restrict__ seg_start,
    const uint32_t* __restrict__ entries, float* __restrict__ partial, Shapes s) {
  constexpr int kGroups = 32 / kUpLanes;  // entries per warp step
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint16_t* x_s = reinterpret_cast<uint16_t*>(smem_raw);
  const FlatSmem m = CarveFlatSmem<kUpCols>(smem_raw + kUpX);
  if (OverBudget(s, seg_start)) return;
  const int r = blockIdx.x, b = blockIdx.y;
  const int col0 = r * kUpCols;
  const int lane = threadIdx.x % 32, group = lane / kUpLanes, q = lane % kUpLanes;
  const unsigned mask = 0xffu << (group * kUpLanes);
  StageXBlock<false>(x_s, x, b, col0, s);
  float* partial_r = partial + static_cast<int64_t>(r) * s.max_entries;
  WalkWarpRuns<kUpCols, false>(m, seg_start, w_up_t, tok_off, b, col0, s,
                               [&](int base, const uint16_t* slab, int p0, int p1) {
    const uint32_t* ent = entries + base;
    for (int p = p0 + group; p < p1; p += kGroups) {
      const uint32_t word = ent[p];
      if (kSkipFlagged && (word & kFlag)) continue;
      const int i = m.tok[p - p0];
      float xv[8], wv[8];
      Unpack8<E>(*reinterpret_cast<const uint4*>(x_s + i * kUpCols + q * 8), xv);
      Unpack8<E>(*reinterpret_cast<const uint4*>(slab + (word & kColumnMask) * kUpCols + q * 8), wv);
      float acc = 0.f;
#pragma unroll
      for (int v = 0; v < 8; ++v) acc = fmaf(xv[v], wv[v], acc);
      acc += __shfl_xor_sync(mask, acc, 4, kUpLanes);
      acc += __shfl_xor_sync(mask, acc, 2, kUpLanes);
      acc += __shfl_xor_sync(mask, acc, 1, kUpLanes);
      if (q == 0) partial_r[base + p] = acc;
    }
  });
}

// ---------------------------------------------------------------------------------------
// Tensor-core steps (kernel="blocked_mma"), version 4: pre-decoded entries.
//
// Version 3 spent most of its instructions on bookkeeping repeated for every column range:
// staging the 1025 token offsets of each (block, tile), filling a per-warp token table,
// looking each entry's token up in it. Version 4 reads the token from the entry word
// itself (bits 8-12: token % 32, the entry's row within its warp's run) and the warp's
// run bounds from two offsets loaded a tile ahead, so a warp step is: one coalesced load
// of 16 words (the next step's already in flight), a few shuffles, ldmatrix and mma.
// The down step also covers 64 columns per warp (16 tokens x 8 column blocks of
// accumulators), twice version 3's, so each entry's bookkeeping serves twice the columns.

// Slab rows of 64 columns (8 chunks of 16 bytes), chunk-swizzled for ldmatrix gathers.
__device__ __forceinline__ int Swizzled64(int row, int chunk) { return row * kUpCols + SwizzleChunk<8>(row, chunk) * 8; }

constexpr int kSlab64Elems = kMaxTile * kUpCols;  // one stage: [kMaxTile, 64] 2-byte elements
constexpr int kSlab64Bytes = kSlab64Elems * 2;


// The tile walk of the version-4 steps: this warp owns tokens [t0, t0 + kTokens) of block
// b (kTokens 16 or 32, t0 a multiple of kTokens). Stages the 64-column slabs of w (and of
// w2 when kSlabs is 2, right after w's in the same ring slot) in a ring of kStages slots
// (kStages - 1 tiles ahead) and calls body(segment start, slab, lo, hi, word) per tile with
// the warp's entry run [lo, hi) (segment-relative) and the run's first 16 entry words
// (lane i holds word lo + i % 16, 0 past hi). Nothing of a tile's bookkeeping waits on
// memory when the tile starts: its segment start and run bounds are loaded two tiles
// ahead, its first words one tile ahead.
template <int kTokens, int kStages, int kSlabs = 1, typename Body>
__device__ void WalkRunsV4(uint16_t* stages, const int32_t* seg_start, const uint32_t* entries, const uint16_t* w,
                           const uint16_t* w2, const int32_t* tok_off, int b, int t0, int col0, const Shapes& s,
                           Body&& body) {
  static_assert(kStages >= 2, "a ring of at least two stages");
  static_assert(kSlabs == 1 || kSlabs == 2, "one or two weight slabs per stage");
  constexpr int kSlot = kSlabs * kSlab64Elems;
  const int lane = threadIdx.x % 32;
  auto stage = [&](int j, int k) {
    uint16_t* slot = stages + j * kSlot;
    CopySlabRows<kUpCols, true>(slot, w, k, col0, s);
    if constexpr (kSlabs == 2) CopySlabRows<kUpCols, true>(slot + kSlab64Elems, w2, k, col0, s);
    CpAsyncCommit();
  };
  // Lane 0 loads off[t0], lane 1 off[t0 + kTokens], lane 2 the segment start, of tile k.
  const int32_t* off_b = tok_off + static_cast<int64_t>(b) * s.n_tiles * (kBlockTokens + 1) + t0 + (lane & 1) * kTokens;
  const int32_t* seg_b = seg_start + static_cast<int64_t>(b) * s.n_tiles;
  auto load_meta = [&](int k) -> int {
    if (k >= s.n_tiles || lane > 2) return 0;
    return lane == 2 ? seg_b[k] : off_b[static_cast<int64_t>(k) * (kBlockTokens + 1)];
  };
  auto first_words = [&](int lo, int hi, int base) -> uint32_t {
    return lo + (lane & 15) < hi ? entries[static_cast<int64_t>(base) + lo + (lane & 15)] : 0u;
  };
  int meta = load_meta(0), next_meta = load_meta(1);
  for (int j = 0; j < kStages - 1; ++j) {
    if (j < s.n_tiles)
      stage(j, j);
    else
      CpAsyncCommit();  // empty group: the wait below counts one group per tile
  }
  int lo = __shfl_sync(0xffffffffu, meta, 0), hi = __shfl_sync(0xffffffffu, meta, 1);
  int base = __shfl_sync(0xffffffffu, meta, 2);
  uint32_t word = first_words(lo, hi, base);
  for (int k = 0; k < s.n_tiles; ++k) {
    const int meta_after = load_meta(k + 2);
    const int lo1 = __shfl_sync(0xffffffffu, next_meta, 0), hi1 = __shfl_sync(0xffffffffu, next_meta, 1);
    const int base1 = __shfl_sync(0xffffffffu, next_meta, 2);
    const uint32_t word1 = first_words(lo1, hi1, base1);  // zero-length past the last tile
    CpAsyncWaitPending<kStages - 2>();
    __syncthreads();  // stage k landed; every warp is done with stage k - 1
    const int ahead = k + kStages - 1;
    if (ahead < s.n_tiles)
      stage(ahead % kStages, ahead);
    else
      CpAsyncCommit();
    body(base, stages + (k % kStages) * kSlot, lo, hi, word);
    lo = lo1, hi = hi1, base = base1, word = word1, next_meta = meta_after;
  }
  CpAsyncWaitAll();
}

constexpr int kUpMmaStages = 3;  // x (128 KB) + 3 slabs of 32 KB: 224 KB of shared memory
template <typename E, bool kSkipFlagged = true>
__global__ void __launch_bounds__(kFlatThreads, 1) TwellBlockedUpMmaKernel(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ w_up_t,
    const int32_t* __restrict__ tok_off, const int32_t* __restrict__ seg_start,
    const uint32_t* __restrict__ entries, float* __restrict__ partial, Shapes s) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint16_t* x_s = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* stages = reinterpret_cast<uint16_t*>(smem_raw + kUpX);
  if (OverBudget(s, seg_start)) return;
  const int r = blockIdx.x, b = blockIdx.y;
  const int col0 = r * kUpCols;
  const int lane = threadIdx.x % 32;
  const int t0 = (threadIdx.x / 32) * 32;
  // Which entry of the 16 this lane addresses for ldmatrix, and which 8-column half.
  const int a_row = (lane & 7) | (lane & 8), a_half = lane >> 4;
  const int b_entry = (lane & 7) | ((lane >> 4) << 3), b_half = (lane >> 3) & 1;
  // The lane holding diagonal i (and 8 + i): 4 i + i / 2.
  const int diag = lane >> 2;
  const bool holds_diag = (lane & 3) == (diag >> 1);
  StageXBlock<true>(x_s, x, b, col0, s);
  float* partial_r = partial + static_cast<int64_t>(r) * s.max_entries;
  WalkRunsV4<32, kUpMmaStages>(stages, seg_start, entries, w_up_t, nullptr, tok_off, b, t0, col0, s,
                                [&](int base, const uint16_t* slab, int lo, int hi, uint32_t word) {
    const uint32_t* ent = entries + base;
    float* part = partial_r + base;
    // word: this step's 16 entries (padding: 0, i.e. token t0, column 0, results dropped)
    for (int pb = lo; pb < hi; pb += 16) {  // warp-uniform
      const int en = pb + 16 + (lane & 15);
      const uint32_t next = en < hi ? ent[en] : 0u;
      const int a_tok = t0 + static_cast<int>((__shfl_sync(0xffffffffu, word, a_row) >> kWordTokenShift) & 31);
      const int b_col = static_cast<int>(__shfl_sync(0xffffffffu, word, b_entry) & kColumnMask);
      float d_lo[4] = {0.f, 0.f, 0.f, 0.f}, d_hi[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int ks = 0; ks < kUpCols / 16; ++ks) {
        uint32_t a[4], bb[4];
        LdMatrixX4(a, x_s + Swizzled64(a_tok, 2 * ks + a_half));
        LdMatrixX4(bb, slab + Swizzled64(b_col, 2 * ks + b_half));
        Mma16816<E>(d_lo, a, bb[0], bb[1]);
        Mma16816<E>(d_hi, a, bb[2], bb[3]);
      }
      const uint32_t w_lo = __shfl_sync(0xffffffffu, word, diag);
      const uint32_t w_hi = __shfl_sync(0xffffffffu, word, diag + 8);
      if (holds_diag) {
        const bool odd = diag & 1;
        if (pb + diag < hi && !(kSkipFlagged && (w_lo & kFlag))) part[pb + diag] = odd ? d_lo[1] : d_lo[0];
        if (pb + 8 + diag < hi && !(kSkipFlagged && (w_hi & kFlag))) part[pb + 8 + diag] = odd ? d_hi[3] : d_hi[2];
      }
      word = next;
    }
  });
}

inline int UpMmaSmemBytes() { return kUpX + kUpMmaStages * kSlab64Bytes; }

// The A fragment (m16n8k16, rows = the warp's 16 tokens, k = the step's 16 entries) of a
// step whose entry e (lane e % 16) packs `value bits << 16 | row of its token` (0xff: no
// row, padding): A[row][e] = value where row matches, else 0. Lane (g = lane / 4, t =
// lane % 4) holds rows g and g + 8 of entries 2t, 2t + 1, 2t + 8, 2t + 9.
__device__ __forceinline__ void OneHotRowsA(uint32_t packed, int g, int t, uint32_t (&a)[4]) {
  const uint32_t p_a = __shfl_sync(0xffffffffu, packed, 2 * t);
  const uint32_t p_b = __shfl_sync(0xffffffffu, packed, 2 * t + 1);
  const uint32_t p_c = __shfl_sync(0xffffffffu, packed, 2 * t + 8);
  const uint32_t p_d = __shfl_sync(0xffffffffu, packed, 2 * t + 9);
  auto pick = [](uint32_t p, uint32_t row) { return (p & 0xffffu) == row ? (p >> 16) : 0u; };
  const uint32_t r0 = g, r1 = g + 8;
  a[0] = pick(p_a, r0) | pick(p_b, r0) << 16;
  a[1] = pick(p_a, r1) | pick(p_b, r1) << 16;
  a[2] = pick(p_c, r0) | pick(p_d, r0) << 16;
  a[3] = pick(p_c, r1) | pick(p_d, r1) << 16;
}

// Writes a warp's m16n8 accumulators over 64 columns (rows = tokens row0 .. row0 + 15, past
// the last token skipped) to out [rows, d] in E, rounded once; NaN when over_budget.
template <typename E>
__device__ __forceinline__ void StoreWarpRows64(const float (&acc)[8][4], uint16_t* out, int64_t row0, int col0,
                                                int g, int t, bool over_budget, const Shapes& s) {
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t tkn = row0 + g + 8 * half;
    if (tkn >= s.rows) continue;
#pragma unroll
    for (int nb = 0; nb < 8; ++nb) {
      const float v0 = over_budget ? __int_as_float(0x7fc00000) : acc[nb][2 * half];
      const float v1 = over_budget ? __int_as_float(0x7fc00000) : acc[nb][2 * half + 1];
      *reinterpret_cast<uint32_t*>(out + tkn * s.d + col0 + nb * 8 + 2 * t) = E::FromFloat(v0) | (E::FromFloat(v1) << 16);
    }
  }
}

constexpr int kDownMmaTokens = 16;  // tokens per warp
constexpr int kDownMmaHalf = kDownMmaTokens * (kFlatThreads / 32);  // tokens per CTA: 512
constexpr int kDownMmaStages = 4;  // 4 slabs of 32 KB
static_assert(kBlockTokens % kDownMmaHalf == 0, "a block splits into whole CTA token ranges");

// Where a thread of a down-shaped mma step (grid (d / 64, 2 x blocks), kFlatThreads)
// works: block b, columns [col0, col0 + 64), its warp's tokens [t0, t0 + 16) of the block,
// its mma fragment coordinates (g, t), and the entry and column chunk it addresses in an
// ldmatrix.trans x4 (matrix j = lane / 8 holds entries (j & 1) * 8 .. + 7 and columns
// (2 q + (j >> 1)) * 8 .. + 7 of call q: the B fragments of column blocks 2q and 2q + 1).
struct DownMmaThread {
  int b, col0, t0, g, t, b_entry, b_chunk;
  bool over_budget;
};
__device__ __forceinline__ DownMmaThread DownMmaThreadOf(const int32_t* seg_start, const Shapes& s) {
  constexpr int kParts = kBlockTokens / kDownMmaHalf;
  const int lane = threadIdx.x % 32;
  return {static_cast<int>(blockIdx.y / kParts),
          static_cast<int>(blockIdx.x * kUpCols),
          static_cast<int>((blockIdx.y % kParts) * kDownMmaHalf + (threadIdx.x / 32) * kDownMmaTokens),
          lane >> 2,
          lane & 3,
          (lane & 7) | ((lane >> 3) & 1) << 3,
          lane >> 4,
          OverBudget(s, seg_start)};
}

__device__ __forceinline__ void ZeroAcc(float (&acc)[8][4]) {
#pragma unroll
  for (int nb = 0; nb < 8; ++nb)
#pragma unroll
    for (int v = 0; v < 4; ++v) acc[nb][v] = 0.f;
}

// K2 on tensor cores. A CTA covers half a block (512 tokens) and 64 model columns; warp w
// owns tokens [16 w, 16 w + 16) of that half and their y[., 64 columns] as mma accumulators
// held for the whole kernel (eight blocks of 8 columns: 32 floats per lane). Per warp
// step, 16 consecutive entries of its run: A[token][e] = h_e where entry e belongs to the
// token, else 0 (built in registers from four shuffles), B = the entries' Wd slab rows
// (gathered by ldmatrix.trans). Deterministic (fixed instruction order); y equals the
// CUDA-core K2's to f32 rounding.
template <typename E>
__global__ void __launch_bounds__(kFlatThreads, 1) TwellBlockedDownMmaKernel(
    const uint16_t* __restrict__ w_down, const int32_t* __restrict__ tok_off,
    const int32_t* __restrict__ seg_start, const uint32_t* __restrict__ entries,
    uint16_t* __restrict__ y, Shapes s) {
  extern __shared__ __align__(16) uint8_t smem_raw[];
  uint16_t* stages = reinterpret_cast<uint16_t*>(smem_raw);
  const DownMmaThread th = DownMmaThreadOf(seg_start, s);
  const int b = th.b, col0 = th.col0, t0 = th.t0, g = th.g, t = th.t, b_entry = th.b_entry, b_chunk = th.b_chunk;
  const int lane = threadIdx.x % 32;
  const bool over_budget = th.over_budget;
  float acc[8][4];
  ZeroAcc(acc);

  if (!over_budget) {
    WalkRunsV4<kDownMmaTokens, kDownMmaStages>(stages, seg_start, entries, w_down, nullptr, tok_off, b, t0, col0, s,
                                               [&](int base, const uint16_t* slab, int lo, int hi, uint32_t word) {
      const uint32_t* ent = entries + base;
      for (int pb = lo; pb < hi; pb += 16) {  // warp-uniform
        const int en = pb + 16 + (lane & 15);
        const uint32_t next = en < hi ? ent[en] : 0u;
        // (h bits << 16) | row of the entry's token in this warp's 16; 0xff (no row) for padding.
        const uint32_t packed = pb + (lane & 15) < hi ? ((word & 0xffff0000u) | ((word >> kWordTokenShift) & 15u)) : 0xffu;
        const int c = __shfl_sync(0xffffffffu, static_cast<int>(word & kColumnMask), b_entry);
        uint32_t a[4];
        OneHotRowsA(packed, g, t, a);
#pragma unroll
        for (int q = 0; q < 4; ++q) {
          uint32_t bf[4];
          LdMatrixX4Trans(bf, slab + Swizzled64(c, 2 * q + b_chunk));
          Mma16816<E>(acc[2 * q], a, bf[0], bf[1]);
          Mma16816<E>(acc[2 * q + 1], a, bf[2], bf[3]);
        }
        word = next;
      }
    });
  }
  StoreWarpRows64<E>(acc, y, static_cast<int64_t>(b) * kBlockTokens + t0, col0, g, t, over_budget, s);
}

inline int DownMmaSmemBytes() { return kDownMmaStages * kSlab64Bytes; }

// K1.5. One thread per entry: sums the partials in range order, rounds like the reference.
template <typename E>
__global__ void __launch_bounds__(256) TwellBlockedFinishKernel(const float* __restrict__ partial,
                                                    const int32_t* __restrict__ seg_start,
                                                    uint32_t* __restrict__ entries, int n_ranges,
                                                    Shapes s) {
  if (OverBudget(s, seg_start)) return;
  const int64_t total = seg_start[s.n_blocks * s.n_tiles];
  for (int64_t e = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; e < total;
       e += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t word = entries[e];
    if (word & kFlag) continue;
    float u = 0.f;
    for (int r = 0; r < n_ranges; ++r) u += partial[static_cast<int64_t>(r) * s.max_entries + e];
    const float h = Round<E>(E::ToFloat(word >> 16) * Round<E>(u));
    entries[e] = (E::FromFloat(h) << 16) | (word & 0xffffu);
  }
}

// K2. Group g (4 lanes) owns tokens g + 128 j, j < 8; lane q of the group columns 8q..8q+7.
template <typename E>
__global__ void __launch_bounds__(kThreads, 1) TwellBlockedDownKernel(
    const uint16_t* __restrict__ w_down, const int32_t* __restrict__ tok_off,
    const int32_t* __restrict__ seg_start, const uint32_t* __restrict__ entries,
    uint16_t* __restrict__ y, Shapes s) {
  constexpr int kGroups = kThreads / kDownLanes;
  constexpr int kTokensPerGroup = kBlockTokens / kGroups;
  using St = Stages<kDownCols>;
  extern __shared__ __align__(16) uint8_t smem_raw[];
  int32_t* seg_s = reinterpret_cast<int32_t*>(smem_raw + 2 * St::kStage);
  const int r = blockIdx.x, b = blockIdx.y;
  const int col0 = r * kDownCols;
  const int group = threadIdx.x / kDownLanes, q = threadIdx.x % kDownLanes;
  const bool over_budget = OverBudget(s, seg_start);

  float acc[kTokensPerGroup][8];
#pragma unroll
  for (int j = 0; j < kTokensPerGroup; ++j)
#pragma unroll
    for (int v = 0; v < 8; ++v) acc[j][v] = 0.f;

  if (!over_budget) {
    for (int k = threadIdx.x; k <= s.n_tiles; k += blockDim.x) seg_s[k] = seg_start[b * s.n_tiles + k];
    __syncthreads();
    StageTile<kDownCols>(smem_raw, w_down, tok_off, entries, seg_s, b, 0, col0, s);
    for (int k = 0; k < s.n_tiles; ++k) {
      CpAsyncWaitAll();
      __syncthreads();
      if (k + 1 < s.n_tiles)
        StageTile<kDownCols>(smem_raw + ((k + 1) % 2) * St::kStage, w_down, tok_off, entries, seg_s, b, k + 1, col0, s);
      const uint8_t* stage = smem_raw + (k % 2) * St::kStage;
      const uint16_t* slab = reinterpret_cast<const uint16_t*>(stage);
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
          const float h = E::ToFloat(word >> 16);
          float wv[8];
          Unpack8<E>(*reinterpret_cast<const uint4*>(slab + (word & kColumnMask) * kDownCols + q * 8), wv);
#pragma unroll
          for (int v = 0; v < 8; ++v) acc[j][v] = fmaf(h, wv[v], acc[j][v]);
        }
      }
    }
  }

#pragma unroll
  for (int j = 0; j < kTokensPerGroup; ++j) {
    const int64_t t = static_cast<int64_t>(b) * kBlockTokens + group + kGroups * j;
    if (t >= s.rows) continue;
    uint32_t out[4];
#pragma unroll
    for (int v = 0; v < 4; ++v) {
      const float lo = over_budget ? __int_as_float(0x7fc00000) : acc[j][2 * v];
      const float hi = over_budget ? __int_as_float(0x7fc00000) : acc[j][2 * v + 1];
      out[v] = E::FromFloat(lo) | (E::FromFloat(hi) << 16);
    }
    *reinterpret_cast<uint4*>(y + t * s.d + col0 + q * 8) = make_uint4(out[0], out[1], out[2], out[3]);
  }
}

// Host side: K1 and K2 on grid (d / columns, blocks or half blocks), CUDA-core or tensor-core version.
template <typename E, bool kSkipFlagged = true>
void LaunchUpStep(cudaStream_t stream, bool mma, const uint16_t* x, const uint16_t* w_t, const int32_t* tok_off,
                  const int32_t* seg_start, const uint32_t* entries, float* partial, const Shapes& s) {
  const dim3 grid(s.d / kUpCols, s.n_blocks);
  if (mma) {
    const int smem = UpMmaSmemBytes();
    cudaFuncSetAttribute(TwellBlockedUpMmaKernel<E, kSkipFlagged>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    TwellBlockedUpMmaKernel<E, kSkipFlagged>
        <<<grid, kFlatThreads, smem, stream>>>(x, w_t, tok_off, seg_start, entries, partial, s);
  } else {
    const int smem = UpSmemBytes(s.n_tiles);
    cudaFuncSetAttribute(TwellBlockedUpKernel<E, kSkipFlagged>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    TwellBlockedUpKernel<E, kSkipFlagged>
        <<<grid, kFlatThreads, smem, stream>>>(x, w_t, tok_off, seg_start, entries, partial, s);
  }
}

template <typename E>
void LaunchDownStep(cudaStream_t stream, bool mma, const uint16_t* w_down, const int32_t* tok_off,
                    const int32_t* seg_start, const uint32_t* h_source, uint16_t* y, const Shapes& s) {
  if (mma) {
    const int smem = DownMmaSmemBytes();
    const dim3 grid(s.d / kUpCols, s.n_blocks * (kBlockTokens / kDownMmaHalf));
    cudaFuncSetAttribute(TwellBlockedDownMmaKernel<E>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    TwellBlockedDownMmaKernel<E><<<grid, kFlatThreads, smem, stream>>>(w_down, tok_off, seg_start, h_source, y, s);
  } else {
    const dim3 grid(s.d / kDownCols, s.n_blocks);
    const int smem = Stages<kDownCols>::Bytes(s.n_tiles);
    cudaFuncSetAttribute(TwellBlockedDownKernel<E>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    TwellBlockedDownKernel<E><<<grid, kThreads, smem, stream>>>(w_down, tok_off, seg_start, h_source, y, s);
  }
}

}  // namespace
}  // namespace jax_twell
