// qkv/detail/fused_tiles.hpp — the fused kernel's tile shapes per SIMD tag (FlashAttention's kernel_traits.h).
//
// Every size the kernel's loops and buffers depend on is here, as compile-time constants of one traits struct per
// tag, so that a binary gives the same bits for any thread count. The shapes follow the tag's vector width (so the
// tests' emulated 16-lane tag runs AVX-512's); an ISA that needs others gets an explicit specialization of FusedTiles.
// The panel and chunk widths are those of the micro-kernels' accumulators (kVectors per row, prefill_kernels.hpp).
//
// Compiled once per kernel ISA, inside that ISA's target region: detail/dispatch.hpp includes it in each pass (the
// guard below, Highway's toggle, lets each pass in once).
#ifndef QKV_PASS_NAME
#error "qkv/detail/fused_tiles.hpp is part of the fused kernel: include qkv/detail/dispatch.hpp"
#endif
#if defined(QKV_DETAIL_FUSED_TILES_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_FUSED_TILES_HPP
#undef QKV_DETAIL_FUSED_TILES_HPP
#else
#define QKV_DETAIL_FUSED_TILES_HPP
#endif

#include <algorithm>
#include <type_traits>
#include <utility>

#include "qkv/config.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512

/// Tile sizes of the fused kernel for a SIMD tag, chosen by its vector width. The prefill micro-kernels hold kStrip
/// rows × kVectors vectors of accumulators: 6 × 2 = 12 on 8-lane AVX2, whose 16 registers also hold the 2 loaded
/// vectors and a broadcast; 6 × 4 = 24 on 16-lane AVX-512, whose 32 registers hold 4 loaded vectors and a broadcast
/// besides (per step 4 loads, 6 broadcasts and 24 FMAs: the FMA ports, not the load ports, bound it). Any 16-lane
/// tag (AVX-512, or the tests' emulated one) gets the 16-lane shapes, so those run on every CPU. Intel's and AMD's
/// AVX-512 cores take the same numbers: the key tile of 512 keys (256 KiB of K and of V at D = 128) fits both
/// vendors' L2 (2 MiB on Sapphire Rapids, 1 MiB on Zen 4 and 5).
template <class Tag>
struct FusedTiles {
  static constexpr int kLanes = Tag::kLanes;
  static constexpr bool kWide = kLanes >= 16;       ///< 32 vector registers (AVX-512 and wider)
  static constexpr int kVectors = kWide ? 4 : 2;    ///< accumulator vectors per micro-kernel row
  static constexpr int kPanel = kVectors * kLanes;  ///< keys per packed Kᵀ panel (qk_panel's accumulator width)
  static constexpr int kChunk = kVectors * kLanes;  ///< Dv columns per packed V chunk (pv_chunk's accumulator width)
  static constexpr int kStrip = 6;                  ///< query rows per prefill micro-kernel call
  static constexpr Index kBlockM = 96;              ///< stacked query rows per task (a multiple of kStrip)
  static constexpr Index kBlockN = kWide ? 512 : 256;  ///< keys per prefill tile (a multiple of every kPanel)
  static constexpr Index kSplitKeys = 2048;         ///< keys per split-K chunk (a single query tile)
  /// A prefill (sequence, kv head) whose packed K and V exceed kPrefillGroupBytes has its query tiles taken
  /// kPrefillGroupTiles at a time (fewer on a team: kPrefillGroupsPerThread), key chunk by key chunk
  /// (fused_attention.hpp, run_prefill_group), so that a chunk of kPrefillChunkBytes (rounded down to whole key tiles:
  /// 2048 keys at D = Dv = 128) read from memory serves every tile of the group from L3, instead of each tile streaming
  /// the whole of K and V. A group's Q blocks and softmax states (96 KiB each at D = Dv = 128) wait in L2 or L3 between
  /// chunks. Measured on Zen 5, AVX-512 kernel (D = 128, paired against tiles alone; bench/README.md, "2026-12-07,
  /// fortieth session"): T = 16384 (16 MiB of K and V per head) took 0.92-0.96 of the time on one thread, 0.915 on two;
  /// T = 8192 0.97-1.005; grouped at T = 4096 (4 MiB) 1.015, hence the threshold. 16 tiles a group took 0.99 of 8's
  /// time (noise). On Zen 3's AVX2 kernel ("forty-first session"): T = 16384 0.94, T = 8192 0.95, causal T = 16384 0.96
  /// (the same code on both sides gave 0.98 at T = 4096).
  static constexpr Index kPrefillGroupBytes = Index(4) << 20;
  static constexpr Index kPrefillChunkBytes = Index(2) << 20;
  static constexpr Index kPrefillGroupTiles = 8;
  /// On a team, groups shrink below kPrefillGroupTiles until each thread has this many (FusedAttention::plans), so
  /// that the threads share a call of few query tiles (one group of 8 would take one thread).
  static constexpr Index kPrefillGroupsPerThread = 4;
  static constexpr Index kDecodeRows = 16;          ///< a sequence with Sq·G ≤ this reads K in place (no packing)
  static constexpr Index kDecodeKeys = 1024;        ///< keys per decoding block: all of its K, then all of its V
  /// Keys ahead that the decoding kernels prefetch (whole rows; 16 rows of D = 128 floats are 8 KiB ahead of the
  /// loads). Without it, decode from DRAM took 1.4–1.9 times as long on Zen 5. Against 32 rows, 16 took g++'s
  /// head-major float decode from DRAM 0.88 of its time (8 rows 0.97, 24 0.95, 64 1.00) and clang++'s AVX2 build's
  /// 0.89; clang++'s AVX-512 build 1.00–1.03 from DRAM (8 to 24 rows within 2 % of each other, 64 slower) and 0.92
  /// from L3 (bench/README.md, "2026-12-03, sixteenth session" and "Decode: four keys per P·V step").
  static constexpr Index kDecodePrefetchKeys = 16;
  /// Keys ahead that a head-major step prefetches where it spreads them one line per vector column (kSpreadAhead in
  /// decode_kernels.hpp). Paired against 16 on Zen 5 (BHSD float, Skv = 32768, one thread, clang++): 8 rows took
  /// 0.940 and 0.957 of the time from DRAM (0.985 from L3), 12 rows 0.968, 4 rows 1.128, 24 rows 1.023–1.030, 32 rows
  /// 1.055–1.064 (bench/README.md, "2026-12-05, twenty-fourth session"). A grouped task's P·V steps prefetch as far
  /// ahead in their reading order (kSpreadAheadPaced): from DRAM 4, 12 and 16 rows gained less than 8 there
  /// ("2026-12-05, twenty-fifth session"). Where a head-major step's prefetches go into L2: kDecodeSpreadKeysL2.
  static constexpr Index kDecodeSpreadKeys = 8;
  /// kDecodeSpreadKeys for a head-major step whose prefetches go into L2 (isa.hpp's decode_prefetch_level: Zen 4).
  /// Paired against 8 on Zen 4 (BHSD float, Skv = 32768, one thread, clang++, prefetches into L2): 16 rows took 0.850,
  /// 0.900 and 0.942 of the time from DRAM (16, 15 and 16 of 16 rounds), 24 rows 0.873, 32 rows 0.899; 32 against 16
  /// 1.015 (8 of 20), and from L3 16 against 8 0.985 (23 of 40, within the noise). A grouped task's P·V spread keeps 8:
  /// 16 took its token-major decode from DRAM 1.011 of the time (5 of 20) (bench/README.md, "2026-12-05, twenty-seventh
  /// session"; decode_kernels.hpp, kSpreadKeys).
  static constexpr Index kDecodeSpreadKeysL2 = 16;
  /// A decoding task over token-major K and V (several kv heads, fused_attention.hpp): keys per sub-block that its
  /// heads take in turn (16 rows of 8 heads × 128 floats are 64 KiB); each sub-block prefetches the next one's whole
  /// key rows, paced over its micro-kernel steps (decode_kernels.hpp, PrefetchCursor). Measured on Zen 5 with float
  /// and f16 K/V, other sizes and look-aheads were slower or traded one storage type for the other (bench/README.md,
  /// "What holds token-major float decode").
  static constexpr Index kDecodeGroupKeys = 16;
  /// Bytes of K rows (D elements each) per sub-block of a head-major decoding task, whose V sub-blocks take as many
  /// keys, that is paced like a grouped one (a PrefetchCursor over the next sub-block in reading order,
  /// fused_attention.hpp's run_decode_task, where kHeadMajorPaced holds): 32 keys of D = 128 floats, 64 of D = 64.
  /// Measured on Zen 5 (Sq = 1, Hq = 32, Hkv = 8, D = 128, BHSD float, Skv = 32768 from DRAM, one thread, paired
  /// against calls over the whole block, the P·V by pairs of keys): 8 KiB took 0.777 of the time, 16 KiB 0.757–0.821
  /// (clang++ three runs, g++ 0.821), 32 KiB 1.026, 64 KiB 1.044, 128 KiB 1.048: what the cursor fetches into L1 a
  /// sub-block ahead must fit there beside the sub-block being read (bench/README.md, "2026-12-06, thirty-second
  /// session").
  static constexpr Index kDecodePacedBytes = 16384;
  /// Key chunks (split-K) a grouped decoding sequence is cut into where it has that many blocks, so that threads
  /// share it: it is one task per chunk, not one per kv head.
  static constexpr Index kDecodeMinChunks = 4;
  /// Whether the decoding task is compiled a second time with its prefetches into L2 (run_group, isa.hpp's
  /// decode_prefetch_level): the vector kernels only. On a CPU that picks L2 (Zen 4, with AVX-512) the scalar kernel
  /// runs only under the QKV_ISA=scalar pin or in a build without dispatch (QKV_DISPATCH=0) whose flags lack AVX2, and
  /// prefetches into L1 there too, so that a dispatching build compiles one decoding copy fewer. The AVX2 kernel keeps
  /// both: an -march=x86-64-v3 binary runs it on Zen 4, where L2 took 0.47–0.62 of its decode time from DRAM
  /// (bench/README.md, "2026-12-05, twenty-sixth session"). Besides its prefetches, the L2 copy differs in one step
  /// size: a grouped task's P·V takes four float keys per step on 16-lane tags (kPvGroupedKeysPerStep), the same bits.
  static constexpr bool kDecodePrefetchL2 = kLanes > 1;
  /// Floats per key of a packed chunk `width` ≤ kChunk columns wide: kChunk for a full chunk, the last chunk of Dv
  /// (or D) rounded up to whole vectors only, so that a narrow tail (Dv = 32, 80 or 96 on AVX-512) costs neither
  /// memory nor multiply-adds for columns that do not exist (pack_values, pv_chunk_tail).
  static constexpr Index chunk_floats(Index width) noexcept { return (width + kLanes - 1) / kLanes * kLanes; }
  static_assert(kVectors >= 1 && kVectors <= 4, "qkv: the micro-kernels hold 1 to 4 vectors per row");
  static_assert(kStrip >= 1 && kStrip <= 6, "qkv: dispatch_rows instantiates strips of 1 to 6 rows");
  static_assert(kBlockM % kStrip == 0, "qkv: kBlockM must be a multiple of kStrip");
  static_assert(kBlockN % kPanel == 0, "qkv: kBlockN must be a multiple of the panel width");
  static_assert(kSplitKeys % kBlockN == 0, "qkv: kSplitKeys must be a multiple of kBlockN");
  static_assert(kSplitKeys % kDecodeKeys == 0, "qkv: kSplitKeys must be a multiple of kDecodeKeys");
};

/// Calls f(std::integral_constant<int, R>()) for R = min(rows, 6), rows ≥ 1 (6 is the largest kStrip): the
/// micro-kernels take the row count as a template argument so their accumulators stay in registers.
template <class F, int... R>
inline void dispatch_rows(Index rows, F&& f, std::integer_sequence<int, R...>) {
  QKV_ASSERT(rows >= 1);
  const Index n = std::min<Index>(rows, 6);
  (void)((n == R ? (f(std::integral_constant<int, R>()), true) : false) || ...);
}
template <class F>
inline void dispatch_rows(Index rows, F&& f) {
  dispatch_rows(rows, f, std::integer_sequence<int, 1, 2, 3, 4, 5, 6>());
}

/// Calls f(std::integral_constant<int, R>(), r0) for the row groups r0 … r0 + R − 1 of rows [begin, end), in order:
/// groups of kRows while that many rows are left (where kRows > 4), then groups of at most 4 (the decoding task's
/// calls, fused_attention.hpp: kRows is decode_kernels.hpp's kQkDecodeRows or kPvDecodeRows, or 4).
template <int kRows, class F>
inline void for_each_row_group(Index begin, Index end, F&& f) {
  static_assert(kRows == 4 || kRows == 8, "qkv: the decoding micro-kernels take 4 or 8 rows");
  Index r0 = begin;
  if constexpr (kRows > 4) {
    for (; end - r0 >= kRows; r0 += kRows) f(std::integral_constant<int, kRows>(), r0);
  }
  for (; r0 < end; r0 += 4) {
    dispatch_rows(std::min<Index>(4, end - r0), [&](auto rows_constant) {
      f(std::integral_constant<int, std::min(4, decltype(rows_constant)::value)>(), r0);
    });
  }
}

/// Calls f(std::integral_constant<int, V>()) for V = vectors, 1 ≤ vectors ≤ kMax ≤ 4: a micro-kernel's vector count
/// as a template argument where a panel or chunk needs fewer than kVectors (a strip's last key panel, qk_panel; a
/// narrow last value chunk, pv_chunk_tail). Only the counts up to kMax are instantiated.
template <int kMax, class F>
inline void dispatch_vectors(int vectors, F&& f) {
  static_assert(kMax >= 1 && kMax <= 4, "qkv: the micro-kernels hold 1 to 4 vectors per row");
  QKV_ASSERT(vectors >= 1 && vectors <= kMax);
  if constexpr (kMax >= 4) {
    if (vectors == 4) return f(std::integral_constant<int, 4>());
  }
  if constexpr (kMax >= 3) {
    if (vectors == 3) return f(std::integral_constant<int, 3>());
  }
  if constexpr (kMax >= 2) {
    if (vectors == 2) return f(std::integral_constant<int, 2>());
  }
  f(std::integral_constant<int, 1>());
}

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_FUSED_TILES_HPP, per pass
