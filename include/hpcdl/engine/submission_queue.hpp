// What submitting threads hand the engine thread. Its one mutex also guards
// the submission side of every communicator context (in_flight,
// unnamed_seq, freed) and the ContextRegistry.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "hpcdl/engine/operation.hpp"
#include "hpcdl/engine/stall_inspector.hpp"
#include "hpcdl/engine/transfers.hpp"

namespace hpcdl {

class CommContext;

struct Submissions {
  std::vector<std::pair<std::shared_ptr<CommContext>, std::shared_ptr<Operation>>> ops;
  std::vector<std::pair<std::shared_ptr<CommContext>, Transfer>> transfers;
  bool empty() const { return ops.empty() && transfers.empty(); }
};

class SubmissionQueue {
 public:
  std::mutex mu;
  std::condition_variable cv;
  // Under mu.
  Submissions submitted;
  std::atomic<std::uint64_t> wakeups{0};  // wake() calls: an idle loop rechecks what is ready or freed
  bool running = false;                   // the engine thread runs (and has not been told to stop)
  bool stopped = false;                   // shutdown() was called: no more submissions
  bool loop_done = false;                 // the thread's last act, so shutdown can bound its wait
  StallLimits limits;

  std::atomic<int> watchers{0};  // live Engine::Watch objects

  // Something pending became ready, or a communicator was freed: an idle loop rechecks now.
  void wake();
  // The same without waiting for mu, for MPI's callbacks: a thread inside MPI
  // must not wait for mu, which a submitting thread holds while it calls MPI
  // (MPICH runs the callback of a communicator the user freed inside whichever
  // MPI call releases it, the engine's MPI_Testall included). When mu is
  // taken, the loop may see the wake-up one idle sleep (at most 20 ms) late.
  void wake_from_mpi();
  // Engine thread: everything submitted since the last call.
  Submissions take();
  StallLimits stall_limits();
};

}  // namespace hpcdl
