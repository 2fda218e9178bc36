// Placement: which tier keeps which sample for one rank's whole run.
// Tiers in order of speed: 0 RAM, 1 node-local disk, 2 the backing store.
// The samples the rank reads are ranked by (frequency descending, first use
// ascending, sample id ascending) and poured into RAM, then disk, in that
// order: the first sample that does not fit closes a tier, so every sample in
// a faster tier ranks before every sample in a slower one. Each tier's list is
// then sorted by first use (the order its fillers load it) and given
// consecutive byte offsets in the tier's region. Static: no eviction.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "hpcdl/stream.hpp"

namespace hpcdl {

constexpr int kTierRam = 0, kTierDisk = 1, kTierStore = 2, kCachedTiers = 2;

struct Placement {
  std::vector<std::uint32_t> freq;   // per sample: reads in the stream
  std::vector<std::uint64_t> first;  // per sample: first position in the stream (max when never)
  std::vector<std::uint8_t> tier;    // per sample
  std::vector<std::uint64_t> offset; // per sample: byte offset in its tier's region
  std::vector<std::uint64_t> lists[kCachedTiers];  // sample ids per cached tier, in first-use order
  std::uint64_t used[kCachedTiers] = {0, 0};
};

inline Placement place(const std::vector<std::uint64_t>& stream, const std::uint64_t* sizes, std::uint64_t samples,
                       const std::uint64_t capacity[kCachedTiers]) {
  constexpr std::uint64_t kNever = std::numeric_limits<std::uint64_t>::max();
  Placement p;
  p.freq.assign(samples, 0);
  p.first.assign(samples, kNever);
  p.tier.assign(samples, kTierStore);
  p.offset.assign(samples, 0);
  std::vector<std::uint64_t> read;
  for (std::uint64_t t = 0; t < stream.size(); ++t) {
    const std::uint64_t k = stream[t];
    if (p.freq[k]++ == 0) {
      p.first[k] = t;
      read.push_back(k);
    }
  }
  std::sort(read.begin(), read.end(), [&](std::uint64_t a, std::uint64_t b) {
    if (p.freq[a] != p.freq[b]) return p.freq[a] > p.freq[b];
    return p.first[a] < p.first[b];  // first uses are distinct: a total order
  });
  int tier = 0;
  for (std::uint64_t k : read) {
    while (tier < kCachedTiers && p.used[tier] + sizes[k] > capacity[tier]) ++tier;
    if (tier == kCachedTiers) break;
    p.tier[k] = static_cast<std::uint8_t>(tier);
    p.used[tier] += sizes[k];
    p.lists[tier].push_back(k);
  }
  for (auto& list : p.lists) {
    std::sort(list.begin(), list.end(), [&](std::uint64_t a, std::uint64_t b) { return p.first[a] < p.first[b]; });
    std::uint64_t at = 0;
    for (std::uint64_t k : list) {
      p.offset[k] = at;
      at += sizes[k];
    }
  }
  return p;
}

// Peer sources: for each sample, the other rank that caches it (RAM or disk
// tier) with the earliest first use, and that first use as a global key
// (step * P + rank: global step order, ties by rank). A rank reading sample s
// at key k asks that peer when its key is < k: the peer then loads s before
// (or while) this rank needs it, and since a source's key is always strictly
// smaller, chains of ranks waiting on sources end at a store read: no cycle.
// ram_capacity / disk_capacity: every rank's tiers. Costs P placements (each
// E*N shuffle draws); a pure function, so every rank computes it alone.
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

inline PeerSources peer_sources(const StreamSpec& spec, std::uint64_t from, const std::uint64_t* sizes,
                                const std::vector<std::uint64_t>& ram_capacity,
                                const std::vector<std::uint64_t>& disk_capacity, std::uint64_t self) {
  PeerSources out;
  out.rank.assign(spec.samples, -1);
  out.key.assign(spec.samples, PeerSources::kNone);
  for (std::uint64_t q = 0; q < spec.ranks; ++q) {
    const std::uint64_t disk = q < disk_capacity.size() ? disk_capacity[q] : 0;
    if (q == self || ram_capacity[q] + disk == 0) continue;
    const std::uint64_t caps[kCachedTiers] = {ram_capacity[q], disk};
    const Placement p = place(spec.rank_stream(q, from), sizes, spec.samples, caps);
    for (const auto& list : p.lists)
      for (std::uint64_t k : list) {
        const std::uint64_t key = global_key(spec, p.first[k], q);
        if (key < out.key[k]) {
          out.key[k] = key;
          out.rank[k] = static_cast<std::int32_t>(q);
        }
      }
  }
  return out;
}

}  // namespace hpcdl
