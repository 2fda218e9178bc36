"""local_rank() and local_size() from MPI, whatever launcher variables a process inherits.

Each test starts its own small mpiexec job (a new session, killed whole on timeout).
"""

import os
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
PROBE = "import hpcdl; print(hpcdl.rank(), hpcdl.local_rank(), hpcdl.local_size(), flush=True)"


def run_job(launcher, n, extra_env, timeout=180):
    env = {**os.environ, **extra_env, "PYTHONPATH": ROOT}
    proc = subprocess.Popen([launcher, "-n", str(n), sys.executable, "-c", PROBE], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{launcher} -n {n} did not end within {timeout} s")
    assert proc.returncode == 0, err
    return sorted(tuple(int(v) for v in line.split()) for line in out.splitlines())


# The variables a process started by srun (or by mpirun inside an sbatch job) inherits.
INHERITED = {"slurm": {"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
             "open-mpi": {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}}


@pytest.mark.parametrize("launcher", ["mpiexec", "mpiexec.gforker"])
@pytest.mark.parametrize("inherited", sorted(INHERITED))
def test_local_rank_comes_from_mpi_not_inherited_variables(launcher, inherited):
    """Two ranks on this node: local ranks 0 and 1 even when an enclosing job's
    variables say 0 (MPICH's gforker exports no local rank of its own)."""
    path = shutil.which(launcher, path=BIN)
    if path is None:
        pytest.skip(f"{launcher} is not installed next to {sys.executable}")
    rows = run_job(path, 2, INHERITED[inherited])
    assert rows == [(0, 0, 2), (1, 1, 2)], rows
