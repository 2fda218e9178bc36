// Pipelined ring allreduce: reduce-scatter then allgather, 2(p-1) steps, each
// step's segment cut into chunks. The schedule is one stream of "units"
// (step, chunk); the receive of unit u+1 is posted before unit u is reduced,
// so transfer and reduction overlap (double buffering, kPipelineDepth slots).
//
// What a unit sends, where it lands and what happens on arrival is left to a
// policy (dense here; codecs plug in their own), so there is one schedule.
#pragma once

#include <mpi.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <utility>
#include <vector>

#include "hpcdl/algorithms/progress.hpp"
#include "hpcdl/util/dtype.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

constexpr int kPipelineDepth = 2;
constexpr std::size_t kDefaultChunkBytes = 4 << 20;  // measured: docs/performance.md
constexpr std::size_t kMinChunkBytes = 64;
constexpr std::size_t kMaxChunkBytes = std::size_t(1) << 30;  // one MPI message, count fits an int

// Which of the ring's two phases run. An allreduce runs both, and after its
// reduce-scatter rank r holds segment r + 1. A reduce-scatter alone ends with
// rank r holding segment r; an allgather alone starts from it.
enum class RingPhases { kAllreduce, kReduceScatter, kAllgather };

// Geometry of one ring: p segments (as even as possible, or given), each cut
// into the same number of chunks so every step has the same unit count.
class RingPlan {
 public:
  RingPlan(int size, int rank, std::size_t count, std::size_t elem_size, std::size_t chunk_bytes)
      : RingPlan(size, rank, even_offsets(size, count, 1), elem_size, chunk_bytes, RingPhases::kAllreduce) {}
  // offsets: p + 1 element offsets, segment s = [offsets[s], offsets[s + 1]).
  RingPlan(int size, int rank, std::vector<std::size_t> offsets, std::size_t elem_size, std::size_t chunk_bytes,
           RingPhases phases)
      : p_(size),
        rank_(rank),
        owner_shift_(phases == RingPhases::kAllreduce ? 1 : 0),
        phases_(phases),
        offsets_(std::move(offsets)),
        esize_(elem_size) {
    std::size_t max_seg = 0;
    for (int s = 0; s < p_; ++s) max_seg = std::max(max_seg, segment_len(s));
    const std::size_t chunk_elems = std::max<std::size_t>(1, chunk_bytes / esize_);
    chunks_ = std::max<std::size_t>(1, (max_seg + chunk_elems - 1) / chunk_elems);
    chunk_elems_ = std::max<std::size_t>(1, (max_seg + chunks_ - 1) / chunks_);
  }

  // p + 1 offsets splitting `rows` rows of `row_elems` elements as evenly as
  // possible, the first rows % p segments one row longer (Horovod's rule).
  static std::vector<std::size_t> even_offsets(int p, std::size_t rows, std::size_t row_elems) {
    std::vector<std::size_t> out(static_cast<std::size_t>(p) + 1, 0);
    const std::size_t base = rows / p, extra = rows % p;
    for (std::size_t s = 0; s < static_cast<std::size_t>(p); ++s)
      out[s + 1] = out[s] + (base + (s < extra ? 1 : 0)) * row_elems;
    return out;
  }

  int size() const { return p_; }
  int rank() const { return rank_; }
  int left() const { return (rank_ - 1 + p_) % p_; }
  int right() const { return (rank_ + 1) % p_; }
  RingPhases phases() const { return phases_; }
  std::size_t count() const { return offsets_.back(); }
  std::size_t elem_size() const { return esize_; }
  std::size_t chunks() const { return chunks_; }
  std::size_t max_chunk_elems() const { return chunk_elems_; }
  std::size_t units() const {
    const std::size_t per_phase = p_ > 1 ? static_cast<std::size_t>(p_ - 1) * chunks_ : 0;
    return phases_ == RingPhases::kAllreduce ? 2 * per_phase : per_phase;
  }
  std::size_t reduce_scatter_units() const {
    return phases_ == RingPhases::kAllgather ? 0 : static_cast<std::size_t>(p_ - 1) * chunks_;
  }

  std::size_t segment_begin(int seg) const { return offsets_[static_cast<std::size_t>(seg)]; }
  std::size_t segment_len(int seg) const {
    return offsets_[static_cast<std::size_t>(seg) + 1] - offsets_[static_cast<std::size_t>(seg)];
  }

  // Element range [begin, begin+len) of chunk k of segment seg; len may be 0.
  void chunk_range(int seg, std::size_t k, std::size_t* begin, std::size_t* len) const {
    const std::size_t seg_len = segment_len(seg);
    const std::size_t lo = std::min(seg_len, k * chunk_elems_);
    const std::size_t hi = std::min(seg_len, lo + chunk_elems_);
    *begin = segment_begin(seg) + lo;
    *len = hi - lo;
  }

  struct Unit {
    bool reduce_phase;  // reduce-scatter (true) or allgather (false)
    std::size_t step;   // within the phase, 0..p-2
    std::size_t chunk;
    int send_seg, recv_seg;
    bool final_reduce;  // last reduce-scatter step: this rank now owns recv_seg
  };

  Unit unit(std::size_t u) const {
    Unit x;
    const std::size_t step = u / chunks_;
    x.chunk = u % chunks_;
    x.reduce_phase = phases_ != RingPhases::kAllgather && step < static_cast<std::size_t>(p_ - 1);
    x.step = x.reduce_phase || phases_ == RingPhases::kAllgather ? step : step - (p_ - 1);
    const int s = static_cast<int>(x.step);
    if (x.reduce_phase) {
      x.send_seg = mod(rank_ + owner_shift_ - 1 - s);
      x.recv_seg = mod(rank_ + owner_shift_ - 2 - s);
      x.final_reduce = s == p_ - 2;
    } else {
      x.send_seg = mod(rank_ + owner_shift_ - s);
      x.recv_seg = mod(rank_ + owner_shift_ - 1 - s);
      x.final_reduce = false;
    }
    return x;
  }

  // Bytes this rank sends in an uncompressed ring: what codecs are measured against.
  std::uint64_t dense_bytes_sent() const {
    std::uint64_t elems = 0;
    for (int s = 0; s + 1 < p_; ++s) {
      if (phases_ != RingPhases::kAllgather) elems += segment_len(mod(rank_ + owner_shift_ - 1 - s));
      if (phases_ != RingPhases::kReduceScatter) elems += segment_len(mod(rank_ + owner_shift_ - s));
    }
    return elems * esize_;
  }

  // Segment this rank holds fully reduced after the reduce-scatter.
  int owned_segment() const { return mod(rank_ + owner_shift_); }

 private:
  int mod(int v) const { return ((v % p_) + p_) % p_; }
  int p_, rank_, owner_shift_;
  RingPhases phases_;
  std::vector<std::size_t> offsets_;
  std::size_t esize_, chunks_ = 1, chunk_elems_ = 1;
};

// What a ring policy provides. `send` may stage (encode) and must return a
// buffer that stays valid until the send completes; `recv_slot` names where
// unit u lands; `received` consumes it (reduce, decode, ...).
struct RingBuffer {
  void* data = nullptr;
  std::size_t bytes = 0;
};

struct RingTraffic {
  std::uint64_t bytes_sent = 0;
  std::uint64_t bytes_received = 0;
  std::uint64_t dense_bytes = 0;  // what the uncompressed allreduce sends for the same op
  double reduce_scatter_end = 0;  // MPI_Wtime() when the last reduce-scatter unit was consumed
};

// Runs the unit stream. Dependencies: unit u is sent only after unit u - C
// (C = chunks per step) has been consumed, since that is where its data came
// from. Nothing ever blocks on a send alone: a rank waits for "my next
// receive or my oldest send", so a neighbour that is waiting for us to post a
// receive always gets it (blocking on sends deadlocks the ring once a step
// holds more chunks than the send window).
template <typename Policy>
Status run_ring(const RingPlan& plan, Policy& policy, MPI_Comm comm, int tag, RingTraffic* traffic,
                Progress& progress) {
  const std::size_t total = plan.units();
  const std::size_t C = plan.chunks();
  const std::size_t rs_units = plan.reduce_scatter_units();
  std::vector<MPI_Request> recv_req(kPipelineDepth, MPI_REQUEST_NULL);
  std::deque<std::pair<std::size_t, MPI_Request>> send_req;  // (unit, request), oldest first
  std::size_t next_recv = 0, next_send = 0, consumed = 0;
  int rc;

  auto sent_through = [&](std::size_t unit) -> bool {
    return next_send > unit && (send_req.empty() || send_req.front().first > unit);
  };
  auto post = [&]() -> Status {
    // Retire sends that have completed, oldest first.
    while (!send_req.empty()) {
      int flag = 0;
      rc = MPI_Test(&send_req.front().second, &flag, MPI_STATUS_IGNORE);
      HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Test(send)"));
      if (!flag) break;
      send_req.pop_front();
    }
    while (next_recv < total && next_recv < consumed + kPipelineDepth) {
      // An allgather unit lands in place, where reduce-scatter unit u - rs_units
      // sent from: that send must be complete before the buffer is reused.
      if (plan.phases() == RingPhases::kAllreduce && next_recv >= rs_units && !sent_through(next_recv - rs_units))
        break;
      RingBuffer b = policy.recv_slot(next_recv);
      rc = MPI_Irecv(b.data, static_cast<int>(b.bytes), MPI_BYTE, plan.left(), tag, comm,
                     &recv_req[next_recv % kPipelineDepth]);
      HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Irecv"));
      ++next_recv;
    }
    while (next_send < total && (next_send < C || next_send - C < consumed) &&
           send_req.size() < static_cast<std::size_t>(kPipelineDepth)) {
      RingBuffer b = policy.send(next_send);
      send_req.emplace_back(next_send, MPI_REQUEST_NULL);
      rc = MPI_Isend(b.data, static_cast<int>(b.bytes), MPI_BYTE, plan.right(), tag, comm, &send_req.back().second);
      HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Isend"));
      traffic->bytes_sent += b.bytes;
      ++next_send;
    }
    return Status::OK();
  };

  // Any early return leaves receives and sends posted into memory the caller
  // frees or reuses next: cancel them (or let them complete) first.
  auto run = [&]() -> Status {
    HPCDL_RETURN_NOT_OK(post());
    while (consumed < total) {
      // Wait for the next receive, or for the oldest send if that is what holds us up.
      MPI_Request wait_on[2];
      int n = 0, recv_index = -1;
      if (next_recv > consumed) {
        recv_index = n;
        wait_on[n++] = recv_req[consumed % kPipelineDepth];
      }
      if (!send_req.empty()) wait_on[n++] = send_req.front().second;
      if (n == 0) return Status::Internal("ring schedule stalled with nothing in flight");
      int index = MPI_UNDEFINED;
      MPI_Status st;
      rc = wait_any_politely(n, wait_on, &index, &st, progress);
      HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Waitany"));
      if (index == recv_index) {
        recv_req[consumed % kPipelineDepth] = MPI_REQUEST_NULL;
        int got = 0;
        MPI_Get_count(&st, MPI_BYTE, &got);
        traffic->bytes_received += static_cast<std::uint64_t>(got);
        HPCDL_RETURN_NOT_OK(policy.received(consumed, static_cast<std::size_t>(got)));
        ++consumed;
        if (consumed == rs_units) traffic->reduce_scatter_end = MPI_Wtime();
      } else {
        send_req.pop_front();
      }
      HPCDL_RETURN_NOT_OK(post());
    }
    // The send window may still hold back the last units: drain it.
    while (!send_req.empty()) {
      rc = wait_politely(&send_req.front().second, MPI_STATUS_IGNORE, progress);
      HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Wait(send)"));
      send_req.pop_front();
      HPCDL_RETURN_NOT_OK(post());
    }
    return Status::OK();
  };
  Status st = run();
  if (!st.ok()) {
    std::vector<MPI_Request*> posted;
    for (MPI_Request& r : recv_req) posted.push_back(&r);
    for (auto& s : send_req) posted.push_back(&s.second);
    cancel_and_complete(posted, 10.0, "ring allreduce", progress.abandoned_because());
  }
  return st;
}

// Uncompressed policy: sends straight from the user's buffer (zero copy),
// reduces arrivals from two staging slots, receives the allgather in place
// (any of RingPhases: an allgather alone needs no staging).
class DenseRingPolicy {
 public:
  // ranks: the average's divisor, applied by the last reduction of each element.
  DenseRingPolicy(const RingPlan& plan, void* data, DType dtype, ReduceOp op, int ranks)
      : plan_(plan),
        data_(static_cast<char*>(data)),
        dtype_(dtype),
        op_(op),
        ranks_(ranks),
        staging_(plan.reduce_scatter_units() > 0 ? kPipelineDepth * plan.max_chunk_elems() * plan.elem_size() : 0) {}

  RingBuffer send(std::size_t u) {
    RingPlan::Unit x = plan_.unit(u);
    return at(x.send_seg, x.chunk);
  }

  RingBuffer recv_slot(std::size_t u) {
    RingPlan::Unit x = plan_.unit(u);
    RingBuffer dst = at(x.recv_seg, x.chunk);
    if (!x.reduce_phase) return dst;
    return {staging_.data() + (u % kPipelineDepth) * plan_.max_chunk_elems() * plan_.elem_size(), dst.bytes};
  }

  Status received(std::size_t u, std::size_t bytes) {
    RingPlan::Unit x = plan_.unit(u);
    RingBuffer dst = at(x.recv_seg, x.chunk);
    if (bytes != dst.bytes)
      return Status::Mismatch("ring chunk of " + std::to_string(bytes) + " bytes, expected " +
                              std::to_string(dst.bytes));
    if (x.reduce_phase) {
      const void* src = staging_.data() + (u % kPipelineDepth) * plan_.max_chunk_elems() * plan_.elem_size();
      reduce_into(dtype_, op_, dst.data, src, bytes / plan_.elem_size(), x.final_reduce ? ranks_ : 1);
    }
    return Status::OK();
  }

 private:
  RingBuffer at(int seg, std::size_t k) const {
    std::size_t begin, len;
    plan_.chunk_range(seg, k, &begin, &len);
    return {data_ + begin * plan_.elem_size(), len * plan_.elem_size()};
  }

  const RingPlan& plan_;
  char* data_;
  DType dtype_;
  ReduceOp op_;
  int ranks_;
  std::vector<char> staging_;
};

}  // namespace hpcdl
