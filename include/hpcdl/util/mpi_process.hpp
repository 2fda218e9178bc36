// The process MPI belongs to. MPI's state (its shared memory, sockets, the
// engine's queues) is copied by fork() but stays the parent's: a forked
// child that makes an MPI call acts as its parent's rank and corrupts its
// messages, and the engine thread is not there to run an operation. Every
// place hpcdl accepts work that makes MPI calls checks the caller's process
// here first.
#pragma once

#include <mpi.h>
#include <unistd.h>

#include <string>

#include "hpcdl/util/status.hpp"

namespace hpcdl {

struct MpiProcess {
  pid_t pid = -1;
  int world_rank = -1;
};

inline MpiProcess& mpi_process() {
  static MpiProcess process;
  return process;
}

// Called once when hpcdl._core loads (MPI is initialized by then: mpi4py was imported first).
inline void remember_mpi_process() {
  MpiProcess& p = mpi_process();
  p.pid = getpid();
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized && !finalized) MPI_Comm_rank(MPI_COMM_WORLD, &p.world_rank);
}

inline bool in_mpi_process() { return mpi_process().pid == getpid(); }

// OK in the process that initialized MPI; in a process forked from it, an
// error naming the cause (`who`: the part that was asked to make MPI calls).
inline Status require_mpi_process(const std::string& who) {
  const MpiProcess& p = mpi_process();
  if (p.pid == getpid()) return Status::OK();
  return Status::Mpi(who + ": this process (pid " + std::to_string(getpid()) + ") was forked from rank " +
                     std::to_string(p.world_rank) + " (pid " + std::to_string(p.pid) +
                     "); MPI cannot be used in a forked child (its MPI state is the parent's: the child would "
                     "act as that rank and corrupt its messages). Use hpcdl and MPI only in the process the "
                     "launcher started and hand the child's results to it (e.g. through a multiprocessing queue)");
}

}  // namespace hpcdl
