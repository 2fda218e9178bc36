// CRC32C (Castagnoli), the checksum of every sample in the store. Uses the
// SSE4.2 crc32 instruction when the CPU has it (checked once at run time),
// else a slicing-by-8 table; both give identical results.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace hpcdl {

namespace crc32c_detail {

constexpr std::uint32_t kPolyReflected = 0x82F63B78u;

struct Tables {
  std::uint32_t t[8][256];
};

inline const Tables& tables() {
  static const Tables tabs = [] {
    Tables tb{};
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kPolyReflected : c >> 1;
      tb.t[0][i] = c;
    }
    for (std::uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) tb.t[s][i] = (tb.t[s - 1][i] >> 8) ^ tb.t[0][tb.t[s - 1][i] & 0xFF];
    return tb;
  }();
  return tabs;
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HPCDL_CRC32C_HAVE_HW 1
__attribute__((target("sse4.2"))) inline std::uint32_t update_hw(std::uint32_t crc, const unsigned char* p,
                                                                 std::size_t n) {
  std::uint64_t c = crc;
  while (n >= 8) {
    std::uint64_t word;
    std::memcpy(&word, p, 8);
    c = __builtin_ia32_crc32di(c, word);
    p += 8;
    n -= 8;
  }
  std::uint32_t c32 = static_cast<std::uint32_t>(c);
  while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
  return c32;
}
#endif

inline std::uint32_t update_sw(std::uint32_t crc, const unsigned char* p, std::size_t n) {
  const Tables& tb = tables();
  while (n >= 8) {
    std::uint32_t lo, hi;
    std::memcpy(&lo, p, 4);  // little-endian hosts only (x86_64, aarch64)
    std::memcpy(&hi, p + 4, 4);
    lo ^= crc;
    crc = tb.t[7][lo & 0xFF] ^ tb.t[6][(lo >> 8) & 0xFF] ^ tb.t[5][(lo >> 16) & 0xFF] ^ tb.t[4][lo >> 24] ^
          tb.t[3][hi & 0xFF] ^ tb.t[2][(hi >> 8) & 0xFF] ^ tb.t[1][(hi >> 16) & 0xFF] ^ tb.t[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n--) crc = (crc >> 8) ^ tb.t[0][(crc ^ *p++) & 0xFF];
  return crc;
}

}  // namespace crc32c_detail

// True when crc32c() runs on the SSE4.2 instruction.
inline bool crc32c_hardware_available() {
#ifdef HPCDL_CRC32C_HAVE_HW
  static const bool has = __builtin_cpu_supports("sse4.2");
  return has;
#else
  return false;
#endif
}

// Table-driven CRC32C; `crc` continues a previous result (0 to start).
inline std::uint32_t crc32c_software(const void* data, std::size_t n, std::uint32_t crc = 0) {
  return ~crc32c_detail::update_sw(~crc, static_cast<const unsigned char*>(data), n);
}

// CRC32C of n bytes; `crc` continues a previous result (0 to start).
inline std::uint32_t crc32c(const void* data, std::size_t n, std::uint32_t crc = 0) {
#ifdef HPCDL_CRC32C_HAVE_HW
  if (crc32c_hardware_available()) return ~crc32c_detail::update_hw(~crc, static_cast<const unsigned char*>(data), n);
#endif
  return crc32c_software(data, n, crc);
}

}  // namespace hpcdl
