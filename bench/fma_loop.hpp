// bench/fma_loop.hpp — the register-only FMA loop that bench_attention (BM_FmaPeak) and the A/B harness
// (bench/ab/ab_fused.cpp) take as the ISA's peak FLOP rate for one thread.
#pragma once

#include <cstdint>

#include "qkv/simd/simd.hpp"

namespace qkv_bench {

/// Independent accumulators: as many as fit the register file with the two operands (12 of AVX2's 16 ymm registers,
/// 16 of AVX-512's 32): enough to cover the FMA latency × the FMA ports (4 × 2 on current x86 cores), none spilled.
constexpr int kFmaChains = qkv::simd::BestTag::kLanes >= 16 ? 16 : 12;

/// Runs `iterations` steps of kFmaChains independent chains acc = acc·x + 1e-7 (2 · kFmaChains · lanes · iterations
/// FLOPs) and returns the sum of the lanes, which the caller keeps alive. x is a run-time value (pass 0.999999f), so
/// the loop cannot be folded.
inline float fma_chains(std::int64_t iterations, float x_value) {
  using Tag = qkv::simd::BestTag;
  typename Tag::Vec acc[kFmaChains];
  for (int a = 0; a < kFmaChains; ++a) acc[a] = qkv::simd::set1(Tag(), float(a));
  const auto x = qkv::simd::set1(Tag(), x_value), y = qkv::simd::set1(Tag(), 1e-7f);
  for (std::int64_t n = 0; n < iterations; ++n) {
    for (int a = 0; a < kFmaChains; ++a) acc[a] = qkv::simd::fmadd(acc[a], x, y);
  }
  float sum = 0;
  for (int a = 0; a < kFmaChains; ++a) sum += qkv::simd::reduce_sum(Tag(), acc[a]);
  return sum;
}

}  // namespace qkv_bench
