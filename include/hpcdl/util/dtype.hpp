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

// Codes travel in operation descriptions and are the Python layer's DTYPES:
// new types take the next code.
enum class DType : int {
  kFloat32 = 0,
  kFloat64 = 1,
  kFloat16 = 2,
  kBFloat16 = 3,
  kInt32 = 4,
  kInt64 = 5,
  kBool = 6,
  kUInt8 = 7,
  kInt8 = 8,
  kInt16 = 9,
  kUInt16 = 10,
  kUInt32 = 11,
  kUInt64 = 12,
};

constexpr int kDTypeCount = 13;

// Sum and average are what the codecs and top-k reduce (partial sums); min,
// max and product are exact (floats: NaN wins) and run the dense ring only.
enum class ReduceOp : int { kSum = 0, kAverage = 1, kMin = 2, kMax = 3, kProduct = 4 };

constexpr int kReduceOpCount = 5;

inline bool reduce_op_valid(int op) { return op >= 0 && op < kReduceOpCount; }

inline const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kAverage: return "average";
    case ReduceOp::kMin: return "min";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kProduct: return "product";
  }
  return "?";
}

inline std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::kFloat32: return 4;
    case DType::kFloat64: return 8;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kInt32: return 4;
    case DType::kInt64: return 8;
    case DType::kBool: return 1;
    case DType::kUInt8: return 1;
    case DType::kInt8: return 1;
    case DType::kInt16: return 2;
    case DType::kUInt16: return 2;
    case DType::kUInt32: return 4;
    case DType::kUInt64: return 8;
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
    case DType::kBool: return "bool";
    case DType::kUInt8: return "uint8";
    case DType::kInt8: return "int8";
    case DType::kInt16: return "int16";
    case DType::kUInt16: return "uint16";
    case DType::kUInt32: return "uint32";
    case DType::kUInt64: return "uint64";
  }
  return "?";
}

inline bool dtype_is_float(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat64 || t == DType::kFloat16 || t == DType::kBFloat16;
}

inline bool dtype_valid(int t) { return t >= 0 && t < kDTypeCount; }

// Whether an allreduce may combine values of type t with op: bool (0 or 1)
// has min (and), max (or) and product (and), no sum. Broadcast takes every type.
inline bool dtype_reduces(DType t, ReduceOp op) {
  return t != DType::kBool || (op != ReduceOp::kSum && op != ReduceOp::kAverage);
}

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

// ---- reduction kernels: dst = op(dst, src) ----

namespace detail {

// Floats (and 16-bit floats widened to fp32): NaN wins min and max, as in numpy.
template <typename A>
inline A min_nan(A a, A b) {
  return (a != a || a < b) ? a : b;
}

template <typename A>
inline A max_nan(A a, A b) {
  return (a != a || a > b) ? a : b;
}

// Integer sums and products wrap modulo 2^bits (two's complement), as MPI_SUM
// and MPI_PROD do in practice: computed unsigned, since signed overflow is
// undefined behaviour (and narrow types would be promoted to int).
template <typename T>
inline T wrapping_add(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(static_cast<std::uint64_t>(static_cast<U>(a)) + static_cast<U>(b)));
}

template <typename T>
inline T wrapping_mul(T a, T b) {
  using U = std::make_unsigned_t<T>;
  return static_cast<T>(static_cast<U>(static_cast<std::uint64_t>(static_cast<U>(a)) * static_cast<U>(b)));
}

// Python's a // b for b > 0 (rounds toward minus infinity).
template <typename T>
inline T floor_div(T a, T b) {
  T q = a / b;
  if constexpr (std::is_signed_v<T>) {
    if (q * b != a && a < 0) --q;
  }
  return q;
}

template <typename T, typename F>
inline void combine(T* dst, const T* src, std::size_t n, F f) {
  for (std::size_t i = 0; i < n; ++i) dst[i] = f(dst[i], src[i]);
}

// The average's last step divides by `ranks` (floored): Horovod's torch API
// floor-divides integer averages too.
template <typename T>
inline void reduce_integer(ReduceOp op, T* dst, const T* src, std::size_t n, int ranks) {
  switch (op) {
    case ReduceOp::kSum: combine(dst, src, n, wrapping_add<T>); break;
    case ReduceOp::kAverage: {
      // in 64 bits: `ranks` may not fit T (int8 over 200 ranks)
      using W = std::conditional_t<std::is_signed_v<T>, std::int64_t, std::uint64_t>;
      const W divisor = static_cast<W>(ranks);
      combine(dst, src, n, [divisor](T a, T b) { return static_cast<T>(floor_div<W>(wrapping_add(a, b), divisor)); });
      break;
    }
    case ReduceOp::kMin: combine(dst, src, n, [](T a, T b) { return b < a ? b : a; }); break;
    case ReduceOp::kMax: combine(dst, src, n, [](T a, T b) { return b > a ? b : a; }); break;
    case ReduceOp::kProduct: combine(dst, src, n, wrapping_mul<T>); break;
  }
}

// float and double in their own type; the average multiplies by 1/ranks,
// rounded once (the same bits as ever for sum and average).
template <typename T>
inline void reduce_float(ReduceOp op, T* dst, const T* src, std::size_t n, int ranks) {
  switch (op) {
    case ReduceOp::kSum: combine(dst, src, n, [](T a, T b) { return a + b; }); break;
    case ReduceOp::kAverage: {
      const T scale = static_cast<T>(1.0 / ranks);
      if (ranks == 1) {
        combine(dst, src, n, [](T a, T b) { return a + b; });
      } else {
        combine(dst, src, n, [scale](T a, T b) { return (a + b) * scale; });
      }
      break;
    }
    case ReduceOp::kMin: combine(dst, src, n, min_nan<T>); break;
    case ReduceOp::kMax: combine(dst, src, n, max_nan<T>); break;
    case ReduceOp::kProduct: combine(dst, src, n, [](T a, T b) { return a * b; }); break;
  }
}

// 16-bit floats: computed in fp32, rounded once per hop.
template <float (*ToF)(std::uint16_t), std::uint16_t (*FromF)(float)>
inline void reduce_half(ReduceOp op, std::uint16_t* dst, const std::uint16_t* src, std::size_t n, int ranks) {
  auto in_fp32 = [&](auto f) {
    combine(dst, src, n, [f](std::uint16_t a, std::uint16_t b) { return FromF(f(ToF(a), ToF(b))); });
  };
  switch (op) {
    case ReduceOp::kSum: in_fp32([](float a, float b) { return a + b; }); break;
    case ReduceOp::kAverage: {
      const float scale = static_cast<float>(1.0 / ranks);
      in_fp32([scale](float a, float b) { return (a + b) * scale; });
      break;
    }
    case ReduceOp::kMin: in_fp32(min_nan<float>); break;
    case ReduceOp::kMax: in_fp32(max_nan<float>); break;
    case ReduceOp::kProduct: in_fp32([](float a, float b) { return a * b; }); break;
  }
}

}  // namespace detail

// dst[i] = op(dst[i], src[i]) in the type's arithmetic. `ranks` is the
// average's divisor, passed only to the last reduction of each element (1
// elsewhere): floats are scaled by 1/ranks there, integers floor-divided.
// Bool is reduced as its bytes 0 and 1 (min: and, max: or, product: and).
inline void reduce_into(DType t, ReduceOp op, void* dst, const void* src, std::size_t n, int ranks) {
  switch (t) {
    case DType::kFloat32:
      detail::reduce_float(op, static_cast<float*>(dst), static_cast<const float*>(src), n, ranks);
      break;
    case DType::kFloat64:
      detail::reduce_float(op, static_cast<double*>(dst), static_cast<const double*>(src), n, ranks);
      break;
    case DType::kFloat16:
      detail::reduce_half<fp16_to_float, float_to_fp16>(op, static_cast<std::uint16_t*>(dst),
                                                        static_cast<const std::uint16_t*>(src), n, ranks);
      break;
    case DType::kBFloat16:
      detail::reduce_half<bf16_to_float, float_to_bf16>(op, static_cast<std::uint16_t*>(dst),
                                                        static_cast<const std::uint16_t*>(src), n, ranks);
      break;
    case DType::kInt32:
      detail::reduce_integer(op, static_cast<std::int32_t*>(dst), static_cast<const std::int32_t*>(src), n, ranks);
      break;
    case DType::kInt64:
      detail::reduce_integer(op, static_cast<std::int64_t*>(dst), static_cast<const std::int64_t*>(src), n, ranks);
      break;
    case DType::kBool:
    case DType::kUInt8:
      detail::reduce_integer(op, static_cast<std::uint8_t*>(dst), static_cast<const std::uint8_t*>(src), n, ranks);
      break;
    case DType::kInt8:
      detail::reduce_integer(op, static_cast<std::int8_t*>(dst), static_cast<const std::int8_t*>(src), n, ranks);
      break;
    case DType::kInt16:
      detail::reduce_integer(op, static_cast<std::int16_t*>(dst), static_cast<const std::int16_t*>(src), n, ranks);
      break;
    case DType::kUInt16:
      detail::reduce_integer(op, static_cast<std::uint16_t*>(dst), static_cast<const std::uint16_t*>(src), n, ranks);
      break;
    case DType::kUInt32:
      detail::reduce_integer(op, static_cast<std::uint32_t*>(dst), static_cast<const std::uint32_t*>(src), n, ranks);
      break;
    case DType::kUInt64:
      detail::reduce_integer(op, static_cast<std::uint64_t*>(dst), static_cast<const std::uint64_t*>(src), n, ranks);
      break;
  }
}

}  // namespace hpcdl
