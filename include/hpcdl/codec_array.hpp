// Any codec over one whole array, as a single chunk: the entry points that
// tests and bench/codecs.py use to check and time the kernels alone.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "hpcdl/codecs.hpp"
#include "hpcdl/status.hpp"
#include "hpcdl/topk.hpp"

namespace hpcdl {

inline Status codec_encoded_bytes(const std::string& text, std::size_t n, std::size_t* out) {
  CodecSpec spec;
  HPCDL_RETURN_NOT_OK(parse_codec(text, &spec));
  switch (spec.kind) {
    case CodecKind::kNone: *out = n * sizeof(float); break;
    case CodecKind::kFp16: *out = Fp16Codec(spec).encoded_bytes(n); break;
    case CodecKind::kBf16: *out = Bf16Codec(spec).encoded_bytes(n); break;
    case CodecKind::kInt8: *out = Int8Codec(spec).encoded_bytes(n); break;
    case CodecKind::kTopK: *out = topk_encoded_bytes(topk_count(n, spec.ratio)); break;
  }
  return Status::OK();
}

// err (optional, n floats): x - decode(encoded), 0 where that is not finite (the
// residual rule, codecs.hpp). stream keys stochastic rounding.
inline Status codec_encode(const std::string& text, const float* x, std::size_t n, std::uint8_t* out, float* err,
                           std::uint64_t stream) {
  CodecSpec spec;
  HPCDL_RETURN_NOT_OK(parse_codec(text, &spec));
  switch (spec.kind) {
    case CodecKind::kNone:
      std::memcpy(out, x, n * sizeof(float));
      if (err) std::memset(err, 0, n * sizeof(float));
      break;
    case CodecKind::kFp16: Fp16Codec(spec).encode(x, nullptr, n, out, err, stream); break;
    case CodecKind::kBf16: Bf16Codec(spec).encode(x, nullptr, n, out, err, stream); break;
    case CodecKind::kInt8: Int8Codec(spec).encode(x, nullptr, n, out, err, stream); break;
    case CodecKind::kTopK: {
      const std::size_t k = topk_count(n, spec.ratio);
      thread_local TopkScratch scratch;  // reused, as the engine does
      if (!err) {
        topk_encode(x, n, k, out, scratch);
        break;
      }
      // The engine's error-feedback path, from a zero residual: err = x (NaN/Inf as 0), the k sent zeroed.
      std::memset(err, 0, n * sizeof(float));
      std::uint32_t* idx = topk_indices(out);
      TopkSelector(n, k, scratch).select_with_residual(x, err, idx, topk_values(out, k));
      for (std::size_t j = 0; j < k; ++j) err[idx[j]] = 0;
      break;
    }
  }
  return Status::OK();
}

inline Status codec_decode(const std::string& text, const std::uint8_t* in, std::size_t n, float* out) {
  CodecSpec spec;
  HPCDL_RETURN_NOT_OK(parse_codec(text, &spec));
  switch (spec.kind) {
    case CodecKind::kNone: std::memcpy(out, in, n * sizeof(float)); break;
    case CodecKind::kFp16: Fp16Codec(spec).decode(in, n, out); break;
    case CodecKind::kBf16: Bf16Codec(spec).decode(in, n, out); break;
    case CodecKind::kInt8: Int8Codec(spec).decode(in, n, out); break;
    case CodecKind::kTopK: {
      // Bytes from outside the engine: the sum walks indices that ascend below n.
      const std::size_t k = topk_count(n, spec.ratio);
      const std::uint32_t* idx = topk_indices(in);
      for (std::size_t j = 0; j < k; ++j)
        if (idx[j] >= n || (j > 0 && idx[j] <= idx[j - 1]))
          return Status::Corrupt("top-k message: index " + std::to_string(idx[j]) + " at pair " + std::to_string(j) +
                                 " (indices must ascend and be below " + std::to_string(n) + ")");
      thread_local TopkScratch scratch;
      topk_sum_into(in, 1, k, out, n, scratch);
      break;
    }
  }
  return Status::OK();
}

}  // namespace hpcdl
