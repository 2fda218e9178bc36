// The engine thread's messages for this rank's caller (EngineNotice): kept
// here, bounded, until the Python layer takes them and issues them as
// warnings, so that they pass Python's warning filters and the engine thread
// never waits for the GIL.
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "hpcdl/engine/engine.hpp"

namespace hpcdl {

void Engine::notice(EngineNotice::Kind kind, std::string message) {
  std::lock_guard<std::mutex> g(notices_mu_);
  // The first ones kept: a flood (a stall warned every few ms) says the same again.
  if (notices_.size() >= kMaxNotices) {
    ++notices_dropped_;
    return;
  }
  notices_.push_back({kind, std::move(message)});
}

std::vector<EngineNotice> Engine::take_notices(std::uint64_t* dropped) {
  std::vector<EngineNotice> out;
  std::lock_guard<std::mutex> g(notices_mu_);
  out.swap(notices_);
  *dropped = notices_dropped_;
  notices_dropped_ = 0;
  return out;
}

}  // namespace hpcdl
