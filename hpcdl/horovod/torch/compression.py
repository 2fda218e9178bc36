"""Horovod's gradient compression for torch tensors: Compression.none and Compression.fp16
(hpcdl.horovod.compression has the rules; this module gives them torch's dtypes)."""

import torch

from hpcdl.horovod import compression as _compression
from hpcdl.horovod.compression import Compressor, NoneCompressor  # noqa: F401 (Horovod's names)


class FP16Compressor(_compression.FP16Compressor):
    float16 = torch.float16

    @staticmethod
    def is_floating(tensor):
        return tensor.dtype.is_floating_point

    @staticmethod
    def cast(tensor, dtype):
        return tensor.type(dtype)


Compression = _compression.compression_names(FP16Compressor)


def codec(compression):
    """hpcdl's codec for a Horovod compressor (DistributedOptimizer's gradient buckets)."""
    return _compression.codec(compression, "hpcdl's DistributedOptimizer")
