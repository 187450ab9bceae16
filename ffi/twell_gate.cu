// twell_gate: x [M, d] and w [d, f] -> TwELL(relu(x @ w)), packed in the matmul's epilogue.
//
// The matmul is a CUTLASS 3 Hopper GEMM: TMA loads, wgmma, a warp-specialised persistent
// schedule (one producer warp group, two consumer warp groups), clusters of 2 along M.
// Attribute `variant` = configuration + 4 x raster + 16 x log2(swizzle): the schedule,
// tile and cluster (GatePackGemm, below), the persistent scheduler's raster order (0
// heuristic, 1 along M, 2 along N) and its swizzle (1, 2, 4 or 8 tiles); the result is the
// same for all.
// The TwELL tile (256 neurons) is the GEMM's N tile, so an output tile is one TwELL tile
// of 64 or 128 tokens, and the epilogue (TwellPackEpilogue, below) packs it straight from
// the accumulator registers: the M x f activation is never written. Schedules: cooperative
// (both consumer warp groups on one 128 x 256 tile) or ping-pong (each on its own 64 x 256
// tile, one's epilogue overlapping the other's main loop).
//
// The output is the format twell_pack writes from the same activation: entries in column
// order, those past `capacity` not stored but counted (the tile's consumer recomputes it),
// unused slots zero. Rounding: the accumulation is f32 over d in the GEMM's K order,
// rounded once to the element type (round to nearest even), as XLA's matmul rounds its
// output; the K order differs from XLA's, so g may differ in the last bit of an element.
//
// Constraints (checked here; the Python side runs XLA's matmul + twell_pack otherwise):
// bf16 or f16, tile 256, capacity in [1, 64], d and f multiples of 8 (16-byte rows for the
// TMA descriptors), operands 16-byte aligned.
#include <cstdint>

// CUTLASS's SM100 MMA traits (reached through the GEMM builder) end with an unpopped
// `#pragma GCC diagnostic error "-Wmissing-field-initializers"`; the push/pop keeps it
// inside CUTLASS, so it does not reach XLA's FFI headers below (from jaxlib 0.11, api.h
// leaves a new XLA_FFI_Handler_Bundle field to its default initializer).
#pragma GCC diagnostic push
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#pragma GCC diagnostic pop

#include "common.h"
#include "cutlass_hardware.cuh"
#include "elements.cuh"
#include "twell_gate_epilogue.cuh"

namespace jax_twell {
namespace {

// Configurations (kConfig): 0, cooperative, 128 x 256 tiles (two consumer warp groups per
// tile), clusters of 2 along M; 1, ping-pong, 64 x 256 tiles (each consumer warp group its
// own tile, one's epilogue overlapping the other's main loop), clusters of 2 along M; 2, the
// same with clusters of 4 (w's 256-column slab multicast to four M tiles: half the L2
// reads of w per output of configuration 1).
template <class Element, int kConfig>
struct GatePackGemm {
  using Schedule = std::conditional_t<kConfig == 0, cutlass::gemm::KernelTmaWarpSpecializedCooperative,
                                      cutlass::gemm::KernelTmaWarpSpecializedPingpong>;
  using TileShape = cute::Shape<std::conditional_t<kConfig == 0, cute::_128, cute::_64>, cute::_256, cute::_64>;
  using ClusterShape = cute::Shape<std::conditional_t<kConfig == 2, cute::_4, cute::_2>, cute::_1, cute::_1>;
  using Epilogue = cutlass::epilogue::collective::detail::Sm90TmaWarpSpecializedAdapter<TwellPackEpilogue<Element>>;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor, 8, Element,
      cutlass::layout::RowMajor, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(
          sizeof(typename TwellPackEpilogue<Element>::SharedStorage))>,
      Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<cute::Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class Element, int kConfig>
ffi::Error LaunchGatePack(cudaStream_t stream, const void* x, const void* w, void* values, int16_t* cols,
                          int32_t* counts, int m, int d, int f, int n_tiles, int capacity, int raster,
                          int swizzle) {
  using G = GatePackGemm<Element, kConfig>;
  using Gemm = typename G::Gemm;
  using StrideA = typename Gemm::GemmKernel::StrideA;
  using StrideB = typename Gemm::GemmKernel::StrideB;
  const StrideA stride_a = cutlass::make_cute_packed_stride(StrideA{}, {m, d, 1});
  const StrideB stride_b = cutlass::make_cute_packed_stride(StrideB{}, {f, d, 1});
  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {m, f, d, 1},
      {static_cast<const Element*>(x), stride_a, static_cast<const Element*>(w), stride_b},
      {static_cast<uint16_t*>(values), cols, counts, m, n_tiles, capacity},
      CachedHardwareInfo<typename Gemm::GemmKernel>()};
  using Raster = cutlass::gemm::kernel::detail::RasterOrderOptions;
  args.scheduler.raster_order = raster == 1 ? Raster::AlongM : raster == 2 ? Raster::AlongN : Raster::Heuristic;
  args.scheduler.max_swizzle_size = swizzle;
  Gemm gemm;
  if (gemm.can_implement(args) != cutlass::Status::kSuccess)
    return Invalid("gate_twell: the fused gate kernel cannot run this problem (d and f must be multiples of 8, "
                   "capacity in [1, 64], operands 16-byte aligned)");
  if (Gemm::get_workspace_size(args) != 0)
    return ffi::Error::Internal("jax-twell: gate_twell: unexpected CUTLASS workspace");
  cutlass::Status status = gemm.initialize(args, nullptr, stream);
  if (status != cutlass::Status::kSuccess)
    return ffi::Error::Internal(std::string("jax-twell: gate_twell: CUTLASS initialize failed: ") +
                                cutlassGetStatusString(status));
  status = gemm.run(stream);
  if (status != cutlass::Status::kSuccess)
    return ffi::Error::Internal(std::string("jax-twell: gate_twell: CUTLASS run failed: ") +
                                cutlassGetStatusString(status));
  return LaunchStatus("twell_gate_pack");
}

template <class Element>
ffi::Error LaunchGatePackVariant(int variant, cudaStream_t stream, const void* x, const void* w, void* values,
                                 int16_t* cols, int32_t* counts, int m, int d, int f, int n_tiles, int capacity) {
  const int config = variant & 3, raster = (variant >> 2) & 3, swizzle = 1 << ((variant >> 4) & 3);
  if (config == 0)
    return LaunchGatePack<Element, 0>(stream, x, w, values, cols, counts, m, d, f, n_tiles, capacity, raster, swizzle);
  if (config == 1)
    return LaunchGatePack<Element, 1>(stream, x, w, values, cols, counts, m, d, f, n_tiles, capacity, raster, swizzle);
  return LaunchGatePack<Element, 2>(stream, x, w, values, cols, counts, m, d, f, n_tiles, capacity, raster, swizzle);
}

ffi::Error TwellGatePackImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w,
                             ffi::Result<ffi::AnyBuffer> values, ffi::Result<ffi::Buffer<ffi::S16>> cols,
                             ffi::Result<ffi::Buffer<ffi::S32>> counts, int32_t tile, int32_t capacity,
                             int32_t variant) {
  auto x_dims = x.dimensions();
  auto w_dims = w.dimensions();
  if (x_dims.size() != 2 || w_dims.size() != 2 || x_dims[1] != w_dims[0])
    return Invalid("gate_twell: x must be [M, d] and w [d, f]");
  const int64_t m = x_dims[0], d = x_dims[1], f = w_dims[1];
  if (tile != kGateTileN) return Invalid("gate_twell: the fused gate kernel packs tiles of 256 neurons");
  if (capacity < 1 || capacity > kGateMaxCapacity)
    return Invalid("gate_twell: the fused gate kernel takes capacity in [1, 64]");
  if (variant < 0 || variant >= 64 || (variant & 3) == 3 || ((variant >> 2) & 3) == 3)
    return Invalid("gate_twell: variant must be configuration (0-2) + 4 x raster (0-2) + 16 x log2 swizzle (0-3)");
  if (d % 8 != 0 || f % 8 != 0 || d == 0)
    return Invalid("gate_twell: the fused gate kernel needs d and f to be positive multiples of 8");
  if (m > (int64_t{1} << 30) || f > (int64_t{1} << 30))
    return Invalid("gate_twell: M and f must be below 2^30");
  if (x.element_type() != w.element_type() || values->element_type() != x.element_type())
    return Invalid("gate_twell: x, w and values must have one dtype");
  const int64_t n_tiles = CeilDiv(f, tile);
  if (!SameDims(values->dimensions(), {m, n_tiles, capacity}) || !SameDims(cols->dimensions(), {m, n_tiles, capacity}) ||
      !SameDims(counts->dimensions(), {m, n_tiles}))
    return Invalid("gate_twell: outputs must be values/cols [M, ceil(f/256), capacity] and counts [M, ceil(f/256)]");
  for (const void* p : {x.untyped_data(), w.untyped_data()})
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return Invalid("gate_twell: operands must be 16-byte aligned");
  if (m == 0 || f == 0) return ffi::Error::Success();
  const int mi = static_cast<int>(m), di = static_cast<int>(d), fi = static_cast<int>(f);
  const int ti = static_cast<int>(n_tiles);
  switch (x.element_type()) {
    case ffi::DataType::BF16:
      return LaunchGatePackVariant<cutlass::bfloat16_t>(variant, stream, x.untyped_data(), w.untyped_data(),
                                                        values->untyped_data(), cols->typed_data(),
                                                        counts->typed_data(), mi, di, fi, ti, capacity);
    case ffi::DataType::F16:
      return LaunchGatePackVariant<cutlass::half_t>(variant, stream, x.untyped_data(), w.untyped_data(),
                                                    values->untyped_data(), cols->typed_data(), counts->typed_data(),
                                                    mi, di, fi, ti, capacity);
    default:
      return Invalid("gate_twell: the fused gate kernel takes bf16 or f16");
  }
}

}  // namespace
}  // namespace jax_twell

// The handlers only launch work on the stream (no host synchronisation): XLA may capture
// them into its CUDA graphs, conditionals included.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellGatePack, jax_twell::TwellGatePackImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S16>>()
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()
                                  .Attr<int32_t>("tile")
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("variant"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
