#!/usr/bin/env bash
# An emulated cluster on one machine: N "hosts", each a network namespace
# (hn0..hn{N-1}) with one interface eth0, all joined by a Linux bridge that
# lives in a namespace of its own (hnbr), every host link limited with a token
# bucket (tc tbf) in both directions. Addresses are 10.77.0.(i+1)/24 and exist
# only inside these namespaces, so no traffic leaves them.
#
#   bench/netcluster.sh [OPTIONS] up        create the namespaces (replaces a stale set)
#   bench/netcluster.sh down                remove them (any host count)
#   bench/netcluster.sh [OPTIONS] stream    measure one TCP stream hn0 -> hn1 (MB/s)
#   bench/netcluster.sh [OPTIONS] streams   up, then every host i streams to host i+1 (mod N)
#                                 at once, as a ring loads the links: each
#                                 receiver's MB/s, then down
#   bench/netcluster.sh cgroup I            print host I's CPU cgroup, if it has one
#   bench/netcluster.sh [OPTIONS] run -- CMD...
#                                 up, measure the stream, run CMD in the root
#                                 namespace with HPCDL_BENCH_STREAM_MBPS,
#                                 HPCDL_NET_HOSTS and HPCDL_NET_RATE set,
#                                 down (always, also on error or Ctrl-C)
# OPTIONS: --hosts N (default $HPCDL_NET_HOSTS, else 4), --rate RATE per host
# link and direction, in tc's units (e.g. 100mbit, 1gbit; default
# $HPCDL_NET_RATE, else 1gbit), --cpus C: each host's processes share C cores
# (a CPU cgroup hn$i with a CFS quota of C cores; default $HPCDL_NET_CPUS,
# else no limit). With C = cores / hosts every host has its own (slower)
# cores, as on a cluster, instead of hosts taking turns on shared ones.
#
# CMD is typically `mpiexec -n 4 bench/netns-exec.sh python bench/allreduce.py`:
# mpiexec stays here, bench/netns-exec.sh moves each rank into hn$PMI_RANK.
#   bench/netcluster.sh --hosts 8 --rate 100mbit run -- mpiexec -n 8 bench/netns-exec.sh CMD
# Needs root. Env: HPCDL_NET_HOSTS (4), HPCDL_NET_RATE (1gbit),
# HPCDL_NET_BURST (256kb), HPCDL_NET_LATENCY (50ms), HPCDL_NET_CPUS,
# HPCDL_NET_CPU_PERIOD_US (2000: the quota's period, so a throttled host
# waits at most ~1 ms at 0.5 cores; longer where the quota would be < 1 ms),
# HPCDL_STREAM_SECONDS (5: how long stream and streams send).
set -euo pipefail
cd "$(dirname "$0")/.."

HOSTS=${HPCDL_NET_HOSTS:-4}
RATE=${HPCDL_NET_RATE:-1gbit}
CPUS=${HPCDL_NET_CPUS:-}
usage() { echo "usage: $0 [--hosts N] [--rate RATE] [--cpus C] up|down|stream|streams|cgroup I|run -- CMD..." >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --hosts) [ $# -ge 2 ] || usage; HOSTS=$2; shift 2 ;;
    --hosts=*) HOSTS=${1#--hosts=}; shift ;;
    --rate) [ $# -ge 2 ] || usage; RATE=$2; shift 2 ;;
    --rate=*) RATE=${1#--rate=}; shift ;;
    --cpus) [ $# -ge 2 ] || usage; CPUS=$2; shift 2 ;;
    --cpus=*) CPUS=${1#--cpus=}; shift ;;
    *) break ;;
  esac
done
# 2..254 hosts: addresses are 10.77.0.1..HOSTS; a rate is digits, an optional
# fraction and a unit (tc checks the unit).
[[ "$HOSTS" =~ ^[0-9]+$ ]] && [ "$HOSTS" -ge 2 ] && [ "$HOSTS" -le 254 ] \
  || { echo "$0: --hosts must be an integer in 2..254, got '$HOSTS'" >&2; exit 2; }
[[ "$RATE" =~ ^[0-9]+(\.[0-9]+)?[A-Za-z]+$ ]] \
  || { echo "$0: --rate must be a tc rate such as 100mbit or 1gbit, got '$RATE'" >&2; exit 2; }
if [ -n "$CPUS" ]; then
  [[ "$CPUS" =~ ^([0-9]+\.?[0-9]*|\.[0-9]+)$ ]] && awk -v c="$CPUS" 'BEGIN { exit !(c > 0) }' \
    || { echo "$0: --cpus must be a positive number of cores such as 0.5, got '$CPUS'" >&2; exit 2; }
fi
STREAM_SECONDS=${HPCDL_STREAM_SECONDS:-5}
[[ "$STREAM_SECONDS" =~ ^[0-9]+$ ]] && [ "$STREAM_SECONDS" -ge 1 ] \
  || { echo "$0: HPCDL_STREAM_SECONDS must be a whole number of seconds >= 1, got '$STREAM_SECONDS'" >&2; exit 2; }
CPU_PERIOD_US=${HPCDL_NET_CPU_PERIOD_US:-2000}
BURST=${HPCDL_NET_BURST:-256kb}
LATENCY=${HPCDL_NET_LATENCY:-50ms}
BRIDGE_NS=hnbr
SUBNET=10.77.0
PY=${HPCDL_VENV:-.venv}/bin/python
[ -x "$PY" ] || PY=python3

log() { echo "[netcluster] $*" >&2; }

host_addr() { echo "$SUBNET.$(($1 + 1))"; }

shape() {  # shape NS DEV: limit what leaves DEV inside namespace NS
  ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$RATE" burst "$BURST" latency "$LATENCY"
}

# Host I's CPU cgroup (cgroup v2's cpu.max, else v1's cpu controller).
[ -f /sys/fs/cgroup/cgroup.controllers ] && CGROUP_V2=1 || CGROUP_V2=
cgroup_dir() {
  if [ -n "$CGROUP_V2" ]; then echo "/sys/fs/cgroup/hn$1"; else echo "/sys/fs/cgroup/cpu/hn$1"; fi
}

limit_cpus() {  # limit_cpus I: host I's processes share $CPUS cores
  local dir period quota
  dir=$(cgroup_dir "$1")
  # The kernel takes quotas of at least 1 ms: a longer period below 0.5 cores.
  period=$(awk -v c="$CPUS" -v p="$CPU_PERIOD_US" 'BEGIN { q = 1000 / c; printf "%d", (p > q ? p : q + 0.999) }')
  quota=$(awk -v c="$CPUS" -v p="$period" 'BEGIN { printf "%d", c * p }')
  {
    if [ -n "$CGROUP_V2" ]; then
      echo +cpu > /sys/fs/cgroup/cgroup.subtree_control && mkdir -p "$dir" && echo "$quota $period" > "$dir/cpu.max"
    else
      mkdir -p "$dir" && echo "$period" > "$dir/cpu.cfs_period_us" && echo "$quota" > "$dir/cpu.cfs_quota_us"
    fi
  } 2>/dev/null || { log "--cpus: cannot give host $1 the CPU cgroup $dir with a quota of $quota us per $period us" \
                         "(needs root and the cgroup cpu controller)"; exit 1; }
}

down() {
  local ns dir
  for ns in $(ip netns list | awk '{print $1}' | grep -E "^(hn[0-9]+|$BRIDGE_NS)$" || true); do
    ip netns del "$ns" || true  # deleting a namespace deletes its veth ends too
  done
  for dir in "$(dirname "$(cgroup_dir 0)")"/hn[0-9]*; do
    [ -d "$dir" ] || continue
    rmdir "$dir" 2>/dev/null || log "cannot remove $dir: processes of an emulated host still run in it"
  done
}

up() {
  down
  ip netns add "$BRIDGE_NS"
  ip -n "$BRIDGE_NS" link set lo up
  ip -n "$BRIDGE_NS" link add br0 type bridge
  ip -n "$BRIDGE_NS" link set br0 up
  for i in $(seq 0 $((HOSTS - 1))); do
    local ns=hn$i
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    # One veth pair per host: eth0 in the host, port$i on the bridge.
    ip link add "hnv$i" netns "$ns" type veth peer name "port$i" netns "$BRIDGE_NS"
    ip -n "$ns" link set "hnv$i" name eth0
    ip -n "$ns" addr add "$(host_addr "$i")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$BRIDGE_NS" link set "port$i" master br0 up
    shape "$ns" eth0                 # host -> network
    shape "$BRIDGE_NS" "port$i"      # network -> host
    [ -z "$CPUS" ] || limit_cpus "$i"
  done
  log "$HOSTS hosts up: hn0..hn$((HOSTS - 1)) at $SUBNET.1..$SUBNET.$HOSTS, links $RATE (tbf burst $BURST)$(
      [ -z "$CPUS" ] || echo ", $CPUS cores each (CPU cgroups hn0..hn$((HOSTS - 1)))")"
}

# A receiver whose sender never connects (it failed to start) gives up.
RECEIVE_LIMIT=$((STREAM_SECONDS + 30))

# One TCP stream hn0 -> hn1 for a few seconds; prints MB/s (10^6 bytes/s).
stream() {
  local port=5201 out
  out=$(mktemp)
  ip netns exec hn1 timeout "$RECEIVE_LIMIT" "$PY" bench/tcp_stream.py receive --port "$port" >"$out" &
  local receiver=$!
  sleep 0.5
  ip netns exec hn0 "$PY" bench/tcp_stream.py send --host "$(host_addr 1)" --port "$port" --seconds "$STREAM_SECONDS"
  wait "$receiver"
  cat "$out"
  rm -f "$out"
}

# Host i -> host i+1 (mod N), all at once: what each link carries when every
# host sends and receives, as in a ring step. Prints "hnJ MB/s" per receiver.
ring_streams() {
  local port=5202 dir i
  dir=$(mktemp -d)
  local receivers=()
  for i in $(seq 0 $((HOSTS - 1))); do
    ip netns exec "hn$i" timeout "$RECEIVE_LIMIT" "$PY" bench/tcp_stream.py receive --port "$port" >"$dir/hn$i" &
    receivers+=($!)
  done
  sleep 0.5
  local senders=()
  for i in $(seq 0 $((HOSTS - 1))); do
    ip netns exec "hn$i" "$PY" bench/tcp_stream.py send --host "$(host_addr $(((i + 1) % HOSTS)))" \
        --port "$port" --seconds "$STREAM_SECONDS" &
    senders+=($!)
  done
  local failed=0
  for pid in "${senders[@]}" "${receivers[@]}"; do wait "$pid" || failed=1; done
  for i in $(seq 0 $((HOSTS - 1))); do echo "hn$i $(cat "$dir/hn$i")"; done
  rm -rf "$dir"
  [ "$failed" = 0 ] || { log "a sender or receiver failed"; return 1; }
}

case "${1:-}" in
  up) up ;;
  down) down; log "down" ;;
  stream) stream ;;
  streams)
    trap 'down; log "down"' EXIT
    trap 'exit 130' INT TERM
    up
    rate=$(stream)
    log "TCP stream hn0 -> hn1 alone: $rate MB/s; host i -> host i+1, all at once:"
    ring_streams
    ;;
  cgroup)
    [[ "${2:-}" =~ ^[0-9]+$ ]] || usage
    [ ! -d "$(cgroup_dir "$2")" ] || cgroup_dir "$2"
    ;;
  run)
    shift
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || usage
    trap 'down; log "down"' EXIT
    trap 'exit 130' INT TERM
    up
    rate=$(stream)
    log "TCP stream hn0 -> hn1: $rate MB/s"
    HPCDL_BENCH_STREAM_MBPS=$rate HPCDL_NET_HOSTS=$HOSTS HPCDL_NET_RATE=$RATE HPCDL_NET_CPUS=$CPUS "$@"
    ;;
  *) usage ;;
esac
