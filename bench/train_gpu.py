"""Training step time on CUDA: torchvision's ResNet-50, hpcdl.torch.DistributedOptimizer
(dense, FP16, Int8) vs DistributedDataParallel (over NCCL where each rank has a GPU of its
own, over gloo where ranks share one: NCCL refuses that) and the same step with no gradient
exchange (the floor), the same ranks in the same run.

    mpiexec -n 2 python bench/train_gpu.py --out bench/results --tag gpu-resnet50-2ranks
    bench/gpu.sh OUTDIR          # 1 rank, then 2 ranks (what ../shared/device/device-check.sh runs)

Random images (fp32), the same every step; systems alternate in rounds (bench/train.py's
time_systems), a step is timed to the end of its GPU work (torch.cuda.synchronize) on the
slowest rank. A run's figure is the median of its timed steps; --runs repeats the whole
timing, and the summary is the median over runs (a ratio: the median of the runs' ratios).
Writes TAG.csv (a row per system and run, then the "median" rows) and TAG.png; rank 0
prints the summary with the runs' spread. Without a CUDA device it refuses at once (CPU
training: bench/train.py).
"""

import argparse
import os
import statistics
import sys

import torch
from mpi4py import MPI
from tqdm import tqdm

WORLD = MPI.COMM_WORLD
FLOOR = "no-exchange"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system and round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--runs", type=int, default=3, help="repeats of the whole timing; the summary is their median")
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
    from hpcdl.measure import save_figure, show

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

    runs = []
    for _ in tqdm(range(args.runs), desc="[hpcdl rank 0] runs", disable=rank != 0):
        runs.append(cpu_bench.time_systems(systems, step, args.rounds, args.steps, warmup_steps=3))
    dist.destroy_process_group()
    if rank != 0:
        return
    params = sum(p.numel() for p in floor.parameters())
    name = torch.cuda.get_device_name(device)
    print(
        f"[hpcdl rank 0] {size} ranks on {gpus} x {name}, ResNet-50 ({params / 1e6:.1f} M params), batch "
        f"{args.batch}/rank, fp32, DDP over {backend}, medians of {args.runs} runs (the runs' range)"
    )
    setting = {"ranks": size, "gpus": gpus, "gpu": name, "batch_per_rank": args.batch}
    per_run, summary = summarize(runs, list(systems), f"ddp-{backend}", setting)
    for r in summary:
        steps = [m["median_step_ms"] for m in per_run if m["system"] == r["system"]]
        print(
            f"[hpcdl rank 0] {r['system']:12s} {show(r['median_step_ms'], '8.2f')} ms/step "
            f"({show(min(steps), '.2f')}-{show(max(steps), '.2f')})  {show(r['samples_per_s'], '8.0f')} samples/s  "
            f"{show(r['step_vs_floor'], '5.2f')}x the floor's step  {show(r['step_vs_ddp'], '5.2f')}x DDP's step"
        )
    rows = per_run + summary
    os.makedirs(args.out, exist_ok=True)
    cpu_bench.write_csv(os.path.join(args.out, f"{args.tag}.csv"), rows)

    title = f"{args.tag}: ResNet-50, {size} ranks on {gpus} x {name}, batch {args.batch}/rank"
    save_figure(os.path.join(args.out, f"{args.tag}.png"), lambda plt: draw(plt, per_run, summary, title))


SUMMARIZED = ("median_step_ms", "samples_per_s", "step_vs_floor", "step_vs_ddp", "cpu_ms_per_step")


def summarize(runs, systems, ddp, setting):
    """(a row per system and run, a "median" row per system) from time_systems' (times, cpu, kernel)
    of each run. A run's figure is the median of its steps, its ratios those of its medians; a
    summary figure is the median over runs of the runs' figures. ``setting``: the columns every
    row shares (ranks, batch_per_rank, ...); ``ddp``: the DDP system the ratios divide by."""
    from hpcdl.measure import rate, ratio

    per_run = []
    for run, (times, cpu, _) in enumerate(runs, start=1):
        medians = {system: statistics.median(times[system]) for system in systems}
        for system in systems:
            per_run.append(
                {
                    "system": system,
                    "run": run,
                    **setting,
                    "median_step_ms": medians[system] * 1e3,
                    "samples_per_s": rate(setting["ranks"] * setting["batch_per_rank"], medians[system]),
                    "step_vs_floor": ratio(medians[system], medians[FLOOR]),
                    "step_vs_ddp": ratio(medians[system], medians[ddp]),
                    "cpu_ms_per_step": statistics.median(cpu[system]) * 1e3,
                    "steps_timed": len(times[system]),
                }
            )
    summary = []
    for system in systems:
        mine = [r for r in per_run if r["system"] == system]
        medians = {key: statistics.median(r[key] for r in mine) for key in SUMMARIZED}
        summary.append(dict(mine[0], run="median", **medians, steps_timed=sum(r["steps_timed"] for r in mine)))
    return per_run, summary


def draw(plt, per_run, summary, title):
    """Bars: each system's median step over runs; error bars: the runs' range."""
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [[r["median_step_ms"] for r in per_run if r["system"] == s["system"]] for s in summary]
    heights = [s["median_step_ms"] for s in summary]
    spread = [[h - min(v) for h, v in zip(heights, steps)], [max(v) - h for h, v in zip(heights, steps)]]
    ax.bar(range(len(summary)), heights, yerr=spread, capsize=4, color="tab:blue")
    ax.set_xticks(range(len(summary)), [s["system"] for s in summary], rotation=30, ha="right")
    ax.set_ylabel(f"step time, ms: median of {len(steps[0])} runs,\nbars their range (lower is better)")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
