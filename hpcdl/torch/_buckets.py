"""DistributedOptimizer's fusion buckets: gradients of several parameters of one dtype
in one flat buffer, reduced by one allreduce.

A bucket of CPU parameters gathers the gradients in host memory that the core
reduces in place. A bucket of CUDA parameters (or of CPU ones under
hpcdl._tensors.staging_cpu_tensors, which runs the same code on CPU) gathers
them on the device; once its last gradient is in, the side stream waits for
the event recorded on the stream that produced them, encodes the bucket on
the device when a codec shrinks it (hpcdl.torch.device_codecs), and copies the
bytes to pinned host memory; the "hpcdl-cuda" thread waits for that copy's
event, decodes compressed bytes on the host and lets the engine move the
data. After the ring the result goes back to the device asynchronously,
ordered before whatever the caller's stream runs next (the optimizer step).

A float32 CPU bucket with TopK is not gathered: the engine reads each
gradient where backward left it, as a segment of the bucket (the index of
an element is its offset in the concatenation of the slots), and writes the
result back into the same tensors, so neither the copy in nor the copy back
exists. A gradient that cannot be a segment (none, not contiguous, another
dtype) is copied into its slot of the flat buffer, which is then its segment.
The bucket keeps each segment's tensor until the step's reduction is read.
"""

import torch

import hpcdl
from hpcdl import _tensors
from hpcdl.compression import TopK
from hpcdl.torch.device_codecs import device_codec


def set_grad(param, reduced):
    """param.grad holds the reduced gradient afterwards (a copy into the existing .grad)."""
    if param.grad is None or param.grad.layout != torch.strided:
        param.grad = reduced.to(param.device, copy=True)
    else:
        param.grad.copy_(reduced)


class Bucket:
    def __init__(self, index, name, dtype, slots, staged, compression, size, grad_as_view=False):
        self.index = index
        self.name = name
        self.compression = compression
        self.slots = slots  # [(param, offset, numel)]
        self.staged = staged
        self.device = slots[0][0].device
        self.numel = numel = sum(n for _, _, n in slots)
        # One rank: the average is the gradient itself; a device bucket stays on the device.
        self.local = staged and size == 1
        self.dtype = dtype
        self.filled = set()  # params whose gradient is in the buffer
        self.handle = None
        self.launched = None  # the hpcdl-cuda thread's job for a staged bucket
        # gradient_as_bucket_view: .grad becomes the parameter's slot of a host bucket (reduced in place)
        self.grad_as_view = grad_as_view and not staged and not self.local
        # TopK reads and writes the gradients where they lie (the module's docstring)
        self.segmented = isinstance(compression, TopK) and dtype == torch.float32 and not staged
        self.in_place = {}  # param -> its .grad, the segment reduced in place this step
        if self.local:
            return
        self.flat = _tensors.host_buffer(numel, dtype, self.device if staged else torch.device("cpu"))
        self.flat.zero_()
        self.array, self.core_dtype = _tensors.numpy_view(self.flat)
        self.gather = torch.zeros(numel, dtype=dtype, device=self.device) if staged else self.flat
        self.encoder = device_codec(compression) if staged and dtype == torch.float32 else None
        if self.encoder is not None:
            self.residual = torch.zeros(numel, dtype=dtype, device=self.device)
            self.wire = _tensors.host_buffer(self.encoder.encoded_size(numel), torch.uint8, self.device)

    def submit(self, op, comm, deferred):
        """Announce this step's allreduce of the bucket; returns its handle (also kept in self.handle)."""
        self.handle = hpcdl.allreduce_async(
            self.array,
            op=op,
            comm=comm,
            name=self.name,
            dtype=self.core_dtype,
            deferred=deferred,
            **({} if self.compression is None else {"compression": self.compression}),
        )
        return self.handle

    def timings(self):
        """The timings of this step's operations (hpcdl's Handle.timings() with their names)."""
        return [dict(self.handle.timings(), name=self.name)]

    def view(self, offset, numel, param):
        """Where param's gradient is gathered (on its device for a staged bucket)."""
        return self.gather[offset : offset + numel].view(param.shape)

    def deliver(self, param, reduced):
        """Leave param's reduced gradient (its slot of result()) in param.grad: a copy, or with
        grad_as_view the slot itself becomes param.grad (backward then accumulates into it)."""
        if param.grad is not None and param.grad.layout == torch.strided and _same_memory(param.grad, reduced):
            return  # reduced in place (a segment): nothing to copy
        if not self.grad_as_view:
            set_grad(param, reduced)
        elif param.grad is None or not _same_memory(param.grad, reduced):
            param.grad = reduced

    def put(self, offset, numel, param, grad):
        """Gather param's gradient (None: zeros) into the bucket (nothing to copy when it is
        the slot already: gradient_as_bucket_view)."""
        if self.segmented and grad is not None and _can_be_segment(grad):
            self.in_place[param] = grad
            return
        slot = self.view(offset, numel, param)
        if grad is None:
            slot.zero_()
        elif not _same_memory(grad, slot):
            slot.copy_(grad)

    def launch(self):
        """All gradients are in: let the data move (for a staged bucket, once it reached the host)."""
        if not self.staged:
            if self.segmented:
                self.handle.mark_ready(
                    [_tensors.host_memory(self._segment(p, off, n), None) for p, off, n in self.slots]
                )
            else:
                self.handle.mark_ready()
            return
        with _tensors.SideWork(self.device) as work:
            if self.encoder is None:
                self.flat.copy_(self.gather, non_blocking=True)
            else:
                self.wire.copy_(self.encoder.encode(self.gather, self.residual), non_blocking=True)
            work.keep(self.gather)
        self.launched = _tensors.launcher().submit(self._land, work)

    def _land(self, work):
        """On the hpcdl-cuda thread: the copy reached the host; the ring may start."""
        try:
            work.wait_host()
            if self.encoder is not None:
                self.encoder.codec.decode_into(self.wire.numpy(), self.array)
        finally:  # a failure here is raised by wait_launched(); the ring must not wait forever for it
            self.handle.mark_ready()

    def wait_launched(self):
        """Raise what launching failed with (the CPU never waits for the device here)."""
        if self.launched is not None:
            launched, self.launched = self.launched, None
            launched.result()

    def _segment(self, param, offset, numel):
        """Where param's data lies this step: its gradient, or its slot of the flat buffer."""
        grad = self.in_place.get(param)
        return grad if grad is not None else self.flat[offset : offset + numel]

    def result(self):
        """The reduced bucket, where the parameters live: for a staged bucket the copy back
        is queued on the side stream and the caller's stream waits for it."""
        if self.staged:
            _tensors.copy_async(self.gather, self.flat, self.device).order_current_stream()
        return self.gather

    def results(self):
        """(param, its reduced gradient) per slot: its slot of result(), or the gradient
        itself where its segment was reduced in place."""
        reduced = self.result()
        for p, offset, numel in self.slots:
            grad = self.in_place.get(p)
            yield p, grad if grad is not None else reduced[offset : offset + numel].view(p.shape)

    def end_step(self):
        """The step's reduction is read: forget its gradients."""
        self.handle = None
        self.filled.clear()
        self.in_place.clear()


def _can_be_segment(grad):
    """A gradient the engine may reduce where it lies (the host_memory rules, and float32)."""
    return grad.dtype == torch.float32 and grad.is_cpu and grad.is_contiguous() and not grad.is_neg()


def _same_memory(a, b):
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


def dense_bytes(param):
    """What a parameter's gradient weighs in a bucket that sends it as it is."""
    return param.numel() * param.element_size()


def make_buckets(named, bucket_bytes, name, first_index, reducible, build, weigh=dense_bytes):
    """Reverse registration order (the order backward produces gradients), one dtype and
    device per bucket, a new bucket once its parameters weigh bucket_bytes (weigh(param):
    the bytes it puts on the wire): the same on every rank. build(index, bucket name,
    dtype, slots) makes each bucket."""
    open_slots, weights, buckets = {}, {}, []

    def close(key):
        slots = open_slots.pop(key)
        index = first_index + len(buckets)
        buckets.append(build(index, f"{name}.bucket.{index}", key[0], slots))

    for pname, p in reversed(named):
        if p.dtype not in reducible:
            raise TypeError(
                f"parameter '{pname}' has dtype {p.dtype}; hpcdl reduces {', '.join(str(t) for t in reducible)}"
            )
        key = (p.dtype, p.device)
        slots = open_slots.setdefault(key, [])
        offset = sum(n for _, _, n in slots)
        slots.append((p, offset, p.numel()))
        weights[key] = weights.get(key, 0) + weigh(p)
        if weights[key] >= bucket_bytes:
            weights.pop(key)
            close(key)
    for key in list(open_slots):
        close(key)
    return buckets
