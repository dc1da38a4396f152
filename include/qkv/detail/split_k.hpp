// qkv/detail/split_k.hpp — the fused kernel's tasks, and the split-K merge of their partial results.
//
// A task is one (sequence, kv head, query tile): the tile's rows of every query head of the group. Threads take groups
// of tasks: a prefill sequence planned in groups (fused_attention.hpp, plans()) has its consecutive query tiles of each
// kv head taken group_tiles at a time, by one thread, key chunk by key chunk; any other task is a group of its own. A
// sequence with a single query tile and more than kSplitKeys keys (decoding, or a short prefill against many keys) is
// split into chunks of kSplitKeys keys, a number fixed by the shape and never by the thread count; each chunk is a task
// that writes a partial (out, lse) state, lse in base e, to a slot of its own, and `merge` combines the chunks of each
// (sequence, kv head, query tile) in chunk order (softmax.hpp, merge_state). So results are bit-identical for any
// number of threads.
//
// Compiled once per kernel ISA, inside that ISA's target region: detail/dispatch.hpp includes it in each pass (the
// guard below, Highway's toggle, lets each pass in once).
#ifndef QKV_PASS_NAME
#error "qkv/detail/split_k.hpp is part of the fused kernel: include qkv/detail/dispatch.hpp"
#endif
#if defined(QKV_DETAIL_SPLIT_K_HPP) == defined(QKV_PASS_TOGGLE)
#ifdef QKV_DETAIL_SPLIT_K_HPP
#undef QKV_DETAIL_SPLIT_K_HPP
#else
#define QKV_DETAIL_SPLIT_K_HPP
#endif

#include <algorithm>
#include <vector>

#include "qkv/config.hpp"
#include "qkv/detail/aligned_buffer.hpp"
#include "qkv/detail/attention_shape.hpp"
#include "qkv/softmax.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {
namespace QKV_PASS_NAME {  // this pass's ISA: kernel_scalar, kernel_avx2 or kernel_avx512

/// One task of the fused kernel: the query rows of one (sequence, kv head, query tile) and the keys it covers. A
/// decoding task over token-major K and V covers several kv heads (h_kv … h_kv + n_kv − 1), so that it reads whole
/// key rows; its block rows are those of each head's group in turn.
struct FusedTask {
  Index sequence = 0;
  Index h_kv = 0;
  Index n_kv = 1;                    ///< kv heads of the task
  Index i_begin = 0, i_end = 0;      ///< query rows of the sequence (every head of the group)
  Index key_begin = 0, key_end = 0;  ///< keys of this task: all of them, or one split-K chunk
  Index partial = -1;                ///< split tasks: index of their (out, lse) slot; −1 = write the output
};

/// How one sequence is cut into tasks: kv heads per task and keys per split-K chunk; and for an unsplit prefill
/// sequence, query tiles per group and keys per group chunk (group_tiles 1: every task on its own).
struct SequencePlan {
  Index kv_heads = 1;
  Index split_keys = 0;
  Index group_tiles = 1;
  Index chunk_keys = 0;
};

/// Consecutive tasks (query tiles of one (sequence, kv head)) that one thread runs together, key chunk by key chunk
/// (fused_attention.hpp, run_prefill_group); a group of one task runs it alone.
struct TaskGroup {
  Index first = 0, count = 1;  ///< tasks [first, first + count) of FusedTasks::tasks()
  Index chunk_keys = 0;        ///< keys per chunk where count > 1
};

/// Every task of a call, in (sequence, kv head, query tile, key chunk) order, their groups, and the partial slots of
/// the split ones: max_rows() = the most block rows of a task (G · rows_per_tile, or G · Sq · n_kv for a multi-head
/// decoding task) rows of Dv floats and one lse each.
class FusedTasks {
 public:
  /// Builds the tasks of `shape` for query tiles of `rows_per_tile` rows, each sequence cut as plans[b] says.
  void build(const AttentionShape& shape, Index rows_per_tile, const std::vector<SequencePlan>& plans) {
    G_ = shape.group;
    Dv_ = shape.Dv;
    max_rows_ = 0;
    max_group_ = 1;
    tasks_.clear();
    groups_.clear();
    Index partials = 0;
    work_ = 0;
    for (Index b = 0; b < shape.n_sequences; ++b) {
      const std::size_t s = static_cast<std::size_t>(b);
      const Index sq = shape.q_rows[s].length, skv = shape.key_counts[s];
      if (sq == 0 || G_ == 0) continue;  // no query rows, or no query heads (Hq = 0): nothing to write
      const Index tiles = (sq + rows_per_tile - 1) / rows_per_tile;
      const Index split_keys = plans[s].split_keys, kv_heads = std::max<Index>(1, plans[s].kv_heads);
      const Index chunks = tiles == 1 && skv > split_keys ? (skv + split_keys - 1) / split_keys : 1;
      // Unsplit tiles of a sequence planned in groups go group_tiles at a time; every other task alone.
      const Index group_tiles = chunks == 1 ? std::max<Index>(1, plans[s].group_tiles) : 1;
      for (Index h_kv = 0; h_kv < shape.Hkv; h_kv += kv_heads) {
        for (Index tile = 0; tile < tiles; ++tile) {
          for (Index c = 0; c < chunks; ++c) {
            if (tile % group_tiles == 0) {  // a group's first task (every task where group_tiles is 1)
              const Index count = std::min(group_tiles, tiles - tile);
              groups_.push_back({static_cast<Index>(tasks_.size()), count, plans[s].chunk_keys});
              max_group_ = std::max(max_group_, count);
            }
            FusedTask t;
            t.sequence = b;
            t.h_kv = h_kv;
            t.n_kv = std::min(kv_heads, shape.Hkv - h_kv);
            t.i_begin = tile * rows_per_tile;
            t.i_end = std::min(sq, t.i_begin + rows_per_tile);
            t.key_begin = chunks == 1 ? 0 : c * split_keys;
            t.key_end = chunks == 1 ? skv : std::min(skv, (c + 1) * split_keys);
            t.partial = chunks == 1 ? -1 : partials++;
            tasks_.push_back(t);
            max_rows_ = std::max(max_rows_, rows(t));
            work_ += rows(t) * (t.key_end - t.key_begin) * (shape.D + shape.Dv);
          }
        }
      }
    }
    partial_count_ = partials;
    partial_out_.resize(static_cast<std::size_t>(std::max<Index>(1, partials * max_rows_ * Dv_)));
    partial_lse_.resize(static_cast<std::size_t>(std::max<Index>(1, partials * max_rows_)));
  }

  /// Block rows of task t: G per query row and kv head.
  Index rows(const FusedTask& t) const noexcept { return G_ * t.n_kv * (t.i_end - t.i_begin); }
  /// The most block rows of any task (0 without tasks).
  Index max_rows() const noexcept { return max_rows_; }
  const std::vector<FusedTask>& tasks() const noexcept { return tasks_; }
  /// The groups, in task order, covering every task once.
  const std::vector<TaskGroup>& groups() const noexcept { return groups_; }
  /// The most tasks of a group (1 without groups).
  Index max_group() const noexcept { return max_group_; }
  /// Multiply-adds of every task, an upper bound (for the threading decision).
  Index work() const noexcept { return work_; }

  /// Stores row r of split task t (const: every task owns its slots, so threads may store at once): its partial (out,
  /// lse) state (out already divided by its own sum, lse in base e).
  void store_partial(const FusedTask& t, Index r, const float* o, float lse) const noexcept {
    const Index slot = t.partial * max_rows_ + r;
    std::copy(o, o + Dv_, partial_out_.data() + slot * Dv_);
    partial_lse_.data()[slot] = lse;
  }

  /// Merges the chunks of each split (sequence, kv head, query tile) in chunk order and hands every merged row to
  /// write_row(first task of the tile, block row r, out row of Dv floats, lse).
  template <class WriteRow>
  void merge(WriteRow&& write_row) const {
    if (partial_count_ == 0) return;
    std::vector<float> o(static_cast<std::size_t>(Dv_));
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
      const Index M = rows(t);
      for (Index r = 0; r < M; ++r) {
        const Index slot0 = t.partial * max_rows_ + r;
        std::copy(partial_out_.data() + slot0 * Dv_, partial_out_.data() + (slot0 + 1) * Dv_, o.begin());
        float lse = partial_lse_.data()[slot0];
        for (std::size_t c = first + 1; c <= last; ++c) {
          const Index slot = tasks_[c].partial * max_rows_ + r;
          merge_state(o.data(), lse, partial_out_.data() + slot * Dv_, partial_lse_.data()[slot], o.data(), lse, Dv_);
        }
        write_row(t, r, o.data(), lse);
      }
      first = last + 1;
    }
  }

 private:
  Index G_ = 1, Dv_ = 0, max_rows_ = 0, max_group_ = 1;
  std::vector<FusedTask> tasks_;
  std::vector<TaskGroup> groups_;
  Index partial_count_ = 0;
  Index work_ = 0;
  AlignedBuffer partial_out_, partial_lse_;
};

}  // namespace QKV_PASS_NAME
}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv

#endif  // QKV_DETAIL_SPLIT_K_HPP, per pass
