// The agreement on each communicator's order of operations: every rank
// reports operations that are ready to a coordinator (rank 0 of the
// communicator). The coordinator runs an operation once every rank has
// reported it, after checking that they all describe it the same way, and
// sends the order out. Reports travel up a k-nomial tree (radix
// HPCDL_AGREEMENT_RADIX) rooted at the coordinator and plans down it: a rank
// merges the reports of its subtree, so an operation seen before (reported as
// a small integer id with an unchanged description) reaches the coordinator
// as one entry per child, O(k log_k P) messages and O(log_k P) hops per step
// instead of one report per rank. The tree's state
// is CommContext's (src/engine/agreement.cc); the leave notices that tell the
// other ranks this one is gone travel on the same channel (leave_notices.cc).
#pragma once

#include <mpi.h>

#include <string>
#include <vector>

#include "hpcdl/engine/stall_inspector.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

class CommContext;
class Executor;
class NoticeBoard;
class StatsBoard;

class Agreement {
 public:
  Agreement(StatsBoard& stats, NoticeBoard& notices, const Executor& executor)
      : stats_(stats), notices_(notices), executor_(executor) {}
  // The engine thread starts: its rank in COMM_WORLD, for leave notices.
  void set_world_rank(int rank) { world_rank_ = rank; }
  // One pass over ctx's control channel: report new submissions, take readies
  // (coordinator) and plans, plan what every rank submitted (coordinator).
  // Plans are queued on ctx, not run: this also runs while an operation's
  // data moves (the engine's Progress), so the next one is agreed meanwhile.
  Status poll(CommContext& ctx, bool stall_check, const StallLimits& limits, bool* busy);
  // Tells the other ranks of ctx that this rank leaves it (`why`), with operations possibly in flight.
  void announce_leaving(CommContext& ctx, const std::string& why);

 private:
  // Takes one control message with `tag` (MPI_ANY_TAG: any) into control_msg_, if one has come.
  Status receive(CommContext& ctx, int tag, bool* got, MPI_Status* probe);
  // Another rank's leave notice (in control_msg_) arrived from `source`.
  Status take_leave_notice(CommContext& ctx, int source);
  // Coordinator: sends the first leave notice on to the ranks still there, once its delay passed.
  Status forward_leave_notice(CommContext& ctx);
  // Adds ctx's control traffic counted since the last call to the stats.
  void publish_stats(CommContext& ctx);

  StatsBoard& stats_;
  NoticeBoard& notices_;
  const Executor& executor_;
  std::vector<char> control_msg_;  // the control message being read
  int world_rank_ = -1;
};

}  // namespace hpcdl
