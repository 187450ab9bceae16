// union_layout_check: the union products' hand-written shared-memory offsets (SwizzleA,
// SwizzleB, SwizzleK128 in ffi/twell_union.cuh) against CuTe's GMMA layouts they stand for, on the host.
//
// Build: nvcc -std=c++17 --expt-relaxed-constexpr -Iffi -I$CUTLASS/include -I$CUTLASS/tools/util/include \
//          lab/union_layout_check.cu -o union_layout_check
// Run:   ./union_layout_check   (exit status 0 and "ok" when every offset matches)
#include <cstdio>

#include "twell_union.cuh"

using namespace cute;
namespace up = jax_twell::union_product;

template <typename Elem>
int Check(const char* name) {
  using Cfg = up::Config<Elem, 1>;
  alignas(1024) static Elem a[cosize_v<typename Cfg::LayoutA>];
  alignas(1024) static Elem b[cosize_v<typename Cfg::LayoutB>];
  Tensor sA = make_tensor(make_smem_ptr(a), typename Cfg::LayoutA{});
  Tensor sB = make_tensor(make_smem_ptr(b), typename Cfg::LayoutB{});
  int bad = 0;
  for (int st = 0; st < up::kRing; ++st) {
    for (int t = 0; t < up::kTok; ++t)
      for (int c = 0; c < up::kChunk; ++c) {
        const long got = reinterpret_cast<char*>(&sA(t, c, st)) - reinterpret_cast<char*>(a);
        const long want = st * up::kTok * up::kChunk * 2 + up::SwizzleA(static_cast<uint32_t>(c << 8 | t));
        if (got != want && bad++ < 5) std::printf("%s A token %d column %d stage %d: CuTe %ld, ours %ld\n", name, t, c, st, got, want);
      }
    for (int k = 0; k < up::kChunk; ++k)
      for (int n = 0; n < up::kCols; n += 8) {
        const long got = reinterpret_cast<char*>(&sB(n, k, st)) - reinterpret_cast<char*>(b);
        const long want = st * up::kCols * up::kChunk * 2 + up::SwizzleB(n, k);
        if (got != want && bad++ < 5) std::printf("%s B column %d row %d stage %d: CuTe %ld, ours %ld\n", name, n, k, st, got, want);
      }
  }
  using Up = up::UpConfig<Elem>;
  alignas(1024) static Elem ua[cosize_v<typename Up::LayoutA>];
  alignas(1024) static Elem ub[cosize_v<typename Up::LayoutB>];
  Tensor uA = make_tensor(make_smem_ptr(ua), typename Up::LayoutA{});
  Tensor uB = make_tensor(make_smem_ptr(ub), typename Up::LayoutB{});
  for (int st = 0; st < Up::kStages; ++st)
    for (int c = 0; c < up::kUpK; c += 8) {
      for (int r = 0; r < up::kTok; ++r) {
        const long got = reinterpret_cast<char*>(&uA(r, c, st)) - reinterpret_cast<char*>(ua);
        const long want = st * up::kTok * up::kUpK * 2 + up::SwizzleK128(r, c);
        if (got != want && bad++ < 5) std::printf("%s up A row %d column %d stage %d: CuTe %ld, ours %ld\n", name, r, c, st, got, want);
      }
      for (int r = 0; r < up::kUpNeurons; ++r) {
        const long got = reinterpret_cast<char*>(&uB(r, c, st)) - reinterpret_cast<char*>(ub);
        const long want = st * up::kUpNeurons * up::kUpK * 2 + up::SwizzleK128(r, c);
        if (got != want && bad++ < 5) std::printf("%s up B row %d column %d stage %d: CuTe %ld, ours %ld\n", name, r, c, st, got, want);
      }
    }
  std::printf("%s: %s\n", name, bad ? "MISMATCH" : "ok");
  return bad;
}

int main() { return Check<cutlass::bfloat16_t>("bf16") + Check<cutlass::half_t>("f16") ? 1 : 0; }
