// CommContext's control channel: messages queued with MPI_Isend and
// completed later, never sent to a rank that has left.
#include "hpcdl/engine/comm_context.hpp"

#include "hpcdl/engine/op_wire.hpp"
#include "hpcdl/util/mpi_util.hpp"

namespace hpcdl {

Status CommContext::send(int dest, int tag, std::vector<char> bytes) {
  if (has_left(dest)) return Status::OK();  // see `left`: a message there could block for good
  auto out = std::make_unique<Outgoing>();
  out->bytes = std::move(bytes);
  int rc = MPI_Isend(out->bytes.data(), static_cast<int>(out->bytes.size()), MPI_BYTE, dest, tag, ctl, &out->req);
  HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Isend(control)"));
  outbox.push_back(std::move(out));
  if (tag != kTagLeave && tag != kTagOneHop) ++counted.messages_sent;
  return Status::OK();
}

Status CommContext::flush_outbox() {
  for (auto it = outbox.begin(); it != outbox.end();) {
    int flag = 0;
    int rc = MPI_Test(&(*it)->req, &flag, MPI_STATUS_IGNORE);
    HPCDL_RETURN_NOT_OK(mpi_status(rc, "MPI_Test(control)"));
    it = flag ? outbox.erase(it) : it + 1;
  }
  return Status::OK();
}

}  // namespace hpcdl
