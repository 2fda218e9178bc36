"""Horovod's torch allgather, alltoall and reducescatter (and their async and
grouped forms) over hpcdl.allgather_async / alltoall_async / reducescatter_async.

Inputs are never modified; results are new tensors on the input's device,
every type of hpcdl.DTYPES. allgather, alltoall and reducescatter are
autograd functions, with Horovod's gradients: an allgather's is this rank's
rows of the averaged gradient, a reducescatter's the allgather of the
gradient (divided by the size for an average), an alltoall's the alltoall of
the gradient back by the received splits. Grouped forms run one operation per
tensor, submitted together (docs/horovod.md).
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


def _as_is(result):
    return result


def _rank_in(process_set):
    return common.comm_of(process_set).Get_rank()


def allgather_async(tensor, name=None, process_set=global_process_set):
    """Start concatenating every rank's ``tensor`` along the first dimension (which may
    differ per rank); returns a handle for poll()/synchronize()."""
    handle = common.call(hpcdl.allgather_async, _movable(tensor), common.comm_of(process_set), _name("allgather", name))
    return common.register(handle, _as_is)


class HorovodAllgather(torch.autograd.Function):
    """An allgather autograd knows: the gradient is this rank's rows of the averaged gradient."""

    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        grad = allreduce(grad_output, op=Average, process_set=ctx.process_set)
        rows = synchronize(allgather_async(torch.tensor([ctx.rows]), process_set=ctx.process_set))
        offset = int(rows[: _rank_in(ctx.process_set)].sum())
        return grad.narrow(0, offset, ctx.rows), None, None


def allgather(tensor, name=None, process_set=global_process_set):
    """Every rank's ``tensor`` concatenated along the first dimension, in rank order (differentiable)."""
    if tensor.requires_grad and torch.is_grad_enabled():
        return HorovodAllgather.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather_async(tensors, name=None, process_set=global_process_set):
    """Start an allgather of each tensor (one operation each, submitted together); one handle."""
    handles = [
        common.call(
            hpcdl.allgather_async,
            _movable(tensor),
            common.comm_of(process_set),
            _name("allgather", common.group_name(name, i)),
        )
        for i, tensor in enumerate(tensors)
    ]
    return common.register(common.Group(handles), _as_is)


def grouped_allgather(tensors, name=None, process_set=global_process_set):
    """allgather of each tensor, as a list."""
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [allgather(t, common.group_name(name, i), process_set) for i, t in enumerate(tensors)]
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
        grad = synchronize(allgather_async(grad_output, process_set=ctx.process_set))
        if ctx.average:
            grad = grad / common.comm_of(ctx.process_set).Get_size()
        if ctx.scale != 1.0:
            grad = grad * ctx.scale
        return grad, None, None, None, None, None


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
    """Start a reducescatter of each tensor (one operation each, submitted together); one handle."""
    handles = []
    for i, tensor in enumerate(tensors):
        data, op_name = _reducescatter_args(tensor, op, prescale_factor, postscale_factor)
        handles.append(
            common.call(
                hpcdl.reducescatter_async,
                data,
                op_name,
                common.comm_of(process_set),
                _name("reducescatter", common.group_name(name, i)),
            )
        )
    scale = _postscale(postscale_factor)
    return common.register(common.Group(handles), lambda outs: [scale(o) for o in outs])


def grouped_reducescatter(
    tensors,
    name=None,
    compression=Compression.none,
    op=Average,
    process_set=global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """reducescatter of each tensor, as a list."""
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [
            reducescatter(
                t, common.group_name(name, i), compression, op, process_set, prescale_factor, postscale_factor
            )
            for i, t in enumerate(tensors)
        ]
    compressed = [compression.compress(t) for t in tensors]
    outs = synchronize(
        grouped_reducescatter_async(
            [c for c, _ in compressed], name, op, process_set, prescale_factor, postscale_factor
        )
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
    "HorovodReducescatter",
    "HorovodAlltoall",
]
