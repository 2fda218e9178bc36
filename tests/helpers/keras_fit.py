"""Models, data and fits shared by the single-process and MPI Keras tests."""

import numpy as np
import tensorflow as tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)
LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
STEPS, LOCAL_BATCH = 4, 6


def make_model(seed=0, hidden=16):
    tf.keras.utils.set_random_seed(seed)
    return tf.keras.Sequential(
        [tf.keras.Input((10,)), tf.keras.layers.Dense(hidden, activation="tanh"), tf.keras.layers.Dense(4)]
    )


def global_data(size, steps=STEPS, per_rank=LOCAL_BATCH, seed=7):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((steps * per_rank * size, 10)).astype(np.float32)
    return x, rng.integers(0, 4, len(x))


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


def max_difference(a, b):
    return max(float(np.max(np.abs(v.numpy() - w.numpy()))) for v, w in zip(a.variables, b.variables))
