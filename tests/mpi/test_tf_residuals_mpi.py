"""Error-feedback residuals of DistributedGradientTape and the Keras DistributedOptimizer in a
tf.train.Checkpoint (hpcdl.tensorflow.residuals): a resumed run continues bit for bit, a
checkpoint of another model raises on every rank before anything is sent, and a new Keras
optimizer starts without the state of an earlier one of its name."""

import hashlib
import io

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import hpcdl
import hpcdl.tensorflow as hvd_tf
from hpcdl.compression import Int8, PowerSGD, TopK

from conftest import agree, collective, outcome
from helpers.tf_adapter import LOSS, full_batch, make_model

pytestmark = pytest.mark.mpi(min_size=2)

WORLD = MPI.COMM_WORLD
LR, PER_RANK = 0.5, 4
CODECS = {"topk": TopK(0.05), "int8": Int8()}


def digest(model):
    return hashlib.sha1(b"".join(v.numpy().tobytes() for v in model.variables)).hexdigest()


def mine(step):
    x, y = full_batch(step, PER_RANK, WORLD.Get_size())
    rows = slice(WORLD.Get_rank() * PER_RANK, (WORLD.Get_rank() + 1) * PER_RANK)
    return x[rows], y[rows]


class TapeRun:
    """A custom loop: DistributedGradientTape named ``name``, its residuals by residual_state."""

    def __init__(self, codec, name, use_function, model):
        self.model, self.opt = model, tf.keras.optimizers.SGD(LR)
        self.name = name

        def step_fn(x, y):
            with tf.GradientTape() as tape:
                loss = LOSS(y, self.model(x))
            tape = hvd_tf.DistributedGradientTape(tape, compression=codec, name=name)
            grads = tape.gradient(loss, self.model.trainable_variables)
            self.opt.apply_gradients(zip(grads, self.model.trainable_variables))

        self.step_fn = tf.function(step_fn) if use_function else step_fn
        hvd_tf.DistributedGradientTape(tf.GradientTape(), compression=codec, name=name)  # the state exists

    def steps(self, first, count):
        for step in range(first, first + count):
            self.step_fn(*mine(step))

    def checkpoint(self):
        return tf.train.Checkpoint(residuals=hvd_tf.residual_state(self.name))


class FitRun:
    """model.fit with the Keras DistributedOptimizer named ``name``: tf.train.Checkpoint(optimizer=...)."""

    def __init__(self, codec, name, use_function, model):
        self.model = model
        self.opt = hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(LR), compression=codec, name=name)
        model.compile(optimizer=self.opt, loss=LOSS, run_eagerly=not use_function)

    def steps(self, first, count):
        for step in range(first, first + count):
            x, y = mine(step)
            self.model.fit(x, y, batch_size=PER_RANK, epochs=1, verbose=0, shuffle=False)

    def checkpoint(self):
        return tf.train.Checkpoint(optimizer=self.opt)


RUNS = {"tape-eager": (TapeRun, False), "tape-function": (TapeRun, True), "fit": (FitRun, True)}


@pytest.mark.parametrize("codec", sorted(CODECS))
@pytest.mark.parametrize("path", sorted(RUNS))
def test_residuals_survive_a_checkpoint_round_trip(path, codec, tmp_path_factory):
    """3 steps, a checkpoint, 2 more: the same 2 steps from the checkpoint under a new name give
    the same bits; without restoring the residuals they do not."""
    kind, use_function = RUNS[path]
    tag = f"tfres.{path}.{codec}"
    run = kind(CODECS[codec], f"{tag}.first", use_function, make_model())
    collective(WORLD, run.steps, 0, 3)
    weights = run.model.get_weights()
    prefix = str(tmp_path_factory.mktemp(f"residuals{WORLD.Get_rank()}") / "ckpt")
    path_written = run.checkpoint().write(prefix)
    saved = hpcdl.compression.residual(f"{tag}.first.float32")
    collective(WORLD, run.steps, 3, 2)
    straight = digest(run.model)

    outcomes = {}
    for restore in (True, False):
        model = make_model()
        model.set_weights(weights)
        resumed = kind(CODECS[codec], f"{tag}.{restore}", use_function, model)
        if restore:
            resumed.checkpoint().read(path_written).assert_existing_objects_matched()
        collective(WORLD, resumed.steps, 3, 2)
        outcomes[restore] = digest(model) == straight
    ranks_identical = len(set(WORLD.allgather(straight))) == 1
    agree(
        WORLD,
        outcomes == {True: True, False: False} and saved is not None and np.any(saved) and ranks_identical,
        f"resumed == uninterrupted with the residuals {outcomes[True]}, without {outcomes[False]}; "
        f"saved residual non-zero: {saved is not None and bool(np.any(saved))}; ranks identical {ranks_identical}",
    )


def test_a_checkpoint_of_another_model_raises_before_anything_is_sent(tmp_path_factory):
    """Restored into a tape that reduces other shapes (one more layer), the residual raises
    ValueError on every rank at the next step, eagerly, before any allreduce is submitted."""
    first = TapeRun(TopK(0.05), "tfres.misfit.saver", False, make_model())
    collective(WORLD, first.steps, 0, 2)
    prefix = str(tmp_path_factory.mktemp(f"misfit{WORLD.Get_rank()}") / "ckpt")
    written = first.checkpoint().write(prefix)

    other = TapeRun(TopK(0.05), "tfres.misfit.loader", False, make_model(extra=True))
    other.checkpoint().read(written)
    hpcdl.stats(reset=True)
    _, err = outcome(other.steps, 2, 1)
    ops = sum(codec["ops"] for codec in hpcdl.stats().get("allreduce", {}).values())
    named = isinstance(err, ValueError) and "tfres.misfit.loader.float32" in str(err) and "shapes" in str(err)
    agree(WORLD, named and ops == 0, f"{err!r}, then {ops} allreduces")


@pytest.mark.parametrize("codec", [TopK(0.05), PowerSGD(rank=1, warmup_steps=1)], ids=str)
def test_a_new_keras_optimizer_named_like_an_earlier_one_starts_afresh(codec):
    """model.fit twice with a DistributedOptimizer of one name, each on a fresh model, trains
    as with a name never used: neither the residuals nor PowerSGD's steps and Q carry over."""

    def two_steps(name):
        run = FitRun(codec, name, True, make_model())
        run.steps(0, 2)
        return digest(run.model)

    first = collective(WORLD, two_steps, f"tfres.reused.{codec.name}")
    again = collective(WORLD, two_steps, f"tfres.reused.{codec.name}")
    fresh = collective(WORLD, two_steps, f"tfres.fresh.{codec.name}")
    agree(WORLD, first == again == fresh, f"first {first}, again {again}, fresh {fresh}")


@pytest.mark.parametrize("blob", [b"not an npz archive", b"PK\x03\x04 truncated", "npz without shapes"])
def test_an_unreadable_residual_blob_raises_a_named_error(blob):
    """What a restore hands residual_state is read by one parser: bytes that are not its npz
    raise ValueError naming the state, not numpy's or zipfile's error."""
    if blob == "npz without shapes":
        buffer = io.BytesIO()
        np.savez(buffer, float32=np.zeros(3, np.float32))
        blob = buffer.getvalue()
    hvd_tf.DistributedGradientTape(tf.GradientTape(), compression=TopK(0.05), name="tfres.unreadable")
    state = hvd_tf.residual_state("tfres.unreadable")
    _, err = outcome(state._restore_from_tensors, {"residuals": tf.constant(blob)})
    agree(WORLD, isinstance(err, ValueError) and "'tfres.unreadable'" in str(err), repr(err))
