"""The one intake of framework tensors for hpcdl's collectives.

numpy arrays and other buffer-protocol objects go to the core as they are.
A torch CPU tensor goes by address (data_ptr(), shape, dtype: no numpy view)
to every collective, with one set of checks (host_memory): in place like an
array for allreduce and broadcast, read for those whose result is new memory.
A torch CUDA tensor is staged: its bytes are copied to pinned host memory on
a side stream once the work queued on its producing stream is done (an
event, not a device-wide sync), the core reduces the host copy, and the
result is copied back asynchronously, ordered before later work on the
caller's stream. A TensorFlow tensor is copied (EagerTensors are immutable:
the result is a new tensor; a tf.Variable is assigned in place).

No framework is imported here: a tensor is recognised by its type's module,
and the framework is taken from sys.modules (it is loaded, since one of its
tensors exists). Non-contiguous tensors are refused like non-contiguous
arrays (hpcdl works in place): pass ``tensor.contiguous()``; so are tensors
with the negative bit set (resolve_neg()) and tensors on other devices.
"""

import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from hpcdl import _core

# Tests run the staging path (side stream, host buffer, waiter thread) on CPU
# tensors, where no GPU exists: staging_cpu_tensors(True) turns it on.
_stage_cpu = {"on": False}


def staging_cpu_tensors(on):
    """Stage CPU tensors like CUDA ones (the same code path, plain host memory). Returns the old setting."""
    old, _stage_cpu["on"] = _stage_cpu["on"], bool(on)
    return old


_frameworks = {}  # type -> the package it comes from ("torch", "tensorflow", "numpy"...), per type once


def _framework(obj):
    kind = type(obj)
    if kind not in _frameworks:
        _frameworks[kind] = kind.__module__.partition(".")[0]
    return _frameworks[kind]


def is_torch(obj):
    return _framework(obj) == "torch" and hasattr(obj, "data_ptr")


def staged(tensor):
    """True when a torch tensor goes through host staging (CUDA, or CPU under staging_cpu_tensors)."""
    return tensor.is_cuda or (_stage_cpu["on"] and tensor.device.type == "cpu")


def numpy_view(tensor):
    """A zero-copy numpy view of a contiguous CPU tensor and the dtype name for the core
    (None: numpy's own), for code that works on the tensor as an array (hpcdl.torch's
    buckets). bfloat16 has no numpy type: its bits go as int16 with "bfloat16"."""
    torch = sys.modules["torch"]
    flat = tensor.detach()
    if flat.dtype == torch.bfloat16:
        return flat.view(torch.int16).numpy(), "bfloat16"
    return flat.numpy(), None


_torch_dtypes = {}  # torch dtype -> (its name, the core's when it has it; item size)


def host_memory(tensor, dtype):
    """The core's Buffer over a CPU tensor's own memory, by address (no numpy view:
    this is the per-call path of every in-place collective), read as ``dtype``
    (None: the tensor's own), once it is contiguous, on the CPU and without the
    negative bit. Outside autograd, as for any array."""
    if not tensor.is_contiguous():
        raise ValueError(_NOT_CONTIGUOUS)
    if not tensor.is_cpu:
        raise TypeError(f"hpcdl takes CPU and CUDA tensors, got one on {tensor.device}: pass tensor.cpu()")
    if tensor.is_neg():
        raise ValueError("tensor has its negative bit set (a lazy negation view): pass tensor.resolve_neg()")
    name, itemsize = _torch_dtypes.get(tensor.dtype) or _torch_dtype(tensor.dtype)
    return _core.Buffer.at(tensor, tensor.data_ptr(), itemsize, tensor.shape, dtype or name)


def _torch_dtype(dtype):
    """(dtype's name, the core's when it has it; its item size), kept per torch dtype."""
    _torch_dtypes[dtype] = (str(dtype).removeprefix("torch."), dtype.itemsize)
    return _torch_dtypes[dtype]


_NOT_CONTIGUOUS = (
    "tensor is not contiguous; hpcdl works in place: pass tensor.contiguous() "
    "(and copy the result back if you need it in the original)"
)


def _require_contiguous(tensor):
    if not tensor.is_contiguous():
        raise ValueError(_NOT_CONTIGUOUS)


_side_streams = {}
_launcher = {"pool": None}


def side_stream(device):
    """hpcdl's copy stream on a CUDA device (one per device), None for CPU."""
    if device.type != "cuda":
        return None
    torch = sys.modules["torch"]
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def launcher():
    """The thread ("hpcdl-cuda") that waits for staged copies to land and then lets the
    engine move their data; it never waits for the engine, so launches never queue behind it."""
    if _launcher["pool"] is None:
        _launcher["pool"] = ThreadPoolExecutor(1, thread_name_prefix="hpcdl-cuda")
    return _launcher["pool"]


class SideWork:
    """Work queued on the device's side stream after everything queued so far on the
    caller's stream (an event, not a device-wide sync); run at once on CPU.

        with SideWork(device) as work:
            host.copy_(tensor, non_blocking=True)
            work.keep(host, tensor)
        work.wait_host() / work.order_current_stream()
    """

    def __init__(self, device):
        self.device = device
        self.stream = side_stream(device)
        self.event = None
        self._context = None

    def __enter__(self):
        if self.stream is not None:
            torch = sys.modules["torch"]
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(self.device))
            self.stream.wait_event(produced)
            self._context = torch.cuda.stream(self.stream)
            self._context.__enter__()
        return self

    def __exit__(self, *exc):
        if self.stream is not None:
            self.event = sys.modules["torch"].cuda.Event()
            self.event.record(self.stream)
            self._context.__exit__(*exc)
        return False

    def keep(self, *tensors):
        """The caching allocator must not hand these to other work before the side stream used them."""
        if self.stream is not None:
            for t in tensors:
                if t.is_cuda:
                    t.record_stream(self.stream)

    def wait_host(self):
        """Block this thread until the work is done (its event only, not the device)."""
        if self.event is not None:
            self.event.synchronize()

    def order_current_stream(self):
        """Later work on the caller's stream runs after this work (the CPU does not wait)."""
        if self.event is not None:
            sys.modules["torch"].cuda.current_stream(self.device).wait_event(self.event)


def copy_async(dst, src, device):
    """dst.copy_(src) on the side stream after the caller's queued work; returns its SideWork."""
    with SideWork(device) as work:
        dst.copy_(src, non_blocking=True)
        work.keep(dst, src)
    return work


def host_buffer(numel, dtype, device):
    """A flat host tensor to stage a device tensor through: pinned for CUDA (torch caches those)."""
    torch = sys.modules["torch"]
    return torch.empty(numel, dtype=dtype, pin_memory=device.type == "cuda")


class _ResultHandle:
    """A core handle whose result needs a last step once the operation is done:
    done() and wait() run _finish() (the subclass's) once the core's handle says so."""

    def done(self):
        if not self._handle.done():
            return False
        self._finish()
        return True

    def wait(self, timeout=None):
        self._handle.wait(timeout)
        return self._finish()


class TensorHandle(_ResultHandle):
    """The handle of a collective on a torch tensor: wait() finishes the core operation,
    for a staged tensor copies the result back asynchronously (ordered before later
    work on the caller's stream), and returns the tensor."""

    def __init__(self, handle, tensor, host, copy_back):
        self._handle, self._tensor, self._host, self._copy_back = handle, tensor, host, copy_back
        self.name = handle.name
        self._finished = False

    def _finish(self):
        if not self._finished:
            self._finished = True
            if self._copy_back:
                copy_async(self._tensor.detach().view(-1), self._host, self._tensor.device).order_current_stream()
        return self._tensor

    def __getattr__(self, attribute):  # mark_ready(), ready(), timings(), wait_for()...
        return getattr(self._handle, attribute)


class _TFResult(_ResultHandle):
    """The handle of a collective on a TensorFlow tensor's copy: wait() returns the
    result as a tensor (assigned into a tf.Variable in place)."""

    def __init__(self, handle, tensor, array):
        self._handle, self._tensor, self._array = handle, tensor, array
        self.name = handle.name
        self._result = None

    def _finish(self):
        if self._result is None:
            if hasattr(self._tensor, "assign"):
                self._tensor.assign(self._array)
                self._result = self._tensor
            else:
                self._result = sys.modules["tensorflow"].convert_to_tensor(self._array)
        return self._result


def submit(obj, dtype, writable, run):
    """Take any supported array or tensor to the core. run(buffer) submits the
    operation on a core Buffer and returns the core's Handle; returns the handle the
    caller's wait() sees. writable: the result is written into obj."""
    framework = _framework(obj)
    if framework == "torch" and hasattr(obj, "data_ptr"):
        if not staged(obj):
            return run(host_memory(obj, dtype))  # in place: the core's handle gives the tensor back
        return _submit_staged(obj, dtype, writable, run)
    if framework == "tensorflow" and hasattr(obj, "numpy"):
        array = obj.numpy().copy()  # a private, writable, contiguous copy
        return _TFResult(run(_core.Buffer(array, dtype, True)), obj, array)
    return run(_core.Buffer(obj, dtype, writable))


def _submit_staged(tensor, dtype, writable, run):
    _require_contiguous(tensor)
    host = host_buffer(tensor.numel(), tensor.dtype, tensor.device)
    # the ring needs the bytes: this thread waits for this copy only, not the device
    copy_async(host, tensor.detach().view(-1), tensor.device).wait_host()
    shaped = host.view(tensor.shape)  # the tensor's shape is part of what ranks agree on
    return TensorHandle(run(host_memory(shaped, dtype)), tensor, host, copy_back=writable)


def intake(obj, dtype):
    """obj for the collectives whose result is new memory (allgather, alltoall,
    reducescatter): the core's Buffer over it, read as ``dtype`` (None: its own),
    obj's shape, the numpy dtype of a result's elements, and a function turning a
    result array into obj's kind: a numpy array, a torch tensor on obj's device, a
    TensorFlow tensor. A torch CPU tensor goes by address (host_memory: the checks
    of the in-place collectives); a CUDA one is staged; TensorFlow's is its copy."""
    if is_torch(obj):
        source = obj
        if staged(obj):
            _require_contiguous(obj)
            source = host_buffer(obj.numel(), obj.dtype, obj.device)
            copy_async(source, obj.detach().view(-1), obj.device).wait_host()
            source = source.view(obj.shape)
        buffer = host_memory(source, dtype)
        return buffer, tuple(obj.shape), _result_dtype(obj.dtype), lambda result: _as_torch(result, obj)
    if _framework(obj) == "tensorflow" and hasattr(obj, "numpy"):
        array, convert = obj.numpy(), sys.modules["tensorflow"].convert_to_tensor
    else:
        array, convert = np.asarray(obj), None
    return _core.Buffer(array, dtype, False), array.shape, array.dtype, convert or (lambda result: result)


def _result_dtype(dtype):
    """The numpy dtype a result of torch ``dtype`` is read as (bfloat16: its bits as int16, as numpy_view)."""
    name = (_torch_dtypes.get(dtype) or _torch_dtype(dtype))[0]
    return np.dtype("int16" if name == "bfloat16" else name)


def _as_torch(array, like):
    torch = sys.modules["torch"]
    tensor = torch.from_numpy(array)
    if like.dtype == torch.bfloat16:
        tensor = tensor.view(torch.bfloat16)
    return tensor if like.device.type == "cpu" else tensor.to(like.device)


class OutputHandle(_ResultHandle):
    """The handle of a collective whose result is new memory: wait() returns
    finish(core handle), made once."""

    def __init__(self, handle, finish):
        self._handle, self._make = handle, finish
        self.name = handle.name
        self._made = False
        self._result = None

    def _finish(self):
        if not self._made:
            self._result, self._made = self._make(self._handle), True
        return self._result

    def __getattr__(self, attribute):  # timings(), wait_for()...
        return getattr(self._handle, attribute)
