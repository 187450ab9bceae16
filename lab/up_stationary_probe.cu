// up_stationary_probe: the up product's partial dot products with the weight held in shared
// memory for the whole launch (ffi/notes/limits.md, "Next: the up product stationary too").
//
// The up step computes u[t, n] = x[t] . Wu[:, n] for the active (token, neuron) pairs only.
// The library's blocked handler already sums per-entry partial dot products over d / 64
// column ranges of x (the partials [d / 64, max_entries], summed by Finish), so a CTA can
// own a range of K neurons and a range of 64 of x's columns, keep Wu^T[n0 : n0 + K,
// 64 r : 64 r + 64] (K x 128 bytes) for the launch, and walk every group of 16 tokens: a
// tensor-core product of the group's x (16 x 64, loaded once) by the union of its tokens'
// active neurons in the range (B rows gathered from shared memory by ldmatrix, eight
// neurons a chunk), of which it stores the products of the active pairs as partials.
//
// What bounds it: shared memory. A chunk's two ldmatrix.x4 read eight union rows (128 bytes
// each) in eight phases of eight 16-byte pieces; a row's pieces are stored XOR-swizzled by
// n mod 8, so a phase is conflict-free where its eight neurons differ mod 8. Variants:
//   plain    the union in ascending order, eight at a time (random residues: ~2.5 rows a
//            bank group at worst per phase);
//   residue  the union dealt by residue mod 8 (chunk k takes the k-th neuron of each
//            residue class; zero rows pad the classes that run out): conflict-free, with
//            ~1.3x the chunks at 0.5% (the largest class sets the count);
//   load     only the weight slice's load and the walk's bookkeeping, no product.
// Measured (up_stationary_probe_2f201b8.txt): all three bound by that bookkeeping (each
// chunk waited on dependent loads of its pair lists and scattered partials in entry order).
//   v2_plain, v2_residue: UpKernel<2>, the same products with a chunk record of 32 bytes (its
//            eight neurons and a 128-bit mask of the group's active (token, slot) pairs),
//            32 records at a time staged in the warp's shared memory by one coalesced load;
//            each thread stores the partials of its own accumulators where the mask has
//            them, in the mask's bit order (the partials come out in pair order, coalesced;
//            the library's Finish would read them through an index).
// Measured (up_stationary_probe_v2_bc6395b.txt): v2_plain 358 us, v2_residue 404, v2_load 264
// (the union up product: 246 us). v2_load is issue-bound (~75 warp instructions a chunk, paid
// by each of the 32 column-range CTAs), v2_plain L1-bound (ldmatrix conflicts): dropped
// (ffi/notes/limits.md).
// The host builds the layouts (the library would build them on the device, like the union
// products' layout). Checked: the partials of a sample of entries against a double sum.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a lab/up_stationary_probe.cu -o up_stationary_probe
// Run:   ./up_stationary_probe [M=16384] [d=2048] [f=5632] [density=0.005] [pattern=uniform|heavy] [K=1536] [host]
//        ("host": only UpKernel<2>'s output indexing replayed on the CPU against the layout)
// Prints one line per variant: microseconds per launch (median of 20), pairs, chunks a
// CTA walks (the largest), and the check's worst relative error.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "probe_barrier.cuh"
#include "probe_rows.h"

namespace {

constexpr int kCols = 64;        // x columns (and Wu^T row elements) a CTA owns
constexpr int kRowBytes = 128;   // one neuron's 64 bf16
constexpr int kGroup = 16;       // tokens of a product (its M)
constexpr int kThreads = 1024;   // 32 warps, a group each at a time
constexpr int kScratch = kGroup * 8;  // floats of a warp's 16 x 8 product tile

// v2: per chunk 8 words, the slots' local neurons (two a word, slot 2i low) then the mask
// (bit 8 t + s: token t of the group at slot s; word w holds tokens 4w .. 4w + 3).
struct Layout2 {
  const int* chunk_off;   // [groups * ranges + 1]
  const uint4* records;   // [chunks * 2]
  const int* pair_base;   // [groups * ranges] first pair (in the output's order) of (group, range)
};

struct Layout {
  const int* chunk_off;    // [groups * ranges + 1] first chunk of (group, range)
  const uint16_t* chunks;  // [chunks * 8] local neuron of each slot (K + slot: a zero row)
  const int* pair_off;     // [chunks + 1] first pair of each chunk
  const uint32_t* pairs;   // token in group << 3 | slot
  const int* pair_entry;   // the pair's entry (index into the partials' row)
};

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// The CTA's slice of Wu^T to shared memory: 16-byte piece q of row n at piece q ^ (n % 8);
// rows past f and the eight padding rows (K .. K + 7) zero.
__device__ __forceinline__ void LoadSlab(uint32_t slab, const __nv_bfloat16* wut, int d, int f, int k_range, int n0,
                                         int c0) {
  for (int i = threadIdx.x; i < (k_range + 8) * 8; i += blockDim.x) {
    const int n = i / 8, q = i % 8;
    const uint32_t dst = slab + n * kRowBytes + ((q ^ (n & 7)) * 16);
    if (n < k_range && n0 + n < f)
      probe::CpAsync16(dst, wut + static_cast<int64_t>(n0 + n) * d + c0 + q * 8);
    else
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};" ::"r"(dst), "r"(0u));
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
}

// acc += the group's x (A) times the chunk's eight neurons' rows: lane L gives row L % 8 of
// matrix L / 8, its slot's neuron nl, 16-byte piece (L / 8) of the half h (pieces 0-3:
// columns 0-31, 4-7: 32-63).
__device__ __forceinline__ void ChunkProduct(float (&acc)[4], const uint32_t (&a)[4][4], uint32_t slab, int nl,
                                             int lane) {
  const uint32_t row = slab + nl * kRowBytes;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    uint32_t b[4];
    LdMatrixX4(b, row + (((4 * h + lane / 8) ^ (nl & 7)) * 16));
    Mma(acc, a[2 * h], b[0], b[1]);
    Mma(acc, a[2 * h + 1], b[2], b[3]);
  }
}

// CTA (j, r) of the grid (ranges x d / 64): neurons [j K, j K + K), x columns [64 r,
// 64 r + 64); its slice loaded.
struct Cta {
  int j, r, c0, lane, warp;
  uint32_t slab;
};

__device__ __forceinline__ Cta Start(unsigned char* smem, const __nv_bfloat16* wut, int d, int f, int k_range,
                                     int ranges) {
  Cta c{static_cast<int>(blockIdx.x) % ranges, static_cast<int>(blockIdx.x) / ranges, 0,
        static_cast<int>(threadIdx.x) % 32, static_cast<int>(threadIdx.x) / 32, probe::Smem(smem)};
  c.c0 = c.r * kCols;
  LoadSlab(c.slab, wut, d, f, k_range, c.j * k_range, c.c0);
  return c;
}

// A: group g's x[:, c0 : c0 + 64], four k-steps of the m16n8k16 row-major fragment (rows
// past m zero).
__device__ __forceinline__ void LoadA(uint32_t (&a)[4][4], const __nv_bfloat16* x, int m, int d, int g, int c0, int g4,
                                      int q4) {
  const int t0 = g * kGroup + g4, t1 = t0 + 8;
  const uint32_t* x0 = reinterpret_cast<const uint32_t*>(x + static_cast<int64_t>(t0) * d + c0);
  const uint32_t* x1 = reinterpret_cast<const uint32_t*>(x + static_cast<int64_t>(t1) * d + c0);
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    a[ks][0] = t0 < m ? __ldg(x0 + 8 * ks + q4) : 0u;
    a[ks][1] = t1 < m ? __ldg(x1 + 8 * ks + q4) : 0u;
    a[ks][2] = t0 < m ? __ldg(x0 + 8 * ks + 4 + q4) : 0u;
    a[ks][3] = t1 < m ? __ldg(x1 + 8 * ks + 4 + q4) : 0u;
  }
}

// v1: chunk lists and pair lists read per chunk, partials scattered in entry order.
template <bool kCompute>
__device__ __forceinline__ void WalkV1(const Cta& cta, unsigned char* smem, const __nv_bfloat16* __restrict__ x,
                                       const Layout& lay, float* __restrict__ partial, int m, int d, int k_range,
                                       int ranges, int64_t entries) {
  const int j = cta.j, r = cta.r, c0 = cta.c0, lane = cta.lane, warp = cta.warp;
  const uint32_t slab = cta.slab;
  float* scratch = reinterpret_cast<float*>(smem + (k_range + 8) * kRowBytes) + warp * kScratch;
  const int g4 = lane / 4, q4 = lane % 4;
  const int groups = (m + kGroup - 1) / kGroup;
  for (int g = warp; g < groups; g += kThreads / 32) {
    const int ch0 = lay.chunk_off[g * ranges + j], ch1 = lay.chunk_off[g * ranges + j + 1];
    if (ch0 == ch1) continue;
    uint32_t a[4][4];
    LoadA(a, x, m, d, g, c0, g4, q4);
    for (int c = ch0; c < ch1; ++c) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      if (kCompute) ChunkProduct(acc, a, slab, lay.chunks[c * 8 + lane % 8], lane);
      // D (16 tokens x 8 slots) to the warp's scratch, then the active pairs' partials
      scratch[g4 * 8 + 2 * q4] = acc[0];
      scratch[g4 * 8 + 2 * q4 + 1] = acc[1];
      scratch[(g4 + 8) * 8 + 2 * q4] = acc[2];
      scratch[(g4 + 8) * 8 + 2 * q4 + 1] = acc[3];
      __syncwarp();
      const int p1 = lay.pair_off[c + 1];
      for (int p = lay.pair_off[c] + lane; p < p1; p += 32) {
        const uint32_t w = lay.pairs[p];
        partial[static_cast<int64_t>(r) * entries + lay.pair_entry[p]] = scratch[(w >> 3) * 8 + (w & 7)];
      }
      __syncwarp();
    }
  }
}

constexpr int kStageBytes = 32 * 32;  // a warp's staged records: 32 chunks x 32 bytes

// v2: 32-byte chunk records staged per warp, partials in mask order.
template <bool kCompute>
__device__ __forceinline__ void WalkV2(const Cta& cta, unsigned char* smem, const __nv_bfloat16* __restrict__ x,
                                       const Layout2& lay, float* __restrict__ partial, int m, int d, int k_range,
                                       int ranges, int64_t pairs) {
  const int j = cta.j, c0 = cta.c0, lane = cta.lane;
  unsigned char* stage = smem + (k_range + 8) * kRowBytes + cta.warp * kStageBytes;
  const int g4 = lane / 4, q4 = lane % 4;
  const int groups = (m + kGroup - 1) / kGroup;
  float* out = partial + static_cast<int64_t>(cta.r) * pairs;
  // this thread's outputs: token g4 at slots 2 q4, 2 q4 + 1 (mask word g4 / 4), token g4 + 8
  // (word 2 + g4 / 4); bit positions within the word
  const int pos = (g4 % 4) * 8 + 2 * q4;
  const uint32_t below = (1u << pos) - 1u;
  for (int g = cta.warp; g < groups; g += kThreads / 32) {
    const int ch0 = lay.chunk_off[g * ranges + j], ch1 = lay.chunk_off[g * ranges + j + 1];
    if (ch0 == ch1) continue;
    int run = lay.pair_base[g * ranges + j];
    uint32_t a[4][4];
    LoadA(a, x, m, d, g, c0, g4, q4);
    for (int b0 = ch0; b0 < ch1; b0 += 32) {
      const int nb = min(32, ch1 - b0);
      __syncwarp();
      if (lane < nb) {
        const uint4 lo = __ldg(lay.records + 2 * (b0 + lane)), hi = __ldg(lay.records + 2 * (b0 + lane) + 1);
        *reinterpret_cast<uint4*>(stage + lane * 32) = lo;
        *reinterpret_cast<uint4*>(stage + lane * 32 + 16) = hi;
      }
      __syncwarp();
      for (int cl = 0; cl < nb; ++cl) {
        const int nl = *reinterpret_cast<const uint16_t*>(stage + cl * 32 + 2 * (lane % 8));
        const uint4 mask = *reinterpret_cast<const uint4*>(stage + cl * 32 + 16);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (kCompute) ChunkProduct(acc, a, cta.slab, nl, lane);
        const int p0 = __popc(mask.x), p1 = p0 + __popc(mask.y), p2 = p1 + __popc(mask.z);
        const uint32_t wa = g4 < 4 ? mask.x : mask.y, wb = g4 < 4 ? mask.z : mask.w;
        const int ba = run + (g4 < 4 ? 0 : p0) + __popc(wa & below);
        const int bb = run + (g4 < 4 ? p1 : p2) + __popc(wb & below);
        if ((wa >> pos) & 1u) out[ba] = acc[0];
        if ((wa >> (pos + 1)) & 1u) out[ba + ((wa >> pos) & 1u)] = acc[1];
        if ((wb >> pos) & 1u) out[bb] = acc[2];
        if ((wb >> (pos + 1)) & 1u) out[bb + ((wb >> pos) & 1u)] = acc[3];
        run = run + p2 + __popc(mask.w);
      }
    }
  }
}

// grid (ranges x d / 64): CTA (j, r) owns neurons [j K, j K + K) and x columns [64 r, 64 r + 64).
template <int kVersion, bool kCompute>
__global__ void __launch_bounds__(kThreads, 1) UpKernel(const __nv_bfloat16* __restrict__ x,
                                                       const __nv_bfloat16* __restrict__ wut, Layout lay, Layout2 lay2,
                                                       float* __restrict__ partial, int m, int d, int f, int k_range,
                                                       int ranges, int64_t entries) {
  extern __shared__ __align__(128) unsigned char smem[];
  const Cta cta = Start(smem, wut, d, f, k_range, ranges);
  if constexpr (kVersion == 1)
    WalkV1<kCompute>(cta, smem, x, lay, partial, m, d, k_range, ranges, entries);
  else
    WalkV2<kCompute>(cta, smem, x, lay2, partial, m, d, k_range, ranges, entries);
}

struct HostLayout {
  std::vector<int> chunk_off, pair_off, pair_entry;
  std::vector<uint16_t> chunks;
  std::vector<uint32_t> pairs;
  // v2: the chunk records, each (group, range)'s first pair, and the entry of each pair in
  // the mask order
  std::vector<uint32_t> records;
  std::vector<int> pair_base, pair2_entry;
};

// Per (group, range): the union of the group's neurons in the range, in chunks of eight;
// `residue`: chunk k holds the k-th neuron of each residue class mod 8 (slot = residue).
HostLayout BuildLayout(const probe::ActiveRows& rows, int m, int k_range, int ranges, bool residue) {
  HostLayout h;
  const int groups = (m + kGroup - 1) / kGroup;
  h.chunk_off.push_back(0);
  h.pair_off.push_back(0);
  std::vector<std::vector<std::pair<int, int>>> at;  // per local neuron: (token in group, entry)
  at.resize(k_range);
  std::vector<int> used;
  for (int g = 0; g < groups; ++g) {
    for (int j = 0; j < ranges; ++j) {
      const int n0 = j * k_range;
      used.clear();
      for (int i = 0; i < kGroup && g * kGroup + i < m; ++i) {
        const int t = g * kGroup + i;
        const int* b = rows.neurons.data() + rows.row_ptr[t];
        const int* e = rows.neurons.data() + rows.row_ptr[t + 1];
        for (const int* p = std::lower_bound(b, e, n0); p != e && *p < n0 + k_range; ++p) {
          const int nl = *p - n0;
          if (at[nl].empty()) used.push_back(nl);
          at[nl].push_back({i, static_cast<int>(p - rows.neurons.data())});
        }
      }
      std::sort(used.begin(), used.end());
      std::vector<std::vector<int>> slots;  // chunks, 8 local neurons each (-1: padding)
      if (residue) {
        std::vector<int> cls[8];
        for (int nl : used) cls[nl & 7].push_back(nl);
        size_t n_chunks = 0;
        for (auto& c : cls) n_chunks = std::max(n_chunks, c.size());
        for (size_t k = 0; k < n_chunks; ++k) {
          std::vector<int> s(8, -1);
          for (int q = 0; q < 8; ++q)
            if (k < cls[q].size()) s[q] = cls[q][k];
          slots.push_back(s);
        }
      } else {
        for (size_t k = 0; k < used.size(); k += 8) {
          std::vector<int> s(8, -1);
          for (size_t q = 0; q < 8 && k + q < used.size(); ++q) s[q] = used[k + q];
          slots.push_back(s);
        }
      }
      h.pair_base.push_back(static_cast<int>(h.pair2_entry.size()));
      for (const auto& s : slots) {
        int bit_entry[kGroup * 8];
        std::fill(bit_entry, bit_entry + kGroup * 8, -1);
        uint32_t rec[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        for (int q = 0; q < 8; ++q) {
          const uint16_t nl = static_cast<uint16_t>(s[q] >= 0 ? s[q] : k_range + q);
          h.chunks.push_back(nl);
          rec[q / 2] |= static_cast<uint32_t>(nl) << (16 * (q % 2));
          if (s[q] < 0) continue;
          for (const auto& te : at[s[q]]) {
            h.pairs.push_back(static_cast<uint32_t>(te.first) << 3 | static_cast<uint32_t>(q));
            h.pair_entry.push_back(te.second);
            const int bit = te.first * 8 + q;
            rec[4 + bit / 32] |= 1u << (bit % 32);
            bit_entry[bit] = te.second;
          }
        }
        h.pair_off.push_back(static_cast<int>(h.pairs.size()));
        h.records.insert(h.records.end(), rec, rec + 8);
        for (int bit = 0; bit < kGroup * 8; ++bit)
          if (bit_entry[bit] >= 0) h.pair2_entry.push_back(bit_entry[bit]);
      }
      h.chunk_off.push_back(static_cast<int>(h.chunk_off.back() + slots.size()));
      for (int nl : used) at[nl].clear();
    }
  }
  return h;
}

// UpKernel<2>'s output indexing replayed on the host (no GPU): every thread's four outputs of
// every chunk land, through the mask and the running count, on the partial of the entry
// whose (token, slot) they hold, and every pair is written once. Returns the mismatches.
int64_t CheckIndexing(const HostLayout& h, const probe::ActiveRows& rows, int m, int k_range, int ranges) {
  const int groups = (m + kGroup - 1) / kGroup;
  std::vector<int> written(h.pair2_entry.size(), 0);
  int64_t bad = 0;
  for (int g = 0; g < groups; ++g) {
    for (int j = 0; j < ranges; ++j) {
      int run = h.pair_base[g * ranges + j];
      for (int c = h.chunk_off[g * ranges + j]; c < h.chunk_off[g * ranges + j + 1]; ++c) {
        const uint32_t* rec = h.records.data() + 8 * c;
        const uint32_t mx = rec[4], my = rec[5], mz = rec[6], mw = rec[7];
        const int p0 = __builtin_popcount(mx), p1 = p0 + __builtin_popcount(my), p2 = p1 + __builtin_popcount(mz);
        for (int lane = 0; lane < 32; ++lane) {
          const int g4 = lane / 4, q4 = lane % 4, pos = (g4 % 4) * 8 + 2 * q4;
          const uint32_t below = (1u << pos) - 1u;
          const uint32_t wa = g4 < 4 ? mx : my, wb = g4 < 4 ? mz : mw;
          const int ba = run + (g4 < 4 ? 0 : p0) + __builtin_popcount(wa & below);
          const int bb = run + (g4 < 4 ? p1 : p2) + __builtin_popcount(wb & below);
          const int idx[4] = {ba, ba + static_cast<int>((wa >> pos) & 1u), bb, bb + static_cast<int>((wb >> pos) & 1u)};
          const bool on[4] = {((wa >> pos) & 1u) != 0, ((wa >> (pos + 1)) & 1u) != 0, ((wb >> pos) & 1u) != 0,
                              ((wb >> (pos + 1)) & 1u) != 0};
          const int tok[4] = {g4, g4, g4 + 8, g4 + 8}, slot[4] = {2 * q4, 2 * q4 + 1, 2 * q4, 2 * q4 + 1};
          for (int k = 0; k < 4; ++k) {
            if (!on[k]) continue;
            const int t = g * kGroup + tok[k];
            const int nl = static_cast<int>((rec[slot[k] / 2] >> (16 * (slot[k] % 2))) & 0xffffu);
            const int e = h.pair2_entry[idx[k]];
            ++written[idx[k]];
            const bool own = t < m && e >= rows.row_ptr[t] && e < rows.row_ptr[t + 1] && nl < k_range &&
                             rows.neurons[e] == j * k_range + nl;
            bad += !own;
          }
        }
        run += p2 + __builtin_popcount(mw);
      }
    }
  }
  for (int w : written) bad += w != 1;
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  const probe::Shape shape = probe::ParseShape(argc, argv);
  const int m = shape.m, d = shape.d, f = shape.f;
  const double p = shape.p;
  const std::string& pattern = shape.pattern;
  const int k_range = argc > 6 ? std::atoi(argv[6]) : 1536;
  const int ranges = (f + k_range - 1) / k_range;
  if (argc > 7 && std::string(argv[7]) == "host") {  // the indexing check alone, no GPU
    std::mt19937_64 rng(4321);
    const probe::ActiveRows rows = probe::DrawRows(m, f, p, pattern, rng);
    for (int residue = 0; residue < 2; ++residue) {
      const HostLayout h = BuildLayout(rows, m, k_range, ranges, residue != 0);
      const int64_t bad = CheckIndexing(h, rows, m, k_range, ranges);
      std::printf("%s: %zu pairs of %zu entries laid out, %lld indexing mismatches\n", residue ? "residue" : "plain",
                  h.pair2_entry.size(), rows.neurons.size(), static_cast<long long>(bad));
      if (bad != 0 || h.pair2_entry.size() != rows.neurons.size()) return 1;
    }
    return 0;
  }
  const int smem = (k_range + 8) * kRowBytes + kThreads / 32 * kStageBytes;  // v2's staging > v1's scratch
  int max_smem = 0;
  CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  if (d % kCols != 0 || k_range > 65536 - 8 || smem > max_smem) {
    std::fprintf(stderr, "needs d a multiple of 64 and (K + 8) x 128 + 32 KB <= %d bytes of shared memory\n", max_smem);
    return 1;
  }
  std::mt19937_64 rng(4321);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<uint16_t> x(static_cast<size_t>(m) * d), wut(static_cast<size_t>(f) * d);
  for (auto& v : x) v = probe::FloatToBf16(uni(rng));
  for (auto& v : wut) v = probe::FloatToBf16(uni(rng) * 0.05f);
  const probe::ActiveRows rows = probe::DrawRows(m, f, p, pattern, rng);
  const int64_t entries = static_cast<int64_t>(rows.neurons.size());
  std::printf("M=%d d=%d f=%d p=%.4f %s K=%d: %lld pairs (%.1f a token), %d x %d CTAs, %d B shared\n", m, d, f, p,
              pattern.c_str(), k_range, static_cast<long long>(entries), static_cast<double>(entries) / m, ranges,
              d / kCols, smem);

  __nv_bfloat16* d_x = reinterpret_cast<__nv_bfloat16*>(probe::Upload(x));
  __nv_bfloat16* d_wut = reinterpret_cast<__nv_bfloat16*>(probe::Upload(wut));
  float* d_partial;
  CHECK(cudaMalloc(&d_partial, static_cast<size_t>(d / kCols) * entries * 4 + 4));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  CHECK(cudaFuncSetAttribute(UpKernel<1, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(UpKernel<1, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(UpKernel<2, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  CHECK(cudaFuncSetAttribute(UpKernel<2, false>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));

  const char* names[] = {"plain", "residue", "load", "v2_plain", "v2_residue", "v2_load"};
  for (int v = 0; v < 6; ++v) {
    const bool v2 = v >= 3, compute = v % 3 != 2;
    const HostLayout h = BuildLayout(rows, m, k_range, ranges, v % 3 != 0);
    int worst = 0;  // chunks of the busiest range
    const int groups = (m + kGroup - 1) / kGroup;
    for (int j = 0; j < ranges; ++j) {
      int n = 0;
      for (int g = 0; g < groups; ++g) n += h.chunk_off[g * ranges + j + 1] - h.chunk_off[g * ranges + j];
      worst = std::max(worst, n);
    }
    Layout lay{probe::Upload(h.chunk_off), probe::Upload(h.chunks), probe::Upload(h.pair_off), probe::Upload(h.pairs), probe::Upload(h.pair_entry)};
    Layout2 lay2{lay.chunk_off, reinterpret_cast<const uint4*>(probe::Upload(h.records)), probe::Upload(h.pair_base)};
    CHECK(cudaMemset(d_partial, 0xff, static_cast<size_t>(d / kCols) * entries * 4));
    const unsigned grid = ranges * (d / kCols);
    auto launch = [&] {
      auto kernel = v2 ? (compute ? UpKernel<2, true> : UpKernel<2, false>)
                       : (compute ? UpKernel<1, true> : UpKernel<1, false>);
      kernel<<<grid, kThreads, smem>>>(d_x, d_wut, lay, lay2, d_partial, m, d, f, k_range, ranges, entries);
    };
    launch();
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<float> times;
    for (int i = 0; i < 20; ++i) {
      CHECK(cudaEventRecord(start));
      launch();
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      float t;
      CHECK(cudaEventElapsedTime(&t, start, stop));
      times.push_back(1e3f * t);
    }
    std::sort(times.begin(), times.end());
    double err = 0.0;
    if (compute) {  // a sample of entries, every column range: against a double sum
      std::vector<float> part(static_cast<size_t>(d / kCols) * entries);
      CHECK(cudaMemcpy(part.data(), d_partial, part.size() * 4, cudaMemcpyDeviceToHost));
      std::vector<int> slot_of(entries);  // where each entry's partial is: entry order (v1), pair order (v2)
      for (int64_t e = 0; e < entries; ++e) slot_of[e] = static_cast<int>(e);
      if (v2)
        for (size_t q = 0; q < h.pair2_entry.size(); ++q) slot_of[h.pair2_entry[q]] = static_cast<int>(q);
      for (int t = 0; t < m; t += std::max(1, m / 256)) {
        for (int e = rows.row_ptr[t]; e < rows.row_ptr[t + 1]; ++e) {
          const int n = rows.neurons[e];
          for (int r = 0; r < d / kCols; ++r) {
            double want = 0.0, mag = 0.0;
            for (int c = r * kCols; c < (r + 1) * kCols; ++c) {
              const double pr = static_cast<double>(probe::Bf16ToFloat(x[static_cast<size_t>(t) * d + c])) *
                                probe::Bf16ToFloat(wut[static_cast<size_t>(n) * d + c]);
              want += pr;
              mag += std::fabs(pr);
            }
            const double got = part[static_cast<size_t>(r) * entries + slot_of[e]];
            err = std::max(err, std::fabs(got - want) / (mag + 1e-30));
          }
        }
      }
    }
    std::printf("%-8s %9.1f us  pairs %lld  chunks (busiest range) %d  worst error / sum|x w| %.2e\n", names[v],
                times[times.size() / 2], static_cast<long long>(entries), worst, err);
    CHECK(cudaFree(const_cast<int*>(lay.chunk_off)));
    CHECK(cudaFree(const_cast<uint16_t*>(lay.chunks)));
    CHECK(cudaFree(const_cast<int*>(lay.pair_off)));
    CHECK(cudaFree(const_cast<uint32_t*>(lay.pairs)));
    CHECK(cudaFree(const_cast<int*>(lay.pair_entry)));
    CHECK(cudaFree(const_cast<uint4*>(lay2.records)));
    CHECK(cudaFree(const_cast<int*>(lay2.pair_base)));
  }
  return 0;
}
