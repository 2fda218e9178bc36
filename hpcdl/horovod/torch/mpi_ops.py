"""Horovod's torch collectives over hpcdl.allreduce_async / hpcdl.broadcast_async.

Out-of-place forms reduce a contiguous copy (any input layout is taken);
in-place forms (``_``) work on the tensor itself, which must be contiguous.
Handles are integers for poll()/synchronize(), as in Horovod. allreduce and
broadcast are autograd functions: the gradient of an allreduce is the
allreduce of the gradient, and a broadcast's gradient is summed onto the root.
"""

import torch

import hpcdl
from hpcdl.errors import HpcdlError
from hpcdl.horovod import common
from hpcdl.horovod.common import Sum, global_process_set, poll, synchronize  # noqa: F401 - Horovod's names
from hpcdl.horovod.torch.compression import Compression


def _name(kind, name):
    return None if name is None else f"{kind}.{name}"


def _allreduce_start(output, average, name, op, prescale_factor, postscale_factor, process_set):
    """Start reducing ``output`` in place (the caller's tensor, or its copy for the out-of-place forms);
    returns hpcdl's handle and what finishes its result (None: nothing), for common.register
    or, waited on at once, common.complete."""
    op_name = common.reduce_op(op, average)
    if prescale_factor != 1.0 or postscale_factor != 1.0:  # the dtype is read only when scaled
        common.check_scale(prescale_factor, postscale_factor, not output.dtype.is_floating_point)
    comm = common.comm_of(process_set)  # every check before the tensor is touched
    if prescale_factor != 1.0:
        output.detach().mul_(prescale_factor)  # detach: the same memory, outside autograd
    # the core averages integers with floor division, as Horovod's torch API does
    if name is not None:  # _name() only when named: this is the per-call path of every allreduce
        name = _name("allreduce", name)
    try:  # common.call()'s translation without its frame
        handle = hpcdl.allreduce_async(output, op_name, comm, name)
    except HpcdlError as exc:
        common.reraise(exc)
    if postscale_factor == 1.0:
        return handle, None

    def finish(result):
        result.detach().mul_(postscale_factor)
        return result

    return handle, finish


def _copy(tensor):
    """A contiguous copy outside autograd, for the out-of-place forms (any input layout):
    Horovod's output tensor, which the engine then reduces in place. A tensor autograd does
    not track is cloned as it is (a detach() per call saved)."""
    return (tensor.detach() if tensor.requires_grad else tensor).clone(memory_format=torch.contiguous_format)


def allreduce_async(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Start an average (or op=hvd.Sum, Min, Max, Product) of ``tensor`` over the ranks into a new
    tensor; ``tensor`` is not modified. Returns a handle for poll()/synchronize()."""
    return common.register(
        *_allreduce_start(_copy(tensor), average, name, op, prescale_factor, postscale_factor, process_set)
    )


def allreduce_async_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Start an in-place allreduce of ``tensor``; returns a handle."""
    return common.register(*_allreduce_start(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


def allreduce_(
    tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Allreduce ``tensor`` in place and return it (no integer handle: it is waited on at once)."""
    return common.complete(*_allreduce_start(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class HorovodAllreduce(torch.autograd.Function):
    """An allreduce autograd knows: the gradient is the same allreduce of the output's gradient."""

    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale_factor, postscale_factor, process_set):
        ctx.settings = (average, op, prescale_factor, postscale_factor, process_set)
        return synchronize(allreduce_async(tensor, average, name, op, prescale_factor, postscale_factor, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        average, op, prescale_factor, postscale_factor, process_set = ctx.settings
        grad = allreduce(
            grad_output,
            average=average,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
        )
        return grad, None, None, None, None, None, None


def allreduce(
    tensor,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """The average (or op=hvd.Sum, Min, Max, Product) of ``tensor`` over the ranks, as a new tensor.
    Differentiable: backward allreduces the gradient the same way."""
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        reduced = HorovodAllreduce.apply(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
    else:  # nothing for autograd to record: the same operation without its bookkeeping
        reduced = synchronize(
            allreduce_async(compressed, average, name, op, prescale_factor, postscale_factor, process_set)
        )
    return compression.decompress(reduced, ctx)


def _grouped_allreduce_async(outputs, average, name, op, prescale_factor, postscale_factor, process_set):
    """Start reducing ``outputs`` in place as one operation (hpcdl.grouped_allreduce_async)."""
    op_name = common.reduce_op(op, average)
    common.check_scale(prescale_factor, postscale_factor, any(not t.dtype.is_floating_point for t in outputs))
    comm = common.comm_of(process_set)
    for output in outputs if prescale_factor != 1.0 else ():
        output.detach().mul_(prescale_factor)
    handle = common.call(hpcdl.grouped_allreduce_async, outputs, op_name, comm, _name("grouped_allreduce", name))

    def finish(results):
        for result in results if postscale_factor != 1.0 else ():
            result.detach().mul_(postscale_factor)
        return results

    return common.register(handle, finish)


def grouped_allreduce_async(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Start an allreduce of every tensor in ``tensors`` into new tensors, agreed as one
    operation; synchronize() returns the list."""
    return _grouped_allreduce_async(
        [_copy(t) for t in tensors], average, name, op, prescale_factor, postscale_factor, process_set
    )


def grouped_allreduce_async_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Start an in-place grouped allreduce of ``tensors``; returns a handle."""
    return _grouped_allreduce_async(list(tensors), average, name, op, prescale_factor, postscale_factor, process_set)


def grouped_allreduce_(
    tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set
):
    """Allreduce every tensor of ``tensors`` in place, as one operation; returns the list."""
    return synchronize(
        grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
    )


class HorovodGroupedAllreduce(torch.autograd.Function):
    """A grouped allreduce autograd knows: the gradients are grouped-allreduced the same way."""

    @staticmethod
    def forward(ctx, average, name, op, prescale_factor, postscale_factor, process_set, *tensors):
        ctx.settings = (average, op, prescale_factor, postscale_factor, process_set)
        return tuple(
            synchronize(
                grouped_allreduce_async(tensors, average, name, op, prescale_factor, postscale_factor, process_set)
            )
        )

    @staticmethod
    def backward(ctx, *grad_outputs):
        average, op, prescale_factor, postscale_factor, process_set = ctx.settings
        grads = grouped_allreduce(
            grad_outputs,
            average=average,
            op=op,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
        )
        return (None,) * 6 + tuple(grads)


def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set=global_process_set,
):
    """The average (or op=hvd.Sum, Min, Max, Product) of every tensor of ``tensors`` over the
    ranks, agreed as one operation, as a list of new tensors. Differentiable."""
    compressed = [compression.compress(t) for t in tensors]
    inputs = [t for t, _ in compressed]
    if any(t.requires_grad for t in inputs) and torch.is_grad_enabled():
        reduced = HorovodGroupedAllreduce.apply(
            average, name, op, prescale_factor, postscale_factor, process_set, *inputs
        )
    else:  # nothing for autograd to record
        reduced = synchronize(
            grouped_allreduce_async(inputs, average, name, op, prescale_factor, postscale_factor, process_set)
        )
    return [compression.decompress(t, ctx) for t, (_, ctx) in zip(reduced, compressed)]


def _broadcast_async(output, root_rank, name, process_set):
    """Start broadcasting into ``output`` in place (the caller's tensor, or its copy): any
    dtype the core has (hpcdl.DTYPES), CPU zero-copy or staged from CUDA."""
    handle = common.call(
        hpcdl.broadcast_async,
        output,
        common.root_in(process_set, root_rank),
        common.comm_of(process_set),
        _name("broadcast", name),
    )
    return common.register(handle)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set):
    """Start copying rank ``root_rank``'s ``tensor`` into a new tensor on every rank; returns a handle."""
    return _broadcast_async(_copy(tensor), root_rank, name, process_set)


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set):
    """Start an in-place broadcast of ``tensor`` from ``root_rank``; returns a handle."""
    return _broadcast_async(tensor, root_rank, name, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set):
    """Broadcast ``tensor`` from ``root_rank`` in place and return it."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class HorovodBroadcast(torch.autograd.Function):
    """A broadcast autograd knows: the ranks' gradients are summed onto the root (zeros elsewhere)."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=Sum, process_set=ctx.process_set)
        if common.rank() != ctx.root_rank:
            grad = torch.zeros_like(grad)
        return grad, None, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set):
    """Rank ``root_rank``'s ``tensor`` as a new tensor on every rank (differentiable)."""
    return HorovodBroadcast.apply(tensor, root_rank, name, process_set)


__all__ = [
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "poll",
    "synchronize",
    "HorovodAllreduce",
    "HorovodGroupedAllreduce",
    "HorovodBroadcast",
]
