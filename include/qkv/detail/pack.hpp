// qkv/detail/pack.hpp — K and V of a prefill sequence, copied once per (sequence, kv head) into the layouts the
// prefill micro-kernels stream (prefill_kernels.hpp).
//
//   K: panels of kPanel = kVectors·lanes keys, [panel][d][key], the last panel zero-padded;
//   V: chunks of kChunk columns, [chunk][key][kChunk]; the last chunk only as wide as whole vectors need
//   (FusedTiles::chunk_floats), its columns past Dv zero-padded. Where that layout is V itself (float rows that abut,
//   one chunk of whole vectors wide: values_packed_as_stored), V is not copied and the prefill reads it in place.
//
// Decoding sequences are not packed (decode_kernels.hpp reads K and V in place).
//
// Compiled once per kernel ISA, inside that ISA's target region: detail/dispatch.hpp includes it in each pass (the
// guard below, Highway's toggle, lets each pass in once).
#ifndef QKV_PASS_NAME
#error "qkv/detail/pack.hpp is part of the fused kernel: include qkv/detail/dispatch.hpp"
#endif
#if defined(QKV_DETAIL_PACK_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_PACK_HPP
#undef QKV_DETAIL_PACK_HPP
#else
#define QKV_DETAIL_PACK_HPP
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/detail/aligned_buffer.hpp"
#include "qkv/detail/attention_shape.hpp"
#include "qkv/detail/fused_tiles.hpp"
#include "qkv/detail/hidden_values.hpp"
#include "qkv/detail/query_block.hpp"
#include "qkv/simd/simd.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512

/// The first n stored elements at src as floats: src itself for float storage; for 16-bit storage, converted
/// (exactly, in registers where the tag can: simd::load_kv) into `buffer` (n floats).
template <class Tag, class S>
const float* row_as_float(const S* src, Index n, float* buffer) noexcept {
  if constexpr (std::is_same_v<S, float>) {
    (void)n;
    (void)buffer;
    return src;
  } else {
    using namespace simd;
    constexpr int L = Tag::kLanes;
    const Index full = n / L * L;
    for (Index d = 0; d < full; d += L) store(Tag(), buffer + d, load_kv(Tag(), src + d));
    if (full < n) {
      const int tail = static_cast<int>(n - full);
      store_partial(Tag(), buffer + full, load_kv_partial(Tag(), src + full, tail), tail);
    }
    return buffer;
  }
}

/// dst[d·kPanel + j] = src[j·ld + d] as float, for keys j < `keys` (rows of D elements stored as S, `ld` apart) and
/// d < D: one panel's columns. Blocks of kLanes keys × kLanes d are loaded row by row (simd::load_kv, which converts
/// 16-bit storage), transposed in registers (simd::transpose) and stored column by column; the d past the last whole
/// block and the keys past the last whole block of keys one element at a time. Each block reads one vector of each of
/// its kLanes rows, whatever their distance (token-major K, whose rows are 4 KiB apart and share L1 sets, included).
/// keys ≤ kPanel; dst holds D·kPanel floats, of which the first `keys` of each row of kPanel are written. Against the
/// element-by-element copy it replaced: token-major prefill (T = 1024, D = 128, one thread, Zen 5) 0.97 of the time,
/// head-major within 1 % (bench/README.md, "2026-12-04, eighteenth session"). Complexity: O(keys·D).
template <class Tag, class S>
void transpose_to_panel(const S* src, Index ld, Index keys, Index D, float* dst) noexcept {
  using namespace simd;
  constexpr int L = Tag::kLanes;
  constexpr Index kPanel = FusedTiles<Tag>::kPanel;
  QKV_ASSERT(0 <= keys && keys <= kPanel);
  const Index full_keys = keys / L * L, full_d = D / L * L;
  for (Index j0 = 0; j0 < full_keys; j0 += L) {
    for (Index d0 = 0; d0 < full_d; d0 += L) {
      typename Tag::Vec block[L];
      QKV_UNROLL for (int i = 0; i < L; ++i) block[i] = load_kv(Tag(), src + (j0 + i) * ld + d0);
      transpose(Tag(), block);
      QKV_UNROLL for (int i = 0; i < L; ++i) store(Tag(), dst + (d0 + i) * kPanel + j0, block[i]);
    }
    for (Index j = j0; j < j0 + L; ++j) {
      for (Index d = full_d; d < D; ++d) dst[d * kPanel + j] = to_float(src[j * ld + d]);
    }
  }
  for (Index j = full_keys; j < keys; ++j) {
    for (Index d = 0; d < D; ++d) dst[d * kPanel + j] = to_float(src[j * ld + d]);
  }
}

/// Packs the first `skv` keys of k (rows of D elements stored as S, `ld` apart) into panels of kPanel keys laid
/// out [panel][d][key] in float (transpose_to_panel), zero-padding the last panel: `packed` holds ⌈skv / kPanel⌉ ·
/// D · kPanel floats. Returns the largest finite |k| (±∞ and NaN left out: they make a score ±∞ or NaN in any base),
/// which bounds the scores for the choice of the softmax's base (query_block.hpp, base2_fits). `row` is scratch of D
/// floats for 16-bit storage (each key row is converted into it for that bound), unused for float. Complexity:
/// O(skv·D).
template <class Tag, class S>
float pack_keys(const S* k, Index ld, Index skv, Index D, float* packed, float* row) noexcept {
  constexpr int kPanel = FusedTiles<Tag>::kPanel;
  const Index panels = (skv + kPanel - 1) / kPanel;
  float abs_max = 0.0f;
  for (Index p = 0; p < panels; ++p) {
    float* dst = packed + p * D * kPanel;
    const Index keys = std::min<Index>(kPanel, skv - p * kPanel);
    const S* src = k + p * kPanel * ld;
    if constexpr (std::is_same_v<S, float>) {
      (void)row;
      abs_max = std::max(abs_max, finite_abs_max<Tag>(src, ld, keys, D));
    } else {
      for (Index j = 0; j < keys; ++j) {
        abs_max = std::max(abs_max, finite_abs_max<Tag>(row_as_float<Tag>(src + j * ld, D, row), D, 1, D));
      }
    }
    transpose_to_panel<Tag>(src, ld, keys, D, dst);
    for (Index d = 0; d < D; ++d) std::fill(dst + d * kPanel + keys, dst + (d + 1) * kPanel, 0.0f);
  }
  return abs_max;
}

/// Rows per finiteness check of pack_values and count_nonfinite_values.
inline constexpr Index kCheckKeys = 64;

/// nonfinite[g + 1] = 1 for each row g in [g0, g1) of `width` values (`ld` apart from v) holding ±∞ or NaN: the rows
/// checked at once, and a group that is not all finite row by row (rare).
template <class Tag, class S>
void mark_nonfinite(const S* v, Index ld, Index g0, Index g1, Index width, std::uint32_t* nonfinite) noexcept {
  if (all_finite<Tag>(v + g0 * ld, g1 - g0, width, ld)) return;
  for (Index g = g0; g < g1; ++g) {
    if (!all_finite<Tag>(v + g * ld, 1, width, ld)) nonfinite[g + 1] = 1;
  }
}

/// Packs the first `skv` values (rows of Dv elements stored as S, `ld` apart) into column chunks laid out
/// [chunk][key][kChunk]: P·V then streams each chunk of a tile as one contiguous block (V read in place crosses a
/// 4 KiB page every few keys, where the hardware prefetchers stop). The last chunk, where Dv is not a multiple of
/// kChunk, is FusedTiles::chunk_floats(width) floats per key (whole vectors), its columns past Dv zero. The chunk
/// of columns from c starts at packed + c·skv, and the whole takes skv · chunk_floats(Dv) floats (kChunk is a
/// multiple of the vector). Row by row, each row's chunks in turn, a vector at a time (simd::load_kv converts 16-bit
/// storage; a row's last vector is a masked load, its lanes past Dv zero, stored whole as the chunk's padding): each
/// row of V is read once, front to back, and no scratch row is needed. Against the pass over the rows per chunk it
/// replaced (element by element, 16-bit rows converted into a scratch row first): the same speed, as the copy waits on
/// V's first read from memory (T = 1024, D = 128, H = 8, one thread, Zen 5: B faster in 31 of 60 rounds, pack_values'
/// share of the samples not lower; the backward, which packs Q, dO and K so, 0.998 of the time; bench/README.md,
/// "2026-12-06, thirty-fourth session").
/// If `nonfinite` is given (skv + 1 counts), nonfinite[j] becomes the number of keys before j whose value row holds
/// ±∞ or NaN, so that whether keys [j0, j1) are all finite is nonfinite[j1] == nonfinite[j0] (the prefill's test
/// before zero weights meet V, hidden_values.hpp), without reading V again later: all_finite runs on each group of
/// 64 rows just copied (the stored values, 16-bit ones converted as they are read). Complexity: O(skv · Dv).
template <class Tag, class S>
void pack_values(const S* v, Index ld, Index skv, Index Dv, float* packed,
                 std::uint32_t* nonfinite = nullptr) noexcept {
  using namespace simd;
  constexpr int L = Tag::kLanes;
  constexpr Index kChunk = FusedTiles<Tag>::kChunk;
  if (nonfinite != nullptr) std::fill(nonfinite, nonfinite + skv + 1, 0u);
  const Index full = Dv / kChunk * kChunk, width = Dv - full, stride = FusedTiles<Tag>::chunk_floats(width);
  const Index whole = width / L * L;
  const int tail = static_cast<int>(width - whole);
  for (Index g0 = 0; g0 < skv; g0 += kCheckKeys) {
    const Index g1 = std::min(skv, g0 + kCheckKeys);
    for (Index j = g0; j < g1; ++j) {
      const S* src = v + j * ld;
      for (Index c = 0; c < full; c += kChunk) {
        float* dst = packed + c * skv + j * kChunk;
        QKV_UNROLL for (Index d = 0; d < kChunk; d += L) store(Tag(), dst + d, load_kv(Tag(), src + c + d));
      }
      if (width > 0) {  // the last chunk, chunk_floats(width) floats per key
        float* dst = packed + full * skv + j * stride;
        for (Index d = 0; d < whole; d += L) store(Tag(), dst + d, load_kv(Tag(), src + full + d));
        if (tail > 0) store(Tag(), dst + whole, load_kv_partial(Tag(), src + full + whole, tail));
      }
    }
    // The kCheckKeys rows just copied, still in cache, checked at once.
    if (nonfinite != nullptr) mark_nonfinite<Tag>(v, ld, g0, g1, Dv, nonfinite);
  }
  if (nonfinite != nullptr) {
    for (Index j = 0; j < skv; ++j) nonfinite[j + 1] += nonfinite[j];
  }
}

/// Whether V's packed layout (pack_values) is V itself, so that the prefill can read it in place: float rows of one
/// chunk whose width is whole vectors (Dv ≤ kChunk, a multiple of the lanes; on AVX-512 Dv = 16, 32, 48 or 64) that
/// abut (`ld` == Dv). Then a copy would only move the same floats to the same layout.
template <class Tag, class S>
constexpr bool values_packed_as_stored(Index ld, Index Dv) noexcept {
  return std::is_same_v<S, float> && Dv > 0 && Dv <= FusedTiles<Tag>::kChunk &&
         FusedTiles<Tag>::chunk_floats(Dv) == Dv && ld == Dv;
}

/// pack_values' counts of non-finite rows without its copy, for V read in place (values_packed_as_stored): the
/// first skv + 1 entries of `nonfinite` as pack_values leaves them. Complexity: one read of the skv · Dv values.
template <class Tag, class S>
void count_nonfinite_values(const S* v, Index ld, Index skv, Index Dv, std::uint32_t* nonfinite) noexcept {
  std::fill(nonfinite, nonfinite + skv + 1, 0u);
  for (Index g0 = 0; g0 < skv; g0 += kCheckKeys)
    mark_nonfinite<Tag>(v, ld, g0, std::min(skv, g0 + kCheckKeys), Dv, nonfinite);
  for (Index j = 0; j < skv; ++j) nonfinite[j + 1] += nonfinite[j];
}

/// When PackedKV packs each (sequence, kv head) of a call (all its pairs' packed K and V are read by the same tasks
/// whichever it is, so the bits do not depend on it): `one_at_a_time`, room for one pair and each packed into it by
/// pack_pair just before its tasks, for a call on one thread; `on_first_use`, room for every pair and each packed by
/// pack_once, by the first thread of a team that takes one of its tasks, while the others wait for it or go on with
/// their own pairs. Either way a pair's packed K and V are still in cache when its tasks read them, and the copies of
/// the pairs do not evict each other, as packing every pair before the first task did. Against packing every pair
/// first (D = 128, H = 8, Zen 5): one thread 0.97 of the time at T = 1024 (bench/README.md, "2026-12-06, thirty-third
/// session"), two threads 0.97–0.99 at T = 1024 and 4096, causal or not ("2026-12-06, thirty-fourth session"). Only
/// teams of two were measured: in a team of N, the threads that take the first pair's other tasks wait for its copy
/// (N − 1 of them at the start), where packing all first copied N pairs at once.
enum class PackOrder { one_at_a_time, on_first_use };

/// K and V of every prefill sequence of a call, packed once per (sequence, kv head) with the largest finite |k| of
/// each (the bound base2_fits needs), in float whatever their storage S; the prefill tasks read them, decoding
/// sequences (`decode[b]` set) are skipped. lay_out makes room for them; pack_pair or pack_once packs each pair
/// (PackOrder).
template <class Tag>
class PackedKV {
 public:
  static constexpr int kPanel = FusedTiles<Tag>::kPanel;
  static constexpr int kChunk = FusedTiles<Tag>::kChunk;

  /// Borrows the calling thread's workspace (aligned_buffer.hpp) for the call, or where a call on this thread holds
  /// it already, uses buffers of its own.
  PackedKV() = default;
  PackedKV(const PackedKV&) = delete;
  PackedKV& operator=(const PackedKV&) = delete;

  /// Lays out packed K and V for every pair (on_first_use) or for the largest pair only (one_at_a_time; every pair's
  /// finiteness counts still have their own place) and packs nothing. Complexity: O(n_sequences · Hkv).
  template <class S>
  void lay_out(const AttentionShape& shape, const TensorView4<const S>& v, const std::vector<char>& decode,
               PackOrder order) {
    Hkv_ = shape.Hkv;
    const bool one_at_a_time = order == PackOrder::one_at_a_time;
    const Index n = shape.n_sequences * shape.Hkv;
    values_as_stored_ = values_packed_as_stored<Tag, S>(v.stride(2), shape.Dv);  // the same for every pair
    key_offset_.assign(static_cast<std::size_t>(n) + 1, 0);
    value_offset_.assign(static_cast<std::size_t>(n) + 1, 0);
    key_abs_max_.assign(static_cast<std::size_t>(n), 0.0f);
    nonfinite_offset_.assign(static_cast<std::size_t>(n) + 1, 0);
    Index key_floats = 0, value_floats = 0;  // one_at_a_time: the largest pair's
    for (Index b = 0; b < shape.n_sequences; ++b) {
      const Index skv = shape.key_counts[static_cast<std::size_t>(b)];
      const bool skip = decode[static_cast<std::size_t>(b)] != 0;
      const Index floats = skip ? 0 : (skv + kPanel - 1) / kPanel * kPanel * shape.D;
      const Index values = skip || values_as_stored_ ? 0 : skv * FusedTiles<Tag>::chunk_floats(shape.Dv);
      key_floats = std::max(key_floats, floats);
      value_floats = std::max(value_floats, values);
      for (Index h = 0; h < shape.Hkv; ++h) {  // one_at_a_time: every pair at offset 0
        key_offset_[index(b, h) + 1] = key_offset_[index(b, h)] + (one_at_a_time ? 0 : floats);
        value_offset_[index(b, h) + 1] = value_offset_[index(b, h)] + (one_at_a_time ? 0 : values);
        nonfinite_offset_[index(b, h) + 1] = nonfinite_offset_[index(b, h)] + (skip ? 0 : skv + 1);
      }
    }
    if (!one_at_a_time) {
      key_floats = key_offset_.back();
      value_floats = value_offset_.back();
      // Not packed yet (0), being packed (1), packed (2): pack_once's flags, one per pair.
      state_.reset(new std::atomic<int>[static_cast<std::size_t>(std::max<Index>(1, n))]());
    }
    values_in_place_.assign(static_cast<std::size_t>(n), nullptr);
    nonfinite_.resize(static_cast<std::size_t>(std::max<Index>(1, nonfinite_offset_.back())));
    keys_.resize(static_cast<std::size_t>(std::max<Index>(1, key_floats)));
    values_.resize(static_cast<std::size_t>(std::max<Index>(1, value_floats)));
  }

  /// The scratch pack_pair and pack_once take for 16-bit storage, a converted key row for pack_keys' bound: D floats
  /// (none for float).
  template <class S>
  static std::size_t row_floats(const AttentionShape& shape) noexcept {
    return std::is_same_v<S, float> ? 0 : static_cast<std::size_t>(shape.D);
  }

  /// Packs the pair (sequence b, kv head h_kv) of a prefill sequence where lay_out made room for it (one_at_a_time:
  /// over the pair packed before). `row`: the calling thread's scratch of row_floats floats (16-bit storage; not read
  /// for float). Complexity: O(skv · (D + Dv)).
  template <class S>
  void pack_pair(const AttentionShape& shape, const TensorView4<const S>& k, const TensorView4<const S>& v, Index b,
                 Index h_kv, float* row) noexcept {
    const std::size_t s = static_cast<std::size_t>(b);
    const Index skv = shape.key_counts[s];
    if (skv == 0 || shape.q_rows[s].length == 0) return;
    const Index vb = shape.view_batch(b), row0 = shape.kv_rows[s].begin;
    key_abs_max_[index(b, h_kv)] = pack_keys<Tag>(&k(vb, h_kv, row0, 0), k.stride(2), skv, shape.D,
                                                  keys_.data() + key_offset_[index(b, h_kv)], row);
    if (values_as_stored_) {  // implies Dv > 0
      if constexpr (std::is_same_v<S, float>) values_in_place_[index(b, h_kv)] = &v(vb, h_kv, row0, 0);
      count_nonfinite_values<Tag>(&v(vb, h_kv, row0, 0), v.stride(2), skv, shape.Dv,
                                  nonfinite_.data() + nonfinite_offset_[index(b, h_kv)]);
    } else if (shape.Dv > 0) {
      pack_values<Tag>(&v(vb, h_kv, row0, 0), v.stride(2), skv, shape.Dv,
                       values_.data() + value_offset_[index(b, h_kv)],
                       nonfinite_.data() + nonfinite_offset_[index(b, h_kv)]);
    }
  }

  /// on_first_use: returns once the pair (sequence b, kv head h_kv) of a prefill sequence is packed, having packed it
  /// itself (pack_pair, with `row` as its scratch: row_floats floats, the calling thread's) if no thread had begun it,
  /// else waited for the thread that had. Any number of threads may call it at once; what the packing thread wrote is
  /// visible to every caller when it returns (release and acquire on the pair's flag). A waiting thread yields its
  /// core between looks. Complexity: O(skv · (D + Dv)) for the packing thread, the rest of that for a waiting one.
  template <class S>
  void pack_once(const AttentionShape& shape, const TensorView4<const S>& k, const TensorView4<const S>& v, Index b,
                 Index h_kv, float* row) noexcept {
    std::atomic<int>& state = state_[index(b, h_kv)];
    if (state.load(std::memory_order_acquire) == 2) return;
    int idle = 0;
    if (state.compare_exchange_strong(idle, 1, std::memory_order_acquire)) {
      pack_pair(shape, k, v, b, h_kv, row);
      state.store(2, std::memory_order_release);
      return;
    }
    while (state.load(std::memory_order_acquire) != 2) std::this_thread::yield();
  }

  /// The packed K panels, the packed V chunks (V itself where values_packed_as_stored: then V must outlive the call
  /// only, as it does) and the largest finite |k| of sequence b's kv head h_kv.
  const float* keys(Index b, Index h_kv) const noexcept { return keys_.data() + key_offset_[index(b, h_kv)]; }
  const float* values(Index b, Index h_kv) const noexcept {
    const float* in_place = values_in_place_[index(b, h_kv)];
    return in_place != nullptr ? in_place : values_.data() + value_offset_[index(b, h_kv)];
  }
  float key_abs_max(Index b, Index h_kv) const noexcept { return key_abs_max_[index(b, h_kv)]; }
  /// Whether the values of keys [j0, j1) of sequence b's kv head h_kv (0 ≤ j0 ≤ j1 ≤ its key count, Dv > 0) are all
  /// finite: all_finite over those rows of V, answered from the counts pack_values kept. O(1).
  bool values_finite(Index b, Index h_kv, Index j0, Index j1) const noexcept {
    QKV_ASSERT(0 <= j0 && j0 <= j1 && j1 < nonfinite_offset_[index(b, h_kv) + 1] - nonfinite_offset_[index(b, h_kv)]);
    const std::uint32_t* counts = nonfinite_.data() + nonfinite_offset_[index(b, h_kv)];
    return counts[j1] == counts[j0];
  }

 private:
  std::size_t index(Index b, Index h_kv) const noexcept { return static_cast<std::size_t>(b * Hkv_ + h_kv); }

  Index Hkv_ = 0;
  WorkspaceLoan loan_;
  AlignedBuffer& keys_ = loan_.first();
  AlignedBuffer& values_ = loan_.second();
  std::vector<Index> key_offset_, value_offset_, nonfinite_offset_;
  std::vector<float> key_abs_max_;
  std::vector<const float*> values_in_place_;  ///< per (sequence, kv head): V itself where it is its packed layout
  std::vector<std::uint32_t> nonfinite_;  ///< per (sequence, kv head): skv + 1 counts of non-finite value rows
  std::unique_ptr<std::atomic<int>[]> state_;  ///< on_first_use: per (sequence, kv head), pack_once's flag
  bool values_as_stored_ = false;         ///< values_packed_as_stored: V read in place, not copied
};

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_PACK_HPP, per pass
