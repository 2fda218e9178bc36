"""hpcdl.tensorflow: DistributedGradientTape (eager and tf.function), broadcasts, Keras callback.

Single process here; tests/mpi/test_tf_adapter_mpi.py runs the adapter on several ranks.
"""

import numpy as np
import pytest
import tensorflow as tf
from mpi4py import MPI

import hpcdl.compression
import hpcdl.tensorflow as hvd_tf

from conftest import ROOT
from helpers.tf_adapter import max_difference, train_distributed, train_reference


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


def test_tf_example_learns_the_digits(tmp_path):
    """examples/train_tf.py end to end in one process: pack, prefetch through tf.data, train, report."""
    import json
    import os
    import re
    import subprocess
    import sys

    root = ROOT
    env = {**os.environ, "PYTHONPATH": root, "TMPDIR": str(tmp_path)}
    metrics = tmp_path / "metrics.jsonl"
    run = subprocess.run(
        [
            sys.executable,
            os.path.join(root, "examples", "train_tf.py"),
            "--epochs",
            "3",
            "--compression",
            "int8",
            "--metrics",
            str(metrics),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    epochs = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [e["epoch"] for e in epochs] == [0, 1, 2] and epochs[-1]["test_acc"] > 0.6, run.stdout
    assert all(e["stall_s"] >= 0 and e["samples_per_s"] > 0 for e in epochs), epochs
    assert len(re.findall(r"epoch +\d+ .* stall \d+\.\d+ s \(", run.stdout)) == 3, run.stdout


def test_powersgd_on_one_rank_leaves_the_gradients_exact_and_refuses_sum_and_other_settings():
    codec = hpcdl.compression.PowerSGD(rank=1, warmup_steps=0)
    var = tf.Variable(tf.reshape(tf.range(12, dtype=tf.float32), (4, 3)), name="w")
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(var * var)
    grads = hvd_tf.DistributedGradientTape(tape, compression=codec, comm=MPI.COMM_SELF, name="psgd.one").gradient(
        loss, [var]
    )
    assert np.array_equal(grads[0].numpy(), 2 * var.numpy())
    with pytest.raises(ValueError, match="op must be 'average'"):
        hvd_tf.DistributedGradientTape(tape, compression=codec, op="sum", comm=MPI.COMM_SELF, name="psgd.sum")
    with pytest.raises(ValueError, match="give this tape or optimizer another name"):
        hvd_tf.DistributedGradientTape(
            tape, compression=hpcdl.compression.PowerSGD(rank=2), comm=MPI.COMM_SELF, name="psgd.one"
        )
