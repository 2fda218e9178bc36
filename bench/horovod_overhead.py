"""Per-call cost of a small allreduce through hpcdl.horovod against hpcdl.allreduce.

    mpiexec -n 2 python bench/horovod_overhead.py --elements 256 --calls 2000 --runs 7 --out bench/results/horovod_overhead.csv

Systems:
  numpy       hpcdl.allreduce(array, op="average") on a float32 numpy buffer (the baseline)
  torch       hpcdl.allreduce on a float32 torch tensor (hpcdl's own tensor intake)
  torch_copy  hpcdl.allreduce(tensor.clone()): a new tensor per call, as the out-of-place form makes
  hvd_inplace hvd.allreduce_(tensor)          (hpcdl.horovod.torch, in place)
  hvd         hvd.allreduce(tensor)           (out of place: a copy, autograd)
  hvd_async   hvd.synchronize(hvd.allreduce_async_(tensor))
A run makes ``--calls`` rounds of one call per system, the systems in turn (each
round starting with the next one), so that load from other processes hits all
alike; a run's figure per system is the slowest rank's median call time. Rank 0 writes one CSV row per
system and run, and prints each system's median over the runs and its ratio to numpy.
"""

import argparse
import csv
import statistics
import time

import numpy as np
import torch
from mpi4py import MPI

import hpcdl
import hpcdl.horovod.torch as hvd

SYSTEMS = ("numpy", "torch", "torch_copy", "hvd_inplace", "hvd", "hvd_async")


def calls_of(system, array, tensor):
    if system == "numpy":
        return lambda: hpcdl.allreduce(array, op="average")
    if system == "torch":
        return lambda: hpcdl.allreduce(tensor, op="average")
    if system == "torch_copy":
        return lambda: hpcdl.allreduce(tensor.clone(), op="average")
    if system == "hvd_inplace":
        return lambda: hvd.allreduce_(tensor)
    if system == "hvd":
        return lambda: hvd.allreduce(tensor)
    return lambda: hvd.synchronize(hvd.allreduce_async_(tensor))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--elements", type=int, default=256, help="float32 elements per allreduce (default 256)")
    p.add_argument("--calls", type=int, default=2000, help="timed calls per system and run")
    p.add_argument("--runs", type=int, default=7, help="runs (the figure is the median over them)")
    p.add_argument("--out", default=None, help="CSV file rank 0 writes (default: none)")
    args = p.parse_args(argv)
    hvd.init()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    array = np.ones(args.elements, np.float32)
    tensor = torch.ones(args.elements)
    calls = {s: calls_of(s, array, tensor) for s in SYSTEMS}
    for call in calls.values():  # warm-up: first-call costs (imports, agreement of new shapes)
        for _ in range(50):
            call()
    rows = []
    for run in range(args.runs):
        times = {s: [] for s in SYSTEMS}
        comm.Barrier()
        for i in range(args.calls):
            for system in SYSTEMS[i % len(SYSTEMS) :] + SYSTEMS[: i % len(SYSTEMS)]:  # each goes first in turn
                start = time.perf_counter()
                calls[system]()
                times[system].append(time.perf_counter() - start)
        for system in SYSTEMS:
            slowest = comm.allreduce(statistics.median(times[system]), op=MPI.MAX)
            rows.append(
                {
                    "system": system,
                    "run": run,
                    "ranks": comm.Get_size(),
                    "elements": args.elements,
                    "calls": args.calls,
                    "us_per_call": slowest * 1e6,
                }
            )
    if comm.Get_rank() != 0:
        return
    if args.out:
        with open(args.out, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    medians = {s: statistics.median(r["us_per_call"] for r in rows if r["system"] == s) for s in SYSTEMS}
    print(
        f"{comm.Get_size()} ranks, {args.elements} float32, {args.calls} calls x {args.runs} runs "
        "(median over runs of the slowest rank's median call time)"
    )
    for system in SYSTEMS:
        print(f"{system:12s} {medians[system]:8.2f} us/call  {medians[system] / medians['numpy']:.3f}x numpy")


if __name__ == "__main__":
    main()
