// qkv/detail/fused_attention.hpp — the fused kernel's driver: FlashAttention-2's forward loop on the CPU, in float.
//
// The public entry point is qkv::attention (Backend::fused or automatic), which validates the call and resolves its
// parameters (attention_params.hpp) before it gets here. The loop, with the room each step lives in:
//
//   pack K and V of every prefill sequence once per (sequence, kv head), each just before its first   pack.hpp
//   task (by the thread that takes it first)
//   for each task (sequence b, kv head h_kv, query tile [i0, i1), key chunk): threads over groups  split_k.hpp
//   of tasks (a prefill group: up to 8 query tiles of a (b, h_kv) whose K and V exceed 4 MiB, which
//   take its keys chunk by chunk of 2 MiB, each tile in turn, keeping their states; else one task)
//     Q_block ← the G query heads of the group stacked, row r = g·rows + (i − i0), pre-scaled by
//               scale·log2 e (scale alone where softcap, bias or ALiBi need base e)            query_block.hpp
//     for each key tile [j0, j1) inside MaskGeometry::key_range(i0, i1), hidden tiles skipped        mask.hpp
//       prefill (Sq·G > kDecodeRows), per strip of kStrip block rows:                     prefill_kernels.hpp
//         acc_s = Q_strip · K_tileᵀ (packed panels); scores finished and masked           score_tile.hpp
//         row_max, row_sum updated (the strip's rows at once), acc_o rescaled where a max rose  online_softmax.hpp
//         P dropped and rescaled by 1/(1 − p) where the call asks for dropout             dropout.hpp
//         acc_o += P · V_tile (packed chunks, or zero weights skipped where V holds NaN/∞)   hidden_values.hpp
//       decoding: the same steps over blocks of kDecodeKeys keys, K and V read in place     decode_kernels.hpp
//         (token-major K and V: one task serves several kv heads, so it reads whole key rows)
//     out = acc_o / row_sum and lse (base e); or a partial state, merged in chunk order             split_k.hpp
//
// Tile sizes: fused_tiles.hpp. Memory: per thread Q_block (M × D) and acc_o (M × Dv) per task of the call's largest
// group (FusedTasks::max_group), M = G · rows per tile (G · Sq · n_kv for a decoding task of n_kv kv heads), and acc_s
// (a strip's kStrip × kBlockN scores, which stay in L1, or a decoding block's M × kDecodeKeys), allocated once per
// call; packed K and V, the size of K and V (prefill sequences only; on one thread the size of the largest pair's),
// kept by the calling thread for its next calls (aligned_buffer.hpp, Workspace). Nothing of size Sq × Skv. Traffic per
// task: K and V of its visible key range once from memory (a prefill group's tasks: once per group, from L3 for the
// others), then from L2 for every strip (kBlockN = 256 keys × D = 128 floats = 128 KiB each on AVX2, 512 keys = 256 KiB
// on AVX-512), Q and out once; decoding reads K and V once, in place.
//
// Exactness rules kept here (docs/design.md): hidden keys are selected away (−∞ before exp), never multiplied by
// zero; a row with NaN or +∞ among its visible scores is NaN; empty rows give zeros and lse −∞; sinks join the
// denominator at the end as a state with output 0 and lse = the sink logit; a prefill task whose scores could
// overflow in base 2 runs again in base e. Dropout acts on the weights after the softmax step (row_sum, and so lse,
// stay undropped) and before P·V; its mask is a function of (sequence, query head, position in the sequence of the
// query and of the key) alone, never of the tile, task or thread, and a dropped weight is a zero weight: its V slot
// is skipped like a hidden one where V may hold NaN or ∞.
//
// Compiled once per kernel ISA, inside that ISA's target region: detail/dispatch.hpp includes it in each pass (the
// guard below, Highway's toggle, lets each pass in once).
#ifndef QKV_PASS_NAME
#error "qkv/detail/fused_attention.hpp is part of the fused kernel: include qkv/detail/dispatch.hpp"
#endif
#if defined(QKV_DETAIL_FUSED_ATTENTION_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_FUSED_ATTENTION_HPP
#undef QKV_DETAIL_FUSED_ATTENTION_HPP
#else
#define QKV_DETAIL_FUSED_ATTENTION_HPP
#endif

#include <algorithm>
#include <cstddef>
#include <limits>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/detail/aligned_buffer.hpp"
#include "qkv/detail/attention_params.hpp"
#include "qkv/detail/attention_shape.hpp"
#include "qkv/detail/decode_kernels.hpp"
#include "qkv/detail/dropout_lanes.hpp"
#include "qkv/detail/fused_tiles.hpp"
#include "qkv/detail/hidden_values.hpp"
#include "qkv/detail/online_softmax.hpp"
#include "qkv/detail/pack.hpp"
#include "qkv/detail/prefill_kernels.hpp"
#include "qkv/detail/query_block.hpp"
#include "qkv/detail/score_tile.hpp"
#include "qkv/detail/split_k.hpp"
#include "qkv/detail/threads.hpp"
#include "qkv/isa.hpp"
#include "qkv/mask.hpp"
#include "qkv/simd/exp_constants.hpp"
#include "qkv/simd/simd.hpp"
#include "qkv/softmax.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512

/// What one running task holds: its Q block, softmax state and head masks.
struct TaskState {
  AlignedBuffer q_block, acc_o, row_max, row_sum;
  std::vector<char> row_nan;
  std::vector<HeadMask<float>> masks;  ///< the task's G head masks
  QueryScale scaled;                   ///< how the task's Q block was scaled
  KeyRange range;                      ///< the task's keys: its rows' key range ∩ its split-K chunk
  bool live = false;                   ///< a group's task still running in base 2 (run_prefill_group)
};

/// Per-thread scratch of the fused kernel: sized once per call, reused by every task of the thread.
struct FusedScratch {
  std::vector<TaskState> states;  ///< one per task of the largest group (FusedTasks::max_group)
  AlignedBuffer acc_s;            ///< a strip's scores, or a decoding block's
  std::vector<float> pack_row;    ///< PackedKV::pack_pair's and pack_once's scratch (16-bit K)
};

/// The fused kernel for one call in float, over validated views and resolved parameters. K and V are stored as S:
/// float, or Eigen::half / Eigen::bfloat16, converted exactly to float where they are read (packing, the decoding
/// kernels, the finiteness scan and the zero-weight path); nothing is computed in 16 bits.
template <class Tag, class S = float>
class FusedAttention {
 public:
  using Tiles = FusedTiles<Tag>;
  static constexpr int kPanel = Tiles::kPanel;
  static constexpr int kStrip = Tiles::kStrip;

  FusedAttention(const AttentionShape& shape, const TensorView4<const float>& q, const TensorView4<const S>& k,
                 const TensorView4<const S>& v, const TensorView4<float>& out, const TensorView3<float>* lse,
                 const AttentionParams<float>& params)
      : shape_(shape), q_(q), k_(k), v_(v), out_(out), lse_(lse), params_(params) {
    G_ = shape.group;
    rows_per_tile_ = std::max<Index>(1, Tiles::kBlockM / std::max<Index>(1, G_));
  }

  /// Runs every task; with OpenMP, threads share the tasks. The result does not depend on the thread count.
  void run() {
    decode_.assign(static_cast<std::size_t>(shape_.n_sequences), 0);
    for (Index b = 0; b < shape_.n_sequences; ++b) {
      decode_[static_cast<std::size_t>(b)] =
          shape_.q_rows[static_cast<std::size_t>(b)].length * G_ <= Tiles::kDecodeRows;
    }
    int team = 1;  // the threads a team would have (for the size of prefill groups only)
#if defined(_OPENMP)
    if (may_open_team()) team = omp_get_max_threads();
#endif
    tasks_.build(shape_, rows_per_tile_, plans(team));
    decode_rows_ = 0;
    for (const FusedTask& t : tasks_.tasks()) {
      if (decode_[static_cast<std::size_t>(t.sequence)]) decode_rows_ = std::max(decode_rows_, tasks_.rows(t));
    }
    zeros_.assign(static_cast<std::size_t>(shape_.Dv), 0.0f);
    const std::vector<FusedTask>& tasks = tasks_.tasks();
    const std::vector<TaskGroup>& groups = tasks_.groups();
    const Index n_groups = static_cast<Index>(groups.size());
    // A team costs microseconds to wake; below about a million multiply-adds one thread is faster. Inside a
    // caller's active parallel region no team is opened (threads.hpp).
    const bool parallel = n_groups > 1 && tasks_.work() > (Index(1) << 20) && may_open_team();
    // One thread packs each (sequence, kv head) just before its tasks, a team each on its first task (PackOrder).
    // Either way every task reads the same packed floats: the same bits.
    bool one_thread = !parallel;
#if defined(_OPENMP)
    one_thread = one_thread || omp_get_max_threads() == 1;
#endif
    packed_.lay_out(shape_, v_, decode_, one_thread ? PackOrder::one_at_a_time : PackOrder::on_first_use);
#if defined(_OPENMP)
#pragma omp parallel if (!one_thread)
#endif
    {
      observe_team();
      FusedScratch scratch;
      allocate(scratch);
      if (one_thread) {
        Index packed_pair = -1;  // groups come in (sequence, kv head) order: each pair is packed once
        for (const TaskGroup& group : groups) {
          const FusedTask& t = tasks[static_cast<std::size_t>(group.first)];
          const Index pair = t.sequence * shape_.Hkv + t.h_kv;
          if (!decode_[static_cast<std::size_t>(t.sequence)] && pair != packed_pair) {
            packed_.pack_pair(shape_, k_, v_, t.sequence, t.h_kv, scratch.pack_row.data());
            packed_pair = pair;
          }
          run_group(group, scratch);
        }
      } else {
#if defined(_OPENMP)
#pragma omp for schedule(dynamic, 1)
#endif
        for (Index i = 0; i < n_groups; ++i) {
          const TaskGroup& group = groups[static_cast<std::size_t>(i)];
          const FusedTask& t = tasks[static_cast<std::size_t>(group.first)];
          if (!decode_[static_cast<std::size_t>(t.sequence)]) {
            packed_.pack_once(shape_, k_, v_, t.sequence, t.h_kv, scratch.pack_row.data());
          }
          run_group(group, scratch);
        }
      }
    }
    tasks_.merge([this](const FusedTask& t, Index r, float* o, float lse) { write_row(t, r, o, lse); });
  }

 private:
  /// How each sequence is cut into tasks. A decoding sequence whose K and V are token-major (each key row holds the
  /// kv heads side by side: view_bshd, the packed Eigen entry point) takes as many kv heads per task as kBlockM rows
  /// allow, so that a task streams whole contiguous key rows instead of striding through them one head at a time,
  /// and it is split into at least kDecodeMinChunks key chunks where it has that many blocks, so that the threads
  /// share it. That much depends on the shapes and strides only, never on the thread count. A prefill sequence whose
  /// packed K and V exceed kPrefillGroupBytes per kv head takes its query tiles in groups over chunks of
  /// kPrefillChunkBytes (run_prefill_group): kPrefillGroupTiles tiles a group on one thread, and on a team of `team`
  /// threads as many as leave kPrefillGroupsPerThread groups per thread among all such tiles of the call (at least
  /// one tile), so that a call of few tiles still spreads over the team. Groups change no bits.
  std::vector<SequencePlan> plans(int team) const {
    const bool token_major = shape_.Hkv > 1 && k_.stride(2) > k_.stride(1) && v_.stride(2) > v_.stride(1);
    const Index key_bytes = std::max<Index>(1, (shape_.D + shape_.Dv) * static_cast<Index>(sizeof(float)));
    const Index chunk_keys =
        std::max<Index>(1, Tiles::kPrefillChunkBytes / key_bytes / Tiles::kBlockN) * Tiles::kBlockN;
    const auto grouped = [&](std::size_t seq) {
      return !decode_[seq] && shape_.key_counts[seq] * key_bytes > Tiles::kPrefillGroupBytes;
    };
    Index group_tiles = Tiles::kPrefillGroupTiles;
    if (team > 1) {
      Index tiles = 0;  // the query tiles of every kv head of the grouped sequences
      for (Index b = 0; b < shape_.n_sequences; ++b) {
        const std::size_t seq = static_cast<std::size_t>(b);
        if (grouped(seq)) tiles += (shape_.q_rows[seq].length + rows_per_tile_ - 1) / rows_per_tile_ * shape_.Hkv;
      }
      group_tiles = std::clamp<Index>(tiles / (Tiles::kPrefillGroupsPerThread * team), 1, group_tiles);
    }
    std::vector<SequencePlan> result(static_cast<std::size_t>(shape_.n_sequences));
    for (Index b = 0; b < shape_.n_sequences; ++b) {
      const std::size_t seq = static_cast<std::size_t>(b);
      SequencePlan& plan = result[seq];
      plan.split_keys = Tiles::kSplitKeys;
      if (grouped(seq)) {
        plan.group_tiles = group_tiles;
        plan.chunk_keys = chunk_keys;
      }
      const Index group_rows = G_ * shape_.q_rows[seq].length;
      if (!decode_[seq] || !token_major || group_rows == 0) continue;
      plan.kv_heads = std::max<Index>(1, std::min(shape_.Hkv, Tiles::kBlockM / group_rows));
      const Index skv = shape_.key_counts[seq], blocks = (skv + Tiles::kDecodeKeys - 1) / Tiles::kDecodeKeys;
      const Index chunk_blocks = (blocks + Tiles::kDecodeMinChunks - 1) / Tiles::kDecodeMinChunks;
      plan.split_keys = std::min(Tiles::kSplitKeys, std::max<Index>(1, chunk_blocks) * Tiles::kDecodeKeys);
    }
    return result;
  }

  void allocate(FusedScratch& s) const {
    const Index M = std::max<Index>(1, tasks_.max_rows());
    s.states.resize(static_cast<std::size_t>(tasks_.max_group()));
    for (TaskState& state : s.states) {
      state.q_block.resize(static_cast<std::size_t>(M * shape_.D));
      state.acc_o.resize(static_cast<std::size_t>(std::max<Index>(1, M * shape_.Dv)));
      state.row_max.resize(static_cast<std::size_t>(M));
      state.row_sum.resize(static_cast<std::size_t>(M));
      state.row_nan.assign(static_cast<std::size_t>(M), 0);
      state.masks.resize(static_cast<std::size_t>(M));
    }
    // Prefill fills one strip of scores at a time (kStrip × kBlockN); decoding a whole block of its M rows: at most
    // kDecodeRows × kDecodeKeys, plus M × kPanel where a task of several kv heads rounds its block up to a panel.
    s.acc_s.resize(static_cast<std::size_t>(
        std::max<Index>(kStrip * Tiles::kBlockN,
                        std::min(decode_rows_, Tiles::kDecodeRows) * Tiles::kDecodeKeys + decode_rows_ * kPanel)));
    s.pack_row.resize(PackedKV<Tag>::template row_floats<S>(shape_));
  }

  /// One group of tasks: a prefill group (run_prefill_group); or one task alone, a prefill one in base 2, or in base
  /// e where base 2 could overflow, a decoding one in base e.
  void run_group(const TaskGroup& group, FusedScratch& s) const {
    const FusedTask& t = tasks_.tasks()[static_cast<std::size_t>(group.first)];
    TaskState& state = s.states[0];
    if (decode_[static_cast<std::size_t>(t.sequence)]) {
      if constexpr (Tiles::kDecodePrefetchL2) {
        if (decode_prefetch_level() == PrefetchLevel::l2) return run_decode_task<2>(t, s, state);
      }
      run_decode_task<3>(t, s, state);
    } else if (group.count > 1) {
      run_prefill_group(group, s);
    } else if (!run_prefill_task<true>(t, s, state)) {
      run_prefill_task<false>(t, s, state);
    }
  }

  template <bool kBase2>
  OnlineSoftmax<Tag, kBase2> softmax_over(TaskState& state) const noexcept {
    return OnlineSoftmax<Tag, kBase2>(state.row_max.data(), state.row_sum.data(), state.row_nan.data(),
                                      state.acc_o.data(), shape_.Dv);
  }

  /// The start of a task: the head masks of its query heads (G per kv head), its Q block (query_block.hpp), its
  /// softmax state cleared, its key range (the mask's key range of its rows ∩ its split-K chunk) set and returned.
  template <bool kBase2>
  KeyRange begin_task(const FusedTask& t, TaskState& state, OnlineSoftmax<Tag, kBase2>& softmax) const {
    constexpr float kLog2e = simd::exp_constants::kLog2e;
    const std::size_t seq = static_cast<std::size_t>(t.sequence);
    const Index vb = shape_.view_batch(t.sequence), rows = t.i_end - t.i_begin, heads = G_ * t.n_kv;
    const Index sq = shape_.q_rows[seq].length, skv = shape_.key_counts[seq];
    for (Index g = 0; g < heads; ++g) {
      state.masks[static_cast<std::size_t>(g)] = params_.head_mask(vb, t.h_kv * G_ + g, sq, skv);
    }
    const bool with_log2e = kBase2 && !state.masks[0].modifies_scores();
    const float scale = params_.rules.scale;
    state.scaled = load_query_block(q_, vb, t.h_kv * G_, heads, shape_.q_rows[seq].begin + t.i_begin, rows, shape_.D,
                                    with_log2e ? params_.scale_log2e : scale, scale, with_log2e ? kLog2e : 1.0f,
                                    state.q_block.data());
    softmax.reset(heads * rows);
    KeyRange range = state.masks[0].geometry.key_range(t.i_begin, t.i_end);
    range.begin = std::max(range.begin, t.key_begin);
    range.end = std::min(range.end, t.key_end);
    state.range = range;
    return range;
  }

  /// The prefill task (K and V packed) alone: begin_prefill, its key tiles (prefill_tiles), its rows finished. With
  /// kBase2, returns false, having written nothing, when a score could overflow base 2.
  template <bool kBase2>
  bool run_prefill_task(const FusedTask& t, FusedScratch& s, TaskState& state) const {
    if (!begin_prefill<kBase2>(t, state) || !prefill_tiles<kBase2>(t, s, state, 0, state.range.end)) return false;
    OnlineSoftmax<Tag, kBase2> softmax = softmax_over<kBase2>(state);
    finish_rows(t, softmax);
    return true;
  }

  /// A group of prefill tasks: consecutive query tiles of one (sequence, kv head) whose packed K and V exceed
  /// kPrefillGroupBytes (plans()). Its key chunks (group.chunk_keys keys, kPrefillChunkBytes; not split-K's chunks)
  /// outermost: each task of the group takes the key tiles that start in a chunk in turn, so that the chunk's packed K
  /// and V, read from memory by the first, serve the others from L3, where a task alone would stream the whole of K
  /// and V once per query tile. Each task keeps its state (FusedScratch::states) between chunks and meets its key
  /// tiles in the order it would alone: the same bits. A task whose scores could overflow base 2 runs alone in base e,
  /// from its start, as run_group's does (at the start, or at the chunk where a finished score overflowed).
  void run_prefill_group(const TaskGroup& group, FusedScratch& s) const {
    const FusedTask* tasks = tasks_.tasks().data() + group.first;
    Index key_end = 0;
    for (Index member = 0; member < group.count; ++member) {
      TaskState& state = s.states[static_cast<std::size_t>(member)];
      state.live = begin_prefill<true>(tasks[member], state);
      if (state.live) {
        key_end = std::max(key_end, state.range.end);
      } else {
        run_prefill_task<false>(tasks[member], s, state);
      }
    }
    for (Index from = 0; from < key_end; from += group.chunk_keys) {
      for (Index member = 0; member < group.count; ++member) {
        TaskState& state = s.states[static_cast<std::size_t>(member)];
        if (state.live && !prefill_tiles<true>(tasks[member], s, state, from, from + group.chunk_keys)) {
          state.live = false;
          run_prefill_task<false>(tasks[member], s, state);
        }
      }
    }
    for (Index member = 0; member < group.count; ++member) {
      TaskState& state = s.states[static_cast<std::size_t>(member)];
      if (!state.live) continue;
      OnlineSoftmax<Tag, true> softmax = softmax_over<true>(state);
      finish_rows(tasks[member], softmax);
    }
  }

  /// A prefill task's start (begin_task); with kBase2, false where its scores could overflow base 2.
  template <bool kBase2>
  bool begin_prefill(const FusedTask& t, TaskState& state) const {
    OnlineSoftmax<Tag, kBase2> softmax = softmax_over<kBase2>(state);
    begin_task(t, state, softmax);
    return !kBase2 || state.masks[0].modifies_scores() ||
           base2_fits<Tag>(state.q_block.data(), G_ * (t.i_end - t.i_begin), shape_.D,
                           packed_.key_abs_max(t.sequence, t.h_kv), state.scaled);
  }

  /// The key tiles of a begun prefill task (K and V packed) that start in keys [from, to): key tiles outermost, so
  /// that a K and V tile stay in L2 across the block, then strips of kStrip block rows, each taken through Q·Kᵀ, the
  /// scores, the softmax step and P·V while its acc_s rows and acc_o rows stay in L1. Per strip, tiles it cannot see
  /// are skipped and its keys are cut to its own visible range (the diagonal strip stops at its last visible key, a
  /// window's strip starts at its first). The tiles start at the task's first key rounded down to a panel, kBlockN
  /// apart, whatever [from, to) is. With kBase2, returns false when a score finished in base e overflowed base 2.
  template <bool kBase2>
  bool prefill_tiles(const FusedTask& t, FusedScratch& s, TaskState& state, Index from, Index to) const {
    const std::size_t seq = static_cast<std::size_t>(t.sequence);
    const Index vb = shape_.view_batch(t.sequence);
    const Index kv_row0 = shape_.kv_rows[seq].begin, skv = shape_.key_counts[seq];
    const Index D = shape_.D, Dv = shape_.Dv, rows = t.i_end - t.i_begin, M = G_ * rows;
    const Index ldS = Tiles::kBlockN, ldv = v_.stride(2);
    const float* q_block = state.q_block.data();
    float* s_strip = s.acc_s.data();  // a strip's scores: R rows, ldS apart; columns [first, n) are keys j0 + first …
    float* acc_o = state.acc_o.data();
    OnlineSoftmax<Tag, kBase2> softmax = softmax_over<kBase2>(state);
    const KeyRange range = state.range;
    const MaskGeometry& geometry = state.masks[0].geometry;
    const bool data_mask = state.masks[0].has_data_mask();
    const bool dropout = params_.dropout.active();
    const BlockRows block{state.masks.data(), rows, t.i_begin};
    const float* packed_k = packed_.keys(t.sequence, t.h_kv);
    const float* packed_v = packed_.values(t.sequence, t.h_kv);
    Index first_tile = range.begin / kPanel * kPanel;
    if (from > first_tile) first_tile += (from - first_tile + Tiles::kBlockN - 1) / Tiles::kBlockN * Tiles::kBlockN;
    bool fits = true;  // false once a score finished in base e overflowed base 2

    for (Index j0 = first_tile; j0 < std::min(to, range.end) && fits; j0 += Tiles::kBlockN) {
      const Index j1 = std::min(j0 + Tiles::kBlockN, range.end);
      if (geometry.classify(t.i_begin, t.i_end, j0, j1) == TileVisibility::hidden) continue;
      const S* v_tile = Dv > 0 ? &v_(vb, t.h_kv, kv_row0 + j0, 0) : nullptr;
      int v_finite = -1;  // whether the tile's values are all finite: decided once, when a strip first needs it

      for (Index r0 = 0; r0 < M && fits; r0 += kStrip) {
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

        dispatch_rows(R, [&](auto rows_constant) {
          constexpr int kR = decltype(rows_constant)::value;
          for (Index p = first / kPanel; p * kPanel < n; ++p) {
            qk_panel<Tag, kR>(q_block + r0 * D, D, packed_k + (j0 / kPanel + p) * D * kPanel, D, s_strip + p * kPanel,
                              ldS, n - p * kPanel);
          }
          if (!finish_score_tile<kBase2>(s_strip, ldS, r0, kR, first, n, j0, block, index_mask, state.scaled)) {
            fits = false;  // the task runs again in base e
            return;
          }
          softmax.template update_rows<kR>(r0, s_strip, ldS, first, n);
          if (Dv == 0) return;
          if (dropout) {
            for (Index rr = 0; rr < kR; ++rr) drop_row(t, r0 + rr, j0 + first, n - first, s_strip + rr * ldS + first);
          }
          // Where some key may be hidden or dropped, zero weights meet V: safe only if the tile's values are finite.
          const bool may_hide = index_mask || data_mask || dropout;
          if (may_hide && v_finite < 0) v_finite = packed_.values_finite(t.sequence, t.h_kv, j0, j1) ? 1 : 0;
          if (!may_hide || v_finite == 1) {
            pv_strip<Tag, kR>(s_strip + first, ldS, packed_v, skv, j0 + first, n - first, acc_o + r0 * Dv, Dv, Dv);
          } else {
            pv_skip_zero_weights(s_strip + first, ldS, v_tile + first * ldv, ldv, n - first, acc_o + r0 * Dv, Dv, Dv,
                                 kR);
          }
        });
      }
    }
    return fits;
  }

  /// The decoding task (Sq·G ≤ kDecodeRows; K and V read in place), in base e. Blocks of kDecodeKeys keys: one
  /// pass over the block's K, its scores and softmax step, then one pass over its V, so that each pass streams a
  /// single array (alternating short K and V blocks stalls the hardware prefetchers). A task of one kv head with more
  /// than 4 rows takes them in calls of 8 on AVX-512 while 8 are left (decode_kernels.hpp, kQkDecodeRows and
  /// kPvDecodeRows), then of at most 4, each call over the whole block, the later ones reading it from L2 (Zen 4,
  /// Hq = 64, Hkv = 8, from DRAM: groups of 4 over whole blocks took 0.85–0.91 of the time of sub-blocks of 64 keys,
  /// calls of 8 then 0.83–0.90 of that; bench/README.md, "2026-12-05, twenty-eighth session"). A task of several kv
  /// heads (token-major K and V, plans()) takes its heads in turn over sub-blocks of kDecodeGroupKeys whole key rows,
  /// so that K and V stream as contiguous memory, and prefetches the whole rows of the next sub-block in the order it
  /// reads them (a block's K, that block's V, the next block's K) from inside the micro-kernels, a few lines per step
  /// (PrefetchCursor), paced over the sub-block's arithmetic; its P·V calls also name the rows their reading goes on
  /// with (NextRows), for the steps that prefetch a few rows ahead in reading order (kSpreadAheadPaced). A head-major
  /// task of one row group (at most 4 rows) is paced the same way over sub-blocks of kDecodePacedBytes where
  /// kHeadMajorPaced holds (float K and V, 16 lanes, the L1 copy: from DRAM 0.78–0.79 of the time on Zen 5), its P·V
  /// with kPvKeysPerStep. Every software prefetch of the task goes to the levels kLocality names (3: every level, 2: L2
  /// and beyond; simd::prefetch), chosen per CPU at run time (decode_prefetch_level, isa.hpp; the scalar kernel: L1
  /// only, FusedTiles::kDecodePrefetchL2), but for those rows ahead, which go into L1 (kSpreadLocality); prefetches
  /// change no result. kLocality also sets a grouped task's P·V step for float V on 16-lane tags
  /// (kPvGroupedKeysPerStep: four keys in the L2 copy, two in the L1 copy), which changes no result either.
  template <int kLocality>
  void run_decode_task(const FusedTask& t, FusedScratch& s, TaskState& state) const {
    const std::size_t seq = static_cast<std::size_t>(t.sequence);
    const Index vb = shape_.view_batch(t.sequence), kv_row0 = shape_.kv_rows[seq].begin;
    const Index D = shape_.D, Dv = shape_.Dv, rows = t.i_end - t.i_begin, GR = G_ * rows, M = GR * t.n_kv;
    const bool grouped = t.n_kv > 1;
    // A task paced by a PrefetchCursor over sub-blocks: a grouped one, or a head-major one of one row group where
    // kHeadMajorPaced holds. Either takes its rows in groups of 4 (no cursor for 8-row calls).
    const bool paced = grouped || (kHeadMajorPaced<Tag, S, kLocality> && GR <= 4);
    // A grouped task's block holds the same bytes of K as one head's block (kDecodeKeys / n_kv whole rows), so that
    // its scores (M × block) stay as small as one head's (kDecodeRows × kDecodeKeys at most).
    const Index block =
        grouped ? std::max<Index>(kPanel, Tiles::kDecodeKeys / t.n_kv / kPanel * kPanel) : Tiles::kDecodeKeys;
    const Index ldS = block, ldv = v_.stride(2), ldk = k_.stride(2);
    const Index paced_keys =
        std::max<Index>(4, Tiles::kDecodePacedBytes / static_cast<Index>(sizeof(S)) / std::max<Index>(D, 1) / 4 * 4);
    const Index sub_keys = grouped ? Tiles::kDecodeGroupKeys : paced ? paced_keys : block;
    float* q_block = state.q_block.data();
    float* acc_s = s.acc_s.data();
    float* acc_o = state.acc_o.data();
    OnlineSoftmax<Tag, false> softmax = softmax_over<false>(state);
    const KeyRange range = begin_task(t, state, softmax);
    const MaskGeometry& geometry = state.masks[0].geometry;
    const bool data_mask = state.masks[0].has_data_mask();
    const bool dropout = params_.dropout.active();
    const BlockRows block_rows{state.masks.data(), rows, t.i_begin};
    // The kv heads of a grouped task lie side by side in each key row: its rows span this many floats.
    const Index k_span = (t.n_kv - 1) * k_.stride(1) + D, v_span = (t.n_kv - 1) * v_.stride(1) + Dv;
    constexpr Index kQkStep = kQkKeysPerStep<Tag>;
    constexpr int kPvGroupedStep = static_cast<int>(kPvGroupedKeysPerStep<Tag, S, kLocality>);
    constexpr int kPvHeadStep = static_cast<int>(kPvKeysPerStep<Tag>);
    const Index pv_step = grouped ? kPvGroupedStep : kPvHeadStep;
    const Index row_groups = (GR + 3) / 4;  // a paced task's micro-kernel calls per kv head and sub-block (4 rows)
    // What a paced task prefetches while a sub-block's `steps` micro-kernel steps run: the next sub-block in the
    // order the task reads rows, `end` being where the running sub-block of a pass over the block (n keys from j0)
    // ends. That is the rest of the pass; after a block's K, the first rows of its V; after its V (or its K, where
    // there is no V), the first rows of the next block's K. So each pass's first rows are on their way before it
    // begins, and nothing is fetched a whole pass before it is read. Only rows of the task's key range are named.
    const auto next_sub_block = [&](bool v_pass, Index j0, Index n, Index end, Index steps) {
      if (end < n) {
        const Index count = std::min(sub_keys, n - end);
        return v_pass ? PrefetchCursor<S>(&v_(vb, t.h_kv, kv_row0 + j0 + end, 0), ldv, count, v_span, steps)
                      : PrefetchCursor<S>(&k_(vb, t.h_kv, kv_row0 + j0 + end, 0), ldk, count, k_span, steps);
      }
      if (!v_pass && Dv > 0) {
        return PrefetchCursor<S>(&v_(vb, t.h_kv, kv_row0 + j0, 0), ldv, std::min(sub_keys, n), v_span, steps);
      }
      const Index next = j0 + block, count = std::min(sub_keys, std::min(block, range.end - next));
      if (count <= 0) return PrefetchCursor<S>();
      return PrefetchCursor<S>(&k_(vb, t.h_kv, kv_row0 + next, 0), ldk, count, k_span, steps);
    };

    for (Index j0 = range.begin / kPanel * kPanel; j0 < range.end; j0 += block) {
      const Index j1 = std::min(j0 + block, range.end);
      const TileVisibility visibility = geometry.classify(t.i_begin, t.i_end, j0, j1);
      if (visibility == TileVisibility::hidden) continue;
      const Index n = j1 - j0;

      const S* k_tile = &k_(vb, t.h_kv, kv_row0 + j0, 0);
      for (Index jb = 0; jb < n; jb += sub_keys) {
        const Index keys = std::min(sub_keys, n - jb);
        // A paced task's prefetches of the next sub-block, paced over this sub-block's micro-kernel steps.
        PrefetchCursor<S> k_ahead;
        if (paced) {
          k_ahead = next_sub_block(false, j0, n, jb + keys, t.n_kv * row_groups * ((keys + kQkStep - 1) / kQkStep));
        }
        for (Index hk = 0; hk < t.n_kv; ++hk) {
          const S* k_head = k_tile + hk * k_.stride(1) + jb * ldk;
          const auto qk_rows = [&](auto rows_constant, Index r0) {
            constexpr int R = decltype(rows_constant)::value;
            if constexpr (R > 4) {  // one kv head, not paced, only
              qk_in_place<Tag, R, kLocality>(q_block + r0 * D, D, k_head, ldk, keys, D, acc_s + r0 * ldS + jb, ldS);
            } else {
              qk_in_place<Tag, R, kLocality>(q_block + r0 * D, D, k_head, ldk, keys, D, acc_s + r0 * ldS + jb, ldS,
                                             paced ? &k_ahead : nullptr);
            }
          };
          if (paced) {
            for_each_row_group<4>(hk * GR, (hk + 1) * GR, qk_rows);
          } else {
            for_each_row_group<kQkDecodeRows<Tag, S>>(hk * GR, (hk + 1) * GR, qk_rows);
          }
        }
        k_ahead.template flush<kLocality>();  // keys left over after the last whole step issue nothing
      }
      const bool index_mask = visibility == TileVisibility::partial;
      finish_score_tile<false>(acc_s, ldS, 0, M, 0, n, j0, block_rows, index_mask, state.scaled);
      for (Index r = 0; r < M; ++r) softmax.update(r, acc_s + r * ldS, 0, n);

      if (Dv == 0) continue;
      if (dropout) {
        for (Index r = 0; r < M; ++r) drop_row(t, r, j0, n, acc_s + r * ldS);
      }
      const S* v_tile = &v_(vb, t.h_kv, kv_row0 + j0, 0);
      bool finite = true;  // whether zero weights may meet V: only where no key is hidden or dropped, or V is finite
      if (index_mask || data_mask || dropout) {
        for (Index hk = 0; hk < t.n_kv && finite; ++hk)
          finite = all_finite<Tag>(v_tile + hk * v_.stride(1), n, Dv, ldv);
      }
      if (finite) {
        for (Index jb = 0; jb < n; jb += sub_keys) {
          const Index keys = std::min(sub_keys, n - jb);
          PrefetchCursor<S> v_ahead;
          if (paced) {
            v_ahead = next_sub_block(true, j0, n, jb + keys, t.n_kv * row_groups * ((keys + pv_step - 1) / pv_step));
          }
          for (Index hk = 0; hk < t.n_kv; ++hk) {
            const S* v_head = v_tile + hk * v_.stride(1) + jb * ldv;
            // Where a paced task's reading goes on after this head's rows (the next head's, the next sub-block's or
            // the next block's first K rows): its P·V steps prefetch those rows as they near the call's end.
            NextRows<S> after_head;
            if (paced && kSpreadAheadPaced<Tag, S, 128>) {  // the steps read it only then (any compiled-in Dv alike)
              const Index next_block = j0 + block,
                          next_keys = std::min(sub_keys, std::min(block, range.end - next_block));
              if (hk + 1 < t.n_kv) {
                after_head = {v_head + v_.stride(1), keys};
              } else if (jb + keys < n) {
                after_head = {v_tile + (jb + keys) * ldv, std::min(sub_keys, n - jb - keys)};
              } else if (next_keys > 0 && ldk == ldv && D >= Dv) {  // K rows as far apart as V's and as wide
                after_head = {&k_(vb, t.h_kv, kv_row0 + next_block, 0), next_keys};
              }
            }
            const auto pv_rows = [&](auto rows_constant, Index r0) {
              constexpr int R = decltype(rows_constant)::value;
              if constexpr (R > 4) {  // one kv head, not paced, only
                pv_in_place<Tag, R, S, kPvKeysPerStep8, kLocality>(acc_s + r0 * ldS + jb, ldS, v_head, ldv, keys,
                                                                   acc_o + r0 * Dv, Dv, Dv);
              } else if (paced) {
                // A row group before the head's last reads the same rows next.
                const NextRows<S> next = r0 + 4 < (hk + 1) * GR ? NextRows<S>{v_head, keys} : after_head;
                if (grouped) {
                  pv_in_place<Tag, R, S, kPvGroupedStep, kLocality>(acc_s + r0 * ldS + jb, ldS, v_head, ldv, keys,
                                                                    acc_o + r0 * Dv, Dv, Dv, &v_ahead, next);
                } else {
                  pv_in_place<Tag, R, S, kPvHeadStep, kLocality>(acc_s + r0 * ldS + jb, ldS, v_head, ldv, keys,
                                                                 acc_o + r0 * Dv, Dv, Dv, &v_ahead, next);
                }
              } else {
                pv_in_place<Tag, R, S, static_cast<int>(kPvKeysPerStep<Tag>), kLocality>(
                    acc_s + r0 * ldS + jb, ldS, v_head, ldv, keys, acc_o + r0 * Dv, Dv, Dv, nullptr);
              }
            };
            if (paced) {
              for_each_row_group<4>(hk * GR, (hk + 1) * GR, pv_rows);
            } else {
              for_each_row_group<kPvDecodeRows<Tag>>(hk * GR, (hk + 1) * GR, pv_rows);
            }
          }
          v_ahead.template flush<kLocality>();
        }
      } else {
        for (Index hk = 0; hk < t.n_kv; ++hk) {
          pv_skip_zero_weights(acc_s + hk * GR * ldS, ldS, v_tile + hk * v_.stride(1), ldv, n, acc_o + hk * GR * Dv, Dv,
                               Dv, GR);
        }
        if (paced) next_sub_block(true, j0, n, n, 1).template flush<kLocality>();  // the next block's first K rows
      }
    }
    finish_rows(t, softmax);
  }

  /// Dropout on block row r of task t (query head h_kv·G + r / rows, query i_begin + r % rows of its sequence): the
  /// weights of keys j0 … j0 + n − 1 of the sequence, in place (dropout.hpp, DropoutRule::apply_row), keyed on the
  /// positions in the sequence (global ones with global positions), never on the tile, task or thread.
  void drop_row(const FusedTask& t, Index r, Index j0, Index n, float* weights) const noexcept {
    const Index rows = t.i_end - t.i_begin;
    params_.dropout.apply_row<DropoutLanes>(t.sequence, t.h_kv * G_ + r / rows,
                                            params_.dropout_q_begin + t.i_begin + r % rows,
                                            params_.dropout_k_begin + j0, n, weights);
  }

  /// The end of a task: every row's (out, lse), to the output or to the task's split-K slot.
  template <bool kBase2>
  void finish_rows(const FusedTask& t, OnlineSoftmax<Tag, kBase2>& softmax) const {
    const Index M = tasks_.rows(t);
    for (Index r = 0; r < M; ++r) {
      const float lse = softmax.finalize(r);
      if (t.partial >= 0) {
        tasks_.store_partial(t, r, softmax.acc_o(r), lse);
      } else {
        write_row(t, r, softmax.acc_o(r), lse);
      }
    }
  }

  /// Writes block row r of task t (query head h_kv·G + r / rows, query i_begin + r % rows), merging in the head's
  /// sink (a state with output 0 and lse = the sink logit).
  void write_row(const FusedTask& t, Index r, float* o, float lse) const {
    const Index rows = t.i_end - t.i_begin, Dv = shape_.Dv;
    const Index h = t.h_kv * G_ + r / rows, vb = shape_.view_batch(t.sequence);
    const Index row = shape_.q_rows[static_cast<std::size_t>(t.sequence)].begin + t.i_begin + r % rows;
    if (params_.sinks != nullptr) merge_state(o, lse, zeros_.data(), params_.sinks[h], o, lse, Dv);
    if (Dv > 0) std::copy(o, o + Dv, &out_(vb, h, row, 0));
    if (lse_ != nullptr) (*lse_)(vb, h, row) = lse;
  }

  const AttentionShape& shape_;
  TensorView4<const float> q_;
  TensorView4<const S> k_, v_;
  TensorView4<float> out_;
  const TensorView3<float>* lse_;
  const AttentionParams<float>& params_;
  Index G_ = 1, rows_per_tile_ = 1;
  Index decode_rows_ = 0;     ///< the most block rows of a decoding task
  std::vector<char> decode_;  ///< per sequence: K and V read in place (decoding) rather than packed
  PackedKV<Tag> packed_;
  FusedTasks tasks_;
  std::vector<float> zeros_;  ///< the output of a sink state
};

/// This pass's kernel: FusedAttention for the pass's tag, chosen by overload on the tag (dispatch.hpp brings the
/// passes' overloads together and calls the one isa.hpp chose); K and V stored as S (float, Eigen::half,
/// Eigen::bfloat16).
template <class S>
void run_fused_as(QKV_PASS_TAG, const AttentionShape& shape, const TensorView4<const float>& q,
                  const TensorView4<const S>& k, const TensorView4<const S>& v, const TensorView4<float>& out,
                  const TensorView3<float>* lse, const AttentionParams<float>& params) {
  FusedAttention<QKV_PASS_TAG, S>(shape, q, k, v, out, lse, params).run();
}

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_FUSED_ATTENTION_HPP, per pass
