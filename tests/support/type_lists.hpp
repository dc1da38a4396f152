// tests/support/type_lists.hpp — the types typed tests run over: the scalar types; the SIMD tags whose ops this
// translation unit's flags let it call directly; and the tags the build compiled a fused kernel for (runtime dispatch,
// config.hpp), which a test runs side by side where the CPU supports them.
#pragma once

#include <gtest/gtest.h>

#include "qkv/isa.hpp"
#include "qkv/simd/simd.hpp"

namespace qkv_test {

using Scalars = ::testing::Types<float, double>;

// Ops are called directly only under flags that enable them (simd/avx2.hpp, simd/avx512.hpp: their callers must be
// compiled for their ISA): tests/CMakeLists.txt builds test_simd once per -march level for that. A tag exists where its
// kernel is compiled (config.hpp): with QKV_DISPATCH=0, the flags' own and the scalar one.
using SimdTags = ::testing::Types<qkv::simd::ScalarTag
#if (defined(QKV_ISA_AVX2) || defined(QKV_ISA_AVX512)) && defined(QKV_KERNEL_AVX2)
                                  ,
                                  qkv::simd::Avx2Tag
#endif
#if defined(QKV_ISA_AVX512)
                                  ,
                                  qkv::simd::Avx512Tag
#endif
                                  >;

// Every kernel the build compiled (qkv::detail::run_fused_as takes the tag); with dispatch, the scalar one always.
using KernelTags = ::testing::Types<
#if defined(QKV_KERNEL_SCALAR)
    qkv::simd::ScalarTag
#endif
#if defined(QKV_KERNEL_SCALAR) && (defined(QKV_KERNEL_AVX2) || defined(QKV_KERNEL_AVX512))
    ,
#endif
#if defined(QKV_KERNEL_AVX2)
    qkv::simd::Avx2Tag
#endif
#if defined(QKV_KERNEL_AVX2) && defined(QKV_KERNEL_AVX512)
    ,
#endif
#if defined(QKV_KERNEL_AVX512)
    qkv::simd::Avx512Tag
#endif
    >;

/// Whether this CPU runs a tag's code (a typed test skips the others).
template <class Tag>
bool cpu_runs() {
  return qkv::detail::cpu_supports(Tag::kIsa);
}

}  // namespace qkv_test
