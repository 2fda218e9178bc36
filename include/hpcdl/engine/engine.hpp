// The collective engine's public face: one background thread per process
// makes every MPI call for hpcdl's collectives. Callers submit operations
// (allreduce, broadcast, barrier, point-to-point transfers) from any thread;
// the engine agrees on one execution order with the other ranks
// (agreement.hpp) and runs them on a duplicate of the caller's communicator,
// so hpcdl traffic never mixes with the user's. The parts and the loop that
// joins them are in engine_loop.hpp; this header is what the Cython layer
// sees, and pulls in no algorithm or codec kernel.
//
// A deferred operation is reported (and so agreed) at submission, before its
// data is in place; the engine runs it, in the agreed order, once the caller
// marks it ready. A framework that knows what it will reduce before backward
// computes it takes the agreement round off the critical path that way.
#pragma once

#include <mpi.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "hpcdl/engine/notices.hpp"
#include "hpcdl/engine/operation.hpp"
#include "hpcdl/engine/stats.hpp"
#include "hpcdl/util/status.hpp"

namespace hpcdl {

class EngineLoop;

class Engine {
 public:
  static Engine& instance();

  Status submit(MPI_Comm comm, OpRequest req, std::shared_ptr<Operation>* out);
  // A send (or receive of exactly `bytes`) of raw memory to (from) `peer`
  // with `tag` on comm, moved by the engine thread (transfers.hpp).
  Status submit_transfer(MPI_Comm comm, bool send, void* data, std::uint64_t bytes, int peer, int tag,
                         std::shared_ptr<Operation>* out);
  // Warn after `warn_seconds` that an operation waits for ranks that never
  // submitted it; fail it after `error_seconds` (0: never).
  void set_stall_limits(double warn_seconds, double error_seconds);
  // Something pending became ready (Operation::mark_ready), or a
  // communicator was freed: an idle loop rechecks now.
  void wake();
  // While one lives, a thread is blocked on an operation or transfer: the
  // engine polls point-to-point transfers often (transfer_poll_sleep).
  class Watch {
   public:
    explicit Watch(Engine& engine);
    ~Watch();
    Watch(const Watch&) = delete;
    Watch& operator=(const Watch&) = delete;

   private:
    Engine& engine_;
  };
  std::vector<EngineStats> stats();
  AgreementStats agreement_stats();
  void reset_stats();
  // Forgets every error-feedback residual (hpcdl.compression.reset_state()).
  void reset_compression_state();
  // The notices kept since the last call, oldest first; *dropped: how many
  // more came while kMaxNotices were already kept (those are lost).
  std::vector<EngineNotice> take_notices(std::uint64_t* dropped);
  static constexpr std::size_t kMaxNotices = NoticeBoard::kMaxNotices;
  // A copy of tensor `name`'s error-feedback residual on `comm`; *found is
  // false when there is none (never compressed with that name, or reset).
  Status copy_residual(MPI_Comm comm, const std::string& name, std::vector<float>* out, bool* found);
  // Makes `values` tensor `name`'s residual on `comm`, on this rank alone
  // (hpcdl.compression.set_residual): before comm's first operation it is
  // held until then.
  Status set_residual(MPI_Comm comm, const std::string& name, std::vector<float> values);
  // Frees it (hpcdl.compression.free_residual); *found: there was one.
  Status free_residual(MPI_Comm comm, const std::string& name, bool* found);
  // Bytes every error-feedback residual of this process takes.
  std::uint64_t residual_bytes();
  // Joins the thread; operations not yet run finish with kCancelled, and the
  // other ranks of every communicator hpcdl used are told that this one left
  // (their operations waiting for it fail instead of waiting forever).
  void shutdown();

 private:
  Engine();
  EngineLoop& loop_;  // never destroyed, as the engine itself
};

}  // namespace hpcdl
