#!/usr/bin/env bash
# The main job: sets itself up, then runs the 4-rank demo (see hpcdl/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
VENV=${HPCDL_VENV:-.venv}
export PATH="$(cd "$VENV" && pwd)/bin:$PATH" OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2
exec mpiexec -n "${HPCDL_DEMO_RANKS:-4}" python -m hpcdl.demo "$@"
