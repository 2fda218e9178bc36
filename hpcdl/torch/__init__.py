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

from hpcdl import _expected_gpu
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


def _why_no_gpu():
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    return f"torch {torch.__version__} (CUDA {torch.version.cuda}) finds no usable device (the driver, or the node)"


_expected_gpu.check(torch.cuda.is_available, _why_no_gpu)
