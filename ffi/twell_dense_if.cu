// twell_dense_if: the per-call form's dense side on cuBLAS's GEMMs, chosen on the device.
//
// The per-call form (jax_twell.ops.ffn.warp.sparse_ffn) chooses between its sparse side
// (our pack, warp kernel and backup) and the dense formula from a sample of g, on the
// device. A lax.cond over that choice costs a host round trip (45-100 us a call, measured
// in ffi/notes/limits.md); our grouped GEMMs as the dense side cost 1.7x cuBLAS's time
// (twell_backup.md). This handler runs the dense side where the flag is set, at cuBLAS's
// rate, with no host round trip:
//
//   y = (g * (x @ w_up)) @ w_down   (gated; non-gated: y = g @ w_down)
//
// as a CUDA graph: a one-thread kernel reads the flag and sets a conditional handle, and
// an IF node whose body holds cuBLASLt's products (and the elementwise h between them).
// Where the flag is clear the body does not run and y keeps y_in (aliased): the sparse
// side's result. The pack, the warp kernel and the backup read the same flag and return
// at once on the dense side (the pack writing empty tiles, so the backup lists no row).
//
// The graph is built once per set of operand addresses and shapes and its executable kept
// (lab/graph_cond_probe.cu measured: the dense side within 0.8-4% of plain launches, the
// side not taken ~10 us, a rebuild 26 us of host time). A graph with a conditional node
// cannot be launched from a stream being captured, so this handler is not declared
// compatible with XLA's command buffers: XLA runs it as its own step.
//
// cuBLASLt is the library XLA itself loaded for its GEMMs; it is found at run time
// (dlopen by its soname), so the library links against nothing new. Built without
// cuBLASLt's header, the handler reports that it is unavailable
// (jax_twell_dense_if_available() = 0) and Python keeps the lax.cond.
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <tuple>
#include <type_traits>

#include "common.h"
#include "elements.cuh"

#if __has_include(<cublasLt.h>)
#include <cublasLt.h>
#define JAX_TWELL_HAVE_CUBLASLT 1
#else
#define JAX_TWELL_HAVE_CUBLASLT 0
#endif

extern "C" __attribute__((visibility("default"))) int jax_twell_dense_if_available() { return JAX_TWELL_HAVE_CUBLASLT; }

namespace jax_twell {
namespace {

// cuBLASLt's scratch inside `work` (after u): 32 MiB, what XLA gives its own GEMMs.
constexpr int64_t kLtWorkspaceBytes = 32 << 20;
constexpr int64_t kAlign = 256;

inline int64_t AlignUp(int64_t v) { return (v + kAlign - 1) / kAlign * kAlign; }

// Mirrors jax_twell.ops.ffn.warp.dense_if_work_bytes: u [M, f] (gated), then cuBLASLt's
// workspace, then slack for aligning the base.
int64_t WorkBytes(int64_t m, int64_t f, int64_t esize, bool gated) {
  return (gated ? AlignUp(m * f * esize) : 0) + kLtWorkspaceBytes + kAlign;
}

// Sets the IF node's handle from the device flag (non-zero: the dense side runs).
__global__ void SetDenseKernel(const int32_t* flag, cudaGraphConditionalHandle handle) {
  cudaGraphSetConditional(handle, *flag != 0 ? 1u : 0u);
}

// h = round(g * u) in place over u, 8 elements (16 bytes) a thread and step, as XLA's
// dense formula rounds it (u rounded to the dtype by the GEMM first).
template <class E>
__global__ __launch_bounds__(256) void MulKernel(const uint4* __restrict__ g, uint4* __restrict__ u, int64_t vectors) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vectors;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 a = g[i];
    uint4 b = u[i];
    const uint32_t* aw = reinterpret_cast<const uint32_t*>(&a);
    uint32_t* bw = reinterpret_cast<uint32_t*>(&b);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      uint32_t out = 0;
#pragma unroll
      for (int half = 0; half < 2; ++half)
        out |= E::FromFloat(E::ToFloat(aw[q] >> (16 * half)) * E::ToFloat(bw[q] >> (16 * half))) << (16 * half);
      bw[q] = out;
    }
    u[i] = b;
  }
}

#if JAX_TWELL_HAVE_CUBLASLT

// The cuBLASLt entry points this file uses, resolved once from the loaded library.
struct LtApi {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtMatmulDescCreate) desc_create = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) desc_set = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) layout_create = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) pref_create = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) pref_set = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) heuristic = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  std::string error;  // empty: every entry point found
};

LtApi LoadLt() {
  LtApi api;
  void* lib = nullptr;
  // XLA loaded it for its own GEMMs: found by its soname first, without loading anything.
  for (const char* name : {"libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"}) {
    lib = dlopen(name, RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
  }
  if (lib == nullptr) {
    api.error = "cuBLASLt (libcublasLt.so.13 or .12) could not be loaded";
    return api;
  }
  auto find = [&](auto& fn, const char* symbol) {
    fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(dlsym(lib, symbol));
    if (fn == nullptr && api.error.empty()) api.error = std::string("cuBLASLt has no ") + symbol;
  };
  find(api.create, "cublasLtCreate");
  find(api.desc_create, "cublasLtMatmulDescCreate");
  find(api.desc_set, "cublasLtMatmulDescSetAttribute");
  find(api.layout_create, "cublasLtMatrixLayoutCreate");
  find(api.pref_create, "cublasLtMatmulPreferenceCreate");
  find(api.pref_set, "cublasLtMatmulPreferenceSetAttribute");
  find(api.heuristic, "cublasLtMatmulAlgoGetHeuristic");
  find(api.matmul, "cublasLtMatmul");
  return api;
}

const LtApi& Lt() {
  static const LtApi api = LoadLt();
  return api;
}

// One product of row-major arrays, C [m, n] = A [m, k] @ B [k, n], as cuBLASLt's
// column-major C^T [n, m] = B^T [n, k] @ A^T [k, m]: B is its first operand (n x k, ld n),
// A its second (k x m, ld k), neither transposed.
struct LtGemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
};

struct LtState {
  cublasLtHandle_t handle = nullptr;
  // (m, n, k, dtype, alignments of cuBLASLt's A, B, C)
  std::map<std::tuple<int64_t, int64_t, int64_t, int, std::tuple<uint32_t, uint32_t, uint32_t>>, LtGemm> gemms;
  cudaStream_t capture = nullptr;  // the stream the IF body is captured on
};

#define LT_CHECK(call)                                                                               \
  do {                                                                                               \
    cublasStatus_t s_ = (call);                                                                      \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                                 \
      return Internal(std::string(#call) + " failed (cuBLAS status " + std::to_string(int(s_)) + ")"); \
  } while (0)

#define CUDA_CHECK(call)                                                        \
  do {                                                                          \
    cudaError_t e_ = (call);                                                    \
    if (e_ != cudaSuccess) {                                                    \
      cudaGetLastError();                                                       \
      return Internal(std::string(#call) + " failed: " + cudaGetErrorString(e_)); \
    }                                                                           \
  } while (0)

ffi::Error Internal(const std::string& what) { return ffi::Error::Internal("jax-twell: dense_ffn_if: " + what); }

// The largest power of two up to 256 that divides an address: the alignment cuBLASLt's
// algorithm may assume of that operand (it assumes 256 bytes unless told).
uint32_t Alignment(const void* ptr) {
  const uintptr_t v = reinterpret_cast<uintptr_t>(ptr) | 256;
  return static_cast<uint32_t>(v & (~v + 1));
}

// The operands' alignments (cuBLASLt's A, B and C/D: see LtGemm) are part of the choice.
using Aligns = std::tuple<uint32_t, uint32_t, uint32_t>;

ffi::Error MakeGemm(LtState& st, int64_t m, int64_t n, int64_t k, cudaDataType_t type, Aligns al, LtGemm* g) {
  const LtApi& lt = Lt();
  LT_CHECK(lt.desc_create(&g->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t no = CUBLAS_OP_N;
  LT_CHECK(lt.desc_set(g->op, CUBLASLT_MATMUL_DESC_TRANSA, &no, sizeof(no)));
  LT_CHECK(lt.desc_set(g->op, CUBLASLT_MATMUL_DESC_TRANSB, &no, sizeof(no)));
  LT_CHECK(lt.layout_create(&g->first, type, n, k, n));
  LT_CHECK(lt.layout_create(&g->second, type, k, m, k));
  LT_CHECK(lt.layout_create(&g->out, type, n, m, n));
  cublasLtMatmulPreference_t pref;
  LT_CHECK(lt.pref_create(&pref));
  const size_t ws = kLtWorkspaceBytes;
  LT_CHECK(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws)));
  const uint32_t a_align = std::get<0>(al), b_align = std::get<1>(al), c_align = std::get<2>(al);
  LT_CHECK(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &a_align, sizeof(a_align)));
  LT_CHECK(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &b_align, sizeof(b_align)));
  LT_CHECK(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &c_align, sizeof(c_align)));
  LT_CHECK(lt.pref_set(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &c_align, sizeof(c_align)));
  cublasLtMatmulHeuristicResult_t pick{};
  int found = 0;
  LT_CHECK(lt.heuristic(st.handle, g->op, g->first, g->second, g->out, g->out, pref, 1, &pick, &found));
  if (found < 1 || pick.state != CUBLAS_STATUS_SUCCESS)
    return Internal("cuBLASLt found no algorithm for [" + std::to_string(m) + ", " + std::to_string(k) + "] @ [" +
                    std::to_string(k) + ", " + std::to_string(n) + "]");
  g->algo = pick.algo;
  return ffi::Error::Success();
}

// C [m, n] = A [m, k] @ B [k, n] for these operands' alignments (cuBLASLt's A is B here).
ffi::Error GetGemm(LtState& st, int64_t m, int64_t n, int64_t k, cudaDataType_t type, const void* a, const void* b,
                   const void* c, const LtGemm** out) {
  const Aligns al{Alignment(b), Alignment(a), Alignment(c)};
  const auto key = std::make_tuple(m, n, k, static_cast<int>(type), al);
  auto it = st.gemms.find(key);
  if (it == st.gemms.end()) {
    LtGemm g;
    if (auto e = MakeGemm(st, m, n, k, type, al, &g); e.failure()) return e;
    it = st.gemms.emplace(key, g).first;
  }
  *out = &it->second;
  return ffi::Error::Success();
}

// C [m, n] = A [m, k] @ B [k, n] (row-major), on `stream` (captured into the IF body).
ffi::Error RunGemm(LtState& st, const LtGemm& g, const void* a, const void* b, void* c, void* workspace,
                   cudaStream_t stream) {
  const float one = 1.f, zero = 0.f;  // host scalars: read when the call is captured
  LT_CHECK(Lt().matmul(st.handle, g.op, &one, b, g.first, a, g.second, &zero, c, g.out, c, g.out, &g.algo, workspace,
                       kLtWorkspaceBytes, stream));
  return ffi::Error::Success();
}

// What one graph's topology depends on (device, shapes, dtype, form), and what else it
// holds (the operands' addresses).
using ShapeKey = std::tuple<int, int64_t, int64_t, int64_t, int, bool>;
using Pointers = std::tuple<const void*, const void*, const void*, const void*, void*, const void*, void*>;

// Executables of one shape, each for one set of addresses. XLA usually hands a call the
// same buffers every time; where it does not, the least recently used one is updated in
// place (cudaGraphExecUpdate: ~26 us of host time in the probe, against a new
// instantiation) once kMaxExecs are kept.
constexpr size_t kMaxExecs = 4;
struct Exec {
  Pointers pointers;
  cudaGraphExec_t exec;
  uint64_t used;
};

struct Process {
  std::mutex mutex;
  std::map<int, LtState> states;  // per device
  std::map<ShapeKey, std::vector<Exec>> execs;
  uint64_t clock = 0;
};

Process& TheProcess() {
  static auto* p = new Process();  // never freed: outlives XLA's calls
  return *p;
}

struct Call {
  const void *x, *g, *w_up, *w_down;
  void* y;
  const int32_t* flag;
  uint8_t* work;
  int64_t m, d, f;
  ffi::DataType dtype;
  bool gated;
};

// decide -> IF (flag != 0): [u = x @ w_up; h = g * u;] y = h @ w_down.
// `update`: an executable of the same shape to update in place (null: a new one in *exec).
ffi::Error Build(LtState& st, const Call& c, cudaGraphExec_t update, cudaGraphExec_t* exec) {
  const cudaDataType_t type = c.dtype == ffi::DataType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
  const int64_t esize = 2;  // bf16 or f16
  uint8_t* base = reinterpret_cast<uint8_t*>(AlignUp(reinterpret_cast<intptr_t>(c.work)));
  void* u = c.gated ? base : nullptr;
  void* workspace = base + (c.gated ? AlignUp(c.m * c.f * esize) : 0);
  const LtGemm *up = nullptr, *down = nullptr;
  if (c.gated) {
    if (auto e = GetGemm(st, c.m, c.f, c.d, type, c.x, c.w_up, u, &up); e.failure()) return e;
  }
  const void* h_in = c.gated ? u : c.g;
  if (auto e = GetGemm(st, c.m, c.d, c.f, type, h_in, c.w_down, c.y, &down); e.failure()) return e;

  cudaGraph_t graph;
  CUDA_CHECK(cudaGraphCreate(&graph, 0));
  struct Guard {
    cudaGraph_t g;
    ~Guard() { cudaGraphDestroy(g); }
  } guard{graph};
  cudaGraphConditionalHandle handle;
  CUDA_CHECK(cudaGraphConditionalHandleCreate(&handle, graph, 0, 0));
  const int32_t* flag = c.flag;
  void* set_args[] = {&flag, &handle};
  cudaGraphNodeParams kp = {};
  kp.type = cudaGraphNodeTypeKernel;
  kp.kernel.func = reinterpret_cast<void*>(SetDenseKernel);
  kp.kernel.gridDim = dim3(1);
  kp.kernel.blockDim = dim3(1);
  kp.kernel.kernelParams = set_args;
  cudaGraphNode_t set_node;
  CUDA_CHECK(cudaGraphAddNode(&set_node, graph, nullptr, nullptr, 0, &kp));
  cudaGraphNodeParams cp = {};
  cp.type = cudaGraphNodeTypeConditional;
  cp.conditional.handle = handle;
  cp.conditional.type = cudaGraphCondTypeIf;
  cp.conditional.size = 1;
  cudaGraphNode_t cond;
  CUDA_CHECK(cudaGraphAddNode(&cond, graph, &set_node, nullptr, 1, &cp));
  cudaGraph_t body = cp.conditional.phGraph_out[0];  // owned by the node

  if (st.capture == nullptr) CUDA_CHECK(cudaStreamCreateWithFlags(&st.capture, cudaStreamNonBlocking));
  CUDA_CHECK(cudaStreamBeginCaptureToGraph(st.capture, body, nullptr, nullptr, 0, cudaStreamCaptureModeThreadLocal));
  ffi::Error body_error = ffi::Error::Success();
  const void* h = c.g;
  if (c.gated) {
    body_error = RunGemm(st, *up, c.x, c.w_up, u, workspace, st.capture);
    if (!body_error.failure()) {
      const int64_t vectors = c.m * c.f / 8;
      const int blocks = static_cast<int>(std::min<int64_t>(CeilDiv(vectors, 256), 132 * 8));
      if (c.dtype == ffi::DataType::BF16)
        MulKernel<Bf16><<<std::max(blocks, 1), 256, 0, st.capture>>>(static_cast<const uint4*>(c.g),
                                                                      static_cast<uint4*>(u), vectors);
      else
        MulKernel<F16><<<std::max(blocks, 1), 256, 0, st.capture>>>(static_cast<const uint4*>(c.g),
                                                                     static_cast<uint4*>(u), vectors);
      if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
        body_error = Internal(std::string("launch of the product h = g * u failed: ") + cudaGetErrorString(e));
      h = u;
    }
  }
  if (!body_error.failure()) body_error = RunGemm(st, *down, h, c.w_down, c.y, workspace, st.capture);
  cudaGraph_t captured = nullptr;
  const cudaError_t end = cudaStreamEndCapture(st.capture, &captured);
  if (body_error.failure()) return body_error;
  if (end != cudaSuccess) {
    cudaGetLastError();
    return Internal(std::string("capturing the dense products failed: ") + cudaGetErrorString(end));
  }
  if (update != nullptr) {
    cudaGraphExecUpdateResultInfo info{};
    if (cudaGraphExecUpdate(update, graph, &info) == cudaSuccess) {
      *exec = update;
      return ffi::Error::Success();
    }
    cudaGetLastError();  // refused: a new executable instead (the old one freed once its launches end)
    cudaGraphExecDestroy(update);
  }
  CUDA_CHECK(cudaGraphInstantiate(exec, graph, 0));
  return ffi::Error::Success();
}

ffi::Error Run(cudaStream_t stream, const Call& c) {
  if (!Lt().error.empty()) return Internal(Lt().error);
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone)
    return Internal("cannot run inside a stream capture (its graph holds a conditional node)");
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  const ShapeKey shape{device, c.m, c.d, c.f, static_cast<int>(c.dtype), c.gated};
  const Pointers pointers{c.x, c.g, c.w_up, c.w_down, c.y, c.flag, c.work};
  Process& p = TheProcess();
  std::lock_guard<std::mutex> lock(p.mutex);
  std::vector<Exec>& kept = p.execs[shape];
  Exec* hit = nullptr;
  for (Exec& e : kept)
    if (e.pointers == pointers) hit = &e;
  if (hit == nullptr) {
    LtState& st = p.states[device];
    if (st.handle == nullptr) LT_CHECK(Lt().create(&st.handle));
    if (kept.size() < kMaxExecs) {
      cudaGraphExec_t exec;
      if (auto e = Build(st, c, nullptr, &exec); e.failure()) return e;
      kept.push_back(Exec{pointers, exec, 0});
      hit = &kept.back();
    } else {
      hit = &kept[0];
      for (Exec& e : kept)
        if (e.used < hit->used) hit = &e;
      cudaGraphExec_t exec = nullptr;
      const ffi::Error built = Build(st, c, hit->exec, &exec);
      if (built.failure()) {  // the old executable may be gone: drop its entry
        kept.erase(kept.begin() + (hit - kept.data()));
        return built;
      }
      hit->exec = exec;
      hit->pointers = pointers;
    }
  }
  hit->used = ++p.clock;
  CUDA_CHECK(cudaGraphLaunch(hit->exec, stream));
  return ffi::Error::Success();
}

#endif  // JAX_TWELL_HAVE_CUBLASLT

ffi::Error Check(const char* op, ffi::AnyBuffer g, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                 ffi::Buffer<ffi::S32> flag, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::U8>> work,
                 bool gated) {
  auto g_dims = g.dimensions();
  auto wd_dims = w_down.dimensions();
  if (g_dims.size() != 2 || wd_dims.size() != 2)
    return Invalid(std::string(op) + ": g must have shape [M, f] and w_down [f, d]");
  const int64_t m = g_dims[0], f = wd_dims[0], d = wd_dims[1];
  const auto dtype = g.element_type();
  if (dtype != ffi::DataType::BF16 && dtype != ffi::DataType::F16)
    return Invalid(std::string(op) + ": the operands must be bf16 or f16");
  if (g_dims[1] != f) return Invalid(std::string(op) + ": g must have shape [M, f] (f from w_down)");
  if (w_down.element_type() != dtype || y_in.element_type() != dtype || y->element_type() != dtype)
    return Invalid(std::string(op) + ": every operand must have g's dtype");
  if (!SameDims(y_in.dimensions(), {m, d}) || !SameDims(y->dimensions(), {m, d}))
    return Invalid(std::string(op) + ": y must have shape [M, d]");
  if (y->untyped_data() != y_in.untyped_data())
    return Invalid(std::string(op) + ": y must alias y_in (input_output_aliases)");
  if (flag.element_count() != 1) return Invalid(std::string(op) + ": the flag must be one s32");
  if (d % 8 != 0 || f % 8 != 0) return Invalid(std::string(op) + ": d and f must be multiples of 8");
  if (!SameDims(work->dimensions(), {WorkBytes(m, f, 2, gated)}))
    return Invalid(std::string(op) + ": work must have shape [" + std::to_string(WorkBytes(m, f, 2, gated)) +
                   "] (dense_if_work_bytes)");
  for (const void* ptr : {g.untyped_data(), w_down.untyped_data(), y->untyped_data()})
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return Invalid(std::string(op) + ": operands must be 16-byte aligned");
  return ffi::Error::Success();
}

ffi::Error Gated(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer g, ffi::AnyBuffer w_up, ffi::AnyBuffer w_down,
                 ffi::AnyBuffer y_in, ffi::Buffer<ffi::S32> flag, ffi::Result<ffi::AnyBuffer> y,
                 ffi::Result<ffi::Buffer<ffi::U8>> work) {
  const char* op = "dense_ffn_if (gated)";
  if (auto e = Check(op, g, w_down, y_in, flag, y, work, true); e.failure()) return e;
  const int64_t m = g.dimensions()[0], f = g.dimensions()[1], d = w_down.dimensions()[1];
  if (!SameDims(x.dimensions(), {m, d}) || !SameDims(w_up.dimensions(), {d, f}))
    return Invalid(std::string(op) + ": x must have shape [M, d] and w_up [d, f]");
  if (x.element_type() != g.element_type() || w_up.element_type() != g.element_type())
    return Invalid(std::string(op) + ": every operand must have g's dtype");
  if (m == 0) return ffi::Error::Success();
#if JAX_TWELL_HAVE_CUBLASLT
  return Run(stream, Call{x.untyped_data(), g.untyped_data(), w_up.untyped_data(), w_down.untyped_data(),
                          y->untyped_data(), flag.typed_data(), work->typed_data(), m, d, f, g.element_type(), true});
#else
  return ffi::Error::Internal("jax-twell: dense_ffn_if: this library was built without cuBLASLt's header");
#endif
}

ffi::Error Ungated(cudaStream_t stream, ffi::AnyBuffer g, ffi::AnyBuffer w_down, ffi::AnyBuffer y_in,
                   ffi::Buffer<ffi::S32> flag, ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::U8>> work) {
  if (auto e = Check("dense_ffn_if", g, w_down, y_in, flag, y, work, false); e.failure()) return e;
  const int64_t m = g.dimensions()[0], f = g.dimensions()[1], d = w_down.dimensions()[1];
  if (m == 0) return ffi::Error::Success();
#if JAX_TWELL_HAVE_CUBLASLT
  return Run(stream, Call{nullptr, g.untyped_data(), nullptr, w_down.untyped_data(), y->untyped_data(),
                          flag.typed_data(), work->typed_data(), m, d, f, g.element_type(), false});
#else
  return ffi::Error::Internal("jax-twell: dense_ffn_if: this library was built without cuBLASLt's header");
#endif
}

}  // namespace
}  // namespace jax_twell

// Not declared compatible with XLA's command buffers: the handler launches a graph of its
// own, which a stream being captured cannot (lab/graph_cond_probe.cu, variant e).
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellDenseFfnIfGated, jax_twell::Gated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // x [M, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // g [M, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_up [d, f]
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // flag []: the dense side
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>());  // work (scratch)

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxTwellDenseFfnIf, jax_twell::Ungated,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<xla::ffi::AnyBuffer>()  // g [M, f] (the activation)
                                  .Arg<xla::ffi::AnyBuffer>()  // w_down [f, d]
                                  .Arg<xla::ffi::AnyBuffer>()  // y_in [M, d] (aliased to y)
                                  .Arg<xla::ffi::Buffer<xla::ffi::S32>>()  // flag []: the dense side
                                  .Ret<xla::ffi::AnyBuffer>()  // y [M, d]
                                  .Ret<xla::ffi::Buffer<xla::ffi::U8>>());  // work (scratch)
