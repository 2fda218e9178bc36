"""Agreement cost per step: report trees of several radixes against direct reports to rank 0.

    python bench/agreement.py --ranks 2,4,8          # starts the mpiexec jobs itself

For every P and mode (radixK: the report tree of radix K, HPCDL_AGREEMENT_RADIX=K,
radix2 being binomial; flat: HPCDL_AGREEMENT_FLAT=1, every rank reports to rank 0
directly) one job
submits B named one-element allreduces per step, each rank in its own order,
for S steps after a warm-up step (new names: full descriptions), and reports:

* messages and entries (reports, one per op and sender) rank 0 receives per
  step, from hpcdl.stats()["agreement"];
* plan latency: per step, the first op agreed there, from the moment the last
  rank submitted it (one host: one clock) to its plan reaching each rank,
  median over steps and ranks: the agreement's round trip alone;
* agreed - submitted per op (Handle.timings()), median over ops, steps and
  ranks: it includes waiting behind the step's earlier ops, which run first;
* step time: barrier to the last op finished on every rank.

Rank 0 of each job prints one CSV row; the driver writes <out>/<tag>.csv and
<out>/<tag>.png (needs matplotlib: hpcdl[bench]).
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys

FIELDS = [
    "mode",
    "ranks",
    "ops_per_step",
    "steps",
    "rank0_messages_per_step",
    "rank0_entries_per_step",
    "rank0_descriptions_per_step",
    "plan_latency_us",
    "agreed_minus_submitted_us",
    "step_ms",
]


def job(args):
    import numpy as np
    from mpi4py import MPI

    import hpcdl

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    names = [f"agreement.{i}" for i in range(args.ops)]
    arrays = {n: np.ones(1, dtype=np.float32) for n in names}
    rng = np.random.default_rng(rank)

    def step():
        comm.Barrier()
        t0 = MPI.Wtime()
        order = rng.permutation(len(names))
        handles = [hpcdl.allreduce_async(arrays[names[i]], name=names[i]) for i in order]
        for h in handles:
            h.wait()
        elapsed = comm.allreduce(MPI.Wtime() - t0, op=MPI.MAX)
        return {h.name: h.timings() for h in handles}, elapsed

    step()  # new names: every rank's full description reaches rank 0
    comm.Barrier()
    hpcdl.stats(reset=True)
    plan_us, per_op_us, step_s = [], [], []
    for _ in range(args.steps):
        times, elapsed = step()
        step_s.append(elapsed)
        per_op_us += [t["agreed_us"] - t["submitted_us"] for t in times.values()]
        first = min(times, key=lambda n: times[n]["agreed_us"])
        # The first op agreed on this rank this step; when did the last rank submit it?
        all_times = comm.allgather(times)
        last_submit = max(t[first]["submitted_us"] for t in all_times)
        plan_us.append(times[first]["agreed_us"] - last_submit)
    counts = hpcdl.stats()["agreement"]
    plan_us = comm.gather(plan_us)
    per_op_us = comm.gather(per_op_us)
    if rank == 0:
        row = {
            "mode": args.mode,
            "ranks": size,
            "ops_per_step": args.ops,
            "steps": args.steps,
            "rank0_messages_per_step": counts["messages_received"] / args.steps,
            "rank0_entries_per_step": counts["entries_received"] / args.steps,
            "rank0_descriptions_per_step": counts["descriptions_received"] / args.steps,
            "plan_latency_us": round(statistics.median(x for r in plan_us for x in r), 1),
            "agreed_minus_submitted_us": round(statistics.median(x for r in per_op_us for x in r), 1),
            "step_ms": round(statistics.median(step_s) * 1e3, 2),
        }
        print("ROW " + json.dumps(row), flush=True)


def draw(plt, rows, title):
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    styles = ("s-", "^-", "v-", "D-")
    for i, mode in enumerate(dict.fromkeys(r["mode"] for r in rows)):
        mine = sorted((r for r in rows if r["mode"] == mode), key=lambda r: r["ranks"])
        ranks = [r["ranks"] for r in mine]
        style = "o--" if mode == "flat" else styles[i % len(styles)]
        label = "direct reports to rank 0" if mode == "flat" else f"report tree, radix {mode[len('radix') :]}"
        axes[0].plot(ranks, [r["rank0_entries_per_step"] for r in mine], style, label=label)
        axes[1].plot(ranks, [r["plan_latency_us"] for r in mine], style, label=label)
        axes[2].plot(ranks, [r["step_ms"] for r in mine], style, label=label)
    for ax, ylabel in zip(
        axes, ("reports rank 0 receives per step", "plan latency (us, median)", "step time (ms, median)")
    ):
        ax.set_xlabel("ranks P")
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({r["ranks"] for r in rows}))
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def drive(args):
    rows = []
    here = os.path.abspath(__file__)
    for size in [int(p) for p in args.ranks.split(",")]:
        for mode in args.modes.split(","):
            env = dict(os.environ, HPCDL_AGREEMENT_FLAT="1" if mode == "flat" else "0")
            if mode != "flat":
                env["HPCDL_AGREEMENT_RADIX"] = mode[len("radix") :]
            cmd = [
                "mpiexec",
                "-n",
                str(size),
                sys.executable,
                here,
                "--job",
                "--mode",
                mode,
                "--ops",
                str(args.ops),
                "--steps",
                str(args.steps),
            ]
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
            found = [line[4:] for line in out.stdout.splitlines() if line.startswith("ROW ")]
            if out.returncode != 0 or not found:
                sys.exit(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
            rows.append(json.loads(found[0]))
            print(" ".join(f"{k}={rows[-1][k]}" for k in FIELDS), flush=True)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, args.tag)
    with open(stem + ".csv", "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    from hpcdl.measure import save_figure

    title = f"Agreement: {args.ops} named ops per step, {args.steps} steps, one host"
    save_figure(stem + ".png", lambda plt: draw(plt, rows, title))
    print(f"wrote {stem}.csv and {stem}.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="2,4,8", help="comma-separated P to run (driver)")
    parser.add_argument(
        "--modes", default="flat,radix2,radix4", help="comma-separated: flat, radixK (HPCDL_AGREEMENT_RADIX=K)"
    )
    parser.add_argument("--ops", type=int, default=50, help="named ops per step (B)")
    parser.add_argument("--steps", type=int, default=30, help="measured steps (S)")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    parser.add_argument("--tag", default="agreement")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per mpiexec job")
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)  # one mpiexec job's rank
    parser.add_argument("--mode", help=argparse.SUPPRESS)  # that job's mode, for its row
    args = parser.parse_args()
    job(args) if args.job else drive(args)


if __name__ == "__main__":
    main()
