// Point-to-point transfers moved by the engine thread (include/hpcdl/p2p.hpp):
// submitted from any thread, posted and tested in the engine's loop, so a
// large message advances while the caller computes (MPICH progresses a
// request only inside MPI calls); failed with the communicator's other
// operations when a rank leaves, the communicator is freed or the engine stops.
#include <string>
#include <vector>

#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/engine/engine.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/engine/transfers.hpp"
#include "hpcdl/util/timeline.hpp"

namespace hpcdl {

namespace {

// A cancelled transfer's memory is handed back once MPI lets go of it; a
// send to a rank that has left may never be cancellable: the job ends then.
constexpr double kCancelSeconds = 30.0;

// "rank 1's receive of 8 bytes from rank 0 (tag 4)"
std::string describe(const Transfer& t, int rank) {
  return "rank " + std::to_string(rank) + "'s " + (t.send ? "send" : "receive") + " of " + std::to_string(t.bytes) +
         " bytes " + (t.send ? "to" : "from") + " rank " + std::to_string(t.peer) + " (tag " + std::to_string(t.tag) +
         ")";
}

}  // namespace

Status Engine::submit_transfer(MPI_Comm comm, bool send, void* data, std::uint64_t bytes, int peer, int tag,
                               std::shared_ptr<Operation>* out) {
  HPCDL_RETURN_NOT_OK(require_thread_multiple("hpcdl", "its engine thread makes MPI calls while yours do"));
  if (bytes > kMaxTransferBytes)
    return Status::Invalid("a point-to-point transfer moves at most " + std::to_string(kMaxTransferBytes) +
                           " bytes, got " + std::to_string(bytes));
  Transfer t;
  t.send = send;
  t.data = data;
  t.bytes = bytes;
  t.peer = peer;
  t.tag = tag;
  std::lock_guard<std::mutex> g(mu_);
  if (stopped_) return Status::Cancelled("hpcdl's engine has shut down (interpreter exit)");
  std::shared_ptr<CommContext> ctx;
  HPCDL_RETURN_NOT_OK(context_for(comm, &ctx));
  int* tag_ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(comm, MPI_TAG_UB, &tag_ub, &found);
  if (tag < 0 || (found && tag > *tag_ub))
    return Status::Invalid("tag " + std::to_string(tag) + " is outside [0, " +
                           std::to_string(found ? *tag_ub : 32767) + "]");
  if (peer < 0 || peer >= ctx->size)
    return Status::Invalid("peer " + std::to_string(peer) + " is not a rank of a communicator of size " +
                           std::to_string(ctx->size));
  HPCDL_RETURN_NOT_OK(start_locked());  // before the transfer is queued: a failed submission leaves nothing
  OpRequest req;
  req.name = describe(t, ctx->rank);
  std::string name = req.name;  // not req.name below: the arguments' order of evaluation is unspecified
  t.op = std::make_shared<Operation>(std::move(name), std::move(req));
  t.op->times_.submitted_us = t.op->times_.ready_us = now_us();
  *out = t.op;
  transfer_queue_.emplace_back(ctx, std::move(t));
  ++wakeups_;
  cv_.notify_one();
  return Status::OK();
}

void Engine::progress_transfers(CommContext& ctx, bool* busy) {
  for (auto it = ctx.transfers.begin(); it != ctx.transfers.end();) {
    Transfer& t = *it;
    const int count = static_cast<int>(t.bytes);
    Status st;
    if (!t.posted) {
      const int rc = t.send ? MPI_Isend(t.data, count, MPI_BYTE, t.peer, t.tag, ctx.user, &t.request)
                            : MPI_Irecv(t.data, count, MPI_BYTE, t.peer, t.tag, ctx.user, &t.request);
      st = mpi_status(rc, t.send ? "MPI_Isend(point-to-point)" : "MPI_Irecv(point-to-point)");
      t.posted = st.ok();
      transfers_moved_at_ = std::chrono::steady_clock::now();
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
        st = Status::Mismatch("hpcdl: " + describe(t, ctx.rank) + " got a larger message: rank " +
                              std::to_string(t.peer) + " and rank " + std::to_string(ctx.rank) +
                              " disagree on its size");
      } else if (rc != MPI_SUCCESS) {
        flag = 1;
        st = mpi_status(rc, "MPI_Test(point-to-point)");
      } else if (flag && !t.send) {
        int got = 0;
        MPI_Get_count(&status, MPI_BYTE, &got);
        if (got != count)
          st = Status::Mismatch("hpcdl: " + describe(t, ctx.rank) + " got " + std::to_string(got) + " bytes: rank " +
                                std::to_string(t.peer) + " and rank " + std::to_string(ctx.rank) +
                                " disagree on its size");
      }
    }
    if (!st.ok() || flag) {
      if (!flag && t.request != MPI_REQUEST_NULL) cancel_and_complete({&t.request}, kCancelSeconds, "hpcdl");
      if (st.ok()) record_transfer(t);
      t.op->finish(std::move(st));
      it = ctx.transfers.erase(it);
      --transfers_in_flight_;
      transfers_moved_at_ = std::chrono::steady_clock::now();
      *busy = true;
    } else {
      ++it;
    }
  }
}

std::chrono::microseconds Engine::transfer_poll_interval() {
  // A 64 MiB transfer no one waited for took 338 ms at one poll per 1 ms
  // (11 ms waited for): a large send is polled for. A large receive is not: a
  // pipeline posts its receives ahead, and polling those at 200 us took ~10% of
  // the stages' compute (1 MiB activations, 2 stages on 2 cores) while the
  // receiver takes a message that has arrived in one poll.
  constexpr std::size_t kOnePollBytes = 256 << 10;
  bool large = false;
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& ctx : contexts_)
      for (auto& t : ctx->transfers) large = large || (t.send && t.bytes > kOnePollBytes);
  }
  return transfer_poll_sleep(large, watchers_ > 0, seconds_since(transfers_moved_at_));
}

void Engine::record_transfer(const Transfer& t) {
  const double end_us = now_us();
  const double start_us = t.op->times().submitted_us;
  RingTraffic traffic;
  (t.send ? traffic.bytes_sent : traffic.bytes_received) = t.bytes;
  traffic.dense_bytes = traffic.bytes_sent;  // nothing compresses a transfer
  count("transfer", t.send ? "send" : "receive", traffic, (end_us - start_us) * 1e-6);
  // The operation's name says the peer, the tag and the bytes: "rank 1's receive of 8 bytes from rank 0 (tag 4)".
  Timeline::instance().record(t.op->name(), t.send ? "send" : "receive", start_us, end_us, 0);
}

void Engine::cancel_transfers(CommContext& ctx, const Status& st) {
  std::vector<MPI_Request*> requests;
  for (auto& t : ctx.transfers) requests.push_back(&t.request);
  cancel_and_complete(requests, kCancelSeconds, "hpcdl");
  for (auto& t : ctx.transfers) t.op->finish(st);
  transfers_in_flight_ -= ctx.transfers.size();
  ctx.transfers.clear();
}

}  // namespace hpcdl
