"""A schedule model of hpcdl's pipeline (hpcdl.torch.Pipeline), validated against
bench/pipeline.py runs, and its predictions for stages that each have a core.

The model is a discrete-event simulation of the exact action order the stages
run (hpcdl.pipeline.stage_actions, GPipe or 1F1B), step after step, given:

- per stage, the CPU seconds of one micro-batch's forward and backward and
  the fixed cost of a step (zero_grad, the optimizer step, allocating the
  gradients), measured in the stage's own process as the pipeline runs it,
  min(P, cores) stages at once so that every core is busy (stage_times,
  medians);
- the link: a message of n bytes arrives alpha + n x beta after its sender's
  action ends (measured through hpcdl.pipeline.Link from the send to the end
  of the receiver's wait, the receiver having waited while the sender
  computed, as in the pipeline; alpha and beta fit over 3 sizes);
- C cores shared by the P stages: the stages that have work ready share them
  as a processor-sharing pool, each running at min(speed, C / ready) speed
  (C = P: a core per stage; waiting stages poll with a sleep, using none).
  On a machine shared with other jobs C = P x the part of a core each of P
  ranks gets while all compute (measured), at most the cores. speed is 1,
  or the cores of each emulated host (bench/netcluster.sh --cpus: a stage
  never runs faster than its host's CPU quota, however many others wait).

A forward needs its micro-batch's activation from the previous stage, a
backward its gradient from the next; each stage runs its actions in order and
steps its optimizer after its last one. Out come the time of the steps,
samples/s, and the bubble as bench/pipeline.py measures it: the share of a
stage's train_step spent waiting for another stage, mean over stages. With
equal stages, free links and C = P it is (P-1)/(M+P-1) for both schedules
(tests/unit/test_pipeline_model.py checks it).

    python bench/pipeline.py --ranks 2 ... --model       # the validation: measured and predicted in one run
    python bench/pipeline_model.py validate bench/results/pipeline-model-*.csv --out bench/results
    python bench/pipeline_model.py predict --stages 2 4 8 --repeats 5 --out bench/results
    mpiexec -n 4 python bench/pipeline_model.py inputs --micro-batches 16   # what predict starts per P
    mpiexec -n 2 python bench/pipeline_model.py link      # the link's alpha and beta alone
    mpiexec -n 2 python bench/pipeline_model.py wait      # engine CPU while a receive waits long, and alpha
"""

import argparse
import csv
import heapq
import json
import os
import statistics
import subprocess
import sys
import time

FORWARD, BACKWARD, OPTIMIZER = "F", "B", "O"
RESULT = "RESULT "
LINK_SIZES = (1 << 10, 1 << 16, 1 << 20)  # message sizes measured to fit alpha and beta


# --------------------------------------------------------------------------- the model


def simulate(
    schedule,
    forward,
    backward,
    message_bytes,
    micro_batches,
    cores,
    alpha=0.0,
    beta=0.0,
    optimizer=None,
    steps=1,
    speed=1.0,
):
    """Simulate ``steps`` pipeline steps from a common start (a barrier).

    forward, backward: seconds per micro-batch of each of the P stages (the last
    stage's include the loss); optimizer: seconds of each stage's zero_grad +
    step (default 0); message_bytes: bytes crossing each of the P - 1 stage
    boundaries per micro-batch (activation forward, gradient backward alike);
    cores: the cores the stages share; speed: the most of a core one stage
    gets (its host's CPU quota).

    Returns {"seconds": the steps' wall time, "step_s": seconds per step,
    "bubble": mean over stages of the median over steps of waited / train_step
    seconds, "waited": per stage, "peak_in_flight": per stage, the most
    micro-batches forwarded but not yet backwarded}.
    """
    from hpcdl.pipeline import stage_actions

    p = len(forward)
    if len(backward) != p or len(message_bytes) != p - 1:
        raise ValueError(f"{p} stages need {p} backward times and {p - 1} message sizes")
    if cores <= 0 or speed <= 0:
        raise ValueError(f"cores and speed must be > 0, got {cores} and {speed}")
    optimizer = optimizer or [0.0] * p
    plans = []
    for s in range(p):
        plan = []
        for step in range(steps):
            plan += [(kind, mb, step) for kind, mb in stage_actions(schedule, p, s, micro_batches)]
            plan.append((OPTIMIZER, None, step))
        plans.append(plan)
    work = {FORWARD: forward, BACKWARD: backward, OPTIMIZER: optimizer}

    def needs(s, action):
        """The message (kind, micro-batch, step, to stage) the action waits for, or None."""
        kind, mb, step = action
        if kind == FORWARD and s > 0 or kind == BACKWARD and s < p - 1:
            return kind, mb, step, s
        return None

    arrived = {}  # message -> arrival time
    in_transit = []  # heap of (arrival time, message)
    position = [0] * p
    remaining = [None] * p  # seconds of work left in the current action once it can run
    blocked_since = [0.0] * p
    step_start = [0.0] * p
    waited_in_step = [0.0] * p
    shares = [[] for _ in range(p)]  # per stage: waited / train_step seconds of each step
    waited = [0.0] * p
    held, peak = [0] * p, [0] * p
    now = 0.0

    def try_start(s):
        if position[s] >= len(plans[s]) or remaining[s] is not None:
            return
        action = plans[s][position[s]]
        message = needs(s, action)
        if message is not None and message not in arrived:
            return
        if message is not None:
            wait = max(0.0, now - blocked_since[s])
            waited[s] += wait
            waited_in_step[s] += wait
        remaining[s] = work[action[0]][s]

    for s in range(p):
        try_start(s)
    while True:
        running = [s for s in range(p) if remaining[s] is not None]
        if not running and not in_transit:
            break
        rate = min(speed, cores / len(running)) if running else 0.0
        next_end = min((remaining[s] / rate for s in running), default=float("inf"))
        next_arrival = in_transit[0][0] - now if in_transit else float("inf")
        dt = max(0.0, min(next_end, next_arrival))
        now += dt
        for s in running:
            remaining[s] -= dt * rate
        while in_transit and in_transit[0][0] <= now:
            _, message = heapq.heappop(in_transit)
            arrived[message] = now
        for s in running:
            if remaining[s] > 1e-12 * max(1.0, now):
                continue
            kind, mb, step = plans[s][position[s]]
            remaining[s] = None
            position[s] += 1
            if kind == FORWARD:
                held[s] += 1
                peak[s] = max(peak[s], held[s])
                if s < p - 1:
                    heapq.heappush(in_transit, (now + alpha + message_bytes[s] * beta, (FORWARD, mb, step, s + 1)))
            elif kind == BACKWARD:
                held[s] -= 1
                if s > 0:
                    heapq.heappush(in_transit, (now + alpha + message_bytes[s - 1] * beta, (BACKWARD, mb, step, s - 1)))
            if position[s] < len(plans[s]) and plans[s][position[s]][0] == OPTIMIZER:
                duration = now - step_start[s]  # train_step's own seconds, as Pipeline reports them
                shares[s].append(waited_in_step[s] / duration if duration > 0 else 0.0)
            elif kind == OPTIMIZER:
                step_start[s], waited_in_step[s] = now, 0.0
            blocked_since[s] = now
        for s in range(p):
            try_start(s)
    if any(position[s] < len(plans[s]) for s in range(p)):
        raise RuntimeError("the schedule deadlocked in the model")  # never for stage_actions' schedules
    return {
        "seconds": now,
        "step_s": now / steps,
        "waited": waited,
        "peak_in_flight": peak,
        "bubble": statistics.mean(statistics.median(x) for x in shares),
    }


def predict(schedule, inputs, micro_batches, cores, batch, steps=1, speed=1.0):
    """simulate() on a dict of measured inputs (stage_times() + the link's alpha and beta):
    {"step_s", "samples_per_s", "bubble", ...}."""
    out = simulate(
        schedule,
        inputs["forward"],
        inputs["backward"],
        inputs["message_bytes"],
        micro_batches,
        cores,
        inputs.get("alpha", 0.0),
        inputs.get("beta", 0.0),
        inputs.get("optimizer"),
        steps,
        speed,
    )
    out["samples_per_s"] = steps * batch / out["seconds"]
    return out


def fit_link(points):
    """alpha (s) and beta (s per byte) from [(bytes, one-way seconds)] by least squares."""
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    beta = sum((b - mx) * (t - my) for b, t in points) / sxx if sxx else 0.0
    beta = max(beta, 0.0)
    return max(my - beta * mx, 0.0), beta


# --------------------------------------------------------------------------- the model's inputs, measured


def stage_times(model, starts, micro_batch, targets, micro_batches, steps=3, only=None):
    """Each stage's CPU seconds (this thread's: the work, not the time other processes
    held the core, which the model's cores account for), one thread, in this process,
    run as the pipeline runs it: per
    step zero_grad, M forwards and backwards of one micro-batch (input requiring grad
    beyond stage 0; the last stage's with the loss / M; gradients accumulate), SGD step.
    forward, backward: medians over the micro-batches; optimizer: per step, the median of
    zero_grad + step + what the step's first backward took beyond the median (it
    allocates the .grad tensors); message_bytes: the bytes leaving each stage but the last.
    only: time that stage alone (the others' lists hold None), the input still made by the
    stages before it."""
    import torch
    import torch.nn.functional as F

    ends = list(starts[1:]) + [len(model)]
    forward, backward, optimizer, message_bytes = [], [], [], []
    x = micro_batch
    for s, (first, end) in enumerate(zip(starts, ends)):
        module = model[first:end]
        last = s == len(starts) - 1
        params = list(module.parameters())
        opt = torch.optim.SGD(params, lr=0.01) if params else None
        f_runs, b_runs, fixed = [], [], []
        for step in range(steps + 1 if only in (None, s) else 0):  # the first is a warm-up
            start = time.thread_time()
            if opt is not None:
                opt.zero_grad()
            per_step = time.thread_time() - start
            f_step, b_step = [], []
            for _ in range(micro_batches):
                inp = x.detach().requires_grad_(s > 0)
                start = time.thread_time()
                out = module(inp)
                if last:
                    out = F.cross_entropy(out, targets) / micro_batches
                mid = time.thread_time()
                out.backward(None if last else torch.ones_like(out))
                f_step.append(mid - start)
                b_step.append(time.thread_time() - mid)
            start = time.thread_time()
            if opt is not None:
                opt.step()
            per_step += time.thread_time() - start
            if step:
                f_runs += f_step
                b_runs += b_step
                fixed.append(per_step + b_step[0] - statistics.median(b_step))
        forward.append(statistics.median(f_runs) if f_runs else None)
        backward.append(statistics.median(b_runs) if b_runs else None)
        optimizer.append(max(0.0, statistics.median(fixed)) if fixed else None)
        with torch.no_grad():
            x = module(x.detach())
        if not last:
            message_bytes.append(x.numel() * x.element_size())
    return {"forward": forward, "backward": backward, "optimizer": optimizer, "message_bytes": message_bytes}


def idle_barrier(comm):
    """A barrier whose waiting ranks sleep, leaving the cores to the ranks still working."""
    done = comm.Ibarrier()
    while not done.Test():
        time.sleep(1e-3)


def link_times(comm, sizes=LINK_SIZES, repeats=20, busy_s=3e-3):
    """On ranks 0 and 1 of comm (collective over comm): seconds from Link.send to the end
    of the receiver's Link.wait per size, as in the pipeline: the receiver has been waiting
    (polling with its backoff sleep) while the sender computed (a busy loop of busy_s).
    One clock: one host. Rank 0 returns {"alpha", "beta", "points"}, the others None."""
    import numpy as np
    from mpi4py import MPI

    from hpcdl.pipeline import Link

    rank = comm.Get_rank()
    pair = comm.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    points = []
    if pair != MPI.COMM_NULL:
        link = Link(pair)
        for size in sizes:
            buffer = np.zeros(size, dtype=np.uint8)
            one_way = []
            for i in range(repeats + 2):
                sender = i % 2  # both directions alike
                pair.Barrier()
                if rank == sender:
                    until = time.perf_counter() + busy_s
                    while time.perf_counter() < until:
                        pass
                    sent_at = time.perf_counter()
                    link.wait(link.send(buffer, 1 - rank, 4), 1 - rank, "the probe")
                    pair.send(sent_at, dest=1 - rank, tag=6)
                else:
                    link.wait(link.recv(buffer, 1 - rank, 4), 1 - rank, "the probe")
                    done_at = time.perf_counter()
                    one_way.append(done_at - pair.recv(source=1 - rank, tag=6))
            both = pair.gather(one_way[2:], root=0)
            if rank == 0:
                points.append((size, statistics.median(both[0] + both[1])))
        link.close()
        pair.Free()
    idle_barrier(comm)
    if rank != 0:
        return None
    alpha, beta = fit_link(points)
    return {"alpha": alpha, "beta": beta, "points": points}


def engine_cpu_seconds():
    """CPU seconds of this process's hpcdl-engine thread so far (Linux /proc: schedstat's
    nanoseconds where the kernel keeps them, else stat's user + system clock ticks)."""
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() != "hpcdl-engine":
                continue
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                return int(f.read().split()[0]) * 1e-9
        except OSError:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    return None


def wait_costs(comm, wait_s=2.0, rounds=5):
    """On ranks 0 and 1 of comm (collective over comm): the receiver (rank 1) posts a
    1 KiB receive and blocks in the handle's wait() (no Python polling) while the sender
    sleeps wait_s before sending; per round, the receiver's engine thread CPU over the
    wait (share of a core) and the message's delay from its send to the receiver's
    wake-up. Then, in the same run, the link's alpha for a message that arrives soon
    (link_times, 1 KiB, the receiver waiting 3 ms). Rank 0 returns medians, the others None."""
    import numpy as np
    from mpi4py import MPI

    from hpcdl.pipeline import Link

    rank = comm.Get_rank()
    pair = comm.Split(0 if rank < 2 else MPI.UNDEFINED, rank)
    shares, delays = [], []
    if pair != MPI.COMM_NULL:
        link = Link(pair)
        buffer = np.zeros(1024, dtype=np.uint8)
        link.wait(
            link.send(buffer, 1, 4) if rank == 0 else link.recv(buffer, 0, 4), 1 - rank, "the probe"
        )  # starts the engine
        for _ in range(rounds):
            pair.Barrier()
            if rank == 0:
                time.sleep(wait_s)
                pair.send(time.perf_counter(), dest=1, tag=6)
                link.wait(link.send(buffer, 1, 4), 1, "the probe")
            else:
                cpu0, t0 = engine_cpu_seconds(), time.perf_counter()
                link.recv(buffer, 0, 4).wait()
                done_at = time.perf_counter()
                shares.append((engine_cpu_seconds() - cpu0) / (done_at - t0))
                delays.append(done_at - pair.recv(source=0, tag=6))
        link.close()
        found = pair.gather((shares, delays), root=0)
        pair.Free()
        if rank == 0:
            shares, delays = found[1]
    link = link_times(comm, sizes=(1024,))
    if rank != 0:
        return None
    return {
        "wait_s": wait_s,
        "rounds": rounds,
        "engine_cpu_share": statistics.median(shares),
        "late_message_delay_s": statistics.median(delays),
        "alpha_1KiB_s": link["points"][0][1],
    }


def measure_inputs(comm, model, starts, micro_batch, targets, micro_batches, cores=None):
    """The model's inputs, measured on the P ranks of comm (collective): each rank times its
    stage (stage_times), C = min(P, cores) ranks at once while the others sleep, so that
    every core is busy as in the pipeline's steady state (cores sharing memory bandwidth
    and caches run slower than one alone) yet no two stages share a core; then the part
    of a core each rank gets while all compute (cost_model.cpu_share, median of 3); then
    the link (link_times). Rank 0 returns the inputs' dict, the others None."""
    from cost_model import cpu_share  # a neighbour: bench/ is a script's sys.path[0]

    rank, size = comm.Get_rank(), comm.Get_size()
    at_once = max(1, min(size, cores or os.cpu_count()))
    mine = None
    for group in range(0, size, at_once):
        if group <= rank < group + at_once:
            mine = stage_times(model, starts, micro_batch, targets, micro_batches, only=rank)
        idle_barrier(comm)
    share = statistics.median(cpu_share(comm, 0.3) for _ in range(3))
    link = link_times(comm) if size > 1 else {"alpha": 0.0, "beta": 0.0, "points": []}
    parts = comm.gather(mine, root=0)
    if rank != 0:
        return None
    inputs = {key: [part[key][s] for s, part in enumerate(parts)] for key in ("forward", "backward", "optimizer")}
    return dict(
        inputs, message_bytes=parts[0]["message_bytes"], cpu_share=share, alpha=link["alpha"], beta=link["beta"]
    )


def inputs_worker(args):
    """Under mpiexec -n P: the model's inputs for the bench's MLP cut into P stages
    (measure_inputs), printed by rank 0."""
    import torch
    from mpi4py import MPI

    from hpcdl.pipeline import balanced_split

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    import pipeline as bench  # bench/pipeline.py, a neighbour

    model = bench.make_model(args.hidden, args.layers)
    starts = balanced_split([sum(q.numel() for q in layer.parameters()) for layer in model], comm.Get_size())
    rows = args.batch // args.micro_batches
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(rows, args.hidden, generator=g), torch.randint(0, 10, (rows,), generator=g)
    out = measure_inputs(comm, model, starts, x, y, args.micro_batches)
    if out is not None:
        print(RESULT + json.dumps(out), flush=True)


def pair_worker(measure, what):
    """Under mpiexec -n 2: print measure(COMM_WORLD)'s result (rank 0's)."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() != 2:
        raise SystemExit(f"the {what} measurement runs on 2 ranks (mpiexec -n 2)")
    out = measure(MPI.COMM_WORLD)
    if out is not None:
        print(RESULT + json.dumps(out), flush=True)


def run_worker(argv, timeout=600):
    """The RESULT of a child job (argv: mpiexec ... this file SUBCOMMAND ...)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env)
    for line in done.stdout.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT) :])
    raise RuntimeError(f"{' '.join(argv[-8:])} gave no result (exit {done.returncode}): {done.stderr.strip()[-500:]}")


# --------------------------------------------------------------------------- subcommands


def cmd_validate(args):
    """One table from bench/pipeline.py --model runs: measured vs predicted per hpcdl schedule,
    with the cores measured apart and as the ranks got them in the run."""
    from hpcdl.measure import cell, ratio

    rows = []
    for path in args.csv:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                if not r.get("predicted_samples_per_s") or not r.get("median_samples_per_s"):
                    continue
                measured = float(r["median_samples_per_s"])
                run = r.get("predicted_samples_per_s_run_share")
                run = float(run) if run else None
                inrun = r.get("predicted_samples_per_s_inrun")
                inrun = float(inrun) if inrun else None
                rows.append(
                    {
                        "run": os.path.basename(path)[:-4],
                        "system": r["system"],
                        "stages": r["ranks"],
                        "micro_batches": r["micro_batches"],
                        "measured_samples_per_s": measured,
                        "measured_bubble": r["measured_bubble"],
                        "cores": r["model_cores"],
                        "predicted_samples_per_s": float(r["predicted_samples_per_s"]),
                        "predicted_over_measured": cell(ratio(float(r["predicted_samples_per_s"]), measured)),
                        "predicted_bubble": r["predicted_bubble"],
                        "cores_run_share": r.get("model_cores_run_share", ""),
                        "predicted_samples_per_s_run_share": cell(run),
                        "predicted_over_measured_run_share": cell(ratio(run, measured)),
                        "predicted_bubble_run_share": r.get("predicted_bubble_run_share", ""),
                        "predicted_samples_per_s_inrun": cell(inrun),
                        "predicted_over_measured_inrun": cell(ratio(inrun, measured)),
                        "predicted_bubble_inrun": r.get("predicted_bubble_inrun", ""),
                        "conditions": r["conditions"],
                    }
                )
    if not rows:
        raise SystemExit("no rows with a prediction: run bench/pipeline.py with --model")
    path = os.path.join(args.out, args.tag + ".csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(
        f"{'run':30} {'system':11} {'P':>2} {'M':>3} {'measured':>9} {'cores':>5} {'predicted':>9} {'ratio':>6} "
        f"{'cores':>5} {'pred(run)':>9} {'ratio':>6} {'pred(in)':>9} {'ratio':>6}  "
        "bubble measured/predicted/predicted(run)/predicted(in run)"
    )
    for r in rows:
        run, inrun = r["predicted_samples_per_s_run_share"], r["predicted_samples_per_s_inrun"]
        print(
            f"{r['run']:30} {r['system']:11} {r['stages']:>2} {r['micro_batches']:>3} "
            f"{r['measured_samples_per_s']:9.1f} {r['cores']:>5} {r['predicted_samples_per_s']:9.1f} "
            f"{r['predicted_over_measured']:6.2f} {r['cores_run_share']:>5} "
            f"{run if run == '' else format(run, '9.1f'):>9} "
            f"{'' if run == '' else format(r['predicted_over_measured_run_share'], '6.2f'):>6} "
            f"{'' if inrun == '' else format(inrun, '9.1f'):>9} "
            f"{'' if inrun == '' else format(r['predicted_over_measured_inrun'], '6.2f'):>6}  "
            f"{r['measured_bubble']}/{r['predicted_bubble']}/{r['predicted_bubble_run_share']}/"
            f"{r['predicted_bubble_inrun']}"
        )
    print(f"wrote {path}")


def cmd_predict(args):
    """P stages with a core each (cores = P), M = 4P, the bench's MLP. Its inputs measured
    by a child job of P ranks on this machine (measure_inputs: stage times with every core
    busy, the link), or with --one-process: stage times one after another in this process
    and the link as given (--alpha, --beta)."""
    import torch
    from pipeline import make_model  # bench/pipeline.py, a neighbour

    from hpcdl.measure import cell, rate, ratio, save_figure
    from hpcdl.pipeline import balanced_split, bubble_fraction

    torch.set_num_threads(1)
    if args.one_process and (args.alpha is None or args.beta is None):
        raise SystemExit("--one-process needs --alpha and --beta")
    model = make_model(args.hidden, args.layers)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(args.batch, args.hidden, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    loss_fn = torch.nn.functional.cross_entropy
    single = []
    for _ in range(args.repeats + 1):
        start = time.perf_counter()
        model.zero_grad()
        loss_fn(model(x), y).backward()
        single.append(time.perf_counter() - start)
    single_rate = rate(args.batch, statistics.median(single[1:]))
    rows = []
    for p in args.stages:
        m = args.micro_batches_per_stage * p
        if args.batch % m:
            raise SystemExit(f"M = {m} micro-batches do not divide the batch of {args.batch}")
        starts = balanced_split([sum(q.numel() for q in layer.parameters()) for layer in model], p)
        if args.one_process:
            inputs = stage_times(model, starts, x[: args.batch // m], y[: args.batch // m], m, args.repeats)
            source = "stage times one after another in one process; link given"
        else:
            inputs = run_worker(
                [
                    args.mpiexec,
                    "-n",
                    str(p),
                    sys.executable,
                    os.path.abspath(__file__),
                    "inputs",
                    "--hidden",
                    str(args.hidden),
                    "--layers",
                    str(args.layers),
                    "--batch",
                    str(args.batch),
                    "--micro-batches",
                    str(m),
                ]
            )
            source = f"stage times {min(p, os.cpu_count())} at once (every core busy), link measured, {p} ranks"
        if args.alpha is not None and args.beta is not None:
            inputs.update(alpha=args.alpha, beta=args.beta)
        link = {"alpha": inputs["alpha"], "beta": inputs["beta"], "source": source}
        for schedule in ("gpipe", "1f1b"):
            out = predict(schedule, inputs, m, p, args.batch, args.steps)
            rows.append(
                {
                    "system": f"hpcdl {schedule}",
                    "stages": p,
                    "cores": p,
                    "micro_batches": m,
                    "micro_batch_rows": args.batch // m,
                    "predicted_samples_per_s": out["samples_per_s"],
                    "single_process_samples_per_s": cell(single_rate),
                    "vs_single_process": cell(ratio(out["samples_per_s"], single_rate)),
                    "predicted_bubble": out["bubble"],
                    "theoretical_bubble": bubble_fraction(p, m),
                    "stage_forward_backward_s": " ".join(
                        f"{f + b:.6f}" for f, b in zip(inputs["forward"], inputs["backward"])
                    ),
                    "alpha_s": link["alpha"],
                    "beta_s_per_byte": link["beta"],
                    "conditions": f"hidden {args.hidden}, {args.layers} layers, batch {args.batch}, "
                    f"{args.steps} steps; measured on {os.cpu_count()} cores (load avg "
                    f"{os.getloadavg()[0]:.1f}): {link['source']}",
                }
            )
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.tag)
    with open(stem + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"{'system':12} {'P':>2} {'M':>3} {'rows':>4} {'samples/s':>10} {'vs 1 proc':>9} {'bubble':>7} {'theory':>7}")
    for r in rows:
        print(
            f"{r['system']:12} {r['stages']:>2} {r['micro_batches']:>3} {r['micro_batch_rows']:>4} "
            f"{r['predicted_samples_per_s']:10.1f} {r['vs_single_process']:9.2f} {r['predicted_bubble']:7.3f} "
            f"{r['theoretical_bubble']:7.3f}"
        )
    print(
        f"single process {single_rate:.1f} samples/s (measured); alpha {rows[-1]['alpha_s'] * 1e6:.1f} us, "
        f"1/beta {1 / rows[-1]['beta_s_per_byte'] / 1e9 if rows[-1]['beta_s_per_byte'] else float('inf'):.2f} GB/s"
    )
    save_figure(stem + ".png", lambda plt: draw_prediction(plt, rows, single_rate, rows[0]["conditions"]))
    print(f"wrote {stem}.csv {stem}.png")


def draw_prediction(plt, rows, single_rate, conditions):
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    stages = sorted({r["stages"] for r in rows})
    width = 0.38
    for i, schedule in enumerate(("hpcdl gpipe", "hpcdl 1f1b")):
        mine = {r["stages"]: r for r in rows if r["system"] == schedule}
        xs = [k + (i - 0.5) * width for k in range(len(stages))]
        left.bar(xs, [mine[p]["predicted_samples_per_s"] for p in stages], width, label=f"{schedule} (predicted)")
        right.bar(xs, [mine[p]["predicted_bubble"] for p in stages], width, label=f"{schedule} (predicted)")
    right.plot(
        range(len(stages)),
        [next(r["theoretical_bubble"] for r in rows if r["stages"] == p) for p in stages],
        "k_",
        markersize=30,
        mew=2,
        label="(P-1)/(M+P-1)",
    )
    if single_rate:
        left.axhline(single_rate, color="grey", linestyle="--", label="single process (measured)")
    labels = [f"P={p}, M={4 * p}" for p in stages]
    for ax in (left, right):
        ax.set_xticks(range(len(stages)), labels)
        ax.legend(fontsize=8)
    left.set_ylabel("samples/s")
    left.set_title("throughput, a core per stage (model prediction)")
    right.set_ylabel("bubble (share of a stage's step spent waiting)")
    right.set_title("pipeline bubble (model prediction)")
    fig.suptitle(f"hpcdl pipeline, predicted by bench/pipeline_model.py\n{conditions}", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("link", help="(under mpiexec -n 2) the link's alpha and beta, measured")
    sub.add_parser("wait", help="(under mpiexec -n 2) engine CPU while a receive waits 2 s, and alpha")
    inp = sub.add_parser("inputs", help="(under mpiexec -n P) the model's inputs for the MLP in P stages")
    inp.add_argument("--hidden", type=int, default=1024)
    inp.add_argument("--layers", type=int, default=8)
    inp.add_argument("--batch", type=int, default=256)
    inp.add_argument("--micro-batches", type=int, required=True)
    v = sub.add_parser("validate", help="measured vs predicted from bench/pipeline.py --model CSVs")
    v.add_argument("csv", nargs="+")
    v.add_argument("--out", default="bench/results")
    v.add_argument("--tag", default="pipeline-model-validation")
    pr = sub.add_parser("predict", help="P stages with a core each: samples/s and bubble")
    pr.add_argument("--stages", type=int, nargs="+", default=[4, 8])
    pr.add_argument("--hidden", type=int, default=1024)
    pr.add_argument("--layers", type=int, default=8)
    pr.add_argument("--batch", type=int, default=256)
    pr.add_argument("--micro-batches-per-stage", type=int, default=4, help="M = this x P")
    pr.add_argument("--steps", type=int, default=5, help="simulated steps (the bench's timed steps)")
    pr.add_argument("--repeats", type=int, default=3, help="steps timed per stage (medians)")
    pr.add_argument("--alpha", type=float, help="link seconds per message (with --beta; default: measured)")
    pr.add_argument("--beta", type=float, help="link seconds per byte (with --alpha; default: measured)")
    pr.add_argument(
        "--one-process",
        action="store_true",
        help="time the stages one after another in this process (needs --alpha, --beta)",
    )
    pr.add_argument("--mpiexec", default="mpiexec")
    pr.add_argument("--out", default="bench/results")
    pr.add_argument("--tag", default="pipeline-model-predict")
    args = ap.parse_args(argv)
    {
        "link": lambda a: pair_worker(link_times, "link"),
        "wait": lambda a: pair_worker(wait_costs, "wait"),
        "inputs": inputs_worker,
        "validate": cmd_validate,
        "predict": cmd_predict,
    }[args.command](args)


if __name__ == "__main__":
    main()
