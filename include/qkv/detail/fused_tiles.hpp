// qkv/detail/fused_tiles.hpp — the fused kernel's tile shapes per SIMD tag (FlashAttention's kernel_traits.h).
//
// Every size the kernel's loops and buffers depend on is here, as compile-time constants of one traits struct per
// tag, so that a binary gives the same bits for any thread count. An ISA takes shapes of its own through an explicit
// specialization of FusedTiles for its tag; the panel and chunk widths are those of the micro-kernels' accumulators
// (two vectors per row today, prefill_kernels.hpp), so a wider panel comes with micro-kernels to match.
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

/// Tile sizes of the fused kernel for a SIMD tag. The prefill micro-kernels hold kStrip rows × 2 vectors of
/// accumulators (12 on AVX2, whose 16 registers also hold the 2 loaded vectors and a broadcast).
template <class Tag>
struct FusedTiles {
  static constexpr int kLanes = Tag::kLanes;
  static constexpr int kPanel = 2 * kLanes;   ///< keys per packed Kᵀ panel (qk_panel's accumulator width)
  static constexpr int kChunk = 2 * kLanes;   ///< Dv columns per packed V chunk (pv_chunk's accumulator width)
  static constexpr int kStrip = 6;            ///< query rows per prefill micro-kernel call
  static constexpr Index kBlockM = 96;        ///< stacked query rows per task (a multiple of kStrip)
  static constexpr Index kBlockN = 256;       ///< keys per prefill tile (a multiple of every kPanel)
  static constexpr Index kSplitKeys = 2048;   ///< keys per split-K chunk (a single query tile)
  static constexpr Index kDecodeRows = 16;    ///< a sequence with Sq·G ≤ this reads K in place (no packing)
  static constexpr Index kDecodeKeys = 1024;  ///< keys per decoding block: all of its K, then all of its V
  static constexpr Index kDecodeSub = 64;     ///< keys per row-group pass when a decoding block has > 4 rows
  /// Keys ahead that the decoding kernels prefetch (whole rows; 32 rows of D = 128 floats are 16 KiB ahead of the
  /// loads). bench/README.md, "Decode rework", gives the measurement behind it.
  static constexpr Index kDecodePrefetchKeys = 32;
  static_assert(kPanel == 2 * kLanes && kChunk == 2 * kLanes,
                "qkv: the micro-kernels hold two vectors per row: another width needs micro-kernels to match");
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

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_FUSED_TILES_HPP, per pass
