// A Llama-style decoder layer around qkv::MultiHeadAttention, with random weights (fixed seed):
//
//     h = x + Attention(RMSNorm(x))       Attention: qkv::MultiHeadAttention, GQA 8 query / 2 kv heads, head_dim 32,
//                                         bias = false, RoPE rotate_half (Config::rope), a KVCache for decoding
//     y = h + MLP(RMSNorm(h))             MLP(z) = (silu(z·W_gate) ⊙ z·W_up)·W_down   (SwiGLU)
//
// RMSNorm, the MLP, the residuals and the embedding are not the module's: they are the few lines of Eigen below.
// The program prefills a 64-token prompt into a KV cache, decodes 32 more tokens one at a time (greedy, over a tied
// embedding), checks the decoded rows against one causal pass over the whole sequence, and prints the time of the
// attention part per decoded token next to the time a plain sum takes to read the cache's K/V bytes once.
//
// Sources: Touvron et al. 2023 (Llama); Zhang & Sennrich 2019 (RMSNorm); Shazeer 2020 (SwiGLU); Su et al. 2021
// (RoPE; Hugging Face Llama's rotate_half); Ainslie et al. 2023 (GQA).
//
// Build and run:   cmake --build <build dir> --target llama_decoder && <build dir>/examples/llama_decoder

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <qkv/qkv.hpp>
#include <random>
#include <vector>

namespace {

using qkv::Index;
using Matrix = qkv::Matrix<float>;
using Vector = Eigen::VectorXf;
using Clock = std::chrono::steady_clock;

constexpr Index kDModel = 256, kHeads = 8, kKvHeads = 2, kHeadDim = 32;
constexpr Index kHidden = 768;  // the MLP's width: 8/3·d_model rounded up to a multiple of 256, as Llama
constexpr Index kVocab = 512, kPrompt = 64, kGenerated = 32;

/// rows × cols draws of N(0, scale²).
Matrix random_matrix(Index rows, Index cols, double scale, std::mt19937& rng) {
  std::normal_distribution<float> normal(0.0f, static_cast<float>(scale));
  return Matrix::NullaryExpr(rows, cols, [&] { return normal(rng); });
}

/// RMSNorm of each row: x / sqrt(mean(x²) + eps) ⊙ weight.
Matrix rms_norm(const Matrix& X, const Vector& weight, float eps = 1e-5f) {
  const Eigen::ArrayXf inverse_rms = (X.array().square().rowwise().mean() + eps).rsqrt();
  return ((X.array().colwise() * inverse_rms).rowwise() * weight.array().transpose()).matrix();
}

struct LlamaLayer {
  qkv::MultiHeadAttention<float> attention;
  Vector attention_norm, mlp_norm;  // RMSNorm weights
  Matrix W_gate, W_up, W_down;      // [in, out], as the module's weights

  /// The layer around `attend`, which runs the attention module on the normed rows (with a cache or causal).
  template <class Attend>
  Matrix forward(const Matrix& X, Attend&& attend) const {
    const Matrix H = X + attend(rms_norm(X, attention_norm));
    const Matrix Z = rms_norm(H, mlp_norm);
    const Matrix gate = Z * W_gate;
    const Matrix silu = (gate.array() / (1.0f + (-gate.array()).exp())).matrix();
    return H + (silu.array() * (Z * W_up).array()).matrix() * W_down;
  }
};

LlamaLayer random_layer(std::mt19937& rng) {
  qkv::MultiHeadAttention<float>::Config config;
  config.d_model = kDModel;
  config.n_heads = kHeads;
  config.n_kv_heads = kKvHeads;
  config.head_dim = kHeadDim;
  config.bias = false;               // Llama's projections have no bias
  config.rope = qkv::RopeOptions{};  // rotate_half, base 10000 (Llama 2; Llama 3 uses base 500000)
  LlamaLayer layer{qkv::MultiHeadAttention<float>(config), {}, {}, {}, {}, {}};
  const auto scaled = [&](Index in, Index out) { return random_matrix(in, out, 1.0 / std::sqrt(double(in)), rng); };
  layer.attention.W_q = scaled(kDModel, kHeads * kHeadDim);
  layer.attention.W_k = scaled(kDModel, kKvHeads * kHeadDim);
  layer.attention.W_v = scaled(kDModel, kKvHeads * kHeadDim);
  layer.attention.W_o = scaled(kHeads * kHeadDim, kDModel);
  layer.attention_norm = Vector::Ones(kDModel) + random_matrix(kDModel, 1, 0.1, rng);
  layer.mlp_norm = Vector::Ones(kDModel) + random_matrix(kDModel, 1, 0.1, rng);
  layer.W_gate = scaled(kDModel, kHidden);
  layer.W_up = scaled(kDModel, kHidden);
  layer.W_down = scaled(kHidden, kDModel);
  return layer;
}

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

volatile float kv_sum;  // where each sum goes, so that the compiler keeps the reads

/// The fastest of 200 plain sums over the cache's filled K and V rows (one streaming read of its K/V bytes).
double kv_read_seconds(const qkv::KVCache<float>& cache) {
  const qkv::TensorView4<const float> keys = cache.keys(), values = cache.values();
  const Index rows = cache.length() * cache.head_dim();  // the filled rows of one kv head are contiguous
  double best = 1e30;
  for (int repeat = 0; repeat < 200; ++repeat) {
    const Clock::time_point start = Clock::now();
    float sum = 0;
    for (Index h = 0; h < cache.n_kv_heads(); ++h) {
      sum += Eigen::Map<const Vector>(keys.data() + h * keys.stride(1), rows).sum();
      sum += Eigen::Map<const Vector>(values.data() + h * values.stride(1), rows).sum();
    }
    kv_sum = sum;
    best = std::min(best, seconds_since(start));
  }
  return best;
}

}  // namespace

int main() {
  std::mt19937 rng(2023);
  const LlamaLayer layer = random_layer(rng);
  const Matrix embedding = random_matrix(kVocab, kDModel, 1.0, rng);  // token id -> row; also the (tied) output head
  std::vector<Index> tokens(kPrompt);
  std::uniform_int_distribution<Index> token(0, kVocab - 1);
  for (Index& t : tokens) t = token(rng);
  const auto embed = [&](Index first, Index count) {
    Matrix X(count, kDModel);
    for (Index t = 0; t < count; ++t) X.row(t) = embedding.row(tokens[static_cast<std::size_t>(first + t)]);
    return X;
  };

  // Prefill: the prompt in one call; the cache keeps its keys (rotated at positions 0 … 63) and values.
  qkv::KVCache<float> cache = layer.attention.make_cache(kPrompt + kGenerated);
  Matrix Y(kPrompt + kGenerated, kDModel);
  Y.topRows(kPrompt) =
      layer.forward(embed(0, kPrompt), [&](const Matrix& Z) { return layer.attention.forward(Z, cache); });

  // Decode: one token at a time at position cache.length(), the next token the best match of the last output.
  std::vector<double> attention_seconds;
  for (Index t = kPrompt; t < kPrompt + kGenerated; ++t) {
    Index next = 0;
    (embedding * Y.row(t - 1).transpose()).maxCoeff(&next);
    tokens.push_back(next);
    Y.row(t) = layer.forward(embed(t, 1), [&](const Matrix& Z) {
      const Clock::time_point start = Clock::now();
      Matrix A = layer.attention.forward(Z, cache);
      attention_seconds.push_back(seconds_since(start));
      return A;
    });
  }

  // Check: one causal pass over all 96 tokens gives the same rows (float rounding only).
  qkv::AttentionOptions<float> causal;
  causal.causal = true;
  const Matrix Y_full = layer.forward(embed(0, kPrompt + kGenerated),
                                      [&](const Matrix& Z) { return layer.attention.forward(Z, causal); });
  const double difference = (Y - Y_full).cwiseAbs().maxCoeff();
  // The module's promise for decoding (docs/design.md), applied to the whole layer: 1e-5·max(1, max|Y|) in float.
  const double bound = 1e-5 * std::max(1.0, double(Y_full.cwiseAbs().maxCoeff()));

  std::sort(attention_seconds.begin(), attention_seconds.end());
  const double read_seconds = kv_read_seconds(cache);
  const qkv::MultiHeadAttention<float>& a = layer.attention;
  const double weight_bytes =
      double((a.W_q.size() + a.W_k.size() + a.W_v.size() + a.W_o.size()) * Index(sizeof(float)));
  const double kv_bytes = 2.0 * double(cache.n_kv_heads() * cache.length() * cache.head_dim() * Index(sizeof(float)));
  std::printf("qkv ISA: %s\n", qkv::isa_name());
  std::printf("Llama-style layer: d_model %ld, heads %ld / kv heads %ld, head_dim %ld, RoPE rotate_half, MLP %ld\n",
              long(kDModel), long(kHeads), long(kKvHeads), long(kHeadDim), long(kHidden));
  std::printf("prefill %ld tokens, then decode %ld tokens one at a time\n", long(kPrompt), long(kGenerated));
  std::printf("max |prefill and decoded rows - one causal pass| = %.3g (bound %.3g)\n", difference, bound);
  std::printf("attention per decoded token (median): %.2f us\n", 1e6 * attention_seconds[attention_seconds.size() / 2]);
  std::printf("K/V bytes read time (%.0f bytes, %ld cached tokens, one plain sum): %.2f us\n", kv_bytes,
              long(cache.length()), 1e6 * read_seconds);
  std::printf("(each decoded token also reads the attention weights once: %.0f bytes)\n", weight_bytes);
  if (!(difference <= bound)) {
    std::printf("FAILED: decoding differs from the causal pass by more than the bound\n");
    return 1;
  }
  return 0;
}
