"""Horovod's gradient compression, framework-blind: Compression.none and Compression.fp16.

A compressor casts a tensor before a collective and back after it (Horovod's
contract: compress(tensor) -> (tensor, ctx), decompress(tensor, ctx)). The
framework modules give FP16Compressor its dtype test and cast; the optimizers,
the tape and the Keras optimizer map compressors onto hpcdl's own codecs
instead (codec()).
"""

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
    """Floating-point tensors travel as float16 (hpcdl sums float16 in float32).
    A framework's subclass says what is floating point and how to cast."""

    @staticmethod
    def is_floating(tensor):
        raise NotImplementedError

    @staticmethod
    def cast(tensor, dtype):
        raise NotImplementedError

    float16 = None

    @classmethod
    def compress(cls, tensor):
        if cls.is_floating(tensor):
            return cls.cast(tensor, cls.float16), tensor.dtype
        return tensor, tensor.dtype

    @classmethod
    def decompress(cls, tensor, ctx):
        return tensor if ctx is None or tensor.dtype == ctx else cls.cast(tensor, ctx)


def compression_names(fp16):
    """The compressors by Horovod's names, with a framework's FP16Compressor."""
    return type(
        "Compression", (), {"__doc__": "The compressors by Horovod's names.", "none": NoneCompressor, "fp16": fp16}
    )


def codec(compression, user):
    """hpcdl's codec for a Horovod compressor; user names what takes it, for the error."""
    if compression is None or compression is NoneCompressor:
        return None
    if isinstance(compression, type) and issubclass(compression, FP16Compressor):
        return hpcdl.compression.FP16()
    if isinstance(compression, hpcdl.compression.Codec):
        return compression
    raise ValueError(
        f"compression={compression!r}: {user} takes Compression.none, "
        "Compression.fp16 or one of hpcdl.compression's codecs (a custom Compressor's "
        "compress/decompress cannot run inside hpcdl's fused buckets)"
    )
