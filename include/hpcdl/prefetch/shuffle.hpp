// The one shuffle of hpcdl: epoch e's sample order is a Fisher-Yates shuffle
// driven by Philox4x32-10 (Salmon et al., SC'11), a counter-based generator, so
// draw k of epoch e is a pure function of (seed, e, k). Specified exactly in
// docs/prefetch.md so any language can reproduce it; Python calls this code.
#pragma once

#include <array>
#include <cstdint>
#include <numeric>
#include <utility>

namespace hpcdl {

// Philox4x32 with 10 rounds: counter (4 words) and key (2 words) -> 4 words.
inline std::array<std::uint32_t, 4> philox4x32_10(std::array<std::uint32_t, 4> ctr, std::array<std::uint32_t, 2> key) {
  constexpr std::uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  constexpr std::uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;
  for (int round = 0; round < 10; ++round) {
    if (round > 0) {
      key[0] += kW0;
      key[1] += kW1;
    }
    const std::uint64_t p0 = static_cast<std::uint64_t>(kM0) * ctr[0];
    const std::uint64_t p1 = static_cast<std::uint64_t>(kM1) * ctr[2];
    const std::uint32_t hi0 = static_cast<std::uint32_t>(p0 >> 32), lo0 = static_cast<std::uint32_t>(p0);
    const std::uint32_t hi1 = static_cast<std::uint32_t>(p1 >> 32), lo1 = static_cast<std::uint32_t>(p1);
    ctr = {hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0};
  }
  return ctr;
}

// Draw k (a 64-bit word) of epoch `epoch` under `seed`: counter
// (k lo, k hi, epoch lo, epoch hi), key (seed lo, seed hi); word = out0 | out1 << 32.
inline std::uint64_t shuffle_draw(std::uint64_t seed, std::uint64_t epoch, std::uint64_t k) {
  const auto out = philox4x32_10({static_cast<std::uint32_t>(k), static_cast<std::uint32_t>(k >> 32),
                                  static_cast<std::uint32_t>(epoch), static_cast<std::uint32_t>(epoch >> 32)},
                                 {static_cast<std::uint32_t>(seed), static_cast<std::uint32_t>(seed >> 32)});
  return static_cast<std::uint64_t>(out[0]) | (static_cast<std::uint64_t>(out[1]) << 32);
}

// out[0..n) = epoch `epoch`'s order of samples 0..n-1: start from the identity;
// for i = n-1 down to 1, with r = draw (n-1-i), swap out[i] and out[(r * (i+1)) >> 64]
// (a 64x64->128-bit multiply: an index in [0, i], bias below 2^-40 for n < 2^24).
// The targets j depend only on (seed, epoch, i), not on earlier swaps: they are
// drawn a block ahead and prefetched so the random accesses overlap (the swaps
// still run in the order above: the same permutation).
template <typename Index>
void epoch_order(std::uint64_t n, std::uint64_t seed, std::uint64_t epoch, Index* out) {
  std::iota(out, out + n, Index{0});
  constexpr std::uint64_t kAhead = 64;
  std::uint64_t target[kAhead];
  for (std::uint64_t top = n; top > 1;) {  // swaps for i = top-1 down to low
    const std::uint64_t low = top > kAhead + 1 ? top - kAhead : 1;
    for (std::uint64_t i = top - 1, b = 0; i >= low; --i, ++b) {
      const std::uint64_t r = shuffle_draw(seed, epoch, n - 1 - i);
      target[b] = static_cast<std::uint64_t>((static_cast<unsigned __int128>(r) * (i + 1)) >> 64);
      __builtin_prefetch(out + target[b], 1);
    }
    for (std::uint64_t i = top - 1, b = 0; i >= low; --i, ++b) std::swap(out[i], out[target[b]]);
    top = low;
  }
}

}  // namespace hpcdl
