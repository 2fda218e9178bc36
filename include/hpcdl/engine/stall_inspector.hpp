// When a wait becomes a stall: the limits the user set (StallLimits), how
// long partial reports are held, and what the engine does when the running
// operation stops progressing or a rank of its communicator has left.
#pragma once

#include <algorithm>
#include <limits>

namespace hpcdl {

class CommContext;

// hpcdl.configure()'s defaults (exposed as _core.DEFAULT_STALL_*).
constexpr double kDefaultStallWarningSeconds = 60.0;
// A rank that never submits ends the others' wait after half an hour, as
// torch.distributed's default timeout does, instead of never (0, still allowed).
constexpr double kDefaultStallErrorSeconds = 1800.0;

// After a rank has left, a wait of the running operation that has made no
// progress for this long (since the news) is given up: the data that rank
// sent before it left had time to arrive. A ring's requests are cancelled
// then; a collective's cannot be, so it gets longer and then ends the job.
constexpr double kLeftRankRingGraceSeconds = 5.0;
constexpr double kLeftRankCollectiveGraceSeconds = 30.0;
// Operations not yet planned here when the news came are failed only after
// this long with no plan to run: plans the coordinator sent before a rank left
// (it may be the one that left) are still on their way down the report tree.
constexpr double kLeftRankPlanGraceSeconds = 5.0;

// Warn after warn_s that an operation waits for ranks that never submitted
// it; fail it after error_s (0: never).
struct StallLimits {
  double warn_s = kDefaultStallWarningSeconds, error_s = kDefaultStallErrorSeconds;

  // How long a rank holds its subtree's partial reports of an operation before
  // sending them up as they are (rank by rank): a quarter of the stall limits,
  // so the coordinator names the missing ranks at most that much later.
  double report_hold_seconds() const {
    double hold = std::numeric_limits<double>::infinity();
    if (warn_s > 0) hold = std::min(hold, warn_s / 4);
    if (error_s > 0) hold = std::min(hold, error_s / 4);
    return hold;
  }
};

class StallInspector {
 public:
  // A wait of the operation running on `running` has lasted waited_s with
  // no request completing. True: wait on. False: abandon it (its requests
  // can be cancelled: a ring); *stalled_s says how long it stalled when that
  // is why. Where a wait can be neither continued nor cancelled (an MPI
  // collective) this ends the job.
  static bool keep_waiting(const CommContext& running, bool cancellable, double waited_s, const StallLimits& limits,
                           double* stalled_s);
};

}  // namespace hpcdl
