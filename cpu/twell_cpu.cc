// CPU XLA FFI handlers of the sparse FFN's up and down products (a nanobind module,
// jax_twell._cpu_kernels, hands them to Python as capsules).
//
// The gate g = relu(x @ w_act) [M, f] is XLA's matmul where its GEMM is the faster (f32, or
// many tokens), else this module's (jax_twell_cpu_gate, or jax_twell_cpu_gate_twell: packed
// to TwELL in the same pass, g never written). These handlers read, per token, only the
// weight rows of the neurons where g is non-zero (from g, or from TwELL:
// jax_twell_cpu_up_down_twell):
//
//   gated:      u = x_t . w_up[:, n] (f32 sums, rounded to the element type),
//               h = g[t, n] * u (in the element type), y_t += h * w_down[n, :] (f32 sums)
//   non-gated:  h = g[t, n],                             y_t += h * w_down[n, :]
//
// y_t is rounded to the element type once, at the end: the rounding of
// jax_twell/ops/ffn/reference.py. A NaN entry of g counts as non-zero (it reaches y as the
// dense formula has it); entries that are zero skip their products, so NaN and Inf that
// only those products would carry are the caller's to add (as_dense_nonfinite).
//
// The up weight comes in one of two layouts (attribute up_transposed): w_up_t [f, d]
// (w_up.T, a kept copy: a neuron's weights are one contiguous row) or w_up [d, f] itself
// (a neuron's weights are a column: d strided reads, one cache line each).
//
// f32 and bf16 (bf16 <-> f32 by bit shifts, rounding to nearest even as XLA does). Loops
// are written for the compiler's vectoriser; on x86-64 the two inner loops are compiled
// for AVX-512, AVX2 and the baseline and chosen at load time (target_clones).

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <nanobind/nanobind.h>

#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;
namespace ffi = xla::ffi;

namespace {

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TWELL_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define TWELL_CLONES
#endif

using bf16 = uint16_t;

inline float to_f32(float v) { return v; }
inline float to_f32(bf16 v) {
  uint32_t bits = uint32_t(v) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Rounds an f32 to the element type T (nearest even; NaN stays NaN).
template <typename T>
T from_f32(float v);
template <>
inline float from_f32<float>(float v) { return v; }
template <>
inline bf16 from_f32<bf16>(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return bf16((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return bf16(bits >> 16);
}
template <typename T>
inline float round_to(float v) { return to_f32(from_f32<T>(v)); }

// Non-zero, NaN included (the sign bit aside, any set bit).
inline bool nonzero(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  return (bits & 0x7fffffffu) != 0;
}
inline bool nonzero(bf16 v) { return (v & 0x7fffu) != 0; }

// Vectors of the GCC/Clang vector extension: their lanes are the code's, whatever the
// target (a ymm in AVX2 and AVX-512, two xmm in the baseline), so sums kept per lane add in
// the same order on every clone.
typedef float vf8 __attribute__((vector_size(32)));
typedef int32_t vi8 __attribute__((vector_size(32)));
typedef uint16_t vh8 __attribute__((vector_size(16)));
typedef uint32_t vu8 __attribute__((vector_size(32)));

#define TWELL_INLINE inline __attribute__((always_inline))

// Eight floats from p (bf16: widened).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // inlined only: no vector crosses a call
TWELL_INLINE vf8 load8(const float* p) {
  vf8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
TWELL_INLINE vf8 load8(const bf16* p) {
  vh8 h;
  std::memcpy(&h, p, sizeof(h));
  const vu8 bits = __builtin_convertvector(h, vu8) << 16;
  vf8 v;
  std::memcpy(&v, &bits, sizeof(v));
  return v;
}
#pragma GCC diagnostic pop

// The dot products of NT rows a[t] with one row w, sum_k a[t][k] * w[k] in f32, each in a
// fixed order that depends on neither NT nor the target: 16 partial sums (lane i adds the
// products of k = i mod 16, in k order, over the whole 16-element chunks), added as a tree
// (lane i + lane i+8, then +4, +2, +1), then the tail's products in k order. Every product
// and sum is written `s + a * w`, so a clone with FMA fuses each of them (GCC contracts a
// product used once by an add), a clone without none; the union form (several tokens at
// once) and the token form (dot, NT = 1) are the same bits.
constexpr int64_t kLanes = 16;
template <int NT, typename T>
TWELL_INLINE void dots_body(const float* const* a, const T* __restrict w, int64_t n, float* out) {
  vf8 lo[NT], hi[NT];  // lanes 0-7 and 8-15
  for (int t = 0; t < NT; ++t) lo[t] = hi[t] = vf8{};
  const int64_t body = n / kLanes * kLanes;
  for (int64_t k = 0; k < body; k += kLanes) {
    const vf8 w0 = load8(w + k), w1 = load8(w + k + 8);
    for (int t = 0; t < NT; ++t) {
      lo[t] = lo[t] + load8(a[t] + k) * w0;
      hi[t] = hi[t] + load8(a[t] + k + 8) * w1;
    }
  }
  for (int t = 0; t < NT; ++t) {
    const vf8 s8 = lo[t] + hi[t];  // lane i + lane i+8
    float s[8];
    std::memcpy(s, &s8, sizeof(s));
    for (int step = 4; step >= 1; step /= 2)
      for (int i = 0; i < step; ++i) s[i] = s[i] + s[i + step];
    float sum = s[0];
    for (int64_t k = body; k < n; ++k) sum = sum + a[t][k] * to_f32(w[k]);
    out[t] = sum;
  }
}

// Up to kDotTokens dot products with one row (the row read once for all of them).
constexpr int kDotTokens = 4;
template <typename T>
TWELL_CLONES void dots(const float* const* a, int nt, const T* __restrict w, int64_t n, float* out) {
  switch (nt) {
    case 1: return dots_body<1>(a, w, n, out);
    case 2: return dots_body<2>(a, w, n, out);
    case 3: return dots_body<3>(a, w, n, out);
    default: return dots_body<4>(a, w, n, out);
  }
}

// sum_k a[k] * w[k] (the order of dots_body).
template <typename T>
float dot(const float* a, const T* w, int64_t n) {
  float out;
  dots(&a, 1, w, n, &out);
  return out;
}

// acc[k] += h * w[k].
template <typename T>
TWELL_CLONES void axpy(float* __restrict acc, float h, const T* __restrict w, int64_t n) {
#pragma omp simd
  for (int64_t k = 0; k < n; ++k) acc[k] += h * to_f32(w[k]);
}

// u[j] = sum_k a[k] * w[k, idx[j]] for the columns idx of w [n, f] (row by row, so the
// rows are read in order).
template <typename T>
void column_dots(float* __restrict u, const float* __restrict a, const T* __restrict w, int64_t n, int64_t f,
                 const int64_t* __restrict idx, int64_t count) {
  std::fill(u, u + count, 0.0f);
  for (int64_t k = 0; k < n; ++k) {
    const float ak = a[k];
    const T* row = w + k * f;
    for (int64_t j = 0; j < count; ++j) u[j] += ak * to_f32(row[idx[j]]);
  }
}

struct Problem {
  int64_t m, d, f;
  const void* x;       // [m, d]
  const void* g;       // [m, f]
  const void* w_up;    // [f, d] (up_transposed) or [d, f]; null: non-gated
  const void* w_down;  // [f, d]
  void* y;             // [m, d]
  bool up_transposed;
  void* u = nullptr;   // [m, f] or null: u at the active entries, zero elsewhere (training)
};

// One token's products from its active entries (neuron idx[j], activation gv[j]): u over
// the up weight's rows or columns, h = g * u rounded to T, y_t = sum h * w_down[n] rounded
// once. u_t: [f] or null, u at the entries (training). xf, acc, u: scratch.
template <typename T>
void token_products(const Problem& p, int64_t t, const int64_t* idx, const float* gv, int64_t count, T* u_t,
                    std::vector<float>& xf, std::vector<float>& acc, std::vector<float>& u) {
  const int64_t d = p.d, f = p.f;
  const T* x = static_cast<const T*>(p.x);
  const T* w_up = static_cast<const T*>(p.w_up);
  const T* w_down = static_cast<const T*>(p.w_down);
  std::fill(acc.begin(), acc.end(), 0.0f);
  if (w_up != nullptr && count > 0) {
    for (int64_t k = 0; k < d; ++k) xf[k] = to_f32(x[t * d + k]);
    u.resize(count);
    if (p.up_transposed) {
      for (int64_t j = 0; j < count; ++j) u[j] = dot(xf.data(), w_up + idx[j] * d, d);
    } else {
      column_dots(u.data(), xf.data(), w_up, d, f, idx, count);
    }
  }
  for (int64_t j = 0; j < count; ++j) {
    const int64_t n = idx[j];
    float h = gv[j];
    if (w_up != nullptr) {
      const T un = from_f32<T>(u[j]);
      if (u_t != nullptr) u_t[n] = un;
      h = round_to<T>(h * to_f32(un));
    }
    axpy(acc.data(), h, w_down + n * d, d);
  }
  T* y_t = static_cast<T*>(p.y) + t * d;
  for (int64_t k = 0; k < d; ++k) y_t[k] = from_f32<T>(acc[k]);
}

// Tokens [begin, end) of the problem, one after another, their entries read from g.
template <typename T>
void run_tokens(const Problem& p, int64_t begin, int64_t end) {
  const int64_t d = p.d, f = p.f;
  const T* g = static_cast<const T*>(p.g);
  std::vector<float> xf(d), acc(d), u, gv;
  std::vector<int64_t> idx;
  idx.reserve(64);
  gv.reserve(64);
  for (int64_t t = begin; t < end; ++t) {
    const T* g_t = g + t * f;
    idx.clear();
    gv.clear();
    for (int64_t n = 0; n < f; ++n)
      if (nonzero(g_t[n])) {
        idx.push_back(n);
        gv.push_back(to_f32(g_t[n]));
      }
    T* u_t = p.u == nullptr ? nullptr : static_cast<T*>(p.u) + t * f;
    if (u_t != nullptr) std::fill(u_t, u_t + f, from_f32<T>(0.0f));
    token_products<T>(p, t, idx.data(), gv.data(), int64_t(idx.size()), u_t, xf, acc, u);
  }
}

// Tokens per thread below which one thread runs the call (starting a thread costs tens of
// microseconds; a token's rows cost a few at 0.5% active).
constexpr int64_t kTokensPerThread = 16;

int64_t cores() { return std::max(1u, std::thread::hardware_concurrency()); }

// fn(begin, end) over [0, n) in at most `parts` contiguous ranges (each a multiple of
// `align` long but the last), one thread each; the calling thread takes the first.
template <typename Fn>
void split(int64_t n, int64_t parts, int64_t align, Fn fn) {
  parts = std::max<int64_t>(1, parts);
  const int64_t chunk = ((n + parts - 1) / parts + align - 1) / align * align;
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < parts; ++i) {
    const int64_t begin = std::min(n, i * chunk), end = std::min(n, (i + 1) * chunk);
    if (begin < end) pool.emplace_back([&fn, begin, end] { fn(begin, end); });
  }
  fn(0, std::min(n, chunk));
  for (auto& th : pool) th.join();
}

// At most this many tokens, a call runs neuron by neuron (run_union): each weight row of the
// tokens' union is read once for all the tokens that have its neuron active, so a call of a
// few dense tokens reads each weight once, as the dense products do, where the token-major
// form (run_tokens) reads it once per token.
constexpr int64_t kUnionMaxTokens = 16;
// Union neurons per thread below which one thread runs a phase of run_union (a neuron's two
// rows are ~16 KB at d = 2048 in f32: 64 of them ~1 MB, ~0.1 ms from memory).
constexpr int64_t kUnionRowsPerThread = 64;

// The down products of run_union over one column range, blocked in registers: the tokens
// in groups of kDownTokens, the union in chunks of kDownChunk neurons, the columns in
// blocks of 16 (a cache line of f32). A block's sums of a group stay in registers over the
// chunk's neurons (loaded and stored once per chunk), and each row block is loaded once for
// all the group's tokens. Every token of the group adds h * w for each neuron where any of
// them is active, h being zero where it is not: exact, as the sums are never -0 (they start
// at +0, and only -0 + -0 gives -0) and a finite w times zero is a signed zero. So a block
// of the chunk's rows that holds an Inf or NaN (w * 0 is NaN, summed in `bad`) is done
// again, each token adding only the neurons where it is active. Either way a token adds its
// products in neuron order, `acc + h * w` per element as axpy has it: the token form's bits.
constexpr int kDownTokens = 4;
constexpr int64_t kDownChunk = 32;
// Floats ahead of the block that a row's next lines are prefetched (the chunk's rows are
// read a line at a time each, too many streams for the hardware's prefetchers).
constexpr int64_t kDownPrefetch = 64;
// Below this share of active (neuron, token) pairs (percent) a chunk runs row by row, each
// active token's row slice added by axpy (sums through L1/L2, only the active products):
// the blocked form computes every token of a group that has any active, which at 25%
// active costs more than it saves (measured 0.85-0.93x the row form's time there,
// 1.8-1.9x faster fully active).
constexpr int64_t kDownBlockedMinPercent = 30;

// acc[t * stride + k .. k + 16) for the NT tokens of a group: bits[j] their mask at chunk
// neuron j, h[j * h_stride + t] their h (zero where inactive).
template <int NT, typename T>
TWELL_INLINE void down_block(float* acc, int64_t stride, int64_t k, const T* const* rows, const uint32_t* bits,
                             const float* h, int64_t h_stride, int64_t count) {
  vf8 lo[NT], hi[NT];
  for (int t = 0; t < NT; ++t) lo[t] = load8(acc + t * stride + k), hi[t] = load8(acc + t * stride + k + 8);
  vf8 bad0 = vf8{}, bad1 = vf8{};
  for (int64_t j = 0; j < count; ++j) {
    if (bits[j] == 0u) continue;
    __builtin_prefetch(rows[j] + k + kDownPrefetch);
    const vf8 w0 = load8(rows[j] + k), w1 = load8(rows[j] + k + 8);
    bad0 = bad0 + w0 * 0.0f;
    bad1 = bad1 + w1 * 0.0f;
    const float* hj = h + j * h_stride;
    for (int t = 0; t < NT; ++t) {
      lo[t] = lo[t] + hj[t] * w0;
      hi[t] = hi[t] + hj[t] * w1;
    }
  }
  const vf8 bad = bad0 + bad1;
  float lanes[8];
  std::memcpy(lanes, &bad, sizeof(lanes));
  bool finite = true;
  for (int i = 0; i < 8; ++i) finite &= lanes[i] == lanes[i];
  if (finite) {
    for (int t = 0; t < NT; ++t) {
      std::memcpy(acc + t * stride + k, &lo[t], sizeof(lo[t]));
      std::memcpy(acc + t * stride + k + 8, &hi[t], sizeof(hi[t]));
    }
    return;
  }
  for (int t = 0; t < NT; ++t)
    for (int64_t c = k; c < k + 16; c += 8) {
      vf8 s = load8(acc + t * stride + c);
      for (int64_t j = 0; j < count; ++j)
        if (bits[j] >> t & 1u) s = s + h[j * h_stride + t] * load8(rows[j] + c);
      std::memcpy(acc + t * stride + c, &s, sizeof(s));
    }
}

// acc [m, width] += a chunk of union neurons' products: rows[j] its Wd row slices, mask[j]
// its tokens, h [count, m] (zero where inactive).
template <typename T>
TWELL_CLONES void down_chunk(float* acc, int64_t m, int64_t width, const T* const* rows, const uint32_t* mask,
                             const float* h, int64_t count) {
  constexpr int64_t kGroups = (kUnionMaxTokens + kDownTokens - 1) / kDownTokens;
  uint32_t bits[kGroups][kDownChunk];
  const int64_t groups = (m + kDownTokens - 1) / kDownTokens;
  for (int64_t gi = 0; gi < groups; ++gi)
    for (int64_t j = 0; j < count; ++j) bits[gi][j] = mask[j] >> (gi * kDownTokens) & ((1u << kDownTokens) - 1u);
  const int64_t body = width / 16 * 16;
  for (int64_t k = 0; k < body; k += 16) {
    for (int64_t gi = 0; gi < groups; ++gi) {
      const int64_t t0 = gi * kDownTokens;
      float* a = acc + t0 * width;
      const float* hg = h + t0;
      switch (std::min<int64_t>(kDownTokens, m - t0)) {
        case 1: down_block<1>(a, width, k, rows, bits[gi], hg, m, count); break;
        case 2: down_block<2>(a, width, k, rows, bits[gi], hg, m, count); break;
        case 3: down_block<3>(a, width, k, rows, bits[gi], hg, m, count); break;
        default: down_block<4>(a, width, k, rows, bits[gi], hg, m, count); break;
      }
    }
  }
  for (int64_t k = body; k < width; ++k)
    for (int64_t t = 0; t < m; ++t) {
      float s = acc[t * width + k];
      for (int64_t j = 0; j < count; ++j)
        if (mask[j] >> t & 1u) s = s + h[j * m + t] * to_f32(rows[j][k]);
      acc[t * width + k] = s;
    }
}

// The products of at most kUnionMaxTokens tokens, neuron by neuron. The same sums as
// run_tokens, bit for bit: u by the same dot order (dots) or column_dots per token, h
// rounded the same way, and each y_t[k] adds its h * w_down[n, k] in neuron order.
//   1. mask[n]: the tokens where g[:, n] is non-zero; the union: the neurons with any.
//   2. u and h per (union neuron, token), the union split over the cores; each w_up_t row
//      is read once per kDotTokens of its tokens (dots: their sums in registers).
//   3. y_t over columns split over the cores (64-aligned ranges), every union neuron's
//      Wd row slice added for each of its tokens, in neuron order: per chunk of kDownChunk
//      neurons, blocked (down_chunk: a group's sums in registers over the chunk) or, in a
//      chunk under kDownBlockedMinPercent active, row by row (axpy per active token).
//      Rounded once.
//
// What the register blocking should move (f32, d = 2048, f = 5632, two cores; written
// before it was measured). Token by token, the up phase did 2 loads per FMA (x and the
// row chunk, the row once per token) and the down phase 2 loads and a store per FMA (each
// token's sums through memory once per neuron, 32-64 KB of them per core: L2), so dense
// calls ran on loads, not on the weights' reading: ~38 ms at M = 8 and ~99 ms at M = 16
// fully active, where XLA's up+down products take ~39 and ~76 ms and one read of the two
// weights ~4-11 ms (M = 1, 0.5-1.0 active). Blocked: 1.25 loads per FMA up (a row chunk
// for 4 tokens), ~0.3 down (a row block for 4 tokens, the sums loaded and stored once per
// 32 neurons), so the fully active calls should run 2-3x faster (kernel_ratio ~2 at
// M = 8, ~2 at M = 16), half active ~1.3-1.5x faster; 0.5% active (a few rows per token,
// reading bound) should not move. Measured: benchmarks/results/cpu_sweep_blocked_*.json
// (jax_twell/ops/ffn/cpu.py's UNION_MAX_FRACTION gives the figures).
template <typename T>
void run_union(const Problem& p) {
  const int64_t m = p.m, d = p.d, f = p.f;
  const T* x = static_cast<const T*>(p.x);
  const T* g = static_cast<const T*>(p.g);
  const T* w_up = static_cast<const T*>(p.w_up);
  const T* w_down = static_cast<const T*>(p.w_down);
  std::vector<uint32_t> mask(f, 0u);
  for (int64_t t = 0; t < m; ++t)
    for (int64_t n = 0; n < f; ++n)
      if (nonzero(g[t * f + n])) mask[n] |= 1u << t;
  std::vector<int64_t> uni;
  std::vector<uint32_t> umask;  // mask of each union neuron
  for (int64_t n = 0; n < f; ++n)
    if (mask[n] != 0u) uni.push_back(n), umask.push_back(mask[n]);
  const int64_t count = int64_t(uni.size());
  std::vector<float> h(size_t(count * m), 0.0f);  // [union, m]: h of (neuron uni[j], token t)
  if (p.u != nullptr) std::fill(static_cast<T*>(p.u), static_cast<T*>(p.u) + m * f, from_f32<T>(0.0f));
  const int64_t parts = std::min(cores(), count / kUnionRowsPerThread);
  if (count > 0 && w_up != nullptr) {
    std::vector<float> xf(size_t(m * d));
    for (int64_t i = 0; i < m * d; ++i) xf[i] = to_f32(x[i]);
    auto finish = [&](int64_t j, int64_t t, float u) {  // h from u: rounded as run_tokens does
      const int64_t n = uni[j];
      const T un = from_f32<T>(u);
      if (p.u != nullptr) static_cast<T*>(p.u)[t * f + n] = un;
      h[j * m + t] = round_to<T>(to_f32(g[t * f + n]) * to_f32(un));
    };
    if (p.up_transposed) {
      split(count, parts, 1, [&](int64_t b, int64_t e) {
        const float* xs[kDotTokens];
        int64_t ts[kDotTokens];
        float out[kDotTokens];
        for (int64_t j = b; j < e; ++j) {
          const T* row = w_up + uni[j] * d;
          int nt = 0;
          for (uint32_t bits = umask[j]; bits != 0u; bits &= bits - 1u) {
            ts[nt] = __builtin_ctz(bits);
            xs[nt] = xf.data() + ts[nt] * d;
            if (++nt == kDotTokens || (bits & (bits - 1u)) == 0u) {
              dots(xs, nt, row, d, out);
              for (int i = 0; i < nt; ++i) finish(j, ts[i], out[i]);
              nt = 0;
            }
          }
        }
      });
    } else {  // columns of w_up: per token over its entries (run_tokens' column_dots)
      std::vector<int64_t> idx, pos;
      std::vector<float> u;
      for (int64_t t = 0; t < m; ++t) {
        idx.clear();
        pos.clear();
        for (int64_t j = 0; j < count; ++j)
          if (umask[j] >> t & 1u) idx.push_back(uni[j]), pos.push_back(j);
        u.resize(idx.size());
        column_dots(u.data(), xf.data() + t * d, w_up, d, f, idx.data(), int64_t(idx.size()));
        for (size_t i = 0; i < idx.size(); ++i) finish(pos[i], t, u[i]);
      }
    }
  } else {
    for (int64_t j = 0; j < count; ++j)
      for (int64_t t = 0; t < m; ++t)
        if (umask[j] >> t & 1u) h[j * m + t] = to_f32(g[t * f + uni[j]]);
  }
  split(d, std::min(parts, d / 64), 64, [&](int64_t c0, int64_t c1) {
    const int64_t width = c1 - c0;
    std::vector<float> acc(size_t(m * width), 0.0f);
    const T* rows[kDownChunk];
    for (int64_t j0 = 0; j0 < count; j0 += kDownChunk) {
      const int64_t n = std::min(kDownChunk, count - j0);
      int64_t active = 0;
      for (int64_t j = 0; j < n; ++j) active += __builtin_popcount(umask[j0 + j]);
      if (active * 100 < kDownBlockedMinPercent * n * m) {  // row by row
        for (int64_t j = j0; j < j0 + n; ++j) {
          const T* row = w_down + uni[j] * d + c0;
          for (uint32_t bits = umask[j]; bits != 0u; bits &= bits - 1u) {
            const int64_t t = __builtin_ctz(bits);
            axpy(acc.data() + t * width, h[j * m + t], row, width);
          }
        }
        continue;
      }
      for (int64_t j = 0; j < n; ++j) rows[j] = w_down + uni[j0 + j] * d + c0;
      down_chunk(acc.data(), m, width, rows, umask.data() + j0, h.data() + j0 * m, n);
    }
    for (int64_t t = 0; t < m; ++t) {
      T* y_t = static_cast<T*>(p.y) + t * d;
      for (int64_t k = c0; k < c1; ++k) y_t[k] = from_f32<T>(acc[t * width + k - c0]);
    }
  });
}

template <typename T>
void run(const Problem& p) {
  if (p.m <= kUnionMaxTokens) return run_union<T>(p);
  split(p.m, std::min(cores(), p.m / kTokensPerThread), 1, [&p](int64_t b, int64_t e) { run_tokens<T>(p, b, e); });
}

// The gate for a few tokens: g = relu(x @ w) [m, f] for x [m, d], w [d, f], rounded to T,
// reading w once, row by row (XLA's matmul at a few tokens runs well below the memory's
// speed, in bf16 several times below). Columns [c0, c1) of g; kGateTokens tokens at a time,
// their f32 sums in a [kGateTokens, c1 - c0] block.
constexpr int64_t kGateTokens = 8;

template <typename T>
TWELL_CLONES void gate_rows(float* __restrict acc, const float* __restrict xs, int64_t tokens, const T* __restrict w,
                            int64_t d, int64_t f, int64_t c0, int64_t width) {
  int64_t k = 0;
  for (; k + 4 <= d; k += 4) {  // four rows a pass: a quarter of the block's loads and stores
    const T* r0 = w + k * f + c0;
    const T* r1 = r0 + f;
    const T* r2 = r1 + f;
    const T* r3 = r2 + f;
    for (int64_t t = 0; t < tokens; ++t) {
      const float* a = xs + t * d + k;
      const float a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
      float* out = acc + t * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j)
        out[j] += a0 * to_f32(r0[j]) + a1 * to_f32(r1[j]) + a2 * to_f32(r2[j]) + a3 * to_f32(r3[j]);
    }
  }
  for (; k < d; ++k) {
    const T* row = w + k * f + c0;
    for (int64_t t = 0; t < tokens; ++t) {
      const float a = xs[t * d + k];
      float* out = acc + t * width;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) out[j] += a * to_f32(row[j]);
    }
  }
}

// relu as XLA's max(v, 0) (NaN stays NaN), rounded to T.
template <typename T>
inline T relu_to(float v) {
  return from_f32<T>(v < 0.0f ? 0.0f : v);
}

// The f32 sums of x @ w over columns [c0, c1), kGateTokens tokens at a time; emit(t, sums)
// takes token t's c1 - c0 sums.
template <typename T, typename Emit>
void gate_blocks(const T* x, const T* w, int64_t m, int64_t d, int64_t f, int64_t c0, int64_t c1, Emit emit) {
  const int64_t width = c1 - c0;
  std::vector<float> xs(kGateTokens * d), acc(kGateTokens * width);
  for (int64_t t0 = 0; t0 < m; t0 += kGateTokens) {
    const int64_t tokens = std::min(kGateTokens, m - t0);
    for (int64_t i = 0; i < tokens * d; ++i) xs[i] = to_f32(x[t0 * d + i]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    gate_rows(acc.data(), xs.data(), tokens, w, d, f, c0, width);
    for (int64_t t = 0; t < tokens; ++t) emit(t0 + t, acc.data() + t * width);
  }
}

template <typename T>
void gate_columns(const T* x, const T* w, T* g, int64_t m, int64_t d, int64_t f, int64_t c0, int64_t c1) {
  gate_blocks(x, w, m, d, f, c0, c1, [=](int64_t t, const float* sums) {
    for (int64_t j = 0; j < c1 - c0; ++j) g[t * f + c0 + j] = relu_to<T>(sums[j]);
  });
}

// Columns split over the cores (a column block per thread, 16-aligned).
template <typename T>
void gate(const void* x, const void* w, void* g, int64_t m, int64_t d, int64_t f) {
  const T* xt = static_cast<const T*>(x);
  const T* wt = static_cast<const T*>(w);
  T* gt = static_cast<T*>(g);
  split(f, std::min(cores(), f / 256), 16, [=](int64_t c0, int64_t c1) { gate_columns(xt, wt, gt, m, d, f, c0, c1); });
}

// The gate packed to TwELL in the same pass: the f32 sums of a [kGateTokens, c1 - c0]
// block (columns [c0, c1), whole tiles) become relu rounded to T, and each (token, tile)
// keeps its first `capacity` non-zeros (NaN included) in column order, with its true
// count; the [M, f] activation is never written. The layout of jax_twell.formats.TwELL:
// values and cols [M, n_tiles, capacity] (cols within the tile), counts [M, n_tiles].
struct TwellOut {
  void* values;
  int16_t* cols;
  int32_t* counts;
  int64_t tile, capacity, n_tiles;
};

template <typename T>
void gate_twell_columns(const T* x, const T* w, const TwellOut& out, int64_t m, int64_t d, int64_t f, int64_t c0,
                        int64_t c1) {
  const int64_t tile = out.tile, cap = out.capacity;
  T* values = static_cast<T*>(out.values);
  gate_blocks(x, w, m, d, f, c0, c1, [&](int64_t t, const float* sums) {
    for (int64_t b = c0; b < c1; b += tile) {
      const int64_t ti = b / tile, end = std::min(c1, b + tile);
      const int64_t slot = (t * out.n_tiles + ti) * cap;
      int32_t count = 0;
      for (int64_t c = b; c < end; ++c) {
        const T r = relu_to<T>(sums[c - c0]);
        if (!nonzero(r)) continue;
        if (count < cap) {
          values[slot + count] = r;
          out.cols[slot + count] = int16_t(c - b);
        }
        ++count;
      }
      for (int64_t k = count; k < cap; ++k) {
        values[slot + k] = from_f32<T>(0.0f);
        out.cols[slot + k] = 0;
      }
      out.counts[t * out.n_tiles + ti] = count;
    }
  });
}

template <typename T>
void gate_twell(const void* x, const void* w, const TwellOut& out, int64_t m, int64_t d, int64_t f) {
  const T* xt = static_cast<const T*>(x);
  const T* wt = static_cast<const T*>(w);
  split(f, std::min(cores(), f / 256), out.tile,
        [=, &out](int64_t c0, int64_t c1) { gate_twell_columns(xt, wt, out, m, d, f, c0, c1); });
}

// The up and down products from TwELL: each token's entries are its tiles' stored ones;
// a tile past capacity (count > capacity) is recomputed exactly here from x and w_act
// (relu(x . w_act[:, c]) over its columns, f32 sums rounded to T), so no entry is lost.
template <typename T>
void run_twell_tokens(const Problem& p, const TwellOut& in, const T* w_act, int64_t begin, int64_t end) {
  const int64_t d = p.d, f = p.f, tile = in.tile, cap = in.capacity;
  const T* x = static_cast<const T*>(p.x);
  const T* values = static_cast<const T*>(in.values);
  std::vector<float> xf(d), acc(d), u, gv, pre(tile);
  std::vector<int64_t> idx;
  idx.reserve(64);
  gv.reserve(64);
  for (int64_t t = begin; t < end; ++t) {
    idx.clear();
    gv.clear();
    bool x_read = false;  // xf holds token t's x
    for (int64_t ti = 0; ti < in.n_tiles; ++ti) {
      const int32_t count = in.counts[t * in.n_tiles + ti];
      const int64_t b = ti * tile, width = std::min(tile, f - b);
      if (count <= cap) {
        const int64_t slot = (t * in.n_tiles + ti) * cap;
        for (int32_t k = 0; k < count; ++k) {
          idx.push_back(b + in.cols[slot + k]);
          gv.push_back(to_f32(values[slot + k]));
        }
        continue;
      }
      if (!x_read) {
        for (int64_t k = 0; k < d; ++k) xf[k] = to_f32(x[t * d + k]);
        x_read = true;
      }
      std::fill(pre.begin(), pre.end(), 0.0f);
      gate_rows(pre.data(), xf.data(), 1, w_act, d, f, b, width);
      for (int64_t c = 0; c < width; ++c) {
        const T r = relu_to<T>(pre[c]);
        if (!nonzero(r)) continue;
        idx.push_back(b + c);
        gv.push_back(to_f32(r));
      }
    }
    token_products<T>(p, t, idx.data(), gv.data(), int64_t(idx.size()), nullptr, xf, acc, u);
  }
}

template <typename T>
void run_twell(const Problem& p, const TwellOut& in, const void* w_act) {
  const T* wa = static_cast<const T*>(w_act);
  split(p.m, std::min(cores(), p.m / kTokensPerThread), 1,
        [&](int64_t b, int64_t e) { run_twell_tokens<T>(p, in, wa, b, e); });
}

// The training backward over the active entries (g != 0) of each token, for the forward
// above (u at the active entries, as the forward wrote it; h = g * u rounded to T):
//
//   dh    = dy_t . w_down[n] + c * sign(h)        (c: the L1 term's cotangent / M)
//   d_pre = dh * u   (gated; dh non-gated)        through relu: active entries only
//   du    = dh * g   (gated)
//   dx_t  = sum_n d_pre * w_act[:, n] + du * w_up[:, n]
//   dw_down[n] += h * dy_t,  dw_act_t[n] += d_pre * x_t,  dw_up_t[n] += du * x_t
//
// all in f32 (the gradients of jax_twell/ops/ffn_train/reference.py). Two passes: tokens
// split over threads compute each entry's (dh, d_pre, du) and dx; then neuron ranges split
// over threads accumulate the weight gradients' rows from every token's entries, in token
// order (no two threads write one row: deterministic, no atomics).
struct Backward {
  int64_t m, d, f;
  const void* x;        // [m, d]
  const void* g;        // [m, f]
  const void* u;        // [m, f] (gated) or null
  const void* dy;       // [m, d]
  const void* w_up_t;   // [f, d] (gated) or null
  const void* w_act_t;  // [f, d]
  const void* w_down;   // [f, d]
  float c;
  void* dx;             // [m, d] T
  float* dw_act_t;      // [f, d]
  float* dw_up_t;       // [f, d] or null
  float* dw_down;       // [f, d]
};

struct Entry {
  int32_t n;
  float h, d_pre, du;
};

template <typename T>
void backward_tokens(const Backward& p, int64_t begin, int64_t end, std::vector<std::vector<Entry>>& entries) {
  const int64_t d = p.d, f = p.f;
  const T* x = static_cast<const T*>(p.x);
  const T* g = static_cast<const T*>(p.g);
  const T* u = static_cast<const T*>(p.u);
  const T* dy = static_cast<const T*>(p.dy);
  const T* w_up_t = static_cast<const T*>(p.w_up_t);
  const T* w_act_t = static_cast<const T*>(p.w_act_t);
  const T* w_down = static_cast<const T*>(p.w_down);
  T* dx = static_cast<T*>(p.dx);
  std::vector<float> dyf(d), acc(d);
  for (int64_t t = begin; t < end; ++t) {
    const T* g_t = g + t * f;
    auto& list = entries[t];
    list.clear();
    for (int64_t k = 0; k < d; ++k) dyf[k] = to_f32(dy[t * d + k]);
    std::fill(acc.begin(), acc.end(), 0.0f);
    for (int64_t n = 0; n < f; ++n) {
      if (!nonzero(g_t[n])) continue;
      const float gn = to_f32(g_t[n]);
      const float un = u == nullptr ? 0.0f : to_f32(u[t * f + n]);
      const float h = u == nullptr ? gn : round_to<T>(gn * un);
      const float sign = h > 0.0f ? 1.0f : (h < 0.0f ? -1.0f : 0.0f);
      const float dh = dot(dyf.data(), w_down + n * d, d) + p.c * sign;
      const float d_pre = u == nullptr ? dh : dh * un;
      const float du = u == nullptr ? 0.0f : dh * gn;
      axpy(acc.data(), d_pre, w_act_t + n * d, d);
      if (u != nullptr) axpy(acc.data(), du, w_up_t + n * d, d);
      list.push_back({int32_t(n), h, d_pre, du});
    }
    T* dx_t = dx + t * d;
    for (int64_t k = 0; k < d; ++k) dx_t[k] = from_f32<T>(acc[k]);
  }
}

template <typename T>
void backward_neurons(const Backward& p, int64_t n0, int64_t n1, const std::vector<std::vector<Entry>>& entries) {
  const int64_t d = p.d;
  const T* x = static_cast<const T*>(p.x);
  const T* dy = static_cast<const T*>(p.dy);
  std::fill(p.dw_down + n0 * d, p.dw_down + n1 * d, 0.0f);
  std::fill(p.dw_act_t + n0 * d, p.dw_act_t + n1 * d, 0.0f);
  if (p.dw_up_t != nullptr) std::fill(p.dw_up_t + n0 * d, p.dw_up_t + n1 * d, 0.0f);
  for (int64_t t = 0; t < p.m; ++t) {
    for (const Entry& e : entries[t]) {
      if (e.n < n0 || e.n >= n1) continue;
      const int64_t n = e.n;
      axpy(p.dw_down + n * d, e.h, dy + t * d, d);
      axpy(p.dw_act_t + n * d, e.d_pre, x + t * d, d);
      if (p.dw_up_t != nullptr) axpy(p.dw_up_t + n * d, e.du, x + t * d, d);
    }
  }
}

template <typename T>
void backward(const Backward& p) {
  std::vector<std::vector<Entry>> entries(p.m);
  split(p.m, std::min(cores(), p.m / kTokensPerThread), 1,
        [&](int64_t b, int64_t e) { backward_tokens<T>(p, b, e, entries); });
  split(p.f, std::min(cores(), p.f / 64), 1, [&](int64_t n0, int64_t n1) { backward_neurons<T>(p, n0, n1, entries); });
}

// fn(T{}) for x's element type T (f32 or bf16), else the error naming the constraint.
template <typename Fn>
ffi::Error by_dtype(ffi::DataType dt, Fn fn) {
  if (dt == ffi::DataType::F32) {
    fn(float{});
  } else if (dt == ffi::DataType::BF16) {
    fn(bf16{});
  } else {
    return ffi::Error::InvalidArgument("jax_twell_cpu: x must be f32 or bf16");
  }
  return ffi::Error::Success();
}

ffi::Error check_2d(const ffi::AnyBuffer& b, const char* name, int64_t rows, int64_t cols, ffi::DataType dtype) {
  auto dims = b.dimensions();
  if (dims.size() != 2 || dims[0] != rows || dims[1] != cols)
    return ffi::Error::InvalidArgument(std::string("jax_twell_cpu: ") + name + " must be [" + std::to_string(rows) +
                                       ", " + std::to_string(cols) + "]");
  if (b.element_type() != dtype)
    return ffi::Error::InvalidArgument(std::string("jax_twell_cpu: ") + name + " must have x's dtype");
  return ffi::Error::Success();
}

ffi::Error solve(Problem p, ffi::DataType dtype) {
  if (p.m == 0 || p.d == 0) return ffi::Error::Success();
  return by_dtype(dtype, [&](auto t) { run<decltype(t)>(p); });
}

// Gated: x [M, d], g [M, f], w_up_t [f, d] (up_transposed != 0) or w_up [d, f],
// w_down [f, d] -> y [M, d].
ffi::Error UpDownImpl(ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                      ffi::Result<ffi::AnyBuffer> y, int32_t up_transposed) {
  auto xd = x.dimensions(), gd = g.dimensions();
  if (xd.size() != 2 || gd.size() != 2) return ffi::Error::InvalidArgument("jax_twell_cpu: x and g must be 2-D");
  const int64_t m = xd[0], d = xd[1], f = gd[1];
  const ffi::DataType dt = x.element_type();
  for (auto err : {check_2d(g, "g", m, f, dt),
                   up_transposed ? check_2d(w_up, "w_up_t", f, d, dt) : check_2d(w_up, "w_up", d, f, dt),
                   check_2d(w_down, "w_down", f, d, dt), check_2d(*y, "y", m, d, dt)})
    if (err.failure()) return err;
  return solve({m, d, f, x.untyped_data(), g.untyped_data(), w_up.untyped_data(), w_down.untyped_data(),
                y->untyped_data(), up_transposed != 0},
               dt);
}

// The training forward (gated): as UpDownImpl with w_up_t [f, d], and u [M, f] (u at the
// active entries, rounded to the element type; zero elsewhere).
ffi::Error UpDownTrainImpl(ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::AnyBuffer w_up_t, ffi::AnyBuffer w_down,
                           ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> u) {
  auto xd = x.dimensions(), gd = g.dimensions();
  if (xd.size() != 2 || gd.size() != 2) return ffi::Error::InvalidArgument("jax_twell_cpu: x and g must be 2-D");
  const int64_t m = xd[0], d = xd[1], f = gd[1];
  const ffi::DataType dt = x.element_type();
  for (auto err : {check_2d(g, "g", m, f, dt), check_2d(w_up_t, "w_up_t", f, d, dt),
                   check_2d(w_down, "w_down", f, d, dt), check_2d(*y, "y", m, d, dt), check_2d(*u, "u", m, f, dt)})
    if (err.failure()) return err;
  Problem p{m, d, f, x.untyped_data(), g.untyped_data(), w_up_t.untyped_data(), w_down.untyped_data(),
            y->untyped_data(), true};
  p.u = u->untyped_data();
  if (m > 0 && d == 0) std::memset(p.u, 0, size_t(m * f) * (dt == ffi::DataType::F32 ? 4 : 2));
  return solve(p, dt);
}

// The training backward (see Backward): x [M, d], g [M, f], u [M, f] (gated; non-gated:
// any [M, f], unread), dy [M, d], w_up_t [f, d] (gated; non-gated: any [f, d], unread),
// w_act_t [f, d], w_down [f, d], c [1] f32 -> dx [M, d], dw_act_t, dw_up_t (zeros
// non-gated), dw_down [f, d] f32.
ffi::Error BackwardImpl(ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::AnyBuffer u, ffi::AnyBuffer dy,
                        ffi::AnyBuffer w_up_t, ffi::AnyBuffer w_act_t, ffi::AnyBuffer w_down,
                        ffi::Buffer<ffi::F32> c, ffi::Result<ffi::AnyBuffer> dx,
                        ffi::Result<ffi::Buffer<ffi::F32>> dw_act_t, ffi::Result<ffi::Buffer<ffi::F32>> dw_up_t,
                        ffi::Result<ffi::Buffer<ffi::F32>> dw_down, int32_t gated) {
  auto xd = x.dimensions(), gd = g.dimensions();
  if (xd.size() != 2 || gd.size() != 2) return ffi::Error::InvalidArgument("jax_twell_cpu: x and g must be 2-D");
  const int64_t m = xd[0], d = xd[1], f = gd[1];
  const ffi::DataType dt = x.element_type();
  for (auto err : {check_2d(g, "g", m, f, dt), check_2d(u, "u", m, f, dt), check_2d(dy, "dy", m, d, dt),
                   check_2d(w_up_t, "w_up_t", f, d, dt), check_2d(w_act_t, "w_act_t", f, d, dt),
                   check_2d(w_down, "w_down", f, d, dt), check_2d(*dx, "dx", m, d, dt)})
    if (err.failure()) return err;
  if (c.element_count() != 1) return ffi::Error::InvalidArgument("jax_twell_cpu: c must hold one value");
  Backward p{m, d, f, x.untyped_data(), g.untyped_data(), gated ? u.untyped_data() : nullptr, dy.untyped_data(),
             gated ? w_up_t.untyped_data() : nullptr, w_act_t.untyped_data(), w_down.untyped_data(), c.typed_data()[0],
             dx->untyped_data(), dw_act_t->typed_data(), gated ? dw_up_t->typed_data() : nullptr, dw_down->typed_data()};
  if (!gated) std::fill(dw_up_t->typed_data(), dw_up_t->typed_data() + f * d, 0.0f);
  if (f == 0 || d == 0) {
    if (m * d > 0) std::memset(p.dx, 0, size_t(m * d) * (dt == ffi::DataType::F32 ? 4 : 2));
    return ffi::Error::Success();
  }
  return by_dtype(dt, [&](auto t) { backward<decltype(t)>(p); });
}

// Non-gated: g [M, f], w_down [f, d] -> y [M, d] (h = g).
ffi::Error DownImpl(ffi::AnyBuffer g, ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y) {
  auto gd = g.dimensions(), wd = w_down.dimensions();
  if (gd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("jax_twell_cpu: g and w_down must be 2-D");
  const int64_t m = gd[0], f = gd[1], d = wd[1];
  const ffi::DataType dt = g.element_type();
  for (auto err : {check_2d(w_down, "w_down", f, d, dt), check_2d(*y, "y", m, d, dt)})
    if (err.failure()) return err;
  return solve({m, d, f, nullptr, g.untyped_data(), nullptr, w_down.untyped_data(), y->untyped_data(), false}, dt);
}

// The gate for a few tokens: x [M, d], w [d, f] -> g [M, f] = relu(x @ w).
ffi::Error GateImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> g) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("jax_twell_cpu: x and w must be 2-D");
  const int64_t m = xd[0], d = xd[1], f = wd[1];
  const ffi::DataType dt = x.element_type();
  for (auto err : {check_2d(w, "w", d, f, dt), check_2d(*g, "g", m, f, dt)})
    if (err.failure()) return err;
  if (m == 0 || f == 0) return ffi::Error::Success();
  return by_dtype(dt, [&](auto t) { gate<decltype(t)>(x.untyped_data(), w.untyped_data(), g->untyped_data(), m, d, f); });
}

ffi::Error check_twell(const ffi::AnyBuffer& values, const ffi::AnyBuffer& cols, const ffi::AnyBuffer& counts,
                       int64_t m, int64_t n_tiles, int64_t capacity, ffi::DataType dtype) {
  auto vd = values.dimensions(), cd = cols.dimensions(), nd = counts.dimensions();
  if (vd.size() != 3 || vd[0] != m || vd[1] != n_tiles || vd[2] != capacity || cd.size() != 3 || cd[0] != m ||
      cd[1] != n_tiles || cd[2] != capacity)
    return ffi::Error::InvalidArgument("jax_twell_cpu: values and cols must be [" + std::to_string(m) + ", " +
                                       std::to_string(n_tiles) + ", " + std::to_string(capacity) + "]");
  if (nd.size() != 2 || nd[0] != m || nd[1] != n_tiles)
    return ffi::Error::InvalidArgument("jax_twell_cpu: counts must be [" + std::to_string(m) + ", " +
                                       std::to_string(n_tiles) + "]");
  if (values.element_type() != dtype) return ffi::Error::InvalidArgument("jax_twell_cpu: values must have x's dtype");
  if (cols.element_type() != ffi::DataType::S16 || counts.element_type() != ffi::DataType::S32)
    return ffi::Error::InvalidArgument("jax_twell_cpu: cols must be int16 and counts int32");
  return ffi::Error::Success();
}

ffi::Error check_tiling(int64_t tile, int64_t capacity) {
  if (tile < 32 || tile % 32 != 0 || tile > 32768 || capacity < 1 || capacity > tile)
    return ffi::Error::InvalidArgument("jax_twell_cpu: tile must be a multiple of 32 up to 32768 and capacity in [1, tile]");
  return ffi::Error::Success();
}

// The gate packed to TwELL: x [M, d], w [d, f] -> values [M, n_tiles, capacity] (x's
// dtype), cols (int16), counts [M, n_tiles] (int32), n_tiles = ceil(f / tile).
ffi::Error GateTwellImpl(ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::Result<ffi::AnyBuffer> values,
                         ffi::Result<ffi::AnyBuffer> cols, ffi::Result<ffi::AnyBuffer> counts, int32_t tile,
                         int32_t capacity) {
  auto xd = x.dimensions(), wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2) return ffi::Error::InvalidArgument("jax_twell_cpu: x and w must be 2-D");
  const int64_t m = xd[0], d = xd[1], f = wd[1];
  const ffi::DataType dt = x.element_type();
  if (auto err = check_tiling(tile, capacity); err.failure()) return err;
  const int64_t n_tiles = (f + tile - 1) / tile;
  for (auto err : {check_2d(w, "w", d, f, dt), check_twell(*values, *cols, *counts, m, n_tiles, capacity, dt)})
    if (err.failure()) return err;
  if (m == 0 || f == 0) return ffi::Error::Success();
  TwellOut out{values->untyped_data(), static_cast<int16_t*>(cols->untyped_data()),
               static_cast<int32_t*>(counts->untyped_data()), tile, capacity, n_tiles};
  return by_dtype(dt, [&](auto t) { gate_twell<decltype(t)>(x.untyped_data(), w.untyped_data(), out, m, d, f); });
}

// The up and down products from TwELL (tiles past capacity recomputed from x and w_act):
// x [M, d], values/cols [M, n_tiles, capacity], counts [M, n_tiles], w_act [d, f],
// w_up_t [f, d] (up_transposed != 0) or w_up [d, f] (gated; non-gated: any, unread),
// w_down [f, d] -> y [M, d].
ffi::Error UpDownTwellImpl(ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::AnyBuffer cols, ffi::AnyBuffer counts,
                           ffi::AnyBuffer w_act, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                           ffi::Result<ffi::AnyBuffer> y, int32_t tile, int32_t up_transposed, int32_t gated) {
  auto xd = x.dimensions(), ad = w_act.dimensions(), vd = values.dimensions();
  if (xd.size() != 2 || ad.size() != 2 || vd.size() != 3)
    return ffi::Error::InvalidArgument("jax_twell_cpu: x and w_act must be 2-D, values 3-D");
  const int64_t m = xd[0], d = xd[1], f = ad[1], capacity = vd[2];
  const ffi::DataType dt = x.element_type();
  if (auto err = check_tiling(tile, capacity); err.failure()) return err;
  const int64_t n_tiles = (f + tile - 1) / tile;
  for (auto err : {check_2d(w_act, "w_act", d, f, dt), check_twell(values, cols, counts, m, n_tiles, capacity, dt),
                   !gated ? ffi::Error::Success()
                          : (up_transposed ? check_2d(w_up, "w_up_t", f, d, dt) : check_2d(w_up, "w_up", d, f, dt)),
                   check_2d(w_down, "w_down", f, d, dt), check_2d(*y, "y", m, d, dt)})
    if (err.failure()) return err;
  if (m == 0 || d == 0) return ffi::Error::Success();
  Problem p{m, d, f, x.untyped_data(), nullptr, gated ? w_up.untyped_data() : nullptr, w_down.untyped_data(),
            y->untyped_data(), up_transposed != 0};
  TwellOut in{const_cast<void*>(values.untyped_data()), static_cast<int16_t*>(const_cast<void*>(cols.untyped_data())),
              static_cast<int32_t*>(const_cast<void*>(counts.untyped_data())), tile, capacity, n_tiles};
  return by_dtype(dt, [&](auto t) { run_twell<decltype(t)>(p, in, w_act.untyped_data()); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellCpuGate, GateImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>());  // g

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellCpuGateTwell, GateTwellImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // w
                                  .Ret<ffi::AnyBuffer>()  // values
                                  .Ret<ffi::AnyBuffer>()  // cols
                                  .Ret<ffi::AnyBuffer>()  // counts
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("capacity"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellCpuUpDownTwell, UpDownTwellImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // values
                                  .Arg<ffi::AnyBuffer>()  // cols
                                  .Arg<ffi::AnyBuffer>()  // counts
                                  .Arg<ffi::AnyBuffer>()  // w_act
                                  .Arg<ffi::AnyBuffer>()  // w_up_t or w_up
                                  .Arg<ffi::AnyBuffer>()  // w_down
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("up_transposed")
                                  .Attr<int32_t>("gated"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellCpuUpDown, UpDownImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // g
                                  .Arg<ffi::AnyBuffer>()  // w_up_t or w_up
                                  .Arg<ffi::AnyBuffer>()  // w_down
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Attr<int32_t>("up_transposed"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellCpuUpDownTrain, UpDownTrainImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // g
                                  .Arg<ffi::AnyBuffer>()  // w_up_t
                                  .Arg<ffi::AnyBuffer>()  // w_down
                                  .Ret<ffi::AnyBuffer>()  // y
                                  .Ret<ffi::AnyBuffer>());  // u

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellCpuBackward, BackwardImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // x
                                  .Arg<ffi::AnyBuffer>()  // g
                                  .Arg<ffi::AnyBuffer>()  // u
                                  .Arg<ffi::AnyBuffer>()  // dy
                                  .Arg<ffi::AnyBuffer>()  // w_up_t
                                  .Arg<ffi::AnyBuffer>()  // w_act_t
                                  .Arg<ffi::AnyBuffer>()  // w_down
                                  .Arg<ffi::Buffer<ffi::F32>>()  // c
                                  .Ret<ffi::AnyBuffer>()  // dx
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dw_act_t
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dw_up_t
                                  .Ret<ffi::Buffer<ffi::F32>>()  // dw_down
                                  .Attr<int32_t>("gated"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellCpuDown, DownImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()  // g
                                  .Arg<ffi::AnyBuffer>()  // w_down
                                  .Ret<ffi::AnyBuffer>());  // y

// Bumped whenever a handler's operands, attributes or results change, so Python never
// binds a stale module (jax_twell/_cpu.py checks it).
constexpr int kAbiVersion = 3;

NB_MODULE(_cpu_kernels, m) {
  m.doc() = "jax_twell's CPU XLA FFI handlers (sparse FFN up and down products, training forward and backward).";
  m.def("handlers", []() {
    nb::dict out;
    out["jax_twell_cpu_up_down"] = nb::capsule(reinterpret_cast<void*>(&JaxTwellCpuUpDown));
    out["jax_twell_cpu_down"] = nb::capsule(reinterpret_cast<void*>(&JaxTwellCpuDown));
    out["jax_twell_cpu_gate"] = nb::capsule(reinterpret_cast<void*>(&JaxTwellCpuGate));
    out["jax_twell_cpu_gate_twell"] = nb::capsule(reinterpret_cast<void*>(&JaxTwellCpuGateTwell));
    out["jax_twell_cpu_up_down_twell"] = nb::capsule(reinterpret_cast<void*>(&JaxTwellCpuUpDownTwell));
    out["jax_twell_cpu_up_down_train"] = nb::capsule(reinterpret_cast<void*>(&JaxTwellCpuUpDownTrain));
    out["jax_twell_cpu_backward"] = nb::capsule(reinterpret_cast<void*>(&JaxTwellCpuBackward));
    return out;
  }, "FFI target name -> capsule of its XLA_FFI_Handler (register with platform='cpu').");
  m.def("abi_version", []() { return kAbiVersion; }, "Version of the handlers' operands and attributes.");
  m.def("ffi_api_version", []() { return nb::make_tuple(XLA_FFI_API_MAJOR, XLA_FFI_API_MINOR); },
        "XLA FFI API (major, minor) of the headers this module was compiled against.");
}
