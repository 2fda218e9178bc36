// Names hpcdl's threads so that `top -H`, perf and /proc/PID/task/*/comm tell
// them apart from the framework's and MPI's threads.
#pragma once

#if defined(__linux__)
#include <pthread.h>
#endif

namespace hpcdl {

// `name`: at most 15 characters (Linux's limit); elsewhere a no-op.
inline void name_this_thread(const char* name) {
#if defined(__linux__)
  pthread_setname_np(pthread_self(), name);
#else
  (void)name;
#endif
}

}  // namespace hpcdl
