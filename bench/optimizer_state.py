"""broadcast_optimizer_state against the pickled broadcast a user writes without it
(mpi4py's comm.bcast of the root's state_dict(), then load_state_dict), in the same run:
what the tensor-by-tensor broadcast (a small pickled skeleton, each tensor beyond 4 KiB
through hpcdl's broadcast into a tensor allocated on each rank) costs or saves.

    mpiexec -n 4 python bench/optimizer_state.py                          # one host
    bench/netcluster.sh run -- mpiexec -n 4 bench/netns-exec.sh \\
        python bench/optimizer_state.py --tag optimizer_state_cluster     # emulated 4-host cluster

Size is the bytes of Adam's two moments (8 bytes per parameter, in 1024-wide float32
layers). Both systems run on the same optimizer, interleaved call by call; a call's
time is the slowest rank's. Per run, the median over iterations; over runs, the median
of those; the ratio is hpcdl's median over the pickled one's (below 1: hpcdl faster).
Each system's result is checked once per size (every rank's state bitwise the root's).
Rank 0 prints a table and writes <out>/<tag>.csv (one row per run, size and system) and
<out>/<tag>.png (the ratio against size).
"""

import argparse
import csv
import hashlib
import os

import torch
from mpi4py import MPI

import hpcdl.torch as hvt
from hpcdl.measure import cell, interleaved_runs, medians_and_ratios, plot_ratios, ratio_lines
from hpcdl.units import size_type

WIDTH = 1024
OP = "adam-state"


def adam_with_state(state_bytes, rank):
    """An Adam optimizer after one step, its moments of ``state_bytes`` in all, different on every rank."""
    rows = max(1, state_bytes // (8 * WIDTH))
    params = [torch.nn.Parameter(torch.zeros(min(rows - i, 256), WIDTH)) for i in range(0, rows, 256)]
    opt = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.full_like(p, float(rank + 1))
    opt.step()
    for p in params:
        p.grad = None
    return opt


def systems(opt, comm):
    """{system: a call giving every rank rank 0's state of opt}."""
    rank = comm.Get_rank()

    def hpcdl_call():
        hvt.broadcast_optimizer_state(opt, root_rank=0, comm=comm)

    def pickled_call():
        state = comm.bcast(opt.state_dict() if rank == 0 else None, 0)
        if rank != 0:
            opt.load_state_dict(state)

    return {"hpcdl": hpcdl_call, "pickled": pickled_call}


def digest(opt):
    h = hashlib.sha1()
    for entry in opt.state_dict()["state"].values():
        for t in entry.values():
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4MiB,64MiB,256MiB", help="bytes of optimizer state, comma-separated")
    parser.add_argument("--iters", type=int, default=3, help="timed calls per system, size and run")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="optimizer_state")
    args = parser.parse_args()
    parse_size = size_type()
    sizes = [parse_size(s) for s in args.sizes.split(",")]
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, p = comm.Get_rank(), comm.Get_size()
    rows, ok = [], True
    for size in sizes:
        opt = adam_with_state(size, rank)
        calls = systems(opt, comm)
        root_digest = comm.bcast(digest(opt) if rank == 0 else None, 0)
        for system, call in calls.items():
            call()
            if not all(comm.allgather(digest(opt) == root_digest)):
                ok = False
                if rank == 0:
                    print(f"{system} at {size} bytes: a rank's state differs from the root's")
        rows.extend(interleaved_runs(comm, calls, args.runs, args.iters, op=OP, size_bytes=size, ranks=p))
    if rank != 0:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.tag}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({k: cell(v) for k, v in r.items()} for r in rows)
    summary = medians_and_ratios(rows, [OP], sizes, ("hpcdl", "pickled"))
    print(
        f"{'op':<14}{'size':>12}{'hpcdl ms':>12}{'pickled ms':>12}{'ratio':>12}   ({p} ranks, median of {args.runs} run medians of {args.iters} calls)"
    )
    print("\n".join(ratio_lines(summary, lambda s: f"{s / 2**20:g} MiB")))
    plot_ratios(
        os.path.join(args.out, f"{args.tag}.png"),
        summary,
        [OP],
        sizes,
        f"{args.tag}: {p} ranks",
        "hpcdl time / pickled time (median)",
        1.0,
        "as fast as the pickled broadcast",
        "MiB of optimizer state",
    )
    if not ok:
        raise SystemExit("a wrong result: see above")


if __name__ == "__main__":
    main()
