"""hpcdl._agree's waited_* collectives, the stall-checked stand-ins for mpi4py's
blocking ones on hpcdl's Python side: each gives what mpi4py's own collective
gives on the same inputs (objects of a different size on every rank, every root),
over COMM_SELF, COMM_WORLD and a Dup()."""

import numpy as np
import pytest
from mpi4py import MPI

from hpcdl._agree import (
    _LONG_BCAST_BYTES,
    waited_allgather,
    waited_allreduce,
    waited_barrier,
    waited_bcast,
    waited_gather,
    waited_scatter,
)
from hpcdl.errors import HpcdlError

from conftest import agree, outcome

pytestmark = pytest.mark.mpi


def thing(rank, salt="", long=False):
    """An object whose pickle's size differs by rank (rank 0's is the smallest); a long
    one is above _LONG_BCAST_BYTES, where a broadcast scatters and allgathers."""
    extra = _LONG_BCAST_BYTES // 8 + 1001 if long else 0
    return {"rank": rank, "salt": salt, "rows": list(range(rank * 37)), "array": np.arange(rank * 5.0 + extra)}


def same(a, b):
    return repr(a) == repr(b)


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_waited_collectives_give_what_mpi4pys_give(comm, long):
    rank, size = comm.Get_rank(), comm.Get_size()
    mine = thing(rank, long=long)
    problems = []
    if not same(waited_allgather(comm, mine, "test"), comm.allgather(mine)):
        problems.append("allgather")
    for root in range(size):
        sent = thing(rank, f"from {root}", long)
        if not same(waited_bcast(comm, sent if rank == root else None, root, "test"), comm.bcast(sent, root)):
            problems.append(f"bcast from {root}")
        if not same(waited_gather(comm, sent, root, "test"), comm.gather(sent, root)):
            problems.append(f"gather to {root}")
        parts = [thing(r, f"for {r} from {root}", long) for r in range(size)] if rank == root else None
        if not same(waited_scatter(comm, parts, root, "test"), comm.scatter(parts, root)):
            problems.append(f"scatter from {root}")
    values = np.arange(7.0) * (rank + 1)
    expected = values.copy()
    comm.Allreduce(MPI.IN_PLACE, expected, op=MPI.MAX)
    waited_allreduce(comm, values, MPI.MAX, "test")
    if not np.array_equal(values, expected):
        problems.append(f"allreduce: {values} against {expected}")
    waited_barrier(comm, "test")
    agree(comm, not problems, problems)


@pytest.mark.mpi(min_size=2)
def test_a_scatter_of_the_wrong_length_raises_on_every_rank():
    """The root's parts must be one per rank: it raises its ValueError, and every other
    rank an HpcdlError naming it, at once, instead of waiting for parts that will not come."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    _, refused = outcome(waited_scatter, comm, [1] if rank == 0 else None, 0, "the test's scatter")
    if rank == 0:
        named = isinstance(refused, ValueError) and f"1 parts for {comm.Get_size()} ranks" in str(refused)
    else:
        named = isinstance(refused, HpcdlError) and "the test's scatter: rank 0 could not send" in str(refused)
    got = waited_scatter(comm, list(range(comm.Get_size())) if rank == 0 else None, 0, "test")
    agree(comm, named and got == rank, f"{refused!r}, got {got}")


def unpicklable(rank):
    return lambda: rank  # pickle refuses a lambda


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("op", ["allgather", "bcast", "gather", "scatter"])
def test_an_object_one_rank_cannot_pickle_raises_on_every_rank(op):
    """Rank 1's object (the root's, for bcast and scatter) cannot be pickled: that rank
    raises pickle's error and every other rank an HpcdlError naming rank 1, with no wait
    (a rank that raised alone would leave the others waiting for its bytes)."""
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    obj = unpicklable(rank) if rank == 1 else thing(rank)
    calls = {
        "allgather": lambda: waited_allgather(comm, obj, "the test's allgather"),
        "bcast": lambda: waited_bcast(comm, obj if rank == 1 else None, 1, "the test's bcast"),
        "gather": lambda: waited_gather(comm, obj, 0, "the test's gather"),
        "scatter": lambda: waited_scatter(
            comm, [obj] * comm.Get_size() if rank == 1 else None, 1, "the test's scatter"
        ),
    }
    _, error = outcome(calls[op])
    if rank == 1:
        named = error is not None and not isinstance(error, HpcdlError) and "lambda" in str(error)
    else:
        named = isinstance(error, HpcdlError) and f"the test's {op}: rank 1 could not send" in str(error)
    waited_barrier(comm, "test")  # every rank is out: the next test's collectives are not mixed with these
    agree(comm, named, repr(error))
