"""Models and training loops shared by the single-process and MPI TensorFlow tests."""

import numpy as np
import tensorflow as tf

import hpcdl.tensorflow as hvd_tf

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)


def make_model(seed=0, hidden=16, extra=False):
    # Named layers: Keras numbers unnamed ones per process, and ranks that built different
    # models before (a test's `extra`) would give the same variable different paths.
    tf.keras.utils.set_random_seed(seed)
    layers = [tf.keras.Input((10,)), tf.keras.layers.Dense(hidden, activation="tanh", name="hidden")]
    if extra:
        layers.append(tf.keras.layers.Dense(hidden, activation="tanh", name="extra"))
    model = tf.keras.Sequential(layers + [tf.keras.layers.Dense(4, name="logits")], name="mlp")
    return model


def full_batch(step, per_rank, size):
    rng = np.random.default_rng(100 + step)
    x = rng.standard_normal((per_rank * size, 10)).astype(np.float32)
    y = rng.integers(0, 4, per_rank * size)
    return x, y


LOSS = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def train_distributed(comm, steps, per_rank, use_function):
    model = make_model()
    opt = tf.keras.optimizers.SGD(0.5)
    rank, size = comm.Get_rank(), comm.Get_size()

    def step_fn(x, y):
        with tf.GradientTape() as tape:
            loss = LOSS(y, model(x))
        tape = hvd_tf.DistributedGradientTape(tape, comm=comm)
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    step_fn = tf.function(step_fn) if use_function else step_fn
    for step in range(steps):
        x, y = full_batch(step, per_rank, size)
        step_fn(x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank])
    return model


def train_reference(steps, per_rank, size):
    model = make_model()
    opt = tf.keras.optimizers.SGD(0.5)
    for step in range(steps):
        x, y = full_batch(step, per_rank, size)
        with tf.GradientTape() as tape:
            loss = (
                tf.add_n(
                    [
                        LOSS(y[r * per_rank : (r + 1) * per_rank], model(x[r * per_rank : (r + 1) * per_rank]))
                        for r in range(size)
                    ]
                )
                / size
            )
        grads = tape.gradient(loss, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
    return model


def max_difference(a, b):
    return max(float(np.max(np.abs(v.numpy() - w.numpy()))) for v, w in zip(a.variables, b.variables))
