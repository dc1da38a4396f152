// Two-TU ODR test (STYLE.md, ODR safety): the same qkv call compiled with two ISA flags links into one program.
// Each unit keeps its own kernels: the scalar kernel copy of the x86-64 unit and of the x86-64-v3 unit are two
// functions, not one the linker picked; both units run the kernel runtime dispatch chose (the same ISA, as
// isa_name() says in each), and agree with each other within the fused kernel's float accuracy.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

void run_baseline(const char** isa, std::vector<float>& out, std::uintptr_t* scalar_kernel);
void run_avx2(const char** isa, std::vector<float>& out, std::uintptr_t* scalar_kernel);

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
  EXPECT_NE(baseline_kernel, avx2_kernel) << "one scalar kernel serves units built with different flags";
  // The x86-64-v3 unit compiled kernels up to AVX2 (config.hpp), the x86-64 unit up to AVX-512: on an AVX-512 CPU
  // without a pin the baseline unit runs AVX-512, the other AVX2.
  if (std::strcmp(baseline_isa, "avx512") != 0) {
    EXPECT_STREQ(avx2_isa, baseline_isa);
  }
  ASSERT_EQ(baseline.size(), avx2.size());
  float largest = 0;
  for (std::size_t n = 0; n < avx2.size(); ++n) largest = std::max(largest, std::fabs(avx2[n] - baseline[n]));
  EXPECT_LE(largest, 1e-5f);  // two float kernels, values in [0, 1): agree to a few ulp of the output
}
