"""hpcdl.tensorflow under Keras model.fit: DistributedOptimizer, the broadcast and metric-average callbacks.

TensorFlow takes seconds to import: these tests share one process per rank.
"""

import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import hpcdl
import hpcdl.prefetch
import hpcdl.store
import hpcdl.tensorflow as hvd_tf
from conftest import agree, collective, outcome

WORLD = MPI.COMM_WORLD
tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
STEPS, LOCAL_BATCH = 4, 6


def make_model(seed=0, hidden=16):
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential([tf.keras.Input((10,)), tf.keras.layers.Dense(hidden, activation="tanh"),
                                tf.keras.layers.Dense(4)])


def global_data(size, steps=STEPS, per_rank=LOCAL_BATCH, seed=7):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * per_rank * size, 10)).astype(np.float32)
    return x, rng.integers(0, 4, len(x))


def quarter(array, rank, size, per_rank=LOCAL_BATCH):
    """Rank ``rank``'s share of every global batch, in step order (what fit reads with shuffle=False)."""
    steps = len(array) // (per_rank * size)
    return array.reshape(steps, size, per_rank, *array.shape[1:])[:, rank].reshape(-1, *array.shape[1:])


def fit(model, optimizer, x, y, batch_size, callbacks=(), as_dataset=False, epochs=1, run_eagerly=False):
    model.compile(optimizer=optimizer, loss=LOSS, metrics=["accuracy"], run_eagerly=run_eagerly)
    if as_dataset:
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(batch_size)
        return model.fit(data, epochs=epochs, verbose=0, shuffle=False, callbacks=list(callbacks))
    return model.fit(x, y, batch_size=batch_size, epochs=epochs, verbose=0, shuffle=False, callbacks=list(callbacks))


def reference(size):
    """One process, plain SGD, fit on the global batches."""
    model = make_model()
    x, y = global_data(size)
    fit(model, tf.keras.optimizers.SGD(0.5), x, y, LOCAL_BATCH * size)
    return model


def digest(model):
    return hashlib.sha1(b"".join(v.numpy().tobytes() for v in model.variables)).hexdigest()


def max_difference(a, b):
    return max(float(np.max(np.abs(v.numpy() - w.numpy()))) for v, w in zip(a.variables, b.variables))


# ---------------------------------------------------------------- single process

def test_wrapper_is_a_subclass_made_from_the_config():
    schedule = tf.keras.optimizers.schedules.ExponentialDecay(0.5, decay_steps=10, decay_rate=0.5)
    opt = hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(schedule, momentum=0.25), comm=MPI.COMM_SELF)
    assert isinstance(opt, tf.keras.optimizers.SGD) and type(opt).__name__ == "DistributedSGD"
    assert opt.momentum == 0.25 and isinstance(opt._learning_rate, tf.keras.optimizers.schedules.ExponentialDecay)


def test_wrapper_rejects_what_it_cannot_wrap():
    _, not_keras = outcome(hvd_tf.DistributedOptimizer, object())
    built = tf.keras.optimizers.SGD(0.1)
    built.build([tf.keras.Variable(np.zeros(3, np.float32))])
    _, was_built = outcome(hvd_tf.DistributedOptimizer, built)
    _, twice = outcome(hvd_tf.DistributedOptimizer, hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.1)))
    assert isinstance(not_keras, TypeError) and "keras.optimizers.Optimizer" in str(not_keras)
    assert isinstance(was_built, ValueError) and "before it is built" in str(was_built)
    assert isinstance(twice, ValueError) and "already" in str(twice)


@pytest.mark.parametrize("as_dataset,run_eagerly", [(False, False), (True, False), (False, True)])
def test_single_process_fit_equals_plain_fit(as_dataset, run_eagerly):
    x, y = global_data(1)
    got = make_model()
    fit(got, hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), comm=MPI.COMM_SELF), x, y, LOCAL_BATCH,
        as_dataset=as_dataset, run_eagerly=run_eagerly)
    assert max_difference(got, reference(1)) < 1e-6


def test_loss_scaling_wraps_the_reduction_not_the_other_way_round():
    """The LossScaleOptimizer's finiteness check must see the reduced gradients (the same on every rank)."""
    x, y = global_data(1)
    right = make_model()
    opt = hvd_tf.DistributedOptimizer(tf.keras.optimizers.LossScaleOptimizer(tf.keras.optimizers.SGD(0.5)),
                                      comm=MPI.COMM_SELF)
    fit(right, opt, x, y, LOCAL_BATCH, callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0, comm=MPI.COMM_SELF)])
    assert max_difference(right, reference(1)) < 1e-5
    wrong = make_model()
    wrapped = tf.keras.optimizers.LossScaleOptimizer(
        hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), comm=MPI.COMM_SELF))
    with pytest.raises(ValueError, match=r"DistributedOptimizer\(LossScaleOptimizer\(opt\)\)"):
        fit(wrong, wrapped, x, y, LOCAL_BATCH,
            callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0, comm=MPI.COMM_SELF)])


def test_xla_compiled_fit_is_refused_with_a_clear_error():
    model = make_model()
    model.compile(optimizer=hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), comm=MPI.COMM_SELF),
                  loss=LOSS, jit_compile=True)
    x, y = global_data(1)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.fit(x, y, batch_size=LOCAL_BATCH, verbose=0)


def test_keras_fit_example_learns_the_digits(tmp_path):
    """examples/train_keras_fit.py in one process: pack, prefetch through tf.data, model.fit, report."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root, "TMPDIR": str(tmp_path)}
    run = subprocess.run([sys.executable, os.path.join(root, "examples", "train_keras_fit.py"), "--epochs", "3",
                          "--compression", "int8"], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    accuracies = [float(a) for a in re.findall(r"test acc (\d\.\d+)", run.stdout)]
    assert len(accuracies) == 3 and accuracies[-1] > 0.6, run.stdout
    assert len(re.findall(r"epoch +\d+ .* stall \d+\.\d+ s \(", run.stdout)) == 3, run.stdout


# ---------------------------------------------------------------- under MPI

@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("as_dataset", [False, True])
def test_fit_on_ranks_equals_single_process_fit_on_the_global_batch(as_dataset):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = global_data(size)
    model = make_model(seed=rank)  # different on every rank: the callback starts all from rank 0's
    collective(WORLD, fit, model, hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5)),
               quarter(x, rank, size), quarter(y, rank, size), LOCAL_BATCH, as_dataset=as_dataset,
               callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0)])
    diff = max_difference(model, reference(size))
    digests = WORLD.allgather(digest(model))
    agree(WORLD, diff < 2e-5 and len(set(digests)) == 1,
          f"max diff {diff}, {len(set(digests))} distinct")


@pytest.mark.mpi(min_size=2)
def test_compressed_fit_keeps_ranks_identical_and_sends_fewer_bytes():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = global_data(size)
    model, codec = make_model(), hpcdl.compression.Int8()
    hpcdl.stats(reset=True)
    collective(WORLD, fit, model, hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), compression=codec,
                                                              name="int8fit"),
               quarter(x, rank, size), quarter(y, rank, size), LOCAL_BATCH)
    codecs = hpcdl.stats()["allreduce"]
    diff = max_difference(model, reference(size))
    digests = WORLD.allgather(digest(model))
    int8 = codecs.get(str(codec), {})
    fewer_bytes = 0 < int8.get("bytes_sent", 0) < int8.get("dense_bytes", 0)
    agree(WORLD, len(set(digests)) == 1 and 0 < diff < 0.05 and fewer_bytes,
          f"{len(set(digests))} distinct, diff {diff}, stats {codecs}")


@pytest.mark.mpi(min_size=2)
def test_logged_metrics_are_the_mean_of_the_ranks_local_values():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = global_data(size, seed=20)
    local = []

    class KeepLocal(tf.keras.callbacks.Callback):  # runs before MetricAverageCallback: sees the local logs
        def on_epoch_end(self, epoch, logs=None):
            local.append(dict(logs))

    history = collective(WORLD, fit, make_model(), hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5)),
                         quarter(x, rank, size), quarter(y, rank, size), LOCAL_BATCH, epochs=2,
                         callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0), KeepLocal(),
                                    hvd_tf.MetricAverageCallback()])
    everyone = WORLD.allgather(local)
    problems = []
    for epoch in range(2):
        for name in ("loss", "accuracy"):
            values = [logs[epoch][name] for logs in everyone]
            if name == "loss" and len(set(values)) == 1:
                problems.append(f"epoch {epoch}: local losses equal on all ranks, nothing to average")
            mean, logged = float(np.mean(values)), history.history[name][epoch]
            if abs(logged - mean) > 1e-12 * max(1.0, abs(mean)):
                problems.append(f"epoch {epoch} {name}: logged {logged}, mean of ranks {mean} ({values})")
    agree(WORLD, not problems, problems)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("with_broadcast", [True, False])
def test_models_with_different_shapes_raise_on_every_rank(with_broadcast):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = global_data(size)
    model = make_model(hidden=17 if rank == size - 1 else 16)
    callbacks = [hvd_tf.BroadcastGlobalVariablesCallback(0)] if with_broadcast else []
    _, err = outcome(fit, model, hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), name=f"bad{with_broadcast}"),
                     quarter(x, rank, size), quarter(y, rank, size), LOCAL_BATCH, callbacks=callbacks)
    text = str(err)
    if with_broadcast:
        ok = isinstance(err, hpcdl.MismatchError) and "variables to broadcast differ" in text
    else:  # the gradient check inside the compiled train step: a tf.errors exception with hpcdl's message
        ok = "the gradients of DistributedOptimizer differ across ranks" in text
    ok = ok and f"17] on rank {size - 1}" in text
    agree(WORLD, ok, repr(err)[:600])


@pytest.mark.mpi(min_size=2)
def test_fit_reading_through_the_prefetcher_equals_single_process_fit():
    """hpcdl.tensorflow.tf_dataset over the whole run + steps_per_epoch: 2 epochs, each rank its share of each
    global batch; the same SGD steps as one process on the global batches the ranks were fed."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = global_data(size, steps=3)
    root = None
    if rank == 0:
        root = tempfile.mkdtemp(prefix="hpcdl-keras-fit-")
        for i, (features, label) in enumerate(zip(x, y)):
            os.makedirs(os.path.join(root, "src", f"c{label}"), exist_ok=True)
            np.save(os.path.join(root, "src", f"c{label}", f"{i:03d}.npy"), features)
        hpcdl.store.pack(os.path.join(root, "src"), os.path.join(root, "store"), comm=MPI.COMM_SELF, progress=False)
    root = WORLD.bcast(root)
    label_of = {features.tobytes(): int(label) for features, label in zip(x, y)}
    fed = []

    def decode(view):
        features = np.load(io.BytesIO(view.tobytes()))
        fed.append(features)
        return features

    def train():
        model = make_model(seed=rank)
        with hpcdl.prefetch.Prefetcher(hpcdl.store.Store(os.path.join(root, "store")),
                                       batch_size=LOCAL_BATCH * size, epochs=2, seed=5, comm=WORLD) as pf:
            dataset = hvd_tf.tf_dataset(pf, transform=decode, output_signature=(
                tf.TensorSpec([10], tf.float32), tf.TensorSpec([], tf.int32))).batch(pf.local_batch)
            model.compile(optimizer=hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), name="prefetched"),
                          loss=LOSS)
            model.fit(dataset, epochs=2, steps_per_epoch=pf.steps_per_epoch, shuffle=False, verbose=0,
                      callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0)])
        return model

    try:
        model = collective(WORLD, train)
        everyone = WORLD.allgather(np.stack(fed))
    finally:
        WORLD.Barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    steps = len(everyone[0]) // LOCAL_BATCH
    global_x = np.concatenate([everyone[r][s * LOCAL_BATCH:(s + 1) * LOCAL_BATCH]
                               for s in range(steps) for r in range(size)])
    global_y = np.array([label_of[features.tobytes()] for features in global_x])
    want = make_model()
    fit(want, tf.keras.optimizers.SGD(0.5), global_x, global_y, LOCAL_BATCH * size)
    diff = max_difference(model, want)
    digests = WORLD.allgather(digest(model))
    agree(WORLD, steps == 2 * 3 and diff < 2e-5 and len(set(digests)) == 1,
          f"{steps} steps fed, max diff {diff}, {len(set(digests))} distinct")
