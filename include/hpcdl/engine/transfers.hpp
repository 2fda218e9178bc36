// Engine-driven point-to-point: sends and receives of a raw contiguous
// buffer to or from one rank, with a tag, on a communicator the caller owns
// (the pipeline link's private duplicate). The engine thread posts them
// (MPI_Isend / MPI_Irecv) and tests them in its loop, so transfers advance
// while the caller computes; the caller holds the same Operation handle as a
// collective's (wait, done, errors). Unlike collectives they are not agreed:
// the tag and the sender's order pair them, as in MPI.
#pragma once

#include <mpi.h>

#include <cstdint>
#include <memory>

#include "hpcdl/engine/operation.hpp"

namespace hpcdl {

// The largest transfer: MPI counts are int, and one message goes as bytes.
constexpr std::uint64_t kMaxTransferBytes = 2147483647;

struct Transfer {
  bool send = true;
  void* data = nullptr;
  std::uint64_t bytes = 0;  // a receive expects exactly this many
  int peer = 0, tag = 0;
  std::shared_ptr<Operation> op;
  MPI_Request request = MPI_REQUEST_NULL;
  bool posted = false;
};

}  // namespace hpcdl
