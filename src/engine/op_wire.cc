// An operation's description as it travels in reports (OpDesc::serialize), and plan entries as they are read.
#include "hpcdl/engine/op_wire.hpp"

#include <cstdint>
#include <string>
#include <vector>

#include "hpcdl/engine/operation.hpp"
#include "hpcdl/util/wire.hpp"

namespace hpcdl {

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kBarrier: return "barrier";
    case OpKind::kAllgather: return "allgather";
    case OpKind::kReduceScatter: return "reducescatter";
    case OpKind::kAlltoall: return "alltoall";
    case OpKind::kGroupedAllreduce: return "grouped_allreduce";
    case OpKind::kJoin: return "join";
  }
  return "?";
}

namespace {
constexpr char kUnnamedPrefix[] = "op#";
}  // namespace

std::string unnamed_op_name(std::uint64_t seq) { return kUnnamedPrefix + std::to_string(seq); }

bool unnamed_op_seq(const std::string& name, std::uint64_t* seq) {
  const std::size_t prefix = sizeof(kUnnamedPrefix) - 1;
  if (name.size() <= prefix || name.compare(0, prefix, kUnnamedPrefix) != 0) return false;
  *seq = 0;
  for (std::size_t i = prefix; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return false;
    *seq = *seq * 10 + static_cast<std::uint64_t>(name[i] - '0');
  }
  return true;
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

bool shape_elements(const std::vector<std::int64_t>& shape, std::uint64_t* elements) {
  *elements = 1;
  for (std::int64_t dim : shape) {
    if (dim < 0) return false;
    *elements *= static_cast<std::uint64_t>(dim);
  }
  return true;
}

namespace {

void put_shape(WireWriter& w, const std::vector<std::int64_t>& shape) {
  w.put<std::uint32_t>(static_cast<std::uint32_t>(shape.size()));
  for (std::int64_t dim : shape) w.put<std::int64_t>(dim);
}

bool get_shape(WireReader& r, std::size_t limit, std::vector<std::int64_t>* shape) {
  std::uint32_t ndim;
  if (!r.get(&ndim) || ndim > limit / sizeof(std::int64_t)) return false;
  shape->resize(ndim);
  for (std::int64_t& dim : *shape)
    if (!r.get(&dim)) return false;
  return true;
}

}  // namespace

std::string OpDesc::serialize(const std::string& name) const {
  WireWriter w;
  w.put_string(name);
  w.put<std::int32_t>(static_cast<std::int32_t>(kind));
  w.put<std::int32_t>(static_cast<std::int32_t>(dtype));
  w.put<std::int32_t>(static_cast<std::int32_t>(reduce_op));
  w.put<std::int32_t>(root);
  w.put<std::uint64_t>(count);
  put_shape(w, shape);
  w.put<std::uint64_t>(chunk_bytes);
  w.put_string(codec);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(members.size()));
  for (const GroupMember& m : members) {
    w.put<std::int32_t>(static_cast<std::int32_t>(m.dtype));
    w.put<std::uint64_t>(m.count);
    put_shape(w, m.shape);
  }
  return std::string(w.buffer().begin(), w.buffer().end());
}

bool OpDesc::parse(const std::string& bytes, std::string* name, OpDesc* out) {
  WireReader r(bytes.data(), bytes.size());
  std::int32_t kind, dtype, op;
  std::uint32_t members;
  if (!r.get_string(name) || !r.get(&kind) || !r.get(&dtype) || !r.get(&op) || !r.get(&out->root) ||
      !r.get(&out->count) || !get_shape(r, bytes.size(), &out->shape) || !r.get(&out->chunk_bytes) ||
      !r.get_string(&out->codec) || !r.get(&members) || members > bytes.size())
    return false;
  out->members.resize(members);
  for (GroupMember& m : out->members) {
    std::int32_t member_dtype;
    if (!r.get(&member_dtype) || !r.get(&m.count) || !get_shape(r, bytes.size(), &m.shape)) return false;
    m.dtype = static_cast<DType>(member_dtype);
  }
  out->kind = static_cast<OpKind>(kind);
  out->dtype = static_cast<DType>(dtype);
  out->reduce_op = static_cast<ReduceOp>(op);
  return true;
}

bool read_plan_entry(WireReader& r, PlanEntry* e) {
  std::uint8_t result = 0, with_name = 0;
  if (!r.get(&e->id) || !r.get(&result) || !r.get(&with_name) ||
      result > static_cast<std::uint8_t>(PlanResult::kJoined))
    return false;
  e->result = static_cast<PlanResult>(result);
  e->name.clear();
  if (with_name && !r.get_string(&e->name)) return false;
  if (e->result != PlanResult::kRun && !r.get_string(&e->message)) return false;
  e->missing.clear();
  if (e->result == PlanResult::kTimeout) {
    std::uint32_t missing = 0;
    if (!r.get(&missing)) return false;
    for (std::uint32_t k = 0; k < missing; ++k) {
      std::int32_t rank = -1;
      if (!r.get(&rank)) return false;
      e->missing.push_back(rank);
    }
  }
  if (e->result == PlanResult::kRunJoined && !r.get_string(&e->desc)) return false;
  if (e->result == PlanResult::kJoined && !r.get(&e->last_joined)) return false;
  return true;
}

}  // namespace hpcdl
