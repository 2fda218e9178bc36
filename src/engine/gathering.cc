// The gathering collectives as the executor runs them (executor.hpp; the
// algorithms are in algorithms/gather.hpp): the row counts first, then each
// result's memory, once, at its final size, then the data.
#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "hpcdl/algorithms/gather.hpp"
#include "hpcdl/algorithms/ring.hpp"
#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/engine/executor.hpp"
#include "hpcdl/engine/op_wire.hpp"
#include "hpcdl/engine/operation.hpp"
#include "hpcdl/util/result_block.hpp"
#include "hpcdl/util/scratch.hpp"

namespace hpcdl {

namespace {

void add_traffic(RingTraffic* total, const RingTraffic& part) {
  total->bytes_sent += part.bytes_sent;
  total->bytes_received += part.bytes_received;
  total->dense_bytes += part.dense_bytes;
}

// Not zeroed: every byte is written (copied, received or reduced into).
void allocate(OpResult* out, std::uint64_t bytes) {
  out->bytes = bytes;
  out->data = ResultBlock::take(std::max<std::uint64_t>(bytes, 1));
}

// One array's reduce-scatter: rank r's segment of the first dimension (the
// first rows % p ranks one row more, RingPlan::even_offsets) into out.
Status reduce_scatter_one(const CommContext& ctx, const OpDesc& d, DType dtype, std::uint64_t count, std::uint64_t rows,
                          const void* data, OpResult* out, Scratch& scratch, RingTraffic* traffic, Progress& progress) {
  const std::vector<std::size_t> split = RingPlan::even_offsets(ctx.size, rows, 1);
  out->rows.resize(ctx.size);
  for (int r = 0; r < ctx.size; ++r) out->rows[r] = split[r + 1] - split[r];
  const std::vector<std::size_t> offsets = RingPlan::even_offsets(ctx.size, rows, rows ? count / rows : 0);
  allocate(out, (offsets[ctx.rank + 1] - offsets[ctx.rank]) * dtype_size(dtype));
  return pairwise_reduce_scatter(ctx.data, ctx.size, ctx.rank, kTagData, data, offsets, dtype, d.reduce_op,
                                 d.chunk_bytes, out->ptr(), scratch, traffic, progress);
}

// One array of an allgather: this rank's rows of row_elems elements, and where its result goes.
struct Gathered {
  DType dtype;
  std::uint64_t row_elems;
  const void* data;
  std::uint64_t rows;
  OpResult* out;
};

// Every rank's row counts of every array in one exchange, then each array
// through the ring's allgather phase into its own result.
Status allgather_each(const CommContext& ctx, const OpDesc& d, const std::vector<Gathered>& arrays,
                      RingTraffic* traffic, Progress& progress) {
  std::vector<std::uint64_t> mine, all;
  for (const Gathered& a : arrays) mine.push_back(a.rows);
  HPCDL_RETURN_NOT_OK(allgather_words(ctx.data, ctx.size, ctx.rank, kTagData, mine, &all, traffic, progress));
  for (std::size_t i = 0; i < arrays.size(); ++i) {
    const Gathered& a = arrays[i];
    OpResult& out = *a.out;
    out.rows.resize(ctx.size);
    std::uint64_t rows = 0;
    for (int r = 0; r < ctx.size; ++r) rows += out.rows[r] = all[static_cast<std::size_t>(r) * arrays.size() + i];
    allocate(&out, rows * a.row_elems * dtype_size(a.dtype));
    RingTraffic part;
    HPCDL_RETURN_NOT_OK(ring_allgatherv(ctx.data, ctx.size, ctx.rank, kTagData, a.data, out.rows, a.row_elems, a.dtype,
                                        d.chunk_bytes, out.ptr(), &part, progress));
    add_traffic(traffic, part);
  }
  return Status::OK();
}

}  // namespace

Status Executor::run_gathering(CommContext& ctx, Operation& op, RingTraffic* traffic, Progress& progress) {
  const OpDesc& d = op.req_.desc;
  const OpRequest& req = op.req_;
  switch (d.kind) {
    case OpKind::kReduceScatter:
      return reduce_scatter_one(ctx, d, d.dtype, d.count, req.rows, req.data, &op.result_, gather_scratch_, traffic,
                                progress);
    case OpKind::kGroupedReduceScatter:
      // One reduce-scatter per array, in order: each array's bits are those of its own call.
      op.member_results_.resize(d.members.size());
      for (std::size_t i = 0; i < d.members.size(); ++i) {
        const GroupMember& m = d.members[i];
        RingTraffic part;
        HPCDL_RETURN_NOT_OK(reduce_scatter_one(ctx, d, m.dtype, m.count, static_cast<std::uint64_t>(m.shape[0]),
                                               req.member_data[i], &op.member_results_[i], gather_scratch_, &part,
                                               progress));
        add_traffic(traffic, part);
      }
      return Status::OK();
    case OpKind::kAllgather:
      return allgather_each(ctx, d, {Gathered{d.dtype, d.count, req.data, req.rows, &op.result_}}, traffic, progress);
    case OpKind::kGroupedAllgather: {
      op.member_results_.resize(d.members.size());
      std::vector<Gathered> arrays;
      for (std::size_t i = 0; i < d.members.size(); ++i)
        arrays.push_back(Gathered{d.members[i].dtype, d.members[i].count, req.member_data[i], req.member_rows[i],
                                  &op.member_results_[i]});
      return allgather_each(ctx, d, arrays, traffic, progress);
    }
    case OpKind::kAlltoall: {
      // Each rank needs only what each peer sends it: one count from each, ahead of its rows.
      OpResult& out = op.result_;
      const std::size_t row_bytes = d.count * dtype_size(d.dtype);
      auto place = [&](const std::vector<std::uint64_t>& rows) {
        std::uint64_t total = 0;
        for (std::uint64_t n : rows) total += n;
        allocate(&out, total * row_bytes);
        return out.ptr();
      };
      return alltoallv_learning_counts(ctx.data, ctx.size, ctx.rank, kTagData, req.data, req.splits, row_bytes,
                                       d.chunk_bytes, &out.rows, place, traffic, progress);
    }
    default: return Status::Internal(std::string("run_gathering of a ") + op_kind_name(d.kind));
  }
}

}  // namespace hpcdl
