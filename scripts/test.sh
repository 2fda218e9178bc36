#!/usr/bin/env bash
# The whole test suite: the C++ format check (scripts/lint.sh), single-process tests (tests/unit), then the MPI tests (tests/mpi)
# under 4 ranks (and the ring's odd-size runs under 3 and 5 ranks, the allreduce's under 8: halving-doubling's
# first size), then the MPI tests again under Open
# MPI (scripts/openmpi.sh; where it is not installed this part is skipped, except with CI=true).
# Sets itself up first.
set -uo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh || exit 1
VENV=${HPCDL_VENV:-.venv}
export PATH="$(cd "$VENV" && pwd)/bin:$PATH"
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2
# A hang becomes a failure: pytest-timeout per test, `timeout` per run.
status=0
run() { echo "+ $*"; local start=$SECONDS; "$@" || status=1; echo "+ took $((SECONDS - start)) s: $*"; }
run ./scripts/lint.sh
run timeout 3000 python -m pytest -q -p no:cacheprovider -m "not mpi" "$@" tests/unit
for n in 4 3 5 8; do
  files=tests/mpi
  [ "$n" != 4 ] && files="tests/mpi/test_allreduce.py tests/mpi/test_sparse_allreduce.py tests/mpi/test_topk_segments_mpi.py"
  [ "$n" = 8 ] && files=tests/mpi/test_allreduce.py
  run timeout 2400 mpiexec -n $n python -m pytest -q -p no:cacheprovider --with-mpi -m mpi "$@" $files
done
if [ -x /usr/bin/mpicc.openmpi ] || [ "${CI:-}" = true ]; then
  run ./scripts/openmpi.sh setup && run timeout 2400 ./scripts/openmpi.sh test "$@"
else
  echo "test.sh: Open MPI is not installed (scripts/openmpi.sh install): its pass is skipped"
fi
exit $status
