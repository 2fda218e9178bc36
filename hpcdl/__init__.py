"""hpcdl: distributed deep-learning training on HPC clusters.

A pipelined ring allreduce run by a background engine thread, an HDF5-packed
small-file store and a clairvoyant prefetcher, all over mpi4py communicators.
"""

from __future__ import annotations

import atexit
import importlib
import os
import sys
import time

# The extension links the libmpi that mpi4py loads; importing mpi4py.MPI first
# puts it in the process (and initializes MPI with MPI_THREAD_MULTIPLE, which
# the engine thread needs). load_core fails clearly if the core brings a second one.
from mpi4py import MPI

from hpcdl._mpi_check import load_core

_core = load_core(lambda: importlib.import_module("hpcdl._core"))

from hpcdl import _env, compression  # noqa: E402
from hpcdl._core import EngineWarning, Handle, StallWarning
from hpcdl.collectives import (
    DTYPES,
    allgather,
    allgather_async,
    allreduce,
    allreduce_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_async,
    configure,
    grouped_allreduce,
    grouped_allreduce_async,
    join,
    join_async,
    reducescatter,
    reducescatter_async,
    stats,
)
from hpcdl.errors import CancelledError, CorruptDataError, HpcdlError, MismatchError, MPIError, StallTimeoutError

__version__ = "0.1.0"

__all__ = [
    "allreduce",
    "allreduce_async",
    "grouped_allreduce",
    "grouped_allreduce_async",
    "broadcast",
    "broadcast_async",
    "barrier",
    "configure",
    "stats",
    "DTYPES",
    "allgather",
    "allgather_async",
    "reducescatter",
    "reducescatter_async",
    "alltoall",
    "alltoall_async",
    "join",
    "join_async",
    "compression",
    "init",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "abort_on_uncaught_exception",
    "Handle",
    "StallWarning",
    "EngineWarning",
    "HpcdlError",
    "MismatchError",
    "MPIError",
    "CancelledError",
    "CorruptDataError",
    "StallTimeoutError",
]

_world = {"comm": MPI.COMM_WORLD, "local": None}


def init(comm: MPI.Comm | None = None) -> MPI.Comm:
    """Choose the communicator the conveniences below describe (default COMM_WORLD).

    MPI itself is initialized by importing hpcdl (through mpi4py), under
    ``mpiexec`` and ``srun --mpi=pmi2`` alike.
    """
    _world["comm"] = MPI.COMM_WORLD if comm is None else comm
    _world["local"] = None
    return _world["comm"]


def rank() -> int:
    """This process's rank in the communicator given to init()."""
    return _world["comm"].Get_rank()


def size() -> int:
    """The number of ranks in the communicator given to init()."""
    return _world["comm"].Get_size()


def _local_comm():
    if _world["local"] is None:
        _core.require_mpi_process("hpcdl.local_rank")
        _world["local"] = _world["comm"].Split_type(MPI.COMM_TYPE_SHARED)
    return _world["local"]


def local_rank() -> int:
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


def local_size() -> int:
    """The number of ranks on this node (collective on first call)."""
    return _local_comm().Get_size()


def _at_exit():
    """Interpreter exit, before mpi4py finalizes MPI (its own hook ran first at
    registration, so it runs last): close the prefetchers (their threads make MPI
    calls), stop the engine thread (it tells the other ranks that this one leaves,
    so that any operation of theirs waiting for it fails), then write the timeline
    (which holds both their events). Modules never imported have nothing to close.

    A process forked from a rank ends here at once (os._exit with its exit
    status): its MPI state, threads and prefetchers are its parent's, and
    finalizing MPI or stopping them from the child would disturb the parent's job."""
    if not _core.in_mpi_process():
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):  # closed or broken: nothing more to say
                pass
        uncaught = getattr(sys, "last_value", None) is not None  # set as Python prints an uncaught exception
        os._exit(1 if uncaught else _forked_child_status[0])
    prefetch = sys.modules.get("hpcdl.prefetch")
    if prefetch is not None:
        prefetch.close_all()
    _core.shutdown()
    timeline = sys.modules.get("hpcdl.timeline")
    if timeline is not None and timeline.enabled():
        timeline.write()


atexit.register(_at_exit)

# A forked child's exit status, for _at_exit's os._exit: sys.exit's argument
# as Python turns it into a status (an uncaught exception: 1, found there).
_forked_child_status = [0]


def _child_exit(status=None):
    _forked_child_status[0] = status if isinstance(status, int) else (0 if status is None else 1)
    raise SystemExit(status)


def _after_fork_in_child():
    _forked_child_status[0] = 0
    for name in ("last_type", "last_value", "last_traceback"):  # the parent's, if it printed one
        sys.__dict__.pop(name, None)
    sys.exit = _child_exit


os.register_at_fork(after_in_child=_after_fork_in_child)


def _abort_job_on_uncaught_exception(kind, value, tb):
    """An exception no code caught ends the whole job (MPI_Abort), as ``python
    -m mpi4py`` does: otherwise this rank blocks in MPI_Finalize while the other
    ranks wait for it in their next collective, and the job hangs until its
    time limit."""
    (_replaced_excepthook[0] if _replaced_excepthook else sys.__excepthook__)(kind, value, tb)  # the traceback
    if not _core.in_mpi_process():  # a forked child: the job is its parent's
        return
    comm = MPI.COMM_WORLD
    sys.stderr.write(
        f"[hpcdl rank {comm.Get_rank()}] uncaught {kind.__name__}: aborting the job (MPI_Abort) "
        f"so that the other {comm.Get_size() - 1} ranks do not wait for this one\n"
    )
    sys.stderr.flush()
    time.sleep(1.0)  # MPI_Abort ends the launcher's forwarding at once: let it pass this output on first
    comm.Abort(1)


_replaced_excepthook = []  # the hook abort_on_uncaught_exception(True) replaced


def abort_on_uncaught_exception(enabled: bool = True) -> None:
    """Whether an uncaught exception on this rank ends the whole job with MPI_Abort
    (docs/troubleshooting.md). On by default when COMM_WORLD has more than one
    rank, unless HPCDL_ABORT_ON_EXCEPTION=0; False restores the hook it replaced."""
    installed = sys.excepthook is _abort_job_on_uncaught_exception
    if enabled and not installed:
        _replaced_excepthook[:] = [sys.excepthook]
        sys.excepthook = _abort_job_on_uncaught_exception
    elif not enabled and installed:
        sys.excepthook = _replaced_excepthook.pop() if _replaced_excepthook else sys.__excepthook__


if MPI.COMM_WORLD.Get_size() > 1 and _env.get("HPCDL_ABORT_ON_EXCEPTION", True):
    abort_on_uncaught_exception(True)

if _env.get("HPCDL_TIMELINE"):
    from hpcdl import timeline as _timeline

    _timeline.enable(_env.get("HPCDL_TIMELINE"))
