// bench/ab/ab_fused.cpp — an in-process A/B of the fused kernel: two versions of the headers in one binary.
//
// Built by scripts/ab_fused.sh, which exports revision A's include/ as is and revision B's include/ as B/qkv/..., then
// compiles this file with `#define qkv qkv_b` around B's headers, so the two kernels live in the namespaces qkv and
// qkv_b. Of the kernel's API only public names that exist at d44d50d are used (attention, view_bhsd, view_bshd,
// TensorView, AttentionOptions, isa_name), so a revision from then on can be either side (bench/fma_loop.hpp, the
// speed modes' peak, also reads A's qkv::simd). The backward modes also call attention_backward and set the dropout
// options, which exist from 116a439 on: they are compiled only with QKV_AB_BACKWARD defined (the script defines it
// for those modes alone), so that the forward modes still build against older revisions. Likewise the decode mode
// calls the 16-bit overloads of attention (c220239 on) and is compiled only with QKV_AB_DECODE (defined for --decode
// alone), and the micro-kernel mode names the decoding micro-kernels of the pass this build's -march reaches (37e39c7
// on) and is compiled only with QKV_AB_MICRO (defined for --micro alone). Modes:
//
//   ab_fused D T rounds causal     speed: B = 1, H = 8, Sq = Skv = T, one thread (QKV_AB_THREADS=N: N threads, in a
//                                  build with -fopenmp; the FMA loop stays on one). Calls alternate A, B (B, A on odd
//                                  rounds) on the same inputs, each round after a register-only FMA loop, so both
//                                  versions see the same machine: on a shared machine whose speed drifts by ±20 % over
//                                  minutes, the ratio of two interleaved versions is repeatable where two separate
//                                  benchmark runs are not. Prints, per version, the best and the median GFLOPS (4·D
//                                  per visible (query, key) pair per head, as bench_attention counts) and their ratio
//                                  to the run's best round of the FMA loop, and the median over rounds of the
//                                  version's GFLOPS over that round's FMA loop ("per round", as the decode mode takes
//                                  its per-round shares: a single fast round of the loop moves it by at most one rank;
//                                  with an even number of rounds, the upper middle one); how many rounds B was faster;
//                                  how many outputs differ in their bits (a NaN on one side counts) and the largest
//                                  finite difference.
//   ab_fused --bits [--perturb] [NAME...]
//                                  bit check: every case of kShapes × kPresets (or those whose name contains one of
//                                  NAME) through both versions, with lse at 1 and 2 OpenMP threads and once without
//                                  lse. One line per case with the bits in which B's out and lse differ from A's, and
//                                  those in which a 2-thread or lse-less call differs from the same version's 1-thread
//                                  call (0 as well, by the library's promise); exits 1 if any differ. --perturb flips
//                                  the lowest bit of B's out[0] and lse[0] in every case: a self-test that the check
//                                  sees one ulp (every line must then read 1 and 1, and the run exit 1).
//   ab_fused --time NAME [rounds]  speed of one case (default 10 rounds, one thread), interleaved as above: best and
//                                  median milliseconds per version, B / A, rounds B won.
//   ab_fused --list                the case names.
//   ab_fused --backward [T D causal rounds dropout_p]
//                                  speed of the fused backward (defaults 4096 128 0 10 0): B = 1, H = 8, Sq = Skv = T,
//                                  D = Dv, BHSD views, one thread (QKV_AB_THREADS as in speed mode); dropout_p > 0 adds
//                                  dropout (the dropout case's seed and offset, the forward's too). The forward's out
//                                  and lse are computed once, by A; then qkv::attention_backward of A and B alternate
//                                  on the same inputs as in speed mode (A first on even rounds), each round after the
//                                  FMA loop. Prints the median milliseconds of each version and the median of the
//                                  per-round ratios B / A (a ratio per round cancels the machine's drift between
//                                  rounds, which a ratio of medians would not); how many rounds B won; whether dQ, dK
//                                  and dV of A and B are bit-identical, and where not, the largest difference relative
//                                  to max |gradient|.
//   ab_fused --backward-bits [--perturb] [NAME...]
//                                  bit check of the backward: every case of kBackwardShapes × kBackwardPresets (or
//                                  those whose name contains one of NAME). Per case the forward's out and lse are
//                                  computed once, by A at one thread, so that both backwards read the same inputs;
//                                  then each version runs the backward at 1 and 2 OpenMP threads. One line per case
//                                  with the bits in which B's dQ, dK and dV differ from A's, and those in which a
//                                  2-thread call differs from the same version's 1-thread call; exits 1 if any differ.
//                                  --perturb flips the lowest bit of B's first non-NaN dQ, dK and dV: every line must
//                                  then read 1, 1 and 1, and the run exit 1.
//   ab_fused --backward-list       the backward case names.
//   ab_fused --decode [layout storage Skv rounds [cached] [D=N] [Hq=N]]  (the last three in any order)
//                                  speed of one decoding step (defaults bshd f16 32768 16): B = 1, Sq = 1, Hq = 32 (or
//                                  N, a multiple of 8), Hkv = 8, D = Dv = 128 (or N), fused, one thread (QKV_AB_THREADS
//                                  as in speed mode); layout bshd (token-major) or bhsd; K and V stored as float, f16
//                                  (Eigen::half) or bf16 (Eigen::bfloat16), rounded once from random normal floats; q
//                                  and out float. A and B alternate as in --backward, but with no FMA loop before each
//                                  round (QKV_AB_DECODE_FMA=1: one before each round, as until the thirty-ninth session
//                                  of bench/README.md, which found that it slowed some forms' reads from L3 more than
//                                  others'), each call after an untimed read of 128 MiB (so that neither finds K and V
//                                  in the cache the other left); each round then times a read loop over A's K and V
//                                  (their bytes, where they lie; as many threads; prepared like the calls). Prints the
//                                  median microseconds of each version with the GB/s of K and V it reads
//                                  (2·Skv·Hkv·D·sizeof(storage) bytes per call) and its share of the read loop (the
//                                  issue's decode measure, taken in one process: the median of the per-round ratios
//                                  read loop / call, and the ratio of the two medians, which is how
//                                  scripts/plot_bench.py takes float rows; where they differ, the rounds spread; for
//                                  16-bit K and V this loop reads their own bytes, not a float loop's), the read loop's
//                                  median, the median of the per-round ratios B / A with their range, how many rounds B
//                                  won, and whether A's and B's outputs are bit-identical. With `cached`, each timed
//                                  call (and read loop) comes right after an untimed one of its own instead of the read
//                                  of 128 MiB: K and V then come from the cache where they fit (Skv = 2048 in float is
//                                  16 MiB), which is the micro-kernels' speed rather than the memory's.
//   ab_fused --micro [keys rounds] the decoding micro-kernels alone (defaults 1024 100): Q·Kᵀ and P·V of one kv head
//                                  (4 query rows, D = Dv = 128, float K and V head-major) over `keys` keys, as a
//                                  head-major decoding task calls them: without a cursor over blocks of 1024 keys (an
//                                  unpaced task), and with a PrefetchCursor over the next call's rows in calls of 32
//                                  keys (a paced one); A's and B's of the pass config.hpp picks for the build's -march.
//                                  Each form of A and B alternates as in --backward, between two FMA loops, on the
//                                  same inputs and output buffers. Prints per form each side's median share of the FMA
//                                  loop timed right after its pair, the median of the per-round ratios B / A, the
//                                  rounds B won and whether the scores or outputs are bit-identical (exit 1 if not).
//                                  With K and V in L1 (64 keys), L2 (1024) or L3 (16384), it times the micro-kernels
//                                  apart from the rest of a decoding call. Against itself A's and B's cursor forms
//                                  have differed with where their copy's code lies (bench/README.md, "2026-12-07,
//                                  thirty-eighth session"): pair a change beside its own A = B run.
#include <algorithm>
#include <array>
#include <bitset>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <memory>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../fma_loop.hpp"   // A's qkv::simd, before A's macros are undefined
#include "../read_loop.hpp"  // likewise
#include "qkv/qkv.hpp"
#include "undef_a.hpp"  // written by the script: #undef of every QKV_ macro A's headers define
#define qkv qkv_b
#include "B/qkv/qkv.hpp"
#undef qkv

namespace {

using Index = qkv::Index;
constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

double now() { return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count(); }

// The register-only FMA loop of bench/fma_loop.hpp (as BM_FmaPeak): the ISA's peak, in GFLOPS.
double fma_loop_gflops() {
  constexpr std::int64_t kIterations = 1 << 22;
  volatile float x = 0.999999f;  // read at run time: the loop cannot be folded
  const double t0 = now();
  volatile float sink = qkv_bench::fma_chains(kIterations, x);
  const double t1 = now();
  (void)sink;
  return 2.0 * qkv_bench::kFmaChains * qkv::simd::BestTag::kLanes * double(kIterations) / (t1 - t0) * 1e-9;
}

// One round of A and B measured by `measure`: A first on even rounds, B first on odd ones, so that neither version
// always runs second.
template <class Measure, class RunA, class RunB>
void interleaved_round(int r, const Measure& measure, const RunA& run_a, const RunB& run_b, std::vector<double>& a,
                       std::vector<double>& b) {
  if (r % 2 == 0) {
    a.push_back(measure(run_a));
    b.push_back(measure(run_b));
  } else {
    b.push_back(measure(run_b));
    a.push_back(measure(run_a));
  }
}

// `rounds` interleaved rounds and the per-round ratios B / A (a ratio per round cancels the machine's drift between
// rounds, which a ratio of medians would not): the backward, decode and micro-kernel speed modes. Each round begins
// with before_round(), the FMA loop unless the caller passes another (the decode mode runs none: see
// decode_speed_mode), and ends with after_round(), which the decode mode uses to time its read loop in the same round.
struct PairedRounds {
  std::vector<double> a, b, ratio;
  int b_faster = 0;
};
struct NoOp {
  void operator()() const {}
};
struct FmaLoop {
  void operator()() const { fma_loop_gflops(); }
};
template <class Measure, class RunA, class RunB, class AfterRound = NoOp, class BeforeRound = FmaLoop>
PairedRounds paired_rounds(int rounds, const Measure& measure, const RunA& run_a, const RunB& run_b,
                           const AfterRound& after_round = NoOp(), const BeforeRound& before_round = FmaLoop()) {
  PairedRounds p;
  for (int r = 0; r < rounds; ++r) {
    before_round();
    interleaved_round(r, measure, run_a, run_b, p.a, p.b);
    p.ratio.push_back(p.b.back() / p.a.back());  // this round's pair, whichever ran first
    p.b_faster += p.b.back() < p.a.back();
    after_round();
  }
  return p;
}

double median_of(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

void print_ratios(const PairedRounds& p) {
  std::printf("B / A: median of the per-round ratios %.3f (range %.3f-%.3f); B faster in %d of %zu rounds\n",
              median_of(p.ratio), *std::min_element(p.ratio.begin(), p.ratio.end()),
              *std::max_element(p.ratio.begin(), p.ratio.end()), p.b_faster, p.ratio.size());
}

// Sets the calling thread's OpenMP team size for the next qkv call (the kernel uses omp_get_max_threads()).
void set_threads(int n) {
#if defined(_OPENMP)
  omp_set_num_threads(n);
#else
  (void)n;
#endif
}

// The speed modes' threads per call: QKV_AB_THREADS=N (a build with -fopenmp in QKV_AB_FLAGS), else 1. Their FMA loop
// stays on one thread.
int speed_threads() {
  const char* threads = std::getenv("QKV_AB_THREADS");
  return threads != nullptr ? std::max(1, std::atoi(threads)) : 1;
}

// The threads a qkv call would run now (after set_threads): one in a build without OpenMP, whatever was asked.
int call_threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

// Outputs whose bits differ (a NaN on one side counts; max would skip it), the bits in which they differ, and the
// largest finite difference. Two NaNs count as equal, and apart, in nan_payload: IEEE 754 leaves the sign and payload
// of a NaN result to the implementation (x86 keeps the first operand's, so they follow the compiler's operand order),
// and qkv promises NaN, not which NaN.
struct BitDiff {
  std::size_t values = 0;
  std::size_t bits = 0;
  std::size_t nan_payload = 0;
  double max_finite = 0;
  BitDiff& operator+=(const BitDiff& other) {
    values += other.values;
    bits += other.bits;
    nan_payload += other.nan_payload;
    max_finite = std::max(max_finite, other.max_finite);
    return *this;
  }
};

BitDiff compare_bits(const std::vector<float>& x, const std::vector<float>& y) {
  BitDiff diff;
  for (std::size_t i = 0; i < x.size(); ++i) {
    std::uint32_t a, b;
    std::memcpy(&a, &x[i], sizeof a);
    std::memcpy(&b, &y[i], sizeof b);
    if (a == b) continue;
    if (std::isnan(x[i]) && std::isnan(y[i])) {
      ++diff.nan_payload;
      continue;
    }
    ++diff.values;
    diff.bits += std::bitset<32>(a ^ b).count();
    const double d = std::fabs(double(x[i]) - double(y[i]));
    if (std::isfinite(d)) diff.max_finite = std::max(diff.max_finite, d);
  }
  return diff;
}

// ---------------------------------------------------------------------------------------------------------------------
// Speed mode: B = 1, H = 8, Sq = Skv = T, no options but `causal`, one thread (as before the bit check existed).

int speed_mode(long D, long T, int rounds, bool causal) {
  const long H = 8;
  std::vector<float> q(H * T * D), k(H * T * D), v(H * T * D), out_a(H * T * D), out_b(H * T * D);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = normal(rng);

  set_threads(speed_threads());
  qkv::AttentionOptions<float> options_a;
  options_a.backend = qkv::Backend::fused;
  options_a.causal = causal;
  qkv_b::AttentionOptions<float> options_b;
  options_b.backend = qkv_b::Backend::fused;
  options_b.causal = causal;
  const auto run_a = [&] {
    qkv::attention(qkv::view_bhsd(q.data(), 1, H, T, D), qkv::view_bhsd(k.data(), 1, H, T, D),
                   qkv::view_bhsd(v.data(), 1, H, T, D), qkv::view_bhsd(out_a.data(), 1, H, T, D), options_a);
  };
  const auto run_b = [&] {
    qkv_b::attention(qkv_b::view_bhsd(q.data(), 1, H, T, D), qkv_b::view_bhsd(k.data(), 1, H, T, D),
                     qkv_b::view_bhsd(v.data(), 1, H, T, D), qkv_b::view_bhsd(out_b.data(), 1, H, T, D), options_b);
  };
  const double pairs = causal ? double(T) * double(T + 1) / 2.0 : double(T) * double(T);
  const double flops = 4.0 * double(D) * pairs * double(H);
  const auto gflops = [&](auto&& f) {
    const double t0 = now();
    f();
    return flops / (now() - t0) * 1e-9;
  };

  run_a();  // warm-up: page faults of the outputs and of both kernels' scratch
  run_b();
  std::vector<double> peak, a, b;
  for (int r = 0; r < rounds; ++r) {
    peak.push_back(fma_loop_gflops());
    interleaved_round(r, gflops, run_a, run_b, a, b);
  }
  int b_faster = 0;
  for (int r = 0; r < rounds; ++r) b_faster += b[static_cast<std::size_t>(r)] > a[static_cast<std::size_t>(r)];
  const BitDiff diff = compare_bits(out_a, out_b);

  const double best_peak = *std::max_element(peak.begin(), peak.end());
  // Per version: its best and median against the run's best round of the FMA loop, and (not for the loop itself) the
  // median of its shares of the FMA loop timed at the start of the same round (before both calls), so that the share
  // follows the machine's drift.
  const auto report = [&](const char* name, const std::vector<double>& x, bool per_round) {
    const double best = *std::max_element(x.begin(), x.end()), median = median_of(x);
    std::printf("D=%ld T=%ld causal=%d %-9s best %6.1f GFLOPS (%.3f of the FMA loop)  median %6.1f (%.3f)", D, T,
                int(causal), name, best, best / best_peak, median, median / best_peak);
    if (per_round) {
      std::vector<double> share;
      for (std::size_t r = 0; r < x.size(); ++r) share.push_back(x[r] / peak[r]);
      std::printf("  per round %.3f", median_of(share));
    }
    std::printf("\n");
  };
  report("FMA loop", peak, false);
  report("A", a, true);
  report("B", b, true);
  std::printf("B faster in %d of %d rounds; outputs whose bits differ: %zu of %zu; max finite |out_A - out_B| = %g\n",
              b_faster, rounds, diff.values, out_a.size(), diff.max_finite);
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------------
// Cases: a shape × an option preset. Each shape is chosen for a path of the kernel (tile boundaries, GQA, split-K,
// the decoding path, odd D and Dv, both layouts); each preset for an option or a numerical edge of it.

enum class Layout { bhsd, bshd };

struct Shape {
  const char* name;
  Index B, Hq, Hkv, Sq, Skv, D, Dv;
  Layout layout;
};

// Split-K starts above 2048 keys with a single query tile; decoding (K and V read in place) at Sq·G ≤ 16, and with
// more than 4 rows (M = Sq·G) a task of one kv head takes them over whole blocks in calls of 8 (AVX-512) and of at most
// 4; a task of several token-major kv heads, in calls of at most 4 over sub-blocks of kDecodeGroupKeys keys.
constexpr Shape kShapes[] = {
    {"prefill300", 2, 4, 2, 300, 300, 64, 64, Layout::bhsd},      // several query and key tiles, GQA 2, B = 2
    {"prefill200x520", 1, 4, 1, 200, 520, 64, 64, Layout::bshd},  // Sq < Skv, MQA
    {"prefill260x100", 1, 2, 2, 260, 100, 32, 48, Layout::bhsd},  // Sq > Skv (bottom-right causal: empty rows)
    {"odd33x77", 2, 6, 2, 33, 77, 80, 72, Layout::bshd},          // odd sizes, D ≠ Dv, GQA 3
    // Prefill groups (fused_attention.hpp, run_prefill_group): D + Dv = 120 floats a key (4.1 MiB of K and V per kv
    // head), chunks of 4096 keys on AVX-512 (512-key tiles; the last of three 808 keys), 4352 on AVX2 and the scalar
    // kernel (256-key tiles); G = 2, 48 rows per tile, 9 tiles: groups of 8 and 1 on one thread, 2 on two.
    {"prefill_group", 1, 4, 2, 400, 9000, 64, 56, Layout::bhsd},
    {"decode4096", 2, 32, 8, 1, 4096, 128, 128, Layout::bshd},    // decoding, GQA 32/8, split-K in 2 chunks
    {"decode5000", 1, 32, 8, 1, 5000, 128, 128, Layout::bhsd},    // decoding, split-K with a short last chunk
    {"short3x5000", 1, 16, 2, 3, 5000, 128, 128, Layout::bshd},   // prefill path (Sq·G = 24 rows), split-K
    {"short3x5000_mha", 1, 4, 4, 3, 5000, 64, 64, Layout::bhsd},  // decoding path (Sq·G = 3), split-K
    // Decoding with M > 4 rows: M = 16 (G = 8, Sq = 2), split-K with a last chunk of 953 keys (an odd last key);
    // key_lengths gives it an unsplit sequence of 2001 keys. Token-major: one task of both kv heads, row groups of 4;
    // head-major: one task per kv head, on AVX-512 two calls of 8 rows (decode_kernels.hpp, kQkDecodeRows).
    {"decode_m16", 2, 16, 2, 2, 3001, 128, 128, Layout::bshd},
    {"decode_m16_bhsd", 2, 16, 2, 2, 3001, 128, 128, Layout::bhsd},
    // M = 12 (G = 12): 8 rows and 4 on AVX-512, split-K in 3 chunks (the last 406 keys: 2 past the last multiple of 4),
    // D and Dv with tails.
    {"decode_m12_odd", 1, 24, 2, 1, 4502, 81, 75, Layout::bhsd},
    // M = 6 (row groups 4 + 2; G = 6), split-K in 3 chunks (the last 405 keys), D and Dv with tails on every ISA
    // (81 = 5·16 + 1, 75 = 9·8 + 3 = 4·16 + 11; 80 and 72 would leave none on AVX2).
    {"decode_m6_odd", 1, 12, 2, 1, 4501, 81, 75, Layout::bhsd},
};

enum class Preset {
  none,
  causal_bottom_right,
  causal_top_left,
  window_global,
  window_causal,
  bias,
  bias_huge,
  allowed,
  alibi,
  softcap,
  sinks,
  varlen,
  key_lengths,
  post_scale,
  post_scale_q,
  base_e,
  nan_visible,
  nan_visible_sinks,
  bias_huge_late,
  dropout,         // backward cases only
  dropout_causal,  // backward cases only
  nan_window,      // backward cases only
};

struct PresetName {
  Preset preset;
  const char* name;
};

constexpr PresetName kPresets[] = {
    {Preset::none, "none"},
    {Preset::causal_bottom_right, "causal_bottom_right"},
    {Preset::causal_top_left, "causal_top_left"},
    {Preset::window_global, "window_global"},
    {Preset::window_causal, "window_causal"},
    {Preset::bias, "bias"},
    {Preset::bias_huge, "bias_huge"},
    {Preset::allowed, "allowed"},
    {Preset::alibi, "alibi"},
    {Preset::softcap, "softcap"},
    {Preset::sinks, "sinks"},
    {Preset::varlen, "varlen"},
    {Preset::key_lengths, "key_lengths"},
    {Preset::post_scale, "post_scale"},
    {Preset::post_scale_q, "post_scale_q"},
    {Preset::base_e, "base_e"},
    {Preset::nan_visible, "nan_visible"},
    {Preset::nan_visible_sinks, "nan_visible_sinks"},
    {Preset::bias_huge_late, "bias_huge_late"},
};

std::string case_name(const Shape& shape, const PresetName& preset) {
  return std::string(shape.name) + "/" + preset.name;
}

// One problem: inputs and options in neither namespace; make_options<Side> turns them into A's or B's options.
struct Problem : Shape {  // the shape's B is 1 for varlen
  std::vector<float> q, k, v;

  std::optional<float> scale;
  float softcap = 0;
  bool causal = false, top_left = false;
  Index window_left = -1, window_right = -1, global_tokens = 0;
  std::vector<Index> key_lengths, cu_seqlens_q, cu_seqlens_k;
  std::unique_ptr<bool[]> allowed;  // [B or 1, Hq or 1, Sq or 1, Skv], contiguous
  std::array<Index, 4> allowed_extents{};
  std::vector<float> bias;  // as `allowed`
  std::array<Index, 4> bias_extents{};
  std::vector<float> alibi_slopes, sinks;
  // Dropout, set by the backward cases alone: make_options leaves it out, as it builds against revisions without it.
  float dropout_p = 0;
  std::uint64_t dropout_seed = 0, dropout_offset = 0;
  // Whether poison_key writes its NaN and ∞. The forward cases always poison; the backward sends a task with a NaN or
  // ∞ anywhere in its keys, hidden or not, to its exact path, so its cases poison only where they mean to test that.
  bool poison_hidden = true;

  // Offset of element (b, h, s, d) of a [B, H, S, width] tensor in this problem's layout.
  Index offset(Index b, Index h, Index s, Index d, Index H, Index S, Index width) const {
    return layout == Layout::bhsd ? ((b * H + h) * S + s) * width + d : ((b * S + s) * H + h) * width + d;
  }
  float& q_at(Index b, Index h, Index i, Index d) { return q[static_cast<std::size_t>(offset(b, h, i, d, Hq, Sq, D))]; }
  float& k_at(Index b, Index h, Index j, Index d) {
    return k[static_cast<std::size_t>(offset(b, h, j, d, Hkv, Skv, D))];
  }
  float& v_at(Index b, Index h, Index j, Index d) {
    return v[static_cast<std::size_t>(offset(b, h, j, d, Hkv, Skv, Dv))];
  }
  // NaN in K and ∞ in V at key j of every kv head of batch entry b: a slot the options hide from every query, so
  // neither may reach the output (the kernel's exactness rule; it must hold on both sides alike).
  void poison_key(Index b, Index j) {
    if (!poison_hidden) return;
    for (Index h = 0; h < Hkv; ++h) {
      k_at(b, h, j, 0) = kNaN;
      v_at(b, h, j, Dv > 1 ? 1 : 0) = kInf;
    }
  }
  std::size_t out_size() const { return static_cast<std::size_t>(B * Hq * Sq * Dv); }
  std::size_t lse_size() const { return static_cast<std::size_t>(B * Hq * Sq); }
};

// Base inputs of a shape (normal q, k, v from a seed fixed per shape), generated once and copied into each preset.
struct BaseData {
  std::vector<float> q, k, v;
};

BaseData make_base(const Shape& shape, unsigned seed) {
  BaseData data;
  data.q.resize(static_cast<std::size_t>(shape.B * shape.Hq * shape.Sq * shape.D));
  data.k.resize(static_cast<std::size_t>(shape.B * shape.Hkv * shape.Skv * shape.D));
  data.v.resize(static_cast<std::size_t>(shape.B * shape.Hkv * shape.Skv * shape.Dv));
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  for (auto* x : {&data.q, &data.k, &data.v})
    for (auto& e : *x) e = normal(rng);
  return data;
}

// Splits `total` rows into 5 varlen sequences by a fixed pattern; `keys` picks the key pattern. Sequences (q rows,
// keys): one with half the keys and one more (split-K from 4096 keys on: 2049 keys make a last chunk of one key), one
// with keys but no query, two ordinary ones, and one with queries but no key (zero rows, lse −∞).
std::vector<Index> split_varlen(Index total, bool keys) {
  std::vector<Index> parts;
  if (keys) {
    const Index first = std::min<Index>(total, total / 2 + 1), second = std::min<Index>(3, total - first),
                third = (total - first - second) / 2;
    parts = {first, second, third, total - first - second - third, 0};
  } else {
    const Index first = (total + 3) / 4, third = (total - first) / 3, last = total - first - third >= 4 ? 2 : 0;
    parts = {first, 0, third, total - first - third - last, last};
  }
  std::vector<Index> cu{0};
  for (Index p : parts) cu.push_back(cu.back() + p);
  return cu;
}

// Sink logits per query head: a −∞ sink (no sink) at head 0, a large one at every third head from 1, small ones.
std::vector<float> sink_logits(Index Hq) {
  std::vector<float> sinks;
  for (Index h = 0; h < Hq; ++h) sinks.push_back(h == 0 ? -kInf : h % 3 == 1 ? 2.5f : -1.0f + 0.1f * float(h));
  return sinks;
}

// Fixed seeds: shape s's base data, and the random parts (bias, allowed) of its preset n.
unsigned shape_seed(std::size_t s) { return 1000u + static_cast<unsigned>(s); }
unsigned case_seed(std::size_t s, std::size_t n) {
  return 7u * static_cast<unsigned>(s) + 31u * static_cast<unsigned>(n);
}

Problem make_problem(const Shape& shape, Preset preset, const BaseData& base, unsigned seed,
                     bool poison_hidden = true) {
  Problem p;
  static_cast<Shape&>(p) = shape;
  p.poison_hidden = poison_hidden;
  if (preset == Preset::varlen) p.B = 1;  // varlen views have batch extent 1
  // The first p.B batch entries of the base data (both layouts keep batch entry 0 at the start).
  const auto take = [&](const std::vector<float>& from, std::vector<float>& to) {
    to.assign(from.begin(), from.begin() + static_cast<std::ptrdiff_t>(from.size() / shape.B * p.B));
  };
  take(base.q, p.q);
  take(base.k, p.k);
  take(base.v, p.v);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> uniform;

  switch (preset) {
    case Preset::none:
      break;
    case Preset::causal_bottom_right:
      p.causal = true;
      break;
    case Preset::causal_top_left:
      p.causal = true;
      p.top_left = true;
      // diag(i) = i: the last key is hidden from every query when Sq < Skv.
      if (p.Sq < p.Skv)
        for (Index b = 0; b < p.B; ++b) p.poison_key(b, p.Skv - 1);
      break;
    case Preset::window_global:  // a window around the bottom-right diagonal, both sides, without causal
      p.window_left = 31;
      p.window_right = 9;
      p.global_tokens = 4;
      break;
    case Preset::window_causal:  // the decoding case: the last 64 keys and 2 global ones
      p.causal = true;
      p.window_left = 63;
      p.global_tokens = 2;
      break;
    case Preset::bias: {  // [B, 1, Sq, Skv] (broadcast over heads), some −∞, an empty row, a key hidden everywhere
      p.bias_extents = {p.B, 1, p.Sq, p.Skv};
      p.bias.resize(static_cast<std::size_t>(p.B * p.Sq * p.Skv));
      for (auto& x : p.bias) x = uniform(rng) < 0.05f ? -kInf : 0.5f * normal(rng);
      const Index hidden = p.Skv / 3 + 1;
      for (Index b = 0; b < p.B; ++b) {
        for (Index i = 0; i < p.Sq; ++i) p.bias[static_cast<std::size_t>((b * p.Sq + i) * p.Skv + hidden)] = -kInf;
        p.poison_key(b, hidden);
      }
      if (p.Sq > 1) std::fill(p.bias.begin() + p.Skv, p.bias.begin() + 2 * p.Skv, -kInf);  // row 1 of b = 0
      break;
    }
    case Preset::bias_huge:  // [1, Hq, 1, Skv]; head 1 adds 2.5e38 at key 7: above FLT_MAX / log2 e, so base e
      p.bias_extents = {1, p.Hq, 1, p.Skv};
      p.bias.resize(static_cast<std::size_t>(p.Hq * p.Skv));
      for (auto& x : p.bias) x = 0.5f * normal(rng);
      if (p.Hq > 1 && p.Skv > 7) p.bias[static_cast<std::size_t>(p.Skv + 7)] = 2.5e38f;
      break;
    case Preset::allowed: {  // [1, Hq, Sq, Skv] (broadcast over batch), ~10 % false, an empty row, a hidden key
      p.allowed_extents = {1, p.Hq, p.Sq, p.Skv};
      const std::size_t n = static_cast<std::size_t>(p.Hq * p.Sq * p.Skv);
      p.allowed.reset(new bool[n]);
      for (std::size_t e = 0; e < n; ++e) p.allowed[e] = uniform(rng) >= 0.1f;
      const Index hidden = p.Skv / 3;
      for (Index e = 0; e < p.Hq * p.Sq; ++e) p.allowed[static_cast<std::size_t>(e * p.Skv + hidden)] = false;
      for (Index b = 0; b < p.B; ++b) p.poison_key(b, hidden);
      if (p.Sq > 1) std::fill(p.allowed.get() + p.Skv, p.allowed.get() + 2 * p.Skv, false);  // head 0, row 1
      break;
    }
    case Preset::alibi:
      for (Index h = 0; h < p.Hq; ++h) p.alibi_slopes.push_back(std::exp2(-8.0f * float(h + 1) / float(p.Hq)));
      break;
    case Preset::softcap:
      p.softcap = 5.0f;
      p.scale = 0.3f;
      break;
    case Preset::sinks:
      p.sinks = sink_logits(p.Hq);
      break;
    case Preset::varlen:
      p.causal = true;
      p.cu_seqlens_q = split_varlen(p.Sq, false);
      p.cu_seqlens_k = split_varlen(p.Skv, true);
      break;
    case Preset::key_lengths:  // lengths 2/3·Skv + 1, 0, Skv, … by batch entry; the padded keys poisoned
      p.causal = true;
      for (Index b = 0; b < p.B; ++b) {
        const Index pattern[] = {2 * p.Skv / 3 + 1, 0, p.Skv};
        const Index length = pattern[b % 3];
        p.key_lengths.push_back(length);
        if (length < p.Skv) {
          p.poison_key(b, length);
          p.poison_key(b, p.Skv - 1);
        }
      }
      break;
    case Preset::post_scale:  // scale·log2 e overflows float: Q is copied unscaled and the scores scaled after Q·Kᵀ
      p.scale = 3e38f;
      for (auto& x : p.k) x *= 2e-38f;  // q·k·scale stays of order 10
      break;
    case Preset::post_scale_q:  // q·scale overflows for q = 3e38 (component 1 of every 5th row; k's is 0)
      p.scale = 2.0f;
      for (Index b = 0; b < p.B; ++b)
        for (Index h = 0; h < p.Hq; ++h)
          for (Index i = 0; i < p.Sq; i += 5) p.q_at(b, h, i, 1) = 3e38f;
      for (Index b = 0; b < p.B; ++b)
        for (Index h = 0; h < p.Hkv; ++h)
          for (Index j = 0; j < p.Skv; ++j) p.k_at(b, h, j, 1) = 0.0f;
      break;
    case Preset::base_e:  // a huge finite key component that no query reads: the scores are ordinary, but the bound
                          // of base 2 fails, so every prefill task runs its softmax in base e
      for (Index b = 0; b < p.B; ++b) {
        for (Index h = 0; h < p.Hkv; ++h)
          for (Index j = 0; j < p.Skv; ++j) p.k_at(b, h, j, 0) = 3e38f;
        for (Index h = 0; h < p.Hq; ++h)
          for (Index i = 0; i < p.Sq; ++i) p.q_at(b, h, i, 0) = 0.0f;
      }
      break;
    case Preset::nan_visible:  // NaN and ∞ where every query sees them (no mask), so that rows come out NaN
    case Preset::nan_visible_sinks: {
      // Kv group (batch entry 0, kv head 0): NaN in q of head 0's last row (all of its scores NaN: the softmax's NaN
      // flag, in the last query tile); +∞ in q of the group's last head, row 0 (±∞ scores, a +∞ max: a NaN row);
      // +∞ in V at key Skv/3 (the group's other rows: +∞ outputs, through split-K merge and sinks as ∞).
      const Index G = p.Hq / p.Hkv;
      p.q_at(0, 0, p.Sq - 1, p.D / 2) = kNaN;
      p.q_at(0, G - 1, 0, 0) = kInf;
      p.v_at(0, 0, p.Skv / 3, p.Dv - 1) = kInf;
      // The last kv group (another one where there is one): NaN in K at key 3·Skv/4, among finite scores of every
      // row of the group (in split-K, a NaN chunk merged with finite ones).
      if (p.B > 1 || p.Hkv > 1) p.k_at(p.B - 1, p.Hkv - 1, 3 * p.Skv / 4, 1) = kNaN;
      if (preset == Preset::nan_visible_sinks) p.sinks = sink_logits(p.Hq);  // NaN rows through both sink branches
      break;
    }
    case Preset::bias_huge_late: {  // [1, Hq, Sq, Skv]; 2.5e38 at one (row, key) of the last head, late in its task
      // Query min(100, Sq − 1) (past the first query tile where Sq > 96), key min(600, Skv − 1) (past the first key
      // tile where Skv > 256): the prefill task aborts base 2 after its softmax state moved, and reruns in base e.
      // prefill_group (9000 keys): key 4500, in its groups' second chunk on every kernel, after the group's other tasks
      // took the first.
      p.bias_extents = {1, p.Hq, p.Sq, p.Skv};
      p.bias.resize(static_cast<std::size_t>(p.Hq * p.Sq * p.Skv));
      for (auto& x : p.bias) x = 0.5f * normal(rng);
      const Index i = std::min<Index>(100, p.Sq - 1), j = p.Skv == 9000 ? 4500 : std::min<Index>(600, p.Skv - 1);
      p.bias[static_cast<std::size_t>(((p.Hq - 1) * p.Sq + i) * p.Skv + j)] = 2.5e38f;
      break;
    }
    case Preset::dropout:  // p = 0.1, as in training; a seed and an offset that are not 0
    case Preset::dropout_causal:
      p.causal = preset == Preset::dropout_causal;
      p.dropout_p = 0.1f;
      p.dropout_seed = 0x243f6a8885a308d3u;
      p.dropout_offset = 7;
      break;
    case Preset::nan_window:  // NaN in K and ∞ in V where a causal window shows them to few rows, so that they reach
                              // some gradients and not others (nan_visible, unmasked, makes whole kv groups NaN).
      // Bottom-right causal with a 64-key window: row i sees keys i + Skv − Sq − 63 … i + Skv − Sq. Key
      // Skv − ⌈Sq/2⌉ is the diagonal of row ⌊Sq/2⌋ and key Skv − ⌈2·Sq/3⌉ of row ⌊Sq/3⌋, each seen by that row and
      // the 63 after it (up to Sq); where those keys fall before Skv/2 and Skv/3 (Sq ≥ Skv), keys Skv/2 and Skv/3
      // are used, seen by a band of late rows.
      p.causal = true;
      p.window_left = 63;
      p.global_tokens = 2;
      p.k_at(0, 0, std::max(p.Skv - (p.Sq + 1) / 2, p.Skv / 2), p.D - 1) = kNaN;
      p.v_at(p.B - 1, p.Hkv - 1, std::max(p.Skv - (2 * p.Sq + 2) / 3, p.Skv / 3), 0) = kInf;
      break;
  }
  return p;
}

// ---------------------------------------------------------------------------------------------------------------------
// The two sides: the same public calls, spelled once per namespace.

template <class Side>
typename Side::Options make_options(const Problem& p) {
  typename Side::Options o;
  using Backend = decltype(o.backend);
  using Alignment = decltype(o.alignment);
  o.backend = Backend::fused;
  o.scale = p.scale;
  o.softcap = p.softcap;
  o.causal = p.causal;
  o.alignment = p.top_left ? Alignment::top_left : Alignment::bottom_right;
  o.window_left = p.window_left;
  o.window_right = p.window_right;
  o.global_tokens = p.global_tokens;
  o.key_lengths = p.key_lengths;
  o.cu_seqlens_q = p.cu_seqlens_q;
  o.cu_seqlens_k = p.cu_seqlens_k;
  o.alibi_slopes = p.alibi_slopes;
  o.sinks = p.sinks;
  if (p.allowed) o.allowed = typename Side::template View4<const bool>(p.allowed.get(), p.allowed_extents);
  if (!p.bias.empty()) o.bias = typename Side::template View4<const float>(p.bias.data(), p.bias_extents);
  return o;
}

// Runs one call of Side's fused kernel on p; lse may be null (the overload without lse).
template <class Side>
void run(const Problem& p, const typename Side::Options& options, float* out, float* lse) {
  using View4 = typename Side::template View4<const float>;
  const View4 q = Side::view(p.q.data(), p.layout, p.B, p.Hq, p.Sq, p.D);
  const View4 k = Side::view(p.k.data(), p.layout, p.B, p.Hkv, p.Skv, p.D);
  const View4 v = Side::view(p.v.data(), p.layout, p.B, p.Hkv, p.Skv, p.Dv);
  const auto o = Side::view(out, p.layout, p.B, p.Hq, p.Sq, p.Dv);
  if (lse != nullptr) {
    Side::attention(q, k, v, o, typename Side::template View3<float>(lse, {p.B, p.Hq, p.Sq}), options);
  } else {
    Side::attention(q, k, v, o, options);
  }
}

// Each version's entry points, spelled once for both namespaces (qkv is A, qkv_b is B).
#define QKV_AB_SIDE(Side, ns)                                                                            \
  struct Side {                                                                                          \
    using Options = ns::AttentionOptions<float>;                                                         \
    template <class T>                                                                                   \
    using View4 = ns::TensorView4<T>;                                                                    \
    template <class T>                                                                                   \
    using View3 = ns::TensorView3<T>;                                                                    \
    template <class T>                                                                                   \
    static View4<T> view(T* data, Layout layout, Index B, Index H, Index S, Index D) {                   \
      return layout == Layout::bhsd ? ns::view_bhsd(data, B, H, S, D) : ns::view_bshd(data, B, S, H, D); \
    }                                                                                                    \
    template <class... Args>                                                                             \
    static void attention(const Args&... args) {                                                         \
      ns::attention(args...);                                                                            \
    }                                                                                                    \
  };
QKV_AB_SIDE(SideA, qkv)
QKV_AB_SIDE(SideB, qkv_b)
#undef QKV_AB_SIDE

// Outputs of one side: with lse at 1 thread (the reference of the comparisons), with lse at 2 threads, and without
// lse at 1 thread. Outputs start as NaN, so an element that one version leaves unwritten differs from the other's.
struct SideResult {
  std::vector<float> out1, lse1, out2, lse2, out_no_lse;
};

template <class Side>
SideResult run_side(const Problem& p) {
  const auto options = make_options<Side>(p);
  SideResult r;
  for (auto* x : {&r.out1, &r.out2, &r.out_no_lse}) x->assign(p.out_size(), kNaN);
  for (auto* x : {&r.lse1, &r.lse2}) x->assign(p.lse_size(), kNaN);
  set_threads(1);
  run<Side>(p, options, r.out1.data(), r.lse1.data());
  run<Side>(p, options, r.out_no_lse.data(), nullptr);
  set_threads(2);
  run<Side>(p, options, r.out2.data(), r.lse2.data());
  set_threads(1);
  return r;
}

bool matches(const std::string& name, const std::vector<std::string>& filters) {
  if (filters.empty()) return true;
  for (const auto& f : filters)
    if (name.find(f) != std::string::npos) return true;
  return false;
}

int bits_mode(const std::vector<std::string>& filters, bool perturb) {
#if defined(_OPENMP)
  const char* threads_note = "1 and 2 threads";
#else
  const char* threads_note = "1 thread only (built without OpenMP: the 2-thread call runs on one)";
#endif
  std::printf("bit check: A = qkv (%s), B = qkv_b (%s); each case with lse at %s, and without lse%s\n", qkv::isa_name(),
              qkv_b::isa_name(), threads_note, perturb ? "; --perturb: B's first non-NaN out and lse flipped" : "");
  std::printf(
      "two NaNs count as equal (their sign and payload are the implementation's); differences in them are\n"
      "noted after the line\n");
  // Columns: the bits in which B's out and lse differ from A's (over the three calls); the bits in which a 2-thread or
  // lse-less call differs from the same version's 1-thread call; then what A's output holds (NaN values, rows with
  // lse −∞, i.e. rows that see no key), to show a case is not degenerate.
  std::printf("%-40s %-48s %8s %8s %8s %8s %8s\n", "case", "shape", "out bits", "lse bits", "threads", "NaN out",
              "-inf lse");
  int cases = 0, failed = 0;
  for (std::size_t s = 0; s < std::size(kShapes); ++s) {
    const Shape& shape = kShapes[s];
    bool any = false;
    for (const PresetName& preset : kPresets) any = any || matches(case_name(shape, preset), filters);
    if (!any) continue;
    const BaseData base = make_base(shape, shape_seed(s));
    for (std::size_t n = 0; n < std::size(kPresets); ++n) {
      const std::string name = case_name(shape, kPresets[n]);
      if (!matches(name, filters)) continue;
      const Problem p = make_problem(shape, kPresets[n].preset, base, case_seed(s, n));
      const SideResult a = run_side<SideA>(p);
      SideResult b = run_side<SideB>(p);
      // Each version's 2-thread and lse-less calls against its own 1-thread call: thread-count identity and the
      // lse overload, which must hold on each side anyway.
      BitDiff self;
      for (const SideResult* r : {&a, static_cast<const SideResult*>(&b)}) {
        self += compare_bits(r->out1, r->out2);
        self += compare_bits(r->lse1, r->lse2);
        self += compare_bits(r->out1, r->out_no_lse);
      }
      if (perturb) {  // the self-test: one ulp in B's first non-NaN output and lse
        for (auto* x : {&b.out1, &b.lse1}) {
          const auto first = std::find_if(x->begin(), x->end(), [](float e) { return !std::isnan(e); });
          if (first == x->end()) continue;
          std::uint32_t u;
          std::memcpy(&u, &*first, sizeof u);
          u ^= 1u;
          std::memcpy(&*first, &u, sizeof u);
        }
      }
      // B against A, at each configuration.
      BitDiff out = compare_bits(a.out1, b.out1), lse = compare_bits(a.lse1, b.lse1);
      out += compare_bits(a.out2, b.out2);
      lse += compare_bits(a.lse2, b.lse2);
      out += compare_bits(a.out_no_lse, b.out_no_lse);
      const bool ok = out.bits == 0 && lse.bits == 0 && self.bits == 0;
      ++cases;
      failed += !ok;
      char shape_text[96];
      std::snprintf(shape_text, sizeof shape_text, "B=%td Hq=%td Hkv=%td Sq=%td Skv=%td D=%td Dv=%td %s", p.B, p.Hq,
                    p.Hkv, p.Sq, p.Skv, p.D, p.Dv, p.layout == Layout::bhsd ? "bhsd" : "bshd");
      const auto nan_values = std::count_if(a.out1.begin(), a.out1.end(), [](float x) { return std::isnan(x); });
      const auto empty_rows = std::count(a.lse1.begin(), a.lse1.end(), -kInf);
      std::printf("%-4s %-35s %-48s %8zu %8zu %8zu %8td %8td", ok ? "ok" : "DIFF", name.c_str(), shape_text, out.bits,
                  lse.bits, self.bits, nan_values, empty_rows);
      if (!ok) {
        std::printf("   (values: out %zu, lse %zu, threads/lse %zu; max finite |A - B| %g)", out.values, lse.values,
                    self.values, std::max(out.max_finite, lse.max_finite));
      }
      const std::size_t nan_payload = out.nan_payload + lse.nan_payload + self.nan_payload;
      if (nan_payload > 0) std::printf("   (NaN sign or payload differs in %zu NaN values)", nan_payload);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (cases == 0) {
    std::fprintf(stderr, "no case matches the given names (--list shows them)\n");
    return 2;
  }
  std::printf("%d of %d cases differ in their bits\n", failed, cases);
  return failed == 0 ? 0 : 1;
}

// Times one case, A and B interleaved as in speed mode, one thread.
int time_mode(const std::string& wanted, int rounds) {
  for (std::size_t s = 0; s < std::size(kShapes); ++s) {
    for (std::size_t n = 0; n < std::size(kPresets); ++n) {
      if (case_name(kShapes[s], kPresets[n]) != wanted) continue;
      const BaseData base = make_base(kShapes[s], shape_seed(s));
      const Problem p = make_problem(kShapes[s], kPresets[n].preset, base, case_seed(s, n));
      const auto options_a = make_options<SideA>(p);
      const auto options_b = make_options<SideB>(p);
      std::vector<float> out_a(p.out_size()), out_b(p.out_size());
      set_threads(1);
      const auto seconds = [&](auto&& f) {
        const double t0 = now();
        f();
        return now() - t0;
      };
      const auto run_a = [&] { run<SideA>(p, options_a, out_a.data(), nullptr); };
      const auto run_b = [&] { run<SideB>(p, options_b, out_b.data(), nullptr); };
      run_a();  // warm-up
      run_b();
      std::vector<double> a, b;
      int b_faster = 0;
      for (int r = 0; r < rounds; ++r) {
        fma_loop_gflops();
        interleaved_round(r, seconds, run_a, run_b, a, b);
        b_faster += b.back() < a.back();
      }
      std::sort(a.begin(), a.end());
      std::sort(b.begin(), b.end());
      const std::size_t m = a.size() / 2;
      std::printf("%s, one thread, %d rounds\n", wanted.c_str(), rounds);
      std::printf("A best %9.3f ms  median %9.3f ms\n", a[0] * 1e3, a[m] * 1e3);
      std::printf("B best %9.3f ms  median %9.3f ms   B / A: best %.3f, median %.3f\n", b[0] * 1e3, b[m] * 1e3,
                  b[0] / a[0], b[m] / a[m]);
      std::printf("B faster in %d of %d rounds; outputs whose bits differ: %zu of %zu\n", b_faster, rounds,
                  compare_bits(out_a, out_b).values, out_a.size());
      return 0;
    }
  }
  std::fprintf(stderr, "no case named %s (--list shows them)\n", wanted.c_str());
  return 2;
}

#if defined(QKV_AB_BACKWARD)
// ---------------------------------------------------------------------------------------------------------------------
// The backward modes. Compiled only with QKV_AB_BACKWARD (the script defines it for them): attention_backward and the
// dropout options exist from 116a439 on, and the forward modes must still build against older revisions.

// Each version's backward entry point, beside its forward ones.
#define QKV_AB_BACKWARD_SIDE(Side, Base, ns)              \
  struct Side : Base {                                    \
    template <class... Args>                              \
    static void attention_backward(const Args&... args) { \
      ns::attention_backward<float>(args...);             \
    }                                                     \
  };
QKV_AB_BACKWARD_SIDE(BackwardA, SideA, qkv)
QKV_AB_BACKWARD_SIDE(BackwardB, SideB, qkv_b)
#undef QKV_AB_BACKWARD_SIDE

// Gradients of one backward call, and how they differ between two calls.
struct Gradients {
  std::vector<float> d_q, d_k, d_v;
};

struct GradientDiff {
  BitDiff d_q, d_k, d_v;
  std::size_t bits() const { return d_q.bits + d_k.bits + d_v.bits; }
  std::size_t values() const { return d_q.values + d_k.values + d_v.values; }
  std::size_t nan_payload() const { return d_q.nan_payload + d_k.nan_payload + d_v.nan_payload; }
  GradientDiff& operator+=(const GradientDiff& other) {
    d_q += other.d_q;
    d_k += other.d_k;
    d_v += other.d_v;
    return *this;
  }
};

GradientDiff compare_gradients(const Gradients& x, const Gradients& y) {
  return {compare_bits(x.d_q, y.d_q), compare_bits(x.d_k, y.d_k), compare_bits(x.d_v, y.d_v)};
}

// The largest finite |x|: the scale against which a difference of gradients is read.
double max_abs_finite(const std::vector<float>& x) {
  double m = 0;
  for (float e : x)
    if (std::isfinite(e)) m = std::max(m, double(std::fabs(e)));
  return m;
}

// Speed of the backward: B = 1, H = 8, Sq = Skv = T, D = Dv, BHSD, one thread; out and lse from A's forward, with the
// same dropout as the backward's.
int backward_speed_mode(long T, long D, bool causal, int rounds, float dropout_p) {
  const long H = 8;
  const std::size_t n = static_cast<std::size_t>(H * T * D);
  std::vector<float> q(n), k(n), v(n), d_out(n), out(n), lse(static_cast<std::size_t>(H * T));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (auto* x : {&q, &k, &v, &d_out})
    for (auto& e : *x) e = normal(rng);

  set_threads(speed_threads());
  qkv::AttentionOptions<float> options_a;
  options_a.backend = qkv::Backend::fused;
  options_a.causal = causal;
  qkv_b::AttentionOptions<float> options_b;
  options_b.backend = qkv_b::Backend::fused;
  options_b.causal = causal;
  if (dropout_p > 0) {  // the driver's dropout case's seed and offset, in the forward and the backward alike
    options_a.dropout_p = options_b.dropout_p = dropout_p;
    options_a.dropout_seed = options_b.dropout_seed = 0x243f6a8885a308d3u;
    options_a.dropout_offset = options_b.dropout_offset = 7;
  }
  qkv::attention(qkv::view_bhsd(q.data(), 1, H, T, D), qkv::view_bhsd(k.data(), 1, H, T, D),
                 qkv::view_bhsd(v.data(), 1, H, T, D), qkv::view_bhsd(out.data(), 1, H, T, D),
                 qkv::TensorView3<float>(lse.data(), {1, H, T}), options_a);

  Gradients a_grad{std::vector<float>(n), std::vector<float>(n), std::vector<float>(n)}, b_grad = a_grad;
  const auto run_a = [&] {
    qkv::attention_backward(qkv::view_bhsd(q.data(), 1, H, T, D), qkv::view_bhsd(k.data(), 1, H, T, D),
                            qkv::view_bhsd(v.data(), 1, H, T, D), qkv::view_bhsd(out.data(), 1, H, T, D),
                            qkv::TensorView3<const float>(lse.data(), {1, H, T}),
                            qkv::view_bhsd(d_out.data(), 1, H, T, D), qkv::view_bhsd(a_grad.d_q.data(), 1, H, T, D),
                            qkv::view_bhsd(a_grad.d_k.data(), 1, H, T, D),
                            qkv::view_bhsd(a_grad.d_v.data(), 1, H, T, D), options_a);
  };
  const auto run_b = [&] {
    qkv_b::attention_backward(
        qkv_b::view_bhsd(q.data(), 1, H, T, D), qkv_b::view_bhsd(k.data(), 1, H, T, D),
        qkv_b::view_bhsd(v.data(), 1, H, T, D), qkv_b::view_bhsd(out.data(), 1, H, T, D),
        qkv_b::TensorView3<const float>(lse.data(), {1, H, T}), qkv_b::view_bhsd(d_out.data(), 1, H, T, D),
        qkv_b::view_bhsd(b_grad.d_q.data(), 1, H, T, D), qkv_b::view_bhsd(b_grad.d_k.data(), 1, H, T, D),
        qkv_b::view_bhsd(b_grad.d_v.data(), 1, H, T, D), options_b);
  };
  const auto seconds = [&](auto&& f) {
    const double t0 = now();
    f();
    return now() - t0;
  };

  run_a();  // warm-up: page faults of the gradients and of both kernels' scratch
  run_b();
  const PairedRounds p = paired_rounds(rounds, seconds, run_a, run_b);
  std::printf(
      "backward T=%ld D=%ld causal=%d (B = 1, H = 8, BHSD), %d thread%s, %d rounds; A = qkv (%s), B = qkv_b (%s)\n", T,
      D, int(causal), call_threads(), call_threads() == 1 ? "" : "s", rounds, qkv::isa_name(), qkv_b::isa_name());
  std::printf("A median %9.3f ms\n", median_of(p.a) * 1e3);
  std::printf("B median %9.3f ms\n", median_of(p.b) * 1e3);
  print_ratios(p);
  const GradientDiff diff = compare_gradients(a_grad, b_grad);
  if (diff.bits() == 0) {
    std::printf("dQ, dK, dV of A and B: bit-identical\n");
    return 0;
  }
  std::printf("dQ, dK, dV of A and B differ in their bits:\n");
  const std::pair<const char*, std::pair<const BitDiff*, const std::vector<float>*>> parts[] = {
      {"dQ", {&diff.d_q, &a_grad.d_q}}, {"dK", {&diff.d_k, &a_grad.d_k}}, {"dV", {&diff.d_v, &a_grad.d_v}}};
  for (const auto& [name, part] : parts) {
    const double scale = max_abs_finite(*part.second);
    std::printf("  %s %zu of %zu values, max finite |A - B| / max finite |A| = %.3g\n", name, part.first->values, n,
                scale > 0 ? part.first->max_finite / scale : part.first->max_finite);
  }
  return 0;
}

// Backward cases: a shape × a preset. The kernel's tiles are query blocks of 64 rows and key tiles of 128 keys
// (detail/fused_backward.hpp), its panels 16 keys on AVX2 and 64 on AVX-512: each shape is chosen for boundaries of
// those, for GQA or MQA, for D and Dv with or without tails, and both layouts. Threads share (sequence, kv head)
// tasks, so every shape has at least two for the 2-thread call to share.
constexpr Shape kBackwardShapes[] = {
    {"bwd300_gqa", 2, 8, 2, 300, 300, 64, 64, Layout::bhsd},      // 2·128 + 44 keys, 4·64 + 44 rows; GQA 4, B = 2
    {"bwd77x300_mqa", 2, 8, 1, 77, 300, 128, 128, Layout::bshd},  // Sq < Skv, MQA, D = 128 (B = 2: a second task)
    {"bwd300x77_d40", 1, 4, 4, 300, 77, 40, 40, Layout::bhsd},    // Sq > Skv (bottom-right causal: empty rows), D = 40
    {"bwd256_d128", 1, 8, 2, 256, 256, 128, 128, Layout::bshd},   // whole blocks and tiles only, GQA 4, D = 128
    // Many key tiles (1000 = 7·128 + 104) for few rows; D and Dv with tails on every ISA (81 = 5·16 + 1,
    // 75 = 4·16 + 11 = 9·8 + 3), D ≠ Dv; GQA 3.
    {"bwd33x1000_odd", 2, 6, 2, 33, 1000, 81, 75, Layout::bshd},
};

// Backward presets: an option preset of the forward cases (or dropout), and whether hidden keys hold NaN in K and ∞
// in V. Index-only masks (causal, window, global tokens, key lengths) run the vector loops over each row's runs of
// visible keys; bias, `allowed`, ALiBi and softcap the element-by-element loop; a task with any NaN or ∞ in what it
// reads (bias_nan: a hidden poisoned key; nan_window: a NaN and an ∞ that some rows see) the exact path.
struct BackwardPreset {
  Preset preset;
  const char* name;
  bool poison_hidden;
};

constexpr BackwardPreset kBackwardPresets[] = {
    {Preset::none, "none", false},
    {Preset::causal_bottom_right, "causal_bottom_right", false},
    {Preset::causal_top_left, "causal_top_left", false},
    {Preset::window_global, "window_global", false},
    {Preset::window_causal, "window_causal", false},
    {Preset::key_lengths, "key_lengths", true},  // the poisoned keys are padding, which the kernel never reads
    {Preset::bias, "bias", false},
    {Preset::bias, "bias_nan", true},
    {Preset::allowed, "allowed", false},
    {Preset::alibi, "alibi", false},
    {Preset::softcap, "softcap", false},
    {Preset::sinks, "sinks", false},
    {Preset::varlen, "varlen", false},
    {Preset::dropout, "dropout", false},
    {Preset::dropout_causal, "dropout_causal", false},
    {Preset::nan_window, "nan_window", false},
};

std::string case_name(const Shape& shape, const BackwardPreset& preset) {
  return std::string(shape.name) + "/" + preset.name;
}

// A backward problem: the forward's problem, its out and lse (A's forward at one thread), and d_out.
struct BackwardProblem {
  Problem p;
  std::vector<float> out, lse, d_out;
};

// Side's options for p: the forward's, with dropout.
template <class Side>
typename Side::Options make_backward_options(const Problem& p) {
  auto o = make_options<Side>(p);
  o.dropout_p = p.dropout_p;
  o.dropout_seed = p.dropout_seed;
  o.dropout_offset = p.dropout_offset;
  return o;
}

BackwardProblem make_backward_problem(const Shape& shape, const BackwardPreset& preset, const BaseData& base,
                                      unsigned seed) {
  BackwardProblem bp{make_problem(shape, preset.preset, base, seed, preset.poison_hidden), {}, {}, {}};
  const Problem& p = bp.p;
  bp.out.assign(p.out_size(), kNaN);
  bp.lse.assign(p.lse_size(), kNaN);
  set_threads(1);
  run<SideA>(p, make_backward_options<SideA>(p), bp.out.data(), bp.lse.data());
  bp.d_out.resize(p.out_size());
  std::mt19937 rng(seed + 1u);
  std::normal_distribution<float> normal;
  for (auto& e : bp.d_out) e = normal(rng);
  return bp;
}

// One backward call of Side on bp at `threads` OpenMP threads; the gradients start as NaN, so an element that one
// version leaves unwritten differs from the other's.
template <class Side>
Gradients run_backward(const BackwardProblem& bp, const typename Side::Options& options, int threads) {
  const Problem& p = bp.p;
  Gradients g;
  g.d_q.assign(p.q.size(), kNaN);
  g.d_k.assign(p.k.size(), kNaN);
  g.d_v.assign(p.v.size(), kNaN);
  using View3 = typename Side::template View3<const float>;
  set_threads(threads);
  Side::attention_backward(
      Side::view(p.q.data(), p.layout, p.B, p.Hq, p.Sq, p.D), Side::view(p.k.data(), p.layout, p.B, p.Hkv, p.Skv, p.D),
      Side::view(p.v.data(), p.layout, p.B, p.Hkv, p.Skv, p.Dv),
      Side::view(bp.out.data(), p.layout, p.B, p.Hq, p.Sq, p.Dv), View3(bp.lse.data(), {p.B, p.Hq, p.Sq}),
      Side::view(bp.d_out.data(), p.layout, p.B, p.Hq, p.Sq, p.Dv),
      Side::view(g.d_q.data(), p.layout, p.B, p.Hq, p.Sq, p.D),
      Side::view(g.d_k.data(), p.layout, p.B, p.Hkv, p.Skv, p.D),
      Side::view(g.d_v.data(), p.layout, p.B, p.Hkv, p.Skv, p.Dv), options);
  set_threads(1);
  return g;
}

int backward_bits_mode(const std::vector<std::string>& filters, bool perturb) {
#if defined(_OPENMP)
  const char* threads_note = "1 and 2 threads";
#else
  const char* threads_note = "1 thread only (built without OpenMP: the 2-thread call runs on one)";
#endif
  std::printf("backward bit check: A = qkv (%s), B = qkv_b (%s); each case at %s, out and lse from A's forward%s\n",
              qkv::isa_name(), qkv_b::isa_name(), threads_note,
              perturb ? "; --perturb: B's first non-NaN dQ, dK and dV flipped" : "");
  std::printf(
      "two NaNs count as equal (their sign and payload are the implementation's); differences in them are\n"
      "noted after the line\n");
  // Columns: the bits in which B's dQ, dK and dV differ from A's (at 1 and 2 threads); the bits in which a 2-thread
  // call differs from the same version's 1-thread call; then NaN gradients of A and rows with lse −∞ (rows that see
  // no key), to show a case is not degenerate.
  std::printf("%-40s %-48s %8s %8s %8s %8s %8s %8s\n", "case", "shape", "dQ bits", "dK bits", "dV bits", "threads",
              "NaN grad", "-inf lse");
  int cases = 0, failed = 0;
  for (std::size_t s = 0; s < std::size(kBackwardShapes); ++s) {
    const Shape& shape = kBackwardShapes[s];
    bool any = false;
    for (const BackwardPreset& preset : kBackwardPresets) any = any || matches(case_name(shape, preset), filters);
    if (!any) continue;
    const BaseData base = make_base(shape, 2000u + static_cast<unsigned>(s));
    for (std::size_t n = 0; n < std::size(kBackwardPresets); ++n) {
      const BackwardPreset& preset = kBackwardPresets[n];
      const std::string name = case_name(shape, preset);
      if (!matches(name, filters)) continue;
      const BackwardProblem bp = make_backward_problem(shape, preset, base, case_seed(s, n) + 5000u);
      const auto options_a = make_backward_options<BackwardA>(bp.p);
      const auto options_b = make_backward_options<BackwardB>(bp.p);
      const Gradients a1 = run_backward<BackwardA>(bp, options_a, 1), a2 = run_backward<BackwardA>(bp, options_a, 2);
      Gradients b1 = run_backward<BackwardB>(bp, options_b, 1);
      const Gradients b2 = run_backward<BackwardB>(bp, options_b, 2);
      // Each version's 2-thread call against its own 1-thread call: the library promises the same bits.
      GradientDiff self = compare_gradients(a1, a2);
      self += compare_gradients(b1, b2);
      if (perturb) {  // the self-test: one ulp in B's first non-NaN dQ, dK and dV
        for (auto* x : {&b1.d_q, &b1.d_k, &b1.d_v}) {
          const auto first = std::find_if(x->begin(), x->end(), [](float e) { return !std::isnan(e); });
          if (first == x->end()) continue;
          std::uint32_t u;
          std::memcpy(&u, &*first, sizeof u);
          u ^= 1u;
          std::memcpy(&*first, &u, sizeof u);
        }
      }
      GradientDiff diff = compare_gradients(a1, b1);
      diff += compare_gradients(a2, b2);
      const bool ok = diff.bits() == 0 && self.bits() == 0;
      ++cases;
      failed += !ok;
      const Problem& p = bp.p;
      char shape_text[96];
      std::snprintf(shape_text, sizeof shape_text, "B=%td Hq=%td Hkv=%td Sq=%td Skv=%td D=%td Dv=%td %s", p.B, p.Hq,
                    p.Hkv, p.Sq, p.Skv, p.D, p.Dv, p.layout == Layout::bhsd ? "bhsd" : "bshd");
      std::ptrdiff_t nan_values = 0;
      for (const auto* x : {&a1.d_q, &a1.d_k, &a1.d_v})
        nan_values += std::count_if(x->begin(), x->end(), [](float e) { return std::isnan(e); });
      const auto empty_rows = std::count(bp.lse.begin(), bp.lse.end(), -kInf);
      std::printf("%-4s %-35s %-48s %8zu %8zu %8zu %8zu %8td %8td", ok ? "ok" : "DIFF", name.c_str(), shape_text,
                  diff.d_q.bits, diff.d_k.bits, diff.d_v.bits, self.bits(), nan_values, empty_rows);
      if (!ok) {
        std::printf("   (values: dQ %zu, dK %zu, dV %zu, threads %zu; max finite |A - B| %g)", diff.d_q.values,
                    diff.d_k.values, diff.d_v.values, self.values(),
                    std::max({diff.d_q.max_finite, diff.d_k.max_finite, diff.d_v.max_finite}));
      }
      const std::size_t nan_payload = diff.nan_payload() + self.nan_payload();
      if (nan_payload > 0) std::printf("   (NaN sign or payload differs in %zu NaN values)", nan_payload);
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  if (cases == 0) {
    std::fprintf(stderr, "no case matches the given names (--backward-list shows them)\n");
    return 2;
  }
  std::printf("%d of %d cases differ in their bits\n", failed, cases);
  return failed == 0 ? 0 : 1;
}
#endif  // QKV_AB_BACKWARD

/// n elements of S in a std::vector's storage, starting where the vector puts them (`offset` null or empty) or
/// `offset` bytes (a decimal count, a multiple of sizeof(S) below 64) past the first 64-byte boundary in it; a copy
/// of `other` so placed when constructed from it. The decode mode's K and V (and the micro-kernel mode's arrays): where
/// their rows start against the cache lines moves decode's speed (bench/README.md, "2026-12-06, thirtieth session").
/// Exits with a message for any other offset.
template <class S>
class PlacedArray {
 public:
  PlacedArray(std::size_t n, const char* offset) : store_(n + 128 / sizeof(S)), n_(n) {
    first_ = store_.data();  // up to 63 bytes to the boundary and 63 past it: 128 bytes of room
    if (offset != nullptr && *offset != '\0') {
      char* end = nullptr;
      const long bytes = std::strtol(offset, &end, 10);
      if (*end != '\0' || bytes < 0 || bytes >= 64 || bytes % static_cast<long>(sizeof(S)) != 0) {
        std::fprintf(stderr, "ab_fused: a K/V offset must be a multiple of %zu bytes below 64, not \"%s\"\n", sizeof(S),
                     offset);
        std::exit(2);
      }
      const auto address = reinterpret_cast<std::uintptr_t>(store_.data());
      first_ = reinterpret_cast<S*>((address + 63) / 64 * 64 + static_cast<std::uintptr_t>(bytes));
    }
  }
  PlacedArray(const PlacedArray& other, const char* offset) : PlacedArray(other.n_, offset) {
    std::copy(other.begin(), other.end(), first_);
  }
  PlacedArray(const PlacedArray&) = delete;
  PlacedArray& operator=(const PlacedArray&) = delete;
  S* data() const noexcept { return first_; }
  S* begin() const noexcept { return first_; }
  S* end() const noexcept { return first_ + n_; }
  /// Bytes past the last 64-byte boundary at or before the first element.
  int offset() const noexcept { return static_cast<int>(reinterpret_cast<std::uintptr_t>(first_) % 64); }

 private:
  std::vector<S> store_;
  std::size_t n_;
  S* first_;
};

#if defined(QKV_AB_DECODE)
// ---------------------------------------------------------------------------------------------------------------------
// The decode speed mode. Compiled only with QKV_AB_DECODE (the script defines it for --decode alone): the 16-bit
// overloads of attention (K and V as Eigen::half or Eigen::bfloat16) exist from c220239 on, and the other modes must
// still build against older revisions.

// Speed of one decoding step: B = 1, Sq = 1, Hq = 32, Hkv = 8, D = Dv (128 unless given), Skv keys, K and V stored as
// S (rounded once from random normal floats), q and out float, one thread (QKV_AB_THREADS as in speed mode); A and B
// alternate as in the backward's speed mode, and each round then times the read loop over A's K and V
// (bench/read_loop.hpp), prepared as the calls are: each side's share of it is printed as the median of the per-round
// ratios read loop / call and as the ratio of the medians.
template <class S>
int decode_speed_mode(Layout layout, const char* storage, long Skv, int rounds, bool cached, long D, long Hq) {
  const long Hkv = 8;
  const std::size_t kv_size = static_cast<std::size_t>(Skv * Hkv * D);
  std::vector<float> q(static_cast<std::size_t>(Hq * D)), out_a(q.size(), kNaN), out_b(q.size(), kNaN);
  // K and V where a std::vector puts them (16 bytes past a page, for glibc's large blocks), or QKV_AB_KV_OFFSET bytes
  // past a 64-byte boundary; QKV_AB_B_KV_OFFSET gives side B a copy of its own so placed (PlacedArray).
  PlacedArray<S> k(kv_size, std::getenv("QKV_AB_KV_OFFSET")), v(kv_size, std::getenv("QKV_AB_KV_OFFSET"));
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (auto& e : q) e = normal(rng);
  for (auto* x : {&k, &v})
    for (auto& e : *x) e = S(normal(rng));  // rounded to the storage type once
  const char* b_offset = std::getenv("QKV_AB_B_KV_OFFSET");
  if (b_offset != nullptr && *b_offset == '\0') b_offset = nullptr;
  std::optional<PlacedArray<S>> k_copy, v_copy;
  if (b_offset != nullptr) {
    k_copy.emplace(k, b_offset);
    v_copy.emplace(v, b_offset);
  }
  const PlacedArray<S>& k_of_b = b_offset != nullptr ? *k_copy : k;
  const PlacedArray<S>& v_of_b = b_offset != nullptr ? *v_copy : v;
  std::printf("K and V %d and %d bytes past a 64-byte boundary for A, %d and %d for B\n", k.offset(), v.offset(),
              k_of_b.offset(), v_of_b.offset());

  set_threads(speed_threads());
  const int threads = call_threads();  // the calls' and the read loop's
  SideA::Options options_a;
  options_a.backend = qkv::Backend::fused;
  SideB::Options options_b;
  options_b.backend = qkv_b::Backend::fused;
  const auto q_a = SideA::view(static_cast<const float*>(q.data()), layout, 1, Hq, 1, D);
  const auto k_a = SideA::view(static_cast<const S*>(k.data()), layout, 1, Hkv, Skv, D);
  const auto v_a = SideA::view(static_cast<const S*>(v.data()), layout, 1, Hkv, Skv, D);
  const auto o_a = SideA::view(out_a.data(), layout, 1, Hq, 1, D);
  const auto q_b = SideB::view(static_cast<const float*>(q.data()), layout, 1, Hq, 1, D);
  const auto k_b = SideB::view(static_cast<const S*>(k_of_b.data()), layout, 1, Hkv, Skv, D);
  const auto v_b = SideB::view(static_cast<const S*>(v_of_b.data()), layout, 1, Hkv, Skv, D);
  const auto o_b = SideB::view(out_b.data(), layout, 1, Hq, 1, D);
  const auto run_a = [&] { SideA::attention(q_a, k_a, v_a, o_a, options_a); };
  const auto run_b = [&] { SideB::attention(q_b, k_b, v_b, o_b, options_b); };
  // Before each call, untimed, a read of 128 MiB (4 times this machine's 32 MiB L3): otherwise the second call of a
  // round finds what the first left of K and V in the cache (all of them at Skv = 2048 in float), and the per-round
  // ratios alternate with the order (about 0.85 and 1.2 at Skv = 2048, float). Decoding reads its cache from memory.
  // With `cached`, an untimed call of the same side instead, so that the timed one finds K and V where it left them.
  std::vector<float> evict(cached ? 0 : std::size_t(32) << 20, 1.0f);
  const auto seconds = [&](auto&& f) {
    if (cached) {
      f();
    } else {
      volatile float sink = std::accumulate(evict.begin(), evict.end(), 0.0f);
      (void)sink;
    }
    const double t0 = now();
    f();
    return now() - t0;
  };

  // The read loop over the bytes A's calls read, timed like them (after the eviction, or after an untimed pass).
  const std::size_t kv_floats = kv_size * sizeof(S) / sizeof(float);
  const auto read_kv = [&] {
    volatile float sink = qkv_bench::read_floats(reinterpret_cast<const float*>(k.data()), kv_floats, threads) +
                          qkv_bench::read_floats(reinterpret_cast<const float*>(v.data()), kv_floats, threads);
    (void)sink;
  };
  std::vector<double> read;
  run_a();  // warm-up: page faults of both kernels' scratch
  run_b();
  read_kv();
  // No FMA loop before each round, unless QKV_AB_DECODE_FMA=1 (the form of this mode until the thirty-ninth session of
  // bench/README.md): after the loop's 9 ms of register FMAs this core read L3 more slowly for a while, and not every
  // form alike. From L3 (head-major float, Skv = 2048, cached) the unpaced form (kHeadMajorPaced false) took 1.05-1.18
  // of the paced form's time with the loop and 0.70-0.73 without it (the paced form's median 1.03-1.34 times as long
  // with it, the unpaced form's 1.6-2.5 times); from DRAM the pair read 1.22-1.33 with it and 1.32-1.33 without.
  const char* with_fma = std::getenv("QKV_AB_DECODE_FMA");
  const bool fma_first = with_fma != nullptr && std::string(with_fma) == "1";
  const auto before_round = [&] {
    if (fma_first) fma_loop_gflops();
  };
  const PairedRounds p = paired_rounds(
      rounds, seconds, run_a, run_b, [&] { read.push_back(seconds(read_kv)); }, before_round);
  std::vector<double> share_a, share_b;  // per round: read loop / call
  for (std::size_t r = 0; r < read.size(); ++r) {
    share_a.push_back(read[r] / p.a[r]);
    share_b.push_back(read[r] / p.b[r]);
  }
  const double kv_bytes = 2.0 * double(kv_size) * double(sizeof(S));
  std::printf(
      "decode Skv=%ld %s %s K/V%s (B = 1, Sq = 1, Hq = %ld, Hkv = 8, D = Dv = %ld), %d thread%s, %d rounds; "
      "A = qkv (%s), B = qkv_b (%s)\n",
      Skv, layout == Layout::bhsd ? "bhsd" : "bshd", storage, cached ? ", cached" : "", Hq, D, threads,
      threads == 1 ? "" : "s", rounds, qkv::isa_name(), qkv_b::isa_name());
  std::printf("A median %9.1f us (%6.1f GB/s of K and V); of the read loop %.3f (per round), %.3f (of the medians)\n",
              median_of(p.a) * 1e6, kv_bytes / median_of(p.a) * 1e-9, median_of(share_a),
              median_of(read) / median_of(p.a));
  std::printf("B median %9.1f us (%6.1f GB/s of K and V); of the read loop %.3f (per round), %.3f (of the medians)\n",
              median_of(p.b) * 1e6, kv_bytes / median_of(p.b) * 1e-9, median_of(share_b),
              median_of(read) / median_of(p.b));
  std::printf("read loop over A's K and V: median %9.1f us (%6.1f GB/s)\n", median_of(read) * 1e6,
              kv_bytes / median_of(read) * 1e-9);
  print_ratios(p);
  const BitDiff diff = compare_bits(out_a, out_b);
  if (diff.values == 0) {
    std::printf("out of A and B: bit-identical\n");
  } else {
    std::printf("out of A and B: %zu of %zu values differ in their bits; max finite |out_A - out_B| = %g\n",
                diff.values, out_a.size(), diff.max_finite);
  }
  return 0;
}
#endif  // QKV_AB_DECODE

#if defined(QKV_AB_MICRO)
// ---------------------------------------------------------------------------------------------------------------------
// The micro-kernel mode. Compiled only with QKV_AB_MICRO (the script defines it for --micro alone): it calls the
// decoding micro-kernels of each side's widest compiled pass by their internal names (detail/decode_kernels.hpp:
// qk_in_place, pv_in_place, PrefetchCursor, NextRows, kQkKeysPerStep, kPvKeysPerStep; fused_tiles.hpp: FusedTiles, as
// they are from 37e39c7 on), which the other modes never name. The pass is the one config.hpp picks for this build's
// -march (B's QKV_ISA_ macros; A's are undefined by now, and both sides see the same flags).
#if defined(QKV_ISA_AVX512)
#define QKV_AB_MICRO_PASS kernel_avx512
#define QKV_AB_MICRO_TAG Avx512Tag
#define QKV_AB_MICRO_ISA "avx512"
#elif defined(QKV_ISA_AVX2)
#define QKV_AB_MICRO_PASS kernel_avx2
#define QKV_AB_MICRO_TAG Avx2Tag
#define QKV_AB_MICRO_ISA "avx2"
#else
#define QKV_AB_MICRO_PASS kernel_scalar
#define QKV_AB_MICRO_TAG ScalarTag
#define QKV_AB_MICRO_ISA "scalar"
#endif

constexpr Index kMicroD = 128;  // D = Dv

// The micro-kernels of one side over `keys` keys of one kv head (4 query rows, D = Dv = 128, float K and V head-major,
// rows kMicroD apart), in the two shapes a head-major decoding task calls them (fused_attention.hpp, run_decode_task):
// without a cursor over whole blocks of FusedTiles::kDecodeKeys keys (an unpaced task: each step prefetches its rows a
// few keys ahead inside its call), and with one over sub-blocks of kDecodePacedBytes (32 keys of 128 floats), each call
// handed a PrefetchCursor over the next sub-block's rows and its P·V naming them as the rows its reading goes on with
// (a paced task, kHeadMajorPaced: float on 16 lanes in the copy whose prefetches go into L1; the last sub-block's
// cursor is empty here, where the task's turns to the block's V or the next block's K). Both with every prefetch into
// L1 (kLocality = 3) and P·V's default step (kPvKeysPerStep keys), as that copy does.
#define QKV_AB_MICRO_SIDE(Side, ns)                                                                                    \
  struct Side {                                                                                                        \
    using Tag = ns::simd::QKV_AB_MICRO_TAG;                                                                            \
    static_assert(std::is_same<Tag, ns::simd::BestTag>::value, "ab_fused: the micro pass is not the build's widest");  \
    using Tiles = ns::detail::QKV_AB_MICRO_PASS::FusedTiles<Tag>;                                                      \
    using Cursor = ns::detail::QKV_AB_MICRO_PASS::PrefetchCursor<float>;                                               \
    static constexpr Index kQkStep = ns::detail::QKV_AB_MICRO_PASS::kQkKeysPerStep<Tag>;                               \
    static constexpr Index kPvStep = ns::detail::QKV_AB_MICRO_PASS::kPvKeysPerStep<Tag>;                               \
    static constexpr Index kSub = Tiles::kDecodePacedBytes / Index(sizeof(float)) / kMicroD / 4 * 4;                   \
    static Index call_keys(bool paced) { return paced ? kSub : Tiles::kDecodeKeys; }                                   \
    static Index steps(Index keys, Index per_step) { return (keys + per_step - 1) / per_step; }                        \
    static void qk(bool paced, const float* q, const float* k, Index keys, float* s, Index lds) {                      \
      for (Index j = 0; j < keys; j += call_keys(paced)) {                                                             \
        const Index n = std::min(call_keys(paced), keys - j);                                                          \
        if (!paced) {                                                                                                  \
          ns::detail::QKV_AB_MICRO_PASS::qk_in_place<Tag, 4, 3>(q, kMicroD, k + j * kMicroD, kMicroD, n, kMicroD,      \
                                                                s + j, lds);                                           \
          continue;                                                                                                    \
        }                                                                                                              \
        Cursor ahead(k + (j + n) * kMicroD, kMicroD, std::min(kSub, keys - j - n), kMicroD, steps(n, kQkStep));        \
        ns::detail::QKV_AB_MICRO_PASS::qk_in_place<Tag, 4, 3>(q, kMicroD, k + j * kMicroD, kMicroD, n, kMicroD, s + j, \
                                                              lds, &ahead);                                            \
        ahead.flush();                                                                                                 \
      }                                                                                                                \
    }                                                                                                                  \
    static void pv(bool paced, const float* p, Index ldp, const float* v, Index keys, float* o) {                      \
      for (Index j = 0; j < keys; j += call_keys(paced)) {                                                             \
        const Index n = std::min(call_keys(paced), keys - j), next = std::min(kSub, keys - j - n);                     \
        if (!paced) {                                                                                                  \
          ns::detail::QKV_AB_MICRO_PASS::pv_in_place<Tag, 4, float>(p + j, ldp, v + j * kMicroD, kMicroD, n, o,        \
                                                                    kMicroD, kMicroD);                                 \
          continue;                                                                                                    \
        }                                                                                                              \
        Cursor ahead(v + (j + n) * kMicroD, kMicroD, next, kMicroD, steps(n, kPvStep));                                \
        const ns::detail::QKV_AB_MICRO_PASS::NextRows<float> rows{next > 0 ? v + (j + n) * kMicroD : nullptr, next};   \
        ns::detail::QKV_AB_MICRO_PASS::pv_in_place<Tag, 4, float>(p + j, ldp, v + j * kMicroD, kMicroD, n, o, kMicroD, \
                                                                  kMicroD, &ahead, rows);                              \
        ahead.flush();                                                                                                 \
      }                                                                                                                \
    }                                                                                                                  \
  };
QKV_AB_MICRO_SIDE(MicroA, qkv)
QKV_AB_MICRO_SIDE(MicroB, qkv_b)
#undef QKV_AB_MICRO_SIDE

// --micro: each form of A and B timed alternately (as --backward pairs its calls), each round between two FMA loops;
// each timing is of about 2^20 elements of K or V (passes over the keys, at least one) after an untimed pass of its
// own, so that K or V come from wherever `keys` rows of 512 bytes fit (64 keys, 32 KiB, in L1; 1024 in L2; 16384 in
// L3 on the CPUs measured so far). Both sides read the same inputs and write the same score and output buffers (one
// buffer each made P·V of A against itself 0.83–1.17 of the time: two outputs lying differently against V modulo
// 4 KiB, bench/README.md, "2026-12-07, thirty-eighth session"). P·V accumulates into its output over the passes; it
// starts from zero only for the bit check. Prints per form the median over rounds of each side's GFLOPS (2 · 4 · 128
// per key and pass) over the FMA loop timed right after the pair, the median of the per-round ratios B / A, the rounds
// B won, and whether the scores or outputs of one pass are bit-identical (exit 1 if not).
int micro_speed_mode(Index keys, int rounds) {
  const Index lds = keys;
  const char* on_lines = "0";  // every array on a 64-byte boundary, as the kernel keeps its scores and outputs
  PlacedArray<float> q(4 * kMicroD, on_lines), k(static_cast<std::size_t>(keys * kMicroD), on_lines),
      v(static_cast<std::size_t>(keys * kMicroD), on_lines), p(static_cast<std::size_t>(4 * lds), on_lines);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (const PlacedArray<float>* x : {&q, &k, &v})
    for (float& e : *x) e = normal(rng);
  for (float& e : p) e = std::abs(normal(rng)) / static_cast<float>(keys);  // weights of a softmax's size
  PlacedArray<float> s(static_cast<std::size_t>(4 * lds), on_lines), o(4 * kMicroD, on_lines);
  const int passes = static_cast<int>(
      std::max<Index>(1, ((Index(1) << 20) + keys * kMicroD / 2) / (keys * kMicroD)));  // nearest count, at least 1
  const double flops = 2.0 * 4 * double(kMicroD) * double(keys) * passes;
  const auto seconds = [passes](auto&& f) {
    f();  // untimed: K or V where this pass leaves them
    const double t0 = now();
    for (int i = 0; i < passes; ++i) f();
    return now() - t0;
  };
  std::printf(
      "micro-kernels of the %s pass, 4 rows, D = Dv = %ld, float K and V, %ld keys (%ld KiB each of K and V), "
      "%d passes per timing, %d rounds, one thread; A = qkv, B = qkv_b\n",
      QKV_AB_MICRO_ISA, static_cast<long>(kMicroD), static_cast<long>(keys),
      static_cast<long>(keys * kMicroD * 4 / 1024), passes, rounds);
  int status = 0;
  for (const bool paced : {false, true}) {
    for (const bool qk : {true, false}) {
      const auto run_a = [&] {
        if (qk) {
          MicroA::qk(paced, q.data(), k.data(), keys, s.data(), lds);
        } else {
          MicroA::pv(paced, p.data(), lds, v.data(), keys, o.data());
        }
      };
      const auto run_b = [&] {
        if (qk) {
          MicroB::qk(paced, q.data(), k.data(), keys, s.data(), lds);
        } else {
          MicroB::pv(paced, p.data(), lds, v.data(), keys, o.data());
        }
      };
      std::vector<double> fma;  // an FMA loop timed after each round's pair, beside the one before it
      const PairedRounds r = paired_rounds(rounds, seconds, run_a, run_b, [&] { fma.push_back(fma_loop_gflops()); });
      std::vector<double> share_a, share_b;
      for (std::size_t i = 0; i < r.a.size(); ++i) {
        share_a.push_back(flops / r.a[i] * 1e-9 / fma[i]);
        share_b.push_back(flops / r.b[i] * 1e-9 / fma[i]);
      }
      // One pass of each side from the same start: NaN scores (every one is written), zero outputs.
      PlacedArray<float>& result = qk ? s : o;
      const float start = qk ? kNaN : 0.0f;
      std::fill(result.begin(), result.end(), start);
      run_a();
      const std::vector<float> of_a(result.begin(), result.end());
      std::fill(result.begin(), result.end(), start);
      run_b();
      const bool same = compare_bits(of_a, std::vector<float>(result.begin(), result.end())).values == 0;
      std::printf("%s, %s: of the FMA loop (median %.1f GFLOPS) A %.3f, B %.3f\n", qk ? "Q·Kᵀ" : "P·V",
                  paced ? "cursor" : "no cursor", median_of(fma), median_of(share_a), median_of(share_b));
      std::printf("      ");
      print_ratios(r);
      std::printf("      %s of A and B: %s\n", qk ? "scores" : "outputs", same ? "bit-identical" : "DIFFER");
      if (!same) status = 1;
    }
  }
  return status;
}
#undef QKV_AB_MICRO_PASS
#undef QKV_AB_MICRO_TAG
#undef QKV_AB_MICRO_ISA
#endif  // QKV_AB_MICRO

int usage(const char* argv0) {
  std::fprintf(stderr,
               "usage: %s D T rounds causal          speed (B = 1, H = 8, Sq = Skv = T, float, one thread)\n"
               "       %s --bits [--perturb] [NAME...] bit check of every case (or those whose name contains NAME)\n"
               "       %s --time NAME [rounds]       speed of one case (default 10 rounds)\n"
               "       %s --list                     case names\n"
               "       %s --backward [T D causal rounds dropout_p]\n"
               "           backward speed (defaults 4096 128 0 10 0; B = 1, H = 8, Sq = Skv = T, D = Dv, one thread)\n"
               "       %s --backward-bits [--perturb] [NAME...]\n"
               "           bit check of the backward's cases (or those whose name contains NAME)\n"
               "       %s --backward-list            backward case names\n"
               "       %s --decode [layout storage Skv rounds [cached] [D=N] [Hq=N]]\n"
               "           decode speed (defaults bshd f16 32768 16; layout bshd or bhsd, storage float, f16 or bf16\n"
               "           for K and V; B = 1, Sq = 1, Hq = 32 or N, Hkv = 8, D = Dv = 128 or N, one thread\n"
               "           or QKV_AB_THREADS; each round also times a read loop over A's K and V;\n"
               "           cached: K and V left in the cache by an untimed call, not evicted; the last three in any\n"
               "           order)\n"
               "       %s --micro [keys rounds]\n"
               "           the decoding micro-kernels alone (defaults 1024 100): Q·Kᵀ and P·V of one kv head, 4 rows,\n"
               "           D = 128, float, with and without a cursor, against the FMA loop\n",
               argv0, argv0, argv0, argv0, argv0, argv0, argv0, argv0, argv0);
  return 2;
}

// Parses the arguments after a bit-check mode: --perturb anywhere, the rest case-name filters.
void bits_arguments(int argc, char** argv, std::vector<std::string>& filters, bool& perturb) {
  perturb = false;
  for (int i = 2; i < argc; ++i) {
    if (std::string(argv[i]) == "--perturb") {
      perturb = true;
    } else {
      filters.emplace_back(argv[i]);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "--list") {
    for (const Shape& shape : kShapes)
      for (const PresetName& preset : kPresets) std::printf("%s\n", case_name(shape, preset).c_str());
    return 0;
  }
  if (mode == "--bits") {
    std::vector<std::string> filters;
    bool perturb = false;
    bits_arguments(argc, argv, filters, perturb);
    return bits_mode(filters, perturb);
  }
  if (mode == "--backward" || mode == "--backward-bits" || mode == "--backward-list") {
#if defined(QKV_AB_BACKWARD)
    if (mode == "--backward-list") {
      for (const Shape& shape : kBackwardShapes)
        for (const BackwardPreset& preset : kBackwardPresets) std::printf("%s\n", case_name(shape, preset).c_str());
      return 0;
    }
    if (mode == "--backward-bits") {
      std::vector<std::string> filters;
      bool perturb = false;
      bits_arguments(argc, argv, filters, perturb);
      return backward_bits_mode(filters, perturb);
    }
    if (argc > 7) return usage(argv[0]);
    const long T = argc > 2 ? std::atol(argv[2]) : 4096, D = argc > 3 ? std::atol(argv[3]) : 128;
    const bool causal = argc > 4 && std::atoi(argv[4]) != 0;
    const int rounds = argc > 5 ? std::atoi(argv[5]) : 10;
    const float dropout_p = argc > 6 ? std::strtof(argv[6], nullptr) : 0.0f;
    if (T < 1 || D < 1 || rounds < 1 || !(dropout_p >= 0.0f && dropout_p <= 1.0f)) {
      std::fprintf(stderr, "T, D and rounds must be at least 1, dropout_p in [0, 1]\n");
      return 2;
    }
    return backward_speed_mode(T, D, causal, rounds, dropout_p);
#else
    std::fprintf(stderr,
                 "%s: built without the backward modes (scripts/ab_fused.sh defines QKV_AB_BACKWARD for them)\n",
                 argv[0]);
    return 2;
#endif
  }
  if (mode == "--decode") {
#if defined(QKV_AB_DECODE)
    if (argc > 9) return usage(argv[0]);
    const std::string layout_name = argc > 2 ? argv[2] : "bshd", storage = argc > 3 ? argv[3] : "f16";
    const long Skv = argc > 4 ? std::atol(argv[4]) : 32768;
    const int rounds = argc > 5 ? std::atoi(argv[5]) : 16;
    bool cached = false, bad_option = false;
    long D = 128, Hq = 32;
    for (int i = 6; i < argc; ++i) {  // `cached`, `D=N` and `Hq=N`, in any order
      const std::string option = argv[i];
      const auto number = [&](std::size_t prefix) {
        char* end = nullptr;
        const long n = std::strtol(option.c_str() + prefix, &end, 10);
        if (end == option.c_str() + prefix || *end != '\0') bad_option = true;
        return n;
      };
      if (option == "cached") {
        cached = true;
      } else if (option.rfind("D=", 0) == 0) {
        D = number(2);
      } else if (option.rfind("Hq=", 0) == 0) {
        Hq = number(3);
        if (Hq % 8 != 0) bad_option = true;  // Hkv = 8 divides it
      } else {
        bad_option = true;
      }
    }
    if ((layout_name != "bshd" && layout_name != "bhsd") ||
        (storage != "float" && storage != "f16" && storage != "bf16") || Skv < 1 || rounds < 1 || D < 1 || Hq < 8 ||
        bad_option) {
      std::fprintf(stderr,
                   "layout must be bshd or bhsd, storage float, f16 or bf16, Skv, rounds and D at least 1, and the "
                   "arguments after rounds, if any, cached, D=N or Hq=N (a multiple of 8)\n");
      return 2;
    }
    const Layout layout = layout_name == "bhsd" ? Layout::bhsd : Layout::bshd;
    if (storage == "f16") return decode_speed_mode<Eigen::half>(layout, "f16", Skv, rounds, cached, D, Hq);
    if (storage == "bf16") return decode_speed_mode<Eigen::bfloat16>(layout, "bf16", Skv, rounds, cached, D, Hq);
    return decode_speed_mode<float>(layout, "float", Skv, rounds, cached, D, Hq);
#else
    std::fprintf(stderr, "%s: built without the decode mode (scripts/ab_fused.sh defines QKV_AB_DECODE for it)\n",
                 argv[0]);
    return 2;
#endif
  }
  if (mode == "--micro") {
#if defined(QKV_AB_MICRO)
    if (argc > 4) return usage(argv[0]);
    const long keys = argc > 2 ? std::atol(argv[2]) : 1024;
    const int rounds = argc > 3 ? std::atoi(argv[3]) : 100;
    if (keys < 1 || rounds < 1) {
      std::fprintf(stderr, "keys and rounds must be at least 1\n");
      return 2;
    }
    return micro_speed_mode(keys, rounds);
#else
    std::fprintf(stderr, "%s: built without the micro-kernel mode (scripts/ab_fused.sh defines QKV_AB_MICRO for it)\n",
                 argv[0]);
    return 2;
#endif
  }
  if (mode == "--time") {
    if (argc < 3) return usage(argv[0]);
    const int rounds = argc > 3 ? std::atoi(argv[3]) : 10;
    if (rounds < 1) {
      std::fprintf(stderr, "rounds must be at least 1\n");
      return 2;
    }
    return time_mode(argv[2], rounds);
  }
  if (argc < 5) return usage(argv[0]);
  const long D = std::atol(argv[1]), T = std::atol(argv[2]);
  const int rounds = std::atoi(argv[3]);
  if (D < 1 || T < 1 || rounds < 1) {
    std::fprintf(stderr, "D, T and rounds must be at least 1\n");
    return 2;
  }
  return speed_mode(D, T, rounds, std::atoi(argv[4]) != 0);
}
