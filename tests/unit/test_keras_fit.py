"""hpcdl.tensorflow under Keras model.fit: DistributedOptimizer, the broadcast and metric-average callbacks.

Single process here; tests/mpi/test_keras_fit_mpi.py runs fit on several ranks.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import hpcdl
import hpcdl.tensorflow as hvd_tf

from conftest import ROOT, outcome
from helpers.keras_fit import LOCAL_BATCH, LOSS, fit, global_data, make_model, max_difference, reference


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


def test_a_model_saved_while_training_loads_with_its_optimizer_wrapped_again(tmp_path):
    """A .keras file names the optimizer "DistributedSGD": hvd_tf.load_model rebuilds it (state
    included) wrapped with the settings given; inference loads anywhere without compiling."""
    x, y = np.ones((8, 4), np.float32), np.ones((8, 2), np.float32)
    model = tf.keras.Sequential([tf.keras.Input((4,)), tf.keras.layers.Dense(2)])
    model.compile(
        optimizer=hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.1, momentum=0.9), comm=MPI.COMM_SELF),
        loss="mse",
    )
    model.fit(x, y, epochs=2, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    _, plain_load = outcome(tf.keras.models.load_model, path)
    loaded = hvd_tf.load_model(path, compression=hpcdl.compression.FP16(), comm=MPI.COMM_SELF)
    saved_state = [v.numpy() for v in model.optimizer.variables]
    loaded_state = [v.numpy() for v in loaded.optimizer.variables]
    loaded.fit(x, y, epochs=1, verbose=0)
    inference = tf.keras.models.load_model(path, compile=False)
    assert isinstance(plain_load, TypeError) and "DistributedSGD" in str(plain_load)
    assert type(loaded.optimizer).__name__ == "DistributedSGD" and loaded.optimizer.momentum == 0.9
    assert str(loaded.optimizer._hpcdl_allreduce.compression) == "fp16"
    assert any(np.any(v != 0) for v in saved_state[1:]), "the momentum was never written"
    assert all(np.array_equal(a, b) for a, b in zip(saved_state, loaded_state))
    assert int(loaded.optimizer.iterations) == 3
    assert np.array_equal(inference.predict(x, verbose=0), model.predict(x, verbose=0))


@pytest.mark.parametrize("as_dataset,run_eagerly", [(False, False), (True, False), (False, True)])
def test_single_process_fit_equals_plain_fit(as_dataset, run_eagerly):
    x, y = global_data(1)
    got = make_model()
    fit(
        got,
        hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), comm=MPI.COMM_SELF),
        x,
        y,
        LOCAL_BATCH,
        as_dataset=as_dataset,
        run_eagerly=run_eagerly,
    )
    assert max_difference(got, reference(1)) < 1e-6


def test_loss_scaling_wraps_the_reduction_not_the_other_way_round():
    """The LossScaleOptimizer's finiteness check must see the reduced gradients (the same on every rank)."""
    x, y = global_data(1)
    right = make_model()
    opt = hvd_tf.DistributedOptimizer(
        tf.keras.optimizers.LossScaleOptimizer(tf.keras.optimizers.SGD(0.5)), comm=MPI.COMM_SELF
    )
    fit(right, opt, x, y, LOCAL_BATCH, callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0, comm=MPI.COMM_SELF)])
    assert max_difference(right, reference(1)) < 1e-5
    wrong = make_model()
    wrapped = tf.keras.optimizers.LossScaleOptimizer(
        hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.5), comm=MPI.COMM_SELF)
    )
    with pytest.raises(ValueError, match=r"DistributedOptimizer\(LossScaleOptimizer\(opt\)\)"):
        fit(
            wrong,
            wrapped,
            x,
            y,
            LOCAL_BATCH,
            callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0, comm=MPI.COMM_SELF)],
        )


def test_xla_compiled_fit_is_refused_with_a_clear_error():
    model = make_model()
    model.compile(
        optimizer=hvd_tf.DistributedOptimizer(tf.keras.optimizers.SGD(0.1), comm=MPI.COMM_SELF),
        loss=LOSS,
        jit_compile=True,
    )
    x, y = global_data(1)
    with pytest.raises(ValueError, match="jit_compile=False"):
        model.fit(x, y, batch_size=LOCAL_BATCH, verbose=0)


def test_keras_fit_example_learns_the_digits(tmp_path):
    """examples/train_keras_fit.py in one process: pack, prefetch through tf.data, model.fit, report."""
    root = ROOT
    env = {**os.environ, "PYTHONPATH": root, "TMPDIR": str(tmp_path)}
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "examples", "train_keras_fit.py"),
            "--epochs",
            "3",
            "--compression",
            "int8",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    accuracies = [float(a) for a in re.findall(r"test acc (\d\.\d+)", run.stdout)]
    assert len(accuracies) == 3 and accuracies[-1] > 0.6, run.stdout
    assert len(re.findall(r"epoch +\d+ .* stall \d+\.\d+ s \(", run.stdout)) == 3, run.stdout
