// Point-to-point transfers moved by the engine thread (transfers.hpp):
// submitted from any thread, posted and tested in the engine's loop, so a
// large message advances while the caller computes (MPICH progresses a
// request only inside MPI calls); failed with the communicator's other
// operations when a rank leaves, the communicator is freed or the engine stops.
#include "hpcdl/engine/transfers.hpp"

#include <string>
#include <vector>

#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/engine/engine_loop.hpp"
#include "hpcdl/engine/stats.hpp"
#include "hpcdl/engine/submission_queue.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/timeline.hpp"

namespace hpcdl {

namespace {

// A cancelled transfer's memory is handed back once MPI lets go of it; a
// send to a rank that has left may never be cancellable: the job ends then.
constexpr double kCancelSeconds = 30.0;

// A 64 MiB transfer no one waited for took 338 ms at one poll per 1 ms
// (11 ms waited for): a large send is polled for. A large receive is not: a
// pipeline posts its receives ahead, and polling those at 200 us took ~10% of
// the stages' compute (1 MiB activations, 2 stages on 2 cores) while the
// receiver takes a message that has arrived in one poll.
constexpr std::size_t kOnePollBytes = 256 << 10;

bool large_send(const Transfer& t) { return t.send && t.bytes > kOnePollBytes; }

}  // namespace

std::string describe_transfer(const Transfer& t, int rank) {
  return "rank " + std::to_string(rank) + "'s " + (t.send ? "send" : "receive") + " of " + std::to_string(t.bytes) +
         " bytes " + (t.send ? "to" : "from") + " rank " + std::to_string(t.peer) + " (tag " + std::to_string(t.tag) +
         ")";
}

void Transfers::take(CommContext& ctx, Transfer t) {
  ++in_flight_;
  if (large_send(t)) ++large_sends_;
  moved_at_ = std::chrono::steady_clock::now();
  ctx.transfers.push_back(std::move(t));
}

void Transfers::finished(const Transfer& t) {
  --in_flight_;
  if (large_send(t)) --large_sends_;
}

void Transfers::progress(CommContext& ctx, bool* busy) {
  for (auto it = ctx.transfers.begin(); it != ctx.transfers.end();) {
    Transfer& t = *it;
    const int count = static_cast<int>(t.bytes);
    Status st;
    if (!t.posted) {
      const int rc = t.send ? MPI_Isend(t.data, count, MPI_BYTE, t.peer, t.tag, ctx.user, &t.request)
                            : MPI_Irecv(t.data, count, MPI_BYTE, t.peer, t.tag, ctx.user, &t.request);
      st = mpi_status(rc, t.send ? "MPI_Isend(point-to-point)" : "MPI_Irecv(point-to-point)");
      t.posted = st.ok();
      moved_at_ = std::chrono::steady_clock::now();
      *busy = true;
    }
    int flag = 0;
    MPI_Status status;
    if (st.ok()) {
      int rc = MPI_Test(&t.request, &flag, &status);
      int error_class = MPI_SUCCESS;
      if (rc != MPI_SUCCESS) MPI_Error_class(rc, &error_class);
      if (error_class == MPI_ERR_TRUNCATE) {
        flag = 1;
        st = Status::Mismatch("hpcdl: " + describe_transfer(t, ctx.rank) + " got a larger message: rank " +
                              std::to_string(t.peer) + " and rank " + std::to_string(ctx.rank) +
                              " disagree on its size");
      } else if (rc != MPI_SUCCESS) {
        flag = 1;
        st = mpi_status(rc, "MPI_Test(point-to-point)");
      } else if (flag && !t.send) {
        int got = 0;
        MPI_Get_count(&status, MPI_BYTE, &got);
        if (got != count)
          st = Status::Mismatch("hpcdl: " + describe_transfer(t, ctx.rank) + " got " + std::to_string(got) +
                                " bytes: rank " + std::to_string(t.peer) + " and rank " + std::to_string(ctx.rank) +
                                " disagree on its size");
      }
    }
    if (!st.ok() || flag) {
      if (!flag && t.request != MPI_REQUEST_NULL) cancel_and_complete({&t.request}, kCancelSeconds, "hpcdl");
      if (st.ok()) record(t);
      finished(t);
      t.op->finish(std::move(st));
      it = ctx.transfers.erase(it);
      moved_at_ = std::chrono::steady_clock::now();
      *busy = true;
    } else {
      ++it;
    }
  }
}

std::chrono::microseconds Transfers::poll_interval() const {
  return transfer_poll_sleep(large_sends_ > 0, queue_.watchers > 0, seconds_since(moved_at_));
}

void Transfers::record(const Transfer& t) {
  const double end_us = now_us();
  const double start_us = t.op->times().submitted_us;
  const std::uint64_t sent = t.send ? t.bytes : 0;
  // Nothing compresses a transfer: its dense bytes are what it sent.
  stats_.count("transfer", t.send ? "send" : "receive", sent, t.send ? 0 : t.bytes, sent, (end_us - start_us) * 1e-6);
  // The operation's name says the peer, the tag and the bytes: "rank 1's receive of 8 bytes from rank 0 (tag 4)".
  Timeline::instance().record(t.op->name(), t.send ? "send" : "receive", start_us, end_us, 0);
}

void Transfers::cancel(CommContext& ctx, const Status& st) {
  std::vector<MPI_Request*> requests;
  for (auto& t : ctx.transfers) requests.push_back(&t.request);
  cancel_and_complete(requests, kCancelSeconds, "hpcdl");
  for (auto& t : ctx.transfers) {
    t.op->finish(st);
    finished(t);
  }
  ctx.transfers.clear();
}

}  // namespace hpcdl
