// The engine thread's messages for this rank's caller (EngineNotice): kept
// here, bounded, until the Python layer takes them and issues them as
// warnings, so that they pass Python's warning filters and the engine thread
// never waits for the GIL.
#include "hpcdl/engine/notices.hpp"

#include <utility>

namespace hpcdl {

void NoticeBoard::post(EngineNotice::Kind kind, std::string message) {
  std::lock_guard<std::mutex> g(mu_);
  // The first ones kept: a flood (a stall warned every few ms) says the same again.
  if (notices_.size() >= kMaxNotices) {
    ++dropped_;
    return;
  }
  notices_.push_back({kind, std::move(message)});
}

std::vector<EngineNotice> NoticeBoard::take(std::uint64_t* dropped) {
  std::vector<EngineNotice> out;
  std::lock_guard<std::mutex> g(mu_);
  out.swap(notices_);
  *dropped = dropped_;
  dropped_ = 0;
  return out;
}

}  // namespace hpcdl
