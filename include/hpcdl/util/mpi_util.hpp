// MPI return codes as Status, and the check every hpcdl thread that makes MPI
// calls next to the user's needs before it starts.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "hpcdl/util/env.hpp"
#include "hpcdl/util/mpi_process.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

// What wait_any_politely (algorithms/progress.hpp) returns when its Progress abandons the wait (not an MPI code).
constexpr int kWaitAbandoned = -1;

inline Status mpi_status(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::OK();
  if (rc == kWaitAbandoned)
    return Status::Cancelled(std::string(what) + ": abandoned (a rank of the communicator left)");
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
inline void cancel_and_complete(std::vector<MPI_Request*> requests, double seconds, const char* who,
                                const std::string& because = "") {
  for (MPI_Request* r : requests)
    if (*r != MPI_REQUEST_NULL) MPI_Cancel(r);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  for (MPI_Request* r : requests) {
    int flag = 0;
    while (*r != MPI_REQUEST_NULL) {
      MPI_Test(r, &flag, MPI_STATUS_IGNORE);
      if (flag) break;
      if (std::chrono::steady_clock::now() > deadline)
        abort_job((because.empty() ? "" : because + "; ") + who + ": a transfer could not be cancelled within " +
                  seconds_text(seconds) + ", and MPI would still use memory about to be freed");
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    }
  }
}

}  // namespace hpcdl
