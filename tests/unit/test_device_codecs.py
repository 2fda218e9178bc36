"""hpcdl.torch.device_codecs: the device encoders write exactly the core's wire bytes
(checked on CPU tensors, and on the GPU under [cuda]), and their error feedback matches
what the core's encoder drops."""

import numpy as np
import pytest
import torch

from hpcdl.compression import BF16, FP16, Int8, TopK
from hpcdl.torch.device_codecs import device_codec

from helpers.device import device  # noqa: F401 - the fixture

CODECS = [FP16(), BF16(), Int8(), Int8(block=7), TopK(0.1), TopK(0.003)]


def awkward_values(seed=0, n=1000):
    """Normal values with the cases the kernels treat apart: a tiny block (int8's 2^64 shift),
    a zero block, magnitudes tied at top-k's cut, values fp16 cannot hold."""
    g = np.random.default_rng(seed)
    v = g.standard_normal(n).astype(np.float32)
    v[256:512] *= np.float32(1e-33)
    v[512:600] = 0
    v[600:700] = np.where(np.arange(100) % 2 == 0, 3.0, -3.0).astype(np.float32)
    v[10] = 7e4
    v[11] = -7e4
    return v


def core_encoding(codec, values):
    out = np.empty(codec.encoded_size(values.size), dtype=np.uint8)
    err = np.zeros_like(values)
    codec.encode_into(values, out, err)
    return out, err


@pytest.mark.parametrize("codec", CODECS, ids=str)
def test_device_bytes_equal_the_core_encoding(codec, device):
    values = awkward_values()
    want, want_err = core_encoding(codec, values)
    encoder = device_codec(codec)
    residual = torch.zeros(values.size, device=device)
    got = encoder.encode(torch.from_numpy(values).to(device), residual).cpu().numpy()
    assert got.nbytes == want.nbytes
    mismatched = np.flatnonzero(got != want)
    assert mismatched.size == 0, f"{mismatched.size} bytes differ, first at {mismatched[:8]}"
    # error feedback: what the encoding dropped, as the core computes it
    np.testing.assert_allclose(residual.cpu().numpy(), want_err, rtol=1e-6, atol=1e-30)


@pytest.mark.parametrize("codec", [FP16(), Int8(block=16), TopK(0.25)], ids=str)
def test_non_finite_values_match_the_core_and_leave_no_residual(codec, device):
    values = awkward_values(seed=1)[:64].copy()
    values[3], values[40] = np.nan, np.inf
    want, want_err = core_encoding(codec, values)
    residual = torch.zeros(values.size, device=device)
    got = device_codec(codec).encode(torch.from_numpy(values).to(device), residual).cpu().numpy()
    decoded_want, decoded_got = np.empty_like(values), np.empty_like(values)
    codec.decode_into(want, decoded_want)
    codec.decode_into(got, decoded_got)
    np.testing.assert_array_equal(np.isnan(decoded_got), np.isnan(decoded_want))
    np.testing.assert_array_equal(decoded_got[np.isfinite(decoded_want)], decoded_want[np.isfinite(decoded_want)])
    assert torch.isfinite(residual).all()
    np.testing.assert_array_equal(residual.cpu().numpy() == 0, want_err == 0)


def test_the_residual_is_added_before_encoding(device):
    """Two encodings with feedback send, in sum, the two inputs up to the last residual."""
    codec = Int8(block=32)
    encoder = device_codec(codec)
    g = torch.Generator().manual_seed(4)
    a, b = torch.randn(300, generator=g), torch.randn(300, generator=g)
    residual = torch.zeros(300, device=device)
    sent = []
    for x in (a, b):
        wire = encoder.encode(x.to(device), residual).cpu().numpy()
        out = np.empty(300, dtype=np.float32)
        codec.decode_into(wire, out)
        sent.append(torch.from_numpy(out))
    torch.testing.assert_close(sent[0] + sent[1] + residual.cpu(), a + b, rtol=0, atol=1e-5)


def test_codecs_the_host_encodes_have_no_device_encoder():
    assert device_codec(None) is None
    assert device_codec(Int8(rounding="stochastic", seed=3)) is None
