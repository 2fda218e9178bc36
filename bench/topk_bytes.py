"""Bytes each rank receives per top-k allreduce call, by algorithm (hpcdl.stats()).

    mpiexec -n 8 python bench/topk_bytes.py                # 4 M floats, TopK 1%
    mpiexec -n 4 python bench/topk_bytes.py --count 1000000 --ratio 0.001 --steps 5

Standard normal gradients (seeded per rank and step), named so error feedback
runs as in training; each algorithm (allgather, split, auto) runs --steps calls
after one uncounted warm-up call.
Prints, per algorithm, the largest and smallest bytes received by a rank per
call, that largest in units of 8k (the allgather's figure at p = 2), and the
slowest rank's mean seconds per call (wall time: machine load shows in it).
--skew F multiplies the first 1/F of each gradient by 1000 (0: off), so every
rank's largest values sit in one corner of the index space.
"""

import argparse

import numpy as np
from mpi4py import MPI

import hpcdl
from hpcdl.compression import TopK


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=4 << 20)
    p.add_argument("--ratio", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--skew", type=int, default=0)
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    k = TopK(args.ratio).k(args.count)
    for algorithm in ("allgather", "split", "auto"):
        codec = TopK(args.ratio, algorithm=algorithm)
        hpcdl.allreduce(np.ones(args.count, np.float32), compression=codec)  # warm-up: scratch grows
        hpcdl.compression.reset_state()
        hpcdl.stats(reset=True)
        for step in range(args.steps):
            g = np.random.default_rng(1000 * step + rank).standard_normal(args.count).astype(np.float32)
            if args.skew:
                g[: args.count // args.skew] *= 1000
            hpcdl.allreduce(g, op="average", name="bench.topk", compression=codec)
        row = hpcdl.stats(reset=True)["allreduce"][str(codec)]
        per_call = row["bytes_received"] / row["ops"]
        most, least = comm.allreduce(per_call, op=MPI.MAX), comm.allreduce(per_call, op=MPI.MIN)
        seconds = comm.allreduce(row["seconds"] / row["ops"], op=MPI.MAX)
        if rank == 0:
            print(
                f"p={size} n={args.count} k={k} {algorithm:9s}: bytes received per rank per call "
                f"max {most:.0f} min {least:.0f} = {most / (8 * k):.2f} x 8k, {1e3 * seconds:.1f} ms per call",
                flush=True,
            )
    hpcdl.compression.reset_state()


if __name__ == "__main__":
    main()
