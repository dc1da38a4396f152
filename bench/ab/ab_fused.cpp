// bench/ab/ab_fused.cpp — an in-process A/B of the fused kernel: two versions of the headers in one binary.
//
// Built by scripts/ab_fused.sh, which exports revision A's include/ as is and revision B's include/ as B/qkv/..., then
// compiles this file with `#define qkv qkv_b` around B's headers, so the two kernels live in the namespaces qkv and
// qkv_b. Calls alternate A, B (B, A on odd rounds) on the same inputs, each round after a register-only FMA loop, so
// both versions see the same machine: on a shared machine whose speed drifts by ±20 % over minutes, the ratio of two
// interleaved versions is repeatable where two separate benchmark runs are not.
//
// Prints, per version, the best and the median GFLOPS (4·D per visible (query, key) pair per head, as bench_attention
// counts) and their ratio to the best FMA loop of the run; how many rounds B was faster; how many outputs differ in
// their bits (0 when B is meant to change only speed; a NaN on one side counts) and the largest finite difference.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "../fma_loop.hpp"  // A's qkv::simd, before A's macros are undefined
#include "qkv/qkv.hpp"
#include "undef_a.hpp"  // written by the script: #undef of every QKV_ macro A's headers define
#define qkv qkv_b
#include "B/qkv/qkv.hpp"
#undef qkv

namespace {

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// The register-only FMA loop of bench/fma_loop.hpp (as BM_FmaPeak): the ISA's peak, in GFLOPS.
double fma_loop_gflops() {
  constexpr std::int64_t kIterations = 1 << 22;
  volatile float x = 0.999999f;  // read at run time: the loop cannot be folded
  const double t0 = now();
  volatile float sink = qkv_bench::fma_chains(kIterations, x);
  const double t1 = now();
  (void)sink;
  return 2.0 * qkv_bench::kFmaChains * qkv::simd::BestTag::kLanes * double(kIterations) / (t1 - t0) * 1e-9;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 5) {
    std::fprintf(stderr, "usage: %s D T rounds causal   (B = 1, H = 8, Sq = Skv = T, float)\n", argv[0]);
    return 2;
  }
  const long D = std::atol(argv[1]), T = std::atol(argv[2]), H = 8;
  const int rounds = std::atoi(argv[3]);
  const bool causal = std::atoi(argv[4]) != 0;
  if (D < 1 || T < 1 || rounds < 1) {
    std::fprintf(stderr, "D, T and rounds must be at least 1\n");
    return 2;
  }
  std::vector<float> q(H * T * D), k(H * T * D), v(H * T * D), out_a(H * T * D), out_b(H * T * D);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = normal(rng);

  qkv::AttentionOptions<float> options_a;
  options_a.backend = qkv::Backend::fused;
  options_a.causal = causal;
  qkv_b::AttentionOptions<float> options_b;
  options_b.backend = qkv_b::Backend::fused;
  options_b.causal = causal;
  const auto run_a = [&] {
    qkv::attention(qkv::view_bhsd(q.data(), 1, H, T, D), qkv::view_bhsd(k.data(), 1, H, T, D),
                   qkv::view_bhsd(v.data(), 1, H, T, D), qkv::view_bhsd(out_a.data(), 1, H, T, D), options_a);
  };
  const auto run_b = [&] {
    qkv_b::attention(qkv_b::view_bhsd(q.data(), 1, H, T, D), qkv_b::view_bhsd(k.data(), 1, H, T, D),
                     qkv_b::view_bhsd(v.data(), 1, H, T, D), qkv_b::view_bhsd(out_b.data(), 1, H, T, D), options_b);
  };
  const double pairs = causal ? double(T) * double(T + 1) / 2.0 : double(T) * double(T);
  const double flops = 4.0 * double(D) * pairs * double(H);
  const auto gflops = [&](auto&& f) {
    const double t0 = now();
    f();
    return flops / (now() - t0) * 1e-9;
  };

  run_a();  // warm-up: page faults of the outputs and of both kernels' scratch
  run_b();
  std::vector<double> peak, a, b;
  for (int r = 0; r < rounds; ++r) {
    peak.push_back(fma_loop_gflops());
    if (r % 2 == 0) {
      a.push_back(gflops(run_a));
      b.push_back(gflops(run_b));
    } else {
      b.push_back(gflops(run_b));
      a.push_back(gflops(run_a));
    }
  }
  int b_faster = 0;
  for (int r = 0; r < rounds; ++r) b_faster += b[static_cast<std::size_t>(r)] > a[static_cast<std::size_t>(r)];
  // Outputs whose bits differ (a NaN on one side counts; max would skip it), and the largest finite difference.
  std::size_t differing = 0;
  double max_diff = 0;
  for (std::size_t i = 0; i < out_a.size(); ++i) {
    if (std::memcmp(&out_a[i], &out_b[i], sizeof(float)) == 0) continue;
    ++differing;
    const double diff = std::fabs(double(out_a[i]) - double(out_b[i]));
    if (std::isfinite(diff)) max_diff = std::max(max_diff, diff);
  }

  const double best_peak = *std::max_element(peak.begin(), peak.end());
  const auto report = [&](const char* name, std::vector<double> x) {
    std::sort(x.begin(), x.end());
    const double best = x.back(), median = x[x.size() / 2];
    std::printf("D=%ld T=%ld causal=%d %-9s best %6.1f GFLOPS (%.3f of the FMA loop)  median %6.1f (%.3f)\n", D, T,
                int(causal), name, best, best / best_peak, median, median / best_peak);
  };
  report("FMA loop", peak);
  report("A", a);
  report("B", b);
  std::printf("B faster in %d of %d rounds; outputs whose bits differ: %zu of %zu; max finite |out_A - out_B| = %g\n",
              b_faster, rounds, differing, out_a.size(), max_diff);
  return 0;
}
