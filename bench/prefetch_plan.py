"""Start-up cost of the prefetcher's plan per rank against the number of ranks P.

    python bench/prefetch_plan.py                      # N = 1,281,167, E = 90, P = 4 .. 4096
    python bench/prefetch_plan.py --samples 100000 --epochs 10 --ranks 4,64

Each P runs in a fresh child process that calls hpcdl.prefetch.plan() for
rank 1 (exactly what a rank's Prefetcher computes at start-up, every peer's
contribution included) and reports its wall and CPU seconds and its peak
resident memory (ru_maxrss: the interpreter, numpy and the store's per-sample
sizes included). Local batch 32 (global batch 32 P), samples of 90..130 KB
(mean 110 KB, seed 0), every rank's RAM tier --ram-gib (8 GiB), disk tier
--disk-gib (0). Writes OUT/NAME.csv and NAME.png (OUT: --out, default
bench/results; NAME: --name, default prefetch-plan).
"""

import argparse
import csv
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.realpath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = """
import json, resource, sys, time
import numpy as np
from hpcdl.prefetch import plan
a = json.loads(sys.argv[1])
sizes = np.random.default_rng(0).integers(90_000, 130_001, a["samples"]).astype(np.uint64)
wall, cpu = time.perf_counter(), time.process_time()
p = plan(a["samples"], 32 * a["ranks"], a["ranks"], 1, a["epochs"], a["seed"], sizes, a["ram"], a["disk"])
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"wall_s": wall, "cpu_s": cpu, "peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "ram_samples": len(p["ram"]), "with_source": int((p["source_rank"] >= 0).sum())}))
"""


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, default=1_281_167)
    ap.add_argument("--epochs", type=int, default=90)
    ap.add_argument("--ranks", default=",".join(str(4 << i) for i in range(11)), help="comma-separated P values")
    ap.add_argument("--ram-gib", type=float, default=8.0)
    ap.add_argument("--disk-gib", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per P")
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--name", default="prefetch-plan")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1")
    rows = []
    for ranks in (int(x) for x in args.ranks.split(",")):
        spec = {
            "samples": args.samples,
            "epochs": args.epochs,
            "ranks": ranks,
            "seed": args.seed,
            "ram": int(args.ram_gib * (1 << 30)),
            "disk": int(args.disk_gib * (1 << 30)),
        }
        done = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(spec)],
            env=env,
            capture_output=True,
            text=True,
            timeout=args.timeout,
        )
        if done.returncode:
            sys.exit(f"P={ranks}: the planning child failed:\n{done.stderr}")
        row = {"ranks": ranks, "samples": args.samples, "epochs": args.epochs, **json.loads(done.stdout)}
        rows.append(row)
        print(
            f"P={ranks:5d}: {row['wall_s']:7.2f} s wall, {row['cpu_s']:7.2f} s CPU, {row['peak_mb']:7.0f} MB peak, "
            f"{row['ram_samples']} samples in RAM, {row['with_source']} with a source peer",
            flush=True,
        )
    path = os.path.join(args.out, args.name)
    with open(path + ".csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, args, path + ".png")
    print(f"wrote {path}.csv and {path}.png")


def plot(rows, args, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ranks = [r["ranks"] for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    left.plot(ranks, [r["wall_s"] for r in rows], "o-", label="wall")
    left.plot(ranks, [r["cpu_s"] for r in rows], "s--", label="CPU")
    left.axhline(10, color="grey", linestyle=":", label="target (10 s)")
    left.set(xscale="log", xlabel="ranks P", ylabel="seconds per rank", title="start-up plan: time")
    right.plot(ranks, [r["peak_mb"] for r in rows], "o-", label="peak resident memory")
    right.axhline(2000, color="grey", linestyle=":", label="target (2 GB)")
    right.set(xscale="log", xlabel="ranks P", ylabel="MB per rank", title="start-up plan: memory")
    for ax in (left, right):
        ax.set_xticks(ranks, [str(r) for r in ranks], rotation=45)
        ax.set_ylim(bottom=0)
        ax.legend()
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"hpcdl.prefetch.plan(), one rank: N = {args.samples:,}, E = {args.epochs}, local batch 32, "
        f"RAM {args.ram_gib:g} GiB, disk {args.disk_gib:g} GiB per rank"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
