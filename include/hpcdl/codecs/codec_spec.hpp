// A codec's settings as every rank agrees on them: the canonical text
// ("fp16", "bf16", "int8(block=256)", "int8(block=256,rounding=stochastic,seed=7)",
// "topk(ratio=0.01)", "topk(ratio=0.01,algorithm=split)",
// "topk(ratio=0.01,reuse_steps=20)"; empty = none),
// parsed and checked once here. No kernels: the engine's public header and
// hpcdl.compression need only this (the kernels are in codecs.hpp).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <initializer_list>
#include <string>

#include "hpcdl/util/dtype.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

// Int8's values per scale unless the text says otherwise (hpcdl.compression.Int8).
constexpr std::uint32_t kDefaultInt8Block = 256;

enum class CodecKind : int { kNone = 0, kFp16 = 1, kBf16 = 2, kInt8 = 3, kTopK = 4 };

// How top-k is reduced (include/hpcdl/algorithms/sparse_allreduce.hpp): auto weighs bytes received and rounds.
enum class TopkAlgorithm : int { kAuto = 0, kAllgather = 1, kSplit = 2 };

// Top-k's threshold reuse (topk.hpp, TopkThreshold): at most this many calls per exact selection.
constexpr std::uint32_t kMaxTopkReuseSteps = 1000000;

struct CodecSpec {
  CodecKind kind = CodecKind::kNone;
  std::uint32_t block = kDefaultInt8Block;              // int8: values per scale
  bool stochastic = false;                              // int8: stochastic rounding instead of nearest
  std::uint64_t seed = 0;                               // int8 stochastic: RNG seed
  double ratio = 0;                                     // topk: fraction of values kept
  TopkAlgorithm topk_algorithm = TopkAlgorithm::kAuto;  // topk: allgather, split, or auto
  std::uint32_t topk_reuse_steps = 0;                   // topk: calls reusing an exact selection's threshold
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

// The first "key=value" field of args whose key is not one of `keys` (or that
// has no '=', or repeats a key); empty when every field is known.
inline std::string unknown_codec_field(const std::string& args, std::initializer_list<const char*> keys) {
  std::string seen = ",";
  std::size_t pos = 0;
  while (pos <= args.size()) {
    std::size_t end = args.find(',', pos);
    if (end == std::string::npos) end = args.size();
    const std::string item = args.substr(pos, end - pos);
    const std::string key = item.substr(0, item.find('='));
    bool known = key.size() < item.size() && seen.find("," + key + ",") == std::string::npos;
    if (known) known = std::any_of(keys.begin(), keys.end(), [&](const char* k) { return key == k; });
    if (!known) return item.empty() ? std::string("(empty)") : item;
    seen += key + ",";
    pos = end + 1;
  }
  return "";
}

inline bool parse_uint(const std::string& s, std::uint64_t* out) {
  if (s.empty() || s.find_first_not_of("0123456789") != std::string::npos || s.size() > 19) return false;
  *out = std::strtoull(s.c_str(), nullptr, 10);
  return true;
}

}  // namespace detail

// Names as the canonical text and hpcdl.compression spell them.
inline const char* codec_name(CodecKind kind) {
  static const char* const names[] = {"none", "fp16", "bf16", "int8", "topk"};
  return names[static_cast<int>(kind)];
}

inline const char* topk_algorithm_name(TopkAlgorithm algorithm) {
  static const char* const names[] = {"auto", "allgather", "split"};
  return names[static_cast<int>(algorithm)];
}

// Parses a canonical codec text (see the top of this file): the one check of
// every codec setting (hpcdl.compression's codecs are checked here too).
inline Status parse_codec(const std::string& text, CodecSpec* out) {
  *out = CodecSpec();
  if (text.empty()) return Status::OK();
  if (text == "fp16") {
    out->kind = CodecKind::kFp16;
    return Status::OK();
  }
  if (text == "bf16") {
    out->kind = CodecKind::kBf16;
    return Status::OK();
  }
  const std::size_t open = text.find('(');
  if (open == std::string::npos || text.back() != ')') return Status::Invalid("unknown compression '" + text + "'");
  const std::string name = text.substr(0, open), args = text.substr(open + 1, text.size() - open - 2);
  std::string v;
  const std::string unknown = name == "int8" ? detail::unknown_codec_field(args, {"block", "rounding", "seed"})
                              : name == "topk"
                                  ? detail::unknown_codec_field(args, {"ratio", "algorithm", "reuse_steps"})
                                  : "";
  if (!unknown.empty()) return Status::Invalid("compression '" + text + "': unknown or repeated setting " + unknown);
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
      if (!detail::parse_uint(v, &seed) || seed >= (std::uint64_t(1) << 63))
        return Status::Invalid("compression '" + text + "': seed must be an integer in [0, 2^63)");
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
    if (detail::codec_field(args, "algorithm", &v)) {
      if (v != "allgather" && v != "split")
        return Status::Invalid("compression '" + text + "': algorithm must be allgather or split (auto: leave it out)");
      out->topk_algorithm = v == "split" ? TopkAlgorithm::kSplit : TopkAlgorithm::kAllgather;
    }
    if (detail::codec_field(args, "reuse_steps", &v)) {
      std::uint64_t steps = 0;
      if (!detail::parse_uint(v, &steps) || steps > kMaxTopkReuseSteps)
        return Status::Invalid("compression '" + text + "': reuse_steps must be an integer in [0, " +
                               std::to_string(kMaxTopkReuseSteps) + "]");
      out->topk_reuse_steps = static_cast<std::uint32_t>(steps);
    }
    return Status::OK();
  }
  return Status::Invalid("unknown compression '" + text + "'");
}

// Which element types a codec accepts (all codecs work on float32 values).
inline Status check_codec_dtype(const CodecSpec& spec, const std::string& text, DType dtype) {
  if (spec.kind == CodecKind::kNone || dtype == DType::kFloat32) return Status::OK();
  return Status::Invalid("compression '" + text + "' needs float32 data, got " + dtype_name(dtype) +
                         (dtype_is_float(dtype) ? " (cast the gradient to float32, or allreduce it uncompressed)"
                                                : " (integer data is never compressed)"));
}

}  // namespace hpcdl
