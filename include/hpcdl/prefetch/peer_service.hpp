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
// size from the store (64-bit), so no size travels; the requester counts the
// bytes that arrived (Ticket::received) for its caller to check.
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
// Implementation: src/prefetch/peer_service.cc.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "hpcdl/util/status.hpp"

namespace hpcdl {

class PeerService {
 public:
  // kServed: sample k's bytes are in dst. kLater: this rank will hold k but has not loaded it yet.
  enum class Serve { kServed, kNotHere, kLater };
  using ServeFn = std::function<Serve(std::uint64_t k, char* dst)>;
  using SizeFn = std::function<std::uint64_t(std::uint64_t k)>;

  // The largest MPI message of a reply by default (a power of two below INT_MAX).
  static constexpr std::uint64_t kMaxMessageBytes = std::uint64_t{1} << 30;

  // Collective over `user` (duplicates it); starts the server thread.
  static Status create(MPI_Comm user, ServeFn serve, SizeFn size_of, double timeout_s, double serve_delay_s,
                       std::uint64_t max_message_bytes, std::unique_ptr<PeerService>* out);
  ~PeerService();

  int rank() const { return rank_; }
  int size() const { return size_; }

  // kLater: the peer has not loaded the sample yet (ask again); kWaiting: no answer yet;
  // kError: an MPI call failed (the ticket's error says which).
  enum class Outcome { kGot, kMiss, kLater, kTimeout, kWaiting, kError };

  // A reply being received: the status byte and the sample, in pieces.
  struct Pending {
    std::vector<char> buffer;
    std::vector<MPI_Request> recvs;    // the first piece; then the rest, once it said "held"
    std::vector<MPI_Status> statuses;  // of recvs: the bytes each piece brought
    std::uint64_t arrived = 0;         // bytes received so far, the status byte included
    int peer = 0, tag = 0;
    bool rest_posted = false;
    bool too_long = false;  // a piece was longer than its receive (MPI_ERR_TRUNCATE)
  };
  // One request in flight: send it with request(), poll() it until it is answered.
  struct Ticket {
    std::unique_ptr<Pending> pending;
    std::uint64_t size = 0;
    // kGot: the sample's bytes that arrived; another length than size: another sample at the peer (size + 1: longer)
    std::uint64_t received = 0;
    std::chrono::steady_clock::time_point deadline;
    Status error;  // of an Outcome::kError
  };

  // Sends a request for sample k (size bytes) to `peer`. Thread-safe.
  Status request(int peer, std::uint64_t k, std::uint64_t size, Ticket* t);

  // Non-blocking: the answer to `t` (on kGot size bytes copied to dst, of
  // which t.received arrived: the caller checks them), or kWaiting.
  // After kTimeout the ticket's receives stay posted until shutdown.
  Outcome poll(Ticket& t, char* dst);

  // Gives up on an unanswered ticket (its receives are matched before shutdown ends).
  void abandon(Ticket& t);

  // The byte ranges [begin, end) of a message of `total` bytes sent in pieces of at most `max_message`.
  static std::vector<std::pair<std::uint64_t, std::uint64_t>> pieces(std::uint64_t total, std::uint64_t max_message);

  std::uint64_t served() const { return served_; }

  // Collective over the communicator: call after this rank's requesters have
  // stopped. Gives up (and says so) after timeout_s.
  Status shutdown(double timeout_s);

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
    std::unique_ptr<Reply> reply;                    // its buffer sized for the sample
    std::chrono::steady_clock::time_point deadline;  // of a deferred request
  };

  PeerService() = default;
  // The duplicate's error handler, this rank's place in it and its tag bound (create(), before the ranks agree).
  Status set_up_comm();

  // Posts a non-blocking send or receive of buffer[begin, end) in pieces of at most max_message_ bytes.
  Status post_pieces(bool send, char* buffer, std::uint64_t begin, std::uint64_t end, int peer, int tag,
                     std::vector<MPI_Request>* requests);
  // Advances a reply's receives: once its first piece says "held", posts the rest. *done: all in.
  Status progress(Pending& p, bool* done);
  // Answers one request; *answered false when it must wait (the sample is not loaded yet and `final` is false).
  Status answer(Request& r, bool final, std::vector<std::unique_ptr<Reply>>* replies, bool* answered);
  void serve_loop();
  Status serve_requests(std::vector<std::unique_ptr<Reply>>* replies);

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
