// The prefetcher's staging ring and consumer (include/hpcdl/prefetch/prefetcher.hpp):
// staging threads claim stream positions in order, reserve each batch's ring
// space, and fill it from the best source; the consumer takes whole batches.
#include <algorithm>
#include <cstring>
#include <vector>

#include "hpcdl/prefetch/prefetcher.hpp"
#include "hpcdl/util/thread_setup.hpp"
#include "hpcdl/util/timeline.hpp"

namespace hpcdl {

std::uint64_t Prefetcher::staging_size() const {
  std::uint64_t largest = 1;
  for (auto b : batch_bytes_) largest = std::max(largest, b);
  return std::max(cfg_.staging_bytes, 3 * largest);
}

bool Prefetcher::claim(std::uint64_t* t) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (stopping_ || next_claim_ >= stream_.size()) return false;
    const std::uint64_t rel_batch = next_claim_ / L_;
    if (next_claim_ % L_ == 0) {
      const std::uint64_t need = batch_bytes_[rel_batch];
      const std::uint64_t cap = staging_bytes_;
      std::uint64_t at = alloc_;
      if (at % cap + need > cap) at += cap - at % cap;  // a batch never wraps: skip the tail
      if (at + need - freed_ > cap) {
        space_cv_.wait(lock);
        continue;
      }
      batch_ring_[rel_batch] = at % cap;
      alloc_ = at + need;
      batch_alloc_end_[rel_batch] = alloc_;
    }
    *t = next_claim_++;
    return true;
  }
}

void Prefetcher::release_locked(std::uint64_t b) {
  freed_ = batch_alloc_end_[b - first_batch()];
  space_cv_.notify_all();
}

void Prefetcher::staging_loop() {
  name_this_thread("hpcdl-staging");
  std::vector<char> scratch;
  std::uint64_t t;
  while (claim(&t)) {
    const std::uint64_t rel_batch = t / L_;
    const std::uint64_t k = stream_[t];
    char* dst = staging_.get() + batch_ring_[rel_batch] + batch_offsets_[rel_batch * (L_ + 1) + t % L_];
    scratch.resize(std::max<std::size_t>(scratch.size(), reader_->size(k)));
    const Status st = fetch(k, global_key(cfg_.spec, t, cfg_.rank), dst, scratch.data());
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!st.ok() && batch_error_[rel_batch].ok()) batch_error_[rel_batch] = st;
      ++batch_done_[rel_batch];
    }
    ready_cv_.notify_all();
  }
}

Status Prefetcher::fetch(std::uint64_t k, std::uint64_t at, char* dst, char* scratch) {
  const double t0 = now_us();
  const std::uint64_t size = reader_->size(k);
  const int tier = placement_.tier[k];
  if (tier == kTierRam && ram_ && ensure_slot(kTierRam, k, nullptr, staging_may_load(k)) == kReady) {
    std::memcpy(dst, ram_.get() + placement_.offset[k], size);
    count(kFromRam, size, t0, "fetch ram");
    return Status::OK();
  }
  if (tier == kTierDisk && disk_fd_ >= 0 && ensure_slot(kTierDisk, k, scratch, staging_may_load(k)) == kReady) {
    if (read_disk(k, dst)) {
      count(kFromDisk, size, t0, "fetch disk");
      return Status::OK();
    }
  }
  const int peer = sources_.rank.empty() ? -1 : sources_.for_read(k, at);
  if (tier == kTierStore && peer >= 0 && fetch_peer(peer, k, dst)) {
    count(kFromPeer, size, t0, "fetch peer");
    return Status::OK();
  }
  HPCDL_RETURN_NOT_OK(read_store(k, dst));
  count(kFromStore, size, t0, "fetch store");
  return Status::OK();
}

Status Prefetcher::next_batch(BatchView* out) {
  std::unique_lock<std::mutex> lock(mu_);
  if (next_consume_ > first_batch()) release_locked(next_consume_ - 1);
  if (next_consume_ >= end_batch()) return Status::Invalid("the run has no more batches");
  const std::uint64_t b = next_consume_;
  const double t0 = now_us();
  bool stalled = false;
  while (!stopping_ && batch_done_[b - first_batch()] < L_) {
    stalled = true;
    ready_cv_.wait(lock);
  }
  const double t1 = now_us();
  if (stalled) {
    stats_.stall_seconds += (t1 - t0) * 1e-6;
    Timeline::instance().record("stall", "prefetch", t0, t1, 1);
  }
  if (stopping_) return Status::Cancelled("the prefetcher was closed");
  ++next_consume_;
  if (!batch_error_[b - first_batch()].ok()) return batch_error_[b - first_batch()];
  ++stats_.batches;
  const std::uint64_t t = b * L_;
  out->batch = b;
  out->ring_offset = batch_ring_[b - first_batch()];
  out->bytes = batch_bytes_[b - first_batch()];
  out->samples = stream_.data() + (t - cfg_.start);
  out->offsets = batch_offsets_.data() + (b - first_batch()) * (L_ + 1);
  out->count = L_;
  return Status::OK();
}

}  // namespace hpcdl
