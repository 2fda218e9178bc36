// A float array held in pieces: the concatenation of the segments, in order,
// is the array, and an element's index is its offset in that concatenation.
// The top-k allreduce reads and writes a bucket's gradients where they lie
// (one tensor per parameter) instead of a copy of them in one buffer.
#pragma once

#include <cstddef>
#include <cstring>

namespace hpcdl {

struct FloatSegment {
  float* data = nullptr;
  std::size_t count = 0;
};

// A view of segments the caller owns (one segment: a plain array).
class FloatSegments {
 public:
  FloatSegments(const FloatSegment* segments, std::size_t size) : segments_(segments), size_(size) {}
  std::size_t size() const { return size_; }
  const FloatSegment& operator[](std::size_t i) const { return segments_[i]; }
  const FloatSegment* begin() const { return segments_; }
  const FloatSegment* end() const { return segments_ + size_; }
  std::size_t total() const {
    std::size_t n = 0;
    for (const FloatSegment& s : *this) n += s.count;
    return n;
  }
  void zero() const {
    for (const FloatSegment& s : *this) std::memset(s.data, 0, s.count * sizeof(float));
  }

 private:
  const FloatSegment* segments_;
  std::size_t size_;
};

// Elements visited at ascending indices: a cursor walks the segments once.
class AscendingCursor {
 public:
  explicit AscendingCursor(const FloatSegments& segments) : segments_(segments) {}
  float& at(std::size_t index) {
    while (index >= base_ + segments_[seg_].count) base_ += segments_[seg_++].count;
    return segments_[seg_].data[index - base_];
  }

 private:
  const FloatSegments& segments_;
  std::size_t seg_ = 0, base_ = 0;
};

}  // namespace hpcdl
