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
#include <vector>

#include "hpcdl/ring.hpp"
#include "hpcdl/status.hpp"

namespace hpcdl {

template <typename Codec>
class CompressedRingPolicy {
 public:
  // data: float32 values, reduced in place. residual: nullptr, or count
  // floats that receive what the encodings dropped (sum units). stream keys
  // stochastic rounding (unique per operation and rank).
  CompressedRingPolicy(const RingPlan& plan, float* data, const Codec& codec, double final_scale, float* residual,
                       std::uint64_t stream)
      : plan_(plan), data_(data), codec_(codec), final_scale_(final_scale), residual_(residual), stream_(stream),
        slot_bytes_((codec.encoded_bytes(plan.max_chunk_elems()) + 7) / 8 * 8),
        send_slots_(kPipelineDepth * slot_bytes_),
        recv_slots_(kPipelineDepth * slot_bytes_),
        gathered_(static_cast<std::size_t>(plan.size()) * plan.chunks() * slot_bytes_) {}

  RingBuffer send(std::size_t u) {
    const RingPlan::Unit x = plan_.unit(u);
    std::size_t begin, len;
    plan_.chunk_range(x.send_seg, x.chunk, &begin, &len);
    if (x.reduce_phase) {
      // At most kPipelineDepth sends are in flight and they retire in order.
      std::uint8_t* out = send_slots_.data() + (u % kPipelineDepth) * slot_bytes_;
      codec_.encode(data_ + begin, len, out, residual_ ? residual_ + begin : nullptr, stream_ + begin);
      return {out, codec_.encoded_bytes(len)};
    }
    std::uint8_t* enc = gathered(x.send_seg, x.chunk);
    if (x.step == 0) {
      // This rank owns the segment: encode its final value once and keep the decoded value.
      float* err = residual_ ? residual_ + begin : nullptr;
      codec_.encode(data_ + begin, len, enc, err, stream_ + begin);
      codec_.decode(enc, len, data_ + begin);
      if (err && final_scale_ != 1.0) {
        const float to_sum_units = static_cast<float>(1.0 / final_scale_);
        for (std::size_t i = 0; i < len; ++i) err[i] *= to_sum_units;
      }
    }
    return {enc, codec_.encoded_bytes(len)};
  }

  RingBuffer recv_slot(std::size_t u) {
    const RingPlan::Unit x = plan_.unit(u);
    const std::size_t bytes = expected_bytes(x);
    if (x.reduce_phase) return {recv_slots_.data() + (u % kPipelineDepth) * slot_bytes_, bytes};
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
    codec_.decode_add(recv_slots_.data() + (u % kPipelineDepth) * slot_bytes_, len, dst);
    if (x.final_reduce && final_scale_ != 1.0) {
      const float s = static_cast<float>(final_scale_);
      for (std::size_t i = 0; i < len; ++i) dst[i] *= s;
    }
    return Status::OK();
  }

 private:
  std::size_t expected_bytes(const RingPlan::Unit& x) const {
    std::size_t begin, len;
    plan_.chunk_range(x.recv_seg, x.chunk, &begin, &len);
    return codec_.encoded_bytes(len);
  }

  std::uint8_t* gathered(int seg, std::size_t chunk) {
    return gathered_.data() + (static_cast<std::size_t>(seg) * plan_.chunks() + chunk) * slot_bytes_;
  }

  const RingPlan& plan_;
  float* data_;
  const Codec& codec_;
  double final_scale_;
  float* residual_;
  std::uint64_t stream_;
  std::size_t slot_bytes_;
  // Encoded chunks: reduce-scatter sends and receives (one per pipeline slot),
  // and the allgather's full set, received there and forwarded from there.
  std::vector<std::uint8_t> send_slots_, recv_slots_, gathered_;
};

}  // namespace hpcdl
