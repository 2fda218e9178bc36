"""hpcdl.tensorflow under MPI: DistributedGradientTape equal to one process on the
concatenated batch, broadcasts, the Keras callback, and bad input on every rank."""

import hashlib

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import hpcdl
import hpcdl.tensorflow as hvd_tf

from conftest import agree, collective, outcome
from helpers.tf_adapter import LOSS, full_batch, make_model, max_difference, train_distributed, train_reference

WORLD = MPI.COMM_WORLD


def digest(model):
    return hashlib.sha1(b"".join(v.numpy().tobytes() for v in model.variables)).hexdigest()


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
    collective(
        WORLD,
        fitted.fit,
        x,
        y,
        batch_size=4,
        epochs=1,
        verbose=0,
        callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(root=0)],
    )
    second = WORLD.allgather(digest(fitted))
    ok = len(set(first)) == 1 and first[0][1] == root and len(set(second)) == 1 and second[0] == initial_on_0
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
    ok = (
        isinstance(err, hpcdl.MismatchError)
        and f"on rank {size - 1} but not on rank 0" in str(err)
        and isinstance(err2, hpcdl.MismatchError)
        and "gradients of DistributedGradientTape" in str(err2)
    )
    agree(WORLD, ok, f"{err!r} / {err2!r}")


@pytest.mark.mpi(min_size=2)
def test_mismatched_tensor_shapes_raise_on_every_rank():
    """hpcdl.allreduce of a TF tensor: [17, 1311] on rank 0 against [17, 23, 57] (the same count)."""
    rank = WORLD.Get_rank()
    t = tf.ones((17, 1311) if rank == 0 else (17, 23, 57))
    _, err = outcome(hpcdl.allreduce, t, name="tf.shape")
    ok = isinstance(err, hpcdl.MismatchError) and "shape differs" in str(err) and "[17, 1311] on rank 0" in str(err)
    agree(WORLD, ok, repr(err))


def embedding_model(dtype="float32"):
    """An Embedding (its gradient is IndexedSlices) before a Dense layer, same weights on every rank."""
    model = tf.keras.Sequential(
        [
            tf.keras.Input((2,), dtype="int32"),
            tf.keras.layers.Embedding(20, 6, dtype=dtype),
            tf.keras.layers.Flatten(dtype=dtype),
            tf.keras.layers.Dense(5, dtype=dtype),
        ]
    )
    rng = np.random.default_rng(3)
    model.set_weights([rng.normal(size=w.shape).astype(dtype) for w in model.get_weights()])
    return model


def embedding_batch(step, rows, size):
    """Step ``step``'s global batch (``rows`` per rank): ids with repeats, integer labels."""
    rng = np.random.default_rng(step)
    return rng.integers(0, 20, (rows * size, 2)).astype(np.int32), rng.integers(0, 5, rows * size)


SPARSE_LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def embedding_reference(steps, rows, size):
    """One process, float64, the concatenated batches (the average of the ranks' mean losses)."""
    model = embedding_model("float64")
    for step in range(steps):
        x, y = embedding_batch(step, rows, size)
        with tf.GradientTape() as tape:
            loss = SPARSE_LOSS(y, model(x))
        grads = tape.gradient(loss, model.trainable_variables)
        for v, g in zip(model.trainable_variables, grads):
            v.assign_sub(0.5 * tf.convert_to_tensor(g))
    return model


def max_weight_difference(a, b):
    return max(float(np.max(np.abs(x.astype(np.float64) - y))) for x, y in zip(a.get_weights(), b.get_weights()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
@pytest.mark.parametrize("use_function", [False, True])
def test_indexed_slices_gradients_gathered_or_dense_with_the_tape(use_function, sparse_as_dense):
    """tf.gather's IndexedSlices gradient: allgathered (Horovod's sparse path, it stays
    IndexedSlices) or made dense; equal to float64 on the concatenated batch; every rank identical."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    model, optimizer, kinds = embedding_model(), tf.keras.optimizers.SGD(0.5), []
    name = f"sparse.tape.{use_function}.{sparse_as_dense}"

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = SPARSE_LOSS(y, model(x))
        grads = hvd_tf.DistributedGradientTape(tape, name=name, sparse_as_dense=sparse_as_dense).gradient(
            loss, model.trainable_variables
        )
        kinds.append(type(grads[0]).__name__)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))

    run = tf.function(step) if use_function else step
    for i in range(3):
        x, y = embedding_batch(i, 4, size)
        collective(WORLD, run, x[rank * 4 : (rank + 1) * 4], y[rank * 4 : (rank + 1) * 4])
    diff = max_weight_difference(model, embedding_reference(3, 4, size))
    digests = set(WORLD.allgather(digest(model)))
    want = "Tensor" if sparse_as_dense else "IndexedSlices"
    ok = diff < 1e-5 and len(digests) == 1 and all(want in k for k in kinds)
    agree(WORLD, ok, f"max diff {diff}, {len(digests)} distinct, gradient kinds {set(kinds)}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_indexed_slices_gradients_in_keras_fit(sparse_as_dense):
    """model.fit (its train step a tf.function) with DistributedOptimizer: the Embedding's
    gradient gathered or made dense; equal to float64 on the concatenated batch."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    model = embedding_model()
    model.compile(
        optimizer=hvd_tf.DistributedOptimizer(
            tf.keras.optimizers.SGD(0.5), name=f"sparse.fit.{sparse_as_dense}", sparse_as_dense=sparse_as_dense
        ),
        loss=SPARSE_LOSS,
    )
    for i in range(3):
        x, y = embedding_batch(i, 4, size)
        collective(
            WORLD,
            model.fit,
            x[rank * 4 : (rank + 1) * 4],
            y[rank * 4 : (rank + 1) * 4],
            batch_size=4,
            epochs=1,
            verbose=0,
            shuffle=False,
        )
    diff = max_weight_difference(model, embedding_reference(3, 4, size))
    digests = set(WORLD.allgather(digest(model)))
    agree(WORLD, diff < 1e-5 and len(digests) == 1, f"max diff {diff}, {len(digests)} distinct")


@pytest.mark.mpi(min_size=2)
def test_indexed_slices_with_other_rows_on_each_rank_and_bad_op():
    """Ranks gathering different numbers of rows (0 on rank 0) get every rank's rows; op='max'
    on IndexedSlices raises ValueError (gathering cannot take a maximum)."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    table = tf.Variable(tf.ones((10, 3)))
    ids = tf.constant([r % 10 for r in range(rank)], dtype=tf.int32)
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, ids) * float(rank))
    tape = hvd_tf.DistributedGradientTape(tape, op="sum", name="sparse.rows")
    grad = collective(WORLD, tape.gradient, loss, [table])[0]
    want = np.zeros((10, 3))
    for r in range(size):
        for i in range(r):
            want[i % 10] += r
    got = tf.convert_to_tensor(grad).numpy()
    with tf.GradientTape() as tape2:
        loss2 = tf.reduce_sum(tf.gather(table, [0]))
    _, err = outcome(hvd_tf.DistributedGradientTape(tape2, op="max", name="sparse.max").gradient, loss2, [table])
    ok = (
        isinstance(grad, tf.IndexedSlices)
        and grad.values.shape[0] == size * (size - 1) // 2
        and np.array_equal(got, want)
        and isinstance(err, ValueError)
        and "sparse_as_dense" in str(err)
    )
    agree(WORLD, ok, f"{type(grad).__name__} {got.tolist()} vs {want.tolist()}, {err!r}")
