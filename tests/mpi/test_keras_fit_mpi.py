"""Keras model.fit under MPI: ranks' fits against one process's fit on the global batch."""

import hashlib
import io
import os
import shutil
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
from helpers.keras_fit import LOCAL_BATCH, LOSS, fit, global_data, make_model, max_difference, reference

WORLD = MPI.COMM_WORLD


def quarter(array, rank, size, per_rank=LOCAL_BATCH):
    """Rank ``rank``'s share of every global batch, in step order (what fit reads with shuffle=False)."""
    steps = len(array) // (per_rank * size)
    return array.reshape(steps, size, per_rank, *array.shape[1:])[:, rank].reshape(-1, *array.shape[1:])


def digest(model):
    return hashlib.sha1(b"".join(v.numpy().tobytes() for v in model.variables)).hexdigest()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("as_dataset", [False, True])
def test_fit_on_ranks_equals_single_process_fit_on_the_global_batch(as_dataset):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = global_data(size)
    model = make_model(seed=rank)  # different on every rank: the callback starts all from rank 0's
    collective(
        WORLD,
        fit,
        model,
        hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5)),
        quarter(x, rank, size),
        quarter(y, rank, size),
        LOCAL_BATCH,
        as_dataset=as_dataset,
        callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0)],
    )
    diff = max_difference(model, reference(size))
    digests = WORLD.allgather(digest(model))
    agree(WORLD, diff < 2e-5 and len(set(digests)) == 1, f"max diff {diff}, {len(set(digests))} distinct")


@pytest.mark.mpi(min_size=2)
def test_compressed_fit_keeps_ranks_identical_and_sends_fewer_bytes():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = global_data(size)
    model, codec = make_model(), hpcdl.compression.Int8()
    hpcdl.stats(reset=True)
    collective(
        WORLD,
        fit,
        model,
        hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), compression=codec, name="int8fit"),
        quarter(x, rank, size),
        quarter(y, rank, size),
        LOCAL_BATCH,
    )
    codecs = hpcdl.stats()["allreduce"]
    diff = max_difference(model, reference(size))
    digests = WORLD.allgather(digest(model))
    int8 = codecs.get(str(codec), {})
    fewer_bytes = 0 < int8.get("bytes_sent", 0) < int8.get("dense_bytes", 0)
    agree(
        WORLD,
        len(set(digests)) == 1 and 0 < diff < 0.05 and fewer_bytes,
        f"{len(set(digests))} distinct, diff {diff}, stats {codecs}",
    )


@pytest.mark.mpi(min_size=2)
def test_logged_metrics_are_the_mean_of_the_ranks_local_values():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = global_data(size, seed=20)
    local = []

    class KeepLocal(tf.keras.callbacks.Callback):  # runs before MetricAverageCallback: sees the local logs
        def on_epoch_end(self, epoch, logs=None):
            local.append(dict(logs))

    history = collective(
        WORLD,
        fit,
        make_model(),
        hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5)),
        quarter(x, rank, size),
        quarter(y, rank, size),
        LOCAL_BATCH,
        epochs=2,
        callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0), KeepLocal(), hvd_tf.MetricAverageCallback()],
    )
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
    _, err = outcome(
        fit,
        model,
        hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), name=f"bad{with_broadcast}"),
        quarter(x, rank, size),
        quarter(y, rank, size),
        LOCAL_BATCH,
        callbacks=callbacks,
    )
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
        with hpcdl.prefetch.Prefetcher(
            hpcdl.store.Store(os.path.join(root, "store")), batch_size=LOCAL_BATCH * size, epochs=2, seed=5, comm=WORLD
        ) as pf:
            dataset = hvd_tf.tf_dataset(
                pf, transform=decode, output_signature=(tf.TensorSpec([10], tf.float32), tf.TensorSpec([], tf.int32))
            ).batch(pf.local_batch)
            model.compile(
                optimizer=hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), name="prefetched"), loss=LOSS
            )
            model.fit(
                dataset,
                epochs=2,
                steps_per_epoch=pf.steps_per_epoch,
                shuffle=False,
                verbose=0,
                callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0)],
            )
        return model

    try:
        model = collective(WORLD, train)
        everyone = WORLD.allgather(np.stack(fed))
    finally:
        WORLD.Barrier()
        if rank == 0:
            shutil.rmtree(root, ignore_errors=True)
    steps = len(everyone[0]) // LOCAL_BATCH
    global_x = np.concatenate(
        [everyone[r][s * LOCAL_BATCH : (s + 1) * LOCAL_BATCH] for s in range(steps) for r in range(size)]
    )
    global_y = np.array([label_of[features.tobytes()] for features in global_x])
    want = make_model()
    fit(want, tf.keras.optimizers.SGD(0.5), global_x, global_y, LOCAL_BATCH * size)
    diff = max_difference(model, want)
    digests = WORLD.allgather(digest(model))
    agree(
        WORLD,
        steps == 2 * 3 and diff < 2e-5 and len(set(digests)) == 1,
        f"{steps} steps fed, max diff {diff}, {len(set(digests))} distinct",
    )
