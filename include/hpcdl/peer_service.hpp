// PeerService: ranks fetch samples from each other's RAM tier over MPI.
// A dedicated server thread answers requests on a private duplicate of the
// user's communicator; needs MPI_THREAD_MULTIPLE (checked in create()).
//
// Protocol (tags on the duplicate): a request is two uint64 {sample, reply tag}
// on kRequestTag; the reply, on the reply tag, is one status byte (1: bytes
// follow, 0: not held) and the sample's bytes. A requester that times out
// falls back to the store and leaves its receive posted: the server answers
// every request, in order, so that receive is matched before shutdown ends.
// Shutdown is collective: each rank sends a "done" request to every server
// after its own requesters stopped; a server exits after P "done"s (MPI's
// non-overtaking order puts them after that peer's last request).
#pragma once

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "hpcdl/mpi_util.hpp"
#include "hpcdl/status.hpp"

namespace hpcdl {

class PeerService {
 public:
  // Copies sample `k`'s bytes to dst when this rank's RAM tier holds them.
  using ServeFn = std::function<bool(std::uint64_t k, char* dst)>;
  using SizeFn = std::function<std::uint64_t(std::uint64_t k)>;

  static Status create(MPI_Comm user, ServeFn serve, SizeFn size_of, double timeout_s, double serve_delay_s,
                       std::unique_ptr<PeerService>* out) {
    HPCDL_RETURN_NOT_OK(require_thread_multiple("the prefetcher's peer tier",
                                                "a server thread answers other ranks while yours run"));
    std::unique_ptr<PeerService> s(new PeerService());
    if (MPI_Comm_dup(user, &s->comm_) != MPI_SUCCESS) return Status::Mpi("MPI_Comm_dup failed");
    MPI_Comm_rank(s->comm_, &s->rank_);
    MPI_Comm_size(s->comm_, &s->size_);
    int* ub = nullptr;
    int found = 0;
    MPI_Comm_get_attr(s->comm_, MPI_TAG_UB, &ub, &found);
    s->tag_limit_ = found ? std::min(*ub, 1 << 20) : 32767;
    s->serve_ = std::move(serve);
    s->size_of_ = std::move(size_of);
    s->timeout_s_ = timeout_s;
    s->serve_delay_s_ = serve_delay_s;
    s->server_ = std::thread([p = s.get()] { p->serve_loop(); });
    *out = std::move(s);
    return Status::OK();
  }

  ~PeerService() {
    if (server_.joinable()) {
      abandon_ = true;
      server_.join();
    }
  }

  int rank() const { return rank_; }
  int size() const { return size_; }

  enum class Outcome { kGot, kMiss, kTimeout };

  // Fetches sample k (size bytes) from `peer` into dst. Thread-safe.
  Outcome fetch(int peer, std::uint64_t k, std::uint64_t size, char* dst) {
    auto pending = std::make_unique<Pending>();
    pending->buffer.resize(size + 1);
    const int tag = kReplyTagBase + static_cast<int>(next_tag_++ % static_cast<std::uint64_t>(tag_limit_ - kReplyTagBase));
    const std::uint64_t request[2] = {k, static_cast<std::uint64_t>(tag)};
    MPI_Irecv(pending->buffer.data(), static_cast<int>(size + 1), MPI_BYTE, peer, tag, comm_, &pending->recv);
    MPI_Request send;
    MPI_Isend(request, 2, MPI_UINT64_T, peer, kRequestTag, comm_, &send);
    MPI_Wait(&send, MPI_STATUS_IGNORE);
    const auto deadline = deadline_after(timeout_s_);
    for (int backoff_us = 5;; backoff_us = std::min(backoff_us * 2, 500)) {
      int done = 0;
      MPI_Test(&pending->recv, &done, MPI_STATUS_IGNORE);
      if (done) break;
      if (std::chrono::steady_clock::now() > deadline) {
        std::lock_guard<std::mutex> g(mu_);
        abandoned_.push_back(std::move(pending));
        return Outcome::kTimeout;
      }
      std::this_thread::sleep_for(std::chrono::microseconds(backoff_us));
    }
    if (pending->buffer[0] != 1) return Outcome::kMiss;
    std::memcpy(dst, pending->buffer.data() + 1, size);
    return Outcome::kGot;
  }

  std::uint64_t served() const { return served_; }

  // Collective over the communicator: call after this rank's requesters have
  // stopped. Gives up (and says so) after timeout_s.
  Status shutdown(double timeout_s) {
    if (!server_.joinable()) return Status::OK();
    const std::uint64_t done[2] = {kDoneSample, 0};
    std::vector<MPI_Request> sends(size_);
    for (int q = 0; q < size_; ++q) MPI_Isend(done, 2, MPI_UINT64_T, q, kRequestTag, comm_, &sends[q]);
    const auto deadline = deadline_after(timeout_s);
    bool in_time = wait_until(deadline, [&] {
      int all = 0;
      MPI_Testall(size_, sends.data(), &all, MPI_STATUSES_IGNORE);
      return all != 0 && server_finished_.load();
    });
    // Every server answers every request before it stops: the abandoned receives get their replies.
    in_time = in_time && wait_until(deadline, [&] {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& p : abandoned_) {
        int flag = 0;
        MPI_Test(&p->recv, &flag, MPI_STATUS_IGNORE);
        if (!flag) return false;
      }
      return true;
    });
    abandon_ = true;
    server_.join();
    if (!in_time) {
      for (auto& r : sends)
        if (r != MPI_REQUEST_NULL) MPI_Cancel(&r), MPI_Request_free(&r);
      for (auto& p : abandoned_)
        if (p->recv != MPI_REQUEST_NULL) MPI_Cancel(&p->recv), MPI_Request_free(&p->recv);
    }
    abandoned_.clear();
    MPI_Comm_free(&comm_);
    if (!in_time)
      return Status::Timeout("peer tier shutdown: not every rank closed its prefetcher within " +
                             std::to_string(timeout_s) + " s (close() is collective)");
    return Status::OK();
  }

 private:
  static constexpr int kRequestTag = 1, kReplyTagBase = 16;
  static constexpr std::uint64_t kDoneSample = std::numeric_limits<std::uint64_t>::max();

  struct Pending {
    std::vector<char> buffer;
    MPI_Request recv = MPI_REQUEST_NULL;
  };
  struct Reply {
    std::vector<char> buffer;
    MPI_Request send = MPI_REQUEST_NULL;
  };

  PeerService() = default;

  static std::chrono::steady_clock::time_point deadline_after(double seconds) {
    return std::chrono::steady_clock::now() +
           std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
  }

  template <typename Pred>
  static bool wait_until(std::chrono::steady_clock::time_point deadline, Pred pred) {
    for (int backoff_us = 5; !pred(); backoff_us = std::min(backoff_us * 2, 1000)) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(backoff_us));
    }
    return true;
  }

  void serve_loop() {
    std::vector<std::unique_ptr<Reply>> replies;
    int dones = 0;
    bool stalled = false;
    for (int idle_us = 5; !abandon_;) {
      int flag = 0;
      MPI_Status status;
      MPI_Iprobe(MPI_ANY_SOURCE, kRequestTag, comm_, &flag, &status);
      if (flag) {
        std::uint64_t request[2];
        MPI_Recv(request, 2, MPI_UINT64_T, status.MPI_SOURCE, kRequestTag, comm_, MPI_STATUS_IGNORE);
        if (request[0] == kDoneSample) {
          ++dones;
        } else {
          if (serve_delay_s_ > 0 && !stalled) {  // testing: a peer that stalls once, before its first answer
            std::this_thread::sleep_for(std::chrono::duration<double>(serve_delay_s_));
            stalled = true;
          }
          auto reply = std::make_unique<Reply>();
          const std::uint64_t size = size_of_(request[0]);
          reply->buffer.resize(size + 1);
          const bool held = serve_(request[0], reply->buffer.data() + 1);
          reply->buffer[0] = held ? 1 : 0;
          served_ += held;
          MPI_Isend(reply->buffer.data(), static_cast<int>(held ? size + 1 : 1), MPI_BYTE, status.MPI_SOURCE,
                    static_cast<int>(request[1]), comm_, &reply->send);
          replies.push_back(std::move(reply));
        }
        idle_us = 5;
        continue;
      }
      replies.erase(std::remove_if(replies.begin(), replies.end(),
                                   [](std::unique_ptr<Reply>& r) {
                                     int done = 0;
                                     MPI_Test(&r->send, &done, MPI_STATUS_IGNORE);
                                     return done != 0;
                                   }),
                    replies.end());
      if (dones == size_ && replies.empty()) break;
      std::this_thread::sleep_for(std::chrono::microseconds(idle_us));
      idle_us = std::min(idle_us * 2, 500);
    }
    for (auto& r : replies)
      if (r->send != MPI_REQUEST_NULL) MPI_Cancel(&r->send), MPI_Request_free(&r->send);
    server_finished_ = true;
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, tag_limit_ = 32767;
  ServeFn serve_;
  SizeFn size_of_;
  double timeout_s_ = 1.0, serve_delay_s_ = 0.0;
  std::thread server_;
  std::atomic<bool> abandon_{false}, server_finished_{false};
  std::atomic<std::uint64_t> next_tag_{0}, served_{0};
  std::mutex mu_;
  std::vector<std::unique_ptr<Pending>> abandoned_;
};

}  // namespace hpcdl
