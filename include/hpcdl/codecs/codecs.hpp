// Gradient codecs: what goes on the wire instead of float32 values, and back.
//
// A codec is named by a canonical text that every rank must agree on (it is
// part of OpDesc; codec_spec.hpp parses it).
//
// Wire formats (little-endian, as the hosts are; one encoded chunk of n values):
//   fp16 / bf16 : n x uint16 (IEEE half / bfloat16, round to nearest even).
//   int8        : ceil(n/block) x float32 scale, then n x int8. Block b covers
//                 values [b*block, (b+1)*block); scale = absmax/127; value =
//                 q * scale. A block holding NaN or +-Inf gets scale NaN: all of
//                 its values decode as NaN (propagated, never hidden). A block
//                 whose absmax is below 2^-100 is quantized at 2^64 times its
//                 size (127/absmax would overflow); its scale may be subnormal.
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
#include <initializer_list>
#include <limits>
#include <string>

#include "hpcdl/codecs/codec_spec.hpp"
#include "hpcdl/util/dtype.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

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

// The codec interface the compressed ring uses (Int8Codec, CastCodec):
//   encode(x, add, n, out, err, stream): encodes v = x + add (add optional);
//       err (optional, may be the same array as add) receives v - decode(out),
//       or 0 where that is not finite (see residual_or_zero).
//   encode_in_place(x, n, out, err, err_scale, stream): encodes x, then x
//       receives decode(out) and err (optional) (x - decode(out)) * err_scale.
//   decode(in, n, out)
//   decode_add(in, n, dst, add, scale): dst = (dst + add + decode(in)) * scale,
//       add optional.
// Each is one pass over memory: the ring fuses error feedback and the final
// scaling into the passes it makes anyway (docs/compression.md).
namespace detail {

// dst = (dst + add + src) * scale over restrict pointers, so the loops vectorize.
template <bool kAdd, bool kScale>
inline void add_values(float* __restrict__ dst, const float* __restrict__ add, const float* __restrict__ src,
                       std::size_t n, float scale) {
  for (std::size_t i = 0; i < n; ++i) {
    float v = kAdd ? dst[i] + add[i] : dst[i];
    v += src[i];
    dst[i] = kScale ? v * scale : v;
  }
}

inline void add_decoded(float* dst, const float* add, const float* src, std::size_t n, float scale) {
  if (add) {
    if (scale != 1.0f)
      add_values<true, true>(dst, add, src, n, scale);
    else
      add_values<true, false>(dst, add, src, n, scale);
  } else {
    if (scale != 1.0f)
      add_values<false, true>(dst, add, src, n, scale);
    else
      add_values<false, false>(dst, add, src, n, scale);
  }
}

// v = x (+ add) into a local block, so later loops read memory nothing else writes.
inline void load_values(const float* __restrict__ x, const float* __restrict__ add, std::size_t n,
                        float* __restrict__ v) {
  if (add) {
    for (std::size_t i = 0; i < n; ++i) v[i] = x[i] + add[i];
  } else {
    std::memcpy(v, x, n * sizeof(float));
  }
}

constexpr std::size_t kCodecPiece = 256;  // values staged on the stack at a time

// err = (v - d) * err_scale, or 0 where that is not finite: a NaN or Inf
// input, or a value the codec cannot hold (fp16 above 65504), reaches this
// step's result through d, but never the residual that every later step adds
// back (error feedback would otherwise turn one overflow into NaN for good).
// The loop only ORs (exponent bits + 1 ulp of exponent), whose bit 31 is set
// by an all-ones exponent (NaN, Inf): integer ops that vectorize with SSE2;
// the fix-up pass runs only for a piece that holds a NaN or Inf.
inline void residual_or_zero(const float* __restrict__ v, const float* __restrict__ d, std::size_t n, float err_scale,
                             float* __restrict__ err) {
  std::uint32_t exponents = 0;
  if (err_scale != 1.0f) {
    for (std::size_t i = 0; i < n; ++i) {
      const float e = (v[i] - d[i]) * err_scale;
      err[i] = e;
      exponents |= (float_to_bits(e) & 0x7f800000u) + 0x00800000u;
    }
  } else {
    for (std::size_t i = 0; i < n; ++i) {
      const float e = v[i] - d[i];
      err[i] = e;
      exponents |= (float_to_bits(e) & 0x7f800000u) + 0x00800000u;
    }
  }
  if (!(exponents & 0x80000000u)) return;
  for (std::size_t i = 0; i < n; ++i)
    if (!std::isfinite(err[i])) err[i] = 0.0f;
}

}  // namespace detail

// Blockwise int8: see the wire format above.
class Int8Codec {
 public:
  explicit Int8Codec(const CodecSpec& spec) : block_(spec.block), stochastic_(spec.stochastic), seed_(spec.seed) {}

  std::size_t encoded_bytes(std::size_t n) const { return blocks(n) * sizeof(float) + n; }

  // `stream` keys the stochastic-rounding draws of value i as (seed, stream, i).
  void encode(const float* x, const float* add, std::size_t n, std::uint8_t* out, float* err,
              std::uint64_t stream) const {
#ifdef HPCDL_X86_DISPATCH
    if (detail::cpu_has_avx2()) return encode_avx2(x, add, n, out, err, 1.0f, nullptr, stream);
#endif
    encode_impl(x, add, n, out, err, 1.0f, nullptr, stream);
  }

  void encode_in_place(float* x, std::size_t n, std::uint8_t* out, float* err, float err_scale,
                       std::uint64_t stream) const {
#ifdef HPCDL_X86_DISPATCH
    if (detail::cpu_has_avx2()) return encode_avx2(x, nullptr, n, out, err, err_scale, x, stream);
#endif
    encode_impl(x, nullptr, n, out, err, err_scale, x, stream);
  }

  void decode(const std::uint8_t* in, std::size_t n, float* out) const {
#ifdef HPCDL_X86_DISPATCH
    if (detail::cpu_has_avx2()) return decode_avx2(in, n, out);
#endif
    decode_impl(in, n, out);
  }

  void decode_add(const std::uint8_t* in, std::size_t n, float* dst, const float* add, float scale) const {
#ifdef HPCDL_X86_DISPATCH
    if (detail::cpu_has_avx2()) return decode_add_avx2(in, n, dst, add, scale);
#endif
    decode_add_impl(in, n, dst, add, scale);
  }

 private:
#ifdef HPCDL_X86_DISPATCH
  // The same kernels, everything inlined and compiled for AVX2 (2x the SSE2 width).
  __attribute__((target("avx2"), flatten)) void encode_avx2(const float* x, const float* add, std::size_t n,
                                                            std::uint8_t* out, float* err, float err_scale,
                                                            float* replace, std::uint64_t stream) const {
    encode_impl(x, add, n, out, err, err_scale, replace, stream);
  }
  __attribute__((target("avx2"), flatten)) void decode_avx2(const std::uint8_t* in, std::size_t n, float* out) const {
    decode_impl(in, n, out);
  }
  __attribute__((target("avx2"), flatten)) void decode_add_avx2(const std::uint8_t* in, std::size_t n, float* dst,
                                                                const float* add, float scale) const {
    decode_add_impl(in, n, dst, add, scale);
  }
#endif

  void decode_impl(const std::uint8_t* in, std::size_t n, float* out) const {
    const std::size_t nb = blocks(n);
    const std::int8_t* q = reinterpret_cast<const std::int8_t*>(in + nb * sizeof(float));
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t lo = b * block_, len = std::min<std::size_t>(block_, n - lo);
      dequantize(q + lo, len, block_scale(in, b), out + lo);
    }
  }

  void decode_add_impl(const std::uint8_t* in, std::size_t n, float* dst, const float* add, float scale) const {
    const std::size_t nb = blocks(n);
    const std::int8_t* q = reinterpret_cast<const std::int8_t*>(in + nb * sizeof(float));
    float v[detail::kCodecPiece];
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t lo = b * block_, len = std::min<std::size_t>(block_, n - lo);
      const float s = block_scale(in, b);
      for (std::size_t p = 0; p < len; p += detail::kCodecPiece) {
        const std::size_t m = std::min(detail::kCodecPiece, len - p), at = lo + p;
        dequantize(q + at, m, s, v);
        detail::add_decoded(dst + at, add ? add + at : nullptr, v, m, scale);
      }
    }
  }

  std::size_t blocks(std::size_t n) const { return (n + block_ - 1) / block_; }

  static float block_scale(const std::uint8_t* in, std::size_t b) {
    float scale;
    std::memcpy(&scale, in + b * sizeof(float), sizeof(float));
    return scale;
  }

  static void dequantize(const std::int8_t* __restrict__ q, std::size_t n, float scale, float* __restrict__ out) {
    for (std::size_t i = 0; i < n; ++i) out[i] = static_cast<float>(q[i]) * scale;
  }

  // |v| as bits: integer order = float order, NaN/Inf on top.
  static std::uint32_t absmax_bits(const float* __restrict__ x, const float* __restrict__ add, std::size_t n) {
    std::uint32_t m = 0;
    if (add) {
      for (std::size_t i = 0; i < n; ++i) m = std::max(m, float_to_bits(x[i] + add[i]) & 0x7fffffffu);
    } else {
      for (std::size_t i = 0; i < n; ++i) m = std::max(m, float_to_bits(x[i]) & 0x7fffffffu);
    }
    return m;
  }

  // q[0, n) = v[0, n) * inv rounded (values lo.. of the chunk).
  void quantize(const float* __restrict__ v, std::size_t n, std::size_t lo, float inv, std::uint64_t base,
                std::int8_t* __restrict__ q) const {
    if (stochastic_) {
      for (std::size_t i = 0; i < n; ++i) {
        const float u = static_cast<float>(mix64(base + lo + i) >> 40) * (1.0f / 16777216.0f);  // [0, 1)
        const float r = round_nearest_small(v[i] * inv + u - 0.5f);
        q[i] = static_cast<std::int8_t>(static_cast<int>(std::min(127.0f, std::max(-127.0f, r))));
      }
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        const float r = round_nearest_small(v[i] * inv);
        q[i] = static_cast<std::int8_t>(static_cast<int>(std::min(127.0f, std::max(-127.0f, r))));
      }
    }
  }

  // err = (v - q * unit) * err_scale; unit is the scale in v's units.
  static void quantization_error(const float* __restrict__ v, const std::int8_t* __restrict__ q, std::size_t n,
                                 float unit, float err_scale, float* __restrict__ err) {
    if (err_scale != 1.0f) {
      for (std::size_t i = 0; i < n; ++i) err[i] = (v[i] - static_cast<float>(q[i]) * unit) * err_scale;
    } else {
      for (std::size_t i = 0; i < n; ++i) err[i] = v[i] - static_cast<float>(q[i]) * unit;
    }
  }

  // A block below this absmax (2^-100) is staged at 2^64 times its values,
  // so 127/absmax stays finite (it overflows below ~3.7e-37) and zeros stay zeros.
  static constexpr std::uint32_t kTinyAbsmaxBits = 27u << 23;
  static constexpr float kTinyShift = 18446744073709551616.0f;  // 2^64

  void encode_impl(const float* x, const float* add, std::size_t n, std::uint8_t* out, float* err, float err_scale,
                   float* replace, std::uint64_t stream) const {
    const std::size_t nb = blocks(n);
    float* scales = reinterpret_cast<float*>(out);
    std::int8_t* q = reinterpret_cast<std::int8_t*>(out + nb * sizeof(float));
    const std::uint64_t base = stochastic_ ? mix64(seed_ ^ mix64(stream)) : 0;
    float v[detail::kCodecPiece];
    for (std::size_t b = 0; b < nb; ++b) {
      const std::size_t lo = b * block_, len = std::min<std::size_t>(block_, n - lo);
      const std::uint32_t amax_bits = absmax_bits(x + lo, add ? add + lo : nullptr, len);
      const bool finite = amax_bits < 0x7f800000u, tiny = amax_bits < kTinyAbsmaxBits;
      const float amax = bits_to_float(amax_bits), shift = tiny ? kTinyShift : 1.0f;
      // scale: what decode multiplies by; inv and scale * shift: the same in the staged values' units.
      const float scale = finite ? amax / 127.0f : std::numeric_limits<float>::quiet_NaN();
      const float inv = finite && amax > 0 ? 127.0f / (amax * shift) : 0.0f;
      // |error| <= scale (stochastic rounding; half that for nearest), so this
      // bounds every err of the block; it fails for a NaN scale. Such a block
      // decodes as NaN and leaves a zero residual (detail::residual_or_zero).
      const bool residual_finite = std::isfinite(2.0f * scale * err_scale);
      std::memcpy(scales + b, &scale, sizeof(float));
      // The block again, a piece at a time (it is in cache): stage v, then quantize.
      for (std::size_t p = 0; p < len; p += detail::kCodecPiece) {
        const std::size_t m = std::min(detail::kCodecPiece, len - p), at = lo + p;
        detail::load_values(x + at, add ? add + at : nullptr, m, v);
        if (tiny)
          for (std::size_t i = 0; i < m; ++i) v[i] *= shift;
        quantize(v, m, at, inv, base, q + at);
        if (err && residual_finite) quantization_error(v, q + at, m, scale * shift, err_scale / shift, err + at);
        if (err && !residual_finite) std::memset(err + at, 0, m * sizeof(float));
        if (replace) dequantize(q + at, m, scale, replace + at);
      }
    }
  }

  std::size_t block_;
  bool stochastic_;
  std::uint64_t seed_;
};

// A cast to a 16-bit float: n x uint16 on the wire. ToHalf/ToFloat convert
// arrays (fp16 uses the CPU's F16C instructions where it has them).
template <void (*ToHalf)(const float*, std::size_t, std::uint16_t*),
          void (*ToFloat)(const std::uint16_t*, std::size_t, float*)>
class CastCodec {
 public:
  explicit CastCodec(const CodecSpec&) {}

  std::size_t encoded_bytes(std::size_t n) const { return n * sizeof(std::uint16_t); }

  void encode(const float* x, const float* add, std::size_t n, std::uint8_t* out, float* err, std::uint64_t) const {
    encode_impl(x, add, n, out, err, 1.0f, nullptr);
  }

  void encode_in_place(float* x, std::size_t n, std::uint8_t* out, float* err, float err_scale, std::uint64_t) const {
    encode_impl(x, nullptr, n, out, err, err_scale, x);
  }

  void decode(const std::uint8_t* in, std::size_t n, float* out) const {
    ToFloat(reinterpret_cast<const std::uint16_t*>(in), n, out);
  }

  void decode_add(const std::uint8_t* in, std::size_t n, float* dst, const float* add, float scale) const {
    const std::uint16_t* h = reinterpret_cast<const std::uint16_t*>(in);
    float d[detail::kCodecPiece];
    for (std::size_t p = 0; p < n; p += detail::kCodecPiece) {
      const std::size_t m = std::min(detail::kCodecPiece, n - p);
      ToFloat(h + p, m, d);
      detail::add_decoded(dst + p, add ? add + p : nullptr, d, m, scale);
    }
  }

 private:
  void encode_impl(const float* x, const float* add, std::size_t n, std::uint8_t* out, float* err, float err_scale,
                   float* replace) const {
    std::uint16_t* h = reinterpret_cast<std::uint16_t*>(out);
    float v[detail::kCodecPiece], d[detail::kCodecPiece];
    for (std::size_t p = 0; p < n; p += detail::kCodecPiece) {
      const std::size_t m = std::min(detail::kCodecPiece, n - p);
      detail::load_values(x + p, add ? add + p : nullptr, m, v);
      ToHalf(v, m, h + p);
      if (!err && !replace) continue;
      ToFloat(h + p, m, d);
      if (err) detail::residual_or_zero(v, d, m, err_scale, err + p);
      if (replace) std::memcpy(replace + p, d, m * sizeof(float));
    }
  }
};

using Fp16Codec = CastCodec<floats_to_fp16, fp16s_to_floats>;
using Bf16Codec = CastCodec<floats_to_bf16, bf16s_to_floats>;

}  // namespace hpcdl
