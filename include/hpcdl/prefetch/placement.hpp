// Placement: which tier keeps which sample for one rank's whole run.
// Tiers in order of speed: 0 RAM, 1 node-local disk, 2 the backing store.
// The samples the rank reads are ranked by (frequency descending, first use
// ascending, sample id ascending) and poured into RAM, then disk, in that
// order: the first sample that does not fit closes a tier, so every sample in
// a faster tier ranks before every sample in a slower one. Each tier's list is
// then sorted by first use (the order its fillers load it) and given
// consecutive byte offsets in the tier's region. Static: no eviction.
// Implementation: src/prefetch/plan.cc.
#pragma once

#include <cstdint>
#include <limits>
#include <vector>

#include "hpcdl/prefetch/stream.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

constexpr int kTierRam = 0, kTierDisk = 1, kTierStore = 2, kCachedTiers = 2;

struct Placement {
  std::vector<std::uint32_t> freq;                 // per sample: reads in the stream
  std::vector<std::uint64_t> first;                // per sample: first position in the stream (max when never)
  std::vector<std::uint8_t> tier;                  // per sample
  std::vector<std::uint64_t> offset;               // per sample: byte offset in its tier's region
  std::vector<std::uint64_t> lists[kCachedTiers];  // sample ids per cached tier, in first-use order
  std::uint64_t used[kCachedTiers] = {0, 0};
};

Placement place(const std::vector<std::uint64_t>& stream, const std::uint64_t* sizes, std::uint64_t samples,
                const std::uint64_t capacity[kCachedTiers]);

// Peer sources: for each sample, the other rank that caches it (RAM or disk
// tier) with the earliest first use, and that first use as a global key
// (step * P + rank: global step order, ties by rank). A rank reading sample s
// at key k asks that peer when its key is < k: the peer then loads s before
// (or while) this rank needs it, and since a source's key is always strictly
// smaller, chains of ranks waiting on sources end at a store read: no cycle.
struct PeerSources {
  static constexpr std::uint64_t kNone = std::numeric_limits<std::uint64_t>::max();
  std::vector<std::int32_t> rank;  // per sample: source rank, -1 none
  std::vector<std::uint64_t> key;  // per sample: the source's first-use key (kNone: none)

  // The peer to ask for sample k when this rank reads it at global key `at` (-1: the store).
  std::int32_t for_read(std::uint64_t k, std::uint64_t at) const { return key[k] < at ? rank[k] : -1; }
};

// Global key of stream position t (relative to the run's start) on `rank`.
inline std::uint64_t global_key(const StreamSpec& spec, std::uint64_t t, std::uint64_t rank) {
  return t / spec.local_batch() * spec.ranks + rank;
}

// What one rank's start-up computes (make_plan): its stream from the start
// position, its placement, and the peer sources implied by every rank's placement.
struct Plan {
  std::vector<std::uint64_t> stream;  // this rank's reads, start .. end of the run
  Placement placement;
  PeerSources sources;  // empty without a peer tier
};

// One rank's start-up plan (docs/prefetch.md, "Planning at scale"): the
// global order of each remaining epoch is shuffled once, and every rank's use
// of it is derived from it, so the cost does not grow with P:
//   1. per epoch: the shuffle (N Philox draws), this rank's reads, and each
//      sample's position (E x N 32-bit words);
//   2. per sample, over its E positions: how often each rank reading it reads
//      it; the entry of each rank's first use is marked with that frequency
//      (E x M 16-bit words, M = global positions per epoch) and added to the
//      rank's bytes per frequency class;
//   3. in global order, each rank's cut (Cut, src/prefetch/plan.cc) decides, at each
//      first use, whether that rank caches the sample; the first other rank
//      that does is the sample's source. When a rank with a disk tier cuts
//      RAM inside a class, a walk before that one finds where, which tells
//      whether its disk tier ends in the same class or a later one.
// Time O(E*N*(Philox + a few memory accesses)) + P*F, memory O(E*N) + P*F
// (F: the largest frequency). own_caps: this rank's RAM and disk bytes;
// ram_capacity / disk_capacity: every rank's (empty: no peer tier, no sources;
// disk_capacity may be empty: no disk tiers).
Status make_plan(const StreamSpec& spec, std::uint64_t from, std::uint64_t self, const std::uint64_t* sizes,
                 const std::uint64_t own_caps[kCachedTiers], const std::vector<std::uint64_t>& ram_capacity,
                 const std::vector<std::uint64_t>& disk_capacity, Plan* out);

}  // namespace hpcdl
