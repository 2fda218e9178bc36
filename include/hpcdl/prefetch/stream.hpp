// Access streams: which samples each rank reads, in which order, over a whole
// run. A pure function of (N, B, P, r, E, seed, drop_last), so every rank can
// compute every other rank's stream without communicating.
//
// Epoch e reads epoch_order(N, seed, e) (shuffle.hpp) in global batches of B
// positions; rank r takes positions [b*B + r*L, b*B + (r+1)*L) of global batch
// b, with L = B / P (B must be a multiple of P). drop_last: floor(N/B) batches,
// the last N mod B positions are not read. Pad: ceil(N/B) batches; positions
// p >= N read order[p mod N] (the epoch's first samples again).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hpcdl/prefetch/shuffle.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

struct StreamSpec {
  std::uint64_t samples = 0;       // N
  std::uint64_t global_batch = 0;  // B
  std::uint64_t ranks = 1;         // P
  std::uint64_t epochs = 0;        // E
  std::uint64_t seed = 0;
  bool drop_last = true;

  Status validate() const {
    if (samples == 0) return Status::Invalid("the data set is empty");
    if (ranks == 0) return Status::Invalid("the number of ranks must be positive");
    if (global_batch == 0) return Status::Invalid("batch_size must be positive");
    if (global_batch % ranks != 0)
      return Status::Invalid("batch_size (the global batch, " + std::to_string(global_batch) +
                             ") must be a multiple of the number of ranks (" + std::to_string(ranks) + ")");
    if (drop_last && samples < global_batch)
      return Status::Invalid("the data set (" + std::to_string(samples) +
                             " samples) is smaller than one global batch (" + std::to_string(global_batch) +
                             ") and drop_last=True would read nothing; pass drop_last=False or a smaller batch_size");
    return Status::OK();
  }
  Status check_rank(std::uint64_t rank) const {
    if (rank >= ranks)
      return Status::Invalid("rank " + std::to_string(rank) + " out of range [0, " + std::to_string(ranks) + ")");
    return Status::OK();
  }
  std::uint64_t local_batch() const { return global_batch / ranks; }
  std::uint64_t batches_per_epoch() const {
    return drop_last ? samples / global_batch : (samples + global_batch - 1) / global_batch;
  }
  std::uint64_t per_epoch() const { return batches_per_epoch() * local_batch(); }  // one rank's reads per epoch
  std::uint64_t length() const { return per_epoch() * epochs; }

  // Rank r's reads of one epoch, given that epoch's order (N entries).
  template <typename Index>
  void rank_epoch(const Index* order, std::uint64_t rank, std::uint64_t* out) const {
    const std::uint64_t L = local_batch();
    for (std::uint64_t b = 0, at = 0; b < batches_per_epoch(); ++b)
      for (std::uint64_t j = 0; j < L; ++j, ++at)
        out[at] = static_cast<std::uint64_t>(order[(b * global_batch + rank * L + j) % samples]);
  }

  // Rank r's stream from position `from` to the end of the run.
  std::vector<std::uint64_t> rank_stream(std::uint64_t rank, std::uint64_t from = 0) const {
    const std::uint64_t S = per_epoch();
    std::vector<std::uint64_t> out(length() - std::min(from, length()));
    if (out.empty()) return out;
    std::vector<std::uint64_t> order(samples), part(S);
    for (std::uint64_t e = from / S; e < epochs; ++e) {
      epoch_order(samples, seed, e, order.data());
      rank_epoch(order.data(), rank, part.data());
      for (std::uint64_t k = 0; k < S; ++k) {
        const std::uint64_t t = e * S + k;
        if (t >= from) out[t - from] = part[k];
      }
    }
    return out;
  }
};

}  // namespace hpcdl
