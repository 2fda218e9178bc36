"""hpcdl: distributed deep-learning training on HPC clusters.

A pipelined ring allreduce run by a background engine thread, an HDF5-packed
small-file store and a clairvoyant prefetcher, all over mpi4py communicators.
"""

import atexit
import os
import sys
import time

# The extension links libmpi through the MPI compiler wrapper; importing
# mpi4py.MPI first puts that same libmpi in the process (and initializes MPI
# with MPI_THREAD_MULTIPLE, which the engine thread needs).
from mpi4py import MPI

from hpcdl import _core, compression
from hpcdl._core import Handle, StallWarning
from hpcdl.collectives import (allreduce, allreduce_async, barrier, broadcast, broadcast_async,
                               configure, stats)
from hpcdl.errors import (CancelledError, CorruptDataError, HpcdlError, MismatchError, MPIError,
                          StallTimeoutError)

__version__ = "0.1.0"

__all__ = [
    "allreduce", "allreduce_async", "broadcast", "broadcast_async", "barrier", "configure",
    "stats", "compression", "init", "rank", "size", "local_rank", "local_size", "Handle", "StallWarning",
    "HpcdlError", "MismatchError", "MPIError", "CancelledError", "CorruptDataError",
    "StallTimeoutError",
]

_world = {"comm": MPI.COMM_WORLD, "local": None}


def init(comm=None):
    """Choose the communicator the conveniences below describe (default COMM_WORLD).

    MPI itself is initialized by importing hpcdl (through mpi4py), under
    ``mpiexec`` and ``srun --mpi=pmi2`` alike.
    """
    _world["comm"] = MPI.COMM_WORLD if comm is None else comm
    _world["local"] = None
    return _world["comm"]


def rank():
    """This process's rank in the communicator given to init()."""
    return _world["comm"].Get_rank()


def size():
    """The number of ranks in the communicator given to init()."""
    return _world["comm"].Get_size()


def _local_comm():
    if _world["local"] is None:
        _world["local"] = _world["comm"].Split_type(MPI.COMM_TYPE_SHARED)
    return _world["local"]


def local_rank():
    """This process's rank among the ranks on the same node (for device selection).

    From MPI itself: a shared-memory split (MPI_Comm_split_type) of the
    communicator given to init(), ordered by rank. Collective on the first
    call of local_rank() or local_size() (every rank of that communicator
    calls it), cached after. Launcher variables (SLURM_LOCALID,
    OMPI_COMM_WORLD_LOCAL_RANK, ...) are not read: a process inherits them
    from an enclosing job step, so under another launcher they can name
    rank 0 on every process of a node.
    """
    return _local_comm().Get_rank()


def local_size():
    """The number of ranks on this node (collective on first call)."""
    return _local_comm().Get_size()


# Stop the engine thread before mpi4py finalizes MPI at exit; it tells the other
# ranks that this one leaves, so that any operation of theirs waiting for it fails.
atexit.register(_core.shutdown)


def _abort_job_on_uncaught_exception(kind, value, tb, previous=sys.excepthook):
    """An exception no code caught ends the whole job (MPI_Abort), as ``python
    -m mpi4py`` does: otherwise this rank blocks in MPI_Finalize while the other
    ranks wait for it in their next collective, and the job hangs until its
    time limit. Restore ``sys.excepthook = sys.__excepthook__`` to keep the old way."""
    previous(kind, value, tb)
    comm = MPI.COMM_WORLD
    sys.stderr.write(f"[hpcdl rank {comm.Get_rank()}] uncaught {kind.__name__}: aborting the job (MPI_Abort) "
                     f"so that the other {comm.Get_size() - 1} ranks do not wait for this one\n")
    sys.stderr.flush()
    time.sleep(1.0)  # MPI_Abort ends the launcher's forwarding at once: let it pass this output on first
    comm.Abort(1)


if MPI.COMM_WORLD.Get_size() > 1:
    sys.excepthook = _abort_job_on_uncaught_exception

if os.environ.get("HPCDL_TIMELINE"):
    from hpcdl import timeline as _timeline

    _timeline.enable(os.environ["HPCDL_TIMELINE"])
