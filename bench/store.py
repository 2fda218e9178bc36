"""Small-file reading: (a) one file per sample, (b) an HDF5 vlen data set read
through h5py, (c) hpcdl's store (single reads, and batched read_many), on an
emulated slow shared file system (bench/slowfs.sh: loop-mounted ext4 with a
blkio read throttle; page cache dropped before each run), with 1 and 4 ranks.

Each run reads the same random subset of samples twice: first cold (right
after the cache drop, under the throttle), then warm (from the page cache).
Also: metadata calls per 10k samples (strace: open/stat/... on the data's
paths) and a sequential scan (`hpcdl verify`) against the throttle's bandwidth.

    sudo python bench/store.py                    # 50k files, about 5 minutes on 2 cores
    python bench/store.py --files 5000 --cold-samples 500   # quick
    python bench/store.py --fs plain              # no root: a plain temporary directory
    hpcdl bench store                             # the same with small defaults (--fs plain)

With --fs plain the data lives in a plain temporary directory on the local
disk: no throttle, and "cold" means the data's pages were evicted from the page
cache with posix_fadvise (no root needed), so it measures the local disk.

Writes bench/results/store.csv and bench/results/store.png (--out DIR elsewhere)
and prints a table.
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
from hpcdl.measure import cell, rate, ratio, show

HERE = os.path.dirname(os.path.realpath(__file__))
# The folder holding the hpcdl this process imported: the processes it starts import the same one.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hpcdl.__file__)))
SLOWFS = os.path.join(HERE, "slowfs.sh")
MODES = ("files", "vlen", "store", "store-batch")


# --------------------------------------------------------------------------- worker


def worker(args):
    """One rank of a read run: cold pass, then warm pass over the same samples."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    data = args.data
    n = int(open(os.path.join(data, "count.txt")).read())
    rng = np.random.default_rng(args.seed)
    chosen = rng.choice(n, size=min(args.samples, n), replace=False)
    mine = chosen[rank::size]
    if args.worker == "files":
        names = open(os.path.join(data, "files.txt")).read().split("\n")
        paths = [os.path.join(data, "files", names[i]) for i in mine]

        def read_all():
            total = 0
            for p in paths:
                with open(p, "rb") as fh:
                    total += len(fh.read())
            return total
    elif args.worker == "vlen":
        import h5py

        f = h5py.File(os.path.join(data, "vlen.h5"), "r")
        ds = f["samples"]

        def read_all():
            return sum(len(ds[int(i)]) for i in mine)
    else:
        from hpcdl.store import Store

        st = Store(os.path.join(data, "store"), threads=args.threads)
        if args.worker == "store":

            def read_all():
                return sum(len(st[int(i)]) for i in mine)
        else:

            def read_all():
                total = 0
                for b in range(0, len(mine), args.batch):
                    buf, offsets = st.read_many(mine[b : b + args.batch])
                    total += int(offsets[-1])
                return total

    result = {}
    for phase in ("cold", "warm"):
        comm.Barrier()
        t0 = time.perf_counter()
        nbytes = read_all()
        comm.Barrier()
        seconds = time.perf_counter() - t0
        nbytes = comm.allreduce(nbytes)
        result[phase] = {"seconds": seconds, "samples": len(chosen), "bytes": nbytes}
    if rank == 0:
        print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- driver


def sh(*cmd, **kwargs):
    return subprocess.run(cmd, check=True, text=True, capture_output=True, **kwargs).stdout


def make_data(data, files, classes, seed):
    """ImageNet-like JPEG sizes scaled down ~12x: lognormal, median 8 KiB, 1-64 KiB."""
    rng = np.random.default_rng(seed)
    sizes = np.clip(rng.lognormal(np.log(8192), 0.6, files), 1024, 65536).astype(np.int64)
    names = []
    for i, size in enumerate(sizes):
        cls = f"n{i % classes:08d}"
        rel = f"{cls}/img_{i:07d}.jpg"
        path = os.path.join(data, "files", rel)
        if i < classes:
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as fh:
            fh.write(rng.bytes(int(size)))
        names.append(rel)
    names.sort(key=lambda s: s.encode())
    with open(os.path.join(data, "files.txt"), "w") as fh:
        fh.write("\n".join(names))
    with open(os.path.join(data, "count.txt"), "w") as fh:
        fh.write(str(files))
    return names, int(sizes.sum())


def make_vlen(data, names):
    import h5py

    with h5py.File(os.path.join(data, "vlen.h5"), "w") as f:
        ds = f.create_dataset("samples", (len(names),), dtype=h5py.vlen_dtype(np.uint8))
        for i, rel in enumerate(names):
            with open(os.path.join(data, "files", rel), "rb") as fh:
                ds[i] = np.frombuffer(fh.read(), dtype=np.uint8)


def evict_page_cache(data):
    """Drop the data's pages from the page cache without root (posix_fadvise on each file)."""
    os.sync()  # dirty pages are not dropped
    for dirpath, _, files in os.walk(data):
        for name in files:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def cold(args, cmd):
    """cmd run after the page cache is emptied (and under the throttle, on the slow file system)."""
    if args.fs == "slow":
        return [SLOWFS, "run", args.workdir] + cmd
    evict_page_cache(os.path.join(args.workdir, "mnt"))
    return cmd


def run_reads(args, data, mode, ranks, seed, samples, throttled=True, strace_out=None):
    from hpcdl.cli import mpiexec_path

    cmd = [
        mpiexec_path(),
        "-n",
        str(ranks),
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        mode,
        "--data",
        data,
        "--samples",
        str(samples),
        "--seed",
        str(seed),
        "--threads",
        str(args.threads),
        "--batch",
        str(args.batch),
    ]
    if strace_out:
        cmd = ["strace", "-f", "-qq", "-e", "trace=%file", "-o", strace_out] + cmd
    if throttled:
        cmd = cold(args, cmd)
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, text=True, capture_output=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    out = proc.stdout
    return json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])


def metadata_calls(args, data, mode):
    """open/stat/openat/... calls naming a path under the data directory, per 10k samples read."""
    trace = os.path.join(args.workdir, f"strace-{mode}.txt")
    samples = min(args.strace_samples, args.files)
    run_reads(args, data, mode, 1, 99, samples, throttled=False, strace_out=trace)
    with open(trace) as fh:
        calls = sum(1 for line in fh if data in line)
    os.remove(trace)
    if calls == 0:  # every mode opens at least the data it reads: strace did not see the ranks
        return None, "strace saw no file call on the data (it cannot follow the ranks here, e.g. under srun)"
    return calls * 10000 / (2 * samples), ""  # the worker reads its samples twice (cold + warm)


def verify_scan(args, data, env):
    """MB/s of one sequential `Store.verify` pass on a cold cache: its own unrounded bytes and seconds."""
    code = (
        "import json, sys; from hpcdl.store import Store; r = Store(sys.argv[1]).verify(); "
        "print('RESULT ' + json.dumps({'bytes': r.bytes_read, 'seconds': r.seconds, 'bad': len(r.problems)}))"
    )
    out = subprocess.run(
        cold(args, [sys.executable, "-c", code, os.path.join(data, "store")]),
        check=True,
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    if result["bad"]:
        raise RuntimeError(f"verify found {result['bad']} bad sample(s) in the freshly packed store")
    return rate(result["bytes"], result["seconds"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--fs",
        choices=("slow", "plain"),
        default="slow",
        help="slow: the emulated slow file "
        "system (root); plain: a temporary directory on the local disk (default slow)",
    )
    p.add_argument("--files", type=int, default=50000)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--cold-samples", type=int, default=2000, help="random samples read per run")
    p.add_argument("--strace-samples", type=int, default=10000)
    p.add_argument("--ranks", default="1,4")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iops", type=int, default=300)
    p.add_argument("--bps", type=int, default=50 << 20)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument(
        "--workdir",
        default=None,
        help="default: bench/results/tmp/slowfs (--fs slow), a new temporary directory (--fs plain)",
    )
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    # worker side
    p.add_argument("--worker", choices=MODES)
    p.add_argument("--data")
    p.add_argument("--samples", type=int)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.fs == "slow" and os.geteuid() != 0:
        sys.exit(
            "bench/store.py --fs slow needs root (loop mount, cgroup throttle, drop_caches); --fs plain runs without"
        )
    have_strace = shutil.which("strace") is not None
    if not have_strace:
        print("strace not found: the metadata-call column is skipped (apt-get install strace)")
    os.makedirs(args.out, exist_ok=True)
    ranks_list = [int(r) for r in args.ranks.split(",")]
    if args.fs == "slow":
        args.workdir = args.workdir or os.path.join(HERE, "results", "tmp", "slowfs")
        image_mb = int(args.files * 40e3 * 3 / 1e6) + 512
        print(sh(SLOWFS, "setup", args.workdir, str(image_mb)).strip())
    else:
        if args.workdir:
            os.makedirs(args.workdir, exist_ok=True)
        args.workdir = tempfile.mkdtemp(prefix="hpcdl-bench-store-", dir=args.workdir)
        os.makedirs(os.path.join(args.workdir, "mnt"))
        print(
            f"plain directory {args.workdir} on the local disk: no throttle, no root; cold reads "
            "follow a posix_fadvise page-cache eviction (--fs slow: the emulated slow file system)"
        )
    rows, scan = [], None
    try:
        data = os.path.join(args.workdir, "mnt")
        t0 = time.time()
        names, total = make_data(data, args.files, args.classes, seed=1)
        print(f"made {args.files} files ({total / 1e6:.0f} MB) in {time.time() - t0:.0f} s")
        t0 = time.time()
        env = {**os.environ, "PYTHONPATH": ROOT}
        sh(
            sys.executable,
            "-m",
            "hpcdl",
            "pack",
            os.path.join(data, "files"),
            os.path.join(data, "store"),
            "--shards",
            str(args.shards),
            "-q",
            env=env,
            cwd=ROOT,
        )
        print(f"packed in {time.time() - t0:.0f} s")
        t0 = time.time()
        make_vlen(data, names)
        print(f"vlen data set written in {time.time() - t0:.0f} s")
        if args.fs == "slow":
            print(sh(SLOWFS, "throttle", args.workdir, str(args.iops), str(args.bps)).strip())
        for ranks in ranks_list:
            for mode in MODES:
                runs = [run_reads(args, data, mode, ranks, seed, args.cold_samples) for seed in range(args.repeats)]
                row = {"mode": mode, "ranks": ranks, "samples": args.cold_samples, "missing": ""}
                for phase in ("cold", "warm"):
                    secs = float(np.median([r[phase]["seconds"] for r in runs]))
                    nbytes = runs[0][phase]["bytes"]
                    row[f"{phase}_samples_per_s"] = rate(args.cold_samples, secs)
                    mb_s = rate(nbytes, secs)
                    row[f"{phase}_MB_per_s"] = None if mb_s is None else mb_s / 1e6
                    if mb_s is None:
                        row["missing"] += f"{phase}: the clock read no time; "
                row["metadata_calls_per_10k"] = None
                if ranks != 1:
                    row["missing"] += "metadata calls: counted at 1 rank only"
                elif not have_strace:
                    row["missing"] += "metadata calls: strace not installed"
                else:
                    row["metadata_calls_per_10k"], why = metadata_calls(args, data, mode)
                    row["missing"] += f"metadata calls: {why}" if why else ""
                rows.append(row)
                print(json.dumps(row))
        # verify's own figure: bytes read and unrounded seconds, start-up excluded
        scans = [s for s in (verify_scan(args, data, env) for _ in range(args.repeats)) if s is not None]
        scan_mb_s = float(np.median(scans)) / 1e6 if scans else None
        scan = {
            "mode": "scan (hpcdl verify)",
            "ranks": 1,
            "samples": args.files,
            "cold_MB_per_s": scan_mb_s,
            "missing": "" if scans else "the scan took no measurable time",
        }
        if args.fs == "slow":
            scan.update(throttle_MB_per_s=args.bps / 1e6, fraction_of_throttle=ratio(scan_mb_s, args.bps / 1e6))
        print(json.dumps(scan))
    finally:
        if args.fs == "slow":
            print(sh(SLOWFS, "teardown", args.workdir).strip())
        else:
            shutil.rmtree(args.workdir, ignore_errors=True)
    write_results(args, rows, scan)
    print_table(args, rows, scan)


def write_results(args, rows, scan):
    from hpcdl.measure import save_figure

    fields = [
        "mode",
        "ranks",
        "samples",
        "cold_samples_per_s",
        "cold_MB_per_s",
        "warm_samples_per_s",
        "warm_MB_per_s",
        "metadata_calls_per_10k",
        "throttle_MB_per_s",
        "fraction_of_throttle",
        "missing",
    ]
    path = os.path.join(args.out, "store.csv")
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        for row in rows + ([scan] if scan else []):
            w.writerow({key: cell(value) for key, value in row.items()})
    png = os.path.join(args.out, "store.png")
    plotted = save_figure(png, lambda plt: draw(plt, args, rows), dpi=120)
    print(f"wrote {path}" + (f" and {png}" if plotted else ""))


def draw(plt, args, rows):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    ranks_list = sorted({r["ranks"] for r in rows})
    width = 0.8 / len(ranks_list)
    for ax, phase in zip(axes, ("cold", "warm")):
        for k, ranks in enumerate(ranks_list):
            vals = [
                next(r[f"{phase}_samples_per_s"] for r in rows if r["mode"] == m and r["ranks"] == ranks) for m in MODES
            ]
            vals = [np.nan if v is None else v for v in vals]  # not measured: no bar
            ax.bar(np.arange(len(MODES)) + k * width, vals, width, label=f"{ranks} rank(s)")
        ax.set_xticks(np.arange(len(MODES)) + width * (len(ranks_list) - 1) / 2, MODES)
        ax.set_yscale("log")
        ax.set_ylabel("samples/s")
        throttle = (
            f"{args.iops} IOPS / {args.bps / 1e6:.0f} MB/s throttle" if args.fs == "slow" else "local disk, no throttle"
        )
        title = f"cold cache, {throttle}" if phase == "cold" else "warm page cache"
        ax.set_title(f"{args.files} files: {title}", fontsize=9)
        ax.legend()
    fig.tight_layout()
    return fig


def print_table(args, rows, scan):
    where = (
        f"slow file system ({args.iops} IOPS, {args.bps / 1e6:.0f} MB/s)"
        if args.fs == "slow"
        else "plain local directory (no throttle)"
    )
    print(f"store: {args.files} files on a {where}; samples/s, median of {args.repeats} run(s)")
    print(
        f"{'mode':<12} {'ranks':>5} {'cold/s':>10} {'cold MB/s':>10} {'warm/s':>10} {'warm MB/s':>10} {'meta/10k':>9}"
    )
    for r in rows:
        print(
            f"{r['mode']:<12} {r['ranks']:>5} {show(r['cold_samples_per_s'], '.0f'):>10} "
            f"{show(r['cold_MB_per_s'], '.1f'):>10} {show(r['warm_samples_per_s'], '.0f'):>10} "
            f"{show(r['warm_MB_per_s'], '.1f'):>10} {show(r['metadata_calls_per_10k'], '.0f', '-'):>9}"
        )
    for r in rows + ([scan] if scan else []):
        if r["missing"]:
            print(f"not measured, {r['mode']} at {r['ranks']} rank(s): {r['missing'].rstrip('; ')}")
    if scan:
        print(
            f"sequential scan (hpcdl verify): {show(scan['cold_MB_per_s'], '.1f')} MB/s"
            + (f" = {show(scan['fraction_of_throttle'], '.0%')} of the throttle" if args.fs == "slow" else "")
        )


if __name__ == "__main__":
    sys.exit(main())
