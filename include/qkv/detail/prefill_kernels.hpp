// qkv/detail/prefill_kernels.hpp — the prefill micro-kernels: Q·Kᵀ over packed key panels and P·V over packed
// value chunks, kStrip query rows at a time with every accumulator in registers.
//
// Per strip of R ≤ kStrip rows (fused_tiles.hpp) and panel of kPanel = kVectors·lanes keys, qk_panel holds
// R × kVectors vectors of scores; per chunk of kChunk Dv columns, pv_chunk holds R × kVectors vectors of acc_o. Both
// read one packed stream (pack.hpp) front to back and broadcast the other operand.
//
// Compiled once per kernel ISA, inside that ISA's target region: detail/dispatch.hpp includes it in each pass (the
// guard below, Highway's toggle, lets each pass in once).
#ifndef QKV_PASS_NAME
#error "qkv/detail/prefill_kernels.hpp is part of the fused kernel: include qkv/detail/dispatch.hpp"
#endif
#if defined(QKV_DETAIL_PREFILL_KERNELS_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_PREFILL_KERNELS_HPP
#undef QKV_DETAIL_PREFILL_KERNELS_HPP
#else
#define QKV_DETAIL_PREFILL_KERNELS_HPP
#endif

#include <algorithm>

#include "qkv/config.hpp"
#include "qkv/detail/fused_tiles.hpp"
#include "qkv/simd/simd.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512

/// Where a micro-kernel's left operand a[r][k] lies: at a[r·lda + k] (rows: Q, P, dS) or at a[r + k·lda] (columns:
/// the backward's Pᵀ and dSᵀ, read in place from P and dS). The operand is only ever broadcast, so its layout costs
/// no shuffles; a compile-time layout lets the compiler address each strip's broadcasts from one row pointer (runtime
/// strides cost the transposed products about 6 % of their speed alone with clang++, 2 % of the whole backward:
/// bench/README.md, "The backward's micro-kernels").
enum class StripLayout { rows, columns };

/// c[r][0 .. kVectors·lanes) = (c[r] if kAccumulate, else 0) + Σ_k a[r][k] · b[k][0 .. kVectors·lanes) for R rows
/// (R ≤ kStrip), n steps of k, a laid out as kLayout says: the prefill micro-kernel. R × kVectors accumulators stay
/// in registers; each step loads kVectors vectors of b and broadcasts one a per row. Q·Kᵀ is this over a packed key
/// panel (qk_panel) and P·V over a packed value chunk (pv_chunk). Kept apart from the tail kernel below: with both in
/// one function clang spilled an accumulator of the full-width loop to the stack.
template <class Tag, int R, bool kAccumulate, StripLayout kLayout = StripLayout::rows,
          int NV = FusedTiles<Tag>::kVectors>
inline void strip_times_panel(const float* a, Index lda, const float* b, Index ldb, Index n, float* c,
                              Index ldc) noexcept {
  using namespace simd;
  constexpr int L = Tag::kLanes;
  typename Tag::Vec acc[R][NV];
  QKV_UNROLL for (int r = 0; r < R; ++r) {
    QKV_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = kAccumulate ? load(Tag(), c + r * ldc + v * L) : zero(Tag());
  }
  for (Index k = 0; k < n; ++k) {
    typename Tag::Vec bv[NV];
    QKV_UNROLL for (int v = 0; v < NV; ++v) bv[v] = load(Tag(), b + k * ldb + v * L);
    QKV_UNROLL for (int r = 0; r < R; ++r) {
      const auto ab = set1(Tag(), kLayout == StripLayout::rows ? a[r * lda + k] : a[r + k * lda]);
      QKV_UNROLL for (int v = 0; v < NV; ++v) acc[r][v] = fmadd(ab, bv[v], acc[r][v]);
    }
  }
  QKV_UNROLL for (int r = 0; r < R; ++r) {
    QKV_UNROLL for (int v = 0; v < NV; ++v) store(Tag(), c + r * ldc + v * L, acc[r][v]);
  }
}

/// acc_s[r][0 .. kPanel) = Σ_d q[r][d] · panel[d][0 .. kPanel) for R rows: the scores of one packed key panel.
/// With `keys` < kPanel (a strip's last panel, cut at its last visible key: the causal diagonal), only the first
/// ⌈keys / lanes⌉ vectors of scores are computed and written; the panel's later keys are not needed.
template <class Tag, int R>
inline void qk_panel(const float* q, Index ldq, const float* panel, Index D, float* s, Index lds,
                     Index keys = FusedTiles<Tag>::kPanel) noexcept {
  constexpr int kPanel = FusedTiles<Tag>::kPanel, L = Tag::kLanes, NV = FusedTiles<Tag>::kVectors;
  const int vectors = keys >= kPanel ? NV : static_cast<int>((keys + L - 1) / L);
  dispatch_vectors<NV>(vectors, [&](auto vectors_constant) {
    constexpr int kV = decltype(vectors_constant)::value;
    strip_times_panel<Tag, R, false, StripLayout::rows, kV>(q, ldq, panel, kPanel, D, s, lds);
  });
}

/// acc_o[r][0 .. kChunk) += Σ_j p[r][j] · v[j][0 .. kChunk) for R rows: P·V over one packed value chunk (p laid out
/// as kLayout says, rows ldp apart or columns ldp apart).
template <class Tag, int R, StripLayout kLayout = StripLayout::rows>
inline void pv_chunk(const float* p, Index ldp, const float* v, Index ldv, Index keys, float* o, Index ldo) noexcept {
  strip_times_panel<Tag, R, true, kLayout>(p, ldp, v, ldv, keys, o, ldo);
}

/// pv_chunk over NV vectors of a packed last chunk (NV·lanes floats per key, ldv apart, zero past the row's end),
/// the last vector's `last` lanes only (1 ≤ last ≤ lanes) read and written in o: nothing past the row is touched.
/// The chunk's padding is loaded in full (it is zero), so the key loop carries no masks.
template <class Tag, int R, StripLayout kLayout, int NV>
inline void pv_chunk_vectors(const float* p, Index ldp, const float* v, Index ldv, Index keys, float* o, Index ldo,
                             int last) noexcept {
  using namespace simd;
  constexpr int L = Tag::kLanes;
  typename Tag::Vec acc[R][NV];
  QKV_UNROLL for (int r = 0; r < R; ++r) {
    QKV_UNROLL for (int u = 0; u + 1 < NV; ++u) acc[r][u] = load(Tag(), o + r * ldo + u * L);
    acc[r][NV - 1] = load_partial(Tag(), o + r * ldo + (NV - 1) * L, last);
  }
  for (Index j = 0; j < keys; ++j) {
    typename Tag::Vec vv[NV];
    QKV_UNROLL for (int u = 0; u < NV; ++u) vv[u] = load(Tag(), v + j * ldv + u * L);
    QKV_UNROLL for (int r = 0; r < R; ++r) {
      const auto pb = set1(Tag(), kLayout == StripLayout::rows ? p[r * ldp + j] : p[r + j * ldp]);
      QKV_UNROLL for (int u = 0; u < NV; ++u) acc[r][u] = fmadd(pb, vv[u], acc[r][u]);
    }
  }
  QKV_UNROLL for (int r = 0; r < R; ++r) {
    QKV_UNROLL for (int u = 0; u + 1 < NV; ++u) store(Tag(), o + r * ldo + u * L, acc[r][u]);
    store_partial(Tag(), o + r * ldo + (NV - 1) * L, acc[r][NV - 1], last);
  }
}

/// pv_chunk for the last `width` < kChunk columns of Dv, packed FusedTiles::chunk_floats(width) floats per key
/// (pack_values): ⌈width / lanes⌉ vectors of multiply-adds, not kVectors (Dv = 32 on AVX-512 would otherwise do
/// twice the work and Dv = 80 1.6 times), the last vector masked in o only. Each column's sum is pv_chunk's.
template <class Tag, int R, StripLayout kLayout = StripLayout::rows>
inline void pv_chunk_tail(const float* p, Index ldp, const float* v, Index keys, float* o, Index ldo,
                          int width) noexcept {
  constexpr int L = Tag::kLanes, NV = FusedTiles<Tag>::kVectors;
  const Index ldv = FusedTiles<Tag>::chunk_floats(width);
  const int vectors = (width + L - 1) / L, last = width - (vectors - 1) * L;
  dispatch_vectors<NV>(vectors, [&](auto vectors_constant) {
    pv_chunk_vectors<Tag, R, kLayout, decltype(vectors_constant)::value>(p, ldp, v, ldv, keys, o, ldo, last);
  });
}

/// acc_o[r][0 .. Dv) += Σ_j p[r][j] · v[first + j][0 .. Dv) for the R rows of a strip, j < keys, V packed by
/// pack_values (`v` its start, `skv` the keys it holds): one pass over the keys per chunk of kChunk columns (acc_o
/// loaded and stored once per chunk), the last chunk by pv_chunk_tail. p[r][j] at p[r·ldp + j].
template <class Tag, int R>
inline void pv_strip(const float* p, Index ldp, const float* v, Index skv, Index first, Index keys, float* o, Index ldo,
                     Index Dv) noexcept {
  constexpr Index kChunk = FusedTiles<Tag>::kChunk;
  const Index full = Dv / kChunk * kChunk;
  for (Index c = 0; c < full; c += kChunk)
    pv_chunk<Tag, R>(p, ldp, v + c * skv + first * kChunk, kChunk, keys, o + c, ldo);
  if (full < Dv) {
    const int width = static_cast<int>(Dv - full);
    pv_chunk_tail<Tag, R>(p, ldp, v + full * skv + first * FusedTiles<Tag>::chunk_floats(width), keys, o + full, ldo,
                          width);
  }
}

/// o[r][0 .. Dv) += Σ_j p[r][j] · v[j][0 .. Dv) for `rows` rows, V packed by pack_values (`v` its start, chunks
/// `chunk_stride` floats apart: the packed keys times kChunk), p laid out as kLayout says (rows or columns ldp
/// apart): pv_strip's sums for a whole block of rows, chunk by chunk. Every strip of kStrip rows passes over one
/// chunk (keys × kChunk floats, the last chunk keys × chunk_floats(width)) before the next, so the
/// chunk is read from L1 while the block's other operands stream; pv_strip, strip by strip, would stream every chunk
/// once per strip. Each element's sum runs over the keys in the same order as pv_strip's: the same bits.
template <class Tag, StripLayout kLayout = StripLayout::rows>
inline void pv_block(const float* p, Index ldp, const float* v, Index chunk_stride, Index keys, float* o, Index ldo,
                     Index rows, Index Dv) noexcept {
  constexpr Index kChunk = FusedTiles<Tag>::kChunk;
  constexpr Index kStrip = FusedTiles<Tag>::kStrip;
  for (Index c = 0; c < Dv; c += kChunk) {
    const float* chunk = v + c / kChunk * chunk_stride;
    const int width = static_cast<int>(std::min(kChunk, Dv - c));
    for (Index r0 = 0; r0 < rows; r0 += kStrip) {
      const float* strip = kLayout == StripLayout::rows ? p + r0 * ldp : p + r0;
      dispatch_rows(std::min(kStrip, rows - r0), [&](auto rows_constant) {
        constexpr int kR = decltype(rows_constant)::value;
        if (width == kChunk) {
          pv_chunk<Tag, kR, kLayout>(strip, ldp, chunk, kChunk, keys, o + r0 * ldo + c, ldo);
        } else {
          pv_chunk_tail<Tag, kR, kLayout>(strip, ldp, chunk, keys, o + r0 * ldo + c, ldo, width);
        }
      });
    }
  }
}

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_PREFILL_KERNELS_HPP, per pass
