// Shared by the standalone probes on synthetic activations (stationary_probe.cu,
// up_stationary_probe.cu): bf16 bits on the host, and each token's active neurons as the
// library's patterns draw them (uniform: every neuron at p; heavy: a log-normal rate per
// token, sigma 1, clipped to 5%), distinct and ascending.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace probe {

inline float Bf16ToFloat(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

inline uint16_t FloatToBf16(float x) {  // round to nearest even (finite inputs)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// The probes' leading arguments: [M=16384] [d=2048] [f=5632] [density=0.005] [pattern=uniform|heavy].
struct Shape {
  int m, d, f;
  double p;
  std::string pattern;
};

inline Shape ParseShape(int argc, char** argv) {
  return Shape{argc > 1 ? std::atoi(argv[1]) : 16384, argc > 2 ? std::atoi(argv[2]) : 2048,
               argc > 3 ? std::atoi(argv[3]) : 5632, argc > 4 ? std::atof(argv[4]) : 0.005,
               argc > 5 ? argv[5] : "uniform"};
}

// Rows of m tokens over f neurons: row_ptr [m + 1] into neurons (ascending within a row).
struct ActiveRows {
  std::vector<int> row_ptr;
  std::vector<int> neurons;
};

inline ActiveRows DrawRows(int m, int f, double p, const std::string& pattern, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 1.0);
  ActiveRows rows;
  rows.row_ptr.assign(m + 1, 0);
  rows.neurons.reserve(static_cast<size_t>(m * p * f * 1.3) + 16);
  std::vector<int> nbuf(f);
  for (int t = 0; t < m; ++t) {
    double rate = p;
    if (pattern == "heavy") rate = std::min(0.05, std::max(1e-6, p * std::exp(normal(rng) - 0.5)));
    std::binomial_distribution<int> count_dist(f, rate);
    const int c = count_dist(rng);
    for (int n = 0; n < f; ++n) nbuf[n] = n;
    for (int i = 0; i < c; ++i) std::swap(nbuf[i], nbuf[i + rng() % (f - i)]);
    std::sort(nbuf.begin(), nbuf.begin() + c);
    rows.neurons.insert(rows.neurons.end(), nbuf.begin(), nbuf.begin() + c);
    rows.row_ptr[t + 1] = static_cast<int>(rows.neurons.size());
  }
  return rows;
}

}  // namespace probe
