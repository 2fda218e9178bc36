"""TensorFlow adapter: data-parallel training with hpcdl's allreduce.

    import hpcdl, hpcdl.tensorflow as hvd_tf
    hvd_tf.broadcast_variables(model.variables, root=0)   # once, after the model is built
    tape = hvd_tf.DistributedGradientTape(tape)           # a custom training loop, or
    model.compile(optimizer=hvd_tf.DistributedOptimizer(opt), ...)   # Keras model.fit with
    model.fit(ds, callbacks=[hvd_tf.BroadcastGlobalVariablesCallback(0), hvd_tf.MetricAverageCallback()])
    ds = hvd_tf.tf_dataset(prefetcher, ...)               # the prefetcher's stream as a tf.data.Dataset
    model = hvd_tf.load_model(path)                       # a model saved while training, optimizer re-wrapped

tape (DistributedGradientTape, broadcast_variables), powersgd (the state of
PowerSGD compression, powersgd_state), residuals (the other codecs' error
feedback in a checkpoint, residual_state), keras (DistributedOptimizer,
the callbacks) and data (tf_dataset) are its modules; hpcdl's core API never
imports them.
"""

import tensorflow as tf

from hpcdl import _expected_gpu
from hpcdl.tensorflow.data import tf_dataset
from hpcdl.tensorflow.keras import (
    BroadcastGlobalVariablesCallback,
    DistributedOptimizer,
    MetricAverageCallback,
    load_model,
)
from hpcdl.tensorflow.powersgd import PowerSGDState, powersgd_state
from hpcdl.tensorflow.residuals import ResidualState, residual_state
from hpcdl.tensorflow.tape import DistributedGradientTape, broadcast_variables

__all__ = [
    "DistributedGradientTape",
    "DistributedOptimizer",
    "broadcast_variables",
    "BroadcastGlobalVariablesCallback",
    "MetricAverageCallback",
    "load_model",
    "tf_dataset",
    "PowerSGDState",
    "powersgd_state",
    "ResidualState",
    "residual_state",
]


def _why_no_gpu():
    if not tf.test.is_built_with_cuda():
        return f"TensorFlow {tf.__version__} is built without CUDA"
    return (
        f"TensorFlow {tf.__version__} (a CUDA build) finds no usable GPU (its CUDA libraries, the driver, or the node)"
    )


_expected_gpu.check(lambda: bool(tf.config.list_physical_devices("GPU")), _why_no_gpu)
