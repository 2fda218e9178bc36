"""One MPI per process, tested the way it failed (issue 29): Debian's Open MPI development files in
the system library directory (scripts/openmpi.sh install; .ci/run installs them), a venv made with
Debian's /usr/bin/python3 (built as a shared library, so setuptools puts -L/usr/lib/x86_64-linux-gnu
on the link line ahead of the MPI wrapper's own -L), PyPI's MPICH and mpi4py in it, and hpcdl built
there with --no-build-isolation from a copy of this checkout: a 2-rank allreduce must work and one
libmpi be in the process. A build forced against Open MPI while mpi4py loads MPICH must fail at
import with the error naming both libraries. Single-process: it starts its own ranks. The venv is
kept in .venv-debian/ (ignored by git) and remade when the pins it uses change. Without Debian's
Python or Open MPI's files the tests skip, and fail with CI=true."""

import hashlib
import json
import os
import re
import shutil
import subprocess

import pytest

from conftest import ROOT, finish_job, start_job

pytestmark = pytest.mark.timeout(1800)

DEBIAN_PYTHON = "/usr/bin/python3"
SYSTEM_LIBDIR = "/usr/lib/x86_64-linux-gnu"
OPEN_MPI = os.path.join(SYSTEM_LIBDIR, "libmpi.so.40")
PINNED = ("mpich", "mpi4py", "numpy", "h5py", "tqdm", "Cython", "setuptools", "wheel")


def need(condition, reason):
    if not condition:
        (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(reason)


def checked(argv, timeout, **kwargs):
    code, out, _ = finish_job(start_job(argv, **kwargs), timeout)
    assert code == 0, f"{' '.join(map(str, argv))} exited {code}:\n{out[-6000:]}"
    return out


def user_env(venv):
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MPICC", "MPICXX", "PYTHONHOME", "MPI4PY_LIBMPI")
    }
    env["PATH"] = os.pathsep.join([os.path.join(venv, "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture(scope="module")
def debian_venv():
    need(os.access(DEBIAN_PYTHON, os.X_OK), f"no {DEBIAN_PYTHON} (Debian's Python, built as a shared library)")
    need(
        os.path.exists(OPEN_MPI) and os.path.exists(os.path.join(SYSTEM_LIBDIR, "libmpi.so")),
        f"Open MPI's development files are not in {SYSTEM_LIBDIR} (scripts/openmpi.sh install)",
    )
    shared = subprocess.run(
        [
            DEBIAN_PYTHON,
            "-c",
            "import sysconfig; print(sysconfig.get_config_var('Py_ENABLE_SHARED'), sysconfig.get_config_var('LIBDIR'))",
        ],
        capture_output=True,
        text=True,
    ).stdout.split()
    assert shared == ["1", SYSTEM_LIBDIR], shared  # what makes setuptools add the -L
    with open(os.path.join(ROOT, "requirements.txt")) as fh:
        pins = [line.strip() for line in fh if re.match(r"^(%s)\b" % "|".join(PINNED), line)]
    venv = os.path.join(ROOT, ".venv-debian")
    stamp = os.path.join(venv, ".requirements-" + hashlib.sha1("\n".join(pins).encode()).hexdigest()[:12])
    if not os.path.exists(stamp):
        shutil.rmtree(venv, ignore_errors=True)
        checked([DEBIAN_PYTHON, "-m", "venv", venv], 300)
        checked(
            [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--quiet"] + pins, 900, env=user_env(venv)
        )
        open(stamp, "w").close()
    return venv


@pytest.fixture(scope="module")
def checkout_copy(tmp_path_factory):
    """This checkout's files as they are (tracked and untracked, not ignored), nothing built."""
    copy = tmp_path_factory.mktemp("one-mpi") / "hpcdl"
    copy.mkdir()
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        source = os.path.join(ROOT, name.decode())
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(copy, name.decode())), exist_ok=True)
            shutil.copy2(source, os.path.join(copy, name.decode()))
    return copy


def test_mpich_build_beside_a_system_open_mpi_runs_a_two_rank_allreduce(debian_venv, checkout_copy, tmp_path):
    venv, env = debian_venv, user_env(debian_venv)
    python = os.path.join(venv, "bin", "python")
    checked(
        [
            python,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-build-isolation",
            "--no-deps",
            "--force-reinstall",
            str(checkout_copy),
        ],
        1200,
        env=env,
        cwd=tmp_path,
    )
    script = tmp_path / "allreduce.py"
    script.write_text(
        "import json, sys\nimport numpy as np\nimport hpcdl\n"
        "x = np.arange(1000, dtype=np.float32) * (hpcdl.rank() + 1)\n"
        "hpcdl.allreduce(x, op='sum')\n"
        "libmpi = sorted({l.split()[-1] for l in open('/proc/self/maps') if '/libmpi.so' in l})\n"
        "with open(f'{sys.argv[1]}/rank{hpcdl.rank()}.json', 'w') as fh:\n"
        "    json.dump([hpcdl.rank(), hpcdl.size(), x.tolist() == [3.0 * i for i in range(1000)],"
        " libmpi, hpcdl.__file__], fh)\n"
    )
    out = checked(
        [os.path.join(venv, "bin", "mpiexec"), "-n", "2", python, str(script), str(tmp_path)],
        300,
        env=env,
        cwd=tmp_path,
    )
    rows = []
    for rank in (0, 1):
        with open(tmp_path / f"rank{rank}.json") as fh:
            rows.append(json.load(fh))
    assert [row[:3] for row in rows] == [[0, 2, True], [1, 2, True]], out[-3000:]
    for row in rows:
        assert len(row[3]) == 1 and os.path.realpath(row[3][0]).startswith(os.path.realpath(venv)), row
        assert row[4].startswith(venv), row  # the installed hpcdl, not a checkout's


def test_a_build_against_another_mpi_than_mpi4py_s_fails_clearly_at_import(debian_venv, checkout_copy):
    """The build is forced onto Open MPI (mpi4py told to load it while building, and Open MPI's
    wrapper named); at run time mpi4py loads the venv's MPICH, so import hpcdl must refuse."""
    venv, env = debian_venv, user_env(debian_venv)
    python = os.path.join(venv, "bin", "python")
    build_env = dict(env, MPI4PY_LIBMPI=OPEN_MPI, MPICXX="/usr/bin/mpicxx.openmpi")
    out = checked(
        [python, "setup.py", "--quiet", "build_ext", "--inplace", "--force"], 1200, env=build_env, cwd=checkout_copy
    )
    assert "libmpi.so.40" in out, out[-3000:]
    code, out, _ = finish_job(start_job([python, "-c", "import hpcdl"], env=env, cwd=checkout_copy), 120)
    assert code != 0 and "ImportError: hpcdl cannot load its core: two MPI libraries" in out, out[-3000:]
    assert re.search(r"mpi4py loads: +\S+/libmpi\.so\.12 \(MPICH Version", out), out[-3000:]
    assert re.search(r"hpcdl's core: +\S+/libmpi\.so\.40\S* \(Open MPI v", out), out[-3000:]
    assert "pip install --no-build-isolation" in out, out[-3000:]
