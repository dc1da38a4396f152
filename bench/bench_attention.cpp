// qkv microbenchmarks: the fused kernel against baselines measured in the same binary and run.
//
//   cmake --preset bench && cmake --build --preset bench && ./build/bench/bench/bench_attention
//
// Counters: GFLOPS counts 2·(D + Dv) FLOPs per visible (query, key) pair per query head (the two products;
// softmax not counted), as FlashAttention does; GBps counts the compulsory bytes (K and V once) of decoding.
// Baselines: a register-only FMA loop (the ISA's peak for one thread), an Eigen SGEMM 2048³ (the "Eigen SGEMM
// reference"), a naive materialized Eigen attention (S = Q·Kᵀ, softmax, P·V per head, float), the qkv reference
// path (float64 accumulation) on small shapes, a plain read loop over the decode sizes (the bandwidth there) and the
// same loop with decode's multiply-adds (how fast the core streams those bytes while doing decode's arithmetic).
// Quote ratios from one run (bench/README.md), never absolute times: the machines are shared. For ratios fit to
// quote, take medians of interleaved rounds, each kernel beside its baseline in one process:
//   bench_attention --benchmark_repetitions=10 --benchmark_enable_random_interleaving=true
//     --benchmark_report_aggregates_only=true --benchmark_filter='FmaPeak|FusedPrefill/T:4096'   (for example,
//     one command)
// Memory: alloc_MiB is the sum of what one fused call allocates (operator new, counted by
// tests/support/counting_allocator.hpp: an upper bound of its peak, as all but a few small vectors live until the call
// returns), scores_MiB the T × T score matrix the naive baseline holds, inputs_MiB what q, k, v and out occupy.
// scripts/plot_bench.py turns the JSON output into a plot and prints the complexity slopes.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <new>
#include <random>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "fma_loop.hpp"
#include "qkv/detail/cache_line_allocator.hpp"
#include "qkv/qkv.hpp"
#include "qkv/simd/simd.hpp"
#include "read_loop.hpp"
#include "support/counting_allocator.hpp"  // replaces operator new in this executable: alloc_MiB

namespace {

using qkv::Index;

/// MiB that `call()` allocates (run once, outside the timed loop) on a released workspace: what the call needs, the
/// packed K and V included, though later calls on the thread reuse those (qkv::release_workspace).
template <class F>
double allocated_mib(F&& call) {
  qkv::release_workspace();
  return double(qkv_test::count_allocations(call).bytes) / (1024.0 * 1024.0);
}

/// n standard normal floats (Box–Muller in float over 24-bit uniforms from mt19937). libstdc++'s
/// std::normal_distribution<float> computes in long double (logl) and took most of a decode run's time, filling
/// 256 MiB of K and V for every repetition (bench/README.md, "2026-12-02, tenth session").
std::vector<float> random_vector(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  const auto uniform = [&rng] { return (float(rng() >> 8) + 0.5f) * 0x1p-24f; };  // in (0, 1)
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; i += 2) {
    const float radius = std::sqrt(-2.0f * std::log(uniform())), angle = 6.28318531f * uniform();
    v[i] = radius * std::cos(angle);
    if (i + 1 < n) v[i + 1] = radius * std::sin(angle);
  }
  return v;
}

void set_threads(int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
}

/// Visible (query, key) pairs of one head: Sq·Skv, or the causal triangle (bottom-right) when causal.
double visible_pairs(Index sq, Index skv, bool causal) {
  if (!causal) return double(sq) * double(skv);
  double pairs = 0;
  for (Index i = 0; i < sq; ++i) pairs += double(std::max<Index>(0, std::min(skv, i + (skv - sq) + 1)));
  return pairs;
}

/// A benchmark's label: what it runs and the fused kernel's ISA (runtime dispatch, or the QKV_ISA pin).
std::string label(const char* what) { return std::string(what) + " " + qkv::isa_name(); }

/// K/V storage of a benchmark row: arg 0 = float, 1 = Eigen::half, 2 = Eigen::bfloat16 (qkv::attention's 16-bit keys
/// and values; q and out stay float).
const char* storage_name(std::int64_t storage) { return storage == 1 ? "f16" : storage == 2 ? "bf16" : "f32"; }

/// Calls f with a value of the storage type of arg `storage` (for its type only).
template <class F>
void with_storage(std::int64_t storage, F&& f) {
  if (storage == 1) {
    f(Eigen::half());
  } else if (storage == 2) {
    f(Eigen::bfloat16());
  } else {
    f(0.0f);
  }
}

/// A vector whose storage starts a 64-byte cache line, as a PyTorch tensor's always does and an Eigen matrix's does
/// with AVX-512 flags: decode's K and V and the read loop's bytes (read from there and 16 bytes on; prefill packs K
/// and V, and its inputs stay in plain vectors). A plain std::vector of that size starts 16 bytes past a page (glibc),
/// where every 512-bit load of a 512-byte row straddles two lines; from L3 that cost token-major float decode about a
/// tenth of its speed on Zen 4 (bench/README.md, "2026-12-06, thirtieth session").
template <class T>
using LineVector = std::vector<T, qkv::detail::CacheLineAllocator<T>>;

/// `values` rounded to storage type S (exactly what a user holding a 16-bit cache has), in a std::vector or, with
/// Vector = LineVector<S>, on cache lines.
template <class S, class Vector = std::vector<S>>
Vector stored_as(const std::vector<float>& values) {
  Vector result(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) result[i] = S(values[i]);
  return result;
}

/// Times one fused prefill call per iteration under `options`: B = 1, H = 8 heads, T = Sq = Skv, D = Dv, random q,
/// k and v, float. Counters: GFLOPS over the visible pairs (causal or not), alloc_MiB, inputs_MiB; label `name`.
void time_fused_prefill(benchmark::State& state, Index T, Index D, const qkv::AttentionOptions<float>& options,
                        const char* name) {
  const Index H = 8;
  const auto q = random_vector(std::size_t(H * T * D), 1), k = random_vector(std::size_t(H * T * D), 2),
             v = random_vector(std::size_t(H * T * D), 3);
  std::vector<float> out(std::size_t(H * T * D));
  const auto call = [&] {
    qkv::attention(qkv::view_bhsd(q.data(), 1, H, T, D), qkv::view_bhsd(k.data(), 1, H, T, D),
                   qkv::view_bhsd(v.data(), 1, H, T, D), qkv::view_bhsd(out.data(), 1, H, T, D), options);
  };
  const double alloc_mib = allocated_mib(call);
  for (auto _ : state) {
    call();
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * double(D + D) * visible_pairs(T, T, options.causal) * double(H);
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["alloc_MiB"] = alloc_mib;
  state.counters["inputs_MiB"] = 4.0 * double(H * T * D) * sizeof(float) / (1024.0 * 1024.0);
  state.SetLabel(label(name));
}

// Prefill: B = 1, H = 8, T = Sq = Skv, D = Dv; args {T, D, causal, threads}.
void BM_FusedPrefill(benchmark::State& state) {
  set_threads(static_cast<int>(state.range(3)));
  qkv::AttentionOptions<float> options;
  options.causal = state.range(2) != 0;
  options.backend = qkv::Backend::fused;
  time_fused_prefill(state, state.range(0), state.range(1), options, "fused");
  set_threads(1);
}

// Prefill with dropout on the weights: B = 1, H = 8, T = Sq = Skv, D = Dv, one thread, not causal; args {T, D,
// 100·p}. The p = 0 row runs no dropout code (BM_FusedPrefill's work); the ratio of the p > 0 row to it in the same run
// is the cost of the mask (dropout.hpp: the Philox generator and the select). Seed and offset fixed.
void BM_FusedPrefillDropout(benchmark::State& state) {
  set_threads(1);
  qkv::AttentionOptions<float> options;
  options.backend = qkv::Backend::fused;
  options.dropout_p = float(state.range(2)) / 100.0f;
  options.dropout_seed = 0x0123456789abcdefULL;
  options.dropout_offset = 0;
  time_fused_prefill(state, state.range(0), state.range(1), options, "fused dropout");
}

// Prefill with 16-bit keys and values (the fused kernel converts them while packing): B = 1, H = 8, T = Sq = Skv,
// D = Dv, one thread, not causal; args {T, D, storage} (1 = half, 2 = bfloat16). Compare with BM_FusedPrefill's
// float row of the same T and D in the same run.
void BM_FusedPrefillKV16(benchmark::State& state) {
  const Index T = state.range(0), D = state.range(1), H = 8;
  set_threads(1);
  const auto q = random_vector(std::size_t(H * T * D), 1);
  std::vector<float> out(std::size_t(H * T * D));
  qkv::AttentionOptions<float> options;
  options.backend = qkv::Backend::fused;
  with_storage(state.range(2), [&](auto storage) {
    using S = decltype(storage);
    const auto k = stored_as<S>(random_vector(std::size_t(H * T * D), 2)),
               v = stored_as<S>(random_vector(std::size_t(H * T * D), 3));
    for (auto _ : state) {
      qkv::attention(qkv::view_bhsd(q.data(), 1, H, T, D), qkv::view_bhsd(k.data(), 1, H, T, D),
                     qkv::view_bhsd(v.data(), 1, H, T, D), qkv::view_bhsd(out.data(), 1, H, T, D), options);
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    }
  });
  const double flops = 2.0 * double(D + D) * double(T) * double(T) * double(H);
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(label((std::string("fused prefill ") + storage_name(state.range(2))).c_str()));
}

// The qkv reference path (float64 accumulation, materialized) on the same shapes: the executable specification.
void BM_ReferencePrefill(benchmark::State& state) {
  const Index T = state.range(0), D = state.range(1), H = 8;
  const bool causal = state.range(2) != 0;
  set_threads(1);
  const auto q = random_vector(std::size_t(H * T * D), 1), k = random_vector(std::size_t(H * T * D), 2),
             v = random_vector(std::size_t(H * T * D), 3);
  std::vector<float> out(std::size_t(H * T * D));
  qkv::AttentionOptions<float> options;
  options.causal = causal;
  options.backend = qkv::Backend::reference;
  for (auto _ : state) {
    qkv::attention(qkv::view_bhsd(q.data(), 1, H, T, D), qkv::view_bhsd(k.data(), 1, H, T, D),
                   qkv::view_bhsd(v.data(), 1, H, T, D), qkv::view_bhsd(out.data(), 1, H, T, D), options);
    benchmark::DoNotOptimize(out.data());
  }
  const double flops = 2.0 * double(D + D) * visible_pairs(T, T, causal) * double(H);
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(label("reference"));
}

// Naive materialized attention in plain Eigen, one head at a time (no mask): the baseline a user would write. One
// thread, like the SGEMM row (Eigen would otherwise use OpenMP's threads for the products).
void BM_NaiveEigenPrefill(benchmark::State& state) {
  const Index T = state.range(0), D = state.range(1), H = 8;
  Eigen::setNbThreads(1);
  using M = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::vector<M> q(std::size_t(H), M::Random(T, D)), k(std::size_t(H), M::Random(T, D)),
      v(std::size_t(H), M::Random(T, D));
  M s, out(T, D);
  const float scale = 1.0f / std::sqrt(float(D));
  const auto call = [&] {
    for (Index h = 0; h < H; ++h) {
      s.noalias() = (q[std::size_t(h)] * scale) * k[std::size_t(h)].transpose();
      s = (s.colwise() - s.rowwise().maxCoeff()).array().exp().matrix();
      s = s.array().colwise() / s.rowwise().sum().array();
      out.noalias() = s * v[std::size_t(h)];
      benchmark::DoNotOptimize(out.data());
    }
  };
  call();  // sizes s: T × T (Eigen allocates with malloc, which the operator new count does not see)
  for (auto _ : state) call();
  const double flops = 2.0 * double(D + D) * double(T) * double(T) * double(H);
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["scores_MiB"] = double(s.size()) * sizeof(float) / (1024.0 * 1024.0);
  state.counters["inputs_MiB"] = 4.0 * double(H * T * D) * sizeof(float) / (1024.0 * 1024.0);
  state.SetLabel(label("naive eigen"));
}

// Backward (qkv::attention_backward, the fused float backward): B = 1, H = 8, T = Sq = Skv, D = Dv, args {T, D, causal,
// threads}; the forward's out and lse computed once, outside the timed loop. GFLOPS counts the five products: 2·(2·D +
// 3·Dv) FLOPs per visible (query, key) pair per head, 2.5 × the forward's count at D = Dv (FlashAttention's count).
// Compare its time with BM_FusedPrefill's row of the same args in the same run (the bound: ≤ 3 × forward).
void BM_FusedBackward(benchmark::State& state) {
  const Index T = state.range(0), D = state.range(1), H = 8;
  const bool causal = state.range(2) != 0;
  set_threads(static_cast<int>(state.range(3)));
  const std::size_t n = std::size_t(H * T * D);
  const auto q = random_vector(n, 1), k = random_vector(n, 2), v = random_vector(n, 3), d_out = random_vector(n, 4);
  std::vector<float> out(n), lse(std::size_t(H * T)), d_q(n), d_k(n), d_v(n);
  qkv::AttentionOptions<float> options;
  options.causal = causal;
  options.backend = qkv::Backend::fused;
  const qkv::TensorView3<float> lse_view(lse.data(), {1, H, T}, {H * T, T, 1});
  qkv::attention(qkv::view_bhsd(q.data(), 1, H, T, D), qkv::view_bhsd(k.data(), 1, H, T, D),
                 qkv::view_bhsd(v.data(), 1, H, T, D), qkv::view_bhsd(out.data(), 1, H, T, D), lse_view, options);
  const auto call = [&] {
    qkv::attention_backward(qkv::view_bhsd(q.data(), 1, H, T, D), qkv::view_bhsd(k.data(), 1, H, T, D),
                            qkv::view_bhsd(v.data(), 1, H, T, D), qkv::view_bhsd(out.data(), 1, H, T, D),
                            qkv::TensorView3<const float>(lse_view), qkv::view_bhsd(d_out.data(), 1, H, T, D),
                            qkv::view_bhsd(d_q.data(), 1, H, T, D), qkv::view_bhsd(d_k.data(), 1, H, T, D),
                            qkv::view_bhsd(d_v.data(), 1, H, T, D), options);
  };
  const double alloc_mib = allocated_mib(call);
  for (auto _ : state) {
    call();
    benchmark::DoNotOptimize(d_q.data());
    benchmark::ClobberMemory();
  }
  const double flops = 2.0 * double(2 * D + 3 * D) * visible_pairs(T, T, causal) * double(H);
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["alloc_MiB"] = alloc_mib;
  state.SetLabel(label("fused backward"));
  set_threads(1);
}

// A naive materialized Eigen backward, one thread, float: per head S = Q·Kᵀ·scale, P = softmax(S), dV = Pᵀ·dO,
// dP = dO·Vᵀ, dS = P ∘ (dP − rowsum(dO ∘ O)), dQ = dS·K·scale, dK = dSᵀ·Q·scale (T × T matrices held); args {T, D,
// out_given}. With out_given = 0 it also computes the forward's O = P·V (a sixth product) for D_i; with 1 it is handed
// O, made before the timed loop, as the fused backward is: the five products of the fused one, the fair comparison.
// GFLOPS counts those five in both.
void BM_NaiveEigenBackward(benchmark::State& state) {
  const Index T = state.range(0), D = state.range(1), H = 8;
  const bool out_given = state.range(2) != 0;
  Eigen::setNbThreads(1);
  using M = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::vector<M> q(std::size_t(H), M::Random(T, D)), k(std::size_t(H), M::Random(T, D)),
      v(std::size_t(H), M::Random(T, D)), d_out(std::size_t(H), M::Random(T, D));
  M p, d_p, d_q(T, D), d_k(T, D), d_v(T, D);
  std::vector<M> outs(std::size_t(H), M(T, D));
  Eigen::VectorXf delta;
  const float scale = 1.0f / std::sqrt(float(D));
  const auto softmax_scores = [&](std::size_t u) {
    p.noalias() = (q[u] * scale) * k[u].transpose();
    p = (p.colwise() - p.rowwise().maxCoeff()).array().exp().matrix();
    p = p.array().colwise() / p.rowwise().sum().array();
  };
  if (out_given) {  // the forward's outputs, made once, outside the timing
    for (std::size_t u = 0; u < std::size_t(H); ++u) {
      softmax_scores(u);
      outs[u].noalias() = p * v[u];
    }
  }
  const auto call = [&] {
    for (Index h = 0; h < H; ++h) {
      const std::size_t u = std::size_t(h);
      M& out = outs[out_given ? u : 0];  // without out_given, one buffer for every head, as before
      softmax_scores(u);
      if (!out_given) out.noalias() = p * v[u];  // the forward's out, which the backward's D_i needs
      d_v.noalias() = p.transpose() * d_out[u];
      d_p.noalias() = d_out[u] * v[u].transpose();
      delta = (d_out[u].array() * out.array()).rowwise().sum().matrix();
      d_p = (p.array() * (d_p.colwise() - delta).array()).matrix();
      d_q.noalias() = (d_p * k[u]) * scale;
      d_k.noalias() = (d_p.transpose() * q[u]) * scale;
      benchmark::DoNotOptimize(d_q.data());
      benchmark::DoNotOptimize(d_k.data());
      benchmark::DoNotOptimize(d_v.data());
    }
  };
  call();
  for (auto _ : state) call();
  const double flops = 2.0 * double(2 * D + 3 * D) * double(T) * double(T) * double(H);
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["scores_MiB"] = 2.0 * double(p.size()) * sizeof(float) / (1024.0 * 1024.0);
  state.SetLabel(label(out_given ? "naive eigen backward, out given" : "naive eigen backward"));
}

// The naive backward's five products alone (S = Q·Kᵀ·scale, dV = Sᵀ·dO, dP = dO·Vᵀ, dQ = dP·K·scale, dK = dPᵀ·Q·scale:
// the same shapes, no softmax, no dS), one thread; args {T, D}. The floor of BM_NaiveEigenBackward's time at Eigen's
// speed: the fused backward's ratio to the naive one cannot exceed (naive time) / (these products' flops at the FMA
// loop's speed), and where these products alone take more than half the naive time, × 2 needs the fused backward to
// run its products faster than Eigen runs these.
void BM_NaiveEigenBackwardProducts(benchmark::State& state) {
  const Index T = state.range(0), D = state.range(1), H = 8;
  Eigen::setNbThreads(1);
  using M = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  std::vector<M> q(std::size_t(H), M::Random(T, D)), k(std::size_t(H), M::Random(T, D)),
      v(std::size_t(H), M::Random(T, D)), d_out(std::size_t(H), M::Random(T, D));
  M s, d_p, d_q(T, D), d_k(T, D), d_v(T, D);
  const float scale = 1.0f / std::sqrt(float(D));
  const auto call = [&] {
    for (std::size_t u = 0; u < std::size_t(H); ++u) {
      s.noalias() = (q[u] * scale) * k[u].transpose();
      d_v.noalias() = s.transpose() * d_out[u];
      d_p.noalias() = d_out[u] * v[u].transpose();
      d_q.noalias() = (d_p * k[u]) * scale;
      d_k.noalias() = (d_p.transpose() * q[u]) * scale;
      benchmark::DoNotOptimize(d_q.data());
      benchmark::DoNotOptimize(d_k.data());
      benchmark::DoNotOptimize(d_v.data());
    }
  };
  call();
  for (auto _ : state) call();
  const double flops = 2.0 * double(2 * D + 3 * D) * double(T) * double(T) * double(H);
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(label("naive eigen backward, products only"));
}

// Eigen SGEMM 2048 × 2048 × 2048, one thread: the "Eigen SGEMM reference".
void BM_EigenSgemm(benchmark::State& state) {
  const Index n = 2048;
  Eigen::setNbThreads(1);
  const Eigen::MatrixXf a = Eigen::MatrixXf::Random(n, n), b = Eigen::MatrixXf::Random(n, n);
  Eigen::MatrixXf c(n, n);
  for (auto _ : state) {
    c.noalias() = a * b;
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["GFLOPS"] =
      benchmark::Counter(2.0 * double(n) * double(n) * double(n) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(label("eigen sgemm"));
}

// A register-only FMA loop (bench/fma_loop.hpp): the ISA's peak FLOP rate for one thread.
void BM_FmaPeak(benchmark::State& state) {
  constexpr std::int64_t kIterations = 1 << 20;
  float x = 0.999999f;
  for (auto _ : state) {
    benchmark::DoNotOptimize(x);
    benchmark::DoNotOptimize(qkv_bench::fma_chains(kIterations, x));
  }
  const double flops = 2.0 * qkv_bench::kFmaChains * qkv::simd::BestTag::kLanes * double(kIterations);
  state.counters["GFLOPS"] = benchmark::Counter(flops * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(std::string("fma peak ") + qkv::simd::BestTag::kName);  // the flags' best ISA, not the pin
}

// Decode: Sq = 1, Hq = 32, Hkv = 8, D = Dv = 128; args {Skv, threads, bshd, storage}. bshd = 0: K and V head-major
// ([B, H, S, D], each head's keys contiguous); bshd = 1: token-major ([B, S, H, D], view_bshd: each key row holds the
// 8 kv heads side by side, 4 KiB apart per head; llama.cpp's cache and the packed Eigen entry point's layout).
// storage: K and V in float, half or bfloat16 (GBps counts the bytes of that storage).
void BM_FusedDecode(benchmark::State& state) {
  const Index Skv = state.range(0), Hq = 32, Hkv = 8, D = 128;
  const bool bshd = state.range(2) != 0;
  set_threads(static_cast<int>(state.range(1)));
  const auto q = random_vector(std::size_t(Hq * D), 1);
  std::vector<float> out(std::size_t(Hq * D));
  qkv::AttentionOptions<float> options;
  options.backend = qkv::Backend::fused;
  std::size_t element_bytes = 4;
  with_storage(state.range(3), [&](auto storage) {
    using S = decltype(storage);
    element_bytes = sizeof(S);
    const auto k = stored_as<S, LineVector<S>>(random_vector(std::size_t(Hkv * Skv * D), 2)),
               v = stored_as<S, LineVector<S>>(random_vector(std::size_t(Hkv * Skv * D), 3));
    const auto view = [&](const auto* data, Index H, Index S_) {
      return bshd ? qkv::view_bshd(data, 1, S_, H, D) : qkv::view_bhsd(data, 1, H, S_, D);
    };
    const auto call = [&] {
      qkv::attention(view(q.data(), Hq, 1), view(k.data(), Hkv, Skv), view(v.data(), Hkv, Skv),
                     bshd ? qkv::view_bshd(out.data(), 1, 1, Hq, D) : qkv::view_bhsd(out.data(), 1, Hq, 1, D),
                     options);
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    };
    // One call before the timed loop: on a VM the first read of freshly written K and V can cost far more than the
    // read itself (a first call at Skv = 32768 took 336-443 ms against 12 ms for the next ones on the Zen 5 VM of
    // bench/README.md, "2026-12-02, tenth session"), and with a short --benchmark_min_time it was the only one timed.
    call();
    for (auto _ : state) call();
  });
  const double bytes = 2.0 * double(Hkv * Skv * D) * double(element_bytes);
  state.counters["GBps"] = benchmark::Counter(bytes * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOPS"] = benchmark::Counter(2.0 * double(D + D) * double(Skv) * double(Hq) * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(label((std::string(bshd ? "fused decode bshd " : "fused decode bhsd ") + storage_name(state.range(3))).c_str()));
  set_threads(1);
}

// A plain read loop over the bytes decode reads (K and V of the same size): the bandwidth there. Args {Skv, threads,
// offset}: the bytes start `offset` bytes past a cache line (a multiple of a float's size, below 64). On one Zen 4
// thread the loop read about a tenth faster from DRAM with its 512-bit loads straddling lines (offset 16) than on lines
// (offset 0), where decode's speed did not move with the placement (bench/README.md, "2026-12-06, thirty-first
// session"): scripts/plot_bench.py takes the faster placement as the memory's speed.
void BM_ReadLoop(benchmark::State& state) {
  const Index Skv = state.range(0), Hkv = 8, D = 128;
  const int threads = static_cast<int>(state.range(1));
  const auto offset_bytes = static_cast<std::size_t>(state.range(2));
  if (offset_bytes % sizeof(float) != 0 || offset_bytes >= 64) {
    state.SkipWithError("offset: a multiple of sizeof(float) below 64");
    return;
  }
  const std::size_t n = std::size_t(2 * Hkv * Skv * D);
  const auto storage = stored_as<float, LineVector<float>>(random_vector(n + 64 / sizeof(float), 4));
  const float* const data = storage.data() + offset_bytes / sizeof(float);
  const auto read = [&] { benchmark::DoNotOptimize(qkv_bench::read_floats(data, n, threads)); };
  read();  // as BM_FusedDecode: the first pass over freshly written memory is not timed
  for (auto _ : state) read();
  state.counters["GBps"] =
      benchmark::Counter(double(n) * sizeof(float) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(label("read loop"));
}

// The read loop with decode's multiply-adds: BM_ReadLoop's bytes (float, on cache lines), each loaded vector met by G
// = Hq / Hkv = 4 multiply-adds, one per query row of a kv head (weights in registers, no reduction, no store, no
// software prefetch), as decode's Q·Kᵀ and P·V meet each K and V vector with its G rows: the rate at which the core
// streams those bytes while it does decode's arithmetic, which neither BM_ReadLoop (no arithmetic) nor BM_FmaPeak (no
// reads) shows. Args {Skv, threads}. Accumulators: 4 rows × 4 vectors on 16-lane tags (AVX-512, 32 registers), else
// 4 × 2 (AVX2's 16 registers), enough to cover the FMA latency.
void BM_ReadFmaLoop(benchmark::State& state) {
  const Index Skv = state.range(0), Hkv = 8, D = 128, G = 4;
  const int threads = static_cast<int>(state.range(1));
  const std::size_t n = std::size_t(2 * Hkv * Skv * D);
  const auto storage = stored_as<float, LineVector<float>>(random_vector(n, 4));
  const float* const data = storage.data();
  using Tag = qkv::simd::BestTag;
  using Vec = typename Tag::Vec;
  constexpr int L = Tag::kLanes, kColumns = L >= 16 ? 4 : 2;
  const auto read = [&] {
    benchmark::DoNotOptimize(qkv_bench::team_sum(threads, n, kColumns * L, [&](std::size_t begin, std::size_t end) {
      const Vec w[G] = {qkv::simd::set1(Tag(), 0.5f), qkv::simd::set1(Tag(), -0.25f), qkv::simd::set1(Tag(), 0.125f),
                        qkv::simd::set1(Tag(), 2.0f)};
      Vec acc[G][kColumns];
      for (auto& row : acc)
        for (auto& a : row) a = qkv::simd::zero(Tag());
      for (std::size_t e = begin; e < end; e += kColumns * L) {
        for (int c = 0; c < kColumns; ++c) {
          const Vec x = qkv::simd::load(Tag(), data + e + std::size_t(c * L));
          for (int r = 0; r < G; ++r) acc[r][c] = qkv::simd::fmadd(w[r], x, acc[r][c]);
        }
      }
      Vec sum = qkv::simd::zero(Tag());
      for (auto& row : acc)
        for (auto& a : row) sum = qkv::simd::add(sum, a);
      return qkv::simd::reduce_sum(Tag(), sum);
    }));
  };
  read();  // as BM_ReadLoop: the first pass over freshly written memory is not timed
  for (auto _ : state) read();
  state.counters["GBps"] =
      benchmark::Counter(double(n) * sizeof(float) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["GFLOPS"] =
      benchmark::Counter(2.0 * double(G) * double(n) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(label("read loop with decode's FMAs"));
}

// Decode's per-key work with none of the kernel's bookkeeping: for each kv head (head-major K and V, float, on cache
// lines) and block of 1024 keys, Q·Kᵀ of its G = 4 query rows over the block's K, NK keys a step (4 on 16-lane tags, 2
// elsewhere: qk_in_place's steps), the 4 × NK sums reduced together (reduce_sum16 on AVX-512, else reduce_sum4) into
// a score buffer in L1; then P·V over the block's V, NK keys a step, each of the 4 output rows (in L1) loaded, met by
// NK multiply-adds per vector and stored (pv_in_place's steps). No softmax (the scores are the weights), no software
// prefetch, no cursor, no calls, no packing. Each thread of the team takes whole kv heads. It answers what the loop of
// decode's micro-kernels streams at by itself, beside BM_ReadLoop and BM_ReadFmaLoop over as many bytes (K and V here
// are two arrays, theirs one); not an attention (its output means nothing). GFLOPS counts decode's 2·(D + Dv) per
// query head and key. Skv must be a multiple of NK (it is 2048 or 32768). Args {Skv, threads}.
template <class Tag>
float decode_step_heads(const float* k, const float* v, Index Skv, Index begin, Index end) {
  using Vec = typename Tag::Vec;
  constexpr int L = Tag::kLanes, R = 4, NK = L >= 16 ? 4 : 2;
  constexpr Index D = 128, kBlockKeys = 1024;
  // In memory, as the kernel's scratch (one buffer per thread, kept between calls: no allocation in the timing): local
  // arrays of these sizes the compiler may keep in (and spill from) registers, which took one thread 5 times as long.
  static thread_local LineVector<float> scratch(std::size_t(2 * R * D + R * kBlockKeys));
  float* const q = scratch.data();
  float* const out = q + R * D;
  float* const scores = out + R * D;
  for (Index e = 0; e < R * D; ++e) q[e] = 0.01f * float(e % 7);
  float total = 0;
  for (Index h = begin; h < end; ++h) {
    std::fill(out, out + R * D, 0.0f);
    for (Index block = 0; block < Skv; block += kBlockKeys) {
      const Index keys = std::min(kBlockKeys, Skv - block);
      const float* kb = k + (h * Skv + block) * D;
      const float* vb = v + (h * Skv + block) * D;
      for (Index j = 0; j + NK <= keys; j += NK) {
        Vec acc[R * NK];
        for (auto& a : acc) a = qkv::simd::zero(Tag());
        for (Index d = 0; d < D; d += L) {
          Vec kv[NK];
          for (int c = 0; c < NK; ++c) kv[c] = qkv::simd::load(Tag(), kb + (j + c) * D + d);
          for (int r = 0; r < R; ++r) {
            const Vec qv = qkv::simd::load(Tag(), q + r * D + d);
            for (int c = 0; c < NK; ++c) acc[r * NK + c] = qkv::simd::fmadd(qv, kv[c], acc[r * NK + c]);
          }
        }
        float sums[R * NK];
        if constexpr (R * NK == 16 && L >= 16) {
          reduce_sum16(Tag(), acc, sums);  // found by argument-dependent lookup: declared on 16-lane tags only
        } else {
          for (int a = 0; a < R * NK; a += 4)
            qkv::simd::reduce_sum4(Tag(), acc[a], acc[a + 1], acc[a + 2], acc[a + 3], sums + a);
        }
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < NK; ++c) scores[r * kBlockKeys + j + c] = sums[r * NK + c];
      }
      for (Index j = 0; j + NK <= keys; j += NK) {
        Vec weight[R][NK];
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < NK; ++c) weight[r][c] = qkv::simd::set1(Tag(), scores[r * kBlockKeys + j + c]);
        for (Index d = 0; d < D; d += L) {
          Vec vv[NK];
          for (int c = 0; c < NK; ++c) vv[c] = qkv::simd::load(Tag(), vb + (j + c) * D + d);
          for (int r = 0; r < R; ++r) {
            Vec o = qkv::simd::load(Tag(), out + r * D + d);
            for (int c = 0; c < NK; ++c) o = qkv::simd::fmadd(weight[r][c], vv[c], o);
            qkv::simd::store(Tag(), out + r * D + d, o);
          }
        }
      }
    }
    for (Index e = 0; e < R * D; ++e) total += out[e];
  }
  return total;
}

void BM_DecodeStepLoop(benchmark::State& state) {
  const Index Skv = state.range(0), Hkv = 8, D = 128;
  const int threads = static_cast<int>(state.range(1));
  const std::size_t n = std::size_t(Hkv * Skv * D);
  const auto k = stored_as<float, LineVector<float>>(random_vector(n, 2));
  const auto v = stored_as<float, LineVector<float>>(random_vector(n, 3));
  const auto read = [&] {
    benchmark::DoNotOptimize(qkv_bench::team_sum(threads, std::size_t(Hkv), 1, [&](std::size_t begin, std::size_t end) {
      return decode_step_heads<qkv::simd::BestTag>(k.data(), v.data(), Skv, Index(begin), Index(end));
    }));
  };
  read();  // as BM_ReadLoop: the first pass over freshly written memory is not timed
  for (auto _ : state) read();
  state.counters["GBps"] =
      benchmark::Counter(double(2 * n) * sizeof(float) * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  const double G = 4;  // query heads per kv head: Hq = 32
  state.counters["GFLOPS"] = benchmark::Counter(2.0 * double(2 * D) * G * double(Hkv * Skv) * 1e-9,
                                                benchmark::Counter::kIsIterationInvariantRate);
  state.SetLabel(label("decode's steps alone"));
}

void prefill_args(benchmark::internal::Benchmark* b) {
  for (int threads : {1, 2})
    for (Index T : {512, 1024, 2048, 4096, 16384})
      for (Index D : {64, 128})
        for (int causal : {0, 1}) {
          if (threads == 2 && T > 4096) continue;
          b->Args({T, D, causal, threads});
        }
  // The head-dimension sweep of the complexity slope against D (T = 2048, one thread, not causal).
  for (Index D : {16, 32, 256}) b->Args({2048, D, 0, 1});
}

BENCHMARK(BM_FmaPeak)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_EigenSgemm)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FusedPrefill)
    ->Apply(prefill_args)
    ->ArgNames({"T", "D", "causal", "threads"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_FusedPrefillDropout)
    ->ArgsProduct({{1024}, {64, 128}, {0, 10}})
    ->ArgNames({"T", "D", "p100"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_FusedPrefillKV16)
    ->ArgsProduct({{1024, 4096}, {64, 128}, {1, 2}})
    ->ArgNames({"T", "D", "storage"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_NaiveEigenPrefill)
    ->ArgsProduct({{512, 1024, 2048, 4096}, {64, 128}})
    ->ArgNames({"T", "D"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FusedBackward)
    ->ArgsProduct({{1024, 4096}, {64, 128}, {0, 1}, {1}})
    ->ArgNames({"T", "D", "causal", "threads"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_NaiveEigenBackward)
    ->ArgsProduct({{1024, 4096}, {64, 128}, {0, 1}})
    ->ArgNames({"T", "D", "out_given"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_NaiveEigenBackwardProducts)
    ->ArgsProduct({{4096}, {64, 128}})
    ->ArgNames({"T", "D"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_ReferencePrefill)
    ->Args({512, 64, 0})
    ->Args({1024, 128, 0})
    ->ArgNames({"T", "D", "causal"})
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_FusedDecode)
    ->ArgsProduct({{2048, 32768}, {1, 2}, {0, 1}, {0, 1, 2}})
    ->ArgNames({"Skv", "threads", "bshd", "storage"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_ReadLoop)
    ->ArgsProduct({{2048, 32768}, {1, 2}, {0, 16}})
    ->ArgNames({"Skv", "threads", "offset"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_ReadFmaLoop)
    ->ArgsProduct({{2048, 32768}, {1, 2}})
    ->ArgNames({"Skv", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();
BENCHMARK(BM_DecodeStepLoop)
    ->ArgsProduct({{2048, 32768}, {1, 2}})
    ->ArgNames({"Skv", "threads"})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
