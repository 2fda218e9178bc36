// The collective engine: one background thread per process makes every MPI
// call for hpcdl's collectives. Callers submit operations (allreduce,
// broadcast, barrier) from any thread; the engine agrees on one execution
// order with the other ranks and runs them on a duplicate of the caller's
// communicator, so hpcdl traffic never mixes with the user's.
//
// Agreement: every rank reports operations that are ready to a coordinator
// (rank 0 of the communicator). The coordinator runs an operation once every
// rank has reported it, after checking that they all describe it the same
// way, and sends the order out. Reports travel up a binomial tree rooted at
// the coordinator and plans down it: a rank merges the reports of its
// subtree, so an operation seen before (reported as a small integer id with
// an unchanged description) reaches the coordinator as one entry per child,
// O(log P) messages and hops per step instead of one report per rank.
//
// A deferred operation is reported (and so agreed) at submission, before its
// data is in place; the engine runs it, in the agreed order, once the caller
// marks it ready. A framework that knows what it will reduce before backward
// computes it takes the agreement round off the critical path that way.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hpcdl/compressed_ring.hpp"
#include "hpcdl/dtype.hpp"
#include "hpcdl/operation.hpp"
#include "hpcdl/p2p.hpp"
#include "hpcdl/residual_store.hpp"
#include "hpcdl/ring.hpp"
#include "hpcdl/status.hpp"
#include "hpcdl/sparse_allreduce.hpp"
#include "hpcdl/topk.hpp"

namespace hpcdl {

struct EngineStats {
  std::string kind;   // allreduce, broadcast, barrier, transfer
  std::string codec;  // allreduce: its codec ("none": dense); transfer: its direction (send, receive)
  std::uint64_t ops = 0, bytes_sent = 0, bytes_received = 0, dense_bytes = 0;
  double seconds = 0;
};

// The agreement's control traffic on this rank, summed over communicators.
struct AgreementStats {
  std::uint64_t messages_sent = 0, messages_received = 0;  // reports and plans
  std::uint64_t entries_received = 0;       // reports taken from other ranks, one per operation and sender
  std::uint64_t descriptions_received = 0;  // of those, full descriptions (new or changed operations)
};

// What the engine thread has to tell this rank's caller. The thread never
// takes the GIL: Engine::notice keeps it for the Python layer, which issues it
// as a warning (hpcdl/_warn.py) at its next call into the engine.
struct EngineNotice {
  enum class Kind : int { kStall = 0, kRankLeft = 1, kError = 2 };
  Kind kind = Kind::kStall;
  std::string message;
};

class CommContext;

class Engine {
 public:
  static Engine& instance();

  Status submit(MPI_Comm comm, OpRequest req, std::shared_ptr<Operation>* out);
  // A send (or receive of exactly `bytes`) of raw memory to (from) `peer`
  // with `tag` on comm, moved by the engine thread (src/engine/p2p.cc).
  Status submit_transfer(MPI_Comm comm, bool send, void* data, std::uint64_t bytes, int peer, int tag,
                         std::shared_ptr<Operation>* out);
  // Warn after `warn_seconds` that an operation waits for ranks that never
  // submitted it; fail it after `error_seconds` (0: never).
  void set_stall_limits(double warn_seconds, double error_seconds);
  // Something pending became ready (Operation::mark_ready), or a
  // communicator was freed: an idle loop rechecks now.
  void wake();
  // While one lives, a thread is blocked on an operation or transfer: the
  // engine polls point-to-point transfers often (transfer_poll_sleep).
  class Watch {
   public:
    explicit Watch(Engine& engine);
    ~Watch();
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    Engine& engine_;
  };
  std::vector<EngineStats> stats();
  AgreementStats agreement_stats();
  void reset_stats();
  // Forgets every error-feedback residual (hpcdl.compression.reset_state()).
  void reset_compression_state();
  // The notices kept since the last call, oldest first; *dropped: how many
  // more came while kMaxNotices were already kept (those are lost).
  std::vector<EngineNotice> take_notices(std::uint64_t* dropped);
  static constexpr std::size_t kMaxNotices = 64;
  // A copy of tensor `name`'s error-feedback residual on `comm`; *found is
  // false when there is none (never compressed with that name, or reset).
  Status copy_residual(MPI_Comm comm, const std::string& name, std::vector<float>* out, bool* found);
  // Frees it (hpcdl.compression.free_residual); *found: there was one.
  Status free_residual(MPI_Comm comm, const std::string& name, bool* found);
  // Bytes every error-feedback residual of this process takes.
  std::uint64_t residual_bytes();
  // Joins the thread; operations not yet run finish with kCancelled, and the
  // other ranks of every communicator hpcdl used are told that this one left
  // (their operations waiting for it fail instead of waiting forever).
  void shutdown();

 private:
  Engine() = default;
  void loop();
  Status context_for(MPI_Comm comm, std::shared_ptr<CommContext>* out);
  // The id of comm's context, if it has one (looked up only: making one is collective).
  Status residual_context(MPI_Comm comm, std::uint64_t* id, bool* found);
  static int on_comm_freed(MPI_Comm comm, int keyval, void* context, void* extra_state);
  bool drain_submissions();
  // Starts the engine thread if it is not running (under mu_); on failure
  // running_ stays false and a later submission tries again.
  Status start_locked();
  // Posts ctx's new transfers, tests those in flight, finishes those done.
  void progress_transfers(CommContext& ctx, bool* busy);
  // The sleep between polls while only transfers are in flight (transfer_poll_sleep).
  std::chrono::microseconds transfer_poll_interval();
  // Every transfer not yet finished on ctx fails with st; its requests are cancelled.
  void cancel_transfers(CommContext& ctx, const Status& st);
  // One pass over ctx's control channel: report new submissions, take readies
  // (coordinator) and plans, plan what every rank submitted (coordinator).
  // Plans are queued on ctx, not run: this also runs while an operation's
  // data moves (wait_hook), so the next one is agreed meanwhile.
  Status poll_control(CommContext& ctx, bool stall_check, double warn_s, double error_s, bool* busy);
  // Adds ctx's control traffic counted since the last call to agreement_stats().
  void publish_agreement_stats(CommContext& ctx);
  // Runs or fails the entries of ctx's queued plans, in order.
  Status run_plans(CommContext& ctx);
  // Waits until a deferred operation the plan has reached is marked ready.
  Status await_ready(CommContext& ctx, Operation& op);
  // The control channel is broken: nothing pending on ctx can complete.
  void fail_context(CommContext& ctx, const Status& st);
  // Everything pending on ctx fails with st (no message of its own).
  void fail_pending(CommContext& ctx, const Status& st);
  // Completes the duplication of ctx's communicator (begun at its first
  // submission); meanwhile warns or fails its pending operations like a stall.
  Status finish_setup(CommContext& ctx, double warn_s, double error_s);
  // Tells the other ranks of ctx that this rank leaves it (`why`), with operations possibly in flight.
  void announce_leaving(CommContext& ctx, const std::string& why);
  // Takes one control message with `tag` (MPI_ANY_TAG: any) into control_msg_, if one has come.
  Status receive_control(CommContext& ctx, int tag, bool* got, MPI_Status* probe);
  // Another rank's leave notice (in control_msg_) arrived from `source`.
  Status take_leave_notice(CommContext& ctx, int source);
  // Coordinator: sends the first leave notice on to the ranks still there, once its delay passed.
  Status forward_leave_notice(CommContext& ctx);
  // Cancels and frees what a freed communicator held; false until its duplication completed.
  bool release_freed(CommContext& ctx);
  Status execute(CommContext& ctx, Operation& op);  // the caller finishes op
  void record(const Operation& op, const RingTraffic& traffic, double seconds);
  // One operation more of (kind, codec) in stats().
  void count(const std::string& kind, const std::string& codec, const RingTraffic& traffic, double seconds);
  // A completed transfer: stats() and, when it records, the timeline (a span from submission to now).
  void record_transfer(const Transfer& t);
  Status run_compressed(CommContext& ctx, Operation& op, RingTraffic* traffic);
  // Keeps a message for take_notices(); past kMaxNotices it only counts it.
  void notice(EngineNotice::Kind kind, std::string message);

  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::pair<std::shared_ptr<CommContext>, std::shared_ptr<Operation>>> queue_;
  std::vector<std::pair<std::shared_ptr<CommContext>, Transfer>> transfer_queue_;
  // A context lives as an attribute of the user's communicator (so a freed
  // handle that MPI hands out again never finds a stale one); the engine owns it.
  int keyval_ = MPI_KEYVAL_INVALID;
  std::vector<std::shared_ptr<CommContext>> contexts_;
  std::thread thread_;
  bool running_ = false, stopped_ = false;
  bool loop_done_ = false;  // under mu_: the thread's last act, so shutdown can bound its wait
  int world_rank_ = -1;     // set as the engine thread starts: leave notices, messages when MPI cannot be called
  std::atomic<int> watchers_{0};  // live Watch objects
  std::uint64_t wakeups_ = 0;  // wake() calls: an idle loop rechecks what is ready or freed
  double stall_warn_s_ = 60.0, stall_error_s_ = 0.0;

  ResidualStore residuals_;
  std::uint64_t next_context_id_ = 0;  // under mu_

  std::mutex stats_mu_;
  std::map<std::pair<std::string, std::string>, EngineStats> stats_;
  AgreementStats agreement_stats_;  // under stats_mu_

  std::mutex notices_mu_;
  std::vector<EngineNotice> notices_;  // under notices_mu_, at most kMaxNotices
  std::uint64_t notices_dropped_ = 0;  // under notices_mu_

  // Engine thread only: the control message being read, and working memory
  // of compressed allreduces, kept between operations.
  std::vector<char> control_msg_;
  std::size_t transfers_in_flight_ = 0;  // taken from transfer_queue_, not finished
  // When a transfer was last submitted, posted or finished: how long a wait only transfers keep has lasted.
  std::chrono::steady_clock::time_point transfers_moved_at_;
  CommContext* executing_ = nullptr;  // the context whose operation moves data now
  bool executing_cancellable_ = false;  // that operation's requests can be cancelled (a ring)
  double executing_stalled_s_ = 0;  // > 0: that ring was abandoned after this long without progress
  RingScratch ring_scratch_;
  TopkScratch topk_scratch_;
  SplitScratch split_scratch_;
};

}  // namespace hpcdl
