// The engine thread's loop (engine_loop.hpp): one pass takes submissions,
// releases freed communicators, completes set-ups, polls each communicator's
// agreement and runs its plans, moves transfers, and otherwise idles with a
// backoff.
#include "hpcdl/engine/engine_loop.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/util/env.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/thread_setup.hpp"

namespace hpcdl {

namespace {

// How long shutdown waits for the engine thread's last leave notices: an MPI_Isend
// to a rank whose process ended just before the notice of its leaving arrived can
// block in connect() for good, and a process must end rather than hang.
constexpr auto kShutdownBound = std::chrono::seconds(30);
constexpr auto kBusyIdle = std::chrono::microseconds(20);        // the first sleep after something moved
constexpr auto kNothingIdle = std::chrono::microseconds(20000);  // nothing pending here: stall checks only

}  // namespace

std::chrono::microseconds engine_wait_sleep() {
  return std::chrono::microseconds(std::clamp(wait_sleep_cap_us(), 1L, 1000L));
}

std::chrono::microseconds transfer_poll_sleep(bool large, bool watched, double transfers_idle_s) {
  const long cap_us = static_cast<long>(engine_wait_sleep().count());
  if (large) return std::chrono::microseconds(cap_us);
  const long floor_us = watched ? cap_us : 5000L;
  const long grown_us = static_cast<long>(transfers_idle_s * (1e6 / 64));
  return std::chrono::microseconds(std::clamp(grown_us, floor_us, std::max(floor_us, 10000L)));
}

struct EngineLoop::Pass {
  std::vector<std::shared_ptr<CommContext>> contexts;  // live ones, as the pass began
  StallLimits limits;
};

// While an operation's data moves (each wait of the ring, top-k's collectives
// and the broadcast) and while a deferred operation waits for its data: take
// new submissions, read the control channels so the next operations are
// agreed, move transfers, and give up a wait that stopped progressing.
class EngineLoop::Meanwhile : public Progress {
 public:
  Meanwhile(EngineLoop& loop, const Pass& pass) : loop_(loop), pass_(pass) {
    // A poll a millisecond agrees the next operation long before a ring
    // ends; every poll more is MPI progress on a core the ranks share. A rank
    // with children in the report tree polls every 200 us: its subtree's
    // reports and plans wait for its polls.
    bool forwards = false;
    for (auto& ctx : pass.contexts) forwards = forwards || !ctx->children.empty();
    agree_every_ = std::chrono::microseconds(forwards ? 200 : 1000);
  }

  bool waiting(double waited_s) override {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_agreed_ >= agree_every_) {
      last_agreed_ = now;
      loop_.drain_submissions();
      for (auto& ctx : pass_.contexts)
        if (ctx->set_up && ctx->control_error.ok())
          ctx->control_error = loop_.agreement_.poll(*ctx, false, pass_.limits, &unused_busy_);
    }
    // Transfers move between a ring's polls too (a pipeline's while its data-parallel allreduce runs).
    if (loop_.transfers_.in_flight() > 0)
      for (auto& ctx : pass_.contexts) loop_.transfers_.progress(*ctx, &unused_busy_);
    const CommContext* running = loop_.executor_.executing();
    if (running == nullptr) return true;
    double stalled_s = 0;
    const bool wait_on =
        StallInspector::keep_waiting(*running, loop_.executor_.cancellable(), waited_s, pass_.limits, &stalled_s);
    if (stalled_s > 0) loop_.executor_.stalled(stalled_s);
    return wait_on;
  }

  std::string abandoned_because() const override { return loop_.executor_.stall_text(); }

 private:
  EngineLoop& loop_;
  const Pass& pass_;
  std::chrono::microseconds agree_every_;
  std::chrono::steady_clock::time_point last_agreed_{};
  bool unused_busy_ = false;
};

Status EngineLoop::start_locked() {
  if (queue.running) return Status::OK();
  HPCDL_RETURN_NOT_OK(start_thread(
      "its engine thread", [this] { run(); }, &thread_));
  queue.running = true;
  return Status::OK();
}

void EngineLoop::run() {
  name_this_thread("hpcdl-engine");
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  agreement_.set_world_rank(world_rank_);
  request_short_slice(engine_slice_us());
  auto idle = kBusyIdle;
  auto last_plan = std::chrono::steady_clock::now();
  while (run_loop_once(&idle, &last_plan)) {}
  finish();
}

bool EngineLoop::run_loop_once(std::chrono::microseconds* idle, std::chrono::steady_clock::time_point* last_plan) {
  bool busy = drain_submissions();
  Pass pass;
  {
    std::lock_guard<std::mutex> g(queue.mu);
    if (!queue.running) return false;
    pass.limits = queue.limits;
  }
  std::vector<std::shared_ptr<CommContext>> freed, freed_during_setup;
  contexts.take(&pass.contexts, &freed);
  for (auto& ctx : freed)
    if (!release_freed(*ctx)) freed_during_setup.push_back(ctx);
  contexts.put_back(freed_during_setup);
  const bool stall_check = seconds_since(*last_plan) > 0.1;
  Meanwhile progress(*this, pass);
  for (auto& ctx : pass.contexts) {
    transfers_.progress(*ctx, &busy);
    if (!ctx->set_up) {
      Status st = contexts.finish_setup(*ctx, pass.limits);
      if (!st.ok()) fail_context(*ctx, st);
      if (!ctx->set_up) continue;
    }
    Status st = agreement_.poll(*ctx, stall_check, pass.limits, &busy);
    if (st.ok()) {
      busy = busy || !ctx->plans.empty();
      st = executor_.run_plans(*ctx, progress);
    }
    if (st.ok()) st = executor_.run_one_hop(*ctx, pass.limits.error_s, progress, &busy);
    if (!st.ok()) {
      fail_context(*ctx, st);
    } else if (!ctx->gone.ok() && !ctx->pending.empty() && ctx->plans.empty() &&
               seconds_since(ctx->gone_at) >= kLeftRankPlanGraceSeconds) {
      fail_pending(*ctx, ctx->gone);  // what waits for the rank that left
    }
    // Data the rank that left sent before it went had this long to arrive.
    if (!ctx->gone.ok() && !ctx->transfers.empty() && seconds_since(ctx->gone_at) >= kLeftRankRingGraceSeconds)
      transfers_.cancel(*ctx, ctx->gone);
  }
  for (auto& ctx : pass.contexts) busy = busy || !ctx->plans.empty();
  // The control channel's polls above moved MPI on too: a message they took in
  // finishes its transfer now, not one sleep later.
  if (!busy && transfers_.in_flight() > 0)
    for (auto& ctx : pass.contexts) transfers_.progress(*ctx, &busy);
  if (stall_check) *last_plan = std::chrono::steady_clock::now();
  if (busy) {
    *idle = kBusyIdle;
    return true;
  }
  idle_wait(pass.contexts, idle);
  return true;
}

// Someone waits for a plan: poll the control channel as a waiting ring
// does (every few polls cost the ranks still computing a share of the
// node's cores); so does a control message MPI has not sent yet. Nothing
// ready here: no plan can run before this rank's data is in place
// (a submission or mark_ready() wakes the loop at once), so poll only for
// the stall checks, every 20 ms (at 1 ms the idle engine took ~6 ms of
// CPU per 200 ms training step from the forward pass on 4 ranks per 2
// cores). A deferred operation was reported when submitted: until it is
// marked ready its round needs no polls on cores computing its data.
void EngineLoop::idle_wait(const std::vector<std::shared_ptr<CommContext>>& live, std::chrono::microseconds* idle) {
  std::uint64_t seen_wakeups;
  {
    std::lock_guard<std::mutex> g(queue.mu);
    seen_wakeups = queue.wakeups;
  }
  // Transfers alone poll often while someone waits for one (or one is
  // large), and less the longer they have not moved (transfer_poll_sleep).
  bool waiting = false;
  for (auto& ctx : live) {
    waiting = waiting || !ctx->outbox.empty() || (!ctx->set_up && !ctx->pending.empty());
    for (auto& kv : ctx->pending) waiting = waiting || kv.second->ready();
  }
  const auto max_idle = waiting                      ? engine_wait_sleep()
                        : transfers_.in_flight() > 0 ? transfers_.poll_interval()
                                                     : kNothingIdle;
  waiting = waiting || transfers_.in_flight() > 0;
  // From 20 us when something just became ready (a wake() ends a 20 ms sleep).
  *idle = waiting ? std::min(*idle, max_idle) : max_idle;
  std::unique_lock<std::mutex> g(queue.mu);
  const bool woken = queue.cv.wait_for(
      g, *idle, [&] { return !queue.submitted.ops.empty() || !queue.running || queue.wakeups != seen_wakeups; });
  *idle = woken ? kBusyIdle : std::min(*idle * 2, max_idle);
}

bool EngineLoop::drain_submissions() {
  Submissions batch = queue.take();
  const bool busy = !batch.empty();
  for (auto& item : batch.transfers) transfers_.take(*item.first, std::move(item.second));
  for (auto& item : batch.ops) {
    item.first->pending.emplace(item.second->name(), item.second);
    // A context a rank has left reports nothing more: the loop fails what is pending there.
    if (item.first->gone.ok()) item.first->unreported.push_back(item.second->name());
  }
  return busy;
}

// Shutting down: whatever has not run never will, and the other ranks may
// wait for this one (in an operation it never submitted, or one it
// cancels here): tell them, so they fail instead of waiting forever.
void EngineLoop::finish() {
  drain_submissions();
  const std::vector<std::shared_ptr<CommContext>> all = contexts.all();
  for (auto& ctx : all) {
    for (auto& op : ctx->pending)
      op.second->finish(Status::Cancelled("hpcdl's engine shut down before '" + op.first + "' ran"));
    ctx->pending.clear();
    transfers_.cancel(*ctx, Status::Cancelled("hpcdl's engine shut down before a point-to-point transfer finished"));
    if (!ctx->freed) agreement_.announce_leaving(*ctx, "its process exited (its engine shut down at interpreter exit)");
  }
  {
    std::lock_guard<std::mutex> g(queue.mu);
    for (auto& ctx : all) ctx->in_flight.clear();
    queue.loop_done = true;
  }
  queue.cv.notify_all();
}

void EngineLoop::stop() {
  {
    std::unique_lock<std::mutex> g(queue.mu);
    queue.stopped = true;
    if (!queue.running) return;
    queue.running = false;
    queue.cv.notify_all();
    if (!queue.cv.wait_for(g, kShutdownBound, [&] { return queue.loop_done; })) {
      // The thread is inside MPI and cannot be stopped, nor can MPI_Finalize run beside it.
      std::fprintf(stderr,
                   "[hpcdl rank %d] exit: the engine could not tell the other ranks that this rank leaves within "
                   "%lld s (MPI blocks sending to a rank whose process has already ended); ending this process "
                   "with exit code 1 instead of hanging\n",
                   world_rank_, static_cast<long long>(kShutdownBound.count()));
      std::fflush(nullptr);
      std::_Exit(1);
    }
  }
  if (thread_.joinable()) thread_.join();
}

// A communicator the user freed (its MPI attribute said so): its pending
// operations are cancelled, the other ranks told, its residuals and
// duplicates freed. False while its duplication has not completed (the
// duplicates exist only then): call again later.
bool EngineLoop::release_freed(CommContext& ctx) {
  residuals.forget_context(ctx.id);
  // The other ranks may wait for these in their rings or agreement: tell them.
  if (!ctx.pending.empty()) agreement_.announce_leaving(ctx, "it freed the communicator with operations in flight");
  for (auto& kv : ctx.pending)
    kv.second->finish(Status::Cancelled("the communicator of '" + kv.first + "' was freed before it ran"));
  ctx.pending.clear();
  transfers_.cancel(ctx,
                    Status::Cancelled("the communicator of a point-to-point transfer was freed before it finished"));
  int set_up = ctx.set_up;
  if (!set_up) MPI_Testall(2, ctx.setup, &set_up, MPI_STATUSES_IGNORE);
  if (!set_up) return false;
  ctx.set_up = true;
  bool closed = false;
  if (ctx.close_control(&closed).ok() && !closed) return false;
  MPI_Comm_free(&ctx.ctl);
  MPI_Comm_free(&ctx.data);
  return true;
}

void EngineLoop::fail_context(CommContext& ctx, const Status& st) {
  notices.post(EngineNotice::Kind::kError, "engine error: " + st.message());
  fail_pending(ctx, st);
  transfers_.cancel(ctx, st);
}

void EngineLoop::fail_pending(CommContext& ctx, const Status& st) {
  for (auto& kv : ctx.pending) kv.second->finish(st);
  ctx.pending.clear();
  ctx.plans.clear();
  ctx.stop_one_hop();
  ctx.control_error = Status::OK();  // delivered: later operations meet their own errors, not this one
  std::lock_guard<std::mutex> g(queue.mu);
  ctx.in_flight.clear();
}

}  // namespace hpcdl
