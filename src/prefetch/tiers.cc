// The prefetcher's tiers (include/hpcdl/prefetch/prefetcher.hpp): the RAM arena and
// the disk tier's unnamed file, their per-sample slots, the store fillers,
// and serving a loaded slot to a peer.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>

#include "hpcdl/prefetch/prefetcher.hpp"
#include "hpcdl/util/crc32c.hpp"
#include "hpcdl/util/thread_setup.hpp"
#include "hpcdl/util/timeline.hpp"

namespace hpcdl {

void Prefetcher::disable_tier(int tier) {
  for (std::uint64_t k : placement_.lists[tier]) {
    std::uint8_t expected = kEmpty;
    slots_[tier][k].compare_exchange_strong(expected, kFailed);
  }
}

void Prefetcher::open_disk() {
  const std::string& dir = cfg_.disk_dir;
  struct stat st;
  if (::stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    warn("disk tier: directory '" + dir + "' does not exist; its samples come from the backing store");
    disable_tier(kTierDisk);
    return;
  }
  // An unnamed file: nothing is left behind, whatever way the process ends.
  int fd = ::open(dir.c_str(), O_TMPFILE | O_RDWR | O_CLOEXEC, 0600);
  if (fd < 0 && errno != EACCES && errno != EROFS && errno != ENOSPC) {
    std::string path = dir + "/.hpcdl-prefetch-XXXXXX";
    fd = ::mkostemp(&path[0], O_CLOEXEC);
    if (fd >= 0) ::unlink(path.c_str());
  }
  if (fd < 0) {
    warn("disk tier: cannot create a file in '" + dir + "': " + std::strerror(errno) +
         "; its samples come from the backing store");
    disable_tier(kTierDisk);
    return;
  }
  disk_fd_ = fd;
}

std::uint8_t Prefetcher::ensure_slot(int tier, std::uint64_t k, char* scratch, bool may_load) {
  std::atomic<std::uint8_t>& slot = slots_[tier][k];
  for (;;) {
    std::uint8_t state = slot.load();
    if (state == kReady || state == kFailed) return state;
    if (state == kEmpty && may_load && slot.compare_exchange_strong(state, kLoading)) {
      const bool ok = load_slot(tier, k, scratch);
      finish_slot(tier, k, ok);
      return ok ? kReady : kFailed;
    }
    std::unique_lock<std::mutex> lock(slot_mu_);
    slot_cv_.wait(lock, [&] { return stopping_ || slot.load() >= kReady; });
    if (stopping_ && slot.load() < kReady) return kFailed;
  }
}

bool Prefetcher::load_slot(int tier, std::uint64_t k, char* scratch) {
  const double t0 = now_us();
  if (tier == kTierDisk && disk_failed_) return false;
  char* dst = tier == kTierRam ? ram_.get() + placement_.offset[k] : scratch;
  if (fill_source_[k] >= 0 && fetch_peer(fill_source_[k], k, dst)) return commit_slot(tier, k, dst, true, t0);
  return fill_from_store(tier, k, dst, t0);
}

bool Prefetcher::fill_from_store(int tier, std::uint64_t k, char* dst, double t0) {
  if (tier == kTierDisk && disk_failed_) return false;
  return read_store(k, dst).ok() && commit_slot(tier, k, dst, false, t0);
}

bool Prefetcher::commit_slot(int tier, std::uint64_t k, const char* bytes, bool from_peer, double t0) {
  const std::uint64_t size = reader_->size(k);
  peer_fills_ += from_peer;
  if (tier == kTierRam) {
    ++ram_loaded_;
    Timeline::instance().record(from_peer ? "load ram from peer" : "load ram", "prefetch", t0, now_us(), 1);
    return true;
  }
  if (disk_failed_) return false;
  const std::uint64_t at = placement_.offset[k];
  for (std::uint64_t done = 0; done < size;) {
    const ssize_t w = ::pwrite(disk_fd_, bytes + done, size - done, static_cast<off_t>(at + done));
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (!disk_failed_.exchange(true))
        warn(std::string("disk tier: writing to '") + cfg_.disk_dir + "' failed (" +
             (w < 0 ? std::strerror(errno) : "no progress") +
             "); the samples not yet cached there come from the backing store");
      return false;
    }
    done += static_cast<std::uint64_t>(w);
  }
  ++disk_written_;
  Timeline::instance().record(from_peer ? "load disk from peer" : "load disk", "prefetch", t0, now_us(), 1);
  return true;
}

void Prefetcher::finish_slot(int tier, std::uint64_t k, bool ok) {
  {
    std::lock_guard<std::mutex> g(slot_mu_);
    slots_[tier][k] = ok ? kReady : kFailed;
  }
  slot_cv_.notify_all();
}

Status Prefetcher::read_store(std::uint64_t k, char* dst) {
  const std::uint64_t size = reader_->size(k);
  store_reads_ += size > 0;  // an empty sample costs no I/O
  store_requests_ += size > 0;
  store_bytes_ += size;
  return reader_->read(k, dst);
}

bool Prefetcher::read_disk(std::uint64_t k, char* dst) {
  const std::uint64_t size = reader_->size(k), at = placement_.offset[k];
  for (std::uint64_t done = 0; done < size;) {
    const ssize_t r = ::pread(disk_fd_, dst + done, size - done, static_cast<off_t>(at + done));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      warn_disk_read_once(std::string("reading the disk tier failed: ") +
                          (r < 0 ? std::strerror(errno) : "short read"));
      return false;
    }
    done += static_cast<std::uint64_t>(r);
  }
  if (crc32c(dst, size) != reader_->checksum(k)) {
    warn_disk_read_once("the disk tier returned bytes that fail their CRC32C (sample " + std::to_string(k) + ")");
    return false;
  }
  return true;
}

void Prefetcher::warn_disk_read_once(const std::string& what) {
  if (!disk_read_warned_.exchange(true)) warn("disk tier: " + what + "; reading those samples from the backing store");
}

void Prefetcher::fill_loop(int tier) {
  name_this_thread(tier == kTierRam ? "hpcdl-fill-ram" : "hpcdl-fill-disk");
  std::vector<char> scratch;
  const auto& list = store_fills_[tier];
  for (;;) {
    const std::uint64_t i = fill_next_[tier]++;
    if (i >= list.size() || stopping_ || (tier == kTierDisk && disk_failed_)) return;
    const std::uint64_t k = list[i];
    if (tier == kTierDisk) scratch.resize(std::max<std::size_t>(scratch.size(), reader_->size(k)));
    ensure_slot(tier, k, scratch.data());
  }
}

PeerService::Serve Prefetcher::serve_peer(std::uint64_t k, char* dst) {
  using Serve = PeerService::Serve;
  if (k >= cfg_.spec.samples || placement_.tier[k] == kTierStore) return Serve::kNotHere;
  const int tier = placement_.tier[k];
  const std::uint8_t state = slots_[tier][k].load();
  if (state == kReady) {
    if (tier == kTierRam) {
      std::memcpy(dst, ram_.get() + placement_.offset[k], reader_->size(k));
      return Serve::kServed;
    }
    return read_disk(k, dst) ? Serve::kServed : Serve::kNotHere;
  }
  const bool tier_gone = tier == kTierRam ? !ram_ : (disk_fd_ < 0 || disk_failed_);
  return state == kFailed || stopping_ || tier_gone ? Serve::kNotHere : Serve::kLater;
}

}  // namespace hpcdl
