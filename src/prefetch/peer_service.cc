// PeerService (include/hpcdl/prefetch/peer_service.hpp): the peer tier's requests,
// replies in pieces, the server thread and the collective shutdown.
#include "hpcdl/prefetch/peer_service.hpp"

#include <algorithm>
#include <cstring>
#include <string>

#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/thread_setup.hpp"

namespace hpcdl {

namespace {

std::chrono::steady_clock::time_point deadline_after(double seconds) {
  return std::chrono::steady_clock::now() +
         std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(seconds));
}

Status test_all(std::vector<MPI_Request>* requests, bool* done) {
  int flag = 0;
  HPCDL_RETURN_NOT_OK(
      mpi_status(MPI_Testall(static_cast<int>(requests->size()), requests->data(), &flag, MPI_STATUSES_IGNORE),
                 "peer tier: MPI_Testall"));
  *done = flag != 0;
  return Status::OK();
}

// MPI_Testall of a reply's receives; once they are all done, p->arrived has
// grown by the bytes they brought. A piece longer than its receive (a longer
// sample at the peer: MPI_ERR_TRUNCATE) completes too and sets p->too_long,
// for the caller's length check; any other failure is that receive's error.
Status test_receives(PeerService::Pending* p, bool* done) {
  int flag = 0;
  p->statuses.resize(p->recvs.size());
  int rc = MPI_Testall(static_cast<int>(p->recvs.size()), p->recvs.data(), &flag, p->statuses.data());
  if (rc == MPI_ERR_IN_STATUS) {
    rc = MPI_SUCCESS;
    flag = 1;
    for (MPI_Status& st : p->statuses) {
      int error_class = MPI_SUCCESS;
      if (st.MPI_ERROR != MPI_SUCCESS) MPI_Error_class(st.MPI_ERROR, &error_class);
      if (error_class == MPI_ERR_TRUNCATE) {
        p->too_long = true;
      } else if (error_class == MPI_ERR_PENDING) {
        flag = 0;
      } else if (error_class != MPI_SUCCESS && rc == MPI_SUCCESS) {
        rc = st.MPI_ERROR;
      }
    }
  }
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "peer tier: MPI_Testall"));
  *done = flag != 0;
  if (*done && !p->too_long)                    // too long: the length check fails whatever the count
    for (const MPI_Status& st : p->statuses) {  // an already completed (null) request: an empty status, 0 bytes
      int count = 0;
      HPCDL_RETURN_NOT_OK(mpi_status(MPI_Get_count(&st, MPI_BYTE, &count), "peer tier: MPI_Get_count"));
      p->arrived += count > 0 ? static_cast<std::uint64_t>(count) : 0;
    }
  return Status::OK();
}

// Clean-up after an error or a timeout that is already reported: a failure
// to cancel leaves nothing more to do, so its return code is not checked.
void cancel_all(std::vector<MPI_Request>* requests) {
  for (auto& r : *requests)
    if (r != MPI_REQUEST_NULL) MPI_Cancel(&r), MPI_Request_free(&r);
}

template <typename Pred>
bool wait_until(std::chrono::steady_clock::time_point deadline, Pred pred) {
  for (int backoff_us = 5; !pred(); backoff_us = std::min(backoff_us * 2, 1000)) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(std::chrono::microseconds(backoff_us));
  }
  return true;
}

}  // namespace

Status PeerService::create(MPI_Comm user, ServeFn serve, SizeFn size_of, double timeout_s, double serve_delay_s,
                           std::uint64_t max_message_bytes, std::unique_ptr<PeerService>* out) {
  HPCDL_RETURN_NOT_OK(
      require_thread_multiple("the prefetcher's peer tier", "a server thread answers other ranks while yours run"));
  std::unique_ptr<PeerService> s(new PeerService());
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Comm_dup(user, &s->comm_), "peer tier: MPI_Comm_dup"));
  s->max_message_ = std::clamp<std::uint64_t>(max_message_bytes, 1, std::numeric_limits<int>::max());
  s->serve_ = std::move(serve);
  s->size_of_ = std::move(size_of);
  s->timeout_s_ = timeout_s;
  s->serve_delay_s_ = serve_delay_s;
  Status local = s->set_up_comm();
  // The server starts before the agreement, so that a rank whose thread the
  // OS refuses fails the agreement too. It only answers requests, and no rank
  // sends one before the agreement has passed.
  if (local.ok())
    local = start_thread(
        "the prefetcher's peer-tier server thread", [p = s.get()] { p->serve_loop(); }, &s->server_);
  // The ranks agree on the set-up before anyone uses the duplicate. A failure
  // anywhere: all of them stop their servers and free it together
  // (MPI_Comm_free is collective) and all return an error, rather than one
  // rank keeping it (a leak) or freeing it alone, and the others serving a
  // rank that has no peer tier. One allreduce of an int.
  int user_rank = 0, user_size = 1;
  MPI_Comm_rank(user, &user_rank);
  MPI_Comm_size(user, &user_size);
  int first_failed = local.ok() ? user_size : user_rank;
  // Should the agreement itself fail, nothing is known of the others (they may
  // go on with the duplicate): it is left unfreed, as at destruction.
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Allreduce(MPI_IN_PLACE, &first_failed, 1, MPI_INT, MPI_MIN, user),
                                 "peer tier: MPI_Allreduce(set-up)"));
  if (first_failed < user_size) {
    if (s->server_.joinable()) {
      s->abandon_ = true;
      s->server_.join();
    }
    MPI_Comm_free(&s->comm_);
    if (!local.ok()) return local;
    return Status::Mpi("peer tier: rank " + std::to_string(first_failed) +
                       " of the communicator could not set up its duplicate or start its server thread (its own "
                       "error says why); the peer tier starts on no rank");
  }
  *out = std::move(s);
  return Status::OK();
}

Status PeerService::set_up_comm() {
  HPCDL_RETURN_NOT_OK(
      mpi_status(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "peer tier: MPI_Comm_set_errhandler"));
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Comm_rank(comm_, &rank_), "peer tier: MPI_Comm_rank"));
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Comm_size(comm_, &size_), "peer tier: MPI_Comm_size"));
  int* ub = nullptr;
  int found = 0;
  HPCDL_RETURN_NOT_OK(
      mpi_status(MPI_Comm_get_attr(comm_, MPI_TAG_UB, &ub, &found), "peer tier: MPI_Comm_get_attr(MPI_TAG_UB)"));
  tag_limit_ = found ? std::min(*ub, 1 << 20) : 32767;
  return Status::OK();
}

// Without shutdown() (a core dropped without close(): the Python Prefetcher
// never does so, its __del__ and the exit hook close it) comm_ is not freed:
// MPI_Comm_free is collective, and other ranks may still send on it.
PeerService::~PeerService() {
  if (server_.joinable()) {
    abandon_ = true;
    server_.join();
  }
}

Status PeerService::request(int peer, std::uint64_t k, std::uint64_t size, Ticket* t) {
  t->pending = std::make_unique<Pending>();
  Pending& p = *t->pending;
  p.buffer.resize(size + 1);
  p.peer = peer;
  p.tag = kReplyTagBase + static_cast<int>(next_tag_++ % static_cast<std::uint64_t>(tag_limit_ - kReplyTagBase));
  t->size = size;
  const std::uint64_t message[2] = {k, static_cast<std::uint64_t>(p.tag)};
  Status st = post_pieces(false, p.buffer.data(), 0, std::min<std::uint64_t>(max_message_, p.buffer.size()), peer,
                          p.tag, &p.recvs);
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

PeerService::Outcome PeerService::poll(Ticket& t, char* dst) {
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
    t.received = t.pending->too_long ? t.size + 1 : t.pending->arrived - 1;
    return Outcome::kGot;
  }
  return status == kNotLoaded ? Outcome::kLater : Outcome::kMiss;
}

void PeerService::abandon(Ticket& t) {
  if (!t.pending) return;
  std::lock_guard<std::mutex> g(mu_);
  abandoned_.push_back(std::move(t.pending));
}

std::vector<std::pair<std::uint64_t, std::uint64_t>> PeerService::pieces(std::uint64_t total,
                                                                         std::uint64_t max_message) {
  std::vector<std::pair<std::uint64_t, std::uint64_t>> out;
  for (std::uint64_t at = 0; at < total; at += max_message) out.emplace_back(at, std::min(total, at + max_message));
  return out;
}

Status PeerService::shutdown(double timeout_s) {
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
  const Status freed = mpi_status(MPI_Comm_free(&comm_), "peer tier shutdown: MPI_Comm_free");
  if (!server_error_.ok()) return server_error_;
  if (!error.ok()) return error;
  if (!in_time)
    return Status::Timeout("peer tier shutdown: not every rank closed its prefetcher within " +
                           seconds_text(timeout_s) + " (close() is collective)");
  return freed;
}

Status PeerService::post_pieces(bool send, char* buffer, std::uint64_t begin, std::uint64_t end, int peer, int tag,
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

Status PeerService::progress(Pending& p, bool* done) {
  HPCDL_RETURN_NOT_OK(test_receives(&p, done));
  if (*done && !p.rest_posted) {
    p.rest_posted = true;
    if (p.buffer[0] == kHeld && p.buffer.size() > max_message_ && !p.too_long) {
      p.recvs.clear();
      HPCDL_RETURN_NOT_OK(post_pieces(false, p.buffer.data(), max_message_, p.buffer.size(), p.peer, p.tag, &p.recvs));
      *done = false;
    }
  }
  return Status::OK();
}

Status PeerService::answer(Request& r, bool final, std::vector<std::unique_ptr<Reply>>* replies, bool* answered) {
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

void PeerService::serve_loop() {
  name_this_thread("hpcdl-peer");
  std::vector<std::unique_ptr<Reply>> replies;
  Status error = serve_requests(&replies);
  for (auto& r : replies) cancel_all(&r->sends);
  server_error_ = std::move(error);
  server_finished_ = true;
}

Status PeerService::serve_requests(std::vector<std::unique_ptr<Reply>>* replies) {
  std::vector<Request> deferred;
  const double defer_s = timeout_s_ / 2;
  int dones = 0;
  bool stalled = false;
  for (int idle_us = 5; !abandon_;) {
    int flag = 0;
    MPI_Status status;
    HPCDL_RETURN_NOT_OK(
        mpi_status(MPI_Iprobe(MPI_ANY_SOURCE, kRequestTag, comm_, &flag, &status), "peer tier server: MPI_Iprobe"));
    if (flag) {
      std::uint64_t request[2];
      HPCDL_RETURN_NOT_OK(
          mpi_status(MPI_Recv(request, 2, MPI_UINT64_T, status.MPI_SOURCE, kRequestTag, comm_, MPI_STATUS_IGNORE),
                     "peer tier server: MPI_Recv"));
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

}  // namespace hpcdl
