// Join: a rank that ran out of data joins; until every rank of the
// communicator has, the coordinator counts it ready for every operation and
// plans those it never submitted with their agreed description, so its engine
// runs them with zeros (docs/architecture.md, "Join").
#include <string>
#include <vector>

#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/engine/op_wire.hpp"
#include "hpcdl/util/wire.hpp"

namespace hpcdl {

void CommContext::take_join_report(int source) {
  if (!is_coordinator()) {
    if (subtree_joined) return;
    // What this subtree holds goes up now, and from now on as it comes.
    release_held(0);
    partial.clear();
    subtree_joined = true;
    return;
  }
  if (joined.empty()) joined.assign(static_cast<std::size_t>(size), 0);
  if (!joined[static_cast<std::size_t>(source)]) {
    joined[static_cast<std::size_t>(source)] = 1;
    ++joined_count;
  }
  last_joined = source;
}

void CommContext::take_plan_news(const std::vector<char>& plan) {
  if (!subtree_joined) return;
  WireReader r(plan.data(), plan.size());
  std::uint32_t entries = 0;
  r.get(&entries);
  PlanEntry e;
  for (std::uint32_t i = 0; i < entries && read_plan_entry(r, &e); ++i)
    if (e.name == kJoinName && e.result != PlanResult::kStall) subtree_joined = false;
}

std::string CommContext::join_refusal(const std::string& name, const OpDesc& d, const std::vector<int>& filled) const {
  std::string why;
  const bool sums = d.reduce_op == ReduceOp::kSum || d.reduce_op == ReduceOp::kAverage;
  switch (d.kind) {
    case OpKind::kAllreduce:
    case OpKind::kGroupedAllreduce:
      // A codec's scheme runs as it is: the joined rank encodes zeros and keeps no residual (run_joined).
      if (!sums) why = std::string("op='") + reduce_op_name(d.reduce_op) + "' would take their zeros as values";
      break;
    case OpKind::kBroadcast:
      for (int r : filled)
        if (r == d.root) why = "its root, rank " + std::to_string(r) + ", has joined and has no data";
      break;
    case OpKind::kAllgather:
    case OpKind::kBarrier:
    case OpKind::kJoin: break;
    case OpKind::kReduceScatter:
    case OpKind::kGroupedAllgather:
    case OpKind::kGroupedReduceScatter:
    case OpKind::kAlltoall: why = std::string(op_kind_name(d.kind)) + " is not run under join"; break;
  }
  if (why.empty()) return why;
  std::string ranks;
  for (std::size_t i = 0; i < filled.size(); ++i) ranks += (i ? ", " : "") + std::to_string(filled[i]);
  return "operation '" + name + "' (" + op_kind_name(d.kind) + ") cannot run while rank" +
         (filled.size() == 1 ? " " : "s ") + ranks + (filled.size() == 1 ? " has" : " have") + " joined: " + why +
         ". Under join hpcdl runs allreduce (compressed too) and grouped_allreduce with op sum or average, "
         "allgather, barrier, and broadcast from a rank that has not joined";
}

void CommContext::end_join() {
  joined.clear();
  joined_count = 0;
  last_joined = -1;
}

}  // namespace hpcdl
