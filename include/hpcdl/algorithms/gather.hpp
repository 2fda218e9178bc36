// Allgather with a first dimension that differs per rank, all-to-all with
// splits and reduce-scatter, over point-to-point messages only: like the ring,
// every request can be cancelled when a rank leaves, and every wait goes
// through Progress.
//
// The row counts are learned at execution (allgather: one small allgather over
// the same ring; alltoall: one count from each peer, ahead of its rows), so the
// agreement stays a comparison of identical descriptions (architecture.md,
// "Gathering collectives").
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "hpcdl/algorithms/progress.hpp"
#include "hpcdl/algorithms/ring.hpp"
#include "hpcdl/util/dtype.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/scratch.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

// p + 1 element offsets of blocks of rows[r] rows of row_elems elements, in rank order.
inline std::vector<std::size_t> row_offsets(const std::vector<std::uint64_t>& rows, std::size_t row_elems) {
  std::vector<std::size_t> out(rows.size() + 1, 0);
  for (std::size_t r = 0; r < rows.size(); ++r) out[r + 1] = out[r] + rows[r] * row_elems;
  return out;
}

// Every rank's `mine` (the same length on every rank), in rank order, into *all.
inline Status allgather_words(MPI_Comm comm, int size, int rank, int tag, const std::vector<std::uint64_t>& mine,
                              std::vector<std::uint64_t>* all, RingTraffic* traffic, Progress& progress) {
  const std::size_t words = mine.size();
  all->assign(words * static_cast<std::size_t>(size), 0);
  std::copy(mine.begin(), mine.end(), all->begin() + static_cast<std::ptrdiff_t>(words * rank));
  if (size == 1) return Status::OK();
  RingPlan plan(size, rank, RingPlan::even_offsets(size, static_cast<std::size_t>(size), words), sizeof(std::uint64_t),
                kMaxChunkBytes, RingPhases::kAllgather);
  DenseRingPolicy policy(plan, all->data(), DType::kInt64, ReduceOp::kSum, 1);
  return run_ring(plan, policy, comm, tag, traffic, progress);
}

// rows[r] rows from every rank r, in rank order, into out; mine holds this
// rank's rows. The ring's allgather phase over blocks of unequal length
// (each cut into the same number of chunks, pipelined as the ring is).
inline Status ring_allgatherv(MPI_Comm comm, int size, int rank, int tag, const void* mine,
                              const std::vector<std::uint64_t>& rows, std::size_t row_elems, DType dtype,
                              std::size_t chunk_bytes, void* out, RingTraffic* traffic, Progress& progress) {
  const std::size_t esize = dtype_size(dtype);
  std::vector<std::size_t> offsets = row_offsets(rows, row_elems);
  const std::size_t mine_bytes = (offsets[rank + 1] - offsets[rank]) * esize;
  if (mine_bytes > 0) std::memcpy(static_cast<char*>(out) + offsets[rank] * esize, mine, mine_bytes);
  if (size == 1) return Status::OK();
  RingPlan plan(size, rank, std::move(offsets), esize, chunk_bytes, RingPhases::kAllgather);
  DenseRingPolicy policy(plan, out, dtype, ReduceOp::kSum, 1);
  traffic->dense_bytes = plan.dense_bytes_sent();
  return run_ring(plan, policy, comm, tag, traffic, progress);
}

// A block travels in pieces of about the agreed chunk size, in whole
// `unit`-byte elements, at most kMaxPiecesPerBlock per block (a 64-byte
// chunk must not post 10^5 requests) and one MPI count each: both sides cut
// a block the same way, from its length. Bounded pieces also keep an
// alltoall's messages as large as the ring's (docs/performance.md: 16 MiB
// messages over MPICH's ofi/tcp ran at half the speed).
constexpr std::size_t kMaxPiecesPerBlock = 64;

inline std::size_t piece_bytes(std::size_t bytes, std::size_t chunk_bytes, std::size_t unit) {
  const std::size_t wanted = std::max<std::size_t>(1, chunk_bytes / unit);
  const std::size_t fewest = (bytes / unit + kMaxPiecesPerBlock - 1) / kMaxPiecesPerBlock;
  return std::min(kMaxChunkBytes / unit, std::max(wanted, fewest)) * unit;
}

// send_rows[j] rows of `data` (in rank order) go to rank j; the rows from
// each rank j land in rank order in the memory `place(recv_rows)` returns,
// once recv_rows[j] (what rank j sends here) is known. Each rank sends peer j
// send_rows[j] as one 8-byte message and its rows right behind it, without
// waiting: MPI matches messages from one rank on one tag in order, so the
// count receives, posted before any data receive, take the counts. The data
// receives are posted once every count is in (one latency), the sends are in
// flight by then. Pairwise order: at step s a rank sends to rank + s and
// receives from rank - s; every message is posted at once, in pieces
// (piece_bytes).
template <class Place>
inline Status alltoallv_learning_counts(MPI_Comm comm, int size, int rank, int tag, const void* data,
                                        const std::vector<std::uint64_t>& send_rows, std::size_t row_bytes,
                                        std::size_t chunk_bytes, std::vector<std::uint64_t>* recv_rows, Place place,
                                        RingTraffic* traffic, Progress& progress) {
  const std::vector<std::size_t> send_at = row_offsets(send_rows, row_bytes);
  const char* src = static_cast<const char*>(data);
  recv_rows->assign(size, 0);
  (*recv_rows)[rank] = send_rows[rank];
  std::vector<MPI_Request> requests;
  auto post = [&](bool send, int peer, const void* from, void* into, std::size_t bytes) -> Status {
    const std::size_t piece = piece_bytes(bytes, chunk_bytes, 1);
    std::size_t off = 0;
    do {  // an empty message too: it pairs with the peer's
      const int n = static_cast<int>(std::min(piece, bytes - off));
      requests.push_back(MPI_REQUEST_NULL);
      const int rc =
          send ? MPI_Isend(static_cast<const char*>(from) + off, n, MPI_BYTE, peer, tag, comm, &requests.back())
               : MPI_Irecv(static_cast<char*>(into) + off, n, MPI_BYTE, peer, tag, comm, &requests.back());
      HPCDL_RETURN_NOT_OK(mpi_status(rc, send ? "MPI_Isend(alltoall)" : "MPI_Irecv(alltoall)"));
      (send ? traffic->bytes_sent : traffic->bytes_received) += static_cast<std::uint64_t>(n);
      off += static_cast<std::size_t>(n);
    } while (off < bytes);
    return Status::OK();
  };
  auto wait_some = [&](std::size_t n, std::size_t count) -> Status {
    for (std::size_t done = 0; done < count; ++done) {
      int index = MPI_UNDEFINED;
      MPI_Status st;
      HPCDL_RETURN_NOT_OK(mpi_status(wait_any_politely(static_cast<int>(n), requests.data(), &index, &st, progress),
                                     "MPI_Waitany(alltoall)"));
    }
    return Status::OK();
  };
  auto run = [&]() -> Status {
    const std::size_t peers = static_cast<std::size_t>(size - 1);
    for (int s = 1; s < size; ++s) {  // first: requests[0, peers) are the count receives
      const int from = (rank - s + size) % size;
      HPCDL_RETURN_NOT_OK(post(false, from, nullptr, &(*recv_rows)[from], sizeof(std::uint64_t)));
    }
    for (int s = 1; s < size; ++s) {
      const int to = (rank + s) % size;
      HPCDL_RETURN_NOT_OK(post(true, to, &send_rows[to], nullptr, sizeof(std::uint64_t)));
      HPCDL_RETURN_NOT_OK(post(true, to, src + send_at[to], nullptr, send_at[to + 1] - send_at[to]));
    }
    HPCDL_RETURN_NOT_OK(wait_some(peers, peers));
    const std::vector<std::size_t> recv_at = row_offsets(*recv_rows, row_bytes);
    char* dst = static_cast<char*>(place(*recv_rows));
    const std::size_t self_bytes = send_at[rank + 1] - send_at[rank];
    if (self_bytes > 0) std::memcpy(dst + recv_at[rank], src + send_at[rank], self_bytes);
    for (int s = 1; s < size; ++s) {
      const int from = (rank - s + size) % size;
      HPCDL_RETURN_NOT_OK(post(false, from, nullptr, dst + recv_at[from], recv_at[from + 1] - recv_at[from]));
    }
    return wait_some(requests.size(), requests.size() - peers);
  };
  Status st = run();
  if (!st.ok()) {
    std::vector<MPI_Request*> posted;
    for (MPI_Request& r : requests) posted.push_back(&r);
    cancel_and_complete(posted, 10.0, "alltoall", progress.abandoned_because());
  }
  return st;
}

// Rank r ends with block r of every rank's `input` (read only; blocks
// [offsets[r], offsets[r + 1]) in elements) reduced, in `out`. Pairwise, as
// MPICH's reduce-scatter for large commutative reductions: `out` starts as this
// rank's own block; at step s = 1..p-1 a rank sends its block for rank + s
// straight from the input and receives rank - s's contribution to its own
// block into one block of scratch, in pieces, each reduced into `out` as it
// lands (the reduction overlaps the transfer). Each element is reduced in the
// same order on every call (own, then steps 1..p-1): deterministic bits.
inline Status pairwise_reduce_scatter(MPI_Comm comm, int size, int rank, int tag, const void* input,
                                      const std::vector<std::size_t>& offsets, DType dtype, ReduceOp op,
                                      std::size_t chunk_bytes, void* out, Scratch& scratch, RingTraffic* traffic,
                                      Progress& progress) {
  const std::size_t esize = dtype_size(dtype);
  const char* in = static_cast<const char*>(input);
  char* dst = static_cast<char*>(out);
  auto block_at = [&](int r) { return offsets[r] * esize; };
  auto block_bytes = [&](int r) { return (offsets[r + 1] - offsets[r]) * esize; };
  const std::size_t own_bytes = block_bytes(rank);
  if (own_bytes > 0) std::memcpy(dst, in + block_at(rank), own_bytes);
  if (size == 1) return Status::OK();
  char* landing = scratch.get<char>(own_bytes);
  constexpr std::size_t kSent = ~std::size_t(0);
  std::vector<MPI_Request> requests;
  std::vector<std::size_t> landed_at;  // requests[i]: a receive's byte offset in the block, or kSent
  auto post = [&](bool send, int peer, const char* from, char* into, std::size_t bytes) -> Status {
    const std::size_t piece = piece_bytes(bytes, chunk_bytes, esize);
    for (std::size_t off = 0; off < bytes; off += piece) {
      const int n = static_cast<int>(std::min(piece, bytes - off));
      requests.push_back(MPI_REQUEST_NULL);
      landed_at.push_back(send ? kSent : off);
      const int rc = send ? MPI_Isend(from + off, n, MPI_BYTE, peer, tag, comm, &requests.back())
                          : MPI_Irecv(into + off, n, MPI_BYTE, peer, tag, comm, &requests.back());
      HPCDL_RETURN_NOT_OK(mpi_status(rc, send ? "MPI_Isend(reducescatter)" : "MPI_Irecv(reducescatter)"));
      (send ? traffic->bytes_sent : traffic->bytes_received) += static_cast<std::uint64_t>(n);
    }
    return Status::OK();
  };
  auto run = [&]() -> Status {
    for (int s = 1; s < size; ++s) {
      const int to = (rank + s) % size, from = (rank - s + size) % size;
      requests.clear();
      landed_at.clear();
      HPCDL_RETURN_NOT_OK(post(false, from, nullptr, landing, own_bytes));
      HPCDL_RETURN_NOT_OK(post(true, to, in + block_at(to), nullptr, block_bytes(to)));
      traffic->dense_bytes += block_bytes(to);
      const int divisor = s == size - 1 ? size : 1;  // the average's, on each element's last reduction
      for (std::size_t done = 0; done < requests.size(); ++done) {
        int index = MPI_UNDEFINED;
        MPI_Status st;
        HPCDL_RETURN_NOT_OK(
            mpi_status(wait_any_politely(static_cast<int>(requests.size()), requests.data(), &index, &st, progress),
                       "MPI_Waitany(reducescatter)"));
        const std::size_t off = landed_at[static_cast<std::size_t>(index)];
        if (off == kSent) continue;
        const std::size_t n = std::min(piece_bytes(own_bytes, chunk_bytes, esize), own_bytes - off);
        reduce_into(dtype, op, dst + off, landing + off, n / esize, divisor);
      }
    }
    return Status::OK();
  };
  Status st = run();
  if (!st.ok()) {
    std::vector<MPI_Request*> posted;
    for (MPI_Request& r : requests) posted.push_back(&r);
    cancel_and_complete(posted, 10.0, "reducescatter", progress.abandoned_because());
  }
  return st;
}

}  // namespace hpcdl
