"""Horovod's TensorFlow allgather, alltoall and reducescatter (and grouped forms)
over hpcdl.allgather / alltoall / reducescatter.

As the allreduce (mpi_ops.py): eagerly a tensor's values go to the core as a
numpy copy, inside a tf.function through ``tf.numpy_function``; unnamed
operations in a graph are named after the graph's unique name. Differentiable
with Horovod's gradients (see hpcdl/horovod/torch/gather_ops.py). Grouped
forms run one operation per tensor (docs/horovod.md).
"""

import numpy as np
import tensorflow as tf

import hpcdl
from hpcdl.horovod import common
from hpcdl.horovod.common import Average, global_process_set
from hpcdl.horovod.tensorflow.compression import Compression
from hpcdl.horovod.tensorflow.mpi_ops import _allreduce, _op_name
from hpcdl.tensorflow.tape import _core_view


def _movable(array):
    """array as the core takes it, its dtype argument, and how to restore the result's type."""
    buffer, core_dtype = _core_view(array)
    return buffer, core_dtype, lambda out: out.view(np.asarray(array).dtype)


def _run(fn, tensor, outputs=None):
    """fn(numpy array) -> array (or a tuple of them) with a first dimension known only after the run."""
    if tf.executing_eagerly():
        out = fn(tensor.numpy())
        return tuple(map(tf.convert_to_tensor, out)) if outputs else tf.convert_to_tensor(out)
    out = tf.numpy_function(fn, [tensor], outputs or tensor.dtype, stateful=True, name="hpcdl_horovod")
    first = out[0] if outputs else out
    first.set_shape([None] + tensor.shape.as_list()[1:])
    return out


def _allgather_array(array, op_key, process_set):
    buffer, core_dtype, restore = _movable(array)
    return restore(common.call(hpcdl.allgather, buffer, common.comm_of(process_set), op_key, core_dtype))


def allgather(tensor, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along the first dimension (which may differ
    per rank), in rank order. Differentiable: the gradient is this rank's rows of the
    averaged gradient."""
    op_key = _op_name("allgather", name)
    common.comm_of(process_set)  # a clear error now, not from inside a graph

    @tf.custom_gradient
    def differentiable(x):
        def grad(dy):
            reduced = _allreduce(
                tf.convert_to_tensor(dy), "average", None if name is None else f"{name}.grad", 1.0, 1.0, process_set
            )
            rows = allgather(tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1]), process_set=process_set)
            offset = tf.reduce_sum(rows[: common.comm_of(process_set).Get_rank()])
            return reduced[offset : offset + tf.shape(x, out_type=tf.int64)[0]]

        return _run(lambda array: _allgather_array(array, op_key, process_set), x), grad

    return differentiable(tf.convert_to_tensor(tensor))


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """allgather of each tensor (one operation each), as a list."""
    return [allgather(t, common.group_name(name, i), ignore_name_scope, process_set) for i, t in enumerate(tensors)]


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's ``obj`` (any picklable object), as a list in rank order."""
    return common.allgather_object(obj, name, process_set)


def _reducescatter_array(array, op_name, op_key, prescale_factor, postscale_factor, process_set):
    array = np.array(array, copy=True)
    if prescale_factor != 1.0:
        array *= array.dtype.type(prescale_factor)
    buffer, core_dtype = _core_view(array)
    out = common.call(hpcdl.reducescatter, buffer, op_name, common.comm_of(process_set), op_key, core_dtype)
    out = out.view(array.dtype)
    if postscale_factor != 1.0:
        out = out * out.dtype.type(postscale_factor)
    return out


def reducescatter(
    tensor,
    device_dense="",
    compression=Compression.none,
    op=Average,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """This rank's rows of the average (or sum) of ``tensor`` over the ranks, the first
    dimension split with the first ``rows % size`` ranks one row more. Differentiable:
    the gradient is the allgather of the gradient (divided by the size for an average)."""
    common.check_default("device_dense", device_dense, "", "hpcdl reduces in host memory")
    op_name = common.reduce_op(op, None)
    tensor = tf.convert_to_tensor(tensor)
    common.check_scale(prescale_factor, postscale_factor, not (tensor.dtype.is_floating or tensor.dtype == tf.bfloat16))
    op_key = _op_name("reducescatter", name)
    size = common.comm_of(process_set).Get_size()

    @tf.custom_gradient
    def differentiable(x):
        def grad(dy):
            gathered = allgather(tf.convert_to_tensor(dy), process_set=process_set)
            scale = prescale_factor * postscale_factor / (size if op_name == "average" else 1)
            return gathered * tf.cast(scale, gathered.dtype) if scale != 1 else gathered

        return _run(
            lambda array: _reducescatter_array(array, op_name, op_key, prescale_factor, postscale_factor, process_set),
            x,
        ), grad

    compressed, ctx = compression.compress(tensor)
    return compression.decompress(differentiable(compressed), ctx)


def grouped_reducescatter(
    tensors,
    device_dense="",
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """reducescatter of each tensor (one operation each), as a list."""
    return [
        reducescatter(t, device_dense, compression, op, None, process_set, False, prescale_factor, postscale_factor)
        for t in tensors
    ]


def alltoall(tensor, splits=None, name=None, ignore_name_scope=False, process_set=global_process_set):
    """Rows of ``tensor`` to each rank by ``splits`` (None: equal split), received in rank
    order; returns (received, received_splits as int32). Differentiable: the gradient
    goes back by the received splits."""
    op_key = _op_name("alltoall", name)
    common.comm_of(process_set)
    splits = None if splits is None else tf.convert_to_tensor(splits, tf.int32)

    def exchange(array, split_array=None):
        buffer, core_dtype, restore = _movable(array)
        split_list = None if split_array is None else [int(n) for n in split_array]
        out, received = common.call(hpcdl.alltoall, buffer, split_list, common.comm_of(process_set), op_key, core_dtype)
        return restore(out), np.array(received, np.int32)

    @tf.custom_gradient
    def differentiable(x):
        if splits is None:
            out, received = _run(exchange, x, [x.dtype, tf.int32])
        elif tf.executing_eagerly():
            out, received = map(tf.convert_to_tensor, exchange(x.numpy(), splits.numpy()))
        else:
            out, received = tf.numpy_function(
                exchange, [x, splits], [x.dtype, tf.int32], stateful=True, name="hpcdl_horovod"
            )
            out.set_shape([None] + x.shape.as_list()[1:])

        def grad(dy, unused=None):
            back, _ = alltoall(tf.convert_to_tensor(dy), received, process_set=process_set)
            return back

        return (out, received), grad

    return differentiable(tf.convert_to_tensor(tensor))


__all__ = ["allgather", "grouped_allgather", "allgather_object", "reducescatter", "grouped_reducescatter", "alltoall"]
