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
