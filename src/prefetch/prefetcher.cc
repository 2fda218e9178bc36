// Prefetcher (include/hpcdl/prefetch/prefetcher.hpp): set-up, threads, shutdown.
#include "hpcdl/prefetch/prefetcher.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <utility>

#include "hpcdl/util/thread_setup.hpp"

namespace hpcdl {

Status Prefetcher::create(std::unique_ptr<StoreReader> reader, PrefetchConfig cfg, std::unique_ptr<Prefetcher>* out) {
  if (cfg.spec.samples != reader->count())
    return Status::Invalid("stream spec and store disagree on the number of samples");
  std::unique_ptr<Prefetcher> p(new Prefetcher());
  p->cfg_ = std::move(cfg);
  p->reader_ = std::move(reader);
  HPCDL_RETURN_NOT_OK(p->plan());
  p->staging_bytes_ = p->staging_size();
  p->staging_.reset(static_cast<char*>(std::malloc(p->staging_bytes_)), std::free);
  if (!p->staging_)
    return Status::Invalid("cannot allocate the staging buffer (" + std::to_string(p->staging_bytes_) + " bytes)");
  p->stats_.staging_bytes = p->staging_bytes_;
  *out = std::move(p);
  return Status::OK();
}

Status Prefetcher::start(MPI_Comm comm) {
  if (!cfg_.peer_ram_bytes.empty() && end_ > cfg_.start) {
    HPCDL_RETURN_NOT_OK(PeerService::create(
        comm, [this](std::uint64_t k, char* dst) { return serve_peer(k, dst); },
        [this](std::uint64_t k) { return reader_->size(k); }, cfg_.peer_timeout, cfg_.serve_delay,
        cfg_.peer_message_bytes, &peers_));
    peer_gone_.reset(new std::atomic<bool>[peers_->size()]);
    for (int q = 0; q < peers_->size(); ++q) peer_gone_[q] = false;
  }
  return start_threads();
}

Prefetcher::~Prefetcher() {
  stop();
  peers_.reset();  // its server reads the tiers: stop it before they go
}

Status Prefetcher::close(double timeout_s) {
  stop();
  Status st;
  if (peers_) {
    st = peers_->shutdown(timeout_s);  // after it, every request to this rank was answered
    stats_.served_to_peers = peers_->served();
    peers_.reset();
  }
  if (disk_fd_ >= 0) {
    ::close(disk_fd_);  // the file was unlinked at creation: closing frees it
    disk_fd_ = -1;
  }
  return st;
}

Status Prefetcher::start_threads() {
  if (next_claim_ + cfg_.start >= end_) return Status::OK();
  Status st;
  auto start = [&](const char* what, auto fn) {
    if (st.ok()) st = start_thread(what, fn, &threads_);
  };
  for (std::size_t i = 0; i < std::max<std::size_t>(cfg_.staging_threads, 1); ++i)
    start("the prefetcher's staging thread", [this] { staging_loop(); });
  if (cfg_.read_bytes > 0) {  // coalesced: the tiers' fillers share one list of spans
    const std::size_t fillers = (ram_ ? std::max<std::size_t>(cfg_.ram_threads, 1) : 0) +
                                (disk_fd_ >= 0 ? std::max<std::size_t>(cfg_.disk_threads, 1) : 0);
    for (std::size_t i = 0; i < fillers && !store_fill_order_.empty(); ++i)
      start("the prefetcher's fill thread", [this] { coalesced_fill_loop(); });
  } else {
    if (ram_)
      for (std::size_t i = 0; i < std::max<std::size_t>(cfg_.ram_threads, 1); ++i)
        start("the prefetcher's RAM fill thread", [this] { fill_loop(kTierRam); });
    if (disk_fd_ >= 0)
      for (std::size_t i = 0; i < std::max<std::size_t>(cfg_.disk_threads, 1); ++i)
        start("the prefetcher's disk fill thread", [this] { fill_loop(kTierDisk); });
  }
  if (peers_ && !peer_fills_list_.empty()) start("the prefetcher's peer fill thread", [this] { peer_fill_loop(); });
  if (!st.ok()) stop();  // the threads already started must not run on a prefetcher that failed
  return st;
}

void Prefetcher::stop() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopping_ = true;
  }
  ready_cv_.notify_all();
  space_cv_.notify_all();
  { std::lock_guard<std::mutex> g(slot_mu_); }
  slot_cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
}

}  // namespace hpcdl
