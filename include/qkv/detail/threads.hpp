// qkv/detail/threads.hpp — the threading policy of every OpenMP region in qkv (internal).
//
// Policy (documented for users on qkv::attention and in README.md, "Threads"):
//   - Called inside an active OpenMP parallel region (omp_in_parallel()), a call runs on the calling thread only:
//     it never opens a nested team, whatever omp_get_max_active_levels() allows, so a user's own parallel loop over
//     calls is not multiplied by qkv's threads.
//   - Otherwise a call large enough to pay for a team (each region states its threshold) uses omp_get_max_threads()
//     threads: the calling thread's own nthreads-var, which OMP_NUM_THREADS sets for every thread and
//     omp_set_num_threads(n) sets for the thread that calls it.
//   - Results never depend on the number of threads: each kernel fixes by the shape what each output row sums, and in
//     what order (how tasks are grouped for the threads may follow their number; fused_attention.hpp, plans).
// Without OpenMP every call is single-threaded.
#pragma once

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "qkv/config.hpp"

namespace qkv {
namespace detail {

/// Test seam (internal, not API): when `callback` is set, thread 0 of every qkv parallel region (that is, the calling
/// thread) calls it with the region's team size (omp_get_num_threads()) and its active nesting level
/// (omp_get_active_level()), so a test can check the policy above. The callback may run on many threads at once; set
/// it only while no other thread runs qkv.
struct TeamObserver {
  using Callback = void (*)(int team_size, int active_level, void* context);
  static inline Callback callback = nullptr;
  static inline void* context = nullptr;
};

// The functions below change with _OPENMP: in the inline namespace that names it (config.hpp), so that units built with
// and without OpenMP (qkv::qkv and qkv::qkv_serial) never share them.
inline namespace QKV_ISA_NAME {

/// Whether a qkv parallel region may open a team of threads: false inside an active parallel region (the policy
/// above) and without OpenMP.
inline bool may_open_team() noexcept {
#if defined(_OPENMP)
  return omp_in_parallel() == 0;
#else
  return false;
#endif
}

/// Reports the current team to `TeamObserver` (from thread 0 only). Call it first inside each parallel region.
inline void observe_team() noexcept {
#if defined(_OPENMP)
  if (TeamObserver::callback != nullptr && omp_get_thread_num() == 0) {
    TeamObserver::callback(omp_get_num_threads(), omp_get_active_level(), TeamObserver::context);
  }
#endif
}

}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv
