// TwellPackEpilogue: the fused gate kernel's epilogue (ffi/twell_gate.cu), in a header so
// that lab/gemm_probe.cu can time it, and its parts, in stock CUTLASS kernels.
#pragma once

#include <cstdint>
#include <type_traits>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/detail.hpp"

#include "elements.cuh"

namespace jax_twell {

constexpr int kGateTileN = 256;         // the TwELL tile
constexpr int kGateConsumerWarps = 8;   // two consumer warp groups
constexpr int kGateMaxCapacity = 64;
// kSteps (timing probes only; the library uses every step): bit 0, the masks, the quad's
// counts and the rows' counts; bit 1, the slots of the non-zeros in the staging area; bit 2,
// the rows' slots written out. A probe without bit 2 leaves the outputs' slots unwritten.
constexpr int kGateAllSteps = 7;

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
template <class Element, int kSteps = kGateAllSteps>
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
                                 ResidueMNK residue_mnk, int thread_idx, char* smem_raw) {
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
    if constexpr ((kSteps & 1) == 0) return;  // timing probe: the main loop alone

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
    // A last tile's columns past f hold x @ 0 (TMA fills w's missing columns with zeros),
    // which is NaN where x has an inf or a NaN: not part of the problem, never packed.
    const int limit = static_cast<int>(get<1>(residue_mnk));  // f - 256 n_tile
    if (limit < kGateTileN) {
      uint32_t valid[2];
      ValidBits(limit, q, valid);
      CUTLASS_PRAGMA_UNROLL
      for (int h = 0; h < 2; ++h) {
        mask[h][0] &= valid[0];
        mask[h][1] &= valid[1];
      }
    }
    if constexpr ((kSteps & 2) != 0) {
      CUTLASS_PRAGMA_UNROLL
      for (int chunk = 0; chunk < 32; ++chunk) {
        CUTLASS_PRAGMA_UNROLL
        for (int h = 0; h < 2; ++h)
          pairs[h][chunk] = PackPair(accumulators(4 * chunk + 2 * h), accumulators(4 * chunk + 2 * h + 1));
      }
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
      uint64_t mine = (kSteps & 2) != 0 ? (static_cast<uint64_t>(mask[h][1]) << 32) | mask[h][0] : 0;
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
    if constexpr ((kSteps & 4) == 0) return;
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
  // The mask bits (2 chunk + b, column 8 chunk + 2 q + b) of lane q's columns below limit,
  // as {chunks 0-15, chunks 16-31}. Bit by bit: it runs in a last, partial tile only. (A
  // closed form with min/max and a select for the full word was miscompiled by ptxas 13.0:
  // the select's condition came out inverted, every column valid.)
  CUTLASS_DEVICE static void ValidBits(int limit, int q, uint32_t (&valid)[2]) {
    valid[0] = valid[1] = 0u;
    CUTLASS_PRAGMA_UNROLL
    for (int chunk = 0; chunk < 32; ++chunk) {
      CUTLASS_PRAGMA_UNROLL
      for (int b = 0; b < 2; ++b)
        if (8 * chunk + 2 * q + b < limit) valid[chunk / 16] |= 1u << ((2 * chunk + b) % 32);
    }
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

}  // namespace jax_twell
