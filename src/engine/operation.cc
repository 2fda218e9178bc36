// The handle an operation's submitter and the engine thread share.
#include "hpcdl/engine/operation.hpp"

#include <chrono>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "hpcdl/engine/engine.hpp"
#include "hpcdl/util/timeline.hpp"

namespace hpcdl {

bool Operation::done() {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

void Operation::mark_ready() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (ready_) return;
    ready_ = true;
    times_.ready_us = now_us();
  }
  cv_.notify_all();           // the engine, if the plan has reached this operation
  Engine::instance().wake();  // the engine, if it idles until something is ready
}

Status Operation::mark_ready(std::vector<FloatSegment> segments) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (ready_) return Status::OK();
    const OpDesc& d = req_.desc;
    if (d.kind != OpKind::kAllreduce || d.dtype != DType::kFloat32 || req_.codec_spec.kind != CodecKind::kTopK)
      return Status::Invalid("'" + name_ + "': only a float32 allreduce with TopK takes its data in segments");
    const std::uint64_t total = FloatSegments(segments.data(), segments.size()).total();
    if (total != d.count)
      return Status::Invalid("'" + name_ + "': segments hold " + std::to_string(total) + " values, the operation " +
                             std::to_string(d.count));
    req_.segments = std::move(segments);  // read by the engine once ready_
  }
  mark_ready();
  return Status::OK();
}

bool Operation::ready() {
  std::lock_guard<std::mutex> g(mu_);
  return ready_;
}

bool Operation::wait_ready_for(double seconds) {
  std::unique_lock<std::mutex> g(mu_);
  cv_.wait_for(g, std::chrono::duration<double>(seconds), [this] { return ready_; });
  return ready_;
}

bool Operation::wait_for(double seconds) {
  if (done()) return true;
  Engine::Watch watch(Engine::instance());  // the engine polls for what this thread waits for
  std::unique_lock<std::mutex> g(mu_);
  cv_.wait_for(g, std::chrono::duration<double>(seconds), [this] { return done_; });
  return done_;
}

Status Operation::status() {
  std::lock_guard<std::mutex> g(mu_);
  return status_;
}

std::vector<std::string> Operation::take_notices() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::string> out;
  out.swap(notices_);
  return out;
}

OpTimes Operation::times() {
  std::lock_guard<std::mutex> g(mu_);
  return times_;
}

void Operation::finish(Status st) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (done_) return;
    status_ = std::move(st);
    times_.finished_us = now_us();
    done_ = true;
  }
  cv_.notify_all();
}

void Operation::notify(std::string message) {
  std::lock_guard<std::mutex> g(mu_);
  notices_.push_back(std::move(message));
}

}  // namespace hpcdl
