// qkv/detail/fused_attention.hpp — the fused kernel: FlashAttention-2's forward loop on the CPU, in float.
//
// Design (internal; the public entry point is qkv::attention with Backend::fused or automatic):
//
//   for each (sequence b, kv head h_kv, query tile of rows [i0, i1)):            one task, threads over tasks
//     stack the G query heads of the group: block row r = g·mq + (i − i0), M = G·mq rows (kBlockM at most
//       unless G alone exceeds it), so every K/V tile is read once per group (GQA; gemma.cpp's head groups)
//     Q_block ← q·scale·log2(e) (M × D, L1/L2 resident; q·scale when softcap, bias or ALiBi must see base e)
//     for each key tile [j0, j1) of kBlockN keys inside MaskGeometry::key_range(i0, i1):  n_block_min/max
//       skip it if the index rules hide it entirely (causal costs about half, a window O(T·w))
//       for each strip of kStrip = 6 block rows (prefill; run_prefill_task):
//         skip the tile if the strip cannot see it; cut its keys to the strip's own visible range
//         acc_s = Q_strip · K_tileᵀ        micro-kernel: 6 rows × one panel of 2·lanes keys (12 accumulators
//                                          on AVX2), K packed once per (sequence, kv head) as panels [D][2·lanes]
//         softcap / bias / ALiBi per element where present; the index mask only in boundary tiles
//         row_max, row_sum: online softmax in base 2 (exp2); acc_o rescaled only when a row's max rose
//         acc_o += P · V_tile               micro-kernel: 6 rows × 2 vectors of Dv, V packed once per (sequence,
//                                          kv head) in chunks [Dv / 2·lanes][key][2·lanes] (contiguous streams)
//       (decoding, Sq·G ≤ kDecodeRows: run_task's own loop, K and V read in place)
//     out = acc_o / row_sum (one division per row), lse = row_max·ln 2 + log(row_sum)
//
// Memory: per thread Q_block (M × D), acc_s (M × kBlockN; prefill uses kStrip × kBlockN of it, which stays in L1),
// acc_o (M × Dv) floats, 64-byte aligned, allocated once per call; packed K and V: the size of K and V, V's rows
// rounded up to 2·lanes floats (prefill sequences only). Nothing of size Sq × Skv. Traffic per task: K and V of the
// visible key range once from memory, then from L2 for every strip (kBlockN = 256 keys × D = 128 floats = 128 KiB
// each), Q and out once.
//
// Exactness rules kept here (DESIGN.md): hidden keys are selected away (−∞ before exp), never multiplied by zero;
// in a tile where a key may be hidden and a value is NaN or ∞, P·V skips zero weights so a hidden slot cannot leak;
// a row with NaN or +∞ among its visible scores is NaN (as the reference); empty rows give zeros and lse −∞;
// sinks join the denominator at the end as a state with output 0 and lse = the sink logit; a prefill task whose
// scores could overflow in base 2 (above FLT_MAX / log2 e) runs in base e (run_prefill_task, base2_fits).
//
// Split-K: a sequence with a single query tile and many keys (decoding, and a short prefill against more than
// kSplitKeys keys) splits its keys into chunks of kSplitKeys (a number fixed by the shape, never by the thread
// count); each chunk is a task; the partial (out, lse) states, lse always in base e, are merged in chunk order, so
// results are bit-identical for any number of threads.
//
// Decoding (Sq·G ≤ kDecodeRows) reads K and V in place, in blocks of kDecodeKeys = 1024 keys: one pass over the
// block's K only (qk_in_place: 2 keys × 4 rows per step on AVX2, vertical accumulation, sums reduced four at a time),
// the mask and the block's softmax over the scores (an L1/L2 buffer of M × 1024 floats), then one pass over its V
// only (pv_in_place: keys in order, two per step). Each pass prefetches kDecodePrefetchKeys rows ahead. Per key and
// kv head (D = Dv = 128, G = 4): 32 vector loads of K and V, 128 FMAs; the compulsory traffic is K and V once.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/detail/attention_shape.hpp"
#include "qkv/detail/threads.hpp"
#include "qkv/mask.hpp"
#include "qkv/options.hpp"
#include "qkv/simd/simd.hpp"
#include "qkv/softmax.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {

/// A 64-byte aligned float buffer, allocated once and reused (no allocation inside the kernel loops).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t n) { resize(n); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { release(); }
  void resize(std::size_t n) {
    if (n <= size_) return;
    release();
    data_ = static_cast<float*>(::operator new(std::max<std::size_t>(n, 1) * sizeof(float), std::align_val_t(64)));
    size_ = n;
  }
  float* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  void release() noexcept {
    if (data_ != nullptr) ::operator delete(data_, std::align_val_t(64));
    data_ = nullptr;
    size_ = 0;
  }
  float* data_ = nullptr;
  std::size_t size_ = 0;
};

/// Tile sizes of the fused kernel for a SIMD tag.
template <class Tag>
struct FusedTiles {
  static constexpr int kLanes = Tag::kLanes;
  static constexpr int kPanel = 2 * kLanes;   ///< keys per packed Kᵀ panel, and Dv columns per P·V chunk
  static constexpr int kStrip = 6;            ///< query rows per micro-kernel call: 6 × 2 accumulators
  static constexpr Index kBlockM = 96;        ///< stacked query rows per task (a multiple of kStrip)
  static constexpr Index kBlockN = 256;       ///< keys per tile (a multiple of every kPanel)
  static constexpr Index kSplitKeys = 2048;   ///< keys per split-K chunk (a single query tile)
  static constexpr Index kDecodeRows = 16;    ///< a sequence with Sq·G ≤ this reads K in place (no packing)
  static constexpr Index kDecodeKeys = 1024;  ///< keys per decoding block: all of its K, then all of its V
  static constexpr Index kDecodeSub = 64;     ///< keys per row-group pass when a decoding block has > 4 rows
  static_assert(kBlockM % kStrip == 0, "qkv: kBlockM must be a multiple of kStrip");
  static_assert(kBlockN % kPanel == 0, "qkv: kBlockN must be a multiple of the panel width");
  static_assert(kSplitKeys % kBlockN == 0, "qkv: kSplitKeys must be a multiple of kBlockN");
  static_assert(kSplitKeys % kDecodeKeys == 0, "qkv: kSplitKeys must be a multiple of kDecodeKeys");
};

/// Packs the first `skv` keys of k (rows of D floats, `ld` apart) into panels of kPanel keys laid out
/// [panel][d][key], zero-padding the last panel. Returns the largest finite |k| (±∞ and NaN left out: they make a
/// score ±∞ or NaN in any base), which bounds the scores for the choice of the softmax's base (base2_fits).
template <class Tag>
float pack_keys(const float* k, Index ld, Index skv, Index D, float* packed) noexcept {
  constexpr int kPanel = FusedTiles<Tag>::kPanel;
  const Index panels = (skv + kPanel - 1) / kPanel;
  constexpr float kInf = std::numeric_limits<float>::infinity();
  float abs_max = 0.0f;
  for (Index p = 0; p < panels; ++p) {
    float* dst = packed + p * D * kPanel;
    const Index keys = std::min<Index>(kPanel, skv - p * kPanel);
    for (Index j = 0; j < kPanel; ++j) {
      if (j < keys) {
        const float* src = k + (p * kPanel + j) * ld;
        for (Index d = 0; d < D; ++d) {
          dst[d * kPanel + j] = src[d];
          const float a = std::fabs(src[d]);
          abs_max = std::max(abs_max, a < kInf ? a : 0.0f);
        }
      } else {
        for (Index d = 0; d < D; ++d) dst[d * kPanel + j] = 0.0f;
      }
    }
  }
  return abs_max;
}

/// Packs the first `skv` values (rows of Dv floats, `ld` apart) into column chunks of 2·lanes laid out
/// [chunk][key][2·lanes], zero-padding the last chunk's columns past Dv: P·V then streams each chunk of a tile as one
/// contiguous block (V read in place crosses a 4 KiB page every few keys, where the hardware prefetchers stop).
template <class Tag>
void pack_values(const float* v, Index ld, Index skv, Index Dv, float* packed) noexcept {
  constexpr Index kChunk = 2 * Tag::kLanes;
  for (Index c = 0; c < Dv; c += kChunk) {
    const Index width = std::min(kChunk, Dv - c);
    float* dst = packed + c * skv;
    for (Index j = 0; j < skv; ++j) {
      const float* src = v + j * ld + c;
      for (Index d = 0; d < width; ++d) dst[j * kChunk + d] = src[d];
      for (Index d = width; d < kChunk; ++d) dst[j * kChunk + d] = 0.0f;
    }
  }
}

/// acc_s[r][0..kPanel) = Σ_d q[r][d] · panel[d][0..kPanel) for R rows (R ≤ kStrip).
template <class Tag, int R>
inline void qk_panel(const float* q, Index ldq, const float* panel, Index D, float* s, Index lds) noexcept {
  using namespace simd;
  constexpr int L = Tag::kLanes;
  constexpr int kPanel = 2 * L;
  typename Tag::Vec acc[R][2];
  QKV_UNROLL for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero(Tag());
  for (Index d = 0; d < D; ++d) {
    const auto k0 = load(Tag(), panel + d * kPanel);
    const auto k1 = load(Tag(), panel + d * kPanel + L);
    QKV_UNROLL for (int r = 0; r < R; ++r) {
      const auto qb = set1(Tag(), q[r * ldq + d]);
      acc[r][0] = fmadd(qb, k0, acc[r][0]);
      acc[r][1] = fmadd(qb, k1, acc[r][1]);
    }
  }
  QKV_UNROLL for (int r = 0; r < R; ++r) {
    store(Tag(), s + r * lds, acc[r][0]);
    store(Tag(), s + r * lds + L, acc[r][1]);
  }
}

/// Keys ahead that the decoding kernels prefetch (all D floats of the row): 32 rows of D = 128 floats are 16 KiB
/// ahead of the loads. Measured on Zen 3 from DRAM: the hardware prefetchers alone left both passes at about 0.65
/// of a plain read loop's bandwidth; with this hint, about 0.8. Only rows inside the kernel's own key range.
constexpr Index kDecodePrefetchKeys = 32;

/// Prefetches the first n floats of row p (one hint per 64-byte line).
inline void prefetch_row(const float* p, Index n) noexcept {
  for (Index d = 0; d < n; d += 16) simd::prefetch(p + d);
}

/// acc_s[r][j] = q[r]·k[j] for R ≤ 4 rows and `keys` keys read in place (rows of D floats, `ldk` apart): the
/// decoding micro-kernel, which streams K once instead of packing it. NK keys per step (2 on AVX2, whose 16
/// registers hold 4 × 2 accumulators, 2 keys and q; 4 on AVX-512): each K vector is loaded once and meets the R
/// rows of q, accumulating vertically over d; the R × NK sums are then reduced four at a time by a transposing
/// reduction (reduce_sum4), not one horizontal reduction per (row, key). D tails by masked loads, so nothing past
/// a row is read; a remainder of keys one at a time.
template <class Tag, int R>
inline void qk_in_place(const float* q, Index ldq, const float* k, Index ldk, Index keys, Index D, float* s,
                        Index lds) noexcept {
  using namespace simd;
  using Vec = typename Tag::Vec;
  constexpr int L = Tag::kLanes;
  constexpr int NK = L >= 16 ? 4 : 2;
  static_assert(R >= 1 && R <= 4, "qkv: qk_in_place takes at most 4 rows");
  const Index d_full = D / L * L;
  const int tail = static_cast<int>(D - d_full);
  Index j = 0;
  for (; j + NK <= keys; j += NK) {
    Vec acc[R * NK];
    QKV_UNROLL for (int a = 0; a < R * NK; ++a) acc[a] = zero(Tag());
    const float* key = k + j * ldk;
    if (j + kDecodePrefetchKeys + NK <= keys) {
      QKV_UNROLL for (int c = 0; c < NK; ++c) prefetch_row(key + (kDecodePrefetchKeys + c) * ldk, D);
    }
    for (Index d = 0; d < d_full; d += L) {
      Vec kv[NK];
      QKV_UNROLL for (int c = 0; c < NK; ++c) kv[c] = load(Tag(), key + c * ldk + d);
      QKV_UNROLL for (int r = 0; r < R; ++r) {
        const Vec qv = load(Tag(), q + r * ldq + d);
        QKV_UNROLL for (int c = 0; c < NK; ++c) acc[r * NK + c] = fmadd(qv, kv[c], acc[r * NK + c]);
      }
    }
    if (tail > 0) {
      Vec kv[NK];
      QKV_UNROLL for (int c = 0; c < NK; ++c) kv[c] = load_partial(Tag(), key + c * ldk + d_full, tail);
      QKV_UNROLL for (int r = 0; r < R; ++r) {
        const Vec qv = load_partial(Tag(), q + r * ldq + d_full, tail);
        QKV_UNROLL for (int c = 0; c < NK; ++c) acc[r * NK + c] = fmadd(qv, kv[c], acc[r * NK + c]);
      }
    }
    // Sums in (row, key) order, four at a time; then each row's NK scores go to its row of s.
    constexpr int kSums = (R * NK + 3) / 4 * 4;
    float sums[kSums];
    QKV_UNROLL for (int a = 0; a < R * NK; a += 4) {
      reduce_sum4(Tag(), acc[a], a + 1 < R * NK ? acc[a + 1] : zero(Tag()), a + 2 < R * NK ? acc[a + 2] : zero(Tag()),
                  a + 3 < R * NK ? acc[a + 3] : zero(Tag()), sums + a);
    }
    QKV_UNROLL for (int r = 0; r < R; ++r) {
      QKV_UNROLL for (int c = 0; c < NK; ++c) s[r * lds + j + c] = sums[r * NK + c];
    }
  }
  for (; j < keys; ++j) {
    Vec acc[R];
    QKV_UNROLL for (int r = 0; r < R; ++r) acc[r] = zero(Tag());
    const float* k0 = k + j * ldk;
    for (Index d = 0; d < d_full; d += L) {
      const auto kv0 = load(Tag(), k0 + d);
      QKV_UNROLL for (int r = 0; r < R; ++r) acc[r] = fmadd(load(Tag(), q + r * ldq + d), kv0, acc[r]);
    }
    if (tail > 0) {
      const auto kv0 = load_partial(Tag(), k0 + d_full, tail);
      QKV_UNROLL for (int r = 0; r < R; ++r) acc[r] =
          fmadd(load_partial(Tag(), q + r * ldq + d_full, tail), kv0, acc[r]);
    }
    QKV_UNROLL for (int r = 0; r < R; ++r) s[r * lds + j] = reduce_sum(Tag(), acc[r]);
  }
}

/// acc_o[r][0 .. 2·lanes) += Σ_j p[r][j] · v[j][0 .. 2·lanes) for R rows (R ≤ kStrip): the P·V micro-kernel,
/// 2R accumulators in registers. Kept apart from the tail kernel below: with both in one function clang spilled
/// an accumulator of the full-width loop to the stack.
template <class Tag, int R>
inline void pv_chunk(const float* p, Index ldp, const float* v, Index ldv, Index keys, float* o, Index ldo) noexcept {
  using namespace simd;
  constexpr int L = Tag::kLanes;
  typename Tag::Vec acc[R][2];
  QKV_UNROLL for (int r = 0; r < R; ++r) {
    acc[r][0] = load(Tag(), o + r * ldo);
    acc[r][1] = load(Tag(), o + r * ldo + L);
  }
  for (Index j = 0; j < keys; ++j) {
    const auto v0 = load(Tag(), v + j * ldv);
    const auto v1 = load(Tag(), v + j * ldv + L);
    QKV_UNROLL for (int r = 0; r < R; ++r) {
      const auto pb = set1(Tag(), p[r * ldp + j]);
      acc[r][0] = fmadd(pb, v0, acc[r][0]);
      acc[r][1] = fmadd(pb, v1, acc[r][1]);
    }
  }
  QKV_UNROLL for (int r = 0; r < R; ++r) {
    store(Tag(), o + r * ldo, acc[r][0]);
    store(Tag(), o + r * ldo + L, acc[r][1]);
  }
}

/// pv_chunk for the last `width` < 2·lanes columns of Dv: masked loads and stores, nothing past the row is touched.
template <class Tag, int R>
inline void pv_chunk_tail(const float* p, Index ldp, const float* v, Index ldv, Index keys, float* o, Index ldo,
                          int width) noexcept {
  using namespace simd;
  constexpr int L = Tag::kLanes;
  typename Tag::Vec acc[R][2];
  const int n0 = std::min(width, L), n1 = std::max(0, width - L);
  QKV_UNROLL for (int r = 0; r < R; ++r) {
    acc[r][0] = load_partial(Tag(), o + r * ldo, n0);
    acc[r][1] = load_partial(Tag(), o + r * ldo + L, n1);
  }
  for (Index j = 0; j < keys; ++j) {
    const auto v0 = load_partial(Tag(), v + j * ldv, n0);
    const auto v1 = load_partial(Tag(), v + j * ldv + L, n1);
    QKV_UNROLL for (int r = 0; r < R; ++r) {
      const auto pb = set1(Tag(), p[r * ldp + j]);
      acc[r][0] = fmadd(pb, v0, acc[r][0]);
      acc[r][1] = fmadd(pb, v1, acc[r][1]);
    }
  }
  QKV_UNROLL for (int r = 0; r < R; ++r) {
    store_partial(Tag(), o + r * ldo, acc[r][0], n0);
    store_partial(Tag(), o + r * ldo + L, acc[r][1], n1);
  }
}

/// acc_o[r][0 .. Dv) += Σ_j p[r][j] · v[j][0 .. Dv) for the R rows of a strip, V packed by pack_values (`v` at
/// the strip's first key of chunk 0, chunks `chunk_stride` floats apart): one pass over the keys per chunk of 2·lanes
/// columns (acc_o loaded and stored once per chunk), the last chunk by pv_chunk_tail.
template <class Tag, int R>
inline void pv_strip(const float* p, Index ldp, const float* v, Index chunk_stride, Index keys, float* o, Index ldo,
                     Index Dv) noexcept {
  constexpr Index kChunk = 2 * Tag::kLanes;
  const Index full = Dv / kChunk * kChunk;
  for (Index c = 0; c < full; c += kChunk)
    pv_chunk<Tag, R>(p, ldp, v + c / kChunk * chunk_stride, kChunk, keys, o + c, ldo);
  if (full < Dv) {
    pv_chunk_tail<Tag, R>(p, ldp, v + full / kChunk * chunk_stride, kChunk, keys, o + full, ldo,
                          static_cast<int>(Dv - full));
  }
}

/// acc_o[r][0 .. Dv) += Σ_j p[r][j] · v[j][0 .. Dv) for R ≤ 4 rows, V read in place, front to back: the decoding
/// P·V. V must stream in order at the prefetchers' pace (visiting a group of keys column slice by column slice, so
/// that the first slice touches one line per key, measured slower from DRAM), so keys stay outermost and go two
/// at a time: the 2·R weights sit in registers, and each acc_o vector (L1) is loaded and stored once per two keys
/// instead of once per key. Per V line: 2 V loads, R acc_o loads and R stores, 2·R FMAs per vector. Dv tails by
/// masked loads; an odd last key alone.
template <class Tag, int R>
inline void pv_in_place(const float* p, Index ldp, const float* v, Index ldv, Index keys, float* o, Index ldo,
                        Index Dv) noexcept {
  using namespace simd;
  using Vec = typename Tag::Vec;
  constexpr int L = Tag::kLanes;
  static_assert(R >= 1 && R <= 4, "qkv: pv_in_place takes at most 4 rows");
  const Index full = Dv / L * L;
  const int tail = static_cast<int>(Dv - full);
  Index j = 0;
  for (; j + 2 <= keys; j += 2) {
    const float* v0 = v + j * ldv;
    const float* v1 = v0 + ldv;
    if (j + kDecodePrefetchKeys + 2 <= keys) {
      prefetch_row(v0 + kDecodePrefetchKeys * ldv, Dv);
      prefetch_row(v1 + kDecodePrefetchKeys * ldv, Dv);
    }
    Vec p0[R], p1[R];
    QKV_UNROLL for (int r = 0; r < R; ++r) {
      p0[r] = set1(Tag(), p[r * ldp + j]);
      p1[r] = set1(Tag(), p[r * ldp + j + 1]);
    }
    for (Index c = 0; c < full; c += L) {
      const Vec a = load(Tag(), v0 + c), b = load(Tag(), v1 + c);
      QKV_UNROLL for (int r = 0; r < R; ++r) {
        store(Tag(), o + r * ldo + c, fmadd(p1[r], b, fmadd(p0[r], a, load(Tag(), o + r * ldo + c))));
      }
    }
    if (tail > 0) {
      const Vec a = load_partial(Tag(), v0 + full, tail), b = load_partial(Tag(), v1 + full, tail);
      QKV_UNROLL for (int r = 0; r < R; ++r) {
        float* out = o + r * ldo + full;
        store_partial(Tag(), out, fmadd(p1[r], b, fmadd(p0[r], a, load_partial(Tag(), out, tail))), tail);
      }
    }
  }
  if (j < keys) {
    const float* v0 = v + j * ldv;
    Vec p0[R];
    QKV_UNROLL for (int r = 0; r < R; ++r) p0[r] = set1(Tag(), p[r * ldp + j]);
    for (Index c = 0; c < full; c += L) {
      const Vec a = load(Tag(), v0 + c);
      QKV_UNROLL for (int r = 0; r < R; ++r)
          store(Tag(), o + r * ldo + c, fmadd(p0[r], a, load(Tag(), o + r * ldo + c)));
    }
    if (tail > 0) {
      const Vec a = load_partial(Tag(), v0 + full, tail);
      QKV_UNROLL for (int r = 0; r < R; ++r) {
        float* out = o + r * ldo + full;
        store_partial(Tag(), out, fmadd(p0[r], a, load_partial(Tag(), out, tail)), tail);
      }
    }
  }
}

/// acc_o[r][0 .. Dv) += Σ_j p[r][j] · v[j][0 .. Dv) for `n_rows` rows over the keys of non-zero weight only: the
/// P·V of a tile whose values hold NaN or ∞ where some key may be hidden, so that a hidden slot (weight 0) is never
/// read into the arithmetic (DESIGN.md: select, never multiply by zero). Scalar: such tiles are rare. One fused
/// multiply-add per key, in key order, as the vector kernels do, so the rows a poisoned slot cannot reach get the same
/// bits as without the poison in every build (a plain `+= a·b` is contracted to an FMA or not depending on -march).
inline void pv_skip_zero_weights(const float* p, Index ldp, const float* v, Index ldv, Index keys, float* o, Index ldo,
                                 Index Dv, Index n_rows) noexcept {
  for (Index r = 0; r < n_rows; ++r) {
    const float* weights = p + r * ldp;
    float* out = o + r * ldo;
    for (Index j = 0; j < keys; ++j) {
      if (weights[j] == 0.0f) continue;
      const float* value = v + j * ldv;
      for (Index d = 0; d < Dv; ++d) out[d] = std::fma(weights[j], value[d], out[d]);
    }
  }
}

/// Whether the first n floats of `rows` rows (`ld` apart) are all finite: Σ x·0 is 0 for finite x and NaN
/// otherwise. Vectorized; reads exactly those floats.
template <class Tag>
inline bool all_finite(const float* rows, Index n_rows, Index n, Index ld) noexcept {
  using namespace simd;
  constexpr int L = Tag::kLanes;
  const auto zero_vector = zero(Tag());
  auto acc = zero(Tag());
  const Index full = n / L * L;
  for (Index r = 0; r < n_rows; ++r) {
    const float* row = rows + r * ld;
    for (Index d = 0; d < full; d += L) acc = add(acc, mul(load(Tag(), row + d), zero_vector));
    if (full < n) acc = add(acc, mul(load_partial(Tag(), row + full, static_cast<int>(n - full)), zero_vector));
  }
  return reduce_sum(Tag(), acc) == 0.0f;
}

/// Calls f(std::integral_constant<int, R>()) for R = rows (1 ≤ rows ≤ kStrip = 6): the micro-kernels take the
/// row count as a template argument so their accumulators stay in registers.
template <class F>
inline void dispatch_rows(Index rows, F&& f) {
  switch (rows) {
    case 1:
      f(std::integral_constant<int, 1>());
      break;
    case 2:
      f(std::integral_constant<int, 2>());
      break;
    case 3:
      f(std::integral_constant<int, 3>());
      break;
    case 4:
      f(std::integral_constant<int, 4>());
      break;
    case 5:
      f(std::integral_constant<int, 5>());
      break;
    default:
      f(std::integral_constant<int, 6>());
      break;
  }
}

/// One task of the fused kernel: the query rows of one (sequence, kv head, query tile) and the keys it covers.
struct FusedTask {
  Index sequence = 0;
  Index h_kv = 0;
  Index i_begin = 0, i_end = 0;      ///< query rows of the sequence (every head of the group)
  Index key_begin = 0, key_end = 0;  ///< keys of this task: all of them, or one split-K chunk
  Index partial = -1;                ///< split tasks: index of their (out, lse) slot; −1 = write the output
};

/// Per-thread scratch of the fused kernel: sized once per call, reused by every task of the thread.
struct FusedScratch {
  AlignedBuffer q_block, acc_s, acc_o, row_max, row_sum;
  /// Set by begin_task when Q could not be pre-scaled exactly (the factor or some q·factor overflows float): Q is
  /// copied unscaled and every score is multiplied by score_scale, then by score_base, after Q·Kᵀ.
  bool post_scale = false;
  float score_scale = 1.0f, score_base = 1.0f;
  std::vector<char> row_nan;
  std::vector<HeadMask<float>> masks;
};

/// The pre-scaled q·factor of a nonzero q that underflowed to 0: the smallest denormal of the product's sign, so
/// that q·(±∞) stays ±∞ (a −∞ score hides its key, DESIGN.md; 0·∞ would make it NaN). Its finite terms change by
/// at most denorm_min·|k| (below 5e-7 for any float k), as the rounding to 0 already did. Found by
/// fuzz/fuzz_attention (q = 1e-45, k = −∞, D = 9: q·scale·log2 e rounded to 0).
inline float underflowed_product(float q, float factor) noexcept {
  const float tiny = std::numeric_limits<float>::denorm_min();
  return (q < 0.0f) != (factor < 0.0f) ? -tiny : tiny;
}

/// The fused kernel for one call in float. Views and options are validated by qkv::attention.
template <class Tag>
class FusedAttention {
 public:
  using Tiles = FusedTiles<Tag>;
  static constexpr int kPanel = Tiles::kPanel;
  static constexpr int kStrip = Tiles::kStrip;

  FusedAttention(const AttentionShape& shape, const TensorView4<const float>& q, const TensorView4<const float>& k,
                 const TensorView4<const float>& v, const TensorView4<float>& out, const TensorView3<float>* lse,
                 const AttentionOptions<float>& options)
      : shape_(shape), q_(q), k_(k), v_(v), out_(out), lse_(lse), options_(options) {
    G_ = shape.group;
    rows_per_tile_ = std::max<Index>(1, Tiles::kBlockM / std::max<Index>(1, G_));
    scale_ = resolve_scale(options, shape.D);
  }

  /// Runs every task; with OpenMP, threads share the tasks. The result does not depend on the thread count.
  void run() {
    pack_keys_and_scan_values();
    build_tasks();
    zeros_.assign(static_cast<std::size_t>(shape_.Dv), 0.0f);
    const Index n_tasks = static_cast<Index>(tasks_.size());
    // A team costs microseconds to wake; below about a million multiply-adds one thread is faster. Inside a
    // caller's active parallel region no team is opened (detail/threads.hpp).
    const bool parallel = n_tasks > 1 && work_ > (Index(1) << 20) && may_open_team();
#if defined(_OPENMP)
#pragma omp parallel if (parallel)
#else
    (void)parallel;
#endif
    {
      observe_team();
      FusedScratch scratch;
      allocate(scratch);
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
      for (Index t = 0; t < n_tasks; ++t) run_task(tasks_[static_cast<std::size_t>(t)], scratch);
    }
    merge_partials();
  }

 private:
  Index max_block_rows() const noexcept { return G_ * rows_per_tile_; }
  std::size_t kv_index(Index b, Index h_kv) const noexcept { return static_cast<std::size_t>(b * shape_.Hkv + h_kv); }

  void allocate(FusedScratch& s) const {
    const Index M = max_block_rows();
    s.q_block.resize(static_cast<std::size_t>(M * shape_.D));
    s.acc_s.resize(static_cast<std::size_t>(std::max(M * Tiles::kBlockN, Tiles::kDecodeRows * Tiles::kDecodeKeys)));
    s.acc_o.resize(static_cast<std::size_t>(std::max<Index>(1, M * shape_.Dv)));
    s.row_max.resize(static_cast<std::size_t>(M));
    s.row_sum.resize(static_cast<std::size_t>(M));
    s.row_nan.assign(static_cast<std::size_t>(M), 0);
    s.masks.resize(static_cast<std::size_t>(G_));
  }

  /// Packs K and V once per (sequence, kv head), except for decoding sequences, which read K and V in place.
  void pack_keys_and_scan_values() {
    const Index n = shape_.n_sequences * shape_.Hkv;
    packed_offset_.assign(static_cast<std::size_t>(n) + 1, 0);
    packed_v_offset_.assign(static_cast<std::size_t>(n) + 1, 0);
    key_abs_max_.assign(static_cast<std::size_t>(n), 0.0f);
    decode_.assign(static_cast<std::size_t>(shape_.n_sequences), 0);
    for (Index b = 0; b < shape_.n_sequences; ++b) {
      const Index skv = shape_.key_counts[static_cast<std::size_t>(b)];
      const bool decode = shape_.q_rows[static_cast<std::size_t>(b)].length * G_ <= Tiles::kDecodeRows;
      decode_[static_cast<std::size_t>(b)] = decode ? 1 : 0;
      const Index floats = decode ? 0 : (skv + kPanel - 1) / kPanel * kPanel * shape_.D;
      const Index value_floats = decode ? 0 : skv * ((shape_.Dv + kPanel - 1) / kPanel * kPanel);
      for (Index h = 0; h < shape_.Hkv; ++h) {
        packed_offset_[kv_index(b, h) + 1] = packed_offset_[kv_index(b, h)] + floats;
        packed_v_offset_[kv_index(b, h) + 1] = packed_v_offset_[kv_index(b, h)] + value_floats;
      }
    }
    packed_.resize(static_cast<std::size_t>(std::max<Index>(1, packed_offset_.back())));
    packed_v_.resize(static_cast<std::size_t>(std::max<Index>(1, packed_v_offset_.back())));
#if defined(_OPENMP)
#pragma omp parallel if (n > 1 && packed_offset_.back() > (Index(1) << 16) && may_open_team())
#endif
    {
      observe_team();
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
      for (Index task = 0; task < n; ++task) {
        const Index b = task / shape_.Hkv, h_kv = task % shape_.Hkv;
        const std::size_t s = static_cast<std::size_t>(b);
        const Index skv = shape_.key_counts[s];
        if (skv == 0 || shape_.q_rows[s].length == 0 || decode_[s]) continue;
        const Index vb = shape_.view_batch(b), row0 = shape_.kv_rows[s].begin;
        key_abs_max_[kv_index(b, h_kv)] = pack_keys<Tag>(&k_(vb, h_kv, row0, 0), k_.stride(2), skv, shape_.D,
                                                         packed_.data() + packed_offset_[kv_index(b, h_kv)]);
        if (shape_.Dv > 0) {
          pack_values<Tag>(&v_(vb, h_kv, row0, 0), v_.stride(2), skv, shape_.Dv,
                           packed_v_.data() + packed_v_offset_[kv_index(b, h_kv)]);
        }
      }
    }
  }

  /// Tasks: (sequence, kv head, query tile), and split-K chunks for a sequence with one query tile and many keys.
  void build_tasks() {
    tasks_.clear();
    partial_count_ = 0;
    work_ = 0;
    for (Index b = 0; b < shape_.n_sequences; ++b) {
      const std::size_t s = static_cast<std::size_t>(b);
      const Index sq = shape_.q_rows[s].length, skv = shape_.key_counts[s];
      if (sq == 0 || G_ == 0) continue;  // no query rows, or no query heads (Hq = 0): nothing to write
      const Index tiles = (sq + rows_per_tile_ - 1) / rows_per_tile_;
      const Index chunks =
          tiles == 1 && skv > Tiles::kSplitKeys ? (skv + Tiles::kSplitKeys - 1) / Tiles::kSplitKeys : 1;
      for (Index h_kv = 0; h_kv < shape_.Hkv; ++h_kv) {
        for (Index tile = 0; tile < tiles; ++tile) {
          for (Index c = 0; c < chunks; ++c) {
            FusedTask t;
            t.sequence = b;
            t.h_kv = h_kv;
            t.i_begin = tile * rows_per_tile_;
            t.i_end = std::min(sq, t.i_begin + rows_per_tile_);
            t.key_begin = chunks == 1 ? 0 : c * Tiles::kSplitKeys;
            t.key_end = chunks == 1 ? skv : std::min(skv, (c + 1) * Tiles::kSplitKeys);
            t.partial = chunks == 1 ? -1 : partial_count_++;
            tasks_.push_back(t);
            work_ += (t.i_end - t.i_begin) * G_ * (t.key_end - t.key_begin) * (shape_.D + shape_.Dv);
          }
        }
      }
    }
    const Index M = max_block_rows();
    partial_out_.resize(static_cast<std::size_t>(std::max<Index>(1, partial_count_ * M * shape_.Dv)));
    partial_lse_.resize(static_cast<std::size_t>(std::max<Index>(1, partial_count_ * M)));
  }

  /// The prefill task (a sequence with Sq·G > kDecodeRows; K packed): key tiles outermost (the K and V tiles stay
  /// in L2 across the block), then strips of kStrip stacked rows, each taken through Q·Kᵀ, the mask, the softmax
  /// step and P·V while its acc_s rows (kStrip × kBlockN) and acc_o rows stay in L1. Scores are in base 2: Q is
  /// pre-scaled by scale·log2(e), so the softmax uses exp2; with softcap, bias or ALiBi Q is scaled by `scale`
  /// alone, the score finished in base e and then multiplied by log2(e). Per strip, key tiles the strip cannot see
  /// are skipped and the strip's keys are cut to its own visible range (the diagonal strip stops at its last
  /// visible key, a window's strip starts at its first).
  ///
  /// Base 2 holds a score only up to FLT_MAX / log2(e) ≈ 2.4e38: with kBase2 the task returns false, having written
  /// nothing, when some score could exceed that (base2_fits) or a score finished by softcap, bias or ALiBi did; the
  /// caller then runs it again with kBase2 = false (Q scaled by `scale`, exp instead of exp2), which holds every
  /// finite score, as the decoding path and the reference do.
  template <bool kBase2>
  bool run_prefill_task(const FusedTask& t, FusedScratch& s) const {
    using namespace simd;
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    constexpr float kLog2e = 1.44269504088896341f;
    constexpr int L = Tag::kLanes;
    const auto vector_exp = [](typename Tag::Vec x) {
      if constexpr (kBase2) {
        return simd::exp2(Tag(), x);
      } else {
        return simd::exp(Tag(), x);
      }
    };
    const auto scalar_exp = [](float x) { return kBase2 ? std::exp2(x) : std::exp(x); };
    const std::size_t seq = static_cast<std::size_t>(t.sequence);
    const Index vb = shape_.view_batch(t.sequence);
    const Index kv_row0 = shape_.kv_rows[seq].begin, skv = shape_.key_counts[seq];
    const Index D = shape_.D, Dv = shape_.Dv, rows = t.i_end - t.i_begin, M = G_ * rows;
    const Index ldS = Tiles::kBlockN;
    float* q_block = s.q_block.data();
    float* acc_s = s.acc_s.data();
    float* acc_o = s.acc_o.data();
    float* row_max = s.row_max.data();
    float* row_sum = s.row_sum.data();
    const KeyRange range = begin_task(t, s, kBase2);
    if (kBase2 && !base2_fits(t, s)) return false;
    bool base2_overflow = false;  // a score finished by softcap, bias or ALiBi overflowed when multiplied by log2(e)
    const HeadMask<float>& first_mask = s.masks[0];
    const MaskGeometry& geometry = first_mask.geometry;
    const bool data_mask = first_mask.has_data_mask(), modifies = first_mask.modifies_scores();
    const float* packed = packed_.data() + packed_offset_[kv_index(t.sequence, t.h_kv)];
    const float* packed_v = packed_v_.data() + packed_v_offset_[kv_index(t.sequence, t.h_kv)];
    const Index ldv = v_.stride(2);

    for (Index j0 = range.begin / kPanel * kPanel; j0 < range.end; j0 += Tiles::kBlockN) {
      const Index j1 = std::min(j0 + Tiles::kBlockN, range.end);
      if (geometry.classify(t.i_begin, t.i_end, j0, j1) == TileVisibility::hidden) continue;
      const float* v_tile = Dv > 0 ? &v_(vb, t.h_kv, kv_row0 + j0, 0) : nullptr;
      int v_finite = -1;  // whether the tile's values are all finite: decided once, when a strip first needs it

      for (Index r0 = 0; r0 < M; r0 += kStrip) {
        const Index R = std::min<Index>(kStrip, M - r0);
        // The strip's query rows; a strip that straddles two heads of the group takes the task's whole range
        // (a superset, so `hidden` and `full` stay true for the strip).
        Index i_lo = t.i_begin, i_hi = t.i_end;
        if (r0 / rows == (r0 + R - 1) / rows) {
          i_lo = t.i_begin + r0 % rows;
          i_hi = i_lo + R;
        }
        const TileVisibility visibility = geometry.classify(i_lo, i_hi, j0, j1);
        if (visibility == TileVisibility::hidden) continue;
        const KeyRange strip_keys = geometry.key_range(i_lo, i_hi);
        const Index n = std::min(j1, strip_keys.end) - j0;  // keys [first, n)
        const Index first = (std::max(j0, strip_keys.begin) - j0) / kPanel * kPanel;
        if (n <= first) continue;
        const bool index_mask = visibility == TileVisibility::partial;
        float* s_strip = acc_s;  // R rows, ldS apart; columns [first, n) are this tile's keys [j0 + first, j0 + n)

        dispatch_rows(R, [&](auto rows_constant) {
          constexpr int kR = decltype(rows_constant)::value;
          // acc_s = Q_strip · K_tileᵀ from the packed panels.
          for (Index p = first / kPanel; p * kPanel < n; ++p) {
            qk_panel<Tag, kR>(q_block + r0 * D, D, packed + (j0 / kPanel + p) * D * kPanel, D, s_strip + p * kPanel,
                              ldS);
          }
          if (s.post_scale) {  // Q could not be pre-scaled (begin_task)
            for (Index rr = 0; rr < kR; ++rr)
              for (Index jj = first; jj < n; ++jj)
                s_strip[rr * ldS + jj] = s_strip[rr * ldS + jj] * s.score_scale * s.score_base;
          }

          // Softcap, bias, ALiBi where present; the mask in boundary tiles or where `allowed` / `bias` decide.
          if (data_mask || modifies) {
            for (Index rr = 0; rr < kR; ++rr) {
              const Index r = r0 + rr;
              const HeadMask<float>& mask = s.masks[static_cast<std::size_t>(r / rows)];
              const Index i = t.i_begin + r % rows;
              float* row = s_strip + rr * ldS;
              for (Index jj = first; jj < n; ++jj) {
                const Index j = j0 + jj;
                if ((index_mask || data_mask) && !mask.visible(i, j)) {
                  row[jj] = kNegInf;
                } else if (modifies) {
                  const float finished = mask.finish(row[jj], i, j);
                  row[jj] = kBase2 ? finished * kLog2e : finished;
                  if (kBase2 && std::isinf(row[jj]) && !std::isinf(finished)) base2_overflow = true;
                }
              }
            }
          } else if (index_mask) {
            // Index rules only: query i sees its band and the global prefix (MaskGeometry::band, ::global).
            for (Index rr = 0; rr < kR; ++rr) {
              const Index i = t.i_begin + (r0 + rr) % rows;
              const KeyRange band = geometry.band(i), global = geometry.global(i);
              float* row = s_strip + rr * ldS;
              for (Index jj = first; jj < n; ++jj) {
                const Index j = j0 + jj;
                const bool visible = (j >= band.begin && j < band.end) || j < global.end;
                row[jj] = visible ? row[jj] : kNegInf;
              }
            }
          }

          if (base2_overflow) return;  // the task is run again in base e

          // Online softmax (base 2, or e): row_max and row_sum; acc_o is rescaled only when a row's max rose.
          const Index n_vec = first + (n - first) / L * L;
          for (Index rr = 0; rr < kR; ++rr) {
            const Index r = r0 + rr;
            float* row = s_strip + rr * ldS;
            auto vmax = set1(Tag(), kNegInf);
            for (Index jj = first; jj < n_vec; jj += L) vmax = max(vmax, load(Tag(), row + jj));
            float tile_max = reduce_max(Tag(), vmax);
            for (Index jj = n_vec; jj < n; ++jj) tile_max = std::max(tile_max, row[jj]);
            const float old_max = row_max[r];
            const float new_max = std::max(old_max, tile_max);
            if (new_max == kNegInf) {  // nothing visible so far; a NaN here would be lost by max: look for it
              for (Index jj = first; jj < n; ++jj) {
                if (std::isnan(row[jj])) s.row_nan[static_cast<std::size_t>(r)] = 1;
                row[jj] = 0.0f;
              }
              continue;
            }
            const auto vm = set1(Tag(), new_max);
            auto vsum = zero(Tag());
            for (Index jj = first; jj < n_vec; jj += L) {
              const auto e = vector_exp(sub(load(Tag(), row + jj), vm));
              store(Tag(), row + jj, e);
              vsum = add(vsum, e);
            }
            float sum = reduce_sum(Tag(), vsum);
            for (Index jj = n_vec; jj < n; ++jj) {
              row[jj] = scalar_exp(row[jj] - new_max);
              sum += row[jj];
            }
            if (new_max > old_max && old_max != kNegInf) {
              const float alpha = scalar_exp(old_max - new_max);
              row_sum[r] *= alpha;
              float* o = acc_o + r * Dv;
              const auto va = set1(Tag(), alpha);
              const Index dv_vec = Dv / L * L;
              for (Index d = 0; d < dv_vec; d += L) store(Tag(), o + d, mul(load(Tag(), o + d), va));
              for (Index d = dv_vec; d < Dv; ++d) o[d] *= alpha;
            }
            row_sum[r] += sum;
            row_max[r] = new_max;
          }

          // acc_o += P · V_tile, V read in place. Where some key may be hidden, zero weights meet V: safe only if the
          // tile's values are finite; otherwise (NaN or ∞ stored there) zero weights are skipped.
          if (Dv == 0) return;
          const bool may_hide = index_mask || data_mask;
          if (may_hide && v_finite < 0) v_finite = all_finite<Tag>(v_tile, j1 - j0, Dv, ldv) ? 1 : 0;
          if (!may_hide || v_finite == 1) {
            pv_strip<Tag, kR>(s_strip + first, ldS, packed_v + (j0 + first) * kPanel, skv * kPanel, n - first,
                              acc_o + r0 * Dv, Dv, Dv);
          } else {
            pv_skip_zero_weights(s_strip + first, ldS, v_tile + first * ldv, ldv, n - first, acc_o + r0 * Dv, Dv, Dv,
                                 kR);
          }
        });
        if (base2_overflow) return false;
      }
    }

    // (out, lse) of every row, lse in base e; the output directly, or the task's partial slot for split-K.
    finish_rows(t, s, kBase2);
    return true;
  }

  /// Whether the prefill task's scores all stay finite in base 2 (run_prefill_task). The finite part of a score
  /// q'·k (q' the Q block as begin_task left it) is at most Σ_d |q'_d| · max |k| over the finite q'_d and k; the
  /// check asks that bound, times the post-scale factors if any (each of q·k, q·k·scale and q·k·scale·log2 e must
  /// stay finite) and a margin for the rounding of the D + 2 operations (e^((D + 3)·2⁻²³) ≥ (1 + 2⁻²⁴)^(D + 3)),
  /// to stay below FLT_MAX. The ±∞ and NaN terms are left out (their scores are ±∞ or NaN already, and where an
  /// infinite term meets a finite part that base 2 would overflow, that finite part fails the check): so a key
  /// holding ±∞ or NaN does not change the base, and a call equals, bit for bit, the same call with that key's
  /// values finite and the key masked out (the NaN policy's tests). A huge finite k switches the whole (sequence,
  /// kv head) to base e even where it is hidden: the results differ from base 2 by rounding only. With softcap,
  /// bias or ALiBi, Q carries no log2(e) and each finished score is checked instead. O(M·D), beside the task's
  /// O(M·Skv·D).
  bool base2_fits(const FusedTask& t, const FusedScratch& s) const {
    if (s.masks[0].modifies_scores()) return true;
    constexpr double kInf = std::numeric_limits<double>::infinity();
    const Index D = shape_.D, M = G_ * (t.i_end - t.i_begin);
    const float* q_block = s.q_block.data();
    double l1_max = 0.0;
    for (Index r = 0; r < M; ++r) {
      double l1 = 0.0;
      for (Index d = 0; d < D; ++d) {
        const double a = std::fabs(double(q_block[r * D + d]));
        l1 += a < kInf ? a : 0.0;
      }
      l1_max = std::max(l1_max, l1);
    }
    const double scale = std::fabs(double(s.score_scale));
    const double factor = s.post_scale ? std::max({1.0, scale, scale * double(s.score_base)}) : 1.0;
    const double rounding = std::exp(double(D + 3) * 0x1p-23);
    const double bound = l1_max * double(key_abs_max_[kv_index(t.sequence, t.h_kv)]) * factor * rounding;
    return bound < double(std::numeric_limits<float>::max());
  }

  /// One task: prefill sequences go to run_prefill_task; decoding sequences (Sq·G ≤ kDecodeRows) run here.
  void run_task(const FusedTask& t, FusedScratch& s) const {
    if (!decode_[static_cast<std::size_t>(t.sequence)]) {  // prefill: packed K and V; base e where base 2 overflows
      if (!run_prefill_task<true>(t, s)) run_prefill_task<false>(t, s);
      return;
    }
    // Decoding (Sq·G ≤ kDecodeRows): K and V read in place.
    using namespace simd;
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    constexpr int L = Tag::kLanes;
    const std::size_t seq = static_cast<std::size_t>(t.sequence);
    const Index vb = shape_.view_batch(t.sequence);
    const Index kv_row0 = shape_.kv_rows[seq].begin;
    const Index D = shape_.D, Dv = shape_.Dv, rows = t.i_end - t.i_begin, M = G_ * rows;
    // Decoding blocks are long (kDecodeKeys): one pass over their K, the softmax, then one pass over their V, so
    // each pass streams a single array (alternating short K and V blocks stalls the hardware prefetchers).
    const Index block = Tiles::kDecodeKeys, ldS = block;
    float* q_block = s.q_block.data();
    float* acc_s = s.acc_s.data();
    float* acc_o = s.acc_o.data();
    float* row_max = s.row_max.data();
    float* row_sum = s.row_sum.data();
    const KeyRange range = begin_task(t, s, /*base2=*/false);
    const HeadMask<float>& first_mask = s.masks[0];
    const MaskGeometry& geometry = first_mask.geometry;
    const bool data_mask = first_mask.has_data_mask(), modifies = first_mask.modifies_scores();
    const Index ldv = v_.stride(2), ldk = k_.stride(2);
    // With more than 4 rows, the row groups take turns over sub-blocks of kDecodeSub keys (in L1), not whole blocks.
    const Index sub_keys = M <= 4 ? block : Tiles::kDecodeSub;

    for (Index j0 = range.begin / kPanel * kPanel; j0 < range.end; j0 += block) {
      const Index j1 = std::min(j0 + block, range.end);
      const TileVisibility visibility = geometry.classify(t.i_begin, t.i_end, j0, j1);
      if (visibility == TileVisibility::hidden) continue;
      const Index n = j1 - j0;

      // acc_s = Q_block · K_blockᵀ, K read in place.
      const float* k_tile = &k_(vb, t.h_kv, kv_row0 + j0, 0);
      for (Index jb = 0; jb < n; jb += sub_keys) {
        const Index keys = std::min(sub_keys, n - jb);
        for (Index r0 = 0; r0 < M; r0 += 4) {
          dispatch_rows(std::min<Index>(4, M - r0), [&](auto rows_constant) {
            constexpr int R = std::min(4, decltype(rows_constant)::value);
            qk_in_place<Tag, R>(q_block + r0 * D, D, k_tile + jb * ldk, ldk, keys, D, acc_s + r0 * ldS + jb, ldS);
          });
        }
      }
      if (s.post_scale) {  // Q could not be pre-scaled (begin_task)
        for (Index r = 0; r < M; ++r)
          for (Index jj = 0; jj < n; ++jj) acc_s[r * ldS + jj] = acc_s[r * ldS + jj] * s.score_scale * s.score_base;
      }

      // Softcap, bias, ALiBi where present; the mask in boundary tiles or where `allowed` / `bias` decide.
      const bool index_mask = visibility == TileVisibility::partial;
      if (index_mask || data_mask || modifies) {
        for (Index r = 0; r < M; ++r) {
          const HeadMask<float>& mask = s.masks[static_cast<std::size_t>(r / rows)];
          const Index i = t.i_begin + r % rows;
          float* row = acc_s + r * ldS;
          for (Index jj = 0; jj < n; ++jj) {
            const Index j = j0 + jj;
            if ((index_mask || data_mask) && !mask.visible(i, j)) {
              row[jj] = kNegInf;
            } else if (modifies) {
              row[jj] = mask.finish(row[jj], i, j);
            }
          }
        }
      }

      // Online softmax: row_max and row_sum; acc_o is rescaled only when a row's max rose.
      const Index n_vec = n / L * L;
      for (Index r = 0; r < M; ++r) {
        float* row = acc_s + r * ldS;
        auto vmax = set1(Tag(), kNegInf);
        for (Index jj = 0; jj < n_vec; jj += L) vmax = max(vmax, load(Tag(), row + jj));
        float tile_max = reduce_max(Tag(), vmax);
        for (Index jj = n_vec; jj < n; ++jj) tile_max = std::max(tile_max, row[jj]);
        const float old_max = row_max[r];
        const float new_max = std::max(old_max, tile_max);
        if (new_max == kNegInf) {  // nothing visible so far; a NaN here would be lost by max: look for it
          for (Index jj = 0; jj < n; ++jj) {
            if (std::isnan(row[jj])) s.row_nan[static_cast<std::size_t>(r)] = 1;
            row[jj] = 0.0f;
          }
          continue;
        }
        const auto vm = set1(Tag(), new_max);
        auto vsum = zero(Tag());
        for (Index jj = 0; jj < n_vec; jj += L) {
          const auto e = simd::exp(Tag(), sub(load(Tag(), row + jj), vm));
          store(Tag(), row + jj, e);
          vsum = add(vsum, e);
        }
        float sum = reduce_sum(Tag(), vsum);
        for (Index jj = n_vec; jj < n; ++jj) {
          row[jj] = std::exp(row[jj] - new_max);
          sum += row[jj];
        }
        if (new_max > old_max && old_max != kNegInf) {
          const float alpha = std::exp(old_max - new_max);
          row_sum[r] *= alpha;
          float* o = acc_o + r * Dv;
          for (Index d = 0; d < Dv; ++d) o[d] *= alpha;
        }
        row_sum[r] += sum;
        row_max[r] = new_max;
      }

      // acc_o += P · V_tile, V read in place.
      if (Dv == 0) continue;
      const float* v_tile = &v_(vb, t.h_kv, kv_row0 + j0, 0);
      // A tile where some key may be hidden from some row multiplies zero weights by V: safe only if the tile's
      // values are finite. Otherwise (NaN or ∞ stored there) zero weights are skipped, so hidden slots are not read.
      const bool may_hide = index_mask || data_mask;
      if (!may_hide || all_finite<Tag>(v_tile, n, Dv, ldv)) {
        for (Index jb = 0; jb < n; jb += sub_keys) {
          const Index keys = std::min(sub_keys, n - jb);
          for (Index r0 = 0; r0 < M; r0 += 4) {
            dispatch_rows(std::min<Index>(4, M - r0), [&](auto rows_constant) {
              constexpr int R = std::min(4, decltype(rows_constant)::value);
              pv_in_place<Tag, R>(acc_s + r0 * ldS + jb, ldS, v_tile + jb * ldv, ldv, keys, acc_o + r0 * Dv, Dv, Dv);
            });
          }
        }
      } else {
        // Some value of this tile is NaN or ∞: skip zero weights so hidden slots are never read.
        pv_skip_zero_weights(acc_s, ldS, v_tile, ldv, n, acc_o, Dv, Dv, M);
      }
    }

    // (out, lse) of every row; the output directly, or the task's partial slot for split-K.
    finish_rows(t, s, /*base2=*/false);
  }

  /// The start of a task: the group's head masks in s.masks, the Q block g-major (row r = g·rows + (i − i_begin))
  /// pre-scaled (by scale·log2 e for a `base2` softmax unless the masks' `finish` runs on base-e scores, else by
  /// scale), row state and acc_o cleared; returns the task's key range (mask geometry ∩ split-K chunk).
  KeyRange begin_task(const FusedTask& t, FusedScratch& s, bool base2) const {
    constexpr float kLog2e = 1.44269504088896341f;
    const std::size_t seq = static_cast<std::size_t>(t.sequence);
    const Index vb = shape_.view_batch(t.sequence), q_row0 = shape_.q_rows[seq].begin;
    const Index sq = shape_.q_rows[seq].length, skv = shape_.key_counts[seq];
    const Index D = shape_.D, Dv = shape_.Dv, rows = t.i_end - t.i_begin, M = G_ * rows;
    for (Index g = 0; g < G_; ++g) {
      s.masks[static_cast<std::size_t>(g)] = HeadMask<float>::make(options_, vb, t.h_kv * G_ + g, sq, skv, D);
    }
    const bool with_log2e = base2 && !s.masks[0].modifies_scores();
    const float q_factor = with_log2e ? scale_ * kLog2e : scale_;
    // Q pre-scaled by q_factor must give the scores that q·k·scale gives: a nonzero q that underflows to 0 is
    // kept nonzero (underflowed_product); if the factor or a finite q·factor overflows, Q is copied unscaled and
    // the scores are scaled after Q·Kᵀ instead (score_scale, then score_base: each step overflows only where the
    // score itself does).
    float* q_block = s.q_block.data();
    bool overflow = !std::isfinite(q_factor);
    for (Index g = 0; g < G_ && !overflow; ++g) {
      for (Index ii = 0; ii < rows; ++ii) {
        const float* src = &q_(vb, t.h_kv * G_ + g, q_row0 + t.i_begin + ii, 0);
        float* dst = q_block + (g * rows + ii) * D;
        for (Index d = 0; d < D; ++d) dst[d] = src[d] * q_factor;
        if (q_factor == 0.0f) continue;  // scale 0: every q·factor is 0 (or NaN), as q·k·0 is
        for (Index d = 0; d < D; ++d) {  // a compare per element; the branch is taken only at the edges
          if (dst[d] == 0.0f && src[d] != 0.0f) dst[d] = underflowed_product(src[d], q_factor);
          if (std::isinf(dst[d]) && std::isfinite(src[d])) overflow = true;
        }
      }
    }
    s.post_scale = overflow;
    s.score_scale = scale_;
    s.score_base = with_log2e ? kLog2e : 1.0f;
    if (overflow) {
      for (Index g = 0; g < G_; ++g) {
        for (Index ii = 0; ii < rows; ++ii) {
          const float* src = &q_(vb, t.h_kv * G_ + g, q_row0 + t.i_begin + ii, 0);
          std::copy(src, src + D, q_block + (g * rows + ii) * D);
        }
      }
    }
    std::fill(s.row_max.data(), s.row_max.data() + M, -std::numeric_limits<float>::infinity());
    std::fill(s.row_sum.data(), s.row_sum.data() + M, 0.0f);
    std::fill(s.row_nan.begin(), s.row_nan.begin() + M, 0);
    std::fill(s.acc_o.data(), s.acc_o.data() + M * Dv, 0.0f);
    KeyRange range = s.masks[0].geometry.key_range(t.i_begin, t.i_end);
    range.begin = std::max(range.begin, t.key_begin);
    range.end = std::min(range.end, t.key_end);
    return range;
  }

  /// The end of a task: out = acc_o / row_sum (one division per row) and lse = max + log(sum) (max in base 2 when
  /// `base2`, as the prefill softmax keeps it), zeros and lse −∞ for a row that saw no key, NaN for a row with NaN
  /// among its visible scores; written to the output, or to the task's partial slot for split-K.
  void finish_rows(const FusedTask& t, FusedScratch& s, bool base2) const {
    constexpr double kLn2 = 0.69314718055994530942;
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    const std::size_t seq = static_cast<std::size_t>(t.sequence);
    const Index vb = shape_.view_batch(t.sequence), q_row0 = shape_.q_rows[seq].begin;
    const Index Dv = shape_.Dv, rows = t.i_end - t.i_begin, M = G_ * rows;
    float* acc_o = s.acc_o.data();
    const float* row_max = s.row_max.data();
    const float* row_sum = s.row_sum.data();
    for (Index r = 0; r < M; ++r) {
      const Index g = r / rows, i = t.i_begin + r % rows, h = t.h_kv * G_ + g;
      float* o = acc_o + r * Dv;
      float lse;
      if (s.row_nan[static_cast<std::size_t>(r)]) {
        lse = std::numeric_limits<float>::quiet_NaN();
        for (Index d = 0; d < Dv; ++d) o[d] = lse;
      } else if (row_sum[r] == 0.0f) {
        lse = kNegInf;
        for (Index d = 0; d < Dv; ++d) o[d] = 0.0f;
      } else {
        const float inverse = 1.0f / row_sum[r];
        for (Index d = 0; d < Dv; ++d) o[d] *= inverse;
        lse = base2 ? static_cast<float>(double(row_max[r]) * kLn2 + std::log(double(row_sum[r])))
                    : row_max[r] + std::log(row_sum[r]);
      }
      if (t.partial >= 0) {
        const Index slot = t.partial * max_block_rows() + r;
        std::copy(o, o + Dv, partial_out_.data() + slot * Dv);
        partial_lse_.data()[slot] = lse;
      } else {
        write_row(vb, h, q_row0 + i, o, lse);
      }
    }
  }

  /// Writes one output row, merging in the head's sink (a state with output 0 and lse = the sink logit).
  void write_row(Index vb, Index h, Index row, float* o, float lse) const {
    const Index Dv = shape_.Dv;
    if (!options_.sinks.empty()) {
      const float sink = options_.sinks[static_cast<std::size_t>(h)];
      merge_state(o, lse, zeros_.data(), sink, o, lse, Dv);
    }
    if (Dv > 0) std::copy(o, o + Dv, &out_(vb, h, row, 0));
    if (lse_ != nullptr) (*lse_)(vb, h, row) = lse;
  }

  /// Merges the split-K chunks of each (sequence, kv head, query tile) in chunk order and writes the rows.
  void merge_partials() {
    if (partial_count_ == 0) return;
    const Index Dv = shape_.Dv, M_max = max_block_rows();
    std::vector<float> o(static_cast<std::size_t>(Dv));
    for (std::size_t first = 0; first < tasks_.size();) {
      const FusedTask& t = tasks_[first];
      if (t.partial < 0) {
        ++first;
        continue;
      }
      std::size_t last = first;
      while (last + 1 < tasks_.size() && tasks_[last + 1].partial >= 0 && tasks_[last + 1].sequence == t.sequence &&
             tasks_[last + 1].h_kv == t.h_kv && tasks_[last + 1].i_begin == t.i_begin) {
        ++last;
      }
      const Index rows = t.i_end - t.i_begin, M = G_ * rows;
      const std::size_t seq = static_cast<std::size_t>(t.sequence);
      for (Index r = 0; r < M; ++r) {
        const Index slot0 = t.partial * M_max + r;
        std::copy(partial_out_.data() + slot0 * Dv, partial_out_.data() + (slot0 + 1) * Dv, o.begin());
        float lse = partial_lse_.data()[slot0];
        for (std::size_t c = first + 1; c <= last; ++c) {
          const Index slot = tasks_[c].partial * M_max + r;
          merge_state(o.data(), lse, partial_out_.data() + slot * Dv, partial_lse_.data()[slot], o.data(), lse, Dv);
        }
        const Index g = r / rows, i = t.i_begin + r % rows;
        write_row(shape_.view_batch(t.sequence), t.h_kv * G_ + g, shape_.q_rows[seq].begin + i, o.data(), lse);
      }
      first = last + 1;
    }
  }

  const AttentionShape& shape_;
  TensorView4<const float> q_, k_, v_;
  TensorView4<float> out_;
  const TensorView3<float>* lse_;
  const AttentionOptions<float>& options_;
  Index G_ = 1, rows_per_tile_ = 1;
  float scale_ = 1.0f;
  AlignedBuffer packed_, partial_out_, partial_lse_;
  AlignedBuffer packed_v_;  ///< V of prefill sequences, packed by pack_values
  std::vector<Index> packed_offset_;
  std::vector<Index> packed_v_offset_;
  std::vector<float> key_abs_max_;  ///< per (sequence, kv head) of a prefill sequence: max finite |k| (pack_keys)
  std::vector<char> decode_;        ///< per sequence: K read in place (decoding) rather than packed
  std::vector<FusedTask> tasks_;
  Index partial_count_ = 0;
  Index work_ = 0;            ///< multiply-adds of every task, upper bound (for the threading decision)
  std::vector<float> zeros_;  ///< the output of a sink state
};

}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv
