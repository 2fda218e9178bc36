// What the engine thread has to tell this rank's caller. The thread never
// takes the GIL: the NoticeBoard keeps its messages for the Python layer,
// which issues them as warnings (hpcdl/_warn.py) at its next call into the
// engine.
#pragma once

#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace hpcdl {

struct EngineNotice {
  enum class Kind : int { kStall = 0, kRankLeft = 1, kError = 2 };
  Kind kind = Kind::kStall;
  std::string message;
};

class NoticeBoard {
 public:
  static constexpr std::size_t kMaxNotices = 64;
  // Keeps a message for take(); past kMaxNotices it only counts it.
  void post(EngineNotice::Kind kind, std::string message);
  // The notices kept since the last call, oldest first; *dropped: how many
  // more came while kMaxNotices were already kept (those are lost).
  std::vector<EngineNotice> take(std::uint64_t* dropped);

 private:
  std::mutex mu_;
  std::vector<EngineNotice> notices_;  // under mu_, at most kMaxNotices
  std::uint64_t dropped_ = 0;          // under mu_
};

}  // namespace hpcdl
