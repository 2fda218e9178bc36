"""local_rank() and local_size() from MPI, whatever launcher variables a process inherits.

Each test starts its own small mpiexec job (a new session, killed whole on timeout).
"""

import os
import shutil
import sys

import pytest

from conftest import ROOT, finish_job, start_job

BIN = os.path.dirname(sys.executable)
# Each rank writes its own file: the ranks' stdout lines can interleave under a launcher.
PROBE = (
    "import os, hpcdl; open(os.path.join(os.environ['PROBE_DIR'], str(hpcdl.rank())), 'w')"
    ".write(f'{hpcdl.rank()} {hpcdl.local_rank()} {hpcdl.local_size()}')"
)


def run_job(launcher, n, extra_env, out_dir, timeout=180):
    env = {**os.environ, **extra_env, "PYTHONPATH": ROOT, "PROBE_DIR": str(out_dir)}
    code, _, err = finish_job(
        start_job([launcher, "-n", str(n), sys.executable, "-c", PROBE], merge_stderr=False, cwd=ROOT, env=env), timeout
    )
    assert code == 0, err
    return sorted(tuple(int(v) for v in path.read_text().split()) for path in out_dir.iterdir())


# The variables a process started by srun (or by mpirun inside an sbatch job) inherits.
INHERITED = {
    "slurm": {"SLURM_LOCALID": "0", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"},
    "open-mpi": {"OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"},
}


@pytest.mark.parametrize("launcher", ["mpiexec", "mpiexec.gforker"])
@pytest.mark.parametrize("inherited", sorted(INHERITED))
def test_local_rank_comes_from_mpi_not_inherited_variables(launcher, inherited, tmp_path):
    """Two ranks on this node: local ranks 0 and 1 even when an enclosing job's
    variables say 0 (MPICH's gforker exports no local rank of its own)."""
    path = shutil.which(launcher, path=BIN)
    assert path is not None, f"{launcher} is not installed next to {sys.executable} (the mpich wheel has both)"
    rows = run_job(path, 2, INHERITED[inherited], tmp_path)
    assert rows == [(0, 0, 2), (1, 1, 2)], rows
