// Gradient codecs: what goes on the wire instead of float32 values, and back.
//
// A codec is named by a canonical text that every rank must agree on (it is
// part of OpDesc): "fp16", "bf16", "int8(block=256)",
// "int8(block=256,rounding=stochastic,seed=7)", "topk(ratio=0.01)"; empty = none.
//
// Wire formats (little-endian, as the hosts are; one encoded chunk of n values):
//   fp16 / bf16 : n x uint16 (IEEE half / bfloat16, round to nearest even).
//   int8        : ceil(n/block) x float32 scale, then n x int8. Block b covers
//                 values [b*block, (b+1)*block); scale = absmax/127; value =
//                 q * scale. A block holding NaN or +-Inf gets scale NaN: all of
//                 its values decode as NaN (propagated, never hidden).
//   topk        : k x uint32 index (ascending), then k x float32 value.
//
// The kernels are plain loops over contiguous arrays that the compiler
// vectorizes (integer max for the absmax, the 1.5*2^23 trick for rounding).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "hpcdl/dtype.hpp"
#include "hpcdl/status.hpp"

namespace hpcdl {

enum class CodecKind : int { kNone = 0, kFp16 = 1, kBf16 = 2, kInt8 = 3, kTopK = 4 };

struct CodecSpec {
  CodecKind kind = CodecKind::kNone;
  std::uint32_t block = 256;  // int8: values per scale
  bool stochastic = false;    // int8: stochastic rounding instead of nearest
  std::uint64_t seed = 0;     // int8 stochastic: RNG seed
  double ratio = 0;           // topk: fraction of values kept
};

namespace detail {

// "key=value" fields of "name(k1=v1,k2=v2)"; false on malformed text.
inline bool codec_field(const std::string& args, const std::string& key, std::string* value) {
  std::size_t pos = 0;
  while (pos <= args.size()) {
    std::size_t end = args.find(',', pos);
    if (end == std::string::npos) end = args.size();
    const std::string item = args.substr(pos, end - pos);
    const std::size_t eq = item.find('=');
    if (eq != std::string::npos && item.substr(0, eq) == key) {
      *value = item.substr(eq + 1);
      return true;
    }
    pos = end + 1;
  }
  return false;
}

inline bool parse_uint(const std::string& s, std::uint64_t* out) {
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 19) return false;
  *out = std::strtoull(s.c_str(), nullptr, 10);
  return true;
}

}  // namespace detail

// Parses a canonical codec text (see the top of this file).
inline Status parse_codec(const std::string& text, CodecSpec* out) {
  *out = CodecSpec();
  if (text.empty()) return Status::OK();
  if (text == "fp16") { out->kind = CodecKind::kFp16; return Status::OK(); }
  if (text == "bf16") { out->kind = CodecKind::kBf16; return Status::OK(); }
  const std::size_t open = text.find('(');
  if (open == std::string::npos || text.back() != ')') return Status::Invalid("unknown compression '" + text + "'");
  const std::string name = text.substr(0, open), args = text.substr(open + 1, text.size() - open - 2);
  std::string v;
  if (name == "int8") {
    std::uint64_t block = 0, seed = 0;
    if (!detail::codec_field(args, "block", &v) || !detail::parse_uint(v, &block) || block < 1 || block > (1u << 24))
      return Status::Invalid("compression '" + text + "': block must be an integer in [1, 2^24]");
    out->kind = CodecKind::kInt8;
    out->block = static_cast<std::uint32_t>(block);
    if (detail::codec_field(args, "rounding", &v)) {
      if (v != "stochastic" && v != "nearest")
        return Status::Invalid("compression '" + text + "': rounding must be nearest or stochastic");
      out->stochastic = v == "stochastic";
    }
    if (detail::codec_field(args, "seed", &v)) {
      if (!detail::parse_uint(v, &seed)) return Status::Invalid("compression '" + text + "': bad seed");
      out->seed = seed;
    }
    return Status::OK();
  }
  if (name == "topk") {
    char* end = nullptr;
    if (!detail::codec_field(args, "ratio", &v)) return Status::Invalid("compression '" + text + "': needs ratio");
    const double ratio = std::strtod(v.c_str(), &end);
    if (end == v.c_str() || *end != '\0' || !(ratio > 0 && ratio <= 1))
      return Status::Invalid("compression '" + text + "': ratio must be in (0, 1]");
    out->kind = CodecKind::kTopK;
    out->ratio = ratio;
    return Status::OK();
  }
  return Status::Invalid("unknown compression '" + text + "'");
}

// Counter-based RNG (splitmix64 finalizer): the same (seed, stream, index)
// always gives the same draw, so stochastic rounding is reproducible.
inline std::uint64_t mix64(std::uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Round to nearest even for |v| < 2^22 without a libm call (vectorizes).
inline float round_nearest_small(float v) {
  const float magic = 12582912.0f;  // 1.5 * 2^23
  return (v + magic) - magic;
}

// Blockwise int8: see the wire format above.
class Int8Codec {
 public:
  explicit Int8Codec(const CodecSpec& spec) : block_(spec.block), stochastic_(spec.stochastic), seed_(spec.seed) {}

  std::size_t encoded_bytes(std::size_t n) const { return blocks(n) * sizeof(float) + n; }

  // Encodes x[0, n). err (optional) receives x - decode(encoded), the part
  // this encoding dropped. `stream` keys the stochastic-rounding draws of
  // value i as (seed, stream, i).
  void encode(const float* x, std::size_t n, std::uint8_t* out, float* err, std::uint64_t stream) const {
    const std::size_t nb = blocks(n);
    float* scales = reinterpret_cast<float*>(out);
    std::int8_t* q = reinterpret_cast<std::int8_t*>(out + nb * sizeof(float));
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t lo = b * block_, len = std::min<std::size_t>(block_, n - lo);
      const float* xb = x + lo;
      std::uint32_t amax_bits = 0;  // |x| as bits: integer order = float order, NaN/Inf on top
      for (std::size_t i = 0; i < len; ++i) amax_bits = std::max(amax_bits, float_to_bits(xb[i]) & 0x7fffffffu);
      float scale, inv;
      if (amax_bits >= 0x7f800000u) {
        scale = std::numeric_limits<float>::quiet_NaN();
        inv = 0;
      } else {
        const float amax = bits_to_float(amax_bits);
        scale = amax / 127.0f;
        inv = amax > 0 ? 127.0f / amax : 0.0f;
      }
      std::memcpy(scales + b, &scale, sizeof(float));
      std::int8_t* qb = q + lo;
      if (stochastic_) {
        const std::uint64_t base = mix64(seed_ ^ mix64(stream)) + lo;
        for (std::size_t i = 0; i < len; ++i) {
          const float u = static_cast<float>(mix64(base + i) >> 40) * (1.0f / 16777216.0f);  // [0, 1)
          const float r = round_nearest_small(xb[i] * inv + u - 0.5f);
          qb[i] = static_cast<std::int8_t>(static_cast<int>(std::min(127.0f, std::max(-127.0f, r))));
        }
      } else {
        for (std::size_t i = 0; i < len; ++i) {
          const float r = round_nearest_small(xb[i] * inv);
          qb[i] = static_cast<std::int8_t>(static_cast<int>(std::min(127.0f, std::max(-127.0f, r))));
        }
      }
      if (err)
        for (std::size_t i = 0; i < len; ++i) err[lo + i] = xb[i] - static_cast<float>(qb[i]) * scale;
    }
  }

  void decode(const std::uint8_t* in, std::size_t n, float* out) const { decode_impl<false>(in, n, out); }
  void decode_add(const std::uint8_t* in, std::size_t n, float* dst) const { decode_impl<true>(in, n, dst); }

 private:
  std::size_t blocks(std::size_t n) const { return (n + block_ - 1) / block_; }

  template <bool Add>
  void decode_impl(const std::uint8_t* in, std::size_t n, float* out) const {
    const std::size_t nb = blocks(n);
    const std::int8_t* q = reinterpret_cast<const std::int8_t*>(in + nb * sizeof(float));
    for (std::size_t b = 0; b < nb; ++b) {
      float scale;
      std::memcpy(&scale, in + b * sizeof(float), sizeof(float));
      const std::size_t lo = b * block_, len = std::min<std::size_t>(block_, n - lo);
      float* ob = out + lo;
      const std::int8_t* qb = q + lo;
      for (std::size_t i = 0; i < len; ++i) {
        const float v = static_cast<float>(qb[i]) * scale;
        ob[i] = Add ? ob[i] + v : v;
      }
    }
  }

  std::size_t block_;
  bool stochastic_;
  std::uint64_t seed_;
};

// A cast to a 16-bit float: n x uint16 on the wire.
template <float (*ToF)(std::uint16_t), std::uint16_t (*FromF)(float)>
class CastCodec {
 public:
  explicit CastCodec(const CodecSpec&) {}

  std::size_t encoded_bytes(std::size_t n) const { return n * sizeof(std::uint16_t); }

  void encode(const float* x, std::size_t n, std::uint8_t* out, float* err, std::uint64_t) const {
    std::uint16_t* h = reinterpret_cast<std::uint16_t*>(out);
    for (std::size_t i = 0; i < n; ++i) h[i] = FromF(x[i]);
    if (err)
      for (std::size_t i = 0; i < n; ++i) err[i] = x[i] - ToF(h[i]);
  }

  void decode(const std::uint8_t* in, std::size_t n, float* out) const {
    const std::uint16_t* h = reinterpret_cast<const std::uint16_t*>(in);
    for (std::size_t i = 0; i < n; ++i) out[i] = ToF(h[i]);
  }

  void decode_add(const std::uint8_t* in, std::size_t n, float* dst) const {
    const std::uint16_t* h = reinterpret_cast<const std::uint16_t*>(in);
    for (std::size_t i = 0; i < n; ++i) dst[i] += ToF(h[i]);
  }
};

using Fp16Codec = CastCodec<fp16_to_float, float_to_fp16>;
using Bf16Codec = CastCodec<bf16_to_float, float_to_bf16>;

// Which element types a codec accepts (all codecs work on float32 values).
inline Status check_codec_dtype(const CodecSpec& spec, const std::string& text, DType dtype) {
  if (spec.kind == CodecKind::kNone || dtype == DType::kFloat32) return Status::OK();
  return Status::Invalid("compression '" + text + "' needs float32 data, got " + dtype_name(dtype) +
                         (dtype_is_float(dtype) ? " (cast the gradient to float32, or allreduce it uncompressed)"
                                                : " (integer data is never compressed)"));
}

}  // namespace hpcdl
