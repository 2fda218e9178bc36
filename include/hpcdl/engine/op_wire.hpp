// The engine's messages on a communicator's control duplicate (reports up the
// report tree, plans down it, leave notices) and the data duplicate's tag.
// An operation's description travels as OpDesc::serialize() bytes.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hpcdl/util/wire.hpp"

namespace hpcdl {

constexpr int kTagReady = 1;  // up the report tree: operations ready in the sender's subtree
constexpr int kTagPlan = 2;   // down the report tree, from the coordinator: what to run, in order
constexpr int kTagData = 3;
constexpr int kTagLeave = 4;  // a rank leaves the communicator (exit, free): to the coordinator, which forwards it
// To every rank of a small communicator (CommContext::one_hop): u64 round, string description.
constexpr int kTagOneHop = 5;
// To every rank, empty, as a one-hop communicator's duplicates are freed: the sender's last control message.
constexpr int kTagClose = 6;

// A plan entry: u32 id, u8 result, u8 with_name, [string name], then for all
// but kRun a string message, and for kTimeout the ranks that had not submitted
// it (u32 count, i32 each): on those the operation, if pending, came too late
// for that decision and stays pending (its report makes a new entry).
// kRunJoined: run it, and ranks that joined (and so never submitted it) run it
// with zeros: the entry carries the agreed description (string). kJoined:
// every rank has joined; then the rank that joined last (i32).
enum class PlanResult : std::uint8_t { kRun = 0, kMismatch = 1, kStall = 2, kTimeout = 3, kRunJoined = 4, kJoined = 5 };

struct PlanEntry {
  std::uint32_t id = 0;
  PlanResult result = PlanResult::kRun;
  std::string name;                   // empty: a kRun of a name an earlier plan announced
  std::string message;                // all but kRun
  std::vector<std::int32_t> missing;  // kTimeout
  std::string desc;                   // kRunJoined
  std::int32_t last_joined = -1;      // kJoined
};

// The next entry of a plan; false when the plan is malformed.
bool read_plan_entry(WireReader& r, PlanEntry* e);

// Entries of a ready message.
constexpr std::uint8_t kEntryDescription = 0;  // i32 rank, string: that rank's full description
constexpr std::uint8_t kEntryCached = 1;       // u32 id, i32 first, i32 end: ranks [first, end) report it unchanged

}  // namespace hpcdl
