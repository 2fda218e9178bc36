// Error feedback: per communicator and tensor name, what compression dropped,
// added back by the next compressed allreduce of that tensor.
#include "hpcdl/engine/residual_store.hpp"

#include <iterator>

namespace hpcdl {

std::shared_ptr<std::vector<float>> ResidualStore::get(std::uint64_t context_id, const std::string& name,
                                                       std::size_t count) {
  std::lock_guard<std::mutex> g(mu_);
  auto& slot = residuals_[{context_id, name}];
  if (!slot || slot->size() != count) slot = std::make_shared<std::vector<float>>(count, 0.0f);
  return slot;
}

bool ResidualStore::copy(std::uint64_t context_id, const std::string& name, std::vector<float>* out) {
  std::lock_guard<std::mutex> g(mu_);
  auto it = residuals_.find({context_id, name});
  if (it == residuals_.end()) return false;
  *out = *it->second;
  return true;
}

void ResidualStore::forget_context(std::uint64_t context_id) {
  std::lock_guard<std::mutex> g(mu_);
  for (auto it = residuals_.begin(); it != residuals_.end();)
    it = it->first.first == context_id ? residuals_.erase(it) : std::next(it);
}

void ResidualStore::clear() {
  std::lock_guard<std::mutex> g(mu_);
  residuals_.clear();
}

}  // namespace hpcdl
