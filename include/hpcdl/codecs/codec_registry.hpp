// The codec registry: the one place a codec's kind (parsed from its canonical
// text by parse_codec, codecs.hpp) becomes the type that holds its kernels.
// visit_codec(spec, f) calls f with one of NoCodec, Fp16Codec, Bf16Codec,
// Int8Codec or TopkCodec; the engine (src/engine/execute.cc) and the
// whole-array hooks (codec_array.hpp) dispatch through it, and hpcdl.compression
// reads the settings back through parse_codec (hpcdl._core.codec_config).
#pragma once

#include <cstddef>
#include <cstdint>

#include "hpcdl/codecs/codecs.hpp"
#include "hpcdl/codecs/topk.hpp"

namespace hpcdl {

// Dense float32: no codec.
struct NoCodec {
  explicit NoCodec(const CodecSpec&) {}
  std::size_t encoded_bytes(std::size_t n) const { return n * sizeof(float); }
};

// Top-k is not a ring codec: the engine reduces its (index, value) pairs with
// topk_allreduce or topk_split_allreduce (sparse_allreduce.hpp).
struct TopkCodec {
  explicit TopkCodec(const CodecSpec& spec)
      : ratio(spec.ratio), algorithm(spec.topk_algorithm), reuse_steps(spec.topk_reuse_steps) {}
  std::size_t count(std::size_t n) const { return topk_count(n, ratio); }
  std::size_t encoded_bytes(std::size_t n) const { return topk_encoded_bytes(count(n)); }
  double ratio;
  TopkAlgorithm algorithm;
  std::uint32_t reuse_steps;  // 0: an exact selection every call
};

template <class F>
decltype(auto) visit_codec(const CodecSpec& spec, F&& f) {
  switch (spec.kind) {
    case CodecKind::kFp16: return f(Fp16Codec(spec));
    case CodecKind::kBf16: return f(Bf16Codec(spec));
    case CodecKind::kInt8: return f(Int8Codec(spec));
    case CodecKind::kTopK: return f(TopkCodec(spec));
    case CodecKind::kNone: break;
  }
  return f(NoCodec(spec));
}

}  // namespace hpcdl
