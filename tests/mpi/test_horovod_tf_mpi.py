"""hpcdl.horovod.tensorflow and .keras on several ranks: values against float64
references computed on every rank locally, eager and tf.function, gradients through
the collectives, object and variable broadcast, the tape and Keras fit against
hpcdl.tensorflow's own."""

import hashlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import hpcdl
import hpcdl.horovod.tensorflow as hvd
import hpcdl.horovod.tensorflow.keras as hvd_keras
import hpcdl.tensorflow as hvd_tf

from conftest import agree, collective, outcome
from helpers.keras_fit import LOCAL_BATCH, LOSS, fit, global_data, make_model

WORLD = MPI.COMM_WORLD


@pytest.fixture(autouse=True)
def initialized():
    hvd.init()
    yield


def rank_data(rank, dtype, shape=(13, 4)):
    values = np.random.default_rng(300 + rank).integers(-40, 40, shape).astype(np.float64)
    if dtype.is_floating:
        values += np.random.default_rng(400 + rank).random(shape)
    return values


def reference_sum(dtype, shape=(13, 4)):
    return sum(rank_data(r, dtype, shape) for r in range(WORLD.Get_size()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.int32, tf.int64])
def test_allreduce_eager_and_in_tf_function_against_float64_reference(dtype):
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    mine = tf.constant(rank_data(rank, dtype), dtype=dtype)

    @tf.function
    def reduced_in_graph(t):  # unnamed operations inside a tf.function
        return hvd.allreduce(t, op=hvd.Sum), hvd.allreduce(t)

    summed = collective(WORLD, hvd.allreduce, mine, op=hvd.Sum)
    average = collective(WORLD, hvd.allreduce, mine, name=f"avg.{dtype.name}")
    graph_sum, graph_avg = collective(WORLD, reduced_in_graph, mine)
    want_sum = reference_sum(dtype)
    want_avg = want_sum / size if dtype.is_floating else np.floor_divide(want_sum, size)
    tol = 1e-4 if dtype == tf.float32 else 1e-12
    ok = all(
        np.allclose(t.numpy().astype(np.float64), want, rtol=tol, atol=tol) and t.dtype == dtype
        for t, want in ((summed, want_sum), (average, want_avg), (graph_sum, want_sum), (graph_avg, want_avg))
    )
    agree(WORLD, ok, f"{dtype.name}: sum diff {np.abs(summed.numpy() - want_sum).max()}")


@pytest.mark.mpi(min_size=2)
def test_gradients_through_allreduce_and_broadcast():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()

    def run():
        x = tf.Variable(tf.fill([3], float(rank + 1)))
        z = tf.Variable(tf.fill([2], float(rank)))
        with tf.GradientTape(persistent=True) as tape:
            y = hvd.allreduce(x, op=hvd.Sum, name="grad.allreduce")
            w = hvd.broadcast(z, root_rank=1, name="grad.broadcast")
            loss_y, loss_w = tf.reduce_sum(y * (rank + 1)), tf.reduce_sum(w * (rank + 2))
        return y, tape.gradient(loss_y, x), w, tape.gradient(loss_w, z)

    y, x_grad, w, z_grad = collective(WORLD, run)
    ranks = np.arange(size)
    ok = np.allclose(y.numpy(), (ranks + 1).sum()) and np.allclose(x_grad.numpy(), (ranks + 1).sum())
    ok = ok and np.allclose(w.numpy(), 1.0) and np.allclose(z_grad.numpy(), (ranks + 2).sum() if rank == 1 else 0)
    agree(WORLD, ok, f"y {y}, dx {x_grad}, w {w}, dz {z_grad}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [tf.float32, tf.int8, tf.bool, tf.uint8, tf.bfloat16])
def test_broadcast_dtypes_variables_and_objects(dtype):
    rank, root = WORLD.Get_rank(), WORLD.Get_size() - 1

    def data(r):
        return tf.cast(np.random.default_rng(r).integers(0, 2, (5, 3)), dtype)

    got = collective(WORLD, hvd.broadcast, data(rank), root)
    variables = [tf.Variable(data(rank)), tf.Variable(tf.fill([4], float(rank)))]
    collective(WORLD, hvd.broadcast_variables, variables, root_rank=root)
    obj = collective(WORLD, hvd.broadcast_object, {"rank": rank, "dtype": dtype.name}, root_rank=root)
    ok = np.array_equal(got.numpy(), data(root).numpy()) and got.dtype == dtype
    ok = ok and np.array_equal(variables[0].numpy(), data(root).numpy()) and np.all(variables[1].numpy() == root)
    agree(WORLD, ok and obj == {"rank": root, "dtype": dtype.name}, f"{dtype.name} broadcast differs")


@pytest.mark.mpi(min_size=2)
def test_mismatched_shapes_raise_a_horovod_error_on_every_rank():
    _, error = outcome(hvd.allreduce, tf.ones([3 + (WORLD.Get_rank() == 1)]), name="tf.mismatch")
    agree(WORLD, isinstance(error, hvd.HorovodInternalError), repr(error))


def digest(model):
    return hashlib.sha1(b"".join(v.numpy().tobytes() for v in model.variables)).hexdigest()


def tape_steps(wrap):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = global_data(size)
    model, opt = make_model(), tf.keras.optimizers.SGD(0.5)
    share = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    for step in range(3):
        rows = slice(step * LOCAL_BATCH * size, (step + 1) * LOCAL_BATCH * size)
        with tf.GradientTape() as tape:
            loss = LOSS(y[rows][share], model(x[rows][share]))
        grads = wrap(tape).gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model


@pytest.mark.mpi(min_size=2)
def test_distributed_gradient_tape_equals_hpcdls_own():
    ours = collective(WORLD, tape_steps, hvd.DistributedGradientTape)
    theirs = collective(WORLD, tape_steps, lambda tape: hvd_tf.DistributedGradientTape(tape))
    digests = WORLD.allgather(digest(ours))
    agree(WORLD, digest(ours) == digest(theirs) and len(set(digests)) == 1, "tape results differ")


def quarter(array, rank, size, per_rank=LOCAL_BATCH):
    steps = len(array) // (per_rank * size)
    return array.reshape(steps, size, per_rank, *array.shape[1:])[:, rank].reshape(-1, *array.shape[1:])


@pytest.mark.mpi(min_size=2)
def test_keras_fit_with_horovod_callbacks_equals_hpcdls_own_fit():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = global_data(size)
    mine = quarter(x, rank, size), quarter(y, rank, size)
    ours = make_model(seed=rank)  # different on every rank: the callback starts all from rank 0's
    history = collective(
        WORLD,
        fit,
        ours,
        hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.5)),
        *mine,
        LOCAL_BATCH,
        epochs=2,
        callbacks=[
            hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0),
            hvd_keras.callbacks.MetricAverageCallback(),
        ],
    )
    theirs = make_model(seed=rank)
    own = collective(
        WORLD,
        fit,
        theirs,
        hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5)),
        *mine,
        LOCAL_BATCH,
        epochs=2,
        callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0), hvd_tf.MetricAverageCallback()],
    )
    losses = WORLD.allgather(history.history["loss"])
    ok = digest(ours) == digest(theirs) and history.history["loss"] == own.history["loss"]
    agree(WORLD, ok and all(loss == losses[0] for loss in losses), f"losses {losses}")


@pytest.mark.mpi(min_size=2)
def test_learning_rate_warmup_rises_from_a_size_th_to_the_initial_rate():
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    x, y = global_data(size)
    seen = []

    class Record(tf.keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            seen.append(float(self.model.optimizer.learning_rate.numpy()))

    steps = len(quarter(x, rank, size)) // LOCAL_BATCH
    collective(
        WORLD,
        fit,
        make_model(),
        hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(0.01)),
        quarter(x, rank, size),
        quarter(y, rank, size),
        LOCAL_BATCH,
        epochs=3,
        callbacks=[hvd_keras.callbacks.LearningRateWarmupCallback(0.8, warmup_epochs=2), Record()],
    )
    want = [0.8 / size * ((e + (b + 1) / steps) * (size - 1) / 2 + 1) for e in range(2) for b in range(steps)]
    want += [want[-1]] * steps  # after the warm-up the rate stays
    agree(WORLD, np.allclose(seen, want) and np.isclose(want[-1], 0.8), f"seen {seen}, want {want}")


@pytest.mark.mpi(min_size=4)
def test_process_sets_in_tensorflow():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    halves = [list(range(size // 2)), list(range(size // 2, size))]

    def run():
        sets = [hvd.add_process_set(ranks) for ranks in halves]
        mine = sets[0] if rank < size // 2 else sets[1]
        summed = hvd.allreduce(tf.constant([float(rank)]), op=hvd.Sum, process_set=mine)
        variable = tf.Variable([float(rank)])
        hvd.broadcast_variables([variable], root_rank=mine.ranks[0], process_set=mine)
        for s in sets:
            hvd.remove_process_set(s)
        return mine.ranks, summed, variable

    members, summed, variable = collective(WORLD, run)
    agree(
        WORLD, summed.numpy()[0] == sum(members) and variable.numpy()[0] == members[0], f"{members} {summed} {variable}"
    )


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dtype", [tf.float32, tf.float64, tf.int32, tf.int64, tf.int8])
def test_min_max_product_eager_and_in_tf_function(dtype):
    size, rank = WORLD.Get_size(), WORLD.Get_rank()

    def data(r):
        return np.random.default_rng(80 + r).integers(-2, 3, (3, 4)).astype(dtype.as_numpy_dtype)

    @tf.function
    def in_graph(t):
        return hvd.allreduce(t, op=hvd.Max), hvd.allreduce(t, op=hvd.Product)

    low = collective(WORLD, hvd.allreduce, tf.constant(data(rank)), op=hvd.Min, name=f"min.{dtype.name}")
    high, product = collective(WORLD, in_graph, tf.constant(data(rank)))
    stack = np.stack([data(r).astype(np.float64) for r in range(size)])
    ok = all(
        t.dtype == dtype and np.array_equal(t.numpy().astype(np.float64), want)
        for t, want in ((low, stack.min(0)), (high, stack.max(0)), (product, stack.prod(0)))
    )
    agree(WORLD, ok, f"{low} {high} {product}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("use_function", [False, True])
def test_allreduce_of_indexed_slices_allgathers_them(use_function):
    """hvd.allreduce(IndexedSlices): every rank's indices and values gathered in rank order
    (average: values / size; Sum: as gathered), densifying to the float64 sum/average."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    rng = np.random.default_rng(40 + rank)
    rows = rank + 1
    values, indices = rng.normal(size=(rows, 3)), rng.integers(0, 6, rows)
    slices = tf.IndexedSlices(
        tf.constant(values, tf.float32), tf.constant(indices, tf.int64), tf.constant([6, 3], tf.int64)
    )

    def both(s):
        return (
            hvd.allreduce(s, name=f"slices.avg.{use_function}"),
            hvd.allreduce(s, op=hvd.Sum, name=f"slices.sum.{use_function}"),
        )

    run = tf.function(both) if use_function else both
    average, summed = collective(WORLD, run, slices)
    everyone = WORLD.allgather((values, indices))
    want = np.zeros((6, 3))
    for v, i in everyone:
        np.add.at(want, i, v)
    got_sum = tf.convert_to_tensor(summed).numpy().astype(np.float64)
    got_avg = tf.convert_to_tensor(average).numpy().astype(np.float64)
    ok = (
        isinstance(summed, tf.IndexedSlices)
        and np.array_equal(summed.indices.numpy(), np.concatenate([i for _, i in everyone]))
        and np.allclose(got_sum, want, atol=1e-5)
        and np.allclose(got_avg, want / size, atol=1e-5)
        and len(set(WORLD.allgather(got_avg.tobytes()))) == 1
    )
    _, err = outcome(hvd.allreduce, slices, op=hvd.Max, name="slices.max")
    ok = ok and isinstance(err, ValueError) and "IndexedSlices" in str(err)
    agree(WORLD, ok, f"{np.max(np.abs(got_sum - want))}, {err!r}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("sparse_as_dense", [False, True])
def test_horovod_tape_passes_sparse_as_dense(sparse_as_dense):
    """hvd.DistributedGradientTape(sparse_as_dense=...): tf.gather's gradient stays IndexedSlices
    (gathered) or becomes dense, averaged over the ranks either way."""
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    table = tf.Variable(tf.zeros((4, 2)))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(tf.gather(table, [rank % 4]) * float(rank + 1))
    grad = collective(
        WORLD, hvd.DistributedGradientTape(tape, sparse_as_dense=sparse_as_dense).gradient, loss, [table]
    )[0]
    want = np.zeros((4, 2))
    for r in range(size):
        want[r % 4] += (r + 1) / size
    got = tf.convert_to_tensor(grad).numpy()
    ok = isinstance(grad, tf.IndexedSlices) != sparse_as_dense and np.allclose(got, want, atol=1e-6)
    agree(WORLD, ok, f"{type(grad).__name__} {got.tolist()} vs {want.tolist()}")


def test_grouped_allreduce_eager_in_tf_function_and_its_gradient():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    dtypes = [tf.float32, tf.float64, tf.int32]
    tensors = [tf.constant(rank_data(rank, d), dtype=d) for d in dtypes]

    @tf.function
    def in_graph(ts):
        return hvd.grouped_allreduce(ts, op=hvd.Sum)

    eager = collective(WORLD, hvd.grouped_allreduce, tensors)
    graph = collective(WORLD, in_graph, tensors)
    x = tf.Variable([float(rank + 1)] * 3, dtype=tf.float64)

    def gradient():
        with tf.GradientTape() as tape:
            a, b = hvd.grouped_allreduce([x, 2.0 * x], op=hvd.Sum)
            loss = tf.reduce_sum(a) + tf.reduce_sum(b)
        return tape.gradient(loss, x)

    grad = collective(WORLD, gradient)
    want = [reference_sum(d) for d in dtypes]
    averages = [w / size if d.is_floating else np.floor_divide(w, size) for w, d in zip(want, dtypes)]
    ok = (
        all(np.allclose(t.numpy(), a, rtol=1e-5) and t.dtype == d for t, a, d in zip(eager, averages, dtypes))
        and all(np.allclose(t.numpy(), w, rtol=1e-5) for t, w in zip(graph, want))
        and np.allclose(grad.numpy(), 3 * size)
    )
    agree(WORLD, ok, f"{[t.numpy().ravel()[:2] for t in eager]} {grad}")


def local_source_gradients(scale_local_gradients, in_function):
    """One tape step: w is shared (its gradient x_r averaged), b is this rank's own, of a
    shape that differs per rank (its gradient c_r, divided by size when scaled)."""
    rank = WORLD.Get_rank()
    x = tf.constant(rank_data(rank, tf.int64, (5,)))  # integers: float64 sums are exact
    c = tf.constant(np.arange(2.0 + rank) + 10 * rank)
    w, b = tf.Variable(tf.zeros(5, tf.float64)), tf.Variable(tf.zeros(2 + rank, tf.float64))

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * x) + tf.reduce_sum(b * c)
        tape = hvd.DistributedGradientTape(tape, scale_local_gradients=scale_local_gradients)
        tape.register_local_source(b)
        return tape.gradient(loss, [w, b])

    return (tf.function(step) if in_function else step)()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("in_function", [False, True])
@pytest.mark.parametrize("scale_local_gradients", [True, False])
def test_tape_keeps_a_registered_local_source_local(scale_local_gradients, in_function):
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    grad_w, grad_b = collective(WORLD, local_source_gradients, scale_local_gradients, in_function)
    want_w = reference_sum(tf.int64, (5,)) / size
    want_b = (np.arange(2.0 + rank) + 10 * rank) / (size if scale_local_gradients else 1)

    # where size is no power of two, the engine's average and a traced division by size
    # (TF may multiply by 1 / size) round once more than the reference's sum / size
    def close(got, want):
        return got.shape == want.shape and np.allclose(got, want, rtol=4 * np.finfo(np.float64).eps, atol=0)

    ok = close(grad_w.numpy(), want_w) and close(grad_b.numpy(), want_b)
    agree(WORLD, ok, f"w {grad_w.numpy()!r} vs {want_w!r}; b {grad_b.numpy()!r} vs {want_b!r}")


def fit_with_a_local_head(rank, size):
    """Keras fit where the output layer's bias is each rank's own: registered with the
    optimizer (not reduced) and the broadcast callback (not broadcast, nor its Adam state)."""
    x, y = global_data(size)
    model = make_model(seed=rank)
    model.build((None, 10))
    local = model.layers[-1].bias
    optimizer = hvd_keras.DistributedOptimizer(tf.keras.optimizers.Adam(0.01))
    optimizer.register_local_var(local)
    broadcast = hvd_keras.callbacks.BroadcastGlobalVariablesCallback(0)
    broadcast.register_local_var(local)
    fit(model, optimizer, quarter(x, rank, size), quarter(y, rank, size), LOCAL_BATCH, callbacks=[broadcast])
    local_state = [v for v in optimizer.variables if v.name.startswith(local.path.replace("/", "_") + "_")]
    shared_state = [v for v in optimizer.variables if all(v is not s for s in local_state)]
    shared = [v for v in model.variables if v is not local]
    return [v.numpy() for v in shared + shared_state], [local.numpy()], [v.numpy() for v in local_state]


@pytest.mark.mpi(min_size=2)
def test_keras_local_variable_is_neither_reduced_nor_broadcast():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    shared, local, slots = collective(WORLD, fit_with_a_local_head, rank, size)

    def digests(arrays):
        return WORLD.allgather(hashlib.sha1(b"".join(a.tobytes() for a in arrays)).hexdigest())

    # Adam's m and v of the local bias differ per rank only if its gradients were not reduced
    ok = len(set(digests(shared))) == 1 and len(set(digests(local))) == len(set(digests(slots))) == size
    agree(WORLD, ok and len(slots) == 2, f"shared {digests(shared)} local {digests(local)} slots {digests(slots)}")


@pytest.mark.mpi(min_size=2)
def test_keras_callbacks_and_optimizer_within_a_process_set():
    """Each half of the ranks trains its own model from its first member's weights
    (BroadcastGlobalVariablesCallback's root_rank a rank of init()'s communicator), its
    gradients and metrics averaged within the half."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    halves = [list(range(size // 2)), list(range(size // 2, size))]
    x, y = global_data(size)

    def run():
        sets = [hvd_keras.add_process_set(ranks) for ranks in halves]
        mine = sets[0] if rank < size // 2 else sets[1]
        model = make_model(seed=rank)
        history = fit(
            model,
            hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), process_set=mine),
            quarter(x, rank, size),
            quarter(y, rank, size),
            LOCAL_BATCH,
            epochs=2,
            callbacks=[
                hvd_keras.callbacks.BroadcastGlobalVariablesCallback(mine.ranks[0], process_set=mine),
                hvd_keras.callbacks.MetricAverageCallback(process_set=mine),
            ],
        )
        for s in sets:
            hvd_keras.remove_process_set(s)
        return mine.ranks, digest(model), history.history["loss"]

    members, weights, losses = collective(WORLD, run)
    seen = WORLD.allgather((members[0], weights, losses))
    by_set = {}
    for first, w, loss in seen:
        by_set.setdefault(first, set()).add((w, tuple(loss)))
    ok = all(len(v) == 1 for v in by_set.values()) and len({next(iter(v))[0] for v in by_set.values()}) == 2
    agree(WORLD, ok, f"{seen}")


@pytest.mark.mpi(min_size=2)
def test_best_model_checkpoint_saves_on_rank_0_only(tmp_path):
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    folder = WORLD.bcast(str(tmp_path) if rank == 0 else None)
    x, y = global_data(size)
    checkpoint = hvd_keras.callbacks.BestModelCheckpoint(monitor="loss", mode="min")
    checkpoint.filepath = f"{folder}/best.{rank}.keras"  # each rank its own name: only rank 0's may exist
    model = make_model()
    history = collective(
        WORLD,
        fit,
        model,
        hvd_keras.DistributedOptimizer(tf.keras.optimizers.SGD(0.5)),
        quarter(x, rank, size),
        quarter(y, rank, size),
        LOCAL_BATCH,
        epochs=3,
        callbacks=[hvd_keras.callbacks.MetricAverageCallback(), checkpoint],
    )
    WORLD.Barrier()
    saved = sorted(os.listdir(folder)) if rank == 0 else None
    best_loss = float(checkpoint.best) if rank == 0 else None
    ok = rank != 0 or (saved == ["best.0.keras"] and best_loss == min(history.history["loss"]))
    agree(WORLD, ok, f"{saved} best {best_loss} losses {history.history['loss']}")


@pytest.mark.mpi(min_size=2)
def test_unnamed_allreduce_from_tf_data_threads_named_differently_per_rank():
    """hpcdl.allreduce without a name inside a tf.data map's numpy_function: TF runs it on
    its own pool threads, not named alike on every rank. The operations pair by submission
    order (one element at a time), each the float64 reference."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    threads = set()

    def reduce(i):
        threads.add(threading.current_thread().name)
        values = rank_data(rank, tf.int64, (6,)) + i
        hpcdl.allreduce(values, op="sum")
        return values

    data = tf.data.Dataset.range(4).map(lambda i: tf.numpy_function(reduce, [i], tf.float64))
    results, error = outcome(lambda: [t.numpy() for t in data])
    right = error is None and all(
        np.array_equal(r, reference_sum(tf.int64, (6,)) + size * i) for i, r in enumerate(results)
    )
    agree(WORLD, right and threading.current_thread().name not in threads, f"{error!r} threads {threads}")


@pytest.mark.mpi(min_size=2)
def test_unnamed_eager_allreduce_from_pool_threads_named_differently_per_rank():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()

    def reduce(i):
        return outcome(hvd.allreduce, tf.constant(rank_data(rank, tf.int64, (4, 3)) + i), op=hvd.Sum)

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"rank{rank}-input") as pool:
        results = [pool.submit(reduce, i).result(120) for i in range(4)]
    errors = [err for _, err in results if err is not None]
    right = not errors and all(
        np.array_equal(out.numpy(), reference_sum(tf.int64, (4, 3)) + size * i) for i, (out, _) in enumerate(results)
    )
    agree(WORLD, right, f"{errors!r}")


@pytest.mark.mpi(min_size=2)
def test_join_returns_the_last_rank_as_an_int32_tensor_while_allreduce_sees_zeros():
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    ok = True
    if rank == size - 1:  # the others have joined: their engines add zeros
        out = hvd.allreduce(tf.constant([2.0, 3.0], dtype=tf.float64), op=hvd.Sum, name="tf.join.sum")
        ok = np.array_equal(out.numpy(), [2.0, 3.0])
    last = hvd.join()
    agree(WORLD, ok and last.dtype == tf.int32 and int(last) == size - 1, f"{last!r}, ok={ok}")


@pytest.mark.mpi(min_size=2)
def test_a_tape_made_each_eager_step_keeps_reducing_while_ranks_have_joined():
    """Horovod's TF2 idiom, a DistributedGradientTape made anew each eager step, with
    rank r having r + 1 batches: the tape's first-use check runs each step through the
    engine, where joined ranks take part, so the ranks still training go on; each step's
    sum is the live ranks' float64 sum."""
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    w = tf.Variable(tf.zeros((3, 2), tf.float64))
    sums = []
    for step in range(rank + 1):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * float(rank + 1 + step))  # its gradient: rank + 1 + step everywhere
        (grad,) = hvd.DistributedGradientTape(tape, op=hvd.Sum).gradient(loss, [w])
        sums.append(grad.numpy())
    last = int(hvd.join())
    expected = [float(sum(r + 1 + step for r in range(step, size))) for step in range(rank + 1)]
    ok = last == size - 1 and all(np.array_equal(s, np.full((3, 2), e)) for s, e in zip(sums, expected))
    agree(WORLD, ok, f"last={last}, sums={[s[0, 0] for s in sums]}, expected={expected}")


@pytest.mark.mpi(min_size=3)
def test_tapes_differing_across_the_live_ranks_raise_there_while_a_rank_has_joined():
    """Rank 0 has joined; the others' tapes differ in a gradient's shape: every live rank
    raises MismatchError naming the live ranks' shapes (no rank waits for rank 0)."""
    rank = WORLD.Get_rank()
    err = None
    if rank > 0:
        w = tf.Variable(tf.zeros((2, rank), tf.float32))
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w)
        _, err = outcome(hvd_tf.DistributedGradientTape(tape, name="tf.join.mismatch").gradient, loss, [w])
    last = int(hvd.join())
    ok = last != 0 and (
        rank == 0
        or (
            isinstance(err, hpcdl.MismatchError)
            and "'gradient.0' is float32[2, 1] on rank 1 but float32[2, 2] on rank 2" in str(err)
        )
    )
    agree(WORLD, ok, f"last={last}, {err!r}")
