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
//   2. gated: BackupGemmKernel<kGatherA, kScaleG>: h[i, :] = bf16(g[r, :] * bf16(x[r, :] @ Wu))
//      for the listed rows r = list[i], into a compact [n, f] buffer (rounded as the
//      reference rounds u and h);
//   3. BackupGemmKernel<kGatherA = !gated>: y[r, :] = bf16(h[i, :] @ Wd) (non-gated: the
//      activation's rows g[r, :] themselves are the left operand).
// The products are tensor-core tiles (mma.sync m16n8k16, f32 accumulators; 64 x 64 x 32
// tiles, four warps, a four-stage cp.async pipeline). Their grids are persistent: a CTA
// reads the count and walks the tiles it covers, so with no row to back up every CTA
// returns after one load (a launch and no more). Each row's sums run over K in one fixed
// order whatever its place in the list: the results are deterministic.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
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
  uint16_t* c;        // C rows: c + i * ldc (kScaleG) or c + list[i] * ldc
  int64_t ldc;
  const uint16_t* g;  // kScaleG: the gate's rows g + list[i] * ldg
  int64_t ldg;
  const int32_t* list;
  const int32_t* count;
  int n, k;
};

template <typename E, bool kGatherA, bool kScaleG>
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
          if constexpr (kScaleG) {
            const uint32_t gv = *reinterpret_cast<const uint32_t*>(p.g + r * p.ldg + col);
            v0 = E::ToFloat(gv) * Round<E>(v0);
            v1 = E::ToFloat(gv >> 16) * Round<E>(v1);
            out = p.c + static_cast<int64_t>(i) * p.ldc + col;
          } else {
            out = p.c + r * p.ldc + col;
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
template <typename E, bool kGatherA, bool kScaleG>
ffi::Error LaunchGemm(cudaStream_t stream, const GemmArgs& p, int64_t max_rows) {
  const int64_t max_tiles = CeilDiv(max_rows, kBM) * CeilDiv(p.n, kBN);
  const int grid = static_cast<int>(std::min<int64_t>(max_tiles, int64_t{4} * SmCount()));
  BackupGemmKernel<E, kGatherA, kScaleG><<<grid, kThreads, kSmemBytes, stream>>>(p);
  return LaunchStatus("BackupGemmKernel");
}

template <typename E>
ffi::Error LaunchTyped(cudaStream_t stream, bool gated, int64_t rows, int64_t d, int64_t f, int n_tiles,
                       int capacity, int max_entries, const void* x, const void* g, const int32_t* counts,
                       const void* w_up, const void* w_down, void* y, void* h, int32_t* list) {
  int32_t* count = list + rows;
  if (cudaMemsetAsync(count, 0, sizeof(int32_t), stream) != cudaSuccess) return LaunchStatus("backup count memset");
  BackupListKernel<<<static_cast<unsigned>(CeilDiv(rows, kListWarps)), kListWarps * 32, 0, stream>>>(
      rows, n_tiles, capacity, max_entries, counts, list, count);
  if (auto e = LaunchStatus("BackupListKernel"); e.failure()) return e;
  const auto* g16 = static_cast<const uint16_t*>(g);
  if (gated) {
    const GemmArgs up{static_cast<const uint16_t*>(x), d, static_cast<const uint16_t*>(w_up), f,
                      static_cast<uint16_t*>(h), f, g16, f, list, count, static_cast<int>(f), static_cast<int>(d)};
    if (auto e = LaunchGemm<E, true, true>(stream, up, rows); e.failure()) return e;
    const GemmArgs down{static_cast<const uint16_t*>(h), f, static_cast<const uint16_t*>(w_down), d,
                        static_cast<uint16_t*>(y), d, nullptr, 0, list, count, static_cast<int>(d), static_cast<int>(f)};
    return LaunchGemm<E, false, false>(stream, down, rows);
  }
  const GemmArgs down{g16, f, static_cast<const uint16_t*>(w_down), d, static_cast<uint16_t*>(y), d, nullptr, 0,
                      list, count, static_cast<int>(d), static_cast<int>(f)};
  return LaunchGemm<E, true, false>(stream, down, rows);
}

// Operands: x [M, d] (gated), g [M, f] (the activation relu(x @ W) the TwELL was packed
// from), counts [M, n_tiles] s32 (its TwELL counts), w_up [d, f] (gated), w_down [f, d],
// y_in [M, d] (the warp kernel's result; aliased to y). Results: y [M, d] (y_in with the
// backed-up rows written), gated: h [M, f] (scratch: the backed-up rows' hidden, compact),
// list [M + 1] s32 (the backed-up rows, their count last). Attributes: capacity (TwELL
// slots a tile), max_entries (the warp kernel's row budget): the warp kernel's rule.
ffi::Error BackupImpl(const char* op, bool gated, cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer g,
                      ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                      ffi::Result<ffi::AnyBuffer> y, void* h, ffi::Result<ffi::Buffer<ffi::S32>> list,
                      int32_t capacity, int32_t max_entries) {
  auto g_dims = g.dimensions();
  if (g_dims.size() != 2) return Invalid(std::string(op) + ": g must have shape [M, f]");
  const int64_t rows = g_dims[0], f = g_dims[1];
  auto wd_dims = w_down.dimensions();
  if (wd_dims.size() != 2 || wd_dims[0] != f) return Invalid(std::string(op) + ": w_down must have shape [f, d]");
  const int64_t d = wd_dims[1];
  if (gated && (!SameDims(x.dimensions(), {rows, d}) || !SameDims(w_up.dimensions(), {d, f})))
    return Invalid(std::string(op) + ": x must have shape [M, d] and w_up [d, f]");
  auto c_dims = counts.dimensions();
  if (c_dims.size() != 2 || c_dims[0] != rows) return Invalid(std::string(op) + ": counts must have shape [M, n_tiles]");
  if (!SameDims(y_in.dimensions(), {rows, d}) || !SameDims(y->dimensions(), {rows, d}))
    return Invalid(std::string(op) + ": y must have shape [M, d]");
  if (!SameDims(list->dimensions(), {rows + 1})) return Invalid(std::string(op) + ": list must have shape [M + 1]");
  const auto dtype = g.element_type();
  if (w_down.element_type() != dtype || y->element_type() != dtype || y_in.element_type() != dtype ||
      (gated && (x.element_type() != dtype || w_up.element_type() != dtype)))
    return Invalid(std::string(op) + ": x, g, the weights and y must share one dtype");
  if (d % 8 != 0 || f % 8 != 0) return Invalid(std::string(op) + ": d and f must be multiples of 8");
  if (rows >= (int64_t{1} << 31) - 1 || f >= (int64_t{1} << 31) || d >= (int64_t{1} << 31))
    return Invalid(std::string(op) + ": M, d and f must be below 2^31");
  if (capacity < 0 || max_entries < 0) return Invalid(std::string(op) + ": capacity and max_entries must be >= 0");
  if (y->untyped_data() != y_in.untyped_data())
    return Invalid(std::string(op) + ": y must alias y_in (input_output_aliases)");
  if (rows == 0) return ffi::Error::Success();
  const int n_tiles = static_cast<int>(c_dims[1]);
  const void* xp = gated ? x.untyped_data() : nullptr;
  const void* wu = gated ? w_up.untyped_data() : nullptr;
  switch (dtype) {
    case ffi::DataType::BF16:
      return LaunchTyped<Bf16>(stream, gated, rows, d, f, n_tiles, capacity, max_entries, xp, g.untyped_data(),
                               counts.typed_data(), wu, w_down.untyped_data(), y->untyped_data(), h,
                               list->typed_data());
    case ffi::DataType::F16:
      return LaunchTyped<F16>(stream, gated, rows, d, f, n_tiles, capacity, max_entries, xp, g.untyped_data(),
                              counts.typed_data(), wu, w_down.untyped_data(), y->untyped_data(), h,
                              list->typed_data());
    default:
      return Invalid(std::string(op) + ": g must be bf16 or f16");
  }
}

ffi::Error BackupGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> counts,
                       ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::AnyBuffer> h, ffi::Result<ffi::Buffer<ffi::S32>> list, int32_t capacity,
                       int32_t max_entries) {
  if (!SameDims(h->dimensions(), {g.dimensions().size() == 2 ? g.dimensions()[0] : -1,
                                  g.dimensions().size() == 2 ? g.dimensions()[1] : -1}) ||
      h->element_type() != g.element_type())
    return Invalid("ffn_backup (gated): h must have g's shape and dtype");
  return BackupImpl("ffn_backup (gated)", true, stream, x, g, counts, w_up, w_down, y_in, y, h->untyped_data(), list,
                    capacity, max_entries);
}

ffi::Error BackupUngated(cudaStream_t stream, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_down,
                         ffi::AnyBuffer y_in, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> list,
                         int32_t capacity, int32_t max_entries) {
  return BackupImpl("ffn_backup", false, stream, g, g, counts, w_down, w_down, y_in, y, nullptr, list, capacity,
                    max_entries);
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
