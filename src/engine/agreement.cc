// The agreement protocol: ranks report the operations ready on them up a
// k-nomial report tree to the coordinator (rank 0), which plans what every
// rank reported the same way and sends the plan down the tree
// (agreement.hpp describes it; op_wire.hpp the messages).
#include "hpcdl/engine/agreement.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "hpcdl/engine/comm_context.hpp"
#include "hpcdl/engine/op_wire.hpp"
#include "hpcdl/engine/stats.hpp"
#include "hpcdl/util/dtype.hpp"
#include "hpcdl/util/mpi_util.hpp"
#include "hpcdl/util/wire.hpp"

namespace hpcdl {

namespace {

// "count differs: 1000 on ranks 0, 1, 3; 998 on rank 2" for each field where ranks disagree.
std::string describe_disagreement(const std::vector<OpDesc>& descs) {
  std::ostringstream os;
  auto field = [&](const char* label, auto value_of) {
    std::map<std::string, std::vector<int>> by_value;
    for (std::size_t r = 0; r < descs.size(); ++r) by_value[value_of(descs[r])].push_back(static_cast<int>(r));
    if (by_value.size() < 2) return;
    if (os.tellp() > 0) os << "; ";
    os << label << " differs:";
    bool first = true;
    for (auto& kv : by_value) {
      os << (first ? " " : ", ") << kv.first << " on " << rank_list(kv.second);
      first = false;
    }
  };
  field("operation", [](const OpDesc& d) { return std::string(op_kind_name(d.kind)); });
  field("dtype", [](const OpDesc& d) { return std::string(dtype_name(d.dtype)); });
  field("count", [](const OpDesc& d) { return std::to_string(d.count); });
  field("shape", [](const OpDesc& d) { return shape_text(d.shape); });
  field("arrays", [](const OpDesc& d) {
    std::string text = "(";
    for (std::size_t i = 0; i < d.members.size(); ++i)
      text += (i ? ", " : "") + std::string(dtype_name(d.members[i].dtype)) + shape_text(d.members[i].shape);
    return text + ")";
  });
  field("op", [](const OpDesc& d) { return std::string(reduce_op_name(d.reduce_op)); });
  field("root", [](const OpDesc& d) { return std::to_string(d.root); });
  field("chunk_bytes", [](const OpDesc& d) { return std::to_string(d.chunk_bytes); });
  field("compression", [](const OpDesc& d) { return d.codec.empty() ? std::string("none") : d.codec; });
  return os.str();
}

}  // namespace

void CommContext::set_tree(long radix) {
  // Rank r's parent clears r's lowest nonzero base-radix digit; r's subtree
  // spans that digit's place (the root's: every rank). A radix >= size is
  // flat: every rank reports to the coordinator directly.
  const long long k = radix;
  long long place = 1;
  if (rank == 0) {
    while (place < size) place *= k;
  } else {
    while ((rank / place) % k == 0) place *= k;
    parent = static_cast<int>(rank - (rank / place) % k * place);
  }
  subtree_end = static_cast<int>(std::min<long long>(size, rank + place));
  for (long long step = 1; step < place; step *= k)
    for (long long child = rank + step; child < subtree_end && child < rank + k * step; child += step)
      children.push_back(static_cast<int>(child));
}

Status CommContext::report() {
  // An operation given up before it was reported (while the communicator
  // was being set up) is not pending any more: nothing to report for it.
  unreported.erase(std::remove_if(unreported.begin(), unreported.end(),
                                  [this](const std::string& name) { return pending.count(name) == 0; }),
                   unreported.end());
  if (unreported.empty()) return Status::OK();
  for (const std::string& name : unreported) HPCDL_RETURN_NOT_OK(send_one_hop(name));
  if (!ran_one_hop.empty()) return Status::OK();  // see ran_one_hop
  WireWriter w;
  w.put<std::uint32_t>(static_cast<std::uint32_t>(unreported.size()));
  for (const std::string& name : unreported) {
    const std::string desc = pending.at(name)->req_.desc.serialize(name);
    auto id = ids.find(name);
    auto last = last_reported.find(name);
    const bool joins = pending.at(name)->req_.desc.kind == OpKind::kJoin;  // a join always goes up by itself
    if (!joins && id != ids.end() && last != last_reported.end() && last->second == desc) {
      w.put<std::uint8_t>(kEntryCached);
      w.put<std::uint32_t>(id->second);
      w.put<std::int32_t>(rank);
      w.put<std::int32_t>(rank + 1);
    } else {
      w.put<std::uint8_t>(kEntryDescription);
      w.put<std::int32_t>(rank);
      w.put_string(desc);
      last_reported[name] = desc;
    }
  }
  unreported.clear();
  return take_report(w.buffer().data(), w.buffer().size(), true);
}

Status CommContext::take_report(const char* bytes, std::size_t n, bool own) {
  WireReader r(bytes, n);
  std::uint32_t count;
  if (!r.get(&count)) return Status::Internal("malformed ready message");
  for (std::uint32_t i = 0; i < count; ++i) {
    std::uint8_t form;
    if (!r.get(&form)) return Status::Internal("malformed ready message");
    if (!own) ++counted.entries_received;
    if (form == kEntryDescription) {
      std::int32_t source;
      std::string desc, name;
      OpDesc parsed;
      if (!r.get(&source) || !r.get_string(&desc) || !OpDesc::parse(desc, &name, &parsed) || source < rank ||
          source >= subtree_end)
        return Status::Internal("malformed operation description");
      if (!own) ++counted.descriptions_received;
      if (parsed.kind == OpKind::kJoin) take_join_report(source);
      if (!is_coordinator()) {
        if (upward_entries++ == 0) upward.put<std::uint32_t>(0);
        upward.put<std::uint8_t>(kEntryDescription);
        upward.put<std::int32_t>(source);
        upward.put_string(desc);
        // A changed description of an operation seen before: the rest of the
        // subtree may report it by id, and their merged entry must not wait for this rank.
        auto known = ids.find(name);
        if (known != ids.end()) merge_cached(known->second, source, source + 1, false);
        continue;
      }
      std::uint32_t id;
      auto it = coord_ids.find(name);
      if (it == coord_ids.end()) {
        id = static_cast<std::uint32_t>(coord_names.size());
        coord_ids.emplace(name, id);
        coord_names.push_back(name);
        last_desc.emplace_back(size);
        announced.push_back(0);
      } else {
        id = it->second;
      }
      last_desc[id][source] = desc;
      mark_ready(id, source, source + 1);
    } else if (form == kEntryCached) {
      std::uint32_t id;
      std::int32_t first, end;
      if (!r.get(&id) || !r.get(&first) || !r.get(&end) || first < rank || first >= end || end > subtree_end)
        return Status::Internal("malformed cached report");
      if (is_coordinator()) {
        if (id >= coord_names.size()) return Status::Internal("unknown operation id in ready message");
        mark_ready(id, first, end);
      } else {
        merge_cached(id, first, end, true);
      }
    } else {
      return Status::Internal("malformed ready message");
    }
  }
  return Status::OK();
}

void CommContext::merge_cached(std::uint32_t id, int first, int end, bool sent_by_id) {
  if (subtree_joined) {  // no merged entry: a joined rank never reports
    if (sent_by_id) put_upward_cached(id, first, end);
    return;
  }
  const int span = subtree_end - rank;
  Partial& p = partial[id];
  if (p.ready.empty()) {
    p.ready.assign(span, 0);
    p.first_seen = std::chrono::steady_clock::now();
  }
  for (int k = first; k < end; ++k)
    if (!p.ready[k - rank]) {
      p.ready[k - rank] = sent_by_id ? kById : kByDescription;
      ++p.count;
    }
  p.any_by_id = p.any_by_id || sent_by_id;
  // The merged entry may name ranks whose descriptions went up before it: the
  // coordinator marks a rank ready once, and reads its description first. It
  // goes up only with a rank reported by id in it, so it never arrives after
  // the descriptions alone completed the operation (a stale mark for the next step).
  if (p.released) {
    if (sent_by_id) put_upward_cached(id, first, end);
  } else if (p.count == span && p.any_by_id) {
    put_upward_cached(id, rank, subtree_end);
  }
  if (p.count == span) partial.erase(id);
}

void CommContext::put_upward_cached(std::uint32_t id, int first, int end) {
  if (upward_entries++ == 0) upward.put<std::uint32_t>(0);
  upward.put<std::uint8_t>(kEntryCached);
  upward.put<std::uint32_t>(id);
  upward.put<std::int32_t>(first);
  upward.put<std::int32_t>(end);
}

void CommContext::release_held(double hold_s) {
  for (auto& kv : partial) {
    Partial& p = kv.second;
    if (p.released || seconds_since(p.first_seen) < hold_s) continue;
    p.released = true;
    const int span = static_cast<int>(p.ready.size());
    for (int i = 0; i < span;) {  // ranks reported by id: descriptions went up already
      if (p.ready[i] != kById) {
        ++i;
        continue;
      }
      int j = i;
      while (j < span && p.ready[j] == kById) ++j;
      put_upward_cached(kv.first, rank + i, rank + j);
      i = j;
    }
  }
}

Status CommContext::send_upward() {
  if (upward_entries == 0) return Status::OK();
  std::memcpy(upward.buffer().data(), &upward_entries, sizeof(upward_entries));
  std::vector<char> bytes = std::move(upward.buffer());
  upward = WireWriter();
  upward_entries = 0;
  return send(parent, kTagReady, std::move(bytes));
}

void CommContext::mark_ready(std::uint32_t id, int first, int end) {
  Entry& e = table[id];
  if (e.ready.empty()) {
    e.ready.assign(size, 0);
    e.first_seen = std::chrono::steady_clock::now();
  }
  for (int k = first; k < end; ++k)
    if (!e.ready[k]) {
      e.ready[k] = 1;
      if (++e.ready_count == size) completed.push_back(id);
    }
}

void CommContext::plan(double warn_s, double error_s, WireWriter* w, std::uint32_t* entries) {
  auto put_entry = [&](std::uint32_t id, PlanResult result, const std::string& message) {
    w->put<std::uint32_t>(id);
    w->put<std::uint8_t>(static_cast<std::uint8_t>(result));
    const bool with_name = result != PlanResult::kRun || !announced[id];
    w->put<std::uint8_t>(with_name ? 1 : 0);
    if (with_name) w->put_string(coord_names[id]);
    if (result == PlanResult::kRun) announced[id] = 1;
    if (result != PlanResult::kRun) w->put_string(message);
    ++*entries;
  };
  // Entries completed in the same cycle run in the order they completed (one
  // a rank reported before another completes first: CommContext::one_hop),
  // then the rest in id order, the join last (what its last rank left, others
  // submitted, runs with zeros before it ends): only the coordinator decides,
  // so every rank gets the same order.
  auto join_id = coord_ids.find(kJoinName);
  const bool join_open = join_id != coord_ids.end() && table.count(join_id->second);
  std::vector<std::uint32_t> order;
  for (std::uint32_t id : completed)
    if (!join_open || id != join_id->second) order.push_back(id);
  completed.clear();
  for (auto& kv : table)
    if (kv.second.ready_count < size && (!join_open || kv.first != join_id->second)) order.push_back(kv.first);
  if (join_open) order.push_back(join_id->second);
  std::string join_failure;  // an operation join refused: the join fails too
  for (std::uint32_t id : order) {
    auto it = table.find(id);
    if (it == table.end()) continue;  // a join's failure took it
    Entry& e = it->second;
    const std::string& name = coord_names[id];
    const bool is_join = name == kJoinName;
    std::vector<int> filled;  // joined ranks that never submitted it: they run it with zeros
    for (int r = 0; r < size && !is_join; ++r)
      if (!e.ready[r] && has_joined(r)) filled.push_back(r);
    if (is_join && e.ready_count == size) {
      put_entry(id, PlanResult::kJoined, "");
      w->put<std::int32_t>(last_joined);
      end_join();
      table.erase(it);
      continue;
    }
    if (!is_join && e.ready_count + static_cast<int>(filled.size()) == size) {
      // Joined ranks take the agreed description: the submitters' must agree.
      int first = 0;
      while (!e.ready[first]) ++first;
      std::vector<OpDesc> descs(size);
      bool same = true;
      for (int r = 0; r < size; ++r) {
        const std::string& desc = last_desc[id][e.ready[r] ? r : first];
        std::string parsed_name;
        OpDesc::parse(desc, &parsed_name, &descs[r]);
        same = same && desc == last_desc[id][first];
      }
      const std::string refusal = same && !filled.empty() ? join_refusal(name, descs[first], filled) : "";
      if (!same) {
        put_entry(id, PlanResult::kMismatch,
                  "hpcdl: ranks disagree on operation '" + name + "': " + describe_disagreement(descs));
      } else if (!refusal.empty()) {
        put_entry(id, PlanResult::kMismatch, "hpcdl: " + refusal);
        join_failure = refusal;
        end_join();  // the entries after this one wait for every rank again
      } else if (!filled.empty()) {
        given_up.erase(name);
        put_entry(id, PlanResult::kRunJoined, "");
        w->put_string(last_desc[id][first]);
      } else {
        given_up.erase(name);
        put_entry(id, PlanResult::kRun, "");
      }
      table.erase(it);
      continue;
    }
    const double waited = seconds_since(e.first_seen);
    std::vector<int> missing;
    for (int r = 0; r < size; ++r)
      if (!e.ready[r] && !has_joined(r)) missing.push_back(r);
    // A join waits for the ranks that still have data as long as they train: never timed out.
    if (!is_join && error_s > 0 && waited >= error_s) {
      put_entry(id, PlanResult::kTimeout,
                "hpcdl: operation '" + name + "' " + describe_missing(name, missing, false) + " (gave up after " +
                    seconds_text(waited) + ")");
      w->put<std::uint32_t>(static_cast<std::uint32_t>(missing.size()));
      for (int r : missing) w->put<std::int32_t>(r);
      std::vector<int> submitted;
      for (int r = 0; r < size; ++r)
        if (e.ready[r]) submitted.push_back(r);
      given_up[name] = GivenUp{submitted, waited};
      table.erase(it);
      continue;
    }
    if (warn_s > 0 && waited >= warn_s && waited - e.warned_at >= warn_s) {
      e.warned_at = waited;
      std::ostringstream os;
      os << "hpcdl: operation '" << name << "' has waited " << seconds_text(waited) << " for "
         << describe_missing(name, missing, true) << " (ready on " << e.ready_count << " of " << size << " ranks)";
      put_entry(id, PlanResult::kStall, os.str());
    }
  }
  auto join = coord_ids.find(kJoinName);
  if (!join_failure.empty() && join != coord_ids.end() && table.erase(join->second))
    put_entry(join->second, PlanResult::kMismatch, "hpcdl: join failed: " + join_failure);
}

std::string CommContext::describe_missing(const std::string& name, const std::vector<int>& missing,
                                          bool still_waiting) const {
  // Ranks that submitted this name before and gave up on it are not waiting
  // any more: a late rank's operation waits for them in vain, and the message
  // says so rather than that they never submitted it.
  std::vector<int> never, gave_up;
  auto earlier = given_up.find(name);
  for (int r : missing) {
    const bool had = earlier != given_up.end() &&
                     std::binary_search(earlier->second.submitted.begin(), earlier->second.submitted.end(), r);
    (had ? gave_up : never).push_back(r);
  }
  std::string text;
  if (!never.empty())
    text = still_waiting ? rank_list(never) + ", which have not submitted it"
                         : "was never submitted by " + rank_list(never);
  if (!gave_up.empty())
    text += std::string(never.empty() ? "" : "; ") + (still_waiting ? "" : "waited for ") + rank_list(gave_up) +
            ", which submitted it earlier and gave up on it after " + seconds_text(earlier->second.waited_s) +
            " (this one came too late for them)";
  return text;
}

Status Agreement::receive(CommContext& ctx, int tag, bool* got, MPI_Status* probe) {
  int flag = 0, n = 0;
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Iprobe(MPI_ANY_SOURCE, tag, ctx.ctl, &flag, probe), "MPI_Iprobe"));
  *got = flag != 0;
  if (!flag) return Status::OK();
  MPI_Get_count(probe, MPI_BYTE, &n);
  control_msg_.resize(static_cast<std::size_t>(n));
  return mpi_status(
      MPI_Recv(control_msg_.data(), n, MPI_BYTE, probe->MPI_SOURCE, probe->MPI_TAG, ctx.ctl, MPI_STATUS_IGNORE),
      "MPI_Recv(control)");
}

Status Agreement::poll(CommContext& ctx, bool stall_check, const StallLimits& limits, bool* busy) {
  const bool reported = !ctx.unreported.empty();
  HPCDL_RETURN_NOT_OK(ctx.report());
  bool arrived = false;
  for (;;) {
    bool got = false;
    MPI_Status probe;
    HPCDL_RETURN_NOT_OK(receive(ctx, MPI_ANY_TAG, &got, &probe));
    if (!got) break;
    arrived = true;
    if (probe.MPI_TAG == kTagLeave) {
      HPCDL_RETURN_NOT_OK(take_leave_notice(ctx, probe.MPI_SOURCE));
      continue;
    }
    if (probe.MPI_TAG == kTagClose) {  // a rank freed the communicator: its last message here
      ctx.note_close(probe.MPI_SOURCE);
      continue;
    }
    if (probe.MPI_TAG == kTagOneHop) {  // not counted: messages_received counts reports and plans
      HPCDL_RETURN_NOT_OK(ctx.take_one_hop(probe.MPI_SOURCE, control_msg_.data(), control_msg_.size()));
      continue;
    }
    ++ctx.counted.messages_received;
    if (probe.MPI_TAG == kTagReady) {
      HPCDL_RETURN_NOT_OK(ctx.take_report(control_msg_.data(), control_msg_.size(), false));
    } else if (probe.MPI_TAG == kTagPlan) {
      for (int child : ctx.children) HPCDL_RETURN_NOT_OK(ctx.send(child, kTagPlan, control_msg_));
      ctx.take_plan_news(control_msg_);  // before the next reports merge: they may come from a new join
      ctx.plans.push_back(control_msg_);
    }
  }
  *busy = *busy || arrived || reported;
  HPCDL_RETURN_NOT_OK(forward_leave_notice(ctx));
  if (!ctx.is_coordinator() && ctx.gone.ok()) {
    ctx.release_held(limits.report_hold_seconds());
    HPCDL_RETURN_NOT_OK(ctx.send_upward());
  }
  if (ctx.is_coordinator() && ctx.gone.ok() && (arrived || reported || stall_check) && !ctx.table.empty()) {
    WireWriter w;
    std::uint32_t entries = 0;
    w.put<std::uint32_t>(0);
    ctx.plan(limits.warn_s, limits.error_s, &w, &entries);
    if (entries) {
      std::memcpy(w.buffer().data(), &entries, sizeof(entries));
      for (int child : ctx.children) HPCDL_RETURN_NOT_OK(ctx.send(child, kTagPlan, w.buffer()));
      ctx.plans.push_back(std::move(w.buffer()));
    }
  }
  publish_stats(ctx);
  return ctx.flush_outbox();
}

void Agreement::publish_stats(CommContext& ctx) { stats_.add_agreement(&ctx.counted); }

}  // namespace hpcdl
