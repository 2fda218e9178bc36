// MPI return codes as Status, and the check every hpcdl thread that makes MPI
// calls next to the user's needs before it starts.
#pragma once

#include <mpi.h>

#include <string>

#include "hpcdl/status.hpp"

namespace hpcdl {

inline Status mpi_status(int rc, const char* what) {
  if (rc == MPI_SUCCESS) return Status::OK();
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, text, &len);
  return Status::Mpi(std::string(what) + ": " + std::string(text, static_cast<std::size_t>(len)));
}

// `who` and `why` name the part and why it needs MPI_THREAD_MULTIPLE.
inline Status require_thread_multiple(const std::string& who, const std::string& why) {
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

}  // namespace hpcdl
