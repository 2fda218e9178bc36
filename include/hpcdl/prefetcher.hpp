// Prefetcher: a rank's clairvoyant multi-tier loader (docs/prefetch.md).
//
// The rank's whole access stream is known up front (stream.hpp), so is where
// each sample lives on every rank (placement.hpp). A sample some other rank
// caches and reads first (its source peer, PeerSources) is fetched from that
// peer, never from the store, so with enough aggregate capacity the store
// serves each sample once per job. Store fillers load the RAM and disk tiers'
// other samples in first-use order; one peer filler keeps several peer
// fetches in flight; staging threads fill a bounded ring buffer in exact
// access order, each sample from the best source: own RAM, own disk, a peer's
// tiers (peer_service.hpp), else the backing store. The consumer takes whole
// local batches, zero-copy, and blocks only when a batch is really not there yet.
//
// Every byte handed out was checked: the store reader checks each sample's
// CRC32C, the disk tier keeps the CRC of what it wrote and checks it on
// read-back (a mismatch falls back to the store), peers serve only from
// slots loaded that way. Disk trouble (missing directory, ENOSPC, I/O errors)
// warns once and sends the affected samples to the store.
#pragma once

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hpcdl/crc32c.hpp"
#include "hpcdl/peer_service.hpp"
#include "hpcdl/placement.hpp"
#include "hpcdl/store_reader.hpp"
#include "hpcdl/stream.hpp"
#include "hpcdl/thread_setup.hpp"
#include "hpcdl/timeline.hpp"

namespace hpcdl {

struct PrefetchConfig {
  StreamSpec spec;
  std::uint64_t rank = 0;
  std::uint64_t start = 0;  // first stream position to deliver (resume)
  std::uint64_t ram_bytes = 0, disk_bytes = 0;
  std::string disk_dir;
  std::uint64_t staging_bytes = 0;  // raised to 3 of the largest local batches when smaller
  std::size_t staging_threads = 4, ram_threads = 2, disk_threads = 2;
  std::vector<std::uint64_t> peer_ram_bytes;   // per rank; empty: no peer tier
  std::vector<std::uint64_t> peer_disk_bytes;  // per rank (empty: no disk tiers)
  double peer_timeout_s = 2.0, serve_delay_s = 0.0;
  std::uint64_t peer_message_bytes = PeerService::kMaxMessageBytes;  // the largest MPI message of a peer reply
};

enum Source { kFromRam = 0, kFromDisk = 1, kFromPeer = 2, kFromStore = 3, kSources = 4 };

struct PrefetchStats {
  std::uint64_t hits[kSources] = {0, 0, 0, 0};
  std::uint64_t bytes[kSources] = {0, 0, 0, 0};
  std::uint64_t peer_misses = 0, peer_timeouts = 0, peer_waits = 0, served_to_peers = 0;
  std::uint64_t peer_errors = 0, peers_gone = 0;  // failed MPI requests; peers given up on (their samples: the store)
  std::uint64_t peer_fills = 0, store_reads = 0;  // tier slots filled from a peer; every read of the backing store
  std::uint64_t ram_loaded = 0, disk_written = 0, batches = 0;
  std::uint64_t tier_used[kCachedTiers] = {0, 0}, tier_samples[kCachedTiers] = {0, 0};
  std::uint64_t staging_bytes = 0;
  double stall_s = 0;
};

struct BatchView {
  std::uint64_t batch = 0;       // global index of the local batch in the run
  std::uint64_t ring_offset = 0; // where its bytes start in the staging buffer
  std::uint64_t bytes = 0;
  const std::uint64_t* samples = nullptr;  // local_batch sample ids
  const std::uint64_t* offsets = nullptr;  // local_batch + 1 offsets relative to ring_offset
  std::uint64_t count = 0;
};

class Prefetcher {
 public:
  // staging: caller-owned memory of config.staging_bytes (see required_staging()).
  static Status create(std::unique_ptr<StoreReader> reader, PrefetchConfig cfg, char* staging, MPI_Comm comm,
                       std::unique_ptr<Prefetcher>* out) {
    HPCDL_RETURN_NOT_OK(cfg.spec.validate());
    if (cfg.spec.samples != reader->count())
      return Status::Invalid("stream spec and store disagree on the number of samples");
    std::unique_ptr<Prefetcher> p(new Prefetcher());
    p->cfg_ = std::move(cfg);
    p->reader_ = std::move(reader);
    p->staging_ = staging;
    HPCDL_RETURN_NOT_OK(p->plan());
    if (p->cfg_.staging_bytes < p->required_staging())
      return Status::Invalid("staging buffer smaller than required_staging()");
    p->stats_.staging_bytes = p->cfg_.staging_bytes;
    if (!p->cfg_.peer_ram_bytes.empty() && p->end_ > p->cfg_.start) {
      HPCDL_RETURN_NOT_OK(PeerService::create(
          comm, [q = p.get()](std::uint64_t k, char* dst) { return q->serve_peer(k, dst); },
          [q = p.get()](std::uint64_t k) { return q->reader_->size(k); }, p->cfg_.peer_timeout_s,
          p->cfg_.serve_delay_s, p->cfg_.peer_message_bytes, &p->peers_));
      p->peer_gone_.reset(new std::atomic<bool>[p->peers_->size()]);
      for (int q = 0; q < p->peers_->size(); ++q) p->peer_gone_[q] = false;
    }
    p->start_threads();
    *out = std::move(p);
    return Status::OK();
  }

  // The smallest staging buffer for this configuration: three of the largest
  // local batches (one held by the consumer, one being filled, one lost to wrap-around).
  static Status required_staging(const StreamSpec& spec, std::uint64_t rank, const std::uint64_t* sizes,
                                 std::uint64_t* out) {
    HPCDL_RETURN_NOT_OK(spec.validate());
    std::uint64_t largest = 0;
    const std::uint64_t L = spec.local_batch();
    std::vector<std::uint64_t> order(spec.samples), part(spec.per_epoch());
    for (std::uint64_t e = 0; e < spec.epochs; ++e) {
      epoch_order(spec.samples, spec.seed, e, order.data());
      spec.rank_epoch(order.data(), rank, part.data());
      for (std::uint64_t b = 0; b < part.size(); b += L) {
        std::uint64_t bytes = 0;
        for (std::uint64_t j = 0; j < L; ++j) bytes += sizes[part[b + j]];
        largest = std::max(largest, bytes);
      }
    }
    *out = 3 * std::max<std::uint64_t>(largest, 1);
    return Status::OK();
  }

  ~Prefetcher() {
    stop();
    peers_.reset();  // its server reads the tiers: stop it before they go
  }

  // Stops every thread (joins them). Collective when the peer tier is on.
  Status close(double timeout_s) {
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

  std::uint64_t first_batch() const { return cfg_.start / L_; }
  std::uint64_t end_batch() const { return end_ / L_; }

  // Blocks until local batch `b` (taken in order) is staged; releases the previous one.
  // A batch with a sample that could not be read is consumed and returns that
  // sample's error; the batches before and after it are delivered.
  Status next_batch(BatchView* out) {
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
      stats_.stall_s += (t1 - t0) * 1e-6;
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

  PrefetchStats stats() {
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
    for (std::size_t q = 0; peer_gone_ && q < cfg_.peer_ram_bytes.size(); ++q) s.peers_gone += peer_gone_[q].load();
    s.peer_fills = peer_fills_;
    s.store_reads = store_reads_;
    s.ram_loaded = ram_loaded_;
    s.disk_written = disk_written_;
    if (peers_) s.served_to_peers = peers_->served();
    return s;
  }

  std::vector<std::string> take_warnings() {
    std::lock_guard<std::mutex> g(warn_mu_);
    std::vector<std::string> w;
    w.swap(warnings_);
    return w;
  }

  const Placement& placement() const { return placement_; }
  const PeerSources& sources() const { return sources_; }

 private:
  enum SlotState : std::uint8_t { kEmpty = 0, kLoading = 1, kReady = 2, kFailed = 3 };
  // Peer fetches the peer filler keeps in flight: enough that waiting on a
  // source that has not loaded its sample yet never holds up the others.
  static constexpr std::size_t kPeerFillsInFlight = 16;

  Prefetcher() = default;

  std::uint64_t required_staging() const {
    std::uint64_t largest = 1;
    for (auto b : batch_bytes_) largest = std::max(largest, b);
    return 3 * largest;
  }

  Status plan() {
    const StreamSpec& spec = cfg_.spec;
    L_ = spec.local_batch();
    end_ = spec.length();
    std::vector<std::uint64_t> sizes(spec.samples);
    for (std::uint64_t k = 0; k < spec.samples; ++k) sizes[k] = reader_->size(k);
    const std::uint64_t caps[kCachedTiers] = {cfg_.ram_bytes, cfg_.disk_dir.empty() ? 0 : cfg_.disk_bytes};
    Plan plan;
    HPCDL_RETURN_NOT_OK(make_plan(spec, cfg_.start, cfg_.rank, sizes.data(), caps, cfg_.peer_ram_bytes,
                                  cfg_.peer_disk_bytes, &plan));
    stream_ = std::move(plan.stream);
    placement_ = std::move(plan.placement);
    sources_ = std::move(plan.sources);
    // Each cached sample is filled from its source peer when it has one, else from the store.
    fill_source_.assign(spec.samples, -1);
    for (int t = 0; t < kCachedTiers; ++t)
      for (std::uint64_t k : placement_.lists[t]) {
        if (!sources_.rank.empty())
          fill_source_[k] = sources_.for_read(k, global_key(spec, placement_.first[k], cfg_.rank));
        if (fill_source_[k] < 0) store_fills_[t].push_back(k);
        else peer_fills_list_.push_back(k);
      }
    std::sort(peer_fills_list_.begin(), peer_fills_list_.end(),
              [&](std::uint64_t a, std::uint64_t b) { return placement_.first[a] < placement_.first[b]; });
    const std::uint64_t batches = stream_.size() / L_;
    batch_bytes_.assign(batches, 0);
    batch_offsets_.assign(batches * (L_ + 1), 0);
    for (std::uint64_t b = 0; b < batches; ++b) {
      std::uint64_t* offs = batch_offsets_.data() + b * (L_ + 1);
      for (std::uint64_t j = 0; j < L_; ++j) offs[j + 1] = offs[j] + sizes[stream_[b * L_ + j]];
      batch_bytes_[b] = offs[L_];
    }
    batch_ring_.assign(batches, 0);
    batch_alloc_end_.assign(batches, 0);
    batch_done_.assign(batches, 0);
    batch_error_.assign(batches, Status::OK());
    next_consume_ = first_batch();
    next_claim_ = 0;
    for (int t = 0; t < kCachedTiers; ++t) {
      stats_.tier_used[t] = placement_.used[t];
      stats_.tier_samples[t] = placement_.lists[t].size();
      slots_[t].reset(new std::atomic<std::uint8_t>[spec.samples]);
      for (std::uint64_t k = 0; k < spec.samples; ++k) slots_[t][k] = kEmpty;
    }
    if (placement_.used[kTierRam] > 0) {
      ram_.reset(static_cast<char*>(std::malloc(placement_.used[kTierRam])));
      if (!ram_) {
        warn("RAM tier: cannot allocate " + std::to_string(placement_.used[kTierRam]) +
             " bytes; its samples come from the next tiers");
        disable_tier(kTierRam);
      }
    }
    if (placement_.used[kTierDisk] > 0) open_disk();
    return Status::OK();
  }

  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };

  void warn(std::string message) {
    std::lock_guard<std::mutex> g(warn_mu_);
    warnings_.push_back(std::move(message));
  }

  void disable_tier(int tier) {
    for (std::uint64_t k : placement_.lists[tier]) {
      std::uint8_t expected = kEmpty;
      slots_[tier][k].compare_exchange_strong(expected, kFailed);
    }
  }

  void open_disk() {
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
    disk_crc_.assign(cfg_.spec.samples, 0);
  }

  void start_threads() {
    if (next_claim_ + cfg_.start >= end_) return;
    for (std::size_t i = 0; i < std::max<std::size_t>(cfg_.staging_threads, 1); ++i)
      threads_.emplace_back([this] { staging_loop(); });
    if (ram_)
      for (std::size_t i = 0; i < std::max<std::size_t>(cfg_.ram_threads, 1); ++i)
        threads_.emplace_back([this] { fill_loop(kTierRam); });
    if (disk_fd_ >= 0)
      for (std::size_t i = 0; i < std::max<std::size_t>(cfg_.disk_threads, 1); ++i)
        threads_.emplace_back([this] { fill_loop(kTierDisk); });
    if (peers_ && !peer_fills_list_.empty()) threads_.emplace_back([this] { peer_fill_loop(); });
  }

  void stop() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stopping_ = true;
    }
    ready_cv_.notify_all();
    space_cv_.notify_all();
    {
      std::lock_guard<std::mutex> g(slot_mu_);
    }
    slot_cv_.notify_all();
    for (auto& t : threads_) t.join();
    threads_.clear();
  }

  // ---------------------------------------------------------------- tiers

  // Loads sample k into its slot of `tier` unless someone already did (or is
  // doing it: then waits); returns the slot's final state. scratch: a bounce
  // buffer of the sample's size, for the disk tier.
  std::uint8_t ensure_slot(int tier, std::uint64_t k, char* scratch) {
    std::atomic<std::uint8_t>& slot = slots_[tier][k];
    for (;;) {
      std::uint8_t state = slot.load();
      if (state == kReady || state == kFailed) return state;
      if (state == kEmpty && slot.compare_exchange_strong(state, kLoading)) {
        const bool ok = load_slot(tier, k, scratch);
        finish_slot(tier, k, ok);
        return ok ? kReady : kFailed;
      }
      std::unique_lock<std::mutex> lock(slot_mu_);
      slot_cv_.wait(lock, [&] { return stopping_ || slot.load() >= kReady; });
      if (stopping_ && slot.load() < kReady) return kFailed;
    }
  }

  // Loads sample k for `tier` from its fill source (a peer, else the store)
  // into the arena (RAM) or `scratch` (disk), then commits it.
  bool load_slot(int tier, std::uint64_t k, char* scratch) {
    const double t0 = now_us();
    if (tier == kTierDisk && disk_failed_) return false;
    char* dst = tier == kTierRam ? ram_.get() + placement_.offset[k] : scratch;
    if (fill_source_[k] >= 0 && fetch_peer(fill_source_[k], k, dst)) return commit_slot(tier, k, dst, true, t0);
    return fill_from_store(tier, k, dst, t0);
  }

  // Sample k for `tier` from the backing store into dst, then committed.
  bool fill_from_store(int tier, std::uint64_t k, char* dst, double t0) {
    if (tier == kTierDisk && disk_failed_) return false;
    return read_store(k, dst).ok() && commit_slot(tier, k, dst, false, t0);
  }

  // The sample's bytes are in `bytes` (the arena itself for RAM): RAM counts
  // them, disk writes them to the file and keeps their CRC.
  bool commit_slot(int tier, std::uint64_t k, const char* bytes, bool from_peer, double t0) {
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
    disk_crc_[k] = crc32c(bytes, size);
    ++disk_written_;
    Timeline::instance().record(from_peer ? "load disk from peer" : "load disk", "prefetch", t0, now_us(), 1);
    return true;
  }

  Status read_store(std::uint64_t k, char* dst) {
    store_reads_ += reader_->size(k) > 0;  // an empty sample costs no I/O
    return reader_->read(k, dst);
  }

  // Blocking fetch of sample k from `peer`; asks again while the peer has not
  // loaded it yet (its first use is earlier, so it will). False: read the store.
  bool fetch_peer(int peer, std::uint64_t k, char* dst) {
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
      if (o == PeerService::Outcome::kGot) return true;
      count_outcome(peer, o, t.error);
      if (o != PeerService::Outcome::kLater) return false;
    }
  }

  // Sends a request; false (the peer is given up on) when MPI fails.
  bool request_peer(int peer, std::uint64_t k, std::uint64_t size, PeerService::Ticket* t) {
    const Status st = peers_->request(peer, k, size, t);
    if (!st.ok()) count_outcome(peer, PeerService::Outcome::kError, st);
    return st.ok();
  }

  // A peer's answer other than the bytes: "later" (ask again), a miss, a
  // timeout or an MPI error; after the last two the peer is given up on for
  // the rest of the run, so a peer that is gone costs one timeout, not one per sample.
  void count_outcome(int peer, PeerService::Outcome o, const Status& error) {
    using O = PeerService::Outcome;
    ++(o == O::kLater ? peer_waits_ : o == O::kTimeout ? peer_timeouts_ : o == O::kError ? peer_errors_ : peer_misses_);
    if ((o == O::kTimeout || o == O::kError) && !peer_gone_[peer].exchange(true))
      warn("peer tier: rank " + std::to_string(peer) +
           (o == O::kTimeout ? " did not answer within " + std::to_string(cfg_.peer_timeout_s) + " s"
                             : " cannot be reached (" + error.message() + ")") +
           "; its samples come from the backing store for the rest of the run");
  }

  void finish_slot(int tier, std::uint64_t k, bool ok) {
    {
      std::lock_guard<std::mutex> g(slot_mu_);
      slots_[tier][k] = ok ? kReady : kFailed;
    }
    slot_cv_.notify_all();
  }

  // Fills the slots whose source is a peer, in first-use order, with up to
  // kPeerFillsInFlight requests out: a source that has not loaded its sample
  // yet defers its answer (or says "later": ask again) without holding up the
  // rest. A miss or a timeout reads the store instead.
  void peer_fill_loop() {
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
        const PeerService::Outcome o =
            peer_gone_[source] ? PeerService::Outcome::kWaiting : peers_->poll(f.ticket, dst);
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
        if (o == PeerService::Outcome::kGot) {
          ok = commit_slot(f.tier, f.k, dst, true, f.t0);
        } else {
          if (o == PeerService::Outcome::kWaiting) peers_->abandon(f.ticket);  // its source was given up on
          else if (o != PeerService::Outcome::kLater) count_outcome(source, o, f.ticket.error);
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

  void fill_loop(int tier) {
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

  // A peer asks for sample k: served from a loaded RAM or disk slot; "later"
  // while this rank will hold it but has not loaded it yet.
  PeerService::Serve serve_peer(std::uint64_t k, char* dst) {
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

  // ---------------------------------------------------------------- staging

  // Claims the next stream position (relative to start), reserving its batch's
  // ring space first when it starts a batch. False when done or stopping.
  bool claim(std::uint64_t* t) {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (stopping_ || next_claim_ >= stream_.size()) return false;
      const std::uint64_t rel_batch = next_claim_ / L_;
      if (next_claim_ % L_ == 0) {
        const std::uint64_t need = batch_bytes_[rel_batch];
        const std::uint64_t cap = cfg_.staging_bytes;
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

  void release_locked(std::uint64_t b) {
    freed_ = batch_alloc_end_[b - first_batch()];
    space_cv_.notify_all();
  }

  void staging_loop() {
    name_this_thread("hpcdl-staging");
    std::vector<char> scratch;
    std::uint64_t t;
    while (claim(&t)) {
      const std::uint64_t rel_batch = t / L_;
      const std::uint64_t k = stream_[t];
      char* dst = staging_ + batch_ring_[rel_batch] + batch_offsets_[rel_batch * (L_ + 1) + t % L_];
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

  void count(Source s, std::uint64_t size, double t0, const char* name) {
    ++hits_[s];
    bytes_[s] += size;
    Timeline::instance().record(name, "prefetch", t0, now_us(), 1);
  }

  // Stages sample k, read at global key `at`, into dst.
  Status fetch(std::uint64_t k, std::uint64_t at, char* dst, char* scratch) {
    const double t0 = now_us();
    const std::uint64_t size = reader_->size(k);
    const int tier = placement_.tier[k];
    if (tier == kTierRam && ram_ && ensure_slot(kTierRam, k, nullptr) == kReady) {
      std::memcpy(dst, ram_.get() + placement_.offset[k], size);
      count(kFromRam, size, t0, "fetch ram");
      return Status::OK();
    }
    if (tier == kTierDisk && disk_fd_ >= 0 && ensure_slot(kTierDisk, k, scratch) == kReady) {
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

  bool read_disk(std::uint64_t k, char* dst) {
    const std::uint64_t size = reader_->size(k), at = placement_.offset[k];
    for (std::uint64_t done = 0; done < size;) {
      const ssize_t r = ::pread(disk_fd_, dst + done, size - done, static_cast<off_t>(at + done));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        warn_disk_read_once(std::string("reading the disk tier failed: ") + (r < 0 ? std::strerror(errno) : "short read"));
        return false;
      }
      done += static_cast<std::uint64_t>(r);
    }
    if (crc32c(dst, size) != disk_crc_[k]) {
      warn_disk_read_once("the disk tier returned bytes that fail their CRC32C (sample " + std::to_string(k) + ")");
      return false;
    }
    return true;
  }

  void warn_disk_read_once(const std::string& what) {
    if (!disk_read_warned_.exchange(true)) warn("disk tier: " + what + "; reading those samples from the backing store");
  }

  PrefetchConfig cfg_;
  std::unique_ptr<StoreReader> reader_;
  std::unique_ptr<PeerService> peers_;
  char* staging_ = nullptr;
  std::uint64_t L_ = 1, end_ = 0;
  std::vector<std::uint64_t> stream_;  // positions start..end of the run
  Placement placement_;
  PeerSources sources_;                  // empty without a peer tier
  std::vector<std::int32_t> fill_source_;  // per cached sample: the peer to fill it from, -1 the store
  std::vector<std::uint64_t> store_fills_[kCachedTiers], peer_fills_list_;  // fill work, in first-use order

  // Tiers: per sample slot states; RAM arena; disk file (unlinked) and the CRCs written.
  std::unique_ptr<std::atomic<std::uint8_t>[]> slots_[kCachedTiers];
  std::unique_ptr<char, FreeDeleter> ram_;
  int disk_fd_ = -1;
  std::vector<std::uint32_t> disk_crc_;
  std::atomic<bool> disk_failed_{false}, disk_read_warned_{false};
  std::atomic<std::uint64_t> fill_next_[kCachedTiers] = {{0}, {0}};
  std::mutex slot_mu_;
  std::condition_variable slot_cv_;

  // Staging ring (guarded by mu_): byte counters alloc_/freed_ grow forever; ring offset = counter % capacity.
  std::mutex mu_;
  std::condition_variable ready_cv_, space_cv_;
  std::atomic<bool> stopping_{false};
  std::vector<Status> batch_error_;  // per local batch: the first sample that could not be read
  std::uint64_t alloc_ = 0, freed_ = 0, next_claim_ = 0, next_consume_ = 0;
  std::vector<std::uint64_t> batch_bytes_, batch_offsets_, batch_ring_, batch_alloc_end_;
  std::vector<std::uint32_t> batch_done_;
  std::vector<std::thread> threads_;

  std::atomic<std::uint64_t> hits_[kSources] = {{0}, {0}, {0}, {0}}, bytes_[kSources] = {{0}, {0}, {0}, {0}};
  std::atomic<std::uint64_t> peer_misses_{0}, peer_timeouts_{0}, peer_waits_{0}, peer_errors_{0}, peer_fills_{0},
      store_reads_{0};
  std::unique_ptr<std::atomic<bool>[]> peer_gone_;  // per rank, with the peer tier: given up on (no answer, MPI error)
  std::atomic<std::uint64_t> ram_loaded_{0}, disk_written_{0};
  PrefetchStats stats_;
  std::mutex warn_mu_;
  std::vector<std::string> warnings_;
};

}  // namespace hpcdl
