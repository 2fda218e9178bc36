"""Data-parallel Keras model.fit with hpcdl: an MLP on the scikit-learn digits.

    mpiexec -n 4 python examples/train_keras_fit.py --epochs 10 [--compression int8]

The same model and data as examples/train_tf.py, trained with model.compile /
model.fit instead of a hand-written loop: hpcdl.tensorflow.DistributedOptimizer
averages the gradients inside Keras' compiled train step, BroadcastGlobalVariablesCallback
starts every rank from rank 0's weights, MetricAverageCallback makes the logged
loss and accuracy the mean over the ranks. Training samples come from an hpcdl
store (the digits are packed into one when --data is not given) through the
clairvoyant prefetcher's tf.data adapter (hpcdl.tensorflow.tf_dataset). Rank 0
prints per epoch: loss, accuracy, samples/s, stall time and gradient bytes
sent vs dense.
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


class Report(tf.keras.callbacks.Callback):
    """Prints the epoch's figures (digits_data.EpochReport) from the logs MetricAverageCallback averaged."""

    def __init__(self, report, samples_per_epoch, test, comm):
        super().__init__()
        self.report, self.samples, self.test, self.comm = report, samples_per_epoch, test, comm

    def on_epoch_begin(self, epoch, logs=None):
        self.started = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        seconds = time.perf_counter() - self.started
        test_correct, test_count = evaluate(self.test, lambda x: np.argmax(self.model(x, training=False), 1), self.comm)
        self.report(
            epoch,
            seconds,
            self.samples,
            logs["loss"] * self.samples,
            logs["accuracy"] * self.samples,
            test_correct,
            test_count,
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
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
    optimizer = hpcdl.tensorflow.DistributedOptimizer(
        tf.keras.optimizers.SGD(args.lr, momentum=0.9), compression=compression_codec(args.compression)
    )
    # jit_compile=False: the allreduce is a host call XLA cannot compile (Keras' "auto" turns XLA on with a GPU)
    model.compile(
        optimizer=optimizer,
        loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        jit_compile=False,
    )

    with make_prefetcher(train, args, comm) as prefetcher:
        # one dataset over the whole run; steps_per_epoch makes fit keep its iterator across epochs
        dataset = hpcdl.tensorflow.tf_dataset(
            prefetcher,
            transform=decode,
            output_signature=(tf.TensorSpec([features], tf.float32), tf.TensorSpec([], tf.int32)),
        ).batch(prefetcher.local_batch)
        log(
            f"{hpcdl.size()} ranks, {len(train)} train / {len(test) if test else 0} test samples, "
            f"{features} features, {classes} classes, compression {args.compression}, model.fit, "
            f"{prefetcher.steps_per_epoch} steps of {prefetcher.local_batch} per rank and epoch"
        )
        report = EpochReport(comm, prefetcher)
        model.fit(
            dataset,
            epochs=args.epochs,
            steps_per_epoch=prefetcher.steps_per_epoch,
            shuffle=False,
            verbose=0,
            callbacks=[
                hpcdl.tensorflow.BroadcastGlobalVariablesCallback(root=0),
                hpcdl.tensorflow.MetricAverageCallback(),
                Report(report, prefetcher.steps_per_epoch * prefetcher.local_batch, test, comm),
            ],
        )
        report.summary()


if __name__ == "__main__":
    main()
