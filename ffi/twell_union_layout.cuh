// The union product's layout over the blocked entries (twell_blocked.cuh) and its launches:
// the training backward's dx (values: the coefficients dh u, dh g), the training forward's
// and the inference FFN's down step (values: h in the entry words), and the inference FFN's
// up step (each entry's index: u lands in its slot). Design and measurements:
// ffi/notes/training_kernels.md, "Dense products over a block's union", and
// ffi/notes/twell_ffn_blocked.md for the up step.
#pragma once

#include <string>
#include <type_traits>

#include "common.h"
#include "twell_blocked.cuh"
#include "twell_union.h"

namespace jax_twell {
namespace {

// Per 64-token sub-block of the blocked entries (twell_blocked.cuh): the union of its
// tokens' neurons with a non-zero value, the table rows of that union (R = 2 per
// neuron, gated: row id 2 j + 0 for Wact^T, 2 j + 1 for Wu^T; R = 1, non-gated) and one
// entry word per non-zero coefficient, counting-sorted by union chunk. A sub-block's union
// has at most as many neurons as it has entries, so its rows, chunk offsets and words all
// fit ranges placed by the entries before it: the layout needs ~2 R words per entry.
namespace up = union_product;
constexpr int kSubBlocks = kBlockTokens / up::kTok;  // sub-blocks per block

// What the layout kernel's words carry (its kValues parameter).
enum UnionValues : int {
  kCoefValues = 0,  // the backward's coefficients (dh u, dh g), rounded to the element type
  kWordValues = 1,  // h in the entry words' top 16 bits (down steps)
  kEntryIndex = 2,  // the up step: a word pair (column within the 256-neuron tile << 8 | token,
                    // entry index) per entry outside overflowed tiles, whatever its value
  kFiredIndex = 3,  // the backward's dh step: the same word pairs for every entry with g != 0,
                    // overflowed tiles' included
};

struct UnionWorkspace {
  up::UnionMeta* meta;  // [n_sub]
  uint32_t* ent;        // [W max_entries], W = R (2 for kEntryIndex): sub-block s from W (entries before s)
  int32_t* rows;        // [R max_entries + 32 n_sub]: from R (entries before s) + 32 s
  int32_t* chunk_off;   // [R max_entries / 32 + 2 n_sub + 1]: from that / 32 + 2 s
  int64_t ints;         // 4-byte words in all
};

int64_t UnionSubBlocks(const Shapes& s) { return CeilDiv(s.rows, up::kTok); }

// words_per_entry: the ent range's words per entry (R, or 2 for kEntryIndex's pairs).
UnionWorkspace UnionLayoutOf(const Shapes& s, int rows_per_neuron, void* base, int words_per_entry = 0) {
  UnionWorkspace w{};
  const int64_t n_sub = UnionSubBlocks(s), re = rows_per_neuron * s.max_entries;
  int32_t* p = static_cast<int32_t*>(base);
  w.meta = reinterpret_cast<up::UnionMeta*>(p);
  p += 4 * n_sub;
  w.ent = reinterpret_cast<uint32_t*>(p);
  p += words_per_entry > 0 ? words_per_entry * s.max_entries : re;
  w.rows = p;
  p += re + up::kChunk * n_sub;
  w.chunk_off = p;
  p += re / up::kChunk + 2 * n_sub + 1;
  w.ints = p - static_cast<int32_t*>(base);
  return w;
}

// Whether the union product can run dx here: the handler refuses bit 2 otherwise (the
// Python side checks the same first; cuda_train.union_dx_supported).
bool UnionDxSupported(const Shapes& s, int rows_per_neuron) {
  return s.d % up::kCols == 0 && s.f <= up::kMaxF &&
         UnionLayoutOf(s, rows_per_neuron, nullptr).ints < (int64_t{1} << 31);
}

// Whether the forward's down step can run as a union product (gated; its layout, R = 1,
// in the up step's partials workspace [d/64, max_entries] f32; cuda_train.union_down_supported).
bool UnionDownSupported(const Shapes& s) {
  return UnionDxSupported(s, 1) && UnionLayoutOf(s, 1, nullptr).ints <= static_cast<int64_t>(s.d / kUpCols) * s.max_entries;
}

// Where the up step's layout starts in the partials: after row 0, 8-byte aligned (word pairs).
int64_t UnionUpOffset(const Shapes& s) { return s.max_entries + (s.max_entries & 1); }

// Whether the inference FFN's up step can run as a union product (gated; its layout, R = 1
// with word pairs, in rows 1.. of the partials workspace [d/64, max_entries] f32, row 0
// taking u; cuda.union_up_supported).
bool UnionUpSupported(const Shapes& s) {
  return s.f <= up::kMaxF && s.d / kUpCols >= 2 &&
         UnionUpOffset(s) + UnionLayoutOf(s, 1, nullptr, 2).ints <= static_cast<int64_t>(s.d / kUpCols) * s.max_entries;
}

// Why the forward steps' union bits of a handler's mma attribute (2: down, 3: up) can't run
// here, or nullptr where they can (both the inference and the training forward handlers).
const char* UnionStepsRefusal(const Shapes& s, bool gated, int32_t mma) {
  if ((mma & 4) != 0 && !(gated && UnionDownSupported(s)))
    return "the down step as a union product (mma bit 2) needs the gated FFN, d a multiple of 256, f at most "
           "65536 and its layout within the partials [d/64, max_entries]";
  if ((mma & 8) != 0 && !(gated && UnionUpSupported(s)))
    return "the up step as a union product (mma bit 3) needs the gated FFN, f at most 65536 and its layout "
           "(~4 words per entry: d at least 320) within rows 1.. of the partials [d/64, max_entries]";
  return nullptr;
}

// Dynamic shared memory of TwellUnionLayoutKernel: the union bits and their prefix over
// ceil(f / 32) words, max_chunks + 1 chunk counters, and three words per tile (where the
// sub-block's entries of the tile start, where its second 32 tokens start, and the prefix
// of the tiles' entry counts).
int UnionLayoutSmem(const Shapes& s, int rows_per_neuron) {
  return static_cast<int>((2 * CeilDiv(s.f, 32) + CeilDiv(rows_per_neuron * s.f, up::kChunk) + 1 + 3 * s.n_tiles) * 4);
}

// Threads of a layout CTA. The kernel is latency-bound (dependent shared-memory and L2
// loads per entry, barriers between passes), so it runs as many warps per sub-block as
// a CTA holds: with 256 threads its 256 CTAs left ~15 warps per SM (23% occupancy). Two
// CTAs per SM (32 registers a thread at 1024) keep every sub-block of M=16,384 resident.
#ifndef TWELL_LAYOUT_THREADS
#define TWELL_LAYOUT_THREADS 1024
#endif
constexpr int kLayoutThreads = TWELL_LAYOUT_THREADS;
static_assert(kLayoutThreads % 32 == 0 && kLayoutThreads <= 1024, "a CTA of whole warps (BlockExclusiveScan: <= 32)");

// One CTA (kLayoutThreads) per sub-block; dynamic shared memory: UnionLayoutSmem. kValues
// (UnionValues) says what the words carry; kWordValues and kEntryIndex need R = 1.
// The sub-block's entries are visited as one flat range over all its tiles (a tile's
// share found by a binary search of the tile prefix in shared memory), so each pass is a
// few independent loads per thread, not a chain of dependent loads per tile.
template <typename E, int R, int kValues>
__global__ void __launch_bounds__(kLayoutThreads, 2048 / kLayoutThreads)
    TwellUnionLayoutKernel(const int32_t* __restrict__ tok_off, const int32_t* __restrict__ seg_start,
                           const uint32_t* __restrict__ entries, const float* __restrict__ coef, UnionWorkspace w,
                           Shapes s) {
  static_assert(kValues == kCoefValues || R == 1, "word values and entry indices: one table row per neuron");
  constexpr bool kIndex = kValues == kEntryIndex || kValues == kFiredIndex;
  extern __shared__ int32_t union_smem[];
  __shared__ int scratch[32];
  __shared__ int total;
  const int n_words = (s.f + 31) / 32;
  const int max_chunks = (R * s.f + up::kChunk - 1) / up::kChunk;
  uint32_t* bits = reinterpret_cast<uint32_t*>(union_smem);
  int32_t* pos = union_smem + n_words;
  int32_t* cnt = pos + n_words;
  int32_t* tile_first = cnt + max_chunks + 1;  // entry index of the tile's first entry of the sub-block
  int32_t* tile_mid = tile_first + s.n_tiles;  // entries of the sub-block's first 32 tokens in the tile
  int32_t* tile_pre = tile_mid + s.n_tiles;    // entries of the sub-block in the tiles before
  const int sub = blockIdx.x, b = sub / kSubBlocks, t0 = (sub % kSubBlocks) * up::kTok, tid = threadIdx.x;
  const float* coefs[2] = {coef + s.max_entries, coef + 2 * s.max_entries};  // Wact^T, Wu^T rows (backward)
  const bool over = OverBudget(s, seg_start);
  for (int i = tid; i < n_words; i += kLayoutThreads) bits[i] = 0;
  // The tiles' ranges, all loaded at once; before: the block's entries of tokens before t0.
  int before = 0, n_entries = 0;
  if (!over) {
    for (int k0 = 0; k0 < s.n_tiles; k0 += kLayoutThreads) {
      const int k = k0 + tid;
      int lo = 0, mid = 0, hi = 0, first = 0;
      if (k < s.n_tiles) {
        const int seg = b * s.n_tiles + k;
        const int32_t* off = tok_off + static_cast<int64_t>(seg) * (kBlockTokens + 1);
        lo = off[t0];
        mid = off[t0 + 32];
        hi = off[t0 + up::kTok];
        first = seg_start[seg] + lo;
      }
      before += lo;
      const int o = BlockExclusiveScan(hi - lo, scratch, &total);
      if (k < s.n_tiles) {
        tile_first[k] = first;
        tile_mid[k] = mid - lo;
        tile_pre[k] = n_entries + o;
      }
      n_entries += total;
    }
  }
  __syncthreads();
  // Visits every entry of the sub-block: fn(entry, neuron, token within the sub-block).
  auto for_each_entry = [&](auto fn) {
    for (int i = tid; i < n_entries; i += kLayoutThreads) {
      int k = 0, hi_k = s.n_tiles - 1;  // the last tile whose prefix is <= i (empty tiles share it)
      while (k < hi_k) {
        const int m = (k + hi_k + 1) / 2;
        if (tile_pre[m] <= i) k = m;
        else hi_k = m - 1;
      }
      const int r = i - tile_pre[k];
      const int64_t e = static_cast<int64_t>(tile_first[k]) + r;
      const uint32_t word = entries[e];
      const int t = (r >= tile_mid[k] ? 32 : 0) + static_cast<int>((word >> kWordTokenShift) & 31);
      fn(e, k * s.tile + static_cast<int>(word & kColumnMask), t);
    }
  };
  // Non-zero where entry e contributes table row r (kEntryIndex: every entry outside an
  // overflowed tile, which Recompute handles whole; kFiredIndex: every entry with g != 0).
  auto coef_bits = [&](int r, int64_t e) -> uint32_t {
    if constexpr (kValues == kFiredIndex)
      return ((entries[e] >> 16) & 0x7fffu) != 0u ? 1u : 0u;
    else if constexpr (kIndex)
      return (entries[e] & kFlag) ? 0u : 1u;
    else if constexpr (kValues == kWordValues)
      return entries[e] >> 16;
    else
      return E::FromFloat(coefs[r][e]);
  };
  if (!over) {
    for_each_entry([&](int64_t e, int j, int) {
      bool any = false;
#pragma unroll
      for (int r = 0; r < R; ++r) any |= coef_bits(r, e) != 0u;
      if (any) atomicOr(&bits[j / 32], 1u << (j % 32));
    });
  }
  BlockExclusiveScan(before, scratch, &total);
  const int64_t ent_base = R * (static_cast<int64_t>(over ? 0 : seg_start[b * s.n_tiles]) + total);
  const int64_t row_base = ent_base + static_cast<int64_t>(up::kChunk) * sub;
  const int64_t chunk_base = ent_base / up::kChunk + 2 * static_cast<int64_t>(sub);
  // Union positions: exclusive prefix of the words' popcounts (words_per thread contiguous).
  const int per = (n_words + kLayoutThreads - 1) / kLayoutThreads;
  int mine = 0;
  for (int i = tid * per; i < min(n_words, (tid + 1) * per); ++i) mine += __popc(bits[i]);
  int acc = BlockExclusiveScan(mine, scratch, &total);
  for (int i = tid * per; i < min(n_words, (tid + 1) * per); ++i) {
    pos[i] = acc;
    acc += __popc(bits[i]);
  }
  const int n_rows = R * total, chunks = (n_rows + up::kChunk - 1) / up::kChunk;
  for (int i = tid; i <= chunks; i += kLayoutThreads) cnt[i] = 0;
  __syncthreads();
  auto position = [&](int j) { return pos[j / 32] + __popc(bits[j / 32] & ((1u << (j % 32)) - 1u)); };
  for (int i = tid; i < n_words; i += kLayoutThreads)
    for (uint32_t m = bits[i]; m != 0u; m &= m - 1u) {
      const int j = 32 * i + __ffs(m) - 1, p = position(j);
#pragma unroll
      for (int r = 0; r < R; ++r) w.rows[row_base + R * p + r] = R == 2 ? 2 * j + r : j;
    }
  for (int i = n_rows + tid; i < chunks * up::kChunk; i += kLayoutThreads) w.rows[row_base + i] = 0;  // A is zero there
  if (!over)
    for_each_entry([&](int64_t e, int j, int) {
#pragma unroll
      for (int r = 0; r < R; ++r)
        if (coef_bits(r, e) != 0u) atomicAdd(&cnt[(R * position(j) + r) / up::kChunk], 1);
    });
  __syncthreads();
  // Chunk offsets (absolute in ent) and the scatter cursors.
  int carry = 0;
  for (int c0 = 0; c0 < chunks; c0 += kLayoutThreads) {
    const int c = c0 + tid;
    const int n = c < chunks ? cnt[c] : 0;
    const int o = BlockExclusiveScan(n, scratch, &total);
    if (c < chunks) {
      w.chunk_off[chunk_base + c] = static_cast<int32_t>(ent_base + carry + o);
      cnt[c] = carry + o;
    }
    carry += total;
  }
  if (tid == 0) {
    w.chunk_off[chunk_base + chunks] = static_cast<int32_t>(ent_base + carry);
    w.meta[sub] = up::UnionMeta{over ? 0 : chunks, static_cast<int>(row_base), static_cast<int>(chunk_base),
                                over ? 1 : 0};
  }
  __syncthreads();
  if (!over)
    for_each_entry([&](int64_t e, int j, int t) {
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const uint32_t v = coef_bits(r, e);
        if (v == 0u) continue;
        const int u = R * position(j) + r;
        const int slot = atomicAdd(&cnt[u / up::kChunk], 1);
        if constexpr (kIndex)
          reinterpret_cast<uint2*>(w.ent)[ent_base + slot] =
              make_uint2(static_cast<uint32_t>(u % up::kUpNeurons) << 8 | static_cast<uint32_t>(t),
                         static_cast<uint32_t>(e));
        else
          w.ent[ent_base + slot] = v << 16 | static_cast<uint32_t>(u % up::kChunk) << 8 | static_cast<uint32_t>(t);
      }
    });
}

// The layout kernel and the product: out[t] = sum over t's values v_j of v_j table[row j].
template <typename E, int R, int kValues>
ffi::Error LaunchUnion(cudaStream_t stream, const Shapes& s, const int32_t* tok_off, const int32_t* seg_start,
                       const uint32_t* words, const float* coef, const uint16_t* table0, const uint16_t* table1,
                       void* workspace, uint16_t* out, const char* what) {
  const UnionWorkspace w = UnionLayoutOf(s, R, workspace);
  const int n_sub = static_cast<int>(UnionSubBlocks(s));
  const int smem = UnionLayoutSmem(s, R);
  auto* layout = TwellUnionLayoutKernel<E, R, kValues>;
  cudaFuncSetAttribute(layout, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  layout<<<n_sub, kLayoutThreads, smem, stream>>>(tok_off, seg_start, words, coef, w, s);
  ffi::Error status = LaunchStatus(what);
  if (status.failure()) return status;
  const cudaError_t e = up::LaunchProduct(stream, std::is_same_v<E, Bf16>, R, table0, table1, s.d, s.rows, n_sub,
                                          w.meta, w.rows, w.chunk_off, w.ent, out);
  if (e != cudaSuccess) return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// The inference FFN's up step as a union product (gated): the layout (word pairs) in rows
// 1.. of the partials, u of every entry outside overflowed tiles into row 0 (f32, one sum
// over d; Finish then runs with one range). x [M, d], w_up_t [f, d].
// kFiredIndex: the training backward's dh = dy . Wd rows (x = dy, w_up_t = Wd) at every entry
// with g != 0.
template <typename E, int kValues = kEntryIndex>
ffi::Error LaunchUnionUp(cudaStream_t stream, const Shapes& s, const int32_t* tok_off, const int32_t* seg_start,
                         const uint32_t* entries, const uint16_t* x, const uint16_t* w_up_t, float* partial) {
  static_assert(kValues == kEntryIndex || kValues == kFiredIndex, "the up product reads word pairs");
  const char* what = kValues == kEntryIndex ? "up step as a union product" : "dh step as a union product";
  const UnionWorkspace w = UnionLayoutOf(s, 1, partial + UnionUpOffset(s), 2);
  const int n_sub = static_cast<int>(UnionSubBlocks(s));
  const int smem = UnionLayoutSmem(s, 1);
  auto* layout = TwellUnionLayoutKernel<E, 1, kValues>;
  cudaFuncSetAttribute(layout, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  layout<<<n_sub, kLayoutThreads, smem, stream>>>(tok_off, seg_start, entries, nullptr, w, s);
  ffi::Error status = LaunchStatus(what);
  if (status.failure()) return status;
  const cudaError_t e = up::LaunchUpProduct(stream, std::is_same_v<E, Bf16>, x, w_up_t, s.d, s.f, s.rows, n_sub, w.meta,
                                            w.rows, w.chunk_off, reinterpret_cast<const uint2*>(w.ent), partial);
  if (e != cudaSuccess) return ffi::Error::Internal(std::string(what) + ": " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_twell
