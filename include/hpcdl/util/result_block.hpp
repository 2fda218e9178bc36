// Memory for the results the engine hands to Python (allgather, alltoall,
// reducescatter), recycled: when a result's last view goes, its block waits
// in a small pool, and the next result that fits takes it with its pages
// already mapped: on the emulated 4-host cluster an alltoall of 64 MiB per
// rank into a fresh block each call took 1.2-1.4x MPI_Alltoallv's time, into
// a recycled one 1.0-1.1x (docs/performance.md). Only large blocks are kept:
// glibc serves smaller ones from its heap and reuses them itself, and keeping
// them measured slower at 1 MiB. Contents are unspecified.
#pragma once

#include <cstddef>
#include <mutex>
#include <utility>
#include <vector>

namespace hpcdl {

class ResultBlock {
 public:
  // The pool keeps at most this many blocks (the most recently given back):
  // enough for a training step's few result sizes, a bounded amount held.
  static constexpr std::size_t kKeptBlocks = 4;
  // Blocks this large or larger are kept: glibc's largest mmap threshold, above
  // which every block it allocates is a fresh mapping.
  static constexpr std::size_t kKeptFromBytes = std::size_t(32) << 20;
  // ... and at most this many bytes in all, so a one-off huge result is not held after it goes.
  static constexpr std::size_t kKeptMaxBytes = std::size_t(1) << 30;

  ResultBlock() = default;
  ResultBlock(ResultBlock&& other) noexcept { swap(other); }
  ResultBlock& operator=(ResultBlock&& other) noexcept {
    ResultBlock(std::move(other)).swap(*this);
    return *this;
  }
  ResultBlock(const ResultBlock&) = delete;
  ResultBlock& operator=(const ResultBlock&) = delete;
  ~ResultBlock() { pool().give_back(data_, capacity_); }

  // At least `bytes` (>= 1): a kept block of bytes..2 x bytes if there is one, else a new one.
  static ResultBlock take(std::size_t bytes) {
    ResultBlock b;
    if (!pool().take(bytes, &b.data_, &b.capacity_)) {
      b.data_ = new char[bytes];
      b.capacity_ = bytes;
    }
    return b;
  }

  char* get() const { return data_; }

 private:
  void swap(ResultBlock& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(capacity_, other.capacity_);
  }

  class Pool {
   public:
    bool take(std::size_t bytes, char** data, std::size_t* capacity) {
      if (bytes < kKeptFromBytes) return false;
      std::lock_guard<std::mutex> lock(mu_);
      for (std::size_t i = kept_.size(); i-- > 0;) {  // the most recently given back first
        if (kept_[i].second < bytes || kept_[i].second / 2 > bytes) continue;
        *data = kept_[i].first;
        *capacity = kept_[i].second;
        kept_bytes_ -= kept_[i].second;
        kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(i));
        return true;
      }
      return false;
    }
    void give_back(char* data, std::size_t capacity) {
      if (capacity < kKeptFromBytes || capacity > kKeptMaxBytes) {
        delete[] data;
        return;
      }
      std::vector<char*> dropped;
      {
        std::lock_guard<std::mutex> lock(mu_);
        kept_.emplace_back(data, capacity);
        kept_bytes_ += capacity;
        while (kept_.size() > kKeptBlocks || kept_bytes_ > kKeptMaxBytes) {
          dropped.push_back(kept_.front().first);
          kept_bytes_ -= kept_.front().second;
          kept_.erase(kept_.begin());
        }
      }
      for (char* block : dropped) delete[] block;  // outside the lock: unmapping a large block takes a while
    }

   private:
    std::mutex mu_;
    std::vector<std::pair<char*, std::size_t>> kept_;  // oldest first
    std::size_t kept_bytes_ = 0;
  };

  // Never destroyed: a result Python still holds at exit gives its block back after static destructors ran.
  static Pool& pool() {
    static Pool* p = new Pool();
    return *p;
  }

  char* data_ = nullptr;
  std::size_t capacity_ = 0;
};

}  // namespace hpcdl
