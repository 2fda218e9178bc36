// Planning (include/hpcdl/prefetch/placement.hpp): one rank's placement and the peer
// sources of every sample; the prefetcher's use of them is Prefetcher::plan().
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

#include "hpcdl/prefetch/placement.hpp"
#include "hpcdl/prefetch/prefetcher.hpp"

namespace hpcdl {

Placement place(const std::vector<std::uint64_t>& stream, const std::uint64_t* sizes, std::uint64_t samples,
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

namespace {

// Where one rank's placement (place()) cuts its ranking, replayed in global
// order. Ranking by (freq desc, first use asc) means: whole frequency classes
// down to the class where RAM runs out (ram_class), then that class's samples
// in first-use order until the first one that does not fit; the same for the
// disk tier from there. Visiting a rank's first uses in global order visits
// each class in first-use order, so the cut is decided sample by sample.
struct Cut {
  std::uint32_t ram_class = 0;  // 0: every sample the rank reads fits in RAM
  std::uint64_t ram_left = 0;   // RAM room left when ram_class starts
  bool ram_open = true;
  std::uint32_t disk_class = 0;  // 0: the disk tier takes the rest
  std::uint64_t disk_left = 0;
  bool disk_open = true;

  // Is the sample (first used here, read `freq` times by the rank) cached?
  bool cache(std::uint32_t freq, std::uint64_t size) {
    if (freq > ram_class) return true;
    if (freq == ram_class && ram_open) {
      if (size <= ram_left) {
        ram_left -= size;
        return true;
      }
      ram_open = false;  // the first sample that does not fit closes RAM
    }
    if (freq > disk_class) return true;
    if (freq < disk_class || !disk_open) return false;
    if (size <= disk_left) {
      disk_left -= size;
      return true;
    }
    disk_open = false;
    return false;
  }
};

// x / d by a multiply (Lemire et al. 2019, exact for 32-bit x): the planner's
// inner loops map positions to ranks, and a hardware divide there costs more than the rest.
struct Divider {
  std::uint64_t d, m;
  explicit Divider(std::uint64_t divisor) : d(divisor), m(divisor > 1 ? ~std::uint64_t{0} / divisor + 1 : 0) {}
  std::uint64_t div(std::uint64_t x) const {
    return d == 1 ? x : static_cast<std::uint64_t>((static_cast<unsigned __int128>(m) * x) >> 64);
  }
};

// Walks classes from `from_class` down with `room` bytes: the class where it runs out and the room left then (0: none).
std::uint32_t class_cut(const std::vector<std::uint64_t>& bytes, std::uint32_t from_class, std::uint64_t* room) {
  for (std::uint32_t f = from_class; f > 0; --f) {
    if (bytes[f] > *room) return f;
    *room -= bytes[f];
  }
  return 0;
}

}  // namespace

Status make_plan(const StreamSpec& spec, std::uint64_t from, std::uint64_t self, const std::uint64_t* sizes,
                 const std::uint64_t own_caps[kCachedTiers], const std::vector<std::uint64_t>& ram_capacity,
                 const std::vector<std::uint64_t>& disk_capacity, Plan* out) {
  HPCDL_RETURN_NOT_OK(spec.validate());
  const std::uint64_t N = spec.samples, B = spec.global_batch, P = spec.ranks, L = spec.local_batch();
  const std::uint64_t batches = spec.batches_per_epoch(), M = batches * B, S = spec.per_epoch();
  HPCDL_RETURN_NOT_OK(spec.check_rank(self));
  if (from % L != 0 || from > spec.length()) return Status::Invalid("resume position is not a batch start of the run");
  if (N > std::numeric_limits<std::uint32_t>::max() || M > std::numeric_limits<std::uint32_t>::max())
    return Status::Invalid("the planner supports up to 2^32-1 samples and positions per epoch");
  const bool peers = !ram_capacity.empty();
  if (peers && ram_capacity.size() != P) return Status::Invalid("ram_capacity needs one entry per rank");
  if (!disk_capacity.empty() && disk_capacity.size() != P)
    return Status::Invalid("disk_capacity needs one entry per rank");
  const std::uint64_t copies = (M + N - 1) / N;  // reads of one sample per epoch (padding repeats the first ones)
  const std::uint64_t s0 = from / L, e0 = batches ? s0 / batches : spec.epochs;  // global steps done, first epoch
  const std::uint64_t p0 = batches ? s0 % batches * B : 0;  // first position of epoch e0 still to read
  const std::uint64_t epochs = spec.epochs > e0 ? spec.epochs - e0 : 0;
  if (peers && epochs * copies > std::numeric_limits<std::uint16_t>::max())
    return Status::Invalid("the planner supports up to 65535 reads of one sample by one rank");

  // 1. shuffles: this rank's stream, each sample's position per epoch.
  out->stream.assign(spec.length() - from, 0);
  std::vector<std::uint32_t> order(N), pos(peers ? epochs * N : 0);  // pos[ei * N + k]: sample k's position
  std::vector<std::uint64_t> part(S);
  for (std::uint64_t ei = 0; ei < epochs; ++ei) {
    epoch_order(N, spec.seed, e0 + ei, order.data());
    spec.rank_epoch(order.data(), self, part.data());
    for (std::uint64_t k = 0; k < S; ++k) {
      const std::uint64_t t = (e0 + ei) * S + k;
      if (t >= from) out->stream[t - from] = part[k];
    }
    if (peers)
      for (std::uint64_t p = 0; p < N; ++p) pos[ei * N + order[p]] = static_cast<std::uint32_t>(p);
  }
  out->placement = place(out->stream, sizes, N, own_caps);
  if (!peers) return Status::OK();

  // 2. per sample: each reader's frequency, marked at its first use; bytes per rank and class.
  std::vector<std::uint16_t> first_freq(epochs * M, 0);
  std::vector<std::vector<std::uint64_t>> class_bytes(P);  // [rank][freq]
  std::vector<std::uint32_t> count(P, 0);
  const Divider by_local(L), by_ranks(P);
  std::vector<std::uint64_t> read_at(epochs * copies), read_rank(epochs * copies);  // one sample's reads
  for (std::uint64_t k = 0; k < N; ++k) {
    std::size_t n_reads = 0;
    for (std::uint64_t ei = 0; ei < epochs; ++ei)
      for (std::uint64_t p = pos[ei * N + k]; p < M; p += N) {
        if (ei == 0 && p < p0) continue;
        const std::uint64_t t = by_local.div(p), q = t - by_ranks.div(t) * P, at = ei * M + p;
        ++count[q];
        __builtin_prefetch(first_freq.data() + at, 1);  // written below: the misses overlap
        read_at[n_reads] = at;
        read_rank[n_reads++] = q;
      }
    for (std::size_t i = 0; i < n_reads; ++i) {
      const std::uint64_t q = read_rank[i];
      if (count[q] == 0) continue;  // not the rank's first use
      const std::uint32_t f = count[q];
      count[q] = 0;
      first_freq[read_at[i]] = static_cast<std::uint16_t>(f);
      if (class_bytes[q].size() <= f) class_bytes[q].resize(f + 1, 0);
      class_bytes[q][f] += sizes[k];
    }
  }

  // 3. cuts, in global order of first uses.
  std::vector<Cut> cuts(P);
  std::vector<bool> has_tier(P, false);
  bool ram_pass = false;
  for (std::uint64_t q = 0; q < P; ++q) {
    const std::uint64_t disk = disk_capacity.empty() ? 0 : disk_capacity[q];
    has_tier[q] = q != self && ram_capacity[q] + disk > 0;
    auto& c = cuts[q];
    auto& bytes = class_bytes[q];
    if (bytes.empty()) continue;
    c.ram_left = ram_capacity[q];
    c.ram_class = class_cut(bytes, static_cast<std::uint32_t>(bytes.size() - 1), &c.ram_left);
    c.disk_class = c.ram_class;  // disk 0: closes with RAM (its closing sample has size > 0)
    c.disk_left = disk;
    ram_pass |= has_tier[q] && c.ram_class > 0 && disk > 0;
  }
  out->sources.rank.assign(N, -1);
  out->sources.key.assign(N, PeerSources::kNone);
  auto sweep = [&](auto&& visit) {
    constexpr std::uint64_t kAhead = 16;  // prefetch distance for the per-sample lookups
    for (std::uint64_t ei = 0; ei < epochs; ++ei) {
      for (std::uint64_t k = 0; k < N; ++k) order[pos[ei * N + k]] = static_cast<std::uint32_t>(k);
      const std::uint16_t* marks = first_freq.data() + ei * M;
      for (std::uint64_t b = ei == 0 ? p0 / B : 0; b < batches; ++b) {
        const std::uint64_t step = (e0 + ei) * batches + b - s0;
        for (std::uint64_t q = 0; q < P; ++q) {
          if (!has_tier[q]) continue;
          for (std::uint64_t p = b * B + q * L, end = p + L; p < end; ++p) {
            const std::uint64_t ahead = p + kAhead;
            if (ahead < M && marks[ahead] != 0) __builtin_prefetch(sizes + order[ahead < N ? ahead : ahead % N]);
            if (marks[p] != 0) visit(q, order[p < N ? p : p % N], marks[p], step * P + q);
          }
        }
      }
    }
  };
  if (ram_pass) {  // where RAM cuts its class decides whether disk starts in that class or a later one
    std::vector<Cut> ram_only = cuts;
    for (auto& c : ram_only) c.disk_open = false;
    sweep([&](std::uint64_t q, std::uint64_t k, std::uint32_t f, std::uint64_t) { ram_only[q].cache(f, sizes[k]); });
    for (std::uint64_t q = 0; q < P; ++q) {
      auto& c = cuts[q];
      if (!has_tier[q] || c.ram_class == 0 || c.disk_left == 0) continue;
      const std::uint64_t rest = class_bytes[q][c.ram_class] - (c.ram_left - ram_only[q].ram_left);
      if (rest > c.disk_left) continue;  // disk runs out in the RAM class too
      c.disk_left -= rest;
      c.disk_class = class_cut(class_bytes[q], c.ram_class - 1, &c.disk_left);
    }
  }
  std::vector<std::uint64_t> found((N + 63) / 64, 0);  // samples with a source: a bitmap stays in cache
  sweep([&](std::uint64_t q, std::uint64_t k, std::uint32_t f, std::uint64_t key) {
    if (cuts[q].cache(f, sizes[k]) && !(found[k / 64] >> (k % 64) & 1)) {
      found[k / 64] |= std::uint64_t{1} << (k % 64);
      out->sources.key[k] = key;  // global order: the first cacher has the smallest key
      out->sources.rank[k] = static_cast<std::int32_t>(q);
    }
  });
  return Status::OK();
}

Status Prefetcher::plan() {
  const StreamSpec& spec = cfg_.spec;
  std::vector<std::uint64_t> sizes(spec.samples);
  for (std::uint64_t k = 0; k < spec.samples; ++k) sizes[k] = reader_->size(k);
  const std::uint64_t caps[kCachedTiers] = {cfg_.ram_bytes, cfg_.disk_dir.empty() ? 0 : cfg_.disk_bytes};
  Plan plan;
  HPCDL_RETURN_NOT_OK(make_plan(spec, cfg_.start, cfg_.rank, sizes.data(), caps, cfg_.peer_ram_bytes,
                                cfg_.peer_disk_bytes, &plan));  // validates the spec: the one check
  L_ = spec.local_batch();
  end_ = spec.length();
  stream_ = std::move(plan.stream);
  placement_ = std::move(plan.placement);
  sources_ = std::move(plan.sources);
  // Each cached sample is filled from its source peer when it has one, else from the store.
  fill_source_.assign(spec.samples, -1);
  for (int t = 0; t < kCachedTiers; ++t)
    for (std::uint64_t k : placement_.lists[t]) {
      if (!sources_.rank.empty())
        fill_source_[k] = sources_.for_read(k, global_key(spec, placement_.first[k], cfg_.rank));
      if (fill_source_[k] < 0)
        store_fills_[t].push_back(k);
      else
        peer_fills_list_.push_back(k);
    }
  const auto by_first_use = [&](std::uint64_t a, std::uint64_t b) { return placement_.first[a] < placement_.first[b]; };
  std::sort(peer_fills_list_.begin(), peer_fills_list_.end(), by_first_use);
  if (cfg_.read_bytes > 0) {
    store_fill_order_ = store_fills_[kTierRam];
    store_fill_order_.insert(store_fill_order_.end(), store_fills_[kTierDisk].begin(), store_fills_[kTierDisk].end());
    std::sort(store_fill_order_.begin(), store_fill_order_.end(), by_first_use);
  }
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
  stats_.ram_used = placement_.used[kTierRam];
  stats_.disk_used = placement_.used[kTierDisk];
  stats_.ram_samples = placement_.lists[kTierRam].size();
  stats_.disk_samples = placement_.lists[kTierDisk].size();
  for (int t = 0; t < kCachedTiers; ++t) {
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

}  // namespace hpcdl
