// A mid-size dense allreduce by recursive halving and doubling (Rabenseifner's
// algorithm, MPICH's MPI_Allreduce for long messages): a reduce-scatter in
// log2 P rounds, each rank sending its partner the half of its range the
// partner keeps and reducing the half it keeps, then an allgather retracing
// those rounds, each rank sending all it holds and receiving as much. 2 log2 P
// rounds against the ring's 2(P - 1), with the ring's bytes per rank
// (2(P - 1)/P of the buffer). Used where a ring step's segment (bytes / P)
// is at most kHalvingDoublingMaxSegmentBytes, i.e. where the ring's rounds'
// latency, not its bytes, sets its time: at P = 1024 a 4 MiB bucket is 2046
// ring steps of 4 KiB. From P = 8 on, and only for P a power of two:
// otherwise the ranks beyond the largest power of two would fold their whole
// buffer into a partner and get it back (MPICH's way), N more bytes each way
// on those ranks, as much again as the ring's whole volume; those
// communicators keep the ring (docs/performance.md, "Small messages and the
// idle engine").
// Every rank ends with the same bits: each block of the buffer is reduced on
// one rank, its owner (into its own partial, as the ring's reductions are),
// and copied to the others; the average's divisor is applied by the last
// halving round, each element's last reduction.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <string>
#include <vector>

#include "hpcdl/algorithms/progress.hpp"
#include "hpcdl/algorithms/recursive_doubling.hpp"
#include "hpcdl/algorithms/ring.hpp"
#include "hpcdl/util/dtype.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/scratch.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

// The largest ring segment (bytes / P) for which halving and doubling replaces the ring.
constexpr std::size_t kHalvingDoublingMaxSegmentBytes = 64 << 10;
// The fewest ranks it runs on: it saves 2(P - 1) - 2 log2 P rounds, 2 at P = 4, where its
// fewer, larger messages cost as much (measured: docs/performance.md), 8 at P = 8.
constexpr int kHalvingDoublingMinRanks = 8;

inline bool use_halving_doubling(int p, std::size_t bytes) {
  return p >= kHalvingDoublingMinRanks && (p & (p - 1)) == 0 && !use_recursive_doubling(bytes) &&
         bytes <= static_cast<std::size_t>(p) * kHalvingDoublingMaxSegmentBytes &&
         bytes <= static_cast<std::size_t>(INT_MAX);
}

// The ranks `rank` exchanges with, in the halving's order: rank ^ P/2, ..., rank ^ 1
// (the doubling meets them again in the reverse order).
inline std::vector<int> halving_doubling_partners(int p, int rank) {
  std::vector<int> partners;
  for (int mask = p / 2; mask >= 1; mask /= 2) partners.push_back(rank ^ mask);
  return partners;
}

// The allreduce of `count` values of dtype at `data`, in place (see the top of
// this file); traffic->reduce_scatter_end marks the end of the halving.
inline Status halving_doubling_allreduce(MPI_Comm comm, int p, int rank, int tag, void* data, DType dtype, ReduceOp op,
                                         std::size_t count, Scratch& scratch, RingTraffic* traffic,
                                         Progress& progress) {
  const std::size_t esize = dtype_size(dtype);
  // Block b of the buffer is elements [off[b], off[b + 1]); rank r ends owning block r.
  const std::vector<std::size_t> off = RingPlan::even_offsets(p, count, 1);
  char* buf = static_cast<char*>(data);
  auto at = [&](int block) { return buf + off[block] * esize; };
  auto bytes_of = [&](int lo, int hi) { return (off[hi] - off[lo]) * esize; };
  char* theirs = scratch.get<char>(std::max<std::size_t>(1, std::max(bytes_of(0, p / 2), bytes_of(p / 2, p))));
  MPI_Request rq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  // Sends `send_bytes` at `send` to partner and receives exactly `recv_bytes` into `recv` from it.
  auto exchange = [&](int partner, const char* send, std::size_t send_bytes, char* recv,
                      std::size_t recv_bytes) -> Status {
    return exchange_with_partner(comm, tag, rq, partner, send, send_bytes, partner, recv, recv_bytes,
                                 "halving-doubling", traffic, progress);
  };
  auto rounds = [&]() -> Status {
    int lo = 0, hi = p;  // the blocks this rank holds partials of
    for (int mask = p / 2; mask >= 1; mask /= 2) {
      const int partner = rank ^ mask, mid = lo + (hi - lo) / 2;
      const bool lower_half = (rank & mask) == 0;
      const int keep_lo = lower_half ? lo : mid, keep_hi = lower_half ? mid : hi;
      const int send_lo = lower_half ? mid : lo, send_hi = lower_half ? hi : mid;
      const std::size_t kept = bytes_of(keep_lo, keep_hi);
      HPCDL_RETURN_NOT_OK(exchange(partner, at(send_lo), bytes_of(send_lo, send_hi), theirs, kept));
      reduce_into(dtype, op, at(keep_lo), theirs, kept / esize, mask == 1 ? p : 1);
      lo = keep_lo;
      hi = keep_hi;
    }
    traffic->reduce_scatter_end = MPI_Wtime();
    for (int mask = 1; mask < p; mask *= 2) {  // the partner holds the `mask` blocks next to this rank's
      const int partner = rank ^ mask;
      const int their_lo = (rank & mask) == 0 ? hi : lo - mask, their_hi = their_lo + mask;
      HPCDL_RETURN_NOT_OK(exchange(partner, at(lo), bytes_of(lo, hi), at(their_lo), bytes_of(their_lo, their_hi)));
      lo = std::min(lo, their_lo);
      hi = std::max(hi, their_hi);
    }
    return Status::OK();
  };
  Status st = rounds();
  traffic->dense_bytes = traffic->bytes_sent;
  // A failed round leaves requests posted into the scratch the next call reuses and the caller's buffer.
  if (!st.ok()) cancel_and_complete({&rq[0], &rq[1]}, 10.0, "halving-doubling", progress.abandoned_because());
  return st;
}

}  // namespace hpcdl
