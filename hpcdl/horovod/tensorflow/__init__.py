"""Horovod's TensorFlow API on hpcdl: ``import hpcdl.horovod.tensorflow as hvd``.

    import hpcdl.horovod.tensorflow as hvd
    hvd.init()
    tape = hvd.DistributedGradientTape(tape)
    hvd.broadcast_variables(model.variables, root_rank=0)

Keras model.fit: hpcdl.horovod.tensorflow.keras. What differs: docs/horovod.md.
``import tensorflow`` in these modules is the real TensorFlow (absolute imports).
"""

from hpcdl.horovod.common import (Adasum, Average, HorovodInternalError, HostsUpdatedInterrupt, Max, Min, ProcessSet,
                                  Product, Sum, add_process_set, barrier, ccl_built, cross_rank, cross_size, cuda_built,
                                  ddl_built, global_process_set, gloo_built, gloo_enabled, init, is_homogeneous,
                                  is_initialized, local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported,
                                  nccl_built, rank, remove_process_set, rocm_built, shutdown, size, start_timeline,
                                  stop_timeline)
from hpcdl.horovod.tensorflow.compression import Compression
from hpcdl.horovod.tensorflow.functions import (DistributedGradientTape, DistributedOptimizer, broadcast_global_variables,
                                                broadcast_object, broadcast_variables)
from hpcdl.horovod.tensorflow.gather_ops import (allgather, allgather_object, alltoall, grouped_allgather,
                                                 grouped_reducescatter, reducescatter)
from hpcdl.horovod.tensorflow.mpi_ops import allreduce, broadcast, grouped_allreduce

__all__ = ["init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank",
           "cross_size", "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled",
           "gloo_built", "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline",
           "stop_timeline", "Average", "Sum", "Adasum", "Min", "Max", "Product", "Compression", "HorovodInternalError",
           "HostsUpdatedInterrupt", "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
           "allreduce", "grouped_allreduce", "broadcast", "barrier", "broadcast_variables",
           "broadcast_global_variables", "broadcast_object", "DistributedGradientTape", "DistributedOptimizer", "allgather",
           "grouped_allgather", "allgather_object", "reducescatter", "grouped_reducescatter", "alltoall"]
