// twell_ffn_blocked: fused up + down projection of the sparse FFN over token blocks, so a
// weight slab is read once per block of 1024 tokens instead of once per active pair.
//
//   gated:      y[t] = sum_j  bf16(g[t,j] * bf16(x[t] . Wu[:, j])) * Wd[j, :]
//   non-gated:  y[t] = sum_j  a[t,j] * Wd[j, :]
//
// Layout and arithmetic are modelled step by step in tests/blocked_emulation.py
// (same constants, same f32 operation order); read its docstring first. Launches, in order:
//   K0a Layout    grid (tile, block): entries reserved per token of the (block, tile)
//                 segment (the stored count, or the tile width for an overflowed tile),
//                 exclusive prefix -> tok_off.
//   K0b SegScan   one CTA: prefix over segments (block-major) -> seg_start, total.
//   K0c Scatter   grid (tile, block): entry words (value bits << 16 | column) in segment
//                 order; flagged placeholders for every column of an overflowed tile.
//   Recompute     grid (tile, block): overflowed tiles, h exactly from x and the [d, f]
//                 weights (one thread per column, 2 MB of weight reads per tile at d=2048).
//   K1 Up         grid (d/64, block), gated only: 8 lanes per token hold x[t, 64 columns]
//                 in registers; per tile the Wu^T slab [tile, 64] and the segment's
//                 offsets and entries are staged in shared memory (cp.async, two stages);
//                 per entry one 8-lane dot -> partial[range, entry] (f32).
//                 mma=1: the same step on tensor cores (TwellBlockedUpMmaKernel).
//   K1.5 Finish   per entry: h = round(g * round(sum of the partials in range order)).
//   K2 Down       grid (d/32, block): 4 lanes per token hold y[t, 32 columns] in f32
//                 registers; per tile the Wd slab [tile, 32] is staged; each token's
//                 entries are applied in order (tiles ascending, columns ascending within a
//                 tile = neuron order); y written once, rounded. No atomics: deterministic.
//                 mma bit 2 (gated): y as a dense product over each 64-token block's union
//                 of active neurons instead (twell_union_layout.cuh, twell_union.cuh).
//                 mma bit 3 (gated): K1 likewise, u = x . Wu^T over the union's rows on
//                 tensor cores, whole, into row 0 of the partials (Finish sums one range).
//                 mma bit 4 (gated; before bit 2): K2 with Wd stationary in shared memory,
//                 16 output columns a CTA (8 where f > 7,264), every token walked
//                 (twell_stationary.cuh).
// Traffic at M=16384, d=2048, f=5632, 0.5% active: weights 16 blocks x (|Wu| + |Wd|) =
// 0.74 GB, mostly L2; partials 2 x 59 MB; entries (4 B) re-read per d-range CTA: 0.2 GB.
// Workspace results (static sizes): seg_start, tok_off, entries [max_entries], partial
// [d/64, max_entries] (gated). When the needed entries exceed max_entries nothing past
// the workspace is written and y is NaN; with the attribute fallback = 1 the handler then
// launches the row kernel's fallback form (twell_ffn.h), which reads the needed entries on
// the device and, only then, writes every row of y exactly: the op needs no branch.
// Device code: twell_blocked.cuh.
#include <string>

#include "common.h"
#include "twell_blocked.cuh"
#include "twell_ffn.h"
#include "twell_stationary.cuh"
#include "twell_union_layout.cuh"

namespace jax_twell {
namespace {

template <typename E, bool kGated>
ffi::Error Launch(cudaStream_t stream, const Shapes& s, const void* x, const void* values,
                  const int16_t* cols, const int32_t* counts, const void* w_act, const void* w_up,
                  const void* w_up_t, const void* w_down, void* y, int32_t* seg_start,
                  int32_t* tok_off, uint32_t* entries, float* partial, int32_t mma_bits) {
  // bit 0: K1 and K2 on tensor cores; bits 2 and 3 (gated, checked): K2 and K1 as union
  // products; bit 4 (gated, checked, before bit 2): K2 with the weight stationary
  const bool mma = (mma_bits & 1) != 0, down_union = kGated && (mma_bits & 4) != 0;
  const bool down_stationary = kGated && (mma_bits & 16) != 0;
  const bool up_union = kGated && (mma_bits & 8) != 0;
  const auto* x16 = static_cast<const uint16_t*>(x);
  const dim3 segments(s.n_tiles, s.n_blocks);
  TwellBlockedLayoutKernel<<<segments, kThreads, 0, stream>>>(counts, tok_off, s);
  TwellBlockedSegScanKernel<<<1, 1024, 0, stream>>>(tok_off, seg_start, s.n_blocks * s.n_tiles);
  TwellBlockedScatterKernel<uint16_t><<<segments, 256, 0, stream>>>(static_cast<const uint16_t*>(values), cols, counts,
                                                        tok_off, seg_start, entries, s);
  ffi::Error status = LaunchStatus("twell_ffn_blocked layout");
  if (status.failure()) return status;
  TwellBlockedRecomputeKernel<E, kGated><<<segments, kMaxTile, s.d * 2, stream>>>(
      x16, counts, static_cast<const uint16_t*>(w_act), static_cast<const uint16_t*>(w_up), tok_off, seg_start,
      entries, s);
  status = LaunchStatus("twell_ffn_blocked recompute");
  if (status.failure()) return status;
  if constexpr (kGated) {
    if (up_union) {  // u whole in the partials' row 0, the layout after it
      status = LaunchUnionUp<E>(stream, s, tok_off, seg_start, entries, x16, static_cast<const uint16_t*>(w_up_t),
                                partial);
    } else {
      LaunchUpStep<E>(stream, mma, x16, static_cast<const uint16_t*>(w_up_t), tok_off, seg_start, entries, partial, s);
      status = LaunchStatus("twell_ffn_blocked up");
    }
    if (status.failure()) return status;
    const int64_t blocks = std::min<int64_t>(CeilDiv(s.max_entries, 256), 132 * 16);
    TwellBlockedFinishKernel<E><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(partial, seg_start, entries,
                                                                       up_union ? 1 : s.d / kUpCols, s);
    status = LaunchStatus("twell_ffn_blocked finish");
    if (status.failure()) return status;
  }
  if (down_stationary)  // the partials' workspace is free once Finish has read it
    return LaunchStationaryDown<E>(stream, s, tok_off, seg_start, entries, static_cast<const uint16_t*>(w_down),
                                   partial, static_cast<uint16_t*>(y), nullptr, "twell_ffn_blocked");
  if (down_union)
    return LaunchUnion<E, 1, kWordValues>(stream, s, tok_off, seg_start, entries, nullptr,
                                   static_cast<const uint16_t*>(w_down), nullptr, partial, static_cast<uint16_t*>(y),
                                   "twell_ffn_blocked down as a union product");
  LaunchDownStep<E>(stream, mma, static_cast<const uint16_t*>(w_down), tok_off, seg_start, entries,
                    static_cast<uint16_t*>(y), s);
  return LaunchStatus("twell_ffn_blocked down");
}

// Operands as the row kernel's (ffi/twell_ffn.cu); results y and the workspace:
// seg_start [n_blocks*n_tiles + 1] s32, tok_off [n_blocks, n_tiles, 1025] s32,
// entries [max_entries] u32, partial [d/64, max_entries] f32 (gated only).
template <bool kGated>
ffi::Error BlockedImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                       ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_act,
                       ffi::AnyBuffer w_up, ffi::AnyBuffer w_up_t, ffi::AnyBuffer w_down,
                       ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> seg_start,
                       ffi::Result<ffi::Buffer<ffi::S32>> tok_off, ffi::Result<ffi::Buffer<ffi::U32>> entries,
                       float* partial, int64_t partial_rows, int64_t partial_cols, int32_t tile,
                       int32_t mma, int32_t fallback) {
  const char* name = "twell_ffn_blocked: ";
  auto x_dims = x.dimensions();
  if (x_dims.size() < 1) return Invalid(std::string(name) + "x must have shape [..., d]");
  const int64_t d = x_dims.back();
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < x_dims.size(); ++i) rows *= x_dims[i];
  auto a_dims = w_act.dimensions();
  if (a_dims.size() != 2 || a_dims[0] != d) return Invalid(std::string(name) + "the activation weight must be [d, f]");
  const int64_t f = a_dims[1];
  auto v_dims = values.dimensions();
  if (v_dims.size() != x_dims.size() + 1)
    return Invalid(std::string(name) + "values must have shape [..., n_tiles, capacity] for x [..., d]");
  const int64_t n_tiles = v_dims[v_dims.size() - 2], capacity = v_dims.back();
  if (f <= 0 || tile <= 0 || tile % 32 != 0 || tile > kMaxTile || CeilDiv(f, tile) != n_tiles)
    return Invalid(std::string(name) + "tile must be a multiple of 32, at most 256, with ceil(f / tile) == n_tiles");
  if (n_tiles > kMaxTiles) return Invalid(std::string(name) + "ceil(f / tile) must be at most 4096");
  bool ok = cols.dimensions().size() == v_dims.size() && counts.dimensions().size() == x_dims.size();
  for (size_t i = 0; ok && i < v_dims.size(); ++i) ok = cols.dimensions()[i] == v_dims[i];
  for (size_t i = 0; ok && i + 1 < x_dims.size(); ++i)
    ok = v_dims[i] == x_dims[i] && counts.dimensions()[i] == x_dims[i];
  ok = ok && counts.dimensions().back() == n_tiles;
  if (!ok) return Invalid(std::string(name) + "values/cols/counts must share x's leading dimensions");
  if (!SameDims(w_down.dimensions(), {f, d})) return Invalid(std::string(name) + "w_down must have shape [f, d]");
  if (kGated && (!SameDims(w_up.dimensions(), {d, f}) || !SameDims(w_up_t.dimensions(), {f, d})))
    return Invalid(std::string(name) + "w_up must have shape [d, f] and w_up_t [f, d]");
  const auto dtype = x.element_type();
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16)
    return Invalid(std::string(name) + "x must be bf16 or f16 (f32 runs the row kernel)");
  if (values.element_type() != dtype || w_act.element_type() != dtype || w_down.element_type() != dtype ||
      y->element_type() != dtype || (kGated && (w_up.element_type() != dtype || w_up_t.element_type() != dtype)))
    return Invalid(std::string(name) + "x, values, weights and y must share one dtype");
  if (d % kUpCols != 0 || d > 16384)
    return Invalid(std::string(name) + "d must be a multiple of 64 and at most 16384, got " + std::to_string(d));
  if (rows * f >= (int64_t{1} << 31)) return Invalid(std::string(name) + "tokens x f must be below 2^31");
  const int64_t n_blocks = CeilDiv(rows, kBlockTokens);
  const int64_t max_entries = entries->element_count();
  bool ws_ok = seg_start->element_count() == n_blocks * n_tiles + 1 &&
               tok_off->element_count() == n_blocks * n_tiles * (kBlockTokens + 1) && max_entries >= 1 &&
               max_entries < (int64_t{1} << 31);
  if (kGated) ws_ok = ws_ok && partial_rows == d / kUpCols && partial_cols == max_entries;
  if (!ws_ok)
    return Invalid(std::string(name) + "workspace results must be seg_start [ceil(M/1024)*n_tiles + 1], "
                   "tok_off [ceil(M/1024), n_tiles, 1025], entries [max_entries >= 1] and (gated) partial "
                   "[d/64, max_entries]");
  if (rows == 0) return ffi::Error::Success();
  const Shapes s{rows, static_cast<int>(d), static_cast<int>(f), tile, static_cast<int>(capacity),
                 static_cast<int>(n_tiles), static_cast<int>(n_blocks), max_entries};
  if (const char* refusal = UnionStepsRefusal(s, kGated, mma)) return Invalid(std::string(name) + refusal);
  if (const char* refusal = StationaryDownRefusal(s, kGated, mma)) return Invalid(std::string(name) + refusal);
  const void* up = kGated ? w_up.untyped_data() : nullptr;
  const void* up_t = kGated ? w_up_t.untyped_data() : nullptr;
  const bool bf16 = dtype == ffi::DataType::BF16;
  auto launch = bf16 ? Launch<Bf16, kGated> : Launch<F16, kGated>;
  ffi::Error status = launch(stream, s, x.untyped_data(), values.untyped_data(), cols.typed_data(),
                             counts.typed_data(), w_act.untyped_data(), up, up_t, w_down.untyped_data(),
                             y->untyped_data(), seg_start->typed_data(), tok_off->typed_data(),
                             entries->typed_data(), partial, mma);
  if (status.failure() || fallback == 0) return status;
  // The entries the call needed are seg_start's last value (K0b): past max_entries the
  // blocked steps wrote NaN, and the row kernel now writes every row of y instead.
  return LaunchRowFallback(stream, bf16, kGated, rows, static_cast<int>(d), static_cast<int>(f), tile,
                           static_cast<int>(capacity), static_cast<int>(n_tiles), x.untyped_data(),
                           values.untyped_data(), cols.typed_data(), counts.typed_data(), w_act.untyped_data(),
                           up, up_t, w_down.untyped_data(), y->untyped_data(),
                           seg_start->typed_data() + n_blocks * n_tiles, max_entries);
}

ffi::Error BlockedGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values, ffi::Buffer<ffi::S16> cols,
                        ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_gate, ffi::AnyBuffer w_up,
                        ffi::AnyBuffer w_up_t, ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::Buffer<ffi::S32>> seg_start, ffi::Result<ffi::Buffer<ffi::S32>> tok_off,
                        ffi::Result<ffi::Buffer<ffi::U32>> entries, ffi::Result<ffi::Buffer<ffi::F32>> partial,
                        int32_t tile, int32_t mma, int32_t fallback) {
  auto p_dims = partial->dimensions();
  if (p_dims.size() != 2) return Invalid("twell_ffn_blocked: partial must have shape [d/64, max_entries]");
  return BlockedImpl<true>(stream, x, values, cols, counts, w_gate, w_up, w_up_t, w_down, y, seg_start, tok_off,
                           entries, partial->typed_data(), p_dims[0], p_dims[1], tile, mma, fallback);
}

ffi::Error BlockedUngated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer values,
                          ffi::Buffer<ffi::S16> cols, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_up,
                          ffi::AnyBuffer w_down, ffi::Result<ffi::AnyBuffer> y,
                          ffi::Result<ffi::Buffer<ffi::S32>> seg_start, ffi::Result<ffi::Buffer<ffi::S32>> tok_off,
                          ffi::Result<ffi::Buffer<ffi::U32>> entries, int32_t tile, int32_t mma,
                          int32_t fallback) {
  return BlockedImpl<false>(stream, x, values, cols, counts, w_up, w_up, w_down, w_down, y, seg_start, tok_off,
                            entries, nullptr, 0, 0, tile, mma & 1, fallback);
}

}  // namespace
}  // namespace jax_twell

// The handlers only launch work on the stream (no host synchronisation): XLA may capture
// them into its CUDA graphs, conditionals included.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBlockedGated, jax_twell::BlockedGated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // values
                                  .Arg<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // w_gate [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up_t [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // y
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_start
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // tok_off
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()  // entries
                                  .Ret<xla::ffi::Buffer<xla::ffi::F32>>()  // partial
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("mma")  // bit 0: K1 and K2 on tensor cores; bits 2, 3: K2, K1 as union products
                                  .Attr<int32_t>("fallback"),  // 1: the row kernel after, where the entries overflowed
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBlocked, jax_twell::BlockedUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x
                                  .Arg<xla::ffi::AnyBuffer>()  // values
                                  .Arg<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Ret<xla::ffi::AnyBuffer>()  // y
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // seg_start
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // tok_off
                                  .Ret<xla::ffi::Buffer<xla::ffi::U32>>()  // entries
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("mma")  // 1: K2 on tensor cores
                                  .Attr<int32_t>("fallback"),  // 1: the row kernel after, where the entries overflowed
                              {xla::ffi::Traits::kCmdBufferCompatible});
