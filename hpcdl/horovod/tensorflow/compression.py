"""Horovod's gradient compression for TensorFlow tensors: Compression.none and Compression.fp16.

compress(tensor) -> (tensor, ctx) before a collective, decompress(tensor, ctx)
after it; the Keras optimizer and the tape map them onto hpcdl's codecs (codec()).
"""

import tensorflow as tf

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
        if tensor.dtype.is_floating:
            return tf.cast(tensor, tf.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        return tensor if ctx is None or tensor.dtype == ctx else tf.cast(tensor, ctx)


class Compression:
    """The compressors by Horovod's names."""

    none = NoneCompressor
    fp16 = FP16Compressor


def codec(compression):
    """hpcdl's codec for a Horovod compressor (the tape's and the Keras optimizer's fused gradients)."""
    if compression in (None, NoneCompressor):
        return None
    if compression is FP16Compressor:
        return hpcdl.compression.FP16()
    if isinstance(compression, hpcdl.compression.Codec):
        return compression
    raise ValueError(f"compression={compression!r}: hpcdl's gradient reduction takes Compression.none, "
                     "Compression.fp16 or one of hpcdl.compression's codecs (a custom Compressor's "
                     "compress/decompress cannot run inside hpcdl's fused buffers)")
