"""Horovod's TensorFlow collectives over hpcdl.allreduce / hpcdl.broadcast.

Eagerly a tensor's values go to the core as a numpy copy; inside a tf.function
through ``tf.numpy_function`` (not XLA-compilable), as hpcdl.tensorflow does.
An unnamed operation inside a tf.function is named after the graph's unique
name for it (the same on every rank that traced the same function): unnamed
operations are otherwise matched by submission order, and a graph may run its
independent numpy_function ops in a different order on each rank. Both are
differentiable, as in Horovod.
"""

import numpy as np
import tensorflow as tf

import hpcdl
from hpcdl.horovod import common
from hpcdl.horovod.common import global_process_set
from hpcdl.horovod.tensorflow.compression import Compression
from hpcdl.tensorflow.tape import _core_view


def _check_device(device_dense, device_sparse):
    common.check_default("device_dense", device_dense, "", "hpcdl reduces in host memory")
    common.check_default("device_sparse", device_sparse, "", "hpcdl reduces in host memory")


def _allreduce_slices(slices, op_name, name, prescale_factor, postscale_factor, process_set):
    """Horovod's allreduce of IndexedSlices: every rank's indices and values allgathered
    (their sum; values / size for the average). Uncompressed, as in Horovod."""
    from hpcdl.horovod.tensorflow.gather_ops import allgather  # it builds on this module

    if op_name not in ("average", "sum"):
        raise ValueError(
            f"an allreduce of IndexedSlices allgathers them, which sums or averages, not "
            f"op={op_name!r}: pass tf.convert_to_tensor(slices)"
        )
    floating = slices.values.dtype.is_floating
    common.check_scale(prescale_factor, postscale_factor, not floating)
    if op_name == "average" and not floating:
        raise TypeError("the average of IndexedSlices divides their values: integer values can only be summed")
    values = allgather(slices.values, None if name is None else f"{name}.values", process_set=process_set)
    indices = allgather(slices.indices, None if name is None else f"{name}.indices", process_set=process_set)
    scale = prescale_factor * postscale_factor / (common.comm_of(process_set).Get_size() if op_name == "average" else 1)
    if scale != 1.0:
        values = values * tf.cast(scale, values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def _dense_only(tensor):
    if isinstance(tensor, tf.IndexedSlices):
        raise TypeError(
            "grouped_allreduce takes dense tensors, as Horovod's: allreduce allgathers IndexedSlices, "
            "or pass tf.convert_to_tensor(slices)"
        )
    return tf.convert_to_tensor(tensor)


def _op_name(kind, name):
    if name is not None:
        return f"{kind}.{name}"
    if tf.executing_eagerly():
        return None  # matched by submission order
    return f"{kind}.{tf.compat.v1.get_default_graph().unique_name('graph')}"


def _run(fn, tensor):
    """fn(numpy array) -> array: eagerly, or as a stateful numpy_function in a graph."""
    if tf.executing_eagerly():
        return tf.convert_to_tensor(fn(tensor.numpy()))
    out = tf.numpy_function(fn, [tensor], tensor.dtype, stateful=True, name="hpcdl_horovod")
    out.set_shape(tensor.shape)
    return out


def _allreduce(tensor, op_name, name, prescale_factor, postscale_factor, process_set):
    integer = not (tensor.dtype.is_floating or tensor.dtype == tf.bfloat16)
    common.check_scale(prescale_factor, postscale_factor, integer)
    op_key = _op_name("allreduce", name)
    comm = common.comm_of(process_set)

    def reduce(array):
        array = np.array(array, copy=True)
        if prescale_factor != 1.0:
            array *= array.dtype.type(prescale_factor)
        buffer, core_dtype = _core_view(array)
        common.call(hpcdl.allreduce, buffer, op_name, comm, op_key, core_dtype)  # integers: floor average
        if postscale_factor != 1.0:
            array *= array.dtype.type(postscale_factor)
        return array

    @tf.custom_gradient
    def differentiable(x):
        def grad(dy):
            return _allreduce(
                tf.convert_to_tensor(dy),
                op_name,
                None if name is None else f"{name}.grad",
                prescale_factor,
                postscale_factor,
                process_set,
            )

        return _run(reduce, x), grad

    return differentiable(tensor)


def allreduce(
    tensor,
    average=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    name=None,
    process_set=global_process_set,
    ignore_name_scope=False,
):
    """The average (or op=hvd.Sum, Min, Max, Product) of ``tensor`` over the ranks, as a new tensor
    (differentiable).
    Integers average with floor division, as in Horovod's torch API.
    IndexedSlices are allgathered (indices and values; average: values / size), as in Horovod."""
    _check_device(device_dense, device_sparse)
    op_name = common.reduce_op(op, average)
    if isinstance(tensor, tf.IndexedSlices):
        return _allreduce_slices(tensor, op_name, name, prescale_factor, postscale_factor, process_set)
    compressed, ctx = compression.compress(tf.convert_to_tensor(tensor))
    reduced = _allreduce(compressed, op_name, name, prescale_factor, postscale_factor, process_set)
    return compression.decompress(reduced, ctx)


def _run_group(fn, tensors):
    """fn(*arrays) -> arrays, as _run for several tensors."""
    if tf.executing_eagerly():
        return [tf.convert_to_tensor(a) for a in fn(*[t.numpy() for t in tensors])]
    outs = tf.numpy_function(fn, list(tensors), [t.dtype for t in tensors], stateful=True, name="hpcdl_horovod")
    for out, tensor in zip(outs, tensors):
        out.set_shape(tensor.shape)
    return outs


def _grouped_allreduce(tensors, op_name, name, prescale_factor, postscale_factor, process_set):
    integer = any(not (t.dtype.is_floating or t.dtype == tf.bfloat16) for t in tensors)
    common.check_scale(prescale_factor, postscale_factor, integer)
    op_key = _op_name("grouped_allreduce", name)
    comm = common.comm_of(process_set)

    def reduce(*arrays):
        arrays = [np.array(a, copy=True) for a in arrays]  # bfloat16: ml_dtypes arrays, taken as they are
        for array in arrays if prescale_factor != 1.0 else ():
            array *= array.dtype.type(prescale_factor)
        common.call(hpcdl.grouped_allreduce, arrays, op_name, comm, op_key)
        for array in arrays if postscale_factor != 1.0 else ():
            array *= array.dtype.type(postscale_factor)
        return arrays

    @tf.custom_gradient
    def differentiable(*xs):
        def grad(*dys):
            return _grouped_allreduce(
                [tf.convert_to_tensor(dy) for dy in dys],
                op_name,
                None if name is None else f"{name}.grad",
                prescale_factor,
                postscale_factor,
                process_set,
            )

        return _run_group(reduce, xs), grad

    return differentiable(*tensors)


def grouped_allreduce(
    tensors,
    average=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """The average (or op=hvd.Sum, Min, Max, Product) of every tensor of ``tensors`` over the
    ranks, agreed as one operation, as a list of new tensors (differentiable)."""
    _check_device(device_dense, device_sparse)
    op_name = common.reduce_op(op, average)
    compressed = [compression.compress(_dense_only(t)) for t in tensors]
    if not compressed:
        return []
    reduced = _grouped_allreduce(
        [t for t, _ in compressed], op_name, None, prescale_factor, postscale_factor, process_set
    )
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, compressed)]


def _broadcast_array(array, root_rank, op_key, process_set):
    array = np.array(array, copy=True)
    buffer, core_dtype = _core_view(array)  # any dtype the core has (hpcdl.DTYPES)
    common.call(
        hpcdl.broadcast, buffer, common.root_in(process_set, root_rank), common.comm_of(process_set), op_key, core_dtype
    )
    return array


def broadcast(tensor, root_rank, name=None, process_set=global_process_set, ignore_name_scope=False):
    """Rank ``root_rank``'s ``tensor`` as a new tensor on every rank (differentiable: the
    ranks' gradients are summed onto the root)."""
    op_key = _op_name("broadcast", name)
    common.comm_of(process_set)  # a clear error now, not from inside a graph

    @tf.custom_gradient
    def differentiable(x):
        def grad(dy):
            summed = _allreduce(
                tf.convert_to_tensor(dy), "sum", None if name is None else f"{name}.grad", 1.0, 1.0, process_set
            )
            return summed if common.rank() == root_rank else tf.zeros_like(summed)

        return _run(lambda array: _broadcast_array(array, root_rank, op_key, process_set), x), grad

    return differentiable(tf.convert_to_tensor(tensor))


__all__ = ["allreduce", "broadcast"]


def join():
    """Horovod's join (hpcdl.join): this rank has run out of data; returns the rank
    that joined last, as an int32 scalar tensor (Horovod's TensorFlow join)."""
    return tf.constant(common.join(), dtype=tf.int32)
