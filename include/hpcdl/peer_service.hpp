// PeerService: ranks fetch samples from each other's cached tiers over MPI.
// A dedicated server thread answers requests on a private duplicate of the
// user's communicator; needs MPI_THREAD_MULTIPLE (checked in create()).
//
// Protocol (tags on the duplicate): a request is two uint64 {sample, reply tag}
// on kRequestTag; the reply, on the reply tag, is one status byte (1: bytes
// follow, 0: not held, 2: not loaded yet, ask again) and the sample's bytes,
// sent as consecutive messages of at most max_message bytes (below INT_MAX:
// MPI counts are int, so a sample of 2 GiB or more goes in pieces; MPI's
// non-overtaking order keeps them in order). The requester receives the first
// piece and, when it says "held", posts the rest. Both sides know the sample's
// size from the store (64-bit), so no size travels.
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
//
// MPI calls on the duplicate return their errors (MPI_ERRORS_RETURN) and are
// checked: a failed request is Outcome::kError with the ticket's Status; a
// failed server stops answering and shutdown() returns its error.
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
#include <utility>
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

  // The largest MPI message of a reply by default (a power of two below INT_MAX).
  static constexpr std::uint64_t kMaxMessageBytes = std::uint64_t{1} << 30;

  static Status create(MPI_Comm user, ServeFn serve, SizeFn size_of, double timeout_s, double serve_delay_s,
                       std::uint64_t max_message_bytes, std::unique_ptr<PeerService>* out) {
    HPCDL_RETURN_NOT_OK(require_thread_multiple("the prefetcher's peer tier",
                                                "a server thread answers other ranks while yours run"));
    std::unique_ptr<PeerService> s(new PeerService());
    HPCDL_RETURN_NOT_OK(mpi_status(MPI_Comm_dup(user, &s->comm_), "peer tier: MPI_Comm_dup"));
    HPCDL_RETURN_NOT_OK(mpi_status(MPI_Comm_set_errhandler(s->comm_, MPI_ERRORS_RETURN),
                                   "peer tier: MPI_Comm_set_errhandler"));
    s->max_message_ = std::clamp<std::uint64_t>(max_message_bytes, 1, std::numeric_limits<int>::max());
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

  // kLater: the peer has not loaded the sample yet (ask again); kWaiting: no answer yet;
  // kError: an MPI call failed (the ticket's error says which).
  enum class Outcome { kGot, kMiss, kLater, kTimeout, kWaiting, kError };

  // A reply being received: the status byte and the sample, in pieces.
  struct Pending {
    std::vector<char> buffer;
    std::vector<MPI_Request> recvs;  // the first piece; then the rest, once it said "held"
    int peer = 0, tag = 0;
    bool rest_posted = false;
  };
  // One request in flight: send it with request(), poll() it until it is answered.
  struct Ticket {
    std::unique_ptr<Pending> pending;
    std::uint64_t size = 0;
    std::chrono::steady_clock::time_point deadline;
    Status error;  // of an Outcome::kError
  };

  // Sends a request for sample k (size bytes) to `peer`. Thread-safe.
  Status request(int peer, std::uint64_t k, std::uint64_t size, Ticket* t) {
    t->pending = std::make_unique<Pending>();
    Pending& p = *t->pending;
    p.buffer.resize(size + 1);
    p.peer = peer;
    p.tag = kReplyTagBase + static_cast<int>(next_tag_++ % static_cast<std::uint64_t>(tag_limit_ - kReplyTagBase));
    t->size = size;
    const std::uint64_t message[2] = {k, static_cast<std::uint64_t>(p.tag)};
    Status st = post_pieces(false, p.buffer.data(), 0, std::min<std::uint64_t>(max_message_, p.buffer.size()),
                            peer, p.tag, &p.recvs);
    MPI_Request send = MPI_REQUEST_NULL;
    if (st.ok())
      st = mpi_status(MPI_Isend(message, 2, MPI_UINT64_T, peer, kRequestTag, comm_, &send), "peer tier: MPI_Isend");
    if (st.ok()) st = mpi_status(MPI_Wait(&send, MPI_STATUS_IGNORE), "peer tier: MPI_Wait");
    if (!st.ok()) {  // never sent: nothing will match the receive
      cancel_all(&p.recvs);
      t->pending.reset();
      return st;
    }
    t->deadline = deadline_after(timeout_s_);
    return Status::OK();
  }

  // Non-blocking: the answer to `t` (bytes copied to dst on kGot), or kWaiting.
  // After kTimeout the ticket's receives stay posted until shutdown.
  Outcome poll(Ticket& t, char* dst) {
    bool done = false;
    t.error = progress(*t.pending, &done);
    if (!t.error.ok()) {
      cancel_all(&t.pending->recvs);
      t.pending.reset();
      return Outcome::kError;
    }
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

  // Gives up on an unanswered ticket (its receives are matched before shutdown ends).
  void abandon(Ticket& t) {
    if (!t.pending) return;
    std::lock_guard<std::mutex> g(mu_);
    abandoned_.push_back(std::move(t.pending));
  }

  // The byte ranges [begin, end) of a message of `total` bytes sent in pieces of at most `max_message`.
  static std::vector<std::pair<std::uint64_t, std::uint64_t>> pieces(std::uint64_t total, std::uint64_t max_message) {
    std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
    for (std::uint64_t at = 0; at < total; at += max_message) out.emplace_back(at, std::min(total, at + max_message));
    return out;
  }

  std::uint64_t served() const { return served_; }

  // Collective over the communicator: call after this rank's requesters have
  // stopped. Gives up (and says so) after timeout_s.
  Status shutdown(double timeout_s) {
    if (!server_.joinable()) return Status::OK();
    const std::uint64_t done[2] = {kDoneSample, 0};
    std::vector<MPI_Request> sends;
    Status error;
    for (int q = 0; q < size_ && error.ok(); ++q) {
      sends.push_back(MPI_REQUEST_NULL);
      error = mpi_status(MPI_Isend(done, 2, MPI_UINT64_T, q, kRequestTag, comm_, &sends.back()),
                         "peer tier shutdown: MPI_Isend");
    }
    const auto deadline = deadline_after(timeout_s);
    bool in_time = error.ok() && wait_until(deadline, [&] {
      bool all = false;
      error = test_all(&sends, &all);
      return !error.ok() || (all && server_finished_.load());
    });
    // Every server answers every request before it stops: the abandoned receives get their replies.
    in_time = in_time && error.ok() && wait_until(deadline, [&] {
      std::lock_guard<std::mutex> g(mu_);
      for (auto& p : abandoned_) {
        bool all = false;
        error = progress(*p, &all);
        if (!error.ok()) return true;
        if (!all) return false;
      }
      return true;
    });
    abandon_ = true;
    server_.join();
    if (!in_time || !error.ok()) {
      cancel_all(&sends);
      for (auto& p : abandoned_) cancel_all(&p->recvs);
    }
    abandoned_.clear();
    MPI_Comm_free(&comm_);
    if (!server_error_.ok()) return server_error_;
    if (!error.ok()) return error;
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
    std::vector<MPI_Request> sends;  // one per piece
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

  // Posts a non-blocking send or receive of buffer[begin, end) in pieces of at most max_message_ bytes.
  Status post_pieces(bool send, char* buffer, std::uint64_t begin, std::uint64_t end, int peer, int tag,
                     std::vector<MPI_Request>* requests) {
    for (const auto& [from, to] : pieces(end - begin, max_message_)) {
      requests->push_back(MPI_REQUEST_NULL);
      char* at = buffer + begin + from;
      const int count = static_cast<int>(to - from);  // <= max_message_ <= INT_MAX
      HPCDL_RETURN_NOT_OK(mpi_status(send ? MPI_Isend(at, count, MPI_BYTE, peer, tag, comm_, &requests->back())
                                          : MPI_Irecv(at, count, MPI_BYTE, peer, tag, comm_, &requests->back()),
                                     send ? "peer tier: MPI_Isend" : "peer tier: MPI_Irecv"));
    }
    return Status::OK();
  }

  static Status test_all(std::vector<MPI_Request>* requests, bool* done) {
    int flag = 0;
    HPCDL_RETURN_NOT_OK(mpi_status(MPI_Testall(static_cast<int>(requests->size()), requests->data(), &flag,
                                               MPI_STATUSES_IGNORE), "peer tier: MPI_Testall"));
    *done = flag != 0;
    return Status::OK();
  }

  static void cancel_all(std::vector<MPI_Request>* requests) {
    for (auto& r : *requests)
      if (r != MPI_REQUEST_NULL) MPI_Cancel(&r), MPI_Request_free(&r);
  }

  // Advances a reply's receives: once its first piece says "held", posts the rest. *done: all in.
  Status progress(Pending& p, bool* done) {
    HPCDL_RETURN_NOT_OK(test_all(&p.recvs, done));
    if (*done && !p.rest_posted) {
      p.rest_posted = true;
      if (p.buffer[0] == kHeld && p.buffer.size() > max_message_) {
        p.recvs.clear();
        HPCDL_RETURN_NOT_OK(
            post_pieces(false, p.buffer.data(), max_message_, p.buffer.size(), p.peer, p.tag, &p.recvs));
        *done = false;
      }
    }
    return Status::OK();
  }

  template <typename Pred>
  static bool wait_until(std::chrono::steady_clock::time_point deadline, Pred pred) {
    for (int backoff_us = 5; !pred(); backoff_us = std::min(backoff_us * 2, 1000)) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(backoff_us));
    }
    return true;
  }

  // Answers one request; *answered false when it must wait (the sample is not loaded yet and `final` is false).
  Status answer(Request& r, bool final, std::vector<std::unique_ptr<Reply>>* replies, bool* answered) {
    std::vector<char>& buffer = r.reply->buffer;
    const Serve got = serve_(r.sample, buffer.data() + 1);
    *answered = got != Serve::kLater || final;
    if (!*answered) return Status::OK();
    buffer[0] = got == Serve::kServed ? kHeld : got == Serve::kLater ? kNotLoaded : kNotHeld;
    served_ += got == Serve::kServed;
    replies->push_back(std::move(r.reply));
    return post_pieces(true, buffer.data(), 0, got == Serve::kServed ? buffer.size() : 1, r.source, r.tag,
                       &replies->back()->sends);
  }

  void serve_loop() {
    name_this_thread("hpcdl-peer");
    std::vector<std::unique_ptr<Reply>> replies;
    Status error = serve_requests(&replies);
    for (auto& r : replies) cancel_all(&r->sends);
    server_error_ = std::move(error);
    server_finished_ = true;
  }

  Status serve_requests(std::vector<std::unique_ptr<Reply>>* replies) {
    std::vector<Request> deferred;
    const double defer_s = timeout_s_ / 2;
    int dones = 0;
    bool stalled = false;
    for (int idle_us = 5; !abandon_;) {
      int flag = 0;
      MPI_Status status;
      HPCDL_RETURN_NOT_OK(mpi_status(MPI_Iprobe(MPI_ANY_SOURCE, kRequestTag, comm_, &flag, &status),
                                     "peer tier server: MPI_Iprobe"));
      if (flag) {
        std::uint64_t request[2];
        HPCDL_RETURN_NOT_OK(mpi_status(MPI_Recv(request, 2, MPI_UINT64_T, status.MPI_SOURCE, kRequestTag, comm_,
                                                MPI_STATUS_IGNORE), "peer tier server: MPI_Recv"));
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
          bool answered = false;
          HPCDL_RETURN_NOT_OK(answer(r, false, replies, &answered));
          if (!answered) deferred.push_back(std::move(r));
        }
        idle_us = 5;
        continue;
      }
      const auto now = std::chrono::steady_clock::now();
      for (std::size_t i = 0; i < deferred.size();) {
        bool answered = false;
        HPCDL_RETURN_NOT_OK(answer(deferred[i], now > deferred[i].deadline, replies, &answered));
        if (answered) {
          deferred[i] = std::move(deferred.back());
          deferred.pop_back();
          idle_us = 5;
        } else {
          ++i;
        }
      }
      for (std::size_t i = 0; i < replies->size();) {
        bool sent = false;
        HPCDL_RETURN_NOT_OK(test_all(&(*replies)[i]->sends, &sent));
        if (sent) {
          (*replies)[i] = std::move(replies->back());
          replies->pop_back();
        } else {
          ++i;
        }
      }
      if (dones == size_ && replies->empty() && deferred.empty()) break;
      std::this_thread::sleep_for(std::chrono::microseconds(idle_us));
      idle_us = std::min(idle_us * 2, deferred.empty() ? 500 : 200);
    }
    return Status::OK();
  }

  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0, size_ = 1, tag_limit_ = 32767;
  ServeFn serve_;
  SizeFn size_of_;
  double timeout_s_ = 1.0, serve_delay_s_ = 0.0;
  std::uint64_t max_message_ = kMaxMessageBytes;
  Status server_error_;  // written by the server thread before server_finished_
  std::thread server_;
  std::atomic<bool> abandon_{false}, server_finished_{false};
  std::atomic<std::uint64_t> next_tag_{0}, served_{0};
  std::mutex mu_;
  std::vector<std::unique_ptr<Pending>> abandoned_;
};

}  // namespace hpcdl
