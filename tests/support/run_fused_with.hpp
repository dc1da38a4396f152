// tests/support/run_fused_with.hpp — the fused kernel on a chosen SIMD tag: a compiled kernel copy (dispatch.hpp's
// run_fused_as) or the emulated 16-lane tag (support/emulated_tag.hpp), whose kernel is instantiated here.
#pragma once

#include "support/emulated_tag.hpp"
// The emulated tag's ops first, as the tests have them (emulated_tag.hpp: the order no longer matters).
#include "qkv/attention.hpp"
#include "qkv/detail/attention_params.hpp"
#include "qkv/detail/attention_shape.hpp"
#include "qkv/detail/dispatch.hpp"
#include "qkv/detail/validate.hpp"
#include "qkv/options.hpp"
#include "qkv/tensor_view.hpp"

namespace qkv_test {
inline namespace QKV_ISA_NAME {  // the body of run_fused_with(Emulated16Tag, ...) depends on which passes exist

// The emulated tag's kernel lives in the first pass the build compiles (config.hpp): kernel_scalar wherever the
// scalar kernel is compiled (every dispatching build), else the flags' one ISA (QKV_DISPATCH=OFF with AVX2 or AVX-512
// flags). Its ops are plain C++, so any pass runs it on any CPU the binary runs on.
#if defined(QKV_KERNEL_SCALAR)
namespace emulated_pass = qkv::detail::kernel_scalar;
#elif defined(QKV_KERNEL_AVX2)
namespace emulated_pass = qkv::detail::kernel_avx2;
#else
namespace emulated_pass = qkv::detail::kernel_avx512;
#endif

/// The fused kernel of a compiled copy (a tag of qkv::simd), over validated views and resolved parameters. The CPU
/// must run that copy (cpu_runs<Tag>(), type_lists.hpp).
template <class Tag>
void run_fused_with(Tag tag, const qkv::detail::AttentionShape& shape, const qkv::TensorView4<const float>& q,
                    const qkv::TensorView4<const float>& k, const qkv::TensorView4<const float>& v,
                    const qkv::TensorView4<float>& out, const qkv::TensorView3<float>* lse,
                    const qkv::detail::AttentionParams<float>& params) {
  qkv::detail::run_fused_as(tag, shape, q, k, v, out, lse, params);
}

/// The fused kernel instantiated on the emulated 16-lane tag: AVX-512's tile shapes and tails, on any CPU.
inline void run_fused_with(Emulated16Tag, const qkv::detail::AttentionShape& shape,
                           const qkv::TensorView4<const float>& q, const qkv::TensorView4<const float>& k,
                           const qkv::TensorView4<const float>& v, const qkv::TensorView4<float>& out,
                           const qkv::TensorView3<float>* lse, const qkv::detail::AttentionParams<float>& params) {
  emulated_pass::FusedAttention<Emulated16Tag>(shape, q, k, v, out, lse, params).run();
}

/// qkv::attention with Backend::fused, on the kernel of `tag` instead of the one isa.hpp chose: validates the call
/// (throws qkv::shape_error as qkv::attention does), resolves its parameters and runs run_fused_with. `lse` may be
/// null.
template <class Tag>
void fused_attention_with(Tag tag, const qkv::TensorView4<const float>& q, const qkv::TensorView4<const float>& k,
                          const qkv::TensorView4<const float>& v, const qkv::TensorView4<float>& out,
                          const qkv::TensorView3<float>* lse, const qkv::AttentionOptions<float>& options) {
  const qkv::detail::AttentionShape shape =
      qkv::detail::validate<float>("qkv_test::fused_attention_with", q, k, &v, &out, lse, options);
  const qkv::detail::AttentionParams<float> params = qkv::detail::resolve_params(options, shape.D);
  run_fused_with(tag, shape, q, k, v, out, lse, params);
}

}  // namespace QKV_ISA_NAME
}  // namespace qkv_test
