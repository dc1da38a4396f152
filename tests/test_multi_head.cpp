// Tests of qkv/multi_head.hpp: MultiHeadAttention and KVCache.
//
// Expected values come from outside the module:
//   - tests/fixtures/mha_torch.safetensors: PyTorch 1.13's nn.MultiheadAttention in float64 (self, cross,
//     key_padding_mask, boolean / float / 3-D attn_mask, batch_first, kdim/vdim, bias=False, per-head weights) and
//     GQA/MQA built in PyTorch by repeating K/V heads (scripts/make_mha_fixtures.py);
//   - tests/fixtures/ppocr_v4_block1_attention.safetensors and the two .npy files: a real pretrained layer (PP-OCRv4)
//     and PyTorch's output with its weights (scripts/make_ppocr_fixture.py);
//   - float64 loops in this file (projections) around tests/brute_force.hpp (attention written from docs/design.md);
//   - decoding with a KV cache against one causal pass (the equivalence docs/design.md promises);
//   - RoPE in the module (Config::rope): the whole module in float64 loops here, the rotation written from its formula
//     (Hugging Face's rotate_half, RoFormer's complex product), never with qkv's own rotation;
//   - the 16-bit cache (KVCache<float, Eigen::half / Eigen::bfloat16>): roundings worked by hand, Eigen's conversion of
//     projections made exact in float by construction, one causal pass over those rounded K/V (float and float64),
//     the float core call on the stored values (bit for bit), and allocation counts
//     (tests/support/counting_allocator.hpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <complex>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "brute_force.hpp"
#include "qkv/multi_head.hpp"
#include "safetensors.hpp"
#include "support/counting_allocator.hpp"  // this file is the one translation unit of test_multi_head that includes it
#include "support/expect_shape_error.hpp"
#include "support/npy.hpp"
#include "support/problem.hpp"
#include "support/type_lists.hpp"

namespace {

using qkv::Index;
using qkv::Matrix;
using qkv_test::random_matrix;

// ---- fixture files --------------------------------------------------------------------------------------------------

/// One array of a fixture, widened to double (exact for F32 and BOOL).
struct Array {
  std::string dtype;
  std::vector<Index> shape;
  std::vector<double> data;
  Index extent(std::size_t axis) const { return shape.at(axis); }
  double at(std::initializer_list<Index> index) const {
    Index offset = 0;
    std::size_t axis = 0;
    for (Index i : index) offset = offset * shape.at(axis++) + i;
    return data.at(static_cast<std::size_t>(offset));
  }
};
using Fixture = std::map<std::string, Array>;

bool little_endian() {
  const std::uint16_t one = 1;
  unsigned char first;
  std::memcpy(&first, &one, 1);
  return first == 1;
}

/// Reads a safetensors fixture (tests/fixtures/README.md) with examples/safetensors.hpp.
Fixture read_fixture(const std::string& path) {
  safetensors::File file = safetensors::read(path);
  Fixture fixture;
  for (auto& [name, tensor] : file.tensors)
    fixture[name] =
        Array{tensor.dtype, std::vector<Index>(tensor.shape.begin(), tensor.shape.end()), std::move(tensor.values)};
  return fixture;
}

/// Reads a NumPy .npy file of little-endian float32 in C order (support/npy.hpp), widened to double.
Array read_npy(const std::string& path) {
  qkv_test::NpyArray npy = qkv_test::read_npy_float32(path);
  return Array{"F32", std::vector<Index>(npy.shape.begin(), npy.shape.end()),
               std::vector<double>(npy.values.begin(), npy.values.end())};
}

std::string fixture_path(const std::string& name) { return std::string(QKV_TEST_FIXTURES_DIR) + "/" + name; }

const Fixture& torch_fixture() {
  static const Fixture fixture = read_fixture(fixture_path("mha_torch.safetensors"));
  return fixture;
}

template <class T>
Matrix<T> to_matrix(const Array& a) {  // a 1-D array as a 1 × n row, a 2-D array as is
  const Index rows = a.shape.size() == 1 ? 1 : a.extent(0), cols = a.shape.back();
  Matrix<T> m(rows, cols);
  for (Index i = 0; i < rows * cols; ++i) m.data()[i] = static_cast<T>(a.data[static_cast<std::size_t>(i)]);
  return m;
}

template <class T>
std::vector<T> to_vector(const Array& a) {
  return std::vector<T>(a.data.begin(), a.data.end());
}

template <class T>
double tolerance(double magnitude) {
  // float: the 1e-5·max(1, max|Y|) of docs/design.md's decoding promise; double: rounding of a few dozen operations.
  return (std::is_same_v<T, float> ? 1e-5 : 1e-12) * std::max(1.0, magnitude);
}

// ---- float64 module in loops (the projections; attention is tests/brute_force.hpp) -------------------------------

/// The parameters of a module in double, stored [in, out] as the module stores them.
struct Weights {
  Matrix<double> W_q, W_k, W_v, W_o;
  std::vector<double> b_q, b_k, b_v, b_o;  // empty = no bias
};

template <class T>
Weights weights_of(const qkv::MultiHeadAttention<T>& m) {
  const auto vec = [](const auto& v) { return std::vector<double>(v.data(), v.data() + v.size()); };
  return {m.W_q.template cast<double>(),
          m.W_k.template cast<double>(),
          m.W_v.template cast<double>(),
          m.W_o.template cast<double>(),
          vec(m.b_q),
          vec(m.b_k),
          vec(m.b_v),
          vec(m.b_o)};
}

/// Y = X·W + b with plain loops.
Matrix<double> linear(const Matrix<double>& X, const Matrix<double>& W, const std::vector<double>& b) {
  Matrix<double> Y(X.rows(), W.cols());
  for (Index i = 0; i < X.rows(); ++i)
    for (Index o = 0; o < W.cols(); ++o) {
      double sum = b.empty() ? 0.0 : b[static_cast<std::size_t>(o)];
      for (Index e = 0; e < X.cols(); ++e) sum += X(i, e) * W(e, o);
      Y(i, o) = sum;
    }
  return Y;
}

/// Packed heads (T × H·D) to a dense [1, H, T, D] vector.
std::vector<double> heads_first(const Matrix<double>& packed, Index H, Index D) {
  std::vector<double> out;
  for (Index h = 0; h < H; ++h)
    for (Index t = 0; t < packed.rows(); ++t)
      for (Index d = 0; d < D; ++d) out.push_back(packed(t, h * D + d));
  return out;
}

/// The whole module in float64: projections in loops, attention by brute::attention with `p` (its sizes are filled
/// in here), then the output projection.
Matrix<double> brute_force_module(const Weights& w, const Matrix<double>& X_q, const Matrix<double>& X_k,
                                  const Matrix<double>& X_v, Index Hq, Index Hkv, Index D, brute::Params p) {
  const Matrix<double> Q = linear(X_q, w.W_q, w.b_q), K = linear(X_k, w.W_k, w.b_k), V = linear(X_v, w.W_v, w.b_v);
  p.B = 1;
  p.Hq = Hq;
  p.Hkv = Hkv;
  p.Sq = X_q.rows();
  p.Skv = X_k.rows();
  p.D = D;
  p.Dv = D;
  const brute::Result r = brute::attention(heads_first(Q, Hq, D), heads_first(K, Hkv, D), heads_first(V, Hkv, D), p);
  Matrix<double> O(X_q.rows(), Hq * D);
  for (Index h = 0; h < Hq; ++h)
    for (Index t = 0; t < X_q.rows(); ++t)
      for (Index d = 0; d < D; ++d) O(t, h * D + d) = r.out[static_cast<std::size_t>((h * X_q.rows() + t) * D + d)];
  return linear(O, w.W_o, w.b_o);
}

/// A module with every weight and bias drawn from U(±1/√d_model) (the PyTorch nn.Linear scale).
template <class T>
qkv::MultiHeadAttention<T> random_module(const typename qkv::MultiHeadAttention<T>::Config& config, unsigned seed) {
  qkv::MultiHeadAttention<T> m(config);
  std::mt19937 rng(seed);
  const double bound = 1.0 / std::sqrt(static_cast<double>(m.d_model()));
  std::uniform_real_distribution<double> uniform(-bound, bound);
  for (auto* w : {&m.W_q, &m.W_k, &m.W_v, &m.W_o})
    for (Index i = 0; i < w->size(); ++i) w->data()[i] = static_cast<T>(uniform(rng));
  for (auto* b : {&m.b_q, &m.b_k, &m.b_v, &m.b_o})
    for (Index i = 0; i < b->size(); ++i) (*b)(i) = static_cast<T>(uniform(rng));
  return m;
}

template <class T>
typename qkv::MultiHeadAttention<T>::Config make_config(Index d_model, Index n_heads, Index n_kv_heads = 0,
                                                        Index head_dim = 0) {
  typename qkv::MultiHeadAttention<T>::Config c;
  c.d_model = d_model;
  c.n_heads = n_heads;
  c.n_kv_heads = n_kv_heads;
  c.head_dim = head_dim;
  return c;
}

/// A number for RecordProperty (std::to_string would print 1e-9 as 0.000000).
std::string scientific(double x) {
  std::ostringstream out;
  out << x;
  return out.str();
}

double max_abs(const Matrix<double>& m) { return m.size() == 0 ? 0.0 : m.cwiseAbs().maxCoeff(); }

template <class T>
double max_difference(const Matrix<T>& a, const Matrix<double>& b) {
  EXPECT_EQ(a.rows(), b.rows());
  EXPECT_EQ(a.cols(), b.cols());
  if (a.rows() != b.rows() || a.cols() != b.cols()) return std::numeric_limits<double>::infinity();
  double worst = 0;
  for (Index i = 0; i < a.size(); ++i) {
    const double d = std::abs(static_cast<double>(a.data()[i]) - b.data()[i]);
    if (!(d <= worst)) worst = d;  // NaN propagates as NaN
  }
  return worst;
}

// ---- PyTorch fixtures -----------------------------------------------------------------------------------------------

/// One nn.MultiheadAttention case of mha_torch.safetensors, converted to T.
template <class T>
struct TorchCase {
  using ConstMap = Eigen::Map<const Matrix<T>, Eigen::Unaligned, Eigen::OuterStride<>>;

  std::string name;
  const Fixture* f = nullptr;
  Index E = 0, H = 0, Hkv = 0, kdim = 0, vdim = 0, N = 0, L = 0, S = 0;
  bool bias = true, batch_first = false;
  std::vector<T> query, key, value;

  explicit TorchCase(const std::string& case_name) : name(case_name), f(&torch_fixture()) {
    const Array& c = get("config");
    E = static_cast<Index>(c.data[0]);
    H = static_cast<Index>(c.data[1]);
    Hkv = static_cast<Index>(c.data[2]);
    kdim = static_cast<Index>(c.data[3]);
    vdim = static_cast<Index>(c.data[4]);
    bias = c.data[5] != 0;
    batch_first = c.data[6] != 0;
    N = static_cast<Index>(c.data[7]);
    L = static_cast<Index>(c.data[8]);
    S = static_cast<Index>(c.data[9]);
    query = to_vector<T>(get("query"));
    key = to_vector<T>(get("key"));
    value = to_vector<T>(get("value"));
  }

  bool has(const std::string& array) const { return f->count(name + "." + array) > 0; }
  const Array& get(const std::string& array) const { return f->at(name + "." + array); }

  /// Batch entry n of a [T, N, width] (seq-first) or [N, T, width] (batch_first) input, as a zero-copy strided map.
  ConstMap rows(const std::vector<T>& data, Index n, Index T_rows, Index width) const {
    if (batch_first) return ConstMap(data.data() + n * T_rows * width, T_rows, width, Eigen::OuterStride<>(width));
    return ConstMap(data.data() + n * width, T_rows, width, Eigen::OuterStride<>(N * width));
  }
  ConstMap X_q(Index n) const { return rows(query, n, L, E); }
  ConstMap X_k(Index n) const { return rows(key, n, S, kdim); }
  ConstMap X_v(Index n) const { return rows(value, n, S, vdim); }

  double expected_out(Index n, Index l, Index e) const {
    return batch_first ? get("out").at({n, l, e}) : get("out").at({l, n, e});
  }

  qkv::MultiHeadAttention<T> module() const {
    typename qkv::MultiHeadAttention<T>::Config config;
    config.d_model = E;
    config.n_heads = H;
    config.n_kv_heads = Hkv;
    config.kdim = kdim;
    config.vdim = vdim;
    config.bias = bias;
    qkv::MultiHeadAttention<T> m(config);
    const Matrix<T> in_bias = to_matrix<T>(get("in_proj_bias")), out_bias = to_matrix<T>(get("out_proj_bias"));
    const Matrix<T> out_weight = to_matrix<T>(get("out_proj_weight"));
    if (has("in_proj_weight")) {
      m.load_pytorch(to_matrix<T>(get("in_proj_weight")), in_bias, out_weight, out_bias);
    } else {
      m.load_pytorch(to_matrix<T>(get("q_proj_weight")), to_matrix<T>(get("k_proj_weight")),
                     to_matrix<T>(get("v_proj_weight")), in_bias, out_weight, out_bias);
    }
    return m;
  }
};

/// The masks of batch entry n as AttentionOptions, with the storage the views point into. PyTorch's boolean masks
/// mean True = masked: `allowed` is their negation.
template <class T>
struct BatchMasks {
  using BoolArray = Eigen::Array<bool, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  BoolArray allowed_2d;
  std::unique_ptr<bool[]> allowed_3d;
  Matrix<T> bias;
  qkv::AttentionOptions<T> options;

  BatchMasks(const TorchCase<T>& c, Index n) {
    const bool has_kpm = c.has("key_padding_mask"), has_mask = c.has("attn_mask");
    const bool kpm_bool = has_kpm && c.get("key_padding_mask").dtype == "BOOL";
    const bool mask_bool = has_mask && c.get("attn_mask").dtype == "BOOL";
    const bool mask_3d = has_mask && c.get("attn_mask").shape.size() == 3;
    if (mask_3d) {  // [N·H, L, S] -> [1, H, L, S] for this batch entry
      EXPECT_TRUE(mask_bool && !has_kpm);
      allowed_3d.reset(new bool[static_cast<std::size_t>(c.H * c.L * c.S)]);
      for (Index h = 0; h < c.H; ++h)
        for (Index i = 0; i < c.L; ++i)
          for (Index j = 0; j < c.S; ++j)
            allowed_3d[static_cast<std::size_t>((h * c.L + i) * c.S + j)] =
                c.get("attn_mask").at({n * c.H + h, i, j}) == 0;
      options.allowed = qkv::TensorView4<const bool>(allowed_3d.get(), {1, c.H, c.L, c.S});
      return;
    }
    if (mask_bool || kpm_bool) {  // one L × S (or 1 × S, broadcast over the queries) boolean mask
      allowed_2d = BoolArray::Constant(mask_bool ? c.L : 1, c.S, true);
      for (Index i = 0; i < allowed_2d.rows(); ++i)
        for (Index j = 0; j < c.S; ++j) {
          bool masked = mask_bool && c.get("attn_mask").at({i, j}) != 0;
          masked = masked || (kpm_bool && c.get("key_padding_mask").at({n, j}) != 0);
          allowed_2d(i, j) = !masked;
        }
      options.allowed = allowed_2d;
    }
    if (has_mask && !mask_bool) {  // float attn_mask: added to the scores
      bias = to_matrix<T>(c.get("attn_mask"));
      options.bias = bias;
    }
    if (has_kpm && !kpm_bool) {  // float key_padding_mask: added, one row broadcast over the queries
      EXPECT_FALSE(has_mask);
      bias = Matrix<T>(1, c.S);
      for (Index j = 0; j < c.S; ++j) bias(0, j) = static_cast<T>(c.get("key_padding_mask").at({n, j}));
      options.bias = bias;
    }
  }
};

struct CaseResult {
  double out_error = 0, out_magnitude = 0, weight_error = 0;
  Index compared_rows = 0, nan_rows = 0;
};

/// Runs every batch entry of a case through the module and compares the output rows and attention weights with
/// PyTorch's. Rows PyTorch reports as NaN (every key masked) are left out of the comparison and checked to be
/// zeros at the attention output instead: Y's row is exactly b_o and the weights' row is zero.
template <class T>
CaseResult run_case(const TorchCase<T>& c) {
  const qkv::MultiHeadAttention<T> m = c.module();
  CaseResult r;
  const Array& weights = c.get("weights");
  const bool per_head = weights.shape.size() == 4;
  for (Index n = 0; n < c.N; ++n) {
    const BatchMasks<T> masks(c, n);
    const Matrix<T> Y = m.forward(c.X_q(n), c.X_k(n), c.X_v(n), masks.options);
    EXPECT_EQ(Y.rows(), c.L);
    EXPECT_EQ(Y.cols(), c.E);
    std::vector<Matrix<T>> P;
    for (Index h = 0; h < c.H; ++h) P.push_back(m.attention_weights(c.X_q(n), c.X_k(n), h, masks.options));
    for (Index l = 0; l < c.L; ++l) {
      if (std::isnan(c.expected_out(n, l, 0))) {
        ++r.nan_rows;
        for (Index e = 0; e < c.E; ++e)
          EXPECT_EQ(Y(l, e), m.config().bias ? m.b_o(e) : T(0)) << c.name << " n " << n << " l " << l;
        for (Index h = 0; h < c.H; ++h) EXPECT_TRUE(P[static_cast<std::size_t>(h)].row(l).isZero(0)) << c.name;
        continue;
      }
      ++r.compared_rows;
      for (Index e = 0; e < c.E; ++e) {
        const double expected = c.expected_out(n, l, e);
        r.out_magnitude = std::max(r.out_magnitude, std::abs(expected));
        r.out_error = std::max(r.out_error, std::abs(static_cast<double>(Y(l, e)) - expected));
      }
      for (Index s = 0; s < c.S; ++s) {
        double mean = 0;
        for (Index h = 0; h < c.H; ++h) {
          const double ours = P[static_cast<std::size_t>(h)](l, s);
          mean += ours / static_cast<double>(c.H);
          if (per_head) r.weight_error = std::max(r.weight_error, std::abs(ours - weights.at({n, h, l, s})));
        }
        if (!per_head) r.weight_error = std::max(r.weight_error, std::abs(mean - weights.at({n, l, s})));
      }
    }
  }
  return r;
}

template <class T>
struct MultiHeadTorch : ::testing::Test {
  void check(const std::string& case_name, Index expected_nan_rows = 0) {
    const TorchCase<T> c(case_name);
    const CaseResult r = run_case(c);
    EXPECT_EQ(r.nan_rows, expected_nan_rows) << case_name;
    EXPECT_EQ(r.compared_rows + r.nan_rows, c.N * c.L) << case_name;
    EXPECT_LE(r.out_error, tolerance<T>(r.out_magnitude)) << case_name << ": output vs PyTorch";
    EXPECT_LE(r.weight_error, tolerance<T>(1.0)) << case_name << ": attention weights vs PyTorch";
    RecordProperty("max_output_error", scientific(r.out_error));
    RecordProperty("max_weight_error", scientific(r.weight_error));
  }
};
TYPED_TEST_SUITE(MultiHeadTorch, qkv_test::Scalars, );

TYPED_TEST(MultiHeadTorch, SelfAttention) { this->check("self"); }
TYPED_TEST(MultiHeadTorch, CrossAttentionPerHeadWeights) { this->check("cross"); }
// Batch entry 2 has every key padded: its 6 rows are NaN in PyTorch 1.13 and b_o (zero attention) here.
TYPED_TEST(MultiHeadTorch, KeyPaddingMaskWithFullyPaddedEntry) { this->check("key_padding", 6); }
// Query row 2 is fully masked in both batch entries: NaN in PyTorch, zeros here.
TYPED_TEST(MultiHeadTorch, BooleanAttnMaskWithFullyMaskedRow) { this->check("bool_mask", 2); }
TYPED_TEST(MultiHeadTorch, BooleanAttnMaskPerBatchAndHead) { this->check("bool_mask_3d"); }
TYPED_TEST(MultiHeadTorch, FloatAttnMaskAndKeyPaddingMask) { this->check("float_mask"); }
TYPED_TEST(MultiHeadTorch, FloatKeyPaddingMask) { this->check("float_padding"); }
TYPED_TEST(MultiHeadTorch, BatchFirstWithCausalAttnMask) { this->check("batch_first"); }
TYPED_TEST(MultiHeadTorch, KdimVdimSeparateWeights) { this->check("kdim_vdim"); }
TYPED_TEST(MultiHeadTorch, NoBias) { this->check("no_bias"); }
TYPED_TEST(MultiHeadTorch, GroupedQueryAttention) { this->check("gqa"); }
TYPED_TEST(MultiHeadTorch, GroupedQueryAttentionCausalMask) { this->check("gqa_causal"); }
TYPED_TEST(MultiHeadTorch, MultiQueryCrossAttention) { this->check("mqa_cross"); }

/// Expects rows n·L + l of Y (batch entries n < batches, one after another) to be PyTorch's output rows (n, l) within
/// the accuracy rule.
template <class T>
void expect_output_matches(const TorchCase<T>& c, const Matrix<T>& Y, Index batches) {
  double error = 0, magnitude = 0;
  for (Index n = 0; n < batches; ++n)
    for (Index l = 0; l < c.L; ++l)
      for (Index e = 0; e < c.E; ++e) {
        magnitude = std::max(magnitude, std::abs(c.expected_out(n, l, e)));
        error = std::max(error, std::abs(static_cast<double>(Y(n * c.L + l, e)) - c.expected_out(n, l, e)));
      }
  EXPECT_LE(error, tolerance<T>(magnitude));
}

// Right padding expressed as key_lengths instead of a boolean row (batch entry 0 of key_padding keeps 4 keys).
TYPED_TEST(MultiHeadTorch, RightPaddingAsKeyLengths) {
  using T = TypeParam;
  const TorchCase<T> c("key_padding");
  const auto m = c.module();
  qkv::AttentionOptions<T> options;
  options.key_lengths = {4};
  expect_output_matches(c, m.forward(c.X_q(0), options), 1);
}

// batch_first memory [N, L, E] is N sequences one after another: run it as one varlen batch, straight from the buffer,
// with the causal option in place of PyTorch's triangular attn_mask (the same when L = S).
TYPED_TEST(MultiHeadTorch, BatchFirstBufferAsVarlenBatch) {
  using T = TypeParam;
  const TorchCase<T> c("batch_first");
  ASSERT_TRUE(c.batch_first);
  const auto m = c.module();
  const Eigen::Map<const Matrix<T>> X(c.query.data(), c.N * c.L, c.E);
  qkv::AttentionOptions<T> options;
  options.causal = true;
  for (Index n = 0; n <= c.N; ++n) options.cu_seqlens_q.push_back(n * c.L);
  options.cu_seqlens_k = options.cu_seqlens_q;
  expect_output_matches(c, m.forward(X, options), c.N);
}

// GQA's causal mask through options.causal instead of the boolean mask, against the same PyTorch output.
TYPED_TEST(MultiHeadTorch, GroupedQueryCausalOption) {
  using T = TypeParam;
  const TorchCase<T> c("gqa_causal");
  const auto m = c.module();
  EXPECT_EQ(m.n_kv_heads(), 2);
  qkv::AttentionOptions<T> options;
  options.causal = true;
  expect_output_matches(c, m.forward(c.X_q(0), options), 1);
}

// ---- loaders -----------------------------------------------------------------------------------------------------

// load_pytorch transposes PyTorch's [out, in] weights into the [in, out] members; load_fused_qkv takes [in, out].
TYPED_TEST(MultiHeadTorch, LoadersPlaceEveryWeight) {
  using T = TypeParam;
  const TorchCase<T> c("gqa");  // GQA: the packed in_proj has (6 + 2·2)·4 rows
  const auto m = c.module();
  const Matrix<T> in_proj = to_matrix<T>(c.get("in_proj_weight")), in_bias = to_matrix<T>(c.get("in_proj_bias"));
  const Matrix<T> out_proj = to_matrix<T>(c.get("out_proj_weight")), out_bias = to_matrix<T>(c.get("out_proj_bias"));
  ASSERT_EQ(in_proj.rows(), 40);
  EXPECT_EQ(m.W_q, in_proj.topRows(24).transpose());
  EXPECT_EQ(m.W_k, in_proj.middleRows(24, 8).transpose());
  EXPECT_EQ(m.W_v, in_proj.bottomRows(8).transpose());
  EXPECT_EQ(m.W_o, out_proj.transpose());
  EXPECT_EQ(m.b_q.transpose(), in_bias.leftCols(24));
  EXPECT_EQ(m.b_k.transpose(), in_bias.middleCols(24, 8));
  EXPECT_EQ(m.b_v.transpose(), in_bias.rightCols(8));
  EXPECT_EQ(m.b_o.transpose(), out_bias);

  qkv::MultiHeadAttention<T> fused(make_config<T>(24, 6, 2));
  const Matrix<T> W_qkv = in_proj.transpose(), W_o = out_proj.transpose();
  fused.load_fused_qkv(W_qkv, in_bias.transpose(), W_o, out_bias);  // biases as columns here, rows above
  EXPECT_EQ(fused.W_q, m.W_q);
  EXPECT_EQ(fused.W_k, m.W_k);
  EXPECT_EQ(fused.W_v, m.W_v);
  EXPECT_EQ(fused.W_o, m.W_o);
  EXPECT_EQ(fused.b_q, m.b_q);
  EXPECT_EQ(fused.b_k, m.b_k);
  EXPECT_EQ(fused.b_v, m.b_v);
  EXPECT_EQ(fused.b_o, m.b_o);
}

TEST(MultiHeadConfig, ResolvesDefaults) {
  qkv::MultiHeadAttention<float>::Config config;
  config.d_model = 12;
  config.n_heads = 4;
  const qkv::MultiHeadAttention<float> m(config);
  EXPECT_EQ(m.n_kv_heads(), 4);
  EXPECT_EQ(m.head_dim(), 3);
  EXPECT_EQ(m.kdim(), 12);
  EXPECT_EQ(m.vdim(), 12);
  EXPECT_EQ(m.W_q.rows(), 12);
  EXPECT_EQ(m.W_q.cols(), 12);
  EXPECT_EQ(m.W_k.cols(), 12);
  EXPECT_EQ(m.W_o.rows(), 12);
  EXPECT_EQ(m.b_o.size(), 12);
  EXPECT_TRUE(m.W_q.isZero(0));

  config.n_kv_heads = 1;
  config.head_dim = 5;  // explicit: n_heads·head_dim = 20 ≠ d_model is allowed
  config.kdim = 7;
  config.bias = false;
  const qkv::MultiHeadAttention<float> g(config);
  EXPECT_EQ(g.W_q.cols(), 20);
  EXPECT_EQ(g.W_k.rows(), 7);
  EXPECT_EQ(g.W_k.cols(), 5);
  EXPECT_EQ(g.W_v.rows(), 12);
  EXPECT_EQ(g.W_o.rows(), 20);
  EXPECT_EQ(g.b_q.size(), 0);
  EXPECT_EQ(g.b_o.size(), 0);
}

// ---- GQA reads K/V once per kv head, no copies ----------------------------------------------------------------------

/// What the module handed to the core. The views may dangle after the call (they point into the module's
/// temporaries), so the keys are copied during the call; afterwards only extents, strides and addresses are used.
struct ObservedCall {
  int calls = 0;
  qkv::TensorView4<const float> q, k, v;
  std::vector<float> keys;  ///< k's elements in [Hkv, Skv, D] order, copied during the call
};

void observe(const qkv::TensorView4<const float>& q, const qkv::TensorView4<const float>& k,
             const qkv::TensorView4<const float>& v, void* context) {
  auto* seen = static_cast<ObservedCall*>(context);
  ++seen->calls;
  seen->q = q;
  seen->k = k;
  seen->v = v;
  seen->keys.clear();
  for (Index h = 0; h < k.extent(1); ++h)
    for (Index t = 0; t < k.extent(2); ++t)
      for (Index d = 0; d < k.extent(3); ++d) seen->keys.push_back(k(0, h, t, d));
}

struct ObserverGuard {  // installs the module's test seam for one test and always removes it
  explicit ObserverGuard(ObservedCall* seen) {
    qkv::detail::MultiHeadCoreObserver<float>::callback = &observe;
    qkv::detail::MultiHeadCoreObserver<float>::context = seen;
  }
  ~ObserverGuard() {
    qkv::detail::MultiHeadCoreObserver<float>::callback = nullptr;
    qkv::detail::MultiHeadCoreObserver<float>::context = nullptr;
  }
};

// 32 query heads, 8 kv heads: the module hands the core K and V with 8 heads (T × 8·head_dim values each, the
// projection computed once per kv head), one core call for all heads, and the core maps query head h to kv head h / 4.
// The 4 query heads of a group therefore read the same memory: no repeated copy of K/V exists anywhere.
TEST(MultiHeadGqa, KeysAndValuesAreProjectedOncePerKvHeadAndShared) {
  const Index d_model = 256, Hq = 32, Hkv = 8, D = 8, T = 9;
  const auto m = random_module<float>(make_config<float>(d_model, Hq, Hkv), 11);
  const Matrix<float> X = random_matrix<float>(T, d_model, 12);
  ObservedCall seen;
  Matrix<float> Y;
  {
    ObserverGuard guard(&seen);
    Y = m.forward(X);
  }
  EXPECT_EQ(seen.calls, 1);
  EXPECT_EQ(seen.q.extent(1), Hq);
  for (const auto* view : {&seen.k, &seen.v}) {
    EXPECT_EQ(view->extent(0), 1);
    EXPECT_EQ(view->extent(1), Hkv);  // not Hq: nothing was repeated
    EXPECT_EQ(view->extent(2), T);
    EXPECT_EQ(view->extent(3), D);
    EXPECT_EQ(view->stride(1), D);        // kv head h_kv is columns [h_kv·D, (h_kv+1)·D) of the projection
    EXPECT_EQ(view->stride(2), Hkv * D);  // rows are tokens of the packed T × Hkv·D projection
  }
  // K and V are two separate T × Hkv·D blocks (the core's reads of one group of 4 query heads stay inside them).
  const auto k_begin = reinterpret_cast<std::uintptr_t>(seen.k.data());
  const auto v_begin = reinterpret_cast<std::uintptr_t>(seen.v.data());
  const auto block_bytes = static_cast<std::uintptr_t>(T * Hkv * D) * sizeof(float);
  EXPECT_TRUE(v_begin >= k_begin + block_bytes || k_begin >= v_begin + block_bytes);
  // The memory the core reads for K is exactly the projection X·W_k + b_k, computed here in float64.
  const Weights w = weights_of(m);
  const Matrix<double> K = linear(X.cast<double>(), w.W_k, w.b_k);
  double error = 0;
  ASSERT_EQ(seen.keys.size(), static_cast<std::size_t>(Hkv * T * D));
  for (Index h_kv = 0; h_kv < Hkv; ++h_kv)
    for (Index t = 0; t < T; ++t)
      for (Index d = 0; d < D; ++d)
        error =
            std::max(error, std::abs(seen.keys[static_cast<std::size_t>((h_kv * T + t) * D + d)] - K(t, h_kv * D + d)));
  EXPECT_LE(error, 1e-5 * std::max(1.0, max_abs(K)));
  // And the output is GQA's: the float64 module with query head h reading kv head h / 4 (brute_force.hpp's rule).
  const Matrix<double> expected =
      brute_force_module(w, X.cast<double>(), X.cast<double>(), X.cast<double>(), Hq, Hkv, D, brute::Params());
  EXPECT_LE(max_difference(Y, expected), tolerance<float>(max_abs(expected)));
}

// With a cache, the core reads the cache's own [Hkv, capacity, head_dim] memory in place, first length() rows.
TEST(MultiHeadGqa, DecodingReadsTheCacheInPlace) {
  const Index d_model = 256, Hq = 32, Hkv = 8, D = 8, capacity = 16;
  const auto m = random_module<float>(make_config<float>(d_model, Hq, Hkv), 13);
  const Matrix<float> X = random_matrix<float>(5, d_model, 14);
  auto cache = m.make_cache(capacity);
  ObservedCall seen;
  ObserverGuard guard(&seen);
  m.forward(X.topRows(3), cache);
  m.forward(X.middleRows(3, 2), cache);
  EXPECT_EQ(seen.calls, 2);
  EXPECT_EQ(seen.k.data(), cache.keys().data());
  EXPECT_EQ(seen.v.data(), cache.values().data());
  EXPECT_EQ(seen.k.extent(1), Hkv);
  EXPECT_EQ(seen.k.extent(2), 5);
  EXPECT_EQ(seen.k.stride(1), capacity * D);
  EXPECT_EQ(seen.k.stride(2), D);
  EXPECT_EQ(seen.q.extent(1), Hq);
  EXPECT_EQ(seen.q.extent(2), 2);
}

// ---- KV-cache decoding ---------------------------------------------------------------------------------------------

struct DecodeShape {
  const char* name;
  Index d_model, n_heads, n_kv_heads, head_dim;
};

class MultiHeadDecode : public ::testing::TestWithParam<DecodeShape> {};

/// Feeds X through forward(X_new, cache) in chunks of the given sizes (cycled) and returns the stacked outputs.
Matrix<float> decode(const qkv::MultiHeadAttention<float>& m, const Matrix<float>& X, const std::vector<Index>& chunks,
                     const qkv::AttentionOptions<float>& options = {}) {
  auto cache = m.make_cache(X.rows());
  Matrix<float> Y(X.rows(), m.d_model());
  Index t = 0;
  for (std::size_t c = 0; t < X.rows(); ++c) {
    const Index n = std::min(chunks[c % chunks.size()], X.rows() - t);
    Y.middleRows(t, n) = m.forward(X.middleRows(t, n), cache, options);
    t += n;
    EXPECT_EQ(cache.length(), t);
  }
  return Y;
}

// Token by token, and in chunks (chunked prefill), equals one causal pass within 1e-5·max(1, max|Y|) in float.
TEST_P(MultiHeadDecode, EqualsOneCausalPass) {
  const DecodeShape s = GetParam();
  const Index T = 37;
  const auto m = random_module<float>(make_config<float>(s.d_model, s.n_heads, s.n_kv_heads, s.head_dim), 21);
  const Matrix<float> X = random_matrix<float>(T, s.d_model, 22);
  qkv::AttentionOptions<float> causal;
  causal.causal = true;
  const Matrix<float> full = m.forward(X, causal);
  ASSERT_TRUE(full.allFinite());
  const Matrix<double> full_d = full.cast<double>();
  const double bound = 1e-5 * std::max(1.0, max_abs(full_d));

  const Matrix<float> one_by_one = decode(m, X, {1});
  ASSERT_TRUE(one_by_one.allFinite());  // cache slots start as NaN: a read past length() would show here
  EXPECT_LE(max_difference(one_by_one, full_d), bound) << s.name << " token by token";
  const Matrix<float> chunked = decode(m, X, {5, 1, 8, 3, 13});
  EXPECT_LE(max_difference(chunked, full_d), bound) << s.name << " chunked prefill";
  const Matrix<float> prefill_then_decode = decode(m, X, {T - 4, 1});
  EXPECT_LE(max_difference(prefill_then_decode, full_d), bound) << s.name << " prefill then decode";

  // The causal pass itself against the float64 module (brute_force.hpp attention).
  brute::Params p;
  p.causal = true;
  const Matrix<double> Xd = X.cast<double>();
  const Matrix<double> expected =
      brute_force_module(weights_of(m), Xd, Xd, Xd, m.n_heads(), m.n_kv_heads(), m.head_dim(), p);
  EXPECT_LE(max_difference(full, expected), tolerance<float>(max_abs(expected))) << s.name;
  RecordProperty("decode_max_difference", scientific(max_difference(one_by_one, full_d)));
}

INSTANTIATE_TEST_SUITE_P(Heads, MultiHeadDecode,
                         ::testing::Values(DecodeShape{"MHA", 64, 4, 4, 0}, DecodeShape{"GQA_32_8", 512, 32, 8, 0},
                                           DecodeShape{"MQA", 96, 8, 1, 0}, DecodeShape{"GQA_odd", 40, 6, 3, 5}),
                         [](const ::testing::TestParamInfo<DecodeShape>& info) {
                           return std::string(info.param.name);
                         });

// The cache path is causal bottom-right whatever options.causal and options.alignment say.
TEST(MultiHeadCache, CausalBottomRightWhateverTheOptionsSay) {
  const auto m = random_module<float>(make_config<float>(32, 4, 2), 31);
  const Matrix<float> X = random_matrix<float>(12, 32, 32);
  qkv::AttentionOptions<float> causal;
  causal.causal = true;
  const Matrix<double> full = m.forward(X, causal).cast<double>();
  qkv::AttentionOptions<float> misleading;
  misleading.causal = false;
  misleading.alignment = qkv::CausalAlignment::top_left;
  EXPECT_LE(max_difference(decode(m, X, {3, 2, 4}, misleading), full), 1e-5 * std::max(1.0, max_abs(full)));
}

// Other options pass through to the cached attention: a sliding window (bottom-right, as FlashAttention's decoding).
TEST(MultiHeadCache, SlidingWindowPassesThrough) {
  const auto m = random_module<float>(make_config<float>(48, 6, 2), 33);
  const Matrix<float> X = random_matrix<float>(20, 48, 34);
  qkv::AttentionOptions<float> window;
  window.causal = true;
  window.window_left = 4;
  const Matrix<double> full = m.forward(X, window).cast<double>();
  EXPECT_LE(max_difference(decode(m, X, {1}, window), full), 1e-5 * std::max(1.0, max_abs(full)));
  EXPECT_LE(max_difference(decode(m, X, {3, 7}, window), full), 1e-5 * std::max(1.0, max_abs(full)));
  brute::Params p;
  p.causal = true;
  p.window_left = 4;
  const Matrix<double> Xd = X.cast<double>();
  const Matrix<double> expected = brute_force_module(weights_of(m), Xd, Xd, Xd, 6, 2, 8, p);
  EXPECT_LE(max_difference(full, expected), tolerance<float>(max_abs(expected)));
}

// Stale slots are never read: after clear(), a new sequence sees only its own keys, though the slots past the new
// length still hold the previous sequence's (finite) keys and values.
TEST(MultiHeadCache, ClearForgetsAndStaleSlotsAreNotRead) {
  const auto m = random_module<float>(make_config<float>(32, 4, 1), 35);
  const Matrix<float> first = random_matrix<float>(10, 32, 36), second = random_matrix<float>(4, 32, 37);
  auto cache = m.make_cache(10);
  m.forward(first, cache);
  EXPECT_EQ(cache.length(), 10);
  cache.clear();
  EXPECT_EQ(cache.length(), 0);
  EXPECT_EQ(cache.capacity(), 10);
  Matrix<float> Y(4, 32);
  for (Index t = 0; t < 4; ++t) Y.row(t) = m.forward(second.row(t), cache);
  qkv::AttentionOptions<float> causal;
  causal.causal = true;
  const Matrix<double> expected = m.forward(second, causal).cast<double>();
  EXPECT_LE(max_difference(Y, expected), 1e-5 * std::max(1.0, max_abs(expected)));
}

using qkv_test::expect_shape_error;

TEST(MultiHeadCache, ViewsAndAppend) {
  qkv::KVCache<double> cache(6, 2, 3);
  EXPECT_EQ(cache.capacity(), 6);
  EXPECT_EQ(cache.n_kv_heads(), 2);
  EXPECT_EQ(cache.head_dim(), 3);
  Matrix<double> K(2, 6), V(2, 6);
  K << 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12;
  V = -K;
  cache.append(K, V);
  const auto keys = cache.keys();
  EXPECT_EQ(keys.extents(), (std::array<Index, 4>{1, 2, 2, 3}));
  EXPECT_EQ(keys.strides(), (std::array<Index, 4>{36, 18, 3, 1}));
  EXPECT_EQ(keys(0, 0, 1, 2), 9);  // token 1, kv head 0, feature 2 = K(1, 2)
  EXPECT_EQ(keys(0, 1, 0, 0), 4);  // token 0, kv head 1, feature 0 = K(0, 3)
  EXPECT_EQ(cache.values()(0, 1, 1, 1), -11);
  expect_shape_error([&] { cache.append(Matrix<double>(1, 5), Matrix<double>(1, 6)); }, {"K_new", "5", "6"});
  expect_shape_error([&] { cache.append(Matrix<double>(1, 6), Matrix<double>(2, 6)); }, {"V_new", "2", "1"});
  expect_shape_error([&] { cache.append(Matrix<double>::Zero(5, 6), Matrix<double>::Zero(5, 6)); },
                     {"overflows", "2", "5", "7", "6"});
  EXPECT_EQ(cache.length(), 2);
  expect_shape_error([] { qkv::KVCache<float>(-1, 2, 3); }, {"capacity", "-1"});
  expect_shape_error([] { qkv::KVCache<float>(4, 0, 3); }, {"n_kv_heads", "0"});
  expect_shape_error([] { qkv::KVCache<float>(4, 2, 0); }, {"head_dim", "0"});
}

// Each head's rows start a 64-byte cache line where head_dim·sizeof(Storage) is a multiple of 64, for every storage
// type and in a copy too (CacheLineAllocator; glibc's malloc, by default, maps blocks this large afresh, 16 bytes past
// a page, where each row of a std::vector straddles two lines).
TEST(MultiHeadCache, RowsStartCacheLines) {
  const auto expect_lines = [](const auto& cache) {
    const auto offset = [](const void* p) { return reinterpret_cast<std::uintptr_t>(p) % 64; };
    for (Index h = 0; h < cache.n_kv_heads(); ++h) {
      for (Index t = 0; t < cache.capacity(); t += 7) {
        EXPECT_EQ(offset(cache.keys().data() + cache.keys().strides()[1] * h + cache.keys().strides()[2] * t), 0u);
        EXPECT_EQ(offset(cache.values().data() + cache.values().strides()[1] * h + cache.values().strides()[2] * t),
                  0u);
      }
    }
  };
  // Large enough (8 MiB, 2 MiB, 512 KiB per array) for glibc's default malloc to map each array afresh.
  qkv::KVCache<float> f32(2048, 8, 128);
  expect_lines(f32);
  qkv::KVCache<float, Eigen::half> f16(1024, 4, 256);
  expect_lines(f16);
  qkv::KVCache<float, Eigen::bfloat16> bf16(512, 8, 64);  // 128-byte rows
  expect_lines(bf16);
  qkv::KVCache<double> f64(100, 3, 8);  // 64-byte rows of double
  expect_lines(f64);
  const qkv::KVCache<float> copy = f32;
  expect_lines(copy);
}

// Overflow throws shape_error naming the sizes and leaves the cache as it was; a failing attention call after the
// append (a bad option) undoes the append.
TEST(MultiHeadCache, OverflowAndFailedCallsLeaveTheCacheUnchanged) {
  const auto m = random_module<float>(make_config<float>(16, 2), 41);
  const Matrix<float> X = random_matrix<float>(6, 16, 42);
  auto cache = m.make_cache(5);
  m.forward(X.topRows(3), cache);
  expect_shape_error([&] { m.forward(X.middleRows(3, 3), cache); }, {"overflows", "3", "5", "6"});
  EXPECT_EQ(cache.length(), 3);
  qkv::AttentionOptions<float> bad;
  bad.scale = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(m.forward(X.row(3), cache, bad), qkv::shape_error);
  EXPECT_EQ(cache.length(), 3);
  const Matrix<float> Y = m.forward(X.middleRows(3, 2), cache);  // still usable, and still exact
  EXPECT_EQ(cache.length(), 5);
  qkv::AttentionOptions<float> causal;
  causal.causal = true;
  const Matrix<double> full = m.forward(X.topRows(5), causal).cast<double>();
  EXPECT_LE(max_difference(Y, full.bottomRows(2)), 1e-5 * std::max(1.0, max_abs(full)));
  auto wrong = qkv::KVCache<float>(8, 1, 8);
  expect_shape_error([&] { m.forward(X.row(0), wrong); }, {"1 kv heads", "n_kv_heads 2"});
}

// ---- varlen batches -------------------------------------------------------------------------------------------------

template <class T>
struct MultiHeadTyped : ::testing::Test {};
TYPED_TEST_SUITE(MultiHeadTyped, qkv_test::Scalars, );

// A list of sequences (one empty) equals one call per sequence: sequences never see each other.
TYPED_TEST(MultiHeadTyped, VarlenListEqualsSeparateCalls) {
  using T = TypeParam;
  const auto m = random_module<T>(make_config<T>(24, 6, 2), 51);
  const std::vector<Matrix<T>> sequences = {random_matrix<T>(5, 24, 52), random_matrix<T>(1, 24, 53), Matrix<T>(0, 24),
                                            random_matrix<T>(7, 24, 54)};
  for (const bool causal : {false, true}) {
    qkv::AttentionOptions<T> options;
    options.causal = causal;
    const std::vector<Matrix<T>> outputs = m.forward(sequences, options);
    ASSERT_EQ(outputs.size(), sequences.size());
    for (std::size_t b = 0; b < sequences.size(); ++b) {
      const Matrix<double> alone = m.forward(sequences[b], options).template cast<double>();
      EXPECT_LE(max_difference(outputs[b], alone), tolerance<T>(max_abs(alone))) << "sequence " << b;
    }
  }
}

// Varlen cross-attention: cu_seqlens_q over X_q's rows, cu_seqlens_k over X_kv's rows; against the float64 module.
TYPED_TEST(MultiHeadTyped, VarlenCrossAttention) {
  using T = TypeParam;
  auto config = make_config<T>(16, 4, 2);
  config.kdim = 10;
  config.vdim = 10;
  const auto m = random_module<T>(config, 55);
  const Matrix<T> X_q = random_matrix<T>(9, 16, 56), X_kv = random_matrix<T>(11, 10, 57);
  qkv::AttentionOptions<T> options;
  options.cu_seqlens_q = {0, 4, 4, 9};
  options.cu_seqlens_k = {0, 3, 8, 11};
  const Matrix<T> Y = m.forward(X_q, X_kv, options);
  const Weights w = weights_of(m);
  for (std::size_t b = 0; b + 1 < options.cu_seqlens_q.size(); ++b) {
    const Index q0 = options.cu_seqlens_q[b], nq = options.cu_seqlens_q[b + 1] - q0;
    const Index k0 = options.cu_seqlens_k[b], nk = options.cu_seqlens_k[b + 1] - k0;
    const Matrix<double> Xq = X_q.middleRows(q0, nq).template cast<double>();
    const Matrix<double> Xkv = X_kv.middleRows(k0, nk).template cast<double>();
    const Matrix<double> expected = brute_force_module(w, Xq, Xkv, Xkv, 4, 2, 4, brute::Params());
    EXPECT_LE(max_difference(Matrix<T>(Y.middleRows(q0, nq)), expected), tolerance<T>(max_abs(expected)))
        << "sequence " << b;
  }
  // Weights of a varlen call are block diagonal: zero across sequences.
  const Matrix<T> P = m.attention_weights(X_q, X_kv, 1, options);
  EXPECT_TRUE(P.block(0, 3, 4, 8).isZero(0));
  EXPECT_TRUE(P.block(4, 0, 5, 8).isZero(0));
  EXPECT_NEAR(static_cast<double>(P.block(4, 8, 5, 3).rowwise().sum().minCoeff()), 1.0, 1e-6);
}

// ---- options pass through ------------------------------------------------------------------------------------------

// Softcap, ALiBi, sinks, an explicit scale and a window reach the core: against the float64 module.
TYPED_TEST(MultiHeadTyped, OptionsPassThrough) {
  using T = TypeParam;
  const auto m = random_module<T>(make_config<T>(24, 4, 2), 61);
  const Matrix<T> X = random_matrix<T>(10, 24, 62);
  qkv::AttentionOptions<T> options;
  options.scale = T(0.3);
  options.softcap = T(2);
  options.alibi_slopes = {T(0.5), T(0.25), T(0.125), T(0.0625)};
  options.sinks = {T(0.1), T(-1), T(2), -std::numeric_limits<T>::infinity()};
  options.causal = true;
  options.window_left = 3;
  brute::Params p;
  p.scale = 0.3;
  p.softcap = 2;
  p.alibi_slopes = {0.5, 0.25, 0.125, 0.0625};
  p.sinks = {0.1, -1, 2, -std::numeric_limits<double>::infinity()};
  p.causal = true;
  p.window_left = 3;
  const Matrix<double> Xd = X.template cast<double>();
  const Matrix<double> expected = brute_force_module(weights_of(m), Xd, Xd, Xd, 4, 2, 6, p);
  EXPECT_LE(max_difference(m.forward(X, options), expected), tolerance<T>(max_abs(expected)));
}

// ---- shape errors ------------------------------------------------------------------------------------------------

TEST(MultiHeadErrors, Config) {
  using MHA = qkv::MultiHeadAttention<float>;
  expect_shape_error([] { MHA m(make_config<float>(10, 4)); }, {"d_model 10", "n_heads 4", "head_dim"});
  expect_shape_error([] { MHA m(make_config<float>(24, 6, 4)); }, {"n_heads 6", "n_kv_heads 4"});
  expect_shape_error([] { MHA m(make_config<float>(0, 1)); }, {"d_model is 0"});
  expect_shape_error([] { MHA m(make_config<float>(8, 0)); }, {"n_heads is 0"});
  expect_shape_error([] { MHA m(make_config<float>(8, 2, -1)); }, {"n_kv_heads is -1"});
  expect_shape_error([] { MHA m(make_config<float>(8, 2, 0, -3)); }, {"head_dim is -3"});
  auto c = make_config<float>(8, 2);
  c.kdim = -2;
  expect_shape_error([&] { MHA m(c); }, {"kdim is -2"});
  EXPECT_NO_THROW({ MHA m(make_config<float>(10, 4, 2, 3)); });  // an explicit head_dim need not divide d_model
}

TEST(MultiHeadErrors, WeightShapes) {
  auto m = random_module<float>(make_config<float>(12, 3), 71);
  const auto before = m.W_q;
  const Matrix<float> in_proj = Matrix<float>::Ones(36, 12), out_proj = Matrix<float>::Ones(12, 12);
  const Eigen::VectorXf in_bias = Eigen::VectorXf::Ones(36), out_bias = Eigen::VectorXf::Ones(12);
  expect_shape_error([&] { m.load_pytorch(Matrix<float>(35, 12), in_bias, out_proj, out_bias); },
                     {"load_pytorch", "in_proj_weight is 35 × 12", "expected 36 × 12"});
  expect_shape_error([&] { m.load_pytorch(in_proj, Eigen::VectorXf(30), out_proj, out_bias); },
                     {"in_proj_bias", "30", "36"});
  expect_shape_error([&] { m.load_pytorch(in_proj, in_bias, Matrix<float>(12, 11), out_bias); },
                     {"out_proj_weight is 12 × 11", "expected 12 × 12"});
  expect_shape_error([&] { m.load_pytorch(in_proj, in_bias, out_proj, Eigen::VectorXf(13)); },
                     {"out_proj_bias", "13", "12"});
  expect_shape_error([&] { m.load_pytorch(in_proj, Matrix<float>(6, 6), out_proj, out_bias); },
                     {"in_proj_bias is 6 × 6", "vector of 36"});
  expect_shape_error([&] { m.load_fused_qkv(Matrix<float>(12, 35), in_bias, out_proj, out_bias); },
                     {"load_fused_qkv", "W_qkv is 12 × 35", "expected 12 × 36"});
  expect_shape_error([&] { m.load_fused_qkv(Matrix<float>(12, 36), in_bias, Matrix<float>(11, 12), out_bias); },
                     {"W_o is 11 × 12", "expected 12 × 12"});
  EXPECT_EQ(m.W_q, before);  // a failed load changes nothing

  auto no_bias_config = make_config<float>(12, 3);
  no_bias_config.bias = false;
  qkv::MultiHeadAttention<float> no_bias(no_bias_config);
  expect_shape_error([&] { no_bias.load_pytorch(in_proj, in_bias, out_proj, out_bias); },
                     {"in_proj_bias", "36", "expected a vector of 0", "Config::bias is false"});
  EXPECT_NO_THROW(no_bias.load_pytorch(in_proj, Eigen::VectorXf(0), out_proj, Eigen::VectorXf(0)));

  auto cross = make_config<float>(12, 3);
  cross.kdim = 5;
  cross.vdim = 7;
  qkv::MultiHeadAttention<float> c(cross);
  expect_shape_error([&] { c.load_pytorch(in_proj, in_bias, out_proj, out_bias); }, {"kdim is 5", "vdim is 7"});
  expect_shape_error(
      [&] {
        c.load_pytorch(Matrix<float>(12, 12), Matrix<float>(12, 6), Matrix<float>(12, 7), in_bias, out_proj, out_bias);
      },
      {"k_proj_weight is 12 × 6", "expected 12 × 5"});
  expect_shape_error([&] { c.load_fused_qkv(Matrix<float>(12, 36), in_bias, out_proj, out_bias); }, {"kdim is 5"});
  EXPECT_NO_THROW(c.load_pytorch(Matrix<float>::Ones(12, 12), Matrix<float>::Ones(12, 5), Matrix<float>::Ones(12, 7),
                                 in_bias, out_proj, out_bias));

  // Public weights assigned a wrong shape are caught by every call.
  m.W_q = Matrix<float>::Zero(12, 11);
  expect_shape_error([&] { m.forward(Matrix<float>::Zero(2, 12)); }, {"W_q is 12 × 11", "expected 12 × 12"});
  m.W_q = before;
  m.b_v = Eigen::VectorXf::Zero(4);
  expect_shape_error([&] { m.forward(Matrix<float>::Zero(2, 12)); }, {"b_v", "4", "12"});
}

TEST(MultiHeadErrors, Inputs) {
  auto config = make_config<float>(12, 3);
  config.kdim = 5;
  config.vdim = 7;
  const auto m = random_module<float>(config, 72);
  expect_shape_error(
      [&] { m.forward(Matrix<float>::Zero(2, 11), Matrix<float>::Zero(3, 5), Matrix<float>::Zero(3, 7)); },
      {"X_q has 11 columns", "d_model 12"});
  expect_shape_error(
      [&] { m.forward(Matrix<float>::Zero(2, 12), Matrix<float>::Zero(3, 6), Matrix<float>::Zero(3, 7)); },
      {"X_k has 6 columns", "kdim 5"});
  expect_shape_error(
      [&] { m.forward(Matrix<float>::Zero(2, 12), Matrix<float>::Zero(3, 5), Matrix<float>::Zero(4, 7)); },
      {"X_v has 4 rows", "expected 3"});
  expect_shape_error([&] { m.forward(Matrix<float>::Zero(2, 12), Matrix<float>::Zero(3, 5)); },
                     {"X_kv has 5 columns", "vdim 7"});
  expect_shape_error([&] { m.attention_weights(Matrix<float>::Zero(2, 12), Matrix<float>::Zero(3, 5), 3); },
                     {"head is 3", "[0, 3)"});
  auto cache = qkv::KVCache<float>(4, 3, 4);
  expect_shape_error([&] { m.forward(Matrix<float>::Zero(1, 12), cache); }, {"kdim is 5", "vdim is 7"});
  const auto self = random_module<float>(make_config<float>(12, 3), 73);
  expect_shape_error([&] { self.forward(Matrix<float>::Zero(1, 13), cache); }, {"X_new has 13 columns", "d_model 12"});
  expect_shape_error([&] { self.make_cache(-1); }, {"capacity is -1"});
}

TEST(MultiHeadErrors, CuSeqlens) {
  const auto m = random_module<float>(make_config<float>(12, 3), 74);
  const Matrix<float> X = Matrix<float>::Zero(6, 12);
  qkv::AttentionOptions<float> options;
  options.cu_seqlens_q = {0, 4, 2, 6};
  options.cu_seqlens_k = options.cu_seqlens_q;
  expect_shape_error([&] { m.forward(X, options); }, {"cu_seqlens_q decreases", "4", "2"});
  options.cu_seqlens_q = options.cu_seqlens_k = {0, 2, 5};
  expect_shape_error([&] { m.forward(X, options); }, {"cu_seqlens_q ends at 5", "expected 6", "X"});
  options.cu_seqlens_q = options.cu_seqlens_k = {1, 2, 6};
  expect_shape_error([&] { m.forward(X, options); }, {"cu_seqlens_q[0] is 1"});
  options.cu_seqlens_q = {0, 2, 6};
  options.cu_seqlens_k = {0, 3, 7};
  expect_shape_error([&] { m.forward(X, Matrix<float>::Zero(5, 12), options); }, {"cu_seqlens_k ends at 7", "5"});
  expect_shape_error([&] { m.attention_weights(X, X, 0, options); }, {"cu_seqlens_k ends at 7", "6"});
  expect_shape_error([&] { m.forward(std::vector<Matrix<float>>{X}, options); }, {"cu_seqlens_q/k are set"});
  expect_shape_error(
      [&] {
        m.forward(std::vector<Matrix<float>>{X, Matrix<float>::Zero(2, 11)});
      },
      {"sequences[1] has 11 columns"});
}

// ---- the real pretrained layer: PP-OCRv4's first attention layer ----------------------------------------------------

struct RealLayer {
  Fixture f = read_fixture(fixture_path("ppocr_v4_block1_attention.safetensors"));
  Array input = read_npy(fixture_path("ppocr_v4_block1_attention_input.npy"));
  Array tokens = read_npy(fixture_path("ppocr_v4_block1_tokens.npy"));

  template <class T>
  qkv::MultiHeadAttention<T> module() const {
    qkv::MultiHeadAttention<T> m(make_config<T>(120, 8));
    m.load_fused_qkv(to_matrix<T>(f.at("linear_77.w_0")), to_matrix<T>(f.at("linear_77.b_0")),
                     to_matrix<T>(f.at("linear_78.w_0")), to_matrix<T>(f.at("linear_78.b_0")));
    return m;
  }
};

const RealLayer& real_layer() {
  static const RealLayer layer;
  return layer;
}

TEST(MultiHeadRealLayer, PpOcrV4FirstAttentionLayerFloat) {
  const RealLayer& r = real_layer();
  ASSERT_EQ(r.input.shape, (std::vector<Index>{40, 120}));
  const auto m = r.module<float>();
  EXPECT_EQ(m.head_dim(), 15);
  const Matrix<float> Y = m.forward(to_matrix<float>(r.input));
  const double vs_f32 = max_difference(Y, to_matrix<double>(r.f.at("torch_attention_f32")));
  const double vs_f64 = max_difference(Y, to_matrix<double>(r.f.at("torch_attention_f64")));
  EXPECT_LE(vs_f32, 1e-5);
  EXPECT_LE(vs_f64, 1e-5);
  std::cout << "[ real layer ] float: max |Y - torch float32| = " << vs_f32 << ", max |Y - torch float64| = " << vs_f64
            << ", max |Y| = " << Y.cwiseAbs().maxCoeff() << "\n";
  RecordProperty("max_difference_vs_torch_f32", scientific(vs_f32));
  RecordProperty("max_difference_vs_torch_f64", scientific(vs_f64));
}

TEST(MultiHeadRealLayer, PpOcrV4FirstAttentionLayerDouble) {
  const RealLayer& r = real_layer();
  const Matrix<double> Y = r.module<double>().forward(to_matrix<double>(r.input));
  const Matrix<double> expected = to_matrix<double>(r.f.at("torch_attention_f64"));
  const double error = max_difference(Y, expected);
  EXPECT_LE(error, tolerance<double>(max_abs(expected)));
  std::cout << "[ real layer ] double: max |Y - torch float64| = " << error << "\n";
}

/// LayerNorm over each row (features), in double: (x − mean) / sqrt(var + eps)·w + b, biased variance as PyTorch.
Matrix<double> layer_norm(const Matrix<double>& x, const Matrix<double>& w, const Matrix<double>& b, double eps) {
  Matrix<double> y(x.rows(), x.cols());
  for (Index i = 0; i < x.rows(); ++i) {
    const double mean = x.row(i).mean();
    const double var = (x.row(i).array() - mean).square().mean();
    y.row(i) = ((x.row(i).array() - mean) / std::sqrt(var + eps) * w.row(0).array() + b.row(0).array()).matrix();
  }
  return y;
}

// The pre-LN attention sub-block (seed 002 §3.3: attention, W_O, residual; LayerNorm first, as SVTR's block does):
// LayerNorm(tokens) reproduces the model's own post-LN input, and tokens + MHA(LayerNorm(tokens)) PyTorch's block.
TEST(MultiHeadRealLayer, PreLayerNormSubBlock) {
  const RealLayer& r = real_layer();
  const Matrix<double> tokens = to_matrix<double>(r.tokens);
  const Matrix<double> normed = layer_norm(tokens, to_matrix<double>(r.f.at("layer_norm_43.w_0")),
                                           to_matrix<double>(r.f.at("layer_norm_43.b_0")), 1e-5);
  const double ln_error = max_difference(normed, to_matrix<double>(r.input));
  EXPECT_LE(ln_error, 1e-5);  // the model's float32 LayerNorm against ours in double
  const Matrix<float> block = tokens.cast<float>() + r.module<float>().forward(normed.cast<float>());
  const Matrix<double> expected = to_matrix<double>(r.f.at("torch_block_f64"));
  const double block_error = max_difference(block, expected);
  EXPECT_LE(block_error, 1e-5 * std::max(1.0, max_abs(expected)));
  std::cout << "[ real layer ] LayerNorm vs model: " << ln_error << ", block vs torch float64: " << block_error
            << " (max |block| = " << max_abs(expected) << ")\n";
}

// ---- RoPE in the module (Config::rope) ------------------------------------------------------------------------------
//
// Expected values: the whole module in float64 loops written here — the projections (`linear` above), RoPE from the
// formula (Hugging Face's q·cos + rotate_half(q)·sin for rotate_half, a complex product for interleaved; never qkv's
// rotation), softmax attention with GQA, the output projection.

/// RoPE from the formula, in double, on packed heads M (T × H·D): row t has position first_position + t.
///   rotate_half (Hugging Face Llama): x' = x·cos(φ) + rotate_half(x)·sin(φ), rotate_half(x) = [−x2, x1], with φ_d the
///     angle of frequency d mod D/2 (Hugging Face's cos/sin are cat(freqs, freqs));
///   interleaved (RoFormer, GPT-J, Meta Llama): (x_2i + i·x_2i+1) ← (x_2i + i·x_2i+1)·e^(i·φ_i).
/// φ_i = (position / interpolation_factor)·(base·ntk_factor^(D/(D−2)))^(−2i/D) (Chen et al. 2023; bloc97 2023).
Matrix<double> rope_by_formula(const Matrix<double>& M, Index H, Index D, Index first_position,
                               const qkv::RopeOptions& rope) {
  const Index half = D / 2;
  const double base = rope.base * std::pow(rope.ntk_factor, static_cast<double>(D) / static_cast<double>(D - 2));
  const auto angle = [&](Index position, Index i) {
    const double theta = std::pow(base, -2.0 * static_cast<double>(i) / static_cast<double>(D));
    return static_cast<double>(position) / rope.interpolation_factor * theta;
  };
  Matrix<double> out(M.rows(), M.cols());
  for (Index t = 0; t < M.rows(); ++t)
    for (Index h = 0; h < H; ++h) {
      const auto x = [&](Index d) { return M(t, h * D + d); };
      for (Index d = 0; d < D; ++d) {
        if (rope.layout == qkv::RopeLayout::rotate_half) {
          const double phi = angle(first_position + t, d % half);
          const double rotated_half = d < half ? -x(d + half) : x(d - half);
          out(t, h * D + d) = x(d) * std::cos(phi) + rotated_half * std::sin(phi);
        } else {
          const std::complex<double> z(x(d - d % 2), x(d - d % 2 + 1));
          const std::complex<double> w = z * std::polar(1.0, angle(first_position + t, d / 2));
          out(t, h * D + d) = d % 2 == 0 ? w.real() : w.imag();
        }
      }
    }
  return out;
}

/// softmax(Q_h·K_{h/G}ᵀ / √D)·V_{h/G} per query head h, G = Hq / Hkv, in double; causal: query i sees keys
/// j ≤ i + Tk − Tq (bottom-right).
Matrix<double> gqa_attention_loop(const Matrix<double>& Q, const Matrix<double>& K, const Matrix<double>& V, Index Hq,
                                  Index Hkv, Index D, bool causal) {
  const Index G = Hq / Hkv, Tq = Q.rows(), Tk = K.rows();
  Matrix<double> O = Matrix<double>::Zero(Tq, Hq * D);
  std::vector<double> scores(static_cast<std::size_t>(Tk));
  for (Index h = 0; h < Hq; ++h)
    for (Index i = 0; i < Tq; ++i) {
      const Index h_kv = h / G, last = causal ? std::min(Tk - 1, i + Tk - Tq) : Tk - 1;
      double max_score = -std::numeric_limits<double>::infinity();
      for (Index j = 0; j <= last; ++j) {
        double s = 0;
        for (Index d = 0; d < D; ++d) s += Q(i, h * D + d) * K(j, h_kv * D + d);
        scores[static_cast<std::size_t>(j)] = s / std::sqrt(static_cast<double>(D));
        max_score = std::max(max_score, scores[static_cast<std::size_t>(j)]);
      }
      double sum = 0;
      for (Index j = 0; j <= last; ++j) sum += std::exp(scores[static_cast<std::size_t>(j)] - max_score);
      for (Index j = 0; j <= last; ++j) {
        const double p = std::exp(scores[static_cast<std::size_t>(j)] - max_score) / sum;
        for (Index d = 0; d < D; ++d) O(i, h * D + d) += p * V(j, h_kv * D + d);
      }
    }
  return O;
}

/// The module with RoPE in float64 loops: queries at positions first_query_position + i, keys at first_key_position
/// + j. `K_rotated`, when given, receives the rotated keys (what a KV cache must hold).
Matrix<double> rope_module_loop(const Weights& w, const Matrix<double>& X_q, const Matrix<double>& X_kv, Index Hq,
                                Index Hkv, Index D, const qkv::RopeOptions& rope, bool causal,
                                Index first_query_position = 0, Index first_key_position = 0,
                                Matrix<double>* K_rotated = nullptr) {
  const Matrix<double> Q = rope_by_formula(linear(X_q, w.W_q, w.b_q), Hq, D, first_query_position, rope);
  const Matrix<double> K = rope_by_formula(linear(X_kv, w.W_k, w.b_k), Hkv, D, first_key_position, rope);
  if (K_rotated != nullptr) *K_rotated = K;
  return linear(gqa_attention_loop(Q, K, linear(X_kv, w.W_v, w.b_v), Hq, Hkv, D, causal), w.W_o, w.b_o);
}

template <class T>
typename qkv::MultiHeadAttention<T>::Config rope_config(Index d_model, Index n_heads, Index n_kv_heads, Index head_dim,
                                                        const qkv::RopeOptions& rope, bool bias = true) {
  auto c = make_config<T>(d_model, n_heads, n_kv_heads, head_dim);
  c.bias = bias;
  c.rope = rope;
  return c;
}

qkv::RopeOptions rope_options(qkv::RopeLayout layout, double base = 10000.0, double interpolation_factor = 1.0,
                              double ntk_factor = 1.0) {
  qkv::RopeOptions rope;
  rope.layout = layout;
  rope.base = base;
  rope.interpolation_factor = interpolation_factor;
  rope.ntk_factor = ntk_factor;
  return rope;
}

const char* layout_name(qkv::RopeLayout layout) {
  return layout == qkv::RopeLayout::rotate_half ? "rotate_half" : "interleaved";
}

template <class T>
struct MultiHeadRope : ::testing::Test {};
TYPED_TEST_SUITE(MultiHeadRope, qkv_test::Scalars, );

// (a) Self-attention (causal and not), cross-attention (Tq ≠ Tk) and attention_weights with RoPE, GQA 8/2 with biases,
// both layouts, against the float64 loop; the scaling options (interpolation, NTK) too.
TYPED_TEST(MultiHeadRope, EqualsFloat64LoopInBothLayouts) {
  using T = TypeParam;
  const Index d_model = 48, Hq = 8, Hkv = 2, D = 12;
  for (const qkv::RopeOptions& rope :
       {rope_options(qkv::RopeLayout::rotate_half), rope_options(qkv::RopeLayout::interleaved),
        rope_options(qkv::RopeLayout::rotate_half, 500000.0, 4.0, 8.0),
        rope_options(qkv::RopeLayout::interleaved, 100.0, 2.5, 3.0)}) {
    SCOPED_TRACE(std::string(layout_name(rope.layout)) + " base " + scientific(rope.base));
    const auto m = random_module<T>(rope_config<T>(d_model, Hq, Hkv, D, rope), 51);
    ASSERT_TRUE(m.config().rope.has_value());
    const Matrix<T> X = random_matrix<T>(23, d_model, 52), X_kv = random_matrix<T>(31, d_model, 53);
    const Matrix<double> Xd = X.template cast<double>(), X_kvd = X_kv.template cast<double>();
    const Weights w = weights_of(m);

    const Matrix<double> expected = rope_module_loop(w, Xd, Xd, Hq, Hkv, D, rope, false);
    EXPECT_LE(max_difference(m.forward(X), expected), tolerance<T>(max_abs(expected))) << "self";

    qkv::AttentionOptions<T> causal;
    causal.causal = true;
    const Matrix<double> expected_causal = rope_module_loop(w, Xd, Xd, Hq, Hkv, D, rope, true);
    EXPECT_LE(max_difference(m.forward(X, causal), expected_causal), tolerance<T>(max_abs(expected_causal)))
        << "self, causal";

    const Matrix<double> expected_cross = rope_module_loop(w, Xd, X_kvd, Hq, Hkv, D, rope, false);
    EXPECT_LE(max_difference(m.forward(X, X_kv), expected_cross), tolerance<T>(max_abs(expected_cross))) << "cross";
  }
}

// Without rope the module is unchanged (the loop with position 0 everywhere is the identity rotation), and with rope
// the output differs: RoPE reaches the attention.
TYPED_TEST(MultiHeadRope, UnsetMeansNoRotation) {
  using T = TypeParam;
  auto config = make_config<T>(32, 4, 2, 8);
  EXPECT_FALSE(config.rope.has_value());
  const auto plain = random_module<T>(config, 54);
  config.rope = qkv::RopeOptions{};
  auto rotary = qkv::MultiHeadAttention<T>(config);
  rotary.W_q = plain.W_q, rotary.W_k = plain.W_k, rotary.W_v = plain.W_v, rotary.W_o = plain.W_o;
  rotary.b_q = plain.b_q, rotary.b_k = plain.b_k, rotary.b_v = plain.b_v, rotary.b_o = plain.b_o;
  const Matrix<T> X = random_matrix<T>(9, 32, 55);
  const Matrix<double> Xd = X.template cast<double>();
  const Matrix<double> with_rope = rope_module_loop(weights_of(plain), Xd, Xd, 4, 2, 8, qkv::RopeOptions{}, false);
  EXPECT_LE(max_difference(rotary.forward(X), with_rope), tolerance<T>(max_abs(with_rope)));
  EXPECT_GT(max_difference(plain.forward(X), with_rope), 100 * tolerance<T>(max_abs(with_rope)));
  // A single token sits at position 0 for queries and keys alike: the rotation is the identity.
  EXPECT_LE(max_difference(rotary.forward(X.topRows(1)), plain.forward(X.topRows(1)).template cast<double>()),
            tolerance<T>(1.0));
}

// The weights of one head, for inspection, see the same rotated Q and K as forward; a varlen batch restarts the
// positions at 0 in every sequence (each equals its own call).
TYPED_TEST(MultiHeadRope, AttentionWeightsAndVarlen) {
  using T = TypeParam;
  const qkv::RopeOptions rope = rope_options(qkv::RopeLayout::rotate_half, 1000.0);
  const auto m = random_module<T>(rope_config<T>(40, 4, 1, 10, rope), 56);
  const Matrix<T> X = random_matrix<T>(11, 40, 57);
  const Matrix<double> Xd = X.template cast<double>();
  const Weights w = weights_of(m);
  const Matrix<double> Q = rope_by_formula(linear(Xd, w.W_q, w.b_q), 4, 10, 0, rope);
  const Matrix<double> K = rope_by_formula(linear(Xd, w.W_k, w.b_k), 1, 10, 0, rope);
  const Index head = 3;
  Matrix<double> expected = Q.middleCols(head * 10, 10) * K.transpose() / std::sqrt(10.0);  // head 3 reads kv head 0
  for (Index i = 0; i < expected.rows(); ++i) {
    expected.row(i) = (expected.row(i).array() - expected.row(i).maxCoeff()).exp().matrix();
    expected.row(i) /= expected.row(i).sum();
  }
  EXPECT_LE(max_difference(m.attention_weights(X, X, head), expected), tolerance<T>(1.0));

  const std::vector<Matrix<T>> sequences = {random_matrix<T>(7, 40, 58), random_matrix<T>(0, 40, 59),
                                            random_matrix<T>(12, 40, 60)};
  qkv::AttentionOptions<T> causal;
  causal.causal = true;
  const std::vector<Matrix<T>> outputs = m.forward(sequences, causal);
  ASSERT_EQ(outputs.size(), sequences.size());
  for (std::size_t b = 0; b < sequences.size(); ++b) {
    const Matrix<double> Xb = sequences[b].template cast<double>();
    const Matrix<double> expected_b = rope_module_loop(w, Xb, Xb, 4, 1, 10, rope, true);
    EXPECT_LE(max_difference(outputs[b], expected_b), tolerance<T>(max_abs(expected_b))) << "sequence " << b;
  }
}

// (b) Prefill then token-by-token decoding (and chunked prefill) with RoPE equals one causal pass, within
// 1e-5·max(1, max|Y|) in float, for both layouts, GQA 8/2 and MQA, without biases (Llama).
TEST(MultiHeadRopeDecode, PrefillThenDecodeEqualsOneCausalPass) {
  for (const qkv::RopeLayout layout : {qkv::RopeLayout::rotate_half, qkv::RopeLayout::interleaved})
    for (const Index n_kv_heads : {Index{2}, Index{1}}) {
      SCOPED_TRACE(std::string(layout_name(layout)) + ", n_kv_heads " + std::to_string(n_kv_heads));
      const auto m = random_module<float>(rope_config<float>(128, 8, n_kv_heads, 16, rope_options(layout), false), 61);
      const Index T = 41;
      const Matrix<float> X = random_matrix<float>(T, 128, 62);
      qkv::AttentionOptions<float> causal;
      causal.causal = true;
      const Matrix<double> full = m.forward(X, causal).cast<double>();
      const double bound = 1e-5 * std::max(1.0, max_abs(full));
      const Matrix<float> prefill_then_decode = decode(m, X, {T - 9, 1});
      ASSERT_TRUE(prefill_then_decode.allFinite());
      EXPECT_LE(max_difference(prefill_then_decode, full), bound) << "prefill then decode";
      EXPECT_LE(max_difference(decode(m, X, {1}), full), bound) << "token by token";
      EXPECT_LE(max_difference(decode(m, X, {5, 1, 8, 3, 13}), full), bound) << "chunked prefill";
    }
}

// (c) RoPE rotates pairs of features: an odd head_dim throws shape_error at construction, naming the module, rope and
// the size (given or derived from d_model / n_heads); so do invalid RopeOptions. Without rope an odd head_dim is fine.
TEST(MultiHeadRopeErrors, OddHeadDimAndBadOptions) {
  using Module = qkv::MultiHeadAttention<float>;
  const qkv::RopeOptions rope;
  expect_shape_error([&] { Module m(rope_config<float>(40, 8, 2, 5, rope)); },
                     {"qkv::MultiHeadAttention", "rope", "head_dim", "5", "even"});
  expect_shape_error([&] { Module m(rope_config<float>(56, 8, 0, 0, rope)); },
                     {"qkv::MultiHeadAttention", "rope", "head_dim", "7", "d_model / n_heads"});
  for (const double bad :
       {0.0, -1.0, std::numeric_limits<double>::quiet_NaN(), std::numeric_limits<double>::infinity()}) {
    expect_shape_error(
        [&] { Module m(rope_config<float>(32, 4, 2, 8, rope_options(qkv::RopeLayout::rotate_half, bad))); },
        {"qkv::MultiHeadAttention", "Config::rope->base"});
    expect_shape_error(
        [&] { Module m(rope_config<float>(32, 4, 2, 8, rope_options(qkv::RopeLayout::rotate_half, 1e4, bad))); },
        {"qkv::MultiHeadAttention", "Config::rope->interpolation_factor"});
    expect_shape_error(
        [&] { Module m(rope_config<float>(32, 4, 2, 8, rope_options(qkv::RopeLayout::rotate_half, 1e4, 1.0, bad))); },
        {"qkv::MultiHeadAttention", "Config::rope->ntk_factor"});
  }
  EXPECT_NO_THROW(Module(make_config<float>(40, 8, 2, 5)));
  EXPECT_NO_THROW(Module(rope_config<float>(32, 16, 4, 2, rope)));  // head_dim 2: one pair
}

// (d) Positions in cache decoding: a cache filled by a prefill of 9 tokens, then a chunk of 4, then one token at a
// time; every output row equals the float64 loop over the whole sequence, and the cache holds each key rotated by
// its absolute position. Decoding the chunk at positions 0 … 3 (forgetting the cache's length) would fail both.
TEST(MultiHeadRopeDecode, PositionsContinueFromTheCacheLength) {
  for (const qkv::RopeOptions& rope :
       {rope_options(qkv::RopeLayout::rotate_half, 50.0), rope_options(qkv::RopeLayout::interleaved, 50.0, 2.0, 4.0)}) {
    SCOPED_TRACE(layout_name(rope.layout));
    const Index Hq = 6, Hkv = 3, D = 8, T = 24;
    const auto m = random_module<float>(rope_config<float>(48, Hq, Hkv, D, rope), 63);
    const Matrix<float> X = random_matrix<float>(T, 48, 64);
    const Matrix<double> Xd = X.cast<double>();
    Matrix<double> K_expected;
    const Matrix<double> expected = rope_module_loop(weights_of(m), Xd, Xd, Hq, Hkv, D, rope, true, 0, 0, &K_expected);
    const double bound = tolerance<float>(max_abs(expected));

    auto cache = m.make_cache(T);
    const Matrix<float> Y_prefill = m.forward(X.topRows(9), cache);
    EXPECT_LE(max_difference(Y_prefill, expected.topRows(9)), bound) << "prefill";
    const Matrix<float> Y_chunk = m.forward(X.middleRows(9, 4), cache);  // positions 9 … 12
    EXPECT_LE(max_difference(Y_chunk, expected.middleRows(9, 4)), bound) << "chunk after a non-empty cache";
    for (Index t = 13; t < T; ++t) {
      const Matrix<float> Y_t = m.forward(X.row(t), cache);
      EXPECT_LE(max_difference(Y_t, expected.middleRows(t, 1)), bound) << "token " << t;
    }
    ASSERT_EQ(cache.length(), T);
    const auto keys = cache.keys();
    double key_error = 0;
    for (Index h = 0; h < Hkv; ++h)
      for (Index j = 0; j < T; ++j)
        for (Index d = 0; d < D; ++d)
          key_error = std::max(key_error, std::abs(static_cast<double>(keys(0, h, j, d)) - K_expected(j, h * D + d)));
    EXPECT_LE(key_error, tolerance<float>(max_abs(K_expected))) << "the cache holds keys rotated by their positions";

    // After clear(), the next sequence starts again at position 0.
    cache.clear();
    const Matrix<float> Y_again = m.forward(X.topRows(5), cache);
    EXPECT_LE(max_difference(Y_again, expected.topRows(5)), bound) << "after clear()";
  }
}

TEST(MultiHeadFixtures, HostIsLittleEndian) { EXPECT_TRUE(little_endian()); }

// ---- 16-bit KV cache: KVCache<float, Eigen::half> and KVCache<float, Eigen::bfloat16> -------------------------------
//
// Expected values: roundings worked by hand from the formats; Eigen's own conversion (round to nearest even) applied
// here to projections computed in float64 loops (exact in float by construction, below) and rotated by RoPE's formula;
// one causal pass over the rounded values by `qkv::scaled_dot_product_attention` on their float copies and by the
// float64 loop `gqa_attention_loop`.

template <class Storage>
struct Kv16 : ::testing::Test {};
using Kv16Types = ::testing::Types<Eigen::half, Eigen::bfloat16>;
TYPED_TEST_SUITE(Kv16, Kv16Types, );

template <class Storage>
std::uint16_t bits_of(Storage x) {
  static_assert(sizeof(Storage) == 2, "a 16-bit storage type");
  std::uint16_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

/// A module whose projections are exact in float whatever the order of summation: weights and biases are multiples of
/// 2⁻¹² (U(±1/√d_model) rounded), inputs multiples of 2⁻⁶ in [−1, 1] (`dyadic_input`), so every product is a multiple
/// of 2⁻¹⁸ and every partial sum is below 2⁴ for d_model ≤ 128: 22 bits, exact in float's 24. Decoding (one row or a
/// chunk at a time) and the one-pass reference then hold the same float K and V and round them to the same 16 bits.
qkv::MultiHeadAttention<float> dyadic_module(const qkv::MultiHeadAttention<float>::Config& config, unsigned seed) {
  auto m = random_module<float>(config, seed);
  for (auto* w : {&m.W_q, &m.W_k, &m.W_v, &m.W_o}) *w = ((w->array() * 4096.0f).round() / 4096.0f).matrix();
  for (auto* b : {&m.b_q, &m.b_k, &m.b_v, &m.b_o}) *b = ((b->array() * 4096.0f).round() / 4096.0f).matrix();
  return m;
}

Matrix<float> dyadic_input(Index rows, Index cols, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> draw(-64, 64);
  Matrix<float> X(rows, cols);
  for (Index i = 0; i < X.size(); ++i) X.data()[i] = static_cast<float>(draw(rng)) / 64.0f;
  return X;
}

bool exact_in_float(const Matrix<double>& M) {
  for (Index i = 0; i < M.size(); ++i)
    if (static_cast<double>(static_cast<float>(M.data()[i])) != M.data()[i]) return false;
  return true;
}

/// One causal pass over the module's K and V rounded to Storage, computed outside the module.
template <class Storage>
struct RoundedPass {
  Matrix<float> K, V;        ///< the projections (K rotated with Config::rope) in float, before rounding
  Matrix<Storage> K16, V16;  ///< K and V rounded once with Eigen's conversion: what a cache must hold
  Matrix<double> Y;          ///< the float pass: scaled_dot_product_attention on K16, V16 widened, then ·W_o + b_o
  Matrix<double> Y_float64;  ///< the float64 loop on the same rounded values
};

template <class Storage>
RoundedPass<Storage> rounded_pass(const qkv::MultiHeadAttention<float>& m, const Matrix<float>& X) {
  const Index Hq = m.n_heads(), Hkv = m.n_kv_heads(), D = m.head_dim();
  const Weights w = weights_of(m);
  const Matrix<double> Xd = X.cast<double>();
  Matrix<double> Q = linear(Xd, w.W_q, w.b_q), K = linear(Xd, w.W_k, w.b_k);
  const Matrix<double> V = linear(Xd, w.W_v, w.b_v);
  EXPECT_TRUE(exact_in_float(Q) && exact_in_float(K) && exact_in_float(V)) << "the test needs exact projections";
  if (m.config().rope) {
    Q = rope_by_formula(Q, Hq, D, 0, *m.config().rope);
    K = rope_by_formula(K, Hkv, D, 0, *m.config().rope);
  }
  RoundedPass<Storage> r;
  const Matrix<float> Q_float = Q.cast<float>();
  r.K = K.cast<float>();
  r.V = V.cast<float>();
  r.K16 = r.K.template cast<Storage>();
  r.V16 = r.V.template cast<Storage>();
  const Matrix<float> K_rounded = r.K16.template cast<float>(), V_rounded = r.V16.template cast<float>();
  qkv::AttentionOptions<float> causal;
  causal.causal = true;
  const Matrix<float> O = qkv::scaled_dot_product_attention(Q_float, K_rounded, V_rounded, qkv::Heads{Hq, Hkv}, causal);
  r.Y = linear(O.cast<double>(), w.W_o, w.b_o);
  r.Y_float64 = linear(
      gqa_attention_loop(Q_float.cast<double>(), K_rounded.cast<double>(), V_rounded.cast<double>(), Hq, Hkv, D, true),
      w.W_o, w.b_o);
  return r;
}

/// Feeds X through forward(X_new, cache) in chunks of the given sizes (cycled); returns the stacked outputs.
template <class Storage>
Matrix<float> decode_into(const qkv::MultiHeadAttention<float>& m, const Matrix<float>& X,
                          const std::vector<Index>& chunks, qkv::KVCache<float, Storage>& cache) {
  Matrix<float> Y(X.rows(), m.d_model());
  Index t = 0;
  for (std::size_t c = 0; t < X.rows(); ++c) {
    const Index n = std::min(chunks[c % chunks.size()], X.rows() - t);
    Y.middleRows(t, n) = m.forward(X.middleRows(t, n), cache);
    t += n;
    EXPECT_EQ(cache.length(), t);
  }
  return Y;
}

/// Entries of a [1, Hkv, T, D] cache view whose bits differ from the packed-heads matrix M (T × Hkv·D).
template <class Storage>
Index differing_entries(const qkv::TensorView4<const Storage>& cached, const Matrix<Storage>& M) {
  EXPECT_EQ(cached.extent(2), M.rows());
  EXPECT_EQ(cached.extent(1) * cached.extent(3), M.cols());
  Index differing = 0;
  const Index D = cached.extent(3);
  for (Index h = 0; h < cached.extent(1); ++h)
    for (Index j = 0; j < std::min(cached.extent(2), M.rows()); ++j)
      for (Index d = 0; d < D; ++d) differing += bits_of(cached(0, h, j, d)) != bits_of(M(j, h * D + d));
  return differing;
}

// The cache's types and memory: keys() and values() view Storage; a 16-bit cache allocates two bytes per element of K
// and V, once (float: four); append allocates nothing; and a decoding step over 4095 cached tokens reads the 16-bit
// memory in place: it allocates less than a quarter of the float size of the cached K and V (no widening copy).
TYPED_TEST(Kv16, HoldsTwoBytesPerElement) {
  using Storage = TypeParam;
  using Cache = qkv::KVCache<float, Storage>;
  static_assert(sizeof(Storage) == 2);
  static_assert(std::is_same_v<qkv::KVCache<float>, qkv::KVCache<float, float>>);
  static_assert(std::is_same_v<decltype(std::declval<const Cache&>().keys()), qkv::TensorView4<const Storage>>);
  static_assert(std::is_same_v<decltype(std::declval<const Cache&>().values()), qkv::TensorView4<const Storage>>);
  static_assert(std::is_same_v<typename Cache::storage_type, Storage> &&
                std::is_same_v<typename Cache::scalar_type, float>);
  const Index d_model = 128, Hq = 8, Hkv = 2, D = 16, capacity = 1000;
  const auto m = random_module<float>(make_config<float>(d_model, Hq, Hkv), 81);
  static_assert(std::is_same_v<decltype(m.make_cache(capacity)), qkv::KVCache<float>>);
  static_assert(std::is_same_v<decltype(m.make_cache<Storage>(capacity)), Cache>);
  if (!QKV_COUNTS_ALLOCATIONS) GTEST_SKIP() << "ThreadSanitizer build: operator new is TSan's, not counted";

  const std::size_t elements = static_cast<std::size_t>(Hkv * capacity * D);  // of K, and of V
  std::optional<Cache> cache;
  const qkv_test::AllocationCount made =
      qkv_test::count_allocations([&] { cache.emplace(m.make_cache<Storage>(capacity)); });
  EXPECT_EQ(made.bytes, 2 * elements * 2);  // K and V, two bytes per element
  EXPECT_EQ(made.largest, elements * 2);
  std::optional<qkv::KVCache<float>> float_cache;
  const qkv_test::AllocationCount made_float =
      qkv_test::count_allocations([&] { float_cache.emplace(m.make_cache(capacity)); });
  EXPECT_EQ(made_float.bytes, 2 * elements * 4);  // the float cache: four
  EXPECT_EQ(made.bytes * 2, made_float.bytes);

  const Matrix<float> K = random_matrix<float>(3, Hkv * D, 82), V = random_matrix<float>(3, Hkv * D, 83);
  EXPECT_EQ(qkv_test::count_allocations([&] { cache->append(K, V); }).bytes, 0u);
  EXPECT_EQ(cache->length(), 3);

  // A long cache, filled by append (rounded), then one decoding step through the module.
  const Index L = 4096;
  Cache long_cache = m.make_cache<Storage>(L);
  long_cache.append(random_matrix<float>(L - 1, Hkv * D, 84), random_matrix<float>(L - 1, Hkv * D, 85));
  const Matrix<float> x = random_matrix<float>(1, d_model, 86);
  Matrix<float> y;
  const qkv_test::AllocationCount step = qkv_test::count_allocations([&] { y = m.forward(x, long_cache); });
  EXPECT_EQ(long_cache.length(), L);
  ASSERT_TRUE(y.allFinite());
  const std::size_t float_kv_bytes = 2 * static_cast<std::size_t>(Hkv * L * D) * sizeof(float);
  EXPECT_LT(step.bytes, float_kv_bytes / 4) << "a decoding step allocated " << step.bytes << " bytes";
  ::testing::Test::RecordProperty("decode_step_allocated_bytes", static_cast<int>(step.bytes));
}

// append rounds each float once with Eigen's conversion, to nearest with ties to even; a float above half's largest
// finite value 65504 (from the tie at 65520 on) becomes ±∞ in half, not in bfloat16; NaN stays NaN; values already of
// the storage type are copied as they are; slots past length() hold NaN. Expected values worked by hand from the
// formats: half has 11 significant bits (spacing 2⁻¹⁰ in [1, 2)) and subnormals down to 2⁻²⁴; bfloat16 has 8
// (spacing 2⁻⁷ in [1, 2)) and float's exponent range.
TYPED_TEST(Kv16, AppendRoundsOnceToNearestEven) {
  using Storage = TypeParam;
  constexpr bool kHalf = std::is_same_v<Storage, Eigen::half>;
  const float inf = std::numeric_limits<float>::infinity();
  const float ulp = std::ldexp(1.0f, kHalf ? -10 : -7);  // spacing in [1, 2)
  struct Case {
    float in, out;
  };
  std::vector<Case> cases = {
      {1.0f + ulp / 2, 1.0f},                                      // a tie: to the even neighbour, 1
      {1.0f + 3 * ulp / 2, 1.0f + 2 * ulp},                        // a tie: to the even neighbour, 1 + 2·spacing
      {1.0f + ulp / 2 + std::ldexp(1.0f, -20), 1.0f + ulp},        // just above the tie: up
      {-(1.0f + ulp / 2 + std::ldexp(1.0f, -20)), -(1.0f + ulp)},  // symmetric
      {1.0f + ulp / 2 - std::ldexp(1.0f, -20), 1.0f},              // just below the tie: down
  };
  if constexpr (kHalf) {
    cases.insert(cases.end(), {{65504.0f, 65504.0f},  // half's largest finite value
                               {65519.0f, 65504.0f},  // below the tie at 65520
                               {65520.0f, inf},       // the tie rounds to the even 2¹⁶: ∞
                               {-70000.0f, -inf},
                               {1e6f, inf},
                               {std::ldexp(1.0f, -25), 0.0f},  // a tie between 0 and 2⁻²⁴: to 0
                               {3 * std::ldexp(1.0f, -26), std::ldexp(1.0f, -24)},
                               {0.1f, 0.0999755859375f}});  // 1638 / 2¹⁴
  } else {
    cases.insert(cases.end(), {{65520.0f, 65536.0f},             // spacing 256 in [2¹⁵, 2¹⁶)
                               {70000.0f, 70144.0f},             // 137 · 512
                               {-1e6f, -999424.0f},              // 244 · 4096
                               {1e30f, std::ldexp(202.0f, 92)},  // finite (float's range): 202 · 2⁹²
                               {0.1f, 0.10009765625f}});         // 205 / 2¹¹
  }
  const Index n = static_cast<Index>(cases.size()) + 1;  // the last entry is NaN
  Matrix<float> K(1, n);
  for (Index d = 0; d + 1 < n; ++d) K(0, d) = cases[static_cast<std::size_t>(d)].in;
  K(0, n - 1) = std::numeric_limits<float>::quiet_NaN();
  qkv::KVCache<float, Storage> cache(3, 1, n);
  EXPECT_TRUE(Eigen::numext::isnan(cache.keys().data()[0]));  // slots start as NaN
  cache.append(K, Matrix<float>(-K));
  for (Index d = 0; d + 1 < n; ++d) {
    const Case c = cases[static_cast<std::size_t>(d)];
    EXPECT_EQ(static_cast<float>(cache.keys()(0, 0, 0, d)), c.out) << "key " << c.in;
    EXPECT_EQ(static_cast<float>(cache.values()(0, 0, 0, d)), -c.out) << "value " << -c.in;
  }
  EXPECT_TRUE(Eigen::numext::isnan(cache.keys()(0, 0, 0, n - 1)));
  EXPECT_TRUE(Eigen::numext::isnan(cache.values()(0, 0, 0, n - 1)));
  EXPECT_TRUE(Eigen::numext::isnan(cache.keys().data()[n]));  // row 1, past length(): still NaN
  EXPECT_TRUE(Eigen::numext::isnan(cache.values().data()[2 * n]));

  // Rows already in the storage type are copied bit for bit.
  Matrix<Storage> K16(1, n), V16(1, n);
  for (Index d = 0; d < n; ++d) {
    K16(0, d) = Storage(static_cast<float>(d) * 0.3f - 2.0f);
    V16(0, d) = Storage(static_cast<float>(d) * -1.7f + 0.5f);
  }
  cache.append(K16, V16);
  ASSERT_EQ(cache.length(), 2);
  for (Index d = 0; d < n; ++d) {
    EXPECT_EQ(bits_of(cache.keys()(0, 0, 1, d)), bits_of(K16(0, d)));
    EXPECT_EQ(bits_of(cache.values()(0, 0, 1, d)), bits_of(V16(0, d)));
  }
}

// Decoding from a 16-bit cache token by token, in chunks, prefill then decode, and as one prefill equals one causal
// pass over the same rounded K/V computed outside the module, within 1e-5·max(1, max|Y|) in float (the float cache's
// rule); the cache holds exactly Eigen's rounding of the (rotated) projections. GQA 8/2, without RoPE and with both
// layouts.
TYPED_TEST(Kv16, DecodingEqualsOneCausalPassOverTheRoundedKeysAndValues) {
  using Storage = TypeParam;
  const Index d_model = 128, Hq = 8, Hkv = 2, D = 16, T = 37;
  const std::vector<std::optional<qkv::RopeOptions>> ropes = {std::nullopt, rope_options(qkv::RopeLayout::rotate_half),
                                                              rope_options(qkv::RopeLayout::interleaved, 500.0)};
  for (const auto& rope : ropes) {
    SCOPED_TRACE(rope ? layout_name(rope->layout) : "no rope");
    auto config = make_config<float>(d_model, Hq, Hkv, D);
    config.rope = rope;
    const auto m = dyadic_module(config, 91);
    const Matrix<float> X = dyadic_input(T, d_model, 92);
    const RoundedPass<Storage> pass = rounded_pass<Storage>(m, X);
    ASSERT_TRUE(pass.Y.allFinite());
    EXPECT_LE(max_difference(pass.Y, pass.Y_float64), tolerance<float>(max_abs(pass.Y_float64))) << "the float pass";
    // The rounding is real: most entries of K and V change (the projections carry about 17 significant bits).
    const Index changed_k = (pass.K16.template cast<float>().array() != pass.K.array()).count();
    const Index changed_v = (pass.V16.template cast<float>().array() != pass.V.array()).count();
    EXPECT_GT(changed_k, pass.K.size() / 2);
    EXPECT_GT(changed_v, pass.V.size() / 2);

    const double bound = 1e-5 * std::max(1.0, max_abs(pass.Y));
    for (const std::vector<Index>& chunks : {std::vector<Index>{1}, std::vector<Index>{5, 1, 8, 3, 13},
                                             std::vector<Index>{T - 4, 1}, std::vector<Index>{T}}) {
      SCOPED_TRACE("chunks of " + std::to_string(chunks.front()) + (chunks.size() > 1 ? ", ..." : ""));
      auto cache = m.make_cache<Storage>(T);
      const Matrix<float> Y = decode_into(m, X, chunks, cache);
      ASSERT_TRUE(Y.allFinite());  // slots start as NaN: a read past length() would show here
      EXPECT_LE(max_difference(Y, pass.Y), bound);
      EXPECT_EQ(differing_entries(cache.keys(), pass.K16), 0) << "the cache holds the rounded (rotated) keys";
      EXPECT_EQ(differing_entries(cache.values(), pass.V16), 0) << "the cache holds the rounded values";
      ::testing::Test::RecordProperty("decode16_max_difference", scientific(max_difference(Y, pass.Y)));
    }
  }
}

/// What the module handed to the core when decoding from a 16-bit cache: q copied (packed heads), k and v by address.
template <class Storage>
struct Observed16 {
  int calls = 0;
  Matrix<float> Q;
  const Storage* k_data = nullptr;
  const Storage* v_data = nullptr;
  Index k_heads = 0, k_rows = 0, k_row_stride = 0;
};

template <class Storage>
void observe16(const qkv::TensorView4<const float>& q, const qkv::TensorView4<const Storage>& k,
               const qkv::TensorView4<const Storage>& v, void* context) {
  auto* seen = static_cast<Observed16<Storage>*>(context);
  ++seen->calls;
  const Index H = q.extent(1), rows = q.extent(2), D = q.extent(3);
  seen->Q.resize(rows, H * D);
  for (Index h = 0; h < H; ++h)
    for (Index i = 0; i < rows; ++i)
      for (Index d = 0; d < D; ++d) seen->Q(i, h * D + d) = q(0, h, i, d);
  seen->k_data = k.data();
  seen->v_data = v.data();
  seen->k_heads = k.extent(1);
  seen->k_rows = k.extent(2);
  seen->k_row_stride = k.stride(2);
}

template <class Storage>
struct Observer16Guard {  // installs the module's 16-bit test seam for one test and always removes it
  explicit Observer16Guard(Observed16<Storage>* seen) {
    qkv::detail::MultiHeadCoreObserver<float, Storage>::callback = &observe16<Storage>;
    qkv::detail::MultiHeadCoreObserver<float, Storage>::context = seen;
  }
  ~Observer16Guard() {
    qkv::detail::MultiHeadCoreObserver<float, Storage>::callback = nullptr;
    qkv::detail::MultiHeadCoreObserver<float, Storage>::context = nullptr;
  }
};

// Each decoding step hands the core the cache's own 16-bit memory (no widened copy), and its output is, bit for bit,
// the float call on the stored values widened to float (qkv::attention's promise for 16-bit K/V), projected by W_o and
// b_o as the module projects: on both backends, through prefill-sized and single-token steps.
TYPED_TEST(Kv16, DecodingReadsTheCacheInPlaceAndIsTheFloatCallBitForBit) {
  using Storage = TypeParam;
  const Index d_model = 64, Hq = 8, Hkv = 2, D = 8, capacity = 40;
  const auto m = random_module<float>(make_config<float>(d_model, Hq, Hkv), 93);
  const Matrix<float> X = random_matrix<float>(capacity, d_model, 94);
  for (const qkv::Backend backend : {qkv::Backend::automatic, qkv::Backend::reference}) {
    SCOPED_TRACE(backend == qkv::Backend::reference ? "reference" : "automatic");
    qkv::AttentionOptions<float> options;
    options.backend = backend;
    auto cache = m.make_cache<Storage>(capacity);
    Observed16<Storage> seen;
    Observer16Guard<Storage> guard(&seen);
    Index t = 0;
    int steps = 0;
    for (const Index n : {Index{17}, Index{1}, Index{1}, Index{5}, Index{1}, Index{15}}) {
      const Matrix<float> Y = m.forward(X.middleRows(t, n), cache, options);
      t += n;
      ASSERT_EQ(seen.calls, ++steps);
      EXPECT_EQ(seen.k_data, cache.keys().data());
      EXPECT_EQ(seen.v_data, cache.values().data());
      EXPECT_EQ(seen.k_heads, Hkv);
      EXPECT_EQ(seen.k_rows, t);
      EXPECT_EQ(seen.k_row_stride, D);
      ASSERT_EQ(seen.Q.rows(), n);

      // The float call on the stored values: K and V widened into dense [1, Hkv, t, D] buffers.
      std::vector<float> keys, values;
      for (Index h = 0; h < Hkv; ++h)
        for (Index j = 0; j < t; ++j)
          for (Index d = 0; d < D; ++d) {
            keys.push_back(static_cast<float>(cache.keys()(0, h, j, d)));
            values.push_back(static_cast<float>(cache.values()(0, h, j, d)));
          }
      qkv::AttentionOptions<float> causal = options;
      causal.causal = true;
      Matrix<float> O(n, Hq * D);
      qkv::attention<float>(qkv::view_bshd(static_cast<const float*>(seen.Q.data()), 1, n, Hq, D),
                            qkv::view_bhsd(static_cast<const float*>(keys.data()), 1, Hkv, t, D),
                            qkv::view_bhsd(static_cast<const float*>(values.data()), 1, Hkv, t, D),
                            qkv::view_bshd(O.data(), 1, n, Hq, D), causal);
      Matrix<float> expected(n, d_model);
      expected.noalias() = O * m.W_o;
      expected.rowwise() += m.b_o.transpose();
      EXPECT_EQ(max_difference(Y, expected.cast<double>()), 0.0) << "step of " << n << " tokens at length " << t;
    }
  }
}

// A 16-bit cache keeps the float cache's errors: a forward past the capacity throws shape_error naming the sizes and
// leaves the cache as it was (also once it is full), a failing attention call after the append is undone, a cache of
// other heads is rejected, and append and the constructor check their arguments.
TYPED_TEST(Kv16, OverflowAndFailedCallsLeaveTheCacheUnchanged) {
  using Storage = TypeParam;
  const auto m = random_module<float>(make_config<float>(16, 2), 95);
  const Matrix<float> X = random_matrix<float>(6, 16, 96);
  auto cache = m.make_cache<Storage>(5);
  m.forward(X.topRows(3), cache);
  expect_shape_error([&] { m.forward(X.middleRows(3, 3), cache); }, {"overflows", "3 of 5", "6 > capacity 5"});
  EXPECT_EQ(cache.length(), 3);
  qkv::AttentionOptions<float> bad;
  bad.scale = std::numeric_limits<float>::quiet_NaN();
  EXPECT_THROW(m.forward(X.row(3), cache, bad), qkv::shape_error);
  EXPECT_EQ(cache.length(), 3);
  const Matrix<float> Y = m.forward(X.middleRows(3, 2), cache);  // fills it
  ASSERT_TRUE(Y.allFinite());
  EXPECT_EQ(cache.length(), 5);
  expect_shape_error([&] { m.forward(X.row(5), cache); },
                     {"qkv::MultiHeadAttention::forward", "overflows", "5 of 5", "6 > capacity 5"});
  EXPECT_EQ(cache.length(), 5);
  auto wrong = qkv::KVCache<float, Storage>(8, 1, 8);
  expect_shape_error([&] { m.forward(X.row(0), wrong); }, {"1 kv heads", "n_kv_heads 2"});
  EXPECT_EQ(wrong.length(), 0);

  qkv::KVCache<float, Storage> direct(2, 2, 3);
  expect_shape_error([&] { direct.append(Matrix<float>(1, 5), Matrix<float>(1, 6)); }, {"K_new", "5", "6"});
  expect_shape_error([&] { direct.append(Matrix<float>(1, 6), Matrix<float>(2, 6)); }, {"V_new", "2", "1"});
  expect_shape_error([&] { direct.append(Matrix<float>::Zero(3, 6), Matrix<float>::Zero(3, 6)); },
                     {"qkv::KVCache::append", "overflows", "0 of 2", "3 > capacity 2"});
  EXPECT_EQ(direct.length(), 0);
  expect_shape_error([] { qkv::KVCache<float, Storage>(-1, 2, 3); }, {"capacity", "-1"});
  expect_shape_error([] { qkv::KVCache<float, Storage>(4, 0, 3); }, {"n_kv_heads", "0"});
  expect_shape_error([&] { m.make_cache<Storage>(-1); }, {"capacity is -1"});
}

}  // namespace
