// The engine's counters (StatsBoard).
#include "hpcdl/engine/stats.hpp"

namespace hpcdl {

void StatsBoard::count(const std::string& kind, const std::string& codec, std::uint64_t bytes_sent,
                       std::uint64_t bytes_received, std::uint64_t dense_bytes, double seconds) {
  std::lock_guard<std::mutex> g(mu_);
  EngineStats& s = rows_[{kind, codec}];
  s.kind = kind;
  s.codec = codec;
  s.ops += 1;
  s.bytes_sent += bytes_sent;
  s.bytes_received += bytes_received;
  s.dense_bytes += dense_bytes;
  s.seconds += seconds;
}

void StatsBoard::add_agreement(AgreementStats* counted) {
  AgreementStats& c = *counted;
  if (c.messages_sent + c.messages_received + c.one_hop_runs == 0) return;
  {
    std::lock_guard<std::mutex> g(mu_);
    agreement_.messages_sent += c.messages_sent;
    agreement_.messages_received += c.messages_received;
    agreement_.entries_received += c.entries_received;
    agreement_.descriptions_received += c.descriptions_received;
    agreement_.one_hop_runs += c.one_hop_runs;
  }
  c = AgreementStats();
}

std::vector<EngineStats> StatsBoard::rows() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<EngineStats> out;
  for (auto& kv : rows_) out.push_back(kv.second);
  return out;
}

AgreementStats StatsBoard::agreement() {
  std::lock_guard<std::mutex> g(mu_);
  return agreement_;
}

void StatsBoard::reset() {
  std::lock_guard<std::mutex> g(mu_);
  rows_.clear();
  agreement_ = AgreementStats();
}

}  // namespace hpcdl
