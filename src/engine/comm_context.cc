// Communicator contexts: made at a communicator's first submission (two
// MPI_Comm_idup duplicates, an MPI attribute that finds it again), completed
// by the engine thread, released when the user frees the communicator, and
// the leave notices that tell the other ranks this one is gone.
#include <chrono>
#include <string>
#include <thread>

#include "hpcdl/comm_context.hpp"
#include "hpcdl/engine.hpp"
#include "hpcdl/env.hpp"
#include "hpcdl/mpi_util.hpp"
#include "hpcdl/op_wire.hpp"
#include "hpcdl/wire.hpp"

namespace hpcdl {

#ifdef OPEN_MPI
// How long freeing a communicator waits for hpcdl's duplication of it (on_comm_freed).
constexpr int kFreeWaitsForSetupSeconds = 10;
#endif

Status CommContext::send(int dest, int tag, std::vector<char> bytes) {
  if (has_left(dest)) return Status::OK();  // see `left`: a message there could block for good
  auto out = std::make_unique<Outgoing>();
  out->bytes = std::move(bytes);
  int rc = MPI_Isend(out->bytes.data(), static_cast<int>(out->bytes.size()), MPI_BYTE, dest, tag, ctl, &out->req);
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Isend(control)"));
  outbox.push_back(std::move(out));
  if (tag != kTagLeave) ++counted.messages_sent;
  return Status::OK();
}

Status CommContext::flush_outbox() {
  for (auto it = outbox.begin(); it != outbox.end();) {
    int flag = 0;
    int rc = MPI_Test(&(*it)->req, &flag, MPI_STATUS_IGNORE);
    HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Test(control)"));
    it = flag ? outbox.erase(it) : it + 1;
  }
  return Status::OK();
}

Status Engine::context_for(MPI_Comm comm, std::shared_ptr<CommContext>* out) {
  if (comm == MPI_COMM_NULL) return Status::Invalid("communicator is MPI_COMM_NULL");
  int rc;
  if (keyval_ == MPI_KEYVAL_INVALID) {
    rc = MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &Engine::on_comm_freed, &keyval_, this);
    HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_create_keyval"));
  }
  void* attr = nullptr;
  int found = 0;
  rc = MPI_Comm_get_attr(comm, keyval_, &attr, &found);
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_get_attr"));
  if (found) {
    for (auto& c : contexts_)
      if (c.get() == attr) *out = c;
    if (*out) return Status::OK();
  }
  // Checked once per communicator, before its context exists: the ring and the
  // agreement address ranks of one group; across an intercommunicator's two
  // groups they would pair the wrong ranks.
  int inter = 0;
  rc = MPI_Comm_test_inter(comm, &inter);
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_test_inter"));
  if (inter)
    return Status::Invalid("hpcdl works on intracommunicators, got an intercommunicator: "
                           "merge its groups first (MPI.Intercomm.Merge)");
  // Started here, in the caller's program order among its own collectives on
  // comm; never waited for here: a rank that submits later must not block
  // this one (nor the engine, which runs what is already agreed meanwhile).
  auto ctx = std::make_shared<CommContext>();
  rc = MPI_Comm_idup(comm, &ctx->ctl, &ctx->setup[0]);
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_idup"));
  rc = MPI_Comm_idup(comm, &ctx->data, &ctx->setup[1]);
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_idup"));
  ctx->setup_since = std::chrono::steady_clock::now();
  ctx->user = comm;
  MPI_Comm_rank(comm, &ctx->rank);
  MPI_Comm_size(comm, &ctx->size);
  ctx->set_tree(agreement_flat());
  ctx->id = next_context_id_++;
  rc = MPI_Comm_set_attr(comm, keyval_, ctx.get());
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_set_attr"));
  *out = ctx;
  contexts_.push_back(std::move(ctx));
  return Status::OK();
}

// Called by MPI when the user frees a communicator hpcdl has used: the engine
// thread cancels what is still pending on it and drops the context.
int Engine::on_comm_freed(MPI_Comm, int, void* context, void* extra_state) {
  Engine* engine = static_cast<Engine*>(extra_state);
  {
    std::lock_guard<std::mutex> g(engine->mu_);
    static_cast<CommContext*>(context)->freed = true;
  }
  engine->wake();
#ifdef OPEN_MPI
  // Open MPI crashes when a communicator is freed while an MPI_Comm_idup of
  // it is in flight (MPICH keeps the parent alive): let the engine thread
  // complete the duplication first. Bounded: a rank that never submitted on
  // this communicator never joins the duplication.
  const auto* ctx = static_cast<CommContext*>(context);
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(kFreeWaitsForSetupSeconds);
  while (!ctx->set_up && std::chrono::steady_clock::now() < until)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
#endif
  return MPI_SUCCESS;
}

// A communicator the user freed (its MPI attribute said so): its pending
// operations are cancelled, the other ranks told, its residuals and
// duplicates freed. False while its duplication has not completed (the
// duplicates exist only then): call again later.
bool Engine::release_freed(CommContext& ctx) {
  residuals_.forget_context(ctx.id);
  // The other ranks may wait for these in their rings or agreement: tell them.
  if (!ctx.pending.empty()) announce_leaving(ctx, "it freed the communicator with operations in flight");
  for (auto& kv : ctx.pending)
    kv.second->finish(Status::Cancelled("the communicator of '" + kv.first + "' was freed before it ran"));
  ctx.pending.clear();
  cancel_transfers(ctx,
                   Status::Cancelled("the communicator of a point-to-point transfer was freed before it finished"));
  int set_up = ctx.set_up;
  if (!set_up) MPI_Testall(2, ctx.setup, &set_up, MPI_STATUSES_IGNORE);
  if (!set_up) return false;
  ctx.set_up = true;
  MPI_Comm_free(&ctx.ctl);
  MPI_Comm_free(&ctx.data);
  return true;
}

Status Engine::finish_setup(CommContext& ctx, double warn_s, double error_s) {
  int flag = 0;
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Testall(2, ctx.setup, &flag, MPI_STATUSES_IGNORE), "MPI_Comm_idup"));
  if (flag) {
    MPI_Comm_set_errhandler(ctx.ctl, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(ctx.data, MPI_ERRORS_RETURN);
    ctx.set_up = true;
    return Status::OK();
  }
  // Until every rank has submitted its first operation here, no operation on
  // this communicator can be reported, so the coordinator cannot name the late
  // ranks: the waiting ranks warn (or fail) on their own.
  const double waited = seconds_since(ctx.setup_since);
  const std::string what = " for the other ranks to submit their first operation on this communicator "
                           "(hpcdl sets up its channels with the first operation every rank submits on it)";
  if (error_s > 0 && waited >= error_s) {
    for (auto& kv : ctx.pending) {
      kv.second->finish(Status::Timeout("hpcdl: operation '" + kv.first + "' waited " +
                                        seconds_text(waited) + what));
      if (ctx.is_coordinator()) ctx.given_up[kv.first] = CommContext::GivenUp{{ctx.rank}, waited};
    }
    ctx.pending.clear();
    // The next operation submitted here waits its own stall limit for the set-up.
    ctx.setup_since = std::chrono::steady_clock::now();
    ctx.setup_warned_at = 0;
    std::lock_guard<std::mutex> g(mu_);
    ctx.in_flight.clear();
  } else if (warn_s > 0 && waited >= warn_s && waited - ctx.setup_warned_at >= warn_s) {
    ctx.setup_warned_at = waited;
    for (auto& kv : ctx.pending)
      kv.second->notify("hpcdl: operation '" + kv.first + "' has waited " + seconds_text(waited) + what);
  }
  return Status::OK();
}

void Engine::announce_leaving(CommContext& ctx, const std::string& why) {
  if (!ctx.set_up || ctx.size < 2) return;
  // Leave notices that have arrived name ranks already gone: they get no notice.
  for (;;) {
    bool got = false;
    MPI_Status probe;
    if (!receive_control(ctx, kTagLeave, &got, &probe).ok() || !got || !take_leave_notice(ctx, probe.MPI_SOURCE).ok())
      break;
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

void Engine::fail_context(CommContext& ctx, const Status& st) {
  notice(EngineNotice::Kind::kError, "engine error: " + st.message());
  fail_pending(ctx, st);
  cancel_transfers(ctx, st);
}

void Engine::fail_pending(CommContext& ctx, const Status& st) {
  for (auto& kv : ctx.pending) kv.second->finish(st);
  ctx.pending.clear();
  ctx.plans.clear();
  ctx.control_error = Status::OK();  // delivered: later operations meet their own errors, not this one
  std::lock_guard<std::mutex> g(mu_);
  ctx.in_flight.clear();
}

// A leave notice from `source` (in control_msg_): every one marks its rank as
// left; the first fails what waits on ctx, and the coordinator forwards it
// (forward_leave_notice).
Status Engine::take_leave_notice(CommContext& ctx, int source) {
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
  if (!ctx.pending.empty() || executing_ == &ctx) notice(EngineNotice::Kind::kRankLeft, ctx.gone.message());
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
Status Engine::forward_leave_notice(CommContext& ctx) {
  if (ctx.leave_to_forward.empty() || std::chrono::steady_clock::now() < ctx.leave_forward_at) return Status::OK();
  std::vector<char> notice = std::move(ctx.leave_to_forward);
  ctx.leave_to_forward.clear();
  for (int r = 1; r < ctx.size; ++r)
    if (r != ctx.leave_source) HPCDL_RETURN_NOT_OK(ctx.send(r, kTagLeave, notice));
  return Status::OK();
}

}  // namespace hpcdl
