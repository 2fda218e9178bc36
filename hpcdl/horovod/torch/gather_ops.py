"""Horovod's torch allgather, alltoall and reducescatter (and their async and
grouped forms) over hpcdl.allgather_async / alltoall_async / reducescatter_async.

Inputs are never modified; results are new tensors on the input's device,
every type of hpcdl.DTYPES. allgather, alltoall and reducescatter are
autograd functions, with Horovod's gradients: an allgather's is this rank's
rows of the averaged gradient, a reducescatter's the allgather of the
gradient (divided by the size for an average), an alltoall's the alltoall of
the gradient back by the received splits. Grouped forms are one agreed
operation over the group (hpcdl.grouped_allgather, grouped_reducescatter).
"""

import torch

import hpcdl
from hpcdl.horovod import common
from hpcdl.horovod.common import Average, global_process_set, synchronize
from hpcdl.horovod.torch.compression import Compression
from hpcdl.horovod.torch.mpi_ops import allreduce


def _name(kind, name):
    return None if name is None else f"{kind}.{name}"


def _movable(tensor):
    """A contiguous tensor the core moves, outside autograd."""
    return tensor.detach().contiguous()


def _rank_in(process_set):
    return common.comm_of(process_set).Get_rank()


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start concatenating every rank's ``tensor`` along the first dimension (which may
    differ per rank); returns a handle for poll()/synchronize()."""
    handle = common.call(hpcdl.allgather_async, _movable(tensor), common.comm_of(process_set), _name("allgather", name))
    return common.register(handle)


class HorovodAllgather(torch.autograd.Function):
    """An allgather autograd knows: the gradient is this rank's rows of the averaged gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        return _allgather_grad(grad_output, ctx.rows, ctx.process_set), None, None


def _allgather_grad(grad_output, rows, process_set):
    """An allgather's gradient: this rank's rows of the averaged gradient."""
    grad = allreduce(grad_output, op=Average, process_set=process_set)
    every_rows = synchronize(allgather_async(torch.tensor([rows]), process_set=process_set))
    offset = int(every_rows[: _rank_in(process_set)].sum())
    return grad.narrow(0, offset, rows)


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order (differentiable)."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return HorovodAllgather.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start an allgather of each tensor, agreed as one operation
    (hpcdl.grouped_allgather_async); one handle, whose result is the list."""
    handle = common.call(
        hpcdl.grouped_allgather_async,
        [_movable(tensor) for tensor in tensors],
        common.comm_of(process_set),
        _name("grouped_allgather", name),
    )
    return common.register(handle)


class HorovodGroupedAllgather(torch.autograd.Function):
    """A grouped allgather autograd knows: each member's gradient is its allgather's."""

    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(tensors, name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, *(_allgather_grad(g, rows, ctx.process_set) for g, rows in zip(grads, ctx.rows)))


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """allgather of each tensor, agreed as one operation, as a list (differentiable)."""
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return list(HorovodGroupedAllgather.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def _reducescatter_args(tensor, op, prescale_factor, postscale_factor):
    op_name = common.reduce_op(op, None)
    common.check_scale(prescale_factor, postscale_factor, not tensor.dtype.is_floating_point)
    data = tensor.detach().contiguous()
    if prescale_factor != 1.0:
        data = data * prescale_factor
    return data, op_name


def _postscale(factor):
    return (lambda out: out) if factor == 1.0 else (lambda out: out.mul_(factor))


def reducescatter_async(
    tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
):
    """Start reducing ``tensor`` over the ranks and scattering the result's first
    dimension (the first ``rows % size`` ranks one row more); returns a handle."""
    data, op_name = _reducescatter_args(tensor, op, prescale_factor, postscale_factor)
    handle = common.call(
        hpcdl.reducescatter_async, data, op_name, common.comm_of(process_set), _name("reducescatter", name)
    )
    return common.register(handle, _postscale(postscale_factor))


class HorovodReducescatter(torch.autograd.Function):
    """A reducescatter autograd knows: the gradient is the allgather of the gradient
    (divided by the size for an average)."""

    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale_factor, postscale_factor):
        ctx.average, ctx.process_set = common.reduce_op(op, None) == "average", process_set
        ctx.scale = prescale_factor * postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale_factor, postscale_factor))

    @staticmethod
    def backward(ctx, grad_output):
        return _reducescatter_grad(grad_output, ctx), None, None, None, None, None


def _reducescatter_grad(grad_output, ctx):
    """A reducescatter's gradient: the allgather of the gradient (divided by the size for an average)."""
    grad = synchronize(allgather_async(grad_output, process_set=ctx.process_set))
    if ctx.average:
        grad = grad / common.comm_of(ctx.process_set).Get_size()
    if ctx.scale != 1.0:
        grad = grad * ctx.scale
    return grad


def reducescatter(
    tensor,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """This rank's rows of the average (or sum) of ``tensor`` over the ranks (differentiable)."""
    compressed, ctx = compression.compress(tensor)
    if compressed.requires_grad and torch.is_grad_enabled():
        out = HorovodReducescatter.apply(compressed, name, op, process_set, prescale_factor, postscale_factor)
    else:
        out = synchronize(reducescatter_async(compressed, name, op, process_set, prescale_factor, postscale_factor))
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(
    tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0, postscale_factor=1.0
):
    """Start a reducescatter of each tensor, agreed as one operation
    (hpcdl.grouped_reducescatter_async); one handle, whose result is the list."""
    prepared = [_reducescatter_args(tensor, op, prescale_factor, postscale_factor) for tensor in tensors]
    op_name = common.reduce_op(op, None)
    handle = common.call(
        hpcdl.grouped_reducescatter_async,
        [data for data, _ in prepared],
        op_name,
        common.comm_of(process_set),
        _name("grouped_reducescatter", name),
    )
    scale = _postscale(postscale_factor)
    return common.register(handle, lambda outs: [scale(o) for o in outs])


class HorovodGroupedReducescatter(torch.autograd.Function):
    """A grouped reducescatter autograd knows: each member's gradient is its reducescatter's."""

    @staticmethod
    def forward(ctx, name, op, process_set, prescale_factor, postscale_factor, *tensors):
        ctx.average, ctx.process_set = common.reduce_op(op, None) == "average", process_set
        ctx.scale = prescale_factor * postscale_factor
        return tuple(
            synchronize(grouped_reducescatter_async(tensors, name, op, process_set, prescale_factor, postscale_factor))
        )

    @staticmethod
    def backward(ctx, *grads):
        return (None, None, None, None, None, *(_reducescatter_grad(g, ctx) for g in grads))


def grouped_reducescatter(
    tensors,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """reducescatter of each tensor, agreed as one operation, as a list (differentiable)."""
    compressed = [compression.compress(t) for t in tensors]
    inputs = [c for c, _ in compressed]
    if any(t.requires_grad for t in inputs) and torch.is_grad_enabled():
        outs = HorovodGroupedReducescatter.apply(name, op, process_set, prescale_factor, postscale_factor, *inputs)
    else:
        outs = synchronize(
            grouped_reducescatter_async(inputs, name, op, process_set, prescale_factor, postscale_factor)
        )
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, compressed)]


def _splits_list(splits):
    if splits is None:
        return None
    return [int(n) for n in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set):
    """Start sending ``splits[j]`` rows of ``tensor`` to rank j (None: equal split);
    synchronize() returns (received, received_splits as an int32 tensor)."""
    handle = common.call(
        hpcdl.alltoall_async,
        _movable(tensor),
        _splits_list(splits),
        common.comm_of(process_set),
        _name("alltoall", name),
    )
    return common.register(handle, lambda out: (out[0], torch.tensor(out[1], dtype=torch.int32)))


class HorovodAlltoall(torch.autograd.Function):
    """An alltoall autograd knows: the gradient goes back by the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        output, received_splits = synchronize(alltoall_async(tensor, splits, name, process_set))
        ctx.process_set, ctx.received_splits = process_set, received_splits
        ctx.mark_non_differentiable(received_splits)
        return output, received_splits

    @staticmethod
    def backward(ctx, grad_output, *unused):
        grad, _ = synchronize(alltoall_async(grad_output, ctx.received_splits, process_set=ctx.process_set))
        return grad, None, None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """Rows of ``tensor`` to each rank by ``splits`` (None: equal split), received in
    rank order (differentiable). Returns the received tensor, and with ``splits``
    given also the received splits (an int32 tensor), as Horovod does."""
    if tensor.requires_grad and torch.is_grad_enabled():
        output, received_splits = HorovodAlltoall.apply(tensor, splits, name, process_set)
    else:
        output, received_splits = synchronize(alltoall_async(tensor, splits, name, process_set))
    return output if splits is None else (output, received_splits)


__all__ = [
    "allgather",
    "allgather_async",
    "grouped_allgather",
    "grouped_allgather_async",
    "reducescatter",
    "reducescatter_async",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "alltoall",
    "alltoall_async",
    "HorovodAllgather",
    "HorovodGroupedAllgather",
    "HorovodReducescatter",
    "HorovodGroupedReducescatter",
    "HorovodAlltoall",
]
