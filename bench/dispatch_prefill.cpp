// bench/dispatch_prefill.cpp — the runtime-dispatch speed check: causal packed prefill through the Eigen entry
// point (scaled_dot_product_attention, T = 1024, 8 heads, D = 64, one thread), timed in process.
//
// scripts/dispatch_speed.sh builds this file twice, without -march (runtime dispatch picks the kernel) and with
// -march=native, and runs the two binaries in turn: the ratio of their best times is the cost of dispatch.
// Prints: the ISA isa_name() reports, the best and the median milliseconds of `rounds` calls, and out[0] (a checksum
// that must agree between the two builds to within the accuracy rule).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "qkv/qkv.hpp"

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 20;
#if defined(_OPENMP)
  omp_set_num_threads(1);
#endif
  const qkv::Index T = 1024, H = 8, D = 64;
  std::srand(7);  // Eigen's Random draws from std::rand
  const qkv::Matrix<float> Q = qkv::Matrix<float>::Random(T, H * D), K = qkv::Matrix<float>::Random(T, H * D),
                           V = qkv::Matrix<float>::Random(T, H * D);
  qkv::AttentionOptions<float> options;
  options.causal = true;
  qkv::Matrix<float> out = qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{H, H}, options);  // warm-up
  std::vector<double> ms;
  for (int r = 0; r < rounds; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    out = qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{H, H}, options);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%s best %.3f ms median %.3f ms out[0] %.9g\n", qkv::isa_name(), ms.front(), ms[ms.size() / 2],
              static_cast<double>(out(0, 0)));
  return 0;
}
