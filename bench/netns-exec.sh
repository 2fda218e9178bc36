#!/usr/bin/env bash
# Started by mpiexec once per rank: moves the rank into its emulated host
# hn$PMI_RANK (made by bench/netcluster.sh: its network namespace and, with
# --cpus, its CPU cgroup) and runs CMD there, with MPICH kept
# on TCP over eth0. mpiexec's PMI connection is a file descriptor it passed
# down (PMI_FD), so it survives the move into another network namespace.
#
#   mpiexec -n 4 bench/netns-exec.sh python bench/allreduce.py ...
set -euo pipefail
rank=${PMI_RANK:?"run me under mpiexec (PMI_RANK is not set)"}
ns=hn$rank
ip netns list | grep -qE "^$ns( |$)" || { echo "[netns-exec rank $rank] no namespace $ns: run bench/netcluster.sh up" >&2; exit 1; }
cgroup=$("$(dirname "$0")/netcluster.sh" cgroup "$rank")
[ -z "$cgroup" ] || echo $$ 2>/dev/null > "$cgroup/cgroup.procs" \
  || { echo "[netns-exec rank $rank] cannot join the CPU cgroup $cgroup of host $ns" >&2; exit 1; }
# Without NOLOCAL (and the ofi netmod: ucx would move data through shared
# memory anyway) ranks on the same kernel bypass the links we emulate.
export MPIR_CVAR_NOLOCAL=1 MPIR_CVAR_CH4_NETMOD=ofi FI_PROVIDER=tcp FI_TCP_IFACE=eth0
export GLOO_SOCKET_IFNAME=eth0 MASTER_ADDR=10.77.0.1
exec ip netns exec "$ns" "$@"
