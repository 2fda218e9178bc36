// An operation submitted to the engine: what every rank must agree on
// (OpDesc), the caller's request, and the handle both sides share.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "hpcdl/codecs/codec_spec.hpp"
#include "hpcdl/util/dtype.hpp"
#include "hpcdl/util/result_block.hpp"
#include "hpcdl/util/segments.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

// Codes travel in operation descriptions.
enum class OpKind : int {
  kAllreduce = 0,
  kBroadcast = 1,
  kBarrier = 2,
  kAllgather = 3,             // rows may differ per rank: OpDesc::count is one row's elements
  kReduceScatter = 4,         // rank r keeps segment r of the first dimension (the first rows % p ranks one row more)
  kAlltoall = 5,              // rows and splits may differ per rank: OpDesc::count is one row's elements
  kGroupedAllreduce = 6,      // several arrays agreed as one operation, each reduced by its own ring
  kJoin = 7,                  // this rank ran out of data: it takes part with zeros until every rank joined
  kGroupedAllgather = 8,      // several allgathers agreed as one operation (members: one row's shape each)
  kGroupedReduceScatter = 9,  // several reducescatters agreed as one operation
};

// Several arrays agreed as one operation (OpDesc::members, OpRequest::member_data).
inline bool is_grouped(OpKind k) {
  return k == OpKind::kGroupedAllreduce || k == OpKind::kGroupedAllgather || k == OpKind::kGroupedReduceScatter;
}

// Join's own name on every rank (Engine::submit gives it): one join at a time per communicator.
constexpr const char* kJoinName = "hpcdl.join";

// Unnamed operations are named by submission order on their communicator: "op#<seq>".
std::string unnamed_op_name(std::uint64_t seq);
// Its sequence number, for a name unnamed_op_name made; false for any other name.
bool unnamed_op_seq(const std::string& name, std::uint64_t* seq);

// One array of a grouped operation (a grouped allgather's: one row, as OpDesc::count and shape are for an allgather).
struct GroupMember {
  DType dtype = DType::kFloat32;
  std::uint64_t count = 0;
  std::vector<std::int64_t> shape;
};

const char* op_kind_name(OpKind k);

// "[17, 1311]": a shape as error messages spell it.
std::string shape_text(const std::vector<std::int64_t>& shape);

// Elements a shape holds; false when a dimension is negative.
bool shape_elements(const std::vector<std::int64_t>& shape, std::uint64_t* elements);

// What every rank must agree on for one operation.
struct OpDesc {
  OpKind kind = OpKind::kAllreduce;
  DType dtype = DType::kFloat32;
  ReduceOp reduce_op = ReduceOp::kSum;
  std::int32_t root = 0;
  std::uint64_t count = 0;
  // The array's dimensions (a flat buffer: {count}; a 0-d array: none): ranks
  // whose arrays hold the same count in different shapes disagree.
  std::vector<std::int64_t> shape;
  std::uint64_t chunk_bytes = 0;
  std::string codec;                 // codec config, canonical text; empty = none
  std::vector<GroupMember> members;  // grouped kinds: its arrays, in the caller's order

  std::string serialize(const std::string& name) const;
  static bool parse(const std::string& bytes, std::string* name, OpDesc* out);
};

struct OpRequest {
  std::string name;  // empty: named by submission order on this communicator
  OpDesc desc;
  void* data = nullptr;
  std::vector<void*> member_data;  // grouped kinds: each member's array
  // A float32 allreduce with top-k: data in pieces (util/segments.hpp) summing to
  // desc.count, given by mark_ready(segments); empty: data. Local: ranks need not agree.
  std::vector<FloatSegment> segments;
  bool deferred = false;                   // data not in place yet: run only after Operation::mark_ready()
  CodecSpec codec_spec;                    // desc.codec as Engine::submit parsed it (the engine's own copy)
  std::uint64_t rows = 0;                  // allgather, alltoall, reducescatter: the first dimension
  std::vector<std::uint64_t> splits;       // alltoall: rows to each rank, in rank order (summing to rows)
  std::vector<std::uint64_t> member_rows;  // grouped allgather: each member's first dimension
};

// What an allgather, alltoall or reducescatter hands back: the engine thread
// allocates it at its final size once the ranks' row counts are known. Read
// once done.
struct OpResult {
  ResultBlock data;
  std::uint64_t bytes = 0;
  std::vector<std::uint64_t> rows;  // rows from (reducescatter: of the segment of) each rank, in rank order
  char* ptr() { return data.get(); }
};

struct OpTimes {
  double submitted_us = 0, ready_us = 0, agreed_us = 0, started_us = 0;
  double reduce_scatter_end_us = 0, finished_us = 0;
};

class Operation {
 public:
  explicit Operation(std::string name, OpRequest req)
      : name_(std::move(name)), req_(std::move(req)), ready_(!req_.deferred) {}
  const std::string& name() const { return name_; }
  bool done();
  // A deferred operation's data is in place: the engine may run it. Idempotent.
  void mark_ready();
  // The same, with the data in segments (OpRequest::segments) instead of the
  // buffer. Refused, and the operation left unready, unless it is a float32
  // allreduce with top-k and the segments hold desc.count values: the engine
  // writes the result through them. Ignored once ready.
  Status mark_ready(std::vector<FloatSegment> segments);
  bool ready();
  // Waits up to `seconds`; true once the operation has finished.
  bool wait_for(double seconds);
  Status status();
  // Warnings for whoever waits on this operation (stalls), oldest first.
  std::vector<std::string> take_notices();
  OpTimes times();
  // An allgather's, alltoall's or reducescatter's result, once done() (empty before).
  OpResult& result() { return result_; }
  // A grouped allgather's or reducescatter's result for member i, once done().
  OpResult& member_result(std::size_t i) { return member_results_[i]; }

 private:
  // The engine's parts that record its times and finish it.
  friend class CommContext;
  friend class ContextRegistry;
  friend class Engine;
  friend class EngineLoop;
  friend class Executor;
  friend class Transfers;
  void finish(Status st);
  void notify(std::string message);
  bool wait_ready_for(double seconds);

  std::string name_;
  OpRequest req_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  bool ready_;
  Status status_;
  std::vector<std::string> notices_;
  OpTimes times_;
  OpResult result_;
  std::vector<OpResult> member_results_;  // grouped allgather, reducescatter: one per member
};

}  // namespace hpcdl
