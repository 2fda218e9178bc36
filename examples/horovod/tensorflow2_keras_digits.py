"""Horovod's Keras MNIST example, on hpcdl by changing only the import, with
scikit-learn's bundled 8x8 digits in place of MNIST (no download).

    mpiexec -n 2 python examples/horovod/tensorflow2_keras_digits.py --epochs 4

Written as a Horovod script (``import hpcdl.horovod.tensorflow.keras as hvd``):
the learning rate scaled by the number of ranks, DistributedOptimizer, the
broadcast and metric-average callbacks, checkpoints on rank 0 only.
"""

import argparse
import os
import tempfile

import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import hpcdl.horovod.tensorflow.keras as hvd

parser = argparse.ArgumentParser(description="Keras digits example")
parser.add_argument("--epochs", type=int, default=6)
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--checkpoint-dir", default=None, help="where rank 0 saves checkpoints (default: a temp dir)")
args = parser.parse_args()

hvd.init()
tf.config.threading.set_intra_op_parallelism_threads(1)

digits = load_digits()
x = (digits.images[..., None] / 16.0).astype(np.float32)
y = digits.target.astype(np.int64)
order = np.random.default_rng(1234).permutation(len(y))
x, y = x[order], y[order]
x_test, y_test, x, y = x[:300], y[:300], x[300:], y[300:]
# each rank trains on its own shard
x, y = x[hvd.rank() :: hvd.size()], y[hvd.rank() :: hvd.size()]

tf.keras.utils.set_random_seed(hvd.rank())  # different initial weights: the broadcast callback aligns them
model = tf.keras.Sequential(
    [
        tf.keras.Input((8, 8, 1)),
        tf.keras.layers.Conv2D(16, 3, activation="relu", padding="same"),
        tf.keras.layers.Flatten(),
        tf.keras.layers.Dense(64, activation="relu"),
        tf.keras.layers.Dense(10),
    ]
)

# Horovod: scale the learning rate by the number of ranks, wrap the optimizer.
optimizer = hvd.DistributedOptimizer(tf.keras.optimizers.Adam(0.001 * hvd.size()))
model.compile(
    optimizer=optimizer, loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"]
)

callbacks = [
    # Horovod: start every rank from rank 0's weights, average the epoch's metrics over the ranks.
    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
    hvd.callbacks.MetricAverageCallback(),
]
checkpoint_dir = args.checkpoint_dir or tempfile.mkdtemp(prefix="hvd-digits-")
if hvd.rank() == 0:  # Horovod: checkpoints on rank 0 only
    callbacks.append(tf.keras.callbacks.ModelCheckpoint(os.path.join(checkpoint_dir, "checkpoint-{epoch}.keras")))

history = model.fit(
    x, y, batch_size=args.batch_size, epochs=args.epochs, callbacks=callbacks, verbose=2 if hvd.rank() == 0 else 0
)
loss, accuracy = model.evaluate(x_test, y_test, verbose=0)
accuracy = float(hvd.allreduce(np.array([accuracy], np.float32), name="test_accuracy")[0])
if hvd.rank() == 0:
    print(f"final training loss {history.history['loss'][-1]:.4f} (averaged over {hvd.size()} ranks)")
    print(f"test accuracy {accuracy:.4f}")
