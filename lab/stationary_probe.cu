// stationary_probe: the down product y = h @ Wd with the weight held in shared memory for
// the whole launch, sliced by output column, and every CTA walking every token's entries.
//
// Why: the designs measured so far (ffi/notes/limits.md) move a weight row, or a slab of
// rows, from L2 into the SMs for each token block, and are bound by that traffic (~8.5 TB/s
// into shared memory at most). At d = 2048, f = 5632 the down weight is 23 MB: it fits in
// the SMs' shared memory (132 x 227 KB). A CTA that owns `cols` output columns keeps
// Wd[:, c0 : c0 + cols] (f x cols x 2 bytes: 180 KB at cols = 16) and computes y[:, c0 :
// c0 + cols] for every token from the token's entry words (4 bytes per active pair, read
// by every CTA: ~1.8 MB each from L2). Nothing is accumulated across tokens, so the
// registers hold one token's columns only; what bounds it is shared memory (one random
// 2 * cols byte row slice per pair) and the issue of the conversions and FMAs.
//
// The run: M tokens, f neurons, d columns, per-token active counts from the library's
// patterns (uniform: every neuron at p; heavy: log-normal sigma 1 rate per token, clipped to
// 5%), distinct neurons in ascending order, h in bf16 at the high half of the word and the
// neuron at the low half (the library's entry word). Variants:
//   cols16      128 CTAs of 16 columns (d / 16), two threads a token, 8 columns each;
//   (cols8      256 CTAs of 8 columns, two a SM, one thread a token: measured slower than
//               cols16 in every run, 4.6 against 6.5 TB/s, and dropped from the table;)
//   cols16_perm cols16 with each token's entries reordered (on the host here) so that the
//               four tokens of a shared-memory phase tend to hit different 32-byte slots
//               of a 128-byte line: bounds what a conflict-aware order would buy;
//   load        only the weight slice's load (the part every variant pays once);
//   v2_*        DownKernel2: 1,024 threads, the entry words loaded a batch ahead, and
//               (`_sort`) tokens taken by descending count;
//   v3_group    DownKernel3: the words in a layout made for the walk (groups of 16 tokens
//               by count, four steps a 128-bit load, zero-padded); `_perm` with each
//               token's words ordered as cols16_perm's, by its place in the group.
// Checked: y of 256 tokens (and their every column) against a double-precision host sum.
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a lab/stationary_probe.cu -o stationary_probe
// Run:   ./stationary_probe [M=16384] [d=2048] [f=5632] [density=0.005] [pattern=uniform|heavy]
// Prints one line per variant: microseconds per launch (median of 20), pairs, the rate in
// weight bytes the pairs touch (pairs x d x 2 / time), and the check's worst error.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "probe_barrier.cuh"
#include "probe_rows.h"

namespace {

__device__ __forceinline__ float Lo(uint32_t w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float Hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ uint32_t Pack(float a, float b) {
  __nv_bfloat162 v = __floats2bfloat162_rn(a, b);
  return *reinterpret_cast<uint32_t*>(&v);
}

using probe::Bf16ToFloat;
using probe::CpAsync16;
using probe::FloatToBf16;

// acc[0..7] += h * the eight bf16 of v
__device__ __forceinline__ void Apply8(float (&acc)[8], float h, const uint4& v) {
  acc[0] = fmaf(h, Lo(v.x), acc[0]);
  acc[1] = fmaf(h, Hi(v.x), acc[1]);
  acc[2] = fmaf(h, Lo(v.y), acc[2]);
  acc[3] = fmaf(h, Hi(v.y), acc[3]);
  acc[4] = fmaf(h, Lo(v.z), acc[4]);
  acc[5] = fmaf(h, Hi(v.z), acc[5]);
  acc[6] = fmaf(h, Lo(v.w), acc[6]);
  acc[7] = fmaf(h, Hi(v.w), acc[7]);
}

// Eight accumulators rounded to bf16, as one 16-byte store.
__device__ __forceinline__ void Store8(__nv_bfloat16* dst, const float (&acc)[8]) {
  uint4 out;
  out.x = Pack(acc[0], acc[1]);
  out.y = Pack(acc[2], acc[3]);
  out.z = Pack(acc[4], acc[5]);
  out.w = Pack(acc[6], acc[7]);
  *reinterpret_cast<uint4*>(dst) = out;
}

// Loads Wd[:, c0 : c0 + kCols] into shared memory, row n at n * kCols * 2 bytes.
template <int kCols>
__device__ __forceinline__ void LoadSlice(unsigned char* smem, const __nv_bfloat16* wd, int f, int d, int c0) {
  constexpr int kPieces = kCols / 8;  // 16-byte pieces a row
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  for (int i = threadIdx.x; i < f * kPieces; i += blockDim.x) {
    const int n = i / kPieces, q = i % kPieces;
    CpAsync16(base + (n * kPieces + q) * 16, wd + static_cast<int64_t>(n) * d + c0 + q * 8);
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
}

// kCols columns a CTA, kCols / 8 threads a token (8 columns each).
template <int kCols, bool kCompute>
__global__ void __launch_bounds__(512) DownKernel(const __nv_bfloat16* __restrict__ wd, const uint32_t* __restrict__ words,
                                                  const int* __restrict__ row_ptr, __nv_bfloat16* __restrict__ y, int m,
                                                  int d, int f) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int c0 = blockIdx.x * kCols;
  LoadSlice<kCols>(smem, wd, f, d, c0);
  if (!kCompute) return;
  constexpr int kThreadsPerToken = kCols / 8;
  const int q = threadIdx.x % kThreadsPerToken;
  const int tokens_per_pass = blockDim.x / kThreadsPerToken;
  const unsigned char* my = smem + q * 16;
  for (int t = threadIdx.x / kThreadsPerToken; t < m; t += tokens_per_pass) {
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    const int e0 = __ldg(row_ptr + t), e1 = __ldg(row_ptr + t + 1);
    int e = e0;
    for (; e + 4 <= e1; e += 4) {
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) w[j] = __ldg(words + e + j);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint4 v = *reinterpret_cast<const uint4*>(my + (w[j] & 0xffffu) * (kCols * 2));
        const float h = Hi(w[j]);
        Apply8(acc, h, v);
      }
    }
    for (; e < e1; ++e) {
      const uint32_t w = __ldg(words + e);
      const uint4 v = *reinterpret_cast<const uint4*>(my + (w & 0xffffu) * (kCols * 2));
      const float h = Hi(w);
      Apply8(acc, h, v);
    }
    Store8(y + static_cast<int64_t>(t) * d + c0 + q * 8, acc);
  }
}

// The same product with latency taken off the entry loads: 1,024 threads (32 warps a SM),
// each token's words loaded eight at a time one batch ahead of their use, the next token's
// row bounds one token ahead, and tokens taken in the order `order` (identity, or sorted
// by count so that a warp's 16 tokens have about the same number of entries).
template <int kCols>
__global__ void __launch_bounds__(1024) DownKernel2(const __nv_bfloat16* __restrict__ wd, const uint32_t* __restrict__ words,
                                                    const int* __restrict__ row_ptr, const int* __restrict__ order,
                                                    __nv_bfloat16* __restrict__ y, int m, int d, int f) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int c0 = blockIdx.x * kCols;
  LoadSlice<kCols>(smem, wd, f, d, c0);
  constexpr int kThreadsPerToken = kCols / 8;
  const int q = threadIdx.x % kThreadsPerToken;
  const int tokens_per_pass = blockDim.x / kThreadsPerToken;
  const unsigned char* my = smem + q * 16;
  int i = threadIdx.x / kThreadsPerToken;
  int t = i < m ? __ldg(order + i) : 0;
  int e0 = i < m ? __ldg(row_ptr + t) : 0, e1 = i < m ? __ldg(row_ptr + t + 1) : 0;
  for (; i < m; i += tokens_per_pass) {
    // next token's bounds, one token ahead
    const int i_n = i + tokens_per_pass;
    const int t_n = i_n < m ? __ldg(order + i_n) : 0;
    const int n0 = i_n < m ? __ldg(row_ptr + t_n) : 0, n1 = i_n < m ? __ldg(row_ptr + t_n + 1) : 0;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint32_t cur[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) cur[j] = e0 + j < e1 ? __ldg(words + e0 + j) : 0u;
    for (int e = e0; e < e1; e += 8) {
      uint32_t nxt[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) nxt[j] = e + 8 + j < e1 ? __ldg(words + e + 8 + j) : 0u;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        // a zero word (past the row's end) reads row 0 and adds 0 * w
        const uint4 v = *reinterpret_cast<const uint4*>(my + (cur[j] & 0xffffu) * (kCols * 2));
        const float h = Hi(cur[j]);
        Apply8(acc, h, v);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) cur[j] = nxt[j];
    }
    Store8(y + static_cast<int64_t>(t) * d + c0 + q * 8, acc);
    t = t_n;
    e0 = n0;
    e1 = n1;
  }
}

// The entry words in a layout made for the walk: tokens sorted by count, cut into groups
// of 16 (a warp each, two threads a token), each group's words stored four steps at a time,
// token-major within a step block (word goff[g] + 64 b + 4 i + k is step 4 b + k of the
// group's token i), padded with zero words to the group's longest row. A warp then loads
// 256 contiguous bytes a block with one 128-bit load a thread, and no entry is predicated.
template <int kCols>
__global__ void __launch_bounds__(1024) DownKernel3(const __nv_bfloat16* __restrict__ wd, const uint32_t* __restrict__ words,
                                                    const int* __restrict__ goff, const int* __restrict__ order,
                                                    __nv_bfloat16* __restrict__ y, int m, int d, int f) {
  static_assert(kCols == 16, "two threads a token");
  extern __shared__ __align__(128) unsigned char smem[];
  const int c0 = blockIdx.x * kCols;
  LoadSlice<kCols>(smem, wd, f, d, c0);
  const int lane = threadIdx.x % 32, q = lane % 2, i = lane / 2;
  const unsigned char* my = smem + q * 16;
  const int groups = (m + 15) / 16;
  for (int g = threadIdx.x / 32; g < groups; g += blockDim.x / 32) {
    const int w0 = __ldg(goff + g), w1 = __ldg(goff + g + 1);
    const uint4* src = reinterpret_cast<const uint4*>(words + w0) + i;
    const int blocks = (w1 - w0) / 64;
    float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    uint4 cur = blocks > 0 ? __ldg(src) : make_uint4(0, 0, 0, 0);
    for (int b = 0; b < blocks; ++b) {
      const uint4 nxt = b + 1 < blocks ? __ldg(src + 16 * (b + 1)) : make_uint4(0, 0, 0, 0);
      const uint32_t ws[4] = {cur.x, cur.y, cur.z, cur.w};
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint4 v = *reinterpret_cast<const uint4*>(my + (ws[k] & 0xffffu) * (kCols * 2));
        const float h = Hi(ws[k]);
        Apply8(acc, h, v);
      }
      cur = nxt;
    }
    if (16 * g + i < m) {
      const int t = __ldg(order + 16 * g + i);
      Store8(y + static_cast<int64_t>(t) * d + c0 + q * 8, acc);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const auto [m, d, f, p, pattern] = probe::ParseShape(argc, argv);
  if (f > 65536 || d % 16 != 0) {
    std::fprintf(stderr, "needs f <= 65536 and d a multiple of 16\n");
    return 1;
  }

  std::mt19937_64 rng(1234);
  std::uniform_real_distribution<float> uni(-1.0f, 1.0f);
  std::vector<uint16_t> wd(static_cast<size_t>(f) * d);
  for (auto& v : wd) v = FloatToBf16(uni(rng) * 0.05f);

  // the rows, then each entry's word: h (bf16, high half) and the neuron (low half)
  const probe::ActiveRows rows = probe::DrawRows(m, f, p, pattern, rng);
  const std::vector<int>& row_ptr = rows.row_ptr;
  std::vector<uint32_t> words(rows.neurons.size());
  for (size_t e = 0; e < words.size(); ++e) {
    const uint16_t h = FloatToBf16(0.05f + std::fabs(uni(rng)));
    words[e] = (static_cast<uint32_t>(h) << 16) | static_cast<uint32_t>(rows.neurons[e]);
  }
  const int64_t pairs = static_cast<int64_t>(words.size());

  // The permuted order: token t sits at position (t % 4) of its shared-memory phase (cols16:
  // two threads a token, eight threads a phase); step k prefers a neuron with
  // (n % 4) == (t + k) % 4, so that the phase's four rows fall in different 32-byte slots.
  std::vector<uint32_t> words_perm(words.size());
  for (int t = 0; t < m; ++t) {
    std::vector<uint32_t> bucket[4];
    for (int e = row_ptr[t]; e < row_ptr[t + 1]; ++e) bucket[words[e] & 3u].push_back(words[e]);
    int out = row_ptr[t];
    for (int k = 0; out < row_ptr[t + 1]; ++k) {
      int b = (t + k) & 3;
      if (bucket[b].empty()) {
        b = 0;
        for (int i = 1; i < 4; ++i)
          if (bucket[i].size() > bucket[b].size()) b = i;
      }
      words_perm[out++] = bucket[b].back();
      bucket[b].pop_back();
    }
  }

  __nv_bfloat16* d_wd = reinterpret_cast<__nv_bfloat16*>(probe::Upload(wd));
  __nv_bfloat16* d_y;
  CHECK(cudaMalloc(&d_y, static_cast<size_t>(m) * d * 2));
  uint32_t* d_words = probe::Upload(words, 4);
  uint32_t* d_words_perm = probe::Upload(words_perm, 4);
  int* d_rp = probe::Upload(row_ptr);

  int max_smem = 0;
  CHECK(cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, 0));
  std::printf("M=%d d=%d f=%d p=%.4f %s: %lld pairs (%.1f a token), max shared %d B\n", m, d, f, p, pattern.c_str(),
              static_cast<long long>(pairs), static_cast<double>(pairs) / m, max_smem);

  // token orders: identity, and by descending count (a counting sort on the GPU would
  // produce it in the library)
  std::vector<int> ident(m), sorted(m);
  for (int t = 0; t < m; ++t) ident[t] = sorted[t] = t;
  std::stable_sort(sorted.begin(), sorted.end(), [&](int a, int b) {
    return row_ptr[a + 1] - row_ptr[a] > row_ptr[b + 1] - row_ptr[b];
  });
  int* d_ident = probe::Upload(ident);
  int* d_sorted = probe::Upload(sorted);

  // group layouts for DownKernel3: plain (each row's words in ascending order) and
  // conflict-aware (step j of the group's token i prefers a neuron with n % 4 == (i + j) % 4,
  // so the four tokens of a shared-memory phase tend to read four different 32-byte slots)
  const int groups = (m + 15) / 16;
  std::vector<int> goff(groups + 1, 0);
  for (int g = 0; g < groups; ++g) {
    int longest = 0;
    for (int i = 0; i < 16 && 16 * g + i < m; ++i) {
      const int t = sorted[16 * g + i];
      longest = std::max(longest, row_ptr[t + 1] - row_ptr[t]);
    }
    goff[g + 1] = goff[g] + 64 * ((longest + 3) / 4);
  }
  std::vector<uint32_t> glay(goff[groups], 0u), glay_perm(goff[groups], 0u);
  for (int g = 0; g < groups; ++g) {
    for (int i = 0; i < 16 && 16 * g + i < m; ++i) {
      const int t = sorted[16 * g + i];
      std::vector<uint32_t> bucket[4];
      for (int e = row_ptr[t]; e < row_ptr[t + 1]; ++e) bucket[words[e] & 3u].push_back(words[e]);
      for (int j = 0; j < row_ptr[t + 1] - row_ptr[t]; ++j) {
        const size_t at = goff[g] + 64 * (j / 4) + 4 * i + j % 4;
        glay[at] = words[row_ptr[t] + j];
        int b = (i + j) & 3;
        if (bucket[b].empty()) {
          b = 0;
          for (int k = 1; k < 4; ++k)
            if (bucket[k].size() > bucket[b].size()) b = k;
        }
        glay_perm[at] = bucket[b].back();
        bucket[b].pop_back();
      }
    }
  }
  uint32_t* d_glay = probe::Upload(glay, 4);
  uint32_t* d_glay_perm = probe::Upload(glay_perm, 4);
  int* d_goff = probe::Upload(goff);
  std::printf("group layout: %d words for %lld pairs (%.1f%% padding)\n", goff[groups], static_cast<long long>(pairs),
              100.0 * (goff[groups] - pairs) / std::max<int64_t>(pairs, 1));

  struct Variant {
    const char* name;
    int kind;  // 0: DownKernel (512 threads), 1: DownKernel2, 2: DownKernel3 (1,024 threads)
    void (*kernel)(const __nv_bfloat16*, const uint32_t*, const int*, __nv_bfloat16*, int, int, int);
    void (*kernel2)(const __nv_bfloat16*, const uint32_t*, const int*, const int*, __nv_bfloat16*, int, int, int);
    int cols;
    bool perm;
    bool sort;
    bool check;
  };
  const Variant variants[] = {
      {"load", 0, DownKernel<16, false>, nullptr, 16, false, false, false},
      {"cols16", 0, DownKernel<16, true>, nullptr, 16, false, false, true},
      {"cols16_perm", 0, DownKernel<16, true>, nullptr, 16, true, false, true},
      {"v2_cols16", 1, nullptr, DownKernel2<16>, 16, false, false, true},
      {"v2_cols16_sort", 1, nullptr, DownKernel2<16>, 16, false, true, true},
      {"v3_group", 2, nullptr, DownKernel3<16>, 16, false, true, true},
      {"v3_group_perm", 2, nullptr, DownKernel3<16>, 16, true, true, true},
  };
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  std::vector<uint16_t> y(static_cast<size_t>(m) * d);
  for (const Variant& v : variants) {
    const size_t smem = static_cast<size_t>(f) * v.cols * 2;
    if (smem > static_cast<size_t>(max_smem)) {
      std::printf("%-16s skipped: slice of %zu B over the %d B of shared memory\n", v.name, smem, max_smem);
      continue;
    }
    if (v.kind == 0)
      CHECK(cudaFuncSetAttribute(v.kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    else
      CHECK(cudaFuncSetAttribute(v.kernel2, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    const uint32_t* w = v.perm ? d_words_perm : d_words;
    const dim3 grid(d / v.cols);
    std::vector<float> ms;
    CHECK(cudaMemset(d_y, 0xff, static_cast<size_t>(m) * d * 2));
    for (int r = 0; r < 23; ++r) {
      CHECK(cudaEventRecord(start));
      if (v.kind == 0)
        v.kernel<<<grid, 512, smem>>>(d_wd, w, d_rp, d_y, m, d, f);
      else if (v.kind == 1)
        v.kernel2<<<grid, 1024, smem>>>(d_wd, w, d_rp, v.sort ? d_sorted : d_ident, d_y, m, d, f);
      else
        v.kernel2<<<grid, 1024, smem>>>(d_wd, v.perm ? d_glay_perm : d_glay, d_goff, d_sorted, d_y, m, d, f);
      CHECK(cudaEventRecord(stop));
      CHECK(cudaEventSynchronize(stop));
      CHECK(cudaGetLastError());
      float t = 0;
      CHECK(cudaEventElapsedTime(&t, start, stop));
      if (r >= 3) ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    const double us = ms[ms.size() / 2] * 1e3;
    double worst = 0;
    if (v.check) {
      CHECK(cudaMemcpy(y.data(), d_y, y.size() * 2, cudaMemcpyDeviceToHost));
      for (int s = 0; s < 256; ++s) {
        const int t = static_cast<int>((static_cast<int64_t>(s) * 7919) % m);
        for (int c = 0; c < d; ++c) {
          double ref = 0, mag = 0;
          for (int e = row_ptr[t]; e < row_ptr[t + 1]; ++e) {
            const double h = Bf16ToFloat(static_cast<uint16_t>(words[e] >> 16));
            const double wv = Bf16ToFloat(wd[static_cast<size_t>(words[e] & 0xffffu) * d + c]);
            ref += h * wv;
            mag += std::fabs(h * wv);
          }
          const double got = Bf16ToFloat(y[static_cast<size_t>(t) * d + c]);
          // bf16 rounding of the result (2^-8 relative) plus f32 accumulation
          const double err = std::fabs(got - ref) / (std::fabs(ref) * 0x1p-8 + mag * 1e-6 + 1e-30);
          worst = std::max(worst, err);
        }
      }
    }
    std::printf("%-16s %9.1f us  %6.2f TB/s of touched rows  check %s (worst %.2f of the bound)\n", v.name, us,
                pairs * static_cast<double>(d) * 2 / (us * 1e-6) / 1e12, v.check ? (worst <= 1.0 ? "ok" : "FAIL") : "-",
                worst);
  }
  return 0;
}
