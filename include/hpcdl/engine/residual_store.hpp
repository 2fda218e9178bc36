// Error-feedback residuals of compressed allreduces: one float per element of
// each named tensor compressed on a communicator (per rank: 4 bytes x the
// elements of every named compressed tensor), kept until the communicator is
// freed or hpcdl.compression.reset_state() clears them.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace hpcdl {

class ResidualStore {
 public:
  // Tensor `name`'s residual on context `context_id`, `count` floats (made,
  // zeroed, when new or when the count changed). The caller's reference keeps
  // it alive even if clear() runs meanwhile.
  std::shared_ptr<std::vector<float>> get(std::uint64_t context_id, const std::string& name, std::size_t count);
  // A copy of it into *out; false when there is none.
  bool copy(std::uint64_t context_id, const std::string& name, std::vector<float>* out);
  void forget_context(std::uint64_t context_id);
  void clear();

 private:
  std::mutex mu_;
  std::map<std::pair<std::uint64_t, std::string>, std::shared_ptr<std::vector<float>>> residuals_;
};

}  // namespace hpcdl
