// fuzz/fuzz_attention.cpp — libFuzzer harness for qkv::attention, the packed Eigen entry point and
// qkv::attention_backward.
//
// Each input decodes into one attention call. A fixed 32-byte header chooses the shape (B ≤ 2, Hq ≤ 4, Hkv ≤ 4
// dividing Hq or not, Sq and Skv 0..24, D and Dv 0..12), the memory layout (BHSD, BSHD, or either with padded
// strides), every `AttentionOptions` field, the backend, how values are drawn and at most one corruption from an
// enumerated list; the bytes after the header place special values (±∞, NaN, denormals, ±0, 1e15) into q, k, v
// and bias. A storage flag (header byte kFieldStorage, bit 3; bit 4 picks bfloat16 over half) rounds k and v to 16 bits
// and runs the call through qkv::attention's 16-bit overloads (issue 16): every oracle then reads the rounded values,
// which are exactly what the 16-bit K/V hold (a value past half's range rounds to ±∞, a tiny one to 0 or a subnormal).
// The harness decides validity itself, from docs/design.md's rules, before calling:
//   - an invalid call (a corruption, Hq % Hkv ≠ 0 or D = 0) must throw qkv::shape_error, nothing else, and leave
//     out and lse untouched;
//   - a valid call must not throw, must write every element of out (and lse) and nothing between them, and:
//       * a row that sees no key is exactly zeros with lse = −∞ (the sink logit with `sinks`);
//       * a row that touches no non-finite input (its q, the k and v of its visible keys, +∞/NaN bias at its
//         visible keys) is finite, and within docs/design.md's accuracy rule of the float64 brute force of
//         tests/brute_force.hpp: fused error ≤ 2 × the error of tests/support/plain_float.hpp + 1e-6·max(1, max|V|),
//         reference error ≤ 1e-6·max(1, max|V|), where the float64 scores fit in float;
//       * NaN or ∞ written into hidden K/V slots (past key_lengths, under allowed = false or a −∞ bias, past the
//         causal diagonal or outside the window) therefore never reaches the output;
//       * with B = 1 in BSHD layout, the packed scaled_dot_product_attention gives the same bits.
// The backward (issue 17): when the mode byte after the special values says so (`enum BackwardByte`), the input also
// calls qkv::attention_backward, on the forward's out and lse with a drawn d_out, outputs in their own layouts and
// at most one corruption of `enum BackwardCorruption` (an invalid forward call is passed on as is and must make the
// backward throw too). It must throw shape_error and write nothing, or succeed: write every gradient element and
// nothing between them, leave the inputs alone, give exactly zero d_q to a row that sees no key and exactly zero d_k,
// d_v to a key that no query sees (poisoned ones included), finite gradients where every input they depend on is
// finite, and, on calls whose every row is finite and well conditioned (scores and gradients: kConditionedBound,
// kCancellation, kGradientCancellation), per gradient an error against a float64 backward ≤ 2 × a plain float
// backward's + 1e-6·max(1, max|g|) (tests/support/plain_backward.hpp, in its two forms). Of the committed inputs
// only the seed_backward_* and regression_backward_* ones call it: the others end before those bytes or have bit 0
// of the mode byte clear.
// A failed check prints what failed and aborts.
//
// Seed corpus: run the harness with QKV_FUZZ_WRITE_SEEDS=<directory> (scripts/fuzz.sh seeds; fuzz/README.md): it
// writes seed_<name>, one input per option value, layout, empty shape and corruption, into the directory and exits.
#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "brute_force.hpp"
#include "qkv/attention.hpp"
#include "qkv/backward.hpp"
#include "qkv/sdpa.hpp"
#include "support/options.hpp"
#include "support/plain_backward.hpp"
#include "support/plain_float.hpp"

namespace {

using qkv::Index;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kOutSentinel = 777.25f;  // fills the gaps of out and lse: the call must not write there

[[noreturn]] void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_attention: CHECK FAILED: %s\n", what.c_str());
  std::fflush(stderr);
  std::abort();
}

/// Reads bytes front to back; 0 once the input is exhausted (so any input decodes).
class ByteReader {
 public:
  ByteReader(const std::uint8_t* data, std::size_t size) : data_(data), size_(size) {}
  std::uint8_t byte() { return position_ < size_ ? data_[position_++] : 0; }
  int below(int n) { return n <= 1 ? 0 : byte() % n; }
  std::uint16_t u16() { return static_cast<std::uint16_t>(byte() << 8 | byte()); }

 private:
  const std::uint8_t* data_;
  std::size_t size_;
  std::size_t position_ = 0;
};

/// splitmix64: the bulk of the values comes from a seed in the header, so small inputs give varied tensors.
class Random {
 public:
  explicit Random(std::uint64_t seed) : state_(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  float uniform() { return static_cast<float>(next() >> 40) * (1.0f / 16777216.0f) * 4.0f - 2.0f; }  // [-2, 2)
  bool chance(int percent) { return static_cast<int>(next() % 100) < percent; }

 private:
  std::uint64_t state_;
};

// ---- the header: one byte per field, read in this order ------------------------------------------------------------
enum Field : int {
  kFieldB,
  kFieldHq,
  kFieldHkv,
  kFieldSq,
  kFieldSkv,
  kFieldD,
  kFieldDv,
  kFieldLayout,
  kFieldScale,
  kFieldSoftcap,
  kFieldCausal,
  kFieldWindowLeft,
  kFieldWindowRight,
  kFieldGlobalTokens,
  kFieldKeyLengths,
  kFieldAllowed,
  kFieldBias,
  kFieldAlibi,
  kFieldSinks,
  kFieldVarlen,
  kFieldBackend,
  kFieldMagnitude,
  kFieldPoison,
  kFieldCorruption,
  kFieldCorruptionParameter,
  kFieldLse,
  kFieldSeed0,
  kFieldSeed1,
  kFieldSeed2,
  kFieldSeed3,
  kFieldSpecials,
  kFieldStorage,  // bit 3: K and V stored in 16 bits; bit 4: bfloat16, else half (other bits unused)
  kHeaderBytes
};

constexpr std::array<float, 12> kSpecialValues = {0.0f,    -0.0f, kInf,   -kInf,  kNaN,     1e-40f,
                                                  -3e-39f, 1e15f, -1e15f, 1e-45f, 65504.0f, -2.5e7f};
constexpr std::array<float, 8> kScales = {0.0f, 0.5f, 1.0f, -1.0f, 1e-3f, 30.0f, 1e3f, 0.125f};  // after "unset"
constexpr std::array<float, 4> kSoftcaps = {1.0f, 5.0f, 30.0f, 1e-3f};                           // after "off"
constexpr std::array<float, 4> kMagnitudes = {1.0f, 1e-20f, 1e5f, 1e15f};

/// How K and V are stored (kFieldStorage). Float is the value 0 of the field, and every committed input whose field
/// is not 0 (regression_out_overlaps_q: 0x03, regression_varlen_dv_zero_reference: 0xe6) has bit 3 clear, so the
/// corpus keeps its meaning.
enum class Storage { float32, half, bfloat16 };

Storage decode_storage(std::uint8_t byte) {
  if ((byte & 0x08) == 0) return Storage::float32;
  return (byte & 0x10) != 0 ? Storage::bfloat16 : Storage::half;
}

const char* storage_name(Storage storage) {
  return storage == Storage::half ? "half" : storage == Storage::bfloat16 ? "bfloat16" : "float";
}

/// x rounded to the storage type and widened back (exactly): the value a 16-bit K/V holds.
float round_to(Storage storage, float x) {
  if (storage == Storage::half) return static_cast<float>(Eigen::half(x));
  if (storage == Storage::bfloat16) return static_cast<float>(Eigen::bfloat16(x));
  return x;
}

/// Corruptions: each makes a valid call invalid by breaking exactly the rule it names (other rules may break too
/// as a consequence, which still means shape_error). 0 = none.
enum Corruption : int {
  kNone,
  kScaleNaN,
  kScaleInfinite,
  kSoftcapNegative,
  kSoftcapNaN,
  kSoftcapInfinite,
  kWindowLeftBelowMinusOne,
  kWindowRightBelowMinusOne,
  kGlobalTokensNegative,
  kKeyLengthsWrongCount,
  kKeyLengthTooLong,
  kKeyLengthNegative,
  kAllowedWrongExtent,
  kBiasWrongExtent,
  kAllowedNegativeStride,
  kBiasInnermostStride,
  kAlibiWrongCount,
  kAlibiNonFinite,
  kSinksWrongCount,
  kSinksNaNOrPlusInfinity,
  kCuSeqlensFirstNotZero,
  kCuSeqlensDecreasing,
  kCuSeqlensLastNotRows,
  kCuSeqlensSizesDiffer,
  kCuSeqlensOnlyOne,
  kCuSeqlensWithKeyLengths,
  kCuSeqlensWithAllowed,
  kCuSeqlensWithBias,
  kCuSeqlensBatchNotOne,
  kKBatchMismatch,
  kKHeadDimMismatch,
  kVSequenceMismatch,
  kVHeadsMismatch,
  kOutWrongExtent,
  kOutOverlapsQ,
  kOutSelfOverlap,
  kQInnermostStride,
  kKNegativeStride,
  kQNullData,
  kLseWrongExtent,
  kLseOverlapsOut,
  kCorruptionCount
};

/// The bytes after the special values that drive the backward call (issue 17), in this order.
enum BackwardByte : int {
  kBackwardMode,        // bit 0: call attention_backward; bit 1: request d_bias; bit 2: request d_sinks;
                        // bit 3: a non-finite d_out element (bit 4: +∞, else NaN) at a position from the parameter
  kBackwardCorruption,  // % 3 == 2: one corruption of `enum BackwardCorruption`, else none
  kBackwardParameter,   // the corruption's parameter (an axis, a value) and the non-finite d_out element's position
  kBackwardLayout,      // bits 0..3: layout of d_q, d_k, d_v (as kFieldLayout); bits 4..7: layout of d_out
  kBackwardBytes
};

/// A strided 4-D tensor in its own buffer; logical elements are also kept dense ([B, H, S, D]) for the oracles.
struct Tensor4 {
  std::array<Index, 4> extents{};
  std::array<Index, 4> strides{};
  std::vector<float> buffer;  // the memory the view describes, gaps included
  std::vector<float> dense;   // logical values, dense row-major

  Index size() const { return extents[0] * extents[1] * extents[2] * extents[3]; }
  Index dense_index(Index b, Index h, Index s, Index d) const {
    return ((b * extents[1] + h) * extents[2] + s) * extents[3] + d;
  }
  Index offset(Index b, Index h, Index s, Index d) const {
    return b * strides[0] + h * strides[1] + s * strides[2] + d * strides[3];
  }
};

/// Lays out [B, H, S, D] as BHSD or BSHD (layout bit 0), with gaps of 1..3 elements after each row, head and batch
/// block when layout bit 1 is set. Gaps are filled with `gap_value`.
void make_layout(Tensor4& t, std::array<Index, 4> extents, int layout, float gap_value) {
  t.extents = extents;
  const Index H = extents[1], S = extents[2], D = extents[3];
  const Index pad = (layout & 2) ? 1 + (layout >> 2) % 3 : 0;
  const Index row = D + pad;
  if ((layout & 1) == 0) {  // BHSD
    const Index head = S * row + pad;
    t.strides = {H * head + pad, head, row, 1};
  } else {  // BSHD
    const Index token = H * row + pad;
    t.strides = {S * token + pad, row, token, 1};
  }
  Index span = 0;
  if (t.size() > 0) {
    for (int axis = 0; axis < 4; ++axis) span += (extents[axis] - 1) * t.strides[axis];
    span += 1;
  }
  t.buffer.assign(static_cast<std::size_t>(span), gap_value);
  t.dense.assign(static_cast<std::size_t>(t.size()), 0.0f);
}

/// Every element of `x` converted to S.
template <class S>
std::vector<S> converted(const std::vector<float>& x) {
  std::vector<S> result(x.size());
  for (std::size_t n = 0; n < x.size(); ++n) result[n] = S(x[n]);
  return result;
}

void scatter(Tensor4& t) {
  for (Index b = 0; b < t.extents[0]; ++b)
    for (Index h = 0; h < t.extents[1]; ++h)
      for (Index s = 0; s < t.extents[2]; ++s)
        for (Index d = 0; d < t.extents[3]; ++d)
          t.buffer[static_cast<std::size_t>(t.offset(b, h, s, d))] =
              t.dense[static_cast<std::size_t>(t.dense_index(b, h, s, d))];
}

/// A broadcastable mask tensor ([B or 1, Hq or 1, Sq or 1, Skv]) for `allowed` or `bias`, in its own buffer with
/// optional gaps. The view gives extent-1 axes a huge stride, which the library must ignore (ASan would report a
/// read through it).
template <class M>
struct MaskTensor {
  std::array<Index, 4> extents{};
  std::array<Index, 4> strides{};  // the view's
  std::array<Index, 4> real{};     // where the elements are
  std::unique_ptr<M[]> buffer;
  std::size_t buffer_size = 0;
  std::vector<M> dense;

  void make(std::array<Index, 4> shape, bool padded, M gap_value) {
    extents = shape;
    const Index pad = padded ? 2 : 0;
    real[3] = 1;
    real[2] = extents[3] + pad;
    real[1] = extents[2] * real[2] + pad;
    real[0] = extents[1] * real[1] + pad;
    Index span = 1, count = 1;
    for (int axis = 0; axis < 4; ++axis) {
      count *= extents[axis];
      if (extents[axis] > 0) span += (extents[axis] - 1) * real[axis];
    }
    buffer_size = static_cast<std::size_t>(count > 0 ? span : 0);
    buffer.reset(new M[buffer_size > 0 ? buffer_size : 1]);
    std::fill(buffer.get(), buffer.get() + buffer_size, gap_value);
    dense.assign(static_cast<std::size_t>(count), M());
    strides = real;
    for (int axis = 0; axis < 3; ++axis) {
      if (extents[axis] == 1) strides[axis] = Index(1) << 24;
    }
  }
  Index dense_index(Index b, Index h, Index i, Index j) const {
    return ((b * extents[1] + h) * extents[2] + i) * extents[3] + j;
  }
  void set(Index b, Index h, Index i, Index j, M value) {
    dense[static_cast<std::size_t>(dense_index(b, h, i, j))] = value;
    buffer[static_cast<std::size_t>(b * real[0] + h * real[1] + i * real[2] + j * real[3])] = value;
  }
  /// The element query (b, h, i) sees at key j, broadcasting extent-1 axes.
  M at(Index b, Index h, Index i, Index j) const {
    return dense[static_cast<std::size_t>(
        dense_index(extents[0] == 1 ? 0 : b, extents[1] == 1 ? 0 : h, extents[2] == 1 ? 0 : i, j))];
  }
  qkv::TensorView4<const M> view() const { return qkv::TensorView4<const M>(buffer.get(), extents, strides); }
};

/// Everything one input decodes into.
struct Call {
  std::array<std::uint8_t, kHeaderBytes> header{};
  Index B = 1, Hq = 1, Hkv = 1, Sq = 0, Skv = 0, D = 1, Dv = 1;  // B is the views' batch extent (1 with varlen)
  int layout = 0;
  bool want_lse = false;
  Tensor4 q, k, v, out;
  std::vector<float> lse_buffer;
  std::array<Index, 3> lse_strides{};
  bool has_allowed = false, has_bias = false;
  MaskTensor<bool> allowed;
  MaskTensor<float> bias;
  qkv::AttentionOptions<float> options;
  // The views handed to the library (a corruption may change them).
  qkv::TensorView4<const float> q_view, k_view, v_view;
  qkv::TensorView4<float> out_view;
  qkv::TensorView3<float> lse_view;
  MaskTensor<bool> corrupt_allowed;  // storage a corruption may need
  MaskTensor<float> corrupt_bias;
  int corruption = kNone;
  bool shape_valid = true;  // Hq % Hkv == 0 and D ≥ 1
  Storage storage = Storage::float32;
  // With 16-bit storage: k's and v's buffers (gaps included) converted, exactly, from the rounded float buffers.
  std::vector<Eigen::half> k_half, v_half;
  std::vector<Eigen::bfloat16> k_bfloat16, v_bfloat16;
  // The backward (issue 17): the bytes after the special values (fuzz/README.md, "The backward"); all 0 (no backward
  // call) in an input that ends before them.
  std::array<std::uint8_t, kBackwardBytes> backward{};
};

Index decode_length(std::uint8_t byte) {
  // 0..24, with small and tile-boundary lengths weighted up; byte 0 gives 7.
  static constexpr std::array<Index, 32> kLengths = {7,  0,  1,  2,  3,  4,  5,  6,  8,  8,  9,  10, 11, 12, 13, 14,
                                                     15, 16, 16, 17, 18, 19, 20, 21, 22, 23, 24, 1,  2,  3,  5,  7};
  return kLengths[byte % kLengths.size()];
}

/// Splits `total` rows into `n` sequences (some may be empty).
std::vector<Index> split_rows(Index total, Index n, Random& random) {
  std::vector<Index> cuts;
  for (Index s = 0; s + 1 < n; ++s)
    cuts.push_back(static_cast<Index>(random.next() % static_cast<std::uint64_t>(total + 1)));
  std::sort(cuts.begin(), cuts.end());
  std::vector<Index> cu = {0};
  for (Index cut : cuts) cu.push_back(cut);
  cu.push_back(total);
  return cu;
}

/// The call as brute::Params (support/options.hpp): shapes and options, for the oracles.
brute::Params call_params(const Call& c) {
  return qkv_test::to_brute(c.options, {c.B, c.Hq, c.Hkv, c.Sq, c.Skv, c.D, c.Dv});
}

/// One (sequence, query head, query row) of a valid call: the sequence (brute::Sequence: its batch entry b, first
/// rows q0 and k0, query and key counts sq and skv), the head, the row i of the sequence and row = q0 + i of the views.
struct RowPlace {
  brute::Sequence s;
  Index h = 0, i = 0, row = 0;
};

template <class F>
void for_each_row(const brute::Params& params, F&& visit) {
  RowPlace p;
  for (const brute::Sequence& s : brute::sequences(params)) {
    p.s = s;
    for (p.h = 0; p.h < params.Hq; ++p.h) {
      for (p.i = 0; p.i < s.sq; ++p.i) {
        p.row = s.q0 + p.i;
        visit(p);
      }
    }
  }
}

/// docs/design.md's index and data rules (everything but a −∞ score): may query p see key j of its sequence?
bool rule_visible(const brute::Params& params, const RowPlace& p, Index j) {
  return brute::visible(params, p.s, p.h, p.i, j);
}

// ---- decoding ------------------------------------------------------------------------------------------------------

void fill_tensor(Tensor4& t, Random& random, float magnitude) {
  for (float& x : t.dense) x = random.uniform() * magnitude;
}

void make_lse(Call& c, bool padded) {
  const Index pad = padded ? 1 : 0;
  c.lse_strides = {c.Hq * (c.Sq + pad), c.Sq + pad, 1};
  const Index count = c.B * c.Hq * c.Sq;
  const std::size_t span =
      count > 0 ? static_cast<std::size_t>((c.B - 1) * c.lse_strides[0] + (c.Hq - 1) * c.lse_strides[1] + c.Sq) : 0;
  c.lse_buffer.assign(span, kOutSentinel);
  for (Index b = 0; b < c.B; ++b)
    for (Index h = 0; h < c.Hq; ++h)
      for (Index i = 0; i < c.Sq; ++i)
        c.lse_buffer[static_cast<std::size_t>(b * c.lse_strides[0] + h * c.lse_strides[1] + i)] = kNaN;
}

void decode(const std::uint8_t* data, std::size_t size, Call& c) {
  ByteReader reader(data, size);
  for (auto& byte : c.header) byte = reader.byte();
  const auto& h = c.header;
  Random random(static_cast<std::uint64_t>(h[kFieldSeed0]) | static_cast<std::uint64_t>(h[kFieldSeed1]) << 8 |
                static_cast<std::uint64_t>(h[kFieldSeed2]) << 16 | static_cast<std::uint64_t>(h[kFieldSeed3]) << 24);
  auto& o = c.options;

  // Shape.
  static constexpr std::array<Index, 9> kBatches = {1, 2, 1, 2, 1, 2, 1, 2, 0};
  static constexpr std::array<Index, 9> kQueryHeads = {1, 2, 3, 4, 2, 4, 4, 1, 0};
  c.B = kBatches[h[kFieldB] % 9];
  c.Hq = kQueryHeads[h[kFieldHq] % 9];
  c.Hkv = 1 + h[kFieldHkv] % 4;
  if ((h[kFieldHkv] / 4) % 2 == 0) {  // mostly a divisor of Hq; otherwise whatever was drawn (GQA error)
    while (c.Hq > 0 && c.Hq % c.Hkv != 0) --c.Hkv;
  }
  c.Sq = decode_length(h[kFieldSq]);
  c.Skv = decode_length(h[kFieldSkv]);
  c.D = h[kFieldD] % 25 == 24 ? 0 : 1 + h[kFieldD] % 12;
  c.Dv = (h[kFieldDv] + 1) % 13;
  c.layout = h[kFieldLayout] % 12;
  c.shape_valid = c.D >= 1 && c.Hq % c.Hkv == 0;

  // Varlen: 1..3 sequences over the rows of a batch-1 view.
  const int n_sequences = h[kFieldVarlen] % 8 < 5 ? 0 : h[kFieldVarlen] % 8 - 4;
  if (n_sequences > 0) {
    c.B = 1;
    o.cu_seqlens_q = split_rows(c.Sq, n_sequences, random);
    o.cu_seqlens_k = split_rows(c.Skv, n_sequences, random);
  }

  // Scalar options.
  if (h[kFieldScale] % 9 != 0) o.scale = kScales[h[kFieldScale] % 9 - 1];
  if (h[kFieldSoftcap] % 5 != 0) o.softcap = kSoftcaps[h[kFieldSoftcap] % 5 - 1];
  o.causal = (h[kFieldCausal] & 1) != 0;
  if (h[kFieldCausal] & 2) o.alignment = qkv::CausalAlignment::top_left;
  o.window_left = h[kFieldWindowLeft] % 2 == 0 ? -1 : (h[kFieldWindowLeft] / 2) % 10 - 1;
  o.window_right = h[kFieldWindowRight] % 2 == 0 ? -1 : (h[kFieldWindowRight] / 2) % 10 - 1;
  o.global_tokens = h[kFieldGlobalTokens] % 2 == 0 ? 0 : (h[kFieldGlobalTokens] / 2) % 30;
  static constexpr std::array<qkv::Backend, 3> kBackends = {qkv::Backend::automatic, qkv::Backend::fused,
                                                            qkv::Backend::reference};
  o.backend = kBackends[h[kFieldBackend] % 3];
  if (h[kFieldKeyLengths] % 2 == 1 && n_sequences == 0) {
    for (Index b = 0; b < c.B; ++b) {
      // Half the time the full length, else anything in [0, Skv].
      o.key_lengths.push_back(
          random.chance(30) ? c.Skv : static_cast<Index>(random.next() % static_cast<std::uint64_t>(c.Skv + 1)));
    }
  }
  static constexpr std::array<float, 6> kSlopes = {0.0f, 0.5f, 0.0625f, -0.25f, 2.0f, 1e3f};
  if (h[kFieldAlibi] % 3 == 1) {
    for (Index q_head = 0; q_head < c.Hq; ++q_head) o.alibi_slopes.push_back(kSlopes[random.next() % kSlopes.size()]);
  }
  static constexpr std::array<float, 6> kSinks = {-kInf, 0.0f, 1.0f, -2.0f, 5.0f, 30.0f};
  if (h[kFieldSinks] % 3 == 1) {
    for (Index q_head = 0; q_head < c.Hq; ++q_head) o.sinks.push_back(kSinks[random.next() % kSinks.size()]);
  }

  // Tensors.
  const int layout_out = (c.layout + h[kFieldLse] / 2) % 12;
  make_layout(c.q, {c.B, c.Hq, c.Sq, c.D}, c.layout, kNaN);
  make_layout(c.k, {c.B, c.Hkv, c.Skv, c.D}, c.layout, kNaN);
  make_layout(c.v, {c.B, c.Hkv, c.Skv, c.Dv}, c.layout, kNaN);
  make_layout(c.out, {c.B, c.Hq, c.Sq, c.Dv}, layout_out, kOutSentinel);
  const int magnitude = h[kFieldMagnitude];
  fill_tensor(c.q, random, magnitude < 128 ? 1.0f : kMagnitudes[magnitude & 3]);
  fill_tensor(c.k, random, magnitude < 128 ? 1.0f : kMagnitudes[(magnitude >> 2) & 3]);
  fill_tensor(c.v, random, magnitude < 128 ? 1.0f : kMagnitudes[(magnitude >> 4) & 3]);
  std::fill(c.out.dense.begin(), c.out.dense.end(), kNaN);  // every element must be written
  c.want_lse = h[kFieldLse] % 2 == 1;
  make_lse(c, (h[kFieldLse] & 4) != 0);

  // allowed and bias: bits 0..2 broadcast the B, Hq, Sq axes; bits 5..6 the density of false / −∞.
  const bool padded_masks = (c.layout & 2) != 0;
  if (h[kFieldAllowed] % 3 == 1 && n_sequences == 0) {
    c.has_allowed = true;
    const int bits = h[kFieldAllowed] >> 2;
    c.allowed.make({bits & 1 ? 1 : c.B, bits & 2 ? 1 : c.Hq, bits & 4 ? 1 : c.Sq, c.Skv}, padded_masks, false);
    static constexpr std::array<int, 4> kFalse = {10, 40, 70, 100};
    const int percent_false = kFalse[(bits >> 3) & 3];
    const auto& e = c.allowed.extents;
    for (Index b = 0; b < e[0]; ++b)
      for (Index q_head = 0; q_head < e[1]; ++q_head)
        for (Index i = 0; i < e[2]; ++i)
          for (Index j = 0; j < e[3]; ++j) c.allowed.set(b, q_head, i, j, !random.chance(percent_false));
  }
  if (h[kFieldBias] % 3 == 1 && n_sequences == 0) {
    c.has_bias = true;
    const int bits = h[kFieldBias] >> 2;
    c.bias.make({bits & 1 ? 1 : c.B, bits & 2 ? 1 : c.Hq, bits & 4 ? 1 : c.Sq, c.Skv}, padded_masks, kNaN);
    static constexpr std::array<int, 4> kMinusInf = {0, 15, 50, 95};
    static constexpr std::array<float, 4> kBiasMagnitudes = {1.0f, 4.0f, 1e3f, 1e15f};
    const int percent_hidden = kMinusInf[(bits >> 3) & 3];
    const float bias_magnitude = kBiasMagnitudes[(bits >> 5) & 1 ? 2 + (bits & 1) : 0];
    const auto& e = c.bias.extents;
    for (Index b = 0; b < e[0]; ++b)
      for (Index q_head = 0; q_head < e[1]; ++q_head)
        for (Index i = 0; i < e[2]; ++i)
          for (Index j = 0; j < e[3]; ++j)
            c.bias.set(b, q_head, i, j, random.chance(percent_hidden) ? -kInf : random.uniform() * bias_magnitude);
  }

  // Special values at positions the input chooses: (tensor, position, value) triples after the header.
  const int n_specials = h[kFieldSpecials] % 32;
  for (int n = 0; n < n_specials; ++n) {
    const int tensor = reader.below(4);
    const std::uint16_t position = reader.u16();
    const float value = kSpecialValues[reader.byte() % kSpecialValues.size()];
    if (tensor < 3) {
      Tensor4& t = tensor == 0 ? c.q : tensor == 1 ? c.k : c.v;
      if (!t.dense.empty()) t.dense[position % t.dense.size()] = value;
    } else if (c.has_bias && !c.bias.dense.empty()) {
      const std::size_t at = position % c.bias.dense.size();
      const auto& e = c.bias.extents;
      const Index j = static_cast<Index>(at) % e[3], i = static_cast<Index>(at) / e[3] % e[2];
      const Index q_head = static_cast<Index>(at) / (e[3] * e[2]) % e[1],
                  b = static_cast<Index>(at) / (e[3] * e[2] * e[1]);
      c.bias.set(b, q_head, i, j, value);
    }
  }

  for (auto& byte : c.backward) byte = reader.byte();  // after every byte the forward reads: its meaning is unchanged

  if (c.has_allowed) o.allowed = c.allowed.view();
  if (c.has_bias) o.bias = c.bias.view();

  // Poison: NaN or ±∞ in every K/V slot that no query of its group may see (past key_lengths, under allowed =
  // false or a −∞ bias, outside every causal/window band); docs/design.md says they cannot reach the output.
  if (h[kFieldPoison] % 2 == 1 && c.shape_valid) {
    static constexpr std::array<float, 3> kPoison = {kNaN, kInf, -kInf};
    const float poison = kPoison[(h[kFieldPoison] / 2) % 3];
    const Index group = c.Hq / c.Hkv;
    const brute::Params params = call_params(c);
    std::vector<char> seen(static_cast<std::size_t>(c.B * c.Hkv * c.Skv), 0);
    for_each_row(params, [&](const RowPlace& p) {
      for (Index j = 0; j < p.s.skv; ++j) {
        if (rule_visible(params, p, j))
          seen[static_cast<std::size_t>((p.s.b * c.Hkv + p.h / group) * c.Skv + p.s.k0 + j)] = 1;
      }
    });
    for (Index b = 0; b < c.B; ++b)
      for (Index h_kv = 0; h_kv < c.Hkv; ++h_kv)
        for (Index j = 0; j < c.Skv; ++j) {
          if (seen[static_cast<std::size_t>((b * c.Hkv + h_kv) * c.Skv + j)]) continue;
          for (Index d = 0; d < c.D; ++d) c.k.dense[static_cast<std::size_t>(c.k.dense_index(b, h_kv, j, d))] = poison;
          for (Index d = 0; d < c.Dv; ++d) c.v.dense[static_cast<std::size_t>(c.v.dense_index(b, h_kv, j, d))] = poison;
        }
  }

  // 16-bit storage: k and v rounded (after the special values and the poison, which round too); the oracles read
  // these rounded values, the call reads the same values in 16 bits.
  c.storage = decode_storage(h[kFieldStorage]);
  if (c.storage != Storage::float32) {
    for (float& x : c.k.dense) x = round_to(c.storage, x);
    for (float& x : c.v.dense) x = round_to(c.storage, x);
  }

  scatter(c.q);
  scatter(c.k);
  scatter(c.v);
  scatter(c.out);
  // The 16-bit buffers: exact conversions (the elements are rounded, the gaps NaN).
  if (c.storage == Storage::half) {
    c.k_half = converted<Eigen::half>(c.k.buffer);
    c.v_half = converted<Eigen::half>(c.v.buffer);
  } else if (c.storage == Storage::bfloat16) {
    c.k_bfloat16 = converted<Eigen::bfloat16>(c.k.buffer);
    c.v_bfloat16 = converted<Eigen::bfloat16>(c.v.buffer);
  }
  c.q_view = qkv::TensorView4<const float>(c.q.buffer.data(), c.q.extents, c.q.strides);
  c.k_view = qkv::TensorView4<const float>(c.k.buffer.data(), c.k.extents, c.k.strides);
  c.v_view = qkv::TensorView4<const float>(c.v.buffer.data(), c.v.extents, c.v.strides);
  c.out_view = qkv::TensorView4<float>(c.out.buffer.data(), c.out.extents, c.out.strides);
  c.lse_view = qkv::TensorView3<float>(c.lse_buffer.data(), {c.B, c.Hq, c.Sq}, c.lse_strides);
  c.corruption = h[kFieldCorruption] % 3 == 2 ? 1 + (h[kFieldCorruption] / 3) % (kCorruptionCount - 1) : kNone;
}

// ---- corruptions ---------------------------------------------------------------------------------------------------

/// `view` with the extent of `axis` replaced (same data and strides).
template <class View>
View with_extent(const View& view, int axis, Index extent) {
  auto extents = view.extents();
  extents[static_cast<std::size_t>(axis)] = extent;
  return View(view.data(), extents, view.strides());
}

/// `view` with the stride of `axis` replaced (same data and extents).
template <class View>
View with_stride(const View& view, int axis, Index stride) {
  auto strides = view.strides();
  strides[static_cast<std::size_t>(axis)] = stride;
  return View(view.data(), view.extents(), strides);
}

/// `view` over other data (same extents and strides).
template <class View>
View with_data(const View& view, decltype(view.data()) data) {
  return View(data, view.extents(), view.strides());
}

/// Applies c.corruption; returns the corruption applied (kScaleNaN when the drawn one needs elements that this
/// shape does not have).
int corrupt(Call& c) {
  auto& o = c.options;
  const int parameter = c.header[kFieldCorruptionParameter];
  const bool out_nonempty = c.out_view.size() > 0, q_nonempty = c.q_view.size() > 0;
  const bool lse_nonempty = c.B * c.Hq * c.Sq > 0;
  const std::array<Index, 4> full_mask = {c.B, c.Hq, c.Sq, c.Skv};
  auto valid_cu = [&]() {
    if (o.cu_seqlens_q.empty()) {
      o.cu_seqlens_q = {0, c.Sq};
      o.cu_seqlens_k = {0, c.Skv};
    }
  };
  switch (c.corruption) {
    case kScaleNaN:
      o.scale = kNaN;
      break;
    case kScaleInfinite:
      o.scale = parameter % 2 ? kInf : -kInf;
      break;
    case kSoftcapNegative:
      o.softcap = -0.5f - static_cast<float>(parameter % 4);
      break;
    case kSoftcapNaN:
      o.softcap = kNaN;
      break;
    case kSoftcapInfinite:
      o.softcap = kInf;
      break;
    case kWindowLeftBelowMinusOne:
      o.window_left = -2 - parameter % 5;
      break;
    case kWindowRightBelowMinusOne:
      o.window_right = -2 - parameter % 5;
      break;
    case kGlobalTokensNegative:
      o.global_tokens = -1 - parameter % 3;
      break;
    case kKeyLengthsWrongCount:
      o.key_lengths.assign(static_cast<std::size_t>(c.B == 2 && parameter % 2 ? 1 : c.B + 1), 0);
      break;
    case kKeyLengthTooLong:
    case kKeyLengthNegative: {
      o.key_lengths.assign(static_cast<std::size_t>(std::max<Index>(c.B, 1)), c.Skv);
      o.key_lengths[static_cast<std::size_t>(parameter) % o.key_lengths.size()] =
          c.corruption == kKeyLengthTooLong ? c.Skv + 1 + parameter % 3 : -1 - parameter % 2;
      break;
    }
    case kAllowedWrongExtent:
    case kBiasWrongExtent: {
      std::array<Index, 4> shape = full_mask;
      const int axis = parameter % 4;
      shape[axis] = axis < 3 ? shape[axis] + 2 : shape[axis] + 1;  // neither the expected extent nor 1
      if (c.corruption == kAllowedWrongExtent) {
        c.corrupt_allowed.make(shape, false, true);
        o.allowed = c.corrupt_allowed.view();
      } else {
        c.corrupt_bias.make(shape, false, 0.0f);
        o.bias = c.corrupt_bias.view();
      }
      break;
    }
    case kAllowedNegativeStride: {
      c.corrupt_allowed.make(full_mask, false, true);
      auto strides = c.corrupt_allowed.strides;
      strides[parameter % 4] = -1 - parameter % 3;
      o.allowed = qkv::TensorView4<const bool>(c.corrupt_allowed.buffer.get(), full_mask, strides);
      break;
    }
    case kBiasInnermostStride: {
      c.corrupt_bias.make({full_mask[0], full_mask[1], full_mask[2], 2 * c.Skv}, false, 0.0f);
      auto strides = c.corrupt_bias.strides;
      strides[3] = c.Skv >= 2 ? 2 : -1;
      o.bias = qkv::TensorView4<const float>(c.corrupt_bias.buffer.get(), full_mask, strides);
      break;
    }
    case kAlibiWrongCount:
      o.alibi_slopes.assign(static_cast<std::size_t>(c.Hq + 1 + parameter % 2), 0.5f);
      break;
    case kSinksWrongCount:
      o.sinks.assign(static_cast<std::size_t>(c.Hq + 1 + parameter % 2), 0.0f);
      break;
    case kAlibiNonFinite:
    case kSinksNaNOrPlusInfinity: {
      auto& values = c.corruption == kAlibiNonFinite ? o.alibi_slopes : o.sinks;
      values.assign(static_cast<std::size_t>(std::max<Index>(c.Hq, 1)), 0.25f);
      static constexpr std::array<float, 3> kBad = {kNaN, kInf, -kInf};  // −∞ is a valid sink: not drawn for sinks
      values[static_cast<std::size_t>(parameter) % values.size()] =
          kBad[static_cast<std::size_t>(parameter / 4) % (c.corruption == kAlibiNonFinite ? 3 : 2)];
      break;
    }
    case kCuSeqlensFirstNotZero:
      valid_cu();
      o.cu_seqlens_q[0] = 1 + parameter % 2;
      break;
    case kCuSeqlensDecreasing:
      valid_cu();
      o.cu_seqlens_q = {0, c.Sq + 1, c.Sq};
      o.cu_seqlens_k = {0, c.Skv, c.Skv};
      break;
    case kCuSeqlensLastNotRows:
      valid_cu();
      o.cu_seqlens_k.back() += 1 + parameter % 2;
      break;
    case kCuSeqlensSizesDiffer:
      valid_cu();
      o.cu_seqlens_k.push_back(o.cu_seqlens_k.back());
      break;
    case kCuSeqlensOnlyOne:
      valid_cu();
      (parameter % 2 ? o.cu_seqlens_q : o.cu_seqlens_k).clear();
      break;
    case kCuSeqlensWithKeyLengths:
      valid_cu();
      o.key_lengths.assign(1, c.Skv);
      break;
    case kCuSeqlensWithAllowed:
      valid_cu();
      c.corrupt_allowed.make({1, c.Hq, c.Sq, c.Skv}, false, true);
      o.allowed = c.corrupt_allowed.view();
      break;
    case kCuSeqlensWithBias:
      valid_cu();
      c.corrupt_bias.make({1, c.Hq, c.Sq, c.Skv}, false, 0.0f);
      o.bias = c.corrupt_bias.view();
      break;
    case kCuSeqlensBatchNotOne: {
      valid_cu();
      if (c.B != 2) {
        c.q_view = with_extent(c.q_view, 0, 2);
        c.k_view = with_extent(c.k_view, 0, 2);
        c.v_view = with_extent(c.v_view, 0, 2);
        c.out_view = with_extent(c.out_view, 0, 2);
      }
      break;
    }
    case kKBatchMismatch:
    case kKHeadDimMismatch:
    case kVSequenceMismatch:
    case kVHeadsMismatch: {
      auto& view = c.corruption == kKBatchMismatch || c.corruption == kKHeadDimMismatch ? c.k_view : c.v_view;
      const int axis = c.corruption == kKBatchMismatch      ? 0
                       : c.corruption == kKHeadDimMismatch  ? 3
                       : c.corruption == kVSequenceMismatch ? 2
                                                            : 1;
      view = with_extent(view, axis, view.extent(axis) + 1);
      break;
    }
    case kOutWrongExtent:
      c.out_view = with_extent(c.out_view, parameter % 4, c.out_view.extent(parameter % 4) + 1);
      break;
    case kOutOverlapsQ:
      if (!out_nonempty || !q_nonempty) return kScaleNaN;
      // out starts at q's first element: both non-empty, so they overlap whatever the shapes.
      c.out_view = with_data(c.out_view, c.q.buffer.data());
      break;
    case kOutSelfOverlap:
      if (!out_nonempty || c.Sq < 2) return kScaleNaN;
      c.out_view = with_stride(c.out_view, 2, 0);
      break;
    case kQInnermostStride:
      c.q_view = c.D >= 2 ? with_stride(c.q_view, 3, 2) : with_stride(c.q_view, parameter % 4, -1);
      break;
    case kKNegativeStride:
      c.k_view = with_stride(c.k_view, parameter % 4, -1 - parameter % 5);
      break;
    case kQNullData:
      if (!q_nonempty) return kScaleNaN;
      c.q_view = with_data(c.q_view, nullptr);
      break;
    case kLseWrongExtent:
      c.want_lse = true;
      c.lse_view = with_extent(c.lse_view, parameter % 3, c.lse_view.extent(parameter % 3) + 1);
      break;
    case kLseOverlapsOut:
      if (!lse_nonempty || !out_nonempty) return kScaleNaN;
      c.want_lse = true;
      c.lse_view = with_data(c.lse_view, c.out.buffer.data());
      break;
    default:
      break;
  }
  return c.corruption;
}

// ---- the oracles ---------------------------------------------------------------------------------------------------

/// What the harness knows about one query row of a valid call.
struct RowFacts {
  bool any_visible = false;  // some key survives every rule, −∞ scores included
  bool tainted = false;      // touches a non-finite q, visible k or v, or a +∞/NaN bias: may be NaN
  bool fits = true;          // the finite parts of its float64 scores fit in float
  double max_abs_v = 0;      // over its visible keys
  double max_bound = 0;      // the largest Σ|q_d·k_d|·|scale| + |bias| + |alibi| over its visible keys
  bool conditioned = true;   // every visible score is well conditioned (see kConditionedBound)
};

/// The accuracy rule compares one call's error with a plain float implementation's; both are rounding noise of
/// the scores, |s|·2^-24 and more under cancellation. Where that noise dwarfs 1e-6·max(1, max|V|), the two errors
/// are independent draws of the same size and "≤ 2×" is a coin toss, not a property of the kernel (the fuzzer finds
/// such rows within a minute: fused 5e-6 against plain float 1e-6 with 20 scores near 137, 1.3e-5 against 5e-6 near
/// 457, dot products that cancel from 1e30). So the rule is checked on rows whose scores satisfy
/// Σ|q_d·k_d|·|scale| + |bias| + |alibi| ≤ kConditionedBound and ≤ kCancellation·max(1, |s|): the range of the
/// test suites' randomized grids (values in [−2, 2], D ≤ 12: |s| ≤ 14); every other row is still checked for
/// finiteness, NaN and the empty-row rule.
constexpr double kConditionedBound = 16;
constexpr double kCancellation = 8;

/// The float64 score of a rule-visible (i, j), the brute force's (brute::finish_score); `bound` receives
/// Σ|q_d·k_d|·|scale| over the finite products plus the finite |bias| and |ALiBi| term (what float must hold).
double score64(const Call& c, const brute::Params& params, const RowPlace& p, Index j, double& bound) {
  const Index h_kv = p.h / (c.Hq / c.Hkv);
  const double scale = params.scale ? *params.scale : 1.0 / std::sqrt(static_cast<double>(c.D));
  double dot = 0;
  bound = 0;
  for (Index d = 0; d < c.D; ++d) {
    const double x = c.q.dense[static_cast<std::size_t>(c.q.dense_index(p.s.b, p.h, p.row, d))];
    const double y = c.k.dense[static_cast<std::size_t>(c.k.dense_index(p.s.b, h_kv, p.s.k0 + j, d))];
    dot += x * y;
    if (std::isfinite(x) && std::isfinite(y)) bound += std::abs(x * y);
  }
  bound *= std::abs(scale);
  if (params.bias) {
    const double bias = params.bias->at(p.s.b, p.h, p.row, p.s.k0 + j);
    if (std::isfinite(bias)) bound += std::abs(bias);
  }
  if (!params.alibi_slopes.empty()) {
    const double distance = static_cast<double>(std::abs(brute::diag(params, p.s, p.i) - j));
    bound += std::abs(params.alibi_slopes[static_cast<std::size_t>(p.h)]) * distance;
  }
  return brute::finish_score(params, p.s, p.h, p.i, j, dot * scale);
}

bool row_nonfinite(const Tensor4& t, Index b, Index h, Index s) {
  for (Index d = 0; d < t.extents[3]; ++d) {
    if (!std::isfinite(t.dense[static_cast<std::size_t>(t.dense_index(b, h, s, d))])) return true;
  }
  return false;
}

/// The float64 brute force on the call's dense inputs.
brute::Result brute_force(const Call& c, const brute::Params& params) {
  const std::vector<double> q(c.q.dense.begin(), c.q.dense.end()), k(c.k.dense.begin(), c.k.dense.end()),
      v(c.v.dense.begin(), c.v.dense.end());
  return brute::attention(q, k, v, params);
}

/// A dense BHSD view of a tensor's logical values.
qkv::TensorView4<const float> dense_view(const Tensor4& t) {
  return qkv::TensorView4<const float>(t.dense.data(), t.extents);
}

std::string where(const Call& c, const RowPlace& p) {
  return "b " + std::to_string(p.s.b) + " h " + std::to_string(p.h) + " row " + std::to_string(p.row) +
         " (corruption " + std::to_string(c.corruption) + ")";
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

/// A float with all its digits (%.9g).
std::string number(float x) {
  char text[32];
  std::snprintf(text, sizeof text, "%.9g", static_cast<double>(x));
  return text;
}

/// The call in one paragraph (QKV_FUZZ_DEBUG): shapes and every option.
std::string describe(const Call& c) {
  const auto& o = c.options;
  std::string s = "B " + std::to_string(c.B) + " Hq " + std::to_string(c.Hq) + " Hkv " + std::to_string(c.Hkv) +
                  " Sq " + std::to_string(c.Sq) + " Skv " + std::to_string(c.Skv) + " D " + std::to_string(c.D) +
                  " Dv " + std::to_string(c.Dv) + " layout " + std::to_string(c.layout) + " backend " +
                  std::to_string(static_cast<int>(o.backend)) + " scale " + (o.scale ? number(*o.scale) : "-") +
                  " softcap " + number(o.softcap) + " causal " + std::to_string(o.causal) + " align " +
                  std::to_string(static_cast<int>(o.alignment)) + " window " + std::to_string(o.window_left) + "," +
                  std::to_string(o.window_right) + " global " + std::to_string(o.global_tokens) + " allowed " +
                  std::to_string(c.has_allowed) + " bias " + std::to_string(c.has_bias) + " lse " +
                  std::to_string(c.want_lse) + " K/V " + storage_name(c.storage) + "\n  key_lengths";
  for (Index x : o.key_lengths) s += " " + std::to_string(x);
  s += "\n  cu_seqlens_q";
  for (Index x : o.cu_seqlens_q) s += " " + std::to_string(x);
  s += "\n  cu_seqlens_k";
  for (Index x : o.cu_seqlens_k) s += " " + std::to_string(x);
  s += "\n  alibi_slopes";
  for (float x : o.alibi_slopes) s += " " + number(x);
  s += "\n  sinks";
  for (float x : o.sinks) s += " " + number(x);
  return s;
}

// ---- the checks ----------------------------------------------------------------------------------------------------

void check_valid_call(const Call& c) {
  const auto& o = c.options;
  const bool reference = o.backend == qkv::Backend::reference;
  // Nothing written between the elements of out and lse.
  std::vector<char> is_element(c.out.buffer.size(), 0);
  for (Index b = 0; b < c.B; ++b)
    for (Index h = 0; h < c.Hq; ++h)
      for (Index i = 0; i < c.Sq; ++i)
        for (Index d = 0; d < c.Dv; ++d) is_element[static_cast<std::size_t>(c.out.offset(b, h, i, d))] = 1;
  for (std::size_t at = 0; at < c.out.buffer.size(); ++at) {
    if (!is_element[at] && !same_bits(c.out.buffer[at], kOutSentinel)) fail("out written between its elements");
  }
  std::vector<char> is_lse(c.lse_buffer.size(), 0);
  for (Index b = 0; b < c.B; ++b)
    for (Index h = 0; h < c.Hq; ++h)
      for (Index i = 0; i < c.Sq; ++i)
        is_lse[static_cast<std::size_t>(b * c.lse_strides[0] + h * c.lse_strides[1] + i)] = 1;
  for (std::size_t at = 0; at < c.lse_buffer.size(); ++at) {
    const bool untouched = same_bits(c.lse_buffer[at], is_lse[at] ? kNaN : kOutSentinel);
    if ((!c.want_lse || !is_lse[at]) && !untouched) fail("lse written where it must not be");
  }

  const brute::Params params = call_params(c);
  const brute::Result expected = brute_force(c, params);
  // The plain float implementation (support/plain_float.hpp) in its four orders, on the dense inputs.
  std::vector<float> plain_out[4], plain_lse[4];
  for (int variant = 0; variant < 4; ++variant) {
    plain_out[variant].assign(c.out.dense.size(), 0.0f);
    plain_lse[variant].assign(static_cast<std::size_t>(c.B * c.Hq * c.Sq), 0.0f);
    qkv_test::plain_float(dense_view(c.q), dense_view(c.k), dense_view(c.v), params,
                          qkv::TensorView4<float>(plain_out[variant].data(), c.out.extents),
                          qkv::TensorView3<float>(plain_lse[variant].data(), {c.B, c.Hq, c.Sq}),
                          {(variant & 1) != 0, (variant & 2) != 0});
  }
  double error = 0, plain_error = 0, lse_error = 0, plain_lse_error = 0, max_abs_v = 0;
  bool any_checked = false;
  std::string worst;  // the row with the largest error, for the failure message
  double worst_error = -1;
  for_each_row(params, [&](const RowPlace& p) {
    const Index h_kv = p.h / (c.Hq / c.Hkv);
    RowFacts facts;
    std::vector<Index> visible;
    const bool q_bad = row_nonfinite(c.q, p.s.b, p.h, p.row);
    for (Index j = 0; j < p.s.skv; ++j) {
      if (!rule_visible(params, p, j)) continue;
      // The row touches key j: its q, k (and v, if the score is not −∞) and its bias.
      if (q_bad || row_nonfinite(c.k, p.s.b, h_kv, p.s.k0 + j) || row_nonfinite(c.v, p.s.b, h_kv, p.s.k0 + j)) {
        facts.tainted = true;
      }
      if (c.has_bias) {
        const float bias = c.bias.at(p.s.b, p.h, p.row, p.s.k0 + j);
        if (std::isnan(bias) || bias == kInf) facts.tainted = true;
      }
      double bound = 0;
      const double s = score64(c, params, p, j, bound);
      if (!(bound <= 1e37)) facts.fits = false;
      facts.max_bound = std::max(facts.max_bound, bound);
      if (!(bound <= kConditionedBound && bound <= kCancellation * std::max(1.0, std::abs(s))))
        facts.conditioned = false;
      if (s == -std::numeric_limits<double>::infinity()) continue;
      visible.push_back(j);
      for (Index d = 0; d < c.Dv; ++d) {
        const double x = c.v.dense[static_cast<std::size_t>(c.v.dense_index(p.s.b, h_kv, p.s.k0 + j, d))];
        if (std::isfinite(x)) facts.max_abs_v = std::max(facts.max_abs_v, std::abs(x));
      }
    }
    facts.any_visible = !visible.empty();
    if (!facts.fits) return;
    const std::size_t lse_dense = static_cast<std::size_t>((p.s.b * c.Hq + p.h) * c.Sq + p.row);
    const float lse =
        c.want_lse ? c.lse_buffer[static_cast<std::size_t>(p.s.b * c.lse_strides[0] + p.h * c.lse_strides[1] + p.row)]
                   : 0.0f;
    const float sink = o.sinks.empty() ? -kInf : o.sinks[static_cast<std::size_t>(p.h)];
    if (!facts.any_visible) {
      if (std::getenv("QKV_FUZZ_DEBUG")) {
        std::fprintf(stderr, "call %s\nrow %s sees no key; lse %.9g\n", describe(c).c_str(), where(c, p).c_str(), lse);
        for (Index j = 0; j < p.s.skv; ++j) {
          double bound = 0;
          std::fprintf(stderr, "  key %ld rule %d score %.9g\n", static_cast<long>(j), int(rule_visible(params, p, j)),
                       score64(c, params, p, j, bound));
        }
        for (Index d = 0; d < c.Dv; ++d)
          std::fprintf(stderr, "  out d %ld = %.9g\n", static_cast<long>(d),
                       c.out.buffer[static_cast<std::size_t>(c.out.offset(p.s.b, p.h, p.row, d))]);
      }
      for (Index d = 0; d < c.Dv; ++d) {
        if (c.out.buffer[static_cast<std::size_t>(c.out.offset(p.s.b, p.h, p.row, d))] != 0.0f) {
          fail("a row that sees no key is not zeros at " + where(c, p));
        }
      }
      if (c.want_lse && !same_bits(lse, sink)) {
        fail("a row that sees no key has lse " + std::to_string(lse) + ", expected " + std::to_string(sink) + " at " +
             where(c, p));
      }
      if (expected.lse[lse_dense] != static_cast<double>(sink)) fail("harness: brute force disagrees on an empty row");
      return;
    }
    if (facts.tainted) return;  // NaN may propagate here (docs/design.md); other rows are checked without it
    if (!facts.conditioned) {
      for (Index d = 0; d < c.Dv; ++d) {
        if (!std::isfinite(c.out.buffer[static_cast<std::size_t>(c.out.offset(p.s.b, p.h, p.row, d))])) {
          fail("non-finite output in a row with finite inputs at " + where(c, p));
        }
      }
      if (c.want_lse && !std::isfinite(lse)) fail("non-finite lse in a row with finite inputs at " + where(c, p));
      return;
    }
    any_checked = true;
    max_abs_v = std::max(max_abs_v, facts.max_abs_v);
    double row_error = 0, row_plain_error = 0;
    for (Index d = 0; d < c.Dv; ++d) {
      const float got = c.out.buffer[static_cast<std::size_t>(c.out.offset(p.s.b, p.h, p.row, d))];
      const double want = expected.out[static_cast<std::size_t>(c.out.dense_index(p.s.b, p.h, p.row, d))];
      if (!std::isfinite(got)) {
        fail("non-finite output " + std::to_string(got) + " in a row with finite inputs at " + where(c, p) + " d " +
             std::to_string(d));
      }
      row_error = std::max(row_error, std::abs(got - want));
      for (const auto& plain : plain_out) {
        const float x = plain[static_cast<std::size_t>(c.out.dense_index(p.s.b, p.h, p.row, d))];
        row_plain_error = std::max(row_plain_error, std::abs(x - want));
      }
    }
    error = std::max(error, row_error);
    plain_error = std::max(plain_error, row_plain_error);
    if (std::getenv("QKV_FUZZ_DEBUG") && row_error > 1e-6) {
      std::fprintf(stderr, "row %s error %g plain %g\n", where(c, p).c_str(), row_error, row_plain_error);
      for (Index j : visible) {
        double bound = 0;
        std::fprintf(stderr, "  key %ld score %.9g\n", static_cast<long>(j), score64(c, params, p, j, bound));
      }
      for (Index d = 0; d < c.Dv; ++d)
        std::fprintf(stderr, "  d %ld got %.9g want %.9g plain %.9g\n", static_cast<long>(d),
                     c.out.buffer[static_cast<std::size_t>(c.out.offset(p.s.b, p.h, p.row, d))],
                     expected.out[static_cast<std::size_t>(c.out.dense_index(p.s.b, p.h, p.row, d))],
                     plain_out[0][static_cast<std::size_t>(c.out.dense_index(p.s.b, p.h, p.row, d))]);
    }
    if (row_error > worst_error) {
      worst_error = row_error;
      worst = where(c, p) + ": error " + std::to_string(row_error) + ", plain float " +
              std::to_string(row_plain_error) + ", largest |score| bound " + std::to_string(facts.max_bound) +
              ", visible keys " + std::to_string(visible.size());
    }
    if (std::getenv("QKV_FUZZ_DEBUG") && c.want_lse) {
      std::fprintf(stderr, "lse %s got %.9g want %.9g plain %.9g %.9g %.9g %.9g bound %g\n", where(c, p).c_str(), lse,
                   expected.lse[lse_dense], plain_lse[0][lse_dense], plain_lse[1][lse_dense], plain_lse[2][lse_dense],
                   plain_lse[3][lse_dense], facts.max_bound);
    }
    if (c.want_lse) {
      if (!std::isfinite(lse)) fail("non-finite lse in a row with finite inputs at " + where(c, p));
      lse_error = std::max(lse_error,
                           std::abs(lse - expected.lse[lse_dense]) / std::max(1.0, std::abs(expected.lse[lse_dense])));
      for (const auto& plain : plain_lse) {
        plain_lse_error = std::max(plain_lse_error, std::abs(plain[lse_dense] - expected.lse[lse_dense]) /
                                                        std::max(1.0, std::abs(expected.lse[lse_dense])));
      }
    }
  });
  if (!any_checked) return;
  // docs/design.md's accuracy rule, over the rows that see a key and touch only finite inputs.
  const double absolute = 1e-6 * std::max(1.0, max_abs_v);
  const double allowed = reference ? absolute : 2 * plain_error + absolute;
  if (!(error <= allowed)) {
    fail("output error " + std::to_string(error) + " exceeds " + std::to_string(allowed) + " (plain float error " +
         std::to_string(plain_error) + ", max|V| " + std::to_string(max_abs_v) + ", backend " +
         std::to_string(static_cast<int>(o.backend)) + ", " + storage_name(c.storage) + " K/V); worst row " + worst);
  }
  // The same rule for lse, relative to max(1, |lse|) (the harness's own reading: docs/design.md states it for out).
  const double lse_allowed = reference ? 1e-6 : 2 * plain_lse_error + 1e-6;
  if (c.want_lse && !(lse_error <= lse_allowed)) {
    fail("lse error " + std::to_string(lse_error) + " exceeds " + std::to_string(lse_allowed));
  }
}

/// The packed Eigen entry point on the same call (B = 1, BSHD without gaps: Q is Sq × Hq·D), with K and V stored as S
/// (float, or the call's 16-bit buffers): the same bits.
template <class S>
void check_packed(const Call& c, const S* k_buffer, const S* v_buffer) {
  if (c.B != 1 || c.Hq < 1 || c.layout != 1) return;
  const Eigen::Map<const qkv::Matrix<float>> Q(c.q.buffer.data(), c.Sq, c.Hq * c.D);
  const Eigen::Map<const qkv::Matrix<S>> K(k_buffer, c.Skv, c.Hkv * c.D), V(v_buffer, c.Skv, c.Hkv * c.Dv);
  qkv::Matrix<float> O;
  try {
    O = qkv::scaled_dot_product_attention(Q, K, V, qkv::Heads{c.Hq, c.Hkv}, c.options);
  } catch (const std::exception& e) {
    fail(std::string("scaled_dot_product_attention threw on a valid call: ") + e.what());
  }
  if (O.rows() != c.Sq || O.cols() != c.Hq * c.Dv) fail("scaled_dot_product_attention returned the wrong shape");
  for (Index i = 0; i < c.Sq; ++i)
    for (Index h = 0; h < c.Hq; ++h)
      for (Index d = 0; d < c.Dv; ++d) {
        const float a = O(i, h * c.Dv + d), b = c.out.buffer[static_cast<std::size_t>(c.out.offset(0, h, i, d))];
        if (!same_bits(a, b) && !(std::isnan(a) && std::isnan(b))) {
          fail("scaled_dot_product_attention differs from attention at row " + std::to_string(i) + " head " +
               std::to_string(h) + " (" + storage_name(c.storage) + " K/V)");
        }
      }
}

void check_packed(const Call& c) {
  if (c.storage == Storage::half) {
    check_packed(c, c.k_half.data(), c.v_half.data());
  } else if (c.storage == Storage::bfloat16) {
    check_packed(c, c.k_bfloat16.data(), c.v_bfloat16.data());
  } else {
    check_packed(c, c.k.buffer.data(), c.v.buffer.data());
  }
}

/// A view of the 16-bit copy `storage` of `buffer` with the extents and strides of `view` (a view into `buffer`, or a
/// corrupted one: the same offset into the copy, or null).
template <class S>
qkv::TensorView4<const S> in_storage(const qkv::TensorView4<const float>& view, const std::vector<float>& buffer,
                                     const std::vector<S>& storage) {
  const S* data = view.data() == nullptr ? nullptr : storage.data() + (view.data() - buffer.data());
  return qkv::TensorView4<const S>(data, view.extents(), view.strides());
}

/// qkv::attention on the call's views, K and V stored as S (in `k_storage`, `v_storage`, copies of k's and v's
/// buffers), with or without lse.
template <class S>
void attention_16(Call& c, const std::vector<S>& k_storage, const std::vector<S>& v_storage) {
  const qkv::TensorView4<const S> k = in_storage(c.k_view, c.k.buffer, k_storage),
                                  v = in_storage(c.v_view, c.v.buffer, v_storage);
  if (c.want_lse) {
    qkv::attention(c.q_view, k, v, c.out_view, c.lse_view, c.options);
  } else {
    qkv::attention(c.q_view, k, v, c.out_view, c.options);
  }
}

// ---- the backward (issue 17) ---------------------------------------------------------------------------------------

/// Corruptions of a backward call whose forward call is valid: each breaks exactly the rule it names (other rules may
/// break too as a consequence, which still means shape_error). 0 = none.
enum BackwardCorruption : int {
  kBackwardNone,
  kDOutWrongExtent,
  kDQWrongExtent,
  kDKWrongExtent,
  kDVWrongExtent,
  kBackwardLseWrongExtent,
  kBackwardOutWrongExtent,
  kDQOverlapsQ,
  kDKOverlapsDV,
  kDVOverlapsDOut,
  kDKOverlapsK,
  kDQSelfOverlap,
  kDQInnermostStride,
  kDOutNullData,
  kDBiasWrong,       // requested without options.bias, or with other extents than the bias's
  kDSinksWrong,      // requested without options.sinks, or with another count than Hq
  kDBiasOverlapsDQ,  // an output overlapping another output
  kDropoutPInvalid,  // NaN, ∞, > 1 or < 0
  kBackwardCorruptionCount
};

/// A NaN with a payload that no arithmetic produces: the backward's outputs start as it and none may keep it (an
/// element still holding it was not written).
float unwritten_marker() {
  const std::uint32_t bits = 0x7fc0beefu;
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
}

/// One attention_backward call built on a decoded Call: d_out drawn, the outputs laid out, the forward's out and lse.
struct BackwardCall {
  qkv::AttentionOptions<float> options;  // the forward's (a corruption may change this copy)
  Tensor4 d_out, d_q, d_k, d_v;
  std::vector<float> out_again, lse_again;  // the forward run again with lse, when the forward call wrote none
  qkv::TensorView4<const float> out_view, d_out_view;
  qkv::TensorView3<const float> lse_view;
  qkv::TensorView4<float> d_q_view, d_k_view, d_v_view;
  std::vector<float> d_bias, d_sinks;  // dense: the bias's extents; Hq
  qkv::AttentionGradientExtras<float> extras;
  int corruption = kBackwardNone;
};

/// Lays out the backward call's tensors (BackwardByte) around the forward's q, k, v, out and lse.
void make_backward(Call& c, BackwardCall& bw) {
  const auto& bytes = c.backward;
  const int mode = bytes[kBackwardMode];
  const auto& h = c.header;
  // d_out from its own stream (the forward's values are not disturbed).
  Random random((static_cast<std::uint64_t>(h[kFieldSeed0]) | static_cast<std::uint64_t>(h[kFieldSeed1]) << 8 |
                 static_cast<std::uint64_t>(h[kFieldSeed2]) << 16 | static_cast<std::uint64_t>(h[kFieldSeed3]) << 24) ^
                0x17b4c7a9d2e5f601ull);
  bw.options = c.options;
  make_layout(bw.d_out, {c.B, c.Hq, c.Sq, c.Dv}, (bytes[kBackwardLayout] >> 4) % 12, kNaN);
  fill_tensor(bw.d_out, random, 1.0f);
  if ((mode & 8) != 0 && !bw.d_out.dense.empty()) {
    bw.d_out.dense[(static_cast<std::size_t>(bytes[kBackwardParameter]) * 7919) % bw.d_out.dense.size()] =
        (mode & 16) != 0 ? kInf : kNaN;
  }
  scatter(bw.d_out);
  const float marker = unwritten_marker();
  const int layout = (bytes[kBackwardLayout] & 15) % 12;
  make_layout(bw.d_q, {c.B, c.Hq, c.Sq, c.D}, layout, kOutSentinel);
  make_layout(bw.d_k, {c.B, c.Hkv, c.Skv, c.D}, layout, kOutSentinel);
  make_layout(bw.d_v, {c.B, c.Hkv, c.Skv, c.Dv}, layout, kOutSentinel);
  for (Tensor4* t : {&bw.d_q, &bw.d_k, &bw.d_v}) {
    std::fill(t->dense.begin(), t->dense.end(), marker);
    scatter(*t);
  }
  bw.d_out_view = qkv::TensorView4<const float>(bw.d_out.buffer.data(), bw.d_out.extents, bw.d_out.strides);
  bw.d_q_view = qkv::TensorView4<float>(bw.d_q.buffer.data(), bw.d_q.extents, bw.d_q.strides);
  bw.d_k_view = qkv::TensorView4<float>(bw.d_k.buffer.data(), bw.d_k.extents, bw.d_k.strides);
  bw.d_v_view = qkv::TensorView4<float>(bw.d_v.buffer.data(), bw.d_v.extents, bw.d_v.strides);
  bw.out_view = c.out_view;
  if (c.want_lse) {
    bw.lse_view = c.lse_view;
  } else {  // a dense lse (the valid path below fills it from a second forward call)
    bw.lse_again.assign(static_cast<std::size_t>(c.B * c.Hq * c.Sq), kNaN);
    bw.lse_view = qkv::TensorView3<const float>(bw.lse_again.data(), {c.B, c.Hq, c.Sq});
  }
  if ((mode & 2) != 0 && c.has_bias) {
    const auto& e = c.bias.extents;
    bw.d_bias.assign(static_cast<std::size_t>(e[0] * e[1] * e[2] * e[3]), marker);
    bw.extras.d_bias = qkv::TensorView4<float>(bw.d_bias.data(), e);
  }
  if ((mode & 4) != 0 && !c.options.sinks.empty()) {
    bw.d_sinks.assign(static_cast<std::size_t>(c.Hq), marker);
    bw.extras.d_sinks = qkv::TensorView<float, 1>(bw.d_sinks.data(), {c.Hq});
  }
}

/// Applies bw.corruption; returns false when this shape lacks what it needs (the caller then applies
/// kDOutWrongExtent, which every shape allows).
bool corrupt_backward(Call& c, BackwardCall& bw) {
  const int parameter = c.backward[kBackwardParameter];
  const auto nonempty = [](const auto& view) { return view.size() > 0; };
  switch (bw.corruption) {
    case kDOutWrongExtent:
      bw.d_out_view = with_extent(bw.d_out_view, parameter % 4, bw.d_out_view.extent(parameter % 4) + 1);
      return true;
    case kDQWrongExtent:
      bw.d_q_view = with_extent(bw.d_q_view, parameter % 4, bw.d_q_view.extent(parameter % 4) + 1);
      return true;
    case kDKWrongExtent:
      bw.d_k_view = with_extent(bw.d_k_view, parameter % 4, bw.d_k_view.extent(parameter % 4) + 1);
      return true;
    case kDVWrongExtent:
      bw.d_v_view = with_extent(bw.d_v_view, parameter % 4, bw.d_v_view.extent(parameter % 4) + 1);
      return true;
    case kBackwardLseWrongExtent:
      bw.lse_view = with_extent(bw.lse_view, parameter % 3, bw.lse_view.extent(parameter % 3) + 1);
      return true;
    case kBackwardOutWrongExtent:
      bw.out_view = with_extent(bw.out_view, parameter % 4, bw.out_view.extent(parameter % 4) + 1);
      return true;
    case kDQOverlapsQ:  // d_q over q's first element: both non-empty, so they overlap
      if (!nonempty(bw.d_q_view) || !nonempty(c.q_view)) return false;
      bw.d_q_view = with_data(bw.d_q_view, c.q.buffer.data());
      return true;
    case kDKOverlapsDV:
      if (!nonempty(bw.d_k_view) || !nonempty(bw.d_v_view)) return false;
      bw.d_v_view = with_data(bw.d_v_view, bw.d_k.buffer.data());
      return true;
    case kDVOverlapsDOut:
      if (!nonempty(bw.d_v_view) || !nonempty(bw.d_out_view)) return false;
      bw.d_v_view = with_data(bw.d_v_view, bw.d_out.buffer.data());
      return true;
    case kDKOverlapsK:
      if (!nonempty(bw.d_k_view) || !nonempty(c.k_view)) return false;
      bw.d_k_view = with_data(bw.d_k_view, c.k.buffer.data());
      return true;
    case kDQSelfOverlap:
      if (!nonempty(bw.d_q_view) || c.Sq < 2) return false;
      bw.d_q_view = with_stride(bw.d_q_view, 2, 0);
      return true;
    case kDQInnermostStride:
      bw.d_q_view = c.D >= 2 ? with_stride(bw.d_q_view, 3, 2) : with_stride(bw.d_q_view, parameter % 4, -1);
      return true;
    case kDOutNullData:
      if (!nonempty(bw.d_out_view)) return false;
      bw.d_out_view = with_data(bw.d_out_view, nullptr);
      return true;
    case kDBiasWrong:
      if (c.has_bias) {  // one extent more than the bias's on one axis (not backed by memory)
        const auto& e = c.bias.extents;
        bw.d_bias.assign(static_cast<std::size_t>(std::max<Index>(e[0] * e[1] * e[2] * e[3], 1)), unwritten_marker());
        auto extents = e;
        extents[static_cast<std::size_t>(parameter % 4)] += 1;
        bw.extras.d_bias = qkv::TensorView4<float>(bw.d_bias.data(), extents);
      } else {  // a gradient of a bias the call does not have
        bw.d_bias.assign(static_cast<std::size_t>(std::max<Index>(c.B * c.Hq * c.Sq * c.Skv, 1)), unwritten_marker());
        bw.extras.d_bias = qkv::TensorView4<float>(bw.d_bias.data(), {c.B, c.Hq, c.Sq, c.Skv});
      }
      return true;
    case kDSinksWrong:
      if (!c.options.sinks.empty()) {  // Hq + 1 entries
        bw.d_sinks.assign(static_cast<std::size_t>(c.Hq + 1), unwritten_marker());
        bw.extras.d_sinks = qkv::TensorView<float, 1>(bw.d_sinks.data(), {c.Hq + 1});
      } else {  // a gradient of sinks the call does not have
        bw.d_sinks.assign(static_cast<std::size_t>(std::max<Index>(c.Hq, 1)), unwritten_marker());
        bw.extras.d_sinks = qkv::TensorView<float, 1>(bw.d_sinks.data(), {c.Hq});
      }
      return true;
    case kDBiasOverlapsDQ: {
      if (!c.has_bias || !nonempty(bw.d_q_view)) return false;
      const auto& e = c.bias.extents;
      if (e[0] * e[1] * e[2] * e[3] == 0) return false;
      bw.extras.d_bias = qkv::TensorView4<float>(bw.d_q.buffer.data(), e);
      return true;
    }
    case kDropoutPInvalid: {
      static constexpr std::array<float, 4> kBad = {kNaN, 1.5f, -0.25f, kInf};
      bw.options.dropout_p = kBad[static_cast<std::size_t>(parameter) % kBad.size()];
      return true;
    }
    default:
      return true;
  }
}

/// The largest |x| over the finite elements of a tensor's logical values.
double max_finite(const std::vector<float>& x) {
  double m = 0;
  for (float value : x)
    if (std::isfinite(value)) m = std::max(m, static_cast<double>(std::abs(value)));
  return m;
}

/// Scores up to this bound (Σ|q_d·k_d|·|scale| + |bias| + |ALiBi|) are recomputed by the backward within about
/// 1e4·D·2^-24 ≤ 0.01 of the forward's, so P = exp(s − lse) stays near the forward's weights; above it a recomputed
/// score may exceed the stored lse by many units (|s|·2^-24 at |s| = 1e30 is 6e22) and P overflows. The harness
/// demands finite gradients only below it (FlashAttention recomputes P from lse the same way).
constexpr double kBackwardFiniteBound = 1e4;

/// The backward's accuracy rule compares one call's error with a plain float backward's; both are the rounding noise
/// of each gradient's terms, about 2^-24·Σ|term| and more. Where Σ|term| dwarfs the gradient, the two errors are
/// independent draws of that noise and "≤ 2×" is a coin toss, not a property of the kernel: a row that sees one key has
/// dS = P·(dP − D_i) = 0 from two equal sums, and with q = 1e15 the rounding of those sums alone puts 1e8 into a d_k
/// that is 0 (found by fuzzing: the plain float backward, summing both in the same order, happened to get 0 exactly).
/// So the rule is checked where every element's Σ|term| ≤ kGradientCancellation·max(1, max|g|) of its gradient, the
/// terms (float64, from the brute force's weights P): d_q_i: Σ_j P_ij·(|dP_ij| + |D_i|)·|k_j|·|scale|; d_k_j: Σ_i
/// P_ij·(|dP_ij| + |D_i|)·|q_i|·|scale|; d_v_j: Σ_i P_ij·|dO_i|; d_bias: Σ P_ij·(|dP_ij| + |D_i|); d_sink_h: Σ_i
/// P_sink·|D_i| (the kernel's own rule for the forward's scores is kCancellation).
constexpr double kGradientCancellation = 8;

bool gradients_conditioned(const Call& c, const BackwardCall& bw, const brute::Params& params,
                           const qkv_test::PlainGradients<double>& expected) {
  const brute::Result forward = brute_force(c, params);
  const double scale = params.scale ? std::abs(*params.scale) : 1.0 / std::sqrt(static_cast<double>(c.D));
  std::vector<double> term_q(expected.d_q.size()), term_k(expected.d_k.size()), term_v(expected.d_v.size()),
      term_bias(expected.d_bias.size()), term_sinks(expected.d_sinks.size());
  const Index group = c.Hq / c.Hkv;
  std::vector<double> dp(static_cast<std::size_t>(c.Skv));
  for_each_row(params, [&](const RowPlace& p) {
    const Index h_kv = p.h / group;
    const auto at = [&](Index j) {
      return forward.weights[brute::flat(c.Hq, c.Sq, c.Skv, p.s.b, p.h, p.row, p.s.k0 + j)];
    };
    double row_sum = 0;  // D_i
    for (Index j = 0; j < p.s.skv; ++j) {
      if (at(j) == 0) continue;  // hidden (its v may be poisoned) or a weight that underflows: no term
      double sum = 0;
      for (Index d = 0; d < c.Dv; ++d) {
        sum +=
            static_cast<double>(bw.d_out.dense[static_cast<std::size_t>(bw.d_out.dense_index(p.s.b, p.h, p.row, d))]) *
            c.v.dense[static_cast<std::size_t>(c.v.dense_index(p.s.b, h_kv, p.s.k0 + j, d))];
      }
      dp[static_cast<std::size_t>(j)] = sum;
      row_sum += at(j) * sum;
    }
    for (Index j = 0; j < p.s.skv; ++j) {
      const double weight = at(j);
      if (weight == 0) continue;
      const double term = weight * (std::abs(dp[static_cast<std::size_t>(j)]) + std::abs(row_sum));
      for (Index d = 0; d < c.D; ++d) {
        term_q[static_cast<std::size_t>(c.q.dense_index(p.s.b, p.h, p.row, d))] +=
            term * scale * std::abs(c.k.dense[static_cast<std::size_t>(c.k.dense_index(p.s.b, h_kv, p.s.k0 + j, d))]);
        term_k[static_cast<std::size_t>(c.k.dense_index(p.s.b, h_kv, p.s.k0 + j, d))] +=
            term * scale * std::abs(c.q.dense[static_cast<std::size_t>(c.q.dense_index(p.s.b, p.h, p.row, d))]);
      }
      for (Index d = 0; d < c.Dv; ++d) {
        term_v[static_cast<std::size_t>(c.v.dense_index(p.s.b, h_kv, p.s.k0 + j, d))] +=
            weight * std::abs(bw.d_out.dense[static_cast<std::size_t>(bw.d_out.dense_index(p.s.b, p.h, p.row, d))]);
      }
      if (!term_bias.empty()) {
        const auto& e = params.bias->extents;
        const Index b = e[0] == 1 ? 0 : p.s.b, h = e[1] == 1 ? 0 : p.h, i = e[2] == 1 ? 0 : p.row;
        term_bias[static_cast<std::size_t>(((b * e[1] + h) * e[2] + i) * e[3] + p.s.k0 + j)] += term;
      }
    }
    if (!term_sinks.empty()) {
      const double sink = params.sinks[static_cast<std::size_t>(p.h)];
      const double lse = forward.lse[brute::flat(c.Hq, c.Sq, 1, p.s.b, p.h, p.row, 0)];
      if (std::isfinite(sink) && std::isfinite(lse))
        term_sinks[static_cast<std::size_t>(p.h)] += std::exp(sink - lse) * std::abs(row_sum);
    }
  });
  const auto conditioned = [](const std::vector<double>& terms, const std::vector<double>& gradient) {
    double largest = 0;
    for (double g : gradient) largest = std::max(largest, std::abs(g));
    for (double t : terms)
      if (!(t <= kGradientCancellation * std::max(1.0, largest))) return false;
    return true;
  };
  return conditioned(term_q, expected.d_q) && conditioned(term_k, expected.d_k) && conditioned(term_v, expected.d_v) &&
         (bw.d_bias.empty() || conditioned(term_bias, expected.d_bias)) &&
         (bw.d_sinks.empty() || conditioned(term_sinks, expected.d_sinks));
}

/// The checks of a valid backward call (fuzz/README.md, "The backward").
void check_backward_values(const Call& c, const BackwardCall& bw) {
  const float marker = unwritten_marker();
  // Every element written (none keeps the marker), nothing between them.
  for (const Tensor4* t : {&bw.d_q, &bw.d_k, &bw.d_v}) {
    std::vector<char> is_element(t->buffer.size(), 0);
    for (Index b = 0; b < t->extents[0]; ++b)
      for (Index h = 0; h < t->extents[1]; ++h)
        for (Index s = 0; s < t->extents[2]; ++s)
          for (Index d = 0; d < t->extents[3]; ++d) is_element[static_cast<std::size_t>(t->offset(b, h, s, d))] = 1;
    for (std::size_t at = 0; at < t->buffer.size(); ++at) {
      if (is_element[at] && same_bits(t->buffer[at], marker)) fail("a gradient element was not written");
      if (!is_element[at] && !same_bits(t->buffer[at], kOutSentinel)) fail("a gradient written between its elements");
    }
  }
  for (const std::vector<float>* extra : {&bw.d_bias, &bw.d_sinks})
    for (float x : *extra)
      if (same_bits(x, marker)) fail("a requested d_bias or d_sinks element was not written");

  const brute::Params params = call_params(c);
  const auto gradient = [](const Tensor4& t, Index b, Index h, Index s, Index d) {
    return t.buffer[static_cast<std::size_t>(t.offset(b, h, s, d))];
  };
  // A bound on every gradient (finite inputs): |dP|, |D_i| ≤ max|d_out|·max|v|·Dv, |dS| ≤ twice that, summed over at
  // most Hq·max(Sq, Skv) terms of |k| or |q|·|scale|·D (or |d_out|).
  const double scale = params.scale ? std::abs(*params.scale) : 1.0 / std::sqrt(static_cast<double>(c.D));
  const double d_s =
      2 * max_finite(bw.d_out.dense) * max_finite(c.v.dense) * static_cast<double>(std::max<Index>(c.Dv, 1));
  const double terms = static_cast<double>(std::max<Index>(c.Hq, 1) * std::max<Index>({c.Sq, c.Skv, 1}));
  const double gradient_bound =
      std::max(d_s * std::max(max_finite(c.q.dense), max_finite(c.k.dense)) * scale * static_cast<double>(c.D),
               max_finite(bw.d_out.dense)) *
      terms;
  const bool gradients_fit = gradient_bound <= 1e30;

  const Index group = c.Hq / c.Hkv;
  std::vector<char> key_seen(static_cast<std::size_t>(c.B * c.Hkv * c.Skv), 0),
      key_unsafe(static_cast<std::size_t>(c.B * c.Hkv * c.Skv), 0);
  bool all_conditioned = true, any_visible = false;
  for_each_row(params, [&](const RowPlace& p) {
    const Index h_kv = p.h / group;
    bool any = false;
    bool safe = !row_nonfinite(c.q, p.s.b, p.h, p.row) && !row_nonfinite(bw.d_out, p.s.b, p.h, p.row);
    std::vector<Index> seen;
    for (Index j = 0; j < p.s.skv; ++j) {
      if (!rule_visible(params, p, j)) continue;
      any = true;
      seen.push_back(j);
      key_seen[static_cast<std::size_t>((p.s.b * c.Hkv + h_kv) * c.Skv + p.s.k0 + j)] = 1;
      if (row_nonfinite(c.k, p.s.b, h_kv, p.s.k0 + j) || row_nonfinite(c.v, p.s.b, h_kv, p.s.k0 + j)) safe = false;
      if (c.has_bias) {
        const float bias = c.bias.at(p.s.b, p.h, p.row, p.s.k0 + j);
        if (std::isnan(bias) || bias == kInf) safe = false;
      }
      double bound = 0;
      const double s = score64(c, params, p, j, bound);
      if (!(bound <= kBackwardFiniteBound)) safe = false;
      if (!(bound <= kConditionedBound && bound <= kCancellation * std::max(1.0, std::abs(s)))) all_conditioned = false;
    }
    any_visible = any_visible || any;
    if (!any) {  // a row that sees no key: zero d_q
      for (Index d = 0; d < c.D; ++d) {
        if (gradient(bw.d_q, p.s.b, p.h, p.row, d) != 0.0f)
          fail("d_q of a row that sees no key is not zero at " + where(c, p));
      }
      return;
    }
    if (!safe || !gradients_fit) {
      all_conditioned = false;
      for (Index j : seen) key_unsafe[static_cast<std::size_t>((p.s.b * c.Hkv + h_kv) * c.Skv + p.s.k0 + j)] = 1;
      return;
    }
    for (Index d = 0; d < c.D; ++d) {
      if (!std::isfinite(gradient(bw.d_q, p.s.b, p.h, p.row, d)))
        fail("non-finite d_q in a row with finite inputs at " + where(c, p));
    }
  });
  for (Index b = 0; b < c.B; ++b)
    for (Index h_kv = 0; h_kv < c.Hkv; ++h_kv)
      for (Index j = 0; j < c.Skv; ++j) {
        const std::size_t at = static_cast<std::size_t>((b * c.Hkv + h_kv) * c.Skv + j);
        const std::string key =
            "b " + std::to_string(b) + " kv head " + std::to_string(h_kv) + " key " + std::to_string(j);
        for (Index d = 0; d < std::max(c.D, c.Dv); ++d) {
          const float dk = d < c.D ? gradient(bw.d_k, b, h_kv, j, d) : 0.0f;
          const float dv = d < c.Dv ? gradient(bw.d_v, b, h_kv, j, d) : 0.0f;
          // A key no query sees (poisoned with NaN or ±∞ when kFieldPoison is set) is never read: exactly zero.
          if (!key_seen[at] && (dk != 0.0f || dv != 0.0f))
            fail("d_k or d_v of a key no query sees is not zero at " + key);
          if (key_seen[at] && !key_unsafe[at] && (!std::isfinite(dk) || !std::isfinite(dv)))
            fail("non-finite d_k or d_v of a key only finite rows see at " + key);
        }
      }
  if (!all_conditioned || !any_visible) return;

  // The accuracy rule (issue 17) on calls whose every row sees only finite, well-conditioned inputs: per gradient,
  // error against the float64 backward ≤ 2 × the plain float backward's error + 1e-6·max(1, max|g|). Both oracles are
  // support/plain_backward.hpp (materialized, with brute_force.hpp's visibility and score rules).
  const std::vector<double> q(c.q.dense.begin(), c.q.dense.end()), k(c.k.dense.begin(), c.k.dense.end()),
      v(c.v.dense.begin(), c.v.dense.end()), d_out(bw.d_out.dense.begin(), bw.d_out.dense.end());
  const qkv_test::PlainGradients<double> expected = qkv_test::plain_backward<double>(q, k, v, d_out, params);
  if (!gradients_conditioned(c, bw, params, expected)) return;
  // The plain float backward in its two forms (support/plain_backward.hpp): weights from a softmax of its own, and
  // from the out and lse this call was given; the larger error is the baseline.
  std::vector<float> out(c.out.dense.size()), lse(static_cast<std::size_t>(c.B * c.Hq * c.Sq));
  for (Index b = 0; b < c.B; ++b)
    for (Index h = 0; h < c.Hq; ++h)
      for (Index i = 0; i < c.Sq; ++i) {
        lse[static_cast<std::size_t>((b * c.Hq + h) * c.Sq + i)] = bw.lse_view(b, h, i);
        for (Index d = 0; d < c.Dv; ++d)
          out[static_cast<std::size_t>(c.out.dense_index(b, h, i, d))] = bw.out_view(b, h, i, d);
      }
  const qkv_test::PlainGradients<float> plain[2] = {
      qkv_test::plain_backward<float>(c.q.dense, c.k.dense, c.v.dense, bw.d_out.dense, params),
      qkv_test::plain_backward<float>(c.q.dense, c.k.dense, c.v.dense, bw.d_out.dense, params, &out, &lse)};
  const auto check = [&](const char* name, const std::vector<double>& want,
                         std::vector<float> qkv_test::PlainGradients<float>::*member, const auto& got_at) {
    double error = 0, plain_error = 0, largest = 0;
    for (std::size_t n = 0; n < want.size(); ++n) {
      const double got = got_at(n);
      if (!std::isfinite(got)) fail(std::string("non-finite ") + name + " in a call with finite inputs");
      error = std::max(error, std::abs(got - want[n]));
      for (const auto& form : plain)
        plain_error = std::max(plain_error, std::abs(static_cast<double>((form.*member)[n]) - want[n]));
      largest = std::max(largest, std::abs(want[n]));
    }
    const double allowed = 2 * plain_error + 1e-6 * std::max(1.0, largest);
    if (std::getenv("QKV_FUZZ_DEBUG")) {
      for (std::size_t n = 0; n < want.size(); ++n) {
        std::fprintf(stderr, "%s %zu got %.9g want %.9g plain %.9g %.9g\n", name, n, got_at(n), want[n],
                     static_cast<double>((plain[0].*member)[n]), static_cast<double>((plain[1].*member)[n]));
      }
    }
    if (!(error <= allowed)) {
      fail(std::string(name) + " error " + std::to_string(error) + " exceeds " + std::to_string(allowed) +
           " (plain float error " + std::to_string(plain_error) + ", max|g| " + std::to_string(largest) + ", backend " +
           std::to_string(static_cast<int>(c.options.backend)) + ")");
    }
  };
  const auto at_of = [&gradient](const Tensor4& t) {
    return [&t, &gradient](std::size_t n) {
      const Index d = static_cast<Index>(n) % t.extents[3], s = static_cast<Index>(n) / t.extents[3] % t.extents[2];
      const Index h = static_cast<Index>(n) / (t.extents[3] * t.extents[2]) % t.extents[1];
      const Index b = static_cast<Index>(n) / (t.extents[3] * t.extents[2] * t.extents[1]);
      return static_cast<double>(gradient(t, b, h, s, d));
    };
  };
  using Plain = qkv_test::PlainGradients<float>;
  check("d_q", expected.d_q, &Plain::d_q, at_of(bw.d_q));
  check("d_k", expected.d_k, &Plain::d_k, at_of(bw.d_k));
  check("d_v", expected.d_v, &Plain::d_v, at_of(bw.d_v));
  if (!bw.d_bias.empty())
    check("d_bias", expected.d_bias, &Plain::d_bias, [&bw](std::size_t n) { return double(bw.d_bias[n]); });
  if (!bw.d_sinks.empty())
    check("d_sinks", expected.d_sinks, &Plain::d_sinks, [&bw](std::size_t n) { return double(bw.d_sinks[n]); });
}

/// The backward call of an input whose mode byte asks for one (after the forward call and its checks, which it does
/// not change). A valid forward: its out and lse (a second forward call supplies lse when the first wrote none), then
/// at most one backward corruption. An invalid forward: the same corrupted views and options, which must make the
/// backward throw as well — except the three corruptions that only concern outputs of the forward (out over q, lse
/// over out, out overlapping itself), which are not errors of the backward's inputs: no backward call for those.
void check_backward(Call& c, bool forward_valid, int forward_corruption) {
  if ((c.backward[kBackwardMode] & 1) == 0) return;
  if (forward_corruption == kOutOverlapsQ || forward_corruption == kLseOverlapsOut ||
      forward_corruption == kOutSelfOverlap)
    return;
  BackwardCall bw;
  make_backward(c, bw);
  if (forward_valid && !c.want_lse) {
    bw.out_again.assign(c.out.dense.size(), kNaN);
    const qkv::TensorView4<float> out_again(bw.out_again.data(), c.out.extents);
    qkv::attention<float>(c.q_view, c.k_view, c.v_view, out_again,
                          qkv::TensorView3<float>(bw.lse_again.data(), {c.B, c.Hq, c.Sq}), c.options);
    bw.out_view = out_again;
  }
  if (forward_valid) {
    const int byte = c.backward[kBackwardCorruption];
    bw.corruption = byte % 3 == 2 ? 1 + (byte / 3) % (kBackwardCorruptionCount - 1) : kBackwardNone;
    if (!corrupt_backward(c, bw)) {
      bw.corruption = kDOutWrongExtent;
      corrupt_backward(c, bw);
    }
  }
  const bool expect_valid = forward_valid && bw.corruption == kBackwardNone;
  // Every buffer the call may see; the first eight are its inputs (q, k, v, out, lse, the second forward's out and
  // lse, d_out).
  const auto snapshot = [&c, &bw]() {
    return std::vector<std::vector<float>>{c.q.buffer,    c.k.buffer,   c.v.buffer,      c.out.buffer,  c.lse_buffer,
                                           bw.out_again,  bw.lse_again, bw.d_out.buffer, bw.d_q.buffer, bw.d_k.buffer,
                                           bw.d_v.buffer, bw.d_bias,    bw.d_sinks};
  };
  const std::vector<std::vector<float>> before = snapshot();
  bool threw = false;
  try {
    qkv::attention_backward<float>(c.q_view, c.k_view, c.v_view, bw.out_view, bw.lse_view, bw.d_out_view, bw.d_q_view,
                                   bw.d_k_view, bw.d_v_view, bw.options, bw.extras);
  } catch (const qkv::shape_error& e) {
    if (expect_valid) fail(std::string("attention_backward: shape_error on a valid call: ") + e.what());
    threw = true;
  } catch (const std::exception& e) {
    fail(std::string("attention_backward: an exception other than shape_error: ") + e.what());
  } catch (...) {
    fail("attention_backward: a non-standard exception");
  }
  const std::vector<std::vector<float>> after = snapshot();
  const auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
  };
  if (!expect_valid) {
    if (!threw) {
      fail("attention_backward: an invalid call did not throw (forward corruption " +
           std::to_string(forward_corruption) + ", backward corruption " + std::to_string(bw.corruption) + ", D " +
           std::to_string(c.D) + ", Hq " + std::to_string(c.Hq) + ", Hkv " + std::to_string(c.Hkv) + ")");
    }
    for (std::size_t n = 0; n < before.size(); ++n)
      if (!same(before[n], after[n])) fail("attention_backward: a call that threw wrote to memory");
    return;
  }
  for (std::size_t n = 0; n < 8; ++n)  // the inputs
    if (!same(before[n], after[n])) fail("attention_backward wrote to an input");
  check_backward_values(c, bw);
}

void run(const std::uint8_t* data, std::size_t size) {
  Call c;
  decode(data, size, c);
  int applied = kNone;
  if (c.corruption != kNone) {
    applied = corrupt(c);
    if (applied != c.corruption) c.options.scale = kNaN;  // the drawn corruption needs elements this shape lacks
    c.corruption = applied;
  }
  const bool expect_valid = applied == kNone && c.shape_valid;
  const std::vector<float> q_before = c.q.buffer, out_before = c.out.buffer, lse_before = c.lse_buffer;
  bool threw = false;
  try {
    if (c.storage == Storage::half) {
      attention_16(c, c.k_half, c.v_half);
    } else if (c.storage == Storage::bfloat16) {
      attention_16(c, c.k_bfloat16, c.v_bfloat16);
    } else if (c.want_lse) {
      qkv::attention<float>(c.q_view, c.k_view, c.v_view, c.out_view, c.lse_view, c.options);
    } else {
      qkv::attention<float>(c.q_view, c.k_view, c.v_view, c.out_view, c.options);
    }
  } catch (const qkv::shape_error& e) {
    if (expect_valid) fail(std::string("shape_error on a valid call: ") + e.what());
    threw = true;
  } catch (const std::exception& e) {
    fail(std::string("an exception other than shape_error: ") + e.what());
  } catch (...) {
    fail("a non-standard exception");
  }
  if (!expect_valid) {
    if (!threw)
      fail("an invalid call did not throw (corruption " + std::to_string(applied) + ", D " + std::to_string(c.D) +
           ", Hq " + std::to_string(c.Hq) + ", Hkv " + std::to_string(c.Hkv) + ")");
    auto same = [](const std::vector<float>& a, const std::vector<float>& b) {
      return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
    };
    if (!same(q_before, c.q.buffer) || !same(out_before, c.out.buffer) || !same(lse_before, c.lse_buffer)) {
      fail("a call that threw wrote to memory");
    }
    check_backward(c, false, applied);
    return;
  }
  check_valid_call(c);
  check_packed(c);
  check_backward(c, true, kNone);
}

// ---- the seed corpus -----------------------------------------------------------------------------------------------

/// Writes one input per option value and per corruption into `directory` (QKV_FUZZ_WRITE_SEEDS).
void write_seeds(const std::string& directory) {
  using Header = std::array<std::uint8_t, kHeaderBytes>;
  Header base{};
  base[kFieldB] = 0;         // B = 1
  base[kFieldHq] = 1;        // Hq = 2
  base[kFieldSq] = 6;        // Sq = 5
  base[kFieldSkv] = 0;       // Skv = 7
  base[kFieldD] = 3;         // D = 4
  base[kFieldDv] = 2;        // Dv = 3
  base[kFieldSeed0] = 0x5e;  // values from seed 0x5e
  int written = 0;
  auto emit = [&](const std::string& name, const Header& header, const std::vector<std::uint8_t>& tail = {}) {
    std::ofstream file(directory + "/seed_" + name, std::ios::binary);
    file.write(reinterpret_cast<const char*>(header.data()), static_cast<std::streamsize>(header.size()));
    file.write(reinterpret_cast<const char*>(tail.data()), static_cast<std::streamsize>(tail.size()));
    if (!file) fail("cannot write " + directory + "/" + name);
    ++written;
  };
  auto with = [&](std::initializer_list<std::pair<int, int>> fields) {
    Header h = base;
    for (const auto& [field, value] : fields) h[static_cast<std::size_t>(field)] = static_cast<std::uint8_t>(value);
    return h;
  };
  emit("plain", base);
  emit("empty_query", with({{kFieldSq, 1}}));
  emit("empty_key", with({{kFieldSkv, 1}}));
  emit("dv_zero", with({{kFieldDv, 12}}));
  emit("batch_zero", with({{kFieldB, 8}}));
  emit("heads_zero", with({{kFieldHq, 8}}));
  emit("gqa_4_2_batch_2", with({{kFieldB, 1}, {kFieldHq, 3}, {kFieldHkv, 1}, {kFieldSq, 16}, {kFieldSkv, 26}}));
  emit("mqa_3_1", with({{kFieldHq, 2}, {kFieldHkv, 0}, {kFieldSq, 3}}));
  emit("gqa_not_dividing", with({{kFieldHq, 2}, {kFieldHkv, 5}}));
  emit("head_dim_zero", with({{kFieldD, 24}}));
  for (int layout = 1; layout < 12; layout += 1) {
    if (layout == 4 || layout == 5 || layout == 8 || layout == 9) continue;  // same layout as a smaller number
    emit("layout_" + std::to_string(layout), with({{kFieldLayout, layout}, {kFieldB, 1}, {kFieldHq, 3}}));
  }
  for (int scale = 1; scale < 9; ++scale) emit("scale_" + std::to_string(scale), with({{kFieldScale, scale}}));
  for (int softcap = 1; softcap < 5; ++softcap)
    emit("softcap_" + std::to_string(softcap), with({{kFieldSoftcap, softcap}}));
  emit("causal_bottom_right", with({{kFieldCausal, 1}, {kFieldSq, 4}, {kFieldSkv, 13}}));
  emit("causal_top_left", with({{kFieldCausal, 3}, {kFieldSq, 13}, {kFieldSkv, 4}}));
  emit("window_bottom_right", with({{kFieldWindowLeft, 5}, {kFieldWindowRight, 3}, {kFieldSkv, 20}}));
  emit("window_top_left_causal_global",
       with({{kFieldCausal, 3}, {kFieldWindowLeft, 3}, {kFieldGlobalTokens, 3}, {kFieldSq, 20}, {kFieldSkv, 20}}));
  emit("key_lengths", with({{kFieldB, 1}, {kFieldKeyLengths, 1}, {kFieldCausal, 1}, {kFieldPoison, 1}}));
  emit("allowed", with({{kFieldAllowed, 1 | (1 << 5)}, {kFieldPoison, 1}}));
  emit("allowed_broadcast", with({{kFieldB, 1}, {kFieldAllowed, 1 | (5 << 2)}, {kFieldLayout, 2}}));
  emit("allowed_all_false", with({{kFieldAllowed, 1 | (3 << 5)}, {kFieldLse, 1}}));
  emit("bias", with({{kFieldBias, 1 | (1 << 5)}, {kFieldPoison, 3}}));
  emit("bias_broadcast_large", with({{kFieldBias, 1 | (6 << 2) | (4 << 5)}}));
  emit("bias_specials", with({{kFieldBias, 1 | (1 << 5)}, {kFieldSpecials, 3}}), {3, 0, 5, 2, 3, 0, 9, 4, 3, 0, 17, 3});
  emit("alibi", with({{kFieldAlibi, 1}, {kFieldCausal, 1}, {kFieldSeed1, 3}}));
  emit("sinks", with({{kFieldSinks, 1}, {kFieldLse, 1}, {kFieldAllowed, 1 | (2 << 5)}}));
  for (int varlen = 5; varlen < 8; ++varlen) {
    emit("varlen_" + std::to_string(varlen - 4),
         with({{kFieldVarlen, varlen}, {kFieldSq, 20}, {kFieldSkv, 24}, {kFieldCausal, 1}, {kFieldLse, 1}}));
  }
  emit("backend_fused", with({{kFieldBackend, 1}, {kFieldLse, 1}}));
  emit("backend_reference", with({{kFieldBackend, 2}, {kFieldLse, 1}}));
  emit("magnitudes", with({{kFieldMagnitude, 128 | 3 | (3 << 2) | (2 << 4)}}));
  emit("tiny_values", with({{kFieldMagnitude, 128 | 1 | (1 << 2) | (1 << 4)}}));
  emit("specials_qkv", with({{kFieldSpecials, 4}}), {0, 0, 3, 4, 1, 0, 7, 2, 2, 0, 11, 5, 0, 0, 20, 7});
  emit("poison_causal",
       with({{kFieldCausal, 1}, {kFieldSq, 3}, {kFieldSkv, 16}, {kFieldWindowLeft, 3}, {kFieldPoison, 5}}));
  for (int corruption = 1; corruption < kCorruptionCount; ++corruption) {
    emit("corruption_" + std::to_string(corruption), with({{kFieldCorruption, 3 * (corruption - 1) + 2},
                                                           {kFieldCorruptionParameter, corruption},
                                                           {kFieldB, corruption % 2}}));
  }
  // 16-bit K and V (kFieldStorage: 0x08 half, 0x18 bfloat16).
  constexpr int kHalf = 0x08, kBFloat16 = 0x18;
  emit("storage_half", with({{kFieldStorage, kHalf}, {kFieldLse, 1}}));
  emit("storage_bfloat16", with({{kFieldStorage, kBFloat16}, {kFieldLse, 1}}));
  emit("storage_half_backend_reference", with({{kFieldStorage, kHalf}, {kFieldBackend, 2}, {kFieldLse, 1}}));
  emit("storage_bfloat16_backend_fused", with({{kFieldStorage, kBFloat16}, {kFieldBackend, 1}, {kFieldLse, 1}}));
  emit(
      "storage_half_gqa_bshd_packed",  // B = 1, dense BSHD: the packed Eigen entry point is checked too
      with(
          {{kFieldStorage, kHalf}, {kFieldLayout, 1}, {kFieldHq, 3}, {kFieldHkv, 1}, {kFieldSq, 16}, {kFieldSkv, 26}}));
  emit("storage_bfloat16_padded_layout",
       with({{kFieldStorage, kBFloat16}, {kFieldLayout, 7}, {kFieldB, 1}, {kFieldHq, 3}}));
  // k: 65504 (half's largest), 1e15 and −2.5e7 (±∞ in half), 1e-45 (0 in half); v: NaN.
  emit("storage_half_specials", with({{kFieldStorage, kHalf}, {kFieldSpecials, 5}}),
       {1, 0, 3, 10, 1, 0, 9, 7, 1, 0, 21, 11, 1, 0, 14, 9, 2, 0, 5, 4});
  emit("storage_half_magnitudes", with({{kFieldStorage, kHalf}, {kFieldMagnitude, 128 | (2 << 2) | (1 << 4)}}));
  emit("storage_bfloat16_magnitudes", with({{kFieldStorage, kBFloat16}, {kFieldMagnitude, 128 | (3 << 2) | (2 << 4)}}));
  emit("storage_half_poison", with({{kFieldStorage, kHalf},
                                    {kFieldCausal, 1},
                                    {kFieldSq, 3},
                                    {kFieldSkv, 16},
                                    {kFieldWindowLeft, 3},
                                    {kFieldPoison, 5}}));
  emit("storage_bfloat16_varlen",
       with({{kFieldStorage, kBFloat16}, {kFieldVarlen, 6}, {kFieldSq, 20}, {kFieldSkv, 24}, {kFieldCausal, 1}}));
  emit("storage_half_masks", with({{kFieldStorage, kHalf},
                                   {kFieldAllowed, 1 | (1 << 5)},
                                   {kFieldBias, 1 | (1 << 5)},
                                   {kFieldKeyLengths, 1},
                                   {kFieldB, 1},
                                   {kFieldPoison, 3}}));
  emit("storage_bfloat16_alibi_sinks_softcap",
       with({{kFieldStorage, kBFloat16}, {kFieldAlibi, 1}, {kFieldSinks, 1}, {kFieldSoftcap, 2}, {kFieldCausal, 3}}));
  for (int corruption : {int(kKHeadDimMismatch), int(kVSequenceMismatch), int(kKNegativeStride), int(kLseWrongExtent),
                         int(kOutOverlapsQ), int(kWindowLeftBelowMinusOne)}) {
    emit("storage_16_corruption_" + std::to_string(corruption),
         with({{kFieldStorage, corruption % 2 ? kHalf : kBFloat16},
               {kFieldCorruption, 3 * (corruption - 1) + 2},
               {kFieldCorruptionParameter, corruption}}));
  }
  // The backward (issue 17): the four bytes after the special values (BackwardByte): mode, corruption, parameter,
  // layout. Mode bit 0 calls attention_backward; 2: d_bias; 4: d_sinks; 8: a non-finite d_out element (16: +∞).
  using Tail = std::vector<std::uint8_t>;
  const auto backward = [](int mode, int corruption = 0, int parameter = 0, int layout = 0) {
    return Tail{static_cast<std::uint8_t>(mode), static_cast<std::uint8_t>(corruption),
                static_cast<std::uint8_t>(parameter), static_cast<std::uint8_t>(layout)};
  };
  emit("backward_plain", base, backward(1));
  emit("backward_gqa_4_2_batch_2", with({{kFieldB, 1}, {kFieldHq, 3}, {kFieldHkv, 1}, {kFieldSq, 16}, {kFieldSkv, 26}}),
       backward(1));
  emit("backward_mqa_3_1", with({{kFieldHq, 2}, {kFieldHkv, 0}, {kFieldSq, 3}}), backward(1));
  emit("backward_causal_bottom_right", with({{kFieldCausal, 1}, {kFieldSq, 4}, {kFieldSkv, 13}}), backward(1));
  emit("backward_causal_empty_rows", with({{kFieldCausal, 1}, {kFieldSq, 14}, {kFieldSkv, 5}}), backward(1));
  emit("backward_causal_top_left", with({{kFieldCausal, 3}, {kFieldSq, 13}, {kFieldSkv, 4}}), backward(1));
  emit("backward_window_top_left_causal_global",
       with({{kFieldCausal, 3}, {kFieldWindowLeft, 3}, {kFieldGlobalTokens, 3}, {kFieldSq, 20}, {kFieldSkv, 20}}),
       backward(1));
  emit("backward_masks_poison_d_bias",
       with({{kFieldAllowed, 1 | (1 << 5)},
             {kFieldBias, 1 | (1 << 5)},
             {kFieldKeyLengths, 1},
             {kFieldB, 1},
             {kFieldPoison, 3}}),
       backward(1 | 2));
  emit("backward_bias_broadcast_d_bias", with({{kFieldB, 1}, {kFieldBias, 1 | (6 << 2)}}), backward(1 | 2));
  emit("backward_alibi_sinks_softcap_d_sinks",
       with({{kFieldAlibi, 1}, {kFieldSinks, 1}, {kFieldSoftcap, 2}, {kFieldCausal, 3}, {kFieldLse, 1}}),
       backward(1 | 4));
  emit("backward_sinks_bias_all_extras", with({{kFieldSinks, 1}, {kFieldBias, 1 | (1 << 5)}, {kFieldLse, 1}}),
       backward(1 | 2 | 4));
  emit("backward_varlen", with({{kFieldVarlen, 6}, {kFieldSq, 20}, {kFieldSkv, 24}, {kFieldCausal, 1}}), backward(1));
  emit("backward_layouts", with({{kFieldLayout, 7}, {kFieldB, 1}, {kFieldHq, 3}, {kFieldLse, 1 | 4}}),
       backward(1, 0, 0, (5 << 4) | 7));
  emit("backward_layouts_bshd", with({{kFieldLayout, 1}, {kFieldHq, 3}}), backward(1, 0, 0, (3 << 4) | 1));
  emit("backward_backend_fused", with({{kFieldBackend, 1}, {kFieldLse, 1}}), backward(1));
  emit("backward_backend_reference", with({{kFieldBackend, 2}}), backward(1));
  emit("backward_scale_zero", with({{kFieldScale, 1}}), backward(1));
  emit("backward_softcap_small", with({{kFieldSoftcap, 4}}), backward(1));
  emit("backward_d_out_nan", with({{kFieldB, 1}, {kFieldHq, 3}}), backward(1 | 8, 0, 5));
  emit("backward_d_out_infinite", with({{kFieldHq, 3}, {kFieldHkv, 0}}), backward(1 | 8 | 16, 0, 9));
  {
    Tail tail = {0, 0, 3, 4, 1, 0, 7, 2, 2, 0, 11, 5, 0, 0, 20, 7};  // specials_qkv's: ±∞, NaN in q, k and v
    const Tail bytes = backward(1);
    tail.insert(tail.end(), bytes.begin(), bytes.end());
    emit("backward_specials_qkv", with({{kFieldSpecials, 4}}), tail);
  }
  emit("backward_magnitudes", with({{kFieldMagnitude, 128 | 3 | (3 << 2) | (2 << 4)}}), backward(1));
  emit("backward_tiny_values", with({{kFieldMagnitude, 128 | 1 | (1 << 2) | (1 << 4)}}), backward(1));
  emit("backward_storage_half", with({{kFieldStorage, 0x08}, {kFieldLse, 1}}), backward(1));
  emit("backward_poison_causal",
       with({{kFieldCausal, 1}, {kFieldSq, 3}, {kFieldSkv, 16}, {kFieldWindowLeft, 3}, {kFieldPoison, 5}}),
       backward(1));
  emit("backward_empty_query", with({{kFieldSq, 1}}), backward(1));
  emit("backward_empty_key", with({{kFieldSkv, 1}}), backward(1));
  emit("backward_dv_zero", with({{kFieldDv, 12}}), backward(1));
  emit("backward_batch_zero", with({{kFieldB, 8}}), backward(1));
  emit("backward_heads_zero", with({{kFieldHq, 8}}), backward(1));
  // Invalid forward calls: the backward must throw too.
  emit("backward_gqa_not_dividing", with({{kFieldHq, 2}, {kFieldHkv, 5}}), backward(1));
  emit("backward_head_dim_zero", with({{kFieldD, 24}}), backward(1));
  for (int corruption : {int(kScaleNaN), int(kKHeadDimMismatch), int(kCuSeqlensBatchNotOne), int(kOutWrongExtent),
                         int(kLseWrongExtent), int(kQNullData), int(kKNegativeStride), int(kSinksWrongCount)}) {
    emit("backward_forward_corruption_" + std::to_string(corruption),
         with({{kFieldCorruption, 3 * (corruption - 1) + 2}, {kFieldCorruptionParameter, corruption}}), backward(1));
  }
  // Every backward corruption, and the two forms of kDBiasWrong and kDSinksWrong (with and without the option).
  for (int corruption = 1; corruption < kBackwardCorruptionCount; ++corruption) {
    emit("backward_corruption_" + std::to_string(corruption), with({{kFieldB, corruption % 2}}),
         backward(1, 3 * (corruption - 1) + 2, corruption));
  }
  emit("backward_corruption_d_bias_extent", with({{kFieldBias, 1 | (1 << 5)}}),
       backward(1 | 2, 3 * (kDBiasWrong - 1) + 2, 2));
  emit("backward_corruption_d_sinks_count", with({{kFieldSinks, 1}}), backward(1 | 4, 3 * (kDSinksWrong - 1) + 2));
  emit("backward_corruption_d_bias_overlaps_d_q", with({{kFieldBias, 1 | (1 << 5)}}),
       backward(1 | 2, 3 * (kDBiasOverlapsDQ - 1) + 2));
  std::fprintf(stderr, "fuzz_attention: wrote %d seeds into %s\n", written, directory.c_str());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  if (const char* directory = std::getenv("QKV_FUZZ_WRITE_SEEDS")) {
    write_seeds(directory);
    std::exit(0);
  }
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  run(data, size);
  return 0;
}
