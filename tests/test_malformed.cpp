// The malformed-input table of docs/malformed_inputs.md, one row per test: every row calls a public function with
// one malformed input and expects qkv::shape_error (not another exception) whose message starts with the function's
// name and contains the row's excerpt (the argument and the sizes involved, written here by hand from the inputs).
// A last test reads docs/malformed_inputs.md and checks that its IDs are exactly this table's, each with the same
// function and a message containing the excerpt, so the table and the tests cannot drift.
//
// Set QKV_PRINT_MALFORMED_ROWS=1 to print each row as a Markdown line with the message qkv actually gives (that is
// how the document's message column is written).
#include <gtest/gtest.h>

#include <array>
#include <cstdlib>
#include <exception>
#include <fstream>
#include <functional>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "qkv/qkv.hpp"
#include "support/backward_call.hpp"
#include "support/problem.hpp"

#ifndef QKV_MALFORMED_DOC
#error "QKV_MALFORMED_DOC must be the path of docs/malformed_inputs.md (set by tests/CMakeLists.txt)"
#endif

namespace {

using qkv::Index;
using qkv::TensorView3;
using qkv::TensorView4;

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr std::size_t kRoom = qkv_test::ValidCall::kRoom;  // every buffer's size: no malformed view points past it

using Call = qkv_test::ValidCall;  // a valid core call; each row breaks one thing
using VarlenCall = qkv_test::ValidVarlenCall;

/// The valid core call of ValidCall (q [2, 4, 3, 4], k [2, 2, 5, 4], v [2, 2, 5, 3], out [2, 4, 3, 3], lse [2, 4, 3])
/// with k and v stored as S (Eigen::half or Eigen::bfloat16): qkv::attention's 16-bit overloads.
template <class S>
struct Kv16Call : qkv_test::ValidCall {
  std::vector<S> k16_data = std::vector<S>(kRoom, S(0.25f)), v16_data = std::vector<S>(kRoom, S(1.0f));
  TensorView4<const S> k16{k16_data.data(), {B, Hkv, Skv, D}};
  TensorView4<const S> v16{v16_data.data(), {B, Hkv, Skv, Dv}};

  void run() { qkv::attention(q, k16, v16, out, options); }
  void run_with_lse() { qkv::attention(q, k16, v16, out, lse, options); }
};

using qkv_test::BackwardCall;

/// merge_attention_states over [1, 2, 4, 3] states.
struct MergeCall {
  std::vector<float> a_out = std::vector<float>(kRoom, 1.0f), b_out = std::vector<float>(kRoom, 2.0f),
                     out = std::vector<float>(kRoom, 0.0f), a_lse = std::vector<float>(kRoom, 0.0f),
                     b_lse = std::vector<float>(kRoom, 0.0f), lse = std::vector<float>(kRoom, 0.0f);
  static TensorView4<float> view4(float* x) { return TensorView4<float>(x, {1, 2, 4, 3}); }
  static TensorView3<float> view3(float* x) { return TensorView3<float>(x, {1, 2, 4}); }
  void run(TensorView4<float> out_b, TensorView3<float> lse_a, TensorView4<float> out_view,
           TensorView3<float> lse_view) {
    qkv::merge_attention_states(view4(a_out.data()), lse_a, out_b, view3(b_lse.data()), out_view, lse_view);
  }
};

using BoolMatrix = Eigen::Matrix<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// A module d_model 8, n_heads 2 (n_kv_heads 2), head_dim 4.
qkv::MultiHeadAttention<float> small_module() {
  qkv::MultiHeadAttention<float>::Config config;
  config.d_model = 8;
  config.n_heads = 2;
  return qkv::MultiHeadAttention<float>(config);
}

/// A core call whose view `member` (q, k, v or out) is replaced by a view of the same buffer with `extents`.
template <class View>
std::function<void()> core_with_extents(View Call::*member, std::array<Index, 4> extents) {
  return [=] {
    Call c;
    c.*member = View((c.*member).data(), extents);
    c.run();
  };
}

/// scaled_dot_product_attention on all-one Q, K and V of the given shapes (rows, columns), with `heads` when given.
std::function<void()> sdpa_on_ones(std::array<Index, 2> q, std::array<Index, 2> k, std::array<Index, 2> v,
                                   std::optional<qkv::Heads> heads = std::nullopt) {
  return [=] {
    const qkv::Matrix<float> Q = qkv::Matrix<float>::Ones(q[0], q[1]), K = qkv::Matrix<float>::Ones(k[0], k[1]),
                             V = qkv::Matrix<float>::Ones(v[0], v[1]);
    if (heads) {
      (void)qkv::scaled_dot_product_attention(Q, K, V, *heads);
    } else {
      (void)qkv::scaled_dot_product_attention(Q, K, V);
    }
  };
}

struct Row {
  std::string id;        // M01, M02, …
  std::string input;     // what is malformed, as the document's "input" column says it
  std::string function;  // the function the message must start with
  std::string excerpt;   // must appear in the message: the argument and the sizes involved
  std::function<void()> call;
};

std::vector<Row> table() {
  std::vector<Row> rows;
  auto add = [&rows](std::string input, std::string function, std::string excerpt, std::function<void()> call) {
    std::ostringstream id;
    id << "M" << (rows.size() + 1 < 10 ? "0" : "") << rows.size() + 1;
    rows.push_back({id.str(), std::move(input), std::move(function), std::move(excerpt), std::move(call)});
  };
  const std::string core = "qkv::attention";

  // ---- qkv::attention over views -------------------------------------------------------------------------------
  add("q with a negative extent: [2, 4, -1, 4]", core, "q axis 2 (Sq) has negative extent -1",
      core_with_extents(&Call::q, {2, 4, -1, 4}));
  add("k with a negative stride on Skv: strides [40, 20, -4, 1]", core, "k axis 2 (Skv) has negative stride -4", [] {
    Call c;
    c.k = TensorView4<const float>(c.k_data.data(), {2, 2, 5, 4}, {40, 20, -4, 1});
    c.run();
  });
  add("v with null data and extents [2, 2, 5, 3]", core, "v has 60 elements but null data", [] {
    Call c;
    c.v = TensorView4<const float>(nullptr, {2, 2, 5, 3});
    c.run();
  });
  add("q with innermost stride 2: extents [2, 4, 3, 4], strides [96, 24, 8, 2]", core,
      "q axis 3 (D) has stride 2, expected 1", [] {
        Call c;
        c.q = TensorView4<const float>(c.q_data.data(), {2, 4, 3, 4}, {96, 24, 8, 2});
        c.run();
      });
  add("k with batch 1, q with batch 2", core, "k axis 0 (B) has extent 1, expected 2 (the extent of q axis 0)",
      core_with_extents(&Call::k, {1, 2, 5, 4}));
  add("k with head_dim 3, q with head_dim 4", core, "k axis 3 (D) has extent 3, expected 4 (the extent of q axis 3)",
      core_with_extents(&Call::k, {2, 2, 5, 3}));
  add("D = 0: q [2, 4, 3, 0], k [2, 2, 5, 0]", core, "q axis 3 (D) has extent 0, expected at least 1", [] {
    Call c;
    c.q = TensorView4<const float>(c.q_data.data(), {2, 4, 3, 0});
    c.k = TensorView4<const float>(c.k_data.data(), {2, 2, 5, 0});
    c.run();
  });
  add("Hq % Hkv != 0: 4 query heads, 3 key/value heads", core,
      "q axis 1 (Hq) has extent 4, not a multiple of k axis 1 (Hkv) extent 3", [] {
        Call c;
        c.k = TensorView4<const float>(c.k_data.data(), {2, 3, 5, 4});
        c.v = TensorView4<const float>(c.v_data.data(), {2, 3, 5, 3});
        c.run();
      });
  add("Hkv = 0 with 4 query heads", core, "k axis 1 (Hkv) has extent 0 but q has 4 heads",
      core_with_extents(&Call::k, {2, 0, 5, 4}));
  add("v with 4 keys, k with 5", core, "v axis 2 (Skv) has extent 4, expected 5 (the extent of k axis 2)",
      core_with_extents(&Call::v, {2, 2, 4, 3}));
  add("out with Dv 2, v with Dv 3", core, "out axis 3 (Dv) has extent 2, expected 3 (the extent of v axis 3)",
      core_with_extents(&Call::out, {2, 4, 3, 2}));
  add("out whose strides make distinct indices share elements: strides [36, 9, 1, 1]", core,
      "out has strides whose elements overlap (extents [2, 4, 3, 3], strides [36, 9, 1, 1])", [] {
        Call c;
        c.out = TensorView4<float>(c.out_data.data(), {2, 4, 3, 3}, {36, 9, 1, 1});
        c.run();
      });
  add("out overlapping q: out starts 5 floats into q's memory", core,
      "out overlaps an input (q): out (288 bytes) starts 20 bytes after the start of q (384 bytes)", [] {
        Call c;
        c.out = TensorView4<float>(c.q_data.data() + 5, {2, 4, 3, 3});
        c.run();
      });
  add("out on v's memory", core,
      "out overlaps an input (v): out (288 bytes) starts 0 bytes after the start of v (240 bytes)", [] {
        Call c;
        c.out = TensorView4<float>(c.v_data.data(), {2, 4, 3, 3});
        c.run();
      });
  add("lse with Sq 4, q with Sq 3", core, "lse axis 2 (Sq) has extent 4, expected 3 (the extents of q axes 0-2)", [] {
    Call c;
    c.lse = TensorView3<float>(c.lse_data.data(), {2, 4, 4});
    c.run_with_lse();
  });
  add("lse on out's memory", core, "lse overlaps out: lse (96 bytes) starts 0 bytes after the start of out (288 bytes)",
      [] {
        Call c;
        c.lse = TensorView3<float>(c.out_data.data(), {2, 4, 3});
        c.run_with_lse();
      });
  add("options.scale = NaN", core, "options.scale is nan, expected a finite number", [] {
    Call c;
    c.options.scale = kNaN;
    c.run();
  });
  add("options.softcap = -1", core, "options.softcap is -1, expected 0 (off) or a finite positive number", [] {
    Call c;
    c.options.softcap = -1.0f;
    c.run();
  });
  add("options.window_left = -2", core, "options.window_left is -2, expected -1 (unbounded) or at least 0", [] {
    Call c;
    c.options.window_left = -2;
    c.run();
  });
  add("options.global_tokens = -1", core, "options.global_tokens is -1, expected at least 0", [] {
    Call c;
    c.options.global_tokens = -1;
    c.run();
  });
  add("options.key_lengths with 1 entry for batch 2", core,
      "options.key_lengths has 1 entries, expected 2 (one per batch entry, q axis 0)", [] {
        Call c;
        c.options.key_lengths = {5};
        c.run();
      });
  add("options.key_lengths = {5, 6} with Skv 5", core,
      "options.key_lengths[1] is 6, expected a length in [0, 5] (k axis 2, Skv)", [] {
        Call c;
        c.options.key_lengths = {5, 6};
        c.run();
      });
  add("options.allowed [2, 4, 3, 4] with Skv 5", core,
      "options.allowed axis 3 (Skv) has extent 4, expected 5 (the extent of k axis 2)", [] {
        Call c;
        c.options.allowed = TensorView4<const bool>(c.allowed_data.get(), {2, 4, 3, 4});
        c.run();
      });
  add("options.bias [1, 2, 3, 5] with Hq 4", core, "options.bias axis 1 (Hq) has extent 2, expected 4 or 1 (broadcast)",
      [] {
        Call c;
        c.options.bias = TensorView4<const float>(c.bias_data.data(), {1, 2, 3, 5});
        c.run();
      });
  add("options.bias with innermost stride 2", core, "options.bias axis 3 (Skv) has stride 2, expected 1", [] {
    Call c;
    c.options.bias = TensorView4<const float>(c.bias_data.data(), {1, 1, 3, 5}, {30, 30, 10, 2});
    c.run();
  });
  add("options.alibi_slopes with 2 entries for 4 query heads", core,
      "options.alibi_slopes has 2 entries, expected 4 (one per query head, q axis 1)", [] {
        Call c;
        c.options.alibi_slopes = {0.5f, 0.25f};
        c.run();
      });
  add("options.sinks with 1 entry for 4 query heads", core,
      "options.sinks has 1 entries, expected 4 (one per query head, q axis 1)", [] {
        Call c;
        c.options.sinks = {0.0f};
        c.run();
      });
  add("cu_seqlens with batch extent 2", core, "q axis 0 (B) has extent 2, expected 1 with cu_seqlens (varlen)", [] {
    Call c;
    c.options.cu_seqlens_q = {0, 3};
    c.options.cu_seqlens_k = {0, 5};
    c.run();
  });
  add("cu_seqlens_k not increasing: {0, 7, 5, 10}", core,
      "options.cu_seqlens_k decreases at 2: options.cu_seqlens_k[1] = 7 > options.cu_seqlens_k[2] = 5", [] {
        VarlenCall c;
        c.options.cu_seqlens_q = {0, 2, 4, 6};
        c.options.cu_seqlens_k = {0, 7, 5, 10};
        c.run();
      });
  add("cu_seqlens_q ending at 5 over 6 query rows", core,
      "options.cu_seqlens_q ends at 5, expected 6 (the row count of the view)", [] {
        VarlenCall c;
        c.options.cu_seqlens_q = {0, 2, 5};
        c.run();
      });
  add("cu_seqlens_q with 2 entries, cu_seqlens_k with 3", core,
      "options.cu_seqlens_q has 2 entries and options.cu_seqlens_k 3, expected the same (B+1)", [] {
        VarlenCall c;
        c.options.cu_seqlens_q = {0, 6};
        c.run();
      });
  add("cu_seqlens_q[0] = 1", core, "options.cu_seqlens_q[0] is 1, expected 0", [] {
    VarlenCall c;
    c.options.cu_seqlens_q = {1, 2, 6};
    c.run();
  });
  add("cu_seqlens together with key_lengths", core,
      "options.key_lengths cannot be combined with cu_seqlens (it has 1 entries, cu_seqlens_q 3)", [] {
        VarlenCall c;
        c.options.key_lengths = {3};
        c.run();
      });
  add("cu_seqlens together with a bias [1, 1, 6, 10]", core,
      "options.bias cannot be combined with cu_seqlens (it has extents [1, 1, 6, 10], strides [60, 60, 10, 1]; "
      "cu_seqlens_q has 3 entries)",
      [] {
        VarlenCall c;
        c.options.bias = TensorView4<const float>(c.bias_data.data(), {1, 1, 6, 10});
        c.run();
      });

  // ---- merge_attention_states ----------------------------------------------------------------------------------
  const std::string merge = "qkv::merge_attention_states";
  add("out_b with Dv 2, out_a with Dv 3", merge, "out_b axis 3 (Dv) has extent 2, expected 3 (the extent of out_a)",
      [] {
        MergeCall m;
        m.run(TensorView4<float>(m.b_out.data(), {1, 2, 4, 2}), MergeCall::view3(m.a_lse.data()),
              MergeCall::view4(m.out.data()), MergeCall::view3(m.lse.data()));
      });
  add("lse with S 3, out_a with S 4", merge, "lse axis 2 (S) has extent 3, expected 4 (the extent of out_a)", [] {
    MergeCall m;
    m.run(MergeCall::view4(m.b_out.data()), MergeCall::view3(m.a_lse.data()), MergeCall::view4(m.out.data()),
          TensorView3<float>(m.lse.data(), {1, 2, 3}));
  });
  add("out overlapping out_a one float off (not the exact in-place view)", merge,
      "out overlaps out_a without being the same view (only exact in-place use is allowed): out (96 bytes) starts 4 "
      "bytes after the start of out_a (96 bytes)",
      [] {
        MergeCall m;
        m.run(MergeCall::view4(m.b_out.data()), MergeCall::view3(m.a_lse.data()), MergeCall::view4(m.a_out.data() + 1),
              MergeCall::view3(m.lse.data()));
      });
  add("lse_a with null data and extents [1, 2, 4]", merge, "lse_a has 8 elements but null data", [] {
    MergeCall m;
    m.run(MergeCall::view4(m.b_out.data()), TensorView3<float>(nullptr, {1, 2, 4}), MergeCall::view4(m.out.data()),
          MergeCall::view3(m.lse.data()));
  });

  // ---- Eigen entry points (sdpa.hpp) -----------------------------------------------------------------------------
  const std::string sdpa = "qkv::scaled_dot_product_attention";
  add("one head: Q 3 × 4, K 5 × 3", sdpa, "K has 3 columns, expected 4 (n_kv_heads 1 × head_dim 4 from Q)",
      sdpa_on_ones({3, 4}, {5, 3}, {5, 2}));
  add("one head: K with 5 rows, V with 4", sdpa, "V has 4 rows, expected 5 (the rows of K)",
      sdpa_on_ones({3, 4}, {5, 4}, {4, 2}));
  add("packed: Q with 10 columns, Heads{4}", sdpa, "Q has 10 columns, not a multiple of n_heads 4",
      sdpa_on_ones({3, 10}, {5, 8}, {5, 8}, qkv::Heads{4}));
  add("packed: Heads{4, 3} (Hq % Hkv != 0)", sdpa, "Heads::n_heads 4 is not a multiple of Heads::n_kv_heads 3",
      sdpa_on_ones({3, 8}, {5, 6}, {5, 6}, qkv::Heads{4, 3}));
  add("packed: Heads{0}", sdpa, "Heads::n_heads is 0, expected at least 1",
      sdpa_on_ones({3, 8}, {5, 8}, {5, 8}, qkv::Heads{0}));
  add("packed: V with 5 columns, Heads{4, 2}", sdpa, "V has 5 columns, not a multiple of n_kv_heads 2",
      sdpa_on_ones({3, 8}, {5, 4}, {5, 5}, qkv::Heads{4, 2}));
  add("one head: Q, K with 0 columns (D = 0)", sdpa,
      "Q has 0 columns, expected at least n_heads 1 (head_dim = columns / n_heads must be at least 1)",
      sdpa_on_ones({3, 0}, {5, 0}, {5, 2}));
  add("options.key_lengths with 2 entries on an Eigen entry point (B = 1)", sdpa,
      "options.key_lengths has 2 entries, expected 1 (one per batch entry, q axis 0)", [] {
        const qkv::Matrix<float> Q = qkv::Matrix<float>::Ones(3, 4), K = qkv::Matrix<float>::Ones(5, 4),
                                 V = qkv::Matrix<float>::Ones(5, 2);
        qkv::AttentionOptions<float> options;
        options.key_lengths = {5, 5};
        (void)qkv::scaled_dot_product_attention(Q, K, V, options);
      });
  add("options.allowed a 2 × 5 bool matrix for Q with 3 rows", sdpa,
      "options.allowed axis 2 (Sq) has extent 2, expected 3 or 1 (broadcast)", [] {
        const qkv::Matrix<float> Q = qkv::Matrix<float>::Ones(3, 4), K = qkv::Matrix<float>::Ones(5, 4),
                                 V = qkv::Matrix<float>::Ones(5, 2);
        const BoolMatrix allowed = BoolMatrix::Constant(2, 5, true);
        qkv::AttentionOptions<float> options;
        options.allowed = allowed;
        (void)qkv::scaled_dot_product_attention(Q, K, V, options);
      });
  add("attention_weights: head 4 of Heads{4}", "qkv::attention_weights", "head is 4, expected an index in [0, 4)", [] {
    const qkv::Matrix<float> Q = qkv::Matrix<float>::Ones(3, 8), K = qkv::Matrix<float>::Ones(5, 8);
    (void)qkv::attention_weights(Q, K, qkv::Heads{4}, 4);
  });

  // ---- MultiHeadAttention and KVCache ---------------------------------------------------------------------------
  const std::string module = "qkv::MultiHeadAttention";
  const std::string forward = "qkv::MultiHeadAttention::forward";
  add("Config n_heads 6, n_kv_heads 4", module, "Config::n_heads 6 is not a multiple of Config::n_kv_heads 4", [] {
    qkv::MultiHeadAttention<float>::Config config;
    config.d_model = 12;
    config.n_heads = 6;
    config.n_kv_heads = 4;
    qkv::MultiHeadAttention<float> mha(config);
  });
  add("Config d_model 10, n_heads 4, head_dim 0", module, "Config::d_model 10 is not divisible by Config::n_heads 4",
      [] {
        qkv::MultiHeadAttention<float>::Config config;
        config.d_model = 10;
        config.n_heads = 4;
        qkv::MultiHeadAttention<float> mha(config);
      });
  add("forward: X with 5 columns, d_model 8", forward, "X has 5 columns, expected d_model 8", [] {
    const auto mha = small_module();
    (void)mha.forward(qkv::Matrix<float>::Ones(3, 5));
  });
  add("W_q assigned 8 × 4 (expected 8 × 8)", forward, "W_q is 8 × 4, expected 8 × 8 ([d_model, n_heads·head_dim])", [] {
    auto mha = small_module();
    mha.W_q = qkv::Matrix<float>::Zero(8, 4);
    (void)mha.forward(qkv::Matrix<float>::Ones(3, 8));
  });
  add("forward(X_q, X_k, X_v): X_k with 5 rows, X_v with 4", forward, "X_v has 4 rows, expected 5 (the rows of X_k)",
      [] {
        const auto mha = small_module();
        (void)mha.forward(qkv::Matrix<float>::Ones(3, 8), qkv::Matrix<float>::Ones(5, 8),
                          qkv::Matrix<float>::Ones(4, 8));
      });
  add("forward: cu_seqlens_q ending at 4 over X with 5 rows", forward,
      "options.cu_seqlens_q ends at 4, expected 5 (the rows of X)", [] {
        const auto mha = small_module();
        qkv::AttentionOptions<float> options;
        options.cu_seqlens_q = {0, 4};
        options.cu_seqlens_k = {0, 5};
        (void)mha.forward(qkv::Matrix<float>::Ones(5, 8), options);
      });
  add("forward(X_new, cache): KV cache overflow, 3 of 4 tokens held, 2 appended", forward,
      "the KV cache overflows: it holds 3 of 4 tokens and 2 more were appended (5 > capacity 4)", [] {
        const auto mha = small_module();
        qkv::KVCache<float> cache = mha.make_cache(4);
        (void)mha.forward(qkv::Matrix<float>::Ones(3, 8), cache);
        (void)mha.forward(qkv::Matrix<float>::Ones(2, 8), cache);
      });
  add("forward(X_new, cache): a cache of 1 kv head for a module with 2", forward,
      "the cache has 1 kv heads of 4 features, expected n_kv_heads 2 of head_dim 4", [] {
        const auto mha = small_module();
        qkv::KVCache<float> cache(4, 1, 4);
        (void)mha.forward(qkv::Matrix<float>::Ones(1, 8), cache);
      });
  add("attention_weights: head 2 of n_heads 2", "qkv::MultiHeadAttention::attention_weights",
      "head is 2, expected an index in [0, 2) (n_heads)", [] {
        const auto mha = small_module();
        (void)mha.attention_weights(qkv::Matrix<float>::Ones(3, 8), qkv::Matrix<float>::Ones(5, 8), 2);
      });
  add("load_pytorch: in_proj_weight 23 × 8 (expected 24 × 8)", "qkv::MultiHeadAttention::load_pytorch",
      "in_proj_weight is 23 × 8, expected 24 × 8", [] {
        auto mha = small_module();
        mha.load_pytorch(qkv::Matrix<float>::Zero(23, 8), qkv::Matrix<float>::Zero(24, 1),
                         qkv::Matrix<float>::Zero(8, 8), qkv::Matrix<float>::Zero(8, 1));
      });
  add("KVCache::append: 3 tokens into a cache of capacity 2", "qkv::KVCache::append",
      "the KV cache overflows: it holds 0 of 2 tokens and 3 more were appended (3 > capacity 2)", [] {
        qkv::KVCache<float> cache(2, 2, 4);
        cache.append(qkv::Matrix<float>::Ones(3, 8), qkv::Matrix<float>::Ones(3, 8));
      });
  add("KVCache::append: K_new with 6 columns, 2 kv heads of 4", "qkv::KVCache::append",
      "K_new has 6 columns, expected 8 (n_kv_heads 2 × head_dim 4)", [] {
        qkv::KVCache<float> cache(4, 2, 4);
        cache.append(qkv::Matrix<float>::Ones(1, 6), qkv::Matrix<float>::Ones(1, 8));
      });
  add("KVCache with capacity -1", "qkv::KVCache::KVCache", "capacity is -1, expected at least 0",
      [] { qkv::KVCache<float> cache(-1, 2, 4); });

  // ---- classic scores and positions ------------------------------------------------------------------------------
  add("DotAttention: S 3 × 4, H 5 × 3", "qkv::DotAttention::forward", "H has 3 columns, expected d_s 4", [] {
    qkv::DotAttention<float> dot;
    (void)dot.forward(qkv::Matrix<float>::Ones(3, 4), qkv::Matrix<float>::Ones(5, 3));
  });
  add("AdditiveAttention: key_lengths {6} over H with 5 rows", "qkv::AdditiveAttention::forward",
      "options.key_lengths[0] is 6, expected a length in [0, 5] (the rows of H)", [] {
        const qkv::AdditiveAttention<float> additive(4, 4, 2);
        qkv::ScoringOptions options;
        options.key_lengths = {6};
        (void)additive.forward(qkv::Matrix<float>::Ones(3, 4), qkv::Matrix<float>::Ones(5, 4), options);
      });
  add("DotAttention: allowed [1, 1, 3, 0] over H with 5 rows", "qkv::DotAttention::forward",
      "options.allowed axis 3 (T) has extent 0, expected 5 (the rows of H)", [] {
        qkv::DotAttention<float> dot;
        std::unique_ptr<bool[]> storage(new bool[kRoom]());
        qkv::ScoringOptions options;
        options.allowed = TensorView4<const bool>(storage.get(), {1, 1, 3, 0});
        (void)dot.forward(qkv::Matrix<float>::Ones(3, 4), qkv::Matrix<float>::Ones(5, 4), options);
      });
  add("apply_rope: X 2 × 6 with n_heads 2 (head_dim 3, odd)", "qkv::apply_rope",
      "head_dim is 3, expected an even number ≥ 2", [] {
        qkv::Matrix<float> X = qkv::Matrix<float>::Ones(2, 6);
        qkv::apply_rope(X, 2);
      });
  add("alibi_bias with Sq = -1", "qkv::alibi_bias", "Sq is -1 and Skv is 4, expected both ≥ 0",
      [] { (void)qkv::alibi_bias(std::vector<float>{0.5f}, -1, 4); });
  add("RelativePositionBias: weights assigned 8 × 2 (expected 32 × 2)", "qkv::RelativePositionBias::bias",
      "weights is 8 × 2, expected 32 × 2 (num_buckets × n_heads)", [] {
        qkv::RelativePositionBias<float>::Config config;
        config.n_heads = 2;
        qkv::RelativePositionBias<float> t5(config);
        t5.weights = qkv::Matrix<float>::Zero(8, 2);
        (void)t5.bias(3, 3);
      });
  add("sinusoidal_encoding with d_model 0", "qkv::sinusoidal_encoding", "d_model is 0, expected at least 1",
      [] { (void)qkv::sinusoidal_encoding<float>(4, 0); });

  // ---- 16-bit keys and values (issue 16): k and v of Eigen::half or Eigen::bfloat16 with a float q ----------------
  // The valid call above with k and v stored in 16 bits; each row breaks one thing, checked as for float K/V.
  add("16-bit K/V: k (half) with head_dim 3, q with head_dim 4", core,
      "k axis 3 (D) has extent 3, expected 4 (the extent of q axis 3)", [] {
        Kv16Call<Eigen::half> c;
        c.k16 = TensorView4<const Eigen::half>(c.k16_data.data(), {2, 2, 5, 3});
        c.run();
      });
  add("16-bit K/V: v (bfloat16) with 4 keys, k with 5", core,
      "v axis 2 (Skv) has extent 4, expected 5 (the extent of k axis 2)", [] {
        Kv16Call<Eigen::bfloat16> c;
        c.v16 = TensorView4<const Eigen::bfloat16>(c.v16_data.data(), {2, 2, 4, 3});
        c.run();
      });
  add("16-bit K/V: k (half) with 3 heads for 4 query heads", core,
      "q axis 1 (Hq) has extent 4, not a multiple of k axis 1 (Hkv) extent 3", [] {
        Kv16Call<Eigen::half> c;
        c.k16 = TensorView4<const Eigen::half>(c.k16_data.data(), {2, 3, 5, 4});
        c.v16 = TensorView4<const Eigen::half>(c.v16_data.data(), {2, 3, 5, 3});
        c.run();
      });
  add("16-bit K/V: k (half) with innermost stride 2", core, "k axis 3 (D) has stride 2, expected 1", [] {
    Kv16Call<Eigen::half> c;
    c.k16 = TensorView4<const Eigen::half>(c.k16_data.data(), {2, 2, 5, 4}, {80, 40, 8, 2});
    c.run();
  });
  add("16-bit K/V: lse with Sq 4, q with Sq 3", core,
      "lse axis 2 (Sq) has extent 4, expected 3 (the extents of q axes 0-2)", [] {
        Kv16Call<Eigen::bfloat16> c;
        c.lse = TensorView3<float>(c.lse_data.data(), {2, 4, 4});
        c.run_with_lse();
      });
  add("16-bit K/V: out on k's (half) memory", core,
      "out overlaps an input (k): out (288 bytes) starts 0 bytes after the start of k (160 bytes)", [] {
        Kv16Call<Eigen::half> c;
        c.out = TensorView4<float>(reinterpret_cast<float*>(c.k16_data.data()), {2, 4, 3, 3});
        c.run();
      });
  add("16-bit K/V: options.window_left = -2", core, "options.window_left is -2, expected -1 (unbounded) or at least 0",
      [] {
        Kv16Call<Eigen::bfloat16> c;
        c.options.window_left = -2;
        c.run();
      });
  add("16-bit K/V: options.key_lengths = {5, 6} with Skv 5", core,
      "options.key_lengths[1] is 6, expected a length in [0, 5] (k axis 2, Skv)", [] {
        Kv16Call<Eigen::half> c;
        c.options.key_lengths = {5, 6};
        c.run();
      });
  add("16-bit K/V, one head: Q 3 × 4, K (half) 5 × 3", sdpa,
      "K has 3 columns, expected 4 (n_kv_heads 1 × head_dim 4 from Q)", [] {
        const qkv::Matrix<float> Q = qkv::Matrix<float>::Ones(3, 4);
        const qkv::Matrix<Eigen::half> K = qkv::Matrix<Eigen::half>::Ones(5, 3),
                                       V = qkv::Matrix<Eigen::half>::Ones(5, 2);
        (void)qkv::scaled_dot_product_attention(Q, K, V);
      });
  add("16-bit K/V, packed: V (bfloat16) with 5 columns, Heads{4, 2}", sdpa,
      "V has 5 columns, not a multiple of n_kv_heads 2", [] {
        const qkv::Matrix<float> Q = qkv::Matrix<float>::Ones(3, 8);
        const qkv::Matrix<Eigen::bfloat16> K = qkv::Matrix<Eigen::bfloat16>::Ones(5, 4),
                                           V = qkv::Matrix<Eigen::bfloat16>::Ones(5, 5);
        (void)qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{4, 2});
      });
  add("16-bit K/V: attention_weights with K (half) 5 × 8 and head 4 of Heads{4}", "qkv::attention_weights",
      "head is 4, expected an index in [0, 4)", [] {
        const qkv::Matrix<float> Q = qkv::Matrix<float>::Ones(3, 8);
        const qkv::Matrix<Eigen::half> K = qkv::Matrix<Eigen::half>::Ones(5, 8);
        (void)qkv::attention_weights(Q, K, qkv::Heads{4}, 4);
      });

  // ---- qkv::attention_backward: the valid call above as a backward call (BackwardCall), one thing broken per row ---
  const std::string backward = "qkv::attention_backward";
  add("backward: d_out with Dv 2, v with Dv 3", backward,
      "d_out axis 3 (Dv) has extent 2, expected 3 (the extent of v axis 3)", [] {
        BackwardCall c;
        c.d_out = TensorView4<const float>(c.d_out_data.data(), {2, 4, 3, 2});
        c.run();
      });
  add("backward: lse with Sq 2, q with Sq 3", backward,
      "lse axis 2 (Sq) has extent 2, expected 3 (the extent of q axis 2)", [] {
        BackwardCall c;
        c.lse = TensorView3<float>(c.lse_data.data(), {2, 4, 2});
        c.run();
      });
  add("backward: d_k with 4 keys, k with 5", backward,
      "d_k axis 2 (Skv) has extent 4, expected 5 (the extent of k axis 2)", [] {
        BackwardCall c;
        c.d_k = TensorView4<float>(c.d_k_data.data(), {2, 2, 4, 4});
        c.run();
      });
  add("backward: d_q whose strides make distinct indices share elements: strides [48, 12, 1, 1]", backward,
      "d_q has strides whose elements overlap (extents [2, 4, 3, 4], strides [48, 12, 1, 1])", [] {
        BackwardCall c;
        c.d_q = TensorView4<float>(c.d_q_data.data(), {2, 4, 3, 4}, {48, 12, 1, 1});
        c.run();
      });
  add("backward: d_q on q's memory", backward,
      "d_q overlaps an input (q): d_q (384 bytes) starts 0 bytes after the start of q (384 bytes)", [] {
        BackwardCall c;
        c.d_q = TensorView4<float>(c.q_data.data(), {2, 4, 3, 4});
        c.run();
      });
  add("backward: d_v on out's memory", backward,
      "d_v overlaps an input (out): d_v (240 bytes) starts 0 bytes after the start of out (288 bytes)", [] {
        BackwardCall c;
        c.d_v = TensorView4<float>(c.out_data.data(), {2, 2, 5, 3});
        c.run();
      });
  add("backward: d_v starting 8 floats into d_k's memory", backward,
      "d_k overlaps d_v: d_k (320 bytes) starts 32 bytes before the start of d_v (240 bytes)", [] {
        BackwardCall c;
        c.d_v = TensorView4<float>(c.d_k_data.data() + 8, {2, 2, 5, 3});
        c.run();
      });
  add("backward: extras.d_bias [1, 1, 3, 5] without options.bias", backward,
      "extras.d_bias is requested (extents [1, 1, 3, 5], strides [15, 15, 5, 1]) but options.bias is not set", [] {
        BackwardCall c;
        c.extras.d_bias = TensorView4<float>(c.d_bias_data.data(), {1, 1, 3, 5});
        c.run();
      });
  add("backward: extras.d_bias [2, 4, 3, 5] for options.bias [2, 1, 3, 5]", backward,
      "extras.d_bias axis 1 (Hq) has extent 4, expected 1 (the extent of options.bias)", [] {
        BackwardCall c;
        c.options.bias = TensorView4<const float>(c.bias_data.data(), {2, 1, 3, 5});
        c.extras.d_bias = TensorView4<float>(c.d_bias_data.data(), {2, 4, 3, 5});
        c.run();
      });
  add("backward: extras.d_sinks with 3 entries for 4 query heads", backward,
      "extras.d_sinks axis 0 (Hq) has extent 3, expected 4 (the extent of q axis 1)", [] {
        BackwardCall c;
        c.options.sinks = {0.0f, 0.0f, 0.0f, 0.0f};
        c.extras.d_sinks = qkv::TensorView<float, 1>(c.d_sinks_data.data(), {3});
        c.run();
      });
  add("backward: extras.d_sinks without options.sinks", backward,
      "extras.d_sinks is requested (4 entries) but options.sinks is empty", [] {
        BackwardCall c;
        c.extras.d_sinks = qkv::TensorView<float, 1>(c.d_sinks_data.data(), {4});
        c.run();
      });
  add("backward: options.window_left = -2", backward,
      "options.window_left is -2, expected -1 (unbounded) or at least 0", [] {
        BackwardCall c;
        c.options.window_left = -2;
        c.run();
      });
  // ---- dropout (options.dropout_p): a probability in [0, 1] ---------------------------------------------------------
  add("options.dropout_p = -0.5", core, "options.dropout_p is -0.5, expected a probability in [0, 1]", [] {
    Call c;
    c.options.dropout_p = -0.5f;
    c.run();
  });
  add("options.dropout_p = 1.5", core, "options.dropout_p is 1.5, expected a probability in [0, 1]", [] {
    Call c;
    c.options.dropout_p = 1.5f;
    c.run();
  });
  add("options.dropout_p = NaN, on attention_weights", "qkv::attention_weights",
      "options.dropout_p is nan, expected a probability in [0, 1]", [] {
        qkv::AttentionOptions<float> options;
        options.dropout_p = kNaN;
        (void)qkv::attention_weights(qkv::Matrix<float>::Ones(3, 4), qkv::Matrix<float>::Ones(5, 4), options);
      });
  return rows;
}

const std::vector<Row>& rows() {
  static const std::vector<Row> all = table();
  return all;
}

class Malformed : public ::testing::TestWithParam<std::size_t> {};

TEST_P(Malformed, ThrowsShapeErrorNamingFunctionArgumentAndSizes) {
  const Row& row = rows()[GetParam()];
  SCOPED_TRACE(row.id + ": " + row.input);
  std::string message;
  try {
    row.call();
    ADD_FAILURE() << "no exception; expected qkv::shape_error";
    return;
  } catch (const qkv::shape_error& e) {
    message = e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected qkv::shape_error, got another exception: " << e.what();
    return;
  }
  EXPECT_EQ(message.rfind(row.function + ": ", 0), 0u)
      << "the message does not start with '" << row.function << ": ': " << message;
  EXPECT_NE(message.find(row.excerpt), std::string::npos) << "'" << row.excerpt << "' not in: " << message;
  if (std::getenv("QKV_PRINT_MALFORMED_ROWS") != nullptr) {
    std::cout << "| " << row.id << " | " << row.input << " | `" << row.function << "` | `" << message << "` |\n";
  }
}

INSTANTIATE_TEST_SUITE_P(Table, Malformed, ::testing::Range<std::size_t>(0, rows().size()),
                         [](const ::testing::TestParamInfo<std::size_t>& info) { return rows()[info.param].id; });

/// The cells of a Markdown table line "| a | b | c |" (outer pipes dropped, cells trimmed).
std::vector<std::string> cells(const std::string& line) {
  std::vector<std::string> result;
  std::string cell;
  for (std::size_t n = 1; n < line.size(); ++n) {
    if (line[n] == '|') {
      const std::size_t first = cell.find_first_not_of(' '), last = cell.find_last_not_of(' ');
      result.push_back(first == std::string::npos ? "" : cell.substr(first, last - first + 1));
      cell.clear();
    } else {
      cell += line[n];
    }
  }
  return result;
}

TEST(MalformedDocument, EveryRowHasATestAndEveryTestARow) {
  std::ifstream doc(QKV_MALFORMED_DOC);
  ASSERT_TRUE(doc.good()) << "cannot read " << QKV_MALFORMED_DOC;
  std::map<std::string, std::vector<std::string>> documented;
  std::string line;
  while (std::getline(doc, line)) {
    if (line.rfind("| M", 0) != 0) continue;
    const std::vector<std::string> row = cells(line);
    ASSERT_EQ(row.size(), 4u) << "a row needs ID, input, function and message: " << line;
    EXPECT_TRUE(documented.emplace(row[0], row).second) << "ID " << row[0] << " appears twice in the document";
  }
  std::set<std::string> tested;
  for (const Row& row : rows()) {
    tested.insert(row.id);
    const auto found = documented.find(row.id);
    if (found == documented.end()) {
      ADD_FAILURE() << row.id << " (" << row.input << ") has a test but no row in docs/malformed_inputs.md";
      continue;
    }
    EXPECT_EQ(found->second[1], row.input) << row.id << ": the document's input differs from the test's";
    EXPECT_EQ(found->second[2], "`" + row.function + "`") << row.id << ": the document's function differs";
    EXPECT_NE(found->second[3].find(row.excerpt), std::string::npos)
        << row.id << ": the document's message does not contain the tested excerpt '" << row.excerpt << "'";
  }
  for (const auto& [id, row] : documented)
    EXPECT_TRUE(tested.count(id) == 1) << id << " is in docs/malformed_inputs.md but has no test";
  EXPECT_GE(tested.size(), 30u);
}

}  // namespace
