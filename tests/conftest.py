"""Shared test helpers. MPI tests are collective-safe: every rank computes its
verdict, the ranks agree on it with an allreduce, and only then assert, so a
failure on one rank never leaves the others hanging in the next collective."""

import contextlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
import traceback

import pytest
from mpi4py import MPI

# The repository (test modules sit one folder below tests/).
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# bench/'s scripts import each other as top-level modules (Python puts a script's folder on
# sys.path); tests import bench/'s models (cost_model, pipeline_model) the same way. Appended,
# so the standard library and installed packages win over a bench script of the same name.
sys.path.append(os.path.join(ROOT, "bench"))
# The launcher of this environment's MPI (the mpich wheel's, beside this Python).
MPIEXEC = os.path.join(os.path.dirname(sys.executable), "mpiexec")


# Packages a GPU image may lack (docs/testing.md, GPU section). When only the `cuda` tests
# run (-m "cuda ..."), a module that imports one of them, itself or through a helper, is
# not collected there instead of failing the collection.
_OPTIONAL = ("tensorflow", "sklearn", "keras", "dlio_benchmark")


def _imports(path, module):
    text = path.read_text(errors="ignore")
    if re.search(rf"^\s*(import|from)\s+{module}\b", text, re.M):
        return True
    helpers = re.findall(r"^\s*from\s+helpers\.(\w+)\s+import", text, re.M)
    return any(
        _imports(path.parent.parent / "helpers" / f"{h}.py", module)
        for h in helpers
        if (path.parent.parent / "helpers" / f"{h}.py").exists() and path.parent.name != "helpers"
    )


def pytest_ignore_collect(collection_path, config):
    if not (config.getoption("-m") or "").lstrip("( ").startswith("cuda") or collection_path.suffix != ".py":
        return None
    missing = [m for m in _OPTIONAL if importlib.util.find_spec(m) is None]
    return True if any(_imports(collection_path, m) for m in missing) else None


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


@contextlib.contextmanager
def stall_limits(**limits):
    """hpcdl.configure(**limits) for the block, then the limits in force before it."""
    import hpcdl

    before = hpcdl.configure()
    hpcdl.configure(**limits)
    try:
        yield
    finally:
        hpcdl.configure(**{key: before[key] for key in limits})


def outcome(fn, *args, **kwargs):
    """(result, exception) of fn: lets a test check an expected error without skipping a collective."""
    try:
        return fn(*args, **kwargs), None
    except Exception as exc:  # noqa: BLE001 - the caller inspects it
        return None, exc


@pytest.fixture(params=["self", "world", "dup"])
def comm(request):
    """The communicator a test body runs over: COMM_SELF, COMM_WORLD and a Dup() of
    COMM_WORLD (freed after the test), as mpi4py's suite runs its tests, so that hpcdl
    is shown to work on any communicator, not only on the world. A test narrows the
    list with one of the two marks below."""
    if request.param == "dup":
        dup = MPI.COMM_WORLD.Dup()
        yield dup
        dup.Free()
    else:
        yield MPI.COMM_SELF if request.param == "self" else MPI.COMM_WORLD


# A test that needs more than one rank (a peer, a disagreement, a pipeline stage per
# rank) runs over COMM_WORLD and its Dup(), not COMM_SELF.
multi_rank = pytest.mark.parametrize("comm", ["world", "dup"], indirect=True)
# A slow end-to-end test runs once, over COMM_WORLD.
world_only = pytest.mark.parametrize("comm", ["world"], indirect=True)


def start_job(argv, merge_stderr=True, **kwargs):
    """A child process (an mpiexec job, a pip run) in its own session, so that a test can
    kill everything it started, and only that, with finish_job."""
    return subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,
        **kwargs,
    )


def finish_job(proc, timeout):
    """(return code, stdout, stderr) once the job ended; if it outlives `timeout` its whole
    process group is killed and the test fails with its output (a hang never hangs the run)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(
            f"{' '.join(map(str, proc.args))} still ran after {timeout} s; its output:\n"
            f"{(out or '')[-4000:]}{(err or '')[-2000:]}"
        )
    return proc.returncode, out, err
