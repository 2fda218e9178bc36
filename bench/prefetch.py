"""Epoch times and stall fractions: (a) PyTorch DataLoader over the store
(DistributedSampler, num_workers=2, prefetch_factor) against (b) hpcdl's
prefetcher, with a training step emulated by a fixed compute time per batch
(as DLIO does), on the emulated slow file system (bench/slowfs.sh), and the
simulator's predictions for the same setting.

    sudo python bench/prefetch.py                       # driver: setup, runs, CSV
    python bench/prefetch.py --files 1000 --compute 0.005  # smaller

The driver packs random files into a store on a throttled loop-mounted ext4
(read IOPS limited), then runs each loader under `mpiexec -n RANKS` through
`slowfs.sh run` (page cache dropped first). The page cache is also dropped at
the start of every epoch: on a cluster the node's cache does not hold a data
set on the shared file system, and here it would. The disk tier lives on the
unthrottled local disk. Writes bench/results/prefetch.csv.
"""

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.realpath(__file__))
# Where the hpcdl package lives: this checkout (bench/ beside hpcdl/), or
# site-packages for an installed hpcdl (bench/ is hpcdl/bench/ there).
ROOT = os.path.dirname(HERE) if os.path.isfile(os.path.join(os.path.dirname(HERE), "hpcdl", "__init__.py")) \
    else os.path.dirname(os.path.dirname(HERE))
SLOWFS = os.path.join(HERE, "slowfs.sh")
sys.path.insert(0, ROOT)  # this checkout's hpcdl


def drop_cache(comm):
    comm.Barrier()
    if comm.Get_rank() == 0 and os.geteuid() == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    comm.Barrier()


def timed_epoch(batches, compute_s, times, stalls, touch=None):
    """One epoch: wait for each batch (stall), then emulate a step of compute_s; appends the totals."""
    stall, start = 0.0, time.monotonic()
    it = iter(batches)
    while True:
        t0 = time.monotonic()
        try:
            batch = next(it)
        except StopIteration:
            break
        stall += time.monotonic() - t0
        if touch is not None:
            touch(batch)
        time.sleep(compute_s)
    times.append(time.monotonic() - start)
    stalls.append(stall)


def worker(args):
    from mpi4py import MPI

    from hpcdl.store import Store

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    st = Store(args.store)
    local = args.batch // size
    times, stalls = [], []
    if args.worker == "dataloader":
        import torch
        from torch.utils.data import DataLoader, Dataset
        from torch.utils.data.distributed import DistributedSampler

        class StoreDataset(Dataset):
            def __len__(self):
                return len(st)

            def __getitem__(self, i):
                return torch.frombuffer(bytearray(st[i]), dtype=torch.uint8).sum(), int(st.labels[i])

        sampler = DistributedSampler(StoreDataset(), num_replicas=size, rank=rank, shuffle=True, seed=1,
                                     drop_last=True)
        loader = DataLoader(StoreDataset(), batch_size=local, sampler=sampler, num_workers=2,
                            prefetch_factor=args.prefetch_factor, drop_last=True, persistent_workers=True)
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            drop_cache(comm)
            timed_epoch(loader, args.compute, times, stalls)
    else:
        from hpcdl.prefetch import Prefetcher

        with Prefetcher(st, args.batch, args.epochs, 1, comm=comm, ram_bytes=args.ram,
                        disk_dir=args.disk_dir, disk_bytes=args.disk, threads=args.threads) as pf:
            for epoch in pf.epochs():
                drop_cache(comm)
                timed_epoch(epoch, args.compute, times, stalls, touch=lambda b: int(b.data[:64].sum()))
            stats = pf.stats()
        if rank == 0:
            print("[hpcdl rank 0] hits", stats["hits"], file=sys.stderr)
    all_times, all_stalls = comm.gather(times, root=0), comm.gather(stalls, root=0)
    if rank == 0:  # an epoch lasts as long as its slowest rank
        epoch_max, stall_max = np.max(all_times, axis=0), np.max(all_stalls, axis=0)
        print(json.dumps({"epoch_s": [float(x) for x in epoch_max], "stall_s": [float(x) for x in stall_max]}))


def run_mode(args, mode, store_path, disk_dir):
    cmd = ["mpiexec", "-n", str(args.ranks), sys.executable, os.path.abspath(__file__), "--worker", mode,
           "--store", store_path, "--epochs", str(args.epochs), "--batch", str(args.batch),
           "--compute", str(args.compute), "--ram", str(args.ram), "--disk", str(args.disk),
           "--disk-dir", disk_dir, "--threads", str(args.threads), "--prefetch-factor", str(args.prefetch_factor)]
    if args.slowfs:
        cmd = [SLOWFS, "run", args.slowfs] + cmd
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=3600,
                         env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"))
    if out.returncode != 0:
        sys.exit(f"{mode} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def driver(args):
    from hpcdl.simulator import System, predict

    work = tempfile.mkdtemp(prefix="hpcdl-bench-prefetch-")
    rng = np.random.default_rng(0)
    src = os.path.join(work, "src")
    for i in range(args.files):
        path = os.path.join(src, f"c{i % 10}", f"{i:06d}.bin")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(rng.bytes(args.file_bytes))
    if args.slowfs:
        subprocess.run([SLOWFS, "setup", args.slowfs, str(max(64, 3 * args.files * args.file_bytes >> 20))], check=True)
        subprocess.run([SLOWFS, "throttle", args.slowfs, str(args.iops), str(args.bps)], check=True)
        store_path = os.path.join(args.slowfs, "mnt", "store")
    else:
        store_path = os.path.join(work, "store")
    subprocess.run([sys.executable, "-m", "hpcdl", "pack", src, store_path, "-q"], cwd=ROOT, check=True,
                   env=dict(os.environ, PYTHONPATH=ROOT))
    disk_dir = os.path.join(work, "disk")
    os.makedirs(disk_dir)
    rows = []
    try:
        for mode in ("dataloader", "hpcdl"):
            res = run_mode(args, mode, store_path, disk_dir)
            for e, (t, s) in enumerate(zip(res["epoch_s"], res["stall_s"])):
                rows.append({"loader": mode, "epoch": e + 1, "epoch_s": round(t, 3), "stall_fraction": round(s / t, 4)})
                print(f"{mode:>10} epoch {e + 1}: {t:7.2f} s, stall {s / t:6.1%}")
    finally:
        if args.slowfs:
            subprocess.run([SLOWFS, "teardown", args.slowfs], check=False)
        shutil.rmtree(work, ignore_errors=True)
    steps = args.files // args.batch
    system = System(samples=args.files, sample_bytes=args.file_bytes, ranks=args.ranks, epochs=args.epochs,
                    batch=args.batch, compute=args.compute, ram_bytes=args.ram, disk_bytes=args.disk,
                    store_bw=args.bps, store_iops=args.iops, disk_bw=1e9, net_bw=2e9, peers=True)
    model = predict(system)
    for e in range(args.epochs):
        rows.append({"loader": "model-staging", "epoch": e + 1, "epoch_s": round(model["staging"][e], 3)})
        rows.append({"loader": "model-prefetch", "epoch": e + 1, "epoch_s": round(model["prefetch"][e], 3)})
        print(f"     model epoch {e + 1}: staging {model['staging'][e]:.2f} s, prefetch {model['prefetch'][e]:.2f} s, "
              f"compute {steps * args.compute:.2f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "prefetch.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["loader", "epoch", "epoch_s", "stall_fraction"])
        w.writeheader()
        w.writerows(rows)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", choices=("dataloader", "hpcdl"))
    ap.add_argument("--store")
    ap.add_argument("--files", type=int, default=2000)
    ap.add_argument("--file-bytes", type=int, default=20000)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--batch", type=int, default=64, help="global batch")
    ap.add_argument("--compute", type=float, default=0.02, help="seconds of emulated compute per step")
    ap.add_argument("--ram", type=int, default=64 << 20, help="RAM tier bytes per rank")
    ap.add_argument("--disk", type=int, default=0, help="disk tier bytes per rank")
    ap.add_argument("--disk-dir", default="")
    ap.add_argument("--threads", type=int, default=4)
    ap.add_argument("--prefetch-factor", type=int, default=4)
    ap.add_argument("--slowfs", default="/tmp/hpcdl-slowfs", help="slow FS directory ('' for none)")
    ap.add_argument("--iops", type=int, default=300)
    ap.add_argument("--bps", type=int, default=50 << 20)
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for prefetch.csv")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
