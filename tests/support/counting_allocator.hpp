// tests/support/counting_allocator.hpp — a counting replacement of the global operator new / delete, shared by
// test_fused (which bounds what one attention call allocates) and bench_attention (which reports it, alloc_MiB).
//
// Include it in exactly one translation unit of an executable: replacement allocation functions are not inline.
// Every operator new of the executable adds its size while counting is on; atomic, because the kernel's OpenMP
// threads allocate their scratch at once. ThreadSanitizer's runtime defines operator new and delete itself (a static
// library: replacing them would be a duplicate definition at link time), so under TSan QKV_COUNTS_ALLOCATIONS is 0,
// the allocation functions stay TSan's and nothing is counted (count_allocations returns zeros: bench_attention's
// alloc_MiB reads 0 in such a build).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstdlib>
#include <new>

#if defined(__SANITIZE_THREAD__)
#define QKV_COUNTS_ALLOCATIONS 0
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define QKV_COUNTS_ALLOCATIONS 0
#endif
#endif
#if !defined(QKV_COUNTS_ALLOCATIONS)
#define QKV_COUNTS_ALLOCATIONS 1
#endif

namespace qkv_test {

/// What one counted call allocated: the sum of the sizes passed to operator new, and the largest of them.
struct AllocationCount {
  std::size_t bytes = 0;
  std::size_t largest = 0;
};

inline std::atomic<bool> g_counting{false};
inline std::atomic<std::size_t> g_allocated_bytes{0};
inline std::atomic<std::size_t> g_largest_allocation{0};

inline void count_allocation(std::size_t bytes) noexcept {
  if (!g_counting.load(std::memory_order_relaxed)) return;
  g_allocated_bytes += bytes;
  std::size_t largest = g_largest_allocation.load();
  while (bytes > largest && !g_largest_allocation.compare_exchange_weak(largest, bytes)) {
  }
}

/// Runs f() with counting on and returns what it allocated (zeros when QKV_COUNTS_ALLOCATIONS is 0).
template <class F>
AllocationCount count_allocations(F&& f) {
  g_allocated_bytes = 0;
  g_largest_allocation = 0;
  g_counting = true;
  f();
  g_counting = false;
  return {g_allocated_bytes.load(), g_largest_allocation.load()};
}

}  // namespace qkv_test

#if QKV_COUNTS_ALLOCATIONS
// GCC sees these inlined into callers and mistakes free() of memory from malloc() for a mismatched pair; the pair is
// matched by construction. (The pragma holds to the end of the translation unit.)
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif

void* operator new(std::size_t bytes) {
  qkv_test::count_allocation(bytes);
  if (void* p = std::malloc(bytes == 0 ? 1 : bytes)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void* operator new(std::size_t bytes, std::align_val_t alignment) {
  qkv_test::count_allocation(bytes);
  const std::size_t a = static_cast<std::size_t>(alignment);
  if (void* p = std::aligned_alloc(a, (std::max<std::size_t>(bytes, 1) + a - 1) / a * a)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
#endif
