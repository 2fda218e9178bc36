// What the prefetcher reports (include/hpcdl/prefetch/prefetcher.hpp): per-source
// counters and their trace events, the stats snapshot, and warnings.
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "hpcdl/prefetch/prefetcher.hpp"
#include "hpcdl/util/timeline.hpp"

namespace hpcdl {

void Prefetcher::count(Source s, std::uint64_t size, double t0, const char* name) {
  ++hits_[s];
  bytes_[s] += size;
  Timeline::instance().record(name, "prefetch", t0, now_us(), 1);
}

PrefetchStats Prefetcher::stats() {
  std::lock_guard<std::mutex> g(mu_);
  PrefetchStats s = stats_;
  for (int i = 0; i < kSources; ++i) {
    s.hits[i] = hits_[i];
    s.bytes[i] = bytes_[i];
  }
  s.peer_misses = peer_misses_;
  s.peer_timeouts = peer_timeouts_;
  s.peer_waits = peer_waits_;
  s.peer_errors = peer_errors_;
  s.peer_damaged = peer_damaged_;
  for (std::size_t q = 0; peer_gone_ && q < cfg_.peer_ram_bytes.size(); ++q) s.peers_gone += peer_gone_[q].load();
  s.peer_fills = peer_fills_;
  s.store_reads = store_reads_;
  s.store_requests = store_requests_;
  s.store_bytes = store_bytes_;
  s.ram_loaded = ram_loaded_;
  s.disk_written = disk_written_;
  if (peers_) s.served_to_peers = peers_->served();
  return s;
}

std::vector<std::string> Prefetcher::take_warnings() {
  std::lock_guard<std::mutex> g(warn_mu_);
  std::vector<std::string> w;
  w.swap(warnings_);
  return w;
}

void Prefetcher::warn(std::string message) {
  std::lock_guard<std::mutex> g(warn_mu_);
  warnings_.push_back(std::move(message));
}

}  // namespace hpcdl
