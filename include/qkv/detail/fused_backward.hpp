// qkv/detail/fused_backward.hpp — the fused backward kernel: FlashAttention-2's backward loop on the CPU, in float.
//
// The public entry point is qkv::attention_backward (backward.hpp), which validates the call, resolves its parameters
// and computes d_sinks before it gets here. Given the forward's out and lse (natural log) and d_out, per task
// (sequence b, kv head h_kv), which owns d_k and d_v of its kv head and d_q of its G query heads:
//
//   pack K as Kᵀ panels and, per key tile, as column chunks; Vᵀ as panels; Q and dO of the G heads, per query
//   block, as column chunks (a block's or a tile's chunks then lie together, not a whole sequence apart)  pack.hpp
//   D_i = rowsum(dO_i ∘ O_i), in float in the micro-kernel's order (pack_task)
//   for each key tile [j0, j1) of kBlockKeys keys inside MaskGeometry::key_range               mask.hpp
//     dK_tile = dV_tile = 0
//     for each query head g of the group, each query block [i0, i1) of kBlockRows rows, hidden blocks skipped
//       S  = Q_blk · K_tileᵀ            P  = exp(finish(S) − lse) on the visible keys, 0 elsewhere (selected)
//       dP = dO_blk · V_tileᵀ           with dropout: P̃ = Z ∘ P, dP ← Z ∘ dP (Z = keep / (1 − p))
//       dS = P ∘ (dP − D_i) · softcap′ · scale
//       dV_tile += P̃ᵀ · dO_blk          dK_tile += dSᵀ · Q_blk          dQ_blk += dS · K_tile
//     d_k, d_v rows [j0, j1) ← dK_tile, dV_tile
//   d_q rows ← dQ
//
// All five products run on the forward's prefill micro-kernel (prefill_kernels.hpp: a strip of ≤ kStrip rows times
// packed panels or chunks, accumulators in registers): S and dP as qk_panel over Kᵀ and Vᵀ panels, the three others
// as pv_block over chunks of Q, dO and K, chunk by chunk so that each chunk is read from L1 by every strip, Pᵀ and
// dSᵀ read in place (the micro-kernel only broadcasts its left operand). Per block: 5·R·n·D multiply-adds (D = Dv),
// against the forward's 2 — FlashAttention-2's backward is 2–2.5 times its forward for the same reason.
// Packing per block and tile matters: packed per sequence, the chunks of one block lie Sq·kChunk floats apart (Sq·64
// bytes on AVX2), a multiple of the L2's way size at Sq = 1024 or 4096, so a block's 16 chunk pieces of Q and dO
// (AVX2, D = 128) competed for the same 8-way sets (valgrind's cache simulator with Zen 3's 512 KiB 8-way L2: half
// the L2 misses of the per-sequence layout at Sq = Skv = 1024, D = 128).
//
// Memory: per thread the task's packed K (twice), Vᵀ, Q and dO (O((Skv + G·Sq)·D) floats), dQ of the task (G·Sq × D),
// and tiles of kBlockRows × kBlockKeys: nothing of size Sq × Skv. Every thread's share is a slice of one buffer that
// the calling thread keeps between calls (aligned_buffer.hpp, Workspace). Threads share the tasks; each task writes
// only its own rows of d_q, d_k and d_v, so the result is bit-identical for any thread count.
//
// Exactness (docs/design.md, "Backward pass"): hidden keys are selected away (P = 0, dS = 0), never read into the
// arithmetic, and get exactly zero gradient; a row that sees no key (lse = −∞) contributes nothing. A task whose inputs
// (q, k, v, out, d_out of its heads) are all finite takes the vector path, where a zero weight times a finite value is
// an exact 0; a task with a NaN or ∞ anywhere takes the exact path, which skips every term whose coefficient is 0
// (hidden, dropped, or an exactly zero weight), so a NaN reaches only the gradients that depend on it.
//
// Compiled once per kernel ISA, inside that ISA's target region: detail/dispatch.hpp includes it in each pass (the
// guard below, Highway's toggle, lets each pass in once).
#ifndef QKV_PASS_NAME
#error "qkv/detail/fused_backward.hpp is part of the fused kernel: include qkv/detail/dispatch.hpp"
#endif
#if defined(QKV_DETAIL_FUSED_BACKWARD_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_FUSED_BACKWARD_HPP
#undef QKV_DETAIL_FUSED_BACKWARD_HPP
#else
#define QKV_DETAIL_FUSED_BACKWARD_HPP
#endif

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/detail/aligned_buffer.hpp"
#include "qkv/detail/attention_params.hpp"
#include "qkv/detail/attention_shape.hpp"
#include "qkv/detail/dropout_lanes.hpp"
#include "qkv/detail/fused_tiles.hpp"
#include "qkv/detail/hidden_values.hpp"
#include "qkv/detail/pack.hpp"
#include "qkv/detail/prefill_kernels.hpp"
#include "qkv/detail/threads.hpp"
#include "qkv/mask.hpp"
#include "qkv/simd/simd.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512

/// Tile sizes of the fused backward: key tiles of kBlockKeys (a multiple of every kPanel: 16 keys on AVX2, 64 on
/// AVX-512) and query blocks of kBlockRows rows. A block's six R × n buffers (S/P, dP/dS, P̃, softcap′ and the two
/// transposes) are 32 KiB each at 64 × 128, and dK_tile, dV_tile 64 KiB each at D = 128: the block's working set stays
/// in L2. Every key tile reads the task's Q, dO and dQ again, so wider tiles read them less often: 128 keys took
/// 0.89–0.94 of 64's time at D = 128 on the Zen 3 (bench/README.md, "Backward prefetch"; 32 and 256 were slower).
/// Unmasked, the tile changes no bits (each key's dK and dV and each row's dQ sum their terms in the same order for
/// any tile); masked, a row's runs of visible keys are clipped at the tile edges, and each run's last keys are taken
/// as a masked vector, whose lanes give the values whole vectors give: each key's P and dS do not depend on the tile.
template <class Tag>
struct BackwardTiles {
  static constexpr int kPanel = FusedTiles<Tag>::kPanel;
  static constexpr int kChunk = FusedTiles<Tag>::kChunk;
  static constexpr int kStrip = FusedTiles<Tag>::kStrip;
  static constexpr Index kBlockKeys = 128;
  static constexpr Index kBlockRows = 64;
  static_assert(kBlockKeys % kPanel == 0, "qkv: kBlockKeys must be a multiple of the panel width");
};

/// Per-thread scratch of the fused backward: sized once per call for the largest task, reused by every task; the
/// float arrays are one thread's slice of a single buffer (FusedBackward::run).
struct BackwardScratch {
  float *k_panels, *k_chunks, *v_panels, *q_chunks, *do_chunks;  ///< the task's packed operands
  float *delta, *dq;                                             ///< D_i and dQ of the task's G·Sq rows
  /// One block's buffers (P̃ with dropout; the transposes on the exact path) and the key tile's dK and dV.
  float *s, *dp, *p_kept, *pt, *dst, *factor, *dk, *dv;
  std::vector<HeadMask<float>> masks;  ///< the task's G head masks
};

/// The fused backward for one call in float, over validated views and resolved parameters.
template <class Tag>
class FusedBackward {
 public:
  using Tiles = BackwardTiles<Tag>;
  static constexpr int kPanel = Tiles::kPanel;
  static constexpr int kChunk = Tiles::kChunk;
  static constexpr int kStrip = Tiles::kStrip;
  static constexpr Index kBlockKeys = Tiles::kBlockKeys;
  static constexpr Index kBlockRows = Tiles::kBlockRows;

  FusedBackward(const AttentionShape& shape, const TensorView4<const float>& q, const TensorView4<const float>& k,
                const TensorView4<const float>& v, const TensorView4<const float>& out,
                const TensorView3<const float>& lse, const TensorView4<const float>& d_out,
                const TensorView4<float>& d_q, const TensorView4<float>& d_k, const TensorView4<float>& d_v,
                const AttentionParams<float>& params)
      : shape_(shape),
        q_(q),
        k_(k),
        v_(v),
        out_(out),
        lse_(lse),
        d_out_(d_out),
        d_q_(d_q),
        d_k_(d_k),
        d_v_(d_v),
        params_(params) {}

  /// Runs every (sequence, kv head) task; with OpenMP, threads share the tasks. The result does not depend on the
  /// thread count.
  void run() const {
    const Index n_tasks = shape_.n_sequences * shape_.Hkv;
    Index work = 0, max_sq = 0, max_skv = 0;
    for (Index b = 0; b < shape_.n_sequences; ++b) {
      const std::size_t seq = static_cast<std::size_t>(b);
      const Index sq = shape_.q_rows[seq].length, skv = shape_.key_counts[seq];
      work += sq * skv * shape_.Hq * (shape_.D + shape_.Dv);
      max_sq = std::max(max_sq, sq);
      max_skv = std::max(max_skv, skv);
    }
    const bool parallel = n_tasks > 1 && work > (Index(1) << 20) && may_open_team();
    // Every thread's scratch is a slice of one buffer of the calling thread's workspace (aligned_buffer.hpp), kept for
    // its next calls: allocated per thread and per call, the slices (12 MiB a thread at T = 4096, D = 128) came back
    // as fresh pages and were faulted in again by every call.
#if defined(_OPENMP)
    const int team = parallel ? static_cast<int>(std::min<Index>(omp_get_max_threads(), n_tasks)) : 1;
#else
    (void)parallel;
    const int team = 1;
#endif
    const std::size_t slice = carve(nullptr, max_sq, max_skv, nullptr);
    WorkspaceLoan loan;
    AlignedBuffer& buffer = loan.first();
    buffer.resize(slice * static_cast<std::size_t>(team));
#if defined(_OPENMP)
#pragma omp parallel if (parallel) num_threads(team)
#endif
    {
      observe_team();
#if defined(_OPENMP)
      const std::size_t thread = static_cast<std::size_t>(omp_get_thread_num());
#else
      const std::size_t thread = 0;
#endif
      BackwardScratch scratch;
      carve(buffer.data() + thread * slice, max_sq, max_skv, &scratch);
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
      for (Index task = 0; task < n_tasks; ++task) run_task(task / shape_.Hkv, task % shape_.Hkv, scratch);
    }
  }

 private:
  static Index round_up(Index n, Index m) noexcept { return (n + m - 1) / m * m; }
  /// Floats per row of a Q, dO or K block packed by pack_values: its full chunks and its last one, whole vectors wide.
  static Index packed_width(Index n) noexcept { return FusedTiles<Tag>::chunk_floats(n); }

  /// Lays one thread's scratch out from `base` (each array 64-byte aligned, so that threads never share a cache line;
  /// the slice a whole number of 4 KiB) and returns the slice's size in floats. With `s` null it only counts.
  std::size_t carve(float* base, Index max_sq, Index max_skv, BackwardScratch* s) const {
    const Index D = shape_.D, Dv = shape_.Dv, G = shape_.group, rows = G * max_sq;
    std::size_t used = 0;
    const auto take = [&](Index n) {
      float* p = base == nullptr ? nullptr : base + used;
      used += static_cast<std::size_t>(round_up(std::max<Index>(1, n), 16));
      return p;
    };
    BackwardScratch unused;
    BackwardScratch& t = s != nullptr ? *s : unused;
    t.k_panels = take(round_up(max_skv, kPanel) * D);
    t.k_chunks = take(packed_width(D) * max_skv);
    t.v_panels = take(round_up(max_skv, kPanel) * Dv);
    t.q_chunks = take(rows * packed_width(D));
    t.do_chunks = take(rows * packed_width(Dv));
    t.delta = take(rows);
    t.dq = take(rows * D);
    const Index block = kBlockRows * kBlockKeys;
    t.s = take(block);
    t.dp = take(block);
    t.p_kept = take(block);
    t.pt = take(block);
    t.dst = take(block);
    t.factor = take(block);
    t.dk = take(kBlockKeys * D);
    t.dv = take(kBlockKeys * Dv);
    if (s != nullptr) s->masks.resize(static_cast<std::size_t>(std::max<Index>(1, G)));
    return static_cast<std::size_t>(round_up(static_cast<Index>(used), 1024));
  }

  /// Whether every input the task reads is finite: q, out and d_out of its G heads, k and v of its visible keys,
  /// and no lse is NaN or +∞ (−∞ marks a row that sees no key).
  bool task_is_finite(Index vb, Index h_kv, Index q_row0, Index sq, Index kv_row0, Index skv) const noexcept {
    const Index D = shape_.D, Dv = shape_.Dv, G = shape_.group;
    if (skv > 0 && !all_finite<Tag>(&k_(vb, h_kv, kv_row0, 0), skv, D, k_.stride(2))) return false;
    if (skv > 0 && Dv > 0 && !all_finite<Tag>(&v_(vb, h_kv, kv_row0, 0), skv, Dv, v_.stride(2))) return false;
    for (Index g = 0; g < G; ++g) {
      const Index h = h_kv * G + g;
      if (!all_finite<Tag>(&q_(vb, h, q_row0, 0), sq, D, q_.stride(2))) return false;
      if (Dv > 0 && !all_finite<Tag>(&out_(vb, h, q_row0, 0), sq, Dv, out_.stride(2))) return false;
      if (Dv > 0 && !all_finite<Tag>(&d_out_(vb, h, q_row0, 0), sq, Dv, d_out_.stride(2))) return false;
      for (Index i = 0; i < sq; ++i) {
        const float l = lse_(vb, h, q_row0 + i);
        if (std::isnan(l) || l == std::numeric_limits<float>::infinity()) return false;
      }
    }
    return true;
  }

  /// One task: sequence b, kv head h_kv.
  void run_task(Index b, Index h_kv, BackwardScratch& s) const {
    const std::size_t seq = static_cast<std::size_t>(b);
    const Index vb = shape_.view_batch(b), G = shape_.group, D = shape_.D, Dv = shape_.Dv;
    const Index q_row0 = shape_.q_rows[seq].begin, sq = shape_.q_rows[seq].length;
    const Index kv_row0 = shape_.kv_rows[seq].begin, kv_rows = shape_.kv_rows[seq].length;
    const Index skv = shape_.key_counts[seq];
    // Each row of d_k and d_v is written once: a key tile that some block reaches from its dK and dV, every other key
    // (padding, keys no query sees) with zeros, as the tiles go by. Writing all the rows zero first and the tiles'
    // rows again later touched every page of d_k and d_v twice, far apart (the zero fill: 14-49 ms of a ~1 s call at
    // T = 4096, D = 128 on a VM where a page's first touch was dear; bench/README.md, "2026-12-03, seventeenth
    // session").
    Index written = 0;  // rows [0, written) of the sequence's keys are written
    const auto zero_rows_to = [&](Index end) {
      for (Index j = written; j < end; ++j) {
        std::fill_n(&d_k_(vb, h_kv, kv_row0 + j, 0), D, 0.0f);
        if (Dv > 0) std::fill_n(&d_v_(vb, h_kv, kv_row0 + j, 0), Dv, 0.0f);
      }
      written = std::max(written, end);
    };
    const auto store_tile = [&](Index j0, Index n) {  // rows [j0, j0 + n) from the tile's dK and dV
      zero_rows_to(j0);
      for (Index j = 0; j < n; ++j) {
        std::copy_n(s.dk + j * D, D, &d_k_(vb, h_kv, kv_row0 + j0 + j, 0));
        if (Dv > 0) std::copy_n(s.dv + j * Dv, Dv, &d_v_(vb, h_kv, kv_row0 + j0 + j, 0));
      }
      written = j0 + n;
    };
    if (sq == 0) {
      zero_rows_to(kv_rows);
      return;
    }
    float* dq = s.dq;
    std::fill_n(dq, G * sq * D, 0.0f);
    if (skv > 0) {
      for (Index g = 0; g < G; ++g) s.masks[static_cast<std::size_t>(g)] = params_.head_mask(vb, h_kv * G + g, sq, skv);
      const bool exact = !task_is_finite(vb, h_kv, q_row0, sq, kv_row0, skv);
      pack_task(vb, h_kv, q_row0, sq, kv_row0, skv, s);
      const MaskGeometry& geometry = s.masks[0].geometry;
      const KeyRange range = geometry.key_range(0, sq);
      for (Index j0 = range.begin / kBlockKeys * kBlockKeys; j0 < range.end; j0 += kBlockKeys) {
        const Index j1 = std::min(j0 + kBlockKeys, range.end), n = j1 - j0;
        std::fill_n(s.dk, n * D, 0.0f);
        std::fill_n(s.dv, n * Dv, 0.0f);
        bool touched = false;
        for (Index g = 0; g < G; ++g) {
          for (Index i0 = 0; i0 < sq; i0 += kBlockRows) {
            const Index i1 = std::min(i0 + kBlockRows, sq);
            const TileVisibility visibility = geometry.classify(i0, i1, j0, j1);
            if (visibility == TileVisibility::hidden) continue;
            run_block(b, vb, h_kv, g, q_row0, sq, i0, i1, j0, n, skv, visibility, exact, s);
            touched = true;
          }
        }
        if (touched) store_tile(j0, n);
      }
    }
    zero_rows_to(kv_rows);
    for (Index g = 0; g < G; ++g) {
      for (Index i = 0; i < sq; ++i) std::copy_n(dq + (g * sq + i) * D, D, &d_q_(vb, h_kv * G + g, q_row0 + i, 0));
    }
  }

  /// Packs the task's operands (pack.hpp): Kᵀ and Vᵀ panels for S and dP, K, Q and dO as column chunks for the
  /// three products that accumulate, and D_i = rowsum(dO_i ∘ O_i) in float, one fused multiply-add per column in
  /// column order: the order in which the micro-kernel forms each dP_ij = dO_i·v_j, so that dP_ij − D_i is exactly 0
  /// where out_i = v_j (a row that sees one key: its exact dS is 0, and so is the computed one, whatever P's rounding).
  void pack_task(Index vb, Index h_kv, Index q_row0, Index sq, Index kv_row0, Index skv, BackwardScratch& s) const {
    const Index D = shape_.D, Dv = shape_.Dv, G = shape_.group;
    const float* k = &k_(vb, h_kv, kv_row0, 0);
    pack_keys<Tag>(k, k_.stride(2), skv, D, s.k_panels, nullptr);
    for (Index j0 = 0; j0 < skv; j0 += kBlockKeys) {
      pack_values<Tag>(k + j0 * k_.stride(2), k_.stride(2), std::min(kBlockKeys, skv - j0), D,
                       s.k_chunks + j0 * packed_width(D));
    }
    if (Dv > 0) pack_keys<Tag>(&v_(vb, h_kv, kv_row0, 0), v_.stride(2), skv, Dv, s.v_panels, nullptr);
    const Index q_area = sq * packed_width(D), do_area = sq * packed_width(Dv);
    for (Index g = 0; g < G; ++g) {
      const Index h = h_kv * G + g;
      for (Index i0 = 0; i0 < sq; i0 += kBlockRows) {
        const Index rows = std::min(kBlockRows, sq - i0);
        pack_values<Tag>(&q_(vb, h, q_row0 + i0, 0), q_.stride(2), rows, D,
                         s.q_chunks + g * q_area + i0 * packed_width(D));
        if (Dv > 0) {
          pack_values<Tag>(&d_out_(vb, h, q_row0 + i0, 0), d_out_.stride(2), rows, Dv,
                           s.do_chunks + g * do_area + i0 * packed_width(Dv));
        }
      }
      for (Index i = 0; i < sq; ++i) {
        float sum = 0.0f;
        if (Dv > 0) {
          const float* o = &out_(vb, h, q_row0 + i, 0);
          const float* d_o = &d_out_(vb, h, q_row0 + i, 0);
          for (Index d = 0; d < Dv; ++d) sum = std::fma(d_o[d], o[d], sum);
        }
        s.delta[g * sq + i] = sum;
      }
    }
  }

  /// One (query block, key tile) of query head g: the seven steps of the comment at the top of this file.
  void run_block(Index b, Index vb, Index h_kv, Index g, Index q_row0, Index sq, Index i0, Index i1, Index j0, Index n,
                 Index skv, TileVisibility visibility, bool exact, BackwardScratch& s) const {
    using namespace simd;
    constexpr int L = Tag::kLanes;
    constexpr float kNegInf = -std::numeric_limits<float>::infinity();
    const Index D = shape_.D, Dv = shape_.Dv, G = shape_.group, h = h_kv * G + g, R = i1 - i0;
    const HeadMask<float>& mask = s.masks[static_cast<std::size_t>(g)];
    const float scale = params_.rules.scale, softcap = params_.rules.softcap;
    const bool dropout = params_.dropout.active();
    const Index ld = kBlockKeys, ldt = kBlockRows;  // row strides of the R × n buffers and of the n × R transposes
    float* S = s.s;                                 // scores, then P
    float* dP = s.dp;                               // dO·Vᵀ, then dS
    float* P_kept = s.p_kept;                       // P with dropout applied (P itself without dropout)
    float* factor = s.factor;                       // softcap′ per (i, j)
    const float* q_rows = &q_(vb, h, q_row0 + i0, 0);
    const float* do_rows = Dv > 0 ? &d_out_(vb, h, q_row0 + i0, 0) : nullptr;
    const float* delta = s.delta + g * sq + i0;
    float* dq = s.dq + (g * sq + i0) * D;
    const Index panels = (n + kPanel - 1) / kPanel;

    // S = Q_blk · K_tileᵀ and dP = dO_blk · V_tileᵀ over the packed panels. A strip's panels also prefetch the next
    // strip's rows of Q and dO, a share per panel: every key tile reads them again from L3 or memory, and the hardware
    // prefetchers lose the strip's interleaved row streams where the next strip starts
    // (bench/README.md, "Backward prefetch").
    for (Index r0 = 0; r0 < R; r0 += kStrip) {
      const Index next = r0 + kStrip, next_end = std::min(next + kStrip, R);
      dispatch_rows(std::min<Index>(kStrip, R - r0), [&](auto rows_constant) {
        constexpr int kR = decltype(rows_constant)::value;
        for (Index p = 0; p < panels; ++p) {
          for (Index r = next + p; r < next_end; r += panels) {
            simd::prefetch_row(q_rows + r * q_.stride(2), D);
            if (Dv > 0) simd::prefetch_row(do_rows + r * d_out_.stride(2), Dv);
          }
          qk_panel<Tag, kR>(q_rows + r0 * q_.stride(2), q_.stride(2), s.k_panels + (j0 / kPanel + p) * D * kPanel, D,
                            S + r0 * ld + p * kPanel, ld);
          if (Dv > 0) {
            qk_panel<Tag, kR>(do_rows + r0 * d_out_.stride(2), d_out_.stride(2),
                              s.v_panels + (j0 / kPanel + p) * Dv * kPanel, Dv, dP + r0 * ld + p * kPanel, ld);
          }
        }
      });
    }
    if (Dv == 0) {
      for (Index r = 0; r < R; ++r) std::fill_n(dP + r * ld, n, 0.0f);
    }

    // P = exp(s − lse) on the visible keys (0 elsewhere, selected), and dS = P ∘ (dP − D_i) · softcap′ · scale.
    // A tile whose mask is index rules only (causal, window, global tokens, key lengths: no `allowed`, bias, ALiBi or
    // softcap) runs the vector loops over each row's visible keys, at most two runs of them (the global prefix and
    // the band, MaskGeometry), and writes 0 elsewhere; so does a fully visible one (one run). Other tiles, and the
    // exact path's dS, go element by element.
    const bool index_only = !mask.has_data_mask() && !mask.modifies_scores();
    const bool plain = visibility == TileVisibility::full && index_only;
    const auto exp_run = [&](float* p_row, float lse, Index a, Index e) {
      const auto scale_vector = set1(Tag(), scale), lse_vector = set1(Tag(), lse);
      Index j = a;
      for (; j + L <= e; j += L) {
        store(Tag(), p_row + j, exp(Tag(), sub(mul(load(Tag(), p_row + j), scale_vector), lse_vector)));
      }
      if (j < e) {  // the run's last e − j < L keys (a causal diagonal ends anywhere): a masked vector, no scalar exp
        const int tail = static_cast<int>(e - j);
        const auto x = sub(mul(load_partial(Tag(), p_row + j, tail), scale_vector), lse_vector);
        store_partial(Tag(), p_row + j, exp(Tag(), x), tail);
      }
    };
    const auto ds_run = [&](const float* p_row, float* ds_row, float d_i, Index a, Index e) {
      const auto scale_vector = set1(Tag(), scale), d_vector = set1(Tag(), d_i);
      Index j = a;
      for (; j + L <= e; j += L) {
        const auto p = load(Tag(), p_row + j);
        store(Tag(), ds_row + j, mul(mul(p, sub(load(Tag(), ds_row + j), d_vector)), scale_vector));
      }
      if (j < e) {
        const int tail = static_cast<int>(e - j);
        const auto p = load_partial(Tag(), p_row + j, tail);
        store_partial(Tag(), ds_row + j,
                      mul(mul(p, sub(load_partial(Tag(), ds_row + j, tail), d_vector)), scale_vector), tail);
      }
    };
    // The block's Q and dO chunks, packed on their own (pack_task): R·kChunk floats from one chunk to the next.
    const Index q_area = sq * packed_width(D), do_area = sq * packed_width(Dv);
    const float* q_chunks = s.q_chunks + g * q_area + i0 * packed_width(D);
    const float* do_chunks = s.do_chunks + g * do_area + i0 * packed_width(Dv);
    // pv_block below reads the block's Q and dO chunks and its rows of dQ, from L3 or memory once per key tile: the
    // row loop prefetches them, a share per row, so they arrive while the exponentials run.
    const auto prefetch_share = [R](const float* data, Index floats, Index r) {
      constexpr Index kPerLine = 64 / static_cast<Index>(sizeof(float));
      const Index lines = (floats + kPerLine - 1) / kPerLine;
      for (Index line = lines * r / R; line < lines * (r + 1) / R; ++line) simd::prefetch(data + line * kPerLine);
    };
    for (Index r = 0; r < R; ++r) {
      if (!exact) {
        prefetch_share(q_chunks, R * packed_width(D), r);
        prefetch_share(do_chunks, R * packed_width(Dv), r);
        prefetch_share(dq, R * D, r);
      }
      const Index i = i0 + r;
      const float lse = lse_(vb, h, q_row0 + i);
      float* p_row = S + r * ld;
      float* ds_row = dP + r * ld;
      float* factor_row = factor + r * ld;
      if (lse == kNegInf) {  // the row sees no key: no weight, no gradient
        std::fill_n(p_row, n, 0.0f);
        std::fill_n(ds_row, n, 0.0f);
        if (dropout) std::fill_n(P_kept + r * ld, n, 0.0f);
        continue;
      }
      // The row's visible keys as at most two runs [runs[t].begin, runs[t].end) of tile columns, in order, apart.
      KeyRange runs[2];
      int n_runs = 0;
      if (plain) {
        runs[n_runs++] = {0, n};
      } else if (index_only) {
        const KeyRange band = mask.geometry.band(i), global = mask.geometry.global(i);
        const auto clip = [&](KeyRange range) {
          return KeyRange{std::clamp(range.begin - j0, Index(0), n),
                          std::clamp(std::min(range.end, skv) - j0, Index(0), n)};
        };
        const KeyRange prefix = clip(global), near = clip(band);
        if (!prefix.empty() && !near.empty() && near.begin <= prefix.end) {
          runs[n_runs++] = {prefix.begin, std::max(prefix.end, near.end)};  // the prefix reaches the band: one run
        } else {
          if (!prefix.empty()) runs[n_runs++] = prefix;
          if (!near.empty()) runs[n_runs++] = near;
        }
      }
      if (index_only) {
        Index done = 0;
        for (int t = 0; t < n_runs; ++t) {
          std::fill(p_row + done, p_row + runs[t].begin, 0.0f);
          exp_run(p_row, lse, runs[t].begin, runs[t].end);
          done = runs[t].end;
        }
        std::fill(p_row + done, p_row + n, 0.0f);
      } else {
        for (Index j = 0; j < n; ++j) {
          factor_row[j] = 1.0f;
          if (j0 + j >= skv || !mask.visible(i, j0 + j)) {
            p_row[j] = 0.0f;
            continue;
          }
          const float scaled = p_row[j] * scale;
          if (softcap > 0.0f) {
            const float t = std::tanh(scaled / softcap);
            factor_row[j] = 1.0f - t * t;
          }
          const float score = mask.finish(scaled, i, j0 + j);
          p_row[j] = score == kNegInf ? 0.0f : std::exp(score - lse);
        }
      }
      if (dropout) {  // P̃ = Z ∘ P for dV; dP ← Z ∘ dP (the forward's mask, drawn once for both: dropout.hpp)
        std::copy_n(p_row, n, P_kept + r * ld);
        params_.dropout.apply_row<DropoutLanes>(b, h, params_.dropout_q_begin + i, params_.dropout_k_begin + j0, n,
                                                P_kept + r * ld, ds_row);
      }
      const float d_i = delta[r];
      if (exact) {
        for (Index j = 0; j < n; ++j) {
          // A zero coefficient (weight, softcap′ or scale) is selected away, never multiplied (NaN rule).
          const float f = index_only ? 1.0f : factor_row[j];
          ds_row[j] = p_row[j] == 0.0f || f == 0.0f || scale == 0.0f ? 0.0f : p_row[j] * (ds_row[j] - d_i) * f * scale;
        }
      } else if (index_only) {
        // Hidden keys are written 0, never multiplied: dP − D_i may overflow to ±∞ even from finite inputs. A visible
        // weight that underflowed to 0 is multiplied, as on a fully visible tile (only the exact path selects it).
        Index done = 0;
        for (int t = 0; t < n_runs; ++t) {
          std::fill(ds_row + done, ds_row + runs[t].begin, 0.0f);
          ds_run(p_row, ds_row, d_i, runs[t].begin, runs[t].end);
          done = runs[t].end;
        }
        std::fill(ds_row + done, ds_row + n, 0.0f);
      } else {
        // Hidden keys (weight 0) selected: dP − D_i may overflow to ±∞ even from finite inputs.
        for (Index j = 0; j < n; ++j) {
          ds_row[j] = p_row[j] == 0.0f ? 0.0f : p_row[j] * (ds_row[j] - d_i) * factor_row[j] * scale;
        }
      }
    }
    const float* P_used = dropout ? P_kept : S;

    // The tile's K chunks, packed on their own: tile_keys·kChunk floats from one chunk to the next.
    const float* k_chunks = s.k_chunks + j0 * packed_width(D);
    const Index tile_keys = std::min(kBlockKeys, skv - j0);
    if (!exact) {
      // dV_tile += P̃ᵀ · dO_blk, dK_tile += dSᵀ · Q_blk (strips of kStrip keys) and dQ_blk += dS · K_tile (strips of
      // kStrip rows), a chunk of dO, Q or K at a time (pv_block: the chunk stays in L1 while the strips pass).
      constexpr StripLayout kColumns = StripLayout::columns;
      if (Dv > 0) pv_block<Tag, kColumns>(P_used, ld, do_chunks, R * kChunk, R, s.dv, Dv, n, Dv);
      pv_block<Tag, kColumns>(dP, ld, q_chunks, R * kChunk, R, s.dk, D, n, D);
      pv_block<Tag>(dP, ld, k_chunks, tile_keys * kChunk, n, dq, D, R, D);
    } else {
      // The exact path: every term whose coefficient is 0 is skipped, so a NaN or ∞ in q, k, v or d_out reaches only
      // the gradients that depend on it (hidden_values.hpp).
      // Pᵀ and dSᵀ (n × R) for the skipping loops.
      float* PT = s.pt;
      float* dST = s.dst;
      for (Index r = 0; r < R; ++r) {
        for (Index j = 0; j < n; ++j) {
          PT[j * ldt + r] = P_used[r * ld + j];
          dST[j * ldt + r] = dP[r * ld + j];
        }
      }
      if (Dv > 0) pv_skip_zero_weights(PT, ldt, do_rows, d_out_.stride(2), R, s.dv, Dv, Dv, n);
      pv_skip_zero_weights(dST, ldt, q_rows, q_.stride(2), R, s.dk, D, D, n);
      pv_skip_zero_weights(dP, ld, &k_(vb, h_kv, shape_.kv_rows[static_cast<std::size_t>(b)].begin + j0, 0),
                           k_.stride(2), n, dq, D, D, R);
    }
  }

  const AttentionShape& shape_;
  TensorView4<const float> q_, k_, v_, out_;
  TensorView3<const float> lse_;
  TensorView4<const float> d_out_;
  TensorView4<float> d_q_, d_k_, d_v_;
  const AttentionParams<float>& params_;
};

/// This pass's fused backward, chosen by overload on the tag (dispatch.hpp brings the passes' overloads together).
inline void run_fused_backward_as(QKV_PASS_TAG, const AttentionShape& shape, const TensorView4<const float>& q,
                                  const TensorView4<const float>& k, const TensorView4<const float>& v,
                                  const TensorView4<const float>& out, const TensorView3<const float>& lse,
                                  const TensorView4<const float>& d_out, const TensorView4<float>& d_q,
                                  const TensorView4<float>& d_k, const TensorView4<float>& d_v,
                                  const AttentionParams<float>& params) {
  FusedBackward<QKV_PASS_TAG>(shape, q, k, v, out, lse, d_out, d_q, d_k, d_v, params).run();
}

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_FUSED_BACKWARD_HPP, per pass
