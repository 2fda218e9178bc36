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
// Every byte handed out was checked against the sample's CRC32C in this
// rank's store index: the store reader checks what it reads, the disk tier
// what it reads back, and a peer's bytes are checked (length and CRC32C) on
// arrival, before a tier keeps them or a batch gets them; a mismatch falls
// back to the store. (The ranks agreed on the store's fingerprint at start,
// hpcdl/prefetch.py, so a peer's store holds the same samples.) Disk trouble
// (missing directory, ENOSPC, I/O errors) warns once and sends the affected
// samples to the store.
//
// Implementation in src/prefetch/, one concern a file: prefetcher.cc (set-up,
// threads, shutdown), plan.cc (placement, peer sources, the run's batches),
// tiers.cc (RAM arena, disk tier, store fills, serving peers), peer_fill.cc
// (fetches from peers), coalesce.cc (store fills in large sorted reads),
// staging.cc (staging ring, consumer), stats.cc (counters, warnings).
#pragma once

#include <mpi.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "hpcdl/prefetch/peer_service.hpp"
#include "hpcdl/prefetch/placement.hpp"
#include "hpcdl/prefetch/stream.hpp"
#include "hpcdl/store/store_reader.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

// The staging ring's size unless told otherwise (hpcdl.prefetch.Prefetcher(staging_bytes=)).
constexpr std::uint64_t kDefaultStagingBytes = 64 << 20;

// The prefetcher's settings. Each field's name is the one Python uses
// (hpcdl.prefetch.Prefetcher's keyword, a leading _ there for the testing
// ones; _core.PrefetchOptions' attribute) and its default here is the only one:
// a new setting is a field here and its row in config_fields() below.
struct PrefetchConfig {
  StreamSpec spec;
  std::uint64_t rank = 0;
  std::uint64_t start = 0;  // first stream position to deliver (resume)
  std::uint64_t ram_bytes = 0, disk_bytes = 0;
  std::string disk_dir;
  std::uint64_t staging_bytes =
      kDefaultStagingBytes;  // at least; raised to 3 of the largest local batches when smaller
  std::size_t staging_threads = 4, ram_threads = 2, disk_threads = 2;
  std::vector<std::uint64_t> peer_ram_bytes;   // per rank; empty: no peer tier
  std::vector<std::uint64_t> peer_disk_bytes;  // per rank (empty: no disk tiers)
  double peer_timeout = 2.0;                   // seconds
  double serve_delay = 0.0;                    // testing: seconds a peer stalls once, before its first answer
  std::uint64_t peer_message_bytes = PeerService::kMaxMessageBytes;  // the largest MPI message of a peer reply
  // Coalesced store fills (coalesce.cc): the tiers' store fills are gathered
  // lookahead_bytes at a time (in first-use order), sorted by file offset and
  // read in spans of at most read_bytes, merging samples whose gap is at most
  // read_gap bytes. read_bytes = 0: one read per sample. read_concurrency:
  // at most that many spans read at once, soonest-needed first (0: no limit).
  std::uint64_t read_bytes = 0, read_gap = 0, lookahead_bytes = 0;
  std::size_t read_concurrency = 0;
  double span_delay = 0.0;  // testing: seconds each span read takes longer (a slow store)
};

// One field of a PrefetchConfig by name, for the bindings (ext/prefetch.pxi):
// exactly one pointer is set, the one of the field's type.
struct ConfigField {
  const char* name;
  std::uint64_t* u64 = nullptr;
  std::size_t* count = nullptr;
  double* seconds = nullptr;
  bool* flag = nullptr;
  std::string* text = nullptr;
  std::vector<std::uint64_t>* list = nullptr;
};

// Every field of c, the stream spec's flattened in.
inline std::vector<ConfigField> config_fields(PrefetchConfig& c) {
  auto u64 = [](const char* n, std::uint64_t& f) {
    ConfigField r{n};
    r.u64 = &f;
    return r;
  };
  auto count = [](const char* n, std::size_t& f) {
    ConfigField r{n};
    r.count = &f;
    return r;
  };
  auto seconds = [](const char* n, double& f) {
    ConfigField r{n};
    r.seconds = &f;
    return r;
  };
  auto list = [](const char* n, std::vector<std::uint64_t>& f) {
    ConfigField r{n};
    r.list = &f;
    return r;
  };
  ConfigField drop_last{"drop_last"}, disk_dir{"disk_dir"};
  drop_last.flag = &c.spec.drop_last;
  disk_dir.text = &c.disk_dir;
  return {u64("samples", c.spec.samples),
          u64("global_batch", c.spec.global_batch),
          u64("ranks", c.spec.ranks),
          u64("epochs", c.spec.epochs),
          u64("seed", c.spec.seed),
          drop_last,
          u64("rank", c.rank),
          u64("start", c.start),
          u64("ram_bytes", c.ram_bytes),
          u64("disk_bytes", c.disk_bytes),
          disk_dir,
          u64("staging_bytes", c.staging_bytes),
          count("staging_threads", c.staging_threads),
          count("ram_threads", c.ram_threads),
          count("disk_threads", c.disk_threads),
          list("peer_ram_bytes", c.peer_ram_bytes),
          list("peer_disk_bytes", c.peer_disk_bytes),
          seconds("peer_timeout", c.peer_timeout),
          seconds("serve_delay", c.serve_delay),
          u64("peer_message_bytes", c.peer_message_bytes),
          u64("read_bytes", c.read_bytes),
          u64("read_gap", c.read_gap),
          u64("lookahead_bytes", c.lookahead_bytes),
          count("read_concurrency", c.read_concurrency),
          seconds("span_delay", c.span_delay)};
}

enum Source { kFromRam = 0, kFromDisk = 1, kFromPeer = 2, kFromStore = 3, kSources = 4 };

// The prefetcher's counters; Python's stats() has them by these names
// (hits and bytes as {"ram", "disk", "peer", "store"}).
struct PrefetchStats {
  std::uint64_t hits[kSources] = {0, 0, 0, 0};
  std::uint64_t bytes[kSources] = {0, 0, 0, 0};
  std::uint64_t peer_misses = 0, peer_timeouts = 0, peer_waits = 0, served_to_peers = 0;
  std::uint64_t peer_errors = 0, peers_gone = 0;  // failed MPI requests; peers given up on (their samples: the store)
  std::uint64_t peer_damaged = 0;  // peer replies of the wrong length or CRC32C (read from the store instead)
  std::uint64_t peer_fills = 0, store_reads = 0;  // tier slots filled from a peer; samples read from the backing store
  std::uint64_t store_requests = 0, store_bytes = 0;  // the backing store's reads (a coalesced span is one) and bytes
  std::uint64_t ram_loaded = 0, disk_written = 0, batches = 0;
  std::uint64_t ram_used = 0, disk_used = 0, ram_samples = 0, disk_samples = 0;  // the tiers' bytes and samples
  std::uint64_t staging_bytes = 0;
  double stall_seconds = 0;
};

// One counter of a PrefetchStats by name (hits and bytes aside): exactly one pointer is set.
struct StatField {
  const char* name;
  const std::uint64_t* count = nullptr;
  const double* seconds = nullptr;
};

inline std::vector<StatField> stat_fields(const PrefetchStats& s) {
  auto count = [](const char* n, const std::uint64_t& f) {
    StatField r{n};
    r.count = &f;
    return r;
  };
  StatField stall{"stall_seconds"};
  stall.seconds = &s.stall_seconds;
  return {count("peer_misses", s.peer_misses),     count("peer_timeouts", s.peer_timeouts),
          count("peer_waits", s.peer_waits),       count("served_to_peers", s.served_to_peers),
          count("peer_errors", s.peer_errors),     count("peers_gone", s.peers_gone),
          count("peer_damaged", s.peer_damaged),   count("peer_fills", s.peer_fills),
          count("store_reads", s.store_reads),     count("store_requests", s.store_requests),
          count("store_bytes", s.store_bytes),     count("ram_loaded", s.ram_loaded),
          count("disk_written", s.disk_written),   count("batches", s.batches),
          count("ram_used", s.ram_used),           count("disk_used", s.disk_used),
          count("ram_samples", s.ram_samples),     count("disk_samples", s.disk_samples),
          count("staging_bytes", s.staging_bytes), stall};
}

struct BatchView {
  std::uint64_t batch = 0;        // global index of the local batch in the run
  std::uint64_t ring_offset = 0;  // where its bytes start in the staging buffer
  std::uint64_t bytes = 0;
  const std::uint64_t* samples = nullptr;  // local_batch sample ids
  const std::uint64_t* offsets = nullptr;  // local_batch + 1 offsets relative to ring_offset
  std::uint64_t count = 0;
};

class Prefetcher {
 public:
  // Validates cfg (once: make_plan), plans and allocates the staging ring:
  // local, no MPI call, so the ranks can agree it succeeded everywhere before
  // start(), the collective part.
  static Status create(std::unique_ptr<StoreReader> reader, PrefetchConfig cfg, std::unique_ptr<Prefetcher>* out);
  // Starts the peer tier (MPI_Comm_dup of comm: collective when cfg has one)
  // and the threads. Once, after create().
  Status start(MPI_Comm comm);
  ~Prefetcher();

  // Stops every thread (joins them). Collective when the peer tier is on.
  Status close(double timeout_s);

  std::uint64_t first_batch() const { return cfg_.start / L_; }
  std::uint64_t end_batch() const { return end_ / L_; }

  // Blocks until local batch `b` (taken in order) is staged; releases the previous one.
  // A batch with a sample that could not be read is consumed and returns that
  // sample's error; the batches before and after it are delivered.
  Status next_batch(BatchView* out);

  // The staging ring the batches are in (BatchView::ring_offset); shared, so
  // views of it may outlive the prefetcher.
  const std::shared_ptr<char>& staging() const { return staging_; }
  std::uint64_t staging_bytes() const { return staging_bytes_; }

  PrefetchStats stats();
  std::vector<std::string> take_warnings();

  const Placement& placement() const { return placement_; }
  const PeerSources& sources() const { return sources_; }

 private:
  enum SlotState : std::uint8_t { kEmpty = 0, kLoading = 1, kReady = 2, kFailed = 3 };
  // Peer fetches the peer filler keeps in flight: enough that waiting on a
  // source that has not loaded its sample yet never holds up the others.
  static constexpr std::size_t kPeerFillsInFlight = 16;

  Prefetcher() = default;

  // ---------------------------------------------------------------- set-up (prefetcher.cc, plan.cc)
  // The run's stream, placement and sources; fill lists; each batch's bytes and offsets; the tiers opened.
  Status plan();
  Status start_threads();  // on failure, those already started are stopped
  void stop();

  // ---------------------------------------------------------------- tiers (tiers.cc)
  void disable_tier(int tier);
  void open_disk();
  // Loads sample k into its slot of `tier` unless someone already did (or is
  // doing it: then waits); returns the slot's final state. scratch: a bounce
  // buffer of the sample's size, for the disk tier. may_load = false: only
  // wait (a coalesced filler will load it in a span).
  std::uint8_t ensure_slot(int tier, std::uint64_t k, char* scratch, bool may_load = true);
  // Whether a staging thread may load sample k's slot itself: not when a coalesced filler will.
  bool staging_may_load(std::uint64_t k) const { return cfg_.read_bytes == 0 || fill_source_[k] >= 0; }
  // Loads sample k for `tier` from its fill source (a peer, else the store)
  // into the arena (RAM) or `scratch` (disk), then commits it.
  bool load_slot(int tier, std::uint64_t k, char* scratch);
  // Sample k for `tier` from the backing store into dst, then committed.
  bool fill_from_store(int tier, std::uint64_t k, char* dst, double t0);
  // The sample's bytes are in `bytes` (the arena itself for RAM), checked:
  // RAM counts them, disk writes them to the file.
  bool commit_slot(int tier, std::uint64_t k, const char* bytes, bool from_peer, double t0);
  void finish_slot(int tier, std::uint64_t k, bool ok);
  Status read_store(std::uint64_t k, char* dst);
  // Sample k from the disk tier, checked against its CRC32C in the store's index; false (warned once): read it
  // elsewhere.
  bool read_disk(std::uint64_t k, char* dst);
  void warn_disk_read_once(const std::string& what);
  // A store filler of `tier`: loads its slots whose source is the store, in first-use order.
  void fill_loop(int tier);
  // ---------------------------------------------------------------- coalesced fills (coalesce.cc)
  // A store filler with coalescing on: takes the next lookahead_bytes of the
  // store fill list (both tiers, first-use order), claims those slots, and
  // loads them in spans, each one read of the store.
  void coalesced_fill_loop();
  // Claims the next window of store_fill_order_; false when none is left.
  bool take_window(std::vector<std::uint64_t>* window);
  // Loads one span (samples of one shard, sorted by file offset) into its
  // slots; a failed read loads each of them alone (so its error is that sample's).
  void load_span(const std::uint64_t* idx, std::size_t n, std::vector<char>* buf);
  // The read gate: at most cfg_.read_concurrency spans are read at once, the
  // one needed soonest (its first use, `need`) first. False: stopping.
  bool enter_read_gate(std::uint64_t need);
  void leave_read_gate();

  // A peer asks for sample k: served from a loaded RAM or disk slot; "later"
  // while this rank will hold it but has not loaded it yet.
  PeerService::Serve serve_peer(std::uint64_t k, char* dst);

  // ---------------------------------------------------------------- peer fill (peer_fill.cc)
  // Blocking fetch of sample k from `peer`; asks again while the peer has not
  // loaded it yet (its first use is earlier, so it will). False: read the store.
  bool fetch_peer(int peer, std::uint64_t k, char* dst);
  // Sends a request; false (the peer is given up on) when MPI fails.
  bool request_peer(int peer, std::uint64_t k, std::uint64_t size, PeerService::Ticket* t);
  // A peer's answer to sample k, checked before anything uses it: the
  // `received` bytes against the sample's size, their CRC32C against the one
  // in this rank's store index. A mismatch (the peer's tier or the transfer
  // damaged them) counts in peer_damaged and gives the peer up for the rest
  // of the run with a warning naming it; false: the caller reads the store.
  bool peer_bytes_ok(int peer, std::uint64_t k, const char* bytes, std::uint64_t received);
  // A peer's answer other than the bytes: "later" (ask again), a miss, a
  // timeout or an MPI error; after the last two the peer is given up on for
  // the rest of the run, so a peer that is gone costs one timeout, not one per sample.
  void count_outcome(int peer, PeerService::Outcome o, const Status& error);
  // Fills the slots whose source is a peer, in first-use order, with up to
  // kPeerFillsInFlight requests out: a source that has not loaded its sample
  // yet defers its answer (or says "later": ask again) without holding up the
  // rest. A miss or a timeout reads the store instead.
  void peer_fill_loop();

  // ---------------------------------------------------------------- staging (staging.cc)
  // The ring's size: cfg_.staging_bytes, raised to three of the run's largest
  // local batches (one held by the consumer, one being filled, one lost to wrap-around).
  std::uint64_t staging_size() const;
  // Claims the next stream position (relative to start), reserving its batch's
  // ring space first when it starts a batch. False when done or stopping.
  bool claim(std::uint64_t* t);
  void release_locked(std::uint64_t b);
  void staging_loop();
  // Stages sample k, read at global key `at`, into dst.
  Status fetch(std::uint64_t k, std::uint64_t at, char* dst, char* scratch);

  // ---------------------------------------------------------------- stats (stats.cc)
  // A sample delivered from source s: its counters and trace event.
  void count(Source s, std::uint64_t size, double t0, const char* name);
  void warn(std::string message);

  struct FreeDeleter {
    void operator()(char* p) const { std::free(p); }
  };

  PrefetchConfig cfg_;
  std::unique_ptr<StoreReader> reader_;
  std::unique_ptr<PeerService> peers_;
  std::shared_ptr<char> staging_;
  std::uint64_t staging_bytes_ = 0;
  std::uint64_t L_ = 1, end_ = 0;
  std::vector<std::uint64_t> stream_;  // positions start..end of the run
  Placement placement_;
  PeerSources sources_;                    // empty without a peer tier
  std::vector<std::int32_t> fill_source_;  // per cached sample: the peer to fill it from, -1 the store
  std::vector<std::uint64_t> store_fills_[kCachedTiers], peer_fills_list_;  // fill work, in first-use order
  std::vector<std::uint64_t> store_fill_order_;  // both tiers' store fills in first-use order (coalescing)
  std::mutex window_mu_;
  std::uint64_t window_next_ = 0;
  std::mutex gate_mu_;
  std::condition_variable gate_cv_;
  std::multiset<std::uint64_t> gate_waiting_;  // the needs of the spans waiting to be read
  std::size_t gate_reading_ = 0;

  // Tiers: per sample slot states; RAM arena; disk file (unlinked).
  std::unique_ptr<std::atomic<std::uint8_t>[]> slots_[kCachedTiers];
  std::unique_ptr<char, FreeDeleter> ram_;
  int disk_fd_ = -1;
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
  std::atomic<std::uint64_t> peer_misses_{0}, peer_timeouts_{0}, peer_waits_{0}, peer_errors_{0}, peer_damaged_{0},
      peer_fills_{0}, store_reads_{0}, store_requests_{0}, store_bytes_{0};
  // Per rank, with the peer tier: given up on (no answer, an MPI error, damaged bytes).
  std::unique_ptr<std::atomic<bool>[]> peer_gone_;
  std::atomic<std::uint64_t> ram_loaded_{0}, disk_written_{0};
  PrefetchStats stats_;
  std::mutex warn_mu_;
  std::vector<std::string> warnings_;
};

}  // namespace hpcdl
