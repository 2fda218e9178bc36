"""hpcdl as a cluster user installs it: the sdist built from this checkout goes
into a fresh virtual environment with `pip install "hpcdl-X.tar.gz[mpich]"`
(pip's own build isolation, so the build requirements in pyproject.toml build
every extension from the .pyx/.cc sources), then hpcdl runs from outside the
checkout: --version, a 2-rank allreduce under the environment's own mpiexec,
`hpcdl bench` refusing clearly (bench/ is not installed) and the sdist's
bench/allreduce.py run with the install, without matplotlib. Single-process (it starts its own ranks);
the pip cache makes repeats faster, the extension build is the bulk."""

import csv
import glob
import json
import os
import re
import subprocess
import sys
import tarfile

import pytest

from conftest import ROOT, finish_job, start_job

# The first test also builds and installs (the module's fixture): minutes on a loaded machine.
pytestmark = pytest.mark.timeout(1800)


def run(argv, timeout, **kwargs):
    """argv's CompletedProcess; on timeout its whole process group is killed and the test fails."""
    code, out, _ = finish_job(start_job(argv, **kwargs), timeout)
    return subprocess.CompletedProcess(argv, code, out)


def checked(argv, timeout, **kwargs):
    proc = run(argv, timeout, **kwargs)
    assert proc.returncode == 0, f"{' '.join(map(str, argv))} exited {proc.returncode}:\n{proc.stdout[-6000:]}"
    return proc.stdout


def source_version():
    with open(os.path.join(ROOT, "hpcdl", "__init__.py")) as fh:
        return re.search(r'^__version__ = "([^"]+)"$', fh.read(), re.M).group(1)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(sdist path, venv, environment, a working directory outside the checkout)."""
    tmp = tmp_path_factory.mktemp("packaging")
    checked([sys.executable, "-m", "build", "--sdist", "--outdir", str(tmp / "dist"), ROOT], 600, cwd=ROOT)
    (sdist,) = glob.glob(str(tmp / "dist" / "hpcdl-*.tar.gz"))
    venv = str(tmp / "venv")
    checked([sys.executable, "-m", "venv", venv], 300)
    # A user's shell: the new environment first, no checkout on sys.path, no MPI of the test environment.
    env = {
        k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "MPICC", "MPICXX", "PYTHONHOME")
    }
    env["PATH"] = os.pathsep.join([os.path.join(venv, "bin"), "/usr/local/bin", "/usr/bin", "/bin"])
    checked(
        [os.path.join(venv, "bin", "python"), "-m", "pip", "install", "--quiet", f"{sdist}[mpich]"],
        900,
        env=env,
        cwd=str(tmp),
    )
    work = tmp / "work"
    work.mkdir()
    return sdist, venv, env, work


def test_sdist_carries_every_source_and_no_generated_cpp(installed):
    sdist = installed[0]
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    sources = [
        os.path.relpath(p, ROOT)
        for pattern in ("ext/_*.pyx", "ext/libhpcdl/*.pxd", "include/hpcdl/**/*.hpp", "src/**/*.cc")
        for p in glob.glob(os.path.join(ROOT, pattern), recursive=True)
    ]
    assert len(sources) > 20 and set(sources) <= names, sorted(set(sources) - names)
    assert not [n for n in names if n.startswith("ext/") and n.endswith(".cpp")]
    # bench/ is not installed, but the sdist carries its scripts as files (MANIFEST.in).
    assert {
        "LICENSE",
        "CHANGELOG.md",
        "bench/allreduce.py",
        "bench/store.py",
        "bench/prefetch.py",
        "bench/slowfs.sh",
    } <= names


def test_version_has_one_source(installed):
    _, venv, env, work = installed
    python = os.path.join(venv, "bin", "python")
    assert (
        checked([os.path.join(venv, "bin", "hpcdl"), "--version"], 120, env=env, cwd=work).strip()
        == f"hpcdl {source_version()}"
    )
    meta = checked(
        [
            python,
            "-c",
            "import importlib.metadata as m, json; d = m.metadata('hpcdl'); "
            "print(json.dumps([d['Version'], d['License-Expression'], d.get_all('Provides-Extra')]))",
        ],
        120,
        env=env,
        cwd=work,
    )
    version, license, extras = json.loads(meta)
    assert version == source_version() and license == "BSD-3-Clause"
    assert {"mpich", "torch", "tensorflow", "bench", "dlio"} <= set(extras)


def test_extensions_load_after_mpi4py_and_share_one_libmpi(installed):
    """pip's isolated build links with the build requirement's mpicxx, whose RUNPATH points into a
    temporary prefix pip deletes: the extensions load because `import hpcdl` imports mpi4py.MPI first,
    which maps the environment's libmpi.so.12. Every extension is imported after it, and one libmpi
    (the environment's) is in the process."""
    _, venv, env, work = installed
    probe = (
        "import json, sys, hpcdl, hpcdl.store, hpcdl.prefetch\n"
        "order = list(sys.modules)\n"
        "exts = [m for m in order if m.startswith('hpcdl._') and hasattr(sys.modules[m], '__file__')"
        " and sys.modules[m].__file__.endswith('.so')]\n"
        "libmpi = sorted({line.split()[-1] for line in open('/proc/self/maps') if '/libmpi.so' in line})\n"
        "print(json.dumps([hpcdl.__file__, order.index('mpi4py.MPI'), [order.index(m) for m in exts], exts,"
        " libmpi]))\n"
    )
    where, mpi_at, ext_at, exts, libmpi = json.loads(
        checked([os.path.join(venv, "bin", "python"), "-c", probe], 120, env=env, cwd=work).splitlines()[-1]
    )
    assert where.startswith(venv) and "site-packages" in where
    assert exts == ["hpcdl._core"]  # one compiled core: each singleton once
    assert all(mpi_at < at for at in ext_at), (mpi_at, ext_at)
    assert len(libmpi) == 1 and os.path.realpath(libmpi[0]).startswith(os.path.realpath(venv)), libmpi


def test_two_rank_allreduce_outside_the_checkout(installed):
    _, venv, env, work = installed
    script = work / "allreduce.py"
    script.write_text(
        "import json, sys\nimport numpy as np\nimport hpcdl\n"
        "x = np.arange(1000, dtype=np.float32) * (hpcdl.rank() + 1)\n"
        "hpcdl.allreduce(x, op='sum')\n"
        "with open(f'{sys.argv[1]}/rank{hpcdl.rank()}.json', 'w') as fh:\n"
        "    json.dump([hpcdl.size(), x.tolist()], fh)\n"
    )
    checked(
        [os.path.join(venv, "bin", "mpiexec"), "-n", "2", os.path.join(venv, "bin", "python"), str(script), str(work)],
        180,
        env=dict(env, OMP_NUM_THREADS="1"),
        cwd=work,
    )
    for rank in (0, 1):
        with open(work / f"rank{rank}.json") as fh:
            size, x = json.load(fh)
        assert size == 2 and x == [3.0 * i for i in range(1000)], (rank, size, x[:4])


def test_bench_is_not_installed(installed):
    """No hpcdl.bench in the install; `hpcdl bench` says where the benchmarks are."""
    _, venv, env, work = installed
    python = os.path.join(venv, "bin", "python")
    where = checked([python, "-c", "import hpcdl, os; print(os.path.dirname(hpcdl.__file__))"], 120, env=env, cwd=work)
    assert not os.path.exists(os.path.join(where.strip(), "bench"))
    proc = run([os.path.join(venv, "bin", "hpcdl"), "bench", "allreduce", "-n", "2"], 120, env=env, cwd=work)
    assert proc.returncode == 2, proc.stdout
    assert "hpcdl bench: error: no benchmark scripts beside" in proc.stdout, proc.stdout
    assert "bench/ of a checkout" in proc.stdout, proc.stdout


def test_sdist_bench_script_without_matplotlib_writes_its_csv(installed, tmp_path):
    """The sdist's bench/allreduce.py, run with the installed hpcdl (python CHECKOUT/bench/NAME.py)."""
    sdist, venv, env, work = installed
    python = os.path.join(venv, "bin", "python")
    assert run([python, "-c", "import matplotlib"], 60, env=env, cwd=work).returncode != 0  # not installed
    with tarfile.open(sdist) as tar:
        tar.extractall(tmp_path)
    (script,) = glob.glob(str(tmp_path / "hpcdl-*" / "bench" / "allreduce.py"))
    out_dir = work / "bench"
    out = checked(
        [
            os.path.join(venv, "bin", "mpiexec"),
            "-n",
            "2",
            python,
            script,
            "--systems",  # torch's gloo is not installed here
            "hpcdl,mpi",
            "--out",
            str(out_dir),
            "--sizes",
            "4KiB",
            "--budget",
            "0.05",
            "--max-iters",
            "3",
        ],
        300,
        env=dict(env, OMP_NUM_THREADS="1"),
        cwd=work,
    )
    assert f"skipped the plot {out_dir / 'allreduce.png'}: matplotlib is not installed" in out, out
    with open(out_dir / "allreduce.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert {(r["system"], r["bytes"], r["correct"]) for r in rows} == {
        ("hpcdl", "4096", "True"),
        ("mpi", "4096", "True"),
    }
    assert not os.path.exists(out_dir / "allreduce.png")
