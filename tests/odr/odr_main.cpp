// Two-TU ODR test (STYLE.md, ODR safety): the same qkv call compiled with two ISA flags links into one program.
// Each unit keeps its own kernels: the fused-kernel entry of the x86-64 unit and of the x86-64-v3 unit (and so the
// kernel copies each calls) are two functions, not one the linker picked; both units run the kernel runtime dispatch
// chose for it (isa_name() in each), and agree with each other within the fused kernel's float accuracy.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

void run_baseline(const char** isa, std::vector<float>& out, std::uintptr_t* kernel);
void run_avx2(const char** isa, std::vector<float>& out, std::uintptr_t* kernel);

TEST(Odr, EachUnitKeepsItsOwnKernels) {
  const char* baseline_isa = nullptr;
  std::vector<float> baseline;
  std::uintptr_t baseline_kernel = 0;
  run_baseline(&baseline_isa, baseline, &baseline_kernel);
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    EXPECT_STREQ(baseline_isa, "scalar");
    GTEST_SKIP() << "no AVX2/FMA on this CPU: the x86-64-v3 unit cannot run";
  }
  const char* avx2_isa = nullptr;
  std::vector<float> avx2;
  std::uintptr_t avx2_kernel = 0;
  run_avx2(&avx2_isa, avx2, &avx2_kernel);
  EXPECT_NE(baseline_kernel, avx2_kernel) << "one kernel entry serves units built with different flags";
  // Each unit runs a kernel it compiled: the x86-64-v3 unit has scalar and AVX2 copies (config.hpp), or AVX2 alone
  // with QKV_DISPATCH=0 (the sanitize preset), so it never reports avx512.
  EXPECT_TRUE(std::strcmp(avx2_isa, "avx2") == 0 || std::strcmp(avx2_isa, "scalar") == 0) << avx2_isa;
  ASSERT_EQ(baseline.size(), avx2.size());
  float largest = 0;
  for (std::size_t n = 0; n < avx2.size(); ++n) largest = std::max(largest, std::fabs(avx2[n] - baseline[n]));
  EXPECT_LE(largest, 1e-5f);  // two float kernels, values in [0, 1): agree to a few ulp of the output
}
