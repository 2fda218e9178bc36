// Any codec over one whole array, as a single chunk: the entry points that
// tests and bench/codecs.py use to check and time the kernels alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "hpcdl/codecs/codec_registry.hpp"
#include "hpcdl/codecs/codecs.hpp"
#include "hpcdl/codecs/topk.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

namespace detail {

inline void encode_array(const NoCodec&, const float* x, std::size_t n, std::uint8_t* out, float* err, std::uint64_t) {
  std::memcpy(out, x, n * sizeof(float));
  if (err) std::memset(err, 0, n * sizeof(float));
}

inline void encode_array(const TopkCodec& codec, const float* x, std::size_t n, std::uint8_t* out, float* err,
                         std::uint64_t) {
  const std::size_t k = codec.count(n);
  thread_local TopkScratch scratch;  // reused, as the engine does
  if (!err) {
    topk_encode(x, n, k, out, scratch);
    return;
  }
  // The engine's error-feedback path, from a zero residual: err = x (NaN/Inf as 0), the k sent zeroed.
  std::memset(err, 0, n * sizeof(float));
  std::uint32_t* idx = topk_indices(out);
  TopkSelector(n, k, scratch).select_with_residual(x, err, idx, topk_values(out, k));
  for (std::size_t j = 0; j < k; ++j) err[idx[j]] = 0;
}

template <class Codec>  // a ring codec (codecs.hpp)
void encode_array(const Codec& codec, const float* x, std::size_t n, std::uint8_t* out, float* err,
                  std::uint64_t stream) {
  codec.encode(x, nullptr, n, out, err, stream);
}

inline Status decode_array(const NoCodec&, const std::uint8_t* in, std::size_t n, float* out) {
  std::memcpy(out, in, n * sizeof(float));
  return Status::OK();
}

inline Status decode_array(const TopkCodec& codec, const std::uint8_t* in, std::size_t n, float* out) {
  // Bytes from outside the engine: the sum walks indices that ascend below n.
  const std::size_t k = codec.count(n);
  const std::uint32_t* idx = topk_indices(in);
  for (std::size_t j = 0; j < k; ++j)
    if (idx[j] >= n || (j > 0 && idx[j] <= idx[j - 1]))
      return Status::Corrupt("top-k message: index " + std::to_string(idx[j]) + " at pair " + std::to_string(j) +
                             " (indices must ascend and be below " + std::to_string(n) + ")");
  thread_local TopkScratch scratch;
  topk_sum_into(in, 1, k, out, n, scratch);
  return Status::OK();
}

template <class Codec>
Status decode_array(const Codec& codec, const std::uint8_t* in, std::size_t n, float* out) {
  codec.decode(in, n, out);
  return Status::OK();
}

}  // namespace detail

inline Status codec_encoded_bytes(const std::string& text, std::size_t n, std::size_t* out) {
  CodecSpec spec;
  HPCDL_RETURN_NOT_OK(parse_codec(text, &spec));
  *out = visit_codec(spec, [&](const auto& codec) { return codec.encoded_bytes(n); });
  return Status::OK();
}

// err (optional, n floats): x - decode(encoded), 0 where that is not finite (the
// residual rule, codecs.hpp). stream keys stochastic rounding.
inline Status codec_encode(const std::string& text, const float* x, std::size_t n, std::uint8_t* out, float* err,
                           std::uint64_t stream) {
  CodecSpec spec;
  HPCDL_RETURN_NOT_OK(parse_codec(text, &spec));
  visit_codec(spec, [&](const auto& codec) { detail::encode_array(codec, x, n, out, err, stream); });
  return Status::OK();
}

inline Status codec_decode(const std::string& text, const std::uint8_t* in, std::size_t n, float* out) {
  CodecSpec spec;
  HPCDL_RETURN_NOT_OK(parse_codec(text, &spec));
  return visit_codec(spec, [&](const auto& codec) { return detail::decode_array(codec, in, n, out); });
}

// One rank's top-k contribution for a named tensor, as the engine selects it
// (with threshold reuse when the codec asks for it), without the scaling: x =
// data + residual; idx and val need room for topk_reuse_cap(k) pairs, *count
// is how many were written; *threshold is the tensor's state, carried from
// call to call; the residual is left holding x without the pairs sent (what
// the allgather leaves; NaN and Inf as 0).
inline Status topk_contribution_array(const std::string& text, const float* x, std::size_t n, float* residual,
                                      TopkThreshold* threshold, std::uint32_t* idx, float* val, std::size_t* count) {
  CodecSpec spec;
  HPCDL_RETURN_NOT_OK(parse_codec(text, &spec));
  if (spec.kind != CodecKind::kTopK) return Status::Invalid("'" + text + "' is not a top-k codec");
  thread_local TopkScratch scratch;
  const TopkCodec codec(spec);
  *count = topk_contribution(x, residual, n, codec.count(n), 1.0, scratch, idx, val, codec.reuse_steps, threshold);
  for (std::size_t j = 0; j < *count; ++j) residual[idx[j]] = 0;
  return Status::OK();
}

}  // namespace hpcdl
