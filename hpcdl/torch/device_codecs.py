"""hpcdl's codecs as torch operations, run on the gradient's device before it is copied
to the host, so the device-to-host copy carries the compressed bytes.

Each encoder produces exactly the bytes of the core's whole-array encoding
(``Codec.encode_into``, the wire formats of docs/compression.md): FP16/BF16
casts round to nearest even, Int8 (nearest rounding) uses the core's
blocks, scales and tiny-block shift, TopK selects the k largest magnitudes
(NaN above Inf above numbers, lower indices win ties) with indices ascending.
The host decodes those bytes with the core's decoder; tests/unit/
test_device_codecs.py checks the bytes against the core's on CPU tensors.

Error feedback: encode(values, residual) encodes values + residual and leaves
in residual what the encoding dropped (0 where that is not finite, as the
core does), one residual per fusion bucket, kept on the device.
"""

import math

import torch

from hpcdl.compression import BF16, FP16, Int8, TopK

_TINY_ABSMAX = 2.0**-100  # blocks below it are staged at 2^64 times their values (include/hpcdl/codecs/codecs.hpp)
_TINY_SHIFT = 2.0**64


def device_codec(codec):
    """The device encoder for a codec from hpcdl.compression, or None when the host encodes
    (no codec, or Int8 with stochastic rounding, whose draws the core keys by operation)."""
    if isinstance(codec, (FP16, BF16)):
        return CastEncoder(codec)
    if isinstance(codec, Int8) and codec.get_config()["rounding"] == "nearest":
        return Int8Encoder(codec)
    if isinstance(codec, TopK):
        return TopKEncoder(codec)
    return None


def _keep_finite(err):
    return torch.where(torch.isfinite(err), err, torch.zeros((), dtype=err.dtype, device=err.device))


class _Encoder:
    def __init__(self, codec):
        self.codec = codec

    def encoded_size(self, count):
        return self.codec.encoded_size(count)

    def encode(self, values, residual=None):
        """uint8 tensor (on values' device) of the encoding of values (+ residual, updated)."""
        v = values if residual is None else values + residual
        encoded, decoded_error = self._encode(v)
        if residual is not None:
            residual.copy_(_keep_finite(decoded_error))
        return encoded


class CastEncoder(_Encoder):
    def __init__(self, codec):
        super().__init__(codec)
        self.dtype = torch.float16 if isinstance(codec, FP16) else torch.bfloat16

    def _encode(self, v):
        half = v.to(self.dtype)
        return half.view(torch.uint8), v - half.float()


class Int8Encoder(_Encoder):
    def __init__(self, codec):
        super().__init__(codec)
        self.block = codec.get_config()["block"]

    def _encode(self, v):
        n, block = v.numel(), self.block
        nb = math.ceil(n / block)
        padded = torch.zeros(nb * block, dtype=torch.float32, device=v.device)
        padded[:n] = v
        blocks = padded.view(nb, block)
        amax = blocks.abs().amax(dim=1)
        finite = torch.isfinite(amax)
        tiny = amax < _TINY_ABSMAX
        shift = torch.where(tiny, torch.full_like(amax, _TINY_SHIFT), torch.ones_like(amax))
        # Divisions by a tensor, not a Python number: CUDA computes t / 127.0 as t * (1/127) and
        # 127.0 / t as reciprocal(t) * 127, one ulp off the core's correctly rounded quotients.
        levels = torch.full_like(amax, 127.0)
        scale = torch.where(finite, amax / levels, torch.full_like(amax, float("nan")))
        inv = torch.where(finite & (amax > 0), levels / (amax * shift), torch.zeros_like(amax))
        staged = blocks * shift[:, None]
        r = torch.round(staged * inv[:, None])
        # the core clamps with max(-127, r) first, which turns NaN into -127
        q = torch.where(torch.isnan(r), torch.full_like(r, -127.0), r.clamp(-127.0, 127.0))
        unit = scale * shift
        err = torch.where(tiny[:, None], (staged - q * unit[:, None]) * (1.0 / _TINY_SHIFT), staged - q * unit[:, None])
        err = torch.where(torch.isfinite(2.0 * scale)[:, None], err, torch.zeros_like(err))
        q8 = q.to(torch.int8).view(-1)[:n]
        encoded = torch.cat([scale.view(torch.uint8), q8.view(torch.uint8)])
        return encoded, err.view(-1)[:n]


class TopKEncoder(_Encoder):
    def __init__(self, codec):
        super().__init__(codec)
        self.ratio = codec.get_config()["ratio"]

    def _encode(self, v):
        n = v.numel()
        k = self.codec.k(n)  # the core's topk_count
        magnitude = (v.view(torch.int32) & 0x7FFFFFFF).to(torch.int64)  # float order, NaN above Inf
        position = torch.arange(n, device=v.device, dtype=torch.int64)
        key = (magnitude << 32) | ((1 << 32) - 1 - position)  # equal magnitudes: the lower index wins
        index = torch.topk(key, k, sorted=False).indices.sort().values
        values = v[index]
        err = v.clone()
        err[index] = 0
        encoded = torch.cat([index.to(torch.int32).view(torch.uint8), values.view(torch.uint8)])
        return encoded, err
