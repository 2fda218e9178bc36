"""Epoch times and stall fractions: (a) PyTorch DataLoader over the store
(DistributedSampler, num_workers=2, prefetch_factor tuned) against (b) hpcdl's
prefetcher, on the emulated slow file system (bench/slowfs.sh), with the
training step either emulated by a fixed compute time per batch (as DLIO
does) or a real small PyTorch model (an MLP on the decoded samples, the same
for both loaders; its step time is measured), and the simulator's
predictions for the same setting.

    sudo python bench/prefetch.py --files 1000 --runs 3   # driver: setup, runs, CSV + PNG
    python bench/prefetch.py --files 400 --slowfs '' --runs 1   # no root: no throttling

The driver packs random files into a store on a throttled loop-mounted ext4
(read IOPS limited), then runs each loader under `mpiexec -n RANKS` through
`slowfs.sh run` (page cache dropped first). The page cache is also dropped at
the start of every epoch: on a cluster the node's cache does not hold a data
set on the shared file system, and here it would. The disk tier lives on the
unthrottled local disk. The DataLoader's prefetch_factor is tuned first (each
of --prefetch-factors once, emulated step; the best epochs 2..E wins).
Writes OUT/prefetch.csv (medians and the model; OUT: --out, default
bench/results), prefetch-runs.csv (every run) and prefetch.png (--name
changes "prefetch").
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

import hpcdl
from hpcdl.measure import cell, ratio, show

HERE = os.path.dirname(os.path.realpath(__file__))
# The folder holding the hpcdl this process imported: the processes it starts import the same one.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hpcdl.__file__)))
SLOWFS = os.path.join(HERE, "slowfs.sh")


def drop_cache(comm):
    comm.Barrier()
    if comm.Get_rank() == 0 and os.geteuid() == 0:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
    comm.Barrier()


def timed_epoch(batches, step, times, stalls, steps_s):
    """One epoch: wait for each batch (stall), then run step(batch); appends the totals."""
    stall, busy, start = 0.0, 0.0, time.monotonic()
    it = iter(batches)
    while True:
        t0 = time.monotonic()
        try:
            batch = next(it)
        except StopIteration:
            break
        t1 = time.monotonic()
        stall += t1 - t0
        step(batch)
        busy += time.monotonic() - t1
    times.append(time.monotonic() - start)
    stalls.append(stall)
    steps_s.append(busy)


def make_step(args):
    """The training step on a batch of decoded samples (a float tensor, labels):
    a sleep of args.compute seconds, or one SGD step of a small MLP."""
    if args.variant == "emulated":
        return lambda x, y: time.sleep(args.compute)
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(args.features, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, args.hidden),
        torch.nn.ReLU(),
        torch.nn.Linear(args.hidden, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()

    def step(x, y):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    return step


def decode(buf, features):
    """A sample's first `features` bytes as floats in [0, 1] (zero-padded)."""
    out = np.zeros(features, dtype=np.float32)
    n = min(len(buf), features)
    out[:n] = np.frombuffer(buf, dtype=np.uint8, count=n)
    return out / 255.0


def worker(args):
    from mpi4py import MPI

    from hpcdl.store import Store

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    st = Store(args.store)
    local = args.batch // size
    times, stalls, steps_s = [], [], []
    train = make_step(args)
    stats = {}
    if args.variant == "torch":
        import torch

        torch.set_num_threads(1)
    if args.worker == "dataloader":
        import torch
        from torch.utils.data import DataLoader, Dataset
        from torch.utils.data.distributed import DistributedSampler

        class StoreDataset(Dataset):
            def __len__(self):
                return len(st)

            def __getitem__(self, i):
                return torch.from_numpy(decode(st[i], args.features)), int(st.labels[i])

        sampler = DistributedSampler(StoreDataset(), num_replicas=size, rank=rank, shuffle=True, seed=1, drop_last=True)
        loader = DataLoader(
            StoreDataset(),
            batch_size=local,
            sampler=sampler,
            num_workers=2,
            prefetch_factor=args.prefetch_factor,
            drop_last=True,
            persistent_workers=True,
        )
        for epoch in range(args.epochs):
            sampler.set_epoch(epoch)
            drop_cache(comm)
            timed_epoch(loader, lambda b: train(b[0], b[1]), times, stalls, steps_s)
    else:
        from hpcdl.prefetch import Prefetcher

        def step(batch):
            x = np.stack([decode(view, args.features) for view in batch.samples()])
            if args.variant == "torch":
                import torch

                train(torch.from_numpy(x), torch.from_numpy(batch.labels.astype(np.int64)))
            else:
                train(x, batch.labels)

        # Epoch 1 includes the start-up (planning, first reads) and starts cold: the
        # fillers begin reading at construction, so the clock and the cache drop come first.
        drop_cache(comm)
        start = time.monotonic()
        with Prefetcher(
            st,
            args.batch,
            args.epochs,
            1,
            comm=comm,
            ram_bytes=args.ram,
            disk_dir=args.disk_dir,
            disk_bytes=args.disk,
            staging_threads=args.threads,
            read_bytes=args.read_bytes,
            read_gap=args.read_gap,
            lookahead_bytes=args.lookahead,
        ) as pf:
            startup = time.monotonic() - start
            for e, epoch in enumerate(pf.epochs()):
                if e:
                    drop_cache(comm)
                timed_epoch(epoch, step, times, stalls, steps_s)
                if e == 0:
                    times[0] += startup
                    stalls[0] += startup
        stats = pf.stats()
    all_times, all_stalls, all_steps = (
        comm.gather(times, root=0),
        comm.gather(stalls, root=0),
        comm.gather(steps_s, root=0),
    )
    all_stats = comm.gather(stats, root=0)
    if rank == 0:  # an epoch lasts as long as its slowest rank
        epoch_max, stall_max = np.max(all_times, axis=0), np.max(all_stalls, axis=0)
        steps_per_epoch = len(st) // args.batch
        step_s = float(np.median(all_steps)) / steps_per_epoch
        summary = {
            key: sum(s.get(key, 0) for s in all_stats)
            for key in (
                "store_reads",
                "store_requests",
                "store_bytes",
                "peer_fills",
                "peer_waits",
                "peer_misses",
                "peer_timeouts",
                "served_to_peers",
            )
        }
        if args.worker == "hpcdl":
            summary["read_settings"] = all_stats[0]["read_settings"]  # rank 0's, which every rank derives alike
            summary["hits"] = {src: sum(s["hits"][src] for s in all_stats) for src in all_stats[0]["hits"]}
            print(f"[hpcdl rank 0] all ranks: {summary}", file=sys.stderr)
        print(
            json.dumps(
                {
                    "epoch_s": [float(x) for x in epoch_max],
                    "stall_s": [float(x) for x in stall_max],
                    "step_s": step_s,
                    "stats": summary,
                }
            )
        )


def run_mode(args, mode, variant, store_path, disk_dir, prefetch_factor):
    from hpcdl.cli import mpiexec_path

    cmd = [
        mpiexec_path(),
        "-n",
        str(args.ranks),
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        mode,
        "--variant",
        variant,
        "--store",
        store_path,
        "--epochs",
        str(args.epochs),
        "--batch",
        str(args.batch),
        "--compute",
        str(args.compute),
        "--ram",
        str(args.ram),
        "--disk",
        str(args.disk),
        "--disk-dir",
        disk_dir if args.disk else "",
        "--threads",
        str(args.threads),
        "--prefetch-factor",
        str(prefetch_factor),
        "--features",
        str(args.features),
        "--hidden",
        str(args.hidden),
        "--read-bytes",
        str(args.read_bytes),
        "--read-gap",
        str(args.read_gap),
        "--lookahead",
        str(args.lookahead),
    ]
    if args.slowfs:
        cmd = [SLOWFS, "run", args.slowfs] + cmd
    out = subprocess.run(
        cmd,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
        env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
    )
    if out.returncode != 0:
        sys.exit(f"{mode} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def later_epochs(res):
    return float(np.median(res["epoch_s"][1:] or res["epoch_s"]))


def model_rows(args, variant, step_s, chosen):
    """The simulator for this setting, reading the store as the hpcdl runs did (chosen: their read settings)."""
    from hpcdl.simulator import System, predict

    system = System(
        samples=args.files,
        sample_bytes=args.file_bytes,
        ranks=args.ranks,
        epochs=args.epochs,
        batch=args.batch,
        compute=step_s,
        ram_bytes=args.ram,
        disk_bytes=args.disk,
        store_bw=args.bps,
        store_iops=args.iops,
        disk_bw=1e9,
        net_bw=2e9,
        peers=True,
        read_bytes=chosen["read_bytes"],
        read_gap=chosen["read_gap"],
        lookahead_bytes=chosen["lookahead_bytes"],
        node_ranks=args.ranks,
    )  # one node: the ranks share its page cache
    model = predict(system)
    rows = []
    for e in range(args.epochs):
        for name, key in (("model-staging", "staging"), ("model-prefetch", "prefetch")):
            t = model[key][e]
            rows.append(
                {
                    "variant": variant,
                    "loader": name,
                    "epoch": e + 1,
                    "epoch_s": t,
                    "stall_fraction": ratio(max(t - model["compute"][e], 0), t),
                    "step_s": step_s,
                }
            )
    return rows


def draw(plt, rows):
    variants = sorted({r["variant"] for r in rows})
    loaders = ["dataloader", "hpcdl", "model-staging", "model-prefetch"]
    colors = {"dataloader": "tab:red", "hpcdl": "tab:blue", "model-staging": "salmon", "model-prefetch": "lightblue"}
    fig, axes = plt.subplots(1, len(variants), figsize=(6 * len(variants), 4), squeeze=False)
    for ax, variant in zip(axes[0], variants):
        sel = [r for r in rows if r["variant"] == variant]
        epochs = sorted({r["epoch"] for r in sel})
        width = 0.8 / len(loaders)
        for i, loader in enumerate(loaders):
            ys = [next((r["epoch_s"] for r in sel if r["loader"] == loader and r["epoch"] == e), 0) for e in epochs]
            xs = [e + (i - 1.5) * width for e in epochs]
            bars = ax.bar(xs, ys, width, label=loader, color=colors[loader])
            if loader in ("dataloader", "hpcdl"):
                for bar, e in zip(bars, epochs):
                    r = next(r for r in sel if r["loader"] == loader and r["epoch"] == e)
                    ax.annotate(
                        show(r["stall_fraction"], ".0%"),
                        (bar.get_x() + width / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=7,
                    )
        ax.set_xticks(epochs)
        ax.set_xlabel("epoch (labels: stall fraction, median of runs)")
        ax.set_ylabel("epoch time (s)")
        ax.set_title(f"4 ranks, slow store: {variant} step")
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def driver(args):
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
    subprocess.run(
        [sys.executable, "-m", "hpcdl", "pack", src, store_path, "-q"],
        cwd=ROOT,
        check=True,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    disk_dir = os.path.join(work, "disk")
    os.makedirs(disk_dir)
    runs = []  # every run: variant, loader, run, epoch, epoch_s, stall_fraction, step_s
    factors = [int(x) for x in args.prefetch_factors.split(",")]

    def record(variant, mode, run, res, factor=""):
        for e, (t, s) in enumerate(zip(res["epoch_s"], res["stall_s"])):
            runs.append(
                {
                    "variant": variant,
                    "loader": mode,
                    "run": run,
                    "epoch": e + 1,
                    "epoch_s": t,
                    "stall_fraction": ratio(s, t),
                    "step_s": res["step_s"],
                    "prefetch_factor": factor,
                    "store_reads": res["stats"].get("store_reads", ""),
                    "store_requests": res["stats"].get("store_requests", ""),
                    "store_bytes": res["stats"].get("store_bytes", ""),
                    "read_settings": " ".join(
                        f"{k}={v}" for k, v in res["stats"].get("read_settings", {}).items() if k != "auto"
                    ),
                }
            )
            print(
                f"{variant:>8} {mode:>10} run {run} epoch {e + 1}: {t:7.2f} s, stall {show(ratio(s, t), '6.1%')}"
                + (f" (prefetch_factor {factor})" if factor else ""),
                flush=True,
            )
        if mode == "hpcdl":
            print(f"{variant:>8}      hpcdl run {run}: {res['stats']}", flush=True)
            chosen[variant] = res["stats"]["read_settings"]

    chosen = {}

    try:
        best = factors[0]
        if len(factors) > 1:  # tune the DataLoader's prefetch_factor on the emulated step
            tried = {}
            for f in factors:
                tried[f] = run_mode(args, "dataloader", "emulated", store_path, disk_dir, f)
                record("emulated", "dataloader-tuning", 0, tried[f], f)
            best = min(factors, key=lambda f: later_epochs(tried[f]))
            print(f"best prefetch_factor: {best}", flush=True)
        for variant in args.variants.split(","):
            for run in range(1, args.runs + 1):
                for mode in ("dataloader", "hpcdl"):
                    record(
                        variant,
                        mode,
                        run,
                        run_mode(args, mode, variant, store_path, disk_dir, best),
                        best if mode == "dataloader" else "",
                    )
    finally:
        if args.slowfs:
            subprocess.run([SLOWFS, "teardown", args.slowfs], check=False)
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for variant in args.variants.split(","):
        for mode in ("dataloader", "hpcdl"):
            for e in range(1, args.epochs + 1):
                sel = [r for r in runs if r["variant"] == variant and r["loader"] == mode and r["epoch"] == e]
                stalls = [r["stall_fraction"] for r in sel if r["stall_fraction"] is not None]
                rows.append(
                    {
                        "variant": variant,
                        "loader": mode,
                        "epoch": e,
                        "epoch_s": float(np.median([r["epoch_s"] for r in sel])),
                        "stall_fraction": float(np.median(stalls)) if stalls else None,
                        "step_s": float(np.median([r["step_s"] for r in sel])),
                    }
                )
        step_s = float(np.median([r["step_s"] for r in runs if r["variant"] == variant and r["loader"] == "hpcdl"]))
        rows += model_rows(args, variant, args.compute if variant == "emulated" else step_s, chosen[variant])
    print(f"medians of {args.runs} runs (load: {os.getloadavg()[0]:.1f}):")
    for r in rows:
        print(
            f"{r['variant']:>8} {r['loader']:>14} epoch {r['epoch']}: {r['epoch_s']:7.2f} s, "
            f"stall {show(r['stall_fraction'], '6.1%')}, step {r['step_s'] * 1e3:.1f} ms"
        )
    for variant in args.variants.split(","):
        total = {
            mode: sum(
                r["epoch_s"]
                for r in rows
                if r["variant"] == variant and r["loader"] == mode and r["epoch"] >= min(2, args.epochs)
            )
            for mode in ("dataloader", "hpcdl")
        }
        print(
            f"{variant:>8} epochs {min(2, args.epochs)}..{args.epochs} dataloader/hpcdl: "
            f"{show(ratio(total['dataloader'], total['hpcdl']), '.2f')}x"
        )
    out = args.out
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{args.name}.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=["variant", "loader", "epoch", "epoch_s", "stall_fraction", "step_s"])
        w.writeheader()
        w.writerows({key: cell(value) for key, value in r.items()} for r in rows)
    with open(os.path.join(out, f"{args.name}-runs.csv"), "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(runs[0]))
        w.writeheader()
        w.writerows({key: cell(value) for key, value in r.items()} for r in runs)
    from hpcdl.measure import save_figure

    save_figure(os.path.join(out, f"{args.name}.png"), lambda plt: draw(plt, rows))


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
    ap.add_argument("--prefetch-factor", type=int, default=4, help="(worker) the DataLoader's prefetch_factor")
    ap.add_argument("--prefetch-factors", default="2,4,8", help="DataLoader prefetch_factors to try (driver)")
    ap.add_argument("--variant", default="emulated", choices=("emulated", "torch"), help="(worker) the step")
    ap.add_argument("--variants", default="emulated,torch", help="steps to run (driver)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--name", default="prefetch", help="results: OUT/NAME.csv, NAME-runs.csv, NAME.png")
    ap.add_argument("--features", type=int, default=4096, help="bytes of each sample the MLP reads")
    ap.add_argument("--hidden", type=int, default=512, help="the MLP's hidden width")
    ap.add_argument(
        "--read-bytes",
        default="auto",
        help="hpcdl: largest coalesced read (0: per sample; auto: from the store's measured IOPS and bandwidth)",
    )
    ap.add_argument("--read-gap", default="auto", help="hpcdl: largest gap read through (a size or auto)")
    ap.add_argument("--lookahead", default="auto", help="hpcdl: bytes of store fills sorted together (a size or auto)")
    ap.add_argument("--slowfs", default="/tmp/hpcdl-slowfs", help="slow FS directory ('' for none)")
    ap.add_argument("--iops", type=int, default=300)
    ap.add_argument("--bps", type=int, default=50 << 20)
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="directory for the results (see --name)")
    args = ap.parse_args(argv)
    if args.worker:
        worker(args)
    else:
        driver(args)


if __name__ == "__main__":
    main()
