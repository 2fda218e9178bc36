"""Small mpiexec jobs for fault tests: each runs in its own session and is
killed as a group if it outlives its bound, so a hang fails the test instead
of hanging the run."""

import os
import re
import sys
import textwrap

from conftest import MPIEXEC, finish_job, start_job

BOUND_S = 120

PRELUDE = """
import os, signal, sys, time, warnings
import numpy as np
from mpi4py import MPI
import hpcdl

WORLD = MPI.COMM_WORLD
RANK = WORLD.Get_rank()
hpcdl.allreduce(np.ones(4, np.float32))  # every rank is up, the engine runs
"""


# MPICH's TCP transport on loopback, as between nodes (no shared memory between ranks).
TCP_LOOPBACK = {"MPIR_CVAR_NOLOCAL": "1", "MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp", "FI_TCP_IFACE": "lo"}


def start(tmp_path, ranks, body, extra_env=None):
    script = tmp_path / "job.py"
    script.write_text(PRELUDE + textwrap.dedent(body))
    env = dict(os.environ, PYTHONUNBUFFERED="1", JOB_DIR=str(tmp_path), **(extra_env or {}))
    for variable in ("HPCDL_STALL_ERROR_SECONDS", "HPCDL_STALL_WARNING_SECONDS"):
        env.pop(variable, None)  # the defaults are what is tested
    return start_job([MPIEXEC, "-n", str(ranks), sys.executable, str(script)], env=env)


def finish(proc, bound=BOUND_S):
    """(return code, output) once the job ended; fails the test if it outlives `bound`."""
    code, out, _ = finish_job(proc, bound)
    return code, out


def run_job(tmp_path, ranks, body, bound=BOUND_S, extra_env=None):
    return finish(start(tmp_path, ranks, body, extra_env), bound)


def survivor_lines(out, survivors, left):
    """Lines where a surviving rank names the rank that left, per survivor."""
    found = {}
    for r in survivors:
        pattern = rf"\[hpcdl rank {r}\].*rank {left} of the communicator .*left"
        found[r] = [line for line in out.splitlines() if re.search(pattern, line)]
    return found
