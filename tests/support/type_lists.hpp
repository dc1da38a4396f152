// tests/support/type_lists.hpp — the types typed tests run over: the scalar types; the SIMD tags whose ops this
// translation unit's flags let it call directly; and the tags the build compiled a fused kernel for (runtime dispatch,
// config.hpp), which a test runs side by side where the CPU supports them. Both tag lists end with the emulated
// 16-lane tag (support/emulated_tag.hpp), whose ops are plain C++ and whose kernel runs on any CPU.
#pragma once

#include <gtest/gtest.h>

#include "qkv/isa.hpp"
#include "qkv/simd/simd.hpp"
#include "support/emulated_tag.hpp"

namespace qkv_test {

using Scalars = ::testing::Types<float, double>;

// Ops are called directly only under flags that enable them (simd/avx2.hpp, simd/avx512.hpp: their callers must be
// compiled for their ISA): tests/CMakeLists.txt builds test_simd once per -march level for that. A tag exists where its
// kernel is compiled (config.hpp): with QKV_DISPATCH=0, the flags' own and the scalar one.
using SimdTags = ::testing::Types<qkv::simd::ScalarTag,
#if (defined(QKV_ISA_AVX2) || defined(QKV_ISA_AVX512)) && defined(QKV_KERNEL_AVX2)
                                  qkv::simd::Avx2Tag,
#endif
#if defined(QKV_ISA_AVX512)
                                  qkv::simd::Avx512Tag,
#endif
                                  Emulated16Tag>;

// Every kernel the build compiled (qkv::detail::run_fused_as takes the tag); with dispatch, the scalar one always. Then
// the emulated 16-lane tag, whose kernel AVX-512's tile shapes instantiate on any CPU: run every entry through
// qkv_test::run_fused_with (support/run_fused_with.hpp), which takes both kinds.
using KernelTags = ::testing::Types<
#if defined(QKV_KERNEL_SCALAR)
    qkv::simd::ScalarTag,
#endif
#if defined(QKV_KERNEL_AVX2)
    qkv::simd::Avx2Tag,
#endif
#if defined(QKV_KERNEL_AVX512)
    qkv::simd::Avx512Tag,
#endif
    Emulated16Tag>;

/// Whether this CPU runs a tag's code (a typed test skips the others); the emulated tag's everywhere.
template <class Tag>
bool cpu_runs() {
  return qkv::detail::cpu_supports(Tag::kIsa);
}

}  // namespace qkv_test
