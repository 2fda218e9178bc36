"""Collectives over MPI communicators, run by hpcdl's engine thread.

Every function takes an mpi4py communicator (default ``MPI.COMM_WORLD``); the
engine works on its own duplicate of it, so hpcdl traffic never mixes with
the user's own MPI calls. Arrays are taken zero-copy through the buffer
protocol and must be C-contiguous; reductions happen in place.
"""

import os

from mpi4py import MPI

from hpcdl import _core
from hpcdl.compression import canonical as _codec_text

_config = {
    "chunk_bytes": int(os.environ.get("HPCDL_CHUNK_BYTES", _core.DEFAULT_CHUNK_BYTES)),
    "stall_warning_seconds": float(os.environ.get("HPCDL_STALL_WARNING_SECONDS", 60)),
    "stall_error_seconds": float(os.environ.get("HPCDL_STALL_ERROR_SECONDS", 0)),
}
_core.set_stall_limits(_config["stall_warning_seconds"], _config["stall_error_seconds"])


def configure(chunk_bytes=None, stall_warning_seconds=None, stall_error_seconds=None):
    """Set engine tunables for this process; returns the settings now in force.

    chunk_bytes: size of a ring pipeline chunk (every rank must use the same
        value: a difference is reported as a mismatch). Env: HPCDL_CHUNK_BYTES.
    stall_warning_seconds: warn (StallWarning, naming the missing ranks) when an
        operation has waited this long for ranks that have not submitted it;
        0 disables. Env: HPCDL_STALL_WARNING_SECONDS (default 60).
    stall_error_seconds: fail such an operation on the ranks that wait for it
        (StallTimeoutError); 0 (the default) waits forever.
        Env: HPCDL_STALL_ERROR_SECONDS.
    """
    if chunk_bytes is not None:
        chunk_bytes = int(chunk_bytes)
        if not 64 <= chunk_bytes <= 1 << 30:
            raise ValueError(f"chunk_bytes must be between 64 and 2**30, got {chunk_bytes}")
        _config["chunk_bytes"] = chunk_bytes
    for key, value in (("stall_warning_seconds", stall_warning_seconds),
                       ("stall_error_seconds", stall_error_seconds)):
        if value is not None:
            if value < 0:
                raise ValueError(f"{key} must be >= 0, got {value}")
            _config[key] = float(value)
    _core.set_stall_limits(_config["stall_warning_seconds"], _config["stall_error_seconds"])
    return dict(_config)


def _comm(comm):
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py.MPI.Comm, got {type(comm).__name__}")
    return comm


def allreduce_async(buf, op="sum", comm=None, name=None, dtype=None, compression=None):
    """Start an in-place allreduce of ``buf``; returns a Handle (``wait()``, ``done()``).

    op: "sum" or "average" (average needs a floating dtype).
    name: identifies the operation across ranks. Named operations may be
        submitted in any order on different ranks: the engine agrees on one
        order before running them. Unnamed ones are matched by submission order.
        With compression, a name also keys the tensor's error-feedback residual.
    dtype: read the buffer as this dtype (e.g. "bfloat16" for a uint16 view).
    compression: None (dense) or a codec from hpcdl.compression (Int8(),
        FP16(), BF16(), TopK(ratio)); float32 data only. Every rank must pass
        the same codec settings.
    """
    codec = _codec_text(compression)
    buffer = _core.Buffer(buf, dtype, True)
    reduce_op = _core.parse_op(op)
    return _core.submit(_core.KIND_ALLREDUCE, buffer, _comm(comm), name, reduce_op, 0,
                        _config["chunk_bytes"], codec)


def allreduce(buf, op="sum", comm=None, name=None, dtype=None, compression=None):
    """Allreduce ``buf`` in place over ``comm`` and return it.

    Ring reduce-scatter + allgather, pipelined in chunks; every rank ends with
    bitwise identical values. 16-bit floats are summed in fp32. With
    ``compression`` (see allreduce_async) the result is approximate but still
    bitwise identical on every rank.
    """
    return allreduce_async(buf, op, comm, name, dtype, compression).wait()


def broadcast_async(buf, root=0, comm=None, name=None, dtype=None):
    """Start an in-place broadcast of ``buf`` from ``root``; returns a Handle."""
    comm = _comm(comm)
    buffer = _core.Buffer(buf, dtype, comm.Get_rank() != root)
    return _core.submit(_core.KIND_BROADCAST, buffer, comm, name, 0, int(root))


def broadcast(buf, root=0, comm=None, name=None, dtype=None):
    """Broadcast ``buf`` from ``root`` into every rank's ``buf`` and return it."""
    return broadcast_async(buf, root, comm, name, dtype).wait()


def barrier(comm=None):
    """Return once every rank of ``comm`` has entered the barrier."""
    _core.submit(_core.KIND_BARRIER, None, _comm(comm), None).wait()


def stats(reset=False):
    """Engine counters per operation kind and codec, measured on this rank.

    Returns {"allreduce": {"none": {"ops", "bytes_sent", "bytes_received",
    "dense_bytes", "seconds"}}, "broadcast": {...}, ...}; dense_bytes is what
    an uncompressed ring sends for the same operations.
    """
    out = {}
    for row in _core.stats():
        kind, codec = row.pop("kind"), row.pop("codec")
        out.setdefault(kind, {})[codec or kind] = row
    if reset:
        _core.reset_stats()
    return out
