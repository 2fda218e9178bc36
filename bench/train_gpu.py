"""Training step time on CUDA: torchvision's ResNet-50, hpcdl.torch.DistributedOptimizer
(dense, FP16, Int8) vs DistributedDataParallel (over NCCL where each rank has a GPU of its
own, over gloo where ranks share one: NCCL refuses that) and the same step with no gradient
exchange (the floor), the same ranks in the same run.

    mpiexec -n 2 python bench/train_gpu.py --out bench/results --tag gpu-resnet50-2ranks
    bench/gpu.sh OUTDIR          # 1 rank, then 2 ranks (what ../shared/device/device-check.sh runs)

Random images (fp32), the same every step; systems alternate in rounds (bench/train.py's
time_systems), a step is timed to the end of its GPU work (torch.cuda.synchronize) on the
slowest rank; figures are medians over all timed steps. Writes TAG.csv and TAG.png; rank 0
prints a table. Without a CUDA device it refuses at once (CPU training: bench/train.py).
"""

import argparse
import os
import statistics
import sys

import torch
from mpi4py import MPI

WORLD = MPI.COMM_WORLD
FLOOR = "no-exchange"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--codecs", default="dense,fp16,int8", help="hpcdl codecs (bench/train.py's names)")
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="gpu-resnet50")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        if WORLD.Get_rank() == 0:
            print(
                "bench/train_gpu.py: no CUDA device here: this benchmark needs one "
                "(bench/train.py measures CPU training)",
                file=sys.stderr,
            )
        sys.exit(2)
    import torch.distributed as dist
    import torchvision
    from torch.nn.parallel import DistributedDataParallel

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import train as cpu_bench  # bench/train.py: the timing loop, the codecs, the CSV

    import hpcdl.torch
    from hpcdl.measure import rate, ratio, save_figure, show

    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    local = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    gpus = torch.cuda.device_count()
    device = torch.device("cuda", local.Get_rank() % gpus)
    torch.cuda.set_device(device)
    own_gpu = WORLD.allreduce(int(local.Get_size() <= gpus), op=MPI.MIN) == 1
    backend = "nccl" if own_gpu else "gloo"
    port = WORLD.bcast(29600 + os.getpid() % 300 if rank == 0 else None)
    os.environ.update(MASTER_ADDR=os.environ.get("MASTER_ADDR", "127.0.0.1"), MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=size, device_id=device if own_gpu else None)
    torch.backends.cudnn.benchmark = True

    def make():
        torch.manual_seed(0)
        return torchvision.models.resnet50().to(device)

    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch, 3, args.image_size, args.image_size, generator=g).to(device)
    y = torch.randint(0, 1000, (args.batch,), generator=g).to(device)
    systems = {}
    floor = make()
    systems[FLOOR] = (floor, torch.optim.SGD(floor.parameters(), lr=args.lr))
    for label, codec in cpu_bench.codecs(args.codecs.split(",")):
        model = make()
        opt = hpcdl.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=args.lr),
            model.named_parameters(),
            compression=codec,
            name=f"bench.gpu.{label}",
        )
        systems[f"hpcdl-{label}"] = (model, opt)
    ddp = DistributedDataParallel(make(), device_ids=[device])
    systems[f"ddp-{backend}"] = (ddp, torch.optim.SGD(ddp.parameters(), lr=args.lr))

    def step(model, opt):
        cpu_bench.train_step(model, opt, x, y)
        torch.cuda.synchronize(device)

    times, cpu, _ = cpu_bench.time_systems(systems, step, args.rounds, args.steps, warmup_steps=3)
    dist.destroy_process_group()
    if rank != 0:
        return
    medians = {name: statistics.median(t) for name, t in times.items()}
    params = sum(p.numel() for p in floor.parameters())
    name = torch.cuda.get_device_name(device)
    print(
        f"[hpcdl rank 0] {size} ranks on {gpus} x {name}, ResNet-50 ({params / 1e6:.1f} M params), batch "
        f"{args.batch}/rank, fp32, DDP over {backend}"
    )
    rows = []
    for system in systems:
        median = medians[system]
        rows.append(
            {
                "system": system,
                "ranks": size,
                "gpus": gpus,
                "gpu": name,
                "batch_per_rank": args.batch,
                "median_step_ms": median * 1e3,
                "samples_per_s": rate(size * args.batch, median),
                "step_vs_floor": ratio(median, medians[FLOOR]),
                "step_vs_ddp": ratio(median, medians[f"ddp-{backend}"]),
                "cpu_ms_per_step": statistics.median(cpu[system]) * 1e3,
                "steps_timed": len(times[system]),
            }
        )
        r = rows[-1]
        print(
            f"[hpcdl rank 0] {system:12s} {show(r['median_step_ms'], '8.2f')} ms/step  "
            f"{show(r['samples_per_s'], '8.0f')} samples/s  {show(r['step_vs_floor'], '5.2f')}x the floor's step  "
            f"{show(r['step_vs_ddp'], '5.2f')}x DDP's step"
        )
    os.makedirs(args.out, exist_ok=True)
    cpu_bench.write_csv(os.path.join(args.out, f"{args.tag}.csv"), rows)

    def draw(plt):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.bar(range(len(rows)), [r["median_step_ms"] for r in rows], color="tab:blue")
        ax.set_xticks(range(len(rows)), [r["system"] for r in rows], rotation=30, ha="right")
        ax.set_ylabel("median step time, ms (lower is better)")
        ax.set_title(f"{args.tag}: ResNet-50, {size} ranks on {gpus} x {name}, batch {args.batch}/rank", fontsize=9)
        fig.tight_layout()
        return fig

    save_figure(os.path.join(args.out, f"{args.tag}.png"), draw)


if __name__ == "__main__":
    main()
