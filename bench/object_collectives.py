"""The object collectives of hpcdl's Python side (hpcdl._agree's waited_*: mpi4py's
nonblocking collectives polled under the stall limits) against mpi4py's blocking
ones (comm.bcast, gather, scatter, allgather) in the same run: what waiting under
the stall limits costs broadcast_optimizer_state, a pipeline's full_state_dict and
load_full_state_dict, and the checks at construction.

    mpiexec -n 4 python bench/object_collectives.py                          # one host
    bench/netcluster.sh run -- mpiexec -n 4 bench/netns-exec.sh \\
        python bench/object_collectives.py --tag object_collectives_cluster  # emulated 4-host cluster

Size is the bytes of the object each rank contributes (a float32 array): the root's
object of a bcast, each rank's of a gather or allgather, each rank's part of a
scatter (the root holds P of them). Both systems run the same objects, interleaved
call by call; a call's time is the slowest rank's. Per run, the median over
iterations; over runs, the median of those; the ratio is hpcdl's median over
mpi4py's (below 1: hpcdl faster). Each system's result is checked once per size.
Rank 0 prints a table and writes <out>/<tag>.csv (one row per run, op, size and
system) and <out>/<tag>.png (the ratio against size, per op).
"""

import argparse
import csv
import os

import numpy as np
from mpi4py import MPI

from hpcdl._agree import waited_allgather, waited_bcast, waited_gather, waited_scatter
from hpcdl.measure import cell, interleaved_runs, medians_and_ratios, plot_ratios, ratio_lines
from hpcdl.units import size_type

OPS = ("bcast", "gather", "scatter", "allgather")


def calls(op, comm, size_bytes):
    """(hpcdl's call, mpi4py's call, check of a result) for op at size on this rank."""
    rank, p = comm.Get_rank(), comm.Get_size()

    def part(r):
        return np.full(max(1, size_bytes // 4), r + 1, np.float32)

    mine = part(rank)
    if op == "bcast":
        obj = mine if rank == 0 else None
        return (
            lambda: waited_bcast(comm, obj, 0, "bench"),
            lambda: comm.bcast(obj, 0),
            lambda got: np.array_equal(got, part(0)),
        )
    if op == "gather":
        return (
            lambda: waited_gather(comm, mine, 0, "bench"),
            lambda: comm.gather(mine, 0),
            lambda got: got is None if rank else all(np.array_equal(g, part(r)) for r, g in enumerate(got)),
        )
    if op == "scatter":
        parts = [part(r) for r in range(p)] if rank == 0 else None
        return (
            lambda: waited_scatter(comm, parts, 0, "bench"),
            lambda: comm.scatter(parts, 0),
            lambda got: np.array_equal(got, mine),
        )
    return (
        lambda: waited_allgather(comm, mine, "bench"),
        lambda: comm.allgather(mine),
        lambda got: all(np.array_equal(g, part(r)) for r, g in enumerate(got)),
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4KiB,1MiB,16MiB,128MiB", help="bytes per object, comma-separated")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--iters", type=int, default=5, help="timed calls per system, op, size and run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="object_collectives")
    args = parser.parse_args()
    parse_size = size_type()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ops = [o for o in args.ops.split(",") if o]
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    rows, ok = [], True
    for op in ops:
        for size in sizes:
            waited, blocking, correct = calls(op, comm, size)
            verdicts = comm.allgather((bool(correct(waited())), bool(correct(blocking()))))
            if not all(a and b for a, b in verdicts):
                ok = False
                if rank == 0:
                    print(f"{op} {size}: a wrong result (hpcdl, mpi4py per rank): {verdicts}")
                continue
            rows.extend(
                interleaved_runs(
                    comm, {"hpcdl": waited, "mpi4py": blocking}, args.runs, args.iters, op=op, size_bytes=size, ranks=p
                )
            )
    if rank != 0:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.tag}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["op"])
        writer.writeheader()
        writer.writerows({k: cell(v) for k, v in r.items()} for r in rows)
    summary = medians_and_ratios(rows, ops, sizes, ("hpcdl", "mpi4py"))
    print(
        f"{'op':<14}{'size':>12}{'hpcdl ms':>12}{'mpi4py ms':>12}{'ratio':>12}   ({p} ranks, median of {args.runs} run medians of {args.iters} calls)"
    )
    print("\n".join(ratio_lines(summary, str)))
    plot_ratios(
        os.path.join(args.out, f"{args.tag}.png"),
        summary,
        ops,
        sizes,
        f"{args.tag}: {p} ranks",
        "hpcdl (waited) time / mpi4py time (median)",
        1.0,
        "as fast as mpi4py",
        "MiB per object",
    )
    if not ok:
        raise SystemExit("a result was wrong; see above")


if __name__ == "__main__":
    main()
