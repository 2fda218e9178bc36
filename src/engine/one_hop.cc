// One-hop agreement on a small communicator (CommContext::one_hop): the
// coordinator's plan takes two hops after the last report (report up, plan
// down), each waiting for an engine thread to get a core; a description sent
// to every rank takes one.
#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/engine/op_wire.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/wire.hpp"

namespace hpcdl {

namespace {

// Descriptions kept per name and rank: more come only from a rank that many
// rounds ahead of this one (this rank has joined, or stopped submitting the
// name); dropping one only sends that round the plan's way.
constexpr std::size_t kOneHopKept = 8;
// How long a freed communicator's duplicates wait for the other ranks' closes.
constexpr double kCloseBoundSeconds = 10.0;

}  // namespace

void CommContext::enable_one_hop(long max_ranks) {
  // Flat: every report goes to the coordinator directly, so the coordinator
  // takes each rank's reports in the order the rank sent them.
  const bool flat = rank == 0 ? static_cast<int>(children.size()) == size - 1 : parent == 0;
  one_hop = size > 1 && size <= max_ranks && flat;
  closes_control = one_hop;
}

void CommContext::note_close(int source) {
  if (source < 0 || source >= size) return;
  closed_by.resize(static_cast<std::size_t>(size), 0);
  closed_by[static_cast<std::size_t>(source)] = 1;
}

Status CommContext::close_control(bool* closed) {
  *closed = true;
  // A rank that left sends nothing more, and a message to it could block for good (CommContext::left).
  if (!closes_control || !gone.ok()) return Status::OK();
  if (!closing) {
    closing = true;
    closing_since = std::chrono::steady_clock::now();
    for (int r = 0; r < size; ++r)
      if (r != rank) HPCDL_RETURN_NOT_OK(send(r, kTagClose, {}));
  }
  for (;;) {
    int flag = 0, n = 0;
    MPI_Status probe;
    HPCDL_RETURN_NOT_OK(mpi_status(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, ctl, &flag, &probe), "MPI_Iprobe(close)"));
    if (!flag) break;
    MPI_Get_count(&probe, MPI_BYTE, &n);
    std::vector<char> dropped(static_cast<std::size_t>(std::max(n, 1)));
    HPCDL_RETURN_NOT_OK(
        mpi_status(MPI_Recv(dropped.data(), n, MPI_BYTE, probe.MPI_SOURCE, probe.MPI_TAG, ctl, MPI_STATUS_IGNORE),
                   "MPI_Recv(close)"));
    if (probe.MPI_TAG == kTagClose) note_close(probe.MPI_SOURCE);
  }
  HPCDL_RETURN_NOT_OK(flush_outbox());
  bool all = outbox.empty();
  for (int r = 0; r < size && all; ++r)
    all = r == rank || (!closed_by.empty() && closed_by[static_cast<std::size_t>(r)]);
  *closed = all || seconds_since(closing_since) >= kCloseBoundSeconds;
  return Status::OK();
}

bool CommContext::one_hop_named(const std::string& name) const {
  std::uint64_t seq = 0;
  // An unnamed operation's name is never reused; a join runs with the ranks that have not joined.
  return one_hop && name != kJoinName && !unnamed_op_seq(name, &seq);
}

Status CommContext::send_one_hop(const std::string& name) {
  if (!one_hop_named(name) || one_hop_own.count(name)) return Status::OK();  // sent while reports waited
  OneHopOwn& own = one_hop_own[name];
  own.round = rounds[name];
  own.alone = pending.size() == 1;
  if (!own.alone) return Status::OK();  // no rank runs this round one-hop: nothing to send
  own.desc = pending.at(name)->req_.desc.serialize(name);
  own.sent = std::chrono::steady_clock::now();
  WireWriter w;
  w.put<std::uint64_t>(own.round);
  w.put_string(own.desc);
  for (int r = 0; r < size; ++r)
    if (r != rank) HPCDL_RETURN_NOT_OK(send(r, kTagOneHop, w.buffer()));
  return Status::OK();
}

Status CommContext::take_one_hop(int source, const char* bytes, std::size_t n) {
  WireReader r(bytes, n);
  std::uint64_t round = 0;
  std::string desc, name;
  OpDesc parsed;
  if (!r.get(&round) || !r.get_string(&desc) || !OpDesc::parse(desc, &name, &parsed) || source < 0 || source >= size)
    return Status::Internal("malformed one-hop description");
  if (!one_hop_named(name)) return Status::OK();
  auto current = rounds.find(name);
  if (current != rounds.end() && round < current->second) return Status::OK();  // a round over here
  std::vector<std::deque<OneHopDesc>>& by_rank = one_hop_descs[name];
  by_rank.resize(static_cast<std::size_t>(size));
  std::deque<OneHopDesc>& kept = by_rank[static_cast<std::size_t>(source)];
  kept.push_back(OneHopDesc{round, std::move(desc), std::chrono::steady_clock::now()});
  if (kept.size() > kOneHopKept) kept.pop_front();
  return Status::OK();
}

std::string CommContext::one_hop_agreed(double error_s) {
  for (auto& kv : one_hop_own) {
    const std::string& name = kv.first;
    const OneHopOwn& own = kv.second;
    // Reported in this round (not one the coordinator gave up on), and its
    // report gone up (not held): the coordinator's entry completes only with it.
    if (!own.alone || own.round != rounds[name] ||
        std::find(unreported.begin(), unreported.end(), name) != unreported.end())
      continue;
    auto found = one_hop_descs.find(name);
    if (found == one_hop_descs.end()) continue;
    std::vector<std::deque<OneHopDesc>>& by_rank = found->second;
    auto earliest = own.sent;
    bool agreed = true;
    for (int r = 0; r < size && agreed; ++r) {
      if (r == rank) continue;
      const std::deque<OneHopDesc>& kept = by_rank[static_cast<std::size_t>(r)];
      // A different description is the plan's to fail, on every rank.
      agreed = !kept.empty() && kept.front().round == own.round && kept.front().desc == own.desc;
      if (agreed) earliest = std::min(earliest, kept.front().arrived);
    }
    if (agreed && (error_s <= 0 || seconds_since(earliest) < error_s / 2)) return name;
  }
  return std::string();
}

void CommContext::conclude_round(const std::string& name) {
  if (!one_hop_named(name)) return;
  const std::uint64_t round = ++rounds[name];
  auto found = one_hop_descs.find(name);
  if (found == one_hop_descs.end()) return;
  bool empty = true;
  for (std::deque<OneHopDesc>& kept : found->second) {
    while (!kept.empty() && kept.front().round < round) kept.pop_front();
    empty = empty && kept.empty();
  }
  if (empty) one_hop_descs.erase(found);
}

void CommContext::stop_one_hop() {
  one_hop = false;
  one_hop_descs.clear();
  one_hop_own.clear();
  // The plans that would count these off were dropped with the pending operations.
  ran_one_hop.clear();
}

}  // namespace hpcdl
