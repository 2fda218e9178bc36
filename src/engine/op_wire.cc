// An operation's description as it travels in reports (OpDesc::serialize).
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
  }
  return "?";
}

std::string shape_text(const std::vector<std::int64_t>& shape) {
  std::string out = "[";
  for (std::size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string OpDesc::serialize(const std::string& name) const {
  WireWriter w;
  w.put_string(name);
  w.put<std::int32_t>(static_cast<std::int32_t>(kind));
  w.put<std::int32_t>(static_cast<std::int32_t>(dtype));
  w.put<std::int32_t>(static_cast<std::int32_t>(reduce_op));
  w.put<std::int32_t>(root);
  w.put<std::uint64_t>(count);
  w.put<std::uint32_t>(static_cast<std::uint32_t>(shape.size()));
  for (std::int64_t dim : shape) w.put<std::int64_t>(dim);
  w.put<std::uint64_t>(chunk_bytes);
  w.put_string(codec);
  w.put_string(thread);
  return std::string(w.buffer().begin(), w.buffer().end());
}

bool OpDesc::parse(const std::string& bytes, std::string* name, OpDesc* out) {
  WireReader r(bytes.data(), bytes.size());
  std::int32_t kind, dtype, op;
  std::uint32_t ndim;
  if (!r.get_string(name) || !r.get(&kind) || !r.get(&dtype) || !r.get(&op) || !r.get(&out->root) ||
      !r.get(&out->count) || !r.get(&ndim) || ndim > bytes.size() / sizeof(std::int64_t))
    return false;
  out->shape.resize(ndim);
  for (std::int64_t& dim : out->shape)
    if (!r.get(&dim)) return false;
  if (!r.get(&out->chunk_bytes) || !r.get_string(&out->codec) || !r.get_string(&out->thread)) return false;
  out->kind = static_cast<OpKind>(kind);
  out->dtype = static_cast<DType>(dtype);
  out->reduce_op = static_cast<ReduceOp>(op);
  return true;
}

}  // namespace hpcdl
