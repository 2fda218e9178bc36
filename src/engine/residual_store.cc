// Error feedback: per communicator and tensor name, what compression dropped,
// added back by the next compressed allreduce of that tensor (and top-k's
// reused threshold).
#include "hpcdl/engine/residual_store.hpp"

#include "hpcdl/util/env.hpp"

namespace hpcdl {

void ResidualStore::erase(Context& c, std::map<std::string, Slot>::iterator it) {
  bytes_ -= it->second.values->residual.size() * sizeof(float);
  c.by_last_use.erase(it->second.in_order);
  c.slots.erase(it);
}

std::shared_ptr<ErrorFeedback> ResidualStore::get(std::uint64_t context_id, const std::string& name,
                                                  std::size_t count) {
  std::lock_guard<std::mutex> g(mu_);
  Context& c = contexts_[context_id];
  const std::uint64_t use = ++c.uses;
  auto it = c.slots.find(name);
  if (it == c.slots.end()) {
    it = c.slots.emplace(name, Slot()).first;
    it->second.in_order = c.by_last_use.insert(c.by_last_use.end(), name);
  } else {
    c.by_last_use.splice(c.by_last_use.end(), c.by_last_use, it->second.in_order);
  }
  Slot& slot = it->second;
  slot.last_use = use;
  if (!slot.values || slot.values->residual.size() != count) {
    if (slot.values) bytes_ -= slot.values->residual.size() * sizeof(float);
    slot.values = std::make_shared<ErrorFeedback>(count);
    bytes_ += count * sizeof(float);
  }
  const auto values = slot.values;
  const std::uint64_t ttl = static_cast<std::uint64_t>(residual_ttl_ops());
  while (ttl > 0 && use - c.slots.at(c.by_last_use.front()).last_use > ttl)
    erase(c, c.slots.find(c.by_last_use.front()));
  return values;
}

bool ResidualStore::copy(std::uint64_t context_id, const std::string& name, std::vector<float>* out) {
  std::lock_guard<std::mutex> g(mu_);
  auto c = contexts_.find(context_id);
  if (c == contexts_.end()) return false;
  auto it = c->second.slots.find(name);
  if (it == c->second.slots.end()) return false;
  *out = it->second.values->residual;
  return true;
}

void ResidualStore::put(std::uint64_t context_id, const std::string& name, std::vector<float> values) {
  std::lock_guard<std::mutex> g(mu_);
  Context& c = contexts_[context_id];
  auto it = c.slots.find(name);
  if (it != c.slots.end()) erase(c, it);
  it = c.slots.emplace(name, Slot()).first;
  it->second.in_order = c.by_last_use.insert(c.by_last_use.end(), name);
  it->second.last_use = c.uses;  // as if used last: the lifetime counts from here
  it->second.values = std::make_shared<ErrorFeedback>(0);
  it->second.values->residual = std::move(values);
  bytes_ += it->second.values->residual.size() * sizeof(float);
}

bool ResidualStore::free(std::uint64_t context_id, const std::string& name) {
  std::lock_guard<std::mutex> g(mu_);
  auto c = contexts_.find(context_id);
  if (c == contexts_.end()) return false;
  auto it = c->second.slots.find(name);
  if (it == c->second.slots.end()) return false;
  erase(c->second, it);
  return true;
}

std::uint64_t ResidualStore::bytes() {
  std::lock_guard<std::mutex> g(mu_);
  return bytes_;
}

void ResidualStore::forget_context(std::uint64_t context_id) {
  std::lock_guard<std::mutex> g(mu_);
  auto c = contexts_.find(context_id);
  if (c == contexts_.end()) return;
  for (auto& kv : c->second.slots) bytes_ -= kv.second.values->residual.size() * sizeof(float);
  contexts_.erase(c);
}

void ResidualStore::clear() {
  std::lock_guard<std::mutex> g(mu_);
  contexts_.clear();
  bytes_ = 0;
}

}  // namespace hpcdl
