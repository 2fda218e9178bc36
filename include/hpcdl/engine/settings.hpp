// Every HPCDL_* setting of the environment hpcdl reads, and its bounds: the
// one table. hpcdl._env checks each variable set against it at import
// (_core.ENV_SETTINGS; integers must be decimal digits only, the rule
// env_long reads them by), so a bad value fails every rank there, before a
// C++ thread reads it (util/env.hpp) or the Python side does.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

#include "hpcdl/algorithms/ring.hpp"

namespace hpcdl {

struct EnvSetting {
  const char* key;       // hpcdl.configure()'s name for it
  const char* variable;  // the environment variable
  bool integer;          // else a number
  std::int64_t low;
  std::int64_t high;  // kUnbounded: none
};

constexpr std::int64_t kUnbounded = -1;

constexpr EnvSetting kEnvSettings[] = {
    {"chunk_bytes", "HPCDL_CHUNK_BYTES", true, static_cast<std::int64_t>(kMinChunkBytes),
     static_cast<std::int64_t>(kMaxChunkBytes)},
    {"stall_warning_seconds", "HPCDL_STALL_WARNING_SECONDS", false, 0, kUnbounded},
    {"stall_error_seconds", "HPCDL_STALL_ERROR_SECONDS", false, 0, kUnbounded},
    // The polite wait's longest sleep (0: poll without sleeping); the engine thread's
    // own polls use it clamped to [1 us, 1 ms] (engine_wait_sleep).
    {"wait_sleep_us", "HPCDL_WAIT_SLEEP_US", true, 0, 1000000},
    {"engine_slice_us", "HPCDL_ENGINE_SLICE_US", true, 0, 100000},  // Linux takes 100 us to 100 ms
    {"agreement_flat", "HPCDL_AGREEMENT_FLAT", true, 0, 1},
    {"agreement_radix", "HPCDL_AGREEMENT_RADIX", true, 2, 65536},
    {"agreement_one_hop_ranks", "HPCDL_AGREEMENT_ONE_HOP_RANKS", true, 0, 65536},
    {"timeline_max_events", "HPCDL_TIMELINE_MAX_EVENTS", true, 1, std::numeric_limits<std::int64_t>::max()},
    {"residual_ttl_ops", "HPCDL_RESIDUAL_TTL_OPS", true, 0, 999999999999999999},  // error feedback (residual_store.hpp)
};

constexpr std::size_t kEnvSettingCount = sizeof(kEnvSettings) / sizeof(kEnvSettings[0]);

}  // namespace hpcdl
