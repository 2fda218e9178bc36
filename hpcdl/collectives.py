"""Collectives over MPI communicators, run by hpcdl's engine thread.

Every function takes an mpi4py communicator (default ``MPI.COMM_WORLD``); the
engine works on its own duplicate of it, so hpcdl traffic never mixes with
the user's own MPI calls. Arrays are taken zero-copy through the buffer
protocol and must be C-contiguous; reductions happen in place. torch tensors
(CPU: zero-copy; CUDA: staged through pinned host memory) and TensorFlow
tensors (a copy) are taken too: hpcdl._tensors is their one intake.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from mpi4py import MPI

from hpcdl import _core, _tensors
from hpcdl._env import check_setting as _checked
from hpcdl._env import engine_settings as _from_environment
from hpcdl._warn import warn as _warn
from hpcdl.compression import canonical as _codec_text
from hpcdl.errors import StallTimeoutError

# The element types allreduce and broadcast take and the reduction ops, as the core
# defines them (include/hpcdl/util/dtype.hpp), by numpy name.
DTYPES = tuple(_core.DTYPES)
OPS = tuple(_core.OPS)


_config = {
    "chunk_bytes": _core.DEFAULT_CHUNK_BYTES,
    "stall_warning_seconds": _core.DEFAULT_STALL_WARNING_SECONDS,
    "stall_error_seconds": _core.DEFAULT_STALL_ERROR_SECONDS,
}
_config.update((k, v) for k, v in _from_environment().items() if k in _config)


def configure(
    chunk_bytes: int | None = None, stall_warning_seconds: float | None = None, stall_error_seconds: float | None = None
) -> dict[str, Any]:
    """Set engine tunables for this process; returns the settings now in force.

    chunk_bytes: size of a ring pipeline chunk, 64 B to 1 GiB (every rank must
        use the same value: a difference is reported as a mismatch).
        Env: HPCDL_CHUNK_BYTES.
    stall_warning_seconds: warn (StallWarning, naming the missing ranks) when an
        operation has waited this long for ranks that have not submitted it;
        0 disables. Env: HPCDL_STALL_WARNING_SECONDS (default 60).
    stall_error_seconds: fail such an operation on the ranks that wait for it
        (StallTimeoutError); default 1800 (half an hour, torch.distributed's
        default timeout); 0 waits forever. Env: HPCDL_STALL_ERROR_SECONDS.

    Read from the environment only (by the engine thread): HPCDL_WAIT_SLEEP_US
    (longest sleep between polls of a waiting operation, default 200; 0 polls
    without sleeping) and HPCDL_ENGINE_SLICE_US (the engine thread's scheduler slice on
    Linux 6.12+, default 100; 0 keeps the system's). HPCDL_AGREEMENT_RADIX: the
    radix of the tree that carries reports to the coordinator (default 4; 2 is
    binomial); HPCDL_AGREEMENT_FLAT=1 sends them to it directly instead
    (bench/agreement.py compares these). HPCDL_RESIDUAL_TTL_OPS:
    the lifetime of an unused error-feedback residual (hpcdl.compression).
    """
    for key, value in (
        ("chunk_bytes", chunk_bytes),
        ("stall_warning_seconds", stall_warning_seconds),
        ("stall_error_seconds", stall_error_seconds),
    ):
        if value is not None:
            _config[key] = _checked(key, value, f"{key}={value!r}")
    _core.set_stall_limits(_config["stall_warning_seconds"], _config["stall_error_seconds"])
    return dict(_config)


configure()  # the environment's stall limits reach the engine


class PoliteWait:
    """A wait outside the engine's operations (the pipeline's link, the agreements at
    construction), from its creation: sleep() backs off from 1 us, doubling up to
    max_sleep_s; check() applies hpcdl.configure()'s stall limits, warning once
    (StallWarning) past stall_warning_seconds and raising StallTimeoutError past
    stall_error_seconds (0: never)."""

    def __init__(self, max_sleep_s):
        self.start = time.perf_counter()
        self.warned = False
        self._delay, self._max_sleep_s = 0.0, max_sleep_s

    def check(self, describe):
        """describe(waited_s): the stall's text, naming what is waited for."""
        waited = time.perf_counter() - self.start
        if _config["stall_error_seconds"] and waited >= _config["stall_error_seconds"]:
            raise StallTimeoutError(f"hpcdl: {describe(waited)} (stall_error_seconds)")
        if _config["stall_warning_seconds"] and waited >= _config["stall_warning_seconds"] and not self.warned:
            _warn(describe(waited), _core.StallWarning)
            self.warned = True

    def sleep(self):
        time.sleep(self._delay)
        self._delay = min(max(2 * self._delay, 1e-6), self._max_sleep_s)


def _comm(comm):
    if comm is None:
        return MPI.COMM_WORLD
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py.MPI.Comm, got {type(comm).__name__}")
    return comm


def allreduce_async(
    buf: Any,
    op: str = "sum",
    comm: MPI.Comm | None = None,
    name: str | None = None,
    dtype: str | None = None,
    compression: Any = None,
    deferred: bool = False,
) -> Any:
    """Start an in-place allreduce of ``buf``; returns a Handle (``wait()``, ``done()``:
    whichever first sees the operation finished raises its error and lets go of ``buf``).

    buf: a C-contiguous numpy array (or buffer-protocol object), a contiguous
        torch tensor on CPU (reduced in place, zero-copy) or CUDA (staged through
        pinned host memory; wait() copies the result back asynchronously, ordered
        before later work on the current stream), or a TensorFlow tensor (reduced
        on a copy: wait() returns a new tensor, or assigns a tf.Variable).

    op: "sum", "average", "min", "max" or "product". Integers wrap on overflow
        (sum, product) and average with floor division (sum // size, as Horovod's
        torch API); floats: NaN wins min and max. bool takes min, max and
        product (and, or, and). Compression takes sum and average only.
    name: identifies the operation across ranks. Named operations may be
        submitted in any order on different ranks: the engine agrees on one
        order before running them. Unnamed ones are matched by submission order
        on each communicator, whichever thread submits them (pool threads named
        differently on each rank pair as the program orders them); ranks still
        agree on each one's kind, dtype, shape and op, so threads racing to
        submit unnamed operations that differ get MismatchError, not each
        other's data. Name the operations of threads that race.
        With compression, a name also keys the tensor's error-feedback residual.
    dtype: read the buffer as this dtype (e.g. "bfloat16" for a uint16 view).
    compression: None (dense) or a codec from hpcdl.compression (Int8(),
        FP16(), BF16(), TopK(ratio)); float32 data only. Every rank must pass
        the same codec settings.
    deferred: agree on the operation with the other ranks now, but move data
        only after ``handle.mark_ready()``; until then ``buf`` may still be
        written. The agreement round then overlaps whatever computes the data
        (the PyTorch adapter announces a step's buckets when backward begins).
        Operations run in the agreed order, so while a deferred one is not
        marked ready, ``wait()`` on an unfinished operation raises RuntimeError
        instead of waiting forever.
    """
    codec = _codec_text(compression)
    reduce_op = _core.parse_op(op)
    comm = _comm(comm)

    def run(buffer):
        return _core.submit(
            _core.KIND_ALLREDUCE,
            buffer,
            comm,
            name,
            reduce_op,
            0,
            _config["chunk_bytes"],
            codec,
            bool(deferred),
        )

    if deferred and _tensors.is_torch(buf) and _tensors.staged(buf):
        raise ValueError("deferred=True takes host memory: a CUDA tensor is staged by hpcdl itself")
    return _tensors.submit(buf, dtype, True, run)


def allreduce(
    buf: Any,
    op: str = "sum",
    comm: MPI.Comm | None = None,
    name: str | None = None,
    dtype: str | None = None,
    compression: Any = None,
) -> Any:
    """Allreduce ``buf`` in place over ``comm`` and return it.

    Ring reduce-scatter + allgather, pipelined in chunks; every rank ends with
    bitwise identical values. 16-bit floats are reduced in fp32, rounded once per hop. With
    ``compression`` (see allreduce_async) the result is approximate but still
    bitwise identical on every rank.
    """
    return allreduce_async(buf, op, comm, name, dtype, compression).wait()


class _GroupMember:
    """One array of a grouped allreduce, as hpcdl._tensors sees a core handle: its
    tensor handle (staging, copy back) finishes it once the group's handle is done."""

    def __init__(self, buffer, name):
        self.buffer, self.name, self.group = buffer, name, None

    def done(self):
        return self.group.done()

    def wait(self, timeout=None):
        self.group.wait(timeout)
        return self.buffer.owner

    def __getattr__(self, attribute):  # mark_ready(), ready(), timings(), wait_for()...
        return getattr(self.group, attribute)


class GroupHandle:
    """The handle of a grouped allreduce: wait() returns the list of results."""

    def __init__(self, handle, members, results):
        self._handle, self._members, self._results = handle, members, results
        self.name = None if handle is None else handle.name

    def done(self):
        if self._handle is not None and not self._handle.done():
            return False
        return all(result.done() for result in self._results)

    def wait(self, timeout=None):
        if self._handle is not None:
            self._handle.wait(timeout)
        return [result.wait() for result in self._results]

    def __getattr__(self, attribute):  # mark_ready(), ready(), timings(), wait_for()...
        return getattr(self._handle, attribute)


def grouped_allreduce_async(
    bufs: Sequence[Any], op: str = "sum", comm: MPI.Comm | None = None, name: str | None = None
) -> GroupHandle:
    """Start an in-place allreduce of every array or tensor in ``bufs`` as one
    operation: one agreement for the group (its arrays' dtypes and shapes, in order,
    are what ranks compare), then each array through its own ring, so each result is
    bitwise the one its own allreduce gives. Returns a handle; ``wait()`` returns the
    list of results (as allreduce's wait() would for each). No compression."""
    reduce_op = _core.parse_op(op)
    comm = _comm(comm)
    members = []

    def take(buffer):
        members.append(_GroupMember(buffer, name))
        return members[-1]

    results = [_tensors.submit(buf, None, True, take) for buf in bufs]
    if not members:
        return GroupHandle(None, [], [])
    handle = _core.submit_group(
        _core.KIND_GROUPED_ALLREDUCE,
        [m.buffer for m in members],
        comm,
        name,
        reduce_op,
        _config["chunk_bytes"],
    )
    for member in members:
        member.group = handle
    return GroupHandle(handle, members, results)


def grouped_allreduce(
    bufs: Sequence[Any], op: str = "sum", comm: MPI.Comm | None = None, name: str | None = None
) -> list[Any]:
    """Allreduce every array or tensor of ``bufs`` in place, agreed as one operation;
    returns the list of results."""
    return grouped_allreduce_async(bufs, op, comm, name).wait()


def broadcast_async(
    buf: Any, root: int = 0, comm: MPI.Comm | None = None, name: str | None = None, dtype: str | None = None
) -> Any:
    """Start an in-place broadcast of ``buf`` from ``root``; returns a Handle."""
    comm = _comm(comm)
    receives = comm.Get_rank() != root

    def run(buffer):
        return _core.submit(_core.KIND_BROADCAST, buffer, comm, name, 0, int(root))

    return _tensors.submit(buf, dtype, receives, run)


def broadcast(
    buf: Any, root: int = 0, comm: MPI.Comm | None = None, name: str | None = None, dtype: str | None = None
) -> Any:
    """Broadcast ``buf`` from ``root`` into every rank's ``buf`` and return it."""
    return broadcast_async(buf, root, comm, name, dtype).wait()


def _first_dimension(shape, what):
    if not shape:
        raise ValueError(f"{what} needs an array with at least one dimension (rows), got a 0-d array")
    return shape[0]


def _new_array(dtype, shape, member=None, rank=None):
    """The result of a core handle (a grouped one's: of ``member``) as an array of
    ``dtype`` and the row shape of ``shape``, and the rows from each rank (a reducescatter,
    ``rank`` given: of each rank's segment, this rank's alone in the result)."""

    def make(handle):
        data, counts = handle.result(member)
        rows = sum(counts) if rank is None else counts[rank]
        return np.frombuffer(data, dtype=dtype).reshape((rows,) + tuple(shape[1:])), counts

    return make


def _take_rows(bufs, dtypes, what):
    """Each of ``bufs`` as hpcdl._tensors.intake gives it (read as ``dtypes[i]`` when
    given), checked to have rows."""
    bufs = list(bufs)
    if dtypes is not None and len(dtypes) != len(bufs):
        raise ValueError(f"{what}: {len(dtypes)} dtypes for {len(bufs)} arrays")
    taken = []
    for i, buf in enumerate(bufs):
        taken.append(_tensors.intake(buf, dtypes[i] if dtypes is not None else None))
        _first_dimension(taken[-1][1], what)
    return taken


def _grouped(kind, taken, comm, name, reduce_op, results):
    """Submit the arrays of ``taken`` as one grouped operation of ``kind``; wait()
    returns results(core handle), a list (an empty group: [] at once)."""
    if not taken:
        return GroupHandle(None, [], [])
    handle = _core.submit_group(
        kind, [buffer for buffer, _, _, _ in taken], comm, name, reduce_op, _config["chunk_bytes"]
    )
    return _tensors.OutputHandle(handle, results)


def allgather_async(buf: Any, comm: MPI.Comm | None = None, name: str | None = None, dtype: str | None = None) -> Any:
    """Start an allgather of ``buf``; returns a handle whose ``wait()`` returns the
    concatenation of every rank's ``buf`` along the first dimension, in rank order.

    The first dimension may differ per rank (0 rows included); the dtype and the
    other dimensions must be the same on every rank (else MismatchError on every
    rank). buf: as for allreduce_async (numpy array, torch tensor on CPU or
    CUDA, TensorFlow tensor), read only; the result is new memory of the same
    kind (a torch tensor on buf's device). Every dtype of DTYPES.
    """
    comm = _comm(comm)
    buffer, shape, result_dtype, convert = _tensors.intake(buf, dtype)
    rows = _first_dimension(shape, "allgather")
    handle = _core.submit(
        _core.KIND_ALLGATHER,
        buffer,
        comm,
        name,
        0,
        0,
        _config["chunk_bytes"],
        rows=rows,
    )
    make = _new_array(result_dtype, shape)
    return _tensors.OutputHandle(handle, lambda h: convert(make(h)[0]))


def allgather(buf: Any, comm: MPI.Comm | None = None, name: str | None = None, dtype: str | None = None) -> Any:
    """Every rank's ``buf`` concatenated along the first dimension in rank order
    (see allgather_async); bitwise identical on every rank."""
    return allgather_async(buf, comm, name, dtype).wait()


def grouped_allgather_async(
    bufs: Sequence[Any],
    comm: MPI.Comm | None = None,
    name: str | None = None,
    dtypes: Sequence[str | None] | None = None,
) -> Any:
    """Start an allgather of every array or tensor in ``bufs`` as one operation: one
    agreement for the group (each member's dtype and row shape, in order, are what
    ranks compare; first dimensions may differ per rank and per member), one
    exchange of the row counts, then each member as its own allgather moves it, so
    each result is bitwise the one its own call gives. ``wait()`` returns the list of
    results (as allgather's wait() would for each). dtypes: each member's dtype
    argument (as allgather's ``dtype``), or None."""
    comm = _comm(comm)
    taken = _take_rows(bufs, dtypes, "grouped_allgather")
    makes = [_new_array(result_dtype, shape, i) for i, (_, shape, result_dtype, _) in enumerate(taken)]

    def results(h):
        return [convert(make(h)[0]) for make, (_, _, _, convert) in zip(makes, taken)]

    return _grouped(_core.KIND_GROUPED_ALLGATHER, taken, comm, name, 0, results)


def grouped_allgather(
    bufs: Sequence[Any],
    comm: MPI.Comm | None = None,
    name: str | None = None,
    dtypes: Sequence[str | None] | None = None,
) -> list[Any]:
    """allgather of every array or tensor of ``bufs``, agreed as one operation; returns the list."""
    return grouped_allgather_async(bufs, comm, name, dtypes).wait()


def reducescatter_async(
    buf: Any, op: str = "sum", comm: MPI.Comm | None = None, name: str | None = None, dtype: str | None = None
) -> Any:
    """Start a reduce-scatter of ``buf``; returns a handle whose ``wait()`` returns
    this rank's part of the reduction (``op``: as for allreduce) of every rank's
    ``buf``: the first dimension split over the ranks in rank order, the first
    ``rows % size`` ranks one row more (Horovod's rule). Every rank passes the
    same shape and dtype. ``buf`` is only read; the result is new memory."""
    reduce_op = _core.parse_op(op)
    comm = _comm(comm)
    buffer, shape, result_dtype, convert = _tensors.intake(buf, dtype)
    rows = _first_dimension(shape, "reducescatter")
    handle = _core.submit(
        _core.KIND_REDUCESCATTER,
        buffer,
        comm,
        name,
        reduce_op,
        0,
        _config["chunk_bytes"],
        rows=rows,
    )
    make = _new_array(result_dtype, shape, rank=comm.Get_rank())
    return _tensors.OutputHandle(handle, lambda h: convert(make(h)[0]))


def reducescatter(
    buf: Any, op: str = "sum", comm: MPI.Comm | None = None, name: str | None = None, dtype: str | None = None
) -> Any:
    """This rank's rows of the reduction of every rank's ``buf`` (see reducescatter_async)."""
    return reducescatter_async(buf, op, comm, name, dtype).wait()


def grouped_reducescatter_async(
    bufs: Sequence[Any],
    op: str = "sum",
    comm: MPI.Comm | None = None,
    name: str | None = None,
    dtypes: Sequence[str | None] | None = None,
) -> Any:
    """Start a reduce-scatter of every array or tensor in ``bufs`` as one operation:
    one agreement for the group (each member's dtype and shape, in order, and
    ``op``), then each member as its own reducescatter runs it, so each result is
    bitwise the one its own call gives. ``wait()`` returns the list of this rank's
    parts (as reducescatter's wait() would for each). dtypes: as for
    grouped_allgather_async."""
    reduce_op = _core.parse_op(op)
    comm = _comm(comm)
    taken = _take_rows(bufs, dtypes, "grouped_reducescatter")
    makes = [_new_array(result_dtype, shape, i, comm.Get_rank()) for i, (_, shape, result_dtype, _) in enumerate(taken)]

    def results(h):
        return [convert(make(h)[0]) for make, (_, _, _, convert) in zip(makes, taken)]

    return _grouped(_core.KIND_GROUPED_REDUCESCATTER, taken, comm, name, reduce_op, results)


def grouped_reducescatter(
    bufs: Sequence[Any],
    op: str = "sum",
    comm: MPI.Comm | None = None,
    name: str | None = None,
    dtypes: Sequence[str | None] | None = None,
) -> list[Any]:
    """reducescatter of every array or tensor of ``bufs``, agreed as one operation; returns the list."""
    return grouped_reducescatter_async(bufs, op, comm, name, dtypes).wait()


def alltoall_async(
    buf: Any,
    splits: Sequence[int] | None = None,
    comm: MPI.Comm | None = None,
    name: str | None = None,
    dtype: str | None = None,
) -> Any:
    """Start an all-to-all of ``buf``; returns a handle whose ``wait()`` returns
    ``(received, received_splits)``.

    splits: rows of ``buf`` for each rank, in rank order (a sequence of
    ``size`` non-negative integers summing to the first dimension); None
    splits the first dimension equally (it must divide by the size).
    ``received`` holds the rows every rank sent here, in rank order;
    ``received_splits[r]`` how many came from rank r (a list of ints). The
    dtype and the dimensions after the first must be the same on every rank.
    """
    comm = _comm(comm)
    size = comm.Get_size()
    buffer, shape, result_dtype, convert = _tensors.intake(buf, dtype)
    rows = _first_dimension(shape, "alltoall")
    if splits is None:
        if rows % size:
            raise ValueError(
                f"alltoall without splits divides the first dimension equally: {rows} rows do not "
                f"divide by {size} ranks; pass splits"
            )
        splits = [rows // size] * size
    splits = [int(n) for n in (splits.tolist() if hasattr(splits, "tolist") else splits)]
    if len(splits) != size or any(n < 0 for n in splits) or sum(splits) != rows:
        raise ValueError(
            f"alltoall splits must be {size} non-negative row counts summing to the first dimension "
            f"({rows}), got {splits}"
        )
    handle = _core.submit(
        _core.KIND_ALLTOALL,
        buffer,
        comm,
        name,
        0,
        0,
        _config["chunk_bytes"],
        rows=rows,
        splits=splits,
    )
    make = _new_array(result_dtype, shape)

    def finish(h):
        received, counts = make(h)
        return convert(received), counts

    return _tensors.OutputHandle(handle, finish)


def alltoall(
    buf: Any,
    splits: Sequence[int] | None = None,
    comm: MPI.Comm | None = None,
    name: str | None = None,
    dtype: str | None = None,
) -> tuple[Any, Any]:
    """Rows of ``buf`` to each rank by ``splits``; returns ``(received, received_splits)``
    (see alltoall_async)."""
    return alltoall_async(buf, splits, comm, name, dtype).wait()


def barrier(comm: MPI.Comm | None = None) -> None:
    """Return once every rank of ``comm`` has entered the barrier."""
    _core.submit(_core.KIND_BARRIER, None, _comm(comm), None).wait()


# Per communicator (MPI.Comm.py2f), the joins completed on it and the rank that joined last:
# state that ranks keep equal by stepping together (PowerSGD's Q and step count in
# hpcdl.torch's DistributedOptimizer) is taken from that rank at the next step.
_joins: dict[int, tuple[int, int]] = {}


def _joins_completed(comm: MPI.Comm) -> tuple[int, int]:
    """(joins of ``comm`` whose wait() returned on this rank, the last one's last rank; -1: none)."""
    return _joins.get(MPI.Comm.py2f(comm), (0, -1))


def join_async(comm: MPI.Comm | None = None) -> Any:
    """Start a join (see join); returns a handle whose ``wait()`` returns the rank that joined last."""
    comm = _comm(comm)
    handle = _core.submit(_core.KIND_JOIN, None, comm, None)

    def finish(h):
        last = h.result()[1][0]
        _joins[MPI.Comm.py2f(comm)] = (_joins_completed(comm)[0] + 1, last)
        return last

    return _tensors.OutputHandle(handle, finish)


def join(comm: MPI.Comm | None = None) -> int:
    """This rank has run out of data (Horovod's join): until every rank of
    ``comm`` has joined, its engine takes part in the other ranks' operations
    with zeros, so their allreduces (op sum or average, grouped too) and
    allgathers complete; average still divides by ``comm``'s size, as Horovod's
    does. Returns, on every rank, the rank that joined last, once all have;
    then ``comm`` works as before (the next epoch).

    Compressed allreduces run too: a joined rank encodes zeros with the agreed
    codec and keeps no error-feedback state for them (its residuals stay as
    they were). While a rank has joined, a broadcast from it, reducescatter,
    alltoall and op min/max/product raise MismatchError on the ranks that
    submitted them, and the join raises it on the joined ranks
    (docs/horovod.md). A join waits as long as the other ranks train: stall
    warnings name the ranks not joined yet; stall_error_seconds never ends it.
    """
    return join_async(comm).wait()


def stats(reset: bool = False) -> dict[str, Any]:
    """Engine counters per operation kind and codec, measured on this rank.

    Returns {"allreduce": {"none": {"ops", "bytes_sent", "bytes_received",
    "dense_bytes", "seconds"}}, "broadcast": {...}, ...}; dense_bytes is what
    an uncompressed ring sends for the same operations. "agreement" counts the
    control traffic that agrees on order: {"messages_sent",
    "messages_received", "entries_received" (reports from other ranks, one
    per operation and sender: a rank's child in the report tree sends one for
    its whole subtree), "descriptions_received" (of those, full descriptions
    of new or changed operations), "one_hop_runs" (operations run on every
    rank's description before their plan came, HPCDL_AGREEMENT_ONE_HOP_RANKS)}.
    "transfer" counts completed point-to-point transfers (a pipeline's
    activations and gradients): {"send": {...},
    "receive": {...}}, the same fields, seconds from submission to completion.
    """
    out = {"agreement": _core.agreement_stats()}
    for row in _core.stats():
        kind, codec = row.pop("kind"), row.pop("codec")
        out.setdefault(kind, {})[codec or kind] = row
    if reset:
        _core.reset_stats()
    return out
