// CommContext: hpcdl's state for one user communicator: its two duplicates
// (control and data, made with MPI_Comm_idup at the first submission), the
// agreement state of the report tree (src/engine/agreement.cc) and the news
// of a rank that left. It lives as an MPI attribute of the user's
// communicator (ContextRegistry); the engine thread alone uses its MPI state.
#pragma once

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "hpcdl/engine/operation.hpp"
#include "hpcdl/engine/stats.hpp"
#include "hpcdl/engine/transfers.hpp"
#include "hpcdl/util/status.hpp"
#include "hpcdl/util/wire.hpp"

namespace hpcdl {

inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// How long the coordinator holds the first leave notice before forwarding it (CommContext::left).
constexpr auto kLeaveForwardDelay = std::chrono::milliseconds(1000);

class CommContext {
 public:
  MPI_Comm ctl = MPI_COMM_NULL, data = MPI_COMM_NULL;
  MPI_Comm user = MPI_COMM_NULL;  // the caller's own: point-to-point transfers go on it
  int rank = 0, size = 1;
  std::uint64_t id = 0;              // never reused: keys error-feedback state
  std::uint64_t compressed_ops = 0;  // engine thread: keys stochastic rounding draws
  std::uint64_t unnamed_seq = 0;     // advanced on submitting threads, under the submission queue's mutex
  std::set<std::string> in_flight;   // names submitted and not finished, under the submission queue's mutex
  // The user freed the communicator. Atomic: MPI calls on_comm_freed inside any MPI call that releases
  // it, on any thread, also while another holds the submission queue's mutex (ContextRegistry).
  std::atomic<bool> freed{false};

  // ctl and data are duplicated with MPI_Comm_idup at the first submission
  // (collective: it completes once every rank submitted on the communicator);
  // the engine thread completes it and only then uses them.
  MPI_Request setup[2] = {MPI_REQUEST_NULL, MPI_REQUEST_NULL};
  std::atomic<bool> set_up{false};  // written by the engine thread; read by on_comm_freed too
  std::chrono::steady_clock::time_point setup_since;
  double setup_warned_at = 0;

  // Engine thread: a rank has left (process exit, freed communicator), and since when.
  Status gone;
  std::chrono::steady_clock::time_point gone_at;
  // Engine thread: [rank] sent a leave notice. send() sends nothing more to such a rank:
  // once it is in MPI_Finalize or ended, an MPI_Isend to it can block in connect() for good (ofi/tcp).
  std::vector<char> left;
  bool has_left(int r) const { return !left.empty() && left[static_cast<std::size_t>(r)]; }
  // Coordinator: the first leave notice, forwarded once kLeaveForwardDelay has passed to
  // the ranks whose own notice has not come meanwhile (at a job's end: none of them).
  std::vector<char> leave_to_forward;
  int leave_source = -1;
  std::chrono::steady_clock::time_point leave_forward_at;

  bool is_coordinator() const { return rank == 0; }

  // Report tree: k-nomial of the given radix and rooted at the coordinator
  // (HPCDL_AGREEMENT_RADIX; flat with HPCDL_AGREEMENT_FLAT=1); this rank's
  // subtree is ranks [rank, subtree_end).
  int parent = -1, subtree_end = 1;
  std::vector<int> children;
  void set_tree(long radix);

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

  // One-hop agreement (src/engine/one_hop.cc). On a communicator small enough
  // (enable_one_hop) a named operation reported while it was the only one
  // pending on its rank also goes, described in full and with its round, straight
  // to every other rank. A name's round is how many plan entries (but stall
  // warnings) for it this rank has taken, counting one run one-hop as its
  // entry: every rank takes every plan, so rounds agree across ranks, joined
  // ones included. A rank runs such an operation once every rank's description
  // of its round has come and equals its own, without waiting for the plan;
  // the plan's entry for it is then only counted off (ran_one_hop). Every rank
  // reported it while alone, so it is every rank's next operation, and the
  // coordinator, planning in the order operations complete, puts it before
  // anything submitted after it.
  bool one_hop = false;
  struct OneHopDesc {
    std::uint64_t round = 0;
    std::string desc;
    std::chrono::steady_clock::time_point arrived;
  };
  std::map<std::string, std::vector<std::deque<OneHopDesc>>> one_hop_descs;  // [name][rank], oldest first
  std::map<std::string, std::uint64_t> rounds;                               // by name
  struct OneHopOwn {
    std::uint64_t round = 0;
    bool alone = false;  // the only operation pending here when reported: its description went out
    std::string desc;    // alone: as sent
    std::chrono::steady_clock::time_point sent;
  };
  std::map<std::string, OneHopOwn> one_hop_own;  // pending named operations, as reported
  // Run one-hop, their plan entry not come yet. Reports wait while any is
  // here: the coordinator then never meets a name's next round while its entry
  // for the last is open, and reports reach it in submission order.
  std::map<std::string, std::uint32_t> ran_one_hop;
  // One-hop's reports, descriptions and plan entries still travel after an
  // operation ended on every rank, and MPI gives the next communicator a freed
  // one's context id, which would take them in as its own (a wrong plan, a
  // hang). So before the duplicates of a communicator that ran one-hop are
  // freed, each rank sends every other a close (kTagClose) and reads the
  // control channel until every rank's close has come: MPI keeps one sender's
  // messages in order. Bounded by kCloseBoundSeconds for a rank that left.
  bool closes_control = false;
  bool closing = false;
  std::chrono::steady_clock::time_point closing_since;
  std::vector<char> closed_by;  // [rank]: its close has come
  void note_close(int source);
  // Sends this rank's close (once) and reads what came; *closed once the duplicates may go.
  Status close_control(bool* closed);
  // One-hop on a communicator of at most max_ranks ranks whose reports go straight to the coordinator.
  void enable_one_hop(long max_ranks);
  // Whether operations named `name` may run one-hop here.
  bool one_hop_named(const std::string& name) const;
  // Sends `name`'s description to the other ranks if it is alone (once per submission).
  Status send_one_hop(const std::string& name);
  // Another rank's description (a kTagOneHop message) from `source`.
  Status take_one_hop(int source, const char* bytes, std::size_t n);
  // The operation whose round every rank described alone and alike (empty:
  // none); none whose first description came error_s / 2 ago or more (the
  // coordinator may time it out meanwhile).
  std::string one_hop_agreed(double error_s);
  // A plan entry for `name`, or its one-hop run, ended its round here.
  void conclude_round(const std::string& name);
  // This rank's pending operations failed outside the plans: no more one-hop here
  // (without this rank's descriptions, no other rank runs one either).
  void stop_one_hop();

  // Engine thread: point-to-point transfers not yet finished, in submission order.
  std::vector<Transfer> transfers;

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
  std::vector<std::uint32_t> completed;  // ids of table entries every rank reported, in the order they completed
  // Coordinator: names whose operation timed out, with the ranks that had
  // submitted it then (sorted) and how long they waited; until that name runs.
  struct GivenUp {
    std::vector<int> submitted;
    double waited_s = 0;
  };
  std::map<std::string, GivenUp> given_up;
  // Who of `missing` never submitted `name` and who gave up on it earlier, for
  // a stall warning (still_waiting) or a timeout.
  std::string describe_missing(const std::string& name, const std::vector<int>& missing, bool still_waiting) const;

  struct Outgoing {
    MPI_Request req;
    std::vector<char> bytes;
  };
  std::vector<std::unique_ptr<Outgoing>> outbox;

  // Engine thread: plans received (workers) or made (coordinator), not yet
  // run; and an error met reading the control channel during an operation.
  std::deque<std::vector<char>> plans;
  Status control_error;

  // Queues a control message (MPI_Isend); flush_outbox() completes what has gone.
  Status send(int dest, int tag, std::vector<char> bytes);
  Status flush_outbox();

  // Takes newly submitted operations into this rank's report.
  Status report();
  // Takes a ready message from a child (or this rank's own): the coordinator
  // records it, any other rank merges it into what goes up.
  Status take_report(const char* bytes, std::size_t n, bool own);
  // Worker: the partial reports held long enough go up as they are.
  void release_held(double hold_s);
  // Worker: sends what goes up to the parent, if anything.
  Status send_upward();

  // Join (src/engine/join.cc). Worker: a rank of this subtree has joined, so
  // reports go up as they come (a merged entry would wait for it) until a plan says the join ended.
  bool subtree_joined = false;
  // Coordinator: [rank] has joined: ready for every operation, which it runs with zeros.
  std::vector<char> joined;
  int joined_count = 0, last_joined = -1;
  bool has_joined(int r) const { return !joined.empty() && joined[static_cast<std::size_t>(r)]; }
  // Rank `source` of this subtree reported a join.
  void take_join_report(int source);
  // A plan on its way down: a join that ended in it ends this subtree's.
  void take_plan_news(const std::vector<char>& plan);
  // Coordinator: why operation `name` cannot run with the joined ranks `filled`
  // taking part with zeros ("operation 'x' (alltoall) cannot run while..."); empty when it can.
  std::string join_refusal(const std::string& name, const OpDesc& d, const std::vector<int>& filled) const;
  // Coordinator: the join ended (every rank joined, or it failed): no rank counts as joined.
  void end_join();

  // Coordinator: ranks [first, end) have operation id ready.
  void mark_ready(std::uint32_t id, int first, int end);
  // Worker: ranks [first, end) of this subtree have operation id ready
  // (sent_by_id: reported by id, else by a description already sent up).
  void merge_cached(std::uint32_t id, int first, int end, bool sent_by_id);
  void put_upward_cached(std::uint32_t id, int first, int end);
  // Coordinator: plan what is complete, warn about what stalls.
  void plan(double warn_s, double error_s, WireWriter* w, std::uint32_t* entries);
};

}  // namespace hpcdl
