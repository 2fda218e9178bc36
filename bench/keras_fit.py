"""Step time: Keras model.fit with hpcdl.tensorflow.DistributedOptimizer vs a DistributedGradientTape loop.

    mpiexec -n 4 python bench/keras_fit.py --out bench/results --tag keras-fit-run1

Two copies of the same MLP (same seed, SGD without momentum, same gradient
codec) train on the same tf.data batches in one job. One model.fit call runs
--rounds + 1 epochs of --steps steps; at the end of each epoch a callback runs
--steps steps of the hand-written loop (a tf.function step whose gradients
DistributedGradientTape averages, the pattern of examples/train_tf.py), so the
two systems alternate and machine noise hits them alike. A round's step time
is its wall time (slowest rank) over --steps, for fit from on_epoch_begin to
on_epoch_end; round 0 (tracing) is not counted. Rank 0 prints the medians,
their ratio and the median of the rounds' fit/tape ratios (robust to load that
drifts between rounds) and the CPU time per step, and writes TAG.csv (one row
per system and round, with the load average at the start and the end) and TAG.png. Imports this
checkout's hpcdl, wherever it is started from.
"""

import argparse
import csv
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from mpi4py import MPI  # noqa: E402

import hpcdl  # noqa: E402
import hpcdl.compression  # noqa: E402
import hpcdl.tensorflow  # noqa: E402
from hpcdl.measure import save_figure  # noqa: E402

WORLD = MPI.COMM_WORLD
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
CODECS = {"dense": lambda: None, "int8": lambda: hpcdl.compression.Int8(), "fp16": lambda: hpcdl.compression.FP16()}


def make_model(features, hidden, layers, classes):
    tf.keras.utils.set_random_seed(0)
    body = [tf.keras.layers.Dense(hidden, activation="relu") for _ in range(layers)]
    return tf.keras.Sequential([tf.keras.Input((features,)), *body, tf.keras.layers.Dense(classes)])


def tape_loop(model, optimizer, codec):
    """The hand-written data-parallel step (examples/train_tf.py's)."""

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x, training=True))
        tape = hpcdl.tensorflow.DistributedGradientTape(tape, compression=codec, name="bench.tape")
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    return step


class Alternate(tf.keras.callbacks.Callback):
    """Times each fit epoch, then runs and times the same number of tape-loop steps."""

    def __init__(self, steps, tape_step, batches):
        super().__init__()
        self.steps, self.tape_step, self.batches = steps, tape_step, batches
        self.times = {"fit": [], "tape": []}
        self.cpu = {"fit": [], "tape": []}  # CPU seconds of the process (all threads) per step, mean over ranks

    def record(self, name, started, cpu_started):
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        self.times[name].append(WORLD.allreduce(wall, op=MPI.MAX) / self.steps)
        self.cpu[name].append(WORLD.allreduce(cpu) / WORLD.Get_size() / self.steps)

    def on_epoch_begin(self, epoch, logs=None):
        self.started, self.cpu_started = time.perf_counter(), time.process_time()

    def on_epoch_end(self, epoch, logs=None):
        self.record("fit", self.started, self.cpu_started)
        WORLD.Barrier()
        started, cpu_started = time.perf_counter(), time.process_time()
        for _ in range(self.steps):
            loss = self.tape_step(*next(self.batches))
        float(loss)  # the last step has finished
        self.record("tape", started, cpu_started)
        WORLD.Barrier()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=20, help="timed steps per system and round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--compression", choices=sorted(CODECS), default="dense")
    parser.add_argument(
        "--steps-per-execution", type=int, default=1, help="Keras' steps per train-function call (1: Keras' default)"
    )
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--tag", default="keras-fit")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    load_start = round(os.getloadavg()[0], 2)

    features, classes = 784, 10
    rng = np.random.default_rng(rank)
    x = rng.standard_normal((args.batch * args.steps, features)).astype(np.float32)
    y = rng.integers(0, classes, len(x)).astype(np.int32)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat().prefetch(2)

    tape_model = make_model(features, args.hidden, args.layers, classes)
    tape_step = tape_loop(tape_model, tf.keras.optimizers.SGD(0.01), CODECS[args.compression]())
    fit_model = make_model(features, args.hidden, args.layers, classes)
    fit_model.compile(
        optimizer=hpcdl.tensorflow.DistributedOptimizer(
            tf.keras.optimizers.SGD(0.01), compression=CODECS[args.compression](), name="bench.fit"
        ),
        loss=LOSS,
        jit_compile=False,
        steps_per_execution=args.steps_per_execution,
    )
    alternate = Alternate(args.steps, tape_step, iter(dataset))
    fit_model.fit(dataset, epochs=args.rounds + 1, steps_per_epoch=args.steps, verbose=0, callbacks=[alternate])
    if rank != 0:
        return

    load = f"{load_start}-{round(os.getloadavg()[0], 2)}"
    params = fit_model.count_params()
    medians = {name: statistics.median(t[1:]) for name, t in alternate.times.items()}
    ratio = medians["fit"] / medians["tape"]
    paired = statistics.median(f / t for f, t in zip(alternate.times["fit"][1:], alternate.times["tape"][1:]))
    print(
        f"[hpcdl rank 0] {size} ranks, MLP {args.layers}x{args.hidden} ({params / 1e6:.2f} M params), "
        f"batch {args.batch}/rank, {args.compression}, steps_per_execution {args.steps_per_execution}, "
        f"{args.rounds} rounds of {args.steps} steps, load {load}"
    )
    cpu = {name: statistics.median(t[1:]) for name, t in alternate.cpu.items()}
    for name, median in medians.items():
        print(f"[hpcdl rank 0] {name:5s} {median * 1e3:8.2f} ms/step (median)  {cpu[name] * 1e3:8.2f} ms CPU/step/rank")
    print(f"[hpcdl rank 0] fit / tape step time: {ratio:.3f} (median of the rounds' ratios {paired:.3f})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"{args.tag}.csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "system",
                "round",
                "step_ms",
                "cpu_ms_per_rank",
                "median_step_ms",
                "fit_over_tape",
                "fit_over_tape_paired",
                "ranks",
                "params",
                "batch_per_rank",
                "compression",
                "steps_per_execution",
                "load_avg_1min_start_end",
            ]
        )
        for name, times in alternate.times.items():
            for rnd, t in enumerate(times[1:], start=1):
                writer.writerow(
                    [
                        name,
                        rnd,
                        round(t * 1e3, 3),
                        round(alternate.cpu[name][rnd] * 1e3, 3),
                        round(medians[name] * 1e3, 3),
                        round(ratio, 4),
                        round(paired, 4),
                        size,
                        params,
                        args.batch,
                        args.compression,
                        args.steps_per_execution,
                        load,
                    ]
                )

    save_figure(
        os.path.join(args.out, f"{args.tag}.png"),
        lambda plt: draw(plt, args, alternate.times, medians, ratio, paired, size, params),
    )


def draw(plt, args, times_by_system, medians, ratio, paired, size, params):
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    labels = {"fit": "model.fit + DistributedOptimizer", "tape": "tf.function loop + DistributedGradientTape"}
    for (name, times), color in zip(times_by_system.items(), ("tab:blue", "tab:orange")):
        rounds = range(1, len(times))
        ax.plot(rounds, [t * 1e3 for t in times[1:]], "o-", color=color, label=f"{labels[name]}")
        ax.axhline(
            medians[name] * 1e3, color=color, linestyle="--", linewidth=1, label=f"median {medians[name] * 1e3:.1f} ms"
        )
    ax.set_xlabel("round")
    ax.set_ylabel("step time (ms, slowest rank)")
    ax.set_ylim(bottom=0)
    ax.set_title(
        f"Keras fit vs tape loop: {size} ranks, {params / 1e6:.2f} M params, {args.compression}, "
        f"steps/execution {args.steps_per_execution}; fit/tape {ratio:.3f} (paired {paired:.3f})",
        fontsize=8,
    )
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    return fig


if __name__ == "__main__":
    main()
