"""Training step time and accuracy: hpcdl.torch.DistributedOptimizer (dense and
its codecs, PowerSGD rank 1 among them) vs DistributedDataParallel over gloo, plain and with its
communication hooks (fp16/bf16 compression, PowerSGD rank 1 and 4), and the
same step with no gradient exchange at all: the floor no data-parallel system
can beat on these cores.

    mpiexec -n 4 python bench/train.py --out bench/results --tag train-onehost
    flock /tmp/hpcdl-netcluster.lock bench/netcluster.sh run -- mpiexec -n 4 bench/netns-exec.sh \\
        python bench/train.py --master-addr 10.77.0.1 --out bench/results --tag train-cluster

The same MLP (CPU), the same data and step on every system; systems alternate
in rounds of a few steps so that machine noise hits them alike; the figure is
the median step time over all timed steps (random data). PowerSGD (DDP's hook
and hpcdl's codec alike) compresses from step POWERSGD_START_ITER on; the
warm-up round runs at least that many steps, so every timed step is compressed. PowerSGD's DDP gets one bucket for
all gradients: over gloo its hook deadlocks with two (see build_systems). A separate, untimed phase trains a
fresh copy of every system for --train-steps steps on the scikit-learn digits
(each rank on its shard, the same batches for every system) and reports the
accuracy on a held-out fifth: with --seeds N, the mean, spread and per-seed values over N training
seeds (initial weights and batch order), as one seed's accuracy moves by a point with summation order alone. The floor (no-exchange: each rank steps its own
model alone) is timed, not trained: it is no way to train. "vs fastest hook"
is the fastest DDP hook's step time over the system's, so the floor's is the
most any system could reach here. A system that cannot run here (DDP refuses
bf16_compress_hook without CUDA/NCCL or XPU) is a row with its reason and no
figures. Writes TAG.csv and TAG.png (with the load average and, on the
emulated cluster, the measured TCP stream); rank 0 prints a table. Imports
this checkout's hpcdl, wherever it is started from.
"""

import argparse
import csv
import os
import resource
import statistics
import sys
import time

import torch
from mpi4py import MPI

import hpcdl
import hpcdl.torch
from hpcdl.measure import cell, rate, ratio, save_figure, show

WORLD = MPI.COMM_WORLD
POWERSGD_START_ITER = 10  # PowerSGDState's warm-up: plain allreduce before this step (its default is 1000)
DDP_HOOKS = ("fp16", "bf16", "powersgd-r1", "powersgd-r4")
CODECS = ("dense", "fp16", "int8", "topk", "topk-allgather", "topk-split", "topk-reuse", "powersgd")
TOPK_REUSE_STEPS = 20  # topk-reuse: TopK(0.01, reuse_steps=...), docs/compression.md
FEATURES, CLASSES = 784, 10  # the timed steps' random data
FLOOR = "no-exchange"
FLOOR_NOTE = "step-time floor: no gradient exchange, not trained"
TEST_FRACTION, SPLIT_SEED = 0.2, 1234


def make_model(features, hidden, layers, classes, seed=0):
    torch.manual_seed(seed)
    body = [torch.nn.Linear(features, hidden), torch.nn.ReLU()]
    for _ in range(layers - 1):
        body += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*body, torch.nn.Linear(hidden, classes))


def random_batch(rank, batch):
    """This rank's (inputs, labels) for the timed steps: random, the same every step."""
    g = torch.Generator().manual_seed(rank)
    return torch.randn(batch, FEATURES, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)


def train_step(model, opt, x, y, set_to_none=True):
    opt.zero_grad(set_to_none=set_to_none)
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def kernel_seconds():
    """This process's CPU time in the kernel so far (all threads)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_stime


def time_systems(systems, step, rounds, steps, warmup_steps=0):
    """({system: [seconds per step]}, {system: [CPU seconds per step]}, {system: [kernel CPU
    seconds per step]}): systems alternate in rounds of `steps` steps, so that machine noise
    hits them alike; round 0 (at least warmup_steps steps) is not timed. A step's time is the
    slowest rank's; its CPU time, this process's (all threads, user and kernel) averaged over
    the ranks, and of it the kernel's (system calls, and the network stack's work the kernel
    charges to the process). Linux splits a process's CPU time between user and kernel by
    sampling at clock ticks, so a single step's kernel time is coarse: use their mean."""
    times = {name: [] for name in systems}
    cpu = {name: [] for name in systems}
    kernel = {name: [] for name in systems}
    for rnd in range(rounds + 1):
        for name, (model, opt) in systems.items():
            WORLD.Barrier()
            for _ in range(steps if rnd else max(steps, warmup_steps)):
                t0, c0, k0 = time.perf_counter(), time.process_time(), kernel_seconds()
                step(model, opt)
                every = WORLD.allgather((time.perf_counter() - t0, time.process_time() - c0, kernel_seconds() - k0))
                if rnd:
                    times[name].append(max(e for e, _, _ in every))
                    cpu[name].append(sum(c for _, c, _ in every) / WORLD.Get_size())
                    kernel[name].append(sum(k for _, _, k in every) / WORLD.Get_size())
    return times, cpu, kernel


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({key: cell(value) for key, value in row.items()} for row in rows)


def codecs(names, topk_reuse_steps=TOPK_REUSE_STEPS):
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
        out.append(
            (
                name,
                {
                    "fp16": c.FP16,
                    "int8": lambda: c.Int8(),
                    "topk": lambda: c.TopK(ratio=0.01),
                    "topk-allgather": lambda: c.TopK(ratio=0.01, algorithm="allgather"),
                    "topk-split": lambda: c.TopK(ratio=0.01, algorithm="split"),
                    "topk-reuse": lambda: c.TopK(ratio=0.01, reuse_steps=topk_reuse_steps),
                    "powersgd": lambda: c.PowerSGD(rank=1, warmup_steps=POWERSGD_START_ITER),
                }[name](),
            )
        )
    return out


def register_hook(model, name):
    """Register DDP's communication hook for --ddp-hooks NAME on model."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if name in ("fp16", "bf16"):
        model.register_comm_hook(None, getattr(default_hooks, f"{name}_compress_hook"))
    else:
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=int(name[-1]), start_powerSGD_iter=POWERSGD_START_ITER
        )
        model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def build_systems(args, make, prefix):
    """({name: (model, optimizer)}, {name: reason it did not run}): the same on every rank."""
    from torch.nn.parallel import DistributedDataParallel

    systems, failed = {}, {}
    ddp = DistributedDataParallel(make())
    systems["ddp-gloo"] = (ddp, torch.optim.SGD(ddp.parameters(), lr=args.lr))
    grad_mib = sum(p.numel() * p.element_size() for p in ddp.parameters()) / 2**20
    for hook in [h for h in args.ddp_hooks.split(",") if h]:
        # PowerSGD's callbacks wait inside gloo's 2 worker threads for a nested allreduce: with 2 buckets
        # in flight both block (deadlock). An explicit bucket_cap_mb also sets the first bucket's cap: one bucket.
        ddp = DistributedDataParallel(make(), bucket_cap_mb=grad_mib + 1 if hook.startswith("powersgd") else None)
        try:
            register_hook(ddp, hook)
            error = None
        except Exception as exc:  # DDP checks the hook at registration, the same on every rank
            error = f"{type(exc).__name__}: {exc}"
        errors = [e for e in WORLD.allgather(error) if e]
        if errors:
            failed[f"ddp-{hook}"] = f"did not run: {errors[0]}"
        else:
            systems[f"ddp-{hook}"] = (ddp, torch.optim.SGD(ddp.parameters(), lr=args.lr))
    for label, codec in codecs(args.codecs.split(",")):
        model = make()
        opt = hpcdl.torch.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=args.lr),
            model.named_parameters(),
            compression=codec,
            bucket_bytes=args.bucket_bytes,
            name=f"{prefix}.{label}",
        )
        systems[f"hpcdl-{label}"] = (model, opt)
    return systems, failed


def digits(rank, size):
    """(train x, train y) of this rank's shard and the whole held-out (x, y) of the scikit-learn digits."""
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = torch.tensor(data.data / 16.0, dtype=torch.float32), torch.tensor(data.target)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(SPLIT_SEED))
    held_out = int(len(y) * TEST_FRACTION)
    test, train = order[:held_out], order[held_out:][rank::size]
    return x[train], y[train], x[test], y[test]


def accuracy_phase(args, rank, size):
    """{system: [(held-out accuracy, mean held-out loss) per training seed]} after --train-steps steps of each
    system on the digits, and the failures. Seed s sets the model's initial weights and every rank's batch
    order (the same for every system); the held-out split stays."""
    train_x, train_y, test_x, test_y = digits(rank, size)
    accuracy, failed = {}, {}
    for seed in range(args.seeds):
        systems, failed = build_systems(
            args, lambda: make_model(train_x.shape[1], args.hidden, args.layers, 10, seed), f"bench.acc{seed}"
        )
        for name, (model, opt) in systems.items():
            if args.accuracy_of and name not in args.accuracy_of.split(","):
                continue
            g = torch.Generator().manual_seed(seed * size + rank)  # the same batches for every system
            for _ in range(args.train_steps):
                pick = torch.randint(0, len(train_y), (args.batch,), generator=g)
                opt.zero_grad()
                torch.nn.functional.cross_entropy(model(train_x[pick]), train_y[pick]).backward()
                opt.step()
            with torch.no_grad():
                mine = slice(rank, None, size)
                logits = model(test_x[mine])
                correct = int((logits.argmax(1) == test_y[mine]).sum())
                loss = float(torch.nn.functional.cross_entropy(logits, test_y[mine], reduction="sum"))
            accuracy.setdefault(name, []).append(
                (ratio(WORLD.allreduce(correct), len(test_y)), ratio(WORLD.allreduce(loss), len(test_y)))
            )
            if rank == 0:  # as it goes: a long phase cut short still shows its seeds
                print(f"[hpcdl rank 0] seed {seed} {name}: held-out accuracy, loss {accuracy[name][-1]!r}", flush=True)
    return accuracy, failed


def accuracy_columns(per_seed):
    """The CSV's accuracy cells of one system from its [(accuracy, loss) per seed] (empty: not trained)."""
    accs = [a for a, _ in per_seed]
    return {
        "test_acc": statistics.mean(accs) if accs else None,
        "test_acc_sd": statistics.stdev(accs) if len(accs) > 1 else None,
        "test_acc_min": min(accs, default=None),
        "test_acc_max": max(accs, default=None),
        "test_acc_per_seed": " ".join(repr(a) for a in accs),
        "test_loss": statistics.mean(loss for _, loss in per_seed) if per_seed else None,
        "test_loss_per_seed": " ".join(repr(loss) for _, loss in per_seed),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per system and round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--codecs", default="dense,int8,topk,powersgd", help=f"hpcdl codecs: {','.join(CODECS)}")
    parser.add_argument(
        "--ddp-hooks",
        default=",".join(DDP_HOOKS),
        help=f"DDP communication hooks, from {','.join(DDP_HOOKS)} ('' for plain DDP only)",
    )
    parser.add_argument("--train-steps", type=int, default=200, help="steps of every system in the accuracy phase")
    parser.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="training seeds of the accuracy phase (0..N-1: initial weights and batch order); "
        "the CSV has the mean, sample standard deviation, min and max of the held-out accuracy; "
        "0: no accuracy phase (step times only; the accuracy does not depend on the links)",
    )
    parser.add_argument(
        "--accuracy-of",
        default="",
        help="the systems the accuracy phase trains, e.g. ddp-powersgd-r1,hpcdl-powersgd ('': all)",
    )
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--bucket-bytes", type=int, default=hpcdl.torch.DEFAULT_BUCKET_BYTES)
    parser.add_argument("--master-addr", default="127.0.0.1", help="rank 0's address for gloo")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="train-onehost")
    args = parser.parse_args()
    unknown = set(filter(None, args.ddp_hooks.split(","))) - set(DDP_HOOKS)
    if unknown:
        parser.error(f"--ddp-hooks: unknown {','.join(sorted(unknown))}; choose from {','.join(DDP_HOOKS)}")
    if args.seeds < 0:
        parser.error("--seeds must be >= 0")
    named = {"ddp-gloo", *(f"ddp-{h}" for h in args.ddp_hooks.split(",") if h)}
    named |= {f"hpcdl-{c}" for c in args.codecs.split(",") if c}
    strangers = set(filter(None, args.accuracy_of.split(","))) - named
    if strangers:
        parser.error(f"--accuracy-of: {','.join(sorted(strangers))} not among the systems {','.join(sorted(named))}")
    torch.set_num_threads(1)
    rank, size = WORLD.Get_rank(), WORLD.Get_size()

    import torch.distributed as dist

    port = WORLD.bcast(29400 + os.getpid() % 500 if rank == 0 else None)
    os.environ.update(MASTER_ADDR=args.master_addr, MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=size)

    x, y = random_batch(rank, args.batch)

    def make():
        return make_model(FEATURES, args.hidden, args.layers, CLASSES)

    systems, failed = build_systems(args, make, "bench")
    floor = make()
    systems[FLOOR] = (floor, torch.optim.SGD(floor.parameters(), lr=args.lr))
    params = sum(p.numel() for p in systems["ddp-gloo"][0].parameters())

    # round 0 warms up, PowerSGD's plain-allreduce steps included
    times, cpu, kernel = time_systems(
        systems, lambda model, opt: train_step(model, opt, x, y), args.rounds, args.steps, POWERSGD_START_ITER
    )
    accuracy, _ = accuracy_phase(args, rank, size)
    dist.destroy_process_group()
    if rank != 0:
        return
    medians = {name: statistics.median(steps) for name, steps in times.items()}
    ddp_median = medians["ddp-gloo"]
    hooks = [f"ddp-{hook}" for hook in args.ddp_hooks.split(",") if hook]
    fastest_hook = min((medians[name] for name in hooks if name in medians), default=None)
    notes = dict(failed, **{FLOOR: FLOOR_NOTE})
    os.makedirs(args.out, exist_ok=True)
    rows = []
    print(
        f"[hpcdl rank 0] {size} ranks, MLP {args.layers}x{args.hidden} ({params / 1e6:.2f} M params, "
        f"{params * 4 / 1e6:.1f} MB of fp32 gradients), batch {args.batch}/rank; "
        + (
            f"accuracy on the digits after {args.train_steps} steps, mean of {args.seeds} seeds"
            if args.seeds
            else "no accuracy phase (--seeds 0)"
        )
        + f"; PowerSGD from step {POWERSGD_START_ITER}"
    )
    for name in ["ddp-gloo", *hooks, *(name for name in times if name.startswith("hpcdl-")), FLOOR]:
        median = medians.get(name)
        used = statistics.median(cpu[name]) if name in cpu else None
        rows.append(
            {
                "system": name,
                "ranks": size,
                "params": params,
                "batch_per_rank": args.batch,
                "median_step_ms": None if median is None else median * 1e3,
                "samples_per_s": rate(size * args.batch, median),
                "throughput_vs_ddp": ratio(ddp_median, median),
                "throughput_vs_fastest_hook": ratio(fastest_hook, median),
                "steps_timed": len(times.get(name, ())),
                "cpu_ms_per_step": None if used is None else used * 1e3,
                "kernel_cpu_ms_per_step_mean": statistics.mean(kernel[name]) * 1e3 if kernel.get(name) else None,
                "train_steps": args.train_steps if args.seeds else None,
                "acc_seeds": len(accuracy.get(name, ())),
                **accuracy_columns(accuracy.get(name, [])),
                "note": notes.get(name, ""),
                "load_avg_1min": os.getloadavg()[0],
                "stream_MBps": os.environ.get("HPCDL_BENCH_STREAM_MBPS", ""),
            }
        )
        r = rows[-1]
        print(
            f"[hpcdl rank 0] {name:17s} {show(r['median_step_ms'], '9.2f')} ms/step  "
            f"{show(r['samples_per_s'], '9.0f')} samples/s  {show(r['throughput_vs_ddp'], '5.2f')}x DDP  "
            f"{show(r['throughput_vs_fastest_hook'], '5.2f')}x fastest hook  "
            f"{show(r['cpu_ms_per_step'], '7.1f')} ms CPU/step/rank  test acc {show(r['test_acc'], '.4f')} "
            f"(sd {show(r['test_acc_sd'], '.4f')}, {r['acc_seeds']} seeds) "
            f"loss {show(r['test_loss'], '.4f')}  "
            f"{r['note']}"
        )
    write_csv(os.path.join(args.out, f"{args.tag}.csv"), rows)
    save_figure(os.path.join(args.out, f"{args.tag}.png"), lambda plt: draw(plt, rows, args.tag, size, params))


def draw(plt, rows, tag, size, params):
    fig, (speed, acc) = plt.subplots(1, 2, figsize=(11, 4.6))
    trained = [r["test_acc_min"] for r in rows if r["test_acc_min"] is not None]
    acc_floor = min(trained, default=0.5) - 0.05  # the seeds' spread is a point or two: show it
    families = {
        "ddp-gloo": ("DDP (gloo)", "tab:gray"),
        "ddp-": ("DDP + comm hook", "tab:orange"),
        "hpcdl-": ("hpcdl DistributedOptimizer", "tab:blue"),
        FLOOR: ("no gradient exchange (floor)", "tab:green"),
    }
    for ax, key, label, bottom in (
        (speed, "samples_per_s", "training throughput, samples/s (all ranks)", 0),
        (
            acc,
            "test_acc",
            f"held-out accuracy, {rows[0]['train_steps']} steps\n(mean; bars: min-max of the seeds)"
            if rows[0]["train_steps"]
            else "held-out accuracy: not trained (--seeds 0)",
            acc_floor,
        ),
    ):
        for i, row in enumerate(rows):
            family = next(f for prefix, f in families.items() if row["system"].startswith(prefix))
            value = row[key]
            ax.bar(i, value or 0, color=family[1], label=family[0])
            if key == "test_acc" and value is not None:
                low, high = row["test_acc_min"], row["test_acc_max"]
                ax.errorbar(i, value, yerr=[[value - low], [high - value]], color="black", capsize=4)
                ax.text(i, high, f"{value:.4f}", ha="center", va="bottom", fontsize=8)
            if value is None:  # not measured: say so instead of drawing a zero
                why = (
                    " not trained"
                    if row["system"] == FLOOR or (key == "test_acc" and not row["note"])
                    else " did not run"
                )
                ax.text(i, bottom, why, rotation=90, ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), [r["system"] for r in rows], rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(label, fontsize=9)
    acc.set_ylim(acc_floor, 1)
    handles = dict(zip(*reversed(speed.get_legend_handles_labels())))
    fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=4, fontsize=8)
    fig.suptitle(f"{tag}: {size} ranks, {params / 1e6:.1f} M-param MLP, CPU, PowerSGD from step {POWERSGD_START_ITER}")
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    return fig


if __name__ == "__main__":
    main()
