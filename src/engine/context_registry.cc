// Communicator contexts: made at a communicator's first submission (two
// MPI_Comm_idup duplicates, an MPI attribute that finds it again), completed
// by the engine thread, dropped when the user frees the communicator.
#include "hpcdl/engine/context_registry.hpp"

#include <algorithm>
#include <chrono>
#include <map>
#include <string>
#include <thread>

#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/engine/residual_store.hpp"
#include "hpcdl/engine/submission_queue.hpp"
#include "hpcdl/util/env.hpp"
#include "hpcdl/util/mpi_util.hpp"

namespace hpcdl {

using HeldResiduals = std::map<std::string, std::vector<float>>;

#ifdef OPEN_MPI
// How long freeing a communicator waits for hpcdl's duplication of it (on_comm_freed).
constexpr int kFreeWaitsForSetupSeconds = 10;
#endif

Status ContextRegistry::context_for(MPI_Comm comm, std::shared_ptr<CommContext>* out) {
  if (comm == MPI_COMM_NULL) return Status::Invalid("communicator is MPI_COMM_NULL");
  int rc;
  if (keyval_ == MPI_KEYVAL_INVALID) {
    rc = MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &ContextRegistry::on_comm_freed, &keyval_, &queue_);
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
    return Status::Invalid(
        "hpcdl works on intracommunicators, got an intercommunicator: "
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
  ctx->set_tree(agreement_flat() ? std::max(2, ctx->size) : agreement_radix());
  ctx->enable_one_hop(agreement_one_hop_ranks());
  ctx->id = next_id_++;
  rc = MPI_Comm_set_attr(comm, keyval_, ctx.get());
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_set_attr"));
  HPCDL_RETURN_NOT_OK(adopt_held_residuals(comm, ctx->id));
  *out = ctx;
  contexts_.push_back(std::move(ctx));
  return Status::OK();
}

Status ContextRegistry::find_id(MPI_Comm comm, bool* found, std::uint64_t* id) {
  std::lock_guard<std::mutex> g(queue_.mu);
  return find_id_locked(comm, found, id);
}

Status ContextRegistry::find_id_locked(MPI_Comm comm, bool* found, std::uint64_t* id) {
  *found = false;
  if (keyval_ == MPI_KEYVAL_INVALID) return Status::OK();
  void* attr = nullptr;
  int has = 0;
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Comm_get_attr(comm, keyval_, &attr, &has), "MPI_Comm_get_attr"));
  if (!has) return Status::OK();
  *found = true;
  *id = static_cast<CommContext*>(attr)->id;
  return Status::OK();
}

Status ContextRegistry::set_residual(MPI_Comm comm, const std::string& name, std::vector<float> values) {
  if (comm == MPI_COMM_NULL) return Status::Invalid("communicator is MPI_COMM_NULL");
  std::lock_guard<std::mutex> g(queue_.mu);
  std::uint64_t id = 0;
  bool has = false;
  HPCDL_RETURN_NOT_OK(find_id_locked(comm, &has, &id));
  if (has) {
    residuals_.put(id, name, std::move(values));
    return Status::OK();
  }
  if (held_keyval_ == MPI_KEYVAL_INVALID)
    HPCDL_RETURN_NOT_OK(mpi_status(
        MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &ContextRegistry::on_held_freed, &held_keyval_, nullptr),
        "MPI_Comm_create_keyval"));
  void* attr = nullptr;
  int found = 0;
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Comm_get_attr(comm, held_keyval_, &attr, &found), "MPI_Comm_get_attr"));
  if (!found) {
    attr = new HeldResiduals();
    const int rc = MPI_Comm_set_attr(comm, held_keyval_, attr);
    if (rc != MPI_SUCCESS) delete static_cast<HeldResiduals*>(attr);
    HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_set_attr"));
  }
  (*static_cast<HeldResiduals*>(attr))[name] = std::move(values);
  return Status::OK();
}

Status ContextRegistry::adopt_held_residuals(MPI_Comm comm, std::uint64_t id) {
  if (held_keyval_ == MPI_KEYVAL_INVALID) return Status::OK();
  void* attr = nullptr;
  int found = 0;
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Comm_get_attr(comm, held_keyval_, &attr, &found), "MPI_Comm_get_attr"));
  if (!found) return Status::OK();
  for (auto& kv : *static_cast<HeldResiduals*>(attr)) residuals_.put(id, kv.first, std::move(kv.second));
  return mpi_status(MPI_Comm_delete_attr(comm, held_keyval_), "MPI_Comm_delete_attr");  // frees the map
}

int ContextRegistry::on_held_freed(MPI_Comm, int, void* held, void*) {
  delete static_cast<HeldResiduals*>(held);
  return MPI_SUCCESS;
}

void ContextRegistry::take(std::vector<std::shared_ptr<CommContext>>* live,
                           std::vector<std::shared_ptr<CommContext>>* freed) {
  std::lock_guard<std::mutex> g(queue_.mu);
  for (auto& c : contexts_) (c->freed ? freed : live)->push_back(c);
  contexts_ = *live;
}

void ContextRegistry::put_back(const std::vector<std::shared_ptr<CommContext>>& contexts) {
  if (contexts.empty()) return;
  std::lock_guard<std::mutex> g(queue_.mu);
  contexts_.insert(contexts_.end(), contexts.begin(), contexts.end());
}

std::vector<std::shared_ptr<CommContext>> ContextRegistry::all() {
  std::lock_guard<std::mutex> g(queue_.mu);
  return contexts_;
}

// Called by MPI when the user frees a communicator hpcdl has used: the engine
// thread cancels what is still pending on it and drops the context. Never
// waits for the queue's mutex (see wake_from_mpi): MPI may call it inside the
// engine thread's own MPI calls while a submitting thread holds the mutex
// and waits for MPI.
int ContextRegistry::on_comm_freed(MPI_Comm, int, void* context, void* extra_state) {
  static_cast<CommContext*>(context)->freed = true;
  static_cast<SubmissionQueue*>(extra_state)->wake_from_mpi();
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

Status ContextRegistry::finish_setup(CommContext& ctx, const StallLimits& limits) {
  const double warn_s = limits.warn_s, error_s = limits.error_s;
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
  const std::string what =
      " for the other ranks to submit their first operation on this communicator "
      "(hpcdl sets up its channels with the first operation every rank submits on it)";
  if (error_s > 0 && waited >= error_s) {
    for (auto& kv : ctx.pending) {
      kv.second->finish(Status::Timeout("hpcdl: operation '" + kv.first + "' waited " + seconds_text(waited) + what));
      if (ctx.is_coordinator()) ctx.given_up[kv.first] = CommContext::GivenUp{{ctx.rank}, waited};
    }
    ctx.pending.clear();
    // The next operation submitted here waits its own stall limit for the set-up.
    ctx.setup_since = std::chrono::steady_clock::now();
    ctx.setup_warned_at = 0;
    std::lock_guard<std::mutex> g(queue_.mu);
    ctx.in_flight.clear();
  } else if (warn_s > 0 && waited >= warn_s && waited - ctx.setup_warned_at >= warn_s) {
    ctx.setup_warned_at = waited;
    for (auto& kv : ctx.pending)
      kv.second->notify("hpcdl: operation '" + kv.first + "' has waited " + seconds_text(waited) + what);
  }
  return Status::OK();
}

}  // namespace hpcdl
