// A buffer the engine thread reuses from one operation to the next: it grows
// to the largest size asked for, never shrinks and is never zeroed, so a
// compressed allreduce of a large tensor does not pay for fresh pages (page
// faults and the kernel's zeroing) on every call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace hpcdl {

class Scratch {
 public:
  // Room for `count` values of T; contents are unspecified.
  template <typename T>
  T* get(std::size_t count) {
    const std::size_t bytes = count * sizeof(T);
    if (bytes > size_) {
      buf_.reset(new std::uint8_t[bytes]);  // operator new: aligned for any fundamental type
      size_ = bytes;
    }
    return reinterpret_cast<T*>(buf_.get());
  }

 private:
  std::unique_ptr<std::uint8_t[]> buf_;
  std::size_t size_ = 0;
};

}  // namespace hpcdl
