// Error-feedback residuals of compressed allreduces: one float per element of
// each named tensor compressed on a communicator (per rank: 4 bytes x the
// elements of every named compressed tensor). A name's residual is freed when
// residual_ttl_ops() named compressed allreduces have run on its communicator
// without it (a name used once, or no longer, does not hold memory for
// good), when the communicator is freed, by free() (hpcdl.compression.
// free_residual) or by clear() (reset_state).
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "hpcdl/codecs/topk.hpp"

namespace hpcdl {

// One named tensor's error-feedback state: its residual and, for top-k with
// threshold reuse, the threshold of its last exact selection.
struct ErrorFeedback {
  explicit ErrorFeedback(std::size_t count) : residual(count, 0.0f) {}
  std::vector<float> residual;
  TopkThreshold topk_threshold;
};

class ResidualStore {
 public:
  // Tensor `name`'s state on context `context_id`, a residual of `count`
  // floats (made, zeroed and without a threshold, when new or when the count
  // changed); counts one use on the context and frees the states unused for
  // longer than the lifetime. The caller's reference keeps it alive even if
  // it is freed meanwhile.
  std::shared_ptr<ErrorFeedback> get(std::uint64_t context_id, const std::string& name, std::size_t count);
  // A copy of it into *out; false when there is none.
  bool copy(std::uint64_t context_id, const std::string& name, std::vector<float>* out);
  // Makes `values` tensor `name`'s residual on the context (a checkpoint's),
  // without a threshold; an allreduce of another size zeroes it, as it does
  // any residual.
  void put(std::uint64_t context_id, const std::string& name, std::vector<float> values);
  // Frees tensor `name`'s residual on the context; false when there was none.
  bool free(std::uint64_t context_id, const std::string& name);
  // Bytes the residuals of every context take.
  std::uint64_t bytes();
  void forget_context(std::uint64_t context_id);
  void clear();

 private:
  struct Slot {
    std::shared_ptr<ErrorFeedback> values;
    std::uint64_t last_use = 0;
    std::list<std::string>::iterator in_order;
  };
  struct Context {
    std::uint64_t uses = 0;              // named compressed allreduces run here
    std::list<std::string> by_last_use;  // least recently used first
    std::map<std::string, Slot> slots;
  };
  void erase(Context& c, std::map<std::string, Slot>::iterator it);

  std::mutex mu_;
  std::map<std::uint64_t, Context> contexts_;
  std::uint64_t bytes_ = 0;  // under mu_
};

}  // namespace hpcdl
