"""What hpcdl.horovod.torch and hpcdl.horovod.tensorflow share: Horovod's basics
(init, rank, size, the build flags), its reduction constants and error types,
integer handles for poll()/synchronize(), and object broadcast.

Everything maps onto hpcdl's own API (hpcdl.init, hpcdl.allreduce_async,
hpcdl.broadcast_async, hpcdl.barrier, hpcdl.timeline) over one mpi4py
communicator, the one init() was given. docs/horovod.md lists what differs.
"""

import itertools
import pickle

import numpy as np
from mpi4py import MPI

import hpcdl
from hpcdl._agree import waited_allgather, waited_barrier
from hpcdl.errors import HpcdlError


class HorovodInternalError(RuntimeError):
    """Horovod's error for a failed collective. hpcdl's errors (MismatchError,
    StallTimeoutError, MPIError...) keep their own types; catch HpcdlError, or this,
    which every hpcdl error raised through the compatibility layer also is."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's elastic-mode signal. hpcdl has no elastic membership: never raised."""


# Horovod's ReduceOp values (its C++ enum: AVERAGE 0, SUM 1, ADASUM 2, MIN 3, MAX 4, PRODUCT 5)
# and hpcdl's op names (hpcdl.collectives.OPS) for them.
Average, Sum, Adasum, Min, Max, Product = 0, 1, 2, 3, 4, 5
_OP_NAMES = {Average: "average", Sum: "sum", Min: "min", Max: "max", Product: "product"}

_state = {"initialized": False, "comm": None, "local": None, "cross": None, "homogeneous": None}
_handles = {}
_handle_ids = itertools.count(1)
_process_sets = {}  # id -> registered ProcessSet (the global one aside)
_process_set_ids = [itertools.count(1)]


class ProcessSet:
    """Horovod's process set: some of init()'s ranks (by their rank there), reducing among
    themselves over an mpi4py sub-communicator. Registered on every rank, in the same
    order, by init(process_sets=...) or add_process_set()."""

    def __init__(self, ranks):
        if isinstance(ranks, MPI.Comm):
            raise TypeError("hpcdl.horovod builds a process set from its list of ranks: pass the ranks")
        self.ranks = sorted({int(r) for r in ranks})
        self.process_set_id = None
        self.mpi_comm = None  # this rank's sub-communicator; None where it is not a member

    def size(self):
        return None if self.process_set_id is None else len(self.ranks)

    def rank(self):
        """This rank's index in the set, None when it is not a member."""
        return self.ranks.index(rank()) if self.process_set_id is not None and self.included() else None

    def included(self):
        return rank() in self.ranks

    def __repr__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"


global_process_set = ProcessSet([])  # init()'s communicator, id 0


def init(comm=None, process_sets=None):
    """Start Horovod over ``comm`` (an mpi4py communicator or a list of world ranks;
    default COMM_WORLD) and register ``process_sets`` (ProcessSets or lists of ranks).
    Collective: every rank of the communicator calls it, as in Horovod. Node-local and
    cross-node communicators are split here once."""
    listed = isinstance(comm, (list, tuple))
    # Every rank arrives under the stall limits first: making communicators blocks in MPI.
    waited_barrier(MPI.COMM_WORLD if listed or comm is None else comm, "init")
    if listed:  # collective over COMM_WORLD, as in Horovod
        ranks = [int(r) for r in comm]
        group = MPI.COMM_WORLD.Get_group().Incl(ranks)
        comm = MPI.COMM_WORLD.Create(group)
        group.Free()
        if comm == MPI.COMM_NULL:
            raise ValueError(f"init(comm={ranks}): this rank ({MPI.COMM_WORLD.Get_rank()}) is not in the list")
    if _state["initialized"]:
        shutdown()  # init() again: the communicators split for the last one are freed first
    comm = hpcdl.init(comm)
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    cross = comm.Split(color=local.Get_rank(), key=comm.Get_rank())
    local_sizes = set(waited_allgather(comm, local.Get_size(), "init's exchange of node sizes"))
    _state.update(initialized=True, comm=comm, local=local, cross=cross, homogeneous=len(local_sizes) == 1)
    global_process_set.ranks, global_process_set.process_set_id = list(range(comm.Get_size())), 0
    global_process_set.mpi_comm = comm
    for process_set in process_sets or []:
        add_process_set(process_set)


def add_process_set(process_set):
    """Register a ProcessSet (or a list of ranks) on every rank and return it. Collective
    over init()'s communicator: every rank passes the same ranks (ValueError on every rank
    otherwise)."""
    if not isinstance(process_set, ProcessSet):
        process_set = ProcessSet(process_set)
    world = comm()
    seen = waited_allgather(world, (process_set.ranks, process_set.process_set_id), "add_process_set")
    problem = None
    if any(ranks != process_set.ranks for ranks, _ in seen):
        problem = f"the ranks differ across ranks: {[ranks for ranks, _ in seen]}"
    elif any(set_id is not None for _, set_id in seen):
        problem = "it is already registered"
    elif not process_set.ranks or not set(process_set.ranks) <= set(range(world.Get_size())):
        problem = f"its ranks must be some of 0..{world.Get_size() - 1}"
    elif any(p.ranks == process_set.ranks for p in _process_sets.values()):
        problem = "a process set with these ranks is registered"
    if problem:
        raise ValueError(f"add_process_set({process_set.ranks}): {problem}")
    group = world.Get_group().Incl(process_set.ranks)
    sub = world.Create(group)
    group.Free()
    process_set.mpi_comm = None if sub == MPI.COMM_NULL else sub
    process_set.process_set_id = next(_process_set_ids[0])
    _process_sets[process_set.process_set_id] = process_set
    return process_set


def remove_process_set(process_set):
    """Unregister a process set on every rank (collective); False for the global one or one not registered."""
    if process_set is global_process_set or _process_sets.get(process_set.process_set_id) is not process_set:
        return False
    waited_barrier(comm(), "remove_process_set")  # every rank lets go of it together
    _forget(process_set)
    return True


def _forget(process_set):
    if process_set.mpi_comm is not None:
        process_set.mpi_comm.Free()
    _process_sets.pop(process_set.process_set_id, None)
    process_set.process_set_id, process_set.mpi_comm = None, None


def comm_of(process_set):
    """The communicator a collective on ``process_set`` runs over (this rank must be a member)."""
    if process_set is global_process_set:
        # init() sets it and shutdown() clears it: read without comm()'s frames (a per-call path)
        return process_set.mpi_comm if process_set.mpi_comm is not None else comm()
    if _process_sets.get(process_set.process_set_id) is not process_set:
        raise ValueError(f"{process_set!r} is not registered: pass it to add_process_set() first")
    if process_set.mpi_comm is None:
        raise ValueError(f"rank {rank()} is not in {process_set!r}")
    return process_set.mpi_comm


def root_in(process_set, root_rank):
    """``root_rank`` (a rank of init()'s communicator, as in Horovod) as a rank of the set's communicator."""
    if process_set is global_process_set:
        return root_rank
    if root_rank not in process_set.ranks:
        raise ValueError(f"root_rank {root_rank} is not in {process_set!r}")
    return process_set.ranks.index(root_rank)


def shutdown():
    """Horovod's shutdown: the module is uninitialized (init() may be called again) and its
    process sets are forgotten. hpcdl's engine itself runs until the interpreter exits
    (its exit hook stops it)."""
    for process_set in list(_process_sets.values()):
        _forget(process_set)
    _process_set_ids[0] = itertools.count(1)
    for key in ("local", "cross"):
        if _state[key] is not None:
            _state[key].Free()
    _state.update(initialized=False, comm=None, local=None, cross=None, homogeneous=None)
    global_process_set.ranks, global_process_set.process_set_id, global_process_set.mpi_comm = [], None, None


def is_initialized():
    return _state["initialized"]


def _require_init():
    if not _state["initialized"]:
        raise ValueError("Horovod has not been initialized; use hvd.init().")


def comm():
    """The communicator init() was given (hpcdl's collectives take it as comm=)."""
    _require_init()
    return _state["comm"]


def rank():
    return comm().Get_rank()


def size():
    return comm().Get_size()


def local_rank():
    _require_init()
    return _state["local"].Get_rank()


def local_size():
    _require_init()
    return _state["local"].Get_size()


def cross_rank():
    """The index of this rank's node among the nodes (ranks with this local rank)."""
    _require_init()
    return _state["cross"].Get_rank()


def cross_size():
    """The number of ranks with this rank's local rank (the number of nodes when homogeneous)."""
    _require_init()
    return _state["cross"].Get_size()


def is_homogeneous():
    """Whether every node runs the same number of ranks."""
    _require_init()
    return _state["homogeneous"]


def mpi_threads_supported():
    _require_init()
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


def mpi_enabled():
    return True


def mpi_built():
    return True


def _not_built():
    return False


# hpcdl runs on MPI alone: no Gloo controller, no NCCL/DDL/oneCCL collectives, no
# device-side (CUDA/ROCm) reduction (CUDA tensors are staged through host memory).
gloo_enabled = gloo_built = nccl_built = ddl_built = ccl_built = cuda_built = rocm_built = _not_built


def start_timeline(file_path, mark_cycles=False):
    """Record hpcdl's timeline (hpcdl.timeline) to ``file_path``, written at exit.
    mark_cycles has no meaning in hpcdl (no cycle loop): True raises ValueError."""
    if mark_cycles:
        raise ValueError(
            "start_timeline(mark_cycles=True): hpcdl's engine has no cycles to mark "
            "(it agrees per operation); see docs/horovod.md"
        )
    from hpcdl import timeline

    timeline.enable(file_path, comm())


def stop_timeline():
    """Stop recording; what was recorded is still written at exit."""
    from hpcdl import timeline

    timeline.record(False)


def reduce_op(op, average):
    """hpcdl's op name for Horovod's (op, deprecated average) pair, checked."""
    if op is None:
        return _OP_NAMES[Sum if average is False else Average]
    if average is not None:
        raise ValueError("The op parameter supersedes average. Please provide only one of them.")
    name = _OP_NAMES.get(op)
    if name is None:
        if op == Adasum:
            raise NotImplementedError("Adasum is not supported by hpcdl.horovod (docs/horovod.md); use op=hvd.Average")
        raise ValueError(f"op={op!r}: hpcdl.horovod takes hvd.Average, hvd.Sum, hvd.Min, hvd.Max or hvd.Product")
    return name


def check_scale(prescale_factor, postscale_factor, integer):
    if integer and (prescale_factor != 1.0 or postscale_factor != 1.0):
        raise TypeError("prescale_factor and postscale_factor apply to floating-point tensors only")


def check_default(what, value, default, why):
    """A Horovod parameter hpcdl cannot honour: any value but its default raises, naming it."""
    if value != default:
        raise ValueError(f"{what}={value!r} is not supported by hpcdl.horovod ({why}); see docs/horovod.md")


class Finished:
    """The handle of an operation that already ran (synchronously)."""

    def __init__(self, result):
        self.result = result

    def done(self):
        return True

    def wait(self, timeout=None):
        return self.result


def register(handle, finish=None):
    """An integer handle, as Horovod returns, for hpcdl's ``handle``; synchronize()
    returns finish() of what handle.wait() returns (None: that result as it is)."""
    key = next(_handle_ids)
    _handles[key] = (handle, finish)
    return key


def _entry(handle):
    entry = _handles.get(handle)
    if entry is None:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
    return entry


def poll(handle):
    """True once the operation of ``handle`` has finished (synchronize() then does not block)."""
    return bool(call(_entry(handle)[0].done))


def synchronize(handle):
    """Wait for the operation of ``handle`` and return its output tensor; the handle is
    spent either way (a failed operation's too)."""
    # the pop inline (the per-call path of every asynchronous collective); _entry() names a miss
    return complete(*(_handles.pop(handle, None) or _entry(handle)))


def complete(operation, finish=None):
    """Wait for hpcdl's ``operation`` and return finish() of its result (None: the result as it is)."""
    try:  # call()'s translation without its frame: this is the per-call path of allreduce_
        result = operation.wait()
    except HpcdlError as exc:
        reraise(exc)
    return result if finish is None else finish(result)


_horovod_errors = {}


def _as_horovod_error(kind):
    """hpcdl's error type ``kind`` that is also a HorovodInternalError (made once per type)."""
    if kind not in _horovod_errors:
        _horovod_errors[kind] = type(kind.__name__, (kind, HorovodInternalError), {"__module__": __name__})
    return _horovod_errors[kind]


def reraise(exc):
    """Raise hpcdl's error ``exc`` as one that is also a HorovodInternalError (keeping its own type)."""
    if isinstance(exc, HorovodInternalError):
        raise exc
    raise _as_horovod_error(type(exc))(str(exc)) from exc


def call(fn, *args):
    """Run an hpcdl call; an hpcdl error also becomes a HorovodInternalError (keeping its own type)."""
    try:
        return fn(*args)
    except HpcdlError as exc:
        reraise(exc)


def wait(handle):
    return call(handle.wait)


def barrier(process_set=global_process_set):
    call(hpcdl.barrier, comm_of(process_set))


def join(device=-1):
    """Horovod's join: this rank has run out of data; until every rank has joined,
    its engine takes part in the others' allreduces with zeros (hpcdl.join).
    Returns the rank that joined last. ``device`` (where Horovod makes the zeros)
    is accepted and unused: hpcdl's engine makes them in host memory."""
    return call(hpcdl.join, comm())


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` (pickled) on every rank of ``process_set``."""
    name = name or "broadcast_object"
    is_root = rank() == root_rank
    payload = np.frombuffer(pickle.dumps(obj), np.uint8).copy() if is_root else None
    length = np.array([payload.size if is_root else 0], np.int64)
    wait(
        hpcdl.broadcast_async(
            length, root=root_in(process_set, root_rank), comm=comm_of(process_set), name=f"{name}.length"
        )
    )
    data = payload if is_root else np.empty(int(length[0]), np.uint8)
    wait(
        hpcdl.broadcast_async(
            data, root=root_in(process_set, root_rank), comm=comm_of(process_set), name=f"{name}.bytes"
        )
    )
    return obj if is_root else pickle.loads(data.tobytes())  # the root keeps its own, as in Horovod


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's ``obj`` (pickled), as a list in rank order, through hpcdl.allgather: the
    lengths first, then the bytes padded to whole int32s (the core's smallest gathered type)."""
    name = name or "allgather_object"
    world = comm_of(process_set)
    data = np.frombuffer(pickle.dumps(obj), np.uint8)
    padded = np.zeros(-(-data.size // 4), np.int32)
    padded.view(np.uint8)[: data.size] = data
    lengths = wait(hpcdl.allgather_async(np.array([data.size], np.int64), world, f"{name}.lengths"))
    gathered = wait(hpcdl.allgather_async(padded, world, f"{name}.bytes")).view(np.uint8)
    out, at = [], 0
    for length in lengths.tolist():
        out.append(pickle.loads(gathered[at : at + length].tobytes()))
        at += -(-length // 4) * 4
    return out
