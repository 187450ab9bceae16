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
// one bit per non-zero column it holds, 2 i + b, in a 64-bit mask per row half, and rounds
// its accumulators in pairs; the quad exchanges its four masks (shuffles), so a non-zero's
// slot (the non-zeros before it in column order) is four popcounts, computed only for the
// thread's own non-zeros (a loop over its set bits), whose values a tree of selects picks
// from the rounded pairs. Slots go to the warp's shared staging area, then the warp writes
// each of its 16 rows' `capacity` slots (zero past the count), four slots per lane, and the
// rows' true counts.
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
    //    tie rounds to even, zero), or NaN. The accumulators, rounded in pairs (columns
    //    8 chunk + 2 q + {0, 1}), are kept for the few non-zeros' values.
    uint32_t mask[2][2] = {{0u, 0u}, {0u, 0u}};
    uint32_t pairs[2][32];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < 128; ++i) {
      const int b = i % 2, h = (i / 2) % 2, chunk = i / 4;
      if (!(static_cast<float>(accumulators(i)) <= kNonZeroAbove)) mask[h][chunk / 16] |= 1u << ((2 * chunk + b) % 32);
    }
    CUTLASS_PRAGMA_UNROLL
    for (int chunk = 0; chunk < 32; ++chunk) {
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < 2; ++h)
        pairs[h][chunk] = PackPair(accumulators(4 * chunk + 2 * h), accumulators(4 * chunk + 2 * h + 1));
    }

    // 2. The quad's masks; each non-zero's slot (the quad's non-zeros before it in column
    //    order: four popcounts); slots below capacity to the warp's staging area. The loop
    //    runs over this thread's non-zeros only (~0.3 per row half at 0.5% active).
    uint32_t* slots = &smem.slots[warp][0][0];
    CUTLASS_PRAGMA_UNROLL
    for (int h = 0; h < 2; ++h) {
      uint64_t quad_masks[4];
      int count = 0;
      CUTLASS_PRAGMA_UNROLL
      for (int j = 0; j < 4; ++j) {
        const uint32_t lo = __shfl_sync(kFullMask, mask[h][0], quad | j);
        const uint32_t hi = __shfl_sync(kFullMask, mask[h][1], quad | j);
        quad_masks[j] = (static_cast<uint64_t>(hi) << 32) | lo;
        count += __popcll(quad_masks[j]);
      }
      const int r = lane / 4 + 8 * h;  // row within the warp's 16
      if (q == 0) smem.counts[warp][r] = count;
      uint64_t mine = (static_cast<uint64_t>(mask[h][1]) << 32) | mask[h][0];
      while (mine != 0) {
        const int bit = __ffsll(static_cast<long long>(mine)) - 1;  // = 2 chunk + b
        mine &= mine - 1;
        const int chunk = bit / 2, b = bit % 2;
        int slot = 0;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < 4; ++j) {
          const int below = j < q ? 2 * chunk + 2 : (j == q ? bit : 2 * chunk);  // bits before this column
          slot += __popcll(below >= 64 ? quad_masks[j] : quad_masks[j] & ((uint64_t{1} << below) - 1));
        }
        if (slot < capacity) {
          const uint32_t value = (Pick32(pairs[h], chunk) >> (16 * b)) & 0xffffu;
          slots[r * kGateMaxCapacity + slot] = value | (static_cast<uint32_t>(8 * chunk + 2 * q + b) << 16);
        }
      }
    }
    __syncwarp();

    // 3. The warp's 16 rows, coalesced. Capacity 4, 8, 16, 32 or 64: a lane writes four
    //    slots of one row's values or columns (8-byte stores), 32 / (capacity / 2) rows at
    //    a time; other capacities: lane s writes slot s.
    const int64_t row0 = static_cast<int64_t>(m_tile) * kTileM + row_base;
    const int64_t row_stride = static_cast<int64_t>(params_.n_tiles) * capacity;
    const int64_t out0 = (row0 * params_.n_tiles + n_tile) * capacity;
    if (lane < 16 && row0 + lane < params_.m)
      params_.counts[(row0 + lane) * params_.n_tiles + n_tile] = smem.counts[warp][lane];
    const int tasks = capacity / 2;  // per row: capacity / 4 groups of values, as many of columns
    if (capacity % 4 == 0 && 32 % tasks == 0) {
      const int rows_per_step = 32 / tasks, groups = capacity / 4;
      const int task = lane % tasks, is_col = task / groups, group = task % groups;
      for (int r = lane / tasks; r < 16; r += rows_per_step) {
        if (row0 + r >= params_.m) break;
        const int count = smem.counts[warp][r];
        const uint4 words = *reinterpret_cast<const uint4*>(&slots[r * kGateMaxCapacity + 4 * group]);
        const uint32_t w[4] = {words.x, words.y, words.z, words.w};
        uint32_t half[4];
        CUTLASS_PRAGMA_UNROLL
        for (int k = 0; k < 4; ++k) half[k] = 4 * group + k < count ? (is_col ? w[k] >> 16 : w[k] & 0xffffu) : 0u;
        const uint2 packed = make_uint2(half[0] | (half[1] << 16), half[2] | (half[3] << 16));
        uint16_t* base = is_col ? reinterpret_cast<uint16_t*>(params_.cols) : params_.values;
        *reinterpret_cast<uint2*>(base + out0 + r * row_stride + 4 * group) = packed;
      }
    } else {
      for (int r = 0; r < 16; ++r) {
        if (row0 + r >= params_.m) break;
        const int count = smem.counts[warp][r];
        for (int s = lane; s < capacity; s += 32) {
          const uint32_t word = s < count ? slots[r * kGateMaxCapacity + s] : 0u;
          params_.values[out0 + r * row_stride + s] = static_cast<uint16_t>(word & 0xffffu);
          params_.cols[out0 + r * row_stride + s] = static_cast<int16_t>(word >> 16);
        }
      }
    }
    __syncwarp();  // the staging area is the next tile's
  }

 private:
  // Two accumulators rounded to the element type, the first in the low 16 bits.
  CUTLASS_DEVICE static uint32_t PackPair(float a, float b) {
    const Element lo(a), hi(b);
    return static_cast<uint32_t>(reinterpret_cast<const uint16_t&>(lo)) |
           (static_cast<uint32_t>(reinterpret_cast<const uint16_t&>(hi)) << 16);
  }
  // v[i] for a run-time i in [0, 32), by a tree of selects (registers, no local memory).
  CUTLASS_DEVICE static uint32_t Pick32(const uint32_t (&v)[32], int i) {
    uint32_t t[16];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 16; ++k) t[k] = (i & 1) ? v[2 * k + 1] : v[2 * k];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 8; ++k) t[k] = (i & 2) ? t[2 * k + 1] : t[2 * k];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 4; ++k) t[k] = (i & 4) ? t[2 * k + 1] : t[2 * k];
    CUTLASS_PRAGMA_UNROLL
    for (int k = 0; k < 2; ++k) t[k] = (i & 8) ? t[2 * k + 1] : t[2 * k];
    return (i & 16) ? t[1] : t[0];
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
