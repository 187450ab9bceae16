// The down step with the weight stationary in shared memory (mma bit 4 of the gated blocked
// handler and of the training forward): y = h @ Wd where each CTA owns 16 output columns (8
// where f > 7,264), keeps Wd[:, c0 : c0 + 16] (f x 32 bytes; f x 16 with 8) in shared memory
// for the whole launch, and walks every token's h entries. The same walk gives the training
// backward's dx (mma bit 4 of jax_twell_train_bwd): a walk over Wact^T's rows (staged from
// Wact in its own [d, f] layout) with the coefficients coef[1], then, gated, a second walk
// over Wu^T's rows with coef[2] and a layout of its own, which adds the first walk's f32
// sums (kept in the workspace by walk place) once after its own steps (LaunchStationaryDx).
// The weight crosses L2 once (|Wd|) instead of once per token block's union; what bounds
// the step is one random 32-byte row read from shared memory per (token, neuron) pair.
// ffi/notes/limits.md ("A fourth family") has the probe runs behind the design.
//
// The walk needs the entries in a layout of its own, built from the blocked layout's h
// entries (after Finish) by five small launches, all in the partials' workspace:
//   S1 StatKeys     grid (chunk of 1024 tokens): per token c = its words (its
//                   entries in the blocked layout: the stored count, or the tile width for
//                   an overflowed tile, summed over tiles; read from tok_off),
//                   key = ceil(c / 4) (0 .. ceil(f / 4)); per chunk a histogram of keys and
//                   each token's rank among the chunk's tokens of its key (stable: token
//                   order; match_any in a warp, a prefix over the warps' counts per key).
//   S2 StatScan     one CTA: exclusive prefix over (key descending, chunk ascending), 8,192
//                   values at a time through shared memory.
//   S3 StatOrder    grid (chunk): rank of each token = its key's offset + its rank in the
//                   chunk; order[rank] = token; the key of each group's first token.
//   S4 StatGroups   one CTA: goff = exclusive prefix of 64 x (the group's first key) over
//                   groups of 16 consecutive ranks (the tokens sorted by count,
//                   descending, so a group's rows have about the same length).
//   S5 StatScatter  a warp per token, a lane per entry: its words to its group's block of the
//                   walk layout, (value bits << 16 | table row; the value h, or the coefficient
//                   rounded to the element type), step j of the group's token i at word
//                   goff[g] + 64 (j / 4) + 4 i + j % 4, zero words to the group's length.
//                   Step order: the entries taken round by round over R residues of the
//                   neuron (R = 4 with 16 columns, 8 with 8), starting at residue i % R (the
//                   q-th entry of residue r goes to step
//                   sum_r' min(c_r', q + [(r' - i) % R < (r - i) % R])), so the tokens of a
//                   shared-memory phase (four with 32-byte rows, eight with 16-byte rows)
//                   tend to read different slots of a 128-byte line. Gated dx: one
//                   pass writes both layouts (Wact^T's and Wu^T's words at the same places).
//   S6 StatDown     grid (d / 16 or d / 8), 1,024 threads: a warp per group and two threads
//                   a token (16 columns) or half a warp per group and a thread a token (8),
//                   8 columns a thread, four steps per 128-bit load of the layout, f32 FMAs
//                   in step order; y rounded once. Deterministic; no atomics in any output.
// tests/stationary_emulation.py models S1-S6 (order, layout and arithmetic).
#pragma once

#include <cstdint>
#include <string>

#include "common.h"
#include "elements.cuh"
#include "twell_blocked.cuh"

namespace jax_twell {
namespace {

constexpr int kStatThreads = 1024;  // S6: 32 warps
constexpr int kStatScatterWarps = 8;  // S5: a warp a token, 256 threads
constexpr int kStatGroup = 16;      // tokens walked together (a warp's 16 x 2 threads, or half a warp)
constexpr int kStatChunk = 1024;    // tokens a CTA of S1 and S3
constexpr int kStatScanTile = 8192;  // S2's values staged in shared memory at a time
constexpr int kStatSmemLimit = 232448;
// Output columns a CTA owns: 16 (two threads a token) where the slice f x 32 bytes fits,
// else 8 (a thread a token, f x 16 bytes).
constexpr int kStatMaxF16 = kStatSmemLimit / (2 * 16);  // 7,264 neurons
// S1's per-warp counts (16-bit) for keys 0..ceil(f / 4): 64 bytes a key; the slice of 8
// columns alone would allow 14,528
constexpr int kStatMaxF = 4 * (kStatSmemLimit / (2 * kStatChunk / 32) - 1);  // 14,524 neurons

__host__ __device__ constexpr int StatCols(int f) { return f <= kStatMaxF16 ? 16 : 8; }
// Sort keys ceil(c / 4) for c <= f entries a token: 0 .. ceil(f / 4).
__host__ __device__ constexpr int StatKeys(int f) { return (f + 3) / 4 + 1; }
__host__ __device__ constexpr int StatKeysSmem(int f) { return kStatChunk / 32 * StatKeys(f) * 2; }
// Residue classes of S5's rotation: a shared-memory phase of S6 reads the rows of four
// tokens (16 columns: 32-byte rows, n mod 4 picks the slot) or eight (8: 16-byte rows, n mod 8).
__host__ __device__ constexpr int StatClasses(int f) { return StatCols(f) == 16 ? 4 : 8; }

// Offsets (in 32-bit words) of the walk's workspace, carved from the partials.
struct StatLayout {
  int64_t hist, info, order, goff, maxkey, glay, glay_words, total;
};

__host__ __device__ inline StatLayout StatLayoutOf(int64_t rows, int f, int64_t max_entries) {
  const int64_t chunks = (rows + kStatChunk - 1) / kStatChunk;
  const int64_t groups = (rows + kStatGroup - 1) / kStatGroup;
  StatLayout l;
  l.hist = 0;
  l.info = l.hist + chunks * StatKeys(f);
  l.order = l.info + rows;
  l.goff = l.order + groups * kStatGroup;
  l.maxkey = l.goff + groups + 1;  // the call's largest key (S1's maximum; S2 scans up to it)
  l.glay = (l.maxkey + 1 + 3) / 4 * 4;  // 16-byte aligned
  // sum over groups of 64 x the first (longest) row's key <= 16 (f + 3) + sum over tokens of
  // (c + 3): each later group's key is at most every key of the group before it
  l.glay_words = (max_entries + 3 * rows + 16 * (static_cast<int64_t>(f) + 3) + 3) / 4 * 4;
  l.total = l.glay + l.glay_words;
  return l;
}

__host__ __device__ inline StatLayout StatLayoutFor(const Shapes& s) {
  return StatLayoutOf(s.rows, s.f, s.max_entries);
}

// Words of the tokens' order as S1-S4 leave it (StatLayout's info, order and goff, one
// range of the workspace): what the training forward keeps for its backward's dx walk,
// whose S1-S4 would compute the same words from the same counts.
inline int64_t StatOrderWords(const Shapes& s) {
  const StatLayout l = StatLayoutFor(s);
  return l.maxkey - l.info;
}

// Words of the walk's workspace: the layout (one table), or for the backward's gated dx
// (two tables) a second walk layout and the first walk's f32 sums after it (d x the rows
// rounded up to a group of 16: kept by walk place).
inline int64_t StationaryWalkWords(const Shapes& s, int tables) {
  const StatLayout l = StatLayoutFor(s);
  const int64_t slots = (s.rows + kStatGroup - 1) / kStatGroup * kStatGroup;  // the sums by walk place
  return tables == 1 ? l.total : l.total + l.glay_words + slots * s.d;
}

// The walk's test for a walk over `tables` tables of f rows: the slice and the sort's
// counts in shared memory (f at most 14,524), d a multiple of the columns a CTA owns, the
// workspace within `workspace_words`.
inline bool StationaryWalkSupported(const Shapes& s, int tables, int64_t workspace_words) {
  return s.f <= kStatMaxF && s.d % StatCols(s.f) == 0 && StationaryWalkWords(s, tables) <= workspace_words;
}

// The handler's test (mma bit 4): the gated FFN, bf16 or f16, d a multiple of the columns
// a CTA owns, the slice within shared memory, neurons within 16 bits, the workspace within
// the partials.
inline bool StationaryDownSupported(const Shapes& s) {
  return StationaryWalkSupported(s, 1, static_cast<int64_t>(s.d / kUpCols) * s.max_entries);
}

// Why a handler's mma bit 4 (the down step with the weight stationary) can't run here, or
// nullptr where it can (the inference handler and the training forward).
inline const char* StationaryDownRefusal(const Shapes& s, bool gated, int32_t mma) {
  if ((mma & 16) == 0 || (gated && StationaryDownSupported(s))) return nullptr;
  return "the down step with the weight stationary (mma bit 4) needs the gated FFN, d a multiple of 16 (of 8 where "
         "f > 7264), f at most 14524 and its workspace within the partials [d/64, max_entries]";
}

// A token's reserved entries over all tiles (the stored counts, or the tile widths where a
// tile overflowed), from the blocked layout's per-segment offsets.
__device__ __forceinline__ int TokenEntries(const Shapes& s, const int32_t* tok_off, int64_t t) {
  const int64_t b = t / kBlockTokens;
  const int tl = static_cast<int>(t % kBlockTokens);
  int c = 0;
  for (int k = 0; k < s.n_tiles; ++k) {
    const int32_t* off = tok_off + (b * s.n_tiles + k) * (kBlockTokens + 1) + tl;
    c += off[1] - off[0];
  }
  return c;
}

// S1. Ranks within the chunk among tokens of the same key, in token order: within a warp
// by match_any, across warps by a prefix over the warps' counts per key (16-bit counts in
// dynamic shared memory, StatKeysSmem(f) bytes).
__global__ void __launch_bounds__(kStatChunk) StatKeysKernel(const int32_t* __restrict__ tok_off,
                                                             const int32_t* __restrict__ seg_start,
                                                             int32_t* __restrict__ ws, Shapes s) {
  extern __shared__ __align__(16) uint16_t wcount[];  // [warp][key]
  if (OverBudget(s, seg_start)) return;
  const StatLayout l = StatLayoutFor(s);
  const int64_t chunks = (s.rows + kStatChunk - 1) / kStatChunk;
  const int64_t groups = (s.rows + kStatGroup - 1) / kStatGroup;
  const int keys = StatKeys(s.f);
  // The chunk's largest key (the counts and prefixes above it are zero), kept in the counts'
  // last word (warp 31's keys - 2 and keys - 1) until every thread has read it: one more
  // shared word would pass the limit at f = kStatMaxF.
  unsigned* chunk_max = reinterpret_cast<unsigned*>(wcount) + kStatChunk / 32 * keys / 2 - 1;
  if (threadIdx.x == 0) *chunk_max = 0u;
  // group lengths start at 0 (S3 takes their maximum): this chunk's share of the groups
  for (int64_t g = static_cast<int64_t>(blockIdx.x) * (kStatChunk / kStatGroup) + threadIdx.x;
       g < groups && g < static_cast<int64_t>(blockIdx.x + 1) * (kStatChunk / kStatGroup); g += blockDim.x)
    ws[l.goff + g] = 0;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kStatChunk + threadIdx.x;
  const bool valid = t < s.rows;
  const int c = valid ? TokenEntries(s, tok_off, t) : 0;
  const int key = (c + 3) / 4;  // < keys: c <= f
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const unsigned valid_lanes = __ballot_sync(kFullMask, valid);
  __syncthreads();  // chunk_max set
  const int warp_max = __reduce_max_sync(kFullMask, static_cast<unsigned>(key));
  if (lane == 0) atomicMax(chunk_max, static_cast<unsigned>(warp_max));
  __syncthreads();
  const int kmax = static_cast<int>(*chunk_max);  // keys 0 .. kmax of each warp's counts
  __syncthreads();  // read by all before the zeros below may overwrite it
  for (int i = threadIdx.x; i < kStatChunk / 32 * (kmax + 1); i += blockDim.x)
    wcount[i / (kmax + 1) * keys + i % (kmax + 1)] = 0;
  if (threadIdx.x == 0) atomicMax(ws + l.maxkey, kmax);
  __syncthreads();
  int wrank = 0;
  if (valid) {
    const unsigned peers = __match_any_sync(valid_lanes, key);
    wrank = __popc(peers & ((1u << lane) - 1u));
    if (lane == __ffs(peers) - 1) wcount[warp * keys + key] = static_cast<uint16_t>(__popc(peers));
  }
  __syncthreads();
  // per key: prefix over the warps, the total (in S2's order); keys past the chunk's
  // largest have none (zeros: S2 and S3 read them up to the call's largest)
  for (int k = threadIdx.x; k < keys; k += blockDim.x) {
    int run = 0;
    if (k <= kmax)
      for (int w = 0; w < kStatChunk / 32; ++w) {
        const int v = wcount[w * keys + k];
        wcount[w * keys + k] = static_cast<uint16_t>(run);
        run += v;
      }
    ws[l.hist + static_cast<int64_t>(keys - 1 - k) * chunks + blockIdx.x] = run;
  }
  __syncthreads();
  if (valid) ws[l.info + t] = key << 10 | (wcount[warp * keys + key] + wrank);
}

// S2. In place over hist, stored by S1 in the order of the prefix (key descending, chunk
// ascending): the exclusive prefix, kStatScanTile values at a time through shared memory.
__global__ void __launch_bounds__(1024) StatScanKernel(const int32_t* __restrict__ seg_start, int32_t* __restrict__ ws,
                                                       Shapes s) {
  __shared__ int vals[kStatScanTile];
  __shared__ int scratch[32];
  __shared__ int total;
  if (OverBudget(s, seg_start)) return;
  const int64_t chunks = (s.rows + kStatChunk - 1) / kStatChunk;
  const int keys = StatKeys(s.f);
  const int64_t n = chunks * keys;
  // keys above the call's largest hold only zeros and are never read (S3 reads its tokens'
  // keys): the scan starts at the largest key's values
  const int64_t first = (keys - 1 - static_cast<int64_t>(ws[StatLayoutFor(s).maxkey])) * chunks;
  constexpr int kPer = kStatScanTile / 1024;
  int carry = 0;
  for (int64_t p0 = first; p0 < n; p0 += kStatScanTile) {
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
  const StatLayout l = StatLayoutFor(s);
  const int64_t chunks = (s.rows + kStatChunk - 1) / kStatChunk;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kStatChunk + threadIdx.x;
  if (t >= s.rows) return;
  const int info = ws[l.info + t];
  const int key = info >> 10;
  const int rank =
      ws[l.hist + static_cast<int64_t>(StatKeys(s.f) - 1 - key) * chunks + blockIdx.x] + (info & 1023);
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
  const StatLayout l = StatLayoutFor(s);
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

// S5. A warp per token. Its entries are taken in the blocked layout's order (tiles
// ascending, then as stored), 32 at a time, a lane an entry: the lanes first take a tile
// each (32 tiles at a time), whose entry range and place in the order (a warp prefix of the
// ranges' lengths) say which lane's tile holds each entry of a batch. Neurons
// n = k * tile + column; R residue classes (StatClasses), counted per batch by ballots. Two
// passes over the entries: the residues' totals, then each entry's step from the entries of
// its residue before it. A word an entry, its value the entry's high half (h words: kCoef
// false) or coef[e] rounded to the element type (kCoef: the caller points `coef` at the
// backward's coefficient row of the table). The layout goes to ws + glay_at
// (StatLayout::glay). kTwo (gated dx): a second layout at ws + glay2_at with coef2[e]'s
// values, written in the same pass: every word sits at the same place in both layouts
// (the place depends on the neurons and the token's order only).
template <typename E, int R, bool kCoef, bool kTwo = false>
__global__ void __launch_bounds__(32 * kStatScatterWarps)
    StatScatterKernel(const int32_t* __restrict__ tok_off, const int32_t* __restrict__ seg_start,
                      const uint32_t* __restrict__ entries, const float* __restrict__ coef,
                      const float* __restrict__ coef2, int32_t* __restrict__ ws, int64_t glay_at, int64_t glay2_at,
                      Shapes s) {
  static_assert(kCoef || !kTwo, "a second layout takes its values from a second coefficient row");
  __shared__ uint8_t owners[kStatScatterWarps][32];  // the lane whose tile holds each entry of a batch
  if (OverBudget(s, seg_start)) return;
  const StatLayout l = StatLayoutFor(s);
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x % 32;
  if (t >= s.rows) return;  // whole warps
  const int rank = ws[l.info + t];
  const int g = rank / kStatGroup, i = rank % kStatGroup;
  const int64_t base = ws[l.goff + g];
  const int steps = (ws[l.goff + g + 1] - static_cast<int>(base)) / kStatGroup;
  const int64_t b = t / kBlockTokens;
  const int tl = static_cast<int>(t % kBlockTokens);
  uint32_t* glay = reinterpret_cast<uint32_t*>(ws + glay_at);
  uint32_t* glay2 = reinterpret_cast<uint32_t*>(ws + glay2_at);
  uint8_t* owner = owners[threadIdx.x / 32];
  const unsigned below = (1u << lane) - 1u;
  // Calls visit(valid, e, word, n) on every lane for each batch of 32 entries in order
  // (valid false on the lanes past the token's last entry).
  auto for_entries = [&](auto&& visit) {
    for (int kb = 0; kb < s.n_tiles; kb += 32) {
      int64_t e0 = 0, e1 = 0;
      if (kb + lane < s.n_tiles) {
        const int64_t seg = b * s.n_tiles + kb + lane;
        const int32_t* off = tok_off + seg * (kBlockTokens + 1) + tl;
        e0 = seg_start[seg] + off[0];
        e1 = seg_start[seg] + off[1];
      }
      const int cnt = static_cast<int>(e1 - e0);
      int total;
      const int pre = WarpExclusive(cnt, lane, &total);  // this tile's entries are places [pre, pre + cnt)
      const int64_t from = e0 - pre;                     // entry of place p: from + p, on the owner lane
      for (int fb = 0; fb < total; fb += 32) {
        const int lo = max(pre, fb), hi = min(pre + cnt, fb + 32);
        for (int p = lo; p < hi; ++p) owner[p - fb] = static_cast<uint8_t>(lane);
        __syncwarp();
        const bool valid = fb + lane < total;
        const int o = valid ? owner[lane] : 0;
        __syncwarp();  // the next batch rewrites the owners
        const int64_t e = __shfl_sync(kFullMask, from, o) + fb + lane;
        const uint32_t word = valid ? entries[e] : 0u;
        const uint32_t n = static_cast<uint32_t>((kb + o) * s.tile) + (word & kColumnMask);
        visit(valid, e, word, n);
      }
    }
  };
  // pass 1: the token's entries per residue (tile a multiple of 32: n % R = column % R)
  int cr[R] = {};
  for_entries([&](bool valid, int64_t, uint32_t, uint32_t n) {
    const int r = static_cast<int>(n & (R - 1u));
#pragma unroll
    for (int r2 = 0; r2 < R; ++r2) cr[r2] += __popc(__ballot_sync(kFullMask, valid && r == r2));
  });
  // pass 2: each entry's step, from the entries of its residue before it
  int carry[R] = {};
  for_entries([&](bool valid, int64_t e, uint32_t word, uint32_t n) {
    const int r = static_cast<int>(n & (R - 1u));
    int q = 0;
#pragma unroll
    for (int r2 = 0; r2 < R; ++r2) {
      const unsigned mask = __ballot_sync(kFullMask, valid && r == r2);
      if (r2 == r) q = carry[r2] + __popc(mask & below);
      carry[r2] += __popc(mask);
    }
    if (!valid) return;
    const int dr = (r - i) & (R - 1);
    int j = 0;
#pragma unroll
    for (int r2 = 0; r2 < R; ++r2) {
      const int cap = q + (((r2 - i) & (R - 1)) < dr ? 1 : 0);
      j += cr[r2] < cap ? cr[r2] : cap;
    }
    const uint32_t value = kCoef ? static_cast<uint32_t>(E::FromFloat(coef[e])) << 16 : word & 0xffff0000u;
    const int64_t at = base + 4 * kStatGroup * (j / 4) + 4 * i + j % 4;
    glay[at] = value | n;
    if constexpr (kTwo) glay2[at] = static_cast<uint32_t>(E::FromFloat(coef2[e])) << 16 | n;
  });
  int c = 0;
#pragma unroll
  for (int r = 0; r < R; ++r) c += cr[r];
  for (int j = c + lane; j < steps; j += 32) {
    const int64_t at = base + 4 * kStatGroup * (j / 4) + 4 * i + j % 4;
    glay[at] = 0u;
    if constexpr (kTwo) glay2[at] = 0u;
  }
}

// The table's [:, c0 : c0 + kCols] from a [d, f] weight (the backward's dx: table row n is
// column n of w) to shared memory, row n at n * 2 kCols bytes. Where f is a multiple of 8, a
// thread loads 16 bytes from each of 8 weight rows (8 neurons x 8 columns) and transposes
// them in registers; else one element at a time.
template <int kCols>
__device__ __forceinline__ void StageTableFromWeights(unsigned char* smem, const uint16_t* __restrict__ w, int c0,
                                                      const Shapes& s) {
  constexpr int kTpt = kCols / 8;
  const int fv = s.f;
  if (s.f % 8 == 0) {
    const int groups = fv / 8;  // 8 neurons each
    for (int p = threadIdx.x; p < kTpt * groups; p += blockDim.x) {
      const int h = p / groups, n0 = 8 * (p % groups);
      const uint16_t* src = w + n0 + static_cast<int64_t>(c0 + 8 * h) * s.f;
      uint32_t a[8][4];  // a[k]: columns c0 + 8 h + k of neurons n0 .. n0 + 7, two a word
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + static_cast<int64_t>(k) * s.f));
        a[k][0] = v.x, a[k][1] = v.y, a[k][2] = v.z, a[k][3] = v.w;
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {  // neuron n0 + j: its 8 columns, two a word
        const unsigned sel = j % 2 == 0 ? 0x5410u : 0x7632u;
        uint4 o;
        o.x = __byte_perm(a[0][j / 2], a[1][j / 2], sel);
        o.y = __byte_perm(a[2][j / 2], a[3][j / 2], sel);
        o.z = __byte_perm(a[4][j / 2], a[5][j / 2], sel);
        o.w = __byte_perm(a[6][j / 2], a[7][j / 2], sel);
        *reinterpret_cast<uint4*>(smem + ((n0 + j) * kTpt + h) * 16) = o;
      }
    }
  } else {
    for (int p = threadIdx.x; p < kTpt * fv; p += blockDim.x) {
      const int h = p / fv, n = p % fv;
      const uint16_t* src = w + n + static_cast<int64_t>(c0 + 8 * h) * s.f;
      uint32_t o[4];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        o[k] = static_cast<uint32_t>(__ldg(src + static_cast<int64_t>(2 * k) * s.f)) |
               static_cast<uint32_t>(__ldg(src + static_cast<int64_t>(2 * k + 1) * s.f)) << 16;
      *reinterpret_cast<uint4*>(smem + (n * kTpt + h) * 16) = make_uint4(o[0], o[1], o[2], o[3]);
    }
  }
}

// What S6 does with a token's f32 sums: round them to y (kStatSumOut), or, for dx as two
// walks of one table each, keep them in an f32 buffer (kStatSumKeep, the first walk)
// or add the buffer's sums once after the token's own steps, then round (kStatSumAdd, the
// second walk: dx = round(sum over Wact^T's rows + sum over Wu^T's rows)).
constexpr int kStatSumOut = 0, kStatSumKeep = 1, kStatSumAdd = 2;

// S6. kCols output columns a CTA: 16 (two threads a token, a warp a group) or 8 (a thread
// a token, half a warp a group). The table's f rows: row n of w [f, d]; or (kWeightsDF)
// column n of w [d, f] (the weight in its own layout: no transposes). The layout at
// ws + glay_at; `sums` the f32 buffer of kStatSumKeep and kStatSumAdd (d x the rows rounded
// up to a group).
template <typename E, int kCols, bool kWeightsDF, int kSum = kStatSumOut>
__global__ void __launch_bounds__(kStatThreads, 1) StatDownKernel(const uint16_t* __restrict__ w,
                                                                 const int32_t* __restrict__ seg_start,
                                                                 const int32_t* __restrict__ ws, int64_t glay_at,
                                                                 float* __restrict__ sums,
                                                                 uint16_t* __restrict__ y, Shapes s) {
  constexpr int kTpt = kCols / 8;                           // threads a token, 8 columns each
  constexpr int kGroupsPerWarp = 32 / (kTpt * kStatGroup);  // 1 or 2
  extern __shared__ __align__(128) unsigned char stat_smem[];
  const int c0 = blockIdx.x * kCols;
  const int lane = threadIdx.x % 32, q = lane % kTpt, i = (lane / kTpt) % kStatGroup;
  const int gw = lane / (kTpt * kStatGroup);
  const int64_t groups = (s.rows + kStatGroup - 1) / kStatGroup;
  if (OverBudget(s, seg_start)) {  // the fallback (or the caller's NaN check) takes over
    if (kSum == kStatSumKeep) return;  // the second walk writes y
    for (int64_t t = threadIdx.x / kTpt; t < s.rows; t += blockDim.x / kTpt)
      for (int k = 0; k < 8; ++k)
        y[t * s.d + c0 + 8 * (threadIdx.x % kTpt) + k] = static_cast<uint16_t>(E::FromFloat(__int_as_float(0x7fc00000)));
    return;
  }
  const StatLayout l = StatLayoutFor(s);
  if constexpr (kWeightsDF) {
    StageTableFromWeights<kCols>(stat_smem, w, c0, s);
    __syncthreads();
  } else {  // the table's [:, c0 : c0 + kCols] to shared memory, row n at n * 2 kCols bytes
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(stat_smem));
    for (int p = threadIdx.x; p < kTpt * s.f; p += blockDim.x) {
      const int n = p / kTpt, h = p % kTpt;
      const uint16_t* src = w + static_cast<int64_t>(n) * s.d + c0 + 8 * h;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(base + p * 16), "l"(src) : "memory");
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
    __syncthreads();
  }
  const uint32_t my = static_cast<uint32_t>(__cvta_generic_to_shared(stat_smem)) + q * 16;  // shared address
  const int32_t* goff = ws + l.goff;
  const int32_t* order = ws + l.order;
  const uint32_t* glay = reinterpret_cast<const uint32_t*>(ws + glay_at);
  for (int64_t g0 = threadIdx.x / 32 * kGroupsPerWarp; g0 < groups; g0 += blockDim.x / 32 * kGroupsPerWarp) {
    const int64_t g = g0 + gw;
    const bool real = g < groups;
    const int w0 = real ? goff[g] : 0, w1 = real ? goff[g + 1] : 0;
    const uint4* src = reinterpret_cast<const uint4*>(glay + w0) + i;
    // the last group's places past the last token hold no words (nothing was written there)
    const int t = real ? order[g * kStatGroup + i] : -1;
    const int blocks = t >= 0 ? (w1 - w0) / (4 * kStatGroup) : 0;
    float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    // the sums in walk order, [d / kCols][groups x 16][kCols]: a CTA's own range, written and
    // read in sequence (the two walks share the order), not its columns of [M, d]
    const int64_t place = (static_cast<int64_t>(blockIdx.x) * groups + g) * kStatGroup + i;
    float* my_sums = t >= 0 && kSum != kStatSumOut ? sums + place * kCols + 8 * q : nullptr;
    float4 kept[2] = {make_float4(0.f, 0.f, 0.f, 0.f), make_float4(0.f, 0.f, 0.f, 0.f)};
    if (kSum == kStatSumAdd && t >= 0) {  // asked for now, used after the token's steps
      kept[0] = __ldcs(reinterpret_cast<const float4*>(my_sums));
      kept[1] = __ldcs(reinterpret_cast<const float4*>(my_sums) + 1);
    }
    // One block of four steps: per word, the thread's 16 bytes of the row (one LDS.128 at a
    // 32-bit shared address) and 8 FMAs.
    auto steps = [&](const uint4 blk) {
      const uint32_t words[4] = {blk.x, blk.y, blk.z, blk.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        uint32_t wv[4];
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(wv[0]), "=r"(wv[1]), "=r"(wv[2]), "=r"(wv[3])
                     : "r"(my + (words[k] & 0xffffu) * (2 * kCols)));
        const float h = E::ToFloat(words[k] >> 16);
#pragma unroll
        for (int p = 0; p < 4; ++p) {
          acc[2 * p] = fmaf(h, E::ToFloat(wv[p] & 0xffffu), acc[2 * p]);
          acc[2 * p + 1] = fmaf(h, E::ToFloat(wv[p] >> 16), acc[2 * p + 1]);
        }
      }
    };
    // Two blocks an iteration, the next ones loaded ahead from a clamped index (always a
    // load: no predicate, no zeroed registers).
    if (blocks > 0) {
      uint4 cur = __ldg(src);
      int blk = 0;
      for (; blk + 2 <= blocks; blk += 2) {
        const uint4 b1 = __ldg(src + kStatGroup * (blk + 1));
        const uint4 b2 = __ldg(src + kStatGroup * min(blk + 2, blocks - 1));
        steps(cur);
        steps(b1);
        cur = b2;
      }
      if (blk < blocks) steps(cur);
    }
    if (t < 0) continue;
    if constexpr (kSum == kStatSumKeep) {  // y is the second walk's
      __stcs(reinterpret_cast<float4*>(my_sums), make_float4(acc[0], acc[1], acc[2], acc[3]));
      __stcs(reinterpret_cast<float4*>(my_sums) + 1, make_float4(acc[4], acc[5], acc[6], acc[7]));
    } else {
      if (kSum == kStatSumAdd) {
        const float k[8] = {kept[0].x, kept[0].y, kept[0].z, kept[0].w, kept[1].x, kept[1].y, kept[1].z, kept[1].w};
#pragma unroll
        for (int p = 0; p < 8; ++p) acc[p] = k[p] + acc[p];
      }
      uint4 out;
      out.x = E::FromFloat(acc[0]) | E::FromFloat(acc[1]) << 16;
      out.y = E::FromFloat(acc[2]) | E::FromFloat(acc[3]) << 16;
      out.z = E::FromFloat(acc[4]) | E::FromFloat(acc[5]) << 16;
      out.w = E::FromFloat(acc[6]) | E::FromFloat(acc[7]) << 16;
      *reinterpret_cast<uint4*>(y + static_cast<int64_t>(t) * s.d + c0 + 8 * q) = out;
    }
  }
}

// S1-S4 (the order of the tokens and their groups: they depend on the tokens' entry counts
// only), in `ws`.
inline ffi::Error LaunchStatOrder(cudaStream_t stream, const Shapes& s, const int32_t* tok_off,
                                  const int32_t* seg_start, int32_t* ws, const std::string& who) {
  const unsigned chunks = static_cast<unsigned>((s.rows + kStatChunk - 1) / kStatChunk);
  const int keys_smem = StatKeysSmem(s.f);
  cudaFuncSetAttribute(StatKeysKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, keys_smem);
  cudaMemsetAsync(ws + StatLayoutFor(s).maxkey, 0, sizeof(int32_t), stream);
  StatKeysKernel<<<chunks, kStatChunk, keys_smem, stream>>>(tok_off, seg_start, ws, s);
  StatScanKernel<<<1, 1024, 0, stream>>>(seg_start, ws, s);
  StatOrderKernel<<<chunks, kStatChunk, 0, stream>>>(seg_start, ws, s);
  StatGroupsKernel<<<1, 1024, 0, stream>>>(seg_start, ws, s);
  return LaunchStatus((who + " stationary order").c_str());
}

// S5 into ws + glay_at: one word an entry, its value the h bits (kCoef false) or coef[e];
// kTwo, a second layout at ws + glay2_at with coef2[e]'s values, in the same pass.
template <typename E, bool kCoef, bool kTwo = false>
ffi::Error LaunchStatScatter(cudaStream_t stream, const Shapes& s, const int32_t* tok_off, const int32_t* seg_start,
                             const uint32_t* entries, const float* coef, const float* coef2, int32_t* ws,
                             int64_t glay_at, int64_t glay2_at, const std::string& who) {
  const unsigned blocks = static_cast<unsigned>((s.rows + kStatScatterWarps - 1) / kStatScatterWarps);
  auto scatter = StatClasses(s.f) == 4 ? StatScatterKernel<E, 4, kCoef, kTwo> : StatScatterKernel<E, 8, kCoef, kTwo>;
  scatter<<<blocks, 32 * kStatScatterWarps, 0, stream>>>(tok_off, seg_start, entries, coef, coef2, ws, glay_at, glay2_at, s);
  return LaunchStatus((who + " stationary layout").c_str());
}

// S6 over one table of f rows (Wd [f, d] as it is; kWeightsDF: Wact or Wu in their own
// [d, f] layout, StageTableFromWeights), the layout at ws + glay_at.
template <typename E, bool kWeightsDF, int kSum>
ffi::Error LaunchStatWalk(cudaStream_t stream, const Shapes& s, const int32_t* seg_start, const uint16_t* table,
                          const int32_t* ws, int64_t glay_at, float* sums, uint16_t* out, const std::string& who) {
  const int cols = StatCols(s.f);
  const int smem = s.f * 2 * cols;
  auto walk = cols == 16 ? StatDownKernel<E, 16, kWeightsDF, kSum> : StatDownKernel<E, 8, kWeightsDF, kSum>;
  cudaFuncSetAttribute(walk, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  walk<<<static_cast<unsigned>(s.d / cols), kStatThreads, smem, stream>>>(table, seg_start, ws, glay_at,
                                                                          sums, out, s);
  return LaunchStatus((who + " stationary walk").c_str());
}

// The down step: y = h Wd from the h words (after Finish), the layout in the partials.
// order_out (nullable; StatOrderWords): the tokens' order, copied out for a later dx walk.
template <typename E>
ffi::Error LaunchStationaryDown(cudaStream_t stream, const Shapes& s, const int32_t* tok_off, const int32_t* seg_start,
                                const uint32_t* h_words, const uint16_t* w_down, float* partial, uint16_t* y,
                                int32_t* order_out, const std::string& who) {
  int32_t* ws = reinterpret_cast<int32_t*>(partial);
  const StatLayout l = StatLayoutFor(s);
  ffi::Error status = LaunchStatOrder(stream, s, tok_off, seg_start, ws, who);
  if (status.failure()) return status;
  if (order_out != nullptr)
    cudaMemcpyAsync(order_out, ws + l.info, StatOrderWords(s) * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream);
  status = LaunchStatScatter<E, false>(stream, s, tok_off, seg_start, h_words, nullptr, nullptr, ws, l.glay, 0, who);
  if (status.failure()) return status;
  return LaunchStatWalk<E, false, kStatSumOut>(stream, s, seg_start, w_down, ws, l.glay, nullptr, y, who);
}

// The training backward's dx = dg Wact^T + du Wu^T (gated; dx = dg Wact^T not) over the
// coefficients `coef` [3 or 2, max_entries] (row 1: Wact^T's, row 2: Wu^T's, each rounded to
// the element type), the tables staged from Wact and Wu in their own [d, f] layout (no
// transposed copies), everything in `ws` (StationaryWalkWords(s, 2 gated, 1 not)). order_in
// (nullable; StatOrderWords): the tokens' order a forward's down walk computed from the same
// layout (LaunchStationaryDown's order_out), copied in for S1-S4. One walk over
// Wact^T's rows; gated, a second walk over Wu^T's rows with its own layout, the first walk's
// f32 sums kept by walk place and added once after the second walk's steps.
template <typename E, bool kGated>
ffi::Error LaunchStationaryDx(cudaStream_t stream, const Shapes& s, const int32_t* tok_off, const int32_t* seg_start,
                              const uint32_t* entries, const float* coef, const uint16_t* w_act, const uint16_t* w_up,
                              int32_t* ws, uint16_t* dx, const int32_t* order_in, const std::string& who) {
  const StatLayout l = StatLayoutFor(s);
  const int64_t glay_up = l.total, sums_at = l.total + l.glay_words;
  ffi::Error status = ffi::Error::Success();
  if (order_in != nullptr)
    cudaMemcpyAsync(ws + l.info, order_in, StatOrderWords(s) * sizeof(int32_t), cudaMemcpyDeviceToDevice, stream);
  else
    status = LaunchStatOrder(stream, s, tok_off, seg_start, ws, who);
  if (status.failure()) return status;
  // S5 once: Wact^T's words with coef[1] and (gated) Wu^T's with coef[2], two layouts
  status = LaunchStatScatter<E, true, kGated>(stream, s, tok_off, seg_start, entries, coef + s.max_entries,
                                              kGated ? coef + 2 * s.max_entries : nullptr, ws, l.glay, glay_up, who);
  if (status.failure()) return status;
  if constexpr (kGated) {
    float* sums = reinterpret_cast<float*>(ws + sums_at);
    status = LaunchStatWalk<E, true, kStatSumKeep>(stream, s, seg_start, w_act, ws, l.glay, sums, nullptr, who);
    if (status.failure()) return status;
    return LaunchStatWalk<E, true, kStatSumAdd>(stream, s, seg_start, w_up, ws, glay_up, sums, dx, who);
  } else {
    return LaunchStatWalk<E, true, kStatSumOut>(stream, s, seg_start, w_act, ws, l.glay, nullptr, dx, who);
  }
}

}  // namespace
}  // namespace jax_twell
