"""A process forked from a rank (a data loader's worker, multiprocessing, a
subprocess helper) is not that rank: MPI's state it inherited is its
parent's. An hpcdl operation there raises at once naming the cause; a child
that exits does so at once and silently; the parents' job goes on untouched.

Each test starts its own `mpiexec -n 2` job with a hard bound (a hang fails
the test). The ranks write their answers to files: the launcher's merged
output can interleave lines."""

import json
import os
import sys
import textwrap

from conftest import MPIEXEC, finish_job, start_job

BOUND_S = 90

PRELUDE = """
import json, os, sys, time
import numpy as np
import hpcdl

RANK = hpcdl.rank()
OUT = sys.argv[1]


def answer(what, value):
    with open(os.path.join(OUT, f"{what}.{RANK}"), "w") as f:
        json.dump(value, f)


def try_allreduce_in_child(path):
    started = time.monotonic()
    try:
        hpcdl.allreduce(np.array([100.0]))
        result = {"error": None}
    except Exception as exc:  # noqa: BLE001 - what the child met is the answer
        result = {"error": type(exc).__name__, "message": str(exc)}
    result["seconds"] = time.monotonic() - started
    with open(path, "w") as f:
        json.dump(result, f)
"""

EPILOGUE = """
x = np.array([RANK + 1.0])
hpcdl.allreduce(x)
answer("sum", x.tolist())
"""


def run(tmp_path, body):
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body) + EPILOGUE)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for variable in ("HPCDL_STALL_ERROR_SECONDS", "HPCDL_STALL_WARNING_SECONDS"):
        env.pop(variable, None)
    rc, out, _ = finish_job(
        start_job([MPIEXEC, "-n", "2", sys.executable, str(script), str(tmp_path)], env=env), BOUND_S
    )
    return rc, out


def read(tmp_path, name):
    path = tmp_path / name
    assert path.exists(), f"{name} was not written"
    return json.loads(path.read_text())


def check_parents_untouched(tmp_path, rc, out):
    assert rc == 0, out
    assert read(tmp_path, "sum.0") == [3.0] and read(tmp_path, "sum.1") == [3.0], out


def check_child_refused(result):
    assert result["error"] == "MPIError", result
    assert "was forked from rank 1" in result["message"] and "cannot be used in a forked child" in result["message"]
    assert result["seconds"] < 10, result


def test_an_op_in_a_child_forked_before_the_first_op_raises_and_the_parents_sum_is_right(tmp_path):
    """Rank 1 forks before any operation; the child's allreduce raises naming the
    cause instead of taking over rank 1's identity, and the parents still sum [1] + [2]."""
    rc, out = run(
        tmp_path,
        """
        if RANK == 1:
            pid = os.fork()
            if pid == 0:
                try_allreduce_in_child(os.path.join(OUT, "child"))
                os._exit(0)
            os.waitpid(pid, 0)
    """,
    )
    check_parents_untouched(tmp_path, rc, out)
    check_child_refused(read(tmp_path, "child"))


def test_an_op_in_a_child_forked_after_the_engine_started_raises_at_once(tmp_path):
    """The engine thread runs in the parent only: a child's operation would wait for
    it forever. It raises at once instead."""
    rc, out = run(
        tmp_path,
        """
        hpcdl.allreduce(np.ones(4))
        if RANK == 1:
            pid = os.fork()
            if pid == 0:
                try_allreduce_in_child(os.path.join(OUT, "child"))
                os._exit(0)
            os.waitpid(pid, 0)
    """,
    )
    check_parents_untouched(tmp_path, rc, out)
    check_child_refused(read(tmp_path, "child"))


def test_a_forked_child_that_exits_ends_at_once_silently_with_its_status(tmp_path):
    """Children that reach interpreter exit (sys.exit(0), sys.exit(3), an uncaught
    exception) end at once with their status, say nothing of the engine, and
    neither wait for the parent's engine nor end the parents' job (MPI_Abort)."""
    rc, out = run(
        tmp_path,
        """
        hpcdl.allreduce(np.ones(4))
        if RANK == 1:
            statuses = {}
            for how in ("sys.exit(0)", "sys.exit(3)", "raise"):
                started = time.monotonic()
                pid = os.fork()
                if pid == 0:
                    if how == "raise":
                        raise RuntimeError("the child fails")
                    sys.exit(int(how[9]))
                _, status = os.waitpid(pid, 0)
                statuses[how] = [os.waitstatus_to_exitcode(status), time.monotonic() - started]
            answer("children", statuses)
    """,
    )
    check_parents_untouched(tmp_path, rc, out)
    children = read(tmp_path, "children.1")
    assert {how: status for how, (status, _) in children.items()} == {"sys.exit(0)": 0, "sys.exit(3)": 3, "raise": 1}
    assert all(seconds < 10 for _, seconds in children.values()), children
    assert "RuntimeError: the child fails" in out, out
    assert "could not tell" not in out and "aborting the job" not in out, out
