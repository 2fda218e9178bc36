#!/usr/bin/env bash
# Open MPI as a second real MPI beside PyPI's MPICH (docs/testing.md): Debian's Open MPI, mpi4py built
# against it and hpcdl built the site-MPI way of docs/building.md (MPICC=mpicc, no build isolation),
# then the MPI test suite under Open MPI's mpirun.
#   scripts/openmpi.sh install   apt-get install Open MPI's development files and launcher if missing
#   scripts/openmpi.sh setup     $HPCDL_OPENMPI_VENV (.venv-openmpi): its own mpi4py for Open MPI, every other
#                                package from $HPCDL_VENV (.venv, made by scripts/bootstrap.sh) through a .pth
#                                line after its own site-packages; a copy of the checkout in it, built in place
#   scripts/openmpi.sh test [pytest args]   tests/mpi in that copy under mpirun.openmpi -n 4 (as root too)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BASE=${HPCDL_VENV:-.venv}  # made by scripts/bootstrap.sh, which runs after `install` in .ci/run
VENV=${HPCDL_OPENMPI_VENV:-.venv-openmpi}
MPICC=${OPENMPI_MPICC:-/usr/bin/mpicc.openmpi}
MPIRUN=${OPENMPI_MPIRUN:-/usr/bin/mpirun.openmpi}
MPI4PY=$(grep -E '^mpi4py==' requirements.txt)

install() {
  [ -x "$MPICC" ] && [ -x "$MPIRUN" ] && return 0
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq --no-install-recommends libopenmpi-dev openmpi-bin >/dev/null
}

setup() {
  [ -x "$MPICC" ] || { echo "openmpi.sh: no $MPICC; run scripts/openmpi.sh install" >&2; exit 1; }
  BASE=$(cd "$BASE" && pwd)
  [ -x "$VENV/bin/python" ] || "$BASE/bin/python" -m venv --without-pip "$VENV"  # pip, setuptools: the base's
  VENV=$(cd "$VENV" && pwd)
  local py="$VENV/bin/python"
  local site
  site=$("$py" -c "import sysconfig; print(sysconfig.get_path('purelib'))")
  "$BASE/bin/python" -c "import sysconfig; print(sysconfig.get_path('purelib'))" >"$site/hpcdl-base-venv.pth"
  # mpi4py is rebuilt when its pin or the MPI changes; pip's wheel cache ignores MPICC, so it is not used.
  local stamp="$VENV/.mpi4py-$( (echo "$MPI4PY"; "$MPICC" --showme:version 2>&1) | sha1sum | cut -c1-12)"
  if [ ! -e "$stamp" ]; then
    rm -f "$VENV"/.mpi4py-*
    MPICC="$MPICC" "$py" -m pip install --quiet --no-cache-dir --no-build-isolation --no-deps --ignore-installed \
      --no-binary mpi4py "$MPI4PY"
    touch "$stamp"
  fi
  # The checkout's files as they are now (tracked and untracked, not ignored), built in place. Only build/
  # stays between runs: a file moved or deleted in the checkout must not linger in the copy.
  mkdir -p "$VENV/src"
  find "$VENV/src" -mindepth 1 -maxdepth 1 ! -name build -exec rm -rf {} +
  git ls-files -z --cached --others --exclude-standard | tar --null -cf - -T - | tar -xf - -C "$VENV/src"
  (cd "$VENV/src" && MPICC="$MPICC" "$py" setup.py --quiet build_ext --inplace -j 2 2>&1 \
    | grep -vE "SetuptoolsDeprecationWarning|^\s*$|warnings.warn|!!|\*\*\*\*" || true)
  (cd "$VENV/src" && "$py" -c "import hpcdl, sys; from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])")
}

test_suite() {
  VENV=$(cd "$VENV" && pwd)
  cd "$VENV/src"
  # As root Open MPI wants both ALLOW variables; 4 ranks on fewer cores need oversubscription; the vader
  # shared-memory transport's single-copy (CMA) needs ptrace rights containers often lack.
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
    OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none \
    "$MPIRUN" --oversubscribe -n 4 \
    "$VENV/bin/python" -m pytest -q -p no:cacheprovider --with-mpi -m mpi "$@" tests/mpi
}

case "${1:-}" in
  install) install ;;
  setup) setup ;;
  test) shift; test_suite "$@" ;;
  *) echo "usage: scripts/openmpi.sh install|setup|test [pytest args]" >&2; exit 2 ;;
esac
