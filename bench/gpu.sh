#!/usr/bin/env bash
# The GPU benchmark: bench/train_gpu.py (ResNet-50 on CUDA) with 1 rank, then 2 ranks sharing
# the machine's GPUs; CSV + PNG in OUTDIR. ../shared/device/device-check.sh runs it when present.
#     bench/gpu.sh OUTDIR
set -euo pipefail
out=${1:?usage: bench/gpu.sh OUTDIR}
cd "$(dirname "$0")/.."
if ! python -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "bench/gpu.sh: no CUDA device here: the GPU benchmark needs one" >&2
  exit 2
fi
mkdir -p "$out"
for ranks in 1 2; do
  timeout 240 mpiexec -n "$ranks" python bench/train_gpu.py --out "$out" --tag "gpu-resnet50-${ranks}rank"
done
