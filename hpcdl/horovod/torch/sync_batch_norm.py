"""Horovod's SyncBatchNorm: batch normalization whose statistics are those of the
whole global batch, over hpcdl.allgather.

In training, every rank's per-channel sum, sum of squares and count (float64)
are allgathered and summed in rank order, so every rank normalizes with the
same mean and variance (bitwise) and keeps the same running statistics; the
backward pass allgathers the per-channel sums of the gradient and of the
gradient times the normalized input the same way. Weight and bias gradients are
this rank's own (DistributedOptimizer averages them, as for any parameter). In
evaluation, or on one rank, it is torch's BatchNorm.
"""

import torch

import hpcdl
from hpcdl.horovod import common


def _summed_over_ranks(local, comm):
    """The sum over the ranks of each rank's 1-d float64 tensor, in rank order."""
    gathered = hpcdl.allgather(local.reshape(1, -1).numpy(), comm=comm)
    return torch.from_numpy(gathered.sum(axis=0))


class _SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, comm):
        channels = x.shape[1]
        dims = [0] + list(range(2, x.dim()))
        shape = [1, channels] + [1] * (x.dim() - 2)
        xd = x.detach().double()
        local = torch.cat(
            [xd.sum(dims), (xd * xd).sum(dims), torch.tensor([x.numel() / channels], dtype=torch.float64)]
        )
        stats = _summed_over_ranks(local, comm)
        total = float(stats[-1])
        mean = stats[:channels] / total
        var = (stats[channels : 2 * channels] / total - mean * mean).clamp_min(0)
        invstd = 1 / torch.sqrt(var + eps)
        if running_mean is not None:
            unbiased = var * total / max(total - 1, 1)
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1 - momentum).add_(unbiased.to(running_var.dtype), alpha=momentum)
        xhat = ((xd - mean.view(shape)) * invstd.view(shape)).to(x.dtype)
        ctx.save_for_backward(xhat, weight, invstd)
        ctx.total, ctx.comm, ctx.dims, ctx.shape = total, comm, dims, shape
        out = xhat
        if weight is not None:
            out = out * weight.view(shape) + bias.view(shape)
        return out

    @staticmethod
    def backward(ctx, grad_output):
        xhat, weight, invstd = ctx.saved_tensors
        dims, shape = ctx.dims, ctx.shape
        dy = grad_output.double()
        sum_dy = dy.sum(dims)
        sum_dy_xhat = (dy * xhat.double()).sum(dims)
        channels = sum_dy.numel()
        stats = _summed_over_ranks(torch.cat([sum_dy, sum_dy_xhat]), ctx.comm)
        mean_dy, mean_dy_xhat = stats[:channels] / ctx.total, stats[channels:] / ctx.total
        scale = invstd if weight is None else invstd * weight.detach().double()
        dx = scale.view(shape) * (dy - mean_dy.view(shape) - xhat.double() * mean_dy_xhat.view(shape))
        if weight is None:
            return dx.to(grad_output.dtype), None, None, None, None, None, None, None
        return (
            dx.to(grad_output.dtype),
            sum_dy_xhat.to(weight.dtype),
            sum_dy.to(weight.dtype),
            None,
            None,
            None,
            None,
            None,
        )


class SyncBatchNorm(torch.nn.modules.batchnorm._BatchNorm):
    """Batch normalization over the global batch of init()'s ranks (Horovod's
    hvd.SyncBatchNorm): inputs of shape (N, C, ...); momentum None keeps a
    cumulative average, as torch's BatchNorm does."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__(num_features, eps, momentum, affine, track_running_stats)

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input):
        self._check_input_dim(input)
        comm = common.comm()
        if not self.training or comm.Get_size() == 1:
            return super().forward(input)
        momentum = self.momentum
        if self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if momentum is None:
                momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFunction.apply(
            input, self.weight, self.bias, self.running_mean, self.running_var, self.eps, momentum or 0.0, comm
        )


__all__ = ["SyncBatchNorm"]
