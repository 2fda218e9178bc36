// A small fixed-size thread pool: run parallel_for() over a range and wait
// for it. The caller of parallel_for
// works on the range too, so it never deadlocks, even when called from a
// pool thread or when every worker is busy.
//
// Threads do not survive fork(): a child process must make its own pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "hpcdl/util/thread_setup.hpp"

namespace hpcdl {

class ThreadPool {
 public:
  // Starts up to `threads` workers: as many as the OS grants (start_thread).
  // Fewer, even none, only make parallel_for slower: its caller works too.
  explicit ThreadPool(std::size_t threads) {
    threads = std::max<std::size_t>(threads, 1);
    workers_.reserve(threads);
    for (std::size_t i = 0; i < threads; ++i)
      if (!start_thread(
               "a store reader thread", [this] { work(); }, &workers_)
               .ok())
        break;
  }

  ~ThreadPool() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();  // queued tasks run before the workers exit
  }

  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  std::size_t size() const { return workers_.size(); }

  // Calls body(begin, end) on consecutive pieces of [0, n) of at most `grain`
  // items, on the pool's threads and the calling one; returns when all are done.
  void parallel_for(std::size_t n, std::size_t grain, const std::function<void(std::size_t, std::size_t)>& body) {
    if (n == 0) return;
    grain = std::max<std::size_t>(grain, 1);
    const std::size_t pieces = (n + grain - 1) / grain;
    if (pieces == 1) {
      body(0, n);
      return;
    }
    struct Shared {
      std::atomic<std::size_t> next{0};
      std::size_t finished = 0;
      std::mutex mu;
      std::condition_variable cv;
    };
    auto shared = std::make_shared<Shared>();
    // Helpers hold the shared state, never the body: a late helper finds no
    // piece left and returns without touching the (by then gone) caller frame.
    auto run_pieces = [shared, pieces, n, grain](const std::function<void(std::size_t, std::size_t)>* fn) {
      std::size_t done_here = 0;
      for (std::size_t p; (p = shared->next.fetch_add(1)) < pieces; ++done_here)
        (*fn)(p * grain, std::min(n, (p + 1) * grain));
      if (done_here) {
        std::lock_guard<std::mutex> lock(shared->mu);
        shared->finished += done_here;
        if (shared->finished == pieces) shared->cv.notify_all();
      }
    };
    const std::size_t helpers = std::min(pieces - 1, workers_.size());
    const auto* fn = &body;
    for (std::size_t i = 0; i < helpers; ++i) submit([run_pieces, fn] { run_pieces(fn); });
    run_pieces(fn);
    std::unique_lock<std::mutex> lock(shared->mu);
    shared->cv.wait(lock, [&] { return shared->finished == pieces; });
  }

 private:
  void submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

  void work() {
    name_this_thread("hpcdl-pool");
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  std::vector<std::thread> workers_;
  std::deque<std::function<void()>> tasks_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stopping_ = false;
};

}  // namespace hpcdl
