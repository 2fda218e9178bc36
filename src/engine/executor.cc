// Running what the plans say, in their order (executor.hpp).
#include "hpcdl/engine/executor.hpp"

#include <algorithm>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>

#include "hpcdl/algorithms/compressed_ring.hpp"
#include "hpcdl/algorithms/halving_doubling.hpp"
#include "hpcdl/algorithms/recursive_doubling.hpp"
#include "hpcdl/algorithms/ring.hpp"
#include "hpcdl/codecs/codec_registry.hpp"
#include "hpcdl/codecs/codecs.hpp"
#include "hpcdl/codecs/topk.hpp"
#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/engine/engine_loop.hpp"
#include "hpcdl/engine/notices.hpp"
#include "hpcdl/engine/op_wire.hpp"
#include "hpcdl/engine/residual_store.hpp"
#include "hpcdl/engine/stats.hpp"
#include "hpcdl/engine/submission_queue.hpp"
#include "hpcdl/engine/transfers.hpp"
#include "hpcdl/util/env.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/timeline.hpp"
#include "hpcdl/util/wire.hpp"

namespace hpcdl {

Status Executor::run_plans(CommContext& ctx, Progress& progress) {
  while (!ctx.plans.empty() && ctx.control_error.ok()) {
    // Taken off the queue first: running an entry may queue the next plans.
    std::vector<char> plan = std::move(ctx.plans.front());
    ctx.plans.pop_front();
    WireReader r(plan.data(), plan.size());
    std::uint32_t entries = 0;
    r.get(&entries);
    for (std::uint32_t i = 0; i < entries; ++i) {
      PlanEntry entry;
      if (!read_plan_entry(r, &entry)) return Status::Internal("malformed plan");
      const std::uint32_t id = entry.id;
      const PlanResult result = entry.result;
      std::string name = entry.name;
      const std::string& message = entry.message;
      if (name.empty() && id < ctx.names_by_id.size()) name = ctx.names_by_id[id];
      if (result == PlanResult::kRun || result == PlanResult::kRunJoined) {
        if (id >= ctx.names_by_id.size()) ctx.names_by_id.resize(id + 1);
        ctx.names_by_id[id] = name;
        ctx.ids[name] = id;
      }
      auto ran = ctx.ran_one_hop.find(name);
      if (ran != ctx.ran_one_hop.end()) {            // this rank ran it on every rank's description (one_hop.cc)
        if (result == PlanResult::kStall) continue;  // a warning the plan's way sent before it came
        if (result != PlanResult::kRun)
          return Status::Internal("operation '" + name + "' ran on every rank's description, but its plan entry " +
                                  std::to_string(static_cast<int>(result)) + " is no plain run: " + message);
        if (--ran->second == 0) ctx.ran_one_hop.erase(ran);
        continue;
      }
      if (result != PlanResult::kStall) ctx.conclude_round(name);
      // this rank had not submitted it when the coordinator gave up on it
      const bool too_late = std::find(entry.missing.begin(), entry.missing.end(),
                                      static_cast<std::int32_t>(ctx.rank)) != entry.missing.end();
      auto it = ctx.pending.find(name);
      if (it == ctx.pending.end()) {
        // This rank has joined: it takes part with zeros. Else a notice for an op this rank never submitted.
        if (result == PlanResult::kRunJoined) HPCDL_RETURN_NOT_OK(run_joined(ctx, name, entry.desc, progress));
        continue;
      }
      if (too_late) continue;  // submitted since: its own report decides (a new entry at the coordinator)
      std::shared_ptr<Operation> op = it->second;
      if (result == PlanResult::kStall) {
        op->notify(message);
        continue;
      }
      ctx.pending.erase(it);
      ctx.one_hop_own.erase(name);
      Status st;
      if (result == PlanResult::kJoined) {
        std::lock_guard<std::mutex> g(op->mu_);
        op->result_.rows.assign(1, static_cast<std::uint64_t>(entry.last_joined));
      } else if (result == PlanResult::kRun || result == PlanResult::kRunJoined) {
        st = run_agreed(ctx, *op, progress);
      } else {
        ctx.last_reported.erase(name);  // report it in full next time
        st = result == PlanResult::kTimeout ? Status::Timeout(message) : Status::Mismatch(message);
      }
      retire(ctx, *op, st);
    }
  }
  return ctx.control_error;
}

Status Executor::run_one_hop(CommContext& ctx, double error_s, Progress& progress, bool* ran) {
  if (!ctx.one_hop || !ctx.gone.ok() || !ctx.control_error.ok()) return Status::OK();
  const std::string name = ctx.one_hop_agreed(error_s);
  if (name.empty()) return Status::OK();
  *ran = true;
  auto it = ctx.pending.find(name);
  if (it == ctx.pending.end()) return Status::Internal("one-hop round of '" + name + "', which is not pending");
  std::shared_ptr<Operation> op = it->second;
  ctx.pending.erase(it);
  ctx.one_hop_own.erase(name);
  ctx.conclude_round(name);  // its plan entry, when it comes, is only counted off
  ++ctx.ran_one_hop[name];
  ++ctx.counted.one_hop_runs;
  retire(ctx, *op, run_agreed(ctx, *op, progress));
  return ctx.control_error;
}

Status Executor::run_agreed(CommContext& ctx, Operation& op, Progress& progress) {
  {
    std::lock_guard<std::mutex> g(op.mu_);
    op.times_.agreed_us = now_us();
  }
  Status st = await_ready(ctx, op, progress);
  if (st.ok()) st = execute(ctx, op, progress);
  if (!st.ok() && !ctx.gone.ok()) st = ctx.gone;  // abandoned because a rank left: say which
  return st;
}

void Executor::retire(CommContext& ctx, Operation& op, const Status& st) {
  {
    // Retire the name before the waiter wakes: its next step may reuse it at once.
    std::lock_guard<std::mutex> g(queue_.mu);
    ctx.in_flight.erase(op.name());
  }
  op.finish(st);
}

// This rank has joined: it runs an operation it never submitted with zeros of
// the agreed dtype and shape (an allgather: no rows), so the other ranks'
// operation completes: a compressed one with the agreed codec, as a rank whose
// data is zero and that keeps no error-feedback state (residual, top-k
// threshold) for it. Its result is dropped; a failure fails the join.
Status Executor::run_joined(CommContext& ctx, const std::string& name, const std::string& desc, Progress& progress) {
  OpRequest req;
  std::string described;
  if (!OpDesc::parse(desc, &described, &req.desc)) return Status::Internal("malformed description in a plan");
  const OpDesc& d = req.desc;
  std::uint64_t seq = 0;
  if (unnamed_op_seq(name, &seq)) {  // this rank's next unnamed operation pairs with the others' next one
    std::lock_guard<std::mutex> g(queue_.mu);
    ctx.unnamed_seq = std::max(ctx.unnamed_seq, seq + 1);
  }
  std::uint64_t bytes = d.kind == OpKind::kAllgather ? 0 : d.count * dtype_size(d.dtype);
  for (const GroupMember& m : d.members) bytes += m.count * dtype_size(m.dtype);
  joined_zeros_.assign(std::max<std::uint64_t>(bytes, 1), 0);  // zeroed again: the last ring left its sum
  req.data = joined_zeros_.data();
  std::uint64_t offset = 0;
  for (const GroupMember& m : d.members) {
    req.member_data.push_back(joined_zeros_.data() + offset);
    offset += m.count * dtype_size(m.dtype);
  }
  if (!d.codec.empty()) HPCDL_RETURN_NOT_OK(parse_codec(d.codec, &req.codec_spec));
  Operation op(name, std::move(req));  // unnamed in the request: a codec keeps no residual for zeros
  op.times_.submitted_us = op.times_.ready_us = op.times_.agreed_us = now_us();
  Status st = execute(ctx, op, progress);
  if (!st.ok() && !ctx.gone.ok()) st = ctx.gone;
  return st;
}

// The other ranks wait in this operation's ring meanwhile; the control
// channel is still read, so later operations are agreed.
Status Executor::await_ready(CommContext& ctx, Operation& op, Progress& progress) {
  const auto since = std::chrono::steady_clock::now();
  double warned_at = 0;
  // Its data comes from the caller's computation: wake rarely meanwhile,
  // unless point-to-point transfers move (each wake progresses them); at least
  // every 1 ms then, since a thread that starts to wait for one cannot wake
  // this wait (a hybrid pipeline's stage during its backward).
  auto wake_every = [&] {
    return transfers_.in_flight() > 0 ? std::min(1e-3, 1e-6 * transfers_.poll_interval().count()) : 0.02;
  };
  while (!op.wait_ready_for(wake_every())) {
    progress.waiting(0);
    if (!ctx.gone.ok()) return ctx.gone;
    double warn_s;
    {
      std::lock_guard<std::mutex> g(queue_.mu);
      if (!queue_.running)
        return Status::Cancelled("hpcdl's engine shut down before '" + op.name() + "' was marked ready");
      warn_s = queue_.limits.warn_s;
    }
    const double waited = seconds_since(since);
    if (warn_s > 0 && waited - warned_at >= warn_s) {
      warned_at = waited;
      notices_.post(EngineNotice::Kind::kStall, "deferred operation '" + op.name() +
                                                    "' is agreed on every rank but has waited " + seconds_text(waited) +
                                                    " for mark_ready() here; the other ranks wait in its ring");
    }
  }
  return Status::OK();
}

// A compressed allreduce (p > 1) with the codec's scheme; named tensors keep
// an error-feedback residual, which the scheme adds where it first touches
// each element (no separate pass over the tensor).
Status Executor::run_compressed(CommContext& ctx, Operation& op, RingTraffic* traffic, Progress& progress) {
  const OpDesc& d = op.req_.desc;
  float* data = static_cast<float*>(op.req_.data);
  const std::size_t n = d.count;
  const double scale = d.reduce_op == ReduceOp::kAverage ? 1.0 / ctx.size : 1.0;
  std::shared_ptr<ErrorFeedback> feedback;  // kept alive even if reset_state() runs meanwhile
  if (!op.req_.name.empty()) feedback = residuals_.get(ctx.id, op.req_.name, n);
  float* res = feedback ? feedback->residual.data() : nullptr;
  RingPlan plan(ctx.size, ctx.rank, n, sizeof(float), d.chunk_bytes);
  traffic->dense_bytes = plan.dense_bytes_sent();
  const std::uint64_t stream = mix64((ctx.compressed_ops++ << 20) ^ static_cast<std::uint64_t>(ctx.rank)) << 32;
  return visit_codec(op.req_.codec_spec, [&](const auto& codec) -> Status {
    using Codec = std::decay_t<decltype(codec)>;
    if constexpr (std::is_same_v<Codec, NoCodec>) {
      return Status::Internal("run_compressed without a codec");
    } else if constexpr (std::is_same_v<Codec, TopkCodec>) {
      cancellable_ = false;  // both variants run MPI collectives, which cannot be cancelled
      const TopkReuse reuse{codec.reuse_steps, feedback ? &feedback->topk_threshold : nullptr};
      const FloatSegment whole{data, n};
      const std::vector<FloatSegment>& pieces = op.req_.segments;
      const FloatSegments segments =  // n values: Operation::mark_ready refuses others
          pieces.empty() ? FloatSegments(&whole, 1) : FloatSegments(pieces.data(), pieces.size());
      if (topk_use_split(codec.algorithm, ctx.size, n, codec.count(n)))
        return topk_split_allreduce(ctx.data, ctx.size, ctx.rank, kTagData, segments, codec.ratio, scale, res, reuse,
                                    traffic, topk_scratch_, split_scratch_, progress);
      return topk_allreduce(ctx.data, ctx.size, segments, codec.ratio, scale, res, reuse, traffic, topk_scratch_,
                            progress);
    } else {
      CompressedRingPolicy<Codec> policy(plan, data, codec, scale, res, stream, ring_scratch_);
      return run_ring(plan, policy, ctx.data, kTagData, traffic, progress);
    }
  });
}

Status Executor::run_dense(CommContext& ctx, const OpDesc& d, DType dtype, std::uint64_t count, void* data,
                           RingTraffic* traffic, Progress& progress) {
  if (ctx.size == 1) return Status::OK();  // every op over one rank leaves its data
  const std::size_t bytes = count * dtype_size(dtype);
  if (use_recursive_doubling(bytes)) {
    partnered_ = "recursive doubling";
    partners_ = recursive_doubling_partners(ctx.size, ctx.rank);
    return recursive_doubling_allreduce(ctx.data, ctx.size, ctx.rank, kTagData, data, dtype, d.reduce_op, count,
                                        traffic, progress);
  }
  if (use_halving_doubling(ctx.size, bytes)) {
    partnered_ = "halving-doubling";
    partners_ = halving_doubling_partners(ctx.size, ctx.rank);
    return halving_doubling_allreduce(ctx.data, ctx.size, ctx.rank, kTagData, data, dtype, d.reduce_op, count,
                                      partner_scratch_, traffic, progress);
  }
  partners_.clear();  // a grouped operation's earlier member may have had partners
  RingPlan plan(ctx.size, ctx.rank, count, dtype_size(dtype), d.chunk_bytes);
  DenseRingPolicy policy(plan, data, dtype, d.reduce_op, ctx.size);
  traffic->dense_bytes = plan.dense_bytes_sent();
  return run_ring(plan, policy, ctx.data, kTagData, traffic, progress);
}

void Executor::stalled(double seconds) {
  const CommContext& ctx = *executing_;
  const std::string stalled = "hpcdl: operation '" + executing_name_ + "' made no progress in its ";
  const std::string why = " for " + seconds_text(seconds) + " (stall_error_seconds): ";
  if (partners_.empty()) {
    stall_text_ = stalled + "ring" + why + "rank " + std::to_string((ctx.rank + ctx.size - 1) % ctx.size) +
                  " or rank " + std::to_string((ctx.rank + 1) % ctx.size) +
                  " of the communicator, its neighbours, may be stopped or dead";
  } else {
    stall_text_ = stalled + partnered_ + why + (partners_.size() > 1 ? "one of " : "") + rank_list(partners_) +
                  " of the communicator, " + (partners_.size() > 1 ? "its partners" : "its partner") +
                  ", may be stopped or dead";
  }
}

Status Executor::execute(CommContext& ctx, Operation& op, Progress& progress) {
  const OpDesc& d = op.req_.desc;
  const double t0 = MPI_Wtime();
  const double start_us = now_us();
  {
    std::lock_guard<std::mutex> g(op.mu_);
    op.times_.started_us = start_us;
  }
  Status st;
  RingTraffic traffic;
  executing_ = &ctx;
  executing_name_ = op.name();
  // Point-to-point requests (the ring's, the gathering collectives') can be cancelled.
  cancellable_ = d.kind != OpKind::kBroadcast && d.kind != OpKind::kBarrier;
  if (d.kind == OpKind::kAllreduce) {
    if (ctx.size > 1 && !d.codec.empty()) {
      st = run_compressed(ctx, op, &traffic, progress);
    } else {
      st = run_dense(ctx, d, d.dtype, d.count, op.req_.data, &traffic, progress);
    }
  } else if (d.kind == OpKind::kGroupedAllreduce) {
    // One ring per array, in order: each array's bits are those of its own allreduce.
    for (std::size_t i = 0; i < d.members.size() && st.ok(); ++i) {
      RingTraffic part;
      const GroupMember& m = d.members[i];
      st = run_dense(ctx, d, m.dtype, m.count, op.req_.member_data[i], &part, progress);
      traffic.bytes_sent += part.bytes_sent;
      traffic.bytes_received += part.bytes_received;
      traffic.dense_bytes += part.dense_bytes;
    }
  } else if (d.kind == OpKind::kBroadcast) {
    const std::size_t total = d.count * dtype_size(d.dtype);
    char* p = static_cast<char*>(op.req_.data);
    for (std::size_t off = 0; off < total && st.ok(); off += kMaxChunkBytes) {
      const int n = static_cast<int>(std::min(kMaxChunkBytes, total - off));
      MPI_Request request;
      st = mpi_status(MPI_Ibcast(p + off, n, MPI_BYTE, d.root, ctx.data, &request), "MPI_Ibcast");
      if (st.ok()) st = mpi_status(wait_politely(&request, MPI_STATUS_IGNORE, progress), "MPI_Wait(broadcast)");
      if (ctx.rank == d.root)
        traffic.bytes_sent += n;
      else
        traffic.bytes_received += n;
    }
  } else if (d.kind != OpKind::kBarrier) {
    st = run_gathering(ctx, op, &traffic, progress);
  }
  // A barrier needs nothing more: it ran because every rank had entered it.
  executing_ = nullptr;
  if (!stall_text_.empty()) {
    st = Status::Timeout(stall_text_);
    stall_text_.clear();
  }
  partners_.clear();
  const double end_us = now_us();
  {
    std::lock_guard<std::mutex> g(op.mu_);
    op.times_.reduce_scatter_end_us =
        traffic.reduce_scatter_end > 0 ? start_us + (traffic.reduce_scatter_end - t0) * 1e6 : 0;
  }
  record(op, traffic, MPI_Wtime() - t0);
  Timeline& tl = Timeline::instance();
  if (tl.enabled()) {
    const OpTimes t = op.times();
    // A deferred operation's wait for its data is not negotiation: its own span.
    if (op.req_.deferred) tl.record(op.name(), "deferred", t.submitted_us, t.ready_us, 0);
    tl.record(op.name(), "negotiate", op.req_.deferred ? t.ready_us : t.submitted_us, start_us, 0);
    if (t.reduce_scatter_end_us > 0) {
      tl.record(op.name(), "reduce_scatter", start_us, t.reduce_scatter_end_us, 0);
      tl.record(op.name(), "allgather", t.reduce_scatter_end_us, end_us, 0);
    } else {
      tl.record(op.name(), op_kind_name(d.kind), start_us, end_us, 0);
    }
  }
  return st;
}

void Executor::record(const Operation& op, const RingTraffic& traffic, double seconds) {
  const OpDesc& d = op.req_.desc;
  const bool reduces = d.kind == OpKind::kAllreduce || d.kind == OpKind::kGroupedAllreduce;
  stats_.count(op_kind_name(d.kind), reduces ? (d.codec.empty() ? "none" : d.codec) : "", traffic.bytes_sent,
               traffic.bytes_received, traffic.dense_bytes, seconds);
}

}  // namespace hpcdl
