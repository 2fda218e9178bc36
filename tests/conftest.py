"""Shared test helpers. MPI tests are collective-safe: every rank computes its
verdict, the ranks agree on it with an allreduce, and only then assert, so a
failure on one rank never leaves the others hanging in the next collective."""

import traceback

import pytest
from mpi4py import MPI


def agree(comm, ok, detail=""):
    """Assert on every rank that every rank is ok; the message names the failing ranks."""
    verdicts = comm.allgather((bool(ok), str(detail)))
    failed = {r: d for r, (good, d) in enumerate(verdicts) if not good}
    assert not failed, "failed on " + "; ".join(f"rank {r}: {d}" for r, d in failed.items())


def collective(comm, fn, *args, **kwargs):
    """Run fn on every rank; return its result, or raise on every rank if any rank raised.

    Returns (result, error) per rank is not needed by callers: an exception on one rank is
    re-raised everywhere as an AssertionError naming it.
    """
    try:
        result, err = fn(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - reported to every rank below
        result, err = None, "".join(traceback.format_exception_only(type(exc), exc)).strip()
    agree(comm, err is None, err)
    return result


def outcome(fn, *args, **kwargs):
    """(result, exception) of fn: lets a test check an expected error without skipping a collective."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - the caller inspects it
        return None, exc


@pytest.fixture
def comm():
    return MPI.COMM_WORLD
