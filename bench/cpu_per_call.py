"""Wall time and CPU time of one allreduce call, per codec and for MPI_Allreduce.

Where does a call's time go: on the wire, or in the CPU of the ranks? Run under
mpiexec (on the emulated cluster like bench/allreduce.py):

    flock /tmp/hpcdl-netcluster.lock bench/netcluster.sh run -- mpiexec -n 4 \\
        bench/netns-exec.sh python bench/cpu_per_call.py --mib 64

Per system: median over calls of the slowest rank's wall time, and of the CPU
time of the whole process (all threads: the engine thread does the work) over
the call, averaged over ranks. The same small-integer float32 data as
bench/allreduce.py; compressed calls are named (error feedback on), and the
residual is kept from call to call as between training steps. Rank 0 prints
one line per system.
"""

import argparse
import statistics
import sys
import time

import numpy as np
from allreduce import parse_codec, rank_input  # bench/ is a script's sys.path[0]: allreduce.py's codecs, data
from mpi4py import MPI

import hpcdl


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=64, help="float32 buffer size in MiB (default 64)")
    p.add_argument(
        "--systems",
        default="int8,topk(ratio=0.01),fp16,none,mpi",
        help="hpcdl codecs (none = dense hpcdl) and/or mpi (default %(default)s)",
    )
    p.add_argument("--calls", type=int, default=5, help="timed calls per system, after one untimed")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    mpi_comm = comm.Dup()
    source = rank_input(args.mib * (1 << 20) // 4, comm.rank, "ints")
    work = np.empty_like(source)
    for name in args.systems.split(","):
        codec = None if name == "mpi" else parse_codec(name)
        walls, cpus = [], []
        for call in range(args.calls + 1):
            np.copyto(work, source)
            comm.Barrier()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            if name == "mpi":
                mpi_comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)
            else:
                hpcdl.allreduce(work, op="sum", name=f"cpu_per_call.{name}", compression=codec)
            wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
            wall, cpu = comm.allreduce(wall, op=MPI.MAX), comm.allreduce(cpu) / comm.size
            if call:
                walls.append(wall)
                cpus.append(cpu)
        if comm.rank == 0:
            print(
                f"{name:10} {args.mib} MiB: wall {1e3 * statistics.median(walls):8.1f} ms (slowest rank), "
                f"CPU {1e3 * statistics.median(cpus):7.1f} ms per rank",
                flush=True,
            )
    mpi_comm.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
