"""Pipeline-parallel training throughput: hpcdl.torch.Pipeline (GPipe, 1F1B) vs one
process vs torch.distributed.pipelining (ScheduleGPipe, Schedule1F1B over gloo).

    python bench/pipeline.py --ranks 2 --hidden 1024 --layers 16 --batch 4096 --micro-batches 16 \
        --steps 3 --runs 3 --tag pipeline-2stages-heavy
    python bench/pipeline.py --hidden 512 --batch 64 --steps 3 --runs 3 --tag pipeline-small
    bench/netcluster.sh --hosts 4 --cpus 0.45 run -- python bench/pipeline.py --netns --model --ranks 4 \
        --hidden 1024 --layers 16 --batch 4096 --micro-batches 16 --steps 3 --runs 3 --tag pipeline-4hosts-own-cores

One host, --ranks ranks (default 4), one thread each (--netns: rank r in emulated
host hn{r}, under bench/netcluster.sh --hosts P run --, hpcdl's MPICH and
torch's gloo both over the rate-limited links, the single process in hn0; with
netcluster's --cpus C each host's processes share C cores of their own, so 4
hosts of 0.5 cores on 2 cores run as a cluster rather than 4 ranks taking turns
on 2 cores); the same MLP (a stack of
Linear(hidden, hidden)+ReLU blocks, compute-heavy per layer), the same data and
SGD step everywhere, M = --micro-batches (default 4P) micro-batches per step.
Every system runs in its own child process with a timeout (--timeout): one that
hangs or fails is reported as "did not complete" and the others still run.
--runs rounds each start every system once, in turn (so machine noise hits them
alike), for a warm-up step and --steps timed steps; the figure is the median
samples/s of the rounds. Also reported: hpcdl's measured
bubble (the share of a timed step a stage waits for others, mean over stages),
its schedule bubble (the same --steps steps again, each apart after a barrier:
a stage's idle share of the slowest stage's train_step, without the optimizer
steps and the drift between steps) beside the theoretical (P-1)/(M+P-1), and
the peak activation memory per stage
(bytes of activations autograd saved, measured) of 1F1B and GPipe, and every
system's CPU seconds per sample, all its ranks and threads together (hpcdl's
engine, gloo's threads) in the timed steps: what it costs where ranks share
cores.
Writes TAG.csv, TAG-memory.csv and TAG.png under --out; prints a table (--replot:
only redraws TAG.png from the two CSVs).

--model: every round also measures the schedule model's inputs just before and
just after hpcdl's run (averaged; each stage's
forward, backward and optimizer seconds on one micro-batch, in one process;
the link's alpha and beta on 2 ranks; bench/pipeline_model.py) and
the CSV gets the model's samples/s and bubble for hpcdl's schedules beside the
measured ones (median of the rounds' predictions). The stages share
min(P, cores, P x share) cores, share being the part of a core a rank gets
(other users' jobs take the rest), measured two ways: by P ranks spinning
together beside the run (predicted_*), and as the ranks got it while they
had work during the run, CPU time over the time not spent waiting
(predicted_*_run_share); --model-cores sets the cores instead. A third
prediction (predicted_*_inrun) takes each stage's CPU per forward, backward and
step as the pipeline itself spent it during the timed steps
(Pipeline.last_step_times(): the layers, posting and sending, without polling),
with the run's share: it tells the schedule's own error apart from the error
of timing the stages outside the pipeline. For
`python bench/pipeline_model.py validate`.
"""

import argparse
import csv
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

import pipeline_model  # bench/pipeline_model.py, beside this script

SCHEDULES = ("gpipe", "1f1b")
RESULT = "RESULT "
# the model's predictions: column suffix -> where the stage times and cores come from
MODEL_VARIANTS = {
    "": "stage times and share measured apart",
    "_run": "stage times measured apart, share the ranks got in the run",
    "_inrun": "stage CPU as the pipeline spent it, share the ranks got in the run",
}


def make_model(hidden, layers, classes=10):
    import torch

    torch.manual_seed(0)
    body = []
    for _ in range(layers):
        body += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*body, torch.nn.Linear(hidden, classes))


def make_batch(args):
    import torch

    g = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.hidden, generator=g), torch.randint(0, 10, (args.batch,), generator=g)


def timed_runs(args, step, barrier=lambda: None):
    """samples/s of each of args.runs runs of args.steps steps, after one warm-up step, and this
    process's CPU seconds per sample over them (all its threads: the library's own included; the
    barriers left out, MPICH's spins)."""
    step()
    rates, cpu = [], 0.0
    for _ in range(args.runs):
        barrier()
        start, start_cpu = time.perf_counter(), time.process_time()
        for _ in range(args.steps):
            step()
        cpu += time.process_time() - start_cpu
        barrier()
        rates.append(args.steps * args.batch / (time.perf_counter() - start))
    return rates, cpu / (args.runs * args.steps * args.batch)


# --------------------------------------------------------------------------- workers (child processes)


def worker_single(args):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    model = make_model(args.hidden, args.layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = make_batch(args)

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    rates, cpu = timed_runs(args, step)
    print(RESULT + json.dumps({"system": "single process", "rates": rates, "cpu_per_sample": cpu}), flush=True)


def worker_hpcdl(args):
    import torch
    import torch.nn.functional as F
    from mpi4py import MPI

    import hpcdl.torch

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    x, y = make_batch(args)
    model = make_model(args.hidden, args.layers)  # the model's inputs time its stages (--model)
    rows = args.batch // args.micro_batches
    pipes = {
        s: hpcdl.torch.Pipeline(make_model(args.hidden, args.layers), F.cross_entropy, args.micro_batches, schedule=s)
        for s in SCHEDULES
    }
    results = {}
    for schedule, pipe in pipes.items():
        opt = torch.optim.SGD(pipe.parameters(), lr=0.01)
        bubbles, waited, action_cpu = [], [], {"forward": [], "backward": [], "optimizer": []}

        def step():
            cpu = time.thread_time()
            opt.zero_grad()
            fixed = time.thread_time() - cpu
            pipe.train_step(x, y)
            cpu = time.thread_time()
            opt.step()
            fixed += time.thread_time() - cpu
            times = pipe.last_step_times()
            bubbles.append(times["waited_s"] / times["step_s"])
            waited.append(times["waited_s"])
            action_cpu["forward"] += times["forward_cpu_s"]
            action_cpu["backward"] += times["backward_cpu_s"]
            action_cpu["optimizer"].append(fixed + times["other_cpu_s"])

        if args.model:  # the model's inputs just before and after the timed runs, averaged: the load drifts
            before = pipeline_model.measure_inputs(comm, model, pipe.starts, x[:rows], y[:rows], args.micro_batches)
        cpu, wall = time.process_time(), time.perf_counter()
        rates, cpu_per_sample = timed_runs(args, step, comm.Barrier)
        cpu_per_sample = comm.reduce(cpu_per_sample, root=0)  # the P ranks' CPU per sample
        # the part of a core this rank got while it had work (not waiting for another stage)
        run_share = comm.gather(
            (time.process_time() - cpu) / max(1e-9, time.perf_counter() - wall - sum(waited)), root=0
        )
        if args.model:
            after = pipeline_model.measure_inputs(comm, model, pipe.starts, x[:rows], y[:rows], args.micro_batches)
        # the stage's CPU per action as the pipeline ran it (the warm-up step left out)
        in_run = comm.gather(
            {
                key: statistics.median(values[len(values) // (args.runs * args.steps + 1) :])
                for key, values in action_cpu.items()
            },
            root=0,
        )
        stats = comm.gather(pipe.activation_stats(), root=0)
        bubble = comm.gather(statistics.median(bubbles[1:]), root=0)
        schedule_bubble = comm.gather(schedule_bubbles(comm, pipe, opt, x, y, args.steps), root=0)
        if comm.Get_rank() == 0:
            if args.model:
                results[schedule + " model"] = dict(
                    mean_inputs(before, after),
                    system="model inputs",
                    schedule=schedule,
                    run_share=min(1.0, statistics.median(run_share)),
                    in_run={key: [stage[key] for stage in in_run] for key in ("forward", "backward", "optimizer")},
                )
            results[schedule] = {
                "system": f"hpcdl {schedule}",
                "rates": rates,
                "cpu_per_sample": cpu_per_sample,
                "bubble": statistics.mean(bubble),
                "schedule_bubble": statistics.mean(schedule_bubble),
                "peak_bytes": [s["peak_bytes"] for s in stats],
                "peak_micro_batches": [s["peak_micro_batches"] for s in stats],
            }
    if comm.Get_rank() == 0:
        for result in results.values():
            print(RESULT + json.dumps(result), flush=True)


def schedule_bubbles(comm, pipe, opt, x, y, steps):
    """This stage's median over ``steps`` steps of the share of the schedule's time it waits.

    The steps are apart (a barrier before each), so what is measured is the
    schedule's own bubble: a stage's idle share of the pipeline's train_step
    (the slowest stage's, barrier to barrier), without the optimizer steps and
    the drift between steps that the timed steps' bubble also counts. This is
    what (P-1)/(M+P-1) describes."""
    from mpi4py import MPI

    shares = []
    for _ in range(steps):
        opt.zero_grad()
        comm.Barrier()
        start = time.perf_counter()
        pipe.train_step(x, y)
        span = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
        times = pipe.last_step_times()
        shares.append(1 - (times["step_s"] - times["waited_s"]) / span)
        opt.step()
    return statistics.median(shares)


def worker_torch(args):
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from hpcdl.pipeline import balanced_split

    torch.set_num_threads(1)
    rank, size = args.rank, args.ranks
    dist.init_process_group("gloo", rank=rank, world_size=size)
    model = make_model(args.hidden, args.layers)
    starts = balanced_split([sum(p.numel() for p in m.parameters()) for m in model], size) + [len(model)]
    stage_module = model[starts[rank] : starts[rank + 1]]  # hpcdl's "params" cut: the same stages
    stage = PipelineStage(stage_module, rank, size, torch.device("cpu"))
    kind = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[args.schedule]
    schedule = kind(stage, args.micro_batches, loss_fn=F.cross_entropy)
    opt = torch.optim.SGD(stage_module.parameters(), lr=0.01)
    x, y = make_batch(args)

    def step():
        opt.zero_grad()
        if rank == 0:
            schedule.step(x)
        elif rank == size - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()

    rates, cpu_per_sample = timed_runs(args, step, dist.barrier)
    cpu = torch.tensor([cpu_per_sample], dtype=torch.float64)
    dist.reduce(cpu, dst=0)  # the P ranks' CPU per sample
    if rank == 0:
        print(
            RESULT
            + json.dumps(
                {
                    "system": f"torch.distributed.pipelining {args.schedule}",
                    "rates": rates,
                    "cpu_per_sample": cpu.item(),
                }
            ),
            flush=True,
        )
    dist.destroy_process_group()


# --------------------------------------------------------------------------- the driver


def child_argv(args, worker, **extra):
    keep = [
        "--hidden",
        args.hidden,
        "--layers",
        args.layers,
        "--batch",
        args.batch,
        "--micro-batches",
        args.micro_batches,
        "--steps",
        args.steps,
        "--runs",
        1,
        "--ranks",
        args.ranks,
        "--worker",
        worker,
    ]
    for key, value in extra.items():
        keep += [f"--{key}", value]
    keep += ["--model"] if args.model and worker == "hpcdl" else []
    return [sys.executable, os.path.abspath(__file__)] + [str(a) for a in keep]


def run_children(argvs, timeout, env=None):
    """Start the processes, each in its own session; their RESULT lines, or the reason
    none came (timeout: every process group killed)."""
    procs = [
        subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, env=env
        )
        for argv in argvs
    ]
    deadline = time.monotonic() + timeout
    outputs, failure = [], None
    for proc in procs:
        try:
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
            if proc.returncode != 0 and failure is None:
                failure = f"exit {proc.returncode}: {err.strip().splitlines()[-1] if err.strip() else ''}"
        except subprocess.TimeoutExpired:
            failure = f"did not complete in {timeout:.0f} s"
            break
    if failure and failure.startswith("did not complete"):
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    results = [
        json.loads(line[len(RESULT) :]) for out in outputs for line in out.splitlines() if line.startswith(RESULT)
    ]
    return results, failure


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mean_inputs(a, b):
    """The element-wise mean of two measurements of the model's inputs."""
    return {
        key: [(x + y) / 2 for x, y in zip(value, b[key])] if isinstance(value, list) else (value + b[key]) / 2
        for key, value in a.items()
    }


def run_round(args, env):
    """One timed run of every system, each in its own child: its result, or why none came."""
    p, rows = args.ranks, []
    # --netns: bench/netns-exec.sh moves rank r (PMI_RANK) into emulated host hn{r} (with its cores, if
    # bench/netcluster.sh --cpus limits them) and points MPICH and gloo at its eth0 (and gloo's master at hn0);
    # the single process runs in hn0, on one host's cores
    netns_exec = os.path.join(os.path.dirname(os.path.abspath(__file__)), "netns-exec.sh")
    into_host = [netns_exec] if args.netns else []  # mpiexec sets PMI_RANK itself

    def in_host(rank):  # the prefix that starts a process in host hn{rank} (none without --netns)
        return ["env", f"PMI_RANK={rank}", netns_exec] if args.netns else []

    got, why = run_children([in_host(0) + child_argv(args, "single")], args.timeout, env)
    rows += got or [{"system": "single process", "failure": why}]
    got, why = run_children([[args.mpiexec, "-n", str(p)] + into_host + child_argv(args, "hpcdl")], args.timeout, env)
    rows += got or [{"system": f"hpcdl {s}", "failure": why} for s in SCHEDULES]
    for schedule in () if args.no_torch else SCHEDULES:
        tenv = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        argvs = [in_host(r) + child_argv(args, "torch", schedule=schedule, rank=r) for r in range(p)]
        got, why = run_children(argvs, args.timeout, tenv)
        rows += got or [{"system": f"torch.distributed.pipelining {schedule}", "failure": why}]
    return rows


def drive(args):
    p, m = args.ranks, args.micro_batches
    env = dict(os.environ, OMP_NUM_THREADS="1")
    merged, predictions, inputs = {}, {}, []
    model_cores = {}
    net_cpus = os.environ.get("HPCDL_NET_CPUS") if args.netns else None  # bench/netcluster.sh --cpus
    host_cpus = min(1.0, float(net_cpus or 1))  # the most of a core a stage gets: one thread each
    for round_ in range(args.runs):  # systems interleaved, so machine noise hits them alike
        print(f"[bench] round {round_ + 1} of {args.runs}", file=sys.stderr, flush=True)
        for row in run_round(args, env):
            if row["system"] == "model inputs":
                inputs.append(row)
                # the cores the stages get: P ranks' share of a core each (measured apart, by spinning
                # together; and as the ranks got it during the run), at most a core per rank, or the
                # emulated host's cores (bench/netcluster.sh --cpus), which also cap each stage's speed
                for kind in MODEL_VARIANTS:
                    share = row["cpu_share"] if kind == "" else row["run_share"]
                    cores = args.model_cores or min(p * host_cpus, os.cpu_count(), p * share)
                    model_cores.setdefault(kind, []).append(cores)
                    given = dict(row, **row["in_run"]) if kind == "_inrun" else row
                    out = pipeline_model.predict(
                        row["schedule"], given, m, cores, args.batch, args.steps, speed=host_cpus
                    )
                    predictions.setdefault((f"hpcdl {row['schedule']}", kind), []).append(out)
                continue
            into = merged.setdefault(
                row["system"],
                {"system": row["system"], "rates": [], "bubbles": [], "schedule_bubbles": [], "cpu_per_samples": []},
            )
            if "failure" in row:
                into["failure"] = row["failure"]
                continue
            into["rates"] += row["rates"]
            into["cpu_per_samples"].append(row["cpu_per_sample"])
            into["bubbles"] += [row["bubble"]] if "bubble" in row else []
            into["schedule_bubbles"] += [row["schedule_bubble"]] if "schedule_bubble" in row else []
            into.update({k: row[k] for k in ("peak_bytes", "peak_micro_batches") if k in row})
    rows = list(merged.values())
    for r in rows:
        for key in ("bubble", "schedule_bubble", "cpu_per_sample"):
            values = r.pop(key + "s")
            if values:
                r[key] = statistics.median(values)
        if "failure" in r:
            del r["rates"]
    single = next(
        (statistics.median(r["rates"]) for r in rows if r["system"] == "single process" and "rates" in r), None
    )
    theory = (p - 1) / (m + p - 1)
    load = os.getloadavg()[0]
    stream = os.environ.get("HPCDL_BENCH_STREAM_MBPS")
    stream = f"{float(stream):.1f} MB/s" if stream else "not measured"
    network = (
        f"{p} emulated hosts{f' of {net_cpus} cores' if net_cpus else ''}, {os.environ.get('HPCDL_NET_RATE', '?')} "
        f"links (one TCP stream {stream}), "
        if args.netns
        else ""
    )
    conditions = (
        f"{network}{p} ranks on {os.cpu_count()} cores (load avg {load:.1f}), hidden {args.hidden}, "
        f"{args.layers} layers, batch {args.batch}, M={m}, median of {args.runs} interleaved runs x {args.steps} steps"
    )
    os.makedirs(args.out, exist_ok=True)
    base = os.path.join(args.out, args.tag)
    cores = {kind: statistics.median(c) for kind, c in model_cores.items()}
    for r in rows:
        for kind in cores:
            if (r["system"], kind) in predictions:
                outs = predictions[(r["system"], kind)]
                r["predicted" + kind] = statistics.median(x["samples_per_s"] for x in outs)
                r["predicted_bubble" + kind] = statistics.median(x["bubble"] for x in outs)
    with open(base + ".csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "system",
                "ranks",
                "micro_batches",
                "median_samples_per_s",
                "runs_samples_per_s",
                "vs_single_process",
                "measured_bubble",
                "theoretical_bubble",
                "schedule_bubble",
                "predicted_samples_per_s",
                "predicted_bubble",
                "model_cores",
                "predicted_samples_per_s_run_share",
                "predicted_bubble_run_share",
                "model_cores_run_share",
                "predicted_samples_per_s_inrun",
                "predicted_bubble_inrun",
                "model_cores_inrun",
                "cpu_ms_per_sample",
                "status",
                "conditions",
            ]
        )
        for r in rows:
            rate = statistics.median(r["rates"]) if "rates" in r else None
            ranks = 1 if r["system"] == "single process" else p
            w.writerow(
                [
                    r["system"],
                    ranks,
                    m if ranks > 1 else "",
                    "" if rate is None else f"{rate:.2f}",
                    " ".join(f"{x:.2f}" for x in r.get("rates", [])),
                    f"{rate / single:.3f}" if rate and single else "",
                    f"{r['bubble']:.3f}" if "bubble" in r else "",
                    f"{theory:.3f}" if ranks > 1 else "",
                    f"{r['schedule_bubble']:.3f}" if "schedule_bubble" in r else "",
                    *[
                        cell
                        for kind in MODEL_VARIANTS
                        for cell in (
                            (
                                f"{r['predicted' + kind]:.2f}",
                                f"{r['predicted_bubble' + kind]:.3f}",
                                f"{cores[kind]:.2f}",
                            )
                            if "predicted" + kind in r
                            else ("", "", "")
                        )
                    ],
                    f"{1e3 * r['cpu_per_sample']:.4f}" if "cpu_per_sample" in r else "",
                    r.get("failure", "ok"),
                    conditions,
                ]
            )
    if inputs:
        write_model_inputs(base + "-model-inputs.csv", inputs)
    with open(base + "-memory.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["schedule", "stage", "micro_batches", "peak_activation_bytes", "peak_micro_batches_held"])
        for r in rows:
            for stage, (nbytes, held) in enumerate(zip(r.get("peak_bytes", []), r.get("peak_micro_batches", []))):
                w.writerow([r["system"], stage, m, nbytes, held])
    plot(rows, base + ".png", conditions, p, m, single)
    print(
        f"{'system':36} {'samples/s':>10} {'vs 1 proc':>9} {'bubble':>7} {'sched.':>7} {'theory':>7} "
        f"{'CPU ms/sample':>13}  status"
    )
    for r in rows:
        rate = statistics.median(r["rates"]) if "rates" in r else None
        print(
            f"{r['system']:36} {rate or 0:10.1f} {(rate / single) if rate and single else 0:9.2f} "
            f"{r.get('bubble', float('nan')):7.3f} {r.get('schedule_bubble', float('nan')):7.3f} {theory:7.3f} "
            f"{1e3 * r.get('cpu_per_sample', float('nan')):13.3f}  {r.get('failure', 'ok')}"
        )
    for r in rows:
        for kind, what in MODEL_VARIANTS.items():
            if "predicted" + kind in r:
                rate = statistics.median(r["rates"]) if "rates" in r else None
                print(
                    f"{r['system']}: model {r['predicted' + kind]:.1f} samples/s (predicted/measured "
                    f"{r['predicted' + kind] / rate if rate else float('nan'):.2f}), bubble "
                    f"{r['predicted_bubble' + kind]:.3f}, {cores[kind]:.2f} cores ({what}, median of the rounds)"
                )
    for r in rows:
        if "peak_bytes" in r:
            print(
                f"{r['system']}: peak activation MiB per stage "
                f"{[round(b / 2**20, 2) for b in r['peak_bytes']]}, micro-batches held {r['peak_micro_batches']}"
            )
    print(conditions)
    print(f"wrote {base}.csv {base}-memory.csv {base}.png")


def write_model_inputs(path, inputs):
    """The model's inputs of every round: per stage forward, backward, optimizer seconds; link."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "round",
                "schedule",
                "stage",
                "forward_s",
                "backward_s",
                "optimizer_s",
                "message_bytes_out",
                "alpha_s",
                "beta_s_per_byte",
                "cpu_share",
                "run_share",
                "in_run_forward_s",
                "in_run_backward_s",
                "in_run_optimizer_s",
            ]
        )
        for i, x in enumerate(inputs):
            for s, (fw, bw, opt) in enumerate(zip(x["forward"], x["backward"], x["optimizer"])):
                out = int(x["message_bytes"][s]) if s < len(x["message_bytes"]) else ""
                w.writerow(
                    [
                        i // len(SCHEDULES),
                        x["schedule"],
                        s,
                        f"{fw:.6g}",
                        f"{bw:.6g}",
                        f"{opt:.6g}",
                        out,
                        f"{x['alpha']:.4g}",
                        f"{x['beta']:.4g}",
                        f"{x['cpu_share']:.3f}",
                        f"{x['run_share']:.3f}",
                        *[f"{x['in_run'][key][s]:.6g}" for key in ("forward", "backward", "optimizer")],
                    ]
                )


def plot(rows, path, conditions, p, m, single):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
    names = [r["system"] for r in rows]
    rates = [statistics.median(r["rates"]) if "rates" in r else 0 for r in rows]
    bars = left.bar(range(len(rows)), rates, color=["grey"] + ["tab:blue"] * (len(rows) - 1))
    for bar, r in zip(bars, rows):
        label = (
            "did not complete"
            if "failure" in r
            else (
                f"bubble {r['bubble']:.2f}"
                + (f"\n(schedule {r['schedule_bubble']:.2f})" if "schedule_bubble" in r else "")
                if "bubble" in r
                else ""
            )
        )
        left.annotate(
            label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=8
        )
    left.set_ylim(0, 1.2 * max(rates + [single or 0, 1]))  # room for the two-line labels
    if single:
        left.axhline(single, color="grey", linestyle="--", label="single process")
        left.legend(loc="lower left")
    left.set_xticks(
        range(len(rows)),
        [n.replace("torch.distributed.pipelining", "torch.pipelining") for n in names],
        rotation=20,
        ha="right",
        fontsize=8,
    )
    left.set_ylabel("samples/s (median of runs)")
    left.set_title(f"throughput, P={p} stages, M={m}; theoretical bubble {(p - 1) / (m + p - 1):.2f}")
    width = 0.4
    measured = [r for r in rows if "peak_bytes" in r]
    for i, r in enumerate(measured):
        stages = range(len(r["peak_bytes"]))
        right.bar(
            [s + (i - 0.5) * width for s in stages], [b / 2**20 for b in r["peak_bytes"]], width, label=r["system"]
        )
    right.set_xticks(range(p))
    right.set_xlabel("stage")
    right.set_ylabel("peak activation memory (MiB, measured)")
    right.set_title(f"activations held per stage, M={m}")
    if measured:
        right.legend()
    fig.suptitle(f"Pipeline parallelism: hpcdl vs torch.distributed.pipelining\n{conditions}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def replot(args):
    """Redraw TAG.png from TAG.csv and TAG-memory.csv (a run's figures, unchanged)."""
    base = os.path.join(args.out, args.tag)
    for path in (base + ".csv", base + "-memory.csv"):
        if not os.path.exists(path):
            raise SystemExit(f"bench/pipeline.py --replot: {path} does not exist (--out and --tag name a run)")
    with open(base + ".csv", newline="") as f:
        table = list(csv.DictReader(f))
    with open(base + "-memory.csv", newline="") as f:
        memory = list(csv.DictReader(f))
    rows = []
    for t in table:
        r = {"system": t["system"]}
        if t["status"] != "ok":
            r["failure"] = t["status"]
        if t["runs_samples_per_s"]:
            r["rates"] = [float(x) for x in t["runs_samples_per_s"].split()]
        for key, column in (("bubble", "measured_bubble"), ("schedule_bubble", "schedule_bubble")):
            if t.get(column):
                r[key] = float(t[column])
        stages = sorted(
            (int(x["stage"]), int(x["peak_activation_bytes"])) for x in memory if x["schedule"] == t["system"]
        )
        if stages:
            r["peak_bytes"] = [b for _, b in stages]
        rows.append(r)
    p = max(int(t["ranks"]) for t in table)
    m = next(int(t["micro_batches"]) for t in table if t["micro_batches"])
    single = next(
        (
            float(t["median_samples_per_s"])
            for t in table
            if t["system"] == "single process" and t["median_samples_per_s"]
        ),
        None,
    )
    plot(rows, base + ".png", table[0]["conditions"], p, m, single)
    print(f"wrote {base}.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4, help="pipeline stages (P), one rank each")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks")
    parser.add_argument("--batch", type=int, default=128, help="samples per step")
    parser.add_argument("--micro-batches", type=int, default=None, help="M (default 4P)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per run")
    parser.add_argument("--runs", type=int, default=3, help="rounds; each runs every system once, in turn")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per system before it is killed")
    parser.add_argument("--mpiexec", default="mpiexec")
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="pipeline")
    parser.add_argument("--no-torch", action="store_true", help="skip torch.distributed.pipelining")
    parser.add_argument(
        "--netns",
        action="store_true",
        help="rank r in emulated host hn{r}: run under bench/netcluster.sh --hosts >= --ranks run --",
    )
    parser.add_argument(
        "--model",
        action="store_true",
        help="also measure the schedule model's inputs and predict (bench/pipeline_model.py)",
    )
    parser.add_argument(
        "--model-cores",
        type=float,
        default=None,
        help="cores the model's stages share (default: measured, min(P, cores, P x CPU share))",
    )
    parser.add_argument("--replot", action="store_true", help="only redraw TAG.png from TAG.csv and TAG-memory.csv")
    parser.add_argument("--worker", choices=["single", "hpcdl", "torch"], help=argparse.SUPPRESS)
    parser.add_argument("--schedule", choices=SCHEDULES, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.micro_batches = args.micro_batches or 4 * args.ranks
    if args.runs < 1 or args.steps < 1:
        parser.error("--runs and --steps must be >= 1")
    if args.replot:
        return replot(args)
    if args.netns and args.worker is None and int(os.environ.get("HPCDL_NET_HOSTS") or 0) < args.ranks:
        parser.error(
            f"--netns needs {args.ranks} emulated hosts: run it under "
            f"bench/netcluster.sh --hosts {args.ranks} run -- (HPCDL_NET_HOSTS is "
            f"{os.environ.get('HPCDL_NET_HOSTS')!r})"
        )
    {"single": worker_single, "hpcdl": worker_hpcdl, "torch": worker_torch, None: drive}[args.worker](args)


if __name__ == "__main__":
    main()
