// qkv/mpi.hpp — context parallelism over MPI: ring attention and DeepSpeed-Ulysses, exact (not in the umbrella
// qkv.hpp: it needs <mpi.h> and an MPI library; CMake target qkv::mpi, option QKV_MPI).
//
// A sequence too long for one machine is split by rows over the ranks of a communicator. Each rank passes its own
// rows of q, k and v (and of out and lse) as [B, H, rows, D] views, exactly like qkv::attention, and gets its own
// rows of the exact attention of the whole sequence:
//
//   ring_attention     each rank keeps its query shard; the K/V shards travel round the ring (rank r sends to r + 1
//                      and receives from r − 1, non-blocking, the next block in flight while the current one is
//                      computed), and the partial states are merged by their log-sum-exp in a fixed order. With
//                      ShardLayout::zigzag a causal sequence gives every rank the same work. (Liu et al. 2023, "Ring
//                      Attention with Blockwise Transformers"; zigzag as ring-flash-attn and Megatron-LM's context
//                      parallelism.)
//   ulysses_attention  an all-to-all turns each rank's sequence shard of all heads into the whole sequence of a
//                      shard of heads; attention runs locally; a second all-to-all turns the result back. (Jacobs et
//                      al. 2023, "DeepSpeed Ulysses".)
//
// Each block of work is one call of qkv::attention with `options.global_positions` (options.hpp): causal masks of
// both alignments, windows, global tokens, ALiBi and key padding are decided on global positions. docs/distributed.md
// gives the cost model and measured numbers; docs/design.md ("The MPI layer") the architecture.
//
// Threads: MPI is called from the thread that calls these functions, which must be the thread that initialized MPI
// (MPI_THREAD_FUNNELED: OpenMP inside a rank, MPI from its main thread). `Environment` asks for that level. Where the
// MPI library provides less (MPI_THREAD_SINGLE), the rank's computation runs on one thread: the calling thread's
// OpenMP thread count is set to 1 for the call and restored after.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/config.hpp"
#include "qkv/errors.hpp"
#include "qkv/mask.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor_view.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace qkv {
namespace mpi {

/// How a sequence's rows are dealt to the ranks (`shard_rows`).
///
/// `contiguous`: rank r holds [L·r/P, L·(r+1)/P). Under a causal mask rank P − 1 then has 2P − 1 times the work of
/// rank 0.
/// `zigzag`: the sequence is cut the same way into 2P chunks and rank r holds chunks r and 2P − 1 − r, one from each
/// end, so that under a causal mask every rank has the same work (ring-flash-attn's zigzag, Megatron-LM's context
/// parallelism).
/// Example, L = 8, P = 2: contiguous gives rank 0 rows 0..3 and rank 1 rows 4..7; zigzag gives rank 0 rows
/// {0, 1, 6, 7} and rank 1 rows {2, 3, 4, 5}.
enum class ShardLayout { contiguous, zigzag };

/// The global rows [begin, end) that `rank` of `size` holds of a sequence of `length` rows, in the order the rank
/// stores them: one range (contiguous: [length·r/size, length·(r+1)/size)) or two (zigzag: the sequence cut the same
/// way into 2·size chunks, rank r holding chunks r and 2·size−1−r). Ranges may be empty (length < size).
/// Example: shard_rows(10, 1, 2, ShardLayout::zigzag) = {[2, 5), [5, 7)}, the chunks of 10 rows into 4 being
/// [0, 2), [2, 5), [5, 7), [7, 10).
/// Throws: shape_error when length < 0, size < 1, rank outside [0, size) or the layout is not one of the two.
/// Complexity: O(1), one small allocation. Thread safety: pure. Source: ring-flash-attn's zigzag layout (Megatron-LM's
/// context parallelism load balancing).
inline std::vector<std::pair<Index, Index>> shard_rows(Index length, int rank, int size, ShardLayout layout) {
  const char* function = "qkv::mpi::shard_rows";
  detail::check_shape(length >= 0, function, ": length is ", length, ", expected at least 0");
  detail::check_shape(size >= 1, function, ": size is ", size, ", expected at least 1 rank");
  detail::check_shape(rank >= 0 && rank < size, function, ": rank is ", rank, ", expected a rank in [0, ", size, ")");
  detail::check_shape(layout == ShardLayout::contiguous || layout == ShardLayout::zigzag, function, ": layout is ",
                      static_cast<int>(layout), ", expected ShardLayout::contiguous or ShardLayout::zigzag");
  // Cut points of `parts` parts, computed without overflow for any length (length·part can exceed Index).
  const auto cut = [length](Index part, Index parts) { return length / parts * part + length % parts * part / parts; };
  const Index r = rank, p = size;
  if (layout == ShardLayout::contiguous) return {{cut(r, p), cut(r + 1, p)}};
  return {{cut(r, 2 * p), cut(r + 1, 2 * p)}, {cut(2 * p - 1 - r, 2 * p), cut(2 * p - r, 2 * p)}};
}

/// MPI for a program that calls ring_attention or ulysses_attention: the constructor initializes MPI with
/// MPI_Init_thread asking for MPI_THREAD_FUNNELED (OpenMP threads inside a rank, MPI from the main thread), unless MPI
/// is already initialized; the destructor finalizes it if the constructor initialized it. `thread_level()` is what the
/// library provides; below MPI_THREAD_FUNNELED, qkv runs each rank's computation on one thread.
///
///     int main(int argc, char** argv) {
///       qkv::mpi::Environment mpi(&argc, &argv);
///       ... qkv::mpi::ring_attention<float>(MPI_COMM_WORLD, q, k, v, out, lse, options, ShardLayout::zigzag);
///     }
///
/// Throws nothing (MPI's own error handler decides what a failing MPI call does). Not copyable. Create one, on the
/// main thread. Source: boost::mpi::environment.
class Environment {
 public:
  Environment(int* argc, char*** argv) noexcept {
    int initialized = 0;
    MPI_Initialized(&initialized);
    if (initialized) {
      MPI_Query_thread(&provided_);
    } else {
      MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided_);
      owns_ = true;
    }
  }
  ~Environment() {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (owns_ && !finalized) MPI_Finalize();
  }
  Environment(const Environment&) = delete;
  Environment& operator=(const Environment&) = delete;

  /// The thread support MPI provides: MPI_THREAD_SINGLE, _FUNNELED, _SERIALIZED or _MULTIPLE.
  int thread_level() const noexcept { return provided_; }

 private:
  int provided_ = MPI_THREAD_SINGLE;
  bool owns_ = false;
};

namespace detail {

using qkv::detail::check_shape;
using qkv::detail::concat;

template <class T>
MPI_Datatype mpi_type() noexcept {
  static_assert(std::is_same_v<T, float> || std::is_same_v<T, double>,
                "qkv::mpi: the scalar type must be float or double");
  return std::is_same_v<T, float> ? MPI_FLOAT : MPI_DOUBLE;
}

/// Rows [begin, begin + length) of a view's S axis (axis 2 of [B, H, S, D], or of [B, H, S]).
template <class V>
V middle_rows(const V& view, Index begin, Index length) {
  auto extents = view.extents();
  extents[2] = length;
  auto* data = view.data();
  if (data != nullptr && length > 0) data += begin * view.stride(2);
  return V(length > 0 ? data : nullptr, extents, view.strides());
}

/// Heads [begin, begin + count) of a view's H axis (axis 1).
template <class V>
V middle_heads(const V& view, Index begin, Index count) {
  auto extents = view.extents();
  extents[1] = count;
  auto* data = view.data();
  if (data != nullptr && count > 0) data += begin * view.stride(1);
  return V(count > 0 ? data : nullptr, extents, view.strides());
}

/// What went wrong on one rank before any collective call, or nothing.
struct LocalError {
  enum Kind : int { none = 0, shape = 1, unsupported = 2 };
  Kind kind = none;
  std::string message;
};

/// Runs `check`; a shape_error or unsupported_error it throws becomes a LocalError (so that the rank can tell the
/// others before anyone throws). Without exceptions a failing check prints its message and aborts this rank, and the
/// MPI launcher then ends the others.
template <class F>
LocalError local_error_of(F&& check) {
#if QKV_HAS_EXCEPTIONS
  try {
    check();
  } catch (const shape_error& e) {
    return {LocalError::shape, e.what()};
  } catch (const unsupported_error& e) {
    return {LocalError::unsupported, e.what()};
  }
#else
  check();
#endif
  return {};
}

/// Collective: if any rank of `comm` has an error, every rank throws it (the lowest such rank's message, prefixed with
/// that rank), so that no rank is left waiting in a later collective call. O(1) messages; a broadcast of the message.
inline void agree(MPI_Comm comm, const char* function, const LocalError& error) {
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  int failing = error.kind == LocalError::none ? size : rank;
  MPI_Allreduce(MPI_IN_PLACE, &failing, 1, MPI_INT, MPI_MIN, comm);
  if (failing == size) return;
  long long header[2] = {static_cast<long long>(error.kind), static_cast<long long>(error.message.size())};
  MPI_Bcast(header, 2, MPI_LONG_LONG, failing, comm);
  std::string message = rank == failing ? error.message : std::string(static_cast<std::size_t>(header[1]), ' ');
  if (header[1] > 0) MPI_Bcast(&message[0], static_cast<int>(header[1]), MPI_CHAR, failing, comm);
  const std::string prefix = std::string(function) + ": ";
  if (message.compare(0, prefix.size(), prefix) == 0) message.erase(0, prefix.size());
  const std::string text = concat(function, ": rank ", failing, " of ", size, ": ", message);
  if (header[0] == LocalError::unsupported) qkv::detail::raise<unsupported_error>(text);
  qkv::detail::raise<shape_error>(text);
}

/// What every rank must pass alike: extents other than the sequence axis, the layout and every option, as int64
/// values with a name each (floating-point values by their bits).
struct Signature {
  std::vector<std::int64_t> values;
  std::vector<std::string> names;
  std::vector<char> real;  ///< whether the value is the bits of a floating-point number

  void add(const std::string& name, std::int64_t value, bool is_real = false) {
    names.push_back(name);
    values.push_back(value);
    real.push_back(is_real ? 1 : 0);
  }
  template <class T>
  void add_real(const std::string& name, T value) {
    const double wide = static_cast<double>(value);
    std::int64_t bits = 0;
    std::memcpy(&bits, &wide, sizeof bits);
    add(name, bits, true);
  }
};

/// The fixed part (extents, flags, scalars and the lengths of the vector options) and the variable part (the vector
/// options' entries) of a call's signature.
template <class T>
std::pair<Signature, Signature> signature_of(const TensorView4<const T>& q, const TensorView4<const T>& k,
                                             const TensorView4<const T>& v, const AttentionOptions<T>& options,
                                             int layout) {
  Signature fixed, entries;
  fixed.add("q axis 0 (B)", q.extent(0));
  fixed.add("q axis 1 (Hq)", q.extent(1));
  fixed.add("q axis 3 (D)", q.extent(3));
  fixed.add("k axis 1 (Hkv)", k.extent(1));
  fixed.add("v axis 3 (Dv)", v.extent(3));
  fixed.add("the layout", layout);
  fixed.add("options.scale (set or not)", options.scale ? 1 : 0);
  fixed.add_real("options.scale", options.scale ? *options.scale : T(0));
  fixed.add_real("options.softcap", options.softcap);
  fixed.add("options.causal", options.causal ? 1 : 0);
  fixed.add("options.alignment", static_cast<std::int64_t>(options.alignment));
  fixed.add("options.window_left", options.window_left);
  fixed.add("options.window_right", options.window_right);
  fixed.add("options.global_tokens", options.global_tokens);
  fixed.add("options.backend", static_cast<std::int64_t>(options.backend));
  fixed.add_real("options.dropout_p", options.dropout_p);
  fixed.add("options.dropout_seed", static_cast<std::int64_t>(options.dropout_seed));
  fixed.add("options.dropout_offset", static_cast<std::int64_t>(options.dropout_offset));
  fixed.add("the size of options.key_lengths", static_cast<std::int64_t>(options.key_lengths.size()));
  fixed.add("the size of options.alibi_slopes", static_cast<std::int64_t>(options.alibi_slopes.size()));
  fixed.add("the size of options.sinks", static_cast<std::int64_t>(options.sinks.size()));
  for (std::size_t n = 0; n < options.key_lengths.size(); ++n)
    entries.add(concat("options.key_lengths[", n, "]"), options.key_lengths[n]);
  for (std::size_t n = 0; n < options.alibi_slopes.size(); ++n)
    entries.add_real(concat("options.alibi_slopes[", n, "]"), options.alibi_slopes[n]);
  for (std::size_t n = 0; n < options.sinks.size(); ++n)
    entries.add_real(concat("options.sinks[", n, "]"), options.sinks[n]);
  return {fixed, entries};
}

/// Collective: throws shape_error on every rank when the ranks' signatures differ (the first differing value named).
inline void check_same_signature(MPI_Comm comm, const char* function, const Signature& signature) {
  const int n = static_cast<int>(signature.values.size());
  if (n == 0) return;
  std::vector<std::int64_t> low = signature.values, high = signature.values;
  MPI_Allreduce(MPI_IN_PLACE, low.data(), n, MPI_INT64_T, MPI_MIN, comm);
  MPI_Allreduce(MPI_IN_PLACE, high.data(), n, MPI_INT64_T, MPI_MAX, comm);
  for (int i = 0; i < n; ++i) {
    const std::size_t s = static_cast<std::size_t>(i);
    if (low[s] == high[s]) continue;
    if (signature.real[s]) {
      check_shape(false, function, ": the ranks disagree on ", signature.names[s],
                  " (every rank must pass the same options)");
    }
    check_shape(false, function, ": the ranks disagree on ", signature.names[s], " (from ", low[s], " to ", high[s],
                " across ranks; every rank must pass the same extents, layout and options)");
  }
}

/// Checks that a count of elements fits MPI's int counts.
inline void check_count(const char* function, const char* what, Index count) {
  check_shape(count <= std::numeric_limits<int>::max(), function, ": ", what, " has ", count,
              " elements, more than one MPI message holds (", std::numeric_limits<int>::max(), ")");
}

/// Runs the calling thread's OpenMP work on one thread while it lives, when MPI provides less than
/// MPI_THREAD_FUNNELED (documented on top of this header).
class ThreadLevelScope {
 public:
  ThreadLevelScope() noexcept {
    int provided = MPI_THREAD_SINGLE;
    MPI_Query_thread(&provided);
#if defined(_OPENMP)
    if (provided < MPI_THREAD_FUNNELED) {
      saved_ = omp_get_max_threads();
      omp_set_num_threads(1);
    }
#endif
    (void)provided;
  }
  ~ThreadLevelScope() {
#if defined(_OPENMP)
    if (saved_ > 0) omp_set_num_threads(saved_);
#endif
  }
  ThreadLevelScope(const ThreadLevelScope&) = delete;
  ThreadLevelScope& operator=(const ThreadLevelScope&) = delete;

 private:
  int saved_ = 0;
};

/// The total row count of a rank's shard.
inline Index total_rows(const std::vector<std::pair<Index, Index>>& ranges) {
  Index rows = 0;
  for (const auto& range : ranges) rows += range.second - range.first;
  return rows;
}

/// The checks both strategies make, in order, each agreed by every rank (so that a bad input throws shape_error on
/// every rank and never leaves one waiting): the local views and the options this layer cannot shard; then the same
/// extents and options on every rank; then the global lengths (the sum of the ranks' rows) and each rank's rows
/// against shard_rows. Returns {global Sq, global Skv}.
template <class T>
std::pair<Index, Index> check_call(MPI_Comm comm, const char* function, const TensorView4<const T>& q,
                                   const TensorView4<const T>& k, const TensorView4<const T>& v,
                                   const TensorView4<T>& out, const TensorView3<T>& lse,
                                   const AttentionOptions<T>& options, ShardLayout layout) {
  check_shape(comm != MPI_COMM_NULL, function, ": comm is MPI_COMM_NULL");
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);

  // 1. This rank's own views and options.
  agree(comm, function, local_error_of([&] {
          check_shape(layout == ShardLayout::contiguous || layout == ShardLayout::zigzag, function, ": layout is ",
                      static_cast<int>(layout), ", expected ShardLayout::contiguous or ShardLayout::zigzag");
          check_shape(!qkv::detail::is_set(options.allowed), function,
                      ": options.allowed cannot be sharded by position (it has ",
                      qkv::detail::describe_layout(options.allowed), "); not supported by the MPI layer yet");
          check_shape(!qkv::detail::is_set(options.bias), function,
                      ": options.bias cannot be sharded by position (it has ", qkv::detail::describe_layout(options.bias),
                      "); not supported by the MPI layer yet");
          check_shape(options.cu_seqlens_q.empty() && options.cu_seqlens_k.empty(), function,
                      ": options.cu_seqlens_q/k (varlen) cannot be sharded by position (cu_seqlens_q has ",
                      options.cu_seqlens_q.size(), " entries, cu_seqlens_k ", options.cu_seqlens_k.size(),
                      "); not supported by the MPI layer yet");
          check_shape(!options.global_positions, function,
                      ": options.global_positions is set; the MPI layer sets it itself from the ranks' shards");
          // The views as qkv::attention checks them; key lengths are global, checked once the global Skv is known.
          AttentionOptions<T> local = options;
          local.key_lengths.clear();
          (void)qkv::detail::validate(function, q, k, &v, &out, &lse, local);
          (void)qkv::detail::use_fused(function, options);  // Backend::fused with double: unsupported_error
        }));

  // 2. The same extents (but the sequence axis), layout and options on every rank.
  const auto signature = signature_of(q, k, v, options, static_cast<int>(layout));
  check_same_signature(comm, function, signature.first);
  check_same_signature(comm, function, signature.second);

  // 3. The global lengths, and each rank's rows as shard_rows deals them.
  std::int64_t lengths[2] = {q.extent(2), k.extent(2)};
  MPI_Allreduce(MPI_IN_PLACE, lengths, 2, MPI_INT64_T, MPI_SUM, comm);
  const Index Sq = lengths[0], Skv = lengths[1];
  agree(
      comm, function, local_error_of([&] {
        const Index q_rows = total_rows(shard_rows(Sq, rank, size, layout));
        const Index kv_rows = total_rows(shard_rows(Skv, rank, size, layout));
        const char* name = layout == ShardLayout::zigzag ? "zigzag" : "contiguous";
        check_shape(q.extent(2) == q_rows, function, ": q axis 2 (Sq) has extent ", q.extent(2), " on rank ", rank,
                    ", expected ", q_rows, " (shard_rows of the global Sq ", Sq, " over ", size, " ranks, ", name, ")");
        check_shape(k.extent(2) == kv_rows, function, ": k axis 2 (Skv) has extent ", k.extent(2), " on rank ", rank,
                    ", expected ", kv_rows, " (shard_rows of the global Skv ", Skv, " over ", size, " ranks, ", name,
                    ")");
        for (std::size_t b = 0; b < options.key_lengths.size(); ++b) {
          check_shape(options.key_lengths[b] >= 0 && options.key_lengths[b] <= Skv, function, ": options.key_lengths[",
                      b, "] is ", options.key_lengths[b], ", expected a length in [0, ", Skv, "] (the global Skv)");
        }
      }));
  return {Sq, Skv};
}

/// Whether any query of global rows [q_begin, q_end) may see a key of global rows [k_begin, k_end) by the index rules
/// (for some batch entry): blocks no query can see are never computed. A bound (MaskGeometry::key_range), so a block
/// it keeps may still be all hidden; its result then merges as nothing.
template <class T>
bool block_visible(const AttentionOptions<T>& options, Index B, Index Sq, Index Skv, Index q_begin, Index q_end,
                   Index k_begin, Index k_end) {
  if (q_end <= q_begin || k_end <= k_begin) return false;
  for (Index b = 0; b < std::max<Index>(B, 1); ++b) {
    const Index skv_b = options.key_lengths.empty() ? Skv : options.key_lengths[static_cast<std::size_t>(b)];
    const MaskGeometry geometry = MaskGeometry::make(Sq, skv_b, options);
    const KeyRange keys = geometry.key_range(q_begin, q_end);
    if (std::max(keys.begin, k_begin) < std::min(keys.end, k_end)) return true;
  }
  return false;
}

/// Adds one logit per query head to each row's softmax denominator, once (lse ← log(exp(lse) + exp(sink)), out scaled
/// by exp(old lse − new lse)): the sinks of options.hpp, after the merge of every key block. A row that saw no key
/// keeps zeros and gets lse = the sink.
template <class T>
void add_sinks(const std::vector<T>& sinks, Index head_begin, const TensorView4<T>& out, const TensorView3<T>& lse) {
  for (Index b = 0; b < out.extent(0); ++b) {
    for (Index h = 0; h < out.extent(1); ++h) {
      const T sink = sinks[static_cast<std::size_t>(head_begin + h)];
      if (sink == -std::numeric_limits<T>::infinity()) continue;
      for (Index i = 0; i < out.extent(2); ++i) {
        const T old_lse = lse(b, h, i);
        if (old_lse == -std::numeric_limits<T>::infinity()) {
          lse(b, h, i) = sink;
          continue;
        }
        const T m = std::max(old_lse, sink);
        const T new_lse = m + std::log(std::exp(old_lse - m) + std::exp(sink - m));
        const T factor = std::exp(old_lse - new_lse);
        for (Index d = 0; d < out.extent(3); ++d) out(b, h, i, d) *= factor;
        lse(b, h, i) = new_lse;
      }
    }
  }
}

/// Where a ring's time went, per rank: computing its blocks (the attention calls and merges) and waiting for the
/// travelling K/V block (MPI_Waitall after the computation of each step). For the benchmark (bench/bench_mpi.cpp).
struct RingTimes {
  double compute_seconds = 0;
  double wait_seconds = 0;
  int blocks_computed = 0;                   ///< (query chunk, key chunk) attention calls
  std::vector<double> step_compute_seconds;  ///< per ring step
  std::vector<double> step_wait_seconds;     ///< per ring step
};

/// A view type of MPI for the elements of `view` (innermost stride 1), at byte offset (view.data() − base) from
/// `base`: nested hvectors over the strides, so that MPI reads and writes strided memory in place. The caller frees
/// it with MPI_Type_free.
template <class T, int Rank>
MPI_Datatype view_type(const void* base, const TensorView<T, Rank>& view) {
  using Element = std::remove_const_t<T>;
  MPI_Datatype type;
  MPI_Type_contiguous(static_cast<int>(view.extent(Rank - 1)), mpi_type<Element>(), &type);
  for (int axis = Rank - 2; axis >= 0; --axis) {
    MPI_Datatype outer;
    MPI_Type_create_hvector(static_cast<int>(view.extent(axis)), 1,
                            static_cast<MPI_Aint>(view.stride(axis)) * static_cast<MPI_Aint>(sizeof(Element)), type,
                            &outer);
    MPI_Type_free(&type);
    type = outer;
  }
  const int one = 1;
  const MPI_Aint offset =
      view.data() == nullptr ? 0 : reinterpret_cast<const char*>(view.data()) - reinterpret_cast<const char*>(base);
  MPI_Datatype placed;
  MPI_Type_create_hindexed(1, &one, &offset, type, &placed);
  MPI_Type_free(&type);
  MPI_Type_commit(&placed);
  return placed;
}

/// A duplicate of a communicator for the ring's point-to-point messages, so that they never match a message of the
/// caller's on the same communicator (MPI_Comm_dup: collective); freed at the end of the scope.
class DuplicateComm {
 public:
  explicit DuplicateComm(MPI_Comm comm) noexcept { MPI_Comm_dup(comm, &comm_); }
  ~DuplicateComm() { MPI_Comm_free(&comm_); }
  DuplicateComm(const DuplicateComm&) = delete;
  DuplicateComm& operator=(const DuplicateComm&) = delete;
  MPI_Comm get() const noexcept { return comm_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
};

/// One all-to-all of views: to each rank p, the elements of send[p] (views into memory starting at send_base); from
/// each rank p, into the elements of receive[p] (views into memory starting at receive_base). MPI_Alltoallw with one
/// derived datatype per peer, so nothing is packed by hand; empty views send nothing.
template <class S, class R, int Rank>
void all_to_all(MPI_Comm comm, const void* send_base, const std::vector<TensorView<S, Rank>>& send, void* receive_base,
                const std::vector<TensorView<R, Rank>>& receive) {
  const std::size_t P = send.size();
  std::vector<int> send_counts(P), receive_counts(P), zeros(P, 0);
  std::vector<MPI_Datatype> send_types(P), receive_types(P);
  for (std::size_t p = 0; p < P; ++p) {
    send_counts[p] = send[p].size() > 0 ? 1 : 0;
    receive_counts[p] = receive[p].size() > 0 ? 1 : 0;
    send_types[p] = send_counts[p] ? view_type(send_base, send[p]) : mpi_type<std::remove_const_t<S>>();
    receive_types[p] = receive_counts[p] ? view_type(receive_base, receive[p]) : mpi_type<R>();
  }
  MPI_Alltoallw(send_base, send_counts.data(), zeros.data(), send_types.data(), receive_base, receive_counts.data(),
                zeros.data(), receive_types.data(), comm);
  for (std::size_t p = 0; p < P; ++p) {
    if (send_counts[p]) MPI_Type_free(&send_types[p]);
    if (receive_counts[p]) MPI_Type_free(&receive_types[p]);
  }
}

}  // namespace detail

}  // namespace mpi

// The functions below run the fused kernel, whose code depends on the build's ISA: they sit in the ISA-named inline
// namespace like qkv::attention (docs/design.md, ODR safety).
namespace detail {
inline namespace QKV_ISA_NAME {

/// ring_attention with its times (mpi::detail::RingTimes) added to `times` when it is not null (the benchmark's).
template <class T>
void ring_attention_impl(MPI_Comm comm, const TensorView4<const T>& q, const TensorView4<const T>& k,
                         const TensorView4<const T>& v, const TensorView4<T>& out, const TensorView3<T>& lse,
                         const AttentionOptions<T>& options, mpi::ShardLayout layout, mpi::detail::RingTimes* times) {
  namespace md = mpi::detail;
  using mpi::shard_rows;
  using Clock = std::chrono::steady_clock;
  const char* function = "qkv::mpi::ring_attention";
  const std::pair<Index, Index> lengths = md::check_call(comm, function, q, k, v, out, lse, options, layout);
  const Index Sq = lengths.first, Skv = lengths.second;  // (not a structured binding: lambdas capture these)
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const Index B = q.extent(0), Hq = q.extent(1), Hkv = k.extent(1), D = q.extent(3), Dv = v.extent(3);

  // Every rank's K/V rows (its shard travels as one block: K [B, Hkv, rows, D] then V [B, Hkv, rows, Dv], dense).
  std::vector<std::vector<std::pair<Index, Index>>> kv_shards;
  Index max_rows = 0;
  for (int p = 0; p < size; ++p) {
    kv_shards.push_back(shard_rows(Skv, p, size, layout));
    max_rows = std::max(max_rows, md::total_rows(kv_shards.back()));
  }
  const Index per_row = B * Hkv * (D + Dv);
  md::agree(comm, function,
            md::local_error_of([&] { md::check_count(function, "a travelling K/V block", max_rows * per_row); }));
  const md::ThreadLevelScope thread_level;
  const md::DuplicateComm ring(comm);  // the ring's messages never meet the caller's

  // The two travelling blocks. This rank's own shard is packed into the first one, to be sent.
  std::vector<T> blocks[2];
  blocks[0].resize(static_cast<std::size_t>(max_rows * per_row));
  if (size > 1) blocks[1].resize(blocks[0].size());  // one rank: nothing travels
  const Index own_rows = k.extent(2);
  {
    T* k_dst = blocks[0].data();
    T* v_dst = k_dst + B * Hkv * own_rows * D;
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < Hkv; ++h)
        for (Index j = 0; j < own_rows; ++j) {
          std::copy_n(&k(b, h, j, 0), D, k_dst + ((b * Hkv + h) * own_rows + j) * D);
          if (Dv > 0) std::copy_n(&v(b, h, j, 0), Dv, v_dst + ((b * Hkv + h) * own_rows + j) * Dv);
        }
  }

  // This rank's query chunks, with their offsets in its views; one partial state per chunk in flight.
  const auto q_shard = shard_rows(Sq, rank, size, layout);
  std::vector<Index> q_offsets;
  Index max_chunk = 0, offset = 0;
  for (const auto& range : q_shard) {
    q_offsets.push_back(offset);
    offset += range.second - range.first;
    max_chunk = std::max(max_chunk, range.second - range.first);
  }
  std::vector<T> part_out(static_cast<std::size_t>(B * Hq * max_chunk * Dv)),
      part_lse(static_cast<std::size_t>(B * Hq * max_chunk));
  std::vector<bool> started(q_shard.size(), false);

  AttentionOptions<T> call = options;  // every block: the caller's options on global positions, sinks added once
  call.sinks.clear();
  const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
  constexpr int kTag = 1812;
  for (int step = 0; step < size; ++step) {
    const int source = (rank - step + size) % size;  // whose K/V this step holds
    std::vector<T>& current = blocks[step % 2];
    std::vector<T>& incoming = blocks[(step + 1) % 2];
    const Index rows = md::total_rows(kv_shards[static_cast<std::size_t>(source)]);
    MPI_Request requests[2];
    int n_requests = 0;
    if (step + 1 < size) {  // the next block in flight while this one is computed
      const int next_source = (source - 1 + size) % size;
      const Index next_rows = md::total_rows(kv_shards[static_cast<std::size_t>(next_source)]);
      MPI_Irecv(incoming.data(), static_cast<int>(next_rows * per_row), md::mpi_type<T>(), previous, kTag, ring.get(),
                &requests[n_requests++]);
      MPI_Isend(current.data(), static_cast<int>(rows * per_row), md::mpi_type<T>(), next, kTag, ring.get(),
                &requests[n_requests++]);
    }
    const auto compute_start = Clock::now();
    const TensorView4<const T> k_block(current.data(), {B, Hkv, rows, D});
    const TensorView4<const T> v_block(current.data() + B * Hkv * rows * D, {B, Hkv, rows, Dv});
    Index key_offset = 0;
    for (const auto& keys : kv_shards[static_cast<std::size_t>(source)]) {
      const Index key_rows = keys.second - keys.first;
      for (std::size_t c = 0; c < q_shard.size(); ++c) {
        const Index query_rows = q_shard[c].second - q_shard[c].first;
        if (!md::block_visible(options, B, Sq, Skv, q_shard[c].first, q_shard[c].second, keys.first, keys.second))
          continue;
        call.global_positions = GlobalPositions{q_shard[c].first, keys.first, Sq, Skv};
        const auto q_chunk = md::middle_rows(q, q_offsets[c], query_rows);
        const auto k_chunk = md::middle_rows(k_block, key_offset, key_rows);
        const auto v_chunk = md::middle_rows(v_block, key_offset, key_rows);
        const auto out_chunk = md::middle_rows(out, q_offsets[c], query_rows);
        const auto lse_chunk = md::middle_rows(lse, q_offsets[c], query_rows);
        if (!started[c]) {
          attention<T>(q_chunk, k_chunk, v_chunk, out_chunk, lse_chunk, call);
          started[c] = true;
        } else {
          const TensorView4<T> out_part(part_out.data(), {B, Hq, query_rows, Dv});
          const TensorView3<T> lse_part(part_lse.data(), {B, Hq, query_rows});
          attention<T>(q_chunk, k_chunk, v_chunk, out_part, lse_part, call);
          merge_attention_states<T>(out_chunk, lse_chunk, out_part, lse_part, out_chunk, lse_chunk);
        }
        if (times != nullptr) ++times->blocks_computed;
      }
      key_offset += key_rows;
    }
    const auto wait_start = Clock::now();
    if (n_requests > 0) MPI_Waitall(n_requests, requests, MPI_STATUSES_IGNORE);
    if (times != nullptr) {
      const double compute = std::chrono::duration<double>(wait_start - compute_start).count();
      const double wait = std::chrono::duration<double>(Clock::now() - wait_start).count();
      times->compute_seconds += compute;
      times->wait_seconds += wait;
      times->step_compute_seconds.push_back(compute);
      times->step_wait_seconds.push_back(wait);
    }
  }

  // Query chunks that saw no key at all: zeros and lse −∞; then the sinks, once.
  for (std::size_t c = 0; c < q_shard.size(); ++c) {
    if (started[c]) continue;
    const Index query_rows = q_shard[c].second - q_shard[c].first;
    const auto out_chunk = md::middle_rows(out, q_offsets[c], query_rows);
    const auto lse_chunk = md::middle_rows(lse, q_offsets[c], query_rows);
    for (Index b = 0; b < B; ++b)
      for (Index h = 0; h < Hq; ++h)
        for (Index i = 0; i < query_rows; ++i) {
          for (Index d = 0; d < Dv; ++d) out_chunk(b, h, i, d) = T(0);
          lse_chunk(b, h, i) = -std::numeric_limits<T>::infinity();
        }
  }
  if (!options.sinks.empty()) md::add_sinks(options.sinks, 0, out, lse);
}

}  // namespace QKV_ISA_NAME
}  // namespace detail

namespace mpi {
inline namespace QKV_ISA_NAME {

/// Ring attention: the exact attention of a sequence whose rows are sharded over the ranks of `comm`; each rank gets
/// its own rows of the whole sequence's out and lse.
///
///     out[b, h, i, :] = Σ_j softmax_j(s_ij) · v[b, h / G, j, :] over every rank's keys j, computed block by block:
///     out, lse = merge over the blocks of (attention of this rank's queries × one rank's K/V rows)
///
/// Shapes (this rank's rows; axes as qkv::attention, any strides with innermost stride 1): q [B, Hq, Sq_r, D],
///   k [B, Hkv, Skv_r, D], v [B, Hkv, Skv_r, Dv] → out [B, Hq, Sq_r, Dv], lse [B, Hq, Sq_r]. Sq_r and Skv_r are the
///   row counts `shard_rows(Sq, rank, size, layout)` and `shard_rows(Skv, rank, size, layout)` give of the global
///   lengths Sq = Σ Sq_r and Skv = Σ Skv_r, rows in the order shard_rows lists them (zigzag: the low chunk first).
///   Sq ≠ Skv works (cross-attention, or queries that are the last rows of a longer sequence with bottom_right).
/// Mapping: GQA and MQA as qkv::attention (query head h reads K/V head h / G). Every option is decided on global
///   positions: causal (both alignments; bottom_right uses the global Skv_b − Sq), window, global tokens, ALiBi,
///   softcap, scale; `key_lengths` are global lengths (one per batch entry, each in [0, Skv]); `sinks` join each row's
///   denominator once; dropout draws the mask of the whole call (keyed on global positions), so the ranks' rows are
///   the one-process call's with the same options. `options.backend` chooses each block's backend (float: fused;
///   double: reference).
/// Preconditions: every rank of `comm` calls with the same extents but the sequence axis, the same options and the
///   same layout; MPI is initialized and this is the thread that calls MPI (see `Environment`).
/// Edge cases: a rank may hold no rows (Sq or Skv < the rank count); a query that sees no key gets zeros and lse −∞
///   (its sink with `sinks`); NaN in a visible q, k or v stays in the rows it touches.
/// Throws: on every rank, never leaving one waiting (each check is agreed by a collective call before any rank
///   throws): shape_error for a bad view on any rank (the message names the rank), ranks that disagree on extents,
///   layout or any option (the message names the first differing one), a rank whose rows are not its shard_rows,
///   `allowed`, `bias` or `cu_seqlens` (not shardable by position yet), `global_positions` set by the caller, global
///   key lengths out of range, or a travelling block of more than INT_MAX elements; unsupported_error for
///   Backend::fused with double.
/// Algorithm: P steps, on a duplicate of `comm` (MPI_Comm_dup, so that the ring's messages never match the caller's).
///   At step s rank r holds the K/V shard of rank (r − s) mod P; it posts MPI_Irecv of the next
///   block from r − 1 and MPI_Isend of the current one to r + 1, computes each (query chunk, key chunk) pair of the
///   current block that some query may see (qkv::attention with global positions; pairs hidden by the causal mask or
///   the window are never computed), merges it into its rows' state with merge_attention_states, then waits. The
///   merge order is fixed (step, then key chunk, then query chunk), so a given rank count gives the same bits run
///   after run and for any OpenMP thread count per rank; different rank counts agree within rounding.
/// Complexity: per rank, (P steps) × the attention of its Sq/P queries against Skv/P keys: O(B·Hq·Sq·Skv·(D + Dv)/P)
///   flops in total with contiguous shards and no mask; with a causal mask zigzag gives every rank the same share
///   (about half of that), while contiguous gives the last rank 2P − 1 times the first's. Communication: P − 1 K/V
///   blocks of B·Hkv·(Skv/P)·(D + Dv) elements sent and received per rank. docs/distributed.md has the measured
///   numbers.
/// Memory: each rank holds its own shard, two travelling K/V blocks (the one computed and the one in flight) and one
///   partial (out, lse) of its largest query chunk; never the whole sequence's K/V. Each attention call allocates as
///   qkv::attention does (the fused kernel packs that call's K/V chunk).
/// Thread safety: as an MPI collective: one call at a time per communicator; OpenMP threads inside each call.
/// Example: examples/ring_attention.cpp. Source: Liu, Zaharia, Abbeel 2023, "Ring Attention with Blockwise
///   Transformers for Near-Infinite Context"; zigzag layout: ring-flash-attn and Megatron-LM's context
///   parallelism; the merge: FlashAttention 2's split-KV combine.
template <class T>
void ring_attention(MPI_Comm comm, non_deduced_t<TensorView4<const T>> q, non_deduced_t<TensorView4<const T>> k,
                    non_deduced_t<TensorView4<const T>> v, TensorView4<T> out, TensorView3<T> lse,
                    const AttentionOptions<T>& options, ShardLayout layout = ShardLayout::contiguous) {
  qkv::detail::ring_attention_impl<T>(comm, q, k, v, out, lse, options, layout, nullptr);
}

/// DeepSpeed-Ulysses: the exact attention of a sequence sharded contiguously over the ranks of `comm`, by exchanging
/// sequence shards for head shards: an all-to-all gives each rank the whole sequence of Hq/P query heads (and of the
/// K/V heads they read), qkv::attention runs locally, and an all-to-all gives each rank its own rows of every head.
///
/// Shapes: as ring_attention with ShardLayout::contiguous: q [B, Hq, Sq_r, D], k [B, Hkv, Skv_r, D],
///   v [B, Hkv, Skv_r, Dv] → out [B, Hq, Sq_r, Dv], lse [B, Hq, Sq_r], Sq_r and Skv_r the row counts of
///   shard_rows(Sq, rank, P, contiguous) and shard_rows(Skv, rank, P, contiguous).
/// Head rules (P ranks): Hq must be a multiple of P (rank r computes query heads [r·Hq/P, (r+1)·Hq/P)); Hkv must be a
///   multiple of P (rank r receives K/V heads [r·Hkv/P, (r+1)·Hkv/P)) or P a multiple of Hkv (each K/V head is then
///   replicated to the P/Hkv ranks whose query heads read it, as GQA requires: rank r receives head r·Hkv/P). Example:
///   Hq = 8, Hkv = 2, P = 4: rank 0 computes query heads 0, 1 with K/V head 0, rank 3 heads 6, 7 with K/V head 1.
/// Options: as ring_attention (on the whole sequence locally, so no global positions are needed); each rank passes
///   the ALiBi slopes and sinks of its own heads to its call.
/// Throws: as ring_attention, on every rank; and shape_error on every rank when the head rules fail, or when
///   `options.dropout_p` > 0 (not supported yet: a rank computes its heads as heads 0, 1, …, and the dropout mask is
///   keyed by the head; ring_attention supports dropout).
/// Complexity: per rank the attention of Hq/P heads over the whole sequence, O(B·Hq·Sq·Skv·(D + Dv)/P) flops (a
///   causal mask halves it on every rank alike); communication: two all-to-alls in, one out, each rank sending about
///   (P−1)/P of its q, k, v (k and v times P/Hkv when replicated) and out, lse shards.
/// Memory: the whole sequence of its heads: q, out [B, Hq/P, Sq, ·], k, v [B, max(1, Hkv/P), Skv, ·]; Ulysses trades
///   the ring's memory bound for two collective steps, and its parallelism is bounded by the head count.
/// Thread safety: as ring_attention. Example: tests/mpi/test_mpi.cpp (Ulysses cases). Source: Jacobs et al. 2023,
///   "DeepSpeed Ulysses: System Optimizations for Enabling Training of Extreme Long Sequence Transformer Models".
template <class T>
void ulysses_attention(MPI_Comm comm, non_deduced_t<TensorView4<const T>> q, non_deduced_t<TensorView4<const T>> k,
                       non_deduced_t<TensorView4<const T>> v, TensorView4<T> out, TensorView3<T> lse,
                       const AttentionOptions<T>& options) {
  namespace md = mpi::detail;
  const char* function = "qkv::mpi::ulysses_attention";
  const std::pair<Index, Index> lengths =
      md::check_call(comm, function, q, k, v, out, lse, options, ShardLayout::contiguous);
  const Index Sq = lengths.first, Skv = lengths.second;  // (not a structured binding: lambdas capture these)
  int rank = 0, size = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &size);
  const Index B = q.extent(0), Hq = q.extent(1), Hkv = k.extent(1), D = q.extent(3), Dv = v.extent(3), P = size;
  // The head rules: every rank sees the same extents (agreed above), so every rank throws alike.
  // Every rank holds the same options (agreed above), so every rank throws alike.
  md::check_shape(options.dropout_p == T(0), function, ": options.dropout_p is ", options.dropout_p,
                  "; dropout is not supported by ulysses_attention yet (a rank computes its heads as heads 0, 1, ..., "
                  "and the dropout mask is keyed by the head); ring_attention supports it");
  md::check_shape(Hq % P == 0, function, ": q axis 1 (Hq) has extent ", Hq, ", not a multiple of the ", P,
                  " ranks (Ulysses gives each rank Hq / ranks query heads)");
  md::check_shape(Hkv % P == 0 || P % Hkv == 0, function, ": k axis 1 (Hkv) has extent ", Hkv, " and there are ", P,
                  " ranks: expected Hkv a multiple of the ranks or the ranks a multiple of Hkv (K/V heads are then "
                  "replicated)");
  const Index heads = Hq / P, kv_heads = Hkv % P == 0 ? Hkv / P : 1;
  const auto kv_begin = [&](Index p) { return p * Hkv / P; };
  const auto q_rows = [&](Index p) { return shard_rows(Sq, static_cast<int>(p), size, ShardLayout::contiguous)[0]; };
  const auto kv_rows = [&](Index p) { return shard_rows(Skv, static_cast<int>(p), size, ShardLayout::contiguous)[0]; };
  md::agree(comm, function, md::local_error_of([&] {
              md::check_count(function, "a rank's query heads", B * heads * Sq * std::max(D, Dv));
              md::check_count(function, "a rank's K/V heads", B * kv_heads * Skv * std::max(D, Dv));
            }));
  const md::ThreadLevelScope thread_level;

  std::vector<T> q_full(static_cast<std::size_t>(B * heads * Sq * D)),
      k_full(static_cast<std::size_t>(B * kv_heads * Skv * D)),
      v_full(static_cast<std::size_t>(B * kv_heads * Skv * Dv)),
      out_full(static_cast<std::size_t>(B * heads * Sq * Dv)), lse_full(static_cast<std::size_t>(B * heads * Sq));
  const TensorView4<T> q_all(q_full.data(), {B, heads, Sq, D}), k_all(k_full.data(), {B, kv_heads, Skv, D}),
      v_all(v_full.data(), {B, kv_heads, Skv, Dv}), out_all(out_full.data(), {B, heads, Sq, Dv});
  const TensorView3<T> lse_all(lse_full.data(), {B, heads, Sq});

  // Sequence shards of all heads → the whole sequence of this rank's heads.
  std::vector<TensorView4<const T>> send_q, send_k, send_v;
  std::vector<TensorView4<T>> receive_q, receive_k, receive_v;
  for (Index p = 0; p < P; ++p) {
    send_q.push_back(md::middle_heads(q, p * heads, heads));
    send_k.push_back(md::middle_heads(k, kv_begin(p), kv_heads));
    send_v.push_back(md::middle_heads(v, kv_begin(p), kv_heads));
    const auto rows_q = q_rows(p), rows_kv = kv_rows(p);
    receive_q.push_back(md::middle_rows(q_all, rows_q.first, rows_q.second - rows_q.first));
    receive_k.push_back(md::middle_rows(k_all, rows_kv.first, rows_kv.second - rows_kv.first));
    receive_v.push_back(md::middle_rows(v_all, rows_kv.first, rows_kv.second - rows_kv.first));
  }
  md::all_to_all(comm, q.data(), send_q, q_full.data(), receive_q);
  md::all_to_all(comm, k.data(), send_k, k_full.data(), receive_k);
  md::all_to_all(comm, v.data(), send_v, v_full.data(), receive_v);

  // The whole sequence, this rank's heads: its ALiBi slopes and sinks.
  AttentionOptions<T> call = options;
  if (!options.alibi_slopes.empty()) {
    call.alibi_slopes.assign(options.alibi_slopes.begin() + rank * heads,
                             options.alibi_slopes.begin() + (rank + 1) * heads);
  }
  if (!options.sinks.empty()) {
    call.sinks.assign(options.sinks.begin() + rank * heads, options.sinks.begin() + (rank + 1) * heads);
  }
  attention<T>(q_all, k_all, v_all, out_all, lse_all, call);

  // This rank's heads of the whole sequence → every rank's rows of all heads.
  std::vector<TensorView4<const T>> send_out;
  std::vector<TensorView3<const T>> send_lse;
  std::vector<TensorView4<T>> receive_out;
  std::vector<TensorView3<T>> receive_lse;
  for (Index p = 0; p < P; ++p) {
    const auto rows_q = q_rows(p);
    send_out.push_back(md::middle_rows(TensorView4<const T>(out_all), rows_q.first, rows_q.second - rows_q.first));
    send_lse.push_back(md::middle_rows(TensorView3<const T>(lse_all), rows_q.first, rows_q.second - rows_q.first));
    receive_out.push_back(md::middle_heads(out, p * heads, heads));
    receive_lse.push_back(md::middle_heads(lse, p * heads, heads));
  }
  md::all_to_all(comm, out_full.data(), send_out, out.data(), receive_out);
  md::all_to_all(comm, lse_full.data(), send_lse, lse.data(), receive_lse);
}

}  // namespace QKV_ISA_NAME
}  // namespace mpi
}  // namespace qkv
