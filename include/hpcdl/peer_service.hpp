// PeerService: ranks fetch samples from each other's cached tiers over MPI.
// A dedicated server thread answers requests on a private duplicate of the
// user's communicator; needs MPI_THREAD_MULTIPLE (checked in create()).
//
// Protocol (tags on the duplicate): a request is two uint64 {sample, reply tag}
// on kRequestTag; the reply, on the reply tag, is one status byte (1: bytes
// follow, 0: not held, 2: not loaded yet, ask again) and the sample's bytes.
// A sample the server's placement holds but has not loaded yet is deferred:
// the server answers as soon as it is loaded, or with 2 after defer_s (half
// the requester's timeout), so every request is answered in bounded time. A
// requester that times out falls back to the store and leaves its receive
// posted: the server answers every request, so that receive is matched
// before shutdown ends. Shutdown is collective: each rank sends a "done"
// request to every server after its own requesters stopped; a server exits
// after P "done"s (MPI's non-overtaking order puts them after that peer's
// last request) once every deferred request is answered (a stopped owner
// answers "not held" for whatever it did not load).
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
#include "hpcdl/thread_setup.hpp"

namespace hpcdl {

class PeerService {
 public:
  // kServed: sample k's bytes are in dst. kLater: this rank will hold k but has not loaded it yet.
  enum class Serve { kServed, kNotHere, kLater };
  using ServeFn = std::function<Serve(std::uint64_t k, char* dst)>;
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

  // kLater: the peer has not loaded the sample yet (ask again); kWaiting: no answer yet.
  enum class Outcome { kGot, kMiss, kLater, kTimeout, kWaiting };

  struct Pending {
    std::vector<char> buffer;
    MPI_Request recv = MPI_REQUEST_NULL;
  };
  // One request in flight: send it with request(), poll() it until it is answered.
  struct Ticket {
    std::unique_ptr<Pending> pending;
    std::uint64_t size = 0;
    std::chrono::steady_clock::time_point deadline;
  };

  // Sends a request for sample k (size bytes) to `peer`. Thread-safe.
  Ticket request(int peer, std::uint64_t k, std::uint64_t size) {
    Ticket t;
    t.pending = std::make_unique<Pending>();
    t.pending->buffer.resize(size + 1);
    t.size = size;
    const int tag = kReplyTagBase + static_cast<int>(next_tag_++ % static_cast<std::uint64_t>(tag_limit_ - kReplyTagBase));
    const std::uint64_t message[2] = {k, static_cast<std::uint64_t>(tag)};
    MPI_Irecv(t.pending->buffer.data(), static_cast<int>(size + 1), MPI_BYTE, peer, tag, comm_, &t.pending->recv);
    MPI_Request send;
    MPI_Isend(message, 2, MPI_UINT64_T, peer, kRequestTag, comm_, &send);
    MPI_Wait(&send, MPI_STATUS_IGNORE);
    t.deadline = deadline_after(timeout_s_);
    return t;
  }

  // Non-blocking: the answer to `t` (bytes copied to dst on kGot), or kWaiting.
  // After kTimeout the ticket's receive stays posted until shutdown.
  Outcome poll(Ticket& t, char* dst) {
    int done = 0;
    MPI_Test(&t.pending->recv, &done, MPI_STATUS_IGNORE);
    if (!done) {
      if (std::chrono::steady_clock::now() <= t.deadline) return Outcome::kWaiting;
      abandon(t);
      return Outcome::kTimeout;
    }
    const char status = t.pending->buffer[0];
    if (status == kHeld) {
      std::memcpy(dst, t.pending->buffer.data() + 1, t.size);
      return Outcome::kGot;
    }
    return status == kNotLoaded ? Outcome::kLater : Outcome::kMiss;
  }

  // Gives up on an unanswered ticket (its receive is matched before shutdown ends).
  void abandon(Ticket& t) {
    if (!t.pending) return;
    std::lock_guard<std::mutex> g(mu_);
    abandoned_.push_back(std::move(t.pending));
  }

  // Fetches sample k (size bytes) from `peer` into dst: one request, waited for. Thread-safe.
  Outcome fetch(int peer, std::uint64_t k, std::uint64_t size, char* dst) {
    Ticket t = request(peer, k, size);
    for (int backoff_us = 5;; backoff_us = std::min(backoff_us * 2, 500)) {
      const Outcome o = poll(t, dst);
      if (o != Outcome::kWaiting) return o;
      std::this_thread::sleep_for(std::chrono::microseconds(backoff_us));
    }
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
  static constexpr char kNotHeld = 0, kHeld = 1, kNotLoaded = 2;
  static constexpr std::uint64_t kDoneSample = std::numeric_limits<std::uint64_t>::max();

  struct Reply {
    std::vector<char> buffer;
    MPI_Request send = MPI_REQUEST_NULL;
  };
  struct Request {
    int source, tag;
    std::uint64_t sample;
    std::unique_ptr<Reply> reply;  // its buffer sized for the sample
    std::chrono::steady_clock::time_point deadline;  // of a deferred request
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

  // Answers one request; false when it must wait (the sample is not loaded yet and `final` is false).
  bool answer(Request& r, bool final, std::vector<std::unique_ptr<Reply>>* replies) {
    std::vector<char>& buffer = r.reply->buffer;
    const Serve got = serve_(r.sample, buffer.data() + 1);
    if (got == Serve::kLater && !final) return false;
    buffer[0] = got == Serve::kServed ? kHeld : got == Serve::kLater ? kNotLoaded : kNotHeld;
    served_ += got == Serve::kServed;
    MPI_Isend(buffer.data(), static_cast<int>(got == Serve::kServed ? buffer.size() : 1), MPI_BYTE, r.source, r.tag,
              comm_, &r.reply->send);
    replies->push_back(std::move(r.reply));
    return true;
  }

  void serve_loop() {
    name_this_thread("hpcdl-peer");
    std::vector<std::unique_ptr<Reply>> replies;
    std::vector<Request> deferred;
    const double defer_s = timeout_s_ / 2;
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
          Request r{status.MPI_SOURCE, static_cast<int>(request[1]), request[0], std::make_unique<Reply>(),
                    deadline_after(defer_s)};
          r.reply->buffer.resize(size_of_(r.sample) + 1);
          if (!answer(r, false, &replies)) deferred.push_back(std::move(r));
        }
        idle_us = 5;
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      for (std::size_t i = 0; i < deferred.size();) {
        if (answer(deferred[i], now > deferred[i].deadline, &replies)) {
          deferred[i] = std::move(deferred.back());
          deferred.pop_back();
          idle_us = 5;
        } else {
          ++i;
        }
      }
      replies.erase(std::remove_if(replies.begin(), replies.end(),
                                   [](std::unique_ptr<Reply>& r) {
                                     int done = 0;
                                     MPI_Test(&r->send, &done, MPI_STATUS_IGNORE);
                                     return done != 0;
                                   }),
                    replies.end());
      if (dones == size_ && replies.empty() && deferred.empty()) break;
      std::this_thread::sleep_for(std::chrono::microseconds(idle_us));
      idle_us = std::min(idle_us * 2, deferred.empty() ? 500 : 200);
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
