// Tests of 16-bit keys and values (issue 16): qkv::attention with K and V stored as Eigen::half or Eigen::bfloat16 and
// a float query and output, on both backends, and the Eigen entry points with Matrix<Eigen::half> / <Eigen::bfloat16>
// K and V. The module's 16-bit KV cache has its own tests (test_multi_head).
//
// Expected values are float64 computations on the same rounded K/V (the stored values converted exactly), never on the
// float values before rounding: qkv's float64 reference backend (itself checked against an independent brute force in
// test_reference), tests/brute_force.hpp, PyTorch's math in double (tests/fixtures/kv16_torch.safetensors, written by
// scripts/make_kv16_fixtures.py) or a double loop in the test. The criterion is docs/design.md's accuracy rule, as in
// test_fused: the fused error ≤ 2 × the error of the plain float implementation (support/plain_float.hpp) on the same
// rounded values + 1e-6·max(1, max|V|), NaN exactly where float64 has NaN; the reference backend within
// 1e-6·max(1, max|V|).
//
// Every grid case runs on the kernel isa.hpp chose (qkv::attention), on the kernel instantiated on the emulated 16-lane
// tag (AVX-512's tile shapes on any CPU; support/emulated_tag.hpp) and on the reference backend; Kv16PerTag runs every
// compiled kernel copy. Run it also with QKV_ISA=scalar (and avx2) to put the dispatched calls on the other kernels.
#include "support/run_fused_with.hpp"  // the emulated 16-lane tag (its place here: support/emulated_tag.hpp)
// The line above stays apart from the headers below.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <iostream>
#include <limits>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

#include "brute_force.hpp"
#include "qkv/attention.hpp"
#include "qkv/sdpa.hpp"
#include "safetensors.hpp"
#include "support/npy.hpp"
#include "support/options.hpp"
#include "support/plain_float.hpp"
#include "support/problem.hpp"
#include "support/type_lists.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "support/counting_allocator.hpp"  // this file is the one translation unit of test_kv16 that includes it

namespace {

using qkv::Index;
using Storages = ::testing::Types<Eigen::half, Eigen::bfloat16>;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

template <class S>
std::string storage_name() {
  return std::is_same_v<S, Eigen::half> ? "half" : "bfloat16";
}

/// What S stores for x (Eigen's conversion: round to nearest even), widened back to float: exactly the value qkv reads.
template <class S>
float rounded(float x) {
  return static_cast<float>(S(x));
}

template <class S>
std::vector<S> to_storage(const std::vector<float>& x) {
  std::vector<S> result(x.size());
  for (std::size_t n = 0; n < x.size(); ++n) result[n] = S(x[n]);
  return result;
}

template <class S>
std::vector<float> widen(const std::vector<S>& x) {
  std::vector<float> result(x.size());
  for (std::size_t n = 0; n < x.size(); ++n) result[n] = static_cast<float>(x[n]);
  return result;
}

template <class T>
qkv::TensorView4<T> make_view(T* data, Index B, Index H, Index S, Index D, bool bshd) {
  return bshd ? qkv::view_bshd(data, B, S, H, D) : qkv::view_bhsd(data, B, H, S, D);
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

/// Bits equal, or both NaN (NaN payloads are not specified).
bool same_value(float a, float b) { return same_bits(a, b) || (std::isnan(a) && std::isnan(b)); }

/// Sanitizer and valgrind runs set QKV_REDUCED_GRID=1 (their test presets): fewer and shorter cases.
bool reduced_grid() { return std::getenv("QKV_REDUCED_GRID") != nullptr; }

// ---- the kernels a case runs on -------------------------------------------------------------------------------------

/// The fused kernel of a compiled copy (a tag of qkv::simd) or of the emulated 16-lane tag, on 16-bit K and V: the
/// call validated and resolved as qkv::attention does it.
template <class Tag, class S>
void fused_on_tag(Tag tag, const qkv::TensorView4<const float>& q, const qkv::TensorView4<const S>& k,
                  const qkv::TensorView4<const S>& v, const qkv::TensorView4<float>& out,
                  const qkv::TensorView3<float>* lse, const qkv::AttentionOptions<float>& options) {
  const qkv::detail::AttentionShape shape = qkv::detail::validate<float, S>("test_kv16", q, k, &v, &out, lse, options);
  const qkv::detail::AttentionParams<float> params = qkv::detail::resolve_params(options, shape.D);
  if constexpr (std::is_same_v<Tag, qkv_test::Emulated16Tag>) {
    (void)tag;
    qkv_test::emulated_pass::FusedAttention<qkv_test::Emulated16Tag, S>(shape, q, k, v, out, lse, params).run();
  } else {
    qkv::detail::run_fused_as(tag, shape, q, k, v, out, lse, params);
  }
}

/// One way of running a call with 16-bit K and V; `reference` marks the reference backend (its own, tighter rule).
template <class S>
struct Runner {
  std::string name;
  bool reference = false;
  std::function<void(const qkv::TensorView4<const float>&, const qkv::TensorView4<const S>&,
                     const qkv::TensorView4<const S>&, const qkv::TensorView4<float>&, const qkv::TensorView3<float>&,
                     qkv::AttentionOptions<float>)>
      run;
};

template <class S>
Runner<S> dispatched_fused() {
  return {"fused kernel isa.hpp chose (" + std::string(qkv::isa_name()) + ")", false,
          [](const auto& q, const auto& k, const auto& v, const auto& out, const auto& lse, auto options) {
            options.backend = qkv::Backend::fused;
            qkv::attention(q, k, v, out, lse, options);
          }};
}

template <class S>
Runner<S> reference_backend() {
  return {"reference backend", true,
          [](const auto& q, const auto& k, const auto& v, const auto& out, const auto& lse, auto options) {
            options.backend = qkv::Backend::reference;
            qkv::attention(q, k, v, out, lse, options);
          }};
}

template <class S, class Tag>
Runner<S> on_tag() {
  return {std::string(Tag::kName) + " kernel", false,
          [](const auto& q, const auto& k, const auto& v, const auto& out, const auto& lse, auto options) {
            options.backend = qkv::Backend::fused;
            fused_on_tag(Tag(), q, k, v, out, &lse, options);
          }};
}

/// Every kernel copy the build compiled (config.hpp) that this CPU runs.
template <class S>
std::vector<Runner<S>> every_compiled_kernel() {
  std::vector<Runner<S>> runners;
#if defined(QKV_KERNEL_SCALAR)
  runners.push_back(on_tag<S, qkv::simd::ScalarTag>());
#endif
#if defined(QKV_KERNEL_AVX2)
  if (qkv_test::cpu_runs<qkv::simd::Avx2Tag>()) runners.push_back(on_tag<S, qkv::simd::Avx2Tag>());
#endif
#if defined(QKV_KERNEL_AVX512)
  if (qkv_test::cpu_runs<qkv::simd::Avx512Tag>()) runners.push_back(on_tag<S, qkv::simd::Avx512Tag>());
#endif
  return runners;
}

/// What every grid case runs on: the dispatched fused kernel, the emulated 16-lane one and the reference backend.
template <class S>
std::vector<Runner<S>> every_path() {
  return {dispatched_fused<S>(), on_tag<S, qkv_test::Emulated16Tag>(), reference_backend<S>()};
}

// ---- cases ----------------------------------------------------------------------------------------------------------

/// A case: its shape (brute::Shape: B, Hq, Hkv, Sq, Skv, D, Dv; with varlen Sq and Skv are the views' row counts),
/// layout, options and the storage behind `bias` and `allowed`.
struct Case : brute::Shape {
  bool bshd = false;
  qkv::AttentionOptions<float> options{};
  std::vector<float> bias{};
  std::unique_ptr<bool[]> allowed{};

  std::string describe() const {
    const auto& o = options;
    std::ostringstream s;
    s << "B " << B << " Hq " << Hq << " Hkv " << Hkv << " Sq " << Sq << " Skv " << Skv << " D " << D << " Dv " << Dv
      << (bshd ? " bshd" : " bhsd") << " causal " << o.causal << " align "
      << (o.alignment == qkv::CausalAlignment::top_left ? "tl" : "br") << " window " << o.window_left << ","
      << o.window_right << " global " << o.global_tokens << " softcap " << o.softcap << " scale "
      << (o.scale ? std::to_string(*o.scale) : "-") << " key_lengths " << o.key_lengths.size() << " bias "
      << !bias.empty() << " allowed " << (allowed != nullptr) << " alibi " << o.alibi_slopes.size() << " sinks "
      << o.sinks.size() << " varlen " << o.cu_seqlens_q.size() << " global positions "
      << (o.global_positions
              ? "{" + std::to_string(o.global_positions->q_begin) + ", " + std::to_string(o.global_positions->k_begin) +
                    ", " + std::to_string(o.global_positions->sq) + ", " + std::to_string(o.global_positions->skv) + "}"
              : "-");
    return s.str();
  }
};

/// A case's inputs: the float query, the stored K and V, and the stored values converted to float (exactly).
template <class S>
struct Stored {
  std::vector<float> q;
  std::vector<S> k, v;
  std::vector<float> k_float, v_float;
};

/// q and k drawn 2·N(0, 1), v N(0, 1), in float; k and v then rounded to S.
template <class S>
Stored<S> draw(const brute::Shape& c, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::vector<float> q(static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.D)),
      k(static_cast<std::size_t>(c.B * c.Hkv * c.Skv * c.D)), v(static_cast<std::size_t>(c.B * c.Hkv * c.Skv * c.Dv));
  for (float& x : q) x = 2.0f * normal(rng);
  for (float& x : k) x = 2.0f * normal(rng);
  for (float& x : v) x = normal(rng);
  Stored<S> stored;
  stored.q = std::move(q);
  stored.k = to_storage<S>(k);
  stored.v = to_storage<S>(v);
  stored.k_float = widen(stored.k);
  stored.v_float = widen(stored.v);
  return stored;
}

/// The float64 output and lse of a case on its stored values (qkv's reference backend in double).
struct Float64 {
  std::vector<double> out, lse;
};

template <class S>
Float64 float64_of(const Case& c, const Stored<S>& in) {
  const brute::Params call = qkv_test::to_brute(c.options, c);
  const auto o64 = qkv_test::from_brute<double>(call, qkv::Backend::reference);
  const std::vector<double> q(in.q.begin(), in.q.end()), k(in.k_float.begin(), in.k_float.end()),
      v(in.v_float.begin(), in.v_float.end());
  Float64 r{std::vector<double>(static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.Dv)),
            std::vector<double>(static_cast<std::size_t>(c.B * c.Hq * c.Sq))};
  qkv::attention(make_view<const double>(q.data(), c.B, c.Hq, c.Sq, c.D, c.bshd),
                 make_view<const double>(k.data(), c.B, c.Hkv, c.Skv, c.D, c.bshd),
                 make_view<const double>(v.data(), c.B, c.Hkv, c.Skv, c.Dv, c.bshd),
                 make_view(r.out.data(), c.B, c.Hq, c.Sq, c.Dv, c.bshd),
                 qkv::TensorView3<double>(r.lse.data(), {c.B, c.Hq, c.Sq}), o64.options);
  return r;
}

/// Runs one case on every runner against float64 on the stored values and the plain float implementation on the same
/// values (each computed once); asserts the accuracy rule, NaN placement and lse for each runner.
template <class S>
void check_case(const Case& c, const Stored<S>& in, const std::vector<Runner<S>>& runners) {
  const std::size_t n_out = static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.Dv);
  const std::size_t n_lse = static_cast<std::size_t>(c.B * c.Hq * c.Sq);
  const auto q = make_view<const float>(in.q.data(), c.B, c.Hq, c.Sq, c.D, c.bshd);
  const auto k = make_view<const S>(in.k.data(), c.B, c.Hkv, c.Skv, c.D, c.bshd);
  const auto v = make_view<const S>(in.v.data(), c.B, c.Hkv, c.Skv, c.Dv, c.bshd);
  const Float64 ref = float64_of(c, in);
  std::vector<float> plain(n_out, 0.0f);
  qkv_test::plain_float(q, make_view<const float>(in.k_float.data(), c.B, c.Hkv, c.Skv, c.D, c.bshd),
                        make_view<const float>(in.v_float.data(), c.B, c.Hkv, c.Skv, c.Dv, c.bshd),
                        qkv_test::to_brute(c.options, c), make_view(plain.data(), c.B, c.Hq, c.Sq, c.Dv, c.bshd), {});
  double err_plain = 0, max_v = 0;
  for (float x : in.v_float) {
    if (std::isfinite(x)) max_v = std::max(max_v, std::fabs(double(x)));
  }
  for (std::size_t n = 0; n < n_out; ++n) {
    if (!std::isnan(ref.out[n])) err_plain = std::max(err_plain, std::fabs(plain[n] - ref.out[n]));
  }
  const double absolute = 1e-6 * std::max(1.0, max_v);

  for (const Runner<S>& runner : runners) {
    std::vector<float> out(n_out, -7.0f), lse(n_lse, -7.0f);
    runner.run(q, k, v, make_view(out.data(), c.B, c.Hq, c.Sq, c.Dv, c.bshd),
               qkv::TensorView3<float>(lse.data(), {c.B, c.Hq, c.Sq}), c.options);
    const std::string what = storage_name<S>() + " K/V, " + c.describe() + " on the " + runner.name;
    double err = 0;
    for (std::size_t n = 0; n < n_out; ++n) {
      ASSERT_EQ(std::isnan(out[n]), std::isnan(ref.out[n]))
          << what << ": element " << n << " is " << out[n] << ", float64 " << ref.out[n];
      if (!std::isnan(ref.out[n])) err = std::max(err, std::fabs(out[n] - ref.out[n]));
    }
    const double allowed = runner.reference ? absolute : 2 * err_plain + absolute;
    EXPECT_LE(err, allowed) << what << " (error " << err << ", plain float error " << err_plain << ")";
    const double lse_tolerance = runner.reference ? 1e-6 : 1e-4;
    for (std::size_t n = 0; n < n_lse; ++n) {
      if (std::isinf(ref.lse[n])) {
        EXPECT_EQ(lse[n], float(ref.lse[n])) << what << ": lse " << n;
      } else if (!std::isnan(ref.lse[n])) {
        EXPECT_NEAR(lse[n], ref.lse[n], lse_tolerance * std::max(1.0, std::fabs(ref.lse[n]))) << what << ": lse " << n;
      }
    }
  }
}

template <class S>
void check_case(const Case& c, unsigned seed, const std::vector<Runner<S>>& runners = every_path<S>()) {
  check_case(c, draw<S>(c, seed), runners);
}

/// The options a random case is sure to have (one per grid case, in turn), or none.
enum Option : int {
  kNoOption = -1,
  kCausalBottomRight,
  kCausalTopLeft,
  kWindow,
  kGlobalTokens,
  kSoftcap,
  kScale,
  kKeyLengths,
  kBias,
  kAllowed,
  kAlibi,
  kSinks,
  kGlobalPositions,
  kVarlen,
  kOptionCount
};

/// A random case: decoding (Sq·G ≤ 16 rows per kv head: K and V read in place) or prefill (more rows: packed), with
/// more keys than a split-K chunk (2048) when `long_keys`; the `forced` option always, the others at random.
Case random_case(std::mt19937& rng, int forced, bool decode, bool long_keys) {
  auto pick = [&](Index lo, Index hi) { return std::uniform_int_distribution<Index>(lo, hi)(rng); };
  auto coin = [&](double p) { return std::bernoulli_distribution(p)(rng); };
  auto on = [&](int option) { return option == forced || coin(0.15); };
  // Head dimensions: most are no multiple of a vector (16 lanes; 8 on AVX2). Long prefill cases keep D ≤ 64.
  const Index dims[] = {3, 15, 17, 33, 64, 80, 100, 128};
  const Index n_dims = decode || !long_keys ? 8 : 5;
  Case c;
  c.D = dims[pick(0, n_dims - 1)];
  c.Dv = coin(0.6) ? c.D : dims[pick(0, n_dims - 1)];
  c.B = pick(1, 2);
  if (decode) {
    // (Hq, Hkv): Llama's 32/8, GQA 4, MHA, MQA with G 8 and 16, G 2.
    static const Index heads[][2] = {{32, 8}, {8, 2}, {4, 4}, {8, 1}, {16, 1}, {2, 1}};
    const auto& h = heads[pick(0, 5)];
    c.Hq = h[0];
    c.Hkv = h[1];
    c.Sq = pick(1, std::min<Index>(3, 16 / (c.Hq / c.Hkv)));
    c.Skv = long_keys ? pick(2049, 4500) : pick(1, 700);
  } else {
    static const Index heads[][2] = {{4, 2}, {2, 2}, {8, 1}, {6, 3}, {4, 1}};  // G 2, 1, 8 (MQA), 2, 4
    const auto& h = heads[pick(0, 4)];
    c.Hq = h[0];
    c.Hkv = h[1];
    const Index G = c.Hq / c.Hkv;
    // Long keys: one query tile (at most kBlockM = 96 stacked rows), which splits its keys into chunks, or two.
    c.Sq = pick(16 / G + 1, long_keys ? (coin(0.7) ? 96 / G : 120 / G) : 160);
    c.Skv = long_keys ? pick(2049, 2700) : pick(1, 400);
  }
  c.bshd = coin(0.5);
  auto& o = c.options;
  o.alignment = coin(0.5) ? qkv::CausalAlignment::bottom_right : qkv::CausalAlignment::top_left;
  if (forced == kCausalBottomRight || forced == kCausalTopLeft) {
    o.causal = true;
    o.alignment = forced == kCausalTopLeft ? qkv::CausalAlignment::top_left : qkv::CausalAlignment::bottom_right;
  } else {
    o.causal = coin(0.3);
  }
  if (on(kWindow) || forced == kGlobalTokens) {
    o.window_left = pick(0, 300);
    if (coin(0.5)) o.window_right = pick(0, 60);
  }
  if (on(kGlobalTokens)) o.global_tokens = pick(1, 8);
  if (on(kSoftcap)) o.softcap = coin(0.5) ? 5.0f : 30.0f;
  // An explicit scale that keeps the scores' spread at or below the default's (σ ≈ 4 with q and k drawn 2·N(0, 1)):
  // with larger scores (|s| ≈ 30) the rounding of the scores alone dwarfs 1e-6, and the fused and plain float errors
  // become two independent draws of one size, for which "≤ 2×" is a coin toss (fuzz/README.md, the conditioned
  // domain; such a case fails the same way with float K/V, whose bits the 16-bit call reproduces).
  if (on(kScale)) o.scale = coin(0.5) ? 0.75f / std::sqrt(static_cast<float>(c.D)) : 0.05f;
  if (on(kAlibi)) {
    for (Index h = 0; h < c.Hq; ++h) o.alibi_slopes.push_back(std::ldexp(1.0f, -static_cast<int>(h % 8 + 1)));
  }
  if (on(kSinks)) {
    for (Index h = 0; h < c.Hq; ++h) o.sinks.push_back(static_cast<float>(pick(-3, 3)));
  }
  // Global positions (the call as one shard of a longer sequence) exclude varlen.
  const bool global_positions = forced != kVarlen && on(kGlobalPositions);
  if (forced == kVarlen ||
      (!global_positions && forced != kKeyLengths && forced != kBias && forced != kAllowed && coin(0.1))) {
    // A varlen batch of three sequences (some may be empty): decoding ones of Sq_b·G ≤ 16 rows, or prefill ones.
    const Index G = c.Hq / c.Hkv;
    c.B = 1;
    o.cu_seqlens_q = {0};
    o.cu_seqlens_k = {0};
    for (int s = 0; s < 3; ++s) {
      const Index sq = decode ? pick(s == 0 ? 1 : 0, std::max<Index>(1, std::min<Index>(3, 16 / G)))
                              : pick(s == 0 ? 16 / G + 1 : 0, 60);
      const Index skv = long_keys && s == 0 ? pick(2049, 2600) : pick(0, 300);
      o.cu_seqlens_q.push_back(o.cu_seqlens_q.back() + sq);
      o.cu_seqlens_k.push_back(o.cu_seqlens_k.back() + skv);
    }
    c.Sq = o.cu_seqlens_q.back();
    c.Skv = o.cu_seqlens_k.back();
    return c;
  }
  if (on(kKeyLengths)) {
    for (Index b = 0; b < c.B; ++b) o.key_lengths.push_back(coin(0.3) ? c.Skv : pick(0, c.Skv));
  }
  if (global_positions) {  // key_lengths above, in [0, Skv], are valid global lengths too (≤ skv)
    qkv::GlobalPositions g;
    g.q_begin = pick(0, 40);
    g.k_begin = pick(0, 40);
    g.sq = g.q_begin + c.Sq + pick(0, 40);
    g.skv = g.k_begin + c.Skv + pick(0, 40);
    o.global_positions = g;
  }
  if (on(kBias)) {
    // [1, Hq, Sq, Skv], or broadcast over heads (and rows) where that would be large; 10 % of it −∞.
    const Index Hb = c.Hq * c.Sq * c.Skv <= 300000 ? c.Hq : 1, Sb = c.Sq * c.Skv <= 300000 ? c.Sq : 1;
    c.bias.resize(static_cast<std::size_t>(Hb * Sb * c.Skv));
    std::normal_distribution<float> normal;
    for (float& x : c.bias) x = coin(0.1) ? -kInf : normal(rng);
    o.bias = qkv::TensorView4<const float>(c.bias.data(), {1, Hb, Sb, c.Skv});
  }
  if (on(kAllowed)) {
    // [B, 1, 1, Skv] or [B, Hq, Sq, Skv], 80 % true.
    const bool full = coin(0.5) && c.B * c.Hq * c.Sq * c.Skv <= 300000;
    const Index Ha = full ? c.Hq : 1, Sa = full ? c.Sq : 1;
    const std::size_t n = static_cast<std::size_t>(c.B * Ha * Sa * c.Skv);
    c.allowed.reset(new bool[n + 1]);
    for (std::size_t e = 0; e < n; ++e) c.allowed[e] = coin(0.8);
    o.allowed = qkv::TensorView4<const bool>(c.allowed.get(), {c.B, Ha, Sa, c.Skv});
  }
  return c;
}

// ---- rounding -------------------------------------------------------------------------------------------------------

std::string fixture_path(const std::string& name) { return std::string(QKV_TEST_FIXTURES_DIR) + "/" + name; }

const safetensors::File& torch_fixture() {
  static const safetensors::File file = safetensors::read(fixture_path("kv16_torch.safetensors"));
  return file;
}

/// A stored 16-bit value from its bit pattern (the fixture's I16 values: int16, widened to double).
template <class S>
S from_bits(double stored) {
  return Eigen::numext::bit_cast<S>(static_cast<std::uint16_t>(static_cast<std::int16_t>(stored)));
}

template <class S>
std::uint16_t bits_of(S x) {
  return Eigen::numext::bit_cast<std::uint16_t>(x);
}

TEST(Kv16Rounding, EigenRoundsAsPyTorch) {
  // Eigen's conversions, which the documentation tells users to store K and V with, give PyTorch's bits (round to
  // nearest even) on random values over many binades, exact ties, subnormals and the edges of half's range.
  const safetensors::File& f = torch_fixture();
  const auto& values = f.tensors.at("rounding.values").values;
  const auto& half_bits = f.tensors.at("rounding.half_bits").values;
  const auto& bf16_bits = f.tensors.at("rounding.bf16_bits").values;
  ASSERT_EQ(values.size(), half_bits.size());
  ASSERT_EQ(values.size(), bf16_bits.size());
  ASSERT_GT(values.size(), 1000u);
  for (std::size_t n = 0; n < values.size(); ++n) {
    const float x = static_cast<float>(values[n]);
    const Eigen::half h(x);
    const Eigen::bfloat16 b(x);
    if (std::isnan(x)) {  // NaN payloads are not specified: NaN is enough
      EXPECT_TRUE(std::isnan(static_cast<float>(h)));
      EXPECT_TRUE(std::isnan(static_cast<float>(b)));
      continue;
    }
    EXPECT_EQ(bits_of(h), bits_of(from_bits<Eigen::half>(half_bits[n]))) << "half(" << x << ")";
    EXPECT_EQ(bits_of(b), bits_of(from_bits<Eigen::bfloat16>(bf16_bits[n]))) << "bfloat16(" << x << ")";
  }
}

TEST(Kv16Rounding, FloatsAboveHalfsRangeBecomeInfinity) {
  // half's largest finite value is 65504; the next would be 65536, so from 65520 (halfway) up a float rounds to ±∞.
  EXPECT_EQ(rounded<Eigen::half>(65504.0f), 65504.0f);
  EXPECT_EQ(rounded<Eigen::half>(65519.0f), 65504.0f);
  EXPECT_EQ(rounded<Eigen::half>(65520.0f), kInf);
  EXPECT_EQ(rounded<Eigen::half>(7e4f), kInf);
  EXPECT_EQ(rounded<Eigen::half>(-1e5f), -kInf);
  EXPECT_EQ(rounded<Eigen::half>(3e38f), kInf);
  // bfloat16 keeps float's range: 1e5 and 3e38 stay finite (8 bits of precision).
  EXPECT_TRUE(std::isfinite(rounded<Eigen::bfloat16>(1e5f)));
  EXPECT_NEAR(rounded<Eigen::bfloat16>(1e5f), 1e5f, 1e5f / 256);
  EXPECT_TRUE(std::isfinite(rounded<Eigen::bfloat16>(3e38f)));
  // Subnormal halves are exact values too: 2^-24 is half's smallest.
  EXPECT_EQ(rounded<Eigen::half>(std::ldexp(1.0f, -24)), std::ldexp(1.0f, -24));
  EXPECT_EQ(rounded<Eigen::half>(std::ldexp(1.0f, -26)), 0.0f);
}

// ---- the grid -------------------------------------------------------------------------------------------------------

template <class S>
struct Kv16 : ::testing::Test {};
TYPED_TEST_SUITE(Kv16, Storages, );

TYPED_TEST(Kv16, RandomCasesWithEveryOption) {
  // Each option forced in turn (and the others at random) in a decoding case and a prefill case: causal in both
  // alignments, window, global tokens, softcap, scale, key_lengths, bias, allowed, ALiBi, sinks, global positions,
  // varlen; every third with more keys than a split-K chunk. Both layouts, GQA, MQA, D and Dv mostly no multiple of 16.
  using S = TypeParam;
  std::mt19937 rng(std::is_same_v<S, Eigen::half> ? 1601 : 1602);
  int n = 0;
  for (int forced = kNoOption; forced < kOptionCount; ++forced) {
    for (bool decode : {true, false}) {
      const bool long_keys = (forced + 1) % 3 == (decode ? 0 : 1);
      if (reduced_grid() && (long_keys || n % 3 != 0)) {
        ++n;
        continue;
      }
      const Case c = random_case(rng, forced, decode, long_keys);
      check_case<S>(c, static_cast<unsigned>(100 + n++));
      if (this->HasFailure()) return;
    }
  }
}

TYPED_TEST(Kv16, WholeGrid) {
  // The grid above with many more random cases: run by the dev-full test preset (QKV_FUSED_FULL=1, test_fused's full
  // grid switch) or with QKV_KV16_FULL=1.
  if (std::getenv("QKV_FUSED_FULL") == nullptr && std::getenv("QKV_KV16_FULL") == nullptr) {
    GTEST_SKIP() << "set QKV_FUSED_FULL=1 or QKV_KV16_FULL=1 (the dev-full test preset)";
  }
  using S = TypeParam;
  std::mt19937 rng(std::is_same_v<S, Eigen::half> ? 1701 : 1702);
  for (int trial = 0; trial < 400; ++trial) {
    const int forced = trial % (kOptionCount + 1) - 1;
    const Case c = random_case(rng, forced, trial % 2 == 0, trial % 5 == 0);
    check_case<S>(c, static_cast<unsigned>(2000 + trial));
    if (this->HasFailure()) return;
  }
}

TYPED_TEST(Kv16, DecodeOfLlamaShapePastTheSplitChunk) {
  // Sq = 1, Hq = 32, Hkv = 8 (G = 4: 4 rows per kv head, read in place), D = 128, Skv = 2300 (past a split-K chunk);
  // head-major, and token-major (BSHD: one task serves several kv heads) with key padding in a batch of 2; causal.
  using S = TypeParam;
  for (bool bshd : {false, true}) {
    Case c;
    static_cast<brute::Shape&>(c) = {bshd ? 2 : 1, 32, 8, 1, 2300, 128, 128};
    c.bshd = bshd;
    c.options.causal = true;
    if (bshd) c.options.key_lengths = {2300, 2101};
    check_case<S>(c, bshd ? 11u : 12u);
    if (this->HasFailure()) return;
  }
}

TYPED_TEST(Kv16, PrefillPastTheSplitChunk) {
  // Prefill of one query tile (Sq·G ≤ kBlockM = 96) over more keys than a split-K chunk (its chunks packed and merged
  // by lse), and of several tiles; D and Dv with tails; causal bottom-right (the diagonal in the last chunk), a window
  // hiding whole chunks, ALiBi with sinks.
  using S = TypeParam;
  struct Shape {
    Index Hq, Hkv, Sq, Skv, D, Dv;
  };
  const Shape shapes[] = {
      {2, 2, 9, 2049, 33, 33}, {4, 2, 40, 4200, 64, 50}, {4, 1, 24, 2500, 15, 80}, {2, 1, 130, 2300, 17, 16}};
  int n = 0;
  for (const Shape& s : shapes) {
    Case c;
    static_cast<brute::Shape&>(c) = {1, s.Hq, s.Hkv, s.Sq, s.Skv, s.D, s.Dv};
    c.bshd = n % 2 == 1;
    if (n == 0 || n == 3) c.options.causal = true;
    if (n == 1) c.options.window_left = 700, c.options.window_right = 10;
    if (n == 2) {
      for (Index h = 0; h < s.Hq; ++h) {
        c.options.alibi_slopes.push_back(std::ldexp(1.0f, -static_cast<int>(h + 4)));
        c.options.sinks.push_back(0.5f * static_cast<float>(h));
      }
    }
    check_case<S>(c, static_cast<unsigned>(300 + n++));
    if (this->HasFailure() || reduced_grid()) return;
  }
}

TYPED_TEST(Kv16, VarlenMixesDecodingAndPrefillSequences) {
  // One varlen call whose sequences take both paths: decoding ones (Sq_b·G ≤ 16: K and V read in place) and prefill
  // ones (packed), an empty one and one past a split-K chunk; causal, GQA 4, both layouts.
  using S = TypeParam;
  for (bool bshd : {false, true}) {
    Case c;
    static_cast<brute::Shape&>(c) = {1, 8, 2, 0, 0, 40, 24};
    c.bshd = bshd;
    c.options.causal = true;
    c.options.cu_seqlens_q = {0, 1, 31, 31, 34, 38};          // 1, 30, 0, 3, 4 queries: 4, 120, 0, 12, 16 rows
    c.options.cu_seqlens_k = {0, 500, 540, 560, 2660, 2700};  // 500, 40, 20, 2100, 40 keys
    c.Sq = c.options.cu_seqlens_q.back();
    c.Skv = c.options.cu_seqlens_k.back();
    check_case<S>(c, bshd ? 21u : 22u);
    if (this->HasFailure()) return;
  }
}

TYPED_TEST(Kv16, VectorTailsAndTileEdges) {
  // D and Dv below, at and past a vector, a packed panel and a value chunk, in decoding (6, 3 and 12 rows) and prefill
  // (24 rows); key counts around a panel (32 keys on AVX2, 64 on 16 lanes) and a key tile (256; 512 on 16 lanes).
  using S = TypeParam;
  const Index dims[][2] = {{1, 1}, {3, 15}, {7, 9}, {16, 17}, {31, 33}, {57, 63}, {65, 80}, {100, 127}, {128, 130}};
  const Index keys[] = {1, 31, 33, 63, 65, 257, 513};
  struct Rows {
    Index Hq, Hkv, Sq;
  };
  const Rows rows[] = {{4, 2, 12}, {6, 1, 1}, {2, 2, 3}, {12, 1, 1}};
  int n = 0;
  for (std::size_t i = 0; i < std::size(dims); ++i) {
    for (std::size_t j = 0; j < std::size(keys); ++j, ++n) {
      if (n % (reduced_grid() ? 9 : 3) != 0) continue;
      const Rows& r = rows[(i + j) % std::size(rows)];
      Case c;
      static_cast<brute::Shape&>(c) = {1, r.Hq, r.Hkv, r.Sq, keys[j], dims[i][0], dims[i][1]};
      c.bshd = n % 4 == 1;
      c.options.causal = n % 2 == 0;
      if (n % 5 == 2) c.options.key_lengths = {std::max<Index>(0, keys[j] - 7)};
      check_case<S>(c, static_cast<unsigned>(400 + n));
      if (this->HasFailure()) return;
    }
  }
}

// Every kernel copy the build compiled (runtime dispatch: scalar, AVX2 and AVX-512 in a plain build) and the emulated
// 16-lane one, on both storage types, each against float64 on the stored values; a kernel this CPU cannot run is
// skipped.
template <class Tag>
struct Kv16PerTag : ::testing::Test {};
TYPED_TEST_SUITE(Kv16PerTag, qkv_test::KernelTags, );

template <class S, class Tag>
void check_tag_cases() {
  std::mt19937 rng(std::is_same_v<S, Eigen::half> ? 31 : 32);
  for (int trial = 0; trial < 4; ++trial) {
    const bool decode = trial % 2 == 0;
    const Case c = random_case(rng, 3 * trial + 1, decode, trial == 2);
    check_case<S>(c, static_cast<unsigned>(500 + trial), {on_tag<S, Tag>()});
    if (::testing::Test::HasFailure()) return;
  }
}

TYPED_TEST(Kv16PerTag, MatchesFloat64OnTheStoredValues) {
  if (!qkv_test::cpu_runs<TypeParam>()) GTEST_SKIP() << "this CPU cannot run the " << TypeParam::kName << " kernel";
  check_tag_cases<Eigen::half, TypeParam>();
  check_tag_cases<Eigen::bfloat16, TypeParam>();
}

// ---- stored ±∞ and NaN ----------------------------------------------------------------------------------------------

/// out of a call on 16-bit K/V, and of the float call on the same values converted (fused, or reference), with lse.
template <class S>
struct TwoCalls {
  std::vector<float> out16, lse16, out32, lse32;
};

template <class S>
TwoCalls<S> run_both(const Case& c, const std::vector<float>& q, const std::vector<S>& k, const std::vector<S>& v,
                     qkv::Backend backend) {
  TwoCalls<S> r;
  const std::size_t n_out = static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.Dv),
                    n_lse = static_cast<std::size_t>(c.B * c.Hq * c.Sq);
  r.out16.assign(n_out, -7.0f);
  r.out32.assign(n_out, -7.0f);
  r.lse16.assign(n_lse, -7.0f);
  r.lse32.assign(n_lse, -7.0f);
  qkv::AttentionOptions<float> options = c.options;
  options.backend = backend;
  const auto qv = make_view<const float>(q.data(), c.B, c.Hq, c.Sq, c.D, c.bshd);
  qkv::attention(qv, make_view<const S>(k.data(), c.B, c.Hkv, c.Skv, c.D, c.bshd),
                 make_view<const S>(v.data(), c.B, c.Hkv, c.Skv, c.Dv, c.bshd),
                 make_view(r.out16.data(), c.B, c.Hq, c.Sq, c.Dv, c.bshd),
                 qkv::TensorView3<float>(r.lse16.data(), {c.B, c.Hq, c.Sq}), options);
  const std::vector<float> kf = widen(k), vf = widen(v);
  qkv::attention(qv, make_view<const float>(kf.data(), c.B, c.Hkv, c.Skv, c.D, c.bshd),
                 make_view<const float>(vf.data(), c.B, c.Hkv, c.Skv, c.Dv, c.bshd),
                 make_view(r.out32.data(), c.B, c.Hq, c.Sq, c.Dv, c.bshd),
                 qkv::TensorView3<float>(r.lse32.data(), {c.B, c.Hq, c.Sq}), options);
  return r;
}

/// The element of a BHSD or BSHD tensor [B, H, S, D] stored densely.
template <class T>
T& at(std::vector<T>& x, bool bshd, Index H, Index S, Index D, Index b, Index h, Index s, Index d) {
  return x[static_cast<std::size_t>(bshd ? ((b * S + s) * H + h) * D + d : ((b * H + h) * S + s) * D + d)];
}

template <class S>
void expect_same_as_float_call(const Case& c, const TwoCalls<S>& r, const std::string& what) {
  for (std::size_t n = 0; n < r.out16.size(); ++n) {
    ASSERT_TRUE(same_value(r.out16[n], r.out32[n]))
        << what << ": out element " << n << " is " << r.out16[n] << " with " << storage_name<S>() << " K/V, "
        << r.out32[n] << " with the same values in float (" << c.describe() << ")";
  }
  for (std::size_t n = 0; n < r.lse16.size(); ++n) {
    ASSERT_TRUE(same_value(r.lse16[n], r.lse32[n]))
        << what << ": lse " << n << " is " << r.lse16[n] << " with " << storage_name<S>() << " K/V, " << r.lse32[n]
        << " in float (" << c.describe() << ")";
  }
}

template <class S>
struct Kv16NonFinite : ::testing::Test {};
TYPED_TEST_SUITE(Kv16NonFinite, Storages, );

TYPED_TEST(Kv16NonFinite, VisibleNaNAndInfinityBehaveAsInFloat) {
  // A stored NaN in a visible key of kv head 0 makes the rows of its query heads NaN (and only those); +∞ in a visible
  // value of kv head 1, −∞ in a key of kv head 2: the same outputs (NaN, ±∞ and finite values, bit for bit) as the
  // float call on the same values. Decoding (Sq·G = 2) and prefill (Sq·G = 60) shapes, both layouts, both backends.
  using S = TypeParam;
  for (Index sq : {Index(1), Index(30)}) {
    for (bool bshd : {false, true}) {
      for (qkv::Backend backend : {qkv::Backend::fused, qkv::Backend::reference}) {
        Case c;
        static_cast<brute::Shape&>(c) = {1, 6, 3, sq, 300, 20, 12};
        c.bshd = bshd;
        Stored<S> in = draw<S>(c, 41);
        for (Index d = 0; d < c.D; ++d) {
          at(in.k, bshd, c.Hkv, c.Skv, c.D, 0, 0, 17, d) = S(d == 3 ? kNaN : 0.5f);
          at(in.k, bshd, c.Hkv, c.Skv, c.D, 0, 2, 250, d) = S(d == 0 ? -kInf : 0.25f);
        }
        at(in.v, bshd, c.Hkv, c.Skv, c.Dv, 0, 1, 100, 5) = S(kInf);
        const TwoCalls<S> r = run_both<S>(c, in.q, in.k, in.v, backend);
        const std::string what = std::string(backend == qkv::Backend::fused ? "fused" : "reference") + ", Sq " +
                                 std::to_string(sq) + (bshd ? ", bshd" : ", bhsd");
        expect_same_as_float_call(c, r, what);
        // What float semantics say, independently: heads 0 and 1 (kv head 0) NaN in every element; heads 2 and 3
        // (kv head 1) +∞ in column 5 (a positive weight times +∞) and finite elsewhere. Heads 4 and 5 score key 250 as
        // −∞·q_0 + finite: +∞ (the row NaN) or −∞ (the key hidden) by the sign of q_0, checked by the float call above.
        auto out = r.out16;
        for (Index h = 0; h < c.Hq; ++h)
          for (Index i = 0; i < sq; ++i)
            for (Index d = 0; d < c.Dv; ++d) {
              const float x = at(out, bshd, c.Hq, sq, c.Dv, 0, h, i, d);
              if (h < 2) {
                EXPECT_TRUE(std::isnan(x)) << what << ": head " << h << " row " << i << " d " << d << " is " << x;
              } else if (h < 4) {
                EXPECT_TRUE(d == 5 ? x == kInf : std::isfinite(x))
                    << what << ": head " << h << " row " << i << " d " << d << " is " << x;
              }
            }
        if (this->HasFailure()) return;
      }
    }
  }
}

TYPED_TEST(Kv16NonFinite, HiddenNaNAndInfinityNeverReachTheOutput) {
  // NaN, +∞ and −∞ stored in the K and V slots that no query may see give the same bits as the same call with zeros
  // there (and as the float call on the converted values), all finite. One hiding rule at a time, each poisoning
  // exactly the slots it hides from every row: keys past key_lengths, a key under allowed = false, a key under a −∞
  // bias, keys past every row's causal diagonal (top-left: keys ≥ Sq), keys left of every row's window (bottom-right:
  // keys < Skv − Sq − window_left). Decoding (Sq·G = 4) and prefill (Sq·G = 80) shapes, both layouts, both backends.
  using S = TypeParam;
  const float poisons[] = {kNaN, kInf, -kInf};
  enum Rule { kByKeyLengths, kByAllowed, kByBias, kByCausal, kByWindow, kRules };
  int n = 0;
  for (int rule = 0; rule < kRules; ++rule) {
    for (Index sq : {Index(2), Index(40)}) {
      for (bool bshd : {false, true}) {
        for (qkv::Backend backend : {qkv::Backend::fused, qkv::Backend::reference}) {
          const float poison = poisons[n++ % 3];
          Case c;
          static_cast<brute::Shape&>(c) = {2, 4, 2, sq, 90, 24, 16};
          c.bshd = bshd;
          std::function<bool(Index, Index)> hidden;  // (b, j): hidden from every query of batch entry b
          if (rule == kByKeyLengths) {
            c.options.key_lengths = {90, 70};
            hidden = [](Index b, Index j) { return b == 1 && j >= 70; };
          } else if (rule == kByAllowed) {
            c.allowed.reset(new bool[2 * 90]);
            for (Index e = 0; e < 2 * 90; ++e) c.allowed[static_cast<std::size_t>(e)] = e % 90 != 5;
            c.options.allowed = qkv::TensorView4<const bool>(c.allowed.get(), {2, 1, 1, 90});
            hidden = [](Index, Index j) { return j == 5; };
          } else if (rule == kByBias) {
            c.bias.assign(90, 0.5f);
            c.bias[11] = -kInf;
            c.options.bias = qkv::TensorView4<const float>(c.bias.data(), {1, 1, 1, 90});
            hidden = [](Index, Index j) { return j == 11; };
          } else if (rule == kByCausal) {
            c.options.causal = true;
            c.options.alignment = qkv::CausalAlignment::top_left;
            hidden = [sq](Index, Index j) { return j >= sq; };
          } else {
            c.options.window_left = 10;  // bottom-right: query i sees keys j ≥ i + 90 − Sq − 10
            hidden = [sq](Index, Index j) { return j < 90 - sq - 10; };
          }
          Stored<S> in = draw<S>(c, 43);
          Stored<S> clean = in;
          for (Index b = 0; b < 2; ++b)
            for (Index h = 0; h < c.Hkv; ++h)
              for (Index j = 0; j < c.Skv; ++j) {
                if (!hidden(b, j)) continue;
                for (Index d = 0; d < c.D; ++d) {
                  at(in.k, bshd, c.Hkv, c.Skv, c.D, b, h, j, d) = S(poison);
                  at(clean.k, bshd, c.Hkv, c.Skv, c.D, b, h, j, d) = S(0.0f);
                }
                for (Index d = 0; d < c.Dv; ++d) {
                  at(in.v, bshd, c.Hkv, c.Skv, c.Dv, b, h, j, d) = S(poison);
                  at(clean.v, bshd, c.Hkv, c.Skv, c.Dv, b, h, j, d) = S(0.0f);
                }
              }
          const TwoCalls<S> poisoned = run_both<S>(c, in.q, in.k, in.v, backend);
          const TwoCalls<S> zeros = run_both<S>(c, clean.q, clean.k, clean.v, backend);
          const std::string what = std::string(backend == qkv::Backend::fused ? "fused" : "reference") + ", rule " +
                                   std::to_string(rule) + ", Sq " + std::to_string(sq) + (bshd ? ", bshd" : ", bhsd") +
                                   ", poison " + std::to_string(poison);
          expect_same_as_float_call(c, poisoned, what);
          for (std::size_t e = 0; e < poisoned.out16.size(); ++e) {
            ASSERT_TRUE(std::isfinite(poisoned.out16[e])) << what << ": element " << e;
            ASSERT_TRUE(same_bits(poisoned.out16[e], zeros.out16[e])) << what << ": element " << e;
          }
          for (std::size_t e = 0; e < poisoned.lse16.size(); ++e) {
            ASSERT_TRUE(same_bits(poisoned.lse16[e], zeros.lse16[e])) << what << ": lse " << e;
          }
          if (this->HasFailure()) return;
        }
      }
    }
  }
}

TEST(Kv16NonFinite, FloatsAboveHalfsRangeStoredAsInfinityBehaveAsInFloat) {
  // Data rounded to half: a key component of 1e5 becomes +∞ (so its scores ±∞ by the sign of q and the row NaN or
  // one-hot as float says) and a value of −7e4 becomes −∞; the call equals the float call on the converted values.
  // The same data rounded to bfloat16 stays finite and within the accuracy rule of float64.
  Case c;
  static_cast<brute::Shape&>(c) = {1, 4, 2, 3, 50, 16, 8};
  Stored<Eigen::half> in = draw<Eigen::half>(c, 45);
  std::vector<float> k = widen(in.k), v = widen(in.v);
  k[static_cast<std::size_t>((0 * 50 + 7) * 16 + 2)] = 1e5f;   // kv head 0, key 7
  v[static_cast<std::size_t>((1 * 50 + 30) * 8 + 4)] = -7e4f;  // kv head 1, key 30
  const std::vector<Eigen::half> k16 = to_storage<Eigen::half>(k), v16 = to_storage<Eigen::half>(v);
  EXPECT_EQ(static_cast<float>(k16[(0 * 50 + 7) * 16 + 2]), kInf);
  EXPECT_EQ(static_cast<float>(v16[(1 * 50 + 30) * 8 + 4]), -kInf);
  for (qkv::Backend backend : {qkv::Backend::fused, qkv::Backend::reference}) {
    const TwoCalls<Eigen::half> r = run_both<Eigen::half>(c, in.q, k16, v16, backend);
    expect_same_as_float_call(c, r, backend == qkv::Backend::fused ? "fused" : "reference");
    // Heads 2 and 3 (kv head 1) put a positive weight on the −∞ value: −∞ in column 4 (or NaN where another value
    // is +∞, which there is not).
    for (Index h = 2; h < 4; ++h)
      for (Index i = 0; i < 3; ++i) EXPECT_EQ(r.out16[static_cast<std::size_t>((h * 3 + i) * 8 + 4)], -kInf);
    // Heads 0 and 1 see a score of ±∞ at key 7: NaN rows (+∞ score) or rows that ignore key 7 (−∞ score), by q's sign.
    for (Index h = 0; h < 2; ++h)
      for (Index i = 0; i < 3; ++i) {
        const float q2 = in.q[static_cast<std::size_t>((h * 3 + i) * 16 + 2)];
        const float x = r.out16[static_cast<std::size_t>((h * 3 + i) * 8)];
        if (q2 > 0) {
          EXPECT_TRUE(std::isnan(x)) << "head " << h << " row " << i;
        } else if (q2 < 0) {
          EXPECT_TRUE(std::isfinite(x)) << "head " << h << " row " << i;
        }
      }
  }
  // bfloat16: the same float data stays finite.
  Case b;
  static_cast<brute::Shape&>(b) = {1, 4, 2, 3, 50, 16, 8};
  Stored<Eigen::bfloat16> in16;
  in16.q = in.q;
  in16.k = to_storage<Eigen::bfloat16>(k);
  in16.v = to_storage<Eigen::bfloat16>(v);
  in16.k_float = widen(in16.k);
  in16.v_float = widen(in16.v);
  EXPECT_TRUE(std::isfinite(in16.k_float[(0 * 50 + 7) * 16 + 2]));
  check_case<Eigen::bfloat16>(b, in16, every_path<Eigen::bfloat16>());
}

// ---- PyTorch fixtures -----------------------------------------------------------------------------------------------

/// A case of tests/fixtures/kv16_torch.safetensors: its shape and options, q, the stored K and V, and PyTorch's float64
/// out and lse on those stored values.
template <class S>
struct TorchCase {
  Case c;
  Stored<S> in;
  std::vector<double> out, lse;
};

template <class S>
TorchCase<S> torch_case(const std::string& name) {
  const safetensors::File& f = torch_fixture();
  const auto& config = f.tensors.at(name + ".config").values;
  TorchCase<S> t;
  static_cast<brute::Shape&>(t.c) = {static_cast<long>(config[0]), static_cast<long>(config[1]),
                                     static_cast<long>(config[2]), static_cast<long>(config[3]),
                                     static_cast<long>(config[4]), static_cast<long>(config[5]),
                                     static_cast<long>(config[6])};
  t.c.options.causal = config[7] != 0;
  t.c.options.alignment = qkv::CausalAlignment::top_left;  // PyTorch's triu mask
  t.c.options.scale = static_cast<float>(config[8]);
  EXPECT_EQ(config[9], (std::is_same_v<S, Eigen::half> ? 0.0 : 1.0)) << name << ": storage type";
  if (f.tensors.count(name + ".key_lengths")) {
    for (double x : f.tensors.at(name + ".key_lengths").values)
      t.c.options.key_lengths.push_back(static_cast<Index>(x));
  }
  for (double x : f.tensors.at(name + ".q").values) t.in.q.push_back(static_cast<float>(x));
  for (double x : f.tensors.at(name + ".k_bits").values) t.in.k.push_back(from_bits<S>(x));
  for (double x : f.tensors.at(name + ".v_bits").values) t.in.v.push_back(from_bits<S>(x));
  t.in.k_float = widen(t.in.k);
  t.in.v_float = widen(t.in.v);
  t.out = f.tensors.at(name + ".out").values;
  t.lse = f.tensors.at(name + ".lse").values;
  const auto& c = t.c;
  EXPECT_EQ(t.in.q.size(), static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.D)) << name;
  EXPECT_EQ(t.in.k.size(), static_cast<std::size_t>(c.B * c.Hkv * c.Skv * c.D)) << name;
  EXPECT_EQ(t.in.v.size(), static_cast<std::size_t>(c.B * c.Hkv * c.Skv * c.Dv)) << name;
  EXPECT_EQ(t.out.size(), static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.Dv)) << name;
  return t;
}

/// [B, H, S, D] dense BHSD → dense BSHD.
template <class T>
std::vector<T> to_bshd(const std::vector<T>& x, Index B, Index H, Index S, Index D) {
  std::vector<T> y(x.size());
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      for (Index s = 0; s < S; ++s)
        for (Index d = 0; d < D; ++d)
          y[static_cast<std::size_t>(((b * S + s) * H + h) * D + d)] =
              x[static_cast<std::size_t>(((b * H + h) * S + s) * D + d)];
  return y;
}

template <class S>
void check_torch_case(const std::string& name) {
  TorchCase<S> t = torch_case<S>(name);
  ASSERT_FALSE(::testing::Test::HasFailure());
  const Case& c = t.c;
  // The plain float implementation on the same stored values: the yardstick of the rule.
  const brute::Params call = qkv_test::to_brute(c.options, c);
  std::vector<float> plain(t.out.size());
  qkv_test::plain_float(qkv::view_bhsd<const float>(t.in.q.data(), c.B, c.Hq, c.Sq, c.D),
                        qkv::view_bhsd<const float>(t.in.k_float.data(), c.B, c.Hkv, c.Skv, c.D),
                        qkv::view_bhsd<const float>(t.in.v_float.data(), c.B, c.Hkv, c.Skv, c.Dv), call,
                        qkv::view_bhsd(plain.data(), c.B, c.Hq, c.Sq, c.Dv), {});
  double err_plain = 0, max_v = 0;
  for (std::size_t n = 0; n < plain.size(); ++n) err_plain = std::max(err_plain, std::fabs(plain[n] - t.out[n]));
  for (float x : t.in.v_float) max_v = std::max(max_v, std::fabs(double(x)));
  const double absolute = 1e-6 * std::max(1.0, max_v);
  for (bool bshd : {false, true}) {
    const std::vector<float> q = bshd ? to_bshd(t.in.q, c.B, c.Hq, c.Sq, c.D) : t.in.q;
    const std::vector<S> k = bshd ? to_bshd(t.in.k, c.B, c.Hkv, c.Skv, c.D) : t.in.k;
    const std::vector<S> v = bshd ? to_bshd(t.in.v, c.B, c.Hkv, c.Skv, c.Dv) : t.in.v;
    for (const Runner<S>& runner : every_path<S>()) {
      std::vector<float> out(t.out.size(), kNaN), lse(t.lse.size(), kNaN);
      runner.run(make_view<const float>(q.data(), c.B, c.Hq, c.Sq, c.D, bshd),
                 make_view<const S>(k.data(), c.B, c.Hkv, c.Skv, c.D, bshd),
                 make_view<const S>(v.data(), c.B, c.Hkv, c.Skv, c.Dv, bshd),
                 make_view(out.data(), c.B, c.Hq, c.Sq, c.Dv, bshd),
                 qkv::TensorView3<float>(lse.data(), {c.B, c.Hq, c.Sq}), c.options);
      const std::vector<float> out_bhsd = bshd ? [&] {
        std::vector<float> y(out.size());
        for (Index b = 0; b < c.B; ++b)
          for (Index h = 0; h < c.Hq; ++h)
            for (Index i = 0; i < c.Sq; ++i)
              for (Index d = 0; d < c.Dv; ++d)
                y[static_cast<std::size_t>(((b * c.Hq + h) * c.Sq + i) * c.Dv + d)] =
                    out[static_cast<std::size_t>(((b * c.Sq + i) * c.Hq + h) * c.Dv + d)];
        return y;
      }()
                                               : out;
      double err = 0;
      for (std::size_t n = 0; n < out.size(); ++n) {
        ASSERT_TRUE(std::isfinite(out_bhsd[n])) << name << " on the " << runner.name << ": element " << n;
        err = std::max(err, std::fabs(out_bhsd[n] - t.out[n]));
      }
      const double allowed = runner.reference ? absolute : 2 * err_plain + absolute;
      EXPECT_LE(err, allowed) << name << (bshd ? " (bshd)" : " (bhsd)") << " on the " << runner.name << ": error "
                              << err << " against PyTorch's float64, plain float error " << err_plain;
      for (std::size_t n = 0; n < lse.size(); ++n) {
        EXPECT_NEAR(lse[n], t.lse[n], (runner.reference ? 1e-6 : 1e-4) * std::max(1.0, std::fabs(t.lse[n])))
            << name << " on the " << runner.name << ": lse " << n;
      }
    }
  }
}

TEST(Kv16Torch, HalfKeysAndValues) {
  for (const char* name : {"half_gqa", "half_decode", "half_long"}) {
    check_torch_case<Eigen::half>(name);
    if (HasFailure()) return;
  }
}

TEST(Kv16Torch, BFloat16KeysAndValues) {
  for (const char* name : {"bf16_causal", "bf16_decode"}) {
    check_torch_case<Eigen::bfloat16>(name);
    if (HasFailure()) return;
  }
}

// ---- it reads 16 bits -----------------------------------------------------------------------------------------------

template <class S>
struct Kv16Memory : ::testing::Test {};
TYPED_TEST_SUITE(Kv16Memory, Storages, );

/// What one fused call on 16-bit K/V of the given shape allocates (K/V constant, so out is known: the mean of V).
template <class S>
qkv_test::AllocationCount allocation_of(Index Hq, Index Hkv, Index Sq, Index Skv, Index D, bool bshd) {
  std::vector<float> q(static_cast<std::size_t>(Hq * Sq * D), 0.01f), out(q.size(), kNaN);
  const std::vector<S> k(static_cast<std::size_t>(Hkv * Skv * D), S(0.02f)), v(k.size(), S(1.0f));
  qkv::AttentionOptions<float> o;
  o.backend = qkv::Backend::fused;
  qkv::release_workspace();  // what the call itself allocates, not what earlier calls left on this thread
  const qkv_test::AllocationCount count = qkv_test::count_allocations([&] {
    qkv::attention(make_view<const float>(q.data(), 1, Hq, Sq, D, bshd),
                   make_view<const S>(k.data(), 1, Hkv, Skv, D, bshd),
                   make_view<const S>(v.data(), 1, Hkv, Skv, D, bshd), make_view(out.data(), 1, Hq, Sq, D, bshd), o);
  });
  for (float x : out) EXPECT_NEAR(x, 1.0f, 1e-6f);  // every row: the mean of equal values
  return count;
}

TYPED_TEST(Kv16Memory, DecodingAllocatesLessThanAQuarterOfFloatKV) {
  // Sq = 1, Hq = 32, Hkv = 8, D = 128, Skv = 4096: K and V in float are 32 MiB. A widening copy of either would be
  // 16 MiB; the decoding kernel reads the 16-bit values in place, and allocates only scratch and split-K partials.
  if (!QKV_COUNTS_ALLOCATIONS) GTEST_SKIP() << "ThreadSanitizer build: operator new is TSan's, not counted";
  using S = TypeParam;
  const Index Hq = 32, Hkv = 8, Sq = 1, Skv = 4096, D = 128;
  const std::size_t float_kv_bytes = 2 * static_cast<std::size_t>(Hkv * Skv * D) * sizeof(float);
  for (bool bshd : {false, true}) {
    const qkv_test::AllocationCount count = allocation_of<S>(Hq, Hkv, Sq, Skv, D, bshd);
    EXPECT_LT(count.bytes, float_kv_bytes / 4) << (bshd ? "bshd" : "bhsd") << ": allocated " << count.bytes;
    std::cout << "[ memory ] " << storage_name<TypeParam>() << (bshd ? " bshd" : " bhsd") << " decode allocates "
              << count.bytes << " bytes (largest " << count.largest << "); float K and V are " << float_kv_bytes
              << "\n";
  }
}

TYPED_TEST(Kv16Memory, PrefillAllocatesThePackedFloatCopiesAndNoMore) {
  // Prefill packs K and V once, converted to float: the float size of K and V (D = 128 and Skv = 4096 need no padding;
  // one kv head's on one thread, which packs each head just before its tasks), as the float call does; besides, both
  // calls allocate the same scratch (a few hundred KiB: Q blocks, accumulators, split-K slots), and the 16-bit one a
  // converted key row of D floats per thread (pack_keys' bound). So the 16-bit call allocates at most the float call on
  // the same shape plus those rows — no widened copy of K or V besides the packed ones (either would be another half of
  // the float K/V size); its largest allocation is one packed copy, the float size of K; and the scratch beyond the
  // packed copies is small next to them.
  if (!QKV_COUNTS_ALLOCATIONS) GTEST_SKIP() << "ThreadSanitizer build: operator new is TSan's, not counted";
  using S = TypeParam;
  const Index Hq = 8, Hkv = 2, Sq = 128, Skv = 4096, D = 128;
#if defined(_OPENMP)
  const std::size_t threads = static_cast<std::size_t>(omp_get_max_threads());
#else
  const std::size_t threads = 1;
#endif
  // A team has room for both kv heads' packed K and V; one thread packs each just before its own tasks, in one head's
  // room.
  const std::size_t packed_heads = threads > 1 ? static_cast<std::size_t>(Hkv) : 1;
  const std::size_t float_k_bytes = packed_heads * static_cast<std::size_t>(Skv * D) * sizeof(float);
  const std::size_t float_kv_bytes = 2 * float_k_bytes;
  const qkv_test::AllocationCount float_call = allocation_of<float>(Hq, Hkv, Sq, Skv, D, false);
  const qkv_test::AllocationCount count = allocation_of<S>(Hq, Hkv, Sq, Skv, D, false);
  std::cout << "[ memory ] " << storage_name<TypeParam>() << " prefill allocates " << count.bytes << " bytes (largest "
            << count.largest << "), the float call " << float_call.bytes << "; float K and V are " << float_kv_bytes
            << "\n";
  EXPECT_LE(count.bytes, float_call.bytes + threads * static_cast<std::size_t>(D) * sizeof(float));
  EXPECT_GE(float_call.bytes, float_kv_bytes);  // the float call's own packed copies, which the bound above includes
  EXPECT_LE(float_call.bytes - float_kv_bytes, float_kv_bytes / 16) << "the float call's scratch";
  EXPECT_LE(count.largest, float_k_bytes);
}

// ---- threads --------------------------------------------------------------------------------------------------------

/// out and lse of a decoding call (Sq = 1, Hq = 32, Hkv = 8, D = 128, Skv = 3000, BSHD, causal: split-K chunks) and of
/// a prefill call (Sq = 200, Hq = 8, Hkv = 2, Skv = 1200, D = 64, BHSD, causal, sinks) on 16-bit K/V with `threads`
/// OpenMP threads; both are large enough for the kernel to open a team.
template <class S>
std::vector<float> run_with_threads(int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#else
  (void)threads;
#endif
  std::vector<float> result;
  for (bool decode : {true, false}) {
    Case c;
    static_cast<brute::Shape&>(c) =
        decode ? brute::Shape{1, 32, 8, 1, 3000, 128, 128} : brute::Shape{1, 8, 2, 200, 1200, 64, 64};
    c.bshd = decode;
    c.options.causal = true;
    if (!decode) c.options.sinks.assign(8, 1.0f);
    const Stored<S> in = draw<S>(c, 61);
    std::vector<float> out(static_cast<std::size_t>(c.Hq * c.Sq * c.Dv)), lse(static_cast<std::size_t>(c.Hq * c.Sq));
    qkv::AttentionOptions<float> o = c.options;
    o.backend = qkv::Backend::fused;
    qkv::attention(make_view<const float>(in.q.data(), 1, c.Hq, c.Sq, c.D, c.bshd),
                   make_view<const S>(in.k.data(), 1, c.Hkv, c.Skv, c.D, c.bshd),
                   make_view<const S>(in.v.data(), 1, c.Hkv, c.Skv, c.Dv, c.bshd),
                   make_view(out.data(), 1, c.Hq, c.Sq, c.Dv, c.bshd),
                   qkv::TensorView3<float>(lse.data(), {1, c.Hq, c.Sq}), o);
    result.insert(result.end(), out.begin(), out.end());
    result.insert(result.end(), lse.begin(), lse.end());
  }
  return result;
}

template <class S>
struct Kv16Threads : ::testing::Test {};
TYPED_TEST_SUITE(Kv16Threads, Storages, );

TYPED_TEST(Kv16Threads, BitIdenticalForOneTwoAndThreeThreads) {
#if defined(_OPENMP)
  const int before = omp_get_max_threads();
#endif
  const std::vector<float> one = run_with_threads<TypeParam>(1), two = run_with_threads<TypeParam>(2),
                           three = run_with_threads<TypeParam>(3);
#if defined(_OPENMP)
  omp_set_num_threads(before);
#endif
  ASSERT_EQ(one.size(), two.size());
  ASSERT_EQ(one.size(), three.size());
  for (std::size_t n = 0; n < one.size(); ++n) {
    ASSERT_TRUE(same_bits(one[n], two[n]))
        << "element " << n << ": " << one[n] << " with 1 thread, " << two[n] << " with 2";
    ASSERT_TRUE(same_bits(one[n], three[n]))
        << "element " << n << ": " << one[n] << " with 1 thread, " << three[n] << " with 3";
  }
}

// ---- nothing accumulated in 16 bits ---------------------------------------------------------------------------------

template <class S>
struct Kv16Exactness : ::testing::Test {};
TYPED_TEST_SUITE(Kv16Exactness, Storages, );

TYPED_TEST(Kv16Exactness, NothingAccumulatedInSixteenBits) {
  // Q rows [128, 128, 128, 128] and [1, 1, 1, 1]; K rows [128, 128, 128, 128], [128, 128, 128, 127], [0, 0, 0, 0]; V
  // rows [1, 0], [0, 1], [0.5, 0.5]; scale 1/256. The raw dots of the first row are 65536 and 65408, past half's
  // largest finite 65504: a dot product or score formed in half would overflow to ∞ (and 128·128 = 16384 per term
  // loses nothing in float). All values are exact in half and bfloat16.
  using S = TypeParam;
  const float q_rows[2][4] = {{128, 128, 128, 128}, {1, 1, 1, 1}};
  const float k_rows[3][4] = {{128, 128, 128, 128}, {128, 128, 128, 127}, {0, 0, 0, 0}};
  const float v_rows[3][2] = {{1, 0}, {0, 1}, {0.5f, 0.5f}};
  const double scale = 1.0 / 256;
  // Expected: a double loop over the same values.
  double expected[2][2];
  for (int i = 0; i < 2; ++i) {
    double score[3], m = -std::numeric_limits<double>::infinity();
    for (int j = 0; j < 3; ++j) {
      double dot = 0;
      for (int d = 0; d < 4; ++d) dot += double(q_rows[i][d]) * double(k_rows[j][d]);
      score[j] = dot * scale;
      m = std::max(m, score[j]);
    }
    double sum = 0, acc[2] = {0, 0};
    for (int j = 0; j < 3; ++j) {
      const double w = std::exp(score[j] - m);
      sum += w;
      for (int d = 0; d < 2; ++d) acc[d] += w * v_rows[j][d];
    }
    for (int d = 0; d < 2; ++d) expected[i][d] = acc[d] / sum;
  }
  const double literals[2][2] = {{0.62246, 0.37754}, {0.50091, 0.49909}};
  for (int i = 0; i < 2; ++i)
    for (int d = 0; d < 2; ++d) ASSERT_NEAR(expected[i][d], literals[i][d], 1e-5) << "the double loop, row " << i;

  std::vector<S> k, v;
  for (const auto& row : k_rows)
    for (float x : row) k.push_back(S(x));
  for (const auto& row : v_rows)
    for (float x : row) v.push_back(S(x));
  for (float x : widen(k)) ASSERT_TRUE(x == 128 || x == 127 || x == 0);  // stored exactly
  {  // Views of mutable 16-bit data (TensorView4<S>, not <const S>) bind as well.
    std::vector<float> q = {128, 128, 128, 128, 1, 1, 1, 1}, out(4, kNaN);
    qkv::AttentionOptions<float> o;
    o.scale = static_cast<float>(scale);
    qkv::attention(qkv::view_bhsd<const float>(q.data(), 1, 1, 2, 4), qkv::view_bhsd(k.data(), 1, 1, 3, 4),
                   qkv::view_bhsd(v.data(), 1, 1, 3, 2), qkv::view_bhsd(out.data(), 1, 1, 2, 2), o);
    for (int n = 0; n < 4; ++n) EXPECT_NEAR(out[static_cast<std::size_t>(n)], expected[n / 2][n % 2], 1e-5);
  }
  // Decoding (Sq·G = 2: K and V read in place) and prefill (the two rows repeated, Sq = 20 over GQA 2: packed).
  for (Index sq : {Index(2), Index(20)}) {
    const Index Hq = sq == 2 ? 1 : 2;
    std::vector<float> q;
    for (Index h = 0; h < Hq; ++h)
      for (Index i = 0; i < sq; ++i)
        for (float x : q_rows[i % 2]) q.push_back(x);
    std::vector<Runner<S>> runners = every_path<S>();
    for (Runner<S>& runner : every_compiled_kernel<S>()) runners.push_back(std::move(runner));
    for (const Runner<S>& runner : runners) {
      qkv::AttentionOptions<float> o;
      o.scale = static_cast<float>(scale);
      std::vector<float> out(static_cast<std::size_t>(Hq * sq * 2), kNaN), lse(static_cast<std::size_t>(Hq * sq));
      runner.run(qkv::view_bhsd<const float>(q.data(), 1, Hq, sq, 4), qkv::view_bhsd<const S>(k.data(), 1, 1, 3, 4),
                 qkv::view_bhsd<const S>(v.data(), 1, 1, 3, 2), qkv::view_bhsd(out.data(), 1, Hq, sq, 2),
                 qkv::TensorView3<float>(lse.data(), {1, Hq, sq}), o);
      for (Index h = 0; h < Hq; ++h)
        for (Index i = 0; i < sq; ++i)
          for (int d = 0; d < 2; ++d) {
            const float got = out[static_cast<std::size_t>((h * sq + i) * 2 + d)];
            EXPECT_NEAR(got, expected[i % 2][d], 1e-5)
                << storage_name<S>() << " on the " << runner.name << ", Sq " << sq << " row " << i << " d " << d;
            EXPECT_NEAR(got, literals[i % 2][d], 1e-5)
                << storage_name<S>() << " on the " << runner.name << ", Sq " << sq;
          }
    }
  }
}

// ---- the real PP-OCRv4 layer ----------------------------------------------------------------------------------------

TEST(Kv16RealLayer, PpOcrV4AttentionWithHalfKeysAndValues) {
  // PP-OCRv4's first attention layer (tests/fixtures/README.md): d_model 120, 8 heads of 15, no mask, on its real
  // input of 40 tokens. Q, K, V = X·W + b in double, then Q in float and K, V in float rounded to half (as a float
  // model storing a half cache would); qkv::attention on the packed [40, 8 × 15] views against float64 on the same
  // rounded values, under the accuracy rule (fused) and the reference rule; the Eigen entry point gives the same bits.
  const safetensors::File f = safetensors::read(fixture_path("ppocr_v4_block1_attention.safetensors"));
  const qkv_test::NpyArray input = qkv_test::read_npy_float32(fixture_path("ppocr_v4_block1_attention_input.npy"));
  ASSERT_EQ(input.shape, (std::vector<long>{40, 120}));
  const auto& W = f.tensors.at("linear_77.w_0");
  const auto& bias = f.tensors.at("linear_77.b_0");
  ASSERT_EQ(W.shape, (std::vector<std::int64_t>{120, 360}));
  const Index T = 40, E = 120, H = 8, hd = 15;
  qkv::Matrix<float> Q(T, E), Kf(T, E), Vf(T, E);
  for (Index t = 0; t < T; ++t)
    for (Index c = 0; c < 3 * E; ++c) {
      double y = bias.values[static_cast<std::size_t>(c)];
      for (Index e = 0; e < E; ++e)
        y += double(input.values[static_cast<std::size_t>(t * E + e)]) *
             W.values[static_cast<std::size_t>(e * 3 * E + c)];
      (c < E ? Q(t, c) : c < 2 * E ? Kf(t, c - E) : Vf(t, c - 2 * E)) = static_cast<float>(y);
    }
  const qkv::Matrix<Eigen::half> K = Kf.cast<Eigen::half>(), V = Vf.cast<Eigen::half>();
  ASSERT_TRUE(K.cast<float>().allFinite() && V.cast<float>().allFinite()) << "|K|, |V| within half's range";
  std::cout << "[ real layer ] max |K| " << Kf.cwiseAbs().maxCoeff() << ", max |V| " << Vf.cwiseAbs().maxCoeff()
            << ", rounding to half moved K by up to " << (K.cast<float>() - Kf).cwiseAbs().maxCoeff() << "\n";
  Case c;
  static_cast<brute::Shape&>(c) = {1, H, H, T, T, hd, hd};
  c.bshd = true;  // [T, H·hd] row-major is BSHD
  Stored<Eigen::half> in;
  in.q.assign(Q.data(), Q.data() + Q.size());
  in.k.assign(K.data(), K.data() + K.size());
  in.v.assign(V.data(), V.data() + V.size());
  in.k_float = widen(in.k);
  in.v_float = widen(in.v);
  check_case<Eigen::half>(c, in, every_path<Eigen::half>());
  // The Eigen entry point on the same matrices: the same bits as the core call (fused).
  const qkv::Matrix<float> O = qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{H});
  std::vector<float> out(static_cast<std::size_t>(T * E));
  qkv::attention(qkv::view_bshd<const float>(Q.data(), 1, T, H, hd),
                 qkv::view_bshd<const Eigen::half>(K.data(), 1, T, H, hd),
                 qkv::view_bshd<const Eigen::half>(V.data(), 1, T, H, hd), qkv::view_bshd(out.data(), 1, T, H, hd));
  for (Index t = 0; t < T; ++t)
    for (Index e = 0; e < E; ++e)
      ASSERT_TRUE(same_bits(O(t, e), out[static_cast<std::size_t>(t * E + e)])) << t << ", " << e;
}

// ---- the Eigen entry points -----------------------------------------------------------------------------------------

template <class S>
struct Kv16Eigen : ::testing::Test {};
TYPED_TEST_SUITE(Kv16Eigen, Storages, );

TYPED_TEST(Kv16Eigen, ScaledDotProductAttentionAndWeights) {
  // scaled_dot_product_attention with a float Q and Matrix<S> K, V: one head and packed heads (GQA 4/2, key padding,
  // causal), against the float64 brute force on the stored values (tests/brute_force.hpp) under the accuracy rule,
  // and bit for bit against qkv::attention on the same memory; an expression (K.cast<S>()) and a column-major matrix
  // bind and give the same bits; attention_weights against the brute force's weights.
  using S = TypeParam;
  const Index Tq = 9, Tk = 33, Hq = 4, Hkv = 2, dk = 24, dv = 20;
  const qkv::Matrix<float> Q = qkv_test::random_matrix<float>(Tq, Hq * dk, 71, 2.0);
  const qkv::Matrix<float> Kf = qkv_test::random_matrix<float>(Tk, Hkv * dk, 72, 2.0);
  const qkv::Matrix<float> Vf = qkv_test::random_matrix<float>(Tk, Hkv * dv, 73);
  const qkv::Matrix<S> K = Kf.cast<S>(), V = Vf.cast<S>();
  qkv::AttentionOptions<float> o;
  o.causal = true;
  o.key_lengths = {30};
  const qkv::Matrix<float> O = qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{Hq, Hkv}, o);
  ASSERT_EQ(O.rows(), Tq);
  ASSERT_EQ(O.cols(), Hq * dv);
  // Float64 on the stored values: the brute force over dense BHSD copies.
  brute::Params p = qkv_test::to_brute(o, {1, Hq, Hkv, Tq, Tk, dk, dv});
  std::vector<double> q64, k64, v64;
  for (Index h = 0; h < Hq; ++h)
    for (Index t = 0; t < Tq; ++t)
      for (Index d = 0; d < dk; ++d) q64.push_back(Q(t, h * dk + d));
  for (Index h = 0; h < Hkv; ++h)
    for (Index t = 0; t < Tk; ++t) {
      for (Index d = 0; d < dk; ++d) k64.push_back(static_cast<double>(static_cast<float>(K(t, h * dk + d))));
    }
  for (Index h = 0; h < Hkv; ++h)
    for (Index t = 0; t < Tk; ++t)
      for (Index d = 0; d < dv; ++d) v64.push_back(static_cast<double>(static_cast<float>(V(t, h * dv + d))));
  const brute::Result expected = brute::attention(q64, k64, v64, p);
  // The plain float implementation on the same values, in the same BHSD order.
  const std::vector<float> qf(q64.begin(), q64.end()), kf(k64.begin(), k64.end()), vf(v64.begin(), v64.end());
  std::vector<float> plain(expected.out.size());
  qkv_test::plain_float(
      qkv::view_bhsd<const float>(qf.data(), 1, Hq, Tq, dk), qkv::view_bhsd<const float>(kf.data(), 1, Hkv, Tk, dk),
      qkv::view_bhsd<const float>(vf.data(), 1, Hkv, Tk, dv), p, qkv::view_bhsd(plain.data(), 1, Hq, Tq, dv), {});
  double err = 0, err_plain = 0, max_v = 0;
  for (Index h = 0; h < Hq; ++h)
    for (Index t = 0; t < Tq; ++t)
      for (Index d = 0; d < dv; ++d) {
        const std::size_t n = static_cast<std::size_t>((h * Tq + t) * dv + d);
        err = std::max(err, std::fabs(O(t, h * dv + d) - expected.out[n]));
        err_plain = std::max(err_plain, std::fabs(plain[n] - expected.out[n]));
      }
  for (double x : v64) max_v = std::max(max_v, std::fabs(x));
  EXPECT_LE(err, 2 * err_plain + 1e-6 * std::max(1.0, max_v)) << "error " << err << ", plain float " << err_plain;
  // The core call on the same memory.
  std::vector<float> out(static_cast<std::size_t>(Tq * Hq * dv));
  qkv::attention(qkv::view_bshd<const float>(Q.data(), 1, Tq, Hq, dk),
                 qkv::view_bshd<const S>(K.data(), 1, Tk, Hkv, dk), qkv::view_bshd<const S>(V.data(), 1, Tk, Hkv, dv),
                 qkv::view_bshd(out.data(), 1, Tq, Hq, dv), o);
  for (Index t = 0; t < Tq; ++t)
    for (Index c = 0; c < Hq * dv; ++c) ASSERT_TRUE(same_bits(O(t, c), out[static_cast<std::size_t>(t * Hq * dv + c)]));
  // An expression and a column-major matrix of S bind (copied first) and give the same bits.
  const Eigen::Matrix<S, Eigen::Dynamic, Eigen::Dynamic> K_column_major = K;
  const qkv::Matrix<float> O_expression = qkv::scaled_dot_product_attention(Q, Kf.cast<S>(), V, qkv::Heads{Hq, Hkv}, o);
  const qkv::Matrix<float> O_column_major =
      qkv::scaled_dot_product_attention(Q, K_column_major, V, qkv::Heads{Hq, Hkv}, o);
  for (Index t = 0; t < Tq; ++t)
    for (Index c = 0; c < Hq * dv; ++c) {
      ASSERT_TRUE(same_bits(O(t, c), O_expression(t, c))) << t << ", " << c;
      ASSERT_TRUE(same_bits(O(t, c), O_column_major(t, c))) << t << ", " << c;
    }
  // One head: query head 3 alone (kv head 1) equals the packed call's columns within the rule's absolute term (the
  // same computation on the same values; the kernel's tiling of one head may differ).
  const qkv::Matrix<float> O1 =
      qkv::scaled_dot_product_attention(qkv::Matrix<float>(Q.middleCols(3 * dk, dk)),
                                        qkv::Matrix<S>(K.middleCols(dk, dk)), qkv::Matrix<S>(V.middleCols(dv, dv)), o);
  for (Index t = 0; t < Tq; ++t)
    for (Index d = 0; d < dv; ++d) {
      const std::size_t n = static_cast<std::size_t>((3 * Tq + t) * dv + d);
      EXPECT_NEAR(O1(t, d), expected.out[n], 2 * err_plain + 1e-6 * std::max(1.0, max_v)) << t << ", " << d;
    }
  // attention_weights of query head 3: the reference path's weights, within 1e-6 of float64's.
  const qkv::Matrix<float> P = qkv::attention_weights(Q, K, qkv::Heads{Hq, Hkv}, 3, o);
  ASSERT_EQ(P.rows(), Tq);
  ASSERT_EQ(P.cols(), Tk);
  for (Index t = 0; t < Tq; ++t)
    for (Index j = 0; j < Tk; ++j) {
      EXPECT_NEAR(P(t, j), expected.weights[static_cast<std::size_t>((3 * Tq + t) * Tk + j)], 1e-6) << t << ", " << j;
    }
  const qkv::Matrix<float> P1 =
      qkv::attention_weights(qkv::Matrix<float>(Q.middleCols(3 * dk, dk)), qkv::Matrix<S>(K.middleCols(dk, dk)), o);
  for (Index t = 0; t < Tq; ++t)
    for (Index j = 0; j < Tk; ++j) EXPECT_TRUE(same_bits(P1(t, j), P(t, j))) << t << ", " << j;
}

}  // namespace
