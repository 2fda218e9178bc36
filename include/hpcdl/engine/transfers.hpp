// Engine-driven point-to-point: sends and receives of a raw contiguous
// buffer to or from one rank, with a tag, on a communicator the caller owns
// (the pipeline link's private duplicate). The engine thread posts them
// (MPI_Isend / MPI_Irecv) and tests them in its loop, so transfers advance
// while the caller computes; the caller holds the same Operation handle as a
// collective's (wait, done, errors). Unlike collectives they are not agreed:
// the tag and the sender's order pair them, as in MPI.
#pragma once

#include <mpi.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "hpcdl/engine/operation.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

class CommContext;
class StatsBoard;
class SubmissionQueue;

// The largest transfer: MPI counts are int, and one message goes as bytes.
constexpr std::uint64_t kMaxTransferBytes = 2147483647;

struct Transfer {
  bool send = true;
  void* data = nullptr;
  std::uint64_t bytes = 0;  // a receive expects exactly this many
  int peer = 0, tag = 0;
  std::shared_ptr<Operation> op;
  MPI_Request request = MPI_REQUEST_NULL;
  bool posted = false;
};

// "rank 1's receive of 8 bytes from rank 0 (tag 4)"
std::string describe_transfer(const Transfer& t, int rank);

// The engine thread's side: the transfers of every communicator, in flight.
class Transfers {
 public:
  Transfers(SubmissionQueue& queue, StatsBoard& stats) : queue_(queue), stats_(stats) {}
  // A transfer taken from the submission queue onto its communicator's list.
  void take(CommContext& ctx, Transfer t);
  // Posts ctx's new transfers, tests those in flight, finishes those done.
  void progress(CommContext& ctx, bool* busy);
  // Every transfer not yet finished on ctx fails with st; its requests are cancelled.
  void cancel(CommContext& ctx, const Status& st);
  // The sleep between polls while only transfers are in flight (transfer_poll_sleep).
  std::chrono::microseconds poll_interval() const;
  std::size_t in_flight() const { return in_flight_; }

 private:
  // A finished transfer leaves the counts.
  void finished(const Transfer& t);
  // A completed transfer: stats and, when it records, the timeline (a span from submission to now).
  void record(const Transfer& t);

  SubmissionQueue& queue_;
  StatsBoard& stats_;
  std::size_t in_flight_ = 0;    // taken from the queue, not finished
  std::size_t large_sends_ = 0;  // of those, sends larger than one poll moves
  // When a transfer was last taken, posted or finished: how long a wait only transfers keep has lasted.
  std::chrono::steady_clock::time_point moved_at_;
};

}  // namespace hpcdl
