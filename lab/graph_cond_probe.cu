// graph_cond_probe: can one call choose between the dense and the sparse FFN on the device,
// inside a CUDA graph, with no host round trip? (standalone probe)
//
// The inference FFN chooses, per call, between the sparse path (our kernels) and the dense
// path (cuBLAS GEMMs) from counts that exist only in device memory. XLA's `lax.cond` reads
// the predicate on the host: a device-to-host copy and a stall, 45-100 us a call. The idea
// tested here: one FFI call launches a CUDA graph holding (1) a small kernel that reads a
// device-side flag and calls cudaGraphSetConditional, and (2) a conditional IF/ELSE node
// (CUDA 12.8+) whose IF body holds the dense path's cuBLASLt GEMMs and whose ELSE body holds
// other kernels (the sparse path; one marker kernel stands in for it). The questions: can
// cuBLASLt GEMMs be captured into a conditional node's body, do they run there at cuBLAS's
// plain speed, what does the side not taken cost, and what does it cost per call to rebuild
// and update the graph when the operands' device pointers change between calls (in XLA
// they can)?
//
// The dense path, bf16 in and out, f32 accumulation, row-major arrays as JAX stores them:
//   U = X [M, d] @ Wu [d, f];  H = G * U (elementwise, G a given [M, f]);  Y = H [M, f] @ Wd [f, d]
// Variants (CUDA-event time of one call: the mean of 50 back-to-back calls after warm-up,
// the median of 5 such rounds, the variants interleaved round by round):
//   (a) plain: the three kernels launched on a stream;
//   (b) the graph with the conditional, flag = 1 (dense side) and flag = 0 (ELSE side only);
//       Y must be bitwise (a)'s with flag = 1, untouched with flag = 0 (the marker written);
//   (c) two sets of X/G/U/H/Y (weights shared) alternating call by call: each call builds a
//       new graph with its pointers, applies it to one exec with cudaGraphExecUpdate
//       (re-instantiating instead if the update is refused) and launches it: host microseconds
//       of the build and of the update, and GPU ms per call over 50 calls (events around the
//       loop: whether the host work hides behind the GPU's);
//   (d) two execs cached, one per set, launched alternately;
//   (e) the exec launched inside another stream capture (what XLA's own command buffers
//       would do with our call): does each step work, and is Y right;
//   (f) the decide kernel with an empty IF body against a graph of one trivial kernel and a
//       bare launch: the fixed cost of the conditional machinery.
// One JSON object a line: the versions and device, the GEMMs' algorithms, one per variant,
// then a summary.
//
// Prediction (written before any run): (b) dense side within ~2% of (a); the not-taken side
// ~3-6 us (two launches inside the graph); (c) cudaGraphExecUpdate works on the conditional
// node's topology, ~30-100 us of host time a call, hidden behind the GPU at M=16,384 (1.5 ms
// of GEMMs) but not fully at M=2,048 (~0.16 ms); (d) within ~1-2% of (b); (e) works (the exec
// becomes a child graph node).
//
// Build (one command): nvcc -O3 -std=c++17 -DNDEBUG -gencode=arch=compute_90a,code=sm_90a -I$CUBLAS/include
//          -L$CUBLAS/lib -Xlinker -rpath=$CUBLAS/lib lab/graph_cond_probe.cu -lcublasLt -o graph_cond_probe
//        ($CUBLAS: a CUDA toolkit, or the nvidia cuBLAS wheel's folder that jax's CUDA plugin
//        installs; where the wheel has only libcublasLt.so.13, -l:libcublasLt.so.13 for -lcublasLt)
// Run:   ./graph_cond_probe [M [d f]]   (default d=2048, f=5632, M = 2048 and 16384;
//        lab/run_graph_cond_probe.sh builds it and runs both M)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "probe_fill.cuh"  // FillKernel

using BF16 = __nv_bfloat16;

namespace {

constexpr size_t kWorkspaceBytes = size_t(32) << 20;  // set in the preference: nothing allocates in a capture
constexpr int kReps = 50;                             // calls per timed round
constexpr int kRounds = 5;
constexpr int kMarker = 0x5eed;                       // what the ELSE body writes
constexpr unsigned char kSentinel = 0xa5;             // Y's bytes before a check

std::string JsonEscape(const char* s) {
  std::string out;
  for (; *s; ++s) {
    if (*s == '"' || *s == '\\') out += '\\';
    out += (*s == '\n') ? ' ' : *s;
  }
  return out;
}

[[noreturn]] void Fail(const char* call, const char* error, const char* file, int line) {
  std::printf("{\"error\": \"%s\", \"call\": \"%s\", \"at\": \"%s:%d\"}\n", JsonEscape(error).c_str(),
              JsonEscape(call).c_str(), file, line);
  std::fflush(stdout);
  std::exit(1);
}

void CheckCuda(cudaError_t e, const char* call, const char* file, int line) {
  if (e != cudaSuccess) Fail(call, cudaGetErrorString(e), file, line);
}

void CheckLt(cublasStatus_t s, const char* call, const char* file, int line) {
  if (s != CUBLAS_STATUS_SUCCESS) Fail(call, cublasLtGetStatusString(s), file, line);
}

#define CK(call) CheckCuda((call), #call, __FILE__, __LINE__)
#define CKL(call) CheckLt((call), #call, __FILE__, __LINE__)
#define CK_LAUNCH(what) CheckCuda(cudaGetLastError(), what, __FILE__, __LINE__)

// ---- kernels ---------------------------------------------------------------------------


// h = bf16(float(g) * float(u)), eight elements (16 bytes) per step.
__global__ void MulKernel(const uint4* g, const uint4* u, uint4* h, size_t vectors) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < vectors; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 a = g[i], b = u[i];
    uint4 c;
    const BF16* pa = reinterpret_cast<const BF16*>(&a);
    const BF16* pb = reinterpret_cast<const BF16*>(&b);
    BF16* pc = reinterpret_cast<BF16*>(&c);
#pragma unroll
    for (int k = 0; k < 8; ++k) pc[k] = __float2bfloat16(__bfloat162float(pa[k]) * __bfloat162float(pb[k]));
    h[i] = c;
  }
}

// The device-side choice: the IF body runs when *flag != 0, the ELSE body otherwise.
__global__ void DecideKernel(const int* flag, cudaGraphConditionalHandle handle) {
  cudaGraphSetConditional(handle, *flag != 0 ? 1u : 0u);
}

// The sparse side's stand-in (and the trivial kernel of (f)).
__global__ void MarkerKernel(int* marker, int value) { *marker = value; }

// ---- operands and the dense path -------------------------------------------------------

struct Shape {
  int m, d, f;
};

// One call's operands: in XLA each of these may move between calls.
struct Set {
  BF16 *x, *g, *u, *h, *y;
  int *flag, *marker;
};

// One cuBLASLt GEMM, column-major D [rows, cols] = A [rows, k] @ B [k, cols], no transposes.
struct Gemm {
  cublasLtMatmulDesc_t op;
  cublasLtMatrixLayout_t a, b, d;
  cublasLtMatmulHeuristicResult_t pick;
};

struct Dense {
  Shape s;
  cublasLtHandle_t lt;
  Gemm up, down;
  void* workspace;
  const BF16 *wu, *wd;
  int mul_blocks;
};

// Row-major data read as column-major is its transpose, so the row-major product
// C [m, n] = A [m, k] @ B [k, n] is the column-major C^T [n, m] = B^T [n, k] @ A^T [k, m]:
// cuBLASLt gets B as its first operand (n x k, ld n) and A as its second (k x m, ld k), both
// untransposed, and writes C^T (n x m, ld n), which is C in row-major order.
Gemm MakeGemm(cublasLtHandle_t lt, int rows, int cols, int k, cublasLtMatmulPreference_t pref) {
  Gemm g{};
  CKL(cublasLtMatmulDescCreate(&g.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t no = CUBLAS_OP_N;
  CKL(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSA, &no, sizeof(no)));
  CKL(cublasLtMatmulDescSetAttribute(g.op, CUBLASLT_MATMUL_DESC_TRANSB, &no, sizeof(no)));
  CKL(cublasLtMatrixLayoutCreate(&g.a, CUDA_R_16BF, rows, k, rows));
  CKL(cublasLtMatrixLayoutCreate(&g.b, CUDA_R_16BF, k, cols, k));
  CKL(cublasLtMatrixLayoutCreate(&g.d, CUDA_R_16BF, rows, cols, rows));
  int found = 0;
  CKL(cublasLtMatmulAlgoGetHeuristic(lt, g.op, g.a, g.b, g.d, g.d, pref, 1, &g.pick, &found));
  if (found < 1 || g.pick.state != CUBLAS_STATUS_SUCCESS) Fail("cublasLtMatmulAlgoGetHeuristic", "no algorithm", __FILE__, __LINE__);
  return g;
}

int AlgoConfig(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attr) {
  int value = -1;
  size_t written = 0;
  CKL(cublasLtMatmulAlgoConfigGetAttribute(&algo, attr, &value, sizeof(value), &written));
  return value;
}

void RunGemm(const Dense& dn, const Gemm& g, const BF16* a, const BF16* b, BF16* d, cudaStream_t stream) {
  const float one = 1.f, zero = 0.f;  // host scalars: read at the call, captured by value
  CKL(cublasLtMatmul(dn.lt, g.op, &one, a, g.a, b, g.b, &zero, d, g.d, d, g.d, &g.pick.algo, dn.workspace,
                     kWorkspaceBytes, stream));
}

// (a): U = X @ Wu, H = G * U, Y = H @ Wd (see MakeGemm for the operand order).
void DensePath(const Dense& dn, const Set& set, cudaStream_t stream) {
  RunGemm(dn, dn.up, dn.wu, set.x, set.u, stream);  // U^T [f, M] = Wu^T [f, d] @ X^T [d, M]
  const size_t vectors = size_t(dn.s.m) * dn.s.f / 8;
  MulKernel<<<dn.mul_blocks, 256, 0, stream>>>(reinterpret_cast<const uint4*>(set.g), reinterpret_cast<const uint4*>(set.u),
                                               reinterpret_cast<uint4*>(set.h), vectors);
  CK_LAUNCH("MulKernel");
  RunGemm(dn, dn.down, dn.wd, set.h, set.y, stream);  // Y^T [d, M] = Wd^T [d, f] @ H^T [f, M]
}

// ---- graphs ------------------------------------------------------------------------------

cudaGraphNode_t AddKernelNode(cudaGraph_t graph, const cudaGraphNode_t* deps, size_t n_deps, void* func, void** args) {
  cudaGraphNodeParams p = {};
  p.type = cudaGraphNodeTypeKernel;
  p.kernel.func = func;
  p.kernel.gridDim = dim3(1);
  p.kernel.blockDim = dim3(1);
  p.kernel.kernelParams = args;
  cudaGraphNode_t node;
  CK(cudaGraphAddNode(&node, graph, deps, nullptr, n_deps, &p));
  return node;
}

enum class Body { kDense, kEmpty };

struct Built {
  cudaGraph_t graph;
  cudaGraphConditionalHandle handle;
};

// decide -> IF (flag != 0): the dense path, captured into the body on `capture`;
//           ELSE: the marker kernel.
// Body::kEmpty: decide -> IF with one empty node and no ELSE (the machinery alone).
// The handle belongs to this graph and is created before the node that uses it; its
// default value is not applied at launch (flags 0): the decide kernel sets it every launch.
Built BuildGraph(const Dense& dn, const Set& set, Body body, cudaStream_t capture) {
  Built b{};
  CK(cudaGraphCreate(&b.graph, 0));
  CK(cudaGraphConditionalHandleCreate(&b.handle, b.graph, 0, 0));
  int* flag = set.flag;
  void* decide_args[] = {&flag, &b.handle};
  const cudaGraphNode_t decide = AddKernelNode(b.graph, nullptr, 0, reinterpret_cast<void*>(DecideKernel), decide_args);

  cudaGraphNodeParams cp = {};
  cp.type = cudaGraphNodeTypeConditional;
  cp.conditional.handle = b.handle;
  cp.conditional.type = cudaGraphCondTypeIf;
  cp.conditional.size = body == Body::kDense ? 2 : 1;  // 2: body [0] is IF, body [1] is ELSE
  cudaGraphNode_t cond;
  CK(cudaGraphAddNode(&cond, b.graph, &decide, nullptr, 1, &cp));
  cudaGraph_t if_body = cp.conditional.phGraph_out[0];  // owned by the node

  if (body == Body::kEmpty) {
    cudaGraphNode_t empty;
    CK(cudaGraphAddEmptyNode(&empty, if_body, nullptr, 0));
    return b;
  }
  CK(cudaStreamBeginCaptureToGraph(capture, if_body, nullptr, nullptr, 0, cudaStreamCaptureModeThreadLocal));
  DensePath(dn, set, capture);
  cudaGraph_t captured = nullptr;
  CK(cudaStreamEndCapture(capture, &captured));
  if (captured != if_body) Fail("cudaStreamEndCapture", "returned a graph other than the IF body", __FILE__, __LINE__);

  int* marker = set.marker;
  int value = kMarker;
  void* marker_args[] = {&marker, &value};
  AddKernelNode(cp.conditional.phGraph_out[1], nullptr, 0, reinterpret_cast<void*>(MarkerKernel), marker_args);
  return b;
}

cudaGraphExec_t Instantiate(cudaGraph_t graph) {
  cudaGraphExec_t exec;
  CK(cudaGraphInstantiate(&exec, graph, 0));
  return exec;
}

// ---- timing and checks -------------------------------------------------------------------

cudaEvent_t g_t0, g_t1;

struct Timed {
  float ms;        // GPU time of one call
  double host_us;  // host time of one call's launch work
};

// Mean over kReps back-to-back calls (events on `stream` around them).
template <class Call>
Timed TimeCalls(cudaStream_t stream, Call call) {
  CK(cudaStreamSynchronize(stream));
  const auto h0 = std::chrono::steady_clock::now();
  CK(cudaEventRecord(g_t0, stream));
  for (int i = 0; i < kReps; ++i) call();
  const auto h1 = std::chrono::steady_clock::now();
  CK(cudaEventRecord(g_t1, stream));
  CK(cudaEventSynchronize(g_t1));
  float ms = 0.f;
  CK(cudaEventElapsedTime(&ms, g_t0, g_t1));
  return {ms / kReps, std::chrono::duration<double, std::micro>(h1 - h0).count() / kReps};
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

std::string JsonList(const std::vector<double>& v, const char* fmt) {
  std::string out = "[";
  char buf[64];
  for (size_t i = 0; i < v.size(); ++i) {
    std::snprintf(buf, sizeof(buf), fmt, v[i]);
    out += (i ? ", " : "") + std::string(buf);
  }
  return out + "]";
}

void SetInt(int* p, int value, cudaStream_t stream) {
  CK(cudaStreamSynchronize(stream));  // nothing in flight reads it
  CK(cudaMemcpyAsync(p, &value, sizeof(int), cudaMemcpyHostToDevice, stream));
  CK(cudaStreamSynchronize(stream));
}

int GetInt(const int* p, cudaStream_t stream) {
  int value = 0;
  CK(cudaMemcpyAsync(&value, p, sizeof(int), cudaMemcpyDeviceToHost, stream));
  CK(cudaStreamSynchronize(stream));
  return value;
}

std::vector<uint16_t> Download(const BF16* p, size_t count, cudaStream_t stream) {
  std::vector<uint16_t> v(count);
  CK(cudaMemcpyAsync(v.data(), p, count * sizeof(BF16), cudaMemcpyDeviceToHost, stream));
  CK(cudaStreamSynchronize(stream));
  return v;
}

void Poison(BF16* p, size_t count, cudaStream_t stream) {
  CK(cudaMemsetAsync(p, kSentinel, count * sizeof(BF16), stream));
  CK(cudaStreamSynchronize(stream));
}

bool Untouched(const std::vector<uint16_t>& v) {
  const uint16_t want = uint16_t(kSentinel) << 8 | kSentinel;
  return std::all_of(v.begin(), v.end(), [want](uint16_t x) { return x == want; });
}

const char* Bool(bool b) { return b ? "true" : "false"; }

const char* UpdateResultName(cudaGraphExecUpdateResult r) {
  switch (r) {
    case cudaGraphExecUpdateSuccess: return "Success";
    case cudaGraphExecUpdateError: return "Error";
    case cudaGraphExecUpdateErrorTopologyChanged: return "ErrorTopologyChanged";
    case cudaGraphExecUpdateErrorNodeTypeChanged: return "ErrorNodeTypeChanged";
    case cudaGraphExecUpdateErrorFunctionChanged: return "ErrorFunctionChanged";
    case cudaGraphExecUpdateErrorParametersChanged: return "ErrorParametersChanged";
    case cudaGraphExecUpdateErrorNotSupported: return "ErrorNotSupported";
    case cudaGraphExecUpdateErrorUnsupportedFunctionChange: return "ErrorUnsupportedFunctionChange";
    case cudaGraphExecUpdateErrorAttributesChanged: return "ErrorAttributesChanged";
  }
  return "unknown";
}

const char* NodeTypeName(cudaGraphNodeType t) {
  switch (t) {
    case cudaGraphNodeTypeKernel: return "kernel";
    case cudaGraphNodeTypeMemcpy: return "memcpy";
    case cudaGraphNodeTypeMemset: return "memset";
    case cudaGraphNodeTypeHost: return "host";
    case cudaGraphNodeTypeGraph: return "child graph";
    case cudaGraphNodeTypeEmpty: return "empty";
    case cudaGraphNodeTypeWaitEvent: return "event wait";
    case cudaGraphNodeTypeEventRecord: return "event record";
    case cudaGraphNodeTypeConditional: return "conditional";
    default: return "other";
  }
}

// A step of (e): "ok" or the error, which (e) reports rather than exits on.
const char* Step(cudaError_t e) {
  if (e == cudaSuccess) return "ok";
  (void)cudaGetLastError();  // not sticky: clear it for the next step
  return cudaGetErrorString(e);
}

// ---- one shape ---------------------------------------------------------------------------

std::string RunShape(const Shape& s, cublasLtHandle_t lt, int sms) {
  const int m = s.m, d = s.d, f = s.f;
  const size_t n_x = size_t(m) * d, n_h = size_t(m) * f, n_w = size_t(d) * f;
  char shape_json[96];
  std::snprintf(shape_json, sizeof(shape_json), "\"m\": %d, \"d\": %d, \"f\": %d", m, d, f);

  cudaStream_t stream, capture, outer;
  CK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  CK(cudaStreamCreateWithFlags(&capture, cudaStreamNonBlocking));  // captures only, never runs work
  CK(cudaStreamCreateWithFlags(&outer, cudaStreamNonBlocking));    // (e)'s capture

  BF16 *wu, *wd;
  CK(cudaMalloc(&wu, n_w * sizeof(BF16)));
  CK(cudaMalloc(&wd, n_w * sizeof(BF16)));
  FillKernel<<<sms * 8, 256, 0, stream>>>(wu, n_w, 3u);
  CK_LAUNCH("FillKernel");
  FillKernel<<<sms * 8, 256, 0, stream>>>(wd, n_w, 4u);
  CK_LAUNCH("FillKernel");
  Set sets[2];
  for (Set& set : sets) {  // same contents in both sets: one reference Y checks either
    CK(cudaMalloc(&set.x, n_x * sizeof(BF16)));
    CK(cudaMalloc(&set.g, n_h * sizeof(BF16)));
    CK(cudaMalloc(&set.u, n_h * sizeof(BF16)));
    CK(cudaMalloc(&set.h, n_h * sizeof(BF16)));
    CK(cudaMalloc(&set.y, n_x * sizeof(BF16)));
    CK(cudaMalloc(&set.flag, sizeof(int)));
    CK(cudaMalloc(&set.marker, sizeof(int)));
    FillKernel<<<sms * 8, 256, 0, stream>>>(set.x, n_x, 1u);
    CK_LAUNCH("FillKernel");
    FillKernel<<<sms * 8, 256, 0, stream>>>(set.g, n_h, 2u);
    CK_LAUNCH("FillKernel");
    SetInt(set.flag, 1, stream);
    SetInt(set.marker, 0, stream);
  }
  void* workspace;
  CK(cudaMalloc(&workspace, kWorkspaceBytes));

  cublasLtMatmulPreference_t pref;
  CKL(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws_bytes = kWorkspaceBytes;
  CKL(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes, sizeof(ws_bytes)));
  Dense dn{};
  dn.s = s;
  dn.lt = lt;
  dn.up = MakeGemm(lt, f, m, d, pref);    // U^T [f, M] = Wu^T [f, d] @ X^T [d, M]
  dn.down = MakeGemm(lt, d, m, f, pref);  // Y^T [d, M] = Wd^T [d, f] @ H^T [f, M]
  dn.workspace = workspace;
  dn.wu = wu;
  dn.wd = wd;
  dn.mul_blocks = sms * 8;
  CKL(cublasLtMatmulPreferenceDestroy(pref));
  for (const auto& [name, g] : {std::pair<const char*, const Gemm*>{"up", &dn.up}, {"down", &dn.down}})
    std::printf("{\"gemm\": \"%s\", %s, \"algo_id\": %d, \"tile_id\": %d, \"splitk\": %d, \"workspace_bytes\": %zu, "
                "\"waves\": %.3f}\n",
                name, shape_json, AlgoConfig(g->pick.algo, CUBLASLT_ALGO_CONFIG_ID),
                AlgoConfig(g->pick.algo, CUBLASLT_ALGO_CONFIG_TILE_ID),
                AlgoConfig(g->pick.algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM), g->pick.workspaceSize, g->pick.wavesCount);
  std::fflush(stdout);

  // (a) once: the reference Y.
  DensePath(dn, sets[0], stream);
  CK(cudaStreamSynchronize(stream));
  const std::vector<uint16_t> ref = Download(sets[0].y, n_x, stream);

  // (b): build, instantiate, check both sides.
  const Built gb = BuildGraph(dn, sets[0], Body::kDense, capture);
  const cudaGraphExec_t exec_b = Instantiate(gb.graph);
  Poison(sets[0].y, n_x, stream);
  SetInt(sets[0].marker, 0, stream);
  CK(cudaGraphLaunch(exec_b, stream));
  CK(cudaStreamSynchronize(stream));
  const bool b_dense_equal = Download(sets[0].y, n_x, stream) == ref;
  const bool b_dense_marker_clear = GetInt(sets[0].marker, stream) == 0;
  Poison(sets[0].y, n_x, stream);
  SetInt(sets[0].flag, 0, stream);
  CK(cudaGraphLaunch(exec_b, stream));
  CK(cudaStreamSynchronize(stream));
  const bool b_skip_untouched = Untouched(Download(sets[0].y, n_x, stream));
  const bool b_skip_marker = GetInt(sets[0].marker, stream) == kMarker;
  SetInt(sets[0].flag, 1, stream);

  // (d): one exec per set; check set 1's Y.
  const Built gd[2] = {BuildGraph(dn, sets[0], Body::kDense, capture), BuildGraph(dn, sets[1], Body::kDense, capture)};
  const cudaGraphExec_t exec_d[2] = {Instantiate(gd[0].graph), Instantiate(gd[1].graph)};
  Poison(sets[1].y, n_x, stream);
  CK(cudaGraphLaunch(exec_d[1], stream));
  CK(cudaStreamSynchronize(stream));
  const bool d_equal = Download(sets[1].y, n_x, stream) == ref;

  // (f): the machinery alone, a graph of one trivial kernel, a bare trivial launch.
  const Built gf = BuildGraph(dn, sets[0], Body::kEmpty, capture);
  const cudaGraphExec_t exec_f = Instantiate(gf.graph);
  cudaGraph_t g_one;
  CK(cudaGraphCreate(&g_one, 0));
  {
    int* marker = sets[0].marker;
    int value = 1;
    void* args[] = {&marker, &value};
    AddKernelNode(g_one, nullptr, 0, reinterpret_cast<void*>(MarkerKernel), args);
  }
  const cudaGraphExec_t exec_one = Instantiate(g_one);

  // Interleaved rounds of (a), (b) both sides, (d), (f).
  struct Variant {
    const char* name;
    int flag;  // sets[0].flag for this variant (-1: not read)
    std::vector<double> ms, host_us;
  };
  enum { kA, kB1, kB0, kD, kF1, kF0, kOne, kBare, kCount };
  Variant v[kCount] = {{"a", -1, {}, {}},  {"b1", 1, {}, {}}, {"b0", 0, {}, {}},  {"d", 1, {}, {}},
                       {"f1", 1, {}, {}}, {"f0", 0, {}, {}}, {"one", -1, {}, {}}, {"bare", -1, {}, {}}};
  int d_next = 0;
  auto call = [&](int k) {
    switch (k) {
      case kA: DensePath(dn, sets[0], stream); break;
      case kB1:
      case kB0: CK(cudaGraphLaunch(exec_b, stream)); break;
      case kD:
        CK(cudaGraphLaunch(exec_d[d_next], stream));
        d_next ^= 1;
        break;
      case kF1:
      case kF0: CK(cudaGraphLaunch(exec_f, stream)); break;
      case kOne: CK(cudaGraphLaunch(exec_one, stream)); break;
      case kBare:
        MarkerKernel<<<1, 1, 0, stream>>>(sets[0].marker, 1);
        CK_LAUNCH("MarkerKernel");
        break;
    }
  };
  for (int round = -1; round < kRounds; ++round) {  // round -1: warm-up, not kept
    for (int k = 0; k < kCount; ++k) {
      if (v[k].flag >= 0) SetInt(sets[0].flag, v[k].flag, stream);
      for (int i = 0; i < 3; ++i) call(k);
      const Timed t = TimeCalls(stream, [&] { call(k); });
      if (round >= 0) {
        v[k].ms.push_back(t.ms);
        v[k].host_us.push_back(t.host_us);
      }
    }
  }
  SetInt(sets[0].flag, 1, stream);
  double ms[kCount], host[kCount];
  for (int k = 0; k < kCount; ++k) {
    ms[k] = Median(v[k].ms);
    host[k] = Median(v[k].host_us);
  }
  const double flops = 2.0 * 2.0 * m * double(d) * f;
  std::printf("{\"variant\": \"a_plain\", %s, \"ms\": %.5f, \"ms_rounds\": %s, \"tflops\": %.1f, \"host_us_per_call\": %.2f}\n",
              shape_json, ms[kA], JsonList(v[kA].ms, "%.5f").c_str(), flops / (ms[kA] * 1e-3) / 1e12, host[kA]);
  std::printf("{\"variant\": \"b_cond_dense\", %s, \"ms\": %.5f, \"ms_rounds\": %s, \"vs_plain\": %.4f, "
              "\"host_us_per_call\": %.2f, \"y_bitwise_equal_to_a\": %s, \"marker_not_written\": %s}\n",
              shape_json, ms[kB1], JsonList(v[kB1].ms, "%.5f").c_str(), ms[kB1] / ms[kA], host[kB1], Bool(b_dense_equal),
              Bool(b_dense_marker_clear));
  std::printf("{\"variant\": \"b_cond_not_taken\", %s, \"ms\": %.5f, \"us\": %.2f, \"ms_rounds\": %s, "
              "\"host_us_per_call\": %.2f, \"y_untouched\": %s, \"marker_written\": %s}\n",
              shape_json, ms[kB0], ms[kB0] * 1e3, JsonList(v[kB0].ms, "%.5f").c_str(), host[kB0], Bool(b_skip_untouched),
              Bool(b_skip_marker));
  std::fflush(stdout);

  // (c): a new graph per call, alternating sets, applied to one exec.
  Built cur = BuildGraph(dn, sets[0], Body::kDense, capture);
  cudaGraphExec_t exec_c = Instantiate(cur.graph);
  bool fallback = false, update_tried = false;
  cudaGraphExecUpdateResultInfo first_info{};
  cudaError_t first_error = cudaSuccess;
  const char* error_node_type = "none";
  unsigned long long handles[2] = {static_cast<unsigned long long>(cur.handle), 0ull};
  // Replaced graphs (and, re-instantiating, replaced execs) retire through a ring of three
  // slots: an exec is destroyed only once its last launch has finished.
  struct Pending {
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaEvent_t done = nullptr;
  } ring[3];
  for (Pending& p : ring) CK(cudaEventCreateWithFlags(&p.done, cudaEventDisableTiming));
  int ring_next = 0;
  std::vector<double> build_us, apply_us, launch_us, host_us;
  int call_index = 0;
  auto call_c = [&](bool record) {
    const Set& set = sets[(call_index + 1) % 2];  // the first call changes the pointers
    const auto h0 = std::chrono::steady_clock::now();
    const Built next = BuildGraph(dn, set, Body::kDense, capture);
    const auto h1 = std::chrono::steady_clock::now();
    if (call_index == 0) handles[1] = static_cast<unsigned long long>(next.handle);
    cudaGraphExec_t retired = nullptr;
    if (!fallback) {
      cudaGraphExecUpdateResultInfo info{};
      const cudaError_t e = cudaGraphExecUpdate(exec_c, next.graph, &info);
      if (!update_tried) {
        update_tried = true;
        first_info = info;
        first_error = e;
        if (info.errorNode) {
          cudaGraphNodeType t;
          CK(cudaGraphNodeGetType(info.errorNode, &t));
          error_node_type = NodeTypeName(t);
        }
      }
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        fallback = true;  // from here on, every call re-instantiates
      }
    }
    if (fallback) {
      retired = exec_c;
      CK(cudaGraphInstantiate(&exec_c, next.graph, 0));
    }
    const auto h2 = std::chrono::steady_clock::now();
    CK(cudaGraphLaunch(exec_c, stream));
    const auto h3 = std::chrono::steady_clock::now();
    // The previous graph (and, re-instantiating, the previous exec) retire through the ring.
    Pending& slot = ring[ring_next];
    ring_next = (ring_next + 1) % 3;
    if (slot.exec) {  // an exec is destroyed only once its launch has finished
      CK(cudaEventSynchronize(slot.done));
      CK(cudaGraphExecDestroy(slot.exec));
    }
    if (slot.graph) CK(cudaGraphDestroy(slot.graph));  // an update copied what it needed
    slot.graph = cur.graph;
    slot.exec = retired;
    CK(cudaEventRecord(slot.done, stream));
    cur = next;
    ++call_index;
    if (record) {
      build_us.push_back(std::chrono::duration<double, std::micro>(h1 - h0).count());
      apply_us.push_back(std::chrono::duration<double, std::micro>(h2 - h1).count());
      launch_us.push_back(std::chrono::duration<double, std::micro>(h3 - h2).count());
      host_us.push_back(std::chrono::duration<double, std::micro>(h3 - h0).count());
    }
  };
  for (int i = 0; i < 6; ++i) call_c(false);
  CK(cudaStreamSynchronize(stream));
  Poison(sets[0].y, n_x, stream);
  Poison(sets[1].y, n_x, stream);
  CK(cudaEventRecord(g_t0, stream));
  for (int i = 0; i < kReps; ++i) call_c(true);
  CK(cudaEventRecord(g_t1, stream));
  CK(cudaEventSynchronize(g_t1));
  float c_total = 0.f;
  CK(cudaEventElapsedTime(&c_total, g_t0, g_t1));
  const double c_ms = c_total / kReps;
  const bool c_equal = Download(sets[0].y, n_x, stream) == ref && Download(sets[1].y, n_x, stream) == ref;
  for (Pending& p : ring) {
    if (p.exec) CK(cudaGraphExecDestroy(p.exec));
    if (p.graph) CK(cudaGraphDestroy(p.graph));
    CK(cudaEventDestroy(p.done));
  }
  std::printf("{\"variant\": \"c_rebuild_update\", %s, \"ms\": %.5f, \"vs_b_dense\": %.4f, \"update_ok\": %s, "
              "\"update_error\": \"%s\", \"update_result\": \"%s\", \"error_node_type\": \"%s\", \"apply\": \"%s\", "
              "\"build_us_median\": %.2f, \"apply_us_median\": %.2f, \"launch_us_median\": %.2f, "
              "\"host_us_median\": %.2f, \"host_us_max\": %.2f, \"y_bitwise_equal_both_sets\": %s, "
              "\"handles\": [\"0x%llx\", \"0x%llx\"]}\n",
              shape_json, c_ms, c_ms / ms[kB1], Bool(first_error == cudaSuccess), JsonEscape(cudaGetErrorString(first_error)).c_str(),
              UpdateResultName(first_info.result), error_node_type, fallback ? "reinstantiate" : "update",
              Median(build_us), Median(apply_us), Median(launch_us), Median(host_us),
              *std::max_element(host_us.begin(), host_us.end()), Bool(c_equal), handles[0], handles[1]);
  std::printf("{\"variant\": \"d_exec_cache\", %s, \"ms\": %.5f, \"ms_rounds\": %s, \"vs_b_dense\": %.4f, "
              "\"host_us_per_call\": %.2f, \"y_bitwise_equal_set1\": %s}\n",
              shape_json, ms[kD], JsonList(v[kD].ms, "%.5f").c_str(), ms[kD] / ms[kB1], host[kD], Bool(d_equal));
  std::fflush(stdout);

  // (e): exec_b launched inside another stream capture.
  bool e_all_ok = true;
  for (const auto& [mode_name, mode] : {std::pair<const char*, cudaStreamCaptureMode>{"global", cudaStreamCaptureModeGlobal},
                                        {"relaxed", cudaStreamCaptureModeRelaxed}}) {
    std::string begin = "skipped", launch = "skipped", end = "skipped", inst = "skipped", run = "skipped";
    bool y_ok = false;
    double e_ms = 0.0;
    cudaGraph_t og = nullptr;
    cudaGraphExec_t oexec = nullptr;
    CK(cudaStreamSynchronize(stream));
    const cudaError_t eb = cudaStreamBeginCapture(outer, mode);
    begin = Step(eb);
    if (eb == cudaSuccess) {
      launch = Step(cudaGraphLaunch(exec_b, outer));
      end = Step(cudaStreamEndCapture(outer, &og));  // always ends the capture, even if the launch failed
    }
    if (og) {
      const cudaError_t ei = cudaGraphInstantiate(&oexec, og, 0);
      inst = Step(ei);
      if (ei != cudaSuccess) oexec = nullptr;
    }
    if (oexec) {
      Poison(sets[0].y, n_x, stream);
      const cudaError_t el = cudaGraphLaunch(oexec, stream);
      const cudaError_t es = el == cudaSuccess ? cudaStreamSynchronize(stream) : el;
      run = Step(es);
      if (es == cudaSuccess) {
        y_ok = Download(sets[0].y, n_x, stream) == ref;
        for (int i = 0; i < 3; ++i) CK(cudaGraphLaunch(oexec, stream));
        e_ms = TimeCalls(stream, [&] { CK(cudaGraphLaunch(oexec, stream)); }).ms;
      }
      CK(cudaGraphExecDestroy(oexec));
    }
    if (og) CK(cudaGraphDestroy(og));
    e_all_ok = e_all_ok && y_ok;
    std::printf("{\"variant\": \"e_outer_capture\", %s, \"mode\": \"%s\", \"ms\": %.5f, \"begin_capture\": \"%s\", "
                "\"graph_launch_in_capture\": \"%s\", \"end_capture\": \"%s\", \"instantiate\": \"%s\", "
                "\"outer_launch\": \"%s\", \"y_bitwise_equal_to_a\": %s}\n",
                shape_json, mode_name, e_ms, JsonEscape(begin.c_str()).c_str(), JsonEscape(launch.c_str()).c_str(),
                JsonEscape(end.c_str()).c_str(), JsonEscape(inst.c_str()).c_str(), JsonEscape(run.c_str()).c_str(), Bool(y_ok));
  }
  std::printf("{\"variant\": \"f_cond_fixed\", %s, \"ms\": %.5f, \"ms_rounds\": %s, \"ms_flag0\": %.5f, "
              "\"ms_one_kernel_graph\": %.5f, \"ms_bare_kernel\": %.5f, \"host_us_per_call\": %.2f, "
              "\"host_us_one_kernel_graph\": %.2f, \"host_us_bare_kernel\": %.2f}\n",
              shape_json, ms[kF1], JsonList(v[kF1].ms, "%.5f").c_str(), ms[kF0], ms[kOne], ms[kBare], host[kF1], host[kOne],
              host[kBare]);
  std::fflush(stdout);

  char summary[640];
  std::snprintf(summary, sizeof(summary),
                "{%s, \"plain_ms\": %.4f, \"dense_vs_plain\": %.4f, \"not_taken_us\": %.2f, \"checks_b\": %s, "
                "\"update\": \"%s\", \"c_host_us\": %.1f, \"c_ms\": %.4f, \"c_vs_b\": %.4f, \"d_vs_b\": %.4f, "
                "\"e_works\": %s, \"cond_fixed_us\": %.2f, \"one_kernel_graph_us\": %.2f}",
                shape_json, ms[kA], ms[kB1] / ms[kA], ms[kB0] * 1e3,
                Bool(b_dense_equal && b_dense_marker_clear && b_skip_untouched && b_skip_marker),
                fallback ? "refused" : (c_equal ? "works" : "wrong result"), Median(host_us), c_ms, c_ms / ms[kB1],
                ms[kD] / ms[kB1], Bool(e_all_ok), ms[kF1] * 1e3, ms[kOne] * 1e3);

  CK(cudaStreamSynchronize(stream));
  CK(cudaGraphExecDestroy(exec_c));
  CK(cudaGraphDestroy(cur.graph));
  for (cudaGraphExec_t e : {exec_b, exec_d[0], exec_d[1], exec_f, exec_one}) CK(cudaGraphExecDestroy(e));
  for (cudaGraph_t g : {gb.graph, gd[0].graph, gd[1].graph, gf.graph, g_one}) CK(cudaGraphDestroy(g));
  for (const Gemm* g : {&dn.up, &dn.down}) {
    CKL(cublasLtMatrixLayoutDestroy(g->a));
    CKL(cublasLtMatrixLayoutDestroy(g->b));
    CKL(cublasLtMatrixLayoutDestroy(g->d));
    CKL(cublasLtMatmulDescDestroy(g->op));
  }
  for (Set& set : sets)
    for (void* p : {(void*)set.x, (void*)set.g, (void*)set.u, (void*)set.h, (void*)set.y, (void*)set.flag, (void*)set.marker})
      CK(cudaFree(p));
  for (void* p : {(void*)wu, (void*)wd, workspace}) CK(cudaFree(p));
  for (cudaStream_t st : {stream, capture, outer}) CK(cudaStreamDestroy(st));
  return summary;
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> ms = {2048, 16384};
  int d = 2048, f = 5632;
  if (argc > 1) ms = {std::atoi(argv[1])};
  if (argc > 3) {
    d = std::atoi(argv[2]);
    f = std::atoi(argv[3]);
  }
  for (int m : ms)
    if (m <= 0 || d <= 0 || f <= 0 || d % 8 || f % 8) {
      std::printf("{\"error\": \"need M > 0 and d, f positive multiples of 8\"}\n");
      return 2;
    }

  int runtime = 0, driver = 0, device = 0;
  CK(cudaRuntimeGetVersion(&runtime));
  CK(cudaDriverGetVersion(&driver));
  CK(cudaGetDevice(&device));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, device));
  std::printf("{\"runtime\": %d, \"driver\": %d, \"device\": \"%s\", \"sms\": %d, \"cublaslt\": %zu}\n", runtime, driver,
              JsonEscape(prop.name).c_str(), prop.multiProcessorCount, cublasLtGetVersion());
  std::fflush(stdout);

  CK(cudaEventCreate(&g_t0));
  CK(cudaEventCreate(&g_t1));
  cublasLtHandle_t lt;
  CKL(cublasLtCreate(&lt));
  std::string summary = "{\"summary\": [";
  for (size_t i = 0; i < ms.size(); ++i) summary += (i ? ", " : "") + RunShape({ms[i], d, f}, lt, prop.multiProcessorCount);
  std::printf("%s]}\n", summary.c_str());
  CKL(cublasLtDestroy(lt));
  CK(cudaEventDestroy(g_t0));
  CK(cudaEventDestroy(g_t1));
  return 0;
}
