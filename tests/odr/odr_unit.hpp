// tests/odr/odr_unit.hpp — one translation unit of the two-TU ODR test: compiled twice with different ISA
// flags (tu_baseline.cpp: -march=x86-64; tu_avx2.cpp: -march=x86-64-v3), each defining run_<name>().
// Every qkv function whose body depends on the flags sits in an inline namespace named after them (qkv::isa_scalar,
// qkv::isa_avx2, ...), the kernel copies of runtime dispatch included (qkv::detail::isa_avx2::kernel_scalar is the
// scalar kernel compiled with AVX2 flags), so the linker keeps both units' kernels instead of silently picking one:
// otherwise the x86-64 unit's kernels could be the ones compiled for AVX2, and fault on a CPU without it.
#include <cstdint>
#include <cstring>
#include <vector>

#include "qkv/attention.hpp"

#define QKV_ODR_CONCAT2(a, b) a##b
#define QKV_ODR_CONCAT(a, b) QKV_ODR_CONCAT2(a, b)

/// Runs causal attention with Backend::fused on raw buffers (no Eigen object crosses the unit), writes the
/// ISA this unit's call ran on into `isa`, the output into `out` (2 heads × 37 rows × 24) and the address of this
/// unit's fused-kernel entry (the dispatcher over its kernel copies) into `kernel`.
void QKV_ODR_CONCAT(run_, QKV_ODR_UNIT)(const char** isa, std::vector<float>& out, std::uintptr_t* kernel) {
  const qkv::Index H = 2, S = 37, D = 24;
  std::vector<float> q(static_cast<std::size_t>(H * S * D)), k(q.size()), v(q.size());
  for (std::size_t n = 0; n < q.size(); ++n) {
    q[n] = static_cast<float>((n * 7919) % 17) / 17.0f - 0.5f;
    k[n] = static_cast<float>((n * 104729) % 23) / 23.0f - 0.5f;
    v[n] = static_cast<float>((n * 1299709) % 29) / 29.0f;
  }
  out.assign(q.size(), 0.0f);
  qkv::AttentionOptions<float> options;
  options.causal = true;
  options.backend = qkv::Backend::fused;
  qkv::attention(qkv::view_bhsd<const float>(q.data(), 1, H, S, D), qkv::view_bhsd<const float>(k.data(), 1, H, S, D),
                 qkv::view_bhsd<const float>(v.data(), 1, H, S, D), qkv::view_bhsd(out.data(), 1, H, S, D), options);
  *isa = qkv::isa_name();
  *kernel = reinterpret_cast<std::uintptr_t>(&qkv::detail::run_fused<float>);  // the float-storage kernel entry
}
