"""Horovod's gradient compression for TensorFlow tensors: Compression.none and Compression.fp16
(hpcdl.horovod.compression has the rules; this module gives them TensorFlow's dtypes)."""

import tensorflow as tf

from hpcdl.horovod import compression as _compression
from hpcdl.horovod.compression import Compressor, NoneCompressor  # noqa: F401 (Horovod's names)


class FP16Compressor(_compression.FP16Compressor):
    float16 = tf.float16

    @staticmethod
    def is_floating(tensor):
        return tensor.dtype.is_floating

    @staticmethod
    def cast(tensor, dtype):
        return tf.cast(tensor, dtype)


Compression = _compression.compression_names(FP16Compressor)


def codec(compression):
    """hpcdl's codec for a Horovod compressor (the tape's and the Keras optimizer's fused gradients)."""
    return _compression.codec(compression, "hpcdl's gradient reduction")
