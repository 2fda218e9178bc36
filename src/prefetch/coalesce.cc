// The prefetcher's coalesced store fills (include/hpcdl/prefetch/prefetcher.hpp).
//
// The store fills (tier slots no peer serves) are known for the whole run.
// Instead of one read per sample in first-use order, a filler takes the next
// lookahead_bytes of them, sorts them by (shard, file offset) and reads each
// run of neighbours as one span: samples whose gap is at most read_gap
// merge, a span is at most read_bytes (a larger sample is a span alone);
// spans are read soonest-needed first. The
// samples go to their RAM or disk slots, each checked against its CRC32C, so
// a slow store pays one IOPS per span instead of one per sample. The consumer
// is served from the tiers as before; a staging thread that needs one of these
// samples waits for its slot (fillers never wait on staging: no deadlock)
// instead of reading it alone, which would cost the IOPS the spans save.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>
#include <tuple>
#include <vector>

#include "hpcdl/prefetch/prefetcher.hpp"
#include "hpcdl/util/thread_setup.hpp"
#include "hpcdl/util/timeline.hpp"

namespace hpcdl {

bool Prefetcher::take_window(std::vector<std::uint64_t>* window) {
  window->clear();
  std::lock_guard<std::mutex> g(window_mu_);
  std::uint64_t bytes = 0;
  while (window_next_ < store_fill_order_.size() && (window->empty() || bytes < cfg_.lookahead_bytes)) {
    const std::uint64_t k = store_fill_order_[window_next_++];
    const int tier = placement_.tier[k];
    std::uint8_t expected = kEmpty;
    if (!slots_[tier][k].compare_exchange_strong(expected, kLoading)) continue;  // a peer fill fell back here
    if (tier == kTierDisk && disk_failed_) {
      finish_slot(tier, k, false);  // the disk tier failed: staging reads it from the store
      continue;
    }
    window->push_back(k);
    bytes += reader_->size(k);
  }
  return !window->empty() || window_next_ < store_fill_order_.size();
}

void Prefetcher::coalesced_fill_loop() {
  name_this_thread("hpcdl-fill-span");
  std::vector<std::uint64_t> window;
  std::vector<std::tuple<std::uint64_t, std::size_t, std::size_t>> spans;  // (first use, begin, end) in window
  std::vector<char> buf;
  while (!stopping_ && take_window(&window)) {
    std::sort(window.begin(), window.end(), [&](std::uint64_t a, std::uint64_t b) {
      const auto sa = reader_->shard_of(a), sb = reader_->shard_of(b);
      return sa != sb ? sa < sb : reader_->file_offset(a) < reader_->file_offset(b);
    });
    spans.clear();
    std::size_t begin = 0;
    while (begin < window.size()) {
      const std::uint64_t first = window[begin];
      const std::uint64_t start = reader_->file_offset(first);
      std::uint64_t end = start + reader_->size(first);
      std::size_t stop = begin + 1;
      for (; stop < window.size(); ++stop) {
        const std::uint64_t k = window[stop], at = reader_->file_offset(k);
        const std::uint64_t k_end = std::max(end, at + reader_->size(k));
        if (reader_->shard_of(k) != reader_->shard_of(first) || at > end + cfg_.read_gap ||
            k_end - start > cfg_.read_bytes)
          break;
        end = k_end;
      }
      std::uint64_t need = placement_.first[window[begin]];
      for (std::size_t j = begin; j < stop; ++j) need = std::min(need, placement_.first[window[j]]);
      spans.push_back({need, begin, stop});
      begin = stop;
    }
    // The span holding the soonest-needed sample first: sorting by offset must not delay the consumer.
    std::sort(spans.begin(), spans.end());
    for (const auto& sp : spans) {
      const bool gated = enter_read_gate(std::get<0>(sp));  // false: stopping, and load_span releases the slots
      load_span(window.data() + std::get<1>(sp), std::get<2>(sp) - std::get<1>(sp), &buf);
      if (gated) leave_read_gate();
    }
  }
}

// Fillers each hold a window of spans; without the gate all of them read at
// once and the span needed next shares the store's bandwidth with spans
// needed windows later. Where concurrent reads add no bandwidth (one throttled
// device), one read at a time in need order delivers the same bytes sooner.
bool Prefetcher::enter_read_gate(std::uint64_t need) {
  if (cfg_.read_concurrency == 0) return !stopping_;
  std::unique_lock<std::mutex> g(gate_mu_);
  const auto mine = gate_waiting_.insert(need);
  // Polled for stopping_ (set under another mutex) every 20 ms; entries leave the gate promptly.
  while (!stopping_ && !(gate_reading_ < cfg_.read_concurrency && gate_waiting_.begin() == mine))
    gate_cv_.wait_for(g, std::chrono::milliseconds(20));
  gate_waiting_.erase(mine);
  if (stopping_) {
    gate_cv_.notify_all();
    return false;
  }
  ++gate_reading_;
  gate_cv_.notify_all();  // the next soonest may also fit
  return true;
}

void Prefetcher::leave_read_gate() {
  if (cfg_.read_concurrency == 0) return;
  {
    std::lock_guard<std::mutex> g(gate_mu_);
    --gate_reading_;
  }
  gate_cv_.notify_all();
}

void Prefetcher::load_span(const std::uint64_t* idx, std::size_t n, std::vector<char>* buf) {
  const double t0 = now_us();
  if (stopping_) {  // claimed but not read: released (their waiters see stopping_ too)
    for (std::size_t j = 0; j < n; ++j) finish_slot(placement_.tier[idx[j]], idx[j], false);
    return;
  }
  const std::uint64_t start = reader_->file_offset(idx[0]);
  std::uint64_t span = 0, end = start;
  for (std::size_t j = 0; j < n; ++j) end = std::max(end, reader_->file_offset(idx[j]) + reader_->size(idx[j]));
  if (end > start) {
    buf->resize(std::max<std::size_t>(buf->size(), end - start));
    if (!reader_->read_span(idx, n, buf->data(), &span).ok()) {
      // Read each alone: a bad sample then fails only its own slot (its batch gets the reader's error).
      for (std::size_t j = 0; j < n; ++j) {
        const int tier = placement_.tier[idx[j]];
        buf->resize(std::max<std::size_t>(buf->size(), reader_->size(idx[j])));
        char* dst = tier == kTierRam ? ram_.get() + placement_.offset[idx[j]] : buf->data();
        finish_slot(tier, idx[j], fill_from_store(tier, idx[j], dst, t0));
      }
      return;
    }
    ++store_requests_;
    store_bytes_ += span;
    if (cfg_.span_delay > 0) std::this_thread::sleep_for(std::chrono::duration<double>(cfg_.span_delay));
  }
  for (std::size_t j = 0; j < n; ++j) {
    const std::uint64_t k = idx[j], size = reader_->size(k);
    const int tier = placement_.tier[k];
    const char* bytes = buf->data() + (reader_->file_offset(k) - start);
    store_reads_ += size > 0;
    bool ok = size == 0 || reader_->verify(k, bytes).ok();  // a bad one fails its slot: staging reads it and reports it
    if (ok && tier == kTierRam) {
      std::memcpy(ram_.get() + placement_.offset[k], bytes, size);
      bytes = ram_.get() + placement_.offset[k];
    }
    finish_slot(tier, k, ok && commit_slot(tier, k, bytes, false, t0));
  }
  Timeline::instance().record("load span", "prefetch", t0, now_us(), 1);
}

}  // namespace hpcdl
