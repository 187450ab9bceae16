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

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "common.h"
#include "elements.cuh"

namespace jax_twell {
namespace {

constexpr int kGateTileN = 256;         // the TwELL tile
constexpr int kGateConsumerWarps = 8;   // two consumer warp groups
constexpr int kGateMaxCapacity = 64;

// Operator-style CUTLASS epilogue (wrapped by Sm90TmaWarpSpecializedAdapter) packing the
// accumulator tile as TwELL, warp by warp: no barrier between warps, no shared copy of the
// tile. Element: cutlass::bfloat16_t or cutlass::half_t.
//
// A wgmma m64nNk16 f32 accumulator gives each warp 16 rows of the tile; the 256 columns of
// a row are spread over a quad of lanes, lane q holding columns 8 i + 2 q + {0, 1}
// (i = 0..31), fragment index 4 i + 2 h + b for row half h (rows +0 / +8). Each thread sets
// one bit per column it holds, 2 i + b, in a 64-bit mask per row half; the quad exchanges
// its four masks (shuffles), so a non-zero's slot (the non-zeros before it in column order)
// is four popcounts. Slots go to the warp's shared staging area, then the warp writes each
// of its 16 rows' `capacity` slots (zero past the count) and true count, coalesced.
template <class Element>
class TwellPackEpilogue {
 public:
  using EpilogueSchedule = cutlass::epilogue::NoSmemWarpSpecialized;
  using DispatchPolicy = EpilogueSchedule;
  using ElementC = Element;
  using ElementD = Element;
  using StrideC = cute::Stride<int64_t, cute::_1, int64_t>;
  using StrideD = StrideC;
  using GmemTiledCopyC = void;
  using GmemTiledCopyD = void;
  struct ThreadEpilogueOp {};  // named by CUTLASS's device adapter only

  struct SharedStorage {
    uint32_t slots[kGateConsumerWarps][16][kGateMaxCapacity];  // value bits | column << 16
    int32_t counts[kGateConsumerWarps][16];
  };
  using TensorStorage = SharedStorage;

  struct Arguments {
    uint16_t* values = nullptr;  // [M, n_tiles, capacity] element bits
    int16_t* cols = nullptr;     // [M, n_tiles, capacity]
    int32_t* counts = nullptr;   // [M, n_tiles]
    int m = 0;
    int n_tiles = 0;
    int capacity = 0;
  };
  using Params = Arguments;

  template <class ProblemShape>
  static constexpr Params to_underlying_arguments(ProblemShape const&, Arguments const& args, void*) {
    return args;
  }
  template <class ProblemShape>
  static size_t get_workspace_size(ProblemShape const&, Arguments const&) {
    return 0;
  }
  template <class ProblemShape>
  static cutlass::Status initialize_workspace(ProblemShape const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }
  template <class ProblemShape>
  static bool can_implement(ProblemShape const&, Arguments const& args) {
    return args.capacity >= 1 && args.capacity <= kGateMaxCapacity;
  }

  CUTLASS_HOST_DEVICE explicit TwellPackEpilogue(Params const& params) : params_(params) {}

  CUTLASS_DEVICE bool is_source_needed() { return false; }

  template <class ProblemShapeMNKL, class BlockShapeMNK, class BlockCoordMNKL, class FrgEngine, class FrgLayout,
            class TiledMma, class ResidueMNK>
  CUTLASS_DEVICE void operator()(ProblemShapeMNKL, BlockShapeMNK, BlockCoordMNKL blk_coord_mnkl,
                                 cute::Tensor<FrgEngine, FrgLayout> const& accumulators, TiledMma tiled_mma,
                                 ResidueMNK, int thread_idx, char* smem_raw) {
    using namespace cute;
    constexpr int kTileM = size<0>(BlockShapeMNK{});
    static_assert(size<1>(BlockShapeMNK{}) == kGateTileN, "the epilogue packs tiles of 256 columns");
    static_assert(size(FrgLayout{}) == 128, "a warp holds 16 rows x 256 columns of f32 accumulators");
    SharedStorage& smem = *reinterpret_cast<SharedStorage*>(smem_raw);
    const int m_tile = static_cast<int>(get<0>(blk_coord_mnkl));
    const int n_tile = static_cast<int>(get<1>(blk_coord_mnkl));
    // A swizzled scheduler pads the tile grid: tiles past f (or past M, below) hold nothing
    // of the problem and must write nothing (their slots would be another row's).
    if (n_tile >= params_.n_tiles) return;
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int quad = lane & ~3, q = lane & 3;
    const int warp = static_cast<int>(threadIdx.x / 32) - 4;  // consumer warps follow the producer warp group
    const int capacity = params_.capacity;

    auto thr_mma = tiled_mma.get_thread_slice(thread_idx);
    Tensor coords = thr_mma.partition_C(make_identity_tensor(make_shape(Int<kTileM>{}, Int<kGateTileN>{})));
    const int row_base = static_cast<int>(get<0>(coords(0))) - lane / 4;  // the warp's first row in the tile

    // The accumulator layout this epilogue is written for, checked at the first element and
    // at each step of the fragment's modes (b, h, chunk).
    bool layout_ok = true;
    CUTLASS_PRAGMA_UNROLL
    for (int i : {0, 1, 2, 4, 127}) {
      const int b = i % 2, h = (i / 2) % 2, chunk = i / 4;
      layout_ok &= static_cast<int>(get<0>(coords(i))) == row_base + lane / 4 + 8 * h &&
                   static_cast<int>(get<1>(coords(i))) == 8 * chunk + 2 * q + b;
    }
    if (!layout_ok) __trap();

    // 1. Masks of the non-zeros after relu and rounding, per row half: relu(a) rounds to a
    //    non-zero exactly when a is above half the element type's smallest subnormal (a
    //    tie rounds to even, zero), or NaN.
    uint32_t mask[2][2] = {{0u, 0u}, {0u, 0u}};
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 128; ++i) {
      const int b = i % 2, h = (i / 2) % 2, chunk = i / 4;
      if (!(static_cast<float>(accumulators(i)) <= kNonZeroAbove)) mask[h][chunk / 16] |= 1u << ((2 * chunk + b) % 32);
    }

    // 2. The quad's masks; each non-zero's slot; the staging area.
    uint32_t* slots = &smem.slots[warp][0][0];
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      uint32_t lo[4], hi[4];
      int count = 0;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 4; ++j) {
        lo[j] = __shfl_sync(kFullMask, mask[h][0], quad | j);
        hi[j] = __shfl_sync(kFullMask, mask[h][1], quad | j);
        count += __popc(lo[j]) + __popc(hi[j]);
      }
      const int r = lane / 4 + 8 * h;  // row within the warp's 16
      if (q == 0) smem.counts[warp][r] = count;
      if (mask[h][0] == 0u && mask[h][1] == 0u) continue;
      CUTLASS_PRAGMA_UNROLL
      for (int k = 0; k < 64; ++k) {  // the fragment indices of half h, in column order
        const int chunk = k / 2, b = k % 2, i = 4 * chunk + 2 * h + b, bit = k;
        if (!((mask[h][chunk / 16] >> (bit % 32)) & 1u)) continue;
        int slot = 0;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) {
          const int below = j < q ? 2 * chunk + 2 : (j == q ? bit : 2 * chunk);  // bits before this column
          slot += PopcBelow(lo[j], hi[j], below);
        }
        if (slot < capacity)
          slots[r * kGateMaxCapacity + slot] = ElementBits(accumulators(i)) | (static_cast<uint32_t>(8 * chunk + 2 * q + b) << 16);
      }
    }
    __syncwarp();

    // 3. The warp's 16 rows, coalesced: slot s of a row by lane s (and s + 32).
    const int64_t row0 = static_cast<int64_t>(m_tile) * kTileM + row_base;
    CUTLASS_PRAGMA_UNROLL
    for (int r = 0; r < 16; ++r) {
      const int64_t row = row0 + r;
      if (row >= params_.m) break;
      const int count = smem.counts[warp][r];
      const int64_t out = (row * params_.n_tiles + n_tile) * capacity;
      for (int s = lane; s < capacity; s += 32) {
        const uint32_t word = s < count ? slots[r * kGateMaxCapacity + s] : 0u;
        params_.values[out + s] = static_cast<uint16_t>(word & 0xffffu);
        params_.cols[out + s] = static_cast<int16_t>(word >> 16);
      }
      if (lane == 0) params_.counts[row * params_.n_tiles + n_tile] = count;
    }
    __syncwarp();  // the staging area is the next tile's
  }

 private:
  // Bits of relu(a) rounded once to the element type; NaN stays NaN (a non-zero).
  CUTLASS_DEVICE static uint32_t ElementBits(float a) {
    const Element e((a > 0.f || a != a) ? a : 0.f);
    return reinterpret_cast<const uint16_t&>(e);
  }
  // Set bits of the 64-bit mask (lo, hi) below bit n (n in [0, 64]).
  CUTLASS_DEVICE static int PopcBelow(uint32_t lo, uint32_t hi, int n) {
    if (n >= 32) return __popc(lo) + __popc(n == 64 ? hi : hi & ((1u << (n - 32)) - 1u));
    return __popc(lo & ((1u << n) - 1u));
  }

  static constexpr float kNonZeroAbove = std::is_same_v<Element, cutlass::half_t> ? 0x1p-25f : 0x1p-134f;

  Params params_;
};

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

// Hardware facts per device, queried once (the query costs a few microseconds).
template <class Kernel>
cutlass::KernelHardwareInfo HardwareInfo() {
  constexpr int kMaxDevices = 64;
  static cutlass::KernelHardwareInfo cache[kMaxDevices];
  int device = 0;
  cudaGetDevice(&device);
  if (device < 0 || device >= kMaxDevices) return cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device);
  if (cache[device].sm_count == 0) cache[device] = cutlass::KernelHardwareInfo::make_kernel_hardware_info<Kernel>(device);
  return cache[device];
}

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
      HardwareInfo<typename Gemm::GemmKernel>()};
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
                                  .Attr<int32_t>("variant"));
