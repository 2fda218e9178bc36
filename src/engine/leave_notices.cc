// Leave notices: a rank that exits or frees a communicator with operations
// in flight tells the others (through the coordinator), so that what waits
// for it fails instead of waiting forever.
#include <chrono>
#include <string>
#include <thread>

#include "hpcdl/engine/agreement.hpp"
#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/engine/executor.hpp"
#include "hpcdl/engine/notices.hpp"
#include "hpcdl/engine/op_wire.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/wire.hpp"

namespace hpcdl {

void Agreement::announce_leaving(CommContext& ctx, const std::string& why) {
  if (!ctx.set_up || ctx.size < 2) return;
  // Leave notices that have arrived name ranks already gone: they get no notice.
  for (;;) {
    bool got = false;
    MPI_Status probe;
    if (!receive(ctx, kTagLeave, &got, &probe).ok() || !got || !take_leave_notice(ctx, probe.MPI_SOURCE).ok()) break;
  }
  WireWriter w;
  w.put<std::int32_t>(ctx.rank);
  w.put<std::int32_t>(world_rank_);
  w.put_string(why);
  // The coordinator tells every rank; anyone else tells the coordinator, which forwards it.
  for (int r = 0; r < ctx.size; ++r)
    if (r != ctx.rank && (ctx.is_coordinator() || r == 0)) ctx.send(r, kTagLeave, w.buffer());
  // Small messages leave at once; a rank already gone must not hold this one up.
  const auto since = std::chrono::steady_clock::now();
  while (!ctx.outbox.empty() && seconds_since(since) < 1.0 && ctx.flush_outbox().ok())
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  for (auto& out : ctx.outbox) {
    MPI_Request_free(&out->req);
    out.release();  // MPI may still read its bytes: a few bytes kept for good
  }
  ctx.outbox.clear();
}

// A leave notice from `source` (in control_msg_): every one marks its rank as
// left; the first fails what waits on ctx, and the coordinator forwards it
// (forward_leave_notice).
Status Agreement::take_leave_notice(CommContext& ctx, int source) {
  WireReader r(control_msg_.data(), control_msg_.size());
  std::int32_t rank = -1, world_rank = -1;
  std::string why;
  r.get(&rank);
  r.get(&world_rank);
  r.get_string(&why);
  if (rank >= 0 && rank < ctx.size) {
    if (ctx.left.empty()) ctx.left.assign(static_cast<std::size_t>(ctx.size), 0);
    ctx.left[static_cast<std::size_t>(rank)] = 1;
  }
  if (!ctx.gone.ok()) return Status::OK();
  ctx.gone = Status::Cancelled("hpcdl: rank " + std::to_string(rank) + " of the communicator (rank " +
                               std::to_string(world_rank) + " of COMM_WORLD) left: " + why +
                               "; operations on this communicator cannot complete");
  ctx.gone_at = std::chrono::steady_clock::now();
  ctx.table.clear();
  ctx.partial.clear();
  // Said here too: the caller may catch the error its operations get.
  if (!ctx.pending.empty() || executor_.executing() == &ctx)
    notices_.post(EngineNotice::Kind::kRankLeft, ctx.gone.message());
  // First news of it at the coordinator: everyone else is told, once, a little later.
  if (ctx.is_coordinator()) {
    ctx.leave_to_forward = control_msg_;
    ctx.leave_source = source;
    ctx.leave_forward_at = std::chrono::steady_clock::now() + kLeaveForwardDelay;
  }
  return Status::OK();
}

// The delay lets the notices of ranks leaving together arrive first: a rank already in
// MPI_Finalize must get no message (see CommContext::left), and ranks that leave get none.
Status Agreement::forward_leave_notice(CommContext& ctx) {
  if (ctx.leave_to_forward.empty() || std::chrono::steady_clock::now() < ctx.leave_forward_at) return Status::OK();
  std::vector<char> notice = std::move(ctx.leave_to_forward);
  ctx.leave_to_forward.clear();
  for (int r = 1; r < ctx.size; ++r)
    if (r != ctx.leave_source) HPCDL_RETURN_NOT_OK(ctx.send(r, kTagLeave, notice));
  return Status::OK();
}

}  // namespace hpcdl
