// qkv/detail/decode_kernels.hpp — the decoding micro-kernels: Q·Kᵀ and P·V with K and V read in place.
//
// Decoding (few query rows) reads the whole cache once per token, so it streams K and V where they lie instead of
// packing them (a packing pass would double the traffic): qk_in_place over a block's keys, then pv_in_place over its
// values, each prefetching a few rows ahead (FusedTiles::kDecodePrefetchKeys, or kSpreadKeys) inside its own key
// range or the rows read next; a paced task (several kv heads of token-major K and V, or a head-major task of at most 4
// rows where kHeadMajorPaced holds) also hands them a PrefetchCursor, whose whole rows ahead they issue a share per
// step. Every prefetch goes to the cache level the kernels' kLocality names (simd::prefetch: 3 into L1, 2 into L2),
// which run_decode_task takes from decode_prefetch_level() (isa.hpp), but for a paced P·V step's rows a few keys ahead,
// which go into L1 (kSpreadLocality). Per key and kv head (D = Dv = 128, G = 4, AVX2): 32 vector loads of K and V and
// 128 FMAs. The micro-kernels are also compiled for D (Dv) = 64 and 128 with their column loops unrolled
// (with_head_dim).
//
// Compiled once per kernel ISA, inside that ISA's target region: detail/dispatch.hpp includes it in each pass (the
// guard below, Highway's toggle, lets each pass in once).
#ifndef QKV_PASS_NAME
#error "qkv/detail/decode_kernels.hpp is part of the fused kernel: include qkv/detail/dispatch.hpp"
#endif
#if defined(QKV_DETAIL_DECODE_KERNELS_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_DECODE_KERNELS_HPP
#undef QKV_DETAIL_DECODE_KERNELS_HPP
#else
#define QKV_DETAIL_DECODE_KERNELS_HPP
#endif

#include <algorithm>
#include <type_traits>

#include "qkv/config.hpp"
#include "qkv/detail/fused_tiles.hpp"
#include "qkv/simd/simd.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512

/// The cache lines of `rows` whole key rows of token-major K or V (`span` elements from each row's start, rows `ld`
/// apart), in memory order, handed out a share at a time to the decoding micro-kernels (one `next_run` per step of
/// keys, `flush` for what the steps left): a grouped decoding task (fused_attention.hpp) paces the next sub-block's
/// prefetches over the current one's arithmetic (at Hkv = 8, D = 128 and G = 4 on AVX2: 16 lines of float or 8 of
/// 16-bit storage per step; more on AVX-512, whose steps take more keys): a P·V step spreads its lines over the vector
/// columns of its loop, between the FMAs; a Q·Kᵀ step issues them after its sums (qk_in_place). Issued in one burst
/// before the arithmetic, they filled the miss queue and stalled it; issued a step's share at a time in a tight loop
/// before the step's arithmetic, clang++'s float decode took 1.35 × as long with the loop over D at run time
/// (bench/README.md, "Paced prefetch in token-major decode" and "Prefetches between the FMAs"); after the arithmetic of
/// an unrolled step, the share costs nothing measurable ("2026-12-05, twenty-third session"); where kSpreadAheadPaced
/// holds, a P·V step also prefetches its rows a few keys ahead in reading order. Its loops of prefetches are not
/// unrolled (QKV_NO_UNROLL): clang++'s eightfold unrolling of them, for runs of one to a few lines, cost token-major
/// decode 2–9 % (bench/README.md, "clang++ no longer unrolls the prefetch loops"); Run::issue_column's loop, of a
/// compile-time count, is unrolled: it issues a run column by column without a count (kStraightRuns). Addresses are
/// formed only for lines inside the rows. Complexity: O(1) per line; throws nothing.
template <class S>
class PrefetchCursor {
 public:
  static constexpr Index kElementsPerLine = 64 / static_cast<Index>(sizeof(S));

  PrefetchCursor() = default;
  /// The lines of rows first, first + ld, …, (rows of them; none if rows ≤ 0, and then `first` is not used), `span`
  /// elements of each, spread over `steps` calls of next_run().
  PrefetchCursor(const S* first, Index ld, Index rows, Index span, Index steps) noexcept
      : base_(first), ld_(ld), per_row_((span + kElementsPerLine - 1) / kElementsPerLine) {
    left_ = rows > 0 ? rows * per_row_ : 0;
    if (ld_ == per_row_ * kElementsPerLine) per_row_ = std::max<Index>(left_, 1);  // rows that abut: one run of lines
    const Index calls = std::max<Index>(steps, 1);
    per_step_ = (left_ + calls - 1) / calls;
  }
  /// Prefetches every line not handed out yet (into the levels kLocality names: simd::prefetch).
  template <int kLocality = 3>
  void flush() noexcept {
    flush([](const S* p) { simd::prefetch<kLocality>(p); });
  }
  /// flush() handing each line's first address to `line(const S*)`, which must not throw, instead of prefetching it
  /// (the tests read the addresses this way).
  template <class Line>
  void flush(Line&& line) noexcept {
    QKV_NO_UNROLL
    for (; left_ > 0; --left_) {
      line(base_ + row_ * ld_ + line_ * kElementsPerLine);
      if (++line_ == per_row_) {
        line_ = 0;
        ++row_;
      }
    }
  }
  /// `lines` consecutive cache lines from `first`, the first `issued` of them prefetched.
  struct Run {
    const S* first = nullptr;
    Index lines = 0;
    Index issued = 0;
    /// Prefetches the next `count` lines, or as many as are left: a loop of `columns` vector columns issues
    /// per_column(columns) at each, so that the run is spread over the whole loop.
    template <int kLocality = 3>
    void issue_next(Index count) noexcept {
      QKV_NO_UNROLL
      for (const Index end = std::min(lines, issued + count); issued < end; ++issued) {
        simd::prefetch<kLocality>(first + issued * kElementsPerLine);
      }
    }
    Index per_column(Index columns) const noexcept { return columns > 0 ? (lines + columns - 1) / columns : lines; }
    /// Prefetches the kPerColumn lines of vector column `column`, lines column·kPerColumn on, straight-line: a loop
    /// of lines / kPerColumn columns issues the whole run without issue_next's count (kStraightRuns); `issued` is
    /// left as it is. Requires (column + 1)·kPerColumn ≤ lines (checked where QKV_ASSERT is on), so that no address
    /// outside the run is formed. The overload hands each line's first address to `line(const S*)`, which must not
    /// throw, instead of prefetching it (the tests).
    template <Index kPerColumn, int kLocality = 3>
    QKV_ALWAYS_INLINE void issue_column(Index column) const noexcept {
      issue_column<kPerColumn>(column, [](const S* p) QKV_ALWAYS_INLINE { simd::prefetch<kLocality>(p); });
    }
    template <Index kPerColumn, class Line>
    QKV_ALWAYS_INLINE void issue_column(Index column, Line&& line) const noexcept {
      static_assert(kPerColumn >= 1, "qkv: issue_column issues at least one line a column");
      QKV_ASSERT(column >= 0 && (column + 1) * kPerColumn <= lines);
      QKV_UNROLL for (Index i = 0; i < kPerColumn; ++i) line(first + (column * kPerColumn + i) * kElementsPerLine);
    }
    /// Prefetches the lines not issued yet: what a loop of fewer columns than lines left, or the whole run.
    template <int kLocality = 3>
    void issue_rest() noexcept {
      QKV_NO_UNROLL
      for (; issued < lines; ++issued) simd::prefetch<kLocality>(first + issued * kElementsPerLine);
    }
  };
  /// This step's share as one run of consecutive lines, for the caller to prefetch spread over the step's
  /// arithmetic; a share that would cross the end of a row's span ends there (later steps and flush issue the rest).
  Run next_run() noexcept {
    const Index count = std::min(std::min(per_step_, left_), per_row_ - line_);
    if (count <= 0) return Run();
    const Run run{base_ + row_ * ld_ + line_ * kElementsPerLine, count, 0};
    left_ -= count;
    line_ += count;
    if (line_ == per_row_) {
      line_ = 0;
      ++row_;
    }
    return run;
  }

 private:
  const S* base_ = nullptr;
  Index ld_ = 0, per_row_ = 1, row_ = 0, line_ = 0, left_ = 0, per_step_ = 0;
};

/// Calls f(std::integral_constant<Index, n>()) where n (D or Dv) is 64 or 128 and Tag is a vector tag, else
/// f(std::integral_constant<Index, 0>()) (n read at run time): the decoding micro-kernels are compiled for those two
/// head_dims besides any, with their loops over a row's vector columns unrolled completely (for_each_column). Measured
/// on Zen 5 (Sq = 1, Hq = 32, Hkv = 8, Skv = 32768, one thread, paired against the loop over D at run time), head-major
/// decode from DRAM took 0.89–0.90 of the time at D = 128 (clang++ and g++; f16 0.84, bf16 0.83, clang++'s AVX2 build
/// 0.95) and 0.83 at D = 64. A grouped task (several kv heads of token-major K and V, paced by a PrefetchCursor) is
/// unrolled too, with its Q·Kᵀ prefetches after each step's sums: float from DRAM in 0.79–0.83 of the time with
/// clang++, 0.90–0.96 with g++ (float K and V, Skv = 32768; bench/README.md, "2026-12-05, twenty-third session";
/// unrolled with the prefetches inside the columns, it had taken 1.03 of the time: "2026-12-04, twenty-first session").
template <class Tag, class F>
inline void with_head_dim(Index n, F&& f) {
  if constexpr (Tag::kLanes >= 8) {
    if (n == 128) return f(std::integral_constant<Index, 128>());
    if (n == 64) return f(std::integral_constant<Index, 64>());
  }
  f(std::integral_constant<Index, 0>());
}

/// Calls column(d) for d = 0, L, 2L, … below `full`, the whole vectors of a row: unrolled completely where the
/// head_dim kDim is known at compile time (then `full` is kDim / L · L), a loop otherwise. column must be inlined
/// (QKV_ALWAYS_INLINE after its parameter list), or its accumulators leave the registers.
template <Index kDim, int L, class F>
QKV_ALWAYS_INLINE inline void for_each_column(Index full, F&& column) {
  if constexpr (kDim > 0) {
    QKV_UNROLL for (Index d = 0; d < kDim / L * L; d += L) column(d);
  } else {
    for (Index d = 0; d < full; d += L) column(d);
  }
}

/// Whether a decoding step without a PrefetchCursor (a head-major task's, where kHeadMajorPaced does not pace it)
/// prefetches its rows ahead one line per vector column, between the FMAs of the unrolled columns (the line of each row
/// ahead that starts at that column, the rows chosen once per step, clamped to the call's last whole step or, in P·V,
/// taken from the rows read next: spread_rows; no branch among the FMAs), instead of prefetch_row's burst of whole rows
/// before the step: where the head_dim is compiled in (kDim > 0) and a vector is exactly a cache line (float on a
/// 16-lane tag), so that every line of a row has its column; and with clang++ only. Measured on Zen 5 (Sq = 1, Hq = 32,
/// Hkv = 8, D = 128, BHSD float, one thread, paired against the burst, both 16 rows ahead): from DRAM 0.90–0.95 of the
/// time with clang++ (14–16 of 16 rounds faster), from L3 0.92–0.97 (31–32 of 60: within the noise). g++ 12 schedules
/// about half of a step's 32 prefetches back to its start and keeps their addresses on the stack: from DRAM 0.99–1.06
/// of the time (from L3 0.95–0.96), and DRAM decides, so g++ keeps the burst. Where a line spans two columns (16-bit K
/// and V, or AVX2), the lines spread over the first half of the columns took 1.03–1.10 of the time (f16 with both
/// compilers, AVX2 with clang++), so those keep the burst too (bench/README.md, "2026-12-05, twenty-fourth session").
/// The spread rows are kSpreadKeys ahead (FusedTiles' kDecodeSpreadKeys, or kDecodeSpreadKeysL2 into L2), not
/// kDecodePrefetchKeys.
#if defined(__clang__)
inline constexpr bool kSpreadAheadCompiler = true;
#else
inline constexpr bool kSpreadAheadCompiler = false;
#endif
template <class Tag, class S, bool kPaced, Index kDim>
inline constexpr bool kSpreadAhead = kSpreadAheadCompiler && !kPaced && kDim > 0 && Tag::kLanes * sizeof(S) == 64;

/// Whether a grouped task's P·V step (paced by a PrefetchCursor, whose lines run a whole sub-block ahead in memory
/// order) also prefetches the rows kDecodeSpreadKeys ahead in its reading order one line per vector column, as a
/// head-major step does where kSpreadAhead holds (the same compilers, types and head_dims). The cursor's lines, 64 KiB
/// ahead at Hkv = 8, D = 128, overflow Zen 5's 48 KiB L1 before they are read; these fetch the rows again into L1 just
/// before their loads. Measured on Zen 5 (Sq = 1, Hq = 32, Hkv = 8, D = 128, BSHD float, one thread, clang++, paired):
/// from DRAM 0.876–0.968 of the time (15–20 of 16–20 rounds, five runs), from L3 1.07–1.10 (the step's memory
/// operations, 6 loads and 4 stores per 8 FMAs, gain two prefetches). DRAM decides. The same in the Q·Kᵀ steps gained
/// nothing from DRAM, and from DRAM 4, 12 or 16 rows ahead gained less than 8 (bench/README.md, "2026-12-05,
/// twenty-fifth session").
template <class Tag, class S, Index kDim>
inline constexpr bool kSpreadAheadPaced = kSpreadAhead<Tag, S, false, kDim>;

/// The level a step's spread prefetches (kSpreadAhead, kSpreadAheadPaced) go to: kLocality's for a head-major step; L1
/// (3) for a paced one in either copy, as the cursor has fetched its rows a sub-block ahead into kLocality's level, and
/// the spread then brings them the short way on into L1. Measured on Zen 4 (whose copy prefetches into L2; Sq = 1,
/// Hq = 32, Hkv = 8, D = 128, BSHD float, one thread, clang++, paired against the spread into L2): from DRAM
/// 0.934–0.987 of the time (17–28 of 24–32 rounds, five runs), from L3 0.888–0.977; without the spread in that
/// copy, 1.040 from DRAM (bench/README.md, "2026-12-05, twenty-ninth session").
template <bool kPaced, int kLocality>
inline constexpr int kSpreadLocality = kPaced ? 3 : kLocality;

/// Whether a paced P·V step (pv_step with a PrefetchCursor's run) whose run holds exactly as many lines as its own NV
/// rows of Dv elements issues them straight-line, the same number at each vector column at fixed offsets from the run's
/// first line, instead of Run::issue_next's loop with its count: with clang++ (kSpreadAheadCompiler) on a 16-lane tag,
/// in the copy whose prefetches go into L1, where the head_dim is compiled in (kDim > 0) and a column's share is whole
/// lines (float and 16-bit V alike; pv_keys checks each run's length). The same lines at the same columns; what goes
/// is the loop's bookkeeping, which is what the paced form's steps cost from the cache ("2026-12-07, thirty-ninth
/// session"). Measured on Zen 5 (Sq = 1, Hq = 32, Hkv = 8, D = 128, G = 4, one and two threads, clang++, paired
/// against the loop; the same bits): float from L3 (Skv = 2048) 0.865–0.939 of the time (BHSD and BSHD), f16 (BSHD)
/// 0.957; from DRAM (Skv = 32768) BHSD float 0.96–1.04 (0.997, the median of eleven runs), BSHD float 1.00–1.02,
/// BSHD f16 and bf16 0.90–0.96. g++ 12 took BHSD float from DRAM 1.01–1.07 and keeps the loop. So do the Q·Kᵀ
/// steps: their run issued straight-line after the sums took 1.02–1.05 of the time from DRAM and gained nothing from
/// L3, and spread over the columns, 0.98–1.13 from DRAM (bench/README.md, "2026-12-08, forty-fourth session"). Runs
/// of another length (a task of more than 4 rows per kv head, rows with gaps, a short last sub-block) keep the loop.
template <class Tag, class S, int kLocality, Index kDim, int NV>
inline constexpr bool kStraightRuns = kLocality == 3 && kDim > 0 && Tag::kLanes >= 16 && kSpreadAheadCompiler &&
                                      (NV * static_cast<Index>(sizeof(S)) * Tag::kLanes) % 64 == 0;

/// The rows a decoding call's reading goes on with (the next kv head's in the sub-block, the next sub-block's, or the
/// next block's first K rows), `keys` of them: where a step spreads its prefetches ahead (kSpreadAhead,
/// kSpreadAheadPaced), the steps whose rows ahead lie past the call's last key prefetch these instead of the call's
/// last rows again. They must lie as far apart as the call's rows (its `ld`), and each must hold at least as many
/// elements as the call's rows (its D or Dv), all of them read by the task: the step prefetches every row and column
/// there as in its own rows. None by default.
template <class S>
struct NextRows {
  const S* rows = nullptr;
  Index keys = 0;
};

/// Keys ahead of the spread prefetches (kSpreadAhead, kSpreadAheadPaced): FusedTiles' kDecodeSpreadKeys, or
/// kDecodeSpreadKeysL2 for a head-major step (no cursor: !kPaced) whose prefetches go into L2 (kLocality = 2).
template <class Tag, bool kPaced, int kLocality>
inline constexpr Index kSpreadKeys =
    !kPaced && kLocality == 2 ? FusedTiles<Tag>::kDecodeSpreadKeysL2 : FusedTiles<Tag>::kDecodeSpreadKeys;

/// The first of `count` rows (`ld` apart) `ahead_keys` keys past key j in reading order (kSpreadKeys): inside the
/// call's `keys` rows from `first`, or, from the call's end on, inside `next` if it holds `count` rows, else the call's
/// last `count` rows again. Complexity: O(1); throws nothing.
template <class S>
QKV_ALWAYS_INLINE inline const S* spread_rows(const S* first, Index ld, Index j, Index keys, Index count,
                                              const NextRows<S>& next, Index ahead_keys) noexcept {
  const Index ahead = j + ahead_keys;
  if (ahead >= keys && next.keys >= count) {
    return next.rows + std::min(ahead - keys, next.keys - count) * ld;
  }
  return first + std::min(ahead, keys - count) * ld;
}

/// Keys per step of qk_in_place (its NK) and of pv_in_place (its NV): what a PrefetchCursor's steps count.
template <class Tag>
inline constexpr Index kQkKeysPerStep = Tag::kLanes >= 16 ? 4 : 2;
template <class Tag>
inline constexpr Index kPvKeysPerStep = Tag::kLanes >= 16 ? 4 : 2;
/// pv_in_place's NV for a grouped (token-major) task, whose V rows of one kv head lie a whole key row apart (4 KiB
/// for 8 float heads of 128): four float rows in flight then share their address bits below 4 KiB with each other
/// and with the acc_o stores, and measured on Zen 5 (Skv = 32768, 8 kv heads of 128, one thread, prefetches into L1)
/// four keys per step ran 10 % slower than two for float V, while 16-bit V (rows half as far apart) ran 10 % faster
/// with four. In the copy whose prefetches go into L2 (kLocality = 2, the one Zen 4 runs: isa.hpp's
/// decode_prefetch_level) four keys per step took float token-major decode 0.93–0.98 of the time from DRAM (six runs)
/// and 0.90–0.95 from L3 (Zen 4, paired against two, clang++; g++ 0.93 and 0.86; the same bits: bench/README.md,
/// "2026-12-05, twenty-ninth session"), so that copy takes kPvKeysPerStep for float V too.
template <class Tag, class S, int kLocality>
inline constexpr Index kPvGroupedKeysPerStep = sizeof(S) == sizeof(float) && kLocality != 2 ? 2 : kPvKeysPerStep<Tag>;

/// Whether a head-major decoding task (one kv head of at most 4 query rows: one row group) is paced as a grouped task
/// is, by a PrefetchCursor over its next sub-block (FusedTiles::kDecodePacedBytes) in the order it reads rows (the rest
/// of the pass, then the block's V, then the next block's K), instead of its calls over whole blocks prefetching a few
/// rows ahead inside the call: for float K and V on a 16-lane tag in the copy whose prefetches go into L1 (kLocality =
/// 3). Its P·V keeps kPvKeysPerStep (four keys per step; a grouped task's two in that copy are for rows 4 KiB apart).
/// Measured on Zen 5 (Sq = 1, Hq = 32, Hkv = 8, D = 128, BHSD float, Skv = 32768, one thread, clang++, paired against
/// the calls over whole blocks): from DRAM 0.782 and 0.790 of the time (16 of 16 rounds each), from L3 0.860 and 0.978,
/// D = 64 0.932; with two keys per P·V step instead, 1.14–1.15 × that from DRAM and 1.11–1.12 from L3; g++, in a first
/// form (two keys per step), 0.821 from DRAM. 16-bit K and V took 1.02 (bf16) and 1.07 (f16) of the time from DRAM in
/// that form and are not paced; at Hq = 64 (8 rows: two row groups of 4 instead of one call of 8) 0.979; the L2 copy
/// (Zen 4) was not measured (bench/README.md, "2026-12-06, thirty-second session").
template <class Tag, class S, int kLocality>
inline constexpr bool kHeadMajorPaced = Tag::kLanes >= 16 && kLocality == 3 && std::is_same_v<S, float>;

/// Query rows per call of a head-major decoding task (one kv head; fused_attention.hpp, run_decode_task) while that
/// many rows are left, the rest in calls of at most 4: 8 on a 32-register tag (qk_in_place with 8 × 2 accumulators,
/// NK = 2; pv_in_place with 8 × 3 weights, NV = kPvKeysPerStep8), so that at G = 8 (Hq = 64, Hkv = 8) each row of K
/// and V is read once, its arithmetic beside its stream, instead of once by each group of 4 rows, the later groups
/// reading the block from L2 while nothing streams from memory; 4 elsewhere. Measured on Zen 4 (Sq = 1, Hq = 64,
/// Hkv = 8, D = 128, BHSD, Skv = 32768 from DRAM, one thread, paired against 4-row calls over whole blocks): float
/// 0.826–0.899 of the time with clang++ (g++ 0.940); P·V alone 0.909 (g++ 0.945), Q·Kᵀ alone 0.919–0.973; 16-bit V
/// (P·V only) f16 0.956–0.990 (g++ 1.019), bf16 0.924–0.936 (g++ 0.996); P·V with NV = 2 0.962, 4 0.925. Q·Kᵀ takes 8
/// rows for float K only: with 16-bit K it took f16 decode 1.04–1.06 of the time, and bf16 0.975 with 8-row P·V
/// (bench/README.md, "2026-12-05, twenty-eighth session").
template <class Tag, class S>
inline constexpr int kQkDecodeRows = Tag::kLanes >= 16 && std::is_same_v<S, float> ? 8 : 4;
template <class Tag>
inline constexpr int kPvDecodeRows = Tag::kLanes >= 16 ? 8 : 4;
/// pv_in_place's NV for 8 rows (kPvDecodeRows): 24 weights in registers, 8 acc_o loads and stores per 24 FMAs.
inline constexpr int kPvKeysPerStep8 = 3;

/// qk_in_place's body, with the prefetch runs' bookkeeping compiled in only where there is a cursor (kPaced): a
/// head-major task that is not paced (kHeadMajorPaced) has none, and its loop then keeps its pointers in registers.
/// kDim: D where with_head_dim compiles it in, else 0 (D read at run time).
template <class Tag, int R, bool kPaced, Index kDim, int kLocality, class S>
inline void qk_steps(const float* q, Index ldq, const S* k, Index ldk, Index keys, Index d_runtime, float* s, Index lds,
                     PrefetchCursor<S>* ahead) noexcept {
  using namespace simd;
  using Vec = typename Tag::Vec;
  const Index D = kDim > 0 ? kDim : d_runtime;
  constexpr int L = Tag::kLanes;
  constexpr Index kDecodePrefetchKeys = FusedTiles<Tag>::kDecodePrefetchKeys;
  constexpr int NK = R > 4 ? 2 : static_cast<int>(kQkKeysPerStep<Tag>);
  static_assert(R >= 1 && (R <= 4 || (R == 8 && L >= 16 && !kPaced)),
                "qkv: qk_in_place takes at most 4 rows, or 8 without a cursor on a 32-register tag");
  static_assert(kQkKeysPerStep<Tag> % NK == 0, "qkv: 8-row steps must end where 4-row steps end (step_keys)");
  const Index d_full = D / L * L;
  const int tail = static_cast<int>(D - d_full);
  // With 8 rows (NK = 2), the steps end where 4-row steps would, and the keys after them go one at a time as there:
  // the same reductions for every key, so the same bits as 4-row calls.
  const Index step_keys = R > 4 ? keys / kQkKeysPerStep<Tag> * kQkKeysPerStep<Tag> : keys;
  Index j = 0;
  for (; j + NK <= step_keys; j += NK) {
    Vec acc[R * NK];
    QKV_UNROLL for (int a = 0; a < R * NK; ++a) acc[a] = zero(Tag());
    const S* key = k + j * ldk;
    typename PrefetchCursor<S>::Run run;
    if constexpr (kPaced) run = ahead->next_run();
    constexpr bool kSpread = kSpreadAhead<Tag, S, kPaced, kDim>;
    const S* ahead_rows = kSpread ? k + std::min(j + kSpreadKeys<Tag, kPaced, kLocality>, keys - NK) * ldk : nullptr;
    if (!kSpread && j + kDecodePrefetchKeys + NK <= keys) {
      QKV_UNROLL for (int c = 0; c < NK; ++c) prefetch_row<kLocality>(key + (kDecodePrefetchKeys + c) * ldk, D);
    }
    for_each_column<kDim, L>(d_full, [&](Index d) QKV_ALWAYS_INLINE {
      if constexpr (kSpread) {
        QKV_UNROLL for (int c = 0; c < NK; ++c) prefetch<kLocality>(ahead_rows + c * ldk + d);
      }
      Vec kv[NK];
      QKV_UNROLL for (int c = 0; c < NK; ++c) {
        kv[c] = load_kv(Tag(), key + c * ldk + d);
        keep_in_register(Tag(), kv[c]);
      }
      QKV_UNROLL for (int r = 0; r < R; ++r) {
        Vec qv = load(Tag(), q + r * ldq + d);
        keep_in_register(Tag(), qv);
        QKV_UNROLL for (int c = 0; c < NK; ++c) acc[r * NK + c] = fmadd(qv, kv[c], acc[r * NK + c]);
      }
    });
    if (tail > 0) {
      Vec kv[NK];
      QKV_UNROLL for (int c = 0; c < NK; ++c) kv[c] = load_kv_partial(Tag(), key + c * ldk + d_full, tail);
      QKV_UNROLL for (int r = 0; r < R; ++r) {
        const Vec qv = load_partial(Tag(), q + r * ldq + d_full, tail);
        QKV_UNROLL for (int c = 0; c < NK; ++c) acc[r * NK + c] = fmadd(qv, kv[c], acc[r * NK + c]);
      }
    }
    // Sums in (row, key) order, sixteen at a time where there are sixteen (4 rows × 4 keys or 8 × 2 on a 16-lane tag),
    // else four at a time (the same pairing, so the same bits); then each row's NK scores go to its row of s.
    constexpr int kSums = (R * NK + 3) / 4 * 4;
    float sums[kSums];
    if constexpr (R * NK == 16) {
      reduce_sum16(Tag(), acc, sums);
    } else {
      QKV_UNROLL for (int a = 0; a < R * NK; a += 4) {
        reduce_sum4(Tag(), acc[a], a + 1 < R * NK ? acc[a + 1] : zero(Tag()), a + 2 < R * NK ? acc[a + 2] : zero(Tag()),
                    a + 3 < R * NK ? acc[a + 3] : zero(Tag()), sums + a);
      }
    }
    QKV_UNROLL for (int r = 0; r < R; ++r) {
      QKV_UNROLL for (int c = 0; c < NK; ++c) s[r * lds + j + c] = sums[r * NK + c];
    }
    // The step's prefetch run, once its accumulators are reduced (see qk_in_place).
    if constexpr (kPaced) run.template issue_rest<kLocality>();
  }
  for (; j < keys; ++j) {
    Vec acc[R];
    QKV_UNROLL for (int r = 0; r < R; ++r) acc[r] = zero(Tag());
    const S* k0 = k + j * ldk;
    for (Index d = 0; d < d_full; d += L) {
      const auto kv0 = load_kv(Tag(), k0 + d);
      QKV_UNROLL for (int r = 0; r < R; ++r) acc[r] = fmadd(load(Tag(), q + r * ldq + d), kv0, acc[r]);
    }
    if (tail > 0) {
      const auto kv0 = load_kv_partial(Tag(), k0 + d_full, tail);
      QKV_UNROLL for (int r = 0; r < R; ++r) acc[r] =
          fmadd(load_partial(Tag(), q + r * ldq + d_full, tail), kv0, acc[r]);
    }
    QKV_UNROLL for (int r = 0; r < R; ++r) s[r * lds + j] = reduce_sum(Tag(), acc[r]);
  }
}

/// acc_s[r][j] = q[r]·k[j] for R ≤ 4 rows (or R = 8 without `ahead` on a 32-register tag: kQkDecodeRows) and `keys`
/// keys read in place (rows of D floats, `ldk` apart): the decoding micro-kernel, which streams K once instead of
/// packing it. NK keys per step (2 on AVX2, whose 16 registers hold 4 × 2 accumulators, 2 keys and q; 4 on AVX-512,
/// 2 there for 8 rows): each K vector is loaded once and meets the R rows of q, accumulating vertically over d; the
/// R × NK sums are then reduced together by a transposing reduction (reduce_sum16 for 4 × 4 and 8 × 2 on AVX-512,
/// else reduce_sum4; each pairs a sum's lanes the same way), not one horizontal reduction per (row, key). D tails by
/// masked loads, so nothing past a row is read. The keys after the last multiple of kQkKeysPerStep go one at a time
/// (reduce_sum, which pairs the lanes otherwise) whatever R is, so a score's bits do not depend on the rows of its
/// call (Fused.EightRowDecodingCallsGiveTheBitsOfTwoCallsOfFour). K is stored as S (float, Eigen::half
/// or Eigen::bfloat16) and converted to float as it is loaded (simd::load_kv): q is never rounded. `ahead`, if given,
/// hands each step of NK keys its run of lines (PrefetchCursor::next_run), prefetched once the step's sums are stored:
/// a loop or branch of prefetches inside the unrolled columns, or before the reduction, left the accumulators live
/// across it, and clang++ 14 spilled 38–45 vectors in the 4-row AVX-512 Q·Kᵀ (from L3 1.13–1.24 × the time). At
/// D = 64 and 128 the loop over d is unrolled (with_head_dim), with or without `ahead`. Each step prefetches the rows
/// kDecodePrefetchKeys ahead, where they lie within the call's keys, in one burst before its loads, with `ahead` too
/// (without it there, paced head-major decode from DRAM took 1.05–1.09 of the time with clang++ on Zen 5:
/// bench/README.md, "The paced Q·Kᵀ step's burst"), or, where kSpreadAhead holds (never with `ahead`), the rows
/// kSpreadKeys ahead one line per column between the FMAs (straight-line prefetches at fixed offsets: no loop or
/// branch, so no spills). Every prefetch goes to the level kLocality names (simd::prefetch: 3 L1, 2 L2).
template <class Tag, int R, int kLocality = 3, class S>
inline void qk_in_place(const float* q, Index ldq, const S* k, Index ldk, Index keys, Index D, float* s, Index lds,
                        PrefetchCursor<S>* ahead = nullptr) noexcept {
  if constexpr (R > 4) QKV_ASSERT(ahead == nullptr);  // 8 rows: no cursor
  if constexpr (R <= 4) {
    if (ahead != nullptr) {
      return with_head_dim<Tag>(D, [&](auto dim) {
        qk_steps<Tag, R, true, decltype(dim)::value, kLocality>(q, ldq, k, ldk, keys, D, s, lds, ahead);
      });
    }
  }
  {
    with_head_dim<Tag>(D, [&](auto dim) {
      qk_steps<Tag, R, false, decltype(dim)::value, kLocality>(q, ldq, k, ldk, keys, D, s, lds, ahead);
    });
  }
}

/// One step of pv_in_place: acc_o[r] += Σ_n p[r][n] · v[n] over NV keys (rows of v, `ldv` apart), each acc_o vector
/// loaded and stored once. The step's prefetch run, if any, is spread evenly over the vector columns
/// (Run::per_column lines at each). kDim: Dv where with_head_dim compiles it in, else 0 (Dv read at run time).
/// `ahead_rows`: the first of NV rows (`ldv` apart, at least Dv wide, rows the task reads: spread_rows) whose lines
/// the step prefetches one per vector column where kSpreadAhead (unpaced) or kSpreadAheadPaced (paced) holds; not read
/// otherwise (then it may be null). The run's lines go to the level kLocality names; a paced step's rows ahead go into
/// L1 in either copy (kSpreadLocality). kStraight (pv_keys, where kStraightRuns holds and the run is as long as the
/// step's rows): the run's lines issued straight-line, NV·L / kElementsPerLine at each column, not by issue_next.
template <class Tag, int R, int NV, bool kPaced, Index kDim, int kLocality, bool kStraight = false, class S>
inline void pv_step(const float* p, Index ldp, const S* v, Index ldv, float* o, Index ldo, Index dv_runtime,
                    typename PrefetchCursor<S>::Run& run, const S* ahead_rows) noexcept {
  using namespace simd;
  using Vec = typename Tag::Vec;
  constexpr int L = Tag::kLanes;
  const Index Dv = kDim > 0 ? kDim : dv_runtime, full = Dv / L * L;
  const int tail = static_cast<int>(Dv - full);
  Vec w[NV][R];
  QKV_UNROLL for (int n = 0; n < NV; ++n) {
    QKV_UNROLL for (int r = 0; r < R; ++r) w[n][r] = set1(Tag(), p[r * ldp + n]);
  }
  static_assert(
      !kStraight || (kPaced && kDim > 0 && kDim % L == 0 && NV * L % PrefetchCursor<S>::kElementsPerLine == 0),
      "qkv: a straight-line run needs a cursor, a compiled-in head_dim and whole lines per column");
  const Index per_column = kPaced && !kStraight ? run.per_column(full / L) : 0;
  for_each_column<kDim, L>(full, [&](Index c) QKV_ALWAYS_INLINE {
    if constexpr (kStraight) {
      run.template issue_column<NV * L / PrefetchCursor<S>::kElementsPerLine, kLocality>(c / L);
    } else if constexpr (kPaced) {
      run.template issue_next<kLocality>(per_column);
    }
    if constexpr (kPaced ? kSpreadAheadPaced<Tag, S, kDim> : kSpreadAhead<Tag, S, false, kDim>) {
      QKV_UNROLL for (int n = 0; n < NV; ++n) prefetch<kSpreadLocality<kPaced, kLocality>>(ahead_rows + n * ldv + c);
    }
    Vec x[NV];
    QKV_UNROLL for (int n = 0; n < NV; ++n) {
      x[n] = load_kv(Tag(), v + n * ldv + c);
      keep_in_register(Tag(), x[n]);
    }
    QKV_UNROLL for (int r = 0; r < R; ++r) {
      Vec acc = load(Tag(), o + r * ldo + c);
      QKV_UNROLL for (int n = 0; n < NV; ++n) acc = fmadd(w[n][r], x[n], acc);
      store(Tag(), o + r * ldo + c, acc);
    }
  });
  if constexpr (kPaced && !kStraight) run.template issue_rest<kLocality>();
  if (tail > 0) {
    Vec x[NV];
    QKV_UNROLL for (int n = 0; n < NV; ++n) x[n] = load_kv_partial(Tag(), v + n * ldv + full, tail);
    QKV_UNROLL for (int r = 0; r < R; ++r) {
      float* out = o + r * ldo + full;
      Vec acc = load_partial(Tag(), out, tail);
      QKV_UNROLL for (int n = 0; n < NV; ++n) acc = fmadd(w[n][r], x[n], acc);
      store_partial(Tag(), out, acc, tail);
    }
  }
}

/// pv_in_place's body for head_dim kDim (0: Dv read at run time), with the prefetch runs' bookkeeping compiled in
/// only where there is a cursor (kPaced): a head-major task that is not paced (kHeadMajorPaced) has none.
template <class Tag, int R, class S, int NV, bool kPaced, Index kDim, int kLocality>
inline void pv_keys(const float* p, Index ldp, const S* v, Index ldv, Index keys, float* o, Index ldo, Index dv_runtime,
                    PrefetchCursor<S>* ahead, const NextRows<S>& next) noexcept {
  constexpr Index kDecodePrefetchKeys = FusedTiles<Tag>::kDecodePrefetchKeys;
  const Index Dv = kDim > 0 ? kDim : dv_runtime;
  Index j = 0;
  for (; j + NV <= keys; j += NV) {
    typename PrefetchCursor<S>::Run run;
    if constexpr (kPaced) run = ahead->next_run();
    constexpr bool kSpread = kSpreadAhead<Tag, S, kPaced, kDim>;
    if (!kSpread && j + kDecodePrefetchKeys + NV <= keys) {
      QKV_UNROLL for (int n = 0; n < NV; ++n) {
        simd::prefetch_row<kLocality>(v + (j + kDecodePrefetchKeys + n) * ldv, Dv);
      }
    }
    constexpr bool kSpreadAny = kPaced ? kSpreadAheadPaced<Tag, S, kDim> : kSpread;
    const S* ahead_rows =
        kSpreadAny ? spread_rows(v, ldv, j, keys, NV, next, kSpreadKeys<Tag, kPaced, kLocality>) : nullptr;
    if constexpr (kPaced && kStraightRuns<Tag, S, kLocality, kDim, NV>) {
      if (run.lines == NV * kDim / PrefetchCursor<S>::kElementsPerLine) {
        pv_step<Tag, R, NV, true, kDim, kLocality, true>(p + j, ldp, v + j * ldv, ldv, o, ldo, Dv, run, ahead_rows);
        continue;
      }
    }
    pv_step<Tag, R, NV, kPaced, kDim, kLocality>(p + j, ldp, v + j * ldv, ldv, o, ldo, Dv, run, ahead_rows);
  }
  // The last keys' steps prefetch nothing new: their rows ahead are their own.
  typename PrefetchCursor<S>::Run none;
  if constexpr (NV > 2) {
    for (; j + 2 <= keys; j += 2) {
      pv_step<Tag, R, 2, false, kDim, kLocality>(p + j, ldp, v + j * ldv, ldv, o, ldo, Dv, none, v + j * ldv);
    }
  }
  if (j < keys) pv_step<Tag, R, 1, false, kDim, kLocality>(p + j, ldp, v + j * ldv, ldv, o, ldo, Dv, none, v + j * ldv);
}

/// pv_in_place with a cursor, out of line (QKV_NOINLINE): inlined into the decoding task, its unrolled bodies changed
/// how the compilers inlined the head-major P·V, which then took 1.02–1.08 (clang++) and 1.14 (g++) of the time.
template <class Tag, int R, class S, int NV, int kLocality>
QKV_NOINLINE inline void pv_paced(const float* p, Index ldp, const S* v, Index ldv, Index keys, float* o, Index ldo,
                                  Index Dv, PrefetchCursor<S>* ahead, const NextRows<S>& next) noexcept {
  with_head_dim<Tag>(Dv, [&](auto dim) {
    pv_keys<Tag, R, S, NV, true, decltype(dim)::value, kLocality>(p, ldp, v, ldv, keys, o, ldo, Dv, ahead, next);
  });
}

/// acc_o[r][0 .. Dv) += Σ_j p[r][j] · v[j][0 .. Dv) for R ≤ 4 rows (or R = 8 without `ahead` on a 32-register tag:
/// kPvDecodeRows), V read in place, front to back: the decoding P·V. V must stream in order at the prefetchers' pace
/// (visiting a group of keys column slice by column slice, so that the first slice touches one line per key, measured
/// slower from DRAM), so keys stay outermost and go NV at a time (kPvKeysPerStep: 2 on AVX2, 4 on AVX-512, whose 32
/// registers hold the 4·R weights; kPvKeysPerStep8 = 3 for 8 rows): the NV·R weights sit in
/// registers, and each acc_o vector (L1) is loaded and stored once per NV keys instead of once per key. Per V line:
/// NV V loads, R acc_o loads and R stores, NV·R FMAs per vector (at NV = 2 on AVX-512 the R stores, one 512-bit
/// store a cycle, matched the FMAs' cycles, and P·V took 1.5 times Q·Kᵀ's time in a decode from L3). Each acc_o
/// element takes its keys' FMAs in key order whatever NV is, so NV does not change the bits. Dv tails by masked
/// loads; the keys past the last whole step by pairs, then one. V is stored as S and converted as it is loaded, like
/// K in qk_in_place. A grouped task passes NV = kPvGroupedKeysPerStep. `ahead`, if given, hands each step of NV keys
/// its run of lines, prefetched spread over the vector columns between the FMAs (out of line, pv_paced), and where
/// kSpreadAheadPaced holds each step also prefetches the rows kDecodeSpreadKeys ahead in reading order, inside the
/// call's keys or past them in `next` (spread_rows); at Dv = 64 and 128 the loop over the columns is unrolled
/// (with_head_dim), with or without `ahead`. It prefetches as qk_in_place does (a burst kDecodePrefetchKeys ahead
/// within the call's keys, with `ahead` too, or, without `ahead`, kSpreadKeys ahead one line per column where
/// kSpreadAhead holds, then also into `next` past the call's keys). `next` is read only where kSpreadAhead or
/// kSpreadAheadPaced holds. Every prefetch goes to the level kLocality names, as in qk_in_place, but for a paced step's
/// rows ahead: L1 (kSpreadLocality).
template <class Tag, int R, class S, int NV = static_cast<int>(kPvKeysPerStep<Tag>), int kLocality = 3>
inline void pv_in_place(const float* p, Index ldp, const S* v, Index ldv, Index keys, float* o, Index ldo, Index Dv,
                        PrefetchCursor<S>* ahead = nullptr, const NextRows<S>& next = NextRows<S>()) noexcept {
  static_assert(R >= 1 && (R <= 4 || (R == 8 && Tag::kLanes >= 16 && NV <= 3)),
                "qkv: pv_in_place takes at most 4 rows, or 8 (at most 3 keys per step: kPvKeysPerStep8) without a "
                "cursor on a 32-register tag");
  if constexpr (R > 4) QKV_ASSERT(ahead == nullptr);
  if constexpr (R <= 4) {
    if (ahead != nullptr) return pv_paced<Tag, R, S, NV, kLocality>(p, ldp, v, ldv, keys, o, ldo, Dv, ahead, next);
  }
  {
    with_head_dim<Tag>(Dv, [&](auto dim) {
      pv_keys<Tag, R, S, NV, false, decltype(dim)::value, kLocality>(p, ldp, v, ldv, keys, o, ldo, Dv, ahead, next);
    });
  }
}

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_DECODE_KERNELS_HPP, per pass
