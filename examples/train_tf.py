"""Data-parallel TensorFlow training with hpcdl: an MLP on the scikit-learn digits.

    mpiexec -n 4 python examples/train_tf.py --epochs 10 [--compression int8] [--eager]

Training samples come from an hpcdl store (the digits are packed into one when
--data is not given) through the clairvoyant prefetcher and its tf.data
adapter (hpcdl.tensorflow.tf_dataset); the training step is a tf.function (or eager with --eager) whose gradients hpcdl.tensorflow's
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
from digits_data import (
    EpochReport,
    add_common_arguments,
    compression_codec,
    decode,
    evaluate,  # noqa: E402
    feature_count,
    log,
    make_prefetcher,
    prepare_stores,
)

import hpcdl  # noqa: E402
import hpcdl.prefetch  # noqa: E402
import hpcdl.tensorflow  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    parser.add_argument("--eager", action="store_true", help="run the training step eagerly")
    parser.add_argument("--threads", type=int, default=1, help="TensorFlow threads per rank")
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.threads)
    comm = hpcdl.init()

    train, test = prepare_stores(args.data, args.test_data, comm)
    features, classes = feature_count(train), max(len(train.classes), 2)

    tf.keras.utils.set_random_seed(args.seed)
    model = tf.keras.Sequential(
        [
            tf.keras.Input((features,)),
            tf.keras.layers.Dense(args.hidden, activation="relu"),
            tf.keras.layers.Dense(args.hidden, activation="relu"),
            tf.keras.layers.Dense(classes),
        ]
    )
    optimizer = tf.keras.optimizers.SGD(args.lr, momentum=0.9)
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    codec = compression_codec(args.compression)
    hpcdl.tensorflow.broadcast_variables(model.variables, root=0)

    def train_step(x, y):
        with tf.GradientTape() as tape:
            logits = model(x, training=True)
            loss = loss_fn(y, logits)
        tape = hpcdl.tensorflow.DistributedGradientTape(tape, compression=codec)
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))
        return loss, tf.reduce_sum(tf.cast(tf.argmax(logits, 1) == tf.cast(y, tf.int64), tf.int32))

    train_step = train_step if args.eager else tf.function(train_step)
    with make_prefetcher(train, args, comm) as prefetcher:
        # one epoch per pass over the dataset; the prefetcher stages the whole run ahead
        dataset = hpcdl.tensorflow.tf_dataset(
            prefetcher,
            transform=decode,
            epochs=1,
            output_signature=(tf.TensorSpec([features], tf.float32), tf.TensorSpec([], tf.int32)),
        ).batch(prefetcher.local_batch)
        log(
            f"{hpcdl.size()} ranks, {len(train)} train / {len(test) if test else 0} test samples, "
            f"{features} features, {classes} classes, compression {args.compression}, "
            f"{'eager' if args.eager else 'tf.function'}, "
            f"{prefetcher.steps_per_epoch} steps of {prefetcher.local_batch} per rank and epoch"
        )
        report = EpochReport(comm, prefetcher, args.metrics)
        for epoch in range(args.epochs):
            started = time.perf_counter()
            samples, loss_sum, correct = 0, 0.0, 0
            for x, y in dataset:
                loss, right = train_step(x, y)
                samples += len(y)
                loss_sum += float(loss) * len(y)
                correct += int(right)
            seconds = time.perf_counter() - started
            test_correct, test_count = evaluate(test, lambda x: np.argmax(model(x, training=False).numpy(), 1), comm)
            report(epoch, seconds, samples, loss_sum, correct, test_correct, test_count)
        report.summary()


if __name__ == "__main__":
    main()
