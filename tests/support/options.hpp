// tests/support/options.hpp — the one converter between qkv::AttentionOptions<T> and brute::Params (the plain
// description the float64 brute force and the plain float implementation read), shared by test_reference,
// test_nan_policy, test_fused, test_support and the fuzzer.
//
// Both directions copy every field of AttentionOptions (the backend is not a semantic field: it is an argument of
// from_brute), but dropout: brute::Params has none, so to_brute aborts on dropout_p ≠ 0 and from_brute leaves it 0.
// Each one names the fields through a structured binding, so a field added to AttentionOptions stops the build here
// until it is converted; test_support round-trips a value of every field.
#pragma once

#include <cstddef>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <vector>

#include "brute_force.hpp"
#include "qkv/options.hpp"

namespace qkv_test {

/// AttentionOptions<T> with its own storage for what `allowed` and `bias` point to, so that converted options outlive
/// their source. Move-only: moving keeps the storage, and the views stay valid. (The library's own owning form,
/// AttentionOptions::set_allowed / set_bias, is not used here: a copy of `options` must not outlive `OwnedOptions`.)
template <class T>
struct OwnedOptions {
  qkv::AttentionOptions<T> options;
  std::unique_ptr<bool[]> allowed;  // dense, the extents of options.allowed
  std::vector<T> bias;              // dense, the extents of options.bias

  OwnedOptions() = default;
  OwnedOptions(OwnedOptions&&) noexcept = default;
  OwnedOptions& operator=(OwnedOptions&&) noexcept = default;
  OwnedOptions(const OwnedOptions&) = delete;
  OwnedOptions& operator=(const OwnedOptions&) = delete;
};

/// Whether an optional mask view is given: a non-null pointer or a non-zero extent (the library's rule: extents
/// {1, Hq, 0, Skv} with no data still count, and varlen rejects them).
template <class E>
bool is_set(const qkv::TensorView4<E>& view) {
  if (view.data() != nullptr) return true;
  for (qkv::Index e : view.extents()) {
    if (e != 0) return true;
  }
  return false;
}

/// A dense copy of a mask view (extent-1 axes stay extent 1: they broadcast).
template <class D, class E>
brute::Broadcast4<D> dense_copy(const qkv::TensorView4<E>& view) {
  brute::Broadcast4<D> dense;
  for (int axis = 0; axis < 4; ++axis) dense.extents[static_cast<std::size_t>(axis)] = view.extent(axis);
  for (qkv::Index b = 0; b < view.extent(0); ++b)
    for (qkv::Index h = 0; h < view.extent(1); ++h)
      for (qkv::Index i = 0; i < view.extent(2); ++i)
        for (qkv::Index j = 0; j < view.extent(3); ++j) dense.data.push_back(static_cast<D>(view(b, h, i, j)));
  return dense;
}

/// The call of `shape` with `options`, as brute::Params (values of T held in double).
template <class T>
brute::Params to_brute(const qkv::AttentionOptions<T>& options, const brute::Shape& shape) {
  const auto& [scale, softcap, causal, alignment, window_left, window_right, global_tokens, key_lengths, allowed, bias,
               alibi_slopes, sinks, global_positions, cu_seqlens_q, cu_seqlens_k, dropout_p, dropout_seed,
               dropout_offset, backend, allowed_storage, bias_storage] = options;
  // The brute force has no dropout (test_dropout checks it with loops of its own): a call with dropout has no
  // brute::Params, and converting one would silently compare against the undropped attention.
  if (dropout_p != T(0)) {
    std::fprintf(stderr, "qkv_test::to_brute: options.dropout_p is %g; brute::Params has no dropout\n",
                 static_cast<double>(dropout_p));
    std::abort();
  }
  (void)dropout_seed;  // only meaningful with dropout_p > 0
  (void)dropout_offset;
  (void)backend;          // not a semantic field
  (void)allowed_storage;  // not semantic either: what keeps `allowed` and `bias` alive; their values are copied
  (void)bias_storage;
  brute::Params p;
  static_cast<brute::Shape&>(p) = shape;
  if (scale) p.scale = static_cast<double>(*scale);
  p.softcap = static_cast<double>(softcap);
  p.causal = causal;
  p.alignment =
      alignment == qkv::CausalAlignment::top_left ? brute::Alignment::top_left : brute::Alignment::bottom_right;
  p.window_left = window_left;
  p.window_right = window_right;
  p.global_tokens = global_tokens;
  p.key_lengths.assign(key_lengths.begin(), key_lengths.end());
  if (is_set(allowed)) p.allowed = dense_copy<char>(allowed);
  if (is_set(bias)) p.bias = dense_copy<double>(bias);
  p.alibi_slopes.assign(alibi_slopes.begin(), alibi_slopes.end());
  p.sinks.assign(sinks.begin(), sinks.end());
  if (global_positions) {
    p.global_positions = brute::Params::GlobalPositions{global_positions->q_begin, global_positions->k_begin,
                                                        global_positions->sq, global_positions->skv};
  }
  p.cu_seqlens_q.assign(cu_seqlens_q.begin(), cu_seqlens_q.end());
  p.cu_seqlens_k.assign(cu_seqlens_k.begin(), cu_seqlens_k.end());
  return p;
}

/// The options of `p` in T (every value rounded to T), with `backend`; `allowed` and `bias` dense in the storage.
template <class T>
OwnedOptions<T> from_brute(const brute::Params& p, qkv::Backend backend = qkv::Backend::automatic) {
  OwnedOptions<T> owned;
  auto& [scale, softcap, causal, alignment, window_left, window_right, global_tokens, key_lengths, allowed, bias,
         alibi_slopes, sinks, global_positions, cu_seqlens_q, cu_seqlens_k, dropout_p, dropout_seed, dropout_offset,
         backend_field, allowed_storage, bias_storage] = owned.options;
  // No dropout (to_brute rejects it): the defaults, dropout_p = 0.
  (void)dropout_p;
  (void)dropout_seed;
  (void)dropout_offset;
  // The dense copies live in `owned` (its views stay valid when it moves); the options' own storage stays null, so
  // that copying `owned.options` out of `owned` is the caller's visible choice (see OwnedOptions).
  allowed_storage = nullptr;
  bias_storage = nullptr;
  if (p.scale) scale = static_cast<T>(*p.scale);
  softcap = static_cast<T>(p.softcap);
  causal = p.causal;
  alignment =
      p.alignment == brute::Alignment::top_left ? qkv::CausalAlignment::top_left : qkv::CausalAlignment::bottom_right;
  window_left = p.window_left;
  window_right = p.window_right;
  global_tokens = p.global_tokens;
  key_lengths.assign(p.key_lengths.begin(), p.key_lengths.end());
  if (p.allowed) {
    const auto& e = p.allowed->extents;
    owned.allowed.reset(new bool[p.allowed->data.size() + 1]);
    for (std::size_t n = 0; n < p.allowed->data.size(); ++n) owned.allowed[n] = p.allowed->data[n] != 0;
    allowed = qkv::TensorView4<const bool>(owned.allowed.get(), {e[0], e[1], e[2], e[3]});
  }
  if (p.bias) {
    const auto& e = p.bias->extents;
    owned.bias.assign(p.bias->data.begin(), p.bias->data.end());
    bias = qkv::TensorView4<const T>(owned.bias.data(), {e[0], e[1], e[2], e[3]});
  }
  alibi_slopes.assign(p.alibi_slopes.begin(), p.alibi_slopes.end());
  sinks.assign(p.sinks.begin(), p.sinks.end());
  if (p.global_positions) {
    const auto& g = *p.global_positions;
    global_positions = qkv::GlobalPositions{g.q_begin, g.k_begin, g.sq, g.skv};
  }
  cu_seqlens_q.assign(p.cu_seqlens_q.begin(), p.cu_seqlens_q.end());
  cu_seqlens_k.assign(p.cu_seqlens_k.begin(), p.cu_seqlens_k.end());
  backend_field = backend;
  return owned;
}

}  // namespace qkv_test
