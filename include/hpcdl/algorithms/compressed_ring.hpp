// The pipelined ring over encoded chunks (int8, fp16, bf16): same schedule as
// the dense ring (run_ring), a policy that encodes before the wire.
//
// Reduce-scatter: a rank encodes its running partial sum of a chunk, the next
// rank decodes it and adds it to its own values in fp32. Allgather: the owner
// of a segment encodes its final value ONCE, overwrites its own copy with the
// decoded value, and every rank forwards those exact bytes, so all ranks end
// bitwise identical.
//
// Every rank encodes every element exactly once per operation (p - 1 segments
// as partial sums, its own segment as the final value). With a residual
// buffer (error feedback), what each encoding dropped is kept there, per
// element, so (sum of applied results) + (sum over ranks of residuals) equals
// the sum of the true inputs. Without one, the p encodings' errors add up:
// per element at most sum over the p encodings of (block absmax)/254 for int8
// round-to-nearest, i.e. about p * (sum over ranks of the block absmax) / 254.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "hpcdl/algorithms/ring.hpp"
#include "hpcdl/util/scratch.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

// Encoded chunks: reduce-scatter sends and receives (one per pipeline slot),
// and the allgather's full set, received there and forwarded from there.
struct RingScratch {
  Scratch send_slots, recv_slots, gathered;
};

template <typename Codec>
class CompressedRingPolicy {
 public:
  // data: float32 values, reduced in place. residual: nullptr, or count
  // floats of error feedback: added to the data where the ring first touches
  // each element (this rank's own segment when it sends it, every other
  // segment when its first partial sum arrives), and overwritten with what
  // this rank's encoding of that element dropped (sum units). stream keys
  // stochastic rounding (unique per operation and rank).
  CompressedRingPolicy(const RingPlan& plan, float* data, const Codec& codec, double final_scale, float* residual,
                       std::uint64_t stream, RingScratch& scratch)
      : plan_(plan),
        data_(data),
        codec_(codec),
        final_scale_(final_scale),
        residual_(residual),
        stream_(stream),
        slot_bytes_((codec.encoded_bytes(plan.max_chunk_elems()) + 7) / 8 * 8),
        send_slots_(scratch.send_slots.get<std::uint8_t>(kPipelineDepth * slot_bytes_)),
        recv_slots_(scratch.recv_slots.get<std::uint8_t>(kPipelineDepth * slot_bytes_)),
        gathered_(
            scratch.gathered.get<std::uint8_t>(static_cast<std::size_t>(plan.size()) * plan.chunks() * slot_bytes_)) {}

  RingBuffer send(std::size_t u) {
    const RingPlan::Unit x = plan_.unit(u);
    std::size_t begin, len;
    plan_.chunk_range(x.send_seg, x.chunk, &begin, &len);
    float* res = residual_ ? residual_ + begin : nullptr;
    if (x.reduce_phase) {
      // At most kPipelineDepth sends are in flight and they retire in order.
      std::uint8_t* out = send_slots_ + (u % kPipelineDepth) * slot_bytes_;
      // Step 0 sends this rank's own values: the first touch, so the residual is added here.
      codec_.encode(data_ + begin, x.step == 0 ? res : nullptr, len, out, res, stream_ + begin);
      return {out, codec_.encoded_bytes(len)};
    }
    std::uint8_t* enc = gathered(x.send_seg, x.chunk);
    if (x.step == 0) {
      // This rank owns the segment: encode its final value once and keep the decoded value.
      codec_.encode_in_place(data_ + begin, len, enc, res, static_cast<float>(1.0 / final_scale_), stream_ + begin);
    }
    return {enc, codec_.encoded_bytes(len)};
  }

  RingBuffer recv_slot(std::size_t u) {
    const RingPlan::Unit x = plan_.unit(u);
    const std::size_t bytes = expected_bytes(x);
    if (x.reduce_phase) return {recv_slots_ + (u % kPipelineDepth) * slot_bytes_, bytes};
    return {gathered(x.recv_seg, x.chunk), bytes};
  }

  Status received(std::size_t u, std::size_t bytes) {
    const RingPlan::Unit x = plan_.unit(u);
    if (bytes != expected_bytes(x))
      return Status::Mismatch("encoded ring chunk of " + std::to_string(bytes) + " bytes, expected " +
                              std::to_string(expected_bytes(x)));
    std::size_t begin, len;
    plan_.chunk_range(x.recv_seg, x.chunk, &begin, &len);
    float* dst = data_ + begin;
    if (!x.reduce_phase) {
      codec_.decode(gathered(x.recv_seg, x.chunk), len, dst);
      return Status::OK();
    }
    // The first partial sum of this chunk to arrive here: add the residual with it.
    const float scale = x.final_reduce ? static_cast<float>(final_scale_) : 1.0f;
    codec_.decode_add(recv_slots_ + (u % kPipelineDepth) * slot_bytes_, len, dst,
                      residual_ ? residual_ + begin : nullptr, scale);
    return Status::OK();
  }

 private:
  std::size_t expected_bytes(const RingPlan::Unit& x) const {
    std::size_t begin, len;
    plan_.chunk_range(x.recv_seg, x.chunk, &begin, &len);
    return codec_.encoded_bytes(len);
  }

  std::uint8_t* gathered(int seg, std::size_t chunk) {
    return gathered_ + (static_cast<std::size_t>(seg) * plan_.chunks() + chunk) * slot_bytes_;
  }

  const RingPlan& plan_;
  float* data_;
  const Codec& codec_;
  double final_scale_;
  float* residual_;
  std::uint64_t stream_;
  std::size_t slot_bytes_;
  std::uint8_t *send_slots_, *recv_slots_, *gathered_;
};

}  // namespace hpcdl
