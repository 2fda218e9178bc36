// Settings hpcdl's C++ threads read from the environment. hpcdl._env
// checks the same variables at import with the same rule (decimal digits
// only, then its bounds), so a value that is not a number in range fails
// there, on every rank, before any thread reads it here.
#pragma once

#include <cstdlib>
#include <cstring>

namespace hpcdl {

// The variable's value if it is 1 to 18 decimal digits (no sign, space or
// '_'), else fallback.
inline long env_long(const char* name, long fallback) {
  const char* v = std::getenv(name);
  if (!v) return fallback;
  const std::size_t len = std::strlen(v);
  if (len == 0 || len > 18 || std::strspn(v, "0123456789") != len) return fallback;
  return std::strtol(v, nullptr, 10);
}

// The longest sleep between two polls of a waiting hpcdl thread
// (HPCDL_WAIT_SLEEP_US, default 200 us; 0: poll without sleeping).
inline long wait_sleep_cap_us() {
  static const long us = env_long("HPCDL_WAIT_SLEEP_US", 200);
  return us;
}

// The engine thread's scheduler slice (HPCDL_ENGINE_SLICE_US, default 100 us;
// 0 leaves the scheduler's default).
inline long engine_slice_us() {
  static const long us = env_long("HPCDL_ENGINE_SLICE_US", 100);
  return us;
}

// HPCDL_AGREEMENT_FLAT=1: every rank reports to the coordinator directly
// (fan-in P - 1) instead of up the report tree; for comparison in bench/.
inline bool agreement_flat() {
  static const bool flat = env_long("HPCDL_AGREEMENT_FLAT", 0) != 0;
  return flat;
}

// The report tree's radix k (HPCDL_AGREEMENT_RADIX, default 4): ceil(log_k P)
// hops each way, up to (k - 1) ceil(log_k P) children at the coordinator.
inline long agreement_radix() {
  static const long radix = env_long("HPCDL_AGREEMENT_RADIX", 4);
  return radix;
}

// The largest communicator whose operations may run on every rank's
// description before the plan (HPCDL_AGREEMENT_ONE_HOP_RANKS, default 4;
// 0: never; CommContext::one_hop).
inline long agreement_one_hop_ranks() {
  static const long ranks = env_long("HPCDL_AGREEMENT_ONE_HOP_RANKS", 4);
  return ranks;
}

// How many named compressed allreduces may run on a communicator without a
// name before that name's error-feedback residual is freed
// (HPCDL_RESIDUAL_TTL_OPS, default 1000; 0 keeps residuals until the
// communicator is freed or reset_state()).
inline long residual_ttl_ops() {
  static const long ops = env_long("HPCDL_RESIDUAL_TTL_OPS", 1000);
  return ops;
}

}  // namespace hpcdl
