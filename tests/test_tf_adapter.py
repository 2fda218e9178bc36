"""hpcdl.tensorflow: DistributedGradientTape (eager and tf.function), broadcasts, Keras callback.

TensorFlow takes seconds to import: these tests share one process per rank.
"""

import hashlib

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import hpcdl
import hpcdl.tensorflow as hvd_tf
from conftest import agree, collective, outcome

WORLD = MPI.COMM_WORLD
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)


def make_model(seed=0, hidden=16, extra=False):
    tf.keras.utils.set_random_seed(seed)
    layers = [tf.keras.Input((10,)), tf.keras.layers.Dense(hidden, activation="tanh")]
    if extra:
        layers.append(tf.keras.layers.Dense(hidden, activation="tanh"))
    model = tf.keras.Sequential(layers + [tf.keras.layers.Dense(4)])
    return model


def full_batch(step, per_rank, size):
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((per_rank * size, 10)).astype(np.float32)
    y = rng.integers(0, 4, per_rank * size)
    return x, y


LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_distributed(comm, steps, per_rank, use_function):
    model = make_model()
    opt = tf.keras.optimizers.SGD(0.5)
    rank, size = comm.Get_rank(), comm.Get_size()

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        tape = hvd_tf.DistributedGradientTape(tape, comm=comm)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step_fn = tf.function(step_fn) if use_function else step_fn
    for step in range(steps):
        x, y = full_batch(step, per_rank, size)
        step_fn(x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank])
    return model


def train_reference(steps, per_rank, size):
    model = make_model()
    opt = tf.keras.optimizers.SGD(0.5)
    for step in range(steps):
        x, y = full_batch(step, per_rank, size)
        with tf.GradientTape() as tape:
            loss = tf.add_n([LOSS(y[r * per_rank:(r + 1) * per_rank], model(x[r * per_rank:(r + 1) * per_rank]))
                             for r in range(size)]) / size
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model


def digest(model):
    return hashlib.sha1(b"".join(v.numpy().tobytes() for v in model.variables)).hexdigest()


def max_difference(a, b):
    return max(float(np.max(np.abs(v.numpy() - w.numpy()))) for v, w in zip(a.variables, b.variables))


# ---------------------------------------------------------------- single process

@pytest.mark.parametrize("use_function", [False, True])
def test_single_process_equals_plain_tape(use_function):
    got = train_distributed(MPI.COMM_SELF, 3, 8, use_function)
    want = train_reference(3, 8, 1)
    assert max_difference(got, want) < 1e-6


def test_unconnected_source_gets_zeros_and_structure_is_kept():
    a, b = tf.Variable([1.0, 2.0]), tf.Variable([[3.0]])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(a * a)
    grads = hvd_tf.DistributedGradientTape(tape, comm=MPI.COMM_SELF).gradient(loss, {"a": a, "b": b})
    assert set(grads) == {"a", "b"}
    np.testing.assert_array_equal(grads["a"].numpy(), [2.0, 4.0])
    np.testing.assert_array_equal(grads["b"].numpy(), [[0.0]])


# ---------------------------------------------------------------- under MPI

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("use_function", [False, True])
def test_data_parallel_equals_single_process_on_concatenated_batch(use_function):
    got = collective(WORLD, train_distributed, WORLD, 4, 6, use_function)
    want = train_reference(4, 6, WORLD.Get_size())
    diff = max_difference(got, want)
    digests = WORLD.allgather(digest(got))
    agree(WORLD, diff < 2e-5 and len(set(digests)) == 1, f"max diff {diff}, {len(set(digests))} distinct")


@pytest.mark.mpi(min_size=2)
def test_broadcast_variables_and_keras_callback():
    rank = WORLD.Get_rank()
    root = WORLD.Get_size() - 1
    model = make_model(seed=rank)
    counter = tf.Variable(rank, dtype=tf.int64)
    collective(WORLD, hvd_tf.broadcast_variables, list(model.variables) + [counter], root=root)
    first = WORLD.allgather((digest(model), int(counter.numpy())))

    # Keras fit with lr 0: the weights stay rank 0's initial ones on every rank.
    fitted = make_model(seed=10 + rank)
    initial_on_0 = WORLD.bcast(digest(fitted) if rank == 0 else None)
    fitted.compile(optimizer=tf.keras.optimizers.SGD(0.0), loss=LOSS)
    x, y = full_batch(0, 8, 1)
    collective(WORLD, fitted.fit, x, y, batch_size=4, epochs=1, verbose=0,
               callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(root=0)])
    second = WORLD.allgather(digest(fitted))
    ok = (len(set(first)) == 1 and first[0][1] == root and len(set(second)) == 1 and second[0] == initial_on_0)
    agree(WORLD, ok, f"{first} / {second} vs {initial_on_0}")


@pytest.mark.mpi(min_size=2)
def test_variable_on_some_ranks_only_raises_everywhere():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    model = make_model(extra=rank == size - 1)
    _, err = outcome(hvd_tf.broadcast_variables, model.variables)
    x, y = full_batch(0, 4, 1)
    with tf.GradientTape() as tape:
        loss = LOSS(y, model(x))
    _, err2 = outcome(hvd_tf.DistributedGradientTape(tape, name="bad").gradient, loss, model.trainable_variables)
    ok = (isinstance(err, hpcdl.MismatchError) and f"on rank {size - 1} but not on rank 0" in str(err)
          and isinstance(err2, hpcdl.MismatchError) and "gradients of DistributedGradientTape" in str(err2))
    agree(WORLD, ok, f"{err!r} / {err2!r}")


def test_tf_example_learns_the_digits(tmp_path):
    """examples/train_tf.py end to end in one process: pack, prefetch through tf.data, train, report."""
    import json
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "TMPDIR": str(tmp_path)}
    metrics = tmp_path / "metrics.jsonl"
    run = subprocess.run([sys.executable, os.path.join(root, "examples", "train_tf.py"), "--epochs", "3",
                          "--compression", "int8", "--metrics", str(metrics)],
                         capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    epochs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [0, 1, 2] and epochs[-1]["test_acc"] > 0.6, run.stdout
    assert all(e["stall_s"] >= 0 and e["samples_per_s"] > 0 for e in epochs), epochs
    assert len(re.findall(r"epoch +\d+ .* stall \d+\.\d+ s \(", run.stdout)) == 3, run.stdout
