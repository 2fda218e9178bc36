#include "hpcdl/engine.hpp"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <limits>
#include <cstdio>
#include <set>
#include <sstream>

#include "hpcdl/codecs.hpp"
#include "hpcdl/compressed_ring.hpp"
#include "hpcdl/env.hpp"
#include "hpcdl/ring.hpp"
#include "hpcdl/thread_setup.hpp"
#include "hpcdl/timeline.hpp"
#include "hpcdl/topk.hpp"
#include "hpcdl/wire.hpp"

namespace hpcdl {

namespace {

constexpr int kTagReady = 1;  // up the report tree: operations ready in the sender's subtree
constexpr int kTagPlan = 2;   // down the report tree, from the coordinator: what to run, in order
constexpr int kTagData = 3;
constexpr int kTagLeave = 4;  // a rank leaves the communicator (exit, free): to the coordinator, which forwards it

// After a rank has left, a wait of the running operation that has made no
// progress for this long (since the news) is given up: the data that rank
// sent before it left had time to arrive. A ring's requests are cancelled
// then; a collective's cannot be, so it gets longer and then ends the job.
constexpr double kLeftRankRingGraceSeconds = 5.0;
constexpr double kLeftRankCollectiveGraceSeconds = 30.0;
// Operations not yet planned here when the news came are failed only after
// this long with no plan to run: plans the coordinator sent before a rank left
// (it may be the one that left) are still on their way down the report tree.
constexpr double kLeftRankPlanGraceSeconds = 5.0;

enum class PlanResult : std::uint8_t { kRun = 0, kMismatch = 1, kStall = 2, kTimeout = 3 };

// Entries of a ready message.
constexpr std::uint8_t kEntryDescription = 0;  // i32 rank, string: that rank's full description
constexpr std::uint8_t kEntryCached = 1;  // u32 id, i32 first, i32 end: ranks [first, end) report it unchanged

// How long a rank holds its subtree's partial reports of an operation before
// sending them up as they are (rank by rank): a quarter of the stall limits,
// so the coordinator names the missing ranks at most that much later.
double report_hold_seconds(double warn_s, double error_s) {
  double hold = std::numeric_limits<double>::infinity();
  if (warn_s > 0) hold = std::min(hold, warn_s / 4);
  if (error_s > 0) hold = std::min(hold, error_s / 4);
  return hold;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string rank_list(const std::vector<int>& ranks) {
  std::ostringstream os;
  os << (ranks.size() == 1 ? "rank " : "ranks ");
  for (std::size_t i = 0; i < ranks.size(); ++i) os << (i ? ", " : "") << ranks[i];
  return os.str();
}

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
  field("op", [](const OpDesc& d) { return std::string(d.reduce_op == ReduceOp::kSum ? "sum" : "average"); });
  field("root", [](const OpDesc& d) { return std::to_string(d.root); });
  field("chunk_bytes", [](const OpDesc& d) { return std::to_string(d.chunk_bytes); });
  field("compression", [](const OpDesc& d) { return d.codec.empty() ? std::string("none") : d.codec; });
  field("submitting thread", [](const OpDesc& d) { return "'" + d.thread + "'"; });
  return os.str();
}

}  // namespace

const char* op_kind_name(OpKind k) {
  switch (k) {
    case OpKind::kAllreduce: return "allreduce";
    case OpKind::kBroadcast: return "broadcast";
    case OpKind::kBarrier: return "barrier";
  }
  return "?";
}

std::string OpDesc::serialize(const std::string& name) const {
  WireWriter w;
  w.put_string(name);
  w.put<std::int32_t>(static_cast<std::int32_t>(kind));
  w.put<std::int32_t>(static_cast<std::int32_t>(dtype));
  w.put<std::int32_t>(static_cast<std::int32_t>(reduce_op));
  w.put<std::int32_t>(root);
  w.put<std::uint64_t>(count);
  w.put<std::uint64_t>(chunk_bytes);
  w.put_string(codec);
  w.put_string(thread);
  return std::string(w.buffer().begin(), w.buffer().end());
}

bool OpDesc::parse(const std::string& bytes, std::string* name, OpDesc* out) {
  WireReader r(bytes.data(), bytes.size());
  std::int32_t kind, dtype, op;
  if (!r.get_string(name) || !r.get(&kind) || !r.get(&dtype) || !r.get(&op) || !r.get(&out->root) ||
      !r.get(&out->count) || !r.get(&out->chunk_bytes) || !r.get_string(&out->codec) || !r.get_string(&out->thread))
    return false;
  out->kind = static_cast<OpKind>(kind);
  out->dtype = static_cast<DType>(dtype);
  out->reduce_op = static_cast<ReduceOp>(op);
  return true;
}

// ---- Operation ----

bool Operation::done() {
  std::lock_guard<std::mutex> g(mu_);
  return done_;
}

void Operation::mark_ready() {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (ready_) return;
    ready_ = true;
    times_.ready_us = now_us();
  }
  cv_.notify_all();  // the engine, if the plan has reached this operation
  Engine::instance().wake();  // the engine, if it idles until something is ready
}

bool Operation::ready() {
  std::lock_guard<std::mutex> g(mu_);
  return ready_;
}

bool Operation::wait_ready_for(double seconds) {
  std::unique_lock<std::mutex> g(mu_);
  cv_.wait_for(g, std::chrono::duration<double>(seconds), [this] { return ready_; });
  return ready_;
}

bool Operation::wait_for(double seconds) {
  std::unique_lock<std::mutex> g(mu_);
  cv_.wait_for(g, std::chrono::duration<double>(seconds), [this] { return done_; });
  return done_;
}

Status Operation::status() {
  std::lock_guard<std::mutex> g(mu_);
  return status_;
}

std::vector<std::string> Operation::take_notices() {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<std::string> out;
  out.swap(notices_);
  return out;
}

OpTimes Operation::times() {
  std::lock_guard<std::mutex> g(mu_);
  return times_;
}

void Operation::finish(Status st) {
  {
    std::lock_guard<std::mutex> g(mu_);
    if (done_) return;
    status_ = std::move(st);
    times_.finished_us = now_us();
    done_ = true;
  }
  cv_.notify_all();
}

void Operation::notify(std::string message) {
  std::lock_guard<std::mutex> g(mu_);
  notices_.push_back(std::move(message));
}

// ---- CommContext: one user communicator, its two duplicates and the agreement state ----

class CommContext {
 public:
  MPI_Comm ctl = MPI_COMM_NULL, data = MPI_COMM_NULL;
  int rank = 0, size = 1;
  std::uint64_t id = 0;              // never reused: keys error-feedback state
  std::uint64_t compressed_ops = 0;  // engine thread: keys stochastic rounding draws
  std::uint64_t unnamed_seq = 0;  // advanced on submitting threads, under Engine::mu_
  std::set<std::string> in_flight;  // names submitted and not finished, under Engine::mu_
  bool freed = false;               // the user freed the communicator, under Engine::mu_

  // ctl and data are duplicated with MPI_Comm_idup at the first submission
  // (collective: it completes once every rank submitted on the communicator);
  // the engine thread completes it and only then uses them.
  MPI_Request setup[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  bool set_up = false;
  std::chrono::steady_clock::time_point setup_since;
  double setup_warned_at = 0;

  // Engine thread: a rank has left (process exit, freed communicator), and since when.
  Status gone;
  std::chrono::steady_clock::time_point gone_at;

  bool is_coordinator() const { return rank == 0; }

  // Report tree: binomial and rooted at the coordinator (or flat,
  // HPCDL_AGREEMENT_FLAT=1); this rank's subtree is ranks [rank, subtree_end).
  int parent = -1, subtree_end = 1;
  std::vector<int> children;
  void set_tree(bool flat);

  // Cached reports from this rank's subtree, merged until all of it has
  // reported an operation (then one entry goes up) or until they have been
  // held report_hold_seconds (then they go up as they are, and so does what
  // arrives later, so the coordinator can name the ranks missing).
  static constexpr char kByDescription = 1, kById = 2;
  struct Partial {
    std::vector<char> ready;  // [rank - this rank]: 0 not yet, kByDescription or kById
    int count = 0;
    bool any_by_id = false;  // else every rank's description went up: nothing to merge
    std::chrono::steady_clock::time_point first_seen;
    bool released = false;
  };
  std::map<std::uint32_t, Partial> partial;
  WireWriter upward;  // the next ready message to the parent
  std::uint32_t upward_entries = 0;
  AgreementStats counted;  // engine thread: not yet added to the engine's

  // Worker side: operations waiting to run here, by name.
  std::map<std::string, std::shared_ptr<Operation>> pending;
  std::vector<std::string> unreported;
  std::map<std::string, std::uint32_t> ids;
  std::vector<std::string> names_by_id;
  std::map<std::string, std::string> last_reported;  // name -> serialized desc last sent

  // Coordinator side.
  struct Entry {
    std::vector<char> ready;
    int ready_count = 0;
    std::chrono::steady_clock::time_point first_seen;
    double warned_at = 0;  // seconds after first_seen of the last stall warning
  };
  std::map<std::string, std::uint32_t> coord_ids;
  std::vector<std::string> coord_names;
  std::vector<std::vector<std::string>> last_desc;  // [id][rank] serialized desc
  std::vector<char> announced;                      // [id] name already sent in a plan
  std::map<std::uint32_t, Entry> table;

  struct Outgoing {
    MPI_Request req;
    std::vector<char> bytes;
  };
  std::vector<std::unique_ptr<Outgoing>> outbox;

  // Engine thread: plans received (workers) or made (coordinator), not yet
  // run; and an error met reading the control channel during an operation.
  std::deque<std::vector<char>> plans;
  Status control_error;

  Status send(int dest, int tag, std::vector<char> bytes) {
    auto out = std::make_unique<Outgoing>();
    out->bytes = std::move(bytes);
    int rc = MPI_Isend(out->bytes.data(), static_cast<int>(out->bytes.size()), MPI_BYTE, dest, tag, ctl, &out->req);
    HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Isend(control)"));
    outbox.push_back(std::move(out));
    if (tag != kTagLeave) ++counted.messages_sent;
    return Status::OK();
  }

  Status flush_outbox() {
    for (auto it = outbox.begin(); it != outbox.end();) {
      int flag = 0;
      int rc = MPI_Test(&(*it)->req, &flag, MPI_STATUS_IGNORE);
      HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Test(control)"));
      it = flag ? outbox.erase(it) : it + 1;
    }
    return Status::OK();
  }

  // Takes newly submitted operations into this rank's report.
  Status report();
  // Takes a ready message from a child (or this rank's own): the coordinator
  // records it, any other rank merges it into what goes up.
  Status take_report(const char* bytes, std::size_t n, bool own);
  // Worker: the partial reports held long enough go up as they are.
  void release_held(double hold_s);
  // Worker: sends what goes up to the parent, if anything.
  Status send_upward();

  // Coordinator: ranks [first, end) have operation id ready.
  void mark_ready(std::uint32_t id, int first, int end);
  // Worker: ranks [first, end) of this subtree have operation id ready
  // (sent_by_id: reported by id, else by a description already sent up).
  void merge_cached(std::uint32_t id, int first, int end, bool sent_by_id);
  void put_upward_cached(std::uint32_t id, int first, int end);
  // Coordinator: plan what is complete, warn about what stalls.
  void plan(double warn_s, double error_s, WireWriter* w, std::uint32_t* entries);
};

void CommContext::set_tree(bool flat) {
  if (flat) {
    parent = rank == 0 ? -1 : 0;
    subtree_end = rank == 0 ? size : rank + 1;
    for (int r = 1; rank == 0 && r < size; ++r) children.push_back(r);
    return;
  }
  // Rank r's parent clears r's lowest set bit; r's subtree spans that bit.
  int span = 1;
  if (rank == 0) {
    while (span < size) span <<= 1;
  } else {
    span = rank & -rank;
    parent = rank - span;
  }
  subtree_end = std::min(size, rank + span);
  for (int step = 1; step < span && rank + step < size; step <<= 1) children.push_back(rank + step);
}

Status CommContext::report() {
  if (unreported.empty()) return Status::OK();
  WireWriter w;
  w.put<std::uint32_t>(static_cast<std::uint32_t>(unreported.size()));
  for (const std::string& name : unreported) {
    const std::string desc = pending.at(name)->req_.desc.serialize(name);
    auto id = ids.find(name);
    auto last = last_reported.find(name);
    if (id != ids.end() && last != last_reported.end() && last->second == desc) {
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
      ++e.ready_count;
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
  // Entries completed in the same cycle run in id order: only the coordinator
  // decides, so every rank gets the same order.
  for (auto it = table.begin(); it != table.end();) {
    const std::uint32_t id = it->first;
    Entry& e = it->second;
    if (e.ready_count == size) {
      std::vector<OpDesc> descs(size);
      bool same = true;
      for (int r = 0; r < size; ++r) {
        std::string name;
        OpDesc::parse(last_desc[id][r], &name, &descs[r]);
        same = same && last_desc[id][r] == last_desc[id][0];
      }
      if (same) {
        put_entry(id, PlanResult::kRun, "");
      } else {
        put_entry(id, PlanResult::kMismatch,
                  "hpcdl: ranks disagree on operation '" + coord_names[id] + "': " + describe_disagreement(descs));
      }
      it = table.erase(it);
      continue;
    }
    const double waited = seconds_since(e.first_seen);
    std::vector<int> missing;
    for (int r = 0; r < size; ++r)
      if (!e.ready[r]) missing.push_back(r);
    if (error_s > 0 && waited >= error_s) {
      put_entry(id, PlanResult::kTimeout,
                "hpcdl: operation '" + coord_names[id] + "' was never submitted by " + rank_list(missing) +
                    " (gave up after " + std::to_string(static_cast<int>(waited)) + " s)");
      it = table.erase(it);
      continue;
    }
    if (warn_s > 0 && waited >= warn_s && waited - e.warned_at >= warn_s) {
      e.warned_at = waited;
      std::ostringstream os;
      os << "hpcdl: operation '" << coord_names[id] << "' has waited " << static_cast<int>(waited)
         << " s for " << rank_list(missing) << ", which have not submitted it (ready on "
         << e.ready_count << " of " << size << " ranks)";
      put_entry(id, PlanResult::kStall, os.str());
    }
    ++it;
  }
}

// ---- Engine ----

Engine& Engine::instance() {
  static Engine* engine = new Engine();  // never destroyed: outlives static teardown order
  return *engine;
}

void Engine::wake() {
  {
    std::lock_guard<std::mutex> g(mu_);
    ++wakeups_;
  }
  cv_.notify_one();
}

void Engine::set_stall_limits(double warn_seconds, double error_seconds) {
  std::lock_guard<std::mutex> g(mu_);
  stall_warn_s_ = warn_seconds;
  stall_error_s_ = error_seconds;
}

Status Engine::context_for(MPI_Comm comm, std::shared_ptr<CommContext>* out) {
  int rc;
  if (keyval_ == MPI_KEYVAL_INVALID) {
    rc = MPI_Comm_create_keyval(MPI_COMM_NULL_COPY_FN, &Engine::on_comm_freed, &keyval_, this);
    HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_create_keyval"));
  }
  void* attr = nullptr;
  int found = 0;
  rc = MPI_Comm_get_attr(comm, keyval_, &attr, &found);
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_get_attr"));
  if (found) {
    for (auto& c : contexts_)
      if (c.get() == attr) *out = c;
    if (*out) return Status::OK();
  }
  // Started here, in the caller's program order among its own collectives on
  // comm; never waited for here: a rank that submits later must not block
  // this one (nor the engine, which runs what is already agreed meanwhile).
  auto ctx = std::make_shared<CommContext>();
  rc = MPI_Comm_idup(comm, &ctx->ctl, &ctx->setup[0]);
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_idup"));
  rc = MPI_Comm_idup(comm, &ctx->data, &ctx->setup[1]);
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_idup"));
  ctx->setup_since = std::chrono::steady_clock::now();
  MPI_Comm_rank(comm, &ctx->rank);
  MPI_Comm_size(comm, &ctx->size);
  ctx->set_tree(agreement_flat());
  ctx->id = next_context_id_++;
  rc = MPI_Comm_set_attr(comm, keyval_, ctx.get());
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Comm_set_attr"));
  *out = ctx;
  contexts_.push_back(std::move(ctx));
  return Status::OK();
}

// Called by MPI when the user frees a communicator hpcdl has used: the engine
// thread cancels what is still pending on it and drops the context.
int Engine::on_comm_freed(MPI_Comm, int, void* context, void* extra_state) {
  Engine* engine = static_cast<Engine*>(extra_state);
  {
    std::lock_guard<std::mutex> g(engine->mu_);
    static_cast<CommContext*>(context)->freed = true;
  }
  engine->wake();
  return MPI_SUCCESS;
}

Status Engine::submit(MPI_Comm comm, OpRequest req, std::shared_ptr<Operation>* out) {
  HPCDL_RETURN_NOT_OK(require_thread_multiple("hpcdl", "its engine thread makes MPI calls while yours do"));
  if (comm == MPI_COMM_NULL) return Status::Invalid("communicator is MPI_COMM_NULL");
  const OpDesc& d = req.desc;
  if (d.kind == OpKind::kAllreduce && d.reduce_op == ReduceOp::kAverage && !dtype_is_float(d.dtype))
    return Status::Invalid(std::string("op='average' needs a floating-point dtype, got ") + dtype_name(d.dtype));
  if (d.kind == OpKind::kAllreduce && (d.chunk_bytes < 64 || d.chunk_bytes > kMaxChunkBytes))
    return Status::Invalid("chunk_bytes must be between 64 and 2^30, got " + std::to_string(d.chunk_bytes));
  if (d.kind == OpKind::kAllreduce && !d.codec.empty()) {
    CodecSpec spec;
    HPCDL_RETURN_NOT_OK(parse_codec(d.codec, &spec));
    HPCDL_RETURN_NOT_OK(check_codec_dtype(spec, d.codec, d.dtype));
    if (spec.kind == CodecKind::kTopK && d.count > std::numeric_limits<std::uint32_t>::max())
      return Status::Invalid("top-k sends uint32 indices: at most 2^32 - 1 elements, got " + std::to_string(d.count));
  }

  std::lock_guard<std::mutex> g(mu_);
  if (stopped_) return Status::Cancelled("hpcdl's engine has shut down (interpreter exit)");
  std::shared_ptr<CommContext> ctx;
  HPCDL_RETURN_NOT_OK(context_for(comm, &ctx));
  if (d.kind == OpKind::kBroadcast && (d.root < 0 || d.root >= ctx->size))
    return Status::Invalid("root " + std::to_string(d.root) + " is not a rank of a communicator of size " +
                           std::to_string(ctx->size));
  std::string name = req.name.empty() ? "op#" + std::to_string(ctx->unnamed_seq++) : req.name;
  if (ctx->in_flight.count(name))
    return Status::Invalid("an operation named '" + name + "' is already in flight on this communicator");
  ctx->in_flight.insert(name);
  auto op = std::make_shared<Operation>(name, std::move(req));
  op->times_.submitted_us = now_us();
  if (op->ready_) op->times_.ready_us = op->times_.submitted_us;
  queue_.emplace_back(ctx, op);
  if (!running_) {
    running_ = true;
    thread_ = std::thread([this] { loop(); });
  }
  cv_.notify_one();
  *out = std::move(op);
  return Status::OK();
}

bool Engine::drain_submissions() {
  std::vector<std::pair<std::shared_ptr<CommContext>, std::shared_ptr<Operation>>> batch;
  {
    std::lock_guard<std::mutex> g(mu_);
    batch.swap(queue_);
  }
  for (auto& item : batch) {
    item.first->pending.emplace(item.second->name(), item.second);
    // A context a rank has left reports nothing more: the loop fails what is pending there.
    if (item.first->gone.ok()) item.first->unreported.push_back(item.second->name());
  }
  return !batch.empty();
}

void Engine::record(const Operation& op, const RingTraffic& traffic, double seconds) {
  const OpDesc& d = op.req_.desc;
  const std::string kind = op_kind_name(d.kind);
  const std::string codec = d.kind == OpKind::kAllreduce ? (d.codec.empty() ? "none" : d.codec) : "";
  std::lock_guard<std::mutex> g(stats_mu_);
  EngineStats& s = stats_[{kind, codec}];
  s.kind = kind;
  s.codec = codec;
  s.ops += 1;
  s.bytes_sent += traffic.bytes_sent;
  s.bytes_received += traffic.bytes_received;
  s.dense_bytes += traffic.dense_bytes;
  s.seconds += seconds;
}

std::vector<EngineStats> Engine::stats() {
  std::lock_guard<std::mutex> g(stats_mu_);
  std::vector<EngineStats> out;
  for (auto& kv : stats_) out.push_back(kv.second);
  return out;
}

AgreementStats Engine::agreement_stats() {
  std::lock_guard<std::mutex> g(stats_mu_);
  return agreement_stats_;
}

void Engine::reset_stats() {
  std::lock_guard<std::mutex> g(stats_mu_);
  stats_.clear();
  agreement_stats_ = AgreementStats();
}

void Engine::reset_compression_state() {
  std::lock_guard<std::mutex> g(residual_mu_);
  residuals_.clear();
}

Status Engine::copy_residual(MPI_Comm comm, const std::string& name, std::vector<float>* out, bool* found) {
  *found = false;
  // Look the context up only: making one is collective (MPI_Comm_dup).
  std::uint64_t id = 0;
  {
    std::lock_guard<std::mutex> g(mu_);
    if (keyval_ == MPI_KEYVAL_INVALID) return Status::OK();
    void* attr = nullptr;
    int has = 0;
    HPCDL_RETURN_NOT_OK(mpi_status(MPI_Comm_get_attr(comm, keyval_, &attr, &has), "MPI_Comm_get_attr"));
    if (!has) return Status::OK();
    id = static_cast<CommContext*>(attr)->id;
  }
  std::lock_guard<std::mutex> g(residual_mu_);
  auto it = residuals_.find({id, name});
  if (it == residuals_.end()) return Status::OK();
  *out = *it->second;
  *found = true;
  return Status::OK();
}

std::shared_ptr<std::vector<float>> Engine::residual_for(std::uint64_t context_id, const std::string& name,
                                                         std::size_t count) {
  std::lock_guard<std::mutex> g(residual_mu_);
  auto& slot = residuals_[{context_id, name}];
  if (!slot || slot->size() != count) slot = std::make_shared<std::vector<float>>(count, 0.0f);
  return slot;
}

// A compressed allreduce (p > 1) with the codec's scheme; named tensors keep
// an error-feedback residual, which the scheme adds where it first touches
// each element (no separate pass over the tensor).
Status Engine::run_compressed(CommContext& ctx, Operation& op, RingTraffic* traffic) {
  const OpDesc& d = op.req_.desc;
  CodecSpec spec;
  HPCDL_RETURN_NOT_OK(parse_codec(d.codec, &spec));
  float* data = static_cast<float*>(op.req_.data);
  const std::size_t n = d.count;
  const double scale = d.reduce_op == ReduceOp::kAverage ? 1.0 / ctx.size : 1.0;
  std::shared_ptr<std::vector<float>> residual;  // kept alive even if reset_state() runs meanwhile
  if (!op.req_.name.empty()) residual = residual_for(ctx.id, op.req_.name, n);
  float* res = residual ? residual->data() : nullptr;
  RingPlan plan(ctx.size, ctx.rank, n, sizeof(float), d.chunk_bytes);
  traffic->dense_bytes = plan.dense_bytes_sent();
  const std::uint64_t stream = mix64((ctx.compressed_ops++ << 20) ^ static_cast<std::uint64_t>(ctx.rank)) << 32;
  switch (spec.kind) {
    case CodecKind::kInt8: {
      Int8Codec codec(spec);
      CompressedRingPolicy<Int8Codec> policy(plan, data, codec, scale, res, stream, ring_scratch_);
      return run_ring(plan, policy, ctx.data, kTagData, traffic);
    }
    case CodecKind::kFp16: {
      Fp16Codec codec(spec);
      CompressedRingPolicy<Fp16Codec> policy(plan, data, codec, scale, res, stream, ring_scratch_);
      return run_ring(plan, policy, ctx.data, kTagData, traffic);
    }
    case CodecKind::kBf16: {
      Bf16Codec codec(spec);
      CompressedRingPolicy<Bf16Codec> policy(plan, data, codec, scale, res, stream, ring_scratch_);
      return run_ring(plan, policy, ctx.data, kTagData, traffic);
    }
    case CodecKind::kTopK:
      executing_cancellable_ = false;  // both variants run MPI collectives, which cannot be cancelled
      if (topk_use_split(spec.topk_algorithm, ctx.size, n, topk_count(n, spec.ratio)))
        return topk_split_allreduce(ctx.data, ctx.size, ctx.rank, data, n, spec.ratio, scale, res, traffic,
                                    topk_scratch_, split_scratch_);
      return topk_allreduce(ctx.data, ctx.size, data, n, spec.ratio, scale, res, traffic, topk_scratch_);
    case CodecKind::kNone:
      break;
  }
  return Status::Internal("run_compressed without a codec");
}

Status Engine::execute(CommContext& ctx, Operation& op) {
  const OpDesc& d = op.req_.desc;
  const double t0 = MPI_Wtime();
  const double start_us = now_us();
  {
    std::lock_guard<std::mutex> g(op.mu_);
    op.times_.started_us = start_us;
  }
  Status st;
  RingTraffic traffic;
  executing_ = &ctx;
  executing_cancellable_ = d.kind == OpKind::kAllreduce;  // a ring's point-to-point requests can be cancelled
  if (d.kind == OpKind::kAllreduce) {
    const double scale = d.reduce_op == ReduceOp::kAverage ? 1.0 / ctx.size : 1.0;
    if (ctx.size == 1) {
      scale_buffer(d.dtype, op.req_.data, d.count, scale);
    } else if (!d.codec.empty()) {
      st = run_compressed(ctx, op, &traffic);
    } else {
      RingPlan plan(ctx.size, ctx.rank, d.count, dtype_size(d.dtype), d.chunk_bytes);
      DenseRingPolicy policy(plan, op.req_.data, d.dtype, scale);
      traffic.dense_bytes = plan.dense_bytes_sent();
      st = run_ring(plan, policy, ctx.data, kTagData, &traffic);
    }
  } else if (d.kind == OpKind::kBroadcast) {
    const std::size_t total = d.count * dtype_size(d.dtype);
    char* p = static_cast<char*>(op.req_.data);
    for (std::size_t off = 0; off < total && st.ok(); off += kMaxChunkBytes) {
      const int n = static_cast<int>(std::min(kMaxChunkBytes, total - off));
      MPI_Request request;
      st = mpi_status(MPI_Ibcast(p + off, n, MPI_BYTE, d.root, ctx.data, &request), "MPI_Ibcast");
      if (st.ok()) st = mpi_status(wait_politely(&request, MPI_STATUS_IGNORE), "MPI_Wait(broadcast)");
      if (ctx.rank == d.root) traffic.bytes_sent += n; else traffic.bytes_received += n;
    }
  }
  // A barrier needs nothing more: it ran because every rank had entered it.
  executing_ = nullptr;
  const double end_us = now_us();
  {
    std::lock_guard<std::mutex> g(op.mu_);
    op.times_.reduce_scatter_end_us =
        traffic.reduce_scatter_end > 0 ? start_us + (traffic.reduce_scatter_end - t0) * 1e6 : 0;
  }
  record(op, traffic, MPI_Wtime() - t0);
  Timeline& tl = Timeline::instance();
  if (tl.enabled()) {
    const OpTimes t = op.times();
    // A deferred operation's wait for its data is not negotiation: its own span.
    if (op.req_.deferred) tl.record(op.name(), "deferred", t.submitted_us, t.ready_us, 0);
    tl.record(op.name(), "negotiate", op.req_.deferred ? t.ready_us : t.submitted_us, start_us, 0);
    if (t.reduce_scatter_end_us > 0) {
      tl.record(op.name(), "reduce_scatter", start_us, t.reduce_scatter_end_us, 0);
      tl.record(op.name(), "allgather", t.reduce_scatter_end_us, end_us, 0);
    } else {
      tl.record(op.name(), op_kind_name(d.kind), start_us, end_us, 0);
    }
  }
  return st;
}

Status Engine::poll_control(CommContext& ctx, bool stall_check, double warn_s, double error_s, bool* busy) {
  const bool reported = !ctx.unreported.empty();
  HPCDL_RETURN_NOT_OK(ctx.report());
  bool arrived = false;
  for (;;) {
    int flag = 0;
    MPI_Status probe;
    HPCDL_RETURN_NOT_OK(mpi_status(MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, ctx.ctl, &flag, &probe), "MPI_Iprobe"));
    if (!flag) break;
    int n = 0;
    MPI_Get_count(&probe, MPI_BYTE, &n);
    control_msg_.resize(static_cast<std::size_t>(n));
    HPCDL_RETURN_NOT_OK(mpi_status(MPI_Recv(control_msg_.data(), n, MPI_BYTE, probe.MPI_SOURCE, probe.MPI_TAG,
                                            ctx.ctl, MPI_STATUS_IGNORE),
                                   "MPI_Recv(control)"));
    arrived = true;
    if (probe.MPI_TAG != kTagLeave) ++ctx.counted.messages_received;
    if (probe.MPI_TAG == kTagLeave) {
      if (ctx.gone.ok()) {
        WireReader r(control_msg_.data(), control_msg_.size());
        std::int32_t rank = -1, world_rank = -1;
        std::string why;
        r.get(&rank);
        r.get(&world_rank);
        r.get_string(&why);
        ctx.gone = Status::Cancelled("hpcdl: rank " + std::to_string(rank) + " of the communicator (rank " +
                                     std::to_string(world_rank) + " of COMM_WORLD) left: " + why +
                                     "; operations on this communicator cannot complete");
        ctx.gone_at = std::chrono::steady_clock::now();
        ctx.table.clear();
        ctx.partial.clear();
        // Said here too: the caller may catch the error its operations get.
        if (!ctx.pending.empty() || executing_ == &ctx)
          std::fprintf(stderr, "[hpcdl rank %d] %s\n", ctx.rank, ctx.gone.message().c_str());
        // First news of it at the coordinator: tell everyone else, once.
        if (ctx.is_coordinator())
          for (int r2 = 1; r2 < ctx.size; ++r2)
            if (r2 != probe.MPI_SOURCE) HPCDL_RETURN_NOT_OK(ctx.send(r2, kTagLeave, control_msg_));
      }
      continue;
    }
    if (probe.MPI_TAG == kTagReady) {
      HPCDL_RETURN_NOT_OK(ctx.take_report(control_msg_.data(), control_msg_.size(), false));
    } else if (probe.MPI_TAG == kTagPlan) {
      for (int child : ctx.children) HPCDL_RETURN_NOT_OK(ctx.send(child, kTagPlan, control_msg_));
      ctx.plans.push_back(control_msg_);
    }
  }
  *busy = *busy || arrived || reported;
  if (!ctx.is_coordinator() && ctx.gone.ok()) {
    ctx.release_held(report_hold_seconds(warn_s, error_s));
    HPCDL_RETURN_NOT_OK(ctx.send_upward());
  }
  if (ctx.is_coordinator() && ctx.gone.ok() && (arrived || reported || stall_check) && !ctx.table.empty()) {
    WireWriter w;
    std::uint32_t entries = 0;
    w.put<std::uint32_t>(0);
    ctx.plan(warn_s, error_s, &w, &entries);
    if (entries) {
      std::memcpy(w.buffer().data(), &entries, sizeof(entries));
      for (int child : ctx.children) HPCDL_RETURN_NOT_OK(ctx.send(child, kTagPlan, w.buffer()));
      ctx.plans.push_back(std::move(w.buffer()));
    }
  }
  publish_agreement_stats(ctx);
  return ctx.flush_outbox();
}

void Engine::publish_agreement_stats(CommContext& ctx) {
  AgreementStats& c = ctx.counted;
  if (c.messages_sent + c.messages_received == 0) return;
  {
    std::lock_guard<std::mutex> g(stats_mu_);
    agreement_stats_.messages_sent += c.messages_sent;
    agreement_stats_.messages_received += c.messages_received;
    agreement_stats_.entries_received += c.entries_received;
    agreement_stats_.descriptions_received += c.descriptions_received;
  }
  c = AgreementStats();
}

Status Engine::run_plans(CommContext& ctx) {
  while (!ctx.plans.empty() && ctx.control_error.ok()) {
    // Taken off the queue first: running an entry may queue the next plans.
    std::vector<char> plan = std::move(ctx.plans.front());
    ctx.plans.pop_front();
    WireReader r(plan.data(), plan.size());
    std::uint32_t entries = 0;
    r.get(&entries);
    for (std::uint32_t i = 0; i < entries; ++i) {
      std::uint32_t id = 0;
      std::uint8_t result = 0, with_name = 0;
      std::string name, message;
      r.get(&id);
      r.get(&result);
      r.get(&with_name);
      if (with_name) {
        r.get_string(&name);
      } else if (id < ctx.names_by_id.size()) {
        name = ctx.names_by_id[id];
      }
      if (static_cast<PlanResult>(result) == PlanResult::kRun) {
        if (id >= ctx.names_by_id.size()) ctx.names_by_id.resize(id + 1);
        ctx.names_by_id[id] = name;
        ctx.ids[name] = id;
      } else {
        r.get_string(&message);
      }
      auto it = ctx.pending.find(name);
      if (it == ctx.pending.end()) continue;  // a stall notice for an op this rank never submitted
      std::shared_ptr<Operation> op = it->second;
      if (static_cast<PlanResult>(result) == PlanResult::kStall) {
        op->notify(message);
        continue;
      }
      ctx.pending.erase(it);
      Status st;
      if (static_cast<PlanResult>(result) == PlanResult::kRun) {
        {
          std::lock_guard<std::mutex> g(op->mu_);
          op->times_.agreed_us = now_us();
        }
        st = await_ready(ctx, *op);
        if (st.ok()) st = execute(ctx, *op);
        if (!st.ok() && !ctx.gone.ok()) st = ctx.gone;  // abandoned because a rank left: say which
      } else {
        ctx.last_reported.erase(name);  // report it in full next time
        st = static_cast<PlanResult>(result) == PlanResult::kTimeout ? Status::Timeout(message)
                                                                     : Status::Mismatch(message);
      }
      {
        // Retire the name before the waiter wakes: its next step may reuse it at once.
        std::lock_guard<std::mutex> g(mu_);
        ctx.in_flight.erase(name);
      }
      op->finish(st);
    }
  }
  return ctx.control_error;
}

// The other ranks wait in this operation's ring meanwhile; the control
// channel is still read, so later operations are agreed.
Status Engine::await_ready(CommContext& ctx, Operation& op) {
  const auto since = std::chrono::steady_clock::now();
  double warned_at = 0;
  // Its data comes from the caller's computation: wake rarely meanwhile.
  while (!op.wait_ready_for(0.02)) {
    if (wait_hook != nullptr) (*wait_hook)(0);
    if (!ctx.gone.ok()) return ctx.gone;
    double warn_s;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!running_) return Status::Cancelled("hpcdl's engine shut down before '" + op.name() + "' was marked ready");
      warn_s = stall_warn_s_;
    }
    const double waited = seconds_since(since);
    if (warn_s > 0 && waited - warned_at >= warn_s) {
      warned_at = waited;
      std::fprintf(stderr,
                   "[hpcdl rank %d] deferred operation '%s' is agreed on every rank but has waited %d s for "
                   "mark_ready() here; the other ranks wait in its ring\n",
                   ctx.rank, op.name().c_str(), static_cast<int>(waited));
    }
  }
  return Status::OK();
}

Status Engine::finish_setup(CommContext& ctx, double warn_s, double error_s) {
  int flag = 0;
  HPCDL_RETURN_NOT_OK(mpi_status(MPI_Testall(2, ctx.setup, &flag, MPI_STATUSES_IGNORE), "MPI_Comm_idup"));
  if (flag) {
    MPI_Comm_set_errhandler(ctx.ctl, MPI_ERRORS_RETURN);
    MPI_Comm_set_errhandler(ctx.data, MPI_ERRORS_RETURN);
    ctx.set_up = true;
    return Status::OK();
  }
  // Until every rank has submitted its first operation here, no operation on
  // this communicator can be reported, so the coordinator cannot name the late
  // ranks: the waiting ranks warn (or fail) on their own.
  const double waited = seconds_since(ctx.setup_since);
  const std::string what = " for the other ranks to submit their first operation on this communicator "
                           "(hpcdl sets up its channels with the first operation every rank submits on it)";
  if (error_s > 0 && waited >= error_s) {
    for (auto& kv : ctx.pending)
      kv.second->finish(Status::Timeout("hpcdl: operation '" + kv.first + "' waited " +
                                        std::to_string(static_cast<int>(waited)) + " s" + what));
    ctx.pending.clear();
    std::lock_guard<std::mutex> g(mu_);
    ctx.in_flight.clear();
  } else if (warn_s > 0 && waited >= warn_s && waited - ctx.setup_warned_at >= warn_s) {
    ctx.setup_warned_at = waited;
    for (auto& kv : ctx.pending)
      kv.second->notify("hpcdl: operation '" + kv.first + "' has waited " + std::to_string(static_cast<int>(waited)) +
                        " s" + what);
  }
  return Status::OK();
}

void Engine::announce_leaving(CommContext& ctx, const std::string& why) {
  if (!ctx.set_up || ctx.size < 2) return;
  int world_rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
  WireWriter w;
  w.put<std::int32_t>(ctx.rank);
  w.put<std::int32_t>(world_rank);
  w.put_string(why);
  // The coordinator tells every rank; anyone else tells the coordinator, which forwards it.
  for (int r = 0; r < ctx.size; ++r)
    if (r != ctx.rank && (ctx.is_coordinator() || r == 0)) ctx.send(r, kTagLeave, w.buffer());
  // Small messages leave at once; a rank already gone must not hold this one up.
  const auto since = std::chrono::steady_clock::now();
  while (!ctx.outbox.empty() && seconds_since(since) < 1.0 && ctx.flush_outbox().ok())
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  for (auto& out : ctx.outbox) {
    MPI_Request_free(&out->req);
    out.release();  // MPI may still read its bytes: a few bytes kept for good
  }
  ctx.outbox.clear();
}

void Engine::fail_context(CommContext& ctx, const Status& st) {
  std::fprintf(stderr, "[hpcdl rank %d] engine error: %s\n", ctx.rank, st.message().c_str());
  fail_pending(ctx, st);
}

void Engine::fail_pending(CommContext& ctx, const Status& st) {
  for (auto& kv : ctx.pending) kv.second->finish(st);
  ctx.pending.clear();
  ctx.plans.clear();
  ctx.control_error = Status::OK();  // delivered: later operations meet their own errors, not this one
  std::lock_guard<std::mutex> g(mu_);
  ctx.in_flight.clear();
}

void Engine::loop() {
  name_this_thread("hpcdl-engine");
  request_short_slice(engine_slice_us());
  auto idle = std::chrono::microseconds(20);
  auto last_plan = std::chrono::steady_clock::now();
  for (;;) {
    bool busy = drain_submissions();
    double warn_s, error_s;
    std::vector<std::shared_ptr<CommContext>> contexts, freed;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!running_) break;
      warn_s = stall_warn_s_;
      error_s = stall_error_s_;
      for (auto& c : contexts_) (c->freed ? freed : contexts).push_back(c);
      contexts_ = contexts;
    }
    std::vector<std::shared_ptr<CommContext>> freed_during_setup;
    for (auto& ctx : freed) {
      {
        std::lock_guard<std::mutex> g(residual_mu_);
        for (auto it = residuals_.begin(); it != residuals_.end();)
          it = it->first.first == ctx->id ? residuals_.erase(it) : std::next(it);
      }
      // The other ranks may wait for these in their rings or agreement: tell them.
      if (!ctx->pending.empty()) announce_leaving(*ctx, "it freed the communicator with operations in flight");
      for (auto& kv : ctx->pending)
        kv.second->finish(Status::Cancelled("the communicator of '" + kv.first + "' was freed before it ran"));
      ctx->pending.clear();
      int set_up = ctx->set_up;
      if (!set_up) MPI_Testall(2, ctx->setup, &set_up, MPI_STATUSES_IGNORE);
      if (!set_up) {  // the duplicates exist only once the idup completes
        freed_during_setup.push_back(ctx);
        continue;
      }
      MPI_Comm_free(&ctx->ctl);
      MPI_Comm_free(&ctx->data);
    }
    if (!freed_during_setup.empty()) {
      std::lock_guard<std::mutex> g(mu_);
      contexts_.insert(contexts_.end(), freed_during_setup.begin(), freed_during_setup.end());
    }
    const bool stall_check = seconds_since(last_plan) > 0.1;
    bool unused_busy = false;
    auto last_agreed = std::chrono::steady_clock::time_point{};
    // A poll a millisecond agrees the next operation long before a ring
    // ends; every poll more is MPI progress on a core the ranks share. A rank
    // with children in the report tree polls every 200 us: its subtree's
    // reports and plans wait for its polls.
    bool forwards = false;
    for (auto& ctx : contexts) forwards = forwards || !ctx->children.empty();
    const auto agree_every = std::chrono::microseconds(forwards ? 200 : 1000);
    std::function<bool(double)> agree_meanwhile = [&](double waited_s) {
      const auto now = std::chrono::steady_clock::now();
      if (now - last_agreed >= agree_every) {
        last_agreed = now;
        drain_submissions();
        for (auto& ctx : contexts)
          if (ctx->set_up && ctx->control_error.ok())
            ctx->control_error = poll_control(*ctx, false, warn_s, error_s, &unused_busy);
      }
      // A rank of the running operation left, and this wait stopped progressing.
      CommContext* running = executing_;
      if (running == nullptr || running->gone.ok()) return true;
      const double stuck_s = std::min(waited_s, seconds_since(running->gone_at));
      if (stuck_s < (executing_cancellable_ ? kLeftRankRingGraceSeconds : kLeftRankCollectiveGraceSeconds))
        return true;
      if (executing_cancellable_) return false;
      abort_job(running->gone.message());  // a collective request can be neither cancelled nor freed
    };
    wait_hook = &agree_meanwhile;
    for (auto& ctx : contexts) {
      if (!ctx->set_up) {
        Status st = finish_setup(*ctx, warn_s, error_s);
        if (!st.ok()) fail_context(*ctx, st);
        if (!ctx->set_up) continue;
      }
      Status st = poll_control(*ctx, stall_check, warn_s, error_s, &busy);
      if (st.ok()) {
        busy = busy || !ctx->plans.empty();
        st = run_plans(*ctx);
      }
      if (!st.ok()) {
        fail_context(*ctx, st);
      } else if (!ctx->gone.ok() && !ctx->pending.empty() && ctx->plans.empty() &&
                 seconds_since(ctx->gone_at) >= kLeftRankPlanGraceSeconds) {
        fail_pending(*ctx, ctx->gone);  // what waits for the rank that left
      }
    }
    wait_hook = nullptr;
    for (auto& ctx : contexts) busy = busy || !ctx->plans.empty();
    if (stall_check) last_plan = std::chrono::steady_clock::now();
    if (busy) {
      idle = std::chrono::microseconds(20);
      continue;
    }
    // Someone waits for a plan: poll the control channel as a waiting ring
    // does (every few polls cost the ranks still computing a share of the
    // node's cores); so does a control message MPI has not sent yet. Nothing
    // ready here: no plan can run before this rank's data is in place
    // (a submission or mark_ready() wakes the loop at once), so poll only for
    // the stall checks, every 20 ms (at 1 ms the idle engine took ~6 ms of
    // CPU per 200 ms training step from the forward pass on 4 ranks per 2
    // cores). A deferred operation was reported when submitted: until it is
    // marked ready its round needs no polls on cores computing its data.
    std::uint64_t seen_wakeups;
    {
      std::lock_guard<std::mutex> g(mu_);
      seen_wakeups = wakeups_;
    }
    bool waiting = false;
    for (auto& ctx : contexts) {
      waiting = waiting || !ctx->outbox.empty() || (!ctx->set_up && !ctx->pending.empty());
      for (auto& kv : ctx->pending) waiting = waiting || kv.second->ready();
    }
    const auto max_idle = std::chrono::microseconds(waiting ? std::clamp(wait_sleep_cap_us(), 1L, 1000L) : 20000);
    // From 20 us when something just became ready (a wake() ends a 20 ms sleep).
    idle = waiting ? std::min(idle, max_idle) : max_idle;
    std::unique_lock<std::mutex> g(mu_);
    const bool woken = cv_.wait_for(g, idle, [&] { return !queue_.empty() || !running_ || wakeups_ != seen_wakeups; });
    idle = woken ? std::chrono::microseconds(20) : std::min(idle * 2, max_idle);
  }
  // Shutting down: whatever has not run never will, and the other ranks may
  // wait for this one (in an operation it never submitted, or one it
  // cancels here): tell them, so they fail instead of waiting forever.
  drain_submissions();
  std::vector<std::shared_ptr<CommContext>> contexts;
  {
    std::lock_guard<std::mutex> g(mu_);
    contexts = contexts_;
  }
  for (auto& ctx : contexts) {
    for (auto& op : ctx->pending)
      op.second->finish(Status::Cancelled("hpcdl's engine shut down before '" + op.first + "' ran"));
    ctx->pending.clear();
    if (!ctx->freed) announce_leaving(*ctx, "its process exited (its engine shut down at interpreter exit)");
  }
  std::lock_guard<std::mutex> g(mu_);
  for (auto& ctx : contexts_) ctx->in_flight.clear();
}

void Engine::shutdown() {
  {
    std::lock_guard<std::mutex> g(mu_);
    stopped_ = true;
    if (!running_) return;
    running_ = false;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

}  // namespace hpcdl
