// The engine's counters: per (kind, codec) operations, bytes and seconds, and
// the agreement's control traffic; written by the engine thread, read by any.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace hpcdl {

struct EngineStats {
  std::string kind;   // allreduce, broadcast, barrier, transfer
  std::string codec;  // allreduce: its codec ("none": dense); transfer: its direction (send, receive)
  std::uint64_t ops = 0, bytes_sent = 0, bytes_received = 0, dense_bytes = 0;
  double seconds = 0;
};

// The agreement's control traffic on this rank, summed over communicators.
struct AgreementStats {
  std::uint64_t messages_sent = 0, messages_received = 0;  // reports and plans
  std::uint64_t entries_received = 0;       // reports taken from other ranks, one per operation and sender
  std::uint64_t descriptions_received = 0;  // of those, full descriptions (new or changed operations)
  std::uint64_t one_hop_runs = 0;           // operations run on every rank's description, before their plan
};

class StatsBoard {
 public:
  // One operation more of (kind, codec): its bytes (dense: what the dense ring would have sent) and time.
  void count(const std::string& kind, const std::string& codec, std::uint64_t bytes_sent, std::uint64_t bytes_received,
             std::uint64_t dense_bytes, double seconds);
  // Adds a communicator's control traffic counted since the last call, and zeroes it there.
  void add_agreement(AgreementStats* counted);
  std::vector<EngineStats> rows();
  AgreementStats agreement();
  void reset();

 private:
  std::mutex mu_;
  std::map<std::pair<std::string, std::string>, EngineStats> rows_;  // under mu_
  AgreementStats agreement_;                                         // under mu_
};

}  // namespace hpcdl
