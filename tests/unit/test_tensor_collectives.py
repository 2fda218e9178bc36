"""hpcdl.allreduce / broadcast (and their async forms) take torch tensors as they take numpy
arrays: in place, the same errors; TF tensors by copy. One process: the single-rank world."""

import numpy as np
import pytest
import torch

import hpcdl
from hpcdl import _tensors

from helpers.device import device  # noqa: F401 - the fixture


def test_a_cpu_tensor_is_reduced_in_place_without_a_copy():
    t = torch.arange(6, dtype=torch.float32)
    ptr = t.data_ptr()
    out = hpcdl.allreduce(t, op="average")
    assert out is t and t.data_ptr() == ptr
    assert torch.equal(t, torch.arange(6, dtype=torch.float32))
    # the core reads the tensor's own memory: a handle holds it until waited for
    h = hpcdl.allreduce_async(t)
    assert h.wait() is t


@pytest.mark.parametrize("name", hpcdl.DTYPES)
def test_every_core_dtype_is_taken(name):
    dtype = getattr(torch, name)
    t = torch.ones(5, dtype=dtype)
    assert hpcdl.allreduce(t, op="max" if name == "bool" else "sum") is t
    assert torch.equal(t, torch.ones(5, dtype=dtype))
    assert hpcdl.broadcast(t, root=0) is t


def test_errors_are_those_of_numpy_arrays():
    def error_of(buf, **kw):
        with pytest.raises(Exception) as info:
            hpcdl.allreduce(buf, **kw)
        return type(info.value), str(info.value)

    assert error_of(torch.ones(4, dtype=torch.complex64)) == error_of(np.ones(4, np.complex64))
    assert error_of(torch.ones(4, dtype=torch.bool)) == error_of(np.ones(4, bool))
    assert error_of(torch.ones(4, dtype=torch.int32), compression=hpcdl.compression.Int8()) == error_of(
        np.ones(4, np.int32), compression=hpcdl.compression.Int8()
    )


def test_a_non_contiguous_tensor_is_refused_clearly():
    t = torch.ones(4, 6)[:, ::2]
    with pytest.raises(ValueError, match=r"not contiguous.*tensor\.contiguous\(\)"):
        hpcdl.allreduce(t)
    with pytest.raises(ValueError, match="not contiguous"):
        hpcdl.broadcast_async(t)


def test_a_tensor_is_read_at_its_own_offset_and_shape():
    base = torch.arange(10, dtype=torch.float64)
    part = base[4:].view(2, 3)  # starts 4 elements into its storage
    h = hpcdl.allreduce_async(part, op="max")
    assert h.buffer.shape == (2, 3) and h.buffer.count == 6 and h.buffer.nbytes == 48
    assert h.wait() is part
    assert torch.equal(base, torch.arange(10, dtype=torch.float64))  # nothing outside part was touched
    empty = torch.empty(0, 3)
    assert hpcdl.allreduce(empty) is empty and empty.shape == (0, 3)


def test_tensors_the_core_cannot_read_in_place_are_refused_clearly():
    with pytest.raises(ValueError, match=r"negative bit.*resolve_neg\(\)"):
        hpcdl.allreduce(torch._neg_view(torch.ones(3)))
    with pytest.raises(TypeError, match=r"CPU and CUDA tensors, got one on meta"):
        hpcdl.allreduce(torch.ones(3, device="meta"))
    with pytest.raises(TypeError, match="unsupported dtype float8_e4m3fn; hpcdl takes float32"):
        hpcdl.allreduce(torch.ones(3).to(torch.float8_e4m3fn))
    # dtype= reads the bytes as another type of the same size only
    with pytest.raises(TypeError, match="dtype bfloat16 has 2-byte elements, the buffer has 4-byte items"):
        hpcdl.allreduce(torch.ones(3), dtype="bfloat16")
    bits = torch.ones(3, dtype=torch.bfloat16).view(torch.int16)
    assert hpcdl.allreduce(bits, op="average", dtype="bfloat16") is bits
    assert torch.equal(bits.view(torch.bfloat16), torch.ones(3, dtype=torch.bfloat16))


def test_a_tensor_that_requires_grad_is_reduced_outside_autograd():
    w = torch.ones(3, requires_grad=True)
    assert hpcdl.allreduce(w, op="average") is w and w.grad_fn is None


def test_staged_tensors_come_back_in_place(device):
    t = torch.arange(8, dtype=torch.float32, device=device) * 2
    ptr = t.data_ptr()
    h = hpcdl.allreduce_async(t, op="average", name="staged.unit")
    assert isinstance(h, _tensors.TensorHandle)
    assert h.wait() is t and t.data_ptr() == ptr
    assert torch.equal(t.cpu(), torch.arange(8, dtype=torch.float32) * 2)
    b = torch.arange(3, dtype=torch.bfloat16, device=device)
    assert hpcdl.broadcast(b) is b and torch.equal(b.cpu(), torch.arange(3, dtype=torch.bfloat16))


def test_a_staged_tensor_cannot_be_deferred(device):
    with pytest.raises(ValueError, match="deferred"):
        hpcdl.allreduce_async(torch.ones(2, device=device), deferred=True)


def test_tensorflow_tensors_go_by_copy():
    tf = pytest.importorskip("tensorflow")
    eager = tf.constant([1.0, 2.0, 3.0])
    out = hpcdl.allreduce(eager, op="average")
    assert isinstance(out, tf.Tensor) and out.numpy().tolist() == [1.0, 2.0, 3.0]
    var = tf.Variable([4.0, 5.0])
    assert hpcdl.broadcast(var) is var and var.numpy().tolist() == [4.0, 5.0]
