// twell_backup: the warp path's dense backup with its row count on the device.
//
// The warp kernel (twell_ffn_warp.cu) leaves zeros on the rows whose entries do not fit
// (a tile past capacity, or more than max_entries entries). This handler computes those
// rows densely, with no host round trip: how many there are is known only on the device,
// and every launch below reads it there.
//
//   1. BackupListKernel: one warp a row applies the warp kernel's rule to the TwELL counts
//      and appends the backed-up rows to a list (an atomic counter, zeroed first by a
//      memset). The list's order varies from run to run; no result depends on it.
//   2. gated: BackupGemmKernel: h[i, :] = bf16(g[r, :] * bf16(x[r, :] @ Wu)) for the listed
//      rows r = list[i], into a compact [n, f] buffer (rounded as the reference rounds u
//      and h). Where the caller has no g (the gate was packed in its matmul's epilogue), a
//      first product recomputes the listed rows' gate, g_c[i] = bf16(relu(x[r] @ Wg)),
//      into a second compact buffer, and h reads it;
//   3. BackupGemmKernel: y[r, :] = bf16(h[i, :] @ Wd) (non-gated: the activation's rows
//      g[r, :] themselves are the left operand).
// The products are tensor-core tiles (mma.sync m16n8k16, f32 accumulators; 64 x 64 x 32
// tiles, four warps, a four-stage cp.async pipeline). Their grids are persistent: a CTA
// reads the count and walks the tiles it covers, so with no row to back up every CTA
// returns after one load (a launch and no more). Each row's sums run over K in one fixed
// order whatever its place in the list: the results are deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "async_mma.cuh"
#include "common.h"
#include "elements.cuh"

namespace jax_twell {
namespace {

constexpr int kBM = 64, kBN = 64, kBK = 32;
constexpr int kStages = 4;
constexpr int kThreads = 128;         // four warps, 2 x 2 over the tile, 32 x 32 each
constexpr int kAStride = kBK + 8;     // elements a row of the A stage: 80 bytes, ldmatrix without bank conflicts
constexpr int kBStride = kBN + 8;     // 144 bytes
constexpr int kAStage = kBM * kAStride;
constexpr int kBStage = kBK * kBStride;
constexpr int kSmemBytes = kStages * (kAStage + kBStage) * 2;
constexpr int kListWarps = 8;

__global__ __launch_bounds__(kListWarps * 32) void BackupListKernel(int64_t rows, int n_tiles, int capacity,
                                                                     int max_entries, const int32_t* __restrict__ counts,
                                                                     int32_t* __restrict__ list,
                                                                     int32_t* __restrict__ count) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kListWarps + threadIdx.x / 32;
  if (row >= rows) return;
  const int32_t* row_counts = counts + row * n_tiles;
  int total = 0;
  bool over = false;
  for (int k = lane; k < n_tiles; k += 32) {
    const int c = row_counts[k];
    total += c;
    over |= c > capacity;
  }
  total = __reduce_add_sync(kFullMask, total);
  over = __any_sync(kFullMask, over);
  if (lane == 0 && (over || total > max_entries)) list[atomicAdd(count, 1)] = static_cast<int32_t>(row);
}

struct GemmArgs {
  const uint16_t* a;  // A rows: a + list[i] * lda (kGatherA) or a + i * lda
  int64_t lda;
  const uint16_t* b;  // B [K, N], row-major
  int64_t ldb;
  uint16_t* c;        // C rows: c + list[i] * ldc (kStoreRows) or c + i * ldc
  int64_t ldc;
  const uint16_t* g;  // kScaleRows: the gate's rows g + list[i] * ldg; kScaleCompact: g + i * ldg
  int64_t ldg;
  const int32_t* list;
  const int32_t* count;
  int n, k;
};

// What a product's epilogue does with its f32 sums v of list position i (row r = list[i]).
enum Epilogue : int {
  kStoreRows = 0,     // c[r] = bf16(v)
  kRelu = 1,          // c[i] = bf16(relu(v))
  kScaleRows = 2,     // c[i] = bf16(g[r] * bf16(v))
  kScaleCompact = 3,  // c[i] = bf16(g[i] * bf16(v))
};

template <typename E, bool kGatherA, int kEpi>
__global__ __launch_bounds__(kThreads) void BackupGemmKernel(const GemmArgs p) {
  extern __shared__ __align__(16) uint16_t smem[];
  uint16_t* sa = smem;
  uint16_t* sb = smem + kStages * kAStage;
  const int count = *p.count;
  const int col_tiles = (p.n + kBN - 1) / kBN;
  const int tiles = ((count + kBM - 1) / kBM) * col_tiles;
  if (static_cast<int>(blockIdx.x) >= tiles) return;
  const int k_steps = (p.k + kBK - 1) / kBK;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wm = warp / 2, wn = warp % 2;

  for (int t = blockIdx.x; t < tiles; t += gridDim.x) {
    const int row0 = (t / col_tiles) * kBM, col0 = (t % col_tiles) * kBN;
    // This thread's two 16-byte pieces of each stage's A (64 rows x 4) and B (32 rows x 8).
    const uint16_t* a_src[2];
    bool a_ok[2];
    int a_dst[2], a_k[2];
    const uint16_t* b_src[2];
    bool b_ok[2];
    int b_dst[2], b_k[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const int q = tid + j * kThreads;
      const int r = q >> 2, kc = (q & 3) * 8;
      const int i = row0 + r;
      a_ok[j] = i < count;
      const int64_t arow = kGatherA ? (a_ok[j] ? p.list[i] : 0) : (a_ok[j] ? i : 0);
      a_src[j] = p.a + arow * p.lda + kc;
      a_dst[j] = r * kAStride + kc;
      a_k[j] = kc;
      const int br = q >> 3, nc = (q & 7) * 8;
      b_ok[j] = col0 + nc < p.n;
      b_src[j] = p.b + static_cast<int64_t>(br) * p.ldb + (b_ok[j] ? col0 + nc : 0);
      b_dst[j] = br * kBStride + nc;
      b_k[j] = br;
    }
    auto load_stage = [&](int ks, int stage) {
      const int k0 = ks * kBK;
      const uint32_t a_base = SmemAddr(sa + stage * kAStage), b_base = SmemAddr(sb + stage * kBStage);
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool ok = a_ok[j] && k0 + a_k[j] < p.k;
        CpAsync16SharedOrZero(a_base + a_dst[j] * 2, ok ? a_src[j] + k0 : p.a, ok ? 16 : 0);
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const bool ok = b_ok[j] && k0 + b_k[j] < p.k;
        CpAsync16SharedOrZero(b_base + b_dst[j] * 2, ok ? b_src[j] + static_cast<int64_t>(k0) * p.ldb : p.b,
                              ok ? 16 : 0);
      }
    };

    float acc[2][4][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
      for (int ni = 0; ni < 4; ++ni)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[mi][ni][v] = 0.f;

#pragma unroll
    for (int s = 0; s < kStages - 1; ++s) {
      if (s < k_steps) load_stage(s, s);
      CpAsyncCommit();
    }
    for (int ks = 0; ks < k_steps; ++ks) {
      CpAsyncWait<kStages - 2>();
      __syncthreads();  // stage ks is in; stage ks - 1, which the prefetch below overwrites, is read
      const int next = ks + kStages - 1;
      if (next < k_steps) load_stage(next, next % kStages);
      CpAsyncCommit();
      const uint16_t* A = sa + (ks % kStages) * kAStage;
      const uint16_t* B = sb + (ks % kStages) * kBStage;
#pragma unroll
      for (int kk = 0; kk < kBK; kk += 16) {
        uint32_t af[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
          LdMatrixX4(af[mi], A + (wm * 32 + mi * 16 + (lane & 15)) * kAStride + kk + (lane >> 4) * 8);
        uint32_t bf[4][2];
#pragma unroll
        for (int nj = 0; nj < 2; ++nj) {
          uint32_t r[4];
          LdMatrixX4Trans(r, B + (kk + ((lane >> 3) & 1) * 8 + (lane & 7)) * kBStride + wn * 32 + nj * 16 +
                                 (lane >> 4) * 8);
          bf[2 * nj][0] = r[0];
          bf[2 * nj][1] = r[1];
          bf[2 * nj + 1][0] = r[2];
          bf[2 * nj + 1][1] = r[3];
        }
#pragma unroll
        for (int mi = 0; mi < 2; ++mi)
#pragma unroll
          for (int ni = 0; ni < 4; ++ni) Mma16816<E>(acc[mi][ni], af[mi], bf[ni][0], bf[ni][1]);
      }
    }
    CpAsyncWait<0>();
    __syncthreads();  // the next tile's prologue overwrites the stages

    // Accumulator (mi, ni): rows lane / 4 and lane / 4 + 8 of its 16, columns 2 (lane % 4) + {0, 1}.
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int i = row0 + wm * 32 + mi * 16 + (lane >> 2) + half * 8;
        if (i >= count) continue;
        const int64_t r = p.list[i];
#pragma unroll
        for (int ni = 0; ni < 4; ++ni) {
          const int col = col0 + wn * 32 + ni * 8 + (lane & 3) * 2;
          if (col >= p.n) continue;
          float v0 = acc[mi][ni][2 * half], v1 = acc[mi][ni][2 * half + 1];
          uint16_t* out;
          if constexpr (kEpi == kStoreRows) {
            out = p.c + r * p.ldc + col;
          } else {
            if constexpr (kEpi == kRelu) {  // NaN stays NaN, as XLA's max has it (fmaxf would drop it)
              v0 = isnan(v0) ? v0 : fmaxf(v0, 0.f);
              v1 = isnan(v1) ? v1 : fmaxf(v1, 0.f);
            } else {
              const int64_t grow = kEpi == kScaleRows ? r : static_cast<int64_t>(i);
              const uint32_t gv = *reinterpret_cast<const uint32_t*>(p.g + grow * p.ldg + col);
              v0 = E::ToFloat(gv) * Round<E>(v0);
              v1 = E::ToFloat(gv >> 16) * Round<E>(v1);
            }
            out = p.c + static_cast<int64_t>(i) * p.ldc + col;
          }
          *reinterpret_cast<uint32_t*>(out) = E::FromFloat(v0) | (E::FromFloat(v1) << 16);
        }
      }
    }
  }
}

int SmCount() {
  static const int count = [] {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
      return 132;
    return sms;
  }();
  return count;
}

// Persistent grid: enough CTAs for the tiles of all M rows, at most a few waves' worth.
template <typename E, bool kGatherA, int kEpi>
ffi::Error LaunchGemm(cudaStream_t stream, const GemmArgs& p, int64_t max_rows) {
  const int64_t max_tiles = CeilDiv(max_rows, kBM) * CeilDiv(p.n, kBN);
  const int grid = static_cast<int>(std::min<int64_t>(max_tiles, int64_t{4} * SmCount()));
  BackupGemmKernel<E, kGatherA, kEpi><<<grid, kThreads, kSmemBytes, stream>>>(p);
  return LaunchStatus("BackupGemmKernel");
}

// The operands of one backup call; null pointers for what the form does not take.
struct BackupOperands {
  const void* x;       // [M, d] (null: non-gated with g given)
  const void* g;       // [M, f] the packed activation (null: recomputed from x and w_act)
  const void* w_act;   // [d, f] the activation's weight, where g is recomputed
  const void* w_up;    // [d, f] (null: non-gated)
  const void* w_down;  // [f, d]
  void* y;             // [M, d]
  void* h;             // [M, f] compact scratch (gated, or g recomputed)
  int32_t* list;       // [M + 1]
};

template <typename E>
ffi::Error LaunchTyped(cudaStream_t stream, int64_t rows, int64_t d, int64_t f, int n_tiles, int capacity,
                       int max_entries, const int32_t* counts, const BackupOperands& o) {
  int32_t* count = o.list + rows;
  if (cudaMemsetAsync(count, 0, sizeof(int32_t), stream) != cudaSuccess) return LaunchStatus("backup count memset");
  BackupListKernel<<<static_cast<unsigned>(CeilDiv(rows, kListWarps)), kListWarps * 32, 0, stream>>>(
      rows, n_tiles, capacity, max_entries, counts, o.list, count);
  if (auto e = LaunchStatus("BackupListKernel"); e.failure()) return e;
  const auto* x = static_cast<const uint16_t*>(o.x);
  const auto* g = static_cast<const uint16_t*>(o.g);
  auto* h = static_cast<uint16_t*>(o.h);
  const int fi = static_cast<int>(f), di = static_cast<int>(d);
  // The hidden rows h (compact) or, non-gated with g given, g's own rows.
  if (g == nullptr) {  // g_c[i] = bf16(relu(x[r] @ W)), into h
    const GemmArgs act{x, d, static_cast<const uint16_t*>(o.w_act), f, h, f, nullptr, 0, o.list, count, fi, di};
    if (auto e = LaunchGemm<E, true, kRelu>(stream, act, rows); e.failure()) return e;
  }
  if (o.w_up != nullptr) {  // h[i] = bf16(g[r or i] * bf16(x[r] @ Wu)): in place over g_c where recomputed
    const GemmArgs up{x, d, static_cast<const uint16_t*>(o.w_up), f, h, f, g == nullptr ? h : g, f, o.list, count,
                      fi, di};
    auto e = g == nullptr ? LaunchGemm<E, true, kScaleCompact>(stream, up, rows)
                          : LaunchGemm<E, true, kScaleRows>(stream, up, rows);
    if (e.failure()) return e;
  }
  const bool compact = o.w_up != nullptr || g == nullptr;
  const GemmArgs down{compact ? h : g, f, static_cast<const uint16_t*>(o.w_down), d, static_cast<uint16_t*>(o.y), d,
                      nullptr, 0, o.list, count, di, fi};
  return compact ? LaunchGemm<E, false, kStoreRows>(stream, down, rows)
                 : LaunchGemm<E, true, kStoreRows>(stream, down, rows);
}

// Dimension codes of Operand::dims: -1 = M, -2 = d, -3 = f.
constexpr int64_t kM = -1, kD = -2, kF = -3;

// Checks the shapes and dtypes of one backup call and launches it: M from counts, f and d
// from w_down; `operands` lists (name, buffer, expected dims) of the others the form takes.
struct Operand {
  const char* name;
  const ffi::AnyBuffer* buffer;
  int64_t dims[2];  // codes kM, kD, kF below
};

ffi::Error BackupCall(const char* op, cudaStream_t stream, std::initializer_list<Operand> operands,
                      ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                      ffi::Result<ffi::AnyBuffer> y, ffi::AnyBuffer::Dimensions h_dims, ffi::DataType h_type,
                      ffi::Result<ffi::Buffer<ffi::S32>> list, int32_t capacity, int32_t max_entries,
                      BackupOperands o) {
  auto c_dims = counts.dimensions();
  auto wd_dims = w_down.dimensions();
  if (c_dims.size() != 2 || wd_dims.size() != 2)
    return Invalid(std::string(op) + ": counts must have shape [M, n_tiles] and w_down [f, d]");
  const int64_t rows = c_dims[0], f = wd_dims[0], d = wd_dims[1];
  const auto dtype = w_down.element_type();
  for (const Operand& a : operands) {
    auto size = [&](int64_t code) { return code == -1 ? rows : code == -2 ? d : f; };
    auto got = a.buffer->dimensions();
    const bool same = got.size() == 2 && got[0] == size(a.dims[0]) && got[1] == size(a.dims[1]);
    if (!same) return Invalid(std::string(op) + ": " + a.name + " has the wrong shape (M, d, f from counts and w_down)");
    if (a.buffer->element_type() != dtype) return Invalid(std::string(op) + ": " + a.name + " must have w_down's dtype");
  }
  if (!SameDims(y_in.dimensions(), {rows, d}) || !SameDims(y->dimensions(), {rows, d}) ||
      y->element_type() != dtype || y_in.element_type() != dtype)
    return Invalid(std::string(op) + ": y must have shape [M, d] and w_down's dtype");
  if (o.h != nullptr && (!SameDims(h_dims, {rows, f}) || h_type != dtype))
    return Invalid(std::string(op) + ": h must have shape [M, f] and w_down's dtype");
  if (!SameDims(list->dimensions(), {rows + 1})) return Invalid(std::string(op) + ": list must have shape [M + 1]");
  if (d % 8 != 0 || f % 8 != 0) return Invalid(std::string(op) + ": d and f must be multiples of 8");
  if (rows >= (int64_t{1} << 31) - 1 || f >= (int64_t{1} << 31) || d >= (int64_t{1} << 31))
    return Invalid(std::string(op) + ": M, d and f must be below 2^31");
  if (capacity < 0 || max_entries < 0) return Invalid(std::string(op) + ": capacity and max_entries must be >= 0");
  if (y->untyped_data() != y_in.untyped_data())
    return Invalid(std::string(op) + ": y must alias y_in (input_output_aliases)");
  if (rows == 0) return ffi::Error::Success();
  o.w_down = w_down.untyped_data();
  o.y = y->untyped_data();
  o.list = list->typed_data();
  const int n_tiles = static_cast<int>(c_dims[1]);
  switch (dtype) {
    case ffi::DataType::BF16:
      return LaunchTyped<Bf16>(stream, rows, d, f, n_tiles, capacity, max_entries, counts.typed_data(), o);
    case ffi::DataType::F16:
      return LaunchTyped<F16>(stream, rows, d, f, n_tiles, capacity, max_entries, counts.typed_data(), o);
    default:
      return Invalid(std::string(op) + ": the operands must be bf16 or f16");
  }
}

// Results, every form: y [M, d] (y_in, aliased, with the backed-up rows written), list
// [M + 1] s32 (the backed-up rows, their count last); gated or recomputing forms: h [M, f]
// (scratch). Attributes: capacity (TwELL slots a tile) and max_entries (the warp kernel's
// row budget): the warp kernel's rule, applied to the TwELL counts [M, n_tiles] s32.

// Gated, g given: x [M, d], g [M, f], counts, w_up [d, f], w_down [f, d], y_in [M, d].
ffi::Error BackupGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> counts,
                       ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::Buffer<ffi::S32>> list, int32_t capacity,
                       int32_t max_entries) {
  BackupOperands o{x.untyped_data(), g.untyped_data(), nullptr, w_up.untyped_data(), nullptr, nullptr,
                   h->untyped_data(), nullptr};
  return BackupCall("ffn_backup (gated)", stream, {{"x", &x, {kM, kD}}, {"g", &g, {kM, kF}}, {"w_up", &w_up, {kD, kF}}},
                    counts, w_down, y_in, y, h->dimensions(), h->element_type(), list, capacity, max_entries, o);
}

// Non-gated, g given (the activation): g [M, f], counts, w_down [f, d], y_in [M, d].
ffi::Error BackupUngated(cudaStream_t stream, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_down,
                         ffi::AnyBuffer y_in, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> list,
                         int32_t capacity, int32_t max_entries) {
  BackupOperands o{nullptr, g.untyped_data(), nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  return BackupCall("ffn_backup", stream, {{"g", &g, {kM, kF}}}, counts, w_down, y_in, y, {}, ffi::DataType::BF16,
                    list, capacity, max_entries, o);
}

// Gated, the gate recomputed for the listed rows (no g: it was packed in its matmul's
// epilogue): x [M, d], counts, w_gate [d, f], w_up [d, f], w_down [f, d], y_in [M, d].
ffi::Error BackupGatedFromX(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> counts,
                            ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                            ffi::Result<ffi::Buffer<ffi::S32>> list, int32_t capacity, int32_t max_entries) {
  BackupOperands o{x.untyped_data(), nullptr, w_gate.untyped_data(), w_up.untyped_data(), nullptr, nullptr,
                   h->untyped_data(), nullptr};
  return BackupCall("ffn_backup (gated, from x)", stream,
                    {{"x", &x, {kM, kD}}, {"w_gate", &w_gate, {kD, kF}}, {"w_up", &w_up, {kD, kF}}}, counts, w_down,
                    y_in, y, h->dimensions(), h->element_type(), list, capacity, max_entries, o);
}

// Non-gated, the activation recomputed for the listed rows: x [M, d], counts, w_act [d, f],
// w_down [f, d], y_in [M, d].
ffi::Error BackupUngatedFromX(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> counts,
                              ffi::AnyBuffer w_act, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                              ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::AnyBuffer> h,
                              ffi::Result<ffi::Buffer<ffi::S32>> list, int32_t capacity, int32_t max_entries) {
  BackupOperands o{x.untyped_data(), nullptr, w_act.untyped_data(), nullptr, nullptr, nullptr, h->untyped_data(),
                   nullptr};
  return BackupCall("ffn_backup (from x)", stream, {{"x", &x, {kM, kD}}, {"w_act", &w_act, {kD, kF}}}, counts, w_down,
                    y_in, y, h->dimensions(), h->element_type(), list, capacity, max_entries, o);
}

}  // namespace
}  // namespace jax_twell

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackupGated, jax_twell::BackupGated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // g [M, f]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // h [M, f] (scratch)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 1]
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackup, jax_twell::BackupUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // a [M, f] (the activation)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 1]
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackupGatedFromX, jax_twell::BackupGatedFromX,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_gate [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // h [M, f] (scratch)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 1]
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackupFromX, jax_twell::BackupUngatedFromX,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_act [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // h [M, f] (scratch)
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 1]
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
