// Two-TU ODR test (STYLE.md, ODR safety): the same qkv call compiled for two ISAs links into one program, and
// each unit runs its own fused kernel: the scalar unit reports "scalar", the AVX2 unit "avx2", and both agree
// with each other within the fused kernel's float accuracy.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

void run_baseline(const char** isa, std::vector<float>& out);
void run_avx2(const char** isa, std::vector<float>& out);

TEST(Odr, EachUnitRunsItsOwnKernel) {
  const char* baseline_isa = nullptr;
  std::vector<float> baseline;
  run_baseline(&baseline_isa, baseline);
  EXPECT_STREQ(baseline_isa, "scalar");
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) GTEST_SKIP() << "no AVX2/FMA on this CPU";
  const char* avx2_isa = nullptr;
  std::vector<float> avx2;
  run_avx2(&avx2_isa, avx2);
  EXPECT_STREQ(avx2_isa, "avx2");
  ASSERT_EQ(baseline.size(), avx2.size());
  float largest = 0;
  for (std::size_t n = 0; n < avx2.size(); ++n) largest = std::max(largest, std::fabs(avx2[n] - baseline[n]));
  EXPECT_LE(largest, 1e-5f);  // two float kernels, values in [0, 1): agree to a few ulp of the output
}
