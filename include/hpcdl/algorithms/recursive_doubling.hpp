// A small dense allreduce by recursive doubling: log2 q rounds, q the largest
// power of two <= P (two more when q < P), instead of the ring's 2(P - 1), every
// rank sending its whole buffer each round. For buffers of at most
// kRecursiveDoublingMaxBytes, whose time is the rounds' latency, not bytes:
// a step's counters, a loss, DistributedOptimizer's presence counts (at
// P = 1024 the ring would take 2046 dependent rounds). Every rank ends with
// the same bits: two partners combine the lower ranks' partial with the
// higher ranks' in that order (the lower is always reduce_into's dst), so
// both compute one value from the same operands; the average's divisor is
// applied by the last round only, as the ring's last reduction does.
// Ranks [0, 2 rem) (rem = P - the largest power of two <= P) first fold in
// pairs: the even rank sends, the odd one takes part in the doubling with
// the pair's partial and sends the result back at the end.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstring>
#include <string>
#include <vector>

#include "hpcdl/algorithms/progress.hpp"
#include "hpcdl/algorithms/ring.hpp"
#include "hpcdl/util/dtype.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

// The largest dense allreduce run by recursive doubling (bytes); larger ones
// take the ring, whose bytes per rank stay 2(P - 1)/P of the buffer
// (docs/performance.md, "Small messages and the idle engine").
constexpr std::size_t kRecursiveDoublingMaxBytes = 64 << 10;

inline bool use_recursive_doubling(std::size_t bytes) { return bytes <= kRecursiveDoublingMaxBytes; }

namespace detail {
inline int power_of_two_below(int p) {
  int pof2 = 1;
  while (pof2 * 2 <= p) pof2 *= 2;
  return pof2;
}
}  // namespace detail

// Whether `rank` folds with rank ^ 1 before the doubling (P not a power of two).
inline bool recursive_doubling_folds(int p, int rank) { return rank < 2 * (p - detail::power_of_two_below(p)); }

// The ranks `rank` exchanges its buffer with, in order (a folding rank's
// pair partner first; it is also the last, receiving or sending the result).
inline std::vector<int> recursive_doubling_partners(int p, int rank) {
  const int pof2 = detail::power_of_two_below(p), rem = p - pof2;
  if (recursive_doubling_folds(p, rank) && rank % 2 == 0) return {rank + 1};
  std::vector<int> partners;
  if (recursive_doubling_folds(p, rank)) partners.push_back(rank - 1);
  const int id = rank < 2 * rem ? rank / 2 : rank - rem;
  for (int mask = 1; mask < pof2; mask <<= 1) {
    const int peer_id = id ^ mask;
    partners.push_back(peer_id < rem ? 2 * peer_id + 1 : peer_id + rem);
  }
  return partners;
}

// One round with a partner: posts a receive of exactly `recv_bytes` into `recv` from
// rank `from` and a send of `send_bytes` at `send` to rank `to` (-1: no such
// half) into rq[0] and rq[1], then waits politely for both; a message of another
// length is a Mismatch. Counts what moved in traffic. `what` names the algorithm.
inline Status exchange_with_partner(MPI_Comm comm, int tag, MPI_Request rq[2], int to, const void* send,
                                    std::size_t send_bytes, int from, void* recv, std::size_t recv_bytes,
                                    const char* what, RingTraffic* traffic, Progress& progress) {
  const std::string wait = std::string("MPI_Wait(") + what + ")";
  if (from >= 0)
    HPCDL_RETURN_NOT_OK(
        mpi_status(MPI_Irecv(recv, static_cast<int>(recv_bytes), MPI_BYTE, from, tag, comm, &rq[0]), "MPI_Irecv"));
  if (to >= 0)
    HPCDL_RETURN_NOT_OK(
        mpi_status(MPI_Isend(send, static_cast<int>(send_bytes), MPI_BYTE, to, tag, comm, &rq[1]), "MPI_Isend"));
  if (from >= 0) {
    MPI_Status status;
    HPCDL_RETURN_NOT_OK(mpi_status(wait_politely(&rq[0], &status, progress), wait.c_str()));
    int got = 0;
    MPI_Get_count(&status, MPI_BYTE, &got);
    if (static_cast<std::size_t>(got) != recv_bytes)
      return Status::Mismatch(std::string(what) + ": " + std::to_string(got) + " bytes from rank " +
                              std::to_string(from) + ", expected " + std::to_string(recv_bytes));
    traffic->bytes_received += recv_bytes;
  }
  if (to >= 0) {
    HPCDL_RETURN_NOT_OK(mpi_status(wait_politely(&rq[1], MPI_STATUS_IGNORE, progress), wait.c_str()));
    traffic->bytes_sent += send_bytes;
  }
  return Status::OK();
}

// The allreduce of `count` values of dtype at `data`, in place (see the top of this file).
inline Status recursive_doubling_allreduce(MPI_Comm comm, int p, int rank, int tag, void* data, DType dtype,
                                           ReduceOp op, std::size_t count, RingTraffic* traffic, Progress& progress) {
  const std::size_t bytes = count * dtype_size(dtype);
  if (bytes == 0) return Status::OK();  // the count is agreed: no rank sends anything
  char* mine = static_cast<char*>(data);
  std::vector<char> theirs(bytes);
  MPI_Request rq[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  // Sends `mine` to `to` and/or receives `theirs` from `from` (-1: neither), then waits for both.
  auto exchange = [&](int to, int from) -> Status {
    return exchange_with_partner(comm, tag, rq, to, mine, bytes, from, theirs.data(), bytes, "recursive doubling",
                                 traffic, progress);
  };
  // mine = op(lower, higher): the partner's partial is the lower one when it came from a lower rank.
  auto combine = [&](bool theirs_is_lower, int divisor) {
    if (theirs_is_lower) {
      reduce_into(dtype, op, theirs.data(), mine, count, divisor);
      std::memcpy(mine, theirs.data(), bytes);
    } else {
      reduce_into(dtype, op, mine, theirs.data(), count, divisor);
    }
  };
  auto rounds = [&]() -> Status {
    const std::vector<int> partners = recursive_doubling_partners(p, rank);
    const bool folds = recursive_doubling_folds(p, rank);
    if (folds && rank % 2 == 0) {  // sends its buffer, gets the result back
      HPCDL_RETURN_NOT_OK(exchange(rank + 1, -1));
      HPCDL_RETURN_NOT_OK(exchange(-1, rank + 1));
      std::memcpy(mine, theirs.data(), bytes);
      return Status::OK();
    }
    std::size_t next = 0;
    if (folds) {  // the pair's partial: the even rank's values first
      HPCDL_RETURN_NOT_OK(exchange(-1, partners[next++]));
      combine(true, 1);
    }
    for (; next < partners.size(); ++next) {
      HPCDL_RETURN_NOT_OK(exchange(partners[next], partners[next]));
      combine(partners[next] < rank, next + 1 == partners.size() ? p : 1);
    }
    if (folds) HPCDL_RETURN_NOT_OK(exchange(rank - 1, -1));
    return Status::OK();
  };
  Status st = rounds();
  traffic->dense_bytes = traffic->bytes_sent;
  // A failed round leaves requests posted into `theirs` (freed on return) and the caller's buffer.
  if (!st.ok()) cancel_and_complete({&rq[0], &rq[1]}, 10.0, "recursive doubling", progress.abandoned_because());
  return st;
}

}  // namespace hpcdl
