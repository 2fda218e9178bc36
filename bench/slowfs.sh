#!/usr/bin/env bash
# An emulated slow shared file system for benchmarks (needs root): an ext4
# image on a loop device, and a cgroup whose reads from that device are
# throttled (cgroup v1 blkio.throttle.*, or io.max where only cgroup v2 exists).
#
#   slowfs.sh setup DIR SIZE_MB       make DIR/fs.img, mount it at DIR/mnt
#   slowfs.sh throttle DIR IOPS BPS   limit reads of processes started by `run`
#   slowfs.sh run DIR CMD...          drop the page cache, run CMD in the throttled cgroup
#   slowfs.sh teardown DIR            unmount, free the loop device, remove the cgroup and image
set -euo pipefail

state() { cat "$1/state/$2"; }

cgroup_dir() {
  if [ -d /sys/fs/cgroup/blkio ]; then echo /sys/fs/cgroup/blkio/hpcdl-slowfs
  else echo /sys/fs/cgroup/hpcdl-slowfs; fi
}

case "${1:-}" in
  setup)
    dir=$2 size_mb=$3
    mkdir -p "$dir/mnt" "$dir/state"
    truncate -s "${size_mb}M" "$dir/fs.img"
    mkfs.ext4 -q -F -E lazy_itable_init=0,lazy_journal_init=0 "$dir/fs.img"
    loop=$(losetup -f --show "$dir/fs.img")
    echo "$loop" > "$dir/state/loop"
    mount "$loop" "$dir/mnt"
    cat "/sys/block/$(basename "$loop")/dev" > "$dir/state/majmin"
    echo "slowfs: $dir/fs.img on $loop mounted at $dir/mnt"
    ;;
  throttle)
    dir=$2 iops=$3 bps=$4
    cg=$(cgroup_dir)
    mkdir -p "$cg"
    majmin=$(state "$dir" majmin)
    if [ -d /sys/fs/cgroup/blkio ]; then
      echo "$majmin $iops" > "$cg/blkio.throttle.read_iops_device"
      echo "$majmin $bps" > "$cg/blkio.throttle.read_bps_device"
      echo "slowfs: cgroup v1 blkio throttle $iops read IOPS, $bps read B/s on $majmin"
    else
      echo "+io" > /sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
      echo "$majmin riops=$iops rbps=$bps" > "$cg/io.max"
      echo "slowfs: cgroup v2 io.max riops=$iops rbps=$bps on $majmin"
    fi
    echo "$cg" > "$dir/state/cgroup"
    ;;
  run)
    dir=$2; shift 2
    sync
    echo 3 > /proc/sys/vm/drop_caches
    if [ -e "$dir/state/cgroup" ]; then
      cg=$(state "$dir" cgroup)
      if [ -e "$cg/tasks" ]; then echo $$ > "$cg/tasks"; else echo $$ > "$cg/cgroup.procs"; fi
    fi
    exec "$@"
    ;;
  teardown)
    dir=$2
    if [ -e "$dir/state/loop" ]; then
      umount "$dir/mnt" 2>/dev/null || umount -l "$dir/mnt" || true
      losetup -d "$(state "$dir" loop)" || true
    fi
    if [ -e "$dir/state/cgroup" ]; then rmdir "$(state "$dir" cgroup)" 2>/dev/null || true; fi
    rm -rf "$dir/state" "$dir/fs.img"
    rmdir "$dir/mnt" 2>/dev/null || true
    echo "slowfs: torn down $dir"
    ;;
  *)
    sed -n '2,10p' "$0"; exit 2 ;;
esac
