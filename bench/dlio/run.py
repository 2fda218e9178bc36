"""DLIO (MLPerf-Storage-style) workloads through hpcdl on the emulated slow file
system: DLIO's stock PyTorch loader on DLIO's files against hpcdl's DLIO plugin
(hpcdl.contrib.dlio) on the same files packed into a store. Every figure is
DLIO's own (summary.json: AU%, samples/s, MB/s); docs/dlio.md.

    sudo python bench/dlio/run.py                          # all workloads
    sudo python bench/dlio/run.py --workloads resnet50 --epochs 3
    sudo python bench/dlio/run.py --workloads unet3d --runs 3 --name dlio-unet3d   # medians of 3

Per workload: a loop-mounted ext4 (bench/slowfs.sh) throttled to --iops read
IOPS and --bps read bytes/s; DLIO generates the data onto it; `hpcdl pack`
packs it next to the files; then --runs rounds of two DLIO runs (the stock
loader, then hpcdl) with --ranks ranks, each under `slowfs.sh run` (page
cache dropped first, reads throttled); the table holds the medians. During both runs
the page cache is dropped every --drop-every seconds: on a cluster the data
set does not fit the nodes' memory (MLPerf Storage requires 5x), so no loader
gets it from the page cache in a later epoch. Takes /tmp/hpcdl-slowfs.lock
itself for the whole slow-FS part (do not wrap it in flock).

Writes OUT/NAME.csv (medians over the runs), NAME-runs.csv (every run),
NAME.md (the table) and NAME.png, and keeps DLIO's output folders and logs
under OUT/NAME/ (OUT: --out, default bench/results; NAME: --name, default dlio).
"""

import argparse
import csv
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import hpcdl
from hpcdl.cli import mpiexec_path
from hpcdl.measure import ratio, show

HERE = os.path.dirname(os.path.abspath(__file__))
# The folder holding the hpcdl this process imported: the processes it starts import the same one.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(hpcdl.__file__)))
SLOWFS = os.path.join(os.path.dirname(HERE), "slowfs.sh")
LOCK = "/tmp/hpcdl-slowfs.lock"
PLUGIN = "hpcdl.contrib.dlio.HpcdlDataLoader"
VENV_BIN = os.path.dirname(sys.executable)  # dlio_benchmark of this Python's venv

# DLIO's V100 configs (dlio_benchmark/configs/workload/*_v100.yaml), scaled to this machine:
# fewer files, smaller batches (compute per step scaled with the batch, so compute per sample
# stays DLIO's), records shrunk by `record_scale` where a full record would not fit a few GB.
# Everything is npz, one sample per file: the format DLIO's PyTorch reader reads natively.
# "au": DLIO's pass threshold (metric.au) where MLPerf Storage's differs from DLIO's default 0.90
# (cosmoflow: 0.70, as DLIO's own cosmoflow_a100/_h100 configs set; the _v100 config sets none).
WORKLOADS = {
    "resnet50": {
        "config": "resnet50_v100",
        "files": 2048,
        "record": 114660,
        "stdev": 0,
        "record_scale": 1,
        "batch": 32,
        "dlio_batch": 64,
        "dlio_compute": 0.195,
    },
    "unet3d": {
        "config": "unet3d_v100",
        "files": 64,
        "record": 146600628,
        "stdev": 68341808,
        "record_scale": 32,
        "batch": 1,
        "dlio_batch": 4,
        "dlio_compute": 1.3604,
    },
    "cosmoflow": {
        "config": "cosmoflow_v100",
        "files": 256,
        "record": 2828486,
        "stdev": 71311,
        "record_scale": 4,
        "batch": 4,
        "dlio_batch": 1,
        "dlio_compute": 0.00936,
        "au": 0.70,
    },
}


def log(message):
    print(f"[bench/dlio] {message}", file=sys.stderr, flush=True)


def workload_settings(name, args):
    w = WORKLOADS[name]
    record = int(w["record"] / w["record_scale"])
    compute = w["dlio_compute"] * w["batch"] / w["dlio_batch"] * args.compute_scale
    return {
        "record": record,
        "stdev": int(w["stdev"] / w["record_scale"]),
        "files": w["files"],
        "batch": w["batch"],
        "compute": round(compute, 6),
        "config": w["config"],
        "au": w.get("au"),
    }


def dlio_command(args, name, s, data_folder, output, loader):
    """mpiexec ... dlio_benchmark with DLIO's own config for the workload and our scaling."""
    cmd = [
        mpiexec_path(),
        "-n",
        str(args.ranks),
        os.path.join(VENV_BIN, "dlio_benchmark"),
        f"workload={s['config']}",
        "++workload.framework=pytorch",
        "++workload.reader.data_loader=pytorch",
        "++workload.dataset.format=npz",
        f"++workload.dataset.data_folder={data_folder}",
        f"++workload.dataset.num_files_train={s['files']}",
        "++workload.dataset.num_files_eval=0",
        "++workload.dataset.num_samples_per_file=1",
        f"++workload.dataset.record_length={s['record']}",
        f"++workload.dataset.record_length_stdev={s['stdev']}",
        "++workload.dataset.num_subfolders_train=0",
        "++workload.dataset.num_subfolders_eval=0",
        f"++workload.reader.batch_size={s['batch']}",
        f"++workload.reader.read_threads={args.read_threads}",
        f"++workload.train.computation_time={s['compute']}",
        f"++workload.train.epochs={args.epochs}",
        "++workload.workflow.evaluation=False",
        "++workload.workflow.checkpoint=False",
        "++workload.workflow.profiling=False",
        f"++workload.output.folder={output}",
        f"hydra.run.dir={output}/hydra",
    ]
    if s["au"] is not None:
        cmd.append(f"++workload.metric.au={s['au']}")
    if loader == "generate":
        cmd += ["++workload.workflow.generate_data=True", "++workload.workflow.train=False"]
    else:
        cmd += ["++workload.workflow.generate_data=False", "++workload.workflow.train=True"]
    if loader == "hpcdl":
        cmd += [f"++workload.reader.data_loader_classname={PLUGIN}", "++workload.reader.data_loader_sampler=none"]
    return cmd


def run(cmd, log_path, env, throttled_dir=None):
    if throttled_dir:
        cmd = [SLOWFS, "run", throttled_dir] + cmd
    with open(log_path, "w") as fh:
        proc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, env=env, timeout=3600)
    if proc.returncode != 0:
        with open(log_path) as fh:
            tail = fh.read()[-4000:]
        sys.exit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{tail}")


class CacheDropper:
    """Drops the page cache every `every` seconds while a run is in progress."""

    def __init__(self, every):
        self.every, self.stop = every, threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self):
        while not self.stop.wait(self.every):
            with open("/proc/sys/vm/drop_caches", "w") as fh:
                fh.write("3\n")

    def __enter__(self):
        if self.every > 0:
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()


def device_reads(slowfs):
    """(read IOs, read bytes) the throttled cgroup has done on the slow FS's device so far."""
    with open(os.path.join(slowfs, "state", "cgroup")) as fh:
        cg = fh.read().strip()
    with open(os.path.join(slowfs, "state", "majmin")) as fh:
        majmin = fh.read().strip()
    if os.path.exists(os.path.join(cg, "blkio.throttle.io_serviced")):  # cgroup v1
        counts = []
        for name in ("blkio.throttle.io_serviced", "blkio.throttle.io_service_bytes"):
            with open(os.path.join(cg, name)) as fh:
                counts.append(next((int(line.split()[2]) for line in fh if line.startswith(majmin + " Read ")), 0))
        return tuple(counts)
    with open(os.path.join(cg, "io.stat")) as fh:  # cgroup v2
        for line in fh:
            if line.startswith(majmin + " "):
                fields = dict(kv.split("=") for kv in line.split()[1:])
                return int(fields.get("rios", 0)), int(fields.get("rbytes", 0))
    return 0, 0


def collect(output, loader, name, s, args, wall):
    with open(os.path.join(output, "summary.json")) as fh:
        metric = json.load(fh)["metric"]
    au = [float(x) for x in metric["train_au_percentage"]]
    sps = [float(x) for x in metric["train_throughput_samples_per_second"]]
    row = {
        "workload": name,
        "loader": loader,
        "ranks": args.ranks,
        "epochs": len(au),
        "files": s["files"],
        "record_bytes": s["record"],
        "batch_per_rank": s["batch"],
        "compute_s": s["compute"],
        "au_mean": float(metric["train_au_mean_percentage"]),
        "au_from_epoch2": sum(au[1:]) / (len(au) - 1) if len(au) > 1 else None,
        "samples_per_s": float(metric["train_throughput_mean_samples_per_second"]),
        "mb_per_s": float(metric["train_io_mean_MB_per_second"]),
        "dlio_verdict": metric["train_au_meet_expectation"],
        "wall_s": wall,
        "au_per_epoch": " ".join(f"{x:.1f}" for x in au),
        "samples_per_s_per_epoch": " ".join(f"{x:.1f}" for x in sps),
    }
    if loader == "hpcdl":
        hits = {}
        for r in range(args.ranks):
            with open(os.path.join(output, f"hpcdl_train_rank{r}.json")) as fh:
                for source, n in json.load(fh)["stats"]["hits"].items():
                    hits[source] = hits.get(source, 0) + n
        row["hpcdl_hits"] = " ".join(f"{k}={v}" for k, v in hits.items())
    return row


def bench_workload(name, args, env):
    s = workload_settings(name, args)
    size_mb = s["files"] * (s["record"] + 3 * s["stdev"]) * 2.2 / 1e6 + 128
    out_root = os.path.join(args.out, args.name, name)
    shutil.rmtree(out_root, ignore_errors=True)
    os.makedirs(out_root)
    rows = []
    subprocess.run([SLOWFS, "setup", args.slowfs, str(int(size_mb))], check=True)
    try:
        data = os.path.join(args.slowfs, "mnt", "data")
        log(f"{name}: DLIO generates {s['files']} npz files of ~{s['record'] / 1e6:.2f} MB")
        run(
            dlio_command(args, name, s, data, os.path.join(out_root, "generate"), "generate"),
            os.path.join(out_root, "generate.log"),
            env,
        )
        log(f"{name}: hpcdl pack")
        run(
            [
                sys.executable,
                "-m",
                "hpcdl",
                "pack",
                os.path.join(data, "train"),
                os.path.join(data, "train.hpcdl"),
                "-q",
            ],
            os.path.join(out_root, "pack.log"),
            env,
        )
        subprocess.run([SLOWFS, "throttle", args.slowfs, str(args.iops), str(args.bps)], check=True)
        for loader, run_no in [(loader, r) for r in range(1, args.runs + 1) for loader in ("stock", "hpcdl")]:
            output = os.path.join(out_root, f"{loader}-{run_no}")
            log(
                f"{name}: DLIO with the {loader} loader, {args.ranks} ranks, {args.epochs} epochs, "
                f"run {run_no}/{args.runs}"
            )
            start, (ios, nbytes) = time.monotonic(), device_reads(args.slowfs)
            with CacheDropper(args.drop_every):
                run(
                    dlio_command(args, name, s, data, output, loader),
                    os.path.join(out_root, f"{loader}-{run_no}.log"),
                    env,
                    throttled_dir=args.slowfs,
                )
            row = collect(output, loader, name, s, args, time.monotonic() - start)
            row["run"] = run_no
            ios_after, bytes_after = device_reads(args.slowfs)
            samples = args.epochs * (s["files"] // (s["batch"] * args.ranks)) * s["batch"] * args.ranks
            row["device_reads_per_sample"] = ratio(ios_after - ios, samples)
            row["device_mb_read"] = (bytes_after - nbytes) / 1e6
            log(
                f"{name} {loader}: AU {row['au_per_epoch']} %, {row['samples_per_s']:.1f} samples/s, "
                f"{row['mb_per_s']:.1f} MB/s ({row['dlio_verdict']})"
            )
            rows.append(row)
    finally:
        subprocess.run([SLOWFS, "teardown", args.slowfs], check=False)
    return rows


def figure(value, spec):
    """A table cell from a CSV or a fresh row: '' and None are figures that were not measured."""
    return show(None if value in ("", None) else float(value), spec)


FIELDS = [
    "workload",
    "loader",
    "ranks",
    "epochs",
    "files",
    "record_bytes",
    "batch_per_rank",
    "compute_s",
    "au_per_epoch",
    "au_mean",
    "au_from_epoch2",
    "samples_per_s",
    "samples_per_s_per_epoch",
    "mb_per_s",
    "dlio_verdict",
    "wall_s",
    "device_reads_per_sample",
    "device_mb_read",
    "hpcdl_hits",
]
MEDIAN_FIELDS = (
    "au_mean",
    "au_from_epoch2",
    "samples_per_s",
    "mb_per_s",
    "wall_s",
    "device_reads_per_sample",
    "device_mb_read",
)


def median(values):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def medians(runs):
    """One row per (workload, loader): the medians over its runs (per-epoch columns epoch by epoch);
    dlio_verdict counts DLIO's "success" verdicts, e.g. "success 2/3"."""
    rows = []
    for key in dict.fromkeys((r["workload"], r["loader"]) for r in runs):
        sel = [r for r in runs if (r["workload"], r["loader"]) == key]
        row = dict(sel[0])
        for f in MEDIAN_FIELDS:
            row[f] = median([None if r.get(f) in ("", None) else float(r[f]) for r in sel])
        for f in ("au_per_epoch", "samples_per_s_per_epoch"):
            per_run = [[float(x) for x in str(r[f]).split()] for r in sel]
            row[f] = " ".join(f"{median(list(col)):.1f}" for col in zip(*per_run))
        row["dlio_verdict"] = f"success {sum(r['dlio_verdict'] == 'success' for r in sel)}/{len(sel)}"
        row["runs"] = len(sel)
        rows.append(row)
    return rows


def write_results(runs, args):
    """NAME.csv (medians) and NAME-runs.csv (unless replotting), NAME.md and NAME.png."""
    rows = medians(runs)
    if not args.replot:
        for path, table, fields in (
            (f"{args.name}-runs.csv", runs, ["run"] + FIELDS),
            (f"{args.name}.csv", rows, FIELDS + ["runs"]),
        ):
            with open(os.path.join(args.out, path), "w", newline="") as fh:
                w = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
                w.writeheader()
                w.writerows(table)
    lines = [
        "| workload | loader | AU % per epoch | AU % mean (DLIO) | AU % epochs 2+ | samples/s | MB/s | "
        "DLIO verdict | hpcdl speedup | device reads/sample | MB read |",
        "|---" * 11 + "|",
    ]
    stock = {r["workload"]: r for r in rows if r["loader"] == "stock"}
    for r in rows:
        speedup = (
            show(ratio(float(r["samples_per_s"]), float(stock[r["workload"]]["samples_per_s"])), ".2f") + "x"
            if r["loader"] == "hpcdl" and r["workload"] in stock
            else ""
        )
        lines.append(
            f"| {r['workload']} | {r['loader']} | {r['au_per_epoch']} | {figure(r['au_mean'], '.1f')} | "
            f"{figure(r['au_from_epoch2'], '.1f')} | {figure(r['samples_per_s'], '.1f')} | "
            f"{figure(r['mb_per_s'], '.1f')} | {r['dlio_verdict']} | {speedup} | "
            f"{figure(r.get('device_reads_per_sample'), '.2f')} | {figure(r.get('device_mb_read'), '.1f')} |"
        )
    with open(os.path.join(args.out, f"{args.name}.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    plot(rows, args.out, args.name)


def plot(rows, out, name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    for k, loader in enumerate(("stock", "hpcdl")):
        by = {r["workload"]: r for r in rows if r["loader"] == loader}
        xs = [i + (k - 0.5) * width for i in range(len(names))]
        label = "DLIO stock PyTorch loader (files)" if loader == "stock" else "hpcdl plugin (packed store)"
        bar = lambda key: [float("nan") if by.get(n, {}).get(key) in (None, "") else by[n][key] for n in names]  # noqa: E731
        axes[0].bar(xs, bar("au_from_epoch2"), width, label=label)  # a figure not measured draws no bar
        axes[1].bar(xs, bar("samples_per_s"), width, label=label)
    axes[0].axhline(90, color="k", ls="--", lw=1, label="MLPerf Storage pass (AU 90%)")
    axes[0].set_ylabel("DLIO train AU %, epochs 2+")
    axes[1].set_ylabel("DLIO train samples/s (mean over epochs, log)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names)
    axes[0].legend(fontsize=8, loc="upper left")
    fig.suptitle("DLIO workloads on the emulated slow file system (4 ranks, 2 cores)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{name}.png"), dpi=120)


def _number(text):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument(
        "--read-threads",
        type=int,
        default=4,
        help="DLIO reader.read_threads: DataLoader workers per rank (stock), staging threads (hpcdl)",
    )
    ap.add_argument("--compute-scale", type=float, default=1.0, help="multiplies every workload's compute time")
    ap.add_argument("--slowfs", default="/tmp/hpcdl-slowfs-dlio", help="slow FS directory")
    ap.add_argument("--iops", type=int, default=300, help="read IOPS of the slow FS")
    ap.add_argument("--bps", type=int, default=50 << 20, help="read bytes/s of the slow FS")
    ap.add_argument("--drop-every", type=float, default=2.0, help="seconds between page-cache drops (0: never)")
    ap.add_argument("--ram", default="1G", help="hpcdl RAM tier per rank (HPCDL_DLIO_RAM)")
    ap.add_argument(
        "--disk",
        default="",
        help="hpcdl disk tier per rank (HPCDL_DLIO_DISK), in a temporary "
        "folder on the unthrottled local disk; default: none",
    )
    ap.add_argument(
        "--read-concurrency",
        default="auto",
        help="hpcdl store spans read at once per rank (HPCDL_DLIO_READ_CONCURRENCY; 0: no limit)",
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "results"), help="results directory")
    ap.add_argument("--runs", type=int, default=1, help="rounds of (stock, hpcdl) runs; the table: medians")
    ap.add_argument("--name", default="dlio", help="results: OUT/NAME.csv, NAME-runs.csv, NAME.md, NAME.png")
    ap.add_argument("--replot", action="store_true", help="only rewrite NAME.md and NAME.png from NAME-runs.csv")
    args = ap.parse_args()
    if args.replot:
        with open(os.path.join(args.out, f"{args.name}-runs.csv")) as fh:
            rows = [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(fh)]
        write_results(rows, args)
        return
    if os.geteuid() != 0:
        sys.exit("bench/dlio/run.py needs root (loop mount, cgroup throttle, drop_caches)")
    if not os.path.exists(os.path.join(VENV_BIN, "dlio_benchmark")):
        sys.exit(
            f"no dlio_benchmark in {VENV_BIN}: run scripts/bootstrap.sh (installs DLIO) and this "
            f"script with the venv's python"
        )
    env = dict(
        os.environ,
        PYTHONPATH=ROOT,
        OMP_NUM_THREADS="1",
        TF_CPP_MIN_LOG_LEVEL="3",
        PATH=VENV_BIN + os.pathsep + os.environ.get("PATH", ""),
        HPCDL_DLIO_RAM=args.ram,
        HPCDL_DLIO_THREADS=str(args.read_threads),
        HPCDL_DLIO_READ_CONCURRENCY=args.read_concurrency,
    )
    if args.disk:
        env.update(HPCDL_DLIO_DISK=args.disk, HPCDL_DLIO_DISK_DIR=tempfile.mkdtemp(prefix="hpcdl-dlio-disk-"))
    os.makedirs(args.out, exist_ok=True)
    log(f"load: {os.getloadavg()}; waiting for {LOCK}")
    rows = []
    with open(LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for name in args.workloads:
            rows += bench_workload(name, args, env)
    log(f"load: {os.getloadavg()}")
    if args.disk:
        shutil.rmtree(env["HPCDL_DLIO_DISK_DIR"], ignore_errors=True)
    write_results(rows, args)


if __name__ == "__main__":
    main()
