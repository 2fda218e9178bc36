// The engine: submissions queue up from any thread; one background thread
// takes them, keeps every communicator's agreement going (agreement.cc), runs
// the plans (execute.cc) and otherwise idles with a backoff.
#include "hpcdl/engine.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <limits>
#include <string>

#include "hpcdl/codecs.hpp"
#include "hpcdl/comm_context.hpp"
#include "hpcdl/env.hpp"
#include "hpcdl/mpi_process.hpp"
#include "hpcdl/mpi_util.hpp"
#include "hpcdl/thread_setup.hpp"
#include "hpcdl/timeline.hpp"

namespace hpcdl {

namespace {

// After a rank has left, a wait of the running operation that has made no
// progress for this long (since the news) is given up: the data that rank
// sent before it left had time to arrive. A ring's requests are cancelled
// then; a collective's cannot be, so it gets longer and then ends the job.
constexpr double kLeftRankRingGraceSeconds = 5.0;
constexpr double kLeftRankCollectiveGraceSeconds = 30.0;
// Operations not yet planned here when the news came are failed only after
// this long with no plan to run: plans the coordinator sent before a rank left
// (it may be the one that left) are still on their way down the report tree.
constexpr double kLeftRankPlanGraceSeconds = 5.0;
// How long shutdown waits for the engine thread's last leave notices: an MPI_Isend
// to a rank whose process ended just before the notice of its leaving arrived can
// block in connect() for good, and a process must end rather than hang.
constexpr auto kShutdownBound = std::chrono::seconds(30);

}  // namespace

// ---- Operation ----

bool Operation::done() {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

void Operation::mark_ready() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (ready_) return;
    ready_ = true;
    times_.ready_us = now_us();
  }
  cv_.notify_all();  // the engine, if the plan has reached this operation
  Engine::instance().wake();  // the engine, if it idles until something is ready
}

bool Operation::ready() {
  std::lock_guard<std::mutex> g(mu_);
  return ready_;
}

bool Operation::wait_ready_for(double seconds) {
  std::unique_lock<std::mutex> g(mu_);
  cv_.wait_for(g, std::chrono::duration<double>(seconds), [this] { return ready_; });
  return ready_;
}

bool Operation::wait_for(double seconds) {
  if (done()) return true;
  Engine::Watch watch(Engine::instance());  // the engine polls for what this thread waits for
  std::unique_lock<std::mutex> g(mu_);
  cv_.wait_for(g, std::chrono::duration<double>(seconds), [this] { return done_; });
  return done_;
}

Status Operation::status() {
  std::lock_guard<std::mutex> g(mu_);
  return status_;
}

std::vector<std::string> Operation::take_notices() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::string> out;
  out.swap(notices_);
  return out;
}

OpTimes Operation::times() {
  std::lock_guard<std::mutex> g(mu_);
  return times_;
}

void Operation::finish(Status st) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (done_) return;
    status_ = std::move(st);
    times_.finished_us = now_us();
    done_ = true;
  }
  cv_.notify_all();
}

void Operation::notify(std::string message) {
  std::lock_guard<std::mutex> g(mu_);
  notices_.push_back(std::move(message));
}

// ---- Engine ----

Engine& Engine::instance() {
  static Engine* engine = new Engine();  // never destroyed: outlives static teardown order
  return *engine;
}

void Engine::wake() {
  {
    std::lock_guard<std::mutex> g(mu_);
    ++wakeups_;
  }
  cv_.notify_one();
}

Engine::Watch::Watch(Engine& engine) : engine_(engine) {
  if (engine_.watchers_.fetch_add(1) == 0) engine_.wake();  // it may sleep a slow poll's interval
}

Engine::Watch::~Watch() { engine_.watchers_.fetch_sub(1); }

void Engine::set_stall_limits(double warn_seconds, double error_seconds) {
  std::lock_guard<std::mutex> g(mu_);
  stall_warn_s_ = warn_seconds;
  stall_error_s_ = error_seconds;
}

Status Engine::submit(MPI_Comm comm, OpRequest req, std::shared_ptr<Operation>* out) {
  HPCDL_RETURN_NOT_OK(require_thread_multiple("hpcdl", "its engine thread makes MPI calls while yours do"));
  const OpDesc& d = req.desc;
  if (d.kind == OpKind::kAllreduce && d.reduce_op == ReduceOp::kAverage && !dtype_is_float(d.dtype))
    return Status::Invalid(std::string("op='average' needs a floating-point dtype, got ") + dtype_name(d.dtype));
  if (d.kind == OpKind::kAllreduce && (d.chunk_bytes < kMinChunkBytes || d.chunk_bytes > kMaxChunkBytes))
    return Status::Invalid("chunk_bytes must be between " + std::to_string(kMinChunkBytes) + " and " +
                           std::to_string(kMaxChunkBytes) + ", got " + std::to_string(d.chunk_bytes));
  if (d.kind == OpKind::kAllreduce && !d.codec.empty()) {
    CodecSpec& spec = req.codec_spec;
    HPCDL_RETURN_NOT_OK(parse_codec(d.codec, &spec));
    HPCDL_RETURN_NOT_OK(check_codec_dtype(spec, d.codec, d.dtype));
    if (spec.kind == CodecKind::kTopK && d.count > std::numeric_limits<std::uint32_t>::max())
      return Status::Invalid("top-k sends uint32 indices: at most 2^32 - 1 elements, got " + std::to_string(d.count));
  }

  std::lock_guard<std::mutex> g(mu_);
  if (stopped_) return Status::Cancelled("hpcdl's engine has shut down (interpreter exit)");
  std::shared_ptr<CommContext> ctx;
  HPCDL_RETURN_NOT_OK(context_for(comm, &ctx));
  if (d.kind == OpKind::kBroadcast && (d.root < 0 || d.root >= ctx->size))
    return Status::Invalid("root " + std::to_string(d.root) + " is not a rank of a communicator of size " +
                           std::to_string(ctx->size));
  // Before the operation is named or recorded: a failed start leaves nothing,
  // not even a gap in the unnamed operations' numbering.
  HPCDL_RETURN_NOT_OK(start_locked());
  std::string name = req.name.empty() ? "op#" + std::to_string(ctx->unnamed_seq++) : req.name;
  if (ctx->in_flight.count(name))
    return Status::Invalid("an operation named '" + name + "' is already in flight on this communicator");
  ctx->in_flight.insert(name);
  auto op = std::make_shared<Operation>(name, std::move(req));
  op->times_.submitted_us = now_us();
  if (op->ready_) op->times_.ready_us = op->times_.submitted_us;
  queue_.emplace_back(ctx, op);
  cv_.notify_one();
  *out = std::move(op);
  return Status::OK();
}

Status Engine::start_locked() {
  if (running_) return Status::OK();
  HPCDL_RETURN_NOT_OK(start_thread("its engine thread", [this] { loop(); }, &thread_));
  running_ = true;
  return Status::OK();
}

bool Engine::drain_submissions() {
  std::vector<std::pair<std::shared_ptr<CommContext>, std::shared_ptr<Operation>>> batch;
  bool busy;
  {
    std::lock_guard<std::mutex> g(mu_);
    batch.swap(queue_);
    for (auto& item : transfer_queue_) item.first->transfers.push_back(std::move(item.second));
    transfers_in_flight_ += transfer_queue_.size();
    busy = !transfer_queue_.empty();
    if (busy) transfers_moved_at_ = std::chrono::steady_clock::now();
    transfer_queue_.clear();
  }
  for (auto& item : batch) {
    item.first->pending.emplace(item.second->name(), item.second);
    // A context a rank has left reports nothing more: the loop fails what is pending there.
    if (item.first->gone.ok()) item.first->unreported.push_back(item.second->name());
  }
  return busy || !batch.empty();
}

void Engine::record(const Operation& op, const RingTraffic& traffic, double seconds) {
  const OpDesc& d = op.req_.desc;
  count(op_kind_name(d.kind), d.kind == OpKind::kAllreduce ? (d.codec.empty() ? "none" : d.codec) : "", traffic,
        seconds);
}

void Engine::count(const std::string& kind, const std::string& codec, const RingTraffic& traffic, double seconds) {
  std::lock_guard<std::mutex> g(stats_mu_);
  EngineStats& s = stats_[{kind, codec}];
  s.kind = kind;
  s.codec = codec;
  s.ops += 1;
  s.bytes_sent += traffic.bytes_sent;
  s.bytes_received += traffic.bytes_received;
  s.dense_bytes += traffic.dense_bytes;
  s.seconds += seconds;
}

std::vector<EngineStats> Engine::stats() {
  std::lock_guard<std::mutex> g(stats_mu_);
  std::vector<EngineStats> out;
  for (auto& kv : stats_) out.push_back(kv.second);
  return out;
}

AgreementStats Engine::agreement_stats() {
  std::lock_guard<std::mutex> g(stats_mu_);
  return agreement_stats_;
}

void Engine::reset_stats() {
  std::lock_guard<std::mutex> g(stats_mu_);
  stats_.clear();
  agreement_stats_ = AgreementStats();
}

void Engine::publish_agreement_stats(CommContext& ctx) {
  AgreementStats& c = ctx.counted;
  if (c.messages_sent + c.messages_received == 0) return;
  {
    std::lock_guard<std::mutex> g(stats_mu_);
    agreement_stats_.messages_sent += c.messages_sent;
    agreement_stats_.messages_received += c.messages_received;
    agreement_stats_.entries_received += c.entries_received;
    agreement_stats_.descriptions_received += c.descriptions_received;
  }
  c = AgreementStats();
}

void Engine::loop() {
  name_this_thread("hpcdl-engine");
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
  request_short_slice(engine_slice_us());
  auto idle = std::chrono::microseconds(20);
  auto last_plan = std::chrono::steady_clock::now();
  for (;;) {
    bool busy = drain_submissions();
    double warn_s, error_s;
    std::vector<std::shared_ptr<CommContext>> contexts, freed;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!running_) break;
      warn_s = stall_warn_s_;
      error_s = stall_error_s_;
      for (auto& c : contexts_) (c->freed ? freed : contexts).push_back(c);
      contexts_ = contexts;
    }
    std::vector<std::shared_ptr<CommContext>> freed_during_setup;
    for (auto& ctx : freed)
      if (!release_freed(*ctx)) freed_during_setup.push_back(ctx);
    if (!freed_during_setup.empty()) {
      std::lock_guard<std::mutex> g(mu_);
      contexts_.insert(contexts_.end(), freed_during_setup.begin(), freed_during_setup.end());
    }
    const bool stall_check = seconds_since(last_plan) > 0.1;
    bool unused_busy = false;
    auto last_agreed = std::chrono::steady_clock::time_point{};
    // A poll a millisecond agrees the next operation long before a ring
    // ends; every poll more is MPI progress on a core the ranks share. A rank
    // with children in the report tree polls every 200 us: its subtree's
    // reports and plans wait for its polls.
    bool forwards = false;
    for (auto& ctx : contexts) forwards = forwards || !ctx->children.empty();
    const auto agree_every = std::chrono::microseconds(forwards ? 200 : 1000);
    std::function<bool(double)> agree_meanwhile = [&](double waited_s) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last_agreed >= agree_every) {
        last_agreed = now;
        drain_submissions();
        for (auto& ctx : contexts)
          if (ctx->set_up && ctx->control_error.ok())
            ctx->control_error = poll_control(*ctx, false, warn_s, error_s, &unused_busy);
      }
      // Transfers move between a ring's polls too (a pipeline's while its data-parallel allreduce runs).
      if (transfers_in_flight_ > 0)
        for (auto& ctx : contexts) progress_transfers(*ctx, &unused_busy);
      CommContext* running = executing_;
      if (running == nullptr) return true;
      // No transfer of the ring completed for stall_error_seconds: a neighbour
      // that is stopped, or dead under a launcher that leaves the job running,
      // looks just like this; end the wait rather than hang.
      if (running->gone.ok() && error_s > 0 && waited_s >= error_s) {
        executing_stalled_s_ = waited_s;
        if (executing_cancellable_) return false;
        abort_job("an MPI collective made no progress for " + seconds_text(waited_s) +
                  " (stall_error_seconds); a rank may be stopped or dead, and such a request can be neither "
                  "cancelled nor freed");
      }
      // A rank of the running operation left, and this wait stopped progressing.
      if (running->gone.ok()) return true;
      const double stuck_s = std::min(waited_s, seconds_since(running->gone_at));
      if (stuck_s < (executing_cancellable_ ? kLeftRankRingGraceSeconds : kLeftRankCollectiveGraceSeconds))
        return true;
      if (executing_cancellable_) return false;
      abort_job(running->gone.message());  // a collective request can be neither cancelled nor freed
    };
    wait_hook = &agree_meanwhile;
    for (auto& ctx : contexts) {
      progress_transfers(*ctx, &busy);
      if (!ctx->set_up) {
        Status st = finish_setup(*ctx, warn_s, error_s);
        if (!st.ok()) fail_context(*ctx, st);
        if (!ctx->set_up) continue;
      }
      Status st = poll_control(*ctx, stall_check, warn_s, error_s, &busy);
      if (st.ok()) {
        busy = busy || !ctx->plans.empty();
        st = run_plans(*ctx);
      }
      if (!st.ok()) {
        fail_context(*ctx, st);
      } else if (!ctx->gone.ok() && !ctx->pending.empty() && ctx->plans.empty() &&
                 seconds_since(ctx->gone_at) >= kLeftRankPlanGraceSeconds) {
        fail_pending(*ctx, ctx->gone);  // what waits for the rank that left
      }
      // Data the rank that left sent before it went had this long to arrive.
      if (!ctx->gone.ok() && !ctx->transfers.empty() && seconds_since(ctx->gone_at) >= kLeftRankRingGraceSeconds)
        cancel_transfers(*ctx, ctx->gone);
    }
    wait_hook = nullptr;
    for (auto& ctx : contexts) busy = busy || !ctx->plans.empty();
    // The control channel's polls above moved MPI on too: a message they took in
    // finishes its transfer now, not one sleep later.
    if (!busy && transfers_in_flight_ > 0)
      for (auto& ctx : contexts) progress_transfers(*ctx, &busy);
    if (stall_check) last_plan = std::chrono::steady_clock::now();
    if (busy) {
      idle = std::chrono::microseconds(20);
      continue;
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
    std::uint64_t seen_wakeups;
    {
      std::lock_guard<std::mutex> g(mu_);
      seen_wakeups = wakeups_;
    }
    // Transfers alone poll often while someone waits for one (or one is
    // large), and less the longer they have not moved (transfer_poll_sleep).
    bool waiting = false;
    for (auto& ctx : contexts) {
      waiting = waiting || !ctx->outbox.empty() || (!ctx->set_up && !ctx->pending.empty());
      for (auto& kv : ctx->pending) waiting = waiting || kv.second->ready();
    }
    const auto max_idle = waiting                    ? engine_wait_sleep()
                          : transfers_in_flight_ > 0 ? transfer_poll_interval()
                                                     : std::chrono::microseconds(20000);
    waiting = waiting || transfers_in_flight_ > 0;
    // From 20 us when something just became ready (a wake() ends a 20 ms sleep).
    idle = waiting ? std::min(idle, max_idle) : max_idle;
    std::unique_lock<std::mutex> g(mu_);
    const bool woken = cv_.wait_for(g, idle, [&] { return !queue_.empty() || !running_ || wakeups_ != seen_wakeups; });
    idle = woken ? std::chrono::microseconds(20) : std::min(idle * 2, max_idle);
  }
  // Shutting down: whatever has not run never will, and the other ranks may
  // wait for this one (in an operation it never submitted, or one it
  // cancels here): tell them, so they fail instead of waiting forever.
  drain_submissions();
  std::vector<std::shared_ptr<CommContext>> contexts;
  {
    std::lock_guard<std::mutex> g(mu_);
    contexts = contexts_;
  }
  for (auto& ctx : contexts) {
    for (auto& op : ctx->pending)
      op.second->finish(Status::Cancelled("hpcdl's engine shut down before '" + op.first + "' ran"));
    ctx->pending.clear();
    cancel_transfers(*ctx, Status::Cancelled("hpcdl's engine shut down before a point-to-point transfer finished"));
    if (!ctx->freed) announce_leaving(*ctx, "its process exited (its engine shut down at interpreter exit)");
  }
  {
    std::lock_guard<std::mutex> g(mu_);
    for (auto& ctx : contexts_) ctx->in_flight.clear();
    loop_done_ = true;
  }
  cv_.notify_all();
}

void Engine::shutdown() {
  // A forked child has a copy of the engine's state but not its thread, which
  // is its parent's to stop: there is nothing to wait for or to tell anyone.
  if (!in_mpi_process()) return;
  {
    std::unique_lock<std::mutex> g(mu_);
    stopped_ = true;
    if (!running_) return;
    running_ = false;
    cv_.notify_all();
    if (!cv_.wait_for(g, kShutdownBound, [&] { return loop_done_; })) {
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

}  // namespace hpcdl
