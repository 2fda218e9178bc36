"""Horovod's torch API on hpcdl: ``import hpcdl.horovod.torch as hvd``.

A Horovod script runs with only its import changed (docs/horovod.md lists
what differs and what is not there yet):

    import hpcdl.horovod.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

``import torch`` in these modules is the real PyTorch (absolute imports).
"""

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
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    synchronize,
)
from hpcdl.horovod.common import allgather_object as _allgather_object
from hpcdl.horovod.common import broadcast_object as _broadcast_object
from hpcdl.horovod.torch.compression import Compression
from hpcdl.horovod.torch.gather_ops import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    grouped_allgather,
    grouped_allgather_async,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter,
    reducescatter_async,
)
from hpcdl.horovod.torch.mpi_ops import (
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
)
from hpcdl.horovod.torch.optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters
from hpcdl.horovod.torch.sync_batch_norm import SyncBatchNorm


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``obj`` (any picklable object) on every rank of ``process_set``."""
    return _broadcast_object(obj, root_rank, name, process_set)


def allgather_object(obj, name=None, process_set=global_process_set):
    """Every rank's ``obj`` (any picklable object), as a list in rank order."""
    return _allgather_object(obj, name, process_set)


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
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "poll",
    "synchronize",
    "barrier",
    "join",
    "broadcast_object",
    "DistributedOptimizer",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "ProcessSet",
    "global_process_set",
    "add_process_set",
    "remove_process_set",
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "allgather_object",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "alltoall",
    "alltoall_async",
    "SyncBatchNorm",
]
