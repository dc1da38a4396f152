// qkv/detail/aligned_buffer.hpp — the fused kernels' scratch storage: 64-byte aligned floats, allocated once per call,
// and the workspace a thread keeps between calls (its largest buffers: a prefill's packed K and V, a backward's
// scratch).
#pragma once

#include <algorithm>
#include <cstddef>
#include <new>
#include <utility>

#include "qkv/config.hpp"

namespace qkv {
namespace detail {
inline namespace QKV_ISA_NAME {

/// A 64-byte aligned float buffer, allocated once and reused (no allocation inside the kernel loops). `resize` only
/// grows it and keeps nothing: the contents after a resize are undefined.
///
/// A buffer of kHugeBytes (4 MiB) or more (the packed K and V of a prefill, a backward's scratch) is aligned to 2 MiB,
/// so that where transparent huge pages are `always` the system may back it with them. qkv does not ask for them
/// (MADV_HUGEPAGE), so where THP is `madvise` the buffer gets 4 KiB pages. It did ask while these buffers were
/// allocated afresh for every call: faulting 64 MiB in 4 KiB pages took 188 ms on a 2-core Zen 5 VM and 4 ms in huge
/// pages (bench/README.md, "2026-12-02, ninth session"). The large buffers now live in the thread's Workspace and
/// fault once per thread, and on that VM the advice cost every later call: after a process touched 16 MiB or more of
/// advised pages, the first touch of each of the caller's 4 KiB pages took microseconds (80 MiB of inputs read in
/// 17-104 ms instead of 3.3 ms); a one-thread backward at T = 4096, D = 128 ran at 0.69-0.76 of the FMA loop with the
/// advice and 0.86-0.88 without (bench/README.md, "2026-12-03, seventeenth session").
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t n) { resize(n); }
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer(AlignedBuffer&& other) noexcept
      : data_(std::exchange(other.data_, nullptr)),
        size_(std::exchange(other.size_, 0)),
        alignment_(other.alignment_) {}
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept {
    if (this != &other) {
      release();
      data_ = std::exchange(other.data_, nullptr);
      size_ = std::exchange(other.size_, 0);
      alignment_ = other.alignment_;
    }
    return *this;
  }
  ~AlignedBuffer() { release(); }
  void resize(std::size_t n) {
    if (n <= size_) return;
    release();
    const std::size_t bytes = std::max<std::size_t>(n, 1) * sizeof(float);
    alignment_ = bytes >= kHugeBytes ? kHugePage : 64;
    data_ = static_cast<float*>(::operator new(bytes, std::align_val_t(alignment_)));
    size_ = n;
  }
  float* data() const noexcept { return data_; }
  std::size_t size() const noexcept { return size_; }
  /// Frees the storage: size() is 0 after.
  void release() noexcept {
    if (data_ != nullptr) ::operator delete(data_, std::align_val_t(alignment_));
    data_ = nullptr;
    size_ = 0;
  }

 private:
  static constexpr std::size_t kHugePage = std::size_t(2) << 20;
  static constexpr std::size_t kHugeBytes = std::size_t(4) << 20;
  float* data_ = nullptr;
  std::size_t size_ = 0;
  std::size_t alignment_ = 64;
};

/// The buffers a thread keeps from one attention call to the next, each grown to the largest the thread has needed and
/// freed by qkv::release_workspace() or when the thread ends: a prefill's packed K in `first` and packed V in `second`
/// (pack.hpp, PackedKV: the largest allocation of a forward call, about the float size of its K and V, or of one
/// (sequence, kv head)'s on one thread); a backward
/// call's scratch for every thread of its team in `first` (fused_backward.hpp). Allocated afresh for every call, they
/// often came back from the system as fresh pages (glibc returns large freed blocks, or cannot reuse them for a 2 MiB-
/// aligned request), and faulting them in again cost a one-thread prefill 3 % of its time at T = 4096, D = 128 (huge
/// pages) and half of it at T = 1024, D = 64 (4 KiB pages) on a Zen 5 VM (bench/README.md, "2026-12-02, tenth
/// session"). One call at a time holds them (`lent`, through WorkspaceLoan); a call that finds them held (a call made
/// while another runs on the same thread) takes its own. One per thread and per qkv build (QKV_ISA_NAME), on the
/// thread that makes the call (the kernel's own OpenMP workers keep none).
struct Workspace {
  AlignedBuffer first, second;
  bool lent = false;

  static Workspace& of_this_thread() noexcept {
    thread_local Workspace workspace;
    return workspace;
  }
};

/// One call's hold on the calling thread's Workspace: its buffers, or where a call on this thread holds the workspace
/// already, buffers of the loan's own, freed with it.
class WorkspaceLoan {
 public:
  WorkspaceLoan() noexcept : workspace_(Workspace::of_this_thread()), borrowed_(!workspace_.lent) {
    if (borrowed_) workspace_.lent = true;
  }
  ~WorkspaceLoan() {
    if (borrowed_) workspace_.lent = false;
  }
  WorkspaceLoan(const WorkspaceLoan&) = delete;
  WorkspaceLoan& operator=(const WorkspaceLoan&) = delete;

  AlignedBuffer& first() noexcept { return borrowed_ ? workspace_.first : own_first_; }
  AlignedBuffer& second() noexcept { return borrowed_ ? workspace_.second : own_second_; }

 private:
  Workspace& workspace_;
  const bool borrowed_;
  AlignedBuffer own_first_, own_second_;
};

}  // namespace QKV_ISA_NAME
}  // namespace detail
}  // namespace qkv
