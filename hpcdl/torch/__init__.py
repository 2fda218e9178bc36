"""PyTorch adapter: data-parallel training with hpcdl's allreduce, pipeline
parallelism, and the prefetcher as a Dataset.

    import hpcdl, hpcdl.torch
    opt = hpcdl.torch.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                           model.named_parameters())
    hpcdl.torch.broadcast_parameters(model.state_dict(), root_rank=0)
    hpcdl.torch.broadcast_optimizer_state(opt, root_rank=0)
    ... loss.backward(); opt.step()

optimizer (DistributedOptimizer, the broadcasts, ddp_comm_hook; its fusion
buckets and CUDA staging in _buckets, its on-device encoders in
device_codecs, PowerSGD's low-rank buckets in powersgd), pipeline (Pipeline, PipeSplit) and data (TorchDataset) are its
modules; hpcdl's core API never imports them.
"""

import torch
from mpi4py import MPI

from hpcdl import _env
from hpcdl.errors import HpcdlError
from hpcdl.torch.data import TorchDataset
from hpcdl.torch.optimizer import (
    DEFAULT_BUCKET_BYTES,
    DistributedOptimizer,
    broadcast_optimizer_state,
    broadcast_parameters,
    ddp_comm_hook,
)
from hpcdl.torch.pipeline import Pipeline, PipelineError, PipeSplit

__all__ = [
    "DistributedOptimizer",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "ddp_comm_hook",
    "DEFAULT_BUCKET_BYTES",
    "Pipeline",
    "PipeSplit",
    "PipelineError",
    "TorchDataset",
]


def _check_expected_gpu():
    """A rank that should have a GPU and has none fails here, not by training on the CPU unnoticed."""
    reason = _env.gpu_expected()
    if reason is None or torch.cuda.is_available():
        return
    if torch.version.cuda is None:
        why = f"torch {torch.__version__} is built without CUDA"
    else:
        why = f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable device (the driver, or the node)"
    raise HpcdlError(
        f"[hpcdl rank {MPI.COMM_WORLD.Get_rank()}] {reason} gives this rank GPUs, but {why}: it would train "
        "on the CPU. Fix the node or the installation, or set HPCDL_EXPECT_GPU=0 to use the CPU anyway."
    )


_check_expected_gpu()
