// The engine's public face: submissions are checked here, on the caller's
// thread, and queued for the engine thread (engine_loop.cc); counters,
// notices and residuals are read from the parts that keep them.
#include "hpcdl/engine/engine.hpp"

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <string>

#include "hpcdl/algorithms/ring.hpp"
#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/engine/engine_loop.hpp"
#include "hpcdl/util/mpi_process.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/timeline.hpp"

namespace hpcdl {

Engine& Engine::instance() {
  static Engine* engine = new Engine();  // never destroyed: outlives static teardown order
  return *engine;
}

Engine::Engine() : loop_(*new EngineLoop()) {}

void Engine::wake() { loop_.queue.wake(); }

Engine::Watch::Watch(Engine& engine) : engine_(engine) {
  if (engine_.loop_.queue.watchers.fetch_add(1) == 0) engine_.wake();  // it may sleep a slow poll's interval
}

Engine::Watch::~Watch() { engine_.loop_.queue.watchers.fetch_sub(1); }

void Engine::set_stall_limits(double warn_seconds, double error_seconds) {
  std::lock_guard<std::mutex> g(loop_.queue.mu);
  loop_.queue.limits = StallLimits{warn_seconds, error_seconds};
}

Status Engine::submit(MPI_Comm comm, OpRequest req, std::shared_ptr<Operation>* out) {
  HPCDL_RETURN_NOT_OK(require_thread_multiple("hpcdl", "its engine thread makes MPI calls while yours do"));
  if (req.desc.kind == OpKind::kJoin) {  // one name on every rank
    req.name = kJoinName;
  } else if (req.name == kJoinName) {
    return Status::Invalid(std::string("the name '") + kJoinName + "' is join's own");
  }
  const OpDesc& d = req.desc;
  if (!reduce_op_valid(static_cast<int>(d.reduce_op))) return Status::Invalid("unknown reduction op code");
  const char* op_name = reduce_op_name(d.reduce_op);
  const bool reduces = d.kind == OpKind::kAllreduce || d.kind == OpKind::kGroupedAllreduce ||
                       d.kind == OpKind::kReduceScatter || d.kind == OpKind::kGroupedReduceScatter;
  // Each array's shape holds its count, and the op reduces its dtype.
  auto check_array = [&](DType dtype, std::uint64_t count, const std::vector<std::int64_t>& shape) -> Status {
    std::uint64_t elements = 0;
    if (!shape_elements(shape, &elements) || elements != count)
      return Status::Invalid("shape " + shape_text(shape) + " does not hold " + std::to_string(count) + " elements");
    if (!dtype_valid(static_cast<int>(dtype))) return Status::Invalid("unknown dtype code");
    if (reduces && !dtype_reduces(dtype, d.reduce_op))
      return Status::Invalid(std::string("op='") + op_name + "' does not reduce " + dtype_name(dtype) +
                             " (bool takes min, max and product: and, or, and)");
    return Status::OK();
  };
  if (is_grouped(d.kind)) {
    const std::string what = std::string("a ") + op_kind_name(d.kind);
    if (d.members.empty() || d.members.size() != req.member_data.size())
      return Status::Invalid(what + " needs one array per member, and at least one");
    if (!d.codec.empty()) return Status::Invalid(what + " takes no compression");
    if (d.kind == OpKind::kGroupedAllgather && req.member_rows.size() != d.members.size())
      return Status::Invalid(what + " needs each member's first dimension");
    for (const GroupMember& m : d.members) {
      HPCDL_RETURN_NOT_OK(check_array(m.dtype, m.count, m.shape));
      if (d.kind == OpKind::kGroupedReduceScatter && m.shape.empty())
        return Status::Invalid(what + " splits each array's first dimension: a 0-d array has none");
    }
  } else if (d.kind != OpKind::kBarrier && d.kind != OpKind::kJoin) {
    HPCDL_RETURN_NOT_OK(check_array(d.dtype, d.count, d.shape));
  }
  if ((reduces || d.kind == OpKind::kAllgather || d.kind == OpKind::kGroupedAllgather || d.kind == OpKind::kAlltoall) &&
      (d.chunk_bytes < kMinChunkBytes || d.chunk_bytes > kMaxChunkBytes))
    return Status::Invalid("chunk_bytes must be between " + std::to_string(kMinChunkBytes) + " and " +
                           std::to_string(kMaxChunkBytes) + ", got " + std::to_string(d.chunk_bytes));
  if (d.kind == OpKind::kAllreduce && !d.codec.empty()) {
    if (d.reduce_op != ReduceOp::kSum && d.reduce_op != ReduceOp::kAverage)
      return Status::Invalid(std::string("compression reduces sums: op='") + op_name +
                             "' takes none (pass compression=None)");
    CodecSpec& spec = req.codec_spec;
    HPCDL_RETURN_NOT_OK(parse_codec(d.codec, &spec));
    HPCDL_RETURN_NOT_OK(check_codec_dtype(spec, d.codec, d.dtype));
    if (spec.kind == CodecKind::kTopK && d.count > std::numeric_limits<std::uint32_t>::max())
      return Status::Invalid("top-k sends uint32 indices: at most 2^32 - 1 elements, got " + std::to_string(d.count));
  }

  SubmissionQueue& queue = loop_.queue;
  std::lock_guard<std::mutex> g(queue.mu);
  if (queue.stopped) return Status::Cancelled("hpcdl's engine has shut down (interpreter exit)");
  std::shared_ptr<CommContext> ctx;
  HPCDL_RETURN_NOT_OK(loop_.contexts.context_for(comm, &ctx));
  if (d.kind == OpKind::kAlltoall) {
    std::uint64_t split_rows = 0;
    for (std::uint64_t rows : req.splits) split_rows += rows;
    if (req.splits.size() != static_cast<std::size_t>(ctx->size) || split_rows != req.rows)
      return Status::Invalid("alltoall needs one split per rank (" + std::to_string(ctx->size) + "), summing to the " +
                             std::to_string(req.rows) + " rows sent; got " + std::to_string(req.splits.size()) +
                             " summing to " + std::to_string(split_rows));
  }
  if (d.kind == OpKind::kBroadcast && (d.root < 0 || d.root >= ctx->size))
    return Status::Invalid("root " + std::to_string(d.root) + " is not a rank of a communicator of size " +
                           std::to_string(ctx->size));
  // Before the operation is named or recorded: a failed start leaves nothing,
  // not even a gap in the unnamed operations' numbering.
  HPCDL_RETURN_NOT_OK(loop_.start_locked());
  std::string name = req.name.empty() ? unnamed_op_name(ctx->unnamed_seq++) : req.name;
  if (ctx->in_flight.count(name))
    return Status::Invalid("an operation named '" + name + "' is already in flight on this communicator");
  ctx->in_flight.insert(name);
  auto op = std::make_shared<Operation>(name, std::move(req));
  op->times_.submitted_us = now_us();
  if (op->ready_) op->times_.ready_us = op->times_.submitted_us;
  queue.submitted.ops.emplace_back(ctx, op);
  queue.cv.notify_one();
  *out = std::move(op);
  return Status::OK();
}

Status Engine::submit_transfer(MPI_Comm comm, bool send, void* data, std::uint64_t bytes, int peer, int tag,
                               std::shared_ptr<Operation>* out) {
  HPCDL_RETURN_NOT_OK(require_thread_multiple("hpcdl", "its engine thread makes MPI calls while yours do"));
  if (bytes > kMaxTransferBytes)
    return Status::Invalid("a point-to-point transfer moves at most " + std::to_string(kMaxTransferBytes) +
                           " bytes, got " + std::to_string(bytes));
  Transfer t;
  t.send = send;
  t.data = data;
  t.bytes = bytes;
  t.peer = peer;
  t.tag = tag;
  SubmissionQueue& queue = loop_.queue;
  std::lock_guard<std::mutex> g(queue.mu);
  if (queue.stopped) return Status::Cancelled("hpcdl's engine has shut down (interpreter exit)");
  std::shared_ptr<CommContext> ctx;
  HPCDL_RETURN_NOT_OK(loop_.contexts.context_for(comm, &ctx));
  int* tag_ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(comm, MPI_TAG_UB, &tag_ub, &found);
  if (tag < 0 || (found && tag > *tag_ub))
    return Status::Invalid("tag " + std::to_string(tag) + " is outside [0, " + std::to_string(found ? *tag_ub : 32767) +
                           "]");
  if (peer < 0 || peer >= ctx->size)
    return Status::Invalid("peer " + std::to_string(peer) + " is not a rank of a communicator of size " +
                           std::to_string(ctx->size));
  HPCDL_RETURN_NOT_OK(loop_.start_locked());  // before the transfer is queued: a failed submission leaves nothing
  OpRequest req;
  req.name = describe_transfer(t, ctx->rank);
  std::string name = req.name;  // not req.name below: the arguments' order of evaluation is unspecified
  t.op = std::make_shared<Operation>(std::move(name), std::move(req));
  t.op->times_.submitted_us = t.op->times_.ready_us = now_us();
  *out = t.op;
  queue.submitted.transfers.emplace_back(ctx, std::move(t));
  ++queue.wakeups;
  queue.cv.notify_one();
  return Status::OK();
}

std::vector<EngineStats> Engine::stats() { return loop_.stats.rows(); }

AgreementStats Engine::agreement_stats() { return loop_.stats.agreement(); }

void Engine::reset_stats() { loop_.stats.reset(); }

std::vector<EngineNotice> Engine::take_notices(std::uint64_t* dropped) { return loop_.notices.take(dropped); }

void Engine::reset_compression_state() { loop_.residuals.clear(); }

Status Engine::copy_residual(MPI_Comm comm, const std::string& name, std::vector<float>* out, bool* found) {
  *found = false;
  std::uint64_t id = 0;
  bool has = false;
  HPCDL_RETURN_NOT_OK(loop_.contexts.find_id(comm, &has, &id));
  if (has) *found = loop_.residuals.copy(id, name, out);
  return Status::OK();
}

Status Engine::set_residual(MPI_Comm comm, const std::string& name, std::vector<float> values) {
  return loop_.contexts.set_residual(comm, name, std::move(values));
}

Status Engine::free_residual(MPI_Comm comm, const std::string& name, bool* found) {
  *found = false;
  std::uint64_t id = 0;
  bool has = false;
  HPCDL_RETURN_NOT_OK(loop_.contexts.find_id(comm, &has, &id));
  if (has) *found = loop_.residuals.free(id, name);
  return Status::OK();
}

std::uint64_t Engine::residual_bytes() { return loop_.residuals.bytes(); }

void Engine::shutdown() {
  // A forked child has a copy of the engine's state but not its thread, which
  // is its parent's to stop: there is nothing to wait for or to tell anyone.
  if (!in_mpi_process()) return;
  loop_.stop();
}

}  // namespace hpcdl
