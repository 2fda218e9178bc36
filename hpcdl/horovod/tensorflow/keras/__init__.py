"""Horovod's Keras API on hpcdl: ``import hpcdl.horovod.tensorflow.keras as hvd``.

import hpcdl.horovod.tensorflow.keras as hvd
hvd.init()
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.01 * hvd.size())), loss=...)
model.fit(x, y, callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                           hvd.callbacks.MetricAverageCallback()])
"""

import hpcdl.tensorflow
from hpcdl.horovod import common
from hpcdl.horovod.common import (
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    ProcessSet,
    Product,
    Sum,
    add_process_set,
    barrier,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from hpcdl.horovod.tensorflow import gather_ops, mpi_ops
from hpcdl.horovod.tensorflow.compression import Compression, codec
from hpcdl.horovod.tensorflow.functions import DistributedOptimizer, broadcast_global_variables, broadcast_object
from hpcdl.horovod.tensorflow.keras import callbacks


def allreduce(
    value, name=None, average=None, prescale_factor=1.0, postscale_factor=1.0, op=None, compression=Compression.none
):
    """The average (or sum) of ``value`` over the ranks, as a numpy value."""
    return mpi_ops.allreduce(
        value,
        average=average,
        compression=compression,
        op=op,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        name=name,
    ).numpy()


def broadcast(value, root_rank, name=None):
    """Rank ``root_rank``'s ``value`` on every rank, as a numpy value."""
    return mpi_ops.broadcast(value, root_rank, name=name).numpy()


def allgather(value, name=None):
    """Every rank's ``value`` concatenated along the first dimension, as a numpy value."""
    return gather_ops.allgather(value, name=name).numpy()


def reducescatter(value, name=None, op=Average):
    """This rank's rows of the average (or sum) of ``value`` over the ranks, as a numpy value."""
    return gather_ops.reducescatter(value, op=op, name=name).numpy()


def load_model(filepath, custom_optimizers=None, custom_objects=None, compression=Compression.none):
    """A model saved while training with DistributedOptimizer, its optimizer wrapped again
    (hpcdl.tensorflow.load_model). Every imported Keras optimizer class is known to it, so
    custom_optimizers (Horovod's list of extra optimizer classes) only has to be imported."""
    objects = dict(custom_objects or {})
    objects.update({cls.__name__: cls for cls in custom_optimizers or []})
    return common.call(
        hpcdl.tensorflow.load_model, filepath, codec(compression), "average", common.comm(), "keras", objects
    )


__all__ = [
    "init",
    "shutdown",
    "is_initialized",
    "rank",
    "size",
    "local_rank",
    "local_size",
    "cross_rank",
    "cross_size",
    "is_homogeneous",
    "mpi_threads_supported",
    "mpi_enabled",
    "mpi_built",
    "gloo_enabled",
    "gloo_built",
    "nccl_built",
    "ddl_built",
    "ccl_built",
    "cuda_built",
    "rocm_built",
    "start_timeline",
    "stop_timeline",
    "Average",
    "Sum",
    "Adasum",
    "Min",
    "Max",
    "Product",
    "Compression",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "allreduce",
    "allgather",
    "reducescatter",
    "broadcast",
    "barrier",
    "broadcast_global_variables",
    "broadcast_object",
    "DistributedOptimizer",
    "load_model",
    "callbacks",
]
