// Timeline: an in-memory list of trace events (Chrome trace "X" events),
// recorded only when enabled; Python writes and merges them.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace hpcdl {

// Wall-clock microseconds: comparable across processes of one host and with
// Python's time.time(), which per-rank tracks need.
inline double now_us() {
  using namespace std::chrono;
  return static_cast<double>(duration_cast<microseconds>(system_clock::now().time_since_epoch()).count());
}

struct TraceEvent {
  std::string name;
  std::string category;
  double start_us;
  double duration_us;
  int track;  // 0: communication engine, 1: prefetcher
};

class Timeline {
 public:
  static Timeline& instance() {
    static Timeline t;
    return t;
  }
  // Keeps at most max_events until take(): a long run would otherwise grow
  // without bound (~140 B an event); the ones past it are only counted.
  void enable(bool on, std::uint64_t max_events) {
    std::lock_guard<std::mutex> g(mu_);
    enabled_ = on;
    max_events_ = max_events;
  }
  bool enabled() const { return enabled_; }
  void record(std::string name, std::string category, double start_us, double end_us, int track) {
    if (!enabled_) return;
    std::lock_guard<std::mutex> g(mu_);
    if (events_.size() >= max_events_) {
      ++dropped_;
      return;
    }
    events_.push_back({std::move(name), std::move(category), start_us, end_us - start_us, track});
  }
  // The events kept since the last call, and in *dropped how many were not.
  std::vector<TraceEvent> take(std::uint64_t* dropped) {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<TraceEvent> out;
    out.swap(events_);
    *dropped = dropped_;
    dropped_ = 0;
    return out;
  }

 private:
  std::mutex mu_;
  bool enabled_ = false;
  std::uint64_t max_events_ = 0;
  std::uint64_t dropped_ = 0;
  std::vector<TraceEvent> events_;
};

}  // namespace hpcdl
