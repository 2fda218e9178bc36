// The prefetcher's peer fills (include/hpcdl/prefetch/prefetcher.hpp): samples from
// the source peer's tiers over PeerService, each checked on arrival, a peer
// given up on after a timeout, an MPI error or bytes that fail the check.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "hpcdl/prefetch/prefetcher.hpp"
#include "hpcdl/util/crc32c.hpp"
#include "hpcdl/util/thread_setup.hpp"
#include "hpcdl/util/timeline.hpp"

namespace hpcdl {

bool Prefetcher::fetch_peer(int peer, std::uint64_t k, char* dst) {
  const std::uint64_t size = reader_->size(k);
  if (size == 0) return false;
  for (;;) {
    if (peer_gone_[peer] || stopping_) return false;
    PeerService::Ticket t;
    if (!request_peer(peer, k, size, &t)) return false;
    PeerService::Outcome o;
    for (int backoff_us = 5;; backoff_us = std::min(backoff_us * 2, 500)) {
      if (peer_gone_[peer]) {  // another thread gave up on it: no need to wait out this timeout too
        peers_->abandon(t);
        return false;
      }
      o = peers_->poll(t, dst);
      if (o != PeerService::Outcome::kWaiting) break;
      std::this_thread::sleep_for(std::chrono::microseconds(backoff_us));
    }
    if (o == PeerService::Outcome::kGot) return peer_bytes_ok(peer, k, dst, t.received);
    count_outcome(peer, o, t.error);
    if (o != PeerService::Outcome::kLater) return false;
  }
}

bool Prefetcher::request_peer(int peer, std::uint64_t k, std::uint64_t size, PeerService::Ticket* t) {
  const Status st = peers_->request(peer, k, size, t);
  if (!st.ok()) count_outcome(peer, PeerService::Outcome::kError, st);
  return st.ok();
}

bool Prefetcher::peer_bytes_ok(int peer, std::uint64_t k, const char* bytes, std::uint64_t received) {
  const std::uint64_t size = reader_->size(k);
  std::string problem;
  if (received != size) {
    problem = (received > size ? "more than " + std::to_string(size) : std::to_string(received)) +
              " bytes where this rank's store has " + std::to_string(size);
  } else {
    const std::uint32_t got = crc32c(bytes, size), stored = reader_->checksum(k);
    if (got == stored) return true;
    char crcs[64];
    std::snprintf(crcs, sizeof crcs, "CRC32C 0x%08x where this rank's store has 0x%08x", got, stored);
    problem = crcs;
  }
  ++peer_damaged_;
  if (!peer_gone_[peer].exchange(true))
    warn("peer tier: rank " + std::to_string(peer) + " sent sample " + std::to_string(k) + " with " + problem +
         " (the ranks agreed on the store's fingerprint at start, so its tier or the transfer damaged it); "
         "read from this rank's store ('" +
         reader_->shard_path(reader_->shard_of(k)) + "') instead, and rank " + std::to_string(peer) +
         "'s samples come from the store for the rest of the run");
  return false;
}

void Prefetcher::count_outcome(int peer, PeerService::Outcome o, const Status& error) {
  using O = PeerService::Outcome;
  ++(o == O::kLater ? peer_waits_ : o == O::kTimeout ? peer_timeouts_ : o == O::kError ? peer_errors_ : peer_misses_);
  if ((o == O::kTimeout || o == O::kError) && !peer_gone_[peer].exchange(true))
    warn("peer tier: rank " + std::to_string(peer) +
         (o == O::kTimeout ? " did not answer within " + seconds_text(cfg_.peer_timeout)
                           : " cannot be reached (" + error.message() + ")") +
         "; its samples come from the backing store for the rest of the run");
}

void Prefetcher::peer_fill_loop() {
  name_this_thread("hpcdl-peerfill");
  struct InFlight {
    int tier;
    std::uint64_t k;
    PeerService::Ticket ticket;
    std::vector<char> scratch;  // disk slots: the bytes before they are written
    double t0;
  };
  std::vector<InFlight> flight;
  std::size_t next = 0;
  for (int idle_us = 5; !stopping_;) {
    while (flight.size() < kPeerFillsInFlight && next < peer_fills_list_.size()) {
      const std::uint64_t k = peer_fills_list_[next++];
      const int tier = placement_.tier[k];
      if (tier == kTierDisk && disk_failed_) continue;
      std::uint8_t expected = kEmpty;
      if (!slots_[tier][k].compare_exchange_strong(expected, kLoading)) continue;  // a staging thread took it
      InFlight f{tier, k, {}, {}, now_us()};
      if (tier == kTierDisk) f.scratch.resize(reader_->size(k));
      char* dst = tier == kTierRam ? ram_.get() + placement_.offset[k] : f.scratch.data();
      // Nothing to fetch, or a source given up on: the store.
      if (reader_->size(k) == 0 || peer_gone_[fill_source_[k]] ||
          !request_peer(fill_source_[k], k, reader_->size(k), &f.ticket)) {
        finish_slot(tier, k, fill_from_store(tier, k, dst, f.t0));
        continue;
      }
      flight.push_back(std::move(f));
    }
    if (flight.empty()) return;
    bool progress = false;
    for (std::size_t i = 0; i < flight.size();) {
      InFlight& f = flight[i];
      char* dst = f.tier == kTierRam ? ram_.get() + placement_.offset[f.k] : f.scratch.data();
      const int source = fill_source_[f.k];
      // A source given up on is not polled: its late answer is matched at shutdown.
      const PeerService::Outcome o = peer_gone_[source] ? PeerService::Outcome::kWaiting : peers_->poll(f.ticket, dst);
      if (o == PeerService::Outcome::kWaiting && !peer_gone_[source]) {
        ++i;
        continue;
      }
      progress = true;
      if (o == PeerService::Outcome::kLater) {  // the source is behind: ask again
        count_outcome(source, o, f.ticket.error);
        if (!peer_gone_[source] && request_peer(source, f.k, reader_->size(f.k), &f.ticket)) {
          ++i;
          continue;
        }
      }
      bool ok;
      if (o == PeerService::Outcome::kGot && peer_bytes_ok(source, f.k, dst, f.ticket.received)) {
        ok = commit_slot(f.tier, f.k, dst, true, f.t0);
      } else {
        if (o == PeerService::Outcome::kWaiting)
          peers_->abandon(f.ticket);  // its source was given up on
        else if (o != PeerService::Outcome::kLater && o != PeerService::Outcome::kGot)
          count_outcome(source, o, f.ticket.error);
        ok = fill_from_store(f.tier, f.k, dst, f.t0);
      }
      finish_slot(f.tier, f.k, ok);
      flight[i] = std::move(flight.back());
      flight.pop_back();
    }
    if (progress) {
      idle_us = 5;
      continue;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(idle_us));
    idle_us = std::min(idle_us * 2, 200);
  }
  for (InFlight& f : flight) {  // stopping: the answers are matched at shutdown
    peers_->abandon(f.ticket);
    finish_slot(f.tier, f.k, false);
  }
}

}  // namespace hpcdl
