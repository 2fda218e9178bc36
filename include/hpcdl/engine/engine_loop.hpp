// The engine's parts and the one loop that joins them on the engine thread:
// each pass takes new submissions, releases freed communicators, completes
// set-ups, polls every communicator's agreement, runs the agreed plans and
// moves point-to-point transfers, then idles with a backoff when nothing
// moved (run_loop_once).
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "hpcdl/engine/agreement.hpp"
#include "hpcdl/engine/context_registry.hpp"
#include "hpcdl/engine/executor.hpp"
#include "hpcdl/engine/notices.hpp"
#include "hpcdl/engine/residual_store.hpp"
#include "hpcdl/engine/stats.hpp"
#include "hpcdl/engine/submission_queue.hpp"
#include "hpcdl/engine/transfers.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

class CommContext;

// The engine thread's longest sleep between two polls while it waits for
// other ranks (it cannot block in MPI: it also watches every communicator's
// control channel): the polite wait's cap (HPCDL_WAIT_SLEEP_US), here within
// [1 us, 1 ms].
std::chrono::microseconds engine_wait_sleep();

// The engine thread's sleep between two polls while only point-to-point
// transfers are in flight, unmoved for transfers_idle_s.
// - `large`: this rank sends one too large to move in one poll (MPICH moves a
//   large message only inside MPI calls, ~200 KB of it per call on shared
//   memory): the polite wait's cap (engine_wait_sleep; the loop backs off to it
//   from 20 us), however long it lasts. Receives posted ahead do not count:
//   their data may not even be sent yet (Transfers::poll_interval).
// - `watched`: a thread is blocked on one of them (a pipeline stage with
//   nothing else to do): from that cap, 1/64 of the idle time, up to 10 ms,
//   so a message that comes after a long wait is seen at most ~1.6% of the
//   wait late and a 2 s wait costs ~450 polls instead of ~10000.
// - neither: the ranks' own threads compute on the cores the engine would
//   poll on, and nothing that lands is needed yet (a thread that starts to
//   wait wakes the engine at once): the same from 5 ms (polling at 200 us
//   then cost 1F1B with 2 stages on 2 cores 10-15% of its throughput; at
//   1 ms, 1-4% with 4 stages on 2 cores).
std::chrono::microseconds transfer_poll_sleep(bool large, bool watched, double transfers_idle_s);

class EngineLoop {
 public:
  EngineLoop() = default;
  SubmissionQueue queue;
  ResidualStore residuals;
  ContextRegistry contexts{queue, residuals};
  NoticeBoard notices;
  StatsBoard stats;

  // Under queue.mu: starts the engine thread if it is not running; on failure
  // queue.running stays false and a later submission tries again.
  Status start_locked();
  // Stops the thread: operations not yet run finish with kCancelled, and the
  // other ranks of every communicator hpcdl used are told that this one left.
  void stop();

 private:
  class Meanwhile;  // the Progress of a pass: what the thread does while it waits
  struct Pass;      // what one pass of the loop works on

  void run();  // the thread: run_loop_once until stopped, then finish()
  // One pass; false once the engine is stopped.
  bool run_loop_once(std::chrono::microseconds* idle, std::chrono::steady_clock::time_point* last_plan);
  // Everything not run is cancelled and the other ranks told this one leaves.
  void finish();
  bool drain_submissions();
  // Cancels and frees what a freed communicator held; false until its duplication completed.
  bool release_freed(CommContext& ctx);
  // The control channel is broken: nothing pending on ctx can complete.
  void fail_context(CommContext& ctx, const Status& st);
  // Everything pending on ctx fails with st (no message of its own).
  void fail_pending(CommContext& ctx, const Status& st);
  // Sleeps until something is submitted or woken, or the idle time passed.
  void idle_wait(const std::vector<std::shared_ptr<CommContext>>& contexts, std::chrono::microseconds* idle);

  Transfers transfers_{queue, stats};
  Executor executor_{queue, notices, stats, residuals, transfers_};
  Agreement agreement_{stats, notices, executor_};
  std::thread thread_;
  int world_rank_ = -1;  // set as the thread starts: messages when MPI cannot be called
};

}  // namespace hpcdl
