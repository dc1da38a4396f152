// qkv/detail/aligned_buffer.hpp — the fused kernel's scratch storage: 64-byte aligned floats, allocated once per call.
#pragma once

#include <algorithm>
#include <cstddef>
#include <new>

#include "qkv/config.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {

/// A 64-byte aligned float buffer, allocated once and reused (no allocation inside the kernel loops). `resize` only
/// grows it and keeps nothing: the contents after a resize are undefined.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t n) { resize(n); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  ~AlignedBuffer() { release(); }
  void resize(std::size_t n) {
    if (n <= size_) return;
    release();
    data_ = static_cast<float*>(::operator new(std::max<std::size_t>(n, 1) * sizeof(float), std::align_val_t(64)));
    size_ = n;
  }
  float* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }

 private:
  void release() noexcept {
    if (data_ != nullptr) ::operator delete(data_, std::align_val_t(64));
    data_ = nullptr;
    size_ = 0;
  }
  float* data_ = nullptr;
  std::size_t size_ = 0;
};

}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv
