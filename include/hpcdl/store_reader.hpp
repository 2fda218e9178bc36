// StoreReader: reads samples of an hpcdl store (docs/store.md) with plain
// positioned reads. Each shard is an HDF5 file whose sample bytes sit in one
// contiguous, unfiltered uint8 data set; whoever opens the store learns the
// data set's file offset and the per-sample offsets, sizes and CRC32Cs once
// (Python does it with h5py) and hands them over in ShardInfo. From then on
// a sample costs one pread: no HDF5 call, no lock, no metadata lookup.
//
// Thread-safe: read() and read_many() may be called from any number of
// threads at once. The file descriptors survive fork() and pread ignores the
// file position, so a forked child may keep using a reader.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "hpcdl/crc32c.hpp"
#include "hpcdl/status.hpp"
#include "hpcdl/thread_pool.hpp"

namespace hpcdl {

struct ShardInfo {
  std::string path;
  std::uint64_t data_offset = 0;  // file offset of the data set (h5py: dataset.id.get_offset())
  std::uint64_t data_bytes = 0;   // length of the data set
  std::vector<std::uint64_t> offsets;  // per sample, relative to the data set
  std::vector<std::uint64_t> sizes;
  std::vector<std::uint32_t> crc32c;
  // Non-empty: the shard could not be opened (truncated, damaged); it still
  // counts `damaged_count` samples, and reading any of them fails with this reason.
  std::string damaged;
  std::uint64_t damaged_count = 0;
};

class StoreReader {
 public:
  static Status open(std::vector<ShardInfo> shards, std::unique_ptr<StoreReader>* out) {
    std::unique_ptr<StoreReader> r(new StoreReader());
    std::size_t total = 0;
    for (const auto& s : shards) {
      const std::size_t n = s.damaged.empty() ? s.offsets.size() : s.damaged_count;
      if (s.damaged.empty() && (s.sizes.size() != n || s.crc32c.size() != n))
        return Status::Corrupt("shard '" + s.path + "': offsets, sizes and checksums differ in length");
      total += n;
    }
    r->file_offset_.resize(total);
    r->size_.resize(total);
    r->crc_.resize(total);
    r->shard_of_.resize(total);
    std::size_t at = 0;
    for (std::uint32_t k = 0; k < shards.size(); ++k) {
      ShardInfo& s = shards[k];
      Shard sh;
      sh.path = std::move(s.path);
      sh.first = at;
      sh.damaged = std::move(s.damaged);
      if (!sh.damaged.empty()) {
        sh.count = s.damaged_count;
        std::fill(r->shard_of_.begin() + at, r->shard_of_.begin() + at + sh.count, k);
        at += sh.count;
        r->shards_.push_back(std::move(sh));
        continue;
      }
      sh.count = s.offsets.size();
      for (std::size_t j = 0; j < sh.count; ++j, ++at) {
        if (s.offsets[j] > s.data_bytes || s.sizes[j] > s.data_bytes - s.offsets[j])
          return Status::Corrupt("shard '" + sh.path + "': sample " + std::to_string(at) + " (shard-local " +
                                 std::to_string(j) + ") lies outside the data set");
        r->file_offset_[at] = s.data_offset + s.offsets[j];
        r->size_[at] = s.sizes[j];
        r->crc_[at] = s.crc32c[j];
        r->shard_of_[at] = k;
      }
      sh.fd = ::open(sh.path.c_str(), O_RDONLY | O_CLOEXEC);
      if (sh.fd < 0) return Status::IO("cannot open shard '" + sh.path + "': " + std::strerror(errno));
      // Samples are read at random: read-ahead would only waste bandwidth.
      ::posix_fadvise(sh.fd, 0, 0, POSIX_FADV_RANDOM);
      r->shards_.push_back(std::move(sh));
    }
    *out = std::move(r);
    return Status::OK();
  }

  ~StoreReader() {
    for (auto& s : shards_)
      if (s.fd >= 0) ::close(s.fd);
  }
  StoreReader(const StoreReader&) = delete;
  StoreReader& operator=(const StoreReader&) = delete;

  std::size_t count() const { return size_.size(); }
  std::size_t shard_count() const { return shards_.size(); }
  std::uint64_t size(std::size_t i) const { return i < size_.size() ? size_[i] : 0; }
  std::size_t shard_of(std::size_t i) const { return shard_of_[i]; }
  std::size_t shard_first(std::size_t shard) const { return shards_[shard].first; }
  std::size_t shard_samples(std::size_t shard) const { return shards_[shard].count; }
  const std::string& shard_path(std::size_t shard) const { return shards_[shard].path; }
  void set_verify_checksums(bool on) { verify_checksums_ = on; }

  // Reads sample i (size(i) bytes) into dst and checks its CRC32C.
  Status read(std::size_t i, void* dst) const {
    if (i >= size_.size())
      return Status::Invalid("sample index " + std::to_string(i) + " out of range [0, " +
                             std::to_string(size_.size()) + ")");
    const Shard& sh = shards_[shard_of_[i]];
    if (!sh.damaged.empty()) return Status::Corrupt(where(i) + " is unreadable: " + sh.damaged);
    HPCDL_RETURN_NOT_OK(pread_all(sh, i, file_offset_[i], size_[i], dst));
    if (verify_checksums_) {
      const std::uint32_t got = crc32c(dst, size_[i]);
      if (got != crc_[i]) return Status::Corrupt(checksum_message(i, got));
    }
    return Status::OK();
  }

  // Reads samples idx[0..n) into dst: sample k goes to dst + dst_offsets[k]
  // (back to back in order when dst_offsets is null). Spread over `pool`
  // (inline when null). On failure the first failing index goes to *failed.
  Status read_many(const std::uint64_t* idx, std::size_t n, void* dst, const std::uint64_t* dst_offsets,
                   ThreadPool* pool, std::uint64_t* failed = nullptr) const {
    std::vector<std::uint64_t> packed;
    if (!dst_offsets) {
      packed.resize(n);
      std::uint64_t at = 0;
      for (std::size_t k = 0; k < n; ++k) {
        packed[k] = at;
        at += size(idx[k]);
      }
      dst_offsets = packed.data();
    }
    char* base = static_cast<char*>(dst);
    std::mutex mu;
    Status first_error;
    std::size_t first_k = n;
    std::atomic<bool> failed_flag{false};
    auto body = [&](std::size_t begin, std::size_t end) {
      for (std::size_t k = begin; k < end && !failed_flag.load(std::memory_order_relaxed); ++k) {
        Status st = read(idx[k], base + dst_offsets[k]);
        if (!st.ok()) {
          std::lock_guard<std::mutex> lock(mu);
          if (k < first_k) {
            first_k = k;
            first_error = std::move(st);
          }
          failed_flag = true;
        }
      }
    };
    if (pool && n > 1)
      pool->parallel_for(n, kReadGrain, body);
    else
      body(0, n);
    if (!first_error.ok() && failed) *failed = idx[first_k];
    return first_error;
  }

  // Scans one shard front to back in large reads and checks every sample's
  // CRC32C; appends the global index and reason of each bad sample. A shard
  // that could not be opened is one error (its reason), not one per sample.
  Status verify_shard(std::size_t shard, std::vector<std::uint64_t>* bad, std::vector<std::string>* reasons,
                      std::uint64_t* bytes_read) const {
    if (shard >= shards_.size()) return Status::Invalid("shard index out of range");
    const Shard& sh = shards_[shard];
    *bytes_read = 0;
    if (!sh.damaged.empty()) return Status::Corrupt(sh.damaged);
    std::vector<std::size_t> order(sh.count);
    std::iota(order.begin(), order.end(), sh.first);
    std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) { return file_offset_[a] < file_offset_[b]; });
    const std::uint64_t shard_end = last_byte(shard);
    // A scan gets its own descriptor with read-ahead on (the shared one is set for random reads).
    Shard scan = sh;
    scan.fd = ::open(sh.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (scan.fd < 0) return Status::IO("cannot open shard '" + sh.path + "': " + std::strerror(errno));
    ::posix_fadvise(scan.fd, 0, 0, POSIX_FADV_SEQUENTIAL);
    struct Closer {
      int fd;
      ~Closer() { ::close(fd); }
    } closer{scan.fd};
    std::vector<char> buf;
    std::uint64_t buf_start = 0, buf_len = 0;
    for (std::size_t i : order) {
      const std::uint64_t off = file_offset_[i], len = size_[i];
      if (off < buf_start || off + len > buf_start + buf_len) {
        buf_start = off;
        buf_len = std::max<std::uint64_t>(len, std::min<std::uint64_t>(kScanBlock, shard_end - off));
        buf.resize(buf_len);
        std::uint64_t got = 0;
        HPCDL_RETURN_NOT_OK(pread_some(scan, i, off, buf_len, buf.data(), &got));
        *bytes_read += got;
        buf_len = got;  // a short read: the samples past it are reported truncated below
      }
      if (off + len > buf_start + buf_len) {
        bad->push_back(i);
        reasons->push_back("truncated: the shard file ends before this sample's last byte");
        continue;
      }
      const std::uint32_t got = crc32c(buf.data() + (off - buf_start), len);
      if (got != crc_[i]) {
        bad->push_back(i);
        reasons->push_back(checksum_message(i, got));
      }
    }
    return Status::OK();
  }

 private:
  static constexpr std::size_t kReadGrain = 8;
  static constexpr std::uint64_t kScanBlock = 8u << 20;

  struct Shard {
    std::string path;
    int fd = -1;
    std::size_t first = 0, count = 0;
    std::string damaged;
  };

  StoreReader() = default;

  std::uint64_t last_byte(std::size_t shard) const {
    const Shard& sh = shards_[shard];
    std::uint64_t end = 0;
    for (std::size_t i = sh.first; i < sh.first + sh.count; ++i) end = std::max(end, file_offset_[i] + size_[i]);
    return end;
  }

  std::string where(std::size_t i) const {
    const Shard& sh = shards_[shard_of_[i]];
    return "sample " + std::to_string(i) + " (shard '" + sh.path + "', shard-local " + std::to_string(i - sh.first) + ")";
  }

  std::string checksum_message(std::size_t i, std::uint32_t got) const {
    char buf[64];
    std::snprintf(buf, sizeof buf, "stored crc32c 0x%08x, read 0x%08x", crc_[i], got);
    return "checksum mismatch in " + where(i) + ": " + buf + " (the shard is corrupted; re-pack it)";
  }

  // Reads up to len bytes at off; *got < len only at end of file.
  Status pread_some(const Shard& sh, std::size_t i, std::uint64_t off, std::uint64_t len, void* dst,
                    std::uint64_t* got) const {
    char* p = static_cast<char*>(dst);
    *got = 0;
    while (*got < len) {
      const ssize_t r = ::pread(sh.fd, p + *got, len - *got, static_cast<off_t>(off + *got));
      if (r < 0) {
        if (errno == EINTR) continue;
        return Status::IO("reading " + where(i) + " failed: " + std::strerror(errno));
      }
      if (r == 0) break;
      *got += static_cast<std::uint64_t>(r);
    }
    return Status::OK();
  }

  Status pread_all(const Shard& sh, std::size_t i, std::uint64_t off, std::uint64_t len, void* dst) const {
    std::uint64_t got = 0;
    HPCDL_RETURN_NOT_OK(pread_some(sh, i, off, len, dst, &got));
    if (got < len)
      return Status::Corrupt(where(i) + " is truncated: the shard file ends " + std::to_string(len - got) +
                             " bytes before the sample's end");
    return Status::OK();
  }

  std::vector<Shard> shards_;
  std::vector<std::uint64_t> file_offset_;  // per sample: where its bytes start in its shard file
  std::vector<std::uint64_t> size_;
  std::vector<std::uint32_t> crc_;
  std::vector<std::uint32_t> shard_of_;
  bool verify_checksums_ = true;
};

}  // namespace hpcdl
