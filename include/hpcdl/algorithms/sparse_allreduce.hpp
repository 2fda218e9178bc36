// Top-k's allreduces: the sparse allgather (topk_allreduce, described in
// codecs/topk.hpp), the split allreduce: bytes per rank flat in p (Ok-Topk's
// scheme, Li & Hoefler PPoPP'22, with an exact global selection), and the
// choice between the two.
//
// Result: the exact top-k (by magnitude, NaN largest, lower index wins ties)
// of s = the sum, in rank order, of every rank's scaled local pairs, i.e. the
// top-k of what the allgather variant returns. Steps, all on the engine's
// data communicator, non-blocking collectives waited on politely:
//   1. each rank selects its local top-k of x = data (+ residual) (TopkSelector),
//      or with threshold reuse every |x| at or above its threshold (TopkReuse:
//      the counts differ between ranks, between k/2 and 2k);
//   2. balance: a histogram of the selected indices over B equal bins is summed
//      (Iallreduce); the index space is cut into p contiguous ranges holding
//      about p k / p = k selected pairs each (cuts interpolated inside bins);
//   3. reduce-scatter: each rank sends the pairs of range j to rank j
//      (a pairwise exchange, one message per peer: its indices then its
//      values, the count read from the message's length); rank j sums them in
//      rank order: its candidates are the union of received indices;
//   4. global selection: the k-th largest candidate magnitude m is found by a
//      radix select over the 32 magnitude bits, 8 at a time (4 Iallreduces of
//      256 counts); ties at m go to the lowest indices (an Iallgather of each
//      range's counts above and at m: ranges ascend, so lower ranges take
//      their ties first, and every rank knows every range's selected count);
//   5. an Iallgatherv of the selected blocks (k pairs in all) gives every rank the
//      same bytes, written into the cleared buffer: bitwise identical results.
// Error feedback: a rank's residual keeps x except where its own pair made it
// into the result (residual = 0 there): residual + what was applied of this
// rank's contribution = x, per rank, in sum units.
// Both allreduces take the data as segments (util/segments.hpp: a bucket's
// gradients where they lie, or one array); more than one needs a residual.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "hpcdl/algorithms/progress.hpp"
#include "hpcdl/algorithms/ring.hpp"
#include "hpcdl/codecs/codecs.hpp"
#include "hpcdl/codecs/topk.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/scratch.hpp"
#include "hpcdl/util/segments.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

// Threshold reuse for one call (codecs/topk.hpp, TopkThreshold): the codec's
// reuse_steps and the named tensor's threshold; off without either. Ranks
// agree on the codec, so on whether counts may differ.
struct TopkReuse {
  std::uint32_t steps = 0;
  TopkThreshold* threshold = nullptr;
  bool on() const { return steps > 0; }
  // The most pairs a rank may send.
  std::size_t most_pairs(std::size_t k) const { return on() ? topk_reuse_cap(k) : k; }
};

namespace detail {

constexpr std::size_t kRadixBits = 8, kRadixBins = 1u << kRadixBits, kRadixRounds = 32 / kRadixBits;

// Bins of the balance histogram: fine enough that one bin (about 64 p
// selected pairs when they spread evenly) is small against a range's k, and at
// least 4 per range.
inline std::size_t split_balance_bins(int p, std::size_t n, std::size_t k) {
  return std::min(n, std::max<std::size_t>(4 * static_cast<std::size_t>(p), k / 64));
}

// The logical volume a rank receives (and sends) in an allreduce of `bytes`: a ring's.
inline std::uint64_t allreduce_volume(int p, std::size_t bytes) {
  return 2 * static_cast<std::uint64_t>(p - 1) * bytes / static_cast<std::uint64_t>(p);
}

inline Status check_segments(const FloatSegments& data, const float* residual) {
  if (data.size() > 1 && residual == nullptr)
    return Status::Invalid("top-k over data in segments needs a residual (a named operation)");
  return Status::OK();
}

inline Status wait_all(MPI_Request* requests, int count, const char* what, Progress& progress) {
  for (int i = 0; i < count; ++i)
    HPCDL_RETURN_NOT_OK(mpi_status(wait_politely(&requests[i], MPI_STATUS_IGNORE, progress), what));
  return Status::OK();
}

// The pairs of the reduce-scatter, one peer at a time: in round r = 1..p-1 a
// rank sends to rank + r and receives from rank - r, one message of its
// block's indices then values, and waits for both before the next round.
// An all-to-all puts p - 1 messages on each rank's link at once; on a link
// that polices its rate (a token bucket, a switch's shallow buffers) those
// bursts are dropped and resent. The receiver does not know a block's size
// beforehand: it lands in a slot for the most a peer may send (`slot_pairs`),
// the message's length gives its count (recv_count; an empty block is an
// empty message), and it is appended to `received` (at recv_offset), so the
// memory held is one slot and the pairs received, not a slot per peer.
inline Status exchange_pairs_pairwise(MPI_Comm comm, int p, int rank, int tag, const std::uint8_t* packed,
                                      const std::vector<int>& send_count, const std::vector<int>& send_displ,
                                      std::uint8_t* slot, std::size_t slot_pairs, std::vector<std::uint8_t>& received,
                                      std::vector<std::size_t>& recv_offset, std::vector<int>& recv_count,
                                      Progress& progress) {
  received.clear();
  MPI_Request rq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  auto rounds = [&]() -> Status {
    for (int r = 1; r < p; ++r) {
      const int to = (rank + r) % p, from = (rank - r + p) % p;
      HPCDL_RETURN_NOT_OK(
          mpi_status(MPI_Irecv(slot, static_cast<int>(8 * slot_pairs), MPI_BYTE, from, tag, comm, &rq[0]),
                     "MPI_Irecv(top-k pairs)"));
      HPCDL_RETURN_NOT_OK(mpi_status(MPI_Isend(packed + 8 * static_cast<std::size_t>(send_displ[to]),
                                               8 * send_count[to], MPI_BYTE, to, tag, comm, &rq[1]),
                                     "MPI_Isend(top-k pairs)"));
      MPI_Status status;
      HPCDL_RETURN_NOT_OK(mpi_status(wait_politely(&rq[0], &status, progress), "MPI_Wait(top-k pairs)"));
      int bytes = 0;
      MPI_Get_count(&status, MPI_BYTE, &bytes);
      if (bytes < 0 || bytes % 8 != 0)
        return Status::Internal("top-k split: a block of " + std::to_string(bytes) + " bytes from rank " +
                                std::to_string(from));
      recv_count[from] = bytes / 8;
      recv_offset[from] = received.size();
      received.insert(received.end(), slot, slot + bytes);
      HPCDL_RETURN_NOT_OK(wait_all(&rq[1], 1, "MPI_Wait(top-k pairs)", progress));
    }
    return Status::OK();
  };
  Status st = rounds();
  // A failed round leaves requests posted into the scratch buffers the next call reuses.
  if (!st.ok()) cancel_and_complete({&rq[0], &rq[1]}, 10.0, "top-k split", progress.abandoned_because());
  return st;
}

// One peer's block of the reduce-scatter: ascending indices and their values.
struct PairBlock {
  const std::uint32_t* idx;
  const float* val;
  std::size_t count;
};

// The union of the blocks' indices, ascending, each index's values summed in
// block (rank) order from +0.0f, with the sums' magnitudes, so the sums never
// touch the tensor (there each would be a cache miss, and another to read it
// back and one to clear it). A window of kMergeWindow indices at a time,
// starting at the smallest index not taken yet: each block's pairs inside it
// are added, block after block, into a cleared array of sums (cache-resident),
// and marked in a bitmap whose set bits, read in order, are the window's
// candidates ascending. O(m + w p) for m pairs in w windows; the windows are
// disjoint inside this rank's range of about n / p indices, so w p <= n / W + p
// (W = kMergeWindow) whatever the pairs' spread; no branch per pair depends on
// the data (a heap's merge: O(m log p), one such branch per step).
constexpr std::size_t kMergeWindow = std::size_t{1} << 14;
class MergeWindow {
 public:
  std::size_t merge(const std::vector<PairBlock>& blocks, std::uint32_t* cand, float* sum, std::uint32_t* mag) {
    if (sums_.empty()) {
      sums_.assign(kMergeWindow, 0.0f);  // kept cleared between calls: taken sums are reset
      words_.assign(kMergeWindow / 64, 0);
    }
    at_.assign(blocks.size(), 0);
    std::size_t n = 0;
    for (;;) {
      std::uint64_t base = UINT64_MAX;
      for (std::size_t r = 0; r < blocks.size(); ++r)
        if (at_[r] < blocks[r].count) base = std::min<std::uint64_t>(base, blocks[r].idx[at_[r]]);
      if (base == UINT64_MAX) return n;
      const std::uint64_t end = base + kMergeWindow;
      for (std::size_t r = 0; r < blocks.size(); ++r) {
        const PairBlock& b = blocks[r];
        std::size_t j = at_[r];
        for (; j < b.count && b.idx[j] < end; ++j) {
          const std::size_t off = static_cast<std::size_t>(b.idx[j] - base);
          sums_[off] += b.val[j];
          words_[off / 64] |= std::uint64_t{1} << (off % 64);
          summary_[off / 4096] |= std::uint64_t{1} << (off / 64 % 64);
        }
        at_[r] = j;
      }
      for (std::size_t s = 0; s < kSummaryWords; ++s) {
        for (std::uint64_t marked = summary_[s]; marked != 0; marked &= marked - 1) {
          const std::size_t w = s * 64 + static_cast<std::size_t>(__builtin_ctzll(marked));
          for (std::uint64_t bits = words_[w]; bits != 0; bits &= bits - 1) {
            const std::size_t off = w * 64 + static_cast<std::size_t>(__builtin_ctzll(bits));
            cand[n] = static_cast<std::uint32_t>(base + off);
            sum[n] = sums_[off];
            mag[n++] = topk_magnitude(sums_[off]);
            sums_[off] = 0.0f;
          }
          words_[w] = 0;
        }
        summary_[s] = 0;
      }
    }
  }

 private:
  static constexpr std::size_t kSummaryWords = kMergeWindow / 4096;  // a bit per word of the bitmap
  std::vector<float> sums_;
  std::vector<std::uint64_t> words_;
  std::uint64_t summary_[kSummaryWords] = {};
  std::vector<std::size_t> at_;  // per block, its first pair not taken yet
};

}  // namespace detail

// Working memory of the split allreduce, reused from call to call.
struct SplitScratch {
  Scratch mine_idx, mine_val, hist, packed, slot, cand, cand_sum, cand_mag, sel, out;
  std::vector<std::uint8_t> received;  // the peers' blocks, one after another
  detail::MergeWindow merge;
};

// Bytes a rank receives in one split allreduce with evenly spread pairs: the
// reduce-scatter's and the allgather's (p - 1)/p * 8k each, plus the balance
// histogram, the radix select and the selected counts.
inline std::uint64_t topk_split_model_bytes(int p, std::size_t n, std::size_t k) {
  const std::uint64_t pairs = 2 * static_cast<std::uint64_t>(p - 1) * topk_encoded_bytes(k) / p;
  return pairs + detail::allreduce_volume(p, 4 * detail::split_balance_bins(p, n, k)) +
         detail::kRadixRounds * detail::allreduce_volume(p, 4 * detail::kRadixBins) +
         static_cast<std::uint64_t>(p - 1) * 8;
}

// Dependent rounds of one split allreduce (a polite wait each: the balance,
// the p - 1 pairwise exchanges, the 4 radix rounds, the ties, the final
// allgather); the allgather variant has one.
inline std::uint64_t topk_split_model_rounds(int p) { return static_cast<std::uint64_t>(p) + 6; }

// What auto charges for one more dependent round, in bytes of a link: a round's
// latency times the link's rate, ~16 KiB for 250 us at 0.5 Gbit/s or 13 us at
// 10 Gbit/s. Below that rate the split's bytes decide, above it its rounds
// (measured in docs/compression.md, "TopK — two reductions").
constexpr std::uint64_t kTopkRoundBytes = 16 * 1024;

// Split or allgather: the algorithm named, or with "auto" the one whose
// bytes received per rank ((p - 1) 8k for the allgather), plus kTopkRoundBytes
// per dependent round, are fewer; auto keeps the allgather where the split's
// counts (p k pairs: MPI's int counts, uint32 histograms) would not fit.
inline bool topk_use_split(TopkAlgorithm algorithm, int p, std::size_t n, std::size_t k) {
  if (algorithm != TopkAlgorithm::kAuto) return algorithm == TopkAlgorithm::kSplit;
  if (static_cast<std::uint64_t>(p) * k > static_cast<std::uint64_t>(INT_MAX) ||
      topk_encoded_bytes(k) > static_cast<std::size_t>(INT_MAX))
    return false;
  const std::uint64_t split = topk_split_model_bytes(p, n, k) + topk_split_model_rounds(p) * kTopkRoundBytes;
  const std::uint64_t allgather = static_cast<std::uint64_t>(p - 1) * topk_encoded_bytes(k) + kTopkRoundBytes;
  return split < allgather;
}

// The split allreduce of data's n values (see the top of this file). residual
// (optional, n values) as in topk_allreduce; traffic counts the logical
// volume of each exchange (an allreduce as a ring's 2 (p - 1)/p).
inline Status topk_split_allreduce(MPI_Comm comm, int p, int rank, int tag, const FloatSegments& data, double ratio,
                                   double final_scale, float* residual, const TopkReuse& reuse, RingTraffic* traffic,
                                   TopkScratch& topk_scratch, SplitScratch& s, Progress& progress) {
  HPCDL_RETURN_NOT_OK(detail::check_segments(data, residual));
  const std::size_t n = data.total();
  const std::size_t k = topk_count(n, ratio);
  if (k == 0) return Status::OK();
  const std::size_t most = reuse.most_pairs(k);
  if (static_cast<std::uint64_t>(p) * most > static_cast<std::uint64_t>(INT_MAX))
    return Status::Invalid("top-k split: p * k = " + std::to_string(static_cast<std::uint64_t>(p) * most) +
                           " pairs exceed MPI's int counts; use algorithm=allgather");
  if (topk_encoded_bytes(most) > static_cast<std::size_t>(INT_MAX))
    return Status::Invalid("top-k split: a block of up to " + std::to_string(topk_encoded_bytes(most)) +
                           " bytes exceeds one MPI message; use algorithm=allgather");
  const std::size_t up = static_cast<std::size_t>(p);
  std::uint64_t received = 0, sent = 0;
  MPI_Request rq[2];

  // 1. Local selection, scaled as in topk_allreduce (the sums are the result):
  // c pairs, k unless a reused threshold picked them. data is no longer read
  // (x is in val, or in the residual): the selection's pass clears it.
  std::uint32_t* idx = s.mine_idx.get<std::uint32_t>(most);
  float* val = s.mine_val.get<float>(most);
  const std::size_t c =
      topk_contribution(data, residual, n, k, final_scale, topk_scratch, idx, val, reuse.steps, reuse.threshold, true);

  // 2. Balance: range j ends where the running count of all pairs (p k without
  // reuse) reaches (j + 1) / p of them, interpolated linearly inside that bin
  // (pairs assumed even there).
  std::size_t bins = detail::split_balance_bins(p, n, k);
  const std::size_t width = (n + bins - 1) / bins;
  bins = (n + width - 1) / width;
  std::uint32_t* hist = s.hist.get<std::uint32_t>(std::max(bins, detail::kRadixBins));
  std::fill(hist, hist + bins, 0u);
  for (std::size_t j = 0; j < c; ++j) ++hist[idx[j] / width];
  HPCDL_RETURN_NOT_OK(
      mpi_status(MPI_Iallreduce(MPI_IN_PLACE, hist, static_cast<int>(bins), MPI_UINT32_T, MPI_SUM, comm, &rq[0]),
                 "MPI_Iallreduce(top-k balance)"));
  received += detail::allreduce_volume(p, 4 * bins);
  sent += detail::allreduce_volume(p, 4 * bins);
  HPCDL_RETURN_NOT_OK(detail::wait_all(rq, 1, "MPI_Wait(top-k balance)", progress));
  std::vector<std::size_t> bound(up + 1, n);
  bound[0] = 0;
  {
    std::uint64_t total = 0, cum = 0;
    for (std::size_t b = 0; b < bins; ++b) total += hist[b];
    std::size_t bin = 0;
    for (int j = 1; j < p; ++j) {
      const std::uint64_t target = total * static_cast<std::uint64_t>(j) / up;
      while (bin < bins && cum + hist[bin] < target) cum += hist[bin++];
      std::size_t at = n;
      if (bin < bins) at = bin * width + (hist[bin] ? (target - cum) * width / hist[bin] : 0);
      bound[j] = std::min(n, at);
    }
  }

  // 3. Reduce-scatter: the pairs of range j to rank j, summed there in rank order.
  std::vector<int> send_count(up), send_displ(up), recv_count(up, 0);
  std::uint8_t* packed = s.packed.get<std::uint8_t>(std::max<std::size_t>(8 * c, 1));
  for (std::size_t j = 0; j < up; ++j) {
    std::uint32_t* first = std::lower_bound(idx, idx + c, bound[j]);
    std::uint32_t* last = std::lower_bound(first, idx + c, bound[j + 1]);
    send_displ[j] = static_cast<int>(first - idx);
    send_count[j] = static_cast<int>(last - first);
    std::uint8_t* block = packed + 8 * static_cast<std::size_t>(send_displ[j]);
    std::memcpy(block, first, 4 * static_cast<std::size_t>(send_count[j]));
    std::memcpy(block + 4 * static_cast<std::size_t>(send_count[j]), val + send_displ[j],
                4 * static_cast<std::size_t>(send_count[j]));
  }
  const std::size_t lo = bound[rank], hi = bound[rank + 1];
  // A peer sends distinct indices of this range, at most `most` of them.
  const std::size_t slot_pairs = std::min(most, hi - lo);
  std::uint8_t* slot = s.slot.get<std::uint8_t>(std::max<std::size_t>(8 * slot_pairs, 1));
  std::vector<std::size_t> recv_offset(up, 0);
  HPCDL_RETURN_NOT_OK(detail::exchange_pairs_pairwise(comm, p, rank, tag, packed, send_count, send_displ, slot,
                                                      slot_pairs, s.received, recv_offset, recv_count, progress));
  recv_count[rank] = send_count[rank];
  std::size_t n_recv = 0;
  for (std::size_t r = 0; r < up; ++r) {
    n_recv += static_cast<std::size_t>(recv_count[r]);
    if (r != static_cast<std::size_t>(rank)) {
      received += 8 * static_cast<std::uint64_t>(recv_count[r]);
      sent += 8 * static_cast<std::uint64_t>(send_count[r]);
    }
  }
  // The candidates: the blocks' union, ascending, each summed in rank order.
  std::vector<detail::PairBlock> blocks(up);
  for (std::size_t r = 0; r < up; ++r) {
    const std::size_t count = static_cast<std::size_t>(recv_count[r]);
    const std::uint8_t* block = r == static_cast<std::size_t>(rank)
                                    ? packed + 8 * static_cast<std::size_t>(send_displ[r])
                                    : s.received.data() + recv_offset[r];
    blocks[r] = {reinterpret_cast<const std::uint32_t*>(block), reinterpret_cast<const float*>(block + 4 * count),
                 count};
    for (std::size_t j = 0; j < count; ++j)
      if (blocks[r].idx[j] < lo || blocks[r].idx[j] >= hi || (j > 0 && blocks[r].idx[j] <= blocks[r].idx[j - 1]))
        return Status::Internal("top-k split: rank " + std::to_string(r) +
                                "'s pairs are not ascending inside its range");
  }
  std::uint32_t* cand = s.cand.get<std::uint32_t>(std::max<std::size_t>(n_recv, 1));
  float* sum = s.cand_sum.get<float>(std::max<std::size_t>(n_recv, 1));
  std::uint32_t* mag = s.cand_mag.get<std::uint32_t>(std::max<std::size_t>(n_recv, 1));
  const std::size_t n_cand = s.merge.merge(blocks, cand, sum, mag);

  // 4. Radix select of the k-th largest candidate magnitude over all ranges.
  std::uint64_t need = k;
  std::uint32_t prefix = 0;
  for (std::size_t round = 0; round < detail::kRadixRounds; ++round) {
    const unsigned shift = static_cast<unsigned>(32 - detail::kRadixBits * (round + 1));
    std::fill(hist, hist + detail::kRadixBins, 0u);
    for (std::size_t c = 0; c < n_cand; ++c)
      if (round == 0 || (mag[c] >> (shift + detail::kRadixBits)) == prefix) ++hist[(mag[c] >> shift) & 0xffu];
    HPCDL_RETURN_NOT_OK(mpi_status(
        MPI_Iallreduce(MPI_IN_PLACE, hist, static_cast<int>(detail::kRadixBins), MPI_UINT32_T, MPI_SUM, comm, &rq[0]),
        "MPI_Iallreduce(top-k select)"));
    HPCDL_RETURN_NOT_OK(detail::wait_all(rq, 1, "MPI_Wait(top-k select)", progress));
    received += detail::allreduce_volume(p, 4 * detail::kRadixBins);
    sent += detail::allreduce_volume(p, 4 * detail::kRadixBins);
    if (round == 0) {  // the union may hold fewer than k (k each without reuse: at least k)
      std::uint64_t total = 0;
      for (std::size_t b = 0; b < detail::kRadixBins; ++b) total += hist[b];
      need = std::min<std::uint64_t>(need, total);
    }
    std::size_t b = detail::kRadixBins - 1;
    for (; b > 0 && hist[b] < need; --b) need -= hist[b];
    prefix = (prefix << detail::kRadixBits) | static_cast<std::uint32_t>(b);
  }
  const std::uint32_t cut = prefix;  // `need` candidates equal to it complete the k
  // Every range's (above, equal) counts: each rank derives all ranges' selected
  // counts from them, so one exchange serves the ties and the allgather's sizes.
  std::uint32_t mine[2] = {0, 0};
  for (std::size_t c = 0; c < n_cand; ++c) {
    if (mag[c] > cut) ++mine[0];
    if (mag[c] == cut) ++mine[1];
  }
  std::vector<std::uint32_t> counts(2 * up);
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Iallgather(mine, 2, MPI_UINT32_T, counts.data(), 2, MPI_UINT32_T, comm, &rq[0]),
                                 "MPI_Iallgather(top-k selected counts)"));
  HPCDL_RETURN_NOT_OK(detail::wait_all(rq, 1, "MPI_Wait(top-k selected counts)", progress));
  received += 8 * (up - 1);
  sent += 8 * (up - 1);
  // Ties go to the lowest indices: range r takes what ranges 0..r-1 left.
  std::vector<int> out_count(up), out_displ(up);
  std::uint64_t ties_left = need, take = 0;
  std::size_t n_out = 0;
  for (std::size_t r = 0; r < up; ++r) {
    const std::uint64_t ties = std::min<std::uint64_t>(ties_left, counts[2 * r + 1]);
    ties_left -= ties;
    if (r == static_cast<std::size_t>(rank)) take = ties;
    out_count[r] = static_cast<int>(counts[2 * r] + ties);
    out_displ[r] = static_cast<int>(n_out);
    n_out += static_cast<std::size_t>(out_count[r]);
  }
  // This range's selected pairs, packed as a block: its indices, then its values.
  const int n_sel = out_count[rank];
  std::uint8_t* sel = s.sel.get<std::uint8_t>(std::max<std::size_t>(8 * static_cast<std::size_t>(n_sel), 1));
  std::uint32_t* sel_idx = reinterpret_cast<std::uint32_t*>(sel);
  float* sel_val = reinterpret_cast<float*>(sel + 4 * static_cast<std::size_t>(n_sel));
  for (std::size_t c = 0, out = 0; c < n_cand; ++c) {
    if (mag[c] > cut || (mag[c] == cut && take > 0)) {
      if (mag[c] == cut) --take;
      sel_idx[out] = cand[c];
      sel_val[out++] = sum[c];
    }
  }

  // 5. Allgather of the selected blocks, in range order (ascending indices).
  std::vector<int> out_bytes(up), out_byte_displ(up);
  for (std::size_t r = 0; r < up; ++r) {
    out_bytes[r] = 8 * out_count[r];
    out_byte_displ[r] = 8 * out_displ[r];
  }
  std::uint8_t* out = s.out.get<std::uint8_t>(std::max<std::size_t>(8 * n_out, 1));
  HPCDL_RETURN_NOT_OK(mpi_status(
      MPI_Iallgatherv(sel, 8 * n_sel, MPI_BYTE, out, out_bytes.data(), out_byte_displ.data(), MPI_BYTE, comm, &rq[0]),
      "MPI_Iallgatherv(top-k result)"));
  HPCDL_RETURN_NOT_OK(detail::wait_all(rq, 1, "MPI_Wait(top-k result)", progress));
  received += 8 * static_cast<std::uint64_t>(n_out - static_cast<std::size_t>(n_sel));
  sent += 8 * static_cast<std::uint64_t>(n_sel) * (up - 1);
  AscendingCursor result(data);  // the blocks ascend, and indices inside each
  for (std::size_t r = 0; r < up; ++r) {
    const std::size_t count = static_cast<std::size_t>(out_count[r]);
    const std::uint32_t* block_idx = reinterpret_cast<const std::uint32_t*>(out + 8 * out_displ[r]);
    const float* block_val = reinterpret_cast<const float*>(out + 8 * out_displ[r] + 4 * count);
    for (std::size_t g = 0; g < count; ++g) result.at(block_idx[g]) = block_val[g];
    // The residual gives up this rank's pairs of range r that made it into the result (both ascend).
    const std::uint32_t* own = idx + send_displ[r];
    for (std::size_t j = 0, g = 0; residual && j < static_cast<std::size_t>(send_count[r]); ++j) {
      while (g < count && block_idx[g] < own[j]) ++g;
      if (g < count && block_idx[g] == own[j]) residual[own[j]] = 0.0f;
    }
  }
  traffic->bytes_received += received;
  traffic->bytes_sent += sent;
  return Status::OK();
}

// Allreduce of data's n values through top-k on every rank. residual (optional,
// n values): added to the data before selection; on return, what this
// rank's contribution dropped, in sum units. With reuse on, ranks send
// different counts: an allgather of the counts, then of the pairs (indices,
// values) at their rank-order places.
inline Status topk_allreduce(MPI_Comm comm, int size, const FloatSegments& data, double ratio, double final_scale,
                             float* residual, const TopkReuse& reuse, RingTraffic* traffic, TopkScratch& scratch,
                             Progress& progress) {
  HPCDL_RETURN_NOT_OK(detail::check_segments(data, residual));
  const std::size_t n = data.total();
  const std::size_t k = topk_count(n, ratio), most = reuse.most_pairs(k);
  const std::size_t bytes = topk_encoded_bytes(most);
  if (bytes > static_cast<std::size_t>(std::numeric_limits<int>::max()) ||
      (reuse.on() && static_cast<std::uint64_t>(size) * most > static_cast<std::uint64_t>(INT_MAX)))
    return Status::Invalid("top-k message of " + std::to_string(bytes) + " bytes exceeds one MPI message");
  std::uint8_t* mine = scratch.mine.get<std::uint8_t>(bytes);
  std::uint32_t* idx = topk_indices(mine);
  float* val = topk_values(mine, most);
  const std::size_t c =
      topk_contribution(data, residual, n, k, final_scale, scratch, idx, val, reuse.steps, reuse.threshold);
  // Non-blocking, waited on without MPI's busy spin: ranks still selecting keep the CPU.
  const std::size_t up = static_cast<std::size_t>(size);
  TopkPairs* ranks = scratch.pairs.get<TopkPairs>(up);
  MPI_Request rq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  if (!reuse.on()) {
    std::uint8_t* all = scratch.all.get<std::uint8_t>(bytes * up);
    HPCDL_RETURN_NOT_OK(mpi_status(
        MPI_Iallgather(mine, static_cast<int>(bytes), MPI_BYTE, all, static_cast<int>(bytes), MPI_BYTE, comm, &rq[0]),
        "MPI_Iallgather(top-k)"));
    // While the pairs travel, the residual gives up what was sent.
    for (std::size_t j = 0; residual && j < c; ++j) residual[idx[j]] = 0.0f;
    HPCDL_RETURN_NOT_OK(detail::wait_all(rq, 1, "MPI_Wait(top-k allgather)", progress));
    // The logical volume of an allgather: every other rank's pairs in, ours out to each.
    traffic->bytes_sent += static_cast<std::uint64_t>(size - 1) * bytes;
    traffic->bytes_received += static_cast<std::uint64_t>(size - 1) * bytes;
    for (std::size_t r = 0; r < up; ++r) {
      const std::uint8_t* in = all + r * bytes;
      ranks[r] = TopkPairs{topk_indices(in), topk_values(in, k), k};
    }
    topk_sum_into(ranks, size, data, scratch);
    return Status::OK();
  }
  int mine_count = static_cast<int>(c);
  std::vector<int> counts(up), displ(up);
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Iallgather(&mine_count, 1, MPI_INT, counts.data(), 1, MPI_INT, comm, &rq[0]),
                                 "MPI_Iallgather(top-k counts)"));
  for (std::size_t j = 0; residual && j < c; ++j) residual[idx[j]] = 0.0f;
  HPCDL_RETURN_NOT_OK(detail::wait_all(rq, 1, "MPI_Wait(top-k counts)", progress));
  std::size_t total = 0;
  for (std::size_t r = 0; r < up; ++r) {
    if (counts[r] < 0 || static_cast<std::size_t>(counts[r]) > most)
      return Status::Internal("top-k: rank " + std::to_string(r) + " sends " + std::to_string(counts[r]) + " pairs");
    displ[r] = static_cast<int>(total);
    total += static_cast<std::size_t>(counts[r]);
  }
  std::uint32_t* all_idx = scratch.all.get<std::uint32_t>(2 * std::max<std::size_t>(total, 1));
  float* all_val = reinterpret_cast<float*>(all_idx + std::max<std::size_t>(total, 1));
  HPCDL_RETURN_NOT_OK(mpi_status(
      MPI_Iallgatherv(idx, mine_count, MPI_UINT32_T, all_idx, counts.data(), displ.data(), MPI_UINT32_T, comm, &rq[0]),
      "MPI_Iallgatherv(top-k indices)"));
  HPCDL_RETURN_NOT_OK(mpi_status(
      MPI_Iallgatherv(val, mine_count, MPI_FLOAT, all_val, counts.data(), displ.data(), MPI_FLOAT, comm, &rq[1]),
      "MPI_Iallgatherv(top-k values)"));
  HPCDL_RETURN_NOT_OK(detail::wait_all(rq, 2, "MPI_Wait(top-k allgather)", progress));
  traffic->bytes_sent += static_cast<std::uint64_t>(size - 1) * (topk_encoded_bytes(c) + sizeof(int));
  traffic->bytes_received += topk_encoded_bytes(total - c) + (up - 1) * sizeof(int);
  for (std::size_t r = 0; r < up; ++r)
    ranks[r] = TopkPairs{all_idx + displ[r], all_val + displ[r], static_cast<std::size_t>(counts[r])};
  topk_sum_into(ranks, size, data, scratch);
  return Status::OK();
}

}  // namespace hpcdl
