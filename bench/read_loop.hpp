// bench/read_loop.hpp — the plain read loop that bench_attention (BM_ReadLoop) and the A/B harness's decode mode
// (bench/ab/ab_fused.cpp) take as the speed at which this machine reads decode's bytes, and the OpenMP team that
// splits it (also BM_ReadFmaLoop's).
#pragma once

#include <cstddef>
#include <cstring>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "qkv/simd/simd.hpp"

namespace qkv_bench {

/// `threads` OpenMP threads (one without OpenMP), each calling sum_range(begin, end) over its contiguous share of
/// [0, n) (shares start at multiples of `step`, the last ends at n), and the sum of what they return.
template <class SumRange>
float team_sum(int threads, std::size_t n, std::size_t step, SumRange&& sum_range) {
  float total = 0;
#if defined(_OPENMP)
#pragma omp parallel num_threads(threads) reduction(+ : total)
#endif
  {
    int thread = 0, team = 1;
#if defined(_OPENMP)
    thread = omp_get_thread_num();
    team = omp_get_num_threads();
#endif
    const std::size_t begin = n / std::size_t(team) * std::size_t(thread) / step * step;
    const std::size_t end = thread == team - 1 ? n : n / std::size_t(team) * std::size_t(thread + 1) / step * step;
    total += sum_range(begin, end);
  }
  (void)threads;
  return total;
}

/// Sums the n floats from `data` on `threads` threads (team_sum), each share with four independent accumulators of
/// the best vector tag: bound by memory, not by add latency; no software prefetch. Returns the sum, for the caller to
/// keep alive. `data` may lie anywhere: the vector tags' loads are unaligned loads and a share's last elements past
/// its whole steps are copied with memcpy, so that 16-bit K and V 2 bytes off a float's alignment can be read as the
/// floats their bytes make (the scalar tag's loads are plain float reads, which x86 performs at any alignment).
inline float read_floats(const float* data, std::size_t n, int threads) {
  using Tag = qkv::simd::BestTag;
  constexpr std::size_t L = static_cast<std::size_t>(Tag::kLanes), kStep = 4 * L;
  return team_sum(threads, n, kStep, [&](std::size_t begin, std::size_t end) {
    auto a0 = qkv::simd::zero(Tag()), a1 = a0, a2 = a0, a3 = a0;
    std::size_t e = begin;
    for (; e + kStep <= end; e += kStep) {
      a0 = qkv::simd::add(a0, qkv::simd::load(Tag(), data + e));
      a1 = qkv::simd::add(a1, qkv::simd::load(Tag(), data + e + L));
      a2 = qkv::simd::add(a2, qkv::simd::load(Tag(), data + e + 2 * L));
      a3 = qkv::simd::add(a3, qkv::simd::load(Tag(), data + e + 3 * L));
    }
    float sum = qkv::simd::reduce_sum(Tag(), qkv::simd::add(qkv::simd::add(a0, a1), qkv::simd::add(a2, a3)));
    for (; e < end; ++e) {
      float x;
      std::memcpy(&x, reinterpret_cast<const unsigned char*>(data) + e * sizeof(float), sizeof x);
      sum += x;
    }
    return sum;
  });
}

}  // namespace qkv_bench
