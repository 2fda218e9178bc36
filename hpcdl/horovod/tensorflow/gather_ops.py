"""Horovod's TensorFlow allgather, alltoall and reducescatter (and grouped forms)
over hpcdl.allgather / alltoall / reducescatter.

As the allreduce (mpi_ops.py): eagerly a tensor's values go to the core as a
numpy copy, inside a tf.function through ``tf.numpy_function``; unnamed
operations in a graph are named after the graph's unique name. Differentiable
with Horovod's gradients (see hpcdl/horovod/torch/gather_ops.py). Grouped
forms are one agreed operation over the group (hpcdl.grouped_allgather,
grouped_reducescatter).
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


def _run_group(fn, tensors):
    """fn(*numpy arrays) -> a list of arrays, each with a first dimension known only after the run."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(out) for out in fn(*[t.numpy() for t in tensors])]
    outs = tf.numpy_function(fn, tensors, [t.dtype for t in tensors], stateful=True, name="hpcdl_horovod")
    for out, tensor in zip(outs, tensors):
        out.set_shape([None] + tensor.shape.as_list()[1:])
    return list(outs)


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
            return _allgather_grad(dy, x, None if name is None else f"{name}.grad", process_set)

        return _run(lambda array: _allgather_array(array, op_key, process_set), x), grad

    return differentiable(tf.convert_to_tensor(tensor))


def _allgather_grad(dy, x, grad_name, process_set):
    """An allgather's gradient: this rank's rows of the averaged gradient."""
    reduced = _allreduce(tf.convert_to_tensor(dy), "average", grad_name, 1.0, 1.0, process_set)
    rows = allgather(tf.reshape(tf.shape(x, out_type=tf.int64)[0], [1]), process_set=process_set)
    offset = tf.reduce_sum(rows[: common.comm_of(process_set).Get_rank()])
    return reduced[offset : offset + tf.shape(x, out_type=tf.int64)[0]]


def grouped_allgather(tensors, name=None, ignore_name_scope=False, process_set=global_process_set):
    """allgather of each tensor, agreed as one operation (hpcdl.grouped_allgather), as a
    list. Differentiable member by member, as allgather is."""
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    op_key = _op_name("grouped_allgather", name)
    common.comm_of(process_set)

    def gather(*arrays):
        moved = [_movable(array) for array in arrays]
        outs = common.call(
            hpcdl.grouped_allgather,
            [buffer for buffer, _, _ in moved],
            common.comm_of(process_set),
            op_key,
            [core_dtype for _, core_dtype, _ in moved],
        )
        return [restore(out) for out, (_, _, restore) in zip(outs, moved)]

    @tf.custom_gradient
    def differentiable(*xs):
        def grad(*dys):
            return [
                _allgather_grad(dy, x, None if name is None else f"{name}.{i}.grad", process_set)
                for i, (dy, x) in enumerate(zip(dys, xs))
            ]

        return _run_group(gather, list(xs)), grad

    return differentiable(*tensors)


def allgather_object(obj, session=None, name=None, process_set=global_process_set):
    """Every rank's ``obj`` (any picklable object), as a list in rank order."""
    return common.allgather_object(obj, name, process_set)


def _prescaled(array, prescale_factor):
    """array scaled by prescale_factor (a new array; the input as is when 1)."""
    array = np.asarray(array)
    return array * array.dtype.type(prescale_factor) if prescale_factor != 1.0 else array


def _postscaled(out, dtype, postscale_factor):
    out = out.view(dtype)
    return out * out.dtype.type(postscale_factor) if postscale_factor != 1.0 else out


def _reducescatter_array(array, op_name, op_key, prescale_factor, postscale_factor, process_set):
    array = _prescaled(array, prescale_factor)
    buffer, core_dtype = _core_view(array)
    out = common.call(hpcdl.reducescatter, buffer, op_name, common.comm_of(process_set), op_key, core_dtype)
    return _postscaled(out, array.dtype, postscale_factor)


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
    """reducescatter of each tensor, agreed as one operation (hpcdl.grouped_reducescatter),
    as a list. Differentiable member by member, as reducescatter is."""
    common.check_default("device_dense", device_dense, "", "hpcdl reduces in host memory")
    op_name = common.reduce_op(op, None)
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    if not tensors:
        return []
    for tensor in tensors:
        integer = not (tensor.dtype.is_floating or tensor.dtype == tf.bfloat16)
        common.check_scale(prescale_factor, postscale_factor, integer)
    op_key = _op_name("grouped_reducescatter", None)
    size = common.comm_of(process_set).Get_size()

    def scatter(*arrays):
        arrays = [_prescaled(array, prescale_factor) for array in arrays]
        views = [_core_view(array) for array in arrays]
        outs = common.call(
            hpcdl.grouped_reducescatter,
            [buffer for buffer, _ in views],
            op_name,
            common.comm_of(process_set),
            op_key,
            [core_dtype for _, core_dtype in views],
        )
        return [_postscaled(out, array.dtype, postscale_factor) for out, array in zip(outs, arrays)]

    @tf.custom_gradient
    def differentiable(*xs):
        def grad(*dys):
            scale = prescale_factor * postscale_factor / (size if op_name == "average" else 1)
            grads = [allgather(tf.convert_to_tensor(dy), process_set=process_set) for dy in dys]
            return [g * tf.cast(scale, g.dtype) if scale != 1 else g for g in grads]

        return _run_group(scatter, list(xs)), grad

    compressed = [compression.compress(t) for t in tensors]
    outs = differentiable(*[c for c, _ in compressed])
    return [compression.decompress(out, ctx) for out, (_, ctx) in zip(outs, compressed)]


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
