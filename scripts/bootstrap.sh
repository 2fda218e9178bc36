#!/usr/bin/env bash
# Make .venv with everything hpcdl needs and build its extensions in place.
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${HPCDL_VENV:-.venv}
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  python3 -m venv "$VENV"
fi
stamp="$VENV/.requirements-$(cat requirements.txt requirements-dlio.txt | sha1sum | cut -c1-12)"
if [ ! -e "$stamp" ]; then
  "$PY" -m pip install --quiet --upgrade pip
  "$PY" -m pip install --quiet -r requirements.txt
  # DLIO's metadata asks for CUDA packages it does not need: its real needs are pinned there.
  "$PY" -m pip install --quiet --no-deps -r requirements-dlio.txt
  touch "$stamp"
fi
# Build in place with the venv's own MPI wrapper (no isolated build env), under a
# lock so parallel callers never write the same .so at once.
(
  flock 9
  "$PY" setup.py --quiet build_ext --inplace -j 2 2>&1 | grep -vE "SetuptoolsDeprecationWarning|^\s*$|warnings.warn|!!|\*\*\*\*" || true
  test -x "$VENV/bin/hpcdl" || "$PY" -m pip install --quiet --no-deps --no-build-isolation -e .
) 9>"$VENV/.build.lock"
"$PY" -c "import hpcdl" || { echo "bootstrap: hpcdl does not import" >&2; exit 1; }
