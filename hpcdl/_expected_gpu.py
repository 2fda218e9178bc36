"""A rank the launcher gave GPUs must be able to use one: the framework adapters check it at
import (hpcdl.torch, hpcdl.tensorflow), so such a rank fails at once instead of training on its
CPU at a fraction of the others' pace. When a GPU is expected is hpcdl._env.gpu_expected()."""

from mpi4py import MPI

from hpcdl import _env
from hpcdl.errors import HpcdlError


def check(sees_gpu, why_not):
    """HpcdlError naming this rank when a GPU is expected and ``sees_gpu()`` is false;
    ``why_not()``: the framework's build and what it found, for the message. Neither is
    called when no GPU is expected."""
    reason = _env.gpu_expected()
    if reason is None or sees_gpu():
        return
    raise HpcdlError(
        f"[hpcdl rank {MPI.COMM_WORLD.Get_rank()}] {reason} gives this rank GPUs, but {why_not()}: it would "
        "train on the CPU. Fix the node or the installation, or set HPCDL_EXPECT_GPU=0 to use the CPU anyway."
    )
