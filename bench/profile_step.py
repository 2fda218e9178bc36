"""One system of bench/train.py stepping alone, for a profiler to watch:

    perf record -a -g -F 499 -o /tmp/topk.perf -- mpiexec -n 4 python bench/profile_step.py topk --steps 300
    perf report -i /tmp/topk.perf --no-children --sort comm,dso,sym -g none

SYSTEM is one of hpcdl's codecs in bench/train.py (dense, fp16, int8, topk, topk-allgather, topk-split, topk-reuse, powersgd) or
no-exchange (the same step with no gradient exchange). The model, batch and
step are bench/train.py's; after 20 untimed steps rank 0 prints the wall time
per step and the process CPU time (all threads) per rank and step, mean over
ranks, so a profile's sample counts can be turned into milliseconds per step,
and of it the CPU of the threads other than the training thread (the engine's
and MPI's), and the allreduces' bytes received per rank and step (hpcdl.stats(), mean
over ranks). --csv PATH also appends those figures, unrounded, as one row
to PATH (a header first when the file is new), so runs can be compared from
their values.
"""

import argparse
import csv
import os
import sys
import time

import torch
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train import (  # noqa: E402
    CLASSES,
    CODECS,
    FEATURES,
    FLOOR,
    TOPK_REUSE_STEPS,
    codecs,
    make_model,
    random_batch,
    train_step,
)

import hpcdl.torch  # noqa: E402

WARMUP_STEPS = 20


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("system", help=f"{', '.join(CODECS)} or {FLOOR}")
    parser.add_argument("--steps", type=int, default=300, help="timed steps")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--bucket-bytes", type=int, default=hpcdl.torch.DEFAULT_BUCKET_BYTES)
    parser.add_argument(
        "--topk-reuse-steps", type=int, default=TOPK_REUSE_STEPS, help="topk-reuse: TopK(0.01, reuse_steps=N)"
    )
    parser.add_argument(
        "--gradient-as-bucket-view",
        action="store_true",
        help="DistributedOptimizer(gradient_as_bucket_view=True): .grad is the bucket's slot",
    )
    parser.add_argument(
        "--keep-grads",
        action="store_true",
        help="zero_grad(set_to_none=False): backward accumulates into the existing .grad",
    )
    parser.add_argument("--csv", metavar="PATH", help="append this run's figures, unrounded, to PATH")
    args = parser.parse_args()
    if args.system != FLOOR and args.system not in CODECS:
        parser.error(f"unknown system '{args.system}': choose {', '.join(CODECS)} or {FLOOR}")
    if args.steps < 1:
        parser.error("--steps must be >= 1")
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    model = make_model(FEATURES, args.hidden, args.layers, CLASSES)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    if args.system != FLOOR:
        ((_, codec),) = codecs([args.system], args.topk_reuse_steps)
        opt = hpcdl.torch.DistributedOptimizer(
            opt,
            model.named_parameters(),
            compression=codec,
            bucket_bytes=args.bucket_bytes,
            name=f"profile.{args.system}",
            gradient_as_bucket_view=args.gradient_as_bucket_view,
        )
    x, y = random_batch(comm.Get_rank(), args.batch)
    for i in range(WARMUP_STEPS + args.steps):
        if i == WARMUP_STEPS:
            comm.Barrier()
            hpcdl.stats(reset=True)
            t0, c0, m0 = time.perf_counter(), time.process_time(), time.thread_time()
        train_step(model, opt, x, y, set_to_none=not args.keep_grads)
    wall, cpu, main_cpu = time.perf_counter() - t0, time.process_time() - c0, time.thread_time() - m0
    cpus = comm.gather(cpu)
    others = comm.gather(max(0.0, cpu - main_cpu))
    walls = comm.gather(wall)
    received = comm.gather(sum(row["bytes_received"] for row in hpcdl.stats().get("allreduce", {}).values()))
    if comm.Get_rank() == 0:
        options = "".join(
            f" +{flag}"
            for flag, on in (("gradient-as-bucket-view", args.gradient_as_bucket_view), ("keep-grads", args.keep_grads))
            if on
        ) + (f" (reuse_steps={args.topk_reuse_steps})" if args.system == "topk-reuse" else "")
        row = {
            "system": args.system + options,
            "ranks": comm.Get_size(),
            "steps": args.steps,
            "ms_per_step": max(walls) / args.steps * 1e3,
            "cpu_ms_per_rank_step": sum(cpus) / len(cpus) / args.steps * 1e3,
            "other_threads_cpu_ms_per_rank_step": sum(others) / len(others) / args.steps * 1e3,
            "kb_received_per_rank_step": sum(received) / len(received) / args.steps / 1e3,
        }
        print(
            f"[hpcdl rank 0] {row['system']}: {row['ms_per_step']:.2f} ms/step, "
            f"{row['cpu_ms_per_rank_step']:.2f} ms CPU per rank and step "
            f"({row['other_threads_cpu_ms_per_rank_step']:.2f} of it in threads other than training's: "
            "the engine's, MPI's), "
            f"{row['kb_received_per_rank_step']:.1f} kB received per rank and step "
            f"({comm.Get_size()} ranks, {args.steps} timed steps after {WARMUP_STEPS})",
            flush=True,
        )
        if args.csv:
            new = not os.path.exists(args.csv) or os.path.getsize(args.csv) == 0
            with open(args.csv, "a", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=list(row))
                if new:
                    writer.writeheader()
                writer.writerow(row)


if __name__ == "__main__":
    main()
