"""The `device` fixture of the CUDA tests: [cuda] runs on the GPU (marked `cuda`, skipped with
the reason where none exists), [staged-cpu] runs the same staging code path (side-stream copies,
host buffers, the hpcdl-cuda thread) on CPU tensors, so CI without a GPU exercises it too."""

import pytest
import torch
from mpi4py import MPI

from hpcdl import _tensors

NO_CUDA = "no CUDA device"
# Decided once, by every rank together: a rank that saw no GPU while another did would skip alone.
CUDA = MPI.COMM_WORLD.allreduce(int(torch.cuda.is_available()), op=MPI.MIN) == 1


def local_gpu():
    """This rank's GPU: ranks on one node share the GPUs round-robin."""
    local_rank = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
    return torch.device("cuda", local_rank % torch.cuda.device_count())


@pytest.fixture(
    params=[pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason=NO_CUDA)]), "staged-cpu"]
)
def device(request):
    if request.param == "cuda":
        gpu = local_gpu()
        torch.cuda.set_device(gpu)
        yield gpu
        torch.cuda.synchronize(gpu)
        return
    old = _tensors.staging_cpu_tensors(True)
    try:
        yield torch.device("cpu")
    finally:
        _tensors.staging_cpu_tensors(old)
