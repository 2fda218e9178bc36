// The hand-over from submitting threads to the engine thread (SubmissionQueue).
#include "hpcdl/engine/submission_queue.hpp"

namespace hpcdl {

void SubmissionQueue::wake() {
  {
    std::lock_guard<std::mutex> g(mu);
    ++wakeups;
  }
  cv.notify_one();
}

void SubmissionQueue::wake_from_mpi() {
  // Under mu when it is free (no wake-up lost); else the loop's next
  // predicate check or timeout sees the count.
  std::unique_lock<std::mutex> g(mu, std::try_to_lock);
  ++wakeups;
  if (g.owns_lock()) g.unlock();
  cv.notify_one();
}

Submissions SubmissionQueue::take() {
  Submissions out;
  std::lock_guard<std::mutex> g(mu);
  std::swap(out, submitted);
  return out;
}

StallLimits SubmissionQueue::stall_limits() {
  std::lock_guard<std::mutex> g(mu);
  return limits;
}

}  // namespace hpcdl
