// twell_backup_gemm: the warp path's dense backup on Hopper's tensor cores (wgmma), with its
// row count on the device.
//
// The warp kernel (twell_ffn_warp.cu) leaves zeros on the rows whose entries do not fit (a
// tile past capacity, or more than max_entries entries). This handler computes those rows
// densely with no host round trip: how many there are is known only on the device, and
// every launch below reads it there.
//
//   1. ListGatherKernel: one warp a row applies the warp kernel's rule to the TwELL counts,
//      appends the backed-up rows to a list (an atomic counter) and copies each listed
//      row's x (or, non-gated with g given, its g) to the list position in a compact
//      scratch. The last CTA to finish (a counter of finished CTAs) reads the row count and
//      writes the products' problem sizes, pointers and strides to device memory.
//   2. The first product, a CUTLASS grouped GEMM (TMA, wgmma, persistent cooperative CTAs)
//      whose problem sizes are read on the device: [x_b @ w_gate,] x_b @ w_up (the gated
//      form recomputing its gate runs both as two groups of one launch).
//   3. MixKernel: h = bf16(g * u) with g the caller's g at the listed rows or the recomputed
//      bf16(relu(x_b @ w_gate)) (NaN kept as XLA's max keeps it); non-gated, recomputed:
//      h = relu(a). In place.
//   4. The down product, the same grouped GEMM with f32 results: h @ w_down, its K loop
//      split into up to kMaxSplit groups when the rows are few (each group a slice of f
//      writing its own f32 partial), so that a handful of rows still spreads over the SMs.
//   5. ScatterKernel: y[list[i]] = bf16(sum of the slices' partials, in slice order).
// The forms with g given take a device flag `dense` (the per-call choice, made on the device
// from a sample of g): where it is set every row is computed, straight from x and g, the
// down product writing y itself (no gather, no partials, no scatter), whatever the counts:
// the dense FFN at the GEMMs' rate, with no conditional and no host round trip.
// With no row listed every launch finds nothing to do: the GEMMs' CTAs see empty problems.
// The list's order varies from run to run; no result depends on it (a row's sums run over K
// in an order fixed by the shapes and the row count).
//
// Scratch: one byte buffer (`work`, laid out by WorkLayout below and by
// jax_twell.ops.ffn.warp.backup_work_bytes) holding the device parameters, the GEMMs'
// workspaces (their TMA descriptors), the compact rows and the f32 partials; its size grows
// with M as XLA's dense FFN's own intermediates do.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#pragma GCC diagnostic push
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#pragma GCC diagnostic pop

#include "common.h"
#include "cutlass_hardware.cuh"
#include "elements.cuh"

namespace jax_twell {
namespace {

constexpr int kListWarps = 8;
constexpr int kMaxSplit = 8;         // K slices of the down product at most
constexpr int kMinSliceK = 256;      // a slice keeps at least four of the GEMM's 64-wide K steps
constexpr int kSplitRowsCap = 1024;  // the partials hold max(M, this) rows: S x count within it
// 128 x 256 tiles: the grouped probe's fastest single-CTA shape (1.06-1.21x of cuBLAS's
// time, lab/results/grouped_gemm_probe_30e3002.json); 128 x 128 measured ~1.9x of cuBLAS's
// time on every row at M=16,384 (lab/results/backup_profile_da1f11f_h100.json).
constexpr int kTileM = 128, kTileN = 256;
constexpr int64_t kParamBytes = 4096;
constexpr int64_t kGemmWorkspaceBytes = 512 * 1024;  // each GEMM's TMA descriptors (~50 KB at 132 SMs)
constexpr int64_t kAlign = 256;

using ProblemShape = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
using Shape3 = ProblemShape::UnderlyingProblemShape;

template <class Element, class ElementOut>
struct BackupGemm {
  using TileShape = cute::Shape<cute::Int<kTileM>, cute::Int<kTileN>, cute::_64>;
  using ClusterShape = cute::Shape<cute::_1, cute::_1, cute::_1>;
  static constexpr int kAlignOut = 16 / sizeof(ElementOut);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void, cutlass::layout::RowMajor*, kAlignOut,
      ElementOut, cutlass::layout::RowMajor*, kAlignOut, cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<ElementOut, float, void, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Element, cutlass::layout::RowMajor*, 8, Element,
      cutlass::layout::RowMajor*, 8, float, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<ProblemShape, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using StrideA = typename Kernel::InternalStrideA;  // Stride<int64_t, _1, _0>: rows of A
  using StrideB = typename Kernel::InternalStrideB;  // Stride<_1, int64_t, _0>: rows of B [K, N]
  using StrideD = typename Kernel::InternalStrideD;  // Stride<int64_t, _1, _0>
};

// The device-side arguments of one grouped GEMM of at most kGroups groups, written by the
// list kernel's last CTA (the row count is known there) and read by the GEMM's CTAs.
template <class Element, class ElementOut, int kGroups>
struct GroupArgs {
  using G = BackupGemm<Element, ElementOut>;
  Shape3 shapes[kGroups];
  const Element* a[kGroups];
  const Element* b[kGroups];
  ElementOut* d[kGroups];
  typename G::StrideA stride_a[kGroups];
  typename G::StrideB stride_b[kGroups];
  typename G::StrideD stride_d[kGroups];
};

// The whole parameter block: the first product's groups, the down product's, and the
// down product's split (read by the scatter).
template <class Element>
struct DeviceParams {
  GroupArgs<Element, Element, 2> first;
  GroupArgs<Element, float, kMaxSplit> down;
  GroupArgs<Element, Element, 1> down_direct;  // the dense flag's form: h @ w_down straight into y
  int32_t split;
  int32_t scatter_rows;  // rows the scatter writes (0 in the dense flag's form)
  int32_t slice_rows;  // rows between two slices' partials (the row count)
};

// Where each scratch lies in `work` (byte offsets; 0 size: the form does not use it).
struct WorkLayout {
  int64_t params, ws_first, ws_down, ws_direct, xb, ab, ub, partials, total;
};

// The forms: gated (w_up given) or not; g given or recomputed from x.
struct Form {
  bool gated, recompute;
};

inline int64_t AlignUp(int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Mirrors jax_twell.ops.ffn.warp.backup_work_bytes.
WorkLayout LayoutOf(int64_t m, int64_t d, int64_t f, int64_t esize, Form form) {
  WorkLayout w{};
  int64_t off = 0;
  auto take = [&](int64_t bytes) {
    const int64_t at = off;
    off = AlignUp(off + bytes);
    return at;
  };
  w.params = take(kParamBytes);
  w.ws_first = take(kGemmWorkspaceBytes);
  w.ws_down = take(kGemmWorkspaceBytes);
  w.ws_direct = take(kGemmWorkspaceBytes);
  const bool has_x = form.gated || form.recompute;  // non-gated with g given reads no x
  w.xb = has_x ? take(m * d * esize) : -1;
  // ab: the recomputed activation, or (non-gated, g given) the listed rows of g.
  w.ab = (form.recompute || !form.gated) ? take(m * f * esize) : -1;
  w.ub = form.gated ? take(m * f * esize) : -1;
  w.partials = take(std::max<int64_t>(m, kSplitRowsCap) * d * 4);
  w.total = off + kAlign;  // slack: the kernel aligns the buffer's start to kAlign bytes
  return w;
}

// The operands of one call, as raw pointers (null where the form does not take them).
struct Operands {
  const uint16_t* x;      // [M, d]
  const uint16_t* g;      // [M, f] (null: recomputed)
  const uint16_t* w_act;  // [d, f] the activation's weight (recompute)
  const uint16_t* w_up;   // [d, f] (null: non-gated)
  const uint16_t* w_down; // [f, d]
  uint16_t* y;            // [M, d]
  int32_t* list;          // [M + 4]: rows, then count, finished CTAs
  const int32_t* dense;   // [] device flag (forms with g given; null elsewhere): every row, directly
  uint8_t* work;
  int64_t m, d, f;
  int sms;
};

template <class Element>
__device__ void WriteParams(const Operands& o, const WorkLayout& w, Form form, int count, bool all) {
  auto* p = reinterpret_cast<DeviceParams<Element>*>(o.work + w.params);
  const int d = static_cast<int>(o.d), f = static_cast<int>(o.f);
  // every row (the dense flag): A is x itself, the list the identity
  auto* xb = all ? reinterpret_cast<const Element*>(o.x) : reinterpret_cast<const Element*>(o.work + w.xb);
  auto* ab = reinterpret_cast<Element*>(o.work + w.ab);
  auto* ub = reinterpret_cast<Element*>(o.work + w.ub);
  // The first product: up (gated) and/or the activation (recomputed).
  int groups = 0;
  auto add_first = [&](const uint16_t* weight, Element* out) {
    p->first.shapes[groups] = Shape3{count, f, d};
    p->first.a[groups] = xb;
    p->first.b[groups] = reinterpret_cast<const Element*>(weight);
    p->first.d[groups] = out;
    cute::get<0>(p->first.stride_a[groups]) = d;
    cute::get<1>(p->first.stride_b[groups]) = f;
    cute::get<0>(p->first.stride_d[groups]) = f;
    ++groups;
  };
  if (form.recompute) add_first(o.w_act, ab);
  if (form.gated) add_first(o.w_up, ub);
  for (; groups < 2; ++groups) {  // unused: empty problems on valid pointers
    p->first.shapes[groups] = Shape3{0, f, d};
    p->first.a[groups] = p->first.a[0];
    p->first.b[groups] = p->first.b[0];
    p->first.d[groups] = p->first.d[0];
    p->first.stride_a[groups] = p->first.stride_a[0];
    p->first.stride_b[groups] = p->first.stride_b[0];
    p->first.stride_d[groups] = p->first.stride_d[0];
  }
  // The down product over h (gated: ub; else ab), split along f when its tiles are few.
  const Element* h = form.gated ? ub : ab;
  if (all && !form.gated && !form.recompute) h = reinterpret_cast<const Element*>(o.g);  // g's own rows
  const int tiles = ((count + kTileM - 1) / kTileM) * ((d + kTileN - 1) / kTileN);
  const int64_t cap_rows = o.m > kSplitRowsCap ? o.m : static_cast<int64_t>(kSplitRowsCap);
  int split = 1;
  if (!all && count > 0 && tiles * 2 <= o.sms) {
    split = min(kMaxSplit, max(1, o.sms / max(tiles, 1)));
    split = min(split, max(1, f / kMinSliceK));
    const int64_t fit = cap_rows / count;
    if (fit < split) split = static_cast<int>(fit < 1 ? 1 : fit);
  }
  int slice = (f + split - 1) / split;
  slice = (slice + 7) / 8 * 8;               // 16-byte aligned slice starts
  split = (f + slice - 1) / slice;           // every slice non-empty
  auto* partials = reinterpret_cast<float*>(o.work + w.partials);
  for (int s = 0; s < kMaxSplit; ++s) {
    const int k0 = min(s * slice, f - 1);
    const int k = s < split ? min(slice, f - s * slice) : slice;
    p->down.shapes[s] = Shape3{s < split && !all ? count : 0, d, k};
    p->down.a[s] = h + k0;
    p->down.b[s] = reinterpret_cast<const Element*>(o.w_down) + static_cast<int64_t>(k0) * d;
    p->down.d[s] = partials + (s < split ? static_cast<int64_t>(s) * count * d : 0);
    cute::get<0>(p->down.stride_a[s]) = f;
    cute::get<1>(p->down.stride_b[s]) = d;
    cute::get<0>(p->down.stride_d[s]) = d;
  }
  p->down_direct.shapes[0] = Shape3{all ? count : 0, d, f};
  p->down_direct.a[0] = h;
  p->down_direct.b[0] = reinterpret_cast<const Element*>(o.w_down);
  p->down_direct.d[0] = reinterpret_cast<Element*>(o.y);
  cute::get<0>(p->down_direct.stride_a[0]) = f;
  cute::get<1>(p->down_direct.stride_b[0]) = d;
  cute::get<0>(p->down_direct.stride_d[0]) = d;
  p->split = split;
  p->slice_rows = count;
  p->scatter_rows = all ? 0 : count;
}

// Step 1. One warp a row: the warp kernel's rule (a tile past capacity or more than
// max_entries entries), the listed row's x (or g) copied to its list position, and the
// last CTA's parameters.
template <class Element>
__global__ __launch_bounds__(kListWarps * 32) void ListGatherKernel(Operands o, WorkLayout w, Form form, int n_tiles,
                                                                    int capacity, int max_entries,
                                                                    const int32_t* __restrict__ counts) {
  const int lane = threadIdx.x % 32;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kListWarps + threadIdx.x / 32;
  int32_t* count = o.list + o.m;
  unsigned int* finished = reinterpret_cast<unsigned int*>(o.list + o.m + 1);
  const bool all = o.dense != nullptr && *o.dense != 0;
  if (all) {
    if (row < o.m && lane == 0) o.list[row] = static_cast<int32_t>(row);
  } else if (row < o.m) {
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
    if (over || total > max_entries) {
      int pos = 0;
      if (lane == 0) pos = atomicAdd(count, 1);
      pos = __shfl_sync(kFullMask, pos, 0);
      if (lane == 0) o.list[pos] = static_cast<int32_t>(row);
      // 16-byte pieces (d and f are multiples of 8).
      if (w.xb >= 0) {
        const uint4* src = reinterpret_cast<const uint4*>(o.x + row * o.d);
        uint4* dst = reinterpret_cast<uint4*>(o.work + w.xb) + pos * (o.d / 8);
        for (int64_t v = lane; v < o.d / 8; v += 32) dst[v] = src[v];
      }
      if (!form.gated && !form.recompute) {
        const uint4* src = reinterpret_cast<const uint4*>(o.g + row * o.f);
        uint4* dst = reinterpret_cast<uint4*>(o.work + w.ab) + pos * (o.f / 8);
        for (int64_t v = lane; v < o.f / 8; v += 32) dst[v] = src[v];
      }
    }
  }
  // The last CTA to finish writes the products' parameters (the count is final then).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned int done = atomicAdd(finished, 1u);
    if (done == gridDim.x - 1) {
      __threadfence();
      int n = atomicAdd(count, 0);
      if (all) {
        n = static_cast<int>(o.m);
        atomicExch(count, n);
      }
      WriteParams<Element>(o, w, form, n, all);
      __threadfence();
    }
  }
}

// Step 3: h = bf16(g * u) in place over u (gated), or a = relu(a) in place (non-gated,
// recomputed), over the listed rows, 16 bytes a thread and step.
template <class E, bool kGated, bool kRecompute>
__global__ __launch_bounds__(256) void MixKernel(Operands o, WorkLayout w) {
  const int count = o.list[o.m];
  const int64_t vecs_per_row = o.f / 8;
  const int64_t total = static_cast<int64_t>(count) * vecs_per_row;
  uint4* ub = reinterpret_cast<uint4*>(o.work + (kGated ? w.ub : w.ab));
  const uint4* ab = reinterpret_cast<const uint4*>(o.work + w.ab);
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = v / vecs_per_row, c = v % vecs_per_row;
    uint4 uv = ub[v];
    uint4 gv;
    if constexpr (kRecompute) {
      gv = kGated ? ab[v] : uv;
    } else {
      gv = reinterpret_cast<const uint4*>(o.g + static_cast<int64_t>(o.list[i]) * o.f)[c];
    }
    const uint32_t* gw = reinterpret_cast<const uint32_t*>(&gv);
    uint32_t* uw = reinterpret_cast<uint32_t*>(&uv);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t out = 0;
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float gval = E::ToFloat(gw[q] >> (16 * half));
        if constexpr (kRecompute) gval = isnan(gval) ? gval : fmaxf(gval, 0.f);  // NaN kept, as XLA's max
        const float r = kGated ? gval * E::ToFloat(uw[q] >> (16 * half)) : gval;
        out |= E::FromFloat(r) << (16 * half);
      }
      uw[q] = out;
    }
    ub[v] = uv;
  }
}

// Step 5: y[list[i]] = bf16(sum over the slices of the f32 partials, in slice order).
template <class E, class Element>
__global__ __launch_bounds__(256) void ScatterKernel(Operands o, WorkLayout w) {
  const auto* p = reinterpret_cast<const DeviceParams<Element>*>(o.work + w.params);
  const int count = p->scatter_rows;
  const int split = p->split;
  const int64_t vecs_per_row = o.d / 4;
  const int64_t total = static_cast<int64_t>(count) * vecs_per_row;
  const int64_t slice_elems = static_cast<int64_t>(count) * o.d;
  const float* partials = reinterpret_cast<const float*>(o.work + w.partials);
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < total;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = v / vecs_per_row, c = (v % vecs_per_row) * 4;
    float4 acc = reinterpret_cast<const float4*>(partials + i * o.d + c)[0];
    for (int s = 1; s < split; ++s) {
      const float4 q = reinterpret_cast<const float4*>(partials + s * slice_elems + i * o.d + c)[0];
      acc.x += q.x;
      acc.y += q.y;
      acc.z += q.z;
      acc.w += q.w;
    }
    uint2 out;
    out.x = E::FromFloat(acc.x) | (E::FromFloat(acc.y) << 16);
    out.y = E::FromFloat(acc.z) | (E::FromFloat(acc.w) << 16);
    *reinterpret_cast<uint2*>(o.y + static_cast<int64_t>(o.list[i]) * o.d + c) = out;
  }
}

// One grouped GEMM launch over the device-side arguments `args` (kGroups groups).
//
// Every argument of these GEMMs is a device pointer into `work` (shapes, pointer arrays,
// strides, the TMA descriptors' workspace), so their kernel parameters depend only on where
// `work` lies and on the device. They are built once per (device, `args`) and kept: CUTLASS's
// host-side set-up (TMA descriptor templates, the shared-memory attribute) cost ~100 us of
// host time a call, three GEMMs a call, which the GPU waited for at M=2,048
// (lab/results/backup_profile_da1f11f_h100.json). Its workspace set-up is a no-op for
// these kernels (the CTAs write their own descriptors).
template <class Element, class ElementOut, int kGroups>
ffi::Error RunGroups(cudaStream_t stream, GroupArgs<Element, ElementOut, kGroups>* args, void* workspace,
                     const char* what) {
  using G = BackupGemm<Element, ElementOut>;
  using Gemm = typename G::Gemm;
  using Params = typename Gemm::Params;
  static std::mutex mutex;
  static auto* cache = new std::map<std::pair<int, const void*>, Params>();  // never freed: outlives XLA's calls
  int device = 0;
  cudaGetDevice(&device);
  const auto key = std::make_pair(device, static_cast<const void*>(args));
  Params params;
  bool found = false;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = cache->find(key); it != cache->end()) {
      params = it->second;
      found = true;
    }
  }
  if (!found) {
    typename Gemm::Arguments a;
    a.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    a.problem_shape = {kGroups, args->shapes, nullptr};  // sizes on the device only
    a.mainloop = {const_cast<const Element**>(args->a), args->stride_a, const_cast<const Element**>(args->b),
                  args->stride_b};
    a.epilogue.thread.alpha = 1.f;
    a.epilogue.thread.beta = 0.f;
    a.epilogue.ptr_C = nullptr;
    a.epilogue.dC = nullptr;
    a.epilogue.ptr_D = args->d;
    a.epilogue.dD = args->stride_d;
    a.hw_info = CachedHardwareInfo<typename Gemm::GemmKernel>();
    if (Gemm::get_workspace_size(a) > static_cast<size_t>(kGemmWorkspaceBytes))
      return ffi::Error::Internal(std::string("jax-twell: ") + what + ": CUTLASS workspace larger than reserved");
    cutlass::Status status = Gemm::GemmKernel::initialize_workspace(a, workspace, stream);
    if (status != cutlass::Status::kSuccess)
      return ffi::Error::Internal(std::string("jax-twell: ") + what + ": CUTLASS initialize failed: " +
                                  cutlassGetStatusString(status));
    params = Gemm::GemmKernel::to_underlying_arguments(a, workspace);
    // The kernel's shared memory on this device: set with every new entry (the first call
    // on each device is one), not per call.
    constexpr int smem = Gemm::GemmKernel::SharedStorageSize;
    if (smem >= (48 << 10)) {
      if (cudaError_t err = cudaFuncSetAttribute(cutlass::device_kernel<typename Gemm::GemmKernel>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
          err != cudaSuccess) {
        cudaGetLastError();
        return ffi::Error::Internal(std::string("jax-twell: ") + what + ": shared memory attribute: " +
                                    cudaGetErrorString(err));
      }
    }
    std::lock_guard<std::mutex> lock(mutex);
    if (cache->size() >= 4096) cache->clear();  // XLA's buffers rarely move; bound the map if they do
    (*cache)[key] = params;
  }
  const cutlass::Status status = Gemm::run(params, stream);
  if (status != cutlass::Status::kSuccess)
    return ffi::Error::Internal(std::string("jax-twell: ") + what + ": CUTLASS run failed: " +
                                cutlassGetStatusString(status));
  return LaunchStatus(what);
}

template <class E, class Element>
ffi::Error LaunchAll(cudaStream_t stream, Operands o, Form form, int n_tiles, int capacity, int max_entries,
                     const int32_t* counts) {
  const WorkLayout w = LayoutOf(o.m, o.d, o.f, 2, form);
  if (cudaError_t earlier = cudaPeekAtLastError(); earlier != cudaSuccess) {
    cudaGetLastError();
    return ffi::Error::Internal(std::string("jax-twell: a launch before the backup failed: ") +
                                cudaGetErrorString(earlier));
  }
  if (cudaError_t err = cudaMemsetAsync(o.list + o.m, 0, 2 * sizeof(int32_t), stream); err != cudaSuccess) {
    cudaGetLastError();
    return ffi::Error::Internal(std::string("jax-twell: backup memset failed: ") + cudaGetErrorString(err));
  }
  const auto hw = CachedHardwareInfo<typename BackupGemm<Element, Element>::Kernel>();
  o.sms = hw.sm_count;
  ListGatherKernel<Element><<<static_cast<unsigned>(CeilDiv(o.m, kListWarps)), kListWarps * 32, 0, stream>>>(
      o, w, form, n_tiles, capacity, max_entries, counts);
  if (auto e = LaunchStatus("ListGatherKernel"); e.failure()) return e;
  auto* params = reinterpret_cast<DeviceParams<Element>*>(o.work + w.params);
  if (form.gated || form.recompute) {
    if (auto e = RunGroups<Element, Element, 2>(stream, &params->first, o.work + w.ws_first, "backup first product");
        e.failure())
      return e;
    const int blocks = std::max(1, o.sms * 4);
    if (form.gated && form.recompute) MixKernel<E, true, true><<<blocks, 256, 0, stream>>>(o, w);
    else if (form.gated) MixKernel<E, true, false><<<blocks, 256, 0, stream>>>(o, w);
    else MixKernel<E, false, true><<<blocks, 256, 0, stream>>>(o, w);
    if (auto e = LaunchStatus("MixKernel"); e.failure()) return e;
  }
  if (auto e = RunGroups<Element, float, kMaxSplit>(stream, &params->down, o.work + w.ws_down, "backup down product");
      e.failure())
    return e;
  if (o.dense != nullptr) {
    if (auto e = RunGroups<Element, Element, 1>(stream, &params->down_direct, o.work + w.ws_direct,
                                                "backup down product (every row)");
        e.failure())
      return e;
  }
  ScatterKernel<E, Element><<<std::max(1, o.sms * 4), 256, 0, stream>>>(o, w);
  return LaunchStatus("ScatterKernel");
}

// Dimension codes of Operand::dims: -1 = M, -2 = d, -3 = f.
constexpr int64_t kM = -1, kD = -2;
constexpr int64_t kF = -3;

struct Operand {
  const char* name;
  const ffi::AnyBuffer* buffer;
  int64_t dims[2];
};

ffi::Error BackupCall(const char* op, cudaStream_t stream, std::initializer_list<Operand> operands, Form form,
                      ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                      ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> list,
                      ffi::Result<ffi::Buffer<ffi::U8>> work, int32_t capacity, int32_t max_entries, Operands o) {
  auto c_dims = counts.dimensions();
  auto wd_dims = w_down.dimensions();
  if (c_dims.size() != 2 || wd_dims.size() != 2)
    return Invalid(std::string(op) + ": counts must have shape [M, n_tiles] and w_down [f, d]");
  const int64_t rows = c_dims[0], f = wd_dims[0], d = wd_dims[1];
  const auto dtype = w_down.element_type();
  for (const Operand& a : operands) {
    auto size = [&](int64_t code) { return code == kM ? rows : code == kD ? d : f; };
    auto got = a.buffer->dimensions();
    const bool same = got.size() == 2 && got[0] == size(a.dims[0]) && got[1] == size(a.dims[1]);
    if (!same) return Invalid(std::string(op) + ": " + a.name + " has the wrong shape (M, d, f from counts and w_down)");
    if (a.buffer->element_type() != dtype) return Invalid(std::string(op) + ": " + a.name + " must have w_down's dtype");
    if (reinterpret_cast<uintptr_t>(a.buffer->untyped_data()) % 16 != 0)
      return Invalid(std::string(op) + ": " + a.name + " must be 16-byte aligned");
  }
  if (!SameDims(y_in.dimensions(), {rows, d}) || !SameDims(y->dimensions(), {rows, d}) ||
      y->element_type() != dtype || y_in.element_type() != dtype)
    return Invalid(std::string(op) + ": y must have shape [M, d] and w_down's dtype");
  if (!SameDims(list->dimensions(), {rows + 4})) return Invalid(std::string(op) + ": list must have shape [M + 4]");
  if (d % 8 != 0 || f % 8 != 0 || d == 0 || f == 0)
    return Invalid(std::string(op) + ": d and f must be positive multiples of 8");
  if (rows >= (int64_t{1} << 30) || f >= (int64_t{1} << 30) || d >= (int64_t{1} << 30))
    return Invalid(std::string(op) + ": M, d and f must be below 2^30");
  if (capacity < 0 || max_entries < 0) return Invalid(std::string(op) + ": capacity and max_entries must be >= 0");
  if (y->untyped_data() != y_in.untyped_data())
    return Invalid(std::string(op) + ": y must alias y_in (input_output_aliases)");
  if (reinterpret_cast<uintptr_t>(w_down.untyped_data()) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(y->untyped_data()) % 16 != 0)
    return Invalid(std::string(op) + ": w_down and y must be 16-byte aligned");
  const WorkLayout w = LayoutOf(rows, d, f, 2, form);
  if (!SameDims(work->dimensions(), {w.total}))
    return Invalid(std::string(op) + ": work must have shape [" + std::to_string(w.total) + "] (backup_work_bytes)");
  if (rows == 0) return ffi::Error::Success();
  o.w_down = static_cast<const uint16_t*>(w_down.untyped_data());
  o.y = static_cast<uint16_t*>(y->untyped_data());
  o.list = list->typed_data();
  // The regions' offsets are multiples of kAlign from a kAlign-aligned start (TMA
  // descriptors in the workspaces need 64 bytes, TMA operands 16).
  const uintptr_t base = reinterpret_cast<uintptr_t>(work->typed_data());
  o.work = reinterpret_cast<uint8_t*>((base + kAlign - 1) / kAlign * kAlign);
  o.m = rows;
  o.d = d;
  o.f = f;
  const int n_tiles = static_cast<int>(c_dims[1]);
  switch (dtype) {
    case ffi::DataType::BF16:
      return LaunchAll<Bf16, cutlass::bfloat16_t>(stream, o, form, n_tiles, capacity, max_entries,
                                                  counts.typed_data());
    case ffi::DataType::F16:
      return LaunchAll<F16, cutlass::half_t>(stream, o, form, n_tiles, capacity, max_entries, counts.typed_data());
    default:
      return Invalid(std::string(op) + ": the operands must be bf16 or f16");
  }
}

const uint16_t* Bits(const ffi::AnyBuffer& b) { return static_cast<const uint16_t*>(b.untyped_data()); }

// Results, every form: y [M, d] (y_in, aliased, with the backed-up rows written), list
// [M + 4] s32 (the backed-up rows, then their count and the finished CTAs), work u8
// (scratch, backup_work_bytes). Attributes: capacity (TwELL slots a tile) and max_entries
// (the warp kernel's row budget): the warp kernel's rule, applied to the counts [M, n_tiles].

// Gated, g given: x [M, d], g [M, f], counts, w_up [d, f], w_down [f, d], y_in [M, d].
ffi::Error GemmGated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> counts,
                     ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in, ffi::Buffer<ffi::S32> dense,
                     ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> list,
                     ffi::Result<ffi::Buffer<ffi::U8>> work, int32_t capacity, int32_t max_entries) {
  if (dense.element_count() != 1) return Invalid("ffn_backup_gemm (gated): dense must be one s32 flag");
  Operands o{Bits(x), Bits(g), nullptr, Bits(w_up)};
  o.dense = dense.typed_data();
  return BackupCall("ffn_backup_gemm (gated)", stream,
                    {{"x", &x, {kM, kD}}, {"g", &g, {kM, kF}}, {"w_up", &w_up, {kD, kF}}}, Form{true, false}, counts,
                    w_down, y_in, y, list, work, capacity, max_entries, o);
}

// Non-gated, g given (the activation): g [M, f], counts, w_down [f, d], y_in [M, d].
ffi::Error GemmUngated(cudaStream_t stream, ffi::AnyBuffer g, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_down,
                       ffi::AnyBuffer y_in, ffi::Buffer<ffi::S32> dense, ffi::Result<ffi::AnyBuffer> y,
                       ffi::Result<ffi::Buffer<ffi::S32>> list, ffi::Result<ffi::Buffer<ffi::U8>> work,
                       int32_t capacity, int32_t max_entries) {
  if (dense.element_count() != 1) return Invalid("ffn_backup_gemm: dense must be one s32 flag");
  Operands o{nullptr, Bits(g)};
  o.dense = dense.typed_data();
  return BackupCall("ffn_backup_gemm", stream, {{"g", &g, {kM, kF}}}, Form{false, false}, counts, w_down, y_in, y,
                    list, work, capacity, max_entries, o);
}

// Gated, the gate recomputed for the listed rows: x [M, d], counts, w_gate [d, f],
// w_up [d, f], w_down [f, d], y_in [M, d].
ffi::Error GemmGatedFromX(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> counts, ffi::AnyBuffer w_gate,
                          ffi::AnyBuffer w_up, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                          ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> list,
                          ffi::Result<ffi::Buffer<ffi::U8>> work, int32_t capacity, int32_t max_entries) {
  Operands o{Bits(x), nullptr, Bits(w_gate), Bits(w_up)};
  return BackupCall("ffn_backup_gemm (gated, from x)", stream,
                    {{"x", &x, {kM, kD}}, {"w_gate", &w_gate, {kD, kF}}, {"w_up", &w_up, {kD, kF}}},
                    Form{true, true}, counts, w_down, y_in, y, list, work, capacity, max_entries, o);
}

// Non-gated, the activation recomputed for the listed rows: x [M, d], counts,
// w_act [d, f], w_down [f, d], y_in [M, d].
ffi::Error GemmUngatedFromX(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::S32> counts,
                            ffi::AnyBuffer w_act, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                            ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::S32>> list,
                            ffi::Result<ffi::Buffer<ffi::U8>> work, int32_t capacity, int32_t max_entries) {
  Operands o{Bits(x), nullptr, Bits(w_act)};
  return BackupCall("ffn_backup_gemm (from x)", stream, {{"x", &x, {kM, kD}}, {"w_act", &w_act, {kD, kF}}},
                    Form{false, true}, counts, w_down, y_in, y, list, work, capacity, max_entries, o);
}

}  // namespace
}  // namespace jax_twell

// The handlers only launch work on the stream (no host synchronisation): XLA may capture
// them into its CUDA graphs.
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackupGemmGated, jax_twell::GemmGated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // g [M, f]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dense [] (flag: every row)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 4]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // work (scratch)
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackupGemm, jax_twell::GemmUngated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // g [M, f] (the activation)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // dense [] (flag: every row)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 4]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // work (scratch)
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackupGemmGatedFromX, jax_twell::GemmGatedFromX,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_gate [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 4]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // work (scratch)
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellFfnBackupGemmFromX, jax_twell::GemmUngatedFromX,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // counts [M, n_tiles]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_act [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::S32>>()  // list [M + 4]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>()   // work (scratch)
                                  .Attr<int32_t>("capacity")
                                  .Attr<int32_t>("max_entries"),
                              {xla::ffi::Traits::kCmdBufferCompatible});
