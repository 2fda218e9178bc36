#!/usr/bin/env bash
# The main job: sets itself up, then trains on the digits packed into an hpcdl
# store with 4 ranks and the Int8-compressed ring allreduce (examples/train_torch.py).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/bootstrap.sh
VENV=${HPCDL_VENV:-.venv}
export PATH="$(cd "$VENV" && pwd)/bin:$PATH" OMP_NUM_THREADS=1 TF_CPP_MIN_LOG_LEVEL=2
exec mpiexec -n "${HPCDL_DEMO_RANKS:-4}" python examples/train_torch.py --compression int8 --epochs 8 "$@"
