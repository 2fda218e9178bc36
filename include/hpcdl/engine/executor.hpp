// Running what the plans say, in their order: waiting for a deferred
// operation's data, then the dense ring, a codec's compressed scheme, the
// broadcast or a gathering collective, their counters and timeline spans. Owns the working memory the
// algorithms reuse from one operation to the next.
#pragma once

#include <string>
#include <vector>

#include "hpcdl/algorithms/compressed_ring.hpp"
#include "hpcdl/algorithms/progress.hpp"
#include "hpcdl/algorithms/ring.hpp"
#include "hpcdl/algorithms/sparse_allreduce.hpp"
#include "hpcdl/codecs/topk.hpp"
#include "hpcdl/util/scratch.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

class CommContext;
class NoticeBoard;
class Operation;
struct OpDesc;
class ResidualStore;
class StatsBoard;
class SubmissionQueue;
class Transfers;

class Executor {
 public:
  Executor(SubmissionQueue& queue, NoticeBoard& notices, StatsBoard& stats, ResidualStore& residuals,
           const Transfers& transfers)
      : queue_(queue), notices_(notices), stats_(stats), residuals_(residuals), transfers_(transfers) {}
  // Runs or fails the entries of ctx's queued plans, in order; waits call progress.
  Status run_plans(CommContext& ctx, Progress& progress);
  // Runs the operation every rank of ctx described alike for one hop, if one is
  // (CommContext::one_hop; ran: whether one ran).
  Status run_one_hop(CommContext& ctx, double error_s, Progress& progress, bool* ran);
  // The context whose operation moves data now (nullptr: none).
  const CommContext* executing() const { return executing_; }
  // That operation's requests can be cancelled (a ring).
  bool cancellable() const { return cancellable_; }
  // That operation's wait is abandoned after `seconds` without progress.
  void stalled(double seconds);
  // Why (empty: it was not): the operation, its algorithm and the ranks it waits on.
  const std::string& stall_text() const { return stall_text_; }

 private:
  // Runs an operation every rank agreed on, once its data is ready.
  Status run_agreed(CommContext& ctx, Operation& op, Progress& progress);
  // op left the pending ones with st: its name is free again, its waiter woken.
  void retire(CommContext& ctx, Operation& op, const Status& st);
  // Waits until a deferred operation the plan has reached is marked ready.
  Status await_ready(CommContext& ctx, Operation& op, Progress& progress);
  Status execute(CommContext& ctx, Operation& op, Progress& progress);  // the caller finishes op
  // This rank has joined: operation `name` (agreed description `desc`) runs here with zeros.
  Status run_joined(CommContext& ctx, const std::string& name, const std::string& desc, Progress& progress);
  Status run_compressed(CommContext& ctx, Operation& op, RingTraffic* traffic, Progress& progress);
  // Allgather, reducescatter, alltoall and the grouped forms (src/engine/gathering.cc).
  Status run_gathering(CommContext& ctx, Operation& op, RingTraffic* traffic, Progress& progress);
  // One array through the dense ring, by recursive doubling when it is small, or
  // by halving and doubling when the ring's segments would be (in place; nothing
  // to move on one rank).
  Status run_dense(CommContext& ctx, const OpDesc& d, DType dtype, std::uint64_t count, void* data,
                   RingTraffic* traffic, Progress& progress);
  void record(const Operation& op, const RingTraffic& traffic, double seconds);

  SubmissionQueue& queue_;
  NoticeBoard& notices_;
  StatsBoard& stats_;
  ResidualStore& residuals_;
  const Transfers& transfers_;
  CommContext* executing_ = nullptr;
  bool cancellable_ = false;
  std::string stall_text_;  // not empty: the executing operation was abandoned (stalled())
  std::string executing_name_;
  std::vector<int> partners_;   // the ranks the operation's recursive doubling or halving-doubling exchanges with
  const char* partnered_ = "";  // which of the two (partners_ empty: a ring)
  RingScratch ring_scratch_;
  TopkScratch topk_scratch_;
  SplitScratch split_scratch_;
  Scratch gather_scratch_;          // where a reducescatter's blocks from the other ranks land
  Scratch partner_scratch_;         // where halving-doubling's halves from the partners land
  std::vector<char> joined_zeros_;  // what a joined rank contributes (run_joined)
};

}  // namespace hpcdl
