// StoreReader (include/hpcdl/store/store_reader.hpp): one pread per sample, CRC32C checked.
#include "hpcdl/store/store_reader.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <numeric>
#include <utility>

#include "hpcdl/util/crc32c.hpp"

namespace hpcdl {

Status StoreReader::open(std::vector<ShardInfo> shards, std::unique_ptr<StoreReader>* out) {
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

StoreReader::~StoreReader() {
  for (auto& s : shards_)
    if (s.fd >= 0) ::close(s.fd);
}

Status StoreReader::read(std::size_t i, void* dst) const {
  if (i >= size_.size())
    return Status::Invalid("sample index " + std::to_string(i) + " out of range [0, " + std::to_string(size_.size()) +
                           ")");
  const Shard& sh = shards_[shard_of_[i]];
  if (!sh.damaged.empty()) return Status::Corrupt(where(i) + " is unreadable: " + sh.damaged);
  HPCDL_RETURN_NOT_OK(pread_all(sh, i, file_offset_[i], size_[i], dst));
  return verify(i, dst);
}

Status StoreReader::read_span(const std::uint64_t* idx, std::size_t n, char* dst, std::uint64_t* span_bytes) const {
  *span_bytes = 0;
  if (n == 0) return Status::OK();
  for (std::size_t k = 0; k < n; ++k)
    if (idx[k] >= size_.size() || shard_of_[idx[k]] != shard_of_[idx[0]] ||
        (k > 0 && file_offset_[idx[k]] < file_offset_[idx[k - 1]]))
      return Status::Invalid("read_span: samples must be valid, in one shard, sorted by file offset");
  const Shard& sh = shards_[shard_of_[idx[0]]];
  if (!sh.damaged.empty()) return Status::Corrupt(where(idx[0]) + " is unreadable: " + sh.damaged);
  const std::uint64_t start = file_offset_[idx[0]];
  std::uint64_t end = start;
  for (std::size_t k = 0; k < n; ++k) end = std::max(end, file_offset_[idx[k]] + size_[idx[k]]);
  HPCDL_RETURN_NOT_OK(pread_all(sh, idx[0], start, end - start, dst));
  *span_bytes = end - start;
  return Status::OK();
}

Status StoreReader::verify(std::size_t i, const void* bytes) const {
  if (!verify_checksums_) return Status::OK();
  const std::uint32_t got = crc32c(bytes, size_[i]);
  return got == crc_[i] ? Status::OK() : Status::Corrupt(checksum_message(i, got));
}

Status StoreReader::read_many(const std::uint64_t* idx, std::size_t n, void* dst, const std::uint64_t* dst_offsets,
                              ThreadPool* pool, std::uint64_t* failed) const {
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

Status StoreReader::verify_shard(std::size_t shard, std::vector<std::uint64_t>* bad, std::vector<std::string>* reasons,
                                 std::uint64_t* bytes_read) const {
  if (shard >= shards_.size()) return Status::Invalid("shard index out of range");
  const Shard& sh = shards_[shard];
  *bytes_read = 0;
  if (!sh.damaged.empty()) return Status::Corrupt(sh.damaged);
  std::vector<std::size_t> order(sh.count);
  std::iota(order.begin(), order.end(), sh.first);
  std::sort(order.begin(), order.end(),
            [&](std::size_t a, std::size_t b) { return file_offset_[a] < file_offset_[b]; });
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

std::uint64_t StoreReader::last_byte(std::size_t shard) const {
  const Shard& sh = shards_[shard];
  std::uint64_t end = 0;
  for (std::size_t i = sh.first; i < sh.first + sh.count; ++i) end = std::max(end, file_offset_[i] + size_[i]);
  return end;
}

std::string StoreReader::where(std::size_t i) const {
  const Shard& sh = shards_[shard_of_[i]];
  return "sample " + std::to_string(i) + " (shard '" + sh.path + "', shard-local " + std::to_string(i - sh.first) + ")";
}

std::string StoreReader::checksum_message(std::size_t i, std::uint32_t got) const {
  char buf[64];
  std::snprintf(buf, sizeof buf, "stored crc32c 0x%08x, read 0x%08x", crc_[i], got);
  return "checksum mismatch in " + where(i) + ": " + buf + " (the shard is corrupted; re-pack it)";
}

Status StoreReader::pread_some(const Shard& sh, std::size_t i, std::uint64_t off, std::uint64_t len, void* dst,
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

Status StoreReader::pread_all(const Shard& sh, std::size_t i, std::uint64_t off, std::uint64_t len, void* dst) const {
  std::uint64_t got = 0;
  HPCDL_RETURN_NOT_OK(pread_some(sh, i, off, len, dst, &got));
  if (got < len)
    return Status::Corrupt(where(i) + " is truncated: the shard file ends " + std::to_string(len - got) +
                           " bytes before the sample's end");
  return Status::OK();
}

}  // namespace hpcdl
