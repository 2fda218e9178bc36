#!/usr/bin/env bash
# The site-MPI case on a GPU machine: hpcdl built against the machine's own Open MPI (not the MPICH
# wheel), with an mpi4py for that MPI, then the `cuda and mpi` tests under Open MPI's mpirun.
# Run there after ../shared/device/device-check.sh, from the project's root, with .whl/ carried:
#     bash scripts/gpu-site-mpi.sh            (log: $OUT/site-mpi.log, OUT defaults to /tmp/out)
# mpi4py comes from .whl/site/mpi4py-*.whl (built here for that MPI and Python) or else is built there
# from .whl/sdist/mpi4py-*.tar.gz; docs/testing.md ("GPU tests and the device check") shows how.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
exec > >(tee -a "$OUT/site-mpi.log") 2>&1
t0=$(date +%s)
MPICC=$(command -v mpicc.openmpi || command -v mpicc) || { echo "no mpicc here"; exit 1; }
MPIRUN=$(command -v mpirun.openmpi || command -v mpirun) || { echo "no mpirun here"; exit 1; }
echo "MPICC=$MPICC MPIRUN=$MPIRUN"; "$MPIRUN" --version 2>&1 | head -1
image_site=$(python3 -c "import torch, os; print(os.path.dirname(os.path.dirname(torch.__file__)))")
venv=/tmp/site-mpi-venv; rm -rf "$venv"; python3 -m venv "$venv"
# Installed before the image's packages become visible (device-check.sh's trap 2).
"$venv/bin/python" -m pip install -q --no-index --no-deps --ignore-installed .whl/setuptools-*.whl \
  .whl/cython-*.whl .whl/tqdm-*.whl .whl/pytest_mpi-*.whl .whl/pytest_timeout-*.whl || exit 1
if compgen -G ".whl/site/mpi4py-*.whl" > /dev/null; then
  "$venv/bin/python" -m pip install -q --no-index --no-deps .whl/site/mpi4py-*.whl || exit 1
else
  echo "building mpi4py for $MPICC"
  MPICC="$MPICC" timeout 400 "$venv/bin/python" -m pip install -q --no-index --no-deps --no-build-isolation \
    .whl/sdist/mpi4py-*.tar.gz > "$OUT/site-mpi4py.log" 2>&1 || { echo "mpi4py build failed"; tail -20 "$OUT/site-mpi4py.log"; exit 1; }
fi
echo "$image_site" > "$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/image-site.pth"
export PATH=$venv/bin:$PATH PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
python -c "import mpi4py, torch; from mpi4py import MPI; print('mpi4py', mpi4py.__file__, '|', MPI.Get_library_version().splitlines()[0], '| torch', torch.__version__)"
# A copy of the tree without the MPICH build, built for this MPI.
src=/tmp/site-mpi-src; rm -rf "$src"; mkdir -p "$src"
tar --exclude=./.whl --exclude=./build --exclude='*.so' -cf - . | tar -xf - -C "$src"; cd "$src"
MPICC="$MPICC" timeout 300 python setup.py -q build_ext --inplace -j 16 > "$OUT/site-build.log" 2>&1 \
  || { echo "build failed"; tail -30 "$OUT/site-build.log"; exit 1; }
readelf -d hpcdl/_core*.so | grep -E "NEEDED.*libmpi|RUNPATH"
echo "built in $(( $(date +%s) - t0 )) s"
# As scripts/openmpi.sh runs it: as root, one node, no single-copy (CMA needs ptrace rights containers lack).
export PYTHONPATH=$src OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none
python -c "import hpcdl, numpy as np; a = np.ones(4, np.float32); hpcdl.allreduce(a); print('allreduce ok', a)"
timeout 200 "$MPIRUN" -n 2 python -m pytest -q -p no:cacheprovider --with-mpi -m "cuda and mpi" -rfEs --tb=short \
  --timeout=120 "$@" tests 2>&1 | tail -30
echo "site-MPI check done in $(( $(date +%s) - t0 )) s"
