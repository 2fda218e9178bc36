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
// Implementation: src/store/store_reader.cc.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hpcdl/util/status.hpp"
#include "hpcdl/util/thread_pool.hpp"

namespace hpcdl {

// Files a rank reads at once unless told otherwise (hpcdl.store.Store, `hpcdl verify --threads`).
constexpr std::size_t kDefaultReaderThreads = 8;

struct ShardInfo {
  std::string path;
  std::uint64_t data_offset = 0;       // file offset of the data set (h5py: dataset.id.get_offset())
  std::uint64_t data_bytes = 0;        // length of the data set
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
  static Status open(std::vector<ShardInfo> shards, std::unique_ptr<StoreReader>* out);

  ~StoreReader();
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
  Status read(std::size_t i, void* dst) const;

  // Reads samples idx[0..n) into dst: sample k goes to dst + dst_offsets[k]
  // (back to back in order when dst_offsets is null). Spread over `pool`
  // (inline when null). On failure the first failing index goes to *failed.
  Status read_many(const std::uint64_t* idx, std::size_t n, void* dst, const std::uint64_t* dst_offsets,
                   ThreadPool* pool, std::uint64_t* failed = nullptr) const;

  // Where sample i's bytes start in its shard file (coalesced reads sort and merge by it).
  std::uint64_t file_offset(std::size_t i) const { return file_offset_[i]; }

  // One pread of the span of samples idx[0..n) (one shard, sorted by file
  // offset) into dst: sample idx[k] lands at dst + file_offset(idx[k]) -
  // file_offset(idx[0]); gap bytes between them are read too. No checksum
  // check here (verify() each sample). *span_bytes: the bytes read.
  Status read_span(const std::uint64_t* idx, std::size_t n, char* dst, std::uint64_t* span_bytes) const;
  // Checks sample i's bytes (read by read_span) against its stored CRC32C.
  Status verify(std::size_t i, const void* bytes) const;
  // Sample i's CRC32C as the store's index records it.
  std::uint32_t checksum(std::size_t i) const { return crc_[i]; }

  // Scans one shard front to back in large reads and checks every sample's
  // CRC32C; appends the global index and reason of each bad sample. A shard
  // that could not be opened is one error (its reason), not one per sample.
  Status verify_shard(std::size_t shard, std::vector<std::uint64_t>* bad, std::vector<std::string>* reasons,
                      std::uint64_t* bytes_read) const;

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

  std::uint64_t last_byte(std::size_t shard) const;
  std::string where(std::size_t i) const;
  std::string checksum_message(std::size_t i, std::uint32_t got) const;
  // Reads up to len bytes at off; *got < len only at end of file.
  Status pread_some(const Shard& sh, std::size_t i, std::uint64_t off, std::uint64_t len, void* dst,
                    std::uint64_t* got) const;
  Status pread_all(const Shard& sh, std::size_t i, std::uint64_t off, std::uint64_t len, void* dst) const;

  std::vector<Shard> shards_;
  std::vector<std::uint64_t> file_offset_;  // per sample: where its bytes start in its shard file
  std::vector<std::uint64_t> size_;
  std::vector<std::uint32_t> crc_;
  std::vector<std::uint32_t> shard_of_;
  bool verify_checksums_ = true;
};

}  // namespace hpcdl
