// MPI return codes as Status, and the check every hpcdl thread that makes MPI
// calls next to the user's needs before it starts.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "hpcdl/env.hpp"
#include "hpcdl/mpi_process.hpp"
#include "hpcdl/status.hpp"

namespace hpcdl {

// What wait_any_politely returns when its wait_hook abandons the wait (not an MPI code).
constexpr int kWaitAbandoned = -1;

inline Status mpi_status(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::OK();
  if (rc == kWaitAbandoned) return Status::Cancelled(std::string(what) + ": abandoned (a rank of the communicator left)");
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return Status::Mpi(std::string(what) + ": " + std::string(text, static_cast<std::size_t>(len)));
}

// `who` and `why` name the part and why it needs MPI_THREAD_MULTIPLE. Every
// part that takes work to make MPI calls with checks here, so the process
// check (a forked child) is here too.
inline Status require_thread_multiple(const std::string& who, const std::string& why) {
  HPCDL_RETURN_NOT_OK(require_mpi_process(who));
  int initialized = 0, finalized = 0, level = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (!initialized || finalized) return Status::Invalid("MPI is not initialized (or already finalized)");
  MPI_Query_thread(&level);
  if (level < MPI_THREAD_MULTIPLE)
    return Status::Invalid(who + " needs MPI_THREAD_MULTIPLE (" + why +
                           "); initialize MPI with it (mpi4py does by default: mpi4py.rc.thread_level = 'multiple')");
  return Status::OK();
}

// Work the waiting thread does while its MPI requests are in flight: the
// engine reads its control channel there, so the next operation is agreed
// while this one's data moves. It must not wait on MPI itself. It gets how
// long the wait has lasted (from its first call) and returns false when the
// wait is to be abandoned (a rank it waits for has left).
inline thread_local std::function<bool(double waited_s)>* wait_hook = nullptr;

// MPI_Waitany without the busy wait: MPICH's progress engine spins at 100% of a
// core inside MPI_Wait*, which on an oversubscribed node takes the CPU from the
// rank's own compute and from the neighbours the ring waits for. Test, then
// sleep with a backoff doubling from 1 us up to the cap; once the wait has
// lasted a few sleeps, run the thread's wait_hook before each further sleep
// (with the cap at 0 MPI blocks, and the hook never runs). Returns
// kWaitAbandoned, the requests still posted, when the hook says so.
inline int wait_any_politely(int n, MPI_Request* requests, int* index, MPI_Status* status) {
  const long cap_us = wait_sleep_cap_us();
  if (cap_us <= 0) return MPI_Waitany(n, requests, index, status);
  long sleep_us = 1;
  std::chrono::steady_clock::time_point hooked_since;  // read only once the hook runs: none on short waits
  for (;;) {
    int flag = 0;
    const int rc = MPI_Testany(n, requests, index, &flag, status);
    if (rc != MPI_SUCCESS || flag) return rc;
    if (sleep_us >= 16 && wait_hook != nullptr) {
      const auto now = std::chrono::steady_clock::now();
      if (hooked_since.time_since_epoch().count() == 0) hooked_since = now;
      if (!(*wait_hook)(std::chrono::duration<double>(now - hooked_since).count())) return kWaitAbandoned;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    sleep_us = std::min(sleep_us * 2, cap_us);
  }
}

// The engine thread's longest sleep between two polls while it waits for
// other ranks (it cannot block in MPI: it also watches every communicator's
// control channel): the polite wait's cap (HPCDL_WAIT_SLEEP_US, here within
// [1 us, 1 ms]).
inline std::chrono::microseconds engine_wait_sleep() {
  return std::chrono::microseconds(std::clamp(wait_sleep_cap_us(), 1L, 1000L));
}

// The engine thread's sleep between two polls while only point-to-point
// transfers are in flight, unmoved for transfers_idle_s.
// - `large`: this rank sends one too large to move in one poll (MPICH moves a
//   large message only inside MPI calls, ~200 KB of it per call on shared
//   memory): the polite wait's cap (engine_wait_sleep; the loop backs off to it
//   from 20 us), however long it lasts. Receives posted ahead do not count:
//   their data may not even be sent yet (Engine::transfer_poll_interval).
// - `watched`: a thread is blocked on one of them (a pipeline stage with
//   nothing else to do): from that cap, 1/64 of the idle time, up to 10 ms,
//   so a message that comes after a long wait is seen at most ~1.6% of the
//   wait late and a 2 s wait costs ~450 polls instead of ~10000.
// - neither: the ranks' own threads compute on the cores the engine would
//   poll on, and nothing that lands is needed yet (a thread that starts to
//   wait wakes the engine at once): the same from 5 ms (polling at 200 us
//   then cost 1F1B with 2 stages on 2 cores 10-15% of its throughput; at
//   1 ms, 1-4% with 4 stages on 2 cores).
inline std::chrono::microseconds transfer_poll_sleep(bool large, bool watched, double transfers_idle_s) {
  const long cap_us = static_cast<long>(engine_wait_sleep().count());
  if (large) return std::chrono::microseconds(cap_us);
  const long floor_us = watched ? cap_us : 5000L;
  const long grown_us = static_cast<long>(transfers_idle_s * (1e6 / 64));
  return std::chrono::microseconds(std::clamp(grown_us, floor_us, std::max(floor_us, 10000L)));
}

// Prints "[hpcdl rank N] <why>: aborting the job" and ends the job (MPI_Abort;
// MPICH's can return to a thread other than the one the launcher kills first).
[[noreturn]] inline void abort_job(const std::string& why) {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  std::fprintf(stderr, "[hpcdl rank %d] %s: aborting the job (MPI_Abort)\n", rank, why.c_str());
  std::fflush(stderr);
  // As hpcdl's Python abort does: the launcher forwards the line before
  // MPI_Abort has it kill every rank (without the pause it was sometimes lost).
  std::this_thread::sleep_for(std::chrono::seconds(1));
  MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

// Cancels posted requests and waits until MPI has let go of their buffers, so
// the memory can be freed or reused; a send MPI cannot cancel must still
// complete: up to `seconds`, then the job is aborted rather than let MPI write
// into (or read from) memory the caller is about to free.
inline void cancel_and_complete(std::vector<MPI_Request*> requests, double seconds, const char* who) {
  for (MPI_Request* r : requests)
    if (*r != MPI_REQUEST_NULL) MPI_Cancel(r);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (MPI_Request* r : requests) {
    int flag = 0;
    while (*r != MPI_REQUEST_NULL) {
      MPI_Test(r, &flag, MPI_STATUS_IGNORE);
      if (flag) break;
      if (std::chrono::steady_clock::now() > deadline)
        abort_job(std::string(who) + ": a transfer could not be cancelled within " +
                  seconds_text(seconds) + ", and MPI would still use memory about to be freed");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

// One request, the same way (non-blocking collectives included).
inline int wait_politely(MPI_Request* request, MPI_Status* status) {
  int index = MPI_UNDEFINED;
  return wait_any_politely(1, request, &index, status);
}

}  // namespace hpcdl
