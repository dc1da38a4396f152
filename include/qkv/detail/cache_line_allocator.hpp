// qkv/detail/cache_line_allocator.hpp — a std::vector allocator whose storage starts on a 64-byte cache line.
#pragma once

#include <cstddef>
#include <new>

namespace qkv {
namespace detail {

/// Allocates T on 64-byte boundaries (aligned operator new): `std::vector<T, CacheLineAllocator<T>>` is a vector whose
/// rows of a multiple of 64 bytes each start a cache line, as Eigen's own storage does with AVX-512 and PyTorch's CPU
/// allocator does always. glibc's malloc gives large blocks 16 bytes past a page, so each 64-byte row of such a
/// std::vector straddles two lines and every 512-bit load of it splits: token-major float decode from L3 took about
/// 1.1 × the time (Zen 4, AVX-512, one thread; from DRAM, and head-major, no consistent difference; bench/README.md,
/// "2026-12-06, thirtieth session"). Stateless: any two compare equal. Throws std::bad_alloc as operator new does.
template <class T>
struct CacheLineAllocator {
  using value_type = T;
  static constexpr std::size_t kAlignment = 64;
  static_assert(alignof(T) <= kAlignment, "qkv: CacheLineAllocator's elements must need at most 64-byte alignment");

  CacheLineAllocator() noexcept = default;
  template <class U>
  CacheLineAllocator(const CacheLineAllocator<U>&) noexcept {}  // NOLINT(google-explicit-constructor): rebinding

  T* allocate(std::size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t(kAlignment))); }
  void deallocate(T* p, std::size_t) noexcept { ::operator delete(p, std::align_val_t(kAlignment)); }

  template <class U>
  bool operator==(const CacheLineAllocator<U>&) const noexcept {
    return true;
  }
  template <class U>
  bool operator!=(const CacheLineAllocator<U>&) const noexcept {
    return false;
  }
};

}  // namespace detail
}  // namespace qkv
