"""allgather, alltoall and reducescatter: hpcdl against MPI's own (MPI_Allgatherv,
MPI_Alltoallv, MPI_Reduce_scatter through mpi4py) in the same run.

    mpiexec -n 4 python bench/gather.py                                   # one host
    bench/netcluster.sh run -- mpiexec -n 4 bench/netns-exec.sh \\
        python bench/gather.py --tag gather_cluster                      # emulated 4-host cluster

Size is the bytes each rank sends (float32): an allgather's contribution (rank r
sends size * (1 + r/p) / (1 + (p-1)/(2p)) bytes rounded to rows, so the counts
differ per rank and average to size), an alltoall's whole buffer (split equally),
a reducescatter's input. Both systems run the same buffers, interleaved call by
call; a call's time is the slowest rank's. Per run, the median over iterations;
over runs, the median of those; the ratio is hpcdl's median over MPI's (below 1:
hpcdl faster). Each system's result is checked against numpy once per size.
Rank 0 prints a table and writes <out>/<tag>.csv (one row per run, op, size and
system; appended as each size finishes, so a run cut short keeps what it
measured) and <out>/<tag>.png (the ratio against size, per op).
"""

import argparse
import csv
import os

import numpy as np
from mpi4py import MPI

import hpcdl
from hpcdl.measure import cell, interleaved_runs, medians_and_ratios, plot_ratios, ratio_lines
from hpcdl.units import size_type

ROW = 256  # float32 per row: 1 KiB rows
OPS = ("allgather", "alltoall", "reducescatter")


def mib(size):
    return f"{size >> 20}Mi"


def allgather_rows(size_bytes, rank, p):
    """Uneven rows per rank, averaging size_bytes."""
    mean_weight = 1 + (p - 1) / (2 * p)
    return max(1, round(size_bytes / (4 * ROW) * (1 + rank / p) / mean_weight))


class Case:
    """One op at one size on this rank: the input, the reference, and both systems' calls."""

    def __init__(self, op, size_bytes, comm, mpi_comm):
        p, rank = comm.Get_size(), comm.Get_rank()
        self.op, self.comm, self.mpi = op, comm, mpi_comm
        rows = max(p, size_bytes // (4 * ROW) // p * p)
        if op == "allgather":
            self.counts = [allgather_rows(size_bytes, r, p) for r in range(p)]
            rows = self.counts[rank]
        self.data = (np.arange(rows * ROW, dtype=np.float32).reshape(rows, ROW) % 1024) * (rank + 1)
        if op == "allgather":
            self.out = np.empty((sum(self.counts), ROW), np.float32)
            self.expected = np.concatenate(
                [
                    (np.arange(n * ROW, dtype=np.float32).reshape(n, ROW) % 1024) * (r + 1)
                    for r, n in enumerate(self.counts)
                ]
            )
        elif op == "alltoall":
            self.out = np.empty_like(self.data)
            block = rows // p
            self.expected = np.concatenate(
                [self.data[rank * block : (rank + 1) * block] / (rank + 1) * (r + 1) for r in range(p)]
            )
        else:
            self.out = np.empty((rows // p, ROW), np.float32)
            self.expected = (self.data / (rank + 1) * sum(range(1, p + 1)))[
                rank * (rows // p) : (rank + 1) * (rows // p)
            ]

    def hpcdl(self):
        if self.op == "allgather":
            return hpcdl.allgather(self.data, comm=self.comm, name="bench.allgather")
        if self.op == "alltoall":
            return hpcdl.alltoall(self.data, comm=self.comm, name="bench.alltoall")[0]
        return hpcdl.reducescatter(self.data, comm=self.comm, name="bench.reducescatter")

    def mpi_call(self):
        p, row_elems = self.mpi.Get_size(), ROW
        if self.op == "allgather":
            counts = [n * row_elems for n in self.counts]
            self.mpi.Allgatherv(self.data, [self.out, counts, MPI.FLOAT])
        elif self.op == "alltoall":
            counts = [self.data.size // p] * p
            self.mpi.Alltoallv([self.data, counts, MPI.FLOAT], [self.out, counts, MPI.FLOAT])
        else:
            self.mpi.Reduce_scatter(self.data, self.out, [self.out.size] * p, op=MPI.SUM)
        return self.out

    def correct(self, got):
        return bool(np.array_equal(got, self.expected))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1MiB,4MiB,16MiB,64MiB", help="bytes each rank sends, comma-separated")
    parser.add_argument("--ops", default=",".join(OPS))
    parser.add_argument("--iters", type=int, default=10, help="timed calls per system, op, size and run")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="gather")
    args = parser.parse_args()
    parse_size = size_type()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    ops = [o for o in args.ops.split(",") if o]
    comm = MPI.COMM_WORLD
    mpi_comm = comm.Dup()
    rank, p = comm.Get_rank(), comm.Get_size()
    rows, ok = [], True
    fields = ["op", "size_bytes", "ranks", "system", "run", "median_s", "min_s"]
    csv_path = os.path.join(args.out, f"{args.tag}.csv")
    if rank == 0:  # written as each size finishes: a run cut short keeps what it measured
        os.makedirs(args.out, exist_ok=True)
        with open(csv_path, "w", newline="") as f:
            csv.DictWriter(f, fieldnames=fields).writeheader()
    for op in ops:
        for size in sizes:
            measured = len(rows)
            case = Case(op, size, comm, mpi_comm)
            verdicts = comm.allgather((case.correct(case.hpcdl()), case.correct(case.mpi_call())))
            if not all(a and b for a, b in verdicts):
                ok = False
                if rank == 0:
                    print(f"{op} {size}: a wrong result (hpcdl, mpi per rank): {verdicts}")
                continue
            rows.extend(
                interleaved_runs(
                    comm,
                    {"hpcdl": case.hpcdl, "mpi": case.mpi_call},
                    args.runs,
                    args.iters,
                    op=op,
                    size_bytes=size,
                    ranks=p,
                )
            )
            if rank == 0:
                with open(csv_path, "a", newline="") as f:
                    csv.DictWriter(f, fieldnames=fields).writerows(
                        {k: cell(v) for k, v in r.items()} for r in rows[measured:]
                    )
    mpi_comm.Free()
    if rank != 0:
        return
    summary = medians_and_ratios(rows, ops, sizes, ("hpcdl", "mpi"))
    print(
        f"{'op':<14}{'size':>12}{'hpcdl ms':>12}{'mpi ms':>12}{'ratio':>12}   ({p} ranks, median of {args.runs} run medians of {args.iters} calls)"
    )
    print("\n".join(ratio_lines(summary, mib)))
    plot_ratios(
        os.path.join(args.out, f"{args.tag}.png"),
        summary,
        ops,
        sizes,
        f"{args.tag}: {p} ranks",
        "hpcdl time / MPI time (median)",
        1.1,
        "1.1x MPI",
        "MiB sent per rank",
    )
    if not ok:
        raise SystemExit("a result was wrong; see above")


if __name__ == "__main__":
    main()
