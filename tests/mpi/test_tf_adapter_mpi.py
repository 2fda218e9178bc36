"""hpcdl.tensorflow under MPI: DistributedGradientTape equal to one process on the
concatenated batch, broadcasts, the Keras callback, and bad input on every rank."""

import hashlib

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


@pytest.mark.mpi(min_size=2)
def test_mismatched_tensor_shapes_raise_on_every_rank():
    """hpcdl.allreduce of a TF tensor: [17, 1311] on rank 0 against [17, 23, 57] (the same count)."""
    rank = WORLD.Get_rank()
    t = tf.ones((17, 1311) if rank == 0 else (17, 23, 57))
    _, err = outcome(hpcdl.allreduce, t, name="tf.shape")
    ok = isinstance(err, hpcdl.MismatchError) and "shape differs" in str(err) and "[17, 1311] on rank 0" in str(err)
    agree(WORLD, ok, repr(err))
