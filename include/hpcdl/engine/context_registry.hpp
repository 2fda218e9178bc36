// The communicator contexts the engine knows. A context lives as an MPI
// attribute of the user's communicator (so a freed handle that MPI hands out
// again never finds a stale one); the registry owns it. Guarded by the
// submission queue's mutex.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hpcdl/engine/stall_inspector.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

class CommContext;
class ResidualStore;
class SubmissionQueue;

class ContextRegistry {
 public:
  ContextRegistry(SubmissionQueue& queue, ResidualStore& residuals) : queue_(queue), residuals_(residuals) {}
  // Under the queue's mutex: comm's context; at comm's first operation it is
  // made, and the duplication of comm (two MPI_Comm_idup) started.
  Status context_for(MPI_Comm comm, std::shared_ptr<CommContext>* out);
  // comm's context's id, if it has one; looks up only: making one is collective.
  Status find_id(MPI_Comm comm, bool* found, std::uint64_t* id);
  // Tensor `name`'s error-feedback residual on comm, set by this rank alone
  // (from a checkpoint): into the store at once when comm has a context, else
  // held with comm (an MPI attribute, freed with it) until its first
  // operation makes one, since making one is collective.
  Status set_residual(MPI_Comm comm, const std::string& name, std::vector<float> values);
  // Engine thread: the live contexts, and those whose communicator the user
  // freed (dropped from the registry; put_back those not released yet).
  void take(std::vector<std::shared_ptr<CommContext>>* live, std::vector<std::shared_ptr<CommContext>>* freed);
  void put_back(const std::vector<std::shared_ptr<CommContext>>& contexts);
  std::vector<std::shared_ptr<CommContext>> all();
  // Engine thread: completes the duplication of ctx's communicator (begun at
  // its first submission); meanwhile warns or fails its pending operations like a stall.
  Status finish_setup(CommContext& ctx, const StallLimits& limits);

 private:
  static int on_comm_freed(MPI_Comm comm, int keyval, void* context, void* extra_state);
  static int on_held_freed(MPI_Comm comm, int keyval, void* held, void* extra_state);
  Status find_id_locked(MPI_Comm comm, bool* found, std::uint64_t* id);
  // Under the queue's mutex: the residuals set on comm before its context existed go to context `id`.
  Status adopt_held_residuals(MPI_Comm comm, std::uint64_t id);

  SubmissionQueue& queue_;
  ResidualStore& residuals_;
  int keyval_ = MPI_KEYVAL_INVALID;
  int held_keyval_ = MPI_KEYVAL_INVALID;  // residuals set before comm's context existed
  std::vector<std::shared_ptr<CommContext>> contexts_;
  std::uint64_t next_id_ = 0;
};

}  // namespace hpcdl
