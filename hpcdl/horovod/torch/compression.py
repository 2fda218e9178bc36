"""Horovod's gradient compression for torch tensors: Compression.none and Compression.fp16.

A compressor casts a tensor before a collective and back after it (Horovod's
contract: compress(tensor) -> (tensor, ctx), decompress(tensor, ctx)).
DistributedOptimizer maps them onto hpcdl's own codecs instead (codec()).
"""

import torch

import hpcdl.compression


class Compressor:
    """Interface of Horovod's compressors."""

    @staticmethod
    def compress(tensor):
        raise NotImplementedError

    @staticmethod
    def decompress(tensor, ctx):
        raise NotImplementedError


class NoneCompressor(Compressor):
    """The tensor as it is."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class FP16Compressor(Compressor):
    """Floating-point tensors travel as float16 (hpcdl sums float16 in float32)."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None or tensor.dtype == ctx else tensor.type(ctx)


class Compression:
    """The compressors by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor


def codec(compression):
    """hpcdl's codec for a Horovod compressor (DistributedOptimizer's gradient buckets)."""
    if compression in (None, NoneCompressor):
        return None
    if compression is FP16Compressor:
        return hpcdl.compression.FP16()
    if isinstance(compression, hpcdl.compression.Codec):
        return compression
    raise ValueError(f"compression={compression!r}: hpcdl's DistributedOptimizer takes Compression.none, "
                     "Compression.fp16 or one of hpcdl.compression's codecs (a custom Compressor's "
                     "compress/decompress cannot run inside hpcdl's fused buckets)")
