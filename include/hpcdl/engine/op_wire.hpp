// The engine's messages on a communicator's control duplicate (reports up the
// report tree, plans down it, leave notices) and the data duplicate's tag.
// An operation's description travels as OpDesc::serialize() bytes.
#pragma once

#include <cstdint>

namespace hpcdl {

constexpr int kTagReady = 1;  // up the report tree: operations ready in the sender's subtree
constexpr int kTagPlan = 2;   // down the report tree, from the coordinator: what to run, in order
constexpr int kTagData = 3;
constexpr int kTagLeave = 4;  // a rank leaves the communicator (exit, free): to the coordinator, which forwards it

// A plan entry: u32 id, u8 result, u8 with_name, [string name], then for all
// but kRun a string message, and for kTimeout the ranks that had not submitted
// it (u32 count, i32 each): on those the operation, if pending, came too late
// for that decision and stays pending (its report makes a new entry).
enum class PlanResult : std::uint8_t { kRun = 0, kMismatch = 1, kStall = 2, kTimeout = 3 };

// Entries of a ready message.
constexpr std::uint8_t kEntryDescription = 0;  // i32 rank, string: that rank's full description
constexpr std::uint8_t kEntryCached = 1;       // u32 id, i32 first, i32 end: ranks [first, end) report it unchanged

}  // namespace hpcdl
