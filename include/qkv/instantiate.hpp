// qkv/instantiate.hpp — the one translation unit of a separately compiled qkv (docs/design.md, "Separate
// compilation").
//
// qkv is header-only: every translation unit that calls `qkv::attention` or `qkv::attention_backward` compiles the
// fused kernel (one copy per instruction set under runtime dispatch), the reference and the validation, about 20 s of
// g++ -O2 per unit. A program with many such units can compile them once instead, as Asio's ASIO_SEPARATE_COMPILATION
// does:
//
//   - define QKV_SEPARATE_COMPILATION for every unit that includes qkv (e.g. target_compile_definitions), so that
//     those units only declare the entry points' instantiations (`extern template`);
//   - include <qkv/instantiate.hpp> in exactly one unit, compiled with the same flags and definitions, which defines
//     them for float, double, and float with Eigen::half or Eigen::bfloat16 keys and values.
//
// Without QKV_SEPARATE_COMPILATION the header is harmless: its definitions are the instantiations the unit would make
// anyway. Units compiled with other flags (another -march, OpenMP or not, QKV_DISPATCH) live in another inline
// namespace (config.hpp, QKV_ISA_NAME), so a mismatch is a link error, never two kernels mixed. Templates instantiated
// on other types, and everything else in qkv, stay in the units that use them.
#pragma once

#include "qkv/attention.hpp"
#include "qkv/backward.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {

QKV_ATTENTION_INSTANTIATIONS(template)
QKV_BACKWARD_INSTANTIATIONS(template)

}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv
