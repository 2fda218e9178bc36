// How hpcdl's own threads are started and present themselves to the OS: a
// name that `top -H`, perf and /proc/PID/task/*/comm show, and for the engine
// a short scheduler slice, since its work is short bursts that others wait for.
#pragma once

#if defined(__linux__)
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include <cstdint>
#include <string>
#include <system_error>
#include <thread>
#include <utility>
#include <vector>

#include "hpcdl/util/status.hpp"

namespace hpcdl {

// Starts fn on a new thread in *out. std::thread throws when the OS refuses
// one (no memory for its stack, a thread limit); uncaught, that would end the
// process in std::terminate with no word from hpcdl. `what`: "its engine thread".
template <typename Fn>
Status start_thread(const char* what, Fn&& fn, std::thread* out) {
  try {
    *out = std::thread(std::forward<Fn>(fn));
  } catch (const std::system_error& e) {
    return Status::Internal(std::string("hpcdl could not start ") + what + ": " + e.what());
  }
  return Status::OK();
}

// The same, appending the started thread to *threads.
template <typename Fn>
Status start_thread(const char* what, Fn&& fn, std::vector<std::thread>* threads) {
  std::thread t;
  HPCDL_RETURN_NOT_OK(start_thread(what, std::forward<Fn>(fn), &t));
  threads->push_back(std::move(t));
  return Status::OK();
}

// `name`: at most 15 characters (Linux's limit); elsewhere a no-op.
inline void name_this_thread(const char* name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

// Asks Linux's EEVDF scheduler (6.12+: sched_setattr's sched_runtime for a
// normal task) for a short slice. A thread with a short slice gets the CPU
// soon after it wakes, ahead of a rank's long compute slices, for no more CPU
// in total; on 4 ranks per 2 cores that made training steps a few percent
// faster (docs/frameworks.md). Best effort: older kernels ignore the request
// or refuse it, and nothing else changes.
inline void request_short_slice(long slice_us) {
#if defined(__linux__) && defined(SYS_sched_setattr) && defined(SYS_sched_getattr)
  if (slice_us <= 0) return;
  struct {
    std::uint32_t size, policy;
    std::uint64_t flags;
    std::int32_t nice;
    std::uint32_t priority;
    std::uint64_t runtime_ns, deadline_ns, period_ns;
    std::uint32_t util_min, util_max;
  } attr = {};
  static_assert(sizeof(attr) == 56, "struct sched_attr, version 1");
  // Only the slice changes: the nice value and policy the user gave stay.
  if (syscall(SYS_sched_getattr, 0, &attr, sizeof(attr), 0u) != 0 || attr.policy != 0 /* SCHED_OTHER */) return;
  attr.size = sizeof(attr);
  attr.flags = 0;
  attr.runtime_ns = static_cast<std::uint64_t>(slice_us) * 1000;
  syscall(SYS_sched_setattr, 0, &attr, 0u);
#else
  (void)slice_us;
#endif
}

}  // namespace hpcdl
