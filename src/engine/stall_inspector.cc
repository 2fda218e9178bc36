// What the engine does when the running operation's wait stops progressing.
#include "hpcdl/engine/stall_inspector.hpp"

#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/util/mpi_util.hpp"

namespace hpcdl {

bool StallInspector::keep_waiting(const CommContext& running, bool cancellable, double waited_s,
                                  const StallLimits& limits, double* stalled_s) {
  // No transfer of the ring completed for stall_error_seconds: a neighbour
  // that is stopped, or dead under a launcher that leaves the job running,
  // looks just like this; end the wait rather than hang.
  if (running.gone.ok() && limits.error_s > 0 && waited_s >= limits.error_s) {
    *stalled_s = waited_s;
    if (cancellable) return false;
    abort_job("an MPI collective made no progress for " + seconds_text(waited_s) +
              " (stall_error_seconds); a rank may be stopped or dead, and such a request can be neither "
              "cancelled nor freed");
  }
  // A rank of the running operation left, and this wait stopped progressing.
  if (running.gone.ok()) return true;
  const double stuck_s = std::min(waited_s, seconds_since(running.gone_at));
  if (stuck_s < (cancellable ? kLeftRankRingGraceSeconds : kLeftRankCollectiveGraceSeconds)) return true;
  if (cancellable) return false;
  abort_job(running.gone.message());  // a collective request can be neither cancelled nor freed
}

}  // namespace hpcdl
