// What a thread does while the requests of an algorithm it runs are in
// flight, and the polite wait that calls it. The engine passes its own
// (engine/engine_loop.cc): it reads the control channels there, so the next
// operation is agreed while this one's data moves, and it decides when a wait
// that stopped progressing is given up.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <string>
#include <thread>

#include "hpcdl/util/env.hpp"
#include "hpcdl/util/mpi_util.hpp"

namespace hpcdl {

class Progress {
 public:
  virtual ~Progress() = default;
  // Called between the polls of a wait that has lasted a few sleeps, with
  // how long it has lasted (from its first call). Must not wait on MPI
  // itself. False: abandon the wait (a rank it waits for has left).
  virtual bool waiting(double waited_s) = 0;
  // Once waiting() said false: why, for an abort that cancelling the requests may still need.
  virtual std::string abandoned_because() const { return {}; }
};

// MPI_Waitany without the busy wait: MPICH's progress engine spins at 100% of a
// core inside MPI_Wait*, which on an oversubscribed node takes the CPU from the
// rank's own compute and from the neighbours the ring waits for. Test, then
// sleep with a backoff doubling from 1 us up to the cap (with the cap at 0,
// poll without sleeping); after kPollsBeforeProgress polls, run
// progress.waiting before each further sleep, whatever the cap: it is what
// gives up a wait on a rank that stopped. Returns kWaitAbandoned, the
// requests still posted, when progress says so.
inline int wait_any_politely(int n, MPI_Request* requests, int* index, MPI_Status* status, Progress& progress) {
  constexpr int kPollsBeforeProgress = 4;  // short waits read no clock
  const long cap_us = wait_sleep_cap_us();
  long sleep_us = std::min(1L, cap_us);
  std::chrono::steady_clock::time_point since;
  for (std::uint64_t polls = 1;; ++polls) {
    int flag = 0;
    const int rc = MPI_Testany(n, requests, index, &flag, status);
    if (rc != MPI_SUCCESS || flag) return rc;
    if (polls > kPollsBeforeProgress) {
      const auto now = std::chrono::steady_clock::now();
      if (since.time_since_epoch().count() == 0) since = now;
      if (!progress.waiting(std::chrono::duration<double>(now - since).count())) return kWaitAbandoned;
    }
    if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    sleep_us = std::min(sleep_us * 2, cap_us);
  }
}

// One request, the same way (non-blocking collectives included).
inline int wait_politely(MPI_Request* request, MPI_Status* status, Progress& progress) {
  int index = MPI_UNDEFINED;
  return wait_any_politely(1, request, &index, status, progress);
}

}  // namespace hpcdl
