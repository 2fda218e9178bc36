"""Data-parallel TensorFlow training with hpcdl: an MLP on the scikit-learn digits.

    mpiexec -n 4 python examples/train_tf.py --epochs 10 [--compression int8] [--eager]

Samples come from an hpcdl store (the digits are packed into one when --data
is not given) through digits_data.epoch_batches; the training step is a
tf.function (or eager with --eager) whose gradients hpcdl.tensorflow's
DistributedGradientTape averages. Rank 0 prints per epoch: loss, accuracy,
samples/s, stall time and gradient bytes sent vs dense.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import hpcdl  # noqa: E402
import hpcdl.tensorflow  # noqa: E402
from digits_data import (add_common_arguments, compression_codec, epoch_batches, eval_batch_size, log, prepare_store,  # noqa: E402
                         report_epoch, split)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--eager", action="store_true", help="run the training step eagerly")
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per rank")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    comm = hpcdl.init()

    store = prepare_store(args.data, comm)
    train_idx, test_idx = split(store)
    x0 = next(epoch_batches(store, train_idx, 1, 0, args.seed, comm))[0]
    features, classes = x0.shape[1], max(len(store.classes), 2)

    tf.keras.utils.set_random_seed(args.seed)
    model = tf.keras.Sequential([tf.keras.Input((features,)),
                                 tf.keras.layers.Dense(args.hidden, activation="relu"),
                                 tf.keras.layers.Dense(args.hidden, activation="relu"),
                                 tf.keras.layers.Dense(classes)])
    optimizer = tf.keras.optimizers.SGD(args.lr, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    codec = compression_codec(args.compression, args.int8_block, args.topk_ratio)
    hpcdl.tensorflow.broadcast_variables(model.variables, root=0)
    log(f"{hpcdl.size()} ranks, {len(train_idx)} train / {len(test_idx)} test samples, {features} features, "
        f"{classes} classes, compression {args.compression}, {'eager' if args.eager else 'tf.function'}")

    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        tape = hpcdl.tensorflow.DistributedGradientTape(tape, compression=codec)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, tf.reduce_sum(tf.cast(tf.argmax(logits, 1) == tf.cast(y, tf.int64), tf.int32))

    train_step = train_step if args.eager else tf.function(train_step)
    hpcdl.stats(reset=True)
    for epoch in range(args.epochs):
        started = time.perf_counter()
        samples, loss_sum, correct, stall = 0, 0.0, 0, 0.0
        for x, y, waited in epoch_batches(store, train_idx, args.batch_size, epoch, args.seed, comm):
            loss, right = train_step(x, y)
            samples += len(y)
            loss_sum += float(loss) * len(y)
            correct += int(right)
            stall += waited
        seconds = time.perf_counter() - started
        test_correct = test_count = 0
        for x, y, _ in epoch_batches(store, test_idx, eval_batch_size(test_idx, comm), 0, args.seed, comm):
            test_correct += int(np.sum(np.argmax(model(x, training=False).numpy(), 1) == y))
            test_count += len(y)
        report_epoch(comm, epoch, seconds, samples, loss_sum, correct, stall, test_correct, test_count)


if __name__ == "__main__":
    main()
