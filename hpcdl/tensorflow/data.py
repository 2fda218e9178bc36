"""The prefetcher as a tf.data.Dataset, in exactly the prefetcher's stream order.

    ds = hpcdl.tensorflow.tf_dataset(pf, transform=decode,
                                     output_signature=(tf.TensorSpec([32, 32, 3], tf.uint8),
                                                       tf.TensorSpec([], tf.int32)))
    model.fit(ds.batch(pf.local_batch), epochs=E, steps_per_epoch=pf.steps_per_epoch)

The dataset covers the rest of the run: give fit steps_per_epoch, so every rank
runs the same number of steps per epoch (each step is an allreduce) and fit keeps
one iterator across epochs.
"""

import numpy as np
import tensorflow as tf


def tf_dataset(prefetcher, transform=None, output_signature=None, epochs=None):
    """A tf.data.Dataset of (transform(sample), label) over the rest of the run
    (or `epochs` epochs of it). transform gets a uint8 numpy view valid only
    during the call (default: a copy, a 1-D uint8 tensor of varying length).
    output_signature: what transform returns, with the label's tf.int32 spec."""
    if output_signature is None:
        output_signature = (tf.TensorSpec(shape=(None,), dtype=tf.uint8), tf.TensorSpec(shape=(), dtype=tf.int32))
    transform = transform if transform is not None else np.array

    def generate():
        for count, epoch in enumerate(prefetcher.epochs()):
            if epochs is not None and count >= epochs:
                return
            for batch in epoch:
                for view, label in batch:
                    yield transform(view), np.int32(label)

    return tf.data.Dataset.from_generator(generate, output_signature=output_signature)
