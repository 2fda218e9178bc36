# Sourced by every slurm/*.sbatch script: the environment, node-local scratch and the
# MPI launch, in one place. Edit the "site" part below once for your cluster.
#
# Settings (environment variables; pass them with `sbatch --export=ALL,NAME=value ...`):
#   HPCDL_HOME     the hpcdl checkout (bench/, examples/); default: the directory you ran sbatch in
#   HPCDL_VENV     a virtual environment to activate; default: $HPCDL_HOME/.venv if it exists
#   HPCDL_MODULES  environment modules to load first, e.g. "python/3.11 openmpi/4.1"
#   HPCDL_LAUNCH   srun (default) or mpiexec
#   HPCDL_SRUN_MPI the srun MPI plugin: pmi2 (default; what the mpich wheel speaks) or pmix
#                  (Open MPI and other site MPIs built with PMIx)
#   HPCDL_SCRATCH  node-local directory for the prefetcher's disk tier; default
#                  ${SLURM_TMPDIR:-${TMPDIR:-/tmp}}/hpcdl-$SLURM_JOB_ID, made on every
#                  node before the run and removed after it
# After sourcing: `launch PROGRAM ARGS...` starts one PROGRAM per Slurm task.

set -euo pipefail

hpcdl_log() { echo "[hpcdl job ${SLURM_JOB_ID:-?}] $*"; }

if [ -z "${SLURM_JOB_ID:-}" ]; then
  echo "slurm/job-env.sh: not inside a Slurm job; submit the script with sbatch" >&2
  exit 2
fi

# ---- site: how this cluster provides Python and MPI (edit here) ----------------------
if [ -n "${HPCDL_MODULES:-}" ]; then
  # shellcheck disable=SC2086 # a list of module names
  module load $HPCDL_MODULES
fi
HPCDL_HOME=${HPCDL_HOME:-$SLURM_SUBMIT_DIR}
HPCDL_VENV=${HPCDL_VENV:-$HPCDL_HOME/.venv}
if [ -e "$HPCDL_VENV/bin/activate" ]; then
  # shellcheck disable=SC1091
  source "$HPCDL_VENV/bin/activate"
fi
export HPCDL_HOME
# One thread per core given to each task; srun (Slurm >= 22.05) no longer inherits
# --cpus-per-task from sbatch unless told through SRUN_CPUS_PER_TASK.
export OMP_NUM_THREADS=${SLURM_CPUS_PER_TASK:-1}
export SRUN_CPUS_PER_TASK=${SLURM_CPUS_PER_TASK:-1}
# HDF5's file locks fail or serialize on Lustre and NFS; hpcdl's stores are read-only
# while training, so the lock buys nothing there.
export HDF5_USE_FILE_LOCKING=${HDF5_USE_FILE_LOCKING:-FALSE}
export PYTHONUNBUFFERED=1

# ---- node-local scratch: the prefetcher's disk tier -----------------------------------
export HPCDL_SCRATCH=${HPCDL_SCRATCH:-${SLURM_TMPDIR:-${TMPDIR:-/tmp}}/hpcdl-$SLURM_JOB_ID}

# One task on every node of the job (for mkdir/rm on node-local disks).
on_every_node() {
  srun --mpi=none --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" \
    --ntasks-per-node=1 --cpus-per-task=1 "$@"
}

hpcdl_cleanup() {
  local status=$?
  trap - EXIT
  # The batch step's own node first: that works even once Slurm has ended the job.
  rm -rf "$HPCDL_SCRATCH"
  if [ "$SLURM_JOB_NUM_NODES" -gt 1 ]; then
    on_every_node rm -rf "$HPCDL_SCRATCH" ||
      hpcdl_log "could not remove $HPCDL_SCRATCH on the other nodes (job already ended?)"
  fi
  hpcdl_log "finished with exit status $status"
  exit "$status"
}
trap hpcdl_cleanup EXIT
# SIGTERM to the batch shell (sbatch --signal=B:TERM@SECONDS before the time limit, or
# scancel --batch --signal=TERM) ends the run while the job can still start the
# clean-up steps; launch() waits in the background so the trap runs at once.
hpcdl_on_signal() {
  if [ -n "${hpcdl_launched:-}" ]; then
    kill -TERM "$hpcdl_launched" 2>/dev/null
    wait "$hpcdl_launched" 2>/dev/null
  fi
  exit 143
}
trap hpcdl_on_signal TERM INT
on_every_node mkdir -p "$HPCDL_SCRATCH"

# ---- launch ---------------------------------------------------------------------------
launch() {
  case ${HPCDL_LAUNCH:-srun} in
    srun) set -- srun --mpi="${HPCDL_SRUN_MPI:-pmi2}" "$@" ;;
    # A site MPI's own launcher; it reads the allocation from Slurm's environment.
    mpiexec) set -- mpiexec -n "$SLURM_NTASKS" "$@" ;;
    *) echo "HPCDL_LAUNCH must be srun or mpiexec, got '$HPCDL_LAUNCH'" >&2; return 2 ;;
  esac
  "$@" &
  hpcdl_launched=$!
  wait "$hpcdl_launched"
}

launch_description=${HPCDL_LAUNCH:-srun}
[ "$launch_description" = srun ] && launch_description="srun --mpi=${HPCDL_SRUN_MPI:-pmi2}"
hpcdl_log "nodes=$SLURM_JOB_NUM_NODES tasks=$SLURM_NTASKS cpus-per-task=${SLURM_CPUS_PER_TASK:-1}" \
  "launch='$launch_description' python=$(command -v python) scratch=$HPCDL_SCRATCH"
