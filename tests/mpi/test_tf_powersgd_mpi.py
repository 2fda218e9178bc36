"""PowerSGD through DistributedGradientTape (eager and tf.function) and the Keras
DistributedOptimizer (model.fit) on several ranks: training against the float64 reference
of the documented semantics (the world and a split into halves), bitwise identity across
ranks, the dense warm-up, a tf.train.Checkpoint round trip of its state, and uneven batches
under hpcdl.join."""

import hashlib

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import hpcdl
import hpcdl.tensorflow as hvd_tf
from hpcdl.compression import PowerSGD

from conftest import agree, collective
from helpers.powersgd import Reference
from helpers.tf_adapter import LOSS, full_batch, make_model

WORLD = MPI.COMM_WORLD
LR, PER_RANK, STEPS = 0.5, 4, 4


def digest(model):
    return hashlib.sha1(b"".join(v.numpy().tobytes() for v in model.variables)).hexdigest()


def mine(step, comm):
    x, y = full_batch(step, PER_RANK, comm.Get_size())
    rows = slice(comm.Get_rank() * PER_RANK, (comm.Get_rank() + 1) * PER_RANK)
    return x[rows], y[rows]


def train_tape(comm, codec, name, use_function, steps=STEPS, model=None, first=0):
    model = make_model() if model is None else model
    opt = tf.keras.optimizers.SGD(LR)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        tape = hvd_tf.DistributedGradientTape(tape, compression=codec, comm=comm, name=name)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))

    step_fn = tf.function(step_fn) if use_function else step_fn
    for step in range(first, first + steps):
        step_fn(*mine(step, comm))
    return model


def train_fit(comm, codec, name):
    model = make_model()
    model.compile(
        optimizer=hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(LR), compression=codec, comm=comm, name=name),
        loss=LOSS,
    )
    for step in range(STEPS):  # one batch per fit call: the batches of the reference
        x, y = mine(step, comm)
        model.fit(x, y, batch_size=PER_RANK, epochs=1, verbose=0, shuffle=False)
    return model


def reference(size, codec, paths, steps=STEPS):
    """The same training in float64 with numpy, every rank's gradient computed here; ``paths``
    name make_model's trainable variables (their PowerSGD keys) in order."""
    weights = dict(zip(paths, (v.numpy().astype(np.float64) for v in make_model().trainable_variables)))
    shapes = {k: codec.matrix_shape(w.shape) for k, w in weights.items() if codec.compresses(w.shape)}
    ref = Reference(shapes, codec.rank, codec.seed, size)
    for step in range(steps):
        x, y = full_batch(step, PER_RANK, size)
        grads = []
        for r in range(size):
            rows = slice(r * PER_RANK, (r + 1) * PER_RANK)
            grads.append(dict(zip(paths, _gradients(list(weights.values()), x[rows].astype(np.float64), y[rows]))))
        for k in weights:
            if size > 1 and step >= codec.warmup_steps and k in shapes:
                approx, _ = ref.step(k, [g[k].reshape(shapes[k]) for g in grads])
                update = approx.reshape(weights[k].shape)
            else:
                update = sum(g[k] for g in grads) / size
            weights[k] = weights[k] - LR * update
    return weights


def _gradients(weights, x, y):
    """Gradients of make_model's (Dense tanh, Dense) mean cross-entropy in float64, in the
    order of its weights (kernel, bias, kernel, bias)."""
    vs = [tf.Variable(w) for w in weights]
    with tf.GradientTape() as tape:
        logits = tf.tanh(x @ vs[0] + vs[1]) @ vs[2] + vs[3]
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(y, logits))
    return [g.numpy() for g in tape.gradient(loss, vs)]


def max_difference(model, weights):
    return max(float(np.max(np.abs(v.numpy() - weights[v.path]))) for v in model.trainable_variables)


@pytest.fixture(params=["world", "halves"])
def group(request):
    if request.param == "world":
        yield WORLD
        return
    comm = WORLD.Split(WORLD.Get_rank() % 2)
    yield comm
    comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("path", ["eager", "function", "fit"])
def test_training_matches_the_float64_reference_with_the_same_bits_on_every_rank(group, path):
    codec = PowerSGD(rank=2, warmup_steps=1, seed=3)
    name = f"tfpsgd.{path}.{'world' if group is WORLD else 'halves'}"
    if path == "fit":
        got = collective(WORLD, train_fit, group, codec, name)
    else:
        got = collective(WORLD, train_tape, group, codec, name, path == "function")
    diff = max_difference(got, reference(group.Get_size(), codec, [v.path for v in got.trainable_variables]))
    digests = group.allgather(digest(got))
    compressed = group.Get_size() == 1 or bool(hvd_tf.powersgd_state(name).q)
    agree(
        WORLD,
        diff < 1e-4 and len(set(digests)) == 1 and compressed,
        f"max diff {diff} to the float64 reference, {len(set(digests))} distinct results",
    )


@pytest.mark.mpi(min_size=2)
def test_warmup_steps_equal_dense_training():
    warm = collective(WORLD, train_tape, WORLD, PowerSGD(rank=1, warmup_steps=STEPS), "tfpsgd.warm", False)
    dense = collective(WORLD, train_tape, WORLD, None, "tfpsgd.dense", False)
    state = hvd_tf.powersgd_state("tfpsgd.warm")
    untouched = all(not np.any(r.numpy()) for r in state.residual.values())
    agree(
        WORLD,
        digest(warm) == digest(dense) and int(state.steps.numpy()) == STEPS and untouched,
        "the warm-up differs from dense training or left a residual",
    )


@pytest.mark.mpi(min_size=2)
def test_checkpoint_round_trip_resumes_bit_for_bit(tmp_path_factory):
    """Steps 3 and 4 from a state restored (before its first step: Q and the residuals are
    restored as they are made) equal them with the state that was saved."""
    codec = PowerSGD(rank=1, warmup_steps=1)
    model = collective(WORLD, train_tape, WORLD, codec, "tfpsgd.first", False, steps=3)
    weights = model.get_weights()
    prefix = str(tmp_path_factory.mktemp(f"ckpt{WORLD.Get_rank()}") / "psgd")
    path = tf.train.Checkpoint(powersgd=hvd_tf.powersgd_state("tfpsgd.first")).write(prefix)
    collective(WORLD, train_tape, WORLD, codec, "tfpsgd.first", False, steps=2, model=model, first=3)
    straight = digest(model)

    model.set_weights(weights)
    hvd_tf.DistributedGradientTape(tf.GradientTape(), compression=codec, name="tfpsgd.resumed")
    fresh = hvd_tf.powersgd_state("tfpsgd.resumed")
    tf.train.Checkpoint(powersgd=fresh).read(path)
    collective(WORLD, train_tape, WORLD, codec, "tfpsgd.resumed", False, steps=2, model=model, first=3)
    agree(
        WORLD,
        digest(model) == straight and int(fresh.steps.numpy()) == 5,
        f"resuming from the checkpoint changed the training (steps {int(fresh.steps.numpy())})",
    )


def _uneven_steps(size, epoch):
    """Rank r's steps in an epoch: 2 + r, then 2 + (size - 1 - r): each rank joins first once."""
    return [2 + (r if epoch % 2 == 0 else size - 1 - r) for r in range(size)]


def _rows(epoch, step, rank, size):
    x, y = full_batch(10 * epoch + step, PER_RANK, size)
    rows = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    return x[rows], y[rows]


def train_uneven_with_join(comm, codec, name, use_function, epochs=2):
    """Each rank trains its uneven steps through the tape, joins, and takes the variables of the
    rank that joined last. Returns the model and each epoch's join result."""
    rank, size = comm.Get_rank(), comm.Get_size()
    model, opt = make_model(), tf.keras.optimizers.SGD(LR)

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        tape = hvd_tf.DistributedGradientTape(tape, compression=codec, comm=comm, name=name)
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    step_fn = tf.function(step_fn) if use_function else step_fn
    lasts = []
    for epoch in range(epochs):
        for step in range(_uneven_steps(size, epoch)[rank]):
            step_fn(*_rows(epoch, step, rank, size))
        lasts.append(hpcdl.join(comm))
        hvd_tf.broadcast_variables(model.variables, root=lasts[-1], comm=comm)
    return model, lasts


def uneven_reference(size, codec, paths, epochs=2):
    """The join training in float64: a joined rank's gradient is zero (the averages still divide
    by every rank) and its residual stays; the warm-up and Q follow the steps reduced."""
    weights = dict(zip(paths, (v.numpy().astype(np.float64) for v in make_model().trainable_variables)))
    shapes = {k: codec.matrix_shape(w.shape) for k, w in weights.items() if codec.compresses(w.shape)}
    ref = Reference(shapes, codec.rank, codec.seed, size)
    reduced = 0
    for epoch in range(epochs):
        steps = _uneven_steps(size, epoch)
        for step in range(max(steps)):
            live = {r for r in range(size) if steps[r] > step}
            grads = {}
            for r in live:
                x, y = _rows(epoch, step, r, size)
                grads[r] = dict(zip(paths, _gradients(list(weights.values()), x.astype(np.float64), y)))
            for k in weights:
                if reduced >= codec.warmup_steps and k in shapes:
                    g = [grads[r][k].reshape(shapes[k]) if r in live else np.zeros(shapes[k]) for r in range(size)]
                    update = ref.step(k, g, live)[0].reshape(weights[k].shape)
                else:
                    update = sum(grads[r][k] for r in live) / size
                weights[k] = weights[k] - LR * update
            reduced += 1
    return weights, reduced


@pytest.mark.mpi(min_size=2)
def test_uneven_batches_under_join_in_a_tf_function_match_the_float64_reference():
    """A warm-up that some ranks finish before they join and others after: after each join
    every rank takes the last rank's step count and Q (else the next epoch would stall on the
    warm-up or disagree on Q). Two epochs against the float64 reference."""
    # On 2 ranks rank 0 joins inside the warm-up and rank 1 after it (the stall case). On more
    # the warm-up ends with every rank live: the tape's first check of the factors' shapes
    # (mpi4py, once per signature) cannot run with joined ranks (a known limit, not PowerSGD's).
    codec = PowerSGD(rank=1, warmup_steps=3 if WORLD.Get_size() == 2 else 1, seed=2)
    name = "tfpsgd.join"
    model, lasts = collective(WORLD, train_uneven_with_join, WORLD, codec, name, True)
    weights, reduced = uneven_reference(WORLD.Get_size(), codec, [v.path for v in model.trainable_variables])
    diff = max_difference(model, weights)
    steps = int(hvd_tf.powersgd_state(name).steps.numpy())
    counted = steps == reduced or WORLD.Get_rank() != lasts[-1]  # the others take it at their next step
    size = WORLD.Get_size()
    agree(
        WORLD,
        diff < 1e-4 and lasts == [size - 1, 0] and counted,
        f"max difference {diff} to the float64 reference; joins returned {lasts}; steps {steps} of {reduced}",
    )
