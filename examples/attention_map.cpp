// Attention maps: an SVG heat map of each head's weights beside the entropy of each of its rows, for a person to look
// at — with the numbers that say how far to trust the picture (seed 000 §2.4.7: weights are a debugging signal, not an
// explanation).
//
// Input: the real pretrained layer of examples/real_layer.cpp — the first transformer block's self-attention of the
// PP-OCRv4 text recogniser (d_model 120, 8 heads of 15) on the 40 tokens of a text-line image reading "attention is
// all you need" (tests/fixtures/, provenance and license in tests/fixtures/README.md). Without those files it falls
// back to seed 000 例 2.4.1, drawn twice: with the 1/√d_k scale and without it (the seed's step (5): sharper rows,
// lower entropy).
//
// It draws, per head (qkv::MultiHeadAttention::attention_weights, qkv::summarize_heads):
//   - the Tq × Tk weights, row i = query token i, column j = key token j, colour scaled to the head's largest weight;
//   - beside each row, a bar of its entropy H_i = −Σ_j p_ij ln p_ij against ln Tk (uniform weights; the dashed line);
//   - in the caption, the mean entropy and the head's ablation: how much the layer's output changes when the head is
//     zeroed (qkv::head_ablation) — how a map looks and how much its head matters are different questions;
// and prints the head summaries, the most correlated pair of heads (qkv::head_redundancy, seed 002 §4.3) and how well
// the head-averaged weights predict the effect of hiding each key (qkv::key_ablation, the seed's check ①).
//
// Usage: attention_map [output.svg] [data directory]
//        (defaults: attention_map.svg in the current directory; tests/fixtures of the source tree this was built from)
// By hand (safetensors.hpp needs nlohmann/json: Debian nlohmann-json3-dev):
//   g++ -std=c++17 -O2 -I include -I /usr/include/eigen3 examples/attention_map.cpp -o attention_map
// The README shows docs/attention_map.svg, written by this program: attention_map docs/attention_map.svg (from the
// repository root).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iostream>
#include <map>
#include <qkv/qkv.hpp>
#include <string>
#include <vector>

#include "safetensors.hpp"

namespace {

using MatrixF = qkv::Matrix<float>;

/// tests/fixtures relative to this source file.
std::string default_data_directory() {
  const std::string file = __FILE__;
  const std::size_t slash = file.find_last_of("/\\");
  return (slash == std::string::npos ? std::string(".") : file.substr(0, slash)) + "/../tests/fixtures";
}

/// A NumPy version-1 .npy file of little-endian float32, C order, two dimensions; false if it is not there or not that.
bool read_npy(const std::string& path, MatrixF& m) {
  std::ifstream in(path, std::ios::binary);
  char magic[10];
  if (!in.read(magic, 10) || std::memcmp(magic, "\x93NUMPY\x01", 7) != 0) return false;
  const std::size_t header_length = static_cast<unsigned char>(magic[8]) | (static_cast<unsigned char>(magic[9]) << 8);
  std::string header(header_length, ' ');
  in.read(&header[0], static_cast<std::streamsize>(header_length));
  const std::size_t shape = header.find("'shape'");
  long rows = 0, cols = 0;
  if (!in || header.find("'<f4'") == std::string::npos || header.find("'fortran_order': False") == std::string::npos ||
      shape == std::string::npos || std::sscanf(header.c_str() + shape, "'shape': (%ld, %ld)", &rows, &cols) != 2)
    return false;
  m.resize(rows, cols);
  return static_cast<bool>(in.read(reinterpret_cast<char*>(m.data()), static_cast<std::streamsize>(m.size() * 4)));
}

/// One panel of the figure.
struct Panel {
  std::string title;
  MatrixF weights;
  qkv::HeadSummary summary;
  Eigen::VectorXf entropy;
  double ablation = -1;  // < 0: not shown
};

/// Viridis, sampled at 5 stops and interpolated linearly: t in [0, 1] → "#rrggbb".
std::string colour(double t) {
  static const double stops[5][3] = {{68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  t = std::min(1.0, std::max(0.0, t)) * 4;
  const int k = std::min(3, static_cast<int>(t));
  const double f = t - k;
  char hex[8];
  std::snprintf(hex, sizeof hex, "#%02x%02x%02x", static_cast<int>(stops[k][0] + f * (stops[k + 1][0] - stops[k][0])),
                static_cast<int>(stops[k][1] + f * (stops[k + 1][1] - stops[k][1])),
                static_cast<int>(stops[k][2] + f * (stops[k + 1][2] - stops[k][2])));
  return hex;
}

/// The heat maps use kLevels + 1 colours: weight / (the panel's largest weight) rounded to a level.
constexpr int kLevels = 48;
int colour_level(double t) { return static_cast<int>(std::lround(std::min(1.0, std::max(0.0, t)) * kLevels)); }

std::string fixed(double x, int decimals) {
  std::ostringstream s;
  s.setf(std::ios::fixed);
  s.precision(decimals);
  s << x;
  return s.str();
}

/// Writes the panels side by side (`columns` per row) as an SVG document.
void write_svg(const std::string& path, const std::string& title, const std::string& subtitle,
               const std::vector<Panel>& panels, int columns) {
  const Eigen::Index Tq = panels[0].weights.rows(), Tk = panels[0].weights.cols();
  const double cell = std::max(4.0, std::min(60.0, 200.0 / static_cast<double>(std::max(Tq, Tk))));
  const bool labels = Tk <= 8;  // print the weights in the cells of a small map
  const double heat_w = cell * static_cast<double>(Tk), heat_h = cell * static_cast<double>(Tq), bars_w = 70;
  const double panel_w = 40 + heat_w + 12 + bars_w + 28, panel_h = 62 + heat_h + 34;
  const int rows = (static_cast<int>(panels.size()) + columns - 1) / columns;
  const double width = 20 + columns * panel_w, height = 70 + rows * panel_h + 10;
  std::ofstream svg(path);
  svg << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
      << "\" viewBox=\"0 0 " << width << " " << height
      << "\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      << "<text x=\"20\" y=\"28\" font-size=\"17\" font-weight=\"bold\">" << title << "</text>\n"
      << "<text x=\"20\" y=\"50\" font-size=\"12\" fill=\"#444\">" << subtitle << "</text>\n";
  for (std::size_t n = 0; n < panels.size(); ++n) {
    const Panel& p = panels[n];
    const double x0 = 20 + static_cast<double>(n % static_cast<std::size_t>(columns)) * panel_w,
                 y0 = 70 + static_cast<double>(n / static_cast<std::size_t>(columns)) * panel_h;
    const double hx = x0 + 40, hy = y0 + 62, bx = hx + heat_w + 12;
    const double peak = std::max(1e-12, static_cast<double>(p.weights.maxCoeff()));
    svg << "<g>\n<text x=\"" << x0 << "\" y=\"" << y0 + 16 << "\" font-size=\"14\" font-weight=\"bold\">" << p.title
        << "</text>\n<text x=\"" << x0 << "\" y=\"" << y0 + 33 << "\" font-size=\"11\">mean entropy "
        << fixed(p.summary.mean_entropy, 2) << " of " << fixed(p.summary.uniform_entropy, 2) << " nats";
    if (p.ablation >= 0) svg << " · ablation " << fixed(100 * p.ablation, 1) << "%";
    svg << "</text>\n<text x=\"" << x0 << "\" y=\"" << y0 + 48 << "\" font-size=\"10\" fill=\"#555\">colour 0 … "
        << fixed(peak, 3) << " · mean max weight " << fixed(p.summary.mean_max_weight, 2) << "</text>\n";
    // Cells in units of one cell (scaled by `cell`), one path per colour level and row runs merged: a compact file.
    std::vector<std::string> paths(kLevels + 1);
    for (Eigen::Index i = 0; i < Tq; ++i)
      for (Eigen::Index j = 0; j < Tk;) {
        const int level = colour_level(p.weights(i, j) / peak);
        Eigen::Index run = 1;
        while (j + run < Tk && colour_level(p.weights(i, j + run) / peak) == level) ++run;
        paths[static_cast<std::size_t>(level)] += "M" + std::to_string(j) + " " + std::to_string(i) + "h" +
                                                  std::to_string(run) + "v1h-" + std::to_string(run) + "z";
        j += run;
      }
    svg << "<g transform=\"translate(" << hx << " " << hy << ") scale(" << cell
        << ")\" shape-rendering=\"crispEdges\">";
    for (int level = 0; level <= kLevels; ++level)
      if (!paths[static_cast<std::size_t>(level)].empty())
        svg << "<path fill=\"" << colour(double(level) / kLevels) << "\" d=\"" << paths[static_cast<std::size_t>(level)]
            << "\"/>";
    svg << "</g>\n";
    if (labels)  // a small map also shows its numbers
      for (Eigen::Index i = 0; i < Tq; ++i)
        for (Eigen::Index j = 0; j < Tk; ++j)
          svg << "<text x=\"" << hx + (static_cast<double>(j) + 0.5) * cell << "\" y=\""
              << hy + (static_cast<double>(i) + 0.5) * cell + 4 << "\" font-size=\"12\" text-anchor=\"middle\" fill=\""
              << (p.weights(i, j) / peak > 0.6 ? "black" : "white") << "\">" << fixed(p.weights(i, j), 3) << "</text>";
    svg << "\n<rect x=\"" << hx << "\" y=\"" << hy << "\" width=\"" << heat_w << "\" height=\"" << heat_h
        << "\" fill=\"none\" stroke=\"#333\" stroke-width=\"0.5\"/>\n"
        << "<text x=\"" << hx + heat_w / 2 << "\" y=\"" << hy + heat_h + 14
        << "\" font-size=\"10\" text-anchor=\"middle\">"
        << "key j →</text>\n"
        << "<text x=\"" << hx - 6 << "\" y=\"" << hy + heat_h / 2 << "\" font-size=\"10\" text-anchor=\"middle\" "
        << "transform=\"rotate(-90 " << hx - 6 << " " << hy + heat_h / 2 << ")\">← query i</text>\n";
    // Row entropies: bar length H_i / ln Tk of the width; the dashed line is ln Tk (uniform weights).
    const double ceiling = std::max(1e-12, p.summary.uniform_entropy);
    for (Eigen::Index i = 0; i < Tq; ++i)
      svg << "<rect x=\"" << bx << "\" y=\"" << hy + static_cast<double>(i) * cell + cell * 0.1 << "\" width=\""
          << bars_w * std::min(1.0, static_cast<double>(p.entropy(i)) / ceiling) << "\" height=\"" << cell * 0.8
          << "\" fill=\"#6b8fb3\"/>";
    svg << "\n<line x1=\"" << bx + bars_w << "\" y1=\"" << hy << "\" x2=\"" << bx + bars_w << "\" y2=\"" << hy + heat_h
        << "\" stroke=\"#c0392b\" stroke-dasharray=\"3,2\"/>\n"
        << "<line x1=\"" << bx << "\" y1=\"" << hy << "\" x2=\"" << bx << "\" y2=\"" << hy + heat_h
        << "\" stroke=\"#333\" stroke-width=\"0.5\"/>\n"
        << "<text x=\"" << bx + bars_w / 2 << "\" y=\"" << hy + heat_h + 14 << "\" font-size=\"10\" "
        << "text-anchor=\"middle\">entropy H_i</text>\n"
        << "<text x=\"" << bx + bars_w << "\" y=\"" << hy - 4 << "\" font-size=\"9\" text-anchor=\"middle\" "
        << "fill=\"#c0392b\">ln " << Tk << "</text>\n</g>\n";
  }
  svg << "</svg>\n";
}

Panel make_panel(const std::string& title, const MatrixF& weights, Eigen::Index head, double ablation) {
  Panel p;
  p.title = title;
  p.weights = weights;
  p.summary = qkv::summarize_weights(weights, head);
  p.entropy = qkv::row_entropy(weights);
  p.ablation = ablation;
  return p;
}

/// Seed 000 例 2.4.1 as a fallback: the weights with the 1/√2 scale and without it.
int worked_example(const std::string& output) {
  MatrixF Q(3, 2);
  Q << 1, 0, 0, 1, 1, 1;  // K = Q
  qkv::AttentionOptions<float> unscaled;
  unscaled.scale = 1.0f;
  std::vector<Panel> panels = {make_panel("scale 1/√2 (as in the seed)", qkv::attention_weights(Q, Q), 0, -1),
                               make_panel("scale 1 (no 1/√d_k)", qkv::attention_weights(Q, Q, unscaled), 1, -1)};
  for (const Panel& p : panels)
    std::cout << p.title << ": mean entropy " << p.summary.mean_entropy << " nats (ln 3 = " << p.summary.uniform_entropy
              << ")\n";
  write_svg(output, "Seed 000, example 2.4.1: Q = K = [1 0; 0 1; 1 1]",
            "Without the 1/√d_k scale the rows are sharper and their entropy lower (seed 000, theorem 2.4.1).", panels,
            2);
  std::cout << "wrote " << output << " (the PP-OCRv4 data was not found: pass its directory as the second argument)\n";
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::string output = argc > 1 ? argv[1] : "attention_map.svg";
  const std::string data = argc > 2 ? argv[2] : default_data_directory();
  MatrixF X;
  safetensors::File file;
  std::string error;
  if (!read_npy(data + "/ppocr_v4_block1_attention_input.npy", X) ||
      !safetensors::try_read(data + "/ppocr_v4_block1_attention.safetensors", file, error) ||
      file.tensors.count("linear_77.w_0") == 0 || file.tensors.count("linear_78.w_0") == 0)
    return worked_example(output);
  const std::map<std::string, MatrixF> fixture = safetensors::to_matrices<MatrixF>(file);  // 1-D: 1 × n rows

  // The layer as the model stores it (see examples/real_layer.cpp): X·W + b, W [in, out], Q | K | V side by side.
  qkv::MultiHeadAttention<float>::Config config;
  config.d_model = 120;
  config.n_heads = 8;
  qkv::MultiHeadAttention<float> attention(config);
  attention.load_fused_qkv(fixture.at("linear_77.w_0"), fixture.at("linear_77.b_0"), fixture.at("linear_78.w_0"),
                           fixture.at("linear_78.b_0"));

  const std::vector<MatrixF> weights = qkv::head_weights(attention, X, X);
  const std::vector<qkv::HeadSummary> summaries = qkv::summarize_heads(attention, X, X);
  const std::vector<double> ablation = qkv::head_ablation(attention, X, X);
  std::vector<Panel> panels;
  std::printf("PP-OCRv4 block 1 self-attention: %td tokens, %td heads of %td\n", X.rows(), attention.n_heads(),
              attention.head_dim());
  std::printf("  head  mean entropy  min entropy  mean max weight  mean |i-j|  ablation   (uniform: ln %td = %.3f)\n",
              X.rows(), summaries[0].uniform_entropy);
  for (std::size_t h = 0; h < weights.size(); ++h) {
    const qkv::HeadSummary& s = summaries[h];
    std::printf("  %4zu  %12.3f  %11.3f  %15.3f  %10.2f  %7.1f%%\n", h, s.mean_entropy, s.min_entropy,
                s.mean_max_weight, s.mean_distance, 100 * ablation[h]);
    panels.push_back(make_panel("head " + std::to_string(h), weights[h], static_cast<Eigen::Index>(h), ablation[h]));
  }

  // Head redundancy (seed 002 §4.3). The seed correlates the maps over a validation set; this example has one real
  // input, so it is the correlation on that input only (pass more inputs to head_redundancy for the real measure).
  const std::vector<MatrixF> inputs = {X};
  const qkv::Matrix<double> C = qkv::head_redundancy(attention, inputs);
  Eigen::Index best_a = 0, best_b = 1;
  for (Eigen::Index a = 0; a < C.rows(); ++a)
    for (Eigen::Index b = a + 1; b < C.cols(); ++b)
      if (C(a, b) > C(best_a, best_b)) {
        best_a = a;
        best_b = b;
      }
  std::cout << "  most similar heads on this input: " << best_a << " and " << best_b << " (weight-map correlation "
            << fixed(C(best_a, best_b), 3) << ")\n";

  // Seed 000 §2.4.7, check ①: hide each key and see whether the output really changes. Compare with the weights
  // averaged over the heads (PyTorch's average_attn_weights): their correlation says how far the map predicts effect.
  const qkv::Matrix<double> effect = qkv::key_ablation(attention, X, X);
  MatrixF mean_weights = MatrixF::Zero(X.rows(), X.rows());
  for (const MatrixF& w : weights) mean_weights += w / static_cast<float>(weights.size());
  const qkv::Matrix<double> r = qkv::head_weight_correlation(
      std::vector<std::vector<qkv::Matrix<double>>>{{mean_weights.cast<double>(), effect}});
  std::cout << "  correlation of the mean weight p_ij with the output change when key j is hidden from query i: "
            << fixed(r(0, 1), 3) << "\n";

  write_svg(output, "PP-OCRv4 text recogniser, block 1 self-attention: 8 heads × 40 tokens",
            "Tokens are image columns of the line “attention is all you need”. Weights are a debugging signal, not an "
            "explanation (seed 000 §2.4.7): compare each map with its ablation.",
            panels, 4);
  std::cout << "wrote " << output << "\n";
  return 0;
}
