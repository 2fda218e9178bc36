// Element types the collectives understand, and the reduction kernels over them.
// 16-bit floats are widened to fp32 for arithmetic and rounded once per hop.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hpcdl {

enum class DType : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3, kInt32 = 4, kInt64 = 5 };

enum class ReduceOp : int { kSum = 0, kAverage = 1 };

inline std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 0;
}

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "float32";
    case DType::kFloat64: return "float64";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
  }
  return "?";
}

inline bool dtype_is_float(DType t) { return t != DType::kInt32 && t != DType::kInt64; }

inline bool dtype_valid(int t) { return t >= 0 && t <= 5; }

// ---- 16-bit float conversions (round to nearest even; NaN stays NaN) ----

inline float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline std::uint32_t float_to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(std::uint16_t h) { return bits_to_float(static_cast<std::uint32_t>(h) << 16); }

inline std::uint16_t float_to_bf16(float f) {
  std::uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<std::uint16_t>(u >> 16);
}

inline float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: man * 2^-24
    float v = std::ldexp(static_cast<float>(man), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (man << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

inline std::uint16_t float_to_fp16(float f) {
  const std::uint32_t u = float_to_bits(f);
  const std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  const std::uint32_t abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;   // NaN
  if (abs >= 0x477ff000u) return sign | 0x7c00u;  // overflow (>= 65520 rounds to inf) or inf
  if (abs < 0x38800000u) {                        // below fp16's smallest normal: subnormal or zero
    // value * 2^24 rounded to nearest even gives the subnormal mantissa
    float scaled = bits_to_float(abs) * 16777216.0f;
    return sign | static_cast<std::uint16_t>(std::nearbyint(scaled));
  }
  std::uint32_t rounded = abs + 0x0fffu + ((abs >> 13) & 1u);
  return sign | static_cast<std::uint16_t>((rounded - 0x38000000u) >> 13);
}

// ---- array conversions (the codecs' inner loops) ----
//
// fp16 on x86-64 uses F16C (vcvtps2ph / vcvtph2ps, round to nearest even)
// when the CPU has it, checked once at run time, so a wheel built for
// baseline x86-64 still runs everywhere. Both paths give the same bits for
// every non-NaN value; a NaN stays a NaN (its payload may differ).

namespace detail {

inline void floats_to_fp16_scalar(const float* x, std::size_t n, std::uint16_t* h) {
  for (std::size_t i = 0; i < n; ++i) h[i] = float_to_fp16(x[i]);
}

inline void fp16s_to_floats_scalar(const std::uint16_t* h, std::size_t n, float* x) {
  for (std::size_t i = 0; i < n; ++i) x[i] = fp16_to_float(h[i]);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HPCDL_X86_DISPATCH 1  // x86-64 with GCC or clang: F16C and AVX2 kernels, chosen at run time
__attribute__((target("avx,f16c"))) inline void floats_to_fp16_f16c(const float* x, std::size_t n, std::uint16_t* h) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i half = _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), half);
  }
  floats_to_fp16_scalar(x + i, n - i, h + i);
}

__attribute__((target("avx,f16c"))) inline void fp16s_to_floats_f16c(const std::uint16_t* h, std::size_t n, float* x) {
  std::size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(x + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
  fp16s_to_floats_scalar(h + i, n - i, x + i);
}

inline bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has;
}

// For kernels compiled a second time for AVX2 (target attribute + flatten):
// the same IEEE operations at twice the width, so the same bits (no FMA).
inline bool cpu_has_avx2() {
  static const bool has = __builtin_cpu_supports("avx2");
  return has;
}
#endif

}  // namespace detail

inline void floats_to_fp16(const float* x, std::size_t n, std::uint16_t* h) {
#ifdef HPCDL_X86_DISPATCH
  if (detail::cpu_has_f16c()) return detail::floats_to_fp16_f16c(x, n, h);
#endif
  detail::floats_to_fp16_scalar(x, n, h);
}

inline void fp16s_to_floats(const std::uint16_t* h, std::size_t n, float* x) {
#ifdef HPCDL_X86_DISPATCH
  if (detail::cpu_has_f16c()) return detail::fp16s_to_floats_f16c(h, n, x);
#endif
  detail::fp16s_to_floats_scalar(h, n, x);
}

inline void floats_to_bf16(const float* x, std::size_t n, std::uint16_t* h) {
  for (std::size_t i = 0; i < n; ++i) h[i] = float_to_bf16(x[i]);
}

inline void bf16s_to_floats(const std::uint16_t* h, std::size_t n, float* x) {
  for (std::size_t i = 0; i < n; ++i) x[i] = bf16_to_float(h[i]);
}

// ---- reduction kernels: dst = (dst + src) * scale ----

namespace detail {

template <typename T, typename Acc>
inline void sum_scale(T* dst, const T* src, std::size_t n, Acc scale) {
  if (scale == Acc(1)) {
    for (std::size_t i = 0; i < n; ++i) dst[i] = dst[i] + src[i];
  } else {
    for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<T>((static_cast<Acc>(dst[i]) + src[i]) * scale);
  }
}

// Integer sums wrap modulo 2^bits (two's complement), as MPI_SUM does in
// practice: added as unsigned, since signed overflow is undefined behaviour.
template <typename T>
inline void sum_wrapping(T* dst, const T* src, std::size_t n) {
  using U = std::make_unsigned_t<T>;
  for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<U>(dst[i]) + static_cast<U>(src[i]));
}

template <float (*ToF)(std::uint16_t), std::uint16_t (*FromF)(float)>
inline void sum_scale_half(std::uint16_t* dst, const std::uint16_t* src, std::size_t n, float scale) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = FromF((ToF(dst[i]) + ToF(src[i])) * scale);
}

template <typename T, typename Acc>
inline void scale_in_place(T* dst, std::size_t n, Acc scale) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = static_cast<T>(static_cast<Acc>(dst[i]) * scale);
}

template <float (*ToF)(std::uint16_t), std::uint16_t (*FromF)(float)>
inline void scale_half(std::uint16_t* dst, std::size_t n, float scale) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = FromF(ToF(dst[i]) * scale);
}

}  // namespace detail

// dst[i] = (dst[i] + src[i]) * scale, computed in the type's accumulator
// (fp32 for 16-bit floats). Integer types only ever get scale == 1, and wrap
// on overflow (detail::sum_wrapping).
inline void reduce_sum_scale(DType t, void* dst, const void* src, std::size_t n, double scale) {
  switch (t) {
    case DType::kFloat32:
      detail::sum_scale(static_cast<float*>(dst), static_cast<const float*>(src), n, static_cast<float>(scale));
      break;
    case DType::kFloat64:
      detail::sum_scale(static_cast<double*>(dst), static_cast<const double*>(src), n, scale);
      break;
    case DType::kFloat16:
      detail::sum_scale_half<fp16_to_float, float_to_fp16>(
          static_cast<std::uint16_t*>(dst), static_cast<const std::uint16_t*>(src), n, static_cast<float>(scale));
      break;
    case DType::kBFloat16:
      detail::sum_scale_half<bf16_to_float, float_to_bf16>(
          static_cast<std::uint16_t*>(dst), static_cast<const std::uint16_t*>(src), n, static_cast<float>(scale));
      break;
    case DType::kInt32:
      detail::sum_wrapping(static_cast<std::int32_t*>(dst), static_cast<const std::int32_t*>(src), n);
      break;
    case DType::kInt64:
      detail::sum_wrapping(static_cast<std::int64_t*>(dst), static_cast<const std::int64_t*>(src), n);
      break;
  }
}

// dst[i] *= scale (used when a single rank "averages" over itself).
inline void scale_buffer(DType t, void* dst, std::size_t n, double scale) {
  if (scale == 1.0) return;
  switch (t) {
    case DType::kFloat32: detail::scale_in_place(static_cast<float*>(dst), n, static_cast<float>(scale)); break;
    case DType::kFloat64: detail::scale_in_place(static_cast<double*>(dst), n, scale); break;
    case DType::kFloat16:
      detail::scale_half<fp16_to_float, float_to_fp16>(static_cast<std::uint16_t*>(dst), n, static_cast<float>(scale));
      break;
    case DType::kBFloat16:
      detail::scale_half<bf16_to_float, float_to_bf16>(static_cast<std::uint16_t*>(dst), n, static_cast<float>(scale));
      break;
    case DType::kInt32:
    case DType::kInt64: break;
  }
}

}  // namespace hpcdl
