// Runtime dispatch (isa.hpp, detail/dispatch.hpp): the choice rule over every combination of compiled kernels, CPU
// support and pin; isa_name() against the CPU's flags as /proc/cpuinfo lists them and against the QKV_ISA pin; and a
// call through qkv::attention giving the same bits as the kernel copy isa_name() names.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "qkv/attention.hpp"
#include "qkv/isa.hpp"
#include "support/type_lists.hpp"

namespace {

using qkv::detail::Isa;

TEST(Dispatch, ParsesEveryPinName) {
  EXPECT_FALSE(qkv::detail::parse_isa(nullptr).pinned);
  EXPECT_FALSE(qkv::detail::parse_isa("").pinned);
  EXPECT_FALSE(qkv::detail::parse_isa("best").pinned);
  EXPECT_TRUE(qkv::detail::parse_isa("scalar").pinned && qkv::detail::parse_isa("scalar").isa == Isa::scalar);
  EXPECT_TRUE(qkv::detail::parse_isa("avx2").pinned && qkv::detail::parse_isa("avx2").isa == Isa::avx2);
  EXPECT_TRUE(qkv::detail::parse_isa("avx512").pinned && qkv::detail::parse_isa("avx512").isa == Isa::avx512);
  for (const char* bad : {"AVX2", "avx", "avx512f", "sse", " scalar"}) {
    EXPECT_TRUE(qkv::detail::parse_isa(bad).pinned) << bad;
    EXPECT_FALSE(qkv::detail::parse_isa(bad).found) << bad;
  }
}

// Every combination of 3 compiled flags (scalar compiled, or a static build of one ISA), 2 × 2 CPU supports and 8 pins,
// against the rule stated in isa.hpp, written out here case by case.
TEST(Dispatch, ChoosesThePinWhenItRunsElseTheBestCompiledKernelTheCpuRuns) {
  const char* pins[] = {nullptr, "", "best", "scalar", "avx2", "avx512", "AVX2", "neon"};
  int cases = 0;
  for (int compiled_bits = 1; compiled_bits < 8; ++compiled_bits) {
    const bool compiled[3] = {(compiled_bits & 1) != 0, (compiled_bits & 2) != 0, (compiled_bits & 4) != 0};
    for (int cpu = 0; cpu < 3; ++cpu) {  // 0: no AVX2; 1: AVX2 only; 2: AVX2 and AVX-512
      const bool supported[3] = {true, cpu >= 1, cpu >= 2};
      for (const char* pin : pins) {
        const char* why_not = "unset";
        const Isa chosen = qkv::detail::choose_isa(compiled, supported, pin, &why_not);
        // The expected kernel: the best compiled one this CPU runs, unless a valid pin names a runnable one.
        Isa best = Isa::scalar;
        bool any = false;
        for (int n = 0; n < 3; ++n) {
          if (compiled[n] && supported[n]) best = static_cast<Isa>(n), any = true;
        }
        if (!any) {  // only a build whose flags this CPU lacks: its lowest compiled kernel
          best = compiled[0] ? Isa::scalar : compiled[1] ? Isa::avx2 : Isa::avx512;
        }
        Isa expected = best;
        bool honoured = true;
        const std::string p = pin == nullptr ? "" : pin;
        if (p == "scalar" || p == "avx2" || p == "avx512") {
          const int n = p == "scalar" ? 0 : p == "avx2" ? 1 : 2;
          honoured = compiled[n] && supported[n];
          if (honoured) expected = static_cast<Isa>(n);
        } else if (!p.empty() && p != "best") {
          honoured = false;
        }
        EXPECT_EQ(chosen, expected) << "compiled " << compiled_bits << " cpu " << cpu << " pin " << p;
        EXPECT_EQ(why_not == nullptr, honoured) << "compiled " << compiled_bits << " cpu " << cpu << " pin " << p;
        ++cases;
      }
    }
  }
  EXPECT_EQ(cases, 7 * 3 * 8);
}

// The decoding kernels' prefetch level (isa.hpp, choose_prefetch_level): L2 on AMD family 0x19 with AVX-512 (Zen 4)
// only, L1 on every other CPU, each CPU case with every pin; the rule written out case by case.
TEST(Dispatch, DecodePrefetchLevelIsL2OnZen4AndL1ElsewhereUnlessPinned) {
  using qkv::detail::PrefetchLevel;
  EXPECT_FALSE(qkv::detail::parse_prefetch_level(nullptr).pinned);
  EXPECT_FALSE(qkv::detail::parse_prefetch_level("").pinned);
  EXPECT_FALSE(qkv::detail::parse_prefetch_level("auto").pinned);
  EXPECT_TRUE(qkv::detail::parse_prefetch_level("l1").pinned);
  EXPECT_EQ(qkv::detail::parse_prefetch_level("l1").level, PrefetchLevel::l1);
  EXPECT_EQ(qkv::detail::parse_prefetch_level("l2").level, PrefetchLevel::l2);
  EXPECT_FALSE(qkv::detail::parse_prefetch_level("L2").found);
  EXPECT_FALSE(qkv::detail::parse_prefetch_level("t1").found);
  struct Cpu {
    bool amd;
    unsigned family;
    bool avx512;
    PrefetchLevel level;  // unpinned
  };
  const Cpu cpus[] = {
      {true, 0x19, true, PrefetchLevel::l2},   // Zen 4
      {true, 0x19, false, PrefetchLevel::l1},  // Zen 3
      {true, 0x1A, true, PrefetchLevel::l1},   // Zen 5
      {true, 0x17, false, PrefetchLevel::l1},  // Zen 2
      {false, 0x06, true, PrefetchLevel::l1},  // an Intel core with AVX-512
      {false, 0x19, true, PrefetchLevel::l1},  // family 0x19 of another vendor
  };
  const char* pins[] = {nullptr, "", "auto", "l1", "l2", "L1", "nta"};
  for (const Cpu& cpu : cpus) {
    for (const char* pin : pins) {
      const std::string p = pin == nullptr ? "" : pin;
      const char* why_not = "unset";
      const PrefetchLevel level = qkv::detail::choose_prefetch_level(cpu.amd, cpu.family, cpu.avx512, pin, &why_not);
      const PrefetchLevel expected = p == "l1" ? PrefetchLevel::l1 : p == "l2" ? PrefetchLevel::l2 : cpu.level;
      const bool known = p.empty() || p == "auto" || p == "l1" || p == "l2";
      EXPECT_EQ(level, expected) << "family " << cpu.family << " amd " << cpu.amd << " pin " << p;
      EXPECT_EQ(why_not == nullptr, known) << "pin " << p;
    }
  }
}

/// The flags of the first processor in /proc/cpuinfo, space-padded ("" where the file does not exist).
std::string cpuinfo_flags() {
  std::ifstream file("/proc/cpuinfo");
  std::string line;
  while (std::getline(file, line)) {
    if (line.rfind("flags", 0) == 0) return line.substr(line.find(':') + 1) + " ";
  }
  return "";
}

// Without a pin, the kernel is the best this build compiled and the CPU lists; with QKV_ISA set (CI pins only what
// the CPU runs), exactly the pin.
TEST(Dispatch, IsaNameIsThePinOrTheBestCompiledKernelTheCpuLists) {
  const std::string flags = cpuinfo_flags();
  if (flags.empty()) GTEST_SKIP() << "no /proc/cpuinfo";
  const auto has = [&](const char* flag) { return flags.find(std::string(" ") + flag + " ") != std::string::npos; };
  const bool avx2 = has("avx2") && has("fma");
  const bool avx512 = avx2 && has("avx512f") && has("avx512bw") && has("avx512dq") && has("avx512vl");
  // The pin in force: the environment's, else the build's (CMake QKV_ISA); CI pins only what the CPU runs. (Under
  // valgrind, which hides AVX-512 from CPUID but not from /proc/cpuinfo, run this test with a pin.)
  const char* pin = std::getenv("QKV_ISA");
#if defined(QKV_ISA_DEFAULT)
  if (pin == nullptr) pin = QKV_ISA_DEFAULT;
#endif
  const qkv::detail::IsaRequest request = qkv::detail::parse_isa(pin);
  if (request.pinned) {
    EXPECT_STREQ(qkv::isa_name(), pin) << "QKV_ISA=" << pin << " was not honoured";
    return;
  }
  std::string expected = "scalar";
#if defined(QKV_KERNEL_AVX2)
  if (avx2) expected = "avx2";
#endif
#if defined(QKV_KERNEL_AVX512)
  if (avx512) expected = "avx512";
#endif
  (void)avx2, (void)avx512;
  EXPECT_EQ(qkv::isa_name(), expected) << "CPU flags:" << flags;
}

/// Runs `run` on the kernel copy of `Tag` when `name` is its ISA.
template <class Tag, class Run>
void run_if_named(const char* name, Run&& run) {
  if (std::strcmp(name, Tag::kName) == 0) run(Tag());
}

// qkv::attention runs the copy isa_name() names: the same bits as calling that copy directly.
TEST(Dispatch, AttentionRunsTheKernelIsaNameNames) {
  const qkv::Index Hq = 4, Hkv = 2, Sq = 45, Skv = 300, D = 40;
  std::mt19937 rng(5);
  std::normal_distribution<float> normal;
  std::vector<float> q(static_cast<std::size_t>(Hq * Sq * D)), k(static_cast<std::size_t>(Hkv * Skv * D)), v(k.size()),
      out(q.size(), 0.0f), direct(q.size(), 1.0f);
  for (auto* x : {&q, &k, &v})
    for (auto& e : *x) e = normal(rng);
  qkv::AttentionOptions<float> options;
  options.causal = true;
  const auto qv = qkv::view_bhsd<const float>(q.data(), 1, Hq, Sq, D);
  const auto kv = qkv::view_bhsd<const float>(k.data(), 1, Hkv, Skv, D);
  const auto vv = qkv::view_bhsd<const float>(v.data(), 1, Hkv, Skv, D);
  qkv::attention(qv, kv, vv, qkv::view_bhsd(out.data(), 1, Hq, Sq, D), options);
  const auto ov = qkv::view_bhsd(direct.data(), 1, Hq, Sq, D);
  const auto shape = qkv::detail::validate<float>("test", qv, kv, &vv, &ov, nullptr, options);
  const auto params = qkv::detail::resolve_params(options, D);
  bool ran = false;
  const auto run = [&](auto tag) {
    qkv::detail::run_fused_as(tag, shape, qv, kv, vv, ov, nullptr, params);
    ran = true;
  };
#if defined(QKV_KERNEL_SCALAR)
  run_if_named<qkv::simd::ScalarTag>(qkv::isa_name(), run);
#endif
#if defined(QKV_KERNEL_AVX2)
  run_if_named<qkv::simd::Avx2Tag>(qkv::isa_name(), run);
#endif
#if defined(QKV_KERNEL_AVX512)
  run_if_named<qkv::simd::Avx512Tag>(qkv::isa_name(), run);
#endif
  ASSERT_TRUE(ran) << qkv::isa_name() << " is not a compiled kernel";
  EXPECT_EQ(std::memcmp(out.data(), direct.data(), out.size() * sizeof(float)), 0) << qkv::isa_name();
}

}  // namespace
