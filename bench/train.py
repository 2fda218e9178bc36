"""Training step time: hpcdl.torch.DistributedOptimizer vs DistributedDataParallel over gloo.

    mpiexec -n 4 python bench/train.py --out bench/results --tag train-onehost
    flock /tmp/hpcdl-netcluster.lock bench/netcluster.sh run -- mpiexec -n 4 bench/netns-exec.sh \\
        python bench/train.py --master-addr 10.77.0.1 --out bench/results --tag train-cluster

The same MLP (CPU), the same data and step on every system; systems alternate
in rounds of a few steps so that machine noise hits them alike; the figure is
the median step time over all timed steps. Writes TAG.csv and TAG.png (with the
load average and, on the emulated cluster, the measured TCP stream); rank 0
prints a table. Imports this checkout's hpcdl, wherever it is started from.
"""

import argparse
import csv
import os
import statistics
import sys
import time

import torch
from mpi4py import MPI

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's hpcdl, not an installed one

import hpcdl
import hpcdl.torch
from hpcdl.bench import save_figure
from hpcdl.measure import rate, ratio, show

WORLD = MPI.COMM_WORLD


def make_model(features, hidden, layers, classes):
    torch.manual_seed(0)
    body = [torch.nn.Linear(features, hidden), torch.nn.ReLU()]
    for _ in range(layers - 1):
        body += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*body, torch.nn.Linear(hidden, classes))


def codecs(names):
    """[(label, codec)] for the requested --codecs; codecs the build lacks are reported and left out."""
    out = []
    for name in names:
        if name == "dense":
            out.append(("dense", None))
            continue
        try:
            import hpcdl.compression as c
        except ImportError:
            if WORLD.Get_rank() == 0:
                print(f"[hpcdl rank 0] hpcdl.compression missing: {name} left out", file=sys.stderr)
            continue
        out.append((name, {"fp16": c.FP16, "int8": lambda: c.Int8(), "topk": lambda: c.TopK(ratio=0.01)}[name]()))
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system and round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--codecs", default="dense,int8,topk")
    parser.add_argument("--bucket-bytes", type=int, default=hpcdl.torch.DEFAULT_BUCKET_BYTES)
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address for gloo")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="train-onehost")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, size = WORLD.Get_rank(), WORLD.Get_size()

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    port = WORLD.bcast(29400 + os.getpid() % 500 if rank == 0 else None)
    os.environ.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)

    features, classes = 784, 10
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, features, generator=g)
    y = torch.randint(0, classes, (args.batch,), generator=g)

    systems = {}
    ddp_model = DistributedDataParallel(make_model(features, args.hidden, args.layers, classes))
    systems["ddp-gloo"] = (ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.01))
    for label, codec in codecs(args.codecs.split(",")):
        model = make_model(features, args.hidden, args.layers, classes)
        opt = hpcdl.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                               model.named_parameters(), compression=codec,
                                               bucket_bytes=args.bucket_bytes, name=f"bench.{label}")
        systems[f"hpcdl-{label}"] = (model, opt)
    params = sum(p.numel() for p in ddp_model.parameters())

    def step(model, opt):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    times = {name: [] for name in systems}
    cpu = {name: [] for name in systems}  # CPU seconds of this process (all threads) per step, mean over ranks
    for rnd in range(args.rounds + 1):  # round 0 warms up
        for name, (model, opt) in systems.items():
            WORLD.Barrier()
            for _ in range(args.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                step(model, opt)
                every = WORLD.allgather((time.perf_counter() - t0, time.process_time() - c0))
                elapsed, used = max(e for e, _ in every), sum(c for _, c in every) / size
                if rnd:
                    times[name].append(elapsed)
                    cpu[name].append(used)
    dist.destroy_process_group()
    if rank != 0:
        return
    ddp_median = statistics.median(times["ddp-gloo"])
    os.makedirs(args.out, exist_ok=True)
    rows = []
    print(f"[hpcdl rank 0] {size} ranks, MLP {args.layers}x{args.hidden} ({params / 1e6:.2f} M params, "
          f"{params * 4 / 1e6:.1f} MB of fp32 gradients), batch {args.batch}/rank")
    for name, samples in times.items():
        median = statistics.median(samples)
        rows.append({"system": name, "ranks": size, "params": params, "batch_per_rank": args.batch,
                     "median_step_ms": median * 1e3, "samples_per_s": rate(size * args.batch, median),
                     "throughput_vs_ddp": ratio(ddp_median, median), "steps_timed": len(samples),
                     "cpu_ms_per_step": statistics.median(cpu[name]) * 1e3,
                     "load_avg_1min": os.getloadavg()[0],
                     "stream_MBps": os.environ.get("HPCDL_BENCH_STREAM_MBPS", "")})
        print(f"[hpcdl rank 0] {name:14s} {median * 1e3:9.2f} ms/step  {show(rows[-1]['samples_per_s'], '9.0f')} "
              f"samples/s  {show(rows[-1]['throughput_vs_ddp'], '5.2f')}x DDP  "
              f"{statistics.median(cpu[name]) * 1e3:7.1f} ms CPU/step/rank")
    with open(os.path.join(args.out, f"{args.tag}.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    save_figure(os.path.join(args.out, f"{args.tag}.png"), lambda plt: draw(plt, rows, args.tag, size, params))


def draw(plt, rows, tag, size, params):
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar([r["system"] for r in rows], [r["samples_per_s"] or 0 for r in rows], color="tab:blue")
    ax.set_ylabel("samples/s (all ranks)")
    ax.set_title(f"{tag}: {size} ranks, {params / 1e6:.1f} M-param MLP, CPU")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
