// tests/support/type_lists.hpp — the types typed tests run over: the scalar types, and every SIMD tag the build's flags
// enable (scalar always; AVX2 and AVX-512 where include/qkv/simd/ defines them), so that one binary tests every
// kernel side by side.
#pragma once

#include <gtest/gtest.h>

#include "qkv/simd/simd.hpp"

namespace qkv_test {

using Scalars = ::testing::Types<float, double>;

// The conditions are those under which simd/avx2.hpp and simd/avx512.hpp define their tags.
using SimdTags = ::testing::Types<qkv::simd::ScalarTag
#if defined(__AVX2__) && defined(__FMA__)
                                  ,
                                  qkv::simd::Avx2Tag
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
                                  ,
                                  qkv::simd::Avx512Tag
#endif
                                  >;

}  // namespace qkv_test
