// Tests of qkv's threading policy (include/qkv/detail/threads.hpp; documented on qkv::attention and in README.md,
// "Threads"):
//   - many std::threads calling qkv::attention (fused and reference, float and double, masks, GQA, varlen, split-K
//     decoding) and a shared const MultiHeadAttention (forward, attention_weights) at once get, bit for bit, what one
//     call on one thread got first;
//   - calls from inside a user's `#pragma omp parallel` region do the same and never open a nested team, even with
//     nested parallelism allowed (observed through detail::TeamObserver);
//   - each calling thread's own omp_set_num_threads decides the size of the team its call opens.
// The shapes are above the kernels' thresholds for a team (2^20 multiply-adds on the fused path, 2^16 on the
// reference path), so the OpenMP regions really run in parallel; each test checks that it saw such a team.
// ThreadSanitizer runs this file with libomp's archer tool (the tsan presets, label `threads`).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/detail/threads.hpp"
#include "qkv/multi_head.hpp"
#include "support/problem.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using qkv::Index;
using qkv::Matrix;

constexpr int kCallerThreads = 8;

/// The bytes of a call's results (out, then lse): compared with memcmp, so −0.0 ≠ 0.0 and NaN payloads count.
using Bytes = std::vector<unsigned char>;

template <class T>
void append_bytes(Bytes& bytes, const T* data, std::size_t n) {
  const auto* first = reinterpret_cast<const unsigned char*>(data);
  bytes.insert(bytes.end(), first, first + n * sizeof(T));
}

/// One named call: deterministic inputs built once (shared, read-only), outputs allocated by each run.
struct Call {
  std::string name;
  std::function<Bytes()> run;
};

template <class T>
std::vector<T> random_vector(std::mt19937& rng, Index n) {
  std::normal_distribution<T> normal;
  std::vector<T> v(static_cast<std::size_t>(n));
  for (T& x : v) x = normal(rng);
  return v;
}

/// Inputs of one qkv::attention call over BHSD buffers (q, k, v drawn from std::mt19937(seed)), with its own mask
/// storage.
template <class T>
struct AttentionInputs : qkv_test::Shape {
  std::vector<T> q, k, v, bias;
  std::unique_ptr<bool[]> allowed;
  qkv::AttentionOptions<T> options;

  AttentionInputs(const qkv_test::Shape& shape, unsigned seed) : qkv_test::Shape(shape) {
    std::mt19937 rng(seed);
    q = random_vector<T>(rng, B * Hq * Sq * D);
    k = random_vector<T>(rng, B * Hkv * Skv * D);
    v = random_vector<T>(rng, B * Hkv * Skv * Dv);
  }
};

/// A Call that runs qkv::attention (with lse) on shared inputs.
template <class T>
Call attention_call(std::string name, std::shared_ptr<const AttentionInputs<T>> in) {
  return {std::move(name), [in] {
            const AttentionInputs<T>& c = *in;
            std::vector<T> out(static_cast<std::size_t>(c.B * c.Hq * c.Sq * c.Dv), T(-7));
            std::vector<T> lse(static_cast<std::size_t>(c.B * c.Hq * c.Sq), T(-7));
            qkv::attention<T>(qkv::view_bhsd<const T>(c.q.data(), c.B, c.Hq, c.Sq, c.D),
                              qkv::view_bhsd<const T>(c.k.data(), c.B, c.Hkv, c.Skv, c.D),
                              qkv::view_bhsd<const T>(c.v.data(), c.B, c.Hkv, c.Skv, c.Dv),
                              qkv::view_bhsd<T>(out.data(), c.B, c.Hq, c.Sq, c.Dv),
                              qkv::TensorView3<T>(lse.data(), {c.B, c.Hq, c.Sq}), c.options);
            Bytes bytes;
            append_bytes(bytes, out.data(), out.size());
            append_bytes(bytes, lse.data(), lse.size());
            return bytes;
          }};
}

/// Fused, GQA 8/2, B = 2: causal with a window, softcap, ALiBi, an `allowed` key mask per batch entry and a bias
/// with −∞ entries. About 2·2·(2·4·128)·256·128 ≈ 1.3e8 multiply-adds: well above the fused team threshold.
Call fused_masked_gqa() {
  auto c = std::make_shared<AttentionInputs<float>>(qkv_test::Shape{2, 8, 2, 128, 256, 64, 64}, 11);
  c->allowed.reset(new bool[static_cast<std::size_t>(c->B * c->Skv)]);
  for (Index n = 0; n < c->B * c->Skv; ++n) c->allowed[static_cast<std::size_t>(n)] = n % 7 != 3;
  c->bias.assign(static_cast<std::size_t>(c->Sq * c->Skv), 0.25f);
  for (Index i = 0; i < c->Sq; ++i)
    c->bias[static_cast<std::size_t>(i * c->Skv + (i * 5) % c->Skv)] = -std::numeric_limits<float>::infinity();
  c->options.causal = true;
  c->options.window_left = 150;
  c->options.softcap = 20.0f;
  c->options.alibi_slopes = {0.5f, 0.25f, 0.125f, 0.0625f, 0.5f, 0.25f, 0.125f, 0.0625f};
  c->options.allowed = qkv::TensorView4<const bool>(c->allowed.get(), {c->B, 1, 1, c->Skv});
  c->options.bias = qkv::TensorView4<const float>(c->bias.data(), {1, 1, c->Sq, c->Skv});
  c->options.backend = qkv::Backend::fused;
  return attention_call<float>("fused, GQA 8/2, masks", c);
}

/// Fused varlen batch of three sequences (one empty on the query side), multi-head, Dv ≠ D, causal, sinks.
Call fused_varlen() {
  auto c = std::make_shared<AttentionInputs<float>>(qkv_test::Shape{1, 4, 4, 230, 300, 32, 48}, 12);
  c->options.cu_seqlens_q = {0, 100, 100, 230};
  c->options.cu_seqlens_k = {0, 150, 170, 300};
  c->options.causal = true;
  c->options.sinks = {0.5f, -1.0f, 2.0f, -std::numeric_limits<float>::infinity()};
  c->options.backend = qkv::Backend::fused;
  return attention_call<float>("fused, varlen", c);
}

/// Fused decoding: Sq = 1, GQA 8/2, 5000 keys split into chunks (split-K merged in chunk order), key padding.
Call fused_decode_split_keys() {
  auto c = std::make_shared<AttentionInputs<float>>(qkv_test::Shape{2, 8, 2, 1, 5000, 64, 64}, 13);
  c->options.key_lengths = {5000, 4321};
  c->options.backend = qkv::Backend::fused;
  return attention_call<float>("fused, decode split-K", c);
}

/// The reference backend (float, and double, which runs it by default): GQA 4/2, causal, a bias [1, Hq, Sq, Skv].
/// q.size()·Skv = 4·64·32·128 ≈ 1e6, above the reference team threshold.
template <class T>
Call reference_gqa(qkv::Backend backend, const char* name) {
  auto c = std::make_shared<AttentionInputs<T>>(qkv_test::Shape{1, 4, 2, 64, 128, 32, 32}, 14);
  c->bias.assign(static_cast<std::size_t>(c->Hq * c->Sq * c->Skv), T(0.125));
  for (std::size_t n = 0; n < c->bias.size(); n += 11) c->bias[n] = -std::numeric_limits<T>::infinity();
  c->options.causal = true;
  c->options.alignment = qkv::CausalAlignment::top_left;
  c->options.bias = qkv::TensorView4<const T>(c->bias.data(), {1, c->Hq, c->Sq, c->Skv});
  c->options.backend = backend;
  return attention_call<T>(name, c);
}

/// A shared const module (GQA 8/2, d_model 128, head_dim 16): self-attention (causal), cross-attention, and the
/// weights of one head (the reference path in double). Attention work 2·(4·150)·150·32 ≈ 5.8e6 multiply-adds.
std::vector<Call> module_calls() {
  struct Module {
    std::unique_ptr<qkv::MultiHeadAttention<float>> mha;
    Matrix<float> X, X_kv;
    qkv::AttentionOptions<float> causal;
  };
  auto m = std::make_shared<Module>();
  qkv::MultiHeadAttention<float>::Config config;
  config.d_model = 128;
  config.n_heads = 8;
  config.n_kv_heads = 2;
  m->mha = std::make_unique<qkv::MultiHeadAttention<float>>(config);
  std::mt19937 rng(15);
  // Returns a Matrix, not the Eigen expression: the expression would refer to a temporary destroyed on return.
  auto random_matrix = [&rng](Index rows, Index cols) -> Matrix<float> {
    const std::vector<float> data = random_vector<float>(rng, rows * cols);
    return Matrix<float>(Eigen::Map<const Matrix<float>>(data.data(), rows, cols)) * (1.0f / std::sqrt(float(rows)));
  };
  qkv::MultiHeadAttention<float>& mha = *m->mha;
  mha.W_q = random_matrix(128, 128);
  mha.W_k = random_matrix(128, 32);
  mha.W_v = random_matrix(128, 32);
  mha.W_o = random_matrix(128, 128);
  mha.b_q = random_matrix(128, 1);
  mha.b_k = random_matrix(32, 1);
  mha.b_v = random_matrix(32, 1);
  mha.b_o = random_matrix(128, 1);
  m->X = random_matrix(150, 128);
  m->X_kv = random_matrix(170, 128);
  m->causal.causal = true;
  std::shared_ptr<const Module> module = m;
  auto bytes_of = [](const Matrix<float>& Y) {
    Bytes bytes;
    append_bytes(bytes, Y.data(), static_cast<std::size_t>(Y.size()));
    return bytes;
  };
  return {
      {"module forward, self, causal",
       [module, bytes_of] { return bytes_of(module->mha->forward(module->X, module->causal)); }},
      {"module forward, cross", [module, bytes_of] { return bytes_of(module->mha->forward(module->X, module->X_kv)); }},
      {"module attention_weights, head 5",
       [module, bytes_of] { return bytes_of(module->mha->attention_weights(module->X, module->X_kv, 5)); }}};
}

std::vector<Call> all_calls() {
  std::vector<Call> calls = {fused_masked_gqa(), fused_varlen(), fused_decode_split_keys(),
                             reference_gqa<float>(qkv::Backend::reference, "reference, float"),
                             reference_gqa<double>(qkv::Backend::automatic, "reference, double")};
  for (Call& call : module_calls()) calls.push_back(std::move(call));
  return calls;
}

/// Records what TeamObserver reports: the number of regions, the largest team, the deepest active level.
struct TeamLog {
  std::mutex mutex;
  int regions = 0;
  int largest_team = 0;
  int deepest_active_level = 0;

  static void record(int team_size, int active_level, void* context) {
    TeamLog& log = *static_cast<TeamLog*>(context);
    std::lock_guard<std::mutex> lock(log.mutex);
    ++log.regions;
    log.largest_team = std::max(log.largest_team, team_size);
    log.deepest_active_level = std::max(log.deepest_active_level, active_level);
  }
};

/// Installs a TeamLog for the lifetime of the object (set and cleared while no other thread runs qkv).
class ObserveTeams {
 public:
  explicit ObserveTeams(TeamLog& log) {
    qkv::detail::TeamObserver::context = &log;
    qkv::detail::TeamObserver::callback = &TeamLog::record;
  }
  ~ObserveTeams() {
    qkv::detail::TeamObserver::callback = nullptr;
    qkv::detail::TeamObserver::context = nullptr;
  }
  ObserveTeams(const ObserveTeams&) = delete;
  ObserveTeams& operator=(const ObserveTeams&) = delete;
};

/// The results of every call, each computed once on this thread alone, with one OpenMP thread.
std::vector<Bytes> single_threaded_results(const std::vector<Call>& calls) {
#if defined(_OPENMP)
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
#endif
  std::vector<Bytes> results;
  for (const Call& call : calls) results.push_back(call.run());
#if defined(_OPENMP)
  omp_set_num_threads(saved);
#endif
  return results;
}

/// Runs every call `rounds` times, starting at call `first` (so concurrent callers run different calls at once);
/// adds each call whose result differs from `expected` to `mismatches`.
void run_and_compare(const std::vector<Call>& calls, const std::vector<Bytes>& expected, std::size_t first, int rounds,
                     std::vector<std::string>& mismatches) {
  for (int round = 0; round < rounds; ++round) {
    for (std::size_t n = 0; n < calls.size(); ++n) {
      const std::size_t index = (first + n) % calls.size();
      if (calls[index].run() != expected[index]) mismatches.push_back(calls[index].name);
    }
  }
}

TEST(ThreadSafety, ConcurrentStdThreadsMatchTheSingleThreadedResultBitForBit) {
  const std::vector<Call> calls = all_calls();
  const std::vector<Bytes> expected = single_threaded_results(calls);
  TeamLog log;
  std::vector<std::vector<std::string>> mismatches(kCallerThreads);
  {
    ObserveTeams observe(log);
    std::vector<std::thread> callers;
    for (int t = 0; t < kCallerThreads; ++t) {
      callers.emplace_back([&, t] {
#if defined(_OPENMP)
        omp_set_num_threads(2);  // this caller's own team size (the policy), whatever the machine's core count
#endif
        run_and_compare(calls, expected, static_cast<std::size_t>(t), 2, mismatches[static_cast<std::size_t>(t)]);
      });
    }
    for (std::thread& caller : callers) caller.join();
  }
  for (int t = 0; t < kCallerThreads; ++t) {
    EXPECT_TRUE(mismatches[static_cast<std::size_t>(t)].empty())
        << "thread " << t << " differs first on: " << mismatches[static_cast<std::size_t>(t)].front();
  }
#if defined(_OPENMP)
  EXPECT_GT(log.regions, 0);
  EXPECT_EQ(log.largest_team, 2) << "the shapes must be large enough for qkv to open a team of the caller's size";
  EXPECT_EQ(log.deepest_active_level, 1);
#endif
}

TEST(ThreadSafety, CallsInsideAUserParallelRegionRunOnTheCallingThreadAndMatch) {
#if !defined(_OPENMP)
  GTEST_SKIP() << "built without OpenMP: there is no parallel region to call from";
#else
  const std::vector<Call> calls = all_calls();
  const std::vector<Bytes> expected = single_threaded_results(calls);
  TeamLog log;
  std::vector<std::vector<std::string>> mismatches(4);
  int outer_team = 0;
  const int saved_levels = omp_get_max_active_levels();
  omp_set_max_active_levels(2);  // nested teams allowed: only qkv's own policy keeps it from opening one
  {
    ObserveTeams observe(log);
#pragma omp parallel num_threads(4)
    {
#pragma omp single
      outer_team = omp_get_num_threads();
      omp_set_num_threads(2);  // the size a nested team would have
      const int t = omp_get_thread_num();
      run_and_compare(calls, expected, static_cast<std::size_t>(t), 1, mismatches[static_cast<std::size_t>(t)]);
    }
  }
  omp_set_max_active_levels(saved_levels);
  ASSERT_EQ(outer_team, 4);
  for (std::size_t t = 0; t < mismatches.size(); ++t) {
    EXPECT_TRUE(mismatches[t].empty()) << "thread " << t << " differs first on: " << mismatches[t].front();
  }
  EXPECT_GE(log.regions, 4 * 5);  // each thread's five qkv::attention calls open a region each, at least
  EXPECT_EQ(log.largest_team, 1) << "a call inside an active parallel region opened a nested team";
  EXPECT_EQ(log.deepest_active_level, 1) << "a call inside an active parallel region opened a nested team";
#endif
}

/// Runs `inner` once, from inside the first parallel region a qkv call opens (on its thread 0, the calling thread, while
/// that call holds the thread's workspace of packed K and V), after trying to free that workspace there.
struct CallInsideACall {
  const Call* inner = nullptr;
  Bytes result;
  bool started = false;

  static void record(int, int, void* context) {
    CallInsideACall& self = *static_cast<CallInsideACall*>(context);
    if (self.started) return;  // the inner call's own regions report here too
    self.started = true;
    qkv::release_workspace();  // must leave the running call's buffers alone
    self.result = self.inner->run();
  }
};

TEST(ThreadSafety, ACallMadeWhileAnotherRunsOnTheThreadTakesBuffersOfItsOwn) {
#if !defined(_OPENMP)
  GTEST_SKIP() << "built without OpenMP: no parallel region to make the inner call from";
#else
  // The calling thread keeps its packed K and V between calls (qkv::release_workspace). A call made while another
  // runs on the same thread (here from the observer of the first region the outer call opens, while it holds the
  // workspace) must neither use nor free the buffers the outer call is packing and reading.
  const std::vector<Call> calls = all_calls();
  const std::vector<Bytes> expected = single_threaded_results(calls);
  const Call& outer = calls[0];  // fused, GQA 8/2, masks: its task loop opens a team
  CallInsideACall nested;
  nested.inner = &calls[1];  // fused varlen: other shapes, other packed K and V
  Bytes outer_result;
  qkv::detail::TeamObserver::context = &nested;
  qkv::detail::TeamObserver::callback = &CallInsideACall::record;
  outer_result = outer.run();
  qkv::detail::TeamObserver::callback = nullptr;
  qkv::detail::TeamObserver::context = nullptr;
  ASSERT_TRUE(nested.started) << "the outer call opened no parallel region";
  EXPECT_TRUE(outer_result == expected[0]) << outer.name << " differs after a call made inside it";
  EXPECT_TRUE(nested.result == expected[1]) << calls[1].name << " differs when made inside another call";
#endif
}

TEST(ThreadSafety, EachCallerThreadChoosesItsTeamSizeWithOmpSetNumThreads) {
#if !defined(_OPENMP)
  GTEST_SKIP() << "built without OpenMP";
#else
  const Call call = fused_masked_gqa();
  const Bytes expected = call.run();
  // The observer runs on thread 0 of each region, which is the calling thread: thread-local storage separates callers.
  static thread_local int largest_team = 0;
  struct PerThread {
    static void record(int team_size, int, void*) { largest_team = std::max(largest_team, team_size); }
  };
  int team[2] = {0, 0};
  bool same[2] = {false, false};
  qkv::detail::TeamObserver::callback = &PerThread::record;
  {
    std::vector<std::thread> callers;
    for (int t = 0; t < 2; ++t) {
      callers.emplace_back([&, t] {
        omp_set_num_threads(t + 1);
        same[t] = call.run() == expected;
        team[t] = largest_team;
      });
    }
    for (std::thread& caller : callers) caller.join();
  }
  qkv::detail::TeamObserver::callback = nullptr;
  EXPECT_TRUE(same[0]);
  EXPECT_TRUE(same[1]);
  EXPECT_EQ(team[0], 1) << "omp_set_num_threads(1) in the caller must keep its call on one thread";
  EXPECT_EQ(team[1], 2) << "omp_set_num_threads(2) in the caller must give its call a team of 2";
#endif
}

}  // namespace
