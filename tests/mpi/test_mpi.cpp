// Tests of the MPI layer (qkv/mpi.hpp): shard_rows, ring_attention (contiguous and zigzag) and ulysses_attention,
// run by ctest under mpirun with 1, 2, 3 and 4 ranks (tests/mpi/CMakeLists.txt). Every rank runs every test.
//
// Expected values: every rank builds the same whole problem from one seed and computes the float64 brute force of the
// whole sequence (tests/brute_force.hpp); it then passes its own rows (shard_rows) to the distributed call and checks
// them against the brute force's rows. Accuracy (issue 18): double within 1e-12·max(1, max|V|); float within 3 × the
// error of a single-process qkv::attention on the whole sequence in float + 2e-6·max(1, max|V|) (the merge order
// differs from one process's); the lse likewise, with max(1, max|lse|) in place of max(1, max|V|).
//
// Also: two runs give the same bits (and so does another OpenMP thread count); bad input on any rank throws
// qkv::shape_error on every rank (never a hang: ctest's timeout would fail the run); Ulysses rejects head counts its
// rule cannot split, on every rank; a ring rank's peak allocation stays within its shard, two travelling K/V blocks,
// one partial state and one attention call's own allocation.
#include <gtest/gtest.h>
#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "brute_force.hpp"
#include "qkv/mpi.hpp"
#include "support/max_error.hpp"
#include "support/options.hpp"
#include "support/problem.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

// ---- live-byte counting: a replacement of the global operator new / delete that records the peak of live bytes ----
// A header of 64 bytes before each block holds its size (64 keeps every alignment qkv asks for).
namespace {
std::atomic<long long> g_live_bytes{0};
std::atomic<long long> g_peak_bytes{0};
constexpr std::size_t kHeader = 64;

void* counted_allocate(std::size_t bytes, std::size_t alignment) {
  alignment = std::max(alignment, kHeader);
  void* raw = std::aligned_alloc(alignment, (bytes + alignment + alignment - 1) / alignment * alignment);
  if (raw == nullptr) throw std::bad_alloc();
  char* user = static_cast<char*>(raw) + alignment;
  reinterpret_cast<std::size_t*>(user - kHeader)[0] = bytes;
  reinterpret_cast<std::size_t*>(user - kHeader)[1] = alignment;
  const long long live = g_live_bytes += static_cast<long long>(bytes);
  long long peak = g_peak_bytes.load();
  while (live > peak && !g_peak_bytes.compare_exchange_weak(peak, live)) {
  }
  return user;
}

void counted_free(void* p) noexcept {
  if (p == nullptr) return;
  char* user = static_cast<char*>(p);
  const std::size_t bytes = reinterpret_cast<std::size_t*>(user - kHeader)[0];
  const std::size_t alignment = reinterpret_cast<std::size_t*>(user - kHeader)[1];
  g_live_bytes -= static_cast<long long>(bytes);
  std::free(user - alignment);
}
}  // namespace

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
void* operator new(std::size_t bytes) { return counted_allocate(bytes, alignof(std::max_align_t)); }
void* operator new[](std::size_t bytes) { return counted_allocate(bytes, alignof(std::max_align_t)); }
void* operator new(std::size_t bytes, std::align_val_t a) {
  return counted_allocate(bytes, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t bytes, std::align_val_t a) {
  return counted_allocate(bytes, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept { counted_free(p); }
void operator delete[](void* p) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t) noexcept { counted_free(p); }
void operator delete(void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { counted_free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { counted_free(p); }

namespace {

using qkv::Index;
using qkv::mpi::ShardLayout;
constexpr double kInf = std::numeric_limits<double>::infinity();

int rank_of_world() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}
int size_of_world() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

/// The number of ranks for which `flag` is true.
int count_ranks(bool flag) {
  int count = flag ? 1 : 0;
  MPI_Allreduce(MPI_IN_PLACE, &count, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  return count;
}

// ---- shard_rows -----------------------------------------------------------------------------------------------------

TEST(ShardRows, ContiguousAndZigzagFollowTheDocumentedFormulas) {
  using Ranges = std::vector<std::pair<Index, Index>>;
  EXPECT_EQ(qkv::mpi::shard_rows(10, 0, 3, ShardLayout::contiguous), (Ranges{{0, 3}}));
  EXPECT_EQ(qkv::mpi::shard_rows(10, 1, 3, ShardLayout::contiguous), (Ranges{{3, 6}}));
  EXPECT_EQ(qkv::mpi::shard_rows(10, 2, 3, ShardLayout::contiguous), (Ranges{{6, 10}}));
  // 10 rows in 4 chunks: [0, 2), [2, 5), [5, 7), [7, 10).
  EXPECT_EQ(qkv::mpi::shard_rows(10, 0, 2, ShardLayout::zigzag), (Ranges{{0, 2}, {7, 10}}));
  EXPECT_EQ(qkv::mpi::shard_rows(10, 1, 2, ShardLayout::zigzag), (Ranges{{2, 5}, {5, 7}}));
  EXPECT_EQ(qkv::mpi::shard_rows(8, 0, 2, ShardLayout::zigzag), (Ranges{{0, 2}, {6, 8}}));  // the enum's example
  EXPECT_EQ(qkv::mpi::shard_rows(2, 3, 4, ShardLayout::contiguous), (Ranges{{1, 2}}));
  EXPECT_EQ(qkv::mpi::shard_rows(0, 0, 1, ShardLayout::zigzag), (Ranges{{0, 0}, {0, 0}}));
  // Every row exactly once, for many lengths and rank counts (floor(L·c / n) computed independently in long double).
  for (int size = 1; size <= 9; ++size) {
    for (Index length : {Index(0), Index(1), Index(7), Index(67), Index(1000003)}) {
      for (ShardLayout layout : {ShardLayout::contiguous, ShardLayout::zigzag}) {
        std::vector<int> owner(static_cast<std::size_t>(std::min<Index>(length, 2000)), -1);
        Index total = 0;
        for (int r = 0; r < size; ++r) {
          const auto ranges = qkv::mpi::shard_rows(length, r, size, layout);
          const Index chunks = layout == ShardLayout::zigzag ? 2 * size : size;
          const Index first = r, second = 2 * size - 1 - r;
          const auto cut = [&](Index c) {
            return static_cast<Index>(std::floor(static_cast<long double>(length) * c / chunks));
          };
          EXPECT_EQ(ranges.front(), std::make_pair(cut(first), cut(first + 1)));
          if (layout == ShardLayout::zigzag) {
            EXPECT_EQ(ranges.back(), std::make_pair(cut(second), cut(second + 1)));
          }
          for (const auto& range : ranges) {
            total += range.second - range.first;
            for (Index i = range.first; i < std::min<Index>(range.second, 2000); ++i) {
              EXPECT_EQ(owner[static_cast<std::size_t>(i)], -1) << "row " << i << " twice";
              owner[static_cast<std::size_t>(i)] = r;
            }
          }
        }
        EXPECT_EQ(total, length);
      }
    }
  }
}

TEST(ShardRows, BadArgumentsThrow) {
  EXPECT_THROW(qkv::mpi::shard_rows(-1, 0, 2, ShardLayout::contiguous), qkv::shape_error);
  EXPECT_THROW(qkv::mpi::shard_rows(5, 0, 0, ShardLayout::contiguous), qkv::shape_error);
  EXPECT_THROW(qkv::mpi::shard_rows(5, 2, 2, ShardLayout::zigzag), qkv::shape_error);
  EXPECT_THROW(qkv::mpi::shard_rows(5, -1, 2, ShardLayout::zigzag), qkv::shape_error);
  EXPECT_THROW(qkv::mpi::shard_rows(5, 0, 2, static_cast<ShardLayout>(7)), qkv::shape_error);
}

// ---- distributed calls against the float64 brute force
// ---------------------------------------------------------------

enum class Strategy { ring, ulysses };

/// One distributed case: the whole problem's shape and options (on brute::Params, converted by support/options.hpp).
struct Case {
  std::string name;
  brute::Shape shape;
  std::function<void(brute::Params&)> set = [](brute::Params&) {};
};

/// Rows `ranges` (global rows of axis 2) of a dense [B, H, S, W] tensor, as a dense [B, H, rows, W] tensor.
template <class T>
std::vector<T> gather_rows(const std::vector<double>& whole, Index B, Index H, Index S, Index W,
                           const std::vector<std::pair<Index, Index>>& ranges) {
  std::vector<T> part;
  for (Index b = 0; b < B; ++b)
    for (Index h = 0; h < H; ++h)
      for (const auto& range : ranges)
        for (Index i = range.first; i < range.second; ++i)
          for (Index w = 0; w < W; ++w)
            part.push_back(static_cast<T>(whole[static_cast<std::size_t>(((b * H + h) * S + i) * W + w)]));
  return part;
}

/// This rank's out and lse (in double) from the distributed call in T.
struct Local {
  std::vector<double> out, lse;
};

template <class T>
Local run_distributed(const qkv_test::Problem& pr, Strategy strategy, ShardLayout layout,
                      const qkv::AttentionOptions<T>& options, MPI_Comm comm = MPI_COMM_WORLD) {
  const brute::Params& p = pr.p;
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const auto q_rows = qkv::mpi::shard_rows(p.Sq, rank, size, layout);
  const auto kv_rows = qkv::mpi::shard_rows(p.Skv, rank, size, layout);
  const Index sq = qkv::mpi::detail::total_rows(q_rows), skv = qkv::mpi::detail::total_rows(kv_rows);
  const std::vector<T> q = gather_rows<T>(pr.q, p.B, p.Hq, p.Sq, p.D, q_rows);
  const std::vector<T> k = gather_rows<T>(pr.k, p.B, p.Hkv, p.Skv, p.D, kv_rows);
  const std::vector<T> v = gather_rows<T>(pr.v, p.B, p.Hkv, p.Skv, p.Dv, kv_rows);
  std::vector<T> out(static_cast<std::size_t>(p.B * p.Hq * sq * p.Dv), std::numeric_limits<T>::quiet_NaN());
  std::vector<T> lse(static_cast<std::size_t>(p.B * p.Hq * sq), std::numeric_limits<T>::quiet_NaN());
  const qkv::TensorView4<const T> qv(q.data(), {p.B, p.Hq, sq, p.D});
  const qkv::TensorView4<const T> kv(k.data(), {p.B, p.Hkv, skv, p.D});
  const qkv::TensorView4<const T> vv(v.data(), {p.B, p.Hkv, skv, p.Dv});
  const qkv::TensorView4<T> ov(out.data(), {p.B, p.Hq, sq, p.Dv});
  const qkv::TensorView3<T> lv(lse.data(), {p.B, p.Hq, sq});
  if (strategy == Strategy::ring) {
    qkv::mpi::ring_attention<T>(comm, qv, kv, vv, ov, lv, options, layout);
  } else {
    qkv::mpi::ulysses_attention<T>(comm, qv, kv, vv, ov, lv, options);
  }
  return {{out.begin(), out.end()}, {lse.begin(), lse.end()}};
}

/// Runs the case in float and in double with `strategy` and `layout` and checks this rank's rows (see the file
/// comment for the tolerances).
void check_case(const Case& c, Strategy strategy, ShardLayout layout) {
  const int rank = rank_of_world(), size = size_of_world();
  qkv_test::Problem pr = qkv_test::make_problem(c.shape, 2018);
  c.set(pr.p);
  pr = qkv_test::rounded<float>(pr);
  const brute::Params& p = pr.p;
  const brute::Result expected = brute::attention(pr.q, pr.k, pr.v, p);
  const auto rows = qkv::mpi::shard_rows(p.Sq, rank, size, layout);
  const std::vector<double> expected_out = gather_rows<double>(expected.out, p.B, p.Hq, p.Sq, p.Dv, rows);
  const std::vector<double> expected_lse = gather_rows<double>(expected.lse, p.B, p.Hq, p.Sq, 1, rows);
  const double v_scale = std::max(1.0, qkv_test::max_finite_abs(pr.v));
  const double lse_scale = std::max(1.0, qkv_test::max_finite_abs(expected.lse));
  const std::string what = c.name + (strategy == Strategy::ring ? " ring " : " ulysses ") +
                           (layout == ShardLayout::zigzag ? "zigzag" : "contiguous") + " rank " + std::to_string(rank) +
                           " of " + std::to_string(size);

  // double: against the brute force, and against a single-process qkv::attention in double.
  const qkv_test::OwnedOptions<double> o64 = qkv_test::from_brute<double>(p);
  const Local d = run_distributed<double>(pr, strategy, layout, o64.options);
  EXPECT_LE(qkv_test::max_error(d.out, expected_out, what + " double out"), 1e-12 * v_scale) << what;
  EXPECT_LE(qkv_test::max_error(d.lse, expected_lse, what + " double lse"), 1e-12 * lse_scale) << what;
  const qkv_test::Output single64 = qkv_test::run<double>(pr, qkv::Backend::automatic);
  EXPECT_LE(qkv_test::max_error(d.out, gather_rows<double>(single64.out, p.B, p.Hq, p.Sq, p.Dv, rows), what + " vs single"),
            1e-12 * v_scale)
      << what;

  // float: within 3 × the single-process float error + 2e-6.
  const qkv_test::OwnedOptions<float> o32 = qkv_test::from_brute<float>(p);
  const Local f = run_distributed<float>(pr, strategy, layout, o32.options);
  const qkv_test::Output single = qkv_test::run<float>(pr, qkv::Backend::automatic);
  const double single_out_error = qkv_test::max_error(single.out, expected.out, what + " single float out");
  const double single_lse_error = qkv_test::max_error(single.lse, expected.lse, what + " single float lse");
  const double out_error = qkv_test::max_error(f.out, expected_out, what + " float out");
  const double lse_error = qkv_test::max_error(f.lse, expected_lse, what + " float lse");
  EXPECT_LE(out_error, 3 * single_out_error + 2e-6 * v_scale)
      << what << " (single-process float error " << single_out_error << ")";
  EXPECT_LE(lse_error, 3 * single_lse_error + 2e-6 * lse_scale)
      << what << " (single-process float lse error " << single_lse_error << ")";
}

/// The cases both strategies run (heads chosen so that Ulysses can split them over 1, 2 and 4 ranks; with 3 ranks
/// Ulysses runs the cases whose heads it can split: see UlyssesCases).
std::vector<Case> ring_cases() {
  std::vector<Case> cases;
  // 67 rows: divisible by none of 2, 3, 4 (nor, for zigzag, 4, 6, 8).
  cases.push_back(
      {"causal_bottom_right_gqa_8_2", {1, 8, 2, 67, 67, 16, 16}, [](brute::Params& p) { p.causal = true; }});
  cases.push_back({"causal_top_left_cross_lengths", {2, 8, 2, 45, 67, 16, 12}, [](brute::Params& p) {
                     p.causal = true;
                     p.alignment = brute::Alignment::top_left;
                   }});
  cases.push_back(
      {"causal_bottom_right_cross_lengths", {2, 8, 2, 45, 67, 16, 12}, [](brute::Params& p) { p.causal = true; }});
  cases.push_back({"window_global_tokens_mqa", {1, 4, 1, 61, 61, 16, 16}, [](brute::Params& p) {
                     p.window_left = 9;
                     p.window_right = 5;
                     p.global_tokens = 3;
                   }});
  cases.push_back({"causal_window_top_left", {1, 4, 2, 53, 59, 8, 8}, [](brute::Params& p) {
                     p.causal = true;
                     p.alignment = brute::Alignment::top_left;
                     p.window_left = 11;
                   }});
  cases.push_back({"global_key_padding_causal", {2, 4, 2, 57, 57, 16, 16}, [](brute::Params& p) {
                     p.causal = true;
                     p.key_lengths = {50, 23};
                   }});
  cases.push_back({"sinks_alibi_softcap_causal", {1, 4, 4, 49, 49, 16, 16}, [](brute::Params& p) {
                     p.causal = true;
                     p.sinks = {1.5, -kInf, -0.5, 3.0};
                     p.alibi_slopes = {0.5, 0.25, 0.125, 0.0625};
                     p.softcap = 5;
                   }});
  cases.push_back({"no_mask_scale", {1, 4, 2, 29, 41, 16, 8}, [](brute::Params& p) { p.scale = 0.3; }});
  cases.push_back({"three_rows", {1, 4, 2, 3, 3, 8, 8}, [](brute::Params& p) { p.causal = true; }});
  return cases;
}

TEST(RingAttention, ContiguousMatchesTheFloat64BruteForce) {
  for (const Case& c : ring_cases()) check_case(c, Strategy::ring, ShardLayout::contiguous);
}

TEST(RingAttention, ZigzagMatchesTheFloat64BruteForce) {
  for (const Case& c : ring_cases()) check_case(c, Strategy::ring, ShardLayout::zigzag);
}

TEST(UlyssesAttention, MatchesTheFloat64BruteForce) {
  const Index P = size_of_world();
  std::vector<Case> cases;
  // Heads every rank count of the tests can split: Hq = 12, Hkv = 12 (multi-head) or 1 (MQA: replicated to every
  // rank); GQA 8/2 where P divides 8 and P or 2 divides the other (P = 1, 2, 4: replicated for 4), else GQA 12/3.
  cases.push_back({"causal_bottom_right_mha", {1, 12, 12, 67, 67, 8, 8}, [](brute::Params& p) { p.causal = true; }});
  if (P != 3) {
    cases.push_back({"gqa_8_2_causal_top_left", {2, 8, 2, 45, 67, 16, 12}, [](brute::Params& p) {
                       p.causal = true;
                       p.alignment = brute::Alignment::top_left;
                     }});
  } else {
    cases.push_back({"gqa_12_3_causal_top_left", {2, 12, 3, 45, 67, 16, 12}, [](brute::Params& p) {
                       p.causal = true;
                       p.alignment = brute::Alignment::top_left;
                     }});
  }
  cases.push_back({"mqa_window_global_key_padding", {2, 12, 1, 57, 57, 8, 8}, [](brute::Params& p) {
                     p.window_left = 9;
                     p.global_tokens = 2;
                     p.key_lengths = {50, 23};
                   }});
  cases.push_back({"sinks_alibi_causal", {1, 12, 12, 37, 37, 8, 8}, [](brute::Params& p) {
                     p.causal = true;
                     for (int h = 0; h < 12; ++h) {
                       p.sinks.push_back(h % 3 == 0 ? -kInf : 0.5 * h - 2);
                       p.alibi_slopes.push_back(std::ldexp(1.0, -(h + 1)));
                     }
                   }});
  cases.push_back({"three_rows", {1, 12, 12, 3, 3, 8, 8}, [](brute::Params& p) { p.causal = true; }});
  for (const Case& c : cases) check_case(c, Strategy::ulysses, ShardLayout::contiguous);
}

TEST(UlyssesAttention, HeadCountsItCannotSplitThrowOnEveryRank) {
  const int P = size_of_world();
  if (P == 1) GTEST_SKIP() << "one rank splits any head count";
  // Hq not a multiple of P; then Hkv neither a multiple of P nor a divisor of it.
  const brute::Shape bad_query_heads{1, P + 1, 1, 9, 9, 8, 8};
  const brute::Shape bad_kv_heads =
      P == 2 ? brute::Shape{1, 6, 3, 9, 9, 8, 8}
             : (P == 3 ? brute::Shape{1, 6, 2, 9, 9, 8, 8} : brute::Shape{1, 12, 3, 9, 9, 8, 8});
  for (const brute::Shape& shape : {bad_query_heads, bad_kv_heads}) {
    const qkv_test::Problem pr = qkv_test::make_problem(shape, 1);
    const qkv_test::OwnedOptions<float> o = qkv_test::from_brute<float>(pr.p);
    bool threw = false;
    try {
      (void)run_distributed<float>(pr, Strategy::ulysses, ShardLayout::contiguous, o.options);
    } catch (const qkv::shape_error& e) {
      threw = true;
      const std::string message = e.what();
      EXPECT_EQ(message.rfind("qkv::mpi::ulysses_attention: ", 0), 0u) << message;
      EXPECT_NE(message.find(shape.Hq % P != 0 ? "q axis 1 (Hq)" : "k axis 1 (Hkv)"), std::string::npos) << message;
    }
    EXPECT_TRUE(threw) << "Hq " << shape.Hq << ", Hkv " << shape.Hkv << ", " << P << " ranks";
    EXPECT_EQ(count_ranks(threw), P);
  }
}

// ---- determinism ----------------------------------------------------------------------------------------------------

TEST(RingAttention, SameBitsRunAfterRunAndForAnyThreadCount) {
  qkv_test::Problem pr = qkv_test::make_problem({1, 8, 2, 300, 300, 32, 32}, 77);
  pr.p.causal = true;
  pr.p.window_left = 200;
  pr = qkv_test::rounded<float>(pr);
  const qkv_test::OwnedOptions<float> o = qkv_test::from_brute<float>(pr.p);
  for (ShardLayout layout : {ShardLayout::contiguous, ShardLayout::zigzag}) {
    const Local first = run_distributed<float>(pr, Strategy::ring, layout, o.options);
    const Local second = run_distributed<float>(pr, Strategy::ring, layout, o.options);
#if defined(_OPENMP)
    const int threads = omp_get_max_threads();
    omp_set_num_threads(2);
#endif
    const Local two_threads = run_distributed<float>(pr, Strategy::ring, layout, o.options);
#if defined(_OPENMP)
    omp_set_num_threads(threads);
#endif
    for (std::size_t n = 0; n < first.out.size(); ++n) {
      ASSERT_EQ(first.out[n], second.out[n]) << n;
      ASSERT_EQ(first.out[n], two_threads.out[n]) << n;
    }
    for (std::size_t n = 0; n < first.lse.size(); ++n) {
      ASSERT_EQ(first.lse[n], second.lse[n]) << n;
      ASSERT_EQ(first.lse[n], two_threads.lse[n]) << n;
    }
  }
}

// ---- bad input: a shape_error on every rank, never a hang
// ------------------------------------------------------------

/// A valid ring call of this rank (float, 2 batch entries, GQA 4/2, causal), which each test breaks on some rank.
struct BadCall {
  qkv_test::Problem pr;
  qkv_test::OwnedOptions<float> owned;
  ShardLayout layout = ShardLayout::zigzag;
  BadCall() : pr(qkv_test::make_problem({2, 4, 2, 23, 23, 8, 8}, 5)) {
    pr.p.causal = true;
    owned = qkv_test::from_brute<float>(pr.p);
  }
};

/// Runs `call` for each strategy, expects a shape_error on this rank whose message holds every one of `parts`, and
/// that every rank threw.
void expect_error_on_every_rank(const std::function<void(Strategy)>& call, const std::vector<std::string>& parts) {
  for (Strategy strategy : {Strategy::ring, Strategy::ulysses}) {
    bool threw = false;
    try {
      call(strategy);
    } catch (const qkv::shape_error& e) {
      threw = true;
      const std::string message = e.what();
      EXPECT_EQ(message.rfind("qkv::mpi::", 0), 0u) << message;
      for (const auto& part : parts)
        EXPECT_NE(message.find(part), std::string::npos) << "'" << part << "' not in: " << message;
    }
    EXPECT_TRUE(threw) << (strategy == Strategy::ring ? "ring" : "ulysses") << " on rank " << rank_of_world();
    EXPECT_EQ(count_ranks(threw), size_of_world());
  }
}

template <class Modify>
void run_modified(BadCall& bad, Strategy strategy, Modify modify) {
  qkv::AttentionOptions<float> options = bad.owned.options;
  modify(options);
  (void)run_distributed<float>(bad.pr, strategy, strategy == Strategy::ring ? bad.layout : ShardLayout::contiguous,
                               options);
}

TEST(RingAttention, DropoutDrawsTheMaskOfTheWholeCall) {
  // Dropout keys its mask by (sequence, head, global query, global key): each ring block passes its global positions,
  // so the ranks' rows equal one process's call with the same options, mask included (double, reference path).
  qkv_test::Problem pr = qkv_test::make_problem({2, 4, 2, 37, 37, 8, 6}, 91);
  pr.p.causal = true;
  const qkv_test::OwnedOptions<double> o = qkv_test::from_brute<double>(pr.p);
  qkv::AttentionOptions<double> options = o.options;
  options.dropout_p = 0.3;
  options.dropout_seed = 1234;
  options.dropout_offset = 5;
  const brute::Params& p = pr.p;
  std::vector<double> whole_out(static_cast<std::size_t>(p.B * p.Hq * p.Sq * p.Dv)),
      whole_lse(static_cast<std::size_t>(p.B * p.Hq * p.Sq));
  qkv::attention<double>(qkv::TensorView4<const double>(pr.q.data(), {p.B, p.Hq, p.Sq, p.D}),
                         qkv::TensorView4<const double>(pr.k.data(), {p.B, p.Hkv, p.Skv, p.D}),
                         qkv::TensorView4<const double>(pr.v.data(), {p.B, p.Hkv, p.Skv, p.Dv}),
                         qkv::TensorView4<double>(whole_out.data(), {p.B, p.Hq, p.Sq, p.Dv}),
                         qkv::TensorView3<double>(whole_lse.data(), {p.B, p.Hq, p.Sq}), options);
  for (ShardLayout layout : {ShardLayout::contiguous, ShardLayout::zigzag}) {
    const Local local = run_distributed<double>(pr, Strategy::ring, layout, options);
    const auto rows = qkv::mpi::shard_rows(p.Sq, rank_of_world(), size_of_world(), layout);
    const std::vector<double> expected = gather_rows<double>(whole_out, p.B, p.Hq, p.Sq, p.Dv, rows);
    ASSERT_EQ(local.out.size(), expected.size());
    for (std::size_t n = 0; n < expected.size(); ++n) {
      EXPECT_NEAR(local.out[n], expected[n], 1e-12 * std::max(1.0, std::fabs(expected[n]))) << n;
    }
  }
}

TEST(UlyssesAttention, DropoutThrowsOnEveryRank) {
  BadCall bad;
  qkv::AttentionOptions<float> options = bad.owned.options;
  options.dropout_p = 0.25f;
  bool threw = false;
  try {
    (void)run_distributed<float>(bad.pr, Strategy::ulysses, ShardLayout::contiguous, options);
  } catch (const qkv::shape_error& e) {
    threw = true;
    EXPECT_NE(std::string(e.what()).find("dropout is not supported by ulysses_attention"), std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(threw);
  EXPECT_EQ(count_ranks(threw), size_of_world());
}


TEST(BadInput, RanksDisagreeingOnAnOptionThrowOnEveryRank) {
  if (size_of_world() == 1) GTEST_SKIP() << "one rank agrees with itself";
  const int last = size_of_world() - 1;
  BadCall bad;
  expect_error_on_every_rank(
      [&](Strategy s) { run_modified(bad, s, [&](auto& o) { o.causal = rank_of_world() != last; }); },
      {"the ranks disagree on options.causal", "from 0 to 1"});
  expect_error_on_every_rank(
      [&](Strategy s) { run_modified(bad, s, [&](auto& o) { o.window_left = rank_of_world() == 0 ? 3 : -1; }); },
      {"options.window_left"});
  expect_error_on_every_rank(
      [&](Strategy s) { run_modified(bad, s, [&](auto& o) { o.scale = rank_of_world() == last ? 0.5f : 0.25f; }); },
      {"the ranks disagree on options.scale"});
  expect_error_on_every_rank(
      [&](Strategy s) {
        run_modified(bad, s, [&](auto& o) { o.sinks = {1, 2, 3, rank_of_world() == last ? 5.0f : 4.0f}; });
      },
      {"options.sinks[3]"});
  expect_error_on_every_rank(
      [&](Strategy s) {
        run_modified(bad, s, [&](auto& o) { o.dropout_seed = rank_of_world() == last ? 7 : 8; });
      },
      {"the ranks disagree on options.dropout_seed"});
  expect_error_on_every_rank(
      [&](Strategy s) {
        run_modified(bad, s, [&](auto& o) {
          if (rank_of_world() == 0) o.key_lengths = {3, 4};
        });
      },
      {"the size of options.key_lengths"});
}

TEST(BadInput, RanksDisagreeingOnShapesThrowOnEveryRank) {
  const int P = size_of_world(), last = P - 1;
  const int rank = rank_of_world();
  BadCall bad;
  // A local error on the last rank only (k's batch extent): every rank reports it, naming that rank.
  expect_error_on_every_rank(
      [&](Strategy s) {
        const auto layout = s == Strategy::ring ? bad.layout : ShardLayout::contiguous;
        const auto rows = qkv::mpi::shard_rows(23, rank, P, layout);
        const Index sq = qkv::mpi::detail::total_rows(rows);
        std::vector<float> q(static_cast<std::size_t>(2 * 4 * sq * 8), 1.0f), k(q.size()), v(q.size()), out(q.size()),
            lse(static_cast<std::size_t>(2 * 4 * sq));
        const Index kb = rank == last ? 1 : 2;
        const qkv::TensorView4<const float> qv(q.data(), {2, 4, sq, 8}), kv(k.data(), {kb, 2, sq, 8}),
            vv(v.data(), {kb, 2, sq, 8});
        const qkv::TensorView4<float> ov(out.data(), {2, 4, sq, 8});
        const qkv::TensorView3<float> lv(lse.data(), {2, 4, sq});
        if (s == Strategy::ring) {
          qkv::mpi::ring_attention<float>(MPI_COMM_WORLD, qv, kv, vv, ov, lv, bad.owned.options, layout);
        } else {
          qkv::mpi::ulysses_attention<float>(MPI_COMM_WORLD, qv, kv, vv, ov, lv, bad.owned.options);
        }
      },
      {"rank " + std::to_string(last) + " of " + std::to_string(P), "k axis 0 (B) has extent 1, expected 2"});
  if (P > 1) {
    // Head dimensions that differ between ranks.
    expect_error_on_every_rank(
        [&](Strategy s) {
          const auto layout = s == Strategy::ring ? bad.layout : ShardLayout::contiguous;
          const Index sq = qkv::mpi::detail::total_rows(qkv::mpi::shard_rows(23, rank, P, layout));
          const Index D = rank == 0 ? 16 : 8;
          std::vector<float> q(static_cast<std::size_t>(2 * 4 * sq * D), 1.0f), out(q.size()),
              lse(static_cast<std::size_t>(2 * 4 * sq));
          const qkv::TensorView4<const float> qv(q.data(), {2, 4, sq, D}), kv(q.data(), {2, 2, sq, D}),
              vv(q.data(), {2, 2, sq, D});
          const qkv::TensorView4<float> ov(out.data(), {2, 4, sq, D});
          const qkv::TensorView3<float> lv(lse.data(), {2, 4, sq});
          if (s == Strategy::ring) {
            qkv::mpi::ring_attention<float>(MPI_COMM_WORLD, qv, kv, vv, ov, lv, bad.owned.options, layout);
          } else {
            qkv::mpi::ulysses_attention<float>(MPI_COMM_WORLD, qv, kv, vv, ov, lv, bad.owned.options);
          }
        },
        {"the ranks disagree on q axis 3 (D)", "from 8 to 16"});
  }
  if (P == 1) return;  // one rank holds whatever rows it passes
  // Rows that are not the rank's shard_rows: rank 0 passes one query row more and the last rank one fewer.
  expect_error_on_every_rank(
      [&](Strategy s) {
        const auto layout = s == Strategy::ring ? bad.layout : ShardLayout::contiguous;
        const Index sq = qkv::mpi::detail::total_rows(qkv::mpi::shard_rows(23, rank, P, layout)) + (rank == 0 ? 1 : 0) -
                         (rank == last ? 1 : 0);
        const Index skv = qkv::mpi::detail::total_rows(qkv::mpi::shard_rows(23, rank, P, layout));
        std::vector<float> q(static_cast<std::size_t>(2 * 4 * sq * 8), 1.0f),
            k(static_cast<std::size_t>(2 * 2 * skv * 8)), out(q.size()), lse(static_cast<std::size_t>(2 * 4 * sq));
        const qkv::TensorView4<const float> qv(q.data(), {2, 4, sq, 8}), kv(k.data(), {2, 2, skv, 8});
        const qkv::TensorView4<float> ov(out.data(), {2, 4, sq, 8});
        const qkv::TensorView3<float> lv(lse.data(), {2, 4, sq});
        if (s == Strategy::ring) {
          qkv::mpi::ring_attention<float>(MPI_COMM_WORLD, qv, kv, kv, ov, lv, bad.owned.options, layout);
        } else {
          qkv::mpi::ulysses_attention<float>(MPI_COMM_WORLD, qv, kv, kv, ov, lv, bad.owned.options);
        }
      },
      {"rank 0 of " + std::to_string(P), "q axis 2 (Sq) has extent", "shard_rows of the global Sq 23"});
}

TEST(BadInput, OptionsThatCannotBeShardedThrowOnEveryRank) {
  BadCall bad;
  std::vector<float> bias(23 * 23, 0.0f);
  bool allowed_data[23 * 23] = {};
  expect_error_on_every_rank(
      [&](Strategy s) {
        run_modified(bad, s, [&](auto& o) { o.allowed = qkv::TensorView4<const bool>(allowed_data, {1, 1, 23, 23}); });
      },
      {"options.allowed cannot be sharded by position"});
  expect_error_on_every_rank(
      [&](Strategy s) {
        run_modified(bad, s, [&](auto& o) { o.bias = qkv::TensorView4<const float>(bias.data(), {1, 1, 23, 23}); });
      },
      {"options.bias cannot be sharded by position"});
  expect_error_on_every_rank(
      [&](Strategy s) {
        run_modified(bad, s, [&](auto& o) {
          o.cu_seqlens_q = {0, 23};
          o.cu_seqlens_k = {0, 23};
        });
      },
      {"cu_seqlens", "cannot be sharded by position"});
  expect_error_on_every_rank(
      [&](Strategy s) {
        run_modified(bad, s, [&](auto& o) { o.global_positions = qkv::GlobalPositions{0, 0, 23, 23}; });
      },
      {"options.global_positions is set"});
  expect_error_on_every_rank([&](Strategy s) { run_modified(bad, s, [&](auto& o) {
                                                 o.key_lengths = {23, 24};
                                               }); },
                             {"options.key_lengths[1] is 24", "the global Skv"});
  expect_error_on_every_rank([&](Strategy s) { run_modified(bad, s, [&](auto& o) { o.window_left = -3; }); },
                             {"options.window_left is -3"});
}

TEST(BadInput, FusedDoubleIsUnsupportedOnEveryRank) {
  qkv_test::Problem pr = qkv_test::make_problem({1, 4, 2, 11, 11, 8, 8}, 6);
  qkv_test::OwnedOptions<double> o = qkv_test::from_brute<double>(pr.p, qkv::Backend::fused);
  bool threw = false;
  try {
    (void)run_distributed<double>(pr, Strategy::ring, ShardLayout::contiguous, o.options);
  } catch (const qkv::unsupported_error& e) {
    threw = true;
    EXPECT_NE(std::string(e.what()).find("Backend::fused exists for float only"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(threw);
  EXPECT_EQ(count_ranks(threw), size_of_world());
}

// ---- the ring's per-rank peak allocation
// ------------------------------------------------------------------------------

TEST(RingAttention, PeakAllocationIsTheShardTwoBlocksAndOneCall) {
  const int rank = rank_of_world(), P = size_of_world();
  for (ShardLayout layout : {ShardLayout::contiguous, ShardLayout::zigzag}) {
    // 1024 rows per rank where the whole K/V is compared (P >= 4). At P = 4 the ring holds two travelling blocks (half
    // the whole K/V), one call's packed K/V of a chunk (on one thread one kv head's: a sixteenth; zigzag's chunks are
    // half that) and the partial state (an eighth): 0.69 of the whole, contiguous, plus the call's scratch, whose size
    // the build's tile shapes and the thread count fix (about 0.1 MiB per thread on an AVX-512 build; ctest runs one
    // OpenMP thread per rank, cmake/qkv_mpi.cmake). 256 rows per rank (the whole: 1 MiB) left too little room for it on
    // an AVX-512 build.
    const Index B = 1, Hq = 4, Hkv = 4, D = 32, Dv = 32, S = (P >= 4 ? 1024 : 256) * P;
    qkv_test::Problem pr = qkv_test::make_problem({B, Hq, Hkv, S, S, D, Dv}, 31);
    pr.p.causal = true;
    const qkv_test::OwnedOptions<float> o = qkv_test::from_brute<float>(pr.p);
    const auto rows = qkv::mpi::shard_rows(S, rank, P, layout);
    const Index own = qkv::mpi::detail::total_rows(rows);
    const std::vector<float> q = gather_rows<float>(pr.q, B, Hq, S, D, rows);
    const std::vector<float> k = gather_rows<float>(pr.k, B, Hkv, S, D, rows);
    const std::vector<float> v = gather_rows<float>(pr.v, B, Hkv, S, Dv, rows);
    std::vector<float> out(static_cast<std::size_t>(B * Hq * own * Dv)), lse(static_cast<std::size_t>(B * Hq * own));
    // The largest block and query chunk of any rank, and what one attention call of that size allocates (measured the
    // same way, in this process: the kernel's packed K/V and scratch).
    Index max_block = 0, max_chunk = 0;
    for (int r = 0; r < P; ++r) {
      const auto ranges = qkv::mpi::shard_rows(S, r, P, layout);
      max_block = std::max(max_block, qkv::mpi::detail::total_rows(ranges));
      for (const auto& range : ranges) max_chunk = std::max(max_chunk, range.second - range.first);
    }
    long long one_call = 0;
    {
      std::vector<float> qc(static_cast<std::size_t>(B * Hq * max_chunk * D), 0.5f),
          kc(static_cast<std::size_t>(B * Hkv * max_chunk * D), 0.5f), vc(kc.size(), 1.0f), oc(qc.size()),
          lc(static_cast<std::size_t>(B * Hq * max_chunk));
      qkv::AttentionOptions<float> options = o.options;
      options.causal = false;  // every key tile visited: the call's largest allocation
      qkv::release_workspace();  // the call's packed K/V counted in one_call, not left from earlier tests
      const long long before = g_live_bytes.load();
      g_peak_bytes = before;
      qkv::attention<float>(qkv::TensorView4<const float>(qc.data(), {B, Hq, max_chunk, D}),
                            qkv::TensorView4<const float>(kc.data(), {B, Hkv, max_chunk, D}),
                            qkv::TensorView4<const float>(vc.data(), {B, Hkv, max_chunk, Dv}),
                            qkv::TensorView4<float>(oc.data(), {B, Hq, max_chunk, Dv}),
                            qkv::TensorView3<float>(lc.data(), {B, Hq, max_chunk}), options);
      one_call = g_peak_bytes.load() - before;
    }
    const long long travelling =
        (P > 1 ? 2 : 1) * max_block * B * Hkv * (D + Dv) * static_cast<long long>(sizeof(float));
    const long long partial = max_chunk * B * Hq * (Dv + 1) * static_cast<long long>(sizeof(float));
    const long long slack = 64 * 1024;  // shard_rows' vectors, the options' copy, strings of the checks
    const long long whole_kv = S * B * Hkv * (D + Dv) * static_cast<long long>(sizeof(float));

    qkv::release_workspace();  // the ring's calls allocate their packed K/V inside the measured window
    MPI_Barrier(MPI_COMM_WORLD);
    const long long before = g_live_bytes.load();
    g_peak_bytes = before;
    qkv::mpi::ring_attention<float>(MPI_COMM_WORLD, qkv::TensorView4<const float>(q.data(), {B, Hq, own, D}),
                                    qkv::TensorView4<const float>(k.data(), {B, Hkv, own, D}),
                                    qkv::TensorView4<const float>(v.data(), {B, Hkv, own, Dv}),
                                    qkv::TensorView4<float>(out.data(), {B, Hq, own, Dv}),
                                    qkv::TensorView3<float>(lse.data(), {B, Hq, own}), o.options, layout);
    const long long peak = g_peak_bytes.load() - before;
    EXPECT_LE(peak, travelling + partial + one_call + slack)
        << "rank " << rank << " of " << P << (layout == ShardLayout::zigzag ? " zigzag" : " contiguous")
        << ": travelling blocks " << travelling << ", partial state " << partial << ", one call " << one_call;
    if (P >= 4) {
      EXPECT_LT(peak, whole_kv) << "rank " << rank << ": the whole sequence's K/V is " << whole_kv << " bytes";
    }
    EXPECT_GE(peak, travelling) << "rank " << rank << ": the two blocks are counted (the bound is not vacuous)";
  }
}

}  // namespace

int main(int argc, char** argv) {
  qkv::mpi::Environment mpi(&argc, &argv);
  ::testing::InitGoogleTest(&argc, argv);
  const int result = RUN_ALL_TESTS();
  int worst = result;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  if (result != 0) std::fprintf(stderr, "test_mpi: rank %d of %d failed\n", rank_of_world(), size_of_world());
  return worst;
}
