"""Horovod's TensorFlow training helpers mapped onto hpcdl.tensorflow:
broadcast_variables, broadcast_object, DistributedGradientTape, DistributedOptimizer."""

import tensorflow as tf

import hpcdl.tensorflow
from hpcdl.horovod import common
from hpcdl.horovod.common import Average, global_process_set
from hpcdl.horovod.tensorflow.compression import Compression, codec
from hpcdl.horovod.tensorflow.mpi_ops import _check_device

_FUSION = "hpcdl fuses the gradients of one dtype into one buffer"


def broadcast_variables(variables, root_rank, process_set=global_process_set, inplace=False):
    """Assign rank ``root_rank``'s values to every rank's variables (eagerly; in place either way)."""
    common.call(
        hpcdl.tensorflow.broadcast_variables,
        variables,
        common.root_in(process_set, root_rank),
        common.comm_of(process_set),
    )


def broadcast_global_variables(root_rank):
    """TF1 graph collections: not in TensorFlow 2's eager mode, as in Horovod."""
    raise RuntimeError(
        "hvd.broadcast_global_variables() does not support eager execution. "
        "Please use `hvd.broadcast_variables(<model/optimizer variables>)` instead."
    )


def broadcast_object(obj, root_rank=0, session=None, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` (any picklable object) on every rank of ``process_set``."""
    common.check_default("session", session, None, "TF1 sessions are not supported")
    return common.broadcast_object(obj, root_rank, name, process_set)


def _gradient_settings(device_dense, device_sparse, compression, op, gradient_predivide_factor, num_groups, groups):
    """hpcdl's (codec, op) for Horovod's gradient-reduction arguments, checked."""
    _check_device(device_dense, device_sparse)
    op_name = common.reduce_op(op, None)
    if gradient_predivide_factor <= 0:
        raise ValueError(f"gradient_predivide_factor must be positive, got {gradient_predivide_factor!r}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    common.check_default("num_groups", num_groups, 0, _FUSION)
    common.check_default("groups", groups, None, _FUSION)
    return codec(compression), op_name


def DistributedGradientTape(
    gradtape,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    op=Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    scale_local_gradients=True,
):
    """hpcdl.tensorflow.DistributedGradientTape over init()'s communicator.

    IndexedSlices gradients are allgathered (indices and values), or made dense
    with sparse_as_dense=True, as in Horovod. ``tape.register_local_source(var)``
    keeps a source's gradient this rank's own (divided by the set's size when
    scale_local_gradients), as in Horovod.
    gradient_predivide_factor with op=Average: the average either way (hpcdl sums
    16-bit floats in float32, so it does not need Horovod's pre-division)."""
    compression, op_name = _gradient_settings(
        device_dense,
        device_sparse,
        compression,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
    )
    return hpcdl.tensorflow.DistributedGradientTape(
        gradtape,
        compression=compression,
        op=op_name,
        comm=common.comm_of(process_set),
        sparse_as_dense=sparse_as_dense,
        scale_local_gradients=scale_local_gradients,
    )


def DistributedOptimizer(
    optimizer,
    name=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    sparse_as_dense=False,
    gradient_predivide_factor=1.0,
    op=Average,
    backward_passes_per_step=1,
    average_aggregated_gradients=False,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    scale_local_gradients=True,
):
    """hpcdl.tensorflow.DistributedOptimizer (a Keras optimizer) over init()'s communicator.

    IndexedSlices gradients are allgathered, or made dense with sparse_as_dense=True.
    ``optimizer.register_local_var(var)`` keeps a variable's gradient this rank's own
    (divided by the set's size when scale_local_gradients), as in Horovod.
    backward_passes_per_step > 1 (local gradient aggregation) is not in hpcdl's Keras
    optimizer yet: it raises ValueError; average_aggregated_gradients goes with it."""
    compression, op_name = _gradient_settings(
        device_dense,
        device_sparse,
        compression,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
    )
    common.check_default(
        "backward_passes_per_step", backward_passes_per_step, 1, "hpcdl's Keras optimizer reduces every step"
    )
    common.check_default(
        "average_aggregated_gradients",
        average_aggregated_gradients,
        False,
        "it applies to backward_passes_per_step > 1",
    )
    if not isinstance(optimizer, tf.keras.optimizers.Optimizer):
        raise TypeError(
            f"DistributedOptimizer wraps a Keras optimizer (TF1 tf.compat.v1.train optimizers are not "
            f"supported), not {type(optimizer).__name__}"
        )
    return common.call(
        hpcdl.tensorflow.DistributedOptimizer,
        optimizer,
        compression,
        op_name,
        common.comm_of(process_set),
        name or "keras",
        sparse_as_dense,
        scale_local_gradients,
    )


__all__ = [
    "broadcast_variables",
    "broadcast_global_variables",
    "broadcast_object",
    "DistributedGradientTape",
    "DistributedOptimizer",
]
