#!/usr/bin/env bash
# A private single-node Slurm cluster on this machine, for testing slurm/*.sbatch.
#
#   scripts/slurm-cluster.sh install  # apt-get install the packages if missing (root)
#   scripts/slurm-cluster.sh start    # install (apt, as root) if missing, configure, start, wait idle
#   scripts/slurm-cluster.sh status   # exit 0 when the node answers and is usable
#   scripts/slurm-cluster.sh stop     # stop what start started and remove its directory
#   scripts/slurm-cluster.sh env      # print `export SLURM_CONF=...` for your shell
#
# Everything lives in $HPCDL_SLURM_DIR (default /tmp/hpcdl-slurm): slurm.conf, the munge
# key and socket, state and spool directories, pid files and logs. Clients and daemons
# find the config through SLURM_CONF, so /etc/slurm and the system munged are never used.
# The node is this host with CPUs=4 (SlurmdParameters=config_overrides lets a 2-core
# machine run 4 ranks), MpiDefault=pmi2, no cgroups (proctrack/linuxproc, task/none).
#
# Exit status of start: 0 running; 1 failed to start (daemon logs printed);
# 3 Slurm cannot run here: not root (slurmd and munged need it), or not installed
#   and apt-get cannot install it.
set -uo pipefail

DIR=${HPCDL_SLURM_DIR:-/tmp/hpcdl-slurm}
CTLD_PORT=${HPCDL_SLURMCTLD_PORT:-6817}
SLURMD_PORT=${HPCDL_SLURMD_PORT:-6818}
START_TIMEOUT=${HPCDL_SLURM_START_TIMEOUT:-90}
CONF=$DIR/slurm.conf
export SLURM_CONF=$CONF
NODE=$(hostname -s)
PACKAGES=(slurmctld slurmd slurm-client munge)
PROGRAMS=(slurmctld slurmd sbatch srun sinfo squeue scancel scontrol munged mungekey runuser)

say() { echo "[slurm-cluster] $*" >&2; }

missing_programs() {
  local p
  for p in "${PROGRAMS[@]}"; do command -v "$p" >/dev/null || echo "$p"; done
}

install_slurm() {
  [ -z "$(missing_programs)" ] && return 0
  if [ "$(id -u)" != 0 ]; then
    say "Slurm is not installed ($(missing_programs | xargs)) and installing it needs root:"
    say "  apt-get install ${PACKAGES[*]}"
    return 3
  fi
  if ! command -v apt-get >/dev/null; then
    say "Slurm is not installed and this machine has no apt-get: install ${PACKAGES[*]} yourself"
    return 3
  fi
  say "installing ${PACKAGES[*]} with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  # Another apt on the machine holds the dpkg lock for a while: wait for it, don't fail.
  local apt=(apt-get -q -y -o DPkg::Lock::Timeout=600)
  if ! { "${apt[@]}" update >/dev/null && "${apt[@]}" install --no-install-recommends "${PACKAGES[@]}" >/dev/null; }; then
    say "apt-get could not install ${PACKAGES[*]}"
    return 3
  fi
  [ -z "$(missing_programs)" ] || { say "still missing after install: $(missing_programs | xargs)"; return 3; }
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_config() {
  mkdir -p "$DIR"/{state,spool,log,run}
  chmod 755 "$DIR"
  # munged refuses keys and sockets in directories others can write to; it runs as munge.
  install -d -m 755 -o munge -g munge "$DIR/munge"
  if [ ! -s "$DIR/munge/munge.key" ]; then
    runuser -u munge -- mungekey --create --keyfile="$DIR/munge/munge.key" || return 1
  fi
  cat >"$CONF" <<EOF
# Written by scripts/slurm-cluster.sh: a private one-node cluster (slurm $(slurmd -V | awk '{print $2}')).
ClusterName=hpcdl-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$DIR/munge/munge.socket
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
# No cgroups: this sandbox (and many containers) cannot delegate them.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=pmi2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
ReturnToService=2
MailProg=/bin/true
SlurmdParameters=config_overrides
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=4 RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=60 State=UP
EOF
  # Slurm reads plugstack.conf next to slurm.conf; an empty one keeps /etc/slurm's out.
  : >"$DIR/plugstack.conf"
  echo "PlugStackConfig=$DIR/plugstack.conf" >>"$CONF"
}

node_state() { sinfo -h -N -n "$NODE" -o %T 2>/dev/null | head -1; }

print_logs() {
  local f
  for f in "$DIR"/log/*.log; do
    [ -e "$f" ] || continue
    say "---- last lines of $f ----"
    tail -n 30 "$f" >&2
  done
}

start() {
  if [ "$(id -u)" != 0 ]; then
    say "starting a private cluster needs root (slurmd runs jobs as their users, munged as munge)"
    return 3
  fi
  install_slurm || return $?
  if status >/dev/null 2>&1; then
    say "already running (SLURM_CONF=$CONF)"
    return 0
  fi
  stop_daemons
  write_config || { say "could not write the configuration in $DIR"; return 1; }
  if ! pid_alive "$DIR/run/munged.pid"; then
    runuser -u munge -- munged --socket="$DIR/munge/munge.socket" --key-file="$DIR/munge/munge.key" \
      --pid-file="$DIR/munge/munged.pid" --log-file="$DIR/munge/munged.log" \
      --seed-file="$DIR/munge/munged.seed" || { say "munged did not start"; cat "$DIR/munge/munged.log" >&2; return 1; }
    cp "$DIR/munge/munged.pid" "$DIR/run/munged.pid"
  fi
  # -D: stay in the foreground of a background job, so the recorded pid is the daemon's.
  # setsid: the daemons outlive this script and ignore its terminal's signals.
  setsid slurmctld -D -f "$CONF" >>"$DIR/log/slurmctld.out" 2>&1 < /dev/null &
  echo $! >"$DIR/run/slurmctld.daemon.pid"
  setsid slurmd -D -f "$CONF" >>"$DIR/log/slurmd.out" 2>&1 < /dev/null &
  echo $! >"$DIR/run/slurmd.daemon.pid"
  local waited=0 state=""
  while [ $waited -lt "$START_TIMEOUT" ]; do
    state=$(node_state)
    case $state in
      idle|mixed|allocated) say "node $NODE is $state (SLURM_CONF=$CONF)"; return 0 ;;
      down*|drain*) scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 ;;
    esac
    for d in slurmctld slurmd; do
      if ! pid_alive "$DIR/run/$d.daemon.pid"; then
        say "$d exited while starting"
        print_logs; tail -n 20 "$DIR/log/$d.out" >&2
        stop_daemons
        return 1
      fi
    done
    sleep 1; waited=$((waited + 1))
  done
  say "node $NODE not idle after ${START_TIMEOUT}s (state: '${state:-no answer}')"
  print_logs
  stop_daemons
  return 1
}

status() {
  pid_alive "$DIR/run/slurmctld.daemon.pid" && pid_alive "$DIR/run/slurmd.daemon.pid" || {
    echo "not running"; return 1; }
  local state; state=$(node_state)
  echo "node $NODE: ${state:-no answer} (SLURM_CONF=$CONF)"
  case $state in idle|mixed|allocated|completing) return 0 ;; *) return 1 ;; esac
}

stop_daemons() {
  local name f pid
  for name in slurmd.daemon slurmctld.daemon munged; do
    f=$DIR/run/$name.pid
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
      kill "$pid" 2>/dev/null
      for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
    fi
    rm -f "$f"
  done
  return 0
}

# Jobs still running would leave their slurmstepd behind a stopped slurmd: cancel them first.
cancel_jobs() {
  pid_alive "$DIR/run/slurmctld.daemon.pid" || return 0
  scancel --full --user="$(id -un)" 2>/dev/null || return 0
  for _ in $(seq 30); do
    [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
    sleep 0.5
  done
  return 0
}

stop() {
  cancel_jobs
  stop_daemons
  rm -rf "$DIR"
  say "stopped; removed $DIR"
}

case ${1:-} in
  install) install_slurm ;;
  start) start ;;
  stop) stop ;;
  status) status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  *) echo "usage: $0 install|start|stop|status|env" >&2; exit 2 ;;
esac
